#!/usr/bin/env bash
# The prepared GPU check (issue 7): under five minutes on one H200.
# Runs the decode benchmark in bf16 at 4K/32K/128K for the blog model (MHA, GQA g=2, MQA)
# and SmolLM2's shapes (MHA, GQA K=3, MQA), both layer-stack modes, and prints the
# achieved fraction of HBM bandwidth (published H200 figure, 4.8 TB/s) and the GQA/MQA
# speedups over MHA against theory. Needs jax with CUDA (the H200 image has it) and absl,
# flax, numpy, matplotlib; writes results to $OUT/gpu_check (or results/gpu_check).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
PYTHONUNBUFFERED=1 python3 -m experiments.bench --gpu_check --max_cache_gb=40 \
  --out_dir="${OUT:-results}/gpu_check"
