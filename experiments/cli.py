"""What every entry point shares: flags parsed with one-line errors, and ``--list_fields``.

``cli.run(main)`` replaces ``app.run(main)`` in every entry point under ``experiments/``.
Before absl parses anything it checks the command line against the flags the entry point
defines, its config flags (``--config`` from a config file, ``--eval``, ``--train``) and
its plain flags: a misspelt field (``--config.model.window_sise``), a field under the
wrong prefix (``--config.eval.corpus``), an unknown flag (``--contxts``) or a missing
config file fails with one line naming it and the closest valid names, exit status 2
(:data:`USAGE_EXIT`), before any weights load or anything compiles. ``--config=gqa``
names a file in ``configs/``. ``--list_fields`` prints every field (type, default,
description; see :mod:`kvjax.fields`) of the configs given, then the entry point's own
flags, and exits. Output into a closed pipe (``| head``) ends the run quietly with
:data:`BROKEN_PIPE_EXIT`, as command-line tools do (:func:`run`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
from typing import Any, Callable

from absl import app, flags
from ml_collections import config_flags

from kvjax import compilation_cache, fields
from kvjax.config import MODEL_FIELD_KINDS

_LIST_FIELDS = flags.DEFINE_bool(
    "list_fields", False,
    "Print every --config / --eval / --train field with its type, default and a one-line "
    "description, then exit (e.g. --config=configs/mla.py --list_fields).")

_COMPILATION_CACHE = flags.DEFINE_bool(
    "compilation_cache", True,
    "Keep compiled programs in JAX's persistent compilation cache under $KVJAX_CACHE/jax "
    "(default ~/.cache/kvjax/jax; $KVJAX_COMPILATION_CACHE names another folder, or 0 for "
    "none), so a second run loads them instead of compiling; false: compile everything.")

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"
USAGE_EXIT = 2
"""Exit status of a command line that cannot run (bad flag, field or value)."""
BROKEN_PIPE_EXIT = 141
"""Exit status when stdout's reader has gone (128 + SIGPIPE, as a shell reports ``head``'s
writer)."""
EVAL_HELP = ("Evaluation settings, set one by one: --eval.corpus=FILE|FOLDER, "
             "--eval.split=all|heldout, --eval.context=512, ... (--list_fields describes each).")
TRAIN_HELP = ("Uptraining settings, set one by one: --train.steps=50, --train.peak_lr=3e-4, "
              "... (--list_fields describes each).")


def config_help(what: str) -> str:
    """The help of a ``--config`` flag: what it is, and how to see and set its fields."""
    return (f"{what} A file in configs/ (or its name: --config=mqa); override any field "
            "with --config.FIELD=VALUE, e.g. --config.model.window_size=128; "
            "--list_fields lists every field with its type, default and meaning.")


# Config flags whose overrides failed when the flag was defined: name -> the error.
_DEFINE_ERRORS: dict[str, str] = {}


def _one_line(e: BaseException) -> str:
    lines = [l.strip() for l in str(e).replace("\\n", "\n").splitlines() if l.strip()]
    return " ".join(lines).strip("'\"") or type(e).__name__


def _define(define: Callable[..., Any], name: str, *args: Any, **kwargs: Any) -> Any:
    """Calls ``define(name, ...)`` (a config_flags DEFINE_*). ml_collections applies the
    overrides it finds in sys.argv while defining the flag and raises on a bad one; then
    the flag is defined without its overrides and :func:`parse_flags` names the bad one."""
    try:
        return define(name, *args, **kwargs)
    except Exception as e:  # AttributeError / KeyError / TypeError from ml_collections
        _DEFINE_ERRORS[name] = _one_line(e)
        argv = [a for a in sys.argv
                if not a.lstrip("-").startswith((f"{name}.", f"no{name}."))]
        return define(name, *args, sys_argv=argv, **kwargs)


def DEFINE_config_file(name: str, default: str, help_string: str, **kwargs: Any):  # noqa: N802
    """``config_flags.DEFINE_config_file`` whose bad overrides fail in one line."""
    return _define(config_flags.DEFINE_config_file, name, default, help_string, **kwargs)


def DEFINE_config_dict(name: str, config: Any, help_string: str = "", **kwargs: Any):  # noqa: N802
    """``config_flags.DEFINE_config_dict`` whose bad overrides fail in one line."""
    return _define(config_flags.DEFINE_config_dict, name, config, help_string, **kwargs)


class UsageError(ValueError):
    """A command line that cannot run; the message is one line."""


def config_names() -> list[str]:
    """The experiment configs shipped in configs/ (file stems, base excluded)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.py")
                  if p.stem not in ("__init__", "base"))


