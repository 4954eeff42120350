"""What one runtime's decode step costs the other's next step: kvjax and llama.cpp in turn.

Times SmolLM2-135M GQA float32 decode steps at one context, in one process, round by
round: kvjax's step right after its own step, right after a llama.cpp f32 step (the
float32 copy of the published GGUF, float32 KV cache: ``experiments.peers``), and after
a llama.cpp step and a pause of each ``--pauses_ms``; llama.cpp's step after its own and
after kvjax's. A step that follows the other runtime's pays for whatever that runtime
left running (its pool threads polling for the next job) -- the reason the benchmark's
llama.cpp rows time back-to-back steps (docs/decisions/0050-peer-rounds-time-back-to-back-steps.md).

  PYTHONPATH=. python scripts/peer_interference.py --step_contexts=1024,4096 --rounds=15

Prints the median milliseconds of each case and its ratio to the step after its own
runtime's step. Needs llama-cpp-python (``pip install llama-cpp-python``). Every figure
names the CPU model and vector ISA; read the ratios of one run on a shared host.
"""

from __future__ import annotations

import statistics
import time

from absl import app, flags

from experiments import bench, peers
from kvjax import checkpoints, native

_CONTEXTS = flags.DEFINE_list("step_contexts", ["1024"],
                               "Cache lengths (tokens), each <= 8192.")
_ROUNDS = flags.DEFINE_integer("rounds", 15, "Rounds (one timed step of each case a round).",
                               lower_bound=1)
_PAUSES = flags.DEFINE_list("pauses_ms", ["1", "10", "100"],
                            "Pauses (ms) after a llama.cpp step before kvjax's.")


def cases(kv, ll, pauses_ms) -> dict:
    """{case: a function that sets the case up (untimed) and returns the timed step's
    seconds}, for kvjax's step ``kv`` and llama.cpp's ``ll`` (each a function that runs
    one step and returns its seconds)."""
    def after(first, then, pause_s=0.0):
        def run():
            first()
            if pause_s:
                time.sleep(pause_s)
            return then()
        return run
    out = {"kvjax after kvjax": after(kv, kv), "kvjax after llama.cpp": after(ll, kv)}
    for ms in pauses_ms:
        out[f"kvjax after llama.cpp + {ms:g} ms"] = after(ll, kv, ms / 1e3)
    out["llama.cpp after llama.cpp"] = after(ll, ll)
    out["llama.cpp after kvjax"] = after(kv, ll)
    return out


def main(argv):
    del argv
    contexts = [int(c) for c in _CONTEXTS.value]
    pauses = [float(p) for p in _PAUSES.value]
    if any(not 0 < t <= 8192 for t in contexts) or any(p < 0 for p in pauses):
        raise app.UsageError(f"--step_contexts={_CONTEXTS.value}, --pauses_ms={_PAUSES.value}; "
                             "allowed: contexts 1..8192 (SmolLM2's trained positions), "
                             "pauses >= 0")
    q4 = str(checkpoints.weights_path(progress=False))
    f32 = peers.dense_gguf(q4)
    print(f"machine: {native.machine_id().partition('|')[0]} ({native.num_threads()} threads)")
    for t in contexts:
        cfg = bench.variant_cfg("smollm2", "gqa", "float32", False)
        kv = bench.step_runner(cfg.replace(decode_attention="auto", weight_matmul="auto"), t)
        ll = peers.llamacpp_stepper(f32, t, kv_type="f32")
        runs = cases(kv, ll, pauses)
        times = bench.interleaved_rounds(runs, _ROUNDS.value, warmup=1)
        med = {n: statistics.median(v) for n, v in times.items()}
        print(f"t = {t:,}, medians of {_ROUNDS.value} rounds (ms; x the step after its own "
              "runtime's):")
        for n, s in med.items():
            own = med["llama.cpp after llama.cpp" if n.startswith("llama") else
                      "kvjax after kvjax"]
            print(f"  {n:32s} {s * 1e3:7.2f}  {s / own:5.3f}x")


if __name__ == "__main__":
    app.run(main)
