# Issue 36's LoRA benchmark on the GPU: sourced by scripts/gpu_bench.sh (its helpers: log, fg,
# spawn, wait_http, setup; its settings: MODE, W, OUT, T0, DEADLINE_S, TOKEN, ports) after
# scripts/gpu_bench_pressure.sh (p_stop, p_alive, p_fits, p_port_free, p_redis, p_gateway and
# the KV / engine settings, which this family shares).
#
#   lora-all   setup (once per machine), 16 PEFT adapters, then `lora`, then `lcollect`
#   lora       every L_STRATEGIES strategy on every L_SHAPES shape, L_REPS rounds
#   lcollect   results-lora.md / .json (python -m fleetgate_tools.bench.lora_tables) and
#              logs-lora.tgz into $OUT
#
# Adapters: 16 rank-16 PEFT LoRAs a0..a15 on q_proj,k_proj,v_proj,o_proj for the config-only
# 7B model (fleetgate_tools/bench/lora_adapters.py: random small A and B, shapes from
# /tmp/vl/m7/config.json; ~20 MiB each). Engines: vLLM 0.26 (`--load-format dummy`, the
# pressure family's KV flags: --kv-cache-memory-bytes P_KV_PRESSURE, --max-num-seqs
# P_MAX_NUM_SEQS) with `--enable-lora --max-loras S --max-lora-rank 16 --max-cpu-loras 16
# --lora-modules a0=... a15=...`, each attached as README says (`python -m workers --engine
# external --url http://...`, no --option: the agent reads the slots from the engine).
# Shapes (L_SHAPES, "<engines>x<slots>"): 2x8, 3x8, 2x4, in that order so that going from
# two engines to three only starts the third; a change of slots restarts them all.
#
# Workload `lora` (fleetgate_tools/bench/workloads.py): tenant t calls adapter a{t}, Zipf(1.0)
# popularity over 16 tenants, a ~1,500-token system prompt + ~65-token question, max_tokens
# 64, streamed, Poisson at L_RATE (GPU 64/s) for L_DURATION (35) s; the same request
# sequence (seed L_SEED) for every strategy:
#   adapter_affinity    client side: adapter a<k> straight to engine k % N (ids in order)
#   direct_round_robin  client side: the engines in turn
#   fleet               through a fresh gateway (config/gateway.yaml, --policy fleet)
# Every row has, beside TTFT p50/p99, out tok/s, ok/sent and 429s, each engine's distinct
# adapters across the run and the most at once (vllm:lora_requests_info), its slots, its
# requests waiting (max) and running (mean): fleetgate_tools/bench/lora.py.
#
# Resumable like `pressure`: a finished run leaves $W/lora/lora<shape>-<strategy>-r<round>.json
# and is not run again; no run starts that would end past T0 + DEADLINE_S; each call writes the
# tables of everything done so far. GPU time (DEADLINE_S=540 a call): setup ~4 min and the
# adapters ~30 s (call 3), each engine (re)start ~60-90 s (three: 2x8, +1 engine for 3x8,
# 2x4), ~35 s + drain + ~20 s a run, 9 runs: about three calls of 9 min after the two that
# carry the payload.
#
# GPU_BENCH_ENGINE=sim: the same steps on standalone simulators (python -m workers.simulator
# --enable-lora --max-loras S --max-cpu-loras 16 --lora-modules ..., time scale 4, so the rate
# is 16/s), adapters written as adapter_config.json only.