def resolve_config_path(name: str) -> str:
    """``configs/gqa.py``, ``gqa`` or any existing .py path -> a config file path.

    Raises:
      UsageError: no such file; the message lists the closest shipped configs.
    """
    p = pathlib.Path(name.split(":")[0])
    if p.is_file():
        return name
    stem = p.stem if p.suffix == ".py" else p.name
    if (CONFIG_DIR / f"{stem}.py").is_file() and p.suffix in ("", ".py") and len(p.parts) <= 2:
        return str(CONFIG_DIR / f"{stem}.py")
    near = fields.closest(stem, config_names()) or config_names()
    raise UsageError(f"config {name!r}: no such file; shipped configs: "
                     f"{', '.join(config_names())} (closest: {', '.join(near)})")


def _config_flags() -> dict[str, Any]:
    """Name -> flag for every ml_collections config flag the entry point defined."""
    out = {}
    for name, flag in flags.FLAGS._flags().items():  # noqa: SLF001 (absl has no public map)
        if isinstance(flag, config_flags.config_flags._ConfigFlag):  # noqa: SLF001
            out[name] = flag
    return out


def _flag_args(argv: list[str]) -> list[tuple[str, str | None]]:
    """(name, value or None) of each ``--name[=value]`` argument."""
    out = []
    for a in argv[1:]:
        if a == "--":
            break
        if a.startswith("--") or (a.startswith("-") and not a[1:2].isdigit()):
            body = a.lstrip("-")
            name, eq, value = body.partition("=")
            out.append((name, value if eq else None))
    return out


def load_configs(argv: list[str]) -> dict[str, Any]:
    """Flag name -> the ConfigDict it will hold once argv is parsed (overrides not
    applied): a config file's ``get_config()`` (the path in argv, else the default), or
    a config dict's default.

    Raises:
      UsageError: a config file that does not exist or does not load.
    """
    given = dict(_flag_args(argv))
    out = {}
    for name, flag in _config_flags().items():
        if isinstance(flag.parser, config_flags.config_flags.ConfigFileFlagParser):
            path = given.get(name)
            if path is None:
                out[name] = flag.default if flag.value is None else flag.value
                continue
            path = resolve_config_path(path)
            try:
                out[name] = flag.parser.parse(path)
            except Exception as e:  # a config file is user code: anything can fail in it
                last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                raise UsageError(f"--{name}={path}: cannot load it: {last}") from None
        else:
            out[name] = flag.value
    return out


def all_fields(configs: dict[str, Any]) -> list[fields.Field]:
    """Every field of every config flag, in flag order."""
    return [f for name, cd in configs.items() for f in fields.config_fields(name, cd)]


def _main_flags() -> list:
    """The flags the entry point's main module defined (absl keys them by ``sys.argv[0]``),
    config flags aside, in definition order."""
    main = sys.argv[0] if sys.argv else ""
    return [f for f in flags.FLAGS.flags_by_module_dict().get(main, [])
            if not isinstance(f, config_flags.config_flags._ConfigFlag)]  # noqa: SLF001


_FLAG_TYPES = {"string": "str", "comma separated list of strings": "list",
               "string enum": "enum"}


def flag_fields() -> list[fields.Field]:
    """The entry point's own flags as fields for ``--list_fields``: ``--name``, type,
    default and the flag's help (an enum's values appended when its help omits them)."""
    out = []
    for f in _main_flags():
        help_text = fields.one_line(f.help or "")
        values = getattr(f.parser, "enum_values", None)
        if values and not all(v in help_text for v in values):
            help_text = f"{help_text} (one of: {', '.join(values)})".strip()
        out.append(fields.Field("--" + f.name, _FLAG_TYPES.get(f.flag_type(), f.flag_type()),
                                f.default, help_text))
    return out


