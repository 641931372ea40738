# Issue 37's GPU proof of the measured worker speed: sourced by scripts/gpu_bench.sh (its
# helpers: log, fg, spawn, wait_http, setup; its settings: MODE, W, OUT, T0, DEADLINE_S, TOKEN,
# ports) after scripts/gpu_bench_pressure.sh (p_stop, p_alive, p_fits, p_port_free, p_redis,
# p_engine_up, p_agent_up, p_gateway and the KV / engine settings, which this family shares).
#
#   speed-starts  setup (once per machine), then `speed`, then `scollect`
#   speed         S_STARTS fresh starts of the same fleet, each measured once
#   scollect      results-speed.md / .json (python -m fleetgate_tools.bench.speed_starts table)
#                 and logs-speed.tgz into $OUT
#
# One start: any engine, agent or gateway still up is stopped; two vLLM 0.26 servers are started
# afresh with the pressure runs' two-engine flags (p_engine_up: 7B shape, --load-format dummy,
# --kv-cache-memory-bytes P_KV_PRESSURE, --max-num-seqs P_MAX_NUM_SEQS, both at once), each is
# attached as README says (`python -m workers --engine external --url http://...`, no --option:
# the agent warms it up and times its start-up probe batch), under a Redis prefix of the start's
# own (gpus<k>: no record of an earlier start is seen), and a gateway with config/gateway.yaml's
# settings and `--policy fleet` waits for both. Then S_DURATION s of the uniform workload
# (fleetgate_tools/bench/speed_starts.py: Poisson at S_RATE, prompts of S_PROMPT_TOKENS each
# unique from its first token, max_tokens S_MAX_TOKENS, ignore_eos, streamed) through it, while
# /admin/workers is read every second (speed, its source, the start-up figure) and the engines'
# /metrics twice a second (running / waiting / KV use). Then gateway, agents and engines stop,
# their logs kept as $W/speed/start<k>-<name>.log. The row: probe speeds, speeds after the load
# and their difference (the worst over every reading from S_SETTLE s to the end of the
# arrivals), the request split (x-fleetgate-worker) and how far from even, the engines' running /
# waiting / KV (mean / max), each with PASS / FAIL.
#
# Load: 16 req/s of 256 + 128 tokens keeps ~20-40 requests running on each engine (~15k of its
# 33.7k KV tokens at most) with none waiting: busy, not saturated, at ~2k output tok/s of the
# ~8k two such engines manage (RUNBOOK). A third check says whether waiting stayed 0.
#
# Resumable: a finished start leaves $W/speed/start<k>.json and is not run again; no start
# begins that would end past T0 + DEADLINE_S (ENGINE_START_S + S_DURATION + S_DRAIN + ~40 s).
# GPU time (H100 or H200): setup ~4 min (call 3); a start ~2.5 min (engines ~60-90 s to
# healthy, agents' warm-up + probe ~10 s, 35 s of arrivals + <=15 s drain, stop ~10 s): starts 1
# and 2 fit call 3 (DEADLINE_S=540) only if setup is quick, so plan on calls 3 and 4.
#
# GPU_BENCH_ENGINE=sim: the same steps on standalone simulators (p_engine_up's, time scale
# SIM_TIME_SCALE=4: the GPU's rate / 4, its latencies x 4).

S_STARTS=${S_STARTS:-3}
S_DURATION=${S_DURATION:-35}
S_SETTLE=${S_SETTLE:-30}                       # speeds compared from this much load on
S_PROMPT_TOKENS=${S_PROMPT_TOKENS:-256}
S_MAX_TOKENS=${S_MAX_TOKENS:-128}
S_SEED=${S_SEED:-0}
S_DIR=$W/speed
if [ "$MODE" = sim ]; then
  S_RATE=${S_RATE:-4}                          # the GPU's 16 at time scale 4
  S_DRAIN=${S_DRAIN:-40}                       # a 128-token answer takes ~4x the GPU's ~5 s
else
  S_RATE=${S_RATE:-16}
  S_DRAIN=${S_DRAIN:-15}
fi

s_stop_fleet() {  # every engine, agent and gateway of any family (the gateway's port freed too)
  local k f
  for f in "$W"/pids/gateway-*; do [ -f "$f" ] && p_stop "$(basename "$f")" 10; done
  for k in "${!P_PORTS[@]}"; do p_stop "agent-vl$k"; done
  for k in "${!P_PORTS[@]}"; do p_stop "vllm$k" 60; done
  rm -f "$P_DIR/engines.kv" "$W/lora/engines.slots"   # no family may take them as its own
}

s_keep_logs() {  # k: this start's engine / agent / gateway logs, kept beside its result
  local k=$1 name
  for name in vllm0 vllm1 agent-vl0 agent-vl1 "gateway-speed$k"; do
    [ -f "$W/logs/$name.log" ] && mv "$W/logs/$name.log" "$S_DIR/start$k-$name.log"
  done
}

