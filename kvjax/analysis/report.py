"""Plain-text reports of the cost hook's figures: tables of theory | jaxpr | XLA |
measured and the attribution of compiled bytes. Formatting only: the figures come from
:mod:`kvjax.analysis.costs` (:class:`~kvjax.analysis.costs.StepCost`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvjax.analysis import theory

if TYPE_CHECKING:  # annotations only: costs imports this module
    from kvjax.analysis.costs import StepCost


def format_table(rows: list[tuple], headers: tuple) -> str:
    """Plain-text table with right-aligned numeric columns."""
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(str(h).rjust(w) for h, w in zip(headers, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def _fmt(x) -> str:
    if isinstance(x, float):
        if x != x:
            return "nan"
        if abs(x) >= 1e3:
            return f"{x:,.0f}"
        return f"{x:.3g}"
    if isinstance(x, (int, np.integer)):
        return f"{x:,}"
    return str(x)


# What each timed program's "measured" line includes (issue 32 item 17: two speeds on
# one screen must each say what they time), by StepCost.name ('loop': the generate
# loop's costs.analyze_loop, named 'generated token' or 'loop step (B tokens)').
MEASURED = {
    "loop": "timed inside the compiled loop: the call's fixed cost cancels",
    "decode_step": "one call of the separately compiled step from Python, dispatch "
                   "and return included",
    "prefill": "one call of the compiled prefill program",
}


def _program(step: StepCost) -> str:
    """'loop', 'decode_step', 'prefill' or the step's own name."""
    return "loop" if step.name.startswith(("generated token", "loop step")) else step.name


def cost_table(step: StepCost, measured_seconds: float | None = None) -> str:
    """Theory | jaxpr | XLA | ratio rows for FLOP and bytes (and measured time if given).

    The first rows are the counted, comparable figures: when native kernels run (custom
    calls XLA's cost analysis leaves out), 'FLOP (+kernels)' / 'bytes (+kernels)' (XLA's
    figure plus the kernels' FLOP from their shapes and their operand and result bytes)
    come first and XLA's own rows follow as 'FLOP (XLA ops only)' / 'bytes (XLA ops
    only)'; without kernels the rows are 'FLOP' and 'bytes'. The measured line says what
    the time includes (:data:`MEASURED`) and the rate it gives, and reads the counted
    bytes.

    The jaxpr column (when computed) counts dots only: their FLOP, and their operands'
    and outputs' bytes.
    """
    jf = step.jaxpr.flops if step.jaxpr else float("nan")
    jb = step.jaxpr.hbm_bytes if step.jaxpr else float("nan")
    kernel_flops = bool(step.xla.custom_calls and step.xla.uncosted_flops)
    kernel_bytes = bool(step.xla.custom_calls and step.xla.uncosted_bytes)
    xla_rows = [
        ("FLOP (XLA ops only)" if kernel_flops else "FLOP", step.theory_flops, jf,
         step.xla.flops, step.xla.raw_flops, step.flops_ratio),
        ("bytes (XLA ops only)" if kernel_bytes else "bytes", step.theory_bytes, jb,
         step.xla.bytes, step.xla.raw_bytes, step.bytes_ratio),
    ]
    rows = []
    counted_bytes = step.xla.bytes
    if kernel_flops:
        # the kernels' FLOP from their shapes (hlo_cost.kernel_flops: the native weight
        # products and decode attention), XLA's -1 otherwise
        plus = step.xla.flops + step.xla.uncosted_flops
        rows.append(("FLOP (+kernels)", step.theory_flops, float("nan"), plus,
                     step.xla.raw_flops + step.xla.uncosted_flops,
                     plus / step.theory_flops if step.theory_flops else float("nan")))
    if step.xla.custom_calls and step.xla.uncosted_bytes:
        # A custom call (a native kernel) is -1 to XLA's cost analysis: its operand +
        # result bytes (the buffers it reads and writes, as XLA's shapes give them) are
        # added here so the ratio is not read against a figure that leaves the kernel out.
        plus = step.xla.bytes + step.xla.uncosted_bytes
        rows.append(("bytes (+kernels)", step.theory_bytes, float("nan"), plus,
                     step.xla.raw_bytes + step.xla.uncosted_bytes,
                     plus / step.theory_bytes if step.theory_bytes else float("nan")))
        counted_bytes = plus
    rows += xla_rows
    text = format_table(rows, ("per " + step.name, "theory", "jaxpr (dots)",
                               "XLA (loop-corrected)", "XLA raw", "XLA/theory"))
    if measured_seconds:
        what = MEASURED.get(_program(step))
        rate = ""
        if _program(step) in ("loop", "decode_step"):
            rate = (f" = {step.batch / measured_seconds:,.1f} tokens/s"
                    + (f" (B = {step.batch})" if step.batch > 1 else ""))
        text += (f"\nmeasured: {measured_seconds * 1e3:.3f} ms per {step.name}{rate}"
                 + (f" ({what})" if what else "") + " -> "
                 f"{step.theory_bytes / measured_seconds / 1e9:.2f} GB/s of theory bytes, "
                 f"{counted_bytes / measured_seconds / 1e9:.2f} GB/s of "
                 + ("counted bytes (XLA + kernels)" if kernel_bytes else "XLA bytes"))
    widened = step.theory_parts.get("bytes_widened")
    if widened:
        text += (f"\ntheory as this backend runs it (weights read as float32 copies made "
                 f"once before the loop): {widened['total']:,.0f} bytes per "
                 f"{step.name}; XLA/that = {step.xla.bytes / widened['total']:.2f}")
    if not step.xla.complete:
        text += ("\nwarning: XLA's own figure is incomplete (custom calls "
                 f"{list(step.xla.custom_calls)}, >= {step.xla.uncosted_bytes:,.0f} bytes "
                 "uncosted, or loops of unknown trip count)"
                 + ("; the (+kernels) rows add the kernels' figures, the 'XLA ops only' "
                    "rows leave them out" if kernel_flops or kernel_bytes else ""))
    return text


