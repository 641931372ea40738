#!/usr/bin/env bash
# Start one fleetgate worker agent (one engine on one GPU) in the background.
#
#   scripts/spawn_worker.sh --gpu 1 [--engine auto|vllm|lmdeploy|sim|external] [--model M]
#       [--adapters a=path,...] [--port P] [--redis-url URL] [--max-model-len L]
#       [--url URL (external)] [--id ID] [--run-dir DIR] [--wait] [--foreground] [--dry-run]
#       [any other `python -m workers` flag, e.g. --option max_num_seqs=128]
#
# Prints the worker id. The agent's pid file and logs go under the run dir
# (default .run/ in the project, or $FLEETGATE_RUN_DIR). `--engine auto` reads the
# card with nvidia-smi: vLLM on cards with >= 40 GiB, LMDeploy below; without a usable
# GPU it fails (`--engine sim` runs the simulator). Before detaching it checks that Redis
# answers and the engine's address resolves. `--wait` blocks until the worker is ready
# (exit 0) or its start failed (exit 1, with the logs' last lines), printing progress.
# `--dry-run` prints the engine command and why.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${FLEETGATE_PYTHON:-}
if [ -z "$python" ]; then
  if [ -x "$root/.venv/bin/python" ]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
run_dir=${FLEETGATE_RUN_DIR:-$root/.run}
foreground=0
dry_run=0
wait_ready=0
port=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --foreground) foreground=1 ;;
    --dry-run) dry_run=1 ;;
    --wait) wait_ready=1 ;;
    --no-wait) wait_ready=0 ;;
    --run-dir) run_dir=$2; shift ;;
    --run-dir=*) run_dir=${1#*=} ;;
    --port) port=$2; shift ;;
    --port=*) port=${1#*=} ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) args+=("$1") ;;
  esac
  shift
done

cd "$root"
if [ -z "$port" ]; then
  port=$("$python" -c 'from fleetgate.net import free_port; print(free_port())')
fi
args+=(--port "$port")

if [ "$dry_run" = 1 ]; then
  exec "$python" -m workers "${args[@]}" --dry-run
fi

# The plan, after checking Redis and the engine's address: a mistake fails here, not later
# in a detached agent that nobody watches.
plan=$("$python" -m workers "${args[@]}" --preflight) || exit $?
worker_id=$(printf '%s\n' "$plan" | sed -n 's/^# worker id: //p')
printf '%s\n' "$plan" | grep '^# ' | grep -v '^# worker id' >&2 || true

if [ "$foreground" = 1 ]; then
  exec "$python" -m workers "${args[@]}" --id "$worker_id"
fi

mkdir -p "$run_dir"
log="$run_dir/$worker_id.log"
engine_log="$run_dir/$worker_id.engine.log"
pidfile="$run_dir/$worker_id.pid"
if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
  echo "worker $worker_id already runs (pid $(cat "$pidfile"))" >&2
  exit 1
fi
setsid nohup "$python" -m workers "${args[@]}" --id "$worker_id" \
  --engine-log "$engine_log" >"$log" 2>&1 < /dev/null &
pid=$!
echo "$pid" > "$pidfile"
echo "started worker $worker_id (pid $pid, log $log); stop it with: kill \$(cat $pidfile)" >&2
if [ "$wait_ready" = 1 ]; then
  status=0
  "$python" -m workers.wait --pid "$pid" --log "$log" --log "$engine_log" -- \
    "${args[@]}" --id "$worker_id" || status=$?
  echo "$worker_id"
  exit "$status"
fi
echo "$worker_id"