def check_overrides(argv: list[str], configs: dict[str, Any]) -> None:
    """Raises UsageError for the first ``--a.b.c=...`` argument that names no field and
    the first ``--name`` that names no flag.

    A dotted name is valid when its first component is a config flag and the rest a
    path through that flag's ConfigDict (a leaf, or ``no``-prefixed boolean leaf); a
    plain name when it is a defined flag (``no``-prefixed for a boolean) or named by
    ``--undefok``. Single-dash arguments are left to absl."""
    paths = [f.path for f in all_fields(configs)]
    valid = set(paths)
    hint = (f" (--list_fields lists all {len(paths)})" if paths else
            " (this entry point has no config fields; --list_fields lists its flags)")
    long_names = {a[2:].partition("=")[0] for a in argv[1:] if a.startswith("--")}
    undefok = {n for k, v in _flag_args(argv) if k == "undefok" and v for n in v.split(",")}
    for name, _ in _flag_args(argv):
        if name in flags.FLAGS or name in valid or name in undefok or name == "undefok":
            continue
        if name.startswith("no") and (name[2:] in valid or (
                name[2:] in flags.FLAGS and flags.FLAGS[name[2:]].boolean)):
            continue
        if "." in name:
            raise UsageError(fields.unknown_field_message(name, paths, hint))
        if name in long_names:
            own = [f.name for f in _main_flags()] + list(configs) + ["list_fields", "help"]
            near = fields.closest(name, own)
            raise UsageError(f"unknown flag --{name}" + (
                f"; did you mean {' or '.join('--' + c for c in near)}?" if near else "")
                + " (--list_fields lists every flag and field)")


