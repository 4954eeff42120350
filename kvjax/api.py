"""The main job from Python (a notebook): load a model, decode a prompt, get the text and
its cost report (theory | compiled | measured) as data.

    import kvjax.api as kv
    model = kv.load("gqa")                      # configs/gqa.py: SmolLM2, GQA, float32
    result = model.decode("What is the capital of France?")
    result.text                                 # 'The capital of France is Paris.'
    result.costs                                # a table: one row per program and context
    result.costs.rows[0]["theory_bytes"]        # the same figures as dicts
    result.costs.kv_share                       # {context: the KV share of a step's bytes}

``load`` takes a config name in ``configs/`` (or a config file, a ConfigDict or a dict)
and any field as a keyword, nested ones as dicts: ``kv.load("gqa", max_seq_len=512,
model=dict(kv_dtype="int8"))``; ``decode`` takes the run's fields the same way
(``max_new_tokens=16``, ``chat_template=False``, ``sampling=dict(temperature=0.8)``),
except the model's, which need a new ``load``. Everything is checked as on the command
line (a ConfigError names the field). Costs are those of ``experiments.decode``
(:func:`kvjax.inference.runner.cost_report`): the generate loop and the single step at
the run's context, the step at the long context beside the config's lever baseline, and
the prefill; ``decode(..., costs=False)`` skips them, ``long_context=False`` skips the
long context. JAX's persistent compilation cache is turned on at the first ``load``
(:mod:`kvjax.compilation_cache`; ``compilation_cache_on=False`` leaves it off).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import pathlib
from typing import Any, Mapping

from ml_collections import config_dict

from kvjax import compilation_cache, naming
from kvjax.analysis import report
from kvjax.config import ConfigError, RunConfig, run_config_from_dict
from kvjax.inference import runner

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"
"""The repository's ``configs/`` folder (config names resolve there)."""


