# Sourced by bench/gpu.sh: installs the carried wheels (.whl), sets the environment, and defines
# `step NAME SECONDS CMD...`, which runs CMD under a time limit with its log in $LOGS/NAME.log,
# prints its status and the log's tail ($TAIL lines), and adds NAME to FAILED when CMD fails.
# With DRY_RUN=1 nothing is installed or run: `step` prints the command it would run.
FAILED=()
if [ -z "${DRY_RUN:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:$PWD
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
step() {
  local name=$1 secs=$2; shift 2
  if [ -n "${DRY_RUN:-}" ]; then
    echo "  $name (${secs}s): $*"
    return 0
  fi
  local t0=$(date +%s)
  timeout "$secs" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"
  grep -v "Warning\|warn(\|register_pre_backward" "$LOGS/$name.log" | tail -n "${TAIL:-12}"
  [ "$rc" -eq 0 ] || FAILED+=("$name")
  return 0
}
