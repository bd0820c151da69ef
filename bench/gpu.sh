#!/usr/bin/env bash
# Every GPU run, named by what it measures or checks; each purpose is one call of the device
# tool (under its 10-minute limit):
#   bash bench/gpu.sh kernels          SDE log-prob kernels: GPU tests, then the bench (SWEEP=1: tilings)
#   bash bench/gpu.sh ipc              weight-sync transport: CUDA tests, then the bench with its sweep
#   bash bench/gpu.sh engine           rollout side: engine generate bench, reward scoring bench,
#                                      the transformer's forward with and without the fast paths
#   bash bench/gpu.sh step [VARIANT]   one training step (bench_step.py) on the 8-layer model:
#                                        default  recipe rows + floors + diffusers (one call: on
#                                                 a cold machine its compiles take minutes)
#                                        peer     the peer, beside the LoRA row at its settings
#                                                 and the LoRA row with the peer's pi_old
#                                        offload  both modes with the colocate offloads forced
#                                        fullsize the 60-block Qwen-Image at 512², one group
#                                                 of 16, LoRA r64 (VeRL-Omni's geometry)
#                                        nsys     two-step Nsight captures (REVS="after before")
#                                                 and the train stages' GPU idle gaps
#                                        profile  torch.profiler of one train stage + its floor
#                                                 (bench/profile_train.py: GPU busy, idle gaps, host lead)
#                                        attention  the LoRA row with torch's attention pick and
#                                                 with each of $BACKENDS (diffusers' names,
#                                                 default _native_efficient), same call
#                                        accumulate  the full row at micro-batch 2 with
#                                                 fsdp.accumulate_unsharded off and on, same call
#                                        textlen  what a new prompt length costs the compiled
#                                                 blocks, per attention backend
#                                                 (bench/bench_text_length.py)
#                                        optimizer  clip + AdamW over the full model's fp32
#                                                 parameters per implementation, against the
#                                                 copy floor (bench/bench_optimizer.py)
#   bash bench/gpu.sh multigpu         every GPU of the host: weak scaling 1 -> N, two-node dry run
#   bash bench/gpu.sh gpu-tests        every GPU test (pytest -m gpu), the checkpoint self-check and
#                                      each bench script's smoke case; ONLY=tests, ONLY=offload or
#                                      ONLY=smoke runs one third (three calls: all of it passes the
#                                      10 minutes)
#   bash bench/gpu.sh toy-sweep        toy learning curves of a sweep file (SWEEP=lab/sweeps/...)
#   bash bench/gpu.sh --list           every purpose and the commands it runs (no GPU needed)
#   DRY_RUN=1 bash bench/gpu.sh P      print purpose P's commands without running anything
# The exit status is non-zero when any command failed. Needs the carried wheels in .whl
# (diffusers, importlib_metadata; for nsys the libdw1 / libelf1 .deb files in .dw). Figures
# are appended to $OUT/results.csv (merge: python bench/results.py merge FILE --commit SHA, then
# python bench/make_table.py); logs come back as $OUT/<purpose>-logs.tar.gz.
# Each row records the checkout's commit; where the tree was copied with a .git that lags its
# latest commits (the device tool's copy records its base commit, "+dirty"), name the commit:
# BENCH_COMMIT=SHA bash bench/gpu.sh ...
set -u
cd "$(dirname "$0")/.."
PURPOSES="kernels ipc engine step multigpu gpu-tests toy-sweep"
PYT="python3 -m pytest -q -rs -o addopts= -p no:cacheprovider"
MODEL=${MODEL:-/tmp/bench_qwen8}
STEP="python3 bench/bench_step.py --layers 8 --model-dir $MODEL"

purpose_kernels() {
  step kernels_tests 120 $PYT -x tests/test_kernels_sde.py tests/test_kernels_loss.py
  TAIL=45 step kernels_bench 200 python3 bench/bench_kernels.py --out "$LOGS/kernels.md" \
    ${SWEEP:+--sweep}
}

purpose_ipc() {
  step ipc_tests 90 $PYT -m gpu tests/test_ipc_cuda.py
  TAIL=45 step ipc_bench 240 python3 bench/bench_ipc.py --sweep --out "$LOGS/ipc.md"
}

