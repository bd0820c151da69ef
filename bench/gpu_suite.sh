#!/usr/bin/env bash
# GPU runs by part, each one call of the device tool (under its 10-minute limit):
#   bash bench/gpu_suite.sh A   kernels (tests + bench), ipc (tests + bench), rewards
#   bash bench/gpu_suite.sh B   engine (bench + tests), one training step (LoRA + full), toy run
# Needs the carried wheels in .whl (diffusers, importlib_metadata). Every log and result goes
# to $OUT/logs and comes back as one archive, $OUT/<part>.tar.gz.
set -u
PART=${1:-A}
OUT=${OUT:-/tmp/out}; LOGS=$OUT/logs
case "$PART" in E|F|G|H|I|J|K) LOGS=$OUT;; esac  # E-G: logs come back as they are
mkdir -p "$LOGS"
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
PYT="python3 -m pytest -q -o addopts= -p no:cacheprovider"
case "$PART" in
A)
  TAIL=40 step kernels_bench 150 python3 bench/bench_kernels.py --out "$LOGS/kernels.md"
  TAIL=40 step ipc_bench 150 python3 bench/bench_ipc.py --out "$LOGS/ipc.md"
  step kernels_tests 110 $PYT -x tests/test_kernels_sde.py tests/test_kernels_loss.py
  step ipc_tests 60 $PYT tests/test_ipc_cuda.py
  TAIL=20 step rewards_bench 70 python3 bench/bench_rewards.py --out "$LOGS/rewards.json"
  ;;
B)
  TAIL=30 step engine_bench 120 python3 bench/bench_engine.py --out "$LOGS/engine.md"
  TAIL=30 step step_bench 300 python3 bench/bench_step.py --out "$LOGS/step.json" --layers 8
  step engine_tests 60 $PYT tests/test_engine_gpu.py tests/test_models_gpu.py
  TAIL=20 step toy_gpu 90 python3 -m trainer launch --config toy --set logging.run_dir=$LOGS/toyrun
  ;;
C)
  TAIL=45 step kernels_bench 120 python3 bench/bench_kernels.py --out "$LOGS/kernels.md"
  TAIL=45 step ipc_bench 180 python3 bench/bench_ipc.py --sweep --out "$LOGS/ipc.md"
  step ipc_tests 60 $PYT -m gpu tests/test_ipc_cuda.py
  TAIL=20 step engine_bench 100 python3 bench/bench_engine.py --out "$LOGS/engine.md"
  step engine_tests 60 $PYT tests/test_engine_gpu.py tests/test_models_gpu.py
  step ckpt_selfcheck 50 python3 tests/test_checkpoint_harness.py selfcheck cuda 1
  ;;
D)
  TAIL=25 step step_bench 330 python3 bench/bench_step.py --out "$LOGS/step.json" --layers 8
  TAIL=15 step toy_gpu 100 python3 -m trainer launch --config toy --set logging.progress=false \
    --set logging.run_dir=$LOGS/toyrun --set logging.tensorboard=false
  NSYS=$(ls /opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys 2>/dev/null | head -1)
  [ -n "$NSYS" ] && TAIL=8 step toy_nsys 90 "$NSYS" profile --capture-range=cudaProfilerApi \
    --capture-range-end=stop -t cuda,nvtx -o "$LOGS/toy_2steps" python3 -m trainer launch \
    --config toy --profile-steps 2:4 --set train.num_rollouts=4 --set data.eval_prompt_data=none \
    --set logging.run_dir=/tmp/toyprof --set logging.progress=false
  ;;
F)  # the step with model compute measured in place (perf/outside_compute_share)
  TAIL=30 step step_bench 280 python3 bench/bench_step.py --out "$LOGS/step.json" --layers 8
  TAIL=30 step step_bench_nooffload 200 python3 bench/bench_step.py --out "$LOGS/step_nooff.json" \
    --layers 8 --no-offload
  # FUSED=1: the same with torch's fused AdamW
  [ -n "${FUSED:-}" ] && TAIL=30 step step_bench_fused 200 python3 bench/bench_step.py \
    --out "$LOGS/step_fused.json" --layers 8 --no-offload --set train.adam_fused=true
  exit 0
  ;;
