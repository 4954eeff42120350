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
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

# rope_type -> the keys (besides rope_type) the kind needs, each a positive number.
ROPE_SCALINGS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
}


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
    return inv