purpose_engine() {
  TAIL=20 step engine_bench 150 python3 bench/bench_engine.py --out "$LOGS/engine.md"
  TAIL=20 step rewards_bench 100 python3 bench/bench_rewards.py --out "$LOGS/rewards.json"
  TAIL=6 step forward_bench 300 python3 bench/bench_forward.py --model-dir "$MODEL"
}

purpose_step() {
  case "${1:-default}" in
  default)
    # 6 rollouts: the first is warm-up and the second has run slower than the later ones
    # too, so the median of 5 kept steps, not 3, is a steady step
    TAIL=30 step step "${SECS:-560}" $STEP --out "$LOGS/step.json" --modes lora full --floors \
      --diffusers --rollouts 6 ${STEP_ARGS:-}
    ;;
  peer)
    TAIL=16 step peer "${SECS2:-230}" $STEP --out "$LOGS/peer.json" --modes lora --no-offload \
      --micro-batch 4 --label "mb4-no-offload-" --peer --strong-peer ${STEP_ARGS:-}
    # the peer's algorithm exactly: pi_old from the sampling log-probs, no anchor forward
    TAIL=8 step engine_anchor "${SECS3:-150}" $STEP --out "$LOGS/engine_anchor.json" --modes lora \
      --no-offload --micro-batch 4 --label "mb4-no-offload-engine-anchor-" \
      --set train.anchor=engine ${STEP_ARGS:-}
    ;;
  fullsize)
    # the full depth (60 blocks, about 20 B parameters) with the bench's one-layer text
    # encoder, as a user with cached prompt embeddings; its directory is built on the machine
    TAIL=16 step fullsize "${SECS:-560}" python3 bench/bench_step.py --layers 60 \
      --model-dir "${FULL_MODEL:-/tmp/bench_qwen60}" --out "$LOGS/fullsize.json" --modes lora \
      --candidates 16 --groups "${FULL_GROUPS:-1}" --resolution 512 --rollouts "${ROLLOUTS:-3}" \
      --label "fullsize-512-g16-" ${STEP_ARGS:-}
    ;;
  offload)
    TAIL=14 step offload_always "${SECS:-300}" $STEP --out "$LOGS/always.json" --modes lora full \
      --label "offload-always-" --set fsdp.offload_policy=always ${STEP_ARGS:-}
    ;;
  nsys) step_nsys ;;
  attention)
    for backend in default ${BACKENDS:-_native_efficient}; do
      local sets=()
      [ "$backend" = default ] || sets=(--set "model.adapter_options={\"attention_backend\": \"$backend\"}")
      TAIL=4 step "attention_$backend" "${SECS:-250}" $STEP --out "$LOGS/attention_$backend.json" \
        --modes lora --rollouts 6 --label "attention-$backend-" "${sets[@]}" ${STEP_ARGS:-}
    done
    ;;
  accumulate)
    # fsdp.accumulate_unsharded off and on, same call: one gather and one gradient reduce per
    # update instead of one per micro-batch (the full actor's copies are 2.76 B parameters
    # each). Micro-batch 2: two per update (at the recipe's 4 an update is one micro-batch)
    for acc in false true; do
      TAIL=4 step "accumulate_$acc" "${SECS:-250}" $STEP --out "$LOGS/accumulate_$acc.json" \
        --modes ${MODES:-full} --rollouts 6 --micro-batch 2 --label "mb2-accumulate-$acc-" \
        --set fsdp.accumulate_unsharded=$acc ${STEP_ARGS:-}
    done
    ;;
  textlen)
    # the recompile log names the guard that failed, where a length compiles again
    TAIL=40 step text_length "${SECS:-400}" env TORCH_LOGS=recompiles python3 \
      bench/bench_text_length.py --model-dir "$MODEL" --profile-length 64 ${STEP_ARGS:-}
    ;;
  optimizer)
    TAIL=10 step optimizer "${SECS:-240}" python3 bench/bench_optimizer.py \
      --out "$LOGS/optimizer.json" ${STEP_ARGS:-}
    ;;
  profile)
    TAIL=8 step profile_train "${SECS:-300}" python3 bench/profile_train.py --model-dir "$MODEL" \
      --out "$LOGS/profile" ${STEP_ARGS:-}
    ;;
  *) echo "unknown step variant '$1' (default, peer, fullsize, offload, nsys, profile, attention," \
       "accumulate, textlen, optimizer)" >&2
     FAILED+=("step:$1") ;;
  esac
}