G)  # toy learning sweep on the shipped toy model (ROUND, ROLLOUTS, SECS from the env)
  TAIL=20 step "toy_${ROUND:-round5}" "${SECS:-560}" python3 bench/bench_toy_learning.py \
    --variants-file "bench/sweeps/toy_${ROUND:-round5}.txt" --rollouts "${ROLLOUTS:-200}" \
    --eval-every 20 --eval-prompts 256 --noise-seeds 7 99 --parallel 12 --device cuda \
    --out "$LOGS/${ROUND:-round5}.json"
  # the device tool returns at most 8 files: one archive of the parts and the log
  tar -czf "$OUT/${ROUND:-round5}.tar.gz" -C "$OUT" $(cd "$OUT" && ls | grep -v '\.tar\.gz$') \
    && find "$OUT" -mindepth 1 ! -name '*.tar.gz' -delete
  exit 0
  ;;
H)  # one GPU: the step with foreach vs fused AdamW
  export CUDA_VISIBLE_DEVICES=${GPU:-0}
  TAIL=16 step step_full_foreach 200 python3 bench/bench_step.py --out "$LOGS/step_foreach.json" \
    --layers 8 --no-offload --modes full
  TAIL=30 step step_fused 280 python3 bench/bench_step.py --out "$LOGS/step_fused.json" \
    --layers 8 --no-offload --set train.adam_fused=true
  exit 0
  ;;
I)  # every GPU of the host: weak scaling 1 -> N through the launcher, 2-node dry run
  TAIL=40 step multi_gpu 560 python3 bench/bench_multi_gpu.py --out "$LOGS/multi_gpu.json" \
    --layers 8 --gpus 1 $(python3 -c "import torch; print(torch.cuda.device_count())") \
    --nnodes-dry-run --timeout 170 ${SETS:-}
  tar -czf "$OUT/I.tar.gz" -C "$OUT" $(cd "$OUT" && ls | grep -v '\.tar\.gz$') \
    && find "$OUT" -mindepth 1 ! -name '*.tar.gz' ! -name 'multi_gpu.*' -delete
  exit 0
  ;;
J)  # weak scaling (6 rollouts, median step, no end-of-run checkpoint) and the
    # full step at the recipes' global batch on one GPU (8 prompts x 8 = 64 samples)
  TAIL=40 step multi_gpu 400 python3 bench/bench_multi_gpu.py --out "$LOGS/multi_gpu.json" \
    --layers 8 --gpus 1 $(python3 -c "import torch; print(torch.cuda.device_count())") \
    --timeout 150 ${SETS:-}
  CUDA_VISIBLE_DEVICES=0 TAIL=12 step step_full_64 150 python3 bench/bench_step.py \
    --out "$LOGS/step_full_64.json" --layers 8 --no-offload --modes full --groups 8
  tar -czf "$OUT/J.tar.gz" -C "$OUT" $(cd "$OUT" && ls | grep -v '\.tar\.gz$') \
    && find "$OUT" -mindepth 1 ! -name '*.tar.gz' ! -name '*.json' -delete
  exit 0
  ;;
K)  # the GPU tests
  TAIL=15 step gpu_tests 300 $PYT -s tests/test_offload_gpu.py tests/test_engine_gpu.py \
    tests/test_ipc_cuda.py tests/test_sync_gather.py
  TAIL=15 step ckpt_selfcheck 150 python3 tests/test_checkpoint_harness.py selfcheck cuda 1
  exit 0
  ;;
E)  # offload proof, engine log-prob parity, checkpoint GPU self-check, step + NVML busy
  step nvml_probe 20 python3 -c "import torch; print('nvml utilization', torch.cuda.utilization())"
  TAIL=25 step offload_engine_tests 170 $PYT -s tests/test_offload_gpu.py tests/test_engine_gpu.py
  step ckpt_selfcheck 60 python3 tests/test_checkpoint_harness.py selfcheck cuda 1
  TAIL=30 step step_bench 250 python3 bench/bench_step.py --out "$LOGS/step.json" --layers 8
  exit 0
  ;;
esac
tar -czf "$OUT/$PART.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