def attribution_rows(step: StepCost) -> list[tuple[str, float, float]]:
    """(part, theory bytes, XLA bytes) for weights, kv_read, kv_write, kv_copies,
    weight_copies, other and the total; theory has no copies and no 'other'
    (activations, logits), so those rows are 0 there."""
    if step.attribution is None:
        raise ValueError("analyze the step with attribute=True")
    tb = step.theory_parts["bytes"]
    xb = step.attribution.bytes
    rows = [(part, float(tb.get(part, 0)), xb[part]) for part in
            ("weights", "kv_read", "kv_write", "kv_copies", "weight_copies", "other")]
    rows.append(("total", step.theory_bytes, step.attribution.total_bytes))
    return rows


def kv_tensor_rows(step: StepCost) -> list[tuple[str, float, float, float, float]]:
    """(cache tensor, theory read, XLA read, theory write, XLA write) bytes per step, one
    row per cache tensor ('k', 'v' and a quantized cache's 'k_scale', 'v_scale'; MLA
    'c_kv', 'k_rope', ...): the attribution's kv_read / kv_write split by tensor
    (:attr:`kvjax.analysis.hlo_cost.Attribution.kv_tensors`) beside theory's
    B·tokens_held(t)·(the tensor's bytes per token) read and B·(bytes per token) written
    (:func:`kvjax.analysis.theory.kv_tensor_bytes_per_token`; sinks re-scored at cache
    positions add key reads that theory keeps in kv_read only)."""
    if step.attribution is None:
        raise ValueError("analyze the step with attribute=True")
    per_token = theory.kv_tensor_bytes_per_token(step.cfg)
    held = theory.tokens_held(step.cfg, step.context)
    xla = step.attribution.kv_tensors
    names = list(per_token) + [n for n in xla if n not in per_token]
    return [(n, float(step.batch * held * per_token.get(n, 0)),
             xla.get(n, {}).get("read", 0.0), float(step.batch * per_token.get(n, 0)),
             xla.get(n, {}).get("write", 0.0)) for n in names]


def attribution_table(step: StepCost) -> str:
    """Compiled bytes of a step split by what they touch, each beside its theory term.

    Ops XLA cannot cost (custom calls: the native kernels on CPU, cuBLAS GEMMs on GPU)
    have their operand + output bytes (a lower bound) split into the same parts: the
    first figure column is then the counted one, 'counted (XLA + kernels)' with its
    ratio to theory, followed by XLA's own ('XLA ops only', which reads kv_read 0 when a
    native kernel reads the cache) and the kernels' ('uncosted (>=)').
    """
    a = step.attribution
    parts = attribution_rows(step)
    if a.num_uncosted_ops:
        unc = [a.uncosted.get(p, 0.0) for p, *_ in parts[:-1]] + [a.uncosted_bytes]
        rows = [(p, t, x + u, (x + u) / t if t else float("nan"), x, x / a.total_bytes, u)
                for (p, t, x), u in zip(parts, unc)]
        headers = (f"bytes of {step.name} @ t={step.context}", "theory",
                   "counted (XLA + kernels)", "counted/theory", "XLA ops only",
                   "share of XLA", "uncosted (>=)")
    else:
        rows = [(p, t, x, x / t if t else float("nan"), x / a.total_bytes)
                for p, t, x in parts]
        headers = (f"bytes of {step.name} @ t={step.context}", "theory", "XLA",
                   "XLA/theory", "share of XLA")
    text = format_table(rows, headers)
    if a.kv_tensors:
        kv_rows = kv_tensor_rows(step)
        text += "\n\n" + format_table(
            [r + (r[2] / r[1] if r[1] else float("nan"),) for r in kv_rows],
            ("KV bytes by cache tensor", "theory read", "XLA read", "theory write",
             "XLA write", "read XLA/theory"))
        unread = [r[0] for r in kv_rows if r[1] and not r[2]]
        if unread and a.num_uncosted_ops:
            text += (f"\nXLA read 0 for {', '.join(unread)}: read by a native kernel, "
                     "which XLA's cost analysis leaves out; the kernels' reads are in the "
                     f"kv_read row's 'uncosted (>=)' ({a.uncosted.get('kv_read', 0.0):,.0f} "
                     "bytes) and its counted figure")
    f = step.theory_parts["flops"]
    text += ("\nFLOP: XLA on the cache (attention) "
             f"{a.flops['kv']:,.0f} vs theory attn {f.get('attn', 0) + f.get('kv_rebuild', 0):,}; "
             f"on weights {a.flops['weights']:,.0f} vs theory proj+mlp+lm_head "
             f"{f.get('proj', 0) + f.get('mlp', 0) + f.get('lm_head', 0):,}; "
             f"other {a.flops['other']:,.0f}")
    if a.num_uncosted_ops:
        text += (f"\n{a.num_uncosted_ops} custom-call executions XLA cannot cost: "
                 f">= {a.uncosted_bytes:,.0f} bytes, FLOPs unknown, not in the XLA column")
    if step.once_per_call is not None:
        once = step.once_per_call
        parts = ", ".join(f"{k} {v:,.0f}" for k, v in once["parts"].items() if abs(v) >= 1)
        text += (f"\nonce per call, outside the loop body (not in the per-token rows): "
                 f"{once['bytes']:,.0f} bytes, {once['flops']:,.0f} FLOP"
                 + (f" ({parts})" if parts else ""))
    return text