step_nsys() {
  local nsys
  nsys=$(ls /opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys 2>/dev/null | head -1)
  if [ -z "${DRY_RUN:-}" ]; then
    [ -n "$nsys" ] || { echo "no nsys on this machine" >&2; FAILED+=("nsys"); return; }
    mkdir -p /tmp/dw && for f in .dw/*.deb; do dpkg -x "$f" /tmp/dw; done
    export LD_LIBRARY_PATH=$(dirname "$(find /tmp/dw -name 'libdw.so.1' | head -1)"):${LD_LIBRARY_PATH:-}
  fi
  for rev in ${REVS:-after}; do
    # "before": a checkout placed in .before (its bench_step.py builds its own model copy)
    local dir=. model="--model-dir $MODEL"
    [ "$rev" = before ] && dir=.before && model=""
    TAIL=8 step "nsys_$rev" "${NSYS_SECS:-200}" "${nsys:-nsys}" profile \
      --capture-range=cudaProfilerApi --capture-range-end=stop -t cuda,nvtx -o "/tmp/step_$rev" \
      --force-overwrite true python3 "$dir/bench/bench_step.py" --layers 8 $model --modes lora \
      --rollouts 4 --out "/tmp/nsys_$rev.json" --set logging.profile_steps=2:4 \
      --label "nsys-profiled-"
    [ -n "${DRY_RUN:-}" ] && continue
    "$nsys" stats --report nvtx_sum --format csv -o "$OUT/nvtx_$rev" "/tmp/step_$rev.nsys-rep" \
      > /dev/null 2>&1
    "$nsys" stats --report nvtx_sum "/tmp/step_$rev.nsys-rep" 2>/dev/null | head -40
    # where the GPU waits inside each train stage (bench/nsys_gaps.py)
    python3 bench/nsys_gaps.py "/tmp/step_$rev.nsys-rep" --nsys "$nsys" | tee "$OUT/gaps_$rev.txt"
    gzip -c "/tmp/step_$rev.nsys-rep" > "$OUT/step_$rev.nsys-rep.gz"
  done
}

purpose_multigpu() {
  local gpus=${GPUS:-$([ -n "${DRY_RUN:-}" ] && echo N || python3 -c \
    "import torch; print(torch.cuda.device_count())")}
  TAIL=40 step multi_gpu 560 python3 bench/bench_multi_gpu.py --out "$LOGS/multi_gpu.json" \
    --layers 8 --gpus 1 "$gpus" --nnodes-dry-run --timeout 170 ${SETS:-}
}

purpose_gpu-tests() {
  # three parts, each one call under the 10-minute limit: ONLY=tests, ONLY=offload, ONLY=smoke
  # (the offload tests move the 8-layer actor over PCIe many times: ~250 s on their own)
  if [ -z "${ONLY:-}" ] || [ "$ONLY" = tests ]; then
    TAIL=25 step gpu_tests 330 $PYT -m gpu tests --ignore=tests/test_offload_gpu.py
    TAIL=8 step ckpt_selfcheck 120 python3 tests/test_checkpoint_harness.py selfcheck cuda 1
  fi
  if [ -z "${ONLY:-}" ] || [ "$ONLY" = offload ]; then
    TAIL=12 step gpu_tests_offload 400 $PYT -m gpu tests/test_offload_gpu.py
  fi
  [ -z "${ONLY:-}" ] || [ "$ONLY" = smoke ] || return 0
  # each bench script's smoke case: a few seconds on the GPU; its rows stay out of the figures
  local BENCH_RESULTS="$LOGS/smoke_results.csv"
  export BENCH_RESULTS
  step smoke_kernels 60 python3 bench/bench_kernels.py --shapes 8x36864 --dtypes bf16 \
    --impls eager,triton
  step smoke_ipc 60 python3 bench/bench_ipc.py --smoke
  step smoke_sglang_sync 120 python3 bench/bench_sglang_sync.py --mb 64 --repeats 1
  step smoke_optimizer 90 python3 bench/bench_optimizer.py --layers 1 --repeats 2
  step smoke_engine 60 python3 bench/bench_engine.py --tiny --layers 2 --warmup 1 --repeats 1
  step smoke_forward 150 python3 bench/bench_forward.py --tiny --layers 2 --repeats 2 --batch 2 \
    --rows 2
  step smoke_text_length 150 python3 bench/bench_text_length.py --tiny --layers 2 --rows 2 \
    --lengths 5 6 9 --backends default
  step smoke_rewards 60 python3 bench/bench_rewards.py --tiny --images 8 --resolution 64 \
    --prompts 2 --repeats 1 --batch-sizes 8 --out "$LOGS/smoke_rewards.json"
  # the step bench with its floors, diffusers' pipeline and the peer loop (peer_step.py, floors.py)
  step smoke_step 240 python3 bench/bench_step.py --tiny --modes lora --rollouts 2 --floors \
    --diffusers --peer --micro-batch 4 --out "$LOGS/smoke_step.json"
  step smoke_multigpu 150 python3 bench/bench_multi_gpu.py --tiny --gpus 1 --modes lora \
    --rollouts 2 --out "$LOGS/smoke_multi.json"
  step smoke_main_job 120 python3 bench/bench_main_job.py --footing smoke \
    --set train.num_rollouts=1 --set data.eval_max_prompts=4 --set logging.tensorboard=false
  step smoke_toy 120 python3 bench/bench_toy_learning.py --rollouts 1 --eval-every 1 \
    --eval-prompts 4 --eval-samples 1 --device cuda --out "$LOGS/smoke_toy.json"
}

purpose_toy-sweep() {
  # the sweeps are the lab's (lab/README.md); lab/toy on the path for the scorers they name
  local sweep=${SWEEP:-lab/sweeps/toy_around-the-recipe.txt}
  local name; name=$(basename "$sweep" .txt)
  TAIL=20 step "toy_sweep_$name" "${SECS:-560}" env PYTHONPATH="lab/toy:${PYTHONPATH:-$PWD}" \
    python3 bench/bench_toy_learning.py \
    --variants-file "$sweep" --rollouts "${ROLLOUTS:-100}" --eval-every 20 --eval-prompts 256 \
    --noise-seeds 7 99 --parallel 12 --device cuda --out "$LOGS/$name.json"
}

list_purposes() {
  DRY_RUN=1
  for p in $PURPOSES; do
    echo "$p:"
    if [ "$p" = step ]; then
      for v in default peer fullsize offload nsys profile attention accumulate textlen optimizer; do echo " step $v:"; purpose_step "$v"; done
    else
      "purpose_$p"
    fi
  done
}

PURPOSE=${1:-}
[ -n "$PURPOSE" ] || { echo "usage: bash bench/gpu.sh PURPOSE|--list  ($PURPOSES)" >&2; exit 2; }
if [ "$PURPOSE" != --list ] && ! [[ " $PURPOSES " == *" $PURPOSE "* ]]; then
  echo "unknown purpose '$PURPOSE'; one of: $PURPOSES (or --list)" >&2
  exit 2
fi
OUT=${OUT:-/tmp/out}; LOGS=$OUT/logs
[ "$PURPOSE" = --list ] && DRY_RUN=1
[ -n "${DRY_RUN:-}" ] || mkdir -p "$LOGS"
source bench/gpu_env.sh
if [ "$PURPOSE" = --list ]; then
  list_purposes
  exit 0
fi
if [ -z "${DRY_RUN:-}" ]; then
  export BENCH_RESULTS="$OUT/results.csv"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
fi
shift
"purpose_$PURPOSE" "$@"
if [ -z "${DRY_RUN:-}" ]; then
  tar -czf "$OUT/$PURPOSE-logs.tar.gz" -C "$LOGS" . && rm -rf "$LOGS"
fi
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "FAILED: ${FAILED[*]}" >&2
  exit 1
fi
echo "all passed: $PURPOSE"
