"""Theory of speculative decoding, in the blog's terms: bytes and FLOPs per step, a
roofline time per step, and the speedup over plain decoding.

A plain decode step at context t moves B_step(t) = weights + KV(t) bytes (blog, "The
Fundamental Equation of Inference Throughput") and does F_step(t) FLOPs; its time is the
roofline max(B / bandwidth, F / peak) (blog, "Why Memory Bandwidth Is the Right Metric").
A verify step scores k + 1 positions in one forward over the same cache: it reads the
weights and the cache once (the chunk attends to the cached keys once per query, which the
formula counts as one read, as a fused kernel does), writes k + 1 positions, and does the
FLOPs of k + 1 steps. With acceptance rate a (each draft accepted independently with
probability a), a round emits E(a, k) = (1 - a^(k+1)) / (1 - a) tokens on average
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
eq. 1). A round costs T_verify + k·T_draft, so

    speedup(t, k, a) = E(a, k) · T_step(t) / (T_verify(t, k) + k · T_draft(t))

(Leviathan et al., Theorem 3.8 with c = T_draft / T_step, here with each time from the
roofline). A draft over a window of W tokens reads weights + KV(min(t, W)): constant in t,
so past the crossover t* = 6·D (the blog's, where the KV read equals the weights) the
target's step keeps growing and the draft's does not: the speedup grows with t. A draft
that copies its window from the target's cache each round (MagicDec's draft,
``draft_kv_source='target'``) adds the copy to the round: it reads and writes the copied
slots once, T_copy = 2·B·slots·kv_bytes_per_token / bandwidth.

Each time is the roofline max(bytes / bandwidth, FLOP / peak) (the reads and the
arithmetic overlap), or with ``overlap=False`` their sum (the serial model of
:func:`kvjax.analysis.theory.batched_steps`: neither hides the other, the roofline's
upper bound). With the peak unknown both are the memory term, the blog's. The verify
step does k + 1 times a plain step's FLOPs (~1 FLOP/byte) over the same bytes: the
roofline keeps it at one plain step's cost until (k + 1) FLOP/byte reaches the ridge
(peak / bandwidth; a 2-core CPU: ~7-20, a GPU: hundreds), while the serial model charges
every one of its FLOPs, which is what a CPU whose cores add their arithmetic to their
reads pays.
"""

from __future__ import annotations

import dataclasses

from kvjax.analysis import theory
from kvjax.config import ModelConfig

__all__ = ["expected_tokens", "verify_bytes", "verify_flops", "draft_bytes", "draft_flops",
           "window_copy_bytes", "RoundTimes", "round_times", "predicted_speedup",
           "crossover_context", "best_k", "acceptance_from_tokens_per_step"]


