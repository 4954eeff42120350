#!/usr/bin/env bash
# The prepared GPU check (issues 7 and 18): under five minutes on one H200.
# Runs the decode benchmark in bf16 at 4K/32K/128K for the blog model (MHA, GQA g=2, MQA)
# and SmolLM2's shapes (MHA, GQA K=3, MQA), both layer-stack modes, and prints the
# achieved fraction of HBM bandwidth (published H200 figure, 4.8 TB/s) and the GQA/MQA
# speedups over MHA against theory. Needs jax with CUDA (the H200 image has it) and absl,
# flax, numpy, matplotlib; writes results to $OUT/gpu_check (or results/gpu_check).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
# Decode attention per layer, XLA einsums vs JAX's Pallas GPU decode-attention kernel
# (model.decode_attention='xla' / 'pallas'), bf16, t = 32K and 128K: GB/s and fraction of
# the H200's published HBM bandwidth (issue 18, item 3). ~1 minute.
for slots in 32768 131072; do
  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/decode_attention_bench.py \
    --slots=$slots --dtype=bfloat16 --rounds=9
done
PYTHONUNBUFFERED=1 python3 -m experiments.bench --gpu_check --max_cache_gb=40 \
  --out_dir="${OUT:-results}/gpu_check"
# Speculative decoding (issue 30): n-gram and window self-draft, k = 2, 4, 8, at t = 4K and
# 16K, B = 1 and 8, against plain decoding and the theory. ~2 minutes.
PYTHONUNBUFFERED=1 python3 -m experiments.speculative --contexts=4096,16384 --ks=2,4,8 \
  --batches=1,8 --repeats=3 --out_dir="${OUT:-results}/gpu_check/speculative"
# The paged decode step against the dense one (issue 29), float32, t = 4K and 32K: XLA's
# gather of the pages, and the Pallas kernel reading them in place (the planner's pick on
# GPU). ~1 minute.
PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/paged_step_bench.py --contexts=4096,32768 \
  --impls=auto,xla,pallas --repeats=5 --rounds=3
