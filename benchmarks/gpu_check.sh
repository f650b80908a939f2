#!/usr/bin/env bash
# The GPU's measurements in one call, on a machine with an NVIDIA GPU whose image already has
# jax 0.11+ (cuda13), flax, optax, orbax, chex and pytest: nothing is installed, nothing is
# downloaded, rudax runs from PYTHONPATH. benchmarks/gpu_check.py runs the stages (tests
# compiled for the GPU, the sweep for impl="auto"'s table, flash attention against cuDNN, the
# trainer's tokens/s and MFU at 124M and 1B parameters), each within its own budget, and writes
# summary.txt and results.json under $OUT (or ./gpu_results). It stops by itself within 9
# minutes. Then, where the repository is committed from:
#   python -m benchmarks.tune_gpu --merge $OUT/tune.json
#
#   bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
# The driver keeps within 530 s; the timeout is the backstop for the driver itself.
timeout -k 5 540 python3 -m benchmarks.gpu_check --out "$out" --total 530