def expected_tokens(a: float, k: int) -> float:
    """E(a, k) = (1 - a^(k+1)) / (1 - a): expected tokens a verify step emits (Leviathan
    et al. 2023, eq. 1); k + 1 at a = 1, 1 at a = 0.

    Raises:
      ValueError: a outside [0, 1] or k < 0.
    """
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance rate a={a}; allowed: a number in [0, 1]")
    if k < 0:
        raise ValueError(f"k={k}; allowed: an integer >= 0")
    if a == 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def acceptance_from_tokens_per_step(tokens_per_step: float, k: int) -> float:
    """The a for which E(a, k) equals a measured tokens-per-step (bisection; E is
    increasing in a). Raises ValueError outside [1, k + 1]."""
    if not 1.0 <= tokens_per_step <= k + 1:
        raise ValueError(f"tokens_per_step={tokens_per_step}; allowed: 1 to k + 1 = {k + 1}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < tokens_per_step else (lo, mid)
    return (lo + hi) / 2


def verify_bytes(cfg: ModelConfig, t: int, k: int, batch: int = 1) -> theory.StepBytes:
    """Bytes of one verify step at context t: the weights once, the cache of t tokens once
    (B·KV(t)) and k + 1 positions written (B·(k+1)·kv_bytes_per_token)."""
    plain = theory.step_bytes(cfg, t, batch)
    return dataclasses.replace(plain, kv_write=(k + 1) * plain.kv_write)


def verify_flops(cfg: ModelConfig, t: int, k: int, batch: int = 1) -> int:
    """FLOPs of one verify step: k + 1 decode steps at contexts t + 1 .. t + k + 1 (query j
    attends to the t cached keys and the j + 1 chunk keys up to itself)."""
    return sum(theory.step_flops(cfg, t + j + 1, batch).total for j in range(k + 1))


def draft_bytes(draft_cfg: ModelConfig | None, t: int, batch: int = 1,
                weights: int | None = None) -> int:
    """Bytes of one draft step: a decode step of the draft model at context t (a window
    caps its keys at W: constant in t); 0 for the n-gram drafter (``draft_cfg`` None).
    ``weights``: the draft's weight bytes per step where they are not its config's dtype
    (an int8 draft: :func:`kvjax.models.weight_matmul.weight_bytes` of its parameters);
    None: :func:`kvjax.analysis.theory.weight_bytes_per_step`."""
    return 0 if draft_cfg is None else theory.step_bytes(draft_cfg, t, batch,
                                                         weights=weights).total


def draft_flops(draft_cfg: ModelConfig | None, t: int, batch: int = 1) -> int:
    """FLOPs of one draft step (0 for the n-gram drafter)."""
    return 0 if draft_cfg is None else theory.step_flops(draft_cfg, t, batch).total


def window_copy_bytes(draft_cfg: ModelConfig | None, slots: int, batch: int = 1) -> int:
    """Bytes of the copy a draft with ``draft_kv_source='target'`` makes each round:
    ``slots`` slots per row (``kvjax.inference.speculative.draft_window``'s ring: W plus
    k + 1 spare) read from the target's cache and written into the draft's ring,
    2·B·slots·kv_bytes_per_token (bytes; the positions' int32 too are left out). 0 for
    ``slots`` 0 or no draft.

    Raises:
      ValueError: ``slots`` or ``batch`` negative.
    """
    if slots < 0 or batch < 0:
        raise ValueError(f"slots={slots}, batch={batch}; allowed: integers >= 0")
    if draft_cfg is None or not slots:
        return 0
    return 2 * batch * slots * theory.kv_bytes_per_token(draft_cfg)


def _time(num_bytes: float, flops: float, bytes_per_s: float,
          flops_per_s: float | None, overlap: bool = True) -> float:
    """Seconds of a step: max(bytes / bandwidth, FLOP / peak) with ``overlap`` (the
    roofline), their sum without (serial); the memory term only when the peak is
    unknown."""
    mem = num_bytes / bytes_per_s
    if not flops_per_s:
        return mem
    comp = flops / flops_per_s
    return max(mem, comp) if overlap else mem + comp


@dataclasses.dataclass(frozen=True)
class RoundTimes:
    """Seconds of one plain step, one verify step, one draft step and the round's window
    copy (0 without one), and the bytes behind them, at one (t, k, batch)."""

    plain_s: float
    verify_s: float
    draft_s: float
    plain_bytes: int
    verify_bytes: int
    draft_bytes: int
    k: int
    copy_s: float = 0.0
    copy_bytes: int = 0

    @property
    def round_s(self) -> float:
        """T_verify + k·T_draft + T_copy."""
        return self.verify_s + self.k * self.draft_s + self.copy_s

    def bytes_per_emitted_token(self, a: float) -> float:
        """Bytes a round moves per token it emits on average:
        (verify + k·draft + copy) / E(a, k)."""
        return (self.verify_bytes + self.k * self.draft_bytes + self.copy_bytes) \
            / expected_tokens(a, self.k)


def round_times(cfg: ModelConfig, t: int, k: int, bytes_per_s: float,
                flops_per_s: float | None = None, draft_cfg: ModelConfig | None = None,
                batch: int = 1, copy_slots: int = 0, overlap: bool = True,
                draft_weights: int | None = None) -> RoundTimes:
    """Times of a plain step, a verify step, a draft step and the window copy at
    context t (module docstring).

    Args:
      cfg: the target. t: context (tokens cached). k: drafts per step.
      bytes_per_s: memory bandwidth (bytes/s; e.g. measured by the cost hook).
      flops_per_s: peak FLOP/s (None: memory term only).
      draft_cfg: the draft model (None: the n-gram drafter, free in this model).
      batch: B.
      copy_slots: slots per row a draft over the target's window copies each round
        (:func:`window_copy_bytes`; 0: none).
      overlap: True: each step the roofline max(memory, compute); False: their sum.
      draft_weights: the draft's weight bytes per step (None: its config's dtype;
        :func:`draft_bytes`).
    """
    pb = theory.step_bytes(cfg, t, batch).total
    pf = theory.step_flops(cfg, t + 1, batch).total
    vb = verify_bytes(cfg, t, k, batch).total
    vf = verify_flops(cfg, t, k, batch)
    db = draft_bytes(draft_cfg, t, batch, draft_weights)
    df = draft_flops(draft_cfg, t, batch)
    cb = window_copy_bytes(draft_cfg, copy_slots, batch)
    return RoundTimes(plain_s=_time(pb, pf, bytes_per_s, flops_per_s, overlap),
                      verify_s=_time(vb, vf, bytes_per_s, flops_per_s, overlap),
                      draft_s=_time(db, df, bytes_per_s, flops_per_s, overlap) if db else 0.0,
                      plain_bytes=pb, verify_bytes=vb, draft_bytes=db, k=k,
                      copy_s=cb / bytes_per_s, copy_bytes=cb)


def predicted_speedup(cfg: ModelConfig, t: int, k: int, a: float, bytes_per_s: float,
                      flops_per_s: float | None = None,
                      draft_cfg: ModelConfig | None = None, batch: int = 1) -> float:
    """E(a, k)·T_step(t) / (T_verify(t, k) + k·T_draft(t)): the speedup of speculative
    over plain decoding at context t (module docstring; Leviathan et al. 2023,
    Theorem 3.8 with roofline times)."""
    r = round_times(cfg, t, k, bytes_per_s, flops_per_s, draft_cfg, batch)
    return expected_tokens(a, k) * r.plain_s / r.round_s


def crossover_context(cfg: ModelConfig, k: int, a: float, bytes_per_s: float,
                      flops_per_s: float | None = None,
                      draft_cfg: ModelConfig | None = None, batch: int = 1,
                      max_t: int = 1 << 24) -> int | None:
    """The smallest context t at which speculative decoding is predicted to beat plain
    decoding (speedup >= 1), by bisection over t in [1, max_t] (the speedup grows with t
    for a window draft); 1 if it already does at t = 1, None if not before max_t."""
    def wins(t):
        return predicted_speedup(cfg, t, k, a, bytes_per_s, flops_per_s, draft_cfg,
                                 batch) >= 1.0
    if wins(1):
        return 1
    if not wins(max_t):
        return None
    lo, hi = 1, max_t
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if wins(mid) else (mid, hi)
    return hi


def best_k(cfg: ModelConfig, t: int, a: float, bytes_per_s: float,
           flops_per_s: float | None = None, draft_cfg: ModelConfig | None = None,
           batch: int = 1, k_max: int = 16) -> tuple[int, float]:
    """(k, predicted speedup) maximising the speedup over k = 1..k_max at context t."""
    best = max(range(1, k_max + 1), key=lambda k: predicted_speedup(
        cfg, t, k, a, bytes_per_s, flops_per_s, draft_cfg, batch))
    return best, predicted_speedup(cfg, t, best, a, bytes_per_s, flops_per_s, draft_cfg,
                                   batch)