s_start() {  # k: one fresh start, measured
  local k=$1 name="start$1" e t0 up ready rc
  [ -f "$S_DIR/$name.json" ] && return 0
  p_fits $(( ENGINE_START_S + S_DURATION + S_DRAIN + 40 )) \
    || { log "speed: deadline: $name and the rest left for the next call"; return 1; }
  s_stop_fleet
  for e in 0 1; do p_port_free "${P_PORTS[$e]}" "engine $e" || return 1; done
  log "speed: $name: two engines afresh ($(( P_KV_PRESSURE / KV_BYTES_PER_BLOCK )) KV blocks each)"
  t0=$(date +%s)
  # S_ALTERNATE=1: even starts launch engine 1 first (6 s ahead), odd ones engine 0, so a
  # difference that follows the order (the first process on a shared card) shows as such.
  local order=(0 1)
  [ "${S_ALTERNATE:-1}" = 1 ] && [ $(( k % 2 )) = 0 ] && order=(1 0)
  p_engine_up "${order[0]}" "$P_KV_PRESSURE"; sleep 6; p_engine_up "${order[1]}" "$P_KV_PRESSURE"
  for e in 0 1; do
    wait_http "http://127.0.0.1:${P_PORTS[$e]}/health" 600 "$W/pids/vllm$e" \
      || { log "speed: $name: engine $e NOT healthy"; tail -20 "$W/logs/vllm$e.log" 2>/dev/null; s_stop_fleet; s_keep_logs "$k"; return 1; }
  done
  up=$(( $(date +%s) - t0 ))
  [ "$MODE" = sim ] || grep -h "GPU KV cache size\|Maximum concurrency" "$W"/logs/vllm*.log 2>/dev/null | tail -2
  for e in 0 1; do P_PREFIX=gpus$k p_agent_up "$e"; done
  P_PREFIX=gpus$k p_gateway fleet "gateway-speed$k" 2 || { s_stop_fleet; s_keep_logs "$k"; return 1; }
  ready=$(( $(date +%s) - t0 ))
  log "speed: $name: engines healthy in ${up}s, both workers ready after ${ready}s"
  if ! p_fits $(( S_DURATION + S_DRAIN + 20 )); then
    log "speed: deadline: $name's engines came up too late to measure; left for the next call"
    s_stop_fleet; s_keep_logs "$k"; return 1
  fi
  log "speed: $name: uniform at $S_RATE req/s for ${S_DURATION}s (+ up to ${S_DRAIN}s drain)"
  fg -m fleetgate_tools.bench.speed_starts run --gateway "http://127.0.0.1:$GW_PORT" --admin-token "$TOKEN" \
    --start "$k" --rate "$S_RATE" --duration "$S_DURATION" --settle "$S_SETTLE" --drain "$S_DRAIN" \
    --seed "$S_SEED" --prompt-tokens "$S_PROMPT_TOKENS" --max-tokens "$S_MAX_TOKENS" \
    --engine-start-s "$up" --ready-s "$ready" --first "vl${order[0]}" --out "$S_DIR/$name.tmp.json" > "$W/logs/speed-$name.txt" 2>&1
  rc=$?
  curl -s -m 5 -H "authorization: Bearer $TOKEN" "http://127.0.0.1:$GW_PORT/admin/workers" \
    > "$S_DIR/$name-workers.json" 2>/dev/null
  s_stop_fleet
  s_keep_logs "$k"
  grep -h '"agent.speed"\|agent.speed ' "$S_DIR/$name"-agent-vl*.log 2>/dev/null | head -4
  if [ $rc = 0 ]; then
    mv "$S_DIR/$name.tmp.json" "$S_DIR/$name.json"
    grep -A2 "^| start" "$W/logs/speed-$name.txt" | sed -n '3p'
  else
    log "speed: $name FAILED (rc $rc)"; tail -5 "$W/logs/speed-$name.txt"
  fi
}

speed() {
  mkdir -p "$S_DIR"
  p_redis || return 1
  log "speed: $S_STARTS starts, uniform at $S_RATE req/s for ${S_DURATION}s each (speeds compared after ${S_SETTLE}s)"
  local k
  for ((k = 1; k <= S_STARTS; k++)); do s_start "$k" || return 1; done
  log "speed: every start is done"
}

scollect() {
  local done
  done=$(find "$S_DIR" -maxdepth 1 -name 'start[0-9].json' 2>/dev/null | wc -l)
  fg -m fleetgate_tools.bench.speed_starts table "$S_DIR" "$OUT" > /dev/null
  [ "$MODE" = sim ] || nvidia-smi > "$W/logs/nvidia-smi-end.txt" 2>&1
  tar -C "$W" -czf "$OUT/logs-speed.tgz" logs speed 2>/dev/null
  cat "$OUT/results-speed.md"
  if [ "$done" -ge "$S_STARTS" ]; then
    log "speed: all $S_STARTS starts done"
  else
    log "speed: $done of $S_STARTS starts done: call again with the same command (the machine must still be warm)"
  fi
}

speed_all() {
  if [ ! -f "$W/setup.done" ]; then
    if [ "$MODE" != sim ] && [ ! -d .vl2 ]; then
      log "speed: this machine has no setup and this call carries no .vl2: start again from call 1"; return 1
    fi
    setup
  fi
  speed
  scollect
}
