# Sourced by the GPU scripts (gpu_suite.sh, gpu_compute.sh): installs the carried wheels (.whl),
# sets the environment, and defines `step NAME SECONDS CMD...`, which runs CMD under a time
# limit with its log in $LOGS/NAME.log and prints its status and the log's tail ($TAIL lines).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
step() {
  local name=$1 secs=$2; shift 2
  local t0=$(date +%s)
  timeout "$secs" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"
  grep -v "Warning\|warn(\|register_pre_backward" "$LOGS/$name.log" | tail -n "${TAIL:-12}"
}