L_SHAPES=${L_SHAPES:-2x8,3x8,2x4}
L_STRATEGIES=${L_STRATEGIES:-adapter_affinity,direct_round_robin,fleet}
L_DURATION=${L_DURATION:-35}
L_REPS=${L_REPS:-1}
L_SEED=${L_SEED:-0}
L_ADAPTERS=${L_ADAPTERS:-16}
L_RANK=${L_RANK:-16}
L_CPU_LORAS=${L_CPU_LORAS:-16}
L_KV=${L_KV:-$P_KV_PRESSURE}
L_GATEWAY_FLAGS=${L_GATEWAY_FLAGS:-}           # more flags for the fleet's gateway (--set key=value ...)
L_DIR=$W/lora
L_PREFIX=gpul                                  # Redis prefix of the LoRA fleet
if [ "$MODE" = sim ]; then
  L_RATE=${L_RATE:-16}                         # the GPU's 64 at time scale 4
  L_DRAIN=${L_DRAIN:-40}
  L_ADAPTER_DIR=$L_DIR/adapters
else
  L_RATE=${L_RATE:-64}
  L_DRAIN=${L_DRAIN:-40}                       # starved adapters wait tens of seconds (issue 36)
  L_ADAPTER_DIR=/tmp/vl/loras
fi

l_client_side() { case $1 in adapter_affinity|tenant_affinity|direct_round_robin) return 0;; esac; return 1; }

l_adapters() {  # the 16 PEFT adapters (once per machine)
  [ -f "$L_DIR/adapters.done" ] && return 0
  local model=/tmp/vl/m7 py=(env PYTHONPATH=/tmp/vl/site python3) extra=()
  if [ "$MODE" = sim ]; then
    # The GPU model's shape (../shared/gpu/make_config_model.py); the simulator reads no weights.
    model=$L_DIR/m7-config
    mkdir -p "$model"
    printf '%s\n' '{"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,' \
      ' "num_key_value_heads": 4, "head_dim": 128}' > "$model/config.json"
    py=("$FG_PY") extra=(--config-only)
  fi
  log "lora: writing $L_ADAPTERS rank-$L_RANK adapters to $L_ADAPTER_DIR"
  "${py[@]}" fleetgate_tools/bench/lora_adapters.py "$model" "$L_ADAPTER_DIR" --count "$L_ADAPTERS" \
    --rank "$L_RANK" --alpha $((2 * L_RANK)) "${extra[@]}" > "$W/logs/lora-adapters.log" 2>&1 \
    || { log "lora: adapters FAILED"; tail -5 "$W/logs/lora-adapters.log"; return 1; }
  tail -1 "$W/logs/lora-adapters.log"
  touch "$L_DIR/adapters.done"
}

l_engine_up() {  # k slots: engine k on P_PORTS[k] with `slots` LoRA slots and every adapter
  local k=$1 slots=$2 port=${P_PORTS[$1]} blocks=$(( L_KV / KV_BYTES_PER_BLOCK )) i mods=()
  for ((i = 0; i < L_ADAPTERS; i++)); do mods+=("a$i=$L_ADAPTER_DIR/a$i"); done
  if [ "$MODE" = sim ]; then
    spawn "vllm$k" env PYTHONPATH="$FG_PATH" "$FG_PY" -m workers.simulator --served-model-name m7 \
      --profile h200-7b --max-model-len 8192 --num-gpu-blocks "$blocks" --block-size 16 \
      --max-num-seqs "$P_MAX_NUM_SEQS" --time-scale "$SIM_TIME_SCALE" --seed $((k + 1)) \
      --enable-lora --max-loras "$slots" --max-cpu-loras "$L_CPU_LORAS" --lora-modules "${mods[@]}" \
      --host 127.0.0.1 --port "$port"
  else
    spawn "vllm$k" env "${VL_ENV[@]}" python3 -m vllm.entrypoints.cli.main serve /tmp/vl/m7 --served-model-name m7 \
      --load-format dummy --max-model-len 8192 --enforce-eager --gpu-memory-utilization "$P_GPU_UTIL" \
      --kv-cache-memory-bytes "$L_KV" --max-num-seqs "$P_MAX_NUM_SEQS" \
      --enable-lora --max-loras "$slots" --max-lora-rank "$L_RANK" --max-cpu-loras "$L_CPU_LORAS" \
      --lora-modules "${mods[@]}" --host 127.0.0.1 --port "$port"
  fi
}