def _resolve_config_args(argv: list[str]) -> list[str]:
    """argv with ``--config=gqa`` (any config-file flag) rewritten to the file's path."""
    files = [n for n, f in _config_flags().items()
             if isinstance(f.parser, config_flags.config_flags.ConfigFileFlagParser)]
    out = list(argv[:1])
    for a in argv[1:]:
        name, eq, value = a.lstrip("-").partition("=")
        if a.startswith("-") and eq and name in files:
            a = f"--{name}={resolve_config_path(value)}"
        out.append(a)
    return out


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing with one-line errors and ``--list_fields``; exits on error."""
    try:
        argv = sys.argv[:] = _resolve_config_args(argv)
        configs = load_configs(argv)
        check_overrides(argv, configs)
        if _DEFINE_ERRORS:
            name, err = next(iter(_DEFINE_ERRORS.items()))
            raise UsageError(f"--{name}: {err}")
        if any(n == "list_fields" and v in (None, "true", "True", "1")
               for n, v in _flag_args(argv)):
            groups = field_groups(argv, configs) + (_EXTRA_FIELDS() if _EXTRA_FIELDS else [])
            own = flag_fields()
            if own:
                groups.append((f"flags of python -m {_module_name(argv)}:", own))
            print(fields.format_fields(groups))
            sys.exit(0)
        try:
            return flags.FLAGS(argv)
        except flags.Error as e:
            raise UsageError(str(e).strip().splitlines()[0]) from None
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise UsageError(_one_line(e)) from None
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        print(f"usage: python -m {_module_name(argv)} --help | --list_fields",
              file=sys.stderr)
        sys.exit(USAGE_EXIT)


def field_groups(argv: list[str], configs: dict[str, Any]) -> list[tuple[str, list]]:
    """(header, fields) per config flag, paths written as typed (``--eval.context``)."""
    given = dict(_flag_args(argv))
    groups = []
    for name, cd in configs.items():
        flag = _config_flags()[name]
        if isinstance(flag.parser, config_flags.config_flags.ConfigFileFlagParser):
            src = given.get(name) or (flag.default_as_str or "").strip("'")
            header = f"--{name} fields (values from {src}; set one with --{name}.FIELD=VALUE):"
        else:
            header = f"--{name} fields (set one with --{name}.FIELD=VALUE):"
        rows = [dataclasses.replace(f, path="--" + f.path)
                for f in fields.config_fields(name, cd)]
        model = f"--{name}.model."
        if not any(f.path.startswith(model) for f in rows):
            groups.append((header, rows))
            continue
        # a run config: its own fields, then the model's by kind (config.MODEL_FIELD_KINDS)
        groups.append((header, [f for f in rows if not f.path.startswith(model)]))
        kinds = {n: k for k, names in MODEL_FIELD_KINDS.items() for n in names}
        for kind, what in (("architecture", "what a checkpoint states"),
                           ("lever", "the cache levers: bytes or math change"),
                           ("execution", "how this machine runs it: same tokens"),
                           ("label", "reports")):
            group = [f for f in rows if f.path.startswith(model)
                     and kinds.get(f.path[len(model):]) == kind]
            if group:
                groups.append((f"--{name}.model fields, {kind} ({what}):", group))
        rest = [f for f in rows if f.path.startswith(model) and f.path[len(model):] not in kinds]
        if rest:
            groups.append((f"--{name}.model fields, other:", rest))
    return groups


def check_output_file(path: str | None, flag: str) -> None:
    """Raises UsageError unless ``path`` (None: not asked for) can be written: its folder
    exists (or can be created) and is writable, and it is not a folder itself."""
    if path is None:
        return
    p = pathlib.Path(path).expanduser()
    if p.is_dir():
        raise UsageError(f"--{flag}={path}: is a folder; allowed: a file path")
    check_output_dir(str(p.parent), flag, what=f"the folder of --{flag}={path}")


def check_output_dir(path: str, flag: str, what: str | None = None) -> None:
    """Raises UsageError unless the folder ``path`` exists and is writable, or can be
    created (its nearest existing parent is a writable folder)."""
    import os  # noqa: PLC0415

    p = pathlib.Path(path).expanduser().absolute()
    q = p
    while not q.exists():
        q = q.parent
    what = what or f"--{flag}={path}"
    if not q.is_dir():
        raise UsageError(f"{what}: {q} is a file, not a folder")
    if not os.access(q, os.W_OK | os.X_OK):
        raise UsageError(f"{what}: {q} is not writable; allowed: a writable folder")


def write_json(path: str, obj: Any) -> None:
    """Writes ``obj`` as indented JSON to ``path``, creating its folder."""
    import json  # noqa: PLC0415

    p = pathlib.Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=2))


def _module_name(argv: list[str]) -> str:
    p = pathlib.Path(argv[0]) if argv else pathlib.Path("?")
    return f"{p.parent.name}.{p.stem}" if p.parent.name else p.stem


_EXTRA_FIELDS: Callable[[], list] | None = None


def _exit_on_broken_pipe() -> None:
    """Ends the process with :data:`BROKEN_PIPE_EXIT`, stdout pointed at /dev/null first
    (the interpreter's last flush then has nowhere to fail)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout closed or not a file
        pass
    sys.exit(BROKEN_PIPE_EXIT)


def run(main: Callable[[list[str]], int | None],
        extra_fields: Callable[[], list] | None = None) -> None:
    """``app.run(main)`` with :func:`parse_flags` as the flag parser; ``extra_fields``
    returns more (header, fields) groups for ``--list_fields``. Before ``main`` runs,
    JAX's persistent compilation cache is turned on (:mod:`kvjax.compilation_cache`;
    ``--compilation_cache=false`` turns it off).

    When stdout's reader has gone (``... | head`` closed the pipe), the BrokenPipeError of
    the next write or of the final flush ends the process quietly with
    :data:`BROKEN_PIPE_EXIT` (no traceback), wherever the output was printed."""
    global _EXTRA_FIELDS
    _EXTRA_FIELDS = extra_fields

    def with_cache(argv):  # after the flags are parsed, before anything compiles
        compilation_cache.enable(on=_COMPILATION_CACHE.value)
        return main(argv)

    try:
        try:
            app.run(with_cache, flags_parser=parse_flags)
        finally:
            if sys.stdout is not None:
                sys.stdout.flush()  # what is still buffered, while a broken pipe is catchable
    except BrokenPipeError:
        _exit_on_broken_pipe()
