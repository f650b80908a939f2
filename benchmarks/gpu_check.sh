#!/usr/bin/env bash
# GPU check for rudax.kernels, as one command on a machine with an NVIDIA GPU (the device
# tool's nvidia-h200: its image already has jax 0.11+, flax, optax, orbax, chex, pytest and
# hypothesis; nothing is installed and nothing is downloaded). It runs the kernel tests
# compiled for the GPU (the tests interpret Pallas only where there is no GPU), the layer
# and fused-AdamW tests, and benchmarks/kernels.py; it writes everything under $OUT (or
# ./gpu_results) and stays under 8 minutes.
#
#   bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, \
'optax', optax.__version__, jax.devices())"
} 2>&1 | tee "$out/env.txt"

timeout 300 python3 -m pytest -q -p no:cacheprovider -x \
  tests/kernels tests/optim/test_fused_adamw.py tests/layers 2>&1 | tee "$out/tests.txt"
tests_rc=${PIPESTATUS[0]}

timeout 150 python3 -m benchmarks.kernels --json "$out/kernels.json" 2>&1 | tee "$out/bench.txt"
bench_rc=${PIPESTATUS[0]}

echo "tests rc=$tests_rc, benchmark rc=$bench_rc" | tee "$out/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
