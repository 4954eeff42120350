"""What every entry point shares: flags parsed with one-line errors, and ``--list_fields``.

``cli.run(main)`` replaces ``app.run(main)``. Before absl parses anything it checks the
command line against the config flags the entry point defines (``--config`` from a
config file, ``--eval``, ``--train``): a misspelt field (``--config.model.window_sise``),
a field under the wrong prefix (``--config.eval.corpus``) or a missing config file fails
with one line naming the field and the closest valid ones, exit status 2, before any
weights load. ``--list_fields`` prints every field (type, default, description; see
:mod:`kvjax.fields`) of the config given with ``--config`` and exits.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from typing import Any, Callable

from absl import app, flags
from ml_collections import config_flags

from kvjax import fields

_LIST_FIELDS = flags.DEFINE_bool(
    "list_fields", False,
    "Print every --config / --eval / --train field with its type, default and a one-line "
    "description, then exit (e.g. --config=configs/mla.py --list_fields).")

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"
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


def check_overrides(argv: list[str], configs: dict[str, Any]) -> None:
    """Raises UsageError for the first ``--a.b.c=...`` argument that names no field.

    A dotted name is valid when its first component is a config flag and the rest a
    path through that flag's ConfigDict (a leaf, or ``no``-prefixed boolean leaf)."""
    paths = [f.path for f in all_fields(configs)]
    valid = set(paths)
    hint = f" (--list_fields lists all {len(paths)})"
    for name, _ in _flag_args(argv):
        if "." not in name or name in valid or name in flags.FLAGS:
            continue
        if name.startswith("no") and name[2:] in valid:
            continue
        raise UsageError(fields.unknown_field_message(name, paths, hint))


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
        sys.exit(2)


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
        groups.append((header, [dataclasses.replace(f, path="--" + f.path)
                                for f in fields.config_fields(name, cd)]))
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


def run(main: Callable[[list[str]], int | None],
        extra_fields: Callable[[], list] | None = None) -> None:
    """``app.run(main)`` with :func:`parse_flags` as the flag parser; ``extra_fields``
    returns more (header, fields) groups for ``--list_fields``."""
    global _EXTRA_FIELDS
    _EXTRA_FIELDS = extra_fields
    app.run(main, flags_parser=parse_flags)
