"""The weight products of a decode step alone, per formulation: does batching amortise them?

Times SmolLM2-135M's float32 weight products of one decode step, nothing else: 30 layers
of q, k, v, o ([576, 576], [576, 192] x 2, [576, 576]), gate, up ([576, 1536]) and down
([1536, 576]) stored [in, out] as separate arrays (as the unrolled model holds them),
then the tied LM head [49152, 576] ([out, in]), on M rows (the batch), with each
``--impls`` formulation of ``model.weight_matmul`` forced for every product (no
planner), interleaved round by round (medians). Each layer's input depends on the last
layer's output, as in the model. Prints per formulation and M: milliseconds, GB/s of
weight read (538 MB per chain), GFLOP/s (2·M per weight element), and the time over
the first formulation's at the same M; then, with ``--head_only``, the LM head alone.
With ``--int8`` it times 'xla' and 'native' over the same weights in int8 too
(``weight_matmul.Int8Weight``: an int8 draft's, ``speculative.draft_weight_dtype``),
GB/s then of the int8 bytes and their scales.

  PYTHONPATH=. python scripts/weight_chain_bench.py --batch_sizes=1,4,16

Every figure names the CPU model and vector ISA; timings on a shared host are noisy:
read the ratios of one interleaved run, not the absolute times.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from kvjax import kernels, planner
from kvjax.models import weight_matmul
from kvjax.native import rows_matmul
from kvjax.plan import Plan

_BATCH = flags.DEFINE_list("batch_sizes", ["1", "4", "16"], "Rows M (the batch).")
_IMPLS = flags.DEFINE_list("impls", ["xla", "native", "native_ksplit", "native_lanes"],
                           "model.weight_matmul formulations to time (not 'auto').")
_ROUNDS = flags.DEFINE_integer("rounds", 9, "Interleaved rounds.")
_LAYERS = flags.DEFINE_integer("layers", 30, "Layers of the chain (SmolLM2: 30).")
_HEAD_ONLY = flags.DEFINE_bool("head_only", False, "Time the LM head alone.")
_INT8 = flags.DEFINE_bool("int8", False, "Also time 'xla' and 'native' over int8 weights.")

D, F, KV, VOCAB = 576, 1536, 192, 49152


def chain(impl: str, layers: int, head_only: bool):
    # the plan a resolved config would carry: the kernel where it loads, else 'xla'
    plan = Plan(native=("rows_matmul",) if impl != "xla" and rows_matmul.load() else ())

    def prod(x, w, eqn):
        return weight_matmul.einsum(eqn, x, w, impl, plan)

    def run(x, ws, head):
        h = x
        if not head_only:
            for q, k, v, o, g, u, d in ws[:layers]:
                a = (prod(h, q, "MD,DN->MN")
                     + jnp.tile(prod(h, k, "MD,DN->MN") + prod(h, v, "MD,DN->MN"), 3))
                h = h + prod(a, o, "MD,DN->MN")
                m = jax.nn.silu(prod(h, g, "MD,DF->MF")) * prod(h, u, "MD,DF->MF")
                h = h + 0.01 * prod(m, d, "MF,FD->MD")
        return prod(h, head, "MD,VD->MV")
    return run


def main(argv):
    del argv
    try:
        batches = [int(b) for b in _BATCH.value]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1 or max(batches) > rows_matmul.MAX_ROWS:
        raise app.UsageError(f"--batch_sizes={','.join(_BATCH.value)}; allowed: integers "
                             f"1..{rows_matmul.MAX_ROWS} (the kernel's rows; XLA above)")
    impls = _IMPLS.value
    if not impls:
        raise app.UsageError("--impls is empty; allowed: a list of "
                             f"{', '.join(i for i in kernels.names('weight_matmul') if i != 'auto')}")
    if _ROUNDS.value < 1:
        raise app.UsageError(f"--rounds={_ROUNDS.value}; allowed: >= 1")
    for impl in impls:
        if impl not in kernels.names("weight_matmul") or impl == "auto":
            raise app.UsageError(f"--impls contains {impl!r}; allowed: "
                                 f"{', '.join(i for i in kernels.names('weight_matmul') if i != 'auto')}")
    if not 0 <= _LAYERS.value <= 30:
        raise app.UsageError(f"--layers={_LAYERS.value}; allowed: 0..30")
    layers = 0 if _HEAD_ONLY.value else _LAYERS.value
    model_name, isa = planner._cpu()  # noqa: SLF001
    print(f"machine: {model_name} ({', '.join(isa)}; the kernel on "
          f"{planner.native.num_threads()} threads), jax {jax.__version__}")
    rng = np.random.default_rng(0)
    shapes = [(D, D), (D, KV), (D, KV), (D, D), (D, F), (D, F), (F, D)]
    ws = tuple(tuple(jnp.asarray(0.02 * rng.standard_normal(s, dtype=np.float32))
                     for s in shapes) for _ in range(layers))
    head = jnp.asarray(0.02 * rng.standard_normal((VOCAB, D), dtype=np.float32))
    elems = layers * sum(a * b for a, b in shapes) + VOCAB * D
    weights = {False: (ws, head)}
    if _INT8.value:  # the int8 draft's layout: a scale per output column / vocabulary row
        weights[True] = (tuple(tuple(weight_matmul.quantize_int8(w, (-1,)) for w in layer)
                               for layer in ws), weight_matmul.quantize_int8(head, (0,)))
    nbytes = {i8: weight_matmul.weight_bytes(w) for i8, w in weights.items()}
    variants = [(impl, False) for impl in impls] + [
        (impl, True) for impl in impls if _INT8.value and impl in ("xla", "native")]
    fns, times, ref = {}, {}, {}
    for m in batches:
        x = jnp.asarray(rng.standard_normal((m, D), dtype=np.float32))
        for impl, i8 in variants:
            w, h = weights[i8]
            f = jax.jit(chain(impl, layers, _HEAD_ONLY.value)).lower(x, w, h).compile()
            y = np.asarray(f(x, w, h))
            if (m, i8) in ref:  # every formulation computes the same product
                np.testing.assert_allclose(y, ref[m, i8], rtol=2e-3,
                                           atol=2e-3 * np.abs(ref[m, i8]).max())
            ref.setdefault((m, i8), y)
            fns[impl, i8, m] = (f, x, w, h)
            times[impl, i8, m] = []
    for _ in range(_ROUNDS.value):
        for key, (f, x, w, h) in fns.items():
            start = time.perf_counter()
            f(x, w, h).block_until_ready()
            times[key].append(time.perf_counter() - start)
    what = ("the LM head alone" if _HEAD_ONLY.value
            else f"{layers} layer{'' if layers == 1 else 's'} + the LM head")
    print(f"\nSmolLM2-135M float32 weight products, {what} ({4 * elems / 1e6:.0f} MB), "
          f"medians of {_ROUNDS.value} interleaved rounds")
    print(f"{'impl':>14} {'M':>3} {'ms':>8} {'GB/s':>6} {'GFLOP/s':>8} "
          f"{'x ' + impls[0]:>12}")
    for m in batches:
        base = statistics.median(times[impls[0], False, m])
        for impl, i8 in variants:
            t = statistics.median(times[impl, i8, m])
            name = impl + ("+int8" if i8 else "")
            print(f"{name:>14} {m:>3} {t * 1e3:8.2f} {nbytes[i8] / t / 1e9:6.1f} "
                  f"{2 * m * elems / t / 1e9:8.1f} {t / base:12.2f}")


if __name__ == "__main__":
    app.run(main)