l_agent_up() {  # k: attach engine k as README says (`--engine external --url`, no --option)
  spawn "agent-vl$1" env PYTHONPATH="$FG_PATH" "$FG_PY" -m workers --engine external \
    --url "http://127.0.0.1:${P_PORTS[$1]}" --flavor vllm --id "vl$1" \
    --redis-url "$REDIS_URL" --redis-prefix "$L_PREFIX"
}

l_engines() {  # count slots: `count` engines with `slots` LoRA slots and their agents; others stopped
  local n=$1 slots=$2 k missing=()
  if [ "$(cat "$L_DIR/engines.slots" 2>/dev/null)" != "$slots" ]; then
    # Other slots, or engines another family started (the pressure family's have no LoRA).
    for k in "${!P_PORTS[@]}"; do p_stop "agent-vl$k"; p_stop "vllm$k" 60; done
    rm -f "$L_DIR/engines.slots" "$P_DIR/engines.kv"
  fi
  for ((k = n; k < ${#P_PORTS[@]}; k++)); do p_stop "agent-vl$k"; p_stop "vllm$k" 60; done
  for ((k = 0; k < n; k++)); do
    { p_alive "vllm$k" && p_alive "agent-vl$k"; } || missing+=("$k")
  done
  if [ "${#missing[@]}" = 0 ]; then echo "$slots" > "$L_DIR/engines.slots"; return 0; fi
  p_fits "$ENGINE_START_S" || { log "lora: no time left to start engine(s) ${missing[*]} with $slots slots"; return 1; }
  for k in "${missing[@]}"; do
    p_stop "agent-vl$k"; p_stop "vllm$k" 60
    p_port_free "${P_PORTS[$k]}" "engine $k" || return 1
  done
  rm -f "$P_DIR/engines.kv"   # the pressure family must not take these engines for its own
  log "lora: starting engine(s) ${missing[*]} with $slots LoRA slots and $L_ADAPTERS adapters"
  for k in "${missing[@]}"; do l_engine_up "$k" "$slots"; done
  for k in "${missing[@]}"; do
    wait_http "http://127.0.0.1:${P_PORTS[$k]}/health" 600 "$W/pids/vllm$k" \
      || { log "lora: engine $k NOT healthy"; tail -20 "$W/logs/vllm$k.log" 2>/dev/null; return 1; }
  done
  [ "$MODE" = sim ] || grep -h "GPU KV cache size\|Maximum concurrency\|LoRA" "$W"/logs/vllm*.log 2>/dev/null | tail -4
  for k in "${missing[@]}"; do l_agent_up "$k"; done
  echo "$slots" > "$L_DIR/engines.slots"
  log "lora: $n engines healthy ($slots slots each)"
}

l_fleet_yaml() {  # the workload's parameters (no workers: the engines are attached)
  printf '%s\n' "model: m7" "workers: []" "workloads:" \
    "  lora: {tenants: $L_ADAPTERS, system_tokens: 1500, user_tokens: 65, max_tokens: 64, zipf: 1.0, adapter_prefix: a}" \
    > "$L_DIR/fleet.yaml"
}

l_run() {  # shape strategy round
  local shape=$1 strategy=$2 round=$3 name="lora$1-$2-r$3" n slots policy=$2 rc
  [ -f "$L_DIR/$name.json" ] && return 0
  n=${shape%x*} slots=${shape#*x}
  p_fits $(( L_DURATION + L_DRAIN + 30 )) || { log "lora: deadline: $name and the rest left for the next call"; return 1; }
  l_engines "$n" "$slots" || return 1
  p_fits $(( L_DURATION + L_DRAIN + 30 )) || { log "lora: deadline: $name and the rest left for the next call"; return 1; }
  l_client_side "$strategy" && policy=round_robin   # that gateway only lists the engines
  # shellcheck disable=SC2086  # L_GATEWAY_FLAGS: words, e.g. "--set lora_slot_turn_s=4"
  P_PREFIX=$L_PREFIX p_gateway "$policy" "gateway-$name" "$n" $L_GATEWAY_FLAGS || return 1
  log "lora: $name, lora at $L_RATE req/s on $n engines x $slots slots (${L_DURATION}s + up to ${L_DRAIN}s drain)"
  fg scripts/bench_fleet.py --attach "http://127.0.0.1:$GW_PORT" --admin-token "$TOKEN" --fleet "$L_DIR/fleet.yaml" \
    --workloads lora --policies "$strategy" --rate "$L_RATE" --duration "$L_DURATION" --drain "$L_DRAIN" \
    --seed "$L_SEED" --pool 4096 --out "$L_DIR/$name.tmp.json" --png "$L_DIR/$name.png" \
    > "$W/logs/lora-$name.txt" 2>&1
  rc=$?
  curl -s -m 5 -H "authorization: Bearer $TOKEN" "http://127.0.0.1:$GW_PORT/admin/workers" \
    > "$W/logs/workers-$name.json" 2>/dev/null
  p_stop "gateway-$name" 10
  if [ $rc = 0 ]; then
    mv "$L_DIR/$name.tmp.json" "$L_DIR/$name.json"
    grep -A2 -E "^workload +policy +ok/sent" "$W/logs/lora-$name.txt" | sed -n '1p;3p'   # header + row
    grep -A3 "^engines' LoRA adapters" "$W/logs/lora-$name.txt" | sed -n '2p;4p'
  else
    log "lora: $name FAILED (rc $rc)"; tail -5 "$W/logs/lora-$name.txt"
  fi
}

lora() {
  mkdir -p "$L_DIR"
  l_fleet_yaml
  l_adapters || return 1
  p_redis || return 1
  IFS=, read -r -a shapes <<< "$L_SHAPES"
  IFS=, read -r -a strats <<< "$L_STRATEGIES"
  local n=${#strats[@]} shape r i
  for shape in "${shapes[@]}"; do
    [[ $shape =~ ^[1-3]x[0-9]+$ ]] || { log "lora: bad shape $shape (<engines 1-3>x<slots>)"; return 1; }
  done
  log "lora: shapes $L_SHAPES, strategies $L_STRATEGIES, $L_RATE req/s for ${L_DURATION}s each"
  for shape in "${shapes[@]}"; do
    for ((r = 1; r <= L_REPS; r++)); do
      for ((i = 0; i < n; i++)); do
        l_run "$shape" "${strats[$(( (i + r - 1) % n ))]}" "$r" || return 1
      done
    done
  done
  log "lora: every run is done"
}

lcollect() {
  local done total
  done=$(find "$L_DIR" -maxdepth 1 -name 'lora*-r*.json' ! -name '*.tmp.json' 2>/dev/null | wc -l)
  IFS=, read -r -a shapes <<< "$L_SHAPES"
  IFS=, read -r -a strats <<< "$L_STRATEGIES"
  total=$(( ${#shapes[@]} * ${#strats[@]} * L_REPS ))
  fg -m fleetgate_tools.bench.lora_tables "$L_DIR" "$OUT" > /dev/null
  nvidia-smi > "$W/logs/nvidia-smi-end.txt" 2>&1
  tar -C "$W" -czf "$OUT/logs-lora.tgz" --exclude='lora/adapters' logs lora 2>/dev/null
  cat "$OUT/results-lora.md"
  if [ "$done" -ge "$total" ]; then
    log "lora: all $total runs done"
  else
    log "lora: $done of $total runs done: call again with the same command (the machine must still be warm)"
  fi
}

lora_all() {
  if [ ! -f "$W/setup.done" ]; then
    if [ "$MODE" != sim ] && [ ! -d .vl2 ]; then
      log "lora: this machine has no setup and this call carries no .vl2: start again from call 1"; return 1
    fi
    setup
  fi
  lora
  lcollect
}
