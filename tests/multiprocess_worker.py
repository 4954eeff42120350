"""Run by tests/test_parallel.py: one of 2 processes on the loopback address, 4 CPU
devices each, greedy decoding on a (data=2, model=4, seq=1) mesh spanning both.

``python tests/multiprocess_worker.py PORT PROCESS_ID`` prints ``TOKENS [...]`` (the
sharded run) and, from process 0, ``REF [...]`` (the same decode on one local device).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvjax.config import DistributedConfig, MeshConfig, ModelConfig, SamplingConfig  # noqa: E402
from kvjax.parallel import distributed  # noqa: E402

port, pid = int(sys.argv[1]), int(sys.argv[2])
distributed.initialize(DistributedConfig(coordinator_address=f"127.0.0.1:{port}",
                                         num_processes=2, process_id=pid, local_devices=4))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from kvjax import cache as cache_lib  # noqa: E402
from kvjax.inference import decode  # noqa: E402
from kvjax.models import model as model_lib  # noqa: E402
from kvjax.parallel import programs  # noqa: E402

assert len(jax.devices()) == 8 and len(jax.local_devices()) == 4
cfg = ModelConfig(vocab_size=256, num_layers=2, d_model=64, num_heads=8, num_kv_heads=4,
                  head_dim=16, mlp_dim=128, scan_layers=False, name="mp")
B, S, T, STEPS = 4, 32, 5, 6
params = model_lib.init_params(cfg, 0)
tokens = np.asarray(jax.random.randint(jax.random.key(1), (B, T), 0, 256, jnp.int32))

mm = programs.build(cfg, MeshConfig(2, 4, 1), B, S)
p = jax.tree.map(distributed.global_array, params, mm._p)
tok = distributed.global_array(tokens, mm.sharding(P("data")))
logits, cache = mm.prefill()(p, tok, mm.init_cache())
first = jnp.argmax(logits, -1).astype(jnp.int32)
buf, steps, cache = mm.generate()(p, first, cache, jnp.int32(STEPS), jax.random.key(0),
                                  jnp.int32(-1))
out = np.concatenate([distributed.to_host(first)[:, None],
                      distributed.to_host(buf)[:, :STEPS]], axis=1)
print("TOKENS " + json.dumps(out.tolist()), flush=True)

if pid == 0:
    with jax.default_device(jax.local_devices()[0]):
        lp = jax.device_put(params, jax.local_devices()[0])
        lg, c = decode.prefill_program(lp, jnp.asarray(tokens), cache_lib.init_cache(cfg, B, S),
                                       cfg=cfg)
        f = jnp.argmax(lg, -1).astype(jnp.int32)
        b, _, _ = decode.generate_program(lp, f, c, jnp.int32(STEPS), jax.random.key(0),
                                          jnp.int32(-1), cfg=cfg, sampling=SamplingConfig())
        ref = np.concatenate([np.asarray(f)[:, None], np.asarray(b)[:, :STEPS]], axis=1)
    print("REF " + json.dumps(ref.tolist()), flush=True)