def config(name: str | pathlib.Path) -> config_dict.ConfigDict:
    """The ``get_config()`` of ``configs/<name>.py`` or of the file ``name``.

    Raises:
      ConfigError: no such config, naming the ones there are.
    """
    path = pathlib.Path(name)
    if path.suffix != ".py":
        path = CONFIG_DIR / f"{name}.py"
    if not path.is_file():
        names = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if not p.stem.startswith("_")
                       and p.stem != "base")
        raise ConfigError(f"invalid config: {name!r} is no config file; allowed: a .py "
                          f"file with get_config(), or one of {names}")
    spec = importlib.util.spec_from_file_location(f"kvjax_config_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def _apply(d: config_dict.ConfigDict, fields: Mapping[str, Any], where: str = "") -> None:
    """Sets ``fields`` on ``d``, a nested mapping into a nested ConfigDict."""
    for k, v in fields.items():
        if k not in d:
            raise ConfigError(f"invalid config: {where}{k}={v!r}: no such field; allowed: "
                              f"{sorted(d.keys())}")
        if isinstance(v, Mapping) and isinstance(d[k], config_dict.ConfigDict):
            _apply(d[k], v, f"{where}{k}.")
        else:
            d[k] = v


@dataclasses.dataclass
class Costs:
    """A run's cost report as data: ``rows``, one dict per program and context, with
    keys program, context, theory_bytes, compiled_bytes (XLA + the native kernels'
    operand bytes), compiled_over_theory, theory_flops, compiled_flops, measured_s (per
    token or per call, see ``what``), theory_bytes_per_s, kv_share (theory's share of the
    KV cache in the bytes), what (how the time was measured). ``report`` is the
    :class:`kvjax.inference.runner.CostReport` they come from."""

    rows: list
    report: runner.CostReport = dataclasses.field(repr=False)

    @property
    def kv_share(self) -> dict:
        """{context: theory's KV share of a decode step's bytes} at each context costed."""
        return {r["context"]: r["kv_share"] for r in self.rows
                if r["program"] == "decode step"}

    def __getitem__(self, program: str) -> dict:
        """The first row whose program is ``program`` ('generate loop', 'decode step',
        'prefill', or a baseline's name)."""
        for r in self.rows:
            if r["program"] == program:
                return r
        raise KeyError(f"{program!r}; allowed: {[r['program'] for r in self.rows]}")

    def __repr__(self) -> str:
        def ms(x):
            return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else x * 1e3
        return report.format_table(
            [(r["program"], r["context"], r["theory_bytes"], r["compiled_bytes"],
              r["compiled_over_theory"], ms(r["measured_s"]), r["kv_share"])
             for r in self.rows],
            ("program", "context t", "theory bytes", "compiled bytes", "compiled/theory",
             "measured ms", "KV share"))


def _row(program: str, step, seconds: float | None, what: str) -> dict:
    counted = step.xla.bytes + step.xla.uncosted_bytes
    parts = step.theory_parts["bytes"]
    has_kv = all(k in parts for k in ("weights", "kv_read", "kv_write"))
    return {"program": program, "context": step.context, "theory_bytes": step.theory_bytes,
            "compiled_bytes": counted, "compiled_over_theory": counted / step.theory_bytes,
            "theory_flops": step.theory_flops,
            "compiled_flops": step.xla.flops + step.xla.uncosted_flops,
            "measured_s": seconds,
            "theory_bytes_per_s": step.theory_bytes / seconds if seconds else None,
            "kv_share": runner.kv_share(parts) if has_kv else None, "what": what}


def costs_of(c: runner.CostReport) -> Costs:
    """:class:`Costs` of a one-device :class:`kvjax.inference.runner.CostReport`."""
    if c.per_device:
        raise ValueError("a run on a mesh: its figures are per device; read the "
                         "CostReport itself (result.costs.report)")
    rows = [_row("generate loop", c.loop, c.loop_seconds_per_token,
                 "per token, inside the compiled loop"),
            _row("decode step", c.step, c.step_seconds_median, "one call from Python")]
    lc = c.long_context
    if lc is not None:
        rows.append(_row("decode step", lc.this.step, lc.this.seconds,
                         "one call from Python, at the long context"))
        if lc.baseline is not None:
            rows.append(_row(lc.baseline_name, lc.baseline.step, lc.baseline.seconds,
                             f"the lever's baseline ({lc.lever})"))
    prefill = _row("prefill", c.prefill, None, "one call of the prefill program")
    prefill["context"] = c.prefill.context
    rows.append(prefill)
    return Costs(rows, c)


@dataclasses.dataclass
class Result:
    """One decoded prompt: ``text`` (row 0's), ``generation`` (the
    :class:`kvjax.inference.runner.Generation`: ids, times, cache bytes) and ``costs``
    (:class:`Costs`, None with ``costs=False``)."""

    text: str
    generation: runner.Generation = dataclasses.field(repr=False)
    costs: Costs | None = None

    def __repr__(self) -> str:
        g = self.generation
        head = (f"Result(text={self.text!r}, prompt_tokens={g.prompt_tokens}, "
                f"new_tokens={g.new_tokens}, stop={g.stop_reason!r}, decode "
                f"{g.decode_tokens_per_s:,.1f} tokens/s, compile {g.compile_seconds:.1f} s)")
        return head if self.costs is None else f"{head}\n{self.costs!r}"


@dataclasses.dataclass
class Model:
    """A loaded model (:func:`load`): ``run`` (the validated RunConfig), ``loaded``
    (weights and tokenizer, :class:`kvjax.inference.runner.LoadedModel`)."""

    run: RunConfig
    loaded: runner.LoadedModel = dataclasses.field(repr=False)
    _config: config_dict.ConfigDict = dataclasses.field(repr=False, default=None)

    def __repr__(self) -> str:
        c = self.run.model
        return (f"Model({naming.variant_name(c)}, weights={self.run.weights!r}, "
                f"N={c.num_heads} K={c.num_kv_heads} L={c.num_layers} D={c.d_model}, "
                f"max_seq_len={self.run.max_seq_len})")

    def decode(self, prompt: str | None = None, *, costs: bool = True,
               long_context: bool = True, **fields) -> Result:
        """Decodes ``prompt`` (None: the config's) greedily or as ``sampling`` says, and
        with ``costs`` runs the cost report. ``fields``: run fields (not the model's).

        Raises:
          ConfigError: a bad field, a model field, or a prompt that does not fit.
        """
        if "model" in fields or "weights" in fields or "weights_path" in fields:
            raise ConfigError("invalid config: the model's fields are fixed once loaded; "
                              "allowed: load(...) again with them")
        d = copy.deepcopy(self._config)
        _apply(d, fields)
        if prompt is not None:
            d.prompt = prompt
        if not long_context:
            d.cost_context = d.max_seq_len
        run = run_config_from_dict(d)
        gen = runner.generate(run, self.loaded)
        report_ = runner.cost_report(run, self.loaded, gen) if costs else None
        return Result(gen.generated_text, gen, None if report_ is None else costs_of(report_))


def load(config_name: str | pathlib.Path | Mapping = "gqa", *, progress: bool = True,
         compilation_cache_on: bool = True, **fields) -> Model:
    """Loads the weights and tokenizer of a config (:func:`config`'s names and files, a
    ConfigDict or a dict) with ``fields`` set on it, after checking them.

    Raises:
      ConfigError: a bad config or field (naming it).
      kvjax.checkpoints.WeightsError: weights unreachable or corrupt.
    """
    if compilation_cache_on and compilation_cache.current() is None:
        compilation_cache.enable()
    if isinstance(config_name, Mapping) and not isinstance(config_name,
                                                          config_dict.ConfigDict):
        d = config_dict.ConfigDict(dict(config_name))
    elif isinstance(config_name, config_dict.ConfigDict):
        d = copy.deepcopy(config_name)
    else:
        d = config(config_name)
    _apply(d, fields)
    run = run_config_from_dict(d)
    return Model(run, runner.load(run, progress=progress), d)
