"""Rotary frequencies: plain (Su et al. 2021) and the scaled ones checkpoints state.

A checkpoint's ``rope_scaling`` (config.json) becomes ``ModelConfig.rope_scaling``, a
hashable tuple of sorted ``(key, value)`` pairs (:func:`rope_scaling_pairs`), so the
config stays a static jit argument. :func:`inverse_frequencies` turns it into the H/2
inverse frequencies the rotation uses; they depend on config constants only, so they are
computed once in numpy (float64) when the program is traced.

Kinds (:data:`ROPE_SCALINGS`, the keys each needs):

* ``'llama3'``: Llama 3.1's frequency-dependent interpolation (Meta's reference
  ``apply_scaling`` in ``llama/model.py``; transformers' ``_compute_llama3_parameters``):
  wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` are
  kept, those longer than ``original / low_freq_factor`` divided by ``factor``, and the
  band between interpolated smoothly. The attention scale is unchanged.
* ``'linear'``: position interpolation (Chen et al. 2023, "Extending Context Window of
  Large Language Models via Positional Interpolation", eq. 4): every frequency divided
  by ``factor`` (Gemma 3's global layers).
* ``'yarn'``: YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large
  Language Models", sec. 3.2 "NTK-by-parts" and 3.4) as DeepSeek-V2 writes it
  (``DeepseekV2YarnRotaryEmbedding``): dimensions rotating more than ``beta_fast`` times
  over the original context keep their frequency, those rotating fewer than
  ``beta_slow`` times are divided by ``factor``, a linear ramp between; cos and sin are
  multiplied by mscale(factor, mscale) / mscale(factor, mscale_all_dim)
  (:func:`rotary_amplitude`), and DeepSeek's attention scale by
  mscale(factor, mscale_all_dim)^2 (:func:`softmax_factor`), with
  mscale(s, m) = 0.1·m·ln(s) + 1 for s > 1.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

# rope_type -> the keys (besides rope_type) the kind needs, each a positive number.
ROPE_SCALINGS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "linear": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
}
# Optional keys of a kind, with their defaults (DeepSeek-V2's modelling code).
ROPE_DEFAULTS = {"yarn": {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                          "mscale_all_dim": 0.0}}


def rope_scaling_pairs(scaling: Mapping[str, Any] | tuple | None) -> tuple | None:
    """``scaling`` (a dict as config.json states it, or already pairs) as the sorted
    tuple of ``(key, value)`` pairs ``ModelConfig.rope_scaling`` holds: ``rope_type``
    (HF's older spelling ``type`` accepted) and the kind's keys of :data:`ROPE_SCALINGS`
    (numbers as float, the original context as int); other keys are dropped. None, an
    empty dict or ``rope_type`` 'default' give None (plain rotary).

    Raises:
      ValueError: not a mapping, an unknown rope_type, or a kind's key missing or not
        a positive number (the message names it and what is allowed).
    """
    if scaling is None:
        return None
    d = dict(scaling)
    kind = d.get("rope_type", d.get("type"))
    if kind in (None, "default") and not set(d) - {"rope_type", "type", "rope_theta"}:
        return None
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"rope_scaling.rope_type={kind!r}; allowed: null, 'default' or one "
                         f"of {list(ROPE_SCALINGS)}")
    out = {"rope_type": kind}
    for key in ROPE_SCALINGS[kind]:
        v = d.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
                or not v > 0:
            raise ValueError(f"rope_scaling.{key}={v!r}; allowed: a positive number (the "
                             f"{kind!r} scaling needs {', '.join(ROPE_SCALINGS[kind])})")
        out[key] = int(v) if key.startswith("original_") else float(v)
    if kind == "yarn" and d.get("attention_factor") is not None:
        raise ValueError(f"rope_scaling.attention_factor={d['attention_factor']!r}; "
                         "allowed: null (the factor follows from mscale, mscale_all_dim)")
    for key, default in ROPE_DEFAULTS.get(kind, {}).items():
        v = d.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
                or v < 0:
            raise ValueError(f"rope_scaling.{key}={v!r}; allowed: a number >= 0")
        out[key] = float(v)
    if kind == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ValueError(f"rope_scaling.high_freq_factor={out['high_freq_factor']!r}; "
                         f"allowed: above low_freq_factor={out['low_freq_factor']!r}")
    return tuple(sorted(out.items()))


def inverse_frequencies(head_dim: int, theta: float, scaling: tuple | None = None
                        ) -> np.ndarray:
    """The rotation's inverse frequencies [H/2] float64: ``theta^(-2i/H)`` (Su et al.
    2021, eq. 15), then scaled as ``scaling`` (:func:`rope_scaling_pairs`) says.

    Raises:
      ValueError: as :func:`rope_scaling_pairs`.
    """
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    s = dict(rope_scaling_pairs(scaling) or ())
    if s.get("rope_type") == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        inv = np.where(wavelen < old / high, inv, np.where(wavelen > old / low,
                                                           inv / factor, mid))
    elif s.get("rope_type") == "linear":
        inv = inv / s["factor"]
    elif s.get("rope_type") == "yarn":
        low, high = _yarn_range(s["beta_fast"], s["beta_slow"], head_dim, theta,
                                s["original_max_position_embeddings"])
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(head_dim // 2) - low) / (high - low), 0, 1)
        keep = 1 - ramp  # 1: the original frequency (fast dims), 0: interpolated
        inv = inv / s["factor"] * (1 - keep) + inv * keep
    return inv


def _yarn_range(fast: float, slow: float, dim: int, theta: float, original: int):
    """(low, high) dimension indices of YaRN's ramp: the dims that rotate ``fast`` and
    ``slow`` times over the ``original`` context (DeepSeek's yarn_find_correction_range)."""
    def dim_of(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    return max(math.floor(dim_of(fast)), 0), min(math.ceil(dim_of(slow)), dim - 1)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude scale 0.1·mscale·ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rotary_amplitude(scaling: tuple | None) -> float:
    """The factor cos and sin are multiplied by: YaRN's mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) (mscale_all_dim 0 counts as 1 here, as DeepSeek's
    code computes it); 1.0 for the other kinds."""
    s = dict(scaling or ())
    if s.get("rope_type") != "yarn":
        return 1.0
    return yarn_mscale(s["factor"], s["mscale"]) / yarn_mscale(s["factor"],
                                                                s["mscale_all_dim"])


def softmax_factor(scaling: tuple | None) -> float:
    """The factor DeepSeek-V2 multiplies its attention scale by: mscale(factor,
    mscale_all_dim)^2 with a yarn scaling whose mscale_all_dim is set; else 1.0."""
    s = dict(scaling or ())
    if s.get("rope_type") != "yarn" or not s["mscale_all_dim"]:
        return 1.0
    return yarn_mscale(s["factor"], s["mscale_all_dim"]) ** 2
