#!/usr/bin/env bash
# Model-compute benchmarks on one GPU (the device tool: each part under its 10-minute limit).
#   bash bench/gpu_compute.sh step    trainer rows (LoRA, full; recipe defaults), their compiled
#                                     fwd+bwd floors, diffusers' eager generate; then LoRA at the
#                                     peer's settings (micro-batch 4, 2 updates, no offload)
#                                     beside the plain eager loop (bench/peer_step.py)
#   bash bench/gpu_compute.sh offload both modes with the colocate offloads forced every step
#                                     (fsdp.offload_policy=always); the GPU tests
#   bash bench/gpu_compute.sh nsys    two-step Nsight Systems captures of the bench model and
#                                     their NVTX summaries (REV=<dir> captures a checkout there)
# Needs the carried wheels in .whl (diffusers, importlib_metadata) and, for nsys, the libdw1 /
# libelf1 .deb files in .dw. Logs and results go to $OUT.
set -u
PART=${1:-step}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODEL=${MODEL:-/tmp/bench_qwen8}
LOGS=$OUT
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
BENCH="python3 bench/bench_step.py --layers 8 --model-dir $MODEL"
case "$PART" in
step)
  TAIL=30 step step "${SECS:-330}" $BENCH --out "$OUT/step.json" --modes lora full --floors \
    --diffusers ${STEP_ARGS:-}
  TAIL=14 step peer "${SECS2:-230}" $BENCH --out "$OUT/peer.json" --modes lora --no-offload \
    --micro-batch 4 --label "mb4-no-offload-" --peer ${STEP_ARGS:-}
  ;;
offload)
  TAIL=14 step always "${SECS:-220}" $BENCH --out "$OUT/always.json" --modes lora full \
    --label "offload-always-" --set fsdp.offload_policy=always ${STEP_ARGS:-}
  TAIL=12 step gpu_tests 150 python3 -m pytest -q -o addopts= -p no:cacheprovider -m gpu tests
  ;;
nsys)
  NSYS=$(ls /opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys | head -1)
  mkdir -p /tmp/dw && for f in .dw/*.deb; do dpkg -x "$f" /tmp/dw; done
  export LD_LIBRARY_PATH=$(dirname "$(find /tmp/dw -name 'libdw.so.1' | head -1)"):${LD_LIBRARY_PATH:-}
  for rev in ${REVS:-after}; do
    # "before": the checkout in .before (bench_step.py there builds its own model copy)
    dir=.; model="--model-dir $MODEL"; [ "$rev" = before ] && dir=.before && model=""
    TAIL=8 step "nsys_$rev" "${NSYS_SECS:-200}" "$NSYS" profile --capture-range=cudaProfilerApi \
      --capture-range-end=stop -t cuda,nvtx -o "/tmp/step_$rev" --force-overwrite true \
      python3 "$dir/bench/bench_step.py" --layers 8 $model --modes lora \
      --rollouts 4 --out "/tmp/nsys_$rev.json" --set logging.profile_steps=2:4
    "$NSYS" stats --report nvtx_sum --format csv -o "$OUT/nvtx_$rev" "/tmp/step_$rev.nsys-rep" \
      > /dev/null 2>&1
    "$NSYS" stats --report nvtx_sum "/tmp/step_$rev.nsys-rep" 2>/dev/null | head -40
    gzip -c "/tmp/step_$rev.nsys-rep" > "$OUT/step_$rev.nsys-rep.gz"; ls -la "$OUT"
  done
  [ -n "${GPU_TESTS:-}" ] && TAIL=12 step gpu_tests 150 python3 -m pytest -q -o addopts= \
    -p no:cacheprovider -m gpu tests
  ;;
esac
