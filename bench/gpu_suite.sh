#!/usr/bin/env bash
# The GPU session in two calls (each under the device tool's 10-minute limit):
#   bash bench/gpu_suite.sh A   kernels (tests + bench), ipc (tests + bench), rewards
#   bash bench/gpu_suite.sh B   engine, one training step (LoRA + full), toy run
# Needs the carried wheels in .whl (diffusers, importlib_metadata); writes logs under $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local t0=$(date +%s)
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"; tail -n 25 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "${1:-A}" in
A)
  step kernels_tests 170 python3 -m pytest -q -x -o addopts="" -p no:cacheprovider \
    tests/test_kernels_sde.py tests/test_kernels_loss.py
  step kernels_bench 170 python3 bench/bench_kernels.py --out "$OUT/kernels.md"
  step ipc_tests 90 python3 -m pytest -q -o addopts="" -p no:cacheprovider -m gpu tests/test_ipc*.py
  step ipc_bench 150 python3 bench/bench_ipc.py --out "$OUT/ipc.md"
  ;;
B)
  step rewards_bench 80 python3 bench/bench_rewards.py --out "$OUT/rewards.json"
  step engine_bench 150 python3 bench/bench_engine.py --out "$OUT/engine.md"
  step step_bench 280 python3 bench/bench_step.py --out "$OUT/step.json" --layers 8
  step toy_gpu 60 python3 -m trainer launch --config toy --set logging.run_dir=/tmp/toyrun \
    --set logging.tensorboard=false
  ;;
esac
