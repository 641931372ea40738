# Issue 31's multi-turn benchmark on the GPU: sourced by scripts/gpu_bench.sh (its helpers: log,
# fg, spawn, wait_http, setup; its settings: MODE, W, OUT, T0, DEADLINE_S, TOKEN, ports) after
# scripts/gpu_bench_pressure.sh (p_stop, p_alive, p_fits, p_port_free, p_redis, p_gateway and the
# KV / engine settings, which this family shares).
#
#   multiturn-all  setup (once per machine), then `multiturn`, then `mcollect`
#   multiturn      every M_STRATEGIES strategy on every M_SHAPES shape, M_REPS rounds
#   mcollect       results-multiturn.md / .json (python -m fleetgate_tools.bench.multiturn_tables)
#                  and logs-multiturn.tgz into $OUT
#
# Engines: vLLM 0.26 servers sharing the card (7B shape, --load-format dummy), each with the
# pressure family's KV cache (--kv-cache-memory-bytes M_KV: 2106 blocks of 16, 33,696 tokens),
# serving M_MODEL: a copy of the GPU model's folder (/tmp/vl/m7) with Qwen2's ChatML chat
# template (make_config_model.py writes a plain `role: content` one; ChatML is what the tiny
# model has, and what a gateway that renders the chat template is tested against), and with
# vLLM's KV cache events on (M_KV_EVENTS_CONFIG; the publisher binds `tcp://*:5570+k`, its
# replay 127.0.0.1:5580+k). Each is attached as README says: `python -m workers --engine
# external --url http://...`, given `--model M_MODEL --served-model-name m7` so that its
# tokenizer (and template) registers, plus M_AGENT_ARGS ({k}, {events}, {replay} replaced by the
# engine's index and its event / replay ports): by default the agent's `--kv-events`,
# `--kv-replay` and `--kv-topic`, so that it subscribes and publishes the engine's index.
#
# Workload `multiturn` (fleetgate_tools/bench/conversations.py; config/bench/multiturn.yaml has
# the sizing): Poisson arrivals of conversations at M_RATE (two engines) / M_RATE_THREE (three)
# a second for M_DURATION s; each opens with one of 4 shared ~1,000-token system prompts and a
# ~2,000-token document of its own, then 3-8 turns of a ~100-token question and a 64-token
# answer (ignore_eos; the engine's own answer is appended to the next turn), ~5 s of think time
# between turns; no session header. A conversation holds ~3-4k tokens: at 2 a second ~70 are
# live, ~250k tokens, against 67k of KV in two engines. The same plan (seed M_SEED) for every
# strategy:
#   direct_round_robin      client side: the engines in turn, turn by turn
#   fleet+kv_events=false   a fresh gateway, --policy fleet, routing.kv_events false (placement only)
#   fleet+kv_events=true    the same with kv_events true (precise: the engines' KV events)
#   conversation_affinity   (optional) client side: conversation k on engine k % N, the oracle
# Every row has turns ok / sent / planned, 429s, TTFT p50 / p99 (all turns and later turns),
# output tok/s, the engines' prefix-cache hit rate (vllm:prefix_cache_hits_total /
# queries_total), preemptions, and the engines' own waiting / running / KV use sampled twice a
# second; every run starts with the engines idle and their prefix caches reset.
#
# Resumable like `pressure`: a finished run leaves $W/mt/mt<engines>-<strategy>-r<round>.json and
# is not run again; no run starts that would end past T0 + DEADLINE_S; each call writes the
# tables of everything done so far. GPU time (H100 or H200): setup ~4 min (call 3), two engines
# ~90 s to start (+1 engine for mt3 ~60 s), a run ~110 s (35 s of arrivals, ~45 s more while the
# last conversations finish, the gateway's start and the engines' reset; the sim dry run with
# 15 s of arrivals took ~88 s a run), 6 runs: ~17 min after the two payload calls, i.e. calls 3
# to 5 at DEADLINE_S=540 (each run is only started when ~130 s are left). M_SHAPES=2 (two
# engines only): ~11 min, calls 3 and 4.
#
# GPU_BENCH_ENGINE=sim: the same steps on standalone simulators (python -m workers.simulator
# --model .cache/tiny/model, the pressure family's KV size, --kv-events-config), at time scale
# M_SIM_TIME_SCALE (1: this workload is light on the client) and the GPU's rates.

M_SHAPES=${M_SHAPES:-2,3}
M_STRATEGIES=${M_STRATEGIES:-direct_round_robin,fleet+kv_events=false,fleet+kv_events=true}
M_DURATION=${M_DURATION:-35}
M_DRAIN=${M_DRAIN:-20}
M_REPS=${M_REPS:-1}
M_SEED=${M_SEED:-0}
M_RATE=${M_RATE:-2}                            # conversations a second, two engines
M_RATE_THREE=${M_RATE_THREE:-3}                # three engines
M_KV=${M_KV:-$P_KV_PRESSURE}
M_PARAMS=${M_PARAMS:-"system_prompts: 4, system_tokens: 1000, context_tokens: 2000, turns_min: 3, turns_max: 8, user_tokens: 100, max_tokens: 64, think_s: 5.0, think_min_s: 1.0"}
M_KV_EVENTS_CONFIG=${M_KV_EVENTS_CONFIG-'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{events}", "replay_endpoint": "tcp://127.0.0.1:{replay}", "topic": "kv@vl{k}"}'}
M_AGENT_ARGS=${M_AGENT_ARGS-"--kv-events tcp://127.0.0.1:{events} --kv-replay tcp://127.0.0.1:{replay} --kv-topic kv@vl{k}"}
M_SIM_TIME_SCALE=${M_SIM_TIME_SCALE:-1}
M_DIR=$W/mt
M_PREFIX=gpumt                                 # Redis prefix of the multi-turn fleet
if [ "$MODE" = sim ]; then
  M_MODEL=${M_MODEL:-$ROOT/.cache/tiny/model}
else
  M_MODEL=${M_MODEL:-/tmp/vl/m7c}
fi

m_client_side() { case $1 in direct_round_robin|conversation_affinity|tenant_affinity) return 0;; esac; return 1; }

m_subst() {  # text k -> text with {k}, {events}, {replay} replaced for engine k
  local s=$1 k=$2
  s=${s//\{k\}/$k}; s=${s//\{events\}/$((5570 + PORT_SHIFT + k))}; s=${s//\{replay\}/$((5580 + PORT_SHIFT + k))}
  printf '%s' "$s"
}

m_model() {  # the served folder: the GPU model with a ChatML chat template (once per machine)
  [ "$MODE" = sim ] && { [ -f "$M_MODEL/tokenizer.json" ] || { log "multiturn: $M_MODEL has no tokenizer.json (make vllm)"; return 1; }; return 0; }
  [ -f "$M_MODEL/chat_template.jinja" ] && grep -q '"<|im_start|>"' "$M_MODEL/tokenizer.json" && return 0
  [ -f /tmp/vl/m7/config.json ] || { log "multiturn: /tmp/vl/m7 is missing (setup did not run)"; return 1; }
  mkdir -p "$M_MODEL" && cp /tmp/vl/m7/* "$M_MODEL/" || return 1
  python3 - "$M_MODEL" <<'EOF'
import json, pathlib, sys
folder = pathlib.Path(sys.argv[1])
template = ("{%- for message in messages %}{%- if loop.first and message['role'] != 'system' %}"
            "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
            "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
            "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
(folder / "chat_template.jinja").write_text(template)
# <|im_start|> and <|im_end|> are the tokenizer's special (added) tokens, as in every ChatML
# model (Qwen2.5's among them), not text cut into a dozen BPE pieces: what the engine's prompt
# holds then matches a real model's, and the gateway tokenizes only the chat's text it has not
# seen lately (gateway/request/token_pieces.py cuts at added tokens); the config's vocab_size
# follows the tokenizer's, so that every id the dummy weights sample decodes.
from tokenizers import AddedToken, Tokenizer
tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
tok.save(str(folder / "tokenizer.json"))
cfg = json.loads((folder / "config.json").read_text())
cfg["vocab_size"] = tok.get_vocab_size()
(folder / "config.json").write_text(json.dumps(cfg, indent=1))
config = folder / "tokenizer_config.json"
data = json.loads(config.read_text()) if config.exists() else {}
data["chat_template"] = template
config.write_text(json.dumps(data, indent=1))
EOF
  log "multiturn: $M_MODEL = /tmp/vl/m7 with a ChatML chat template"
}

m_engine_up() {  # k: engine k on P_PORTS[k], KV events on when M_KV_EVENTS_CONFIG is set
  local k=$1 port=${P_PORTS[$1]} blocks=$(( M_KV / KV_BYTES_PER_BLOCK )) events=()
  [ -n "$M_KV_EVENTS_CONFIG" ] && events=(--kv-events-config "$(m_subst "$M_KV_EVENTS_CONFIG" "$k")")
  if [ "$MODE" = sim ]; then
    spawn "vllm$k" env PYTHONPATH="$FG_PATH" "$FG_PY" -m workers.simulator --served-model-name m7 \
      --model "$M_MODEL" --profile h200-7b --max-model-len 8192 --num-gpu-blocks "$blocks" --block-size 16 \
      --max-num-seqs "$P_MAX_NUM_SEQS" --time-scale "$M_SIM_TIME_SCALE" --seed $((k + 1)) \
      "${events[@]}" --host 127.0.0.1 --port "$port"
  else
    spawn "vllm$k" env "${VL_ENV[@]}" python3 -m vllm.entrypoints.cli.main serve "$M_MODEL" --served-model-name m7 \
      --load-format dummy --max-model-len 8192 --enforce-eager --gpu-memory-utilization "$P_GPU_UTIL" \
      --kv-cache-memory-bytes "$M_KV" --max-num-seqs "$P_MAX_NUM_SEQS" "${events[@]}" \
      --host 127.0.0.1 --port "$port"
  fi
}

m_agent_up() {  # k: attach engine k as README says, with the model folder (its tokenizer registers)
  local extra=()
  # shellcheck disable=SC2206  # M_AGENT_ARGS is a list of words by design
  [ -n "$M_AGENT_ARGS" ] && extra=($(m_subst "$M_AGENT_ARGS" "$1"))
  spawn "agent-vl$1" env PYTHONPATH="$FG_PATH" "$FG_PY" -m workers --engine external \
    --url "http://127.0.0.1:${P_PORTS[$1]}" --flavor vllm --id "vl$1" --model "$M_MODEL" --served-model-name m7 \
    --redis-url "$REDIS_URL" --redis-prefix "$M_PREFIX" "${extra[@]}"
}

m_state() { echo "$M_KV $M_MODEL ${M_KV_EVENTS_CONFIG:+events} $(cat "$W/pids/vllm0" 2>/dev/null)"; }

m_engines() {  # count: `count` engines of this family and their agents; others stopped
  local n=$1 k missing=()
  if [ "$(cat "$M_DIR/engines.state" 2>/dev/null)" != "$(m_state)" ]; then
    # Other settings, or engines another family started (its model, KV or LoRA flags).
    for k in "${!P_PORTS[@]}"; do p_stop "agent-vl$k"; p_stop "vllm$k" 60; done
    rm -f "$M_DIR/engines.state"
  fi
  for ((k = n; k < ${#P_PORTS[@]}; k++)); do p_stop "agent-vl$k"; p_stop "vllm$k" 60; done
  for ((k = 0; k < n; k++)); do
    { p_alive "vllm$k" && p_alive "agent-vl$k"; } || missing+=("$k")
  done
  if [ "${#missing[@]}" = 0 ]; then m_state > "$M_DIR/engines.state"; return 0; fi
  p_fits "$ENGINE_START_S" || { log "multiturn: no time left to start engine(s) ${missing[*]}"; return 1; }
  for k in "${missing[@]}"; do
    p_stop "agent-vl$k"; p_stop "vllm$k" 60
    p_port_free "${P_PORTS[$k]}" "engine $k" || return 1
  done
  rm -f "$P_DIR/engines.kv" "$L_DIR/engines.slots"   # the other families must not take these engines
  log "multiturn: starting engine(s) ${missing[*]} with $(( M_KV / KV_BYTES_PER_BLOCK )) KV blocks of 16 tokens, serving $M_MODEL"
  for k in "${missing[@]}"; do m_engine_up "$k"; done
  for k in "${missing[@]}"; do
    wait_http "http://127.0.0.1:${P_PORTS[$k]}/health" 600 "$W/pids/vllm$k" \
      || { log "multiturn: engine $k NOT healthy"; tail -20 "$W/logs/vllm$k.log" 2>/dev/null; return 1; }
  done
  [ "$MODE" = sim ] || grep -h "GPU KV cache size\|Maximum concurrency\|kv_events\|KV event" "$W"/logs/vllm*.log 2>/dev/null | tail -4
  for k in "${missing[@]}"; do m_agent_up "$k"; done
  m_state > "$M_DIR/engines.state"
  log "multiturn: $n engines healthy"
}

m_fleet_yaml() {  # the workload's parameters (no workers: the engines are attached)
  printf '%s\n' "model: m7" "workers: []" "workloads:" "  multiturn: {$M_PARAMS}" > "$M_DIR/fleet.yaml"
}

m_run() {  # engines strategy round
  local n=$1 strategy=$2 round=$3 name="mt$1-$2-r$3" rate=$M_RATE rc gw=()
  [ -f "$M_DIR/$name.json" ] && return 0
  [ "$n" = 3 ] && rate=$M_RATE_THREE
  # the planned conversations end ~45 s after the last start (8 turns x 5 s of think time)
  local need=$(( M_DURATION + 45 + M_DRAIN + 30 ))
  p_fits "$need" || { log "multiturn: deadline: $name and the rest left for the next call"; return 1; }
  m_engines "$n" || return 1
  p_fits "$need" || { log "multiturn: deadline: $name and the rest left for the next call"; return 1; }
  if m_client_side "$strategy"; then
    gw=(round_robin)                           # that gateway only lists the engines
  else
    # policy, then its arguments (routing options on top of the config's routing block)
    mapfile -t gw < <(fg -c "import sys; from fleetgate_tools.bench.variants import main; sys.exit(main())" "$strategy" 2>>"$W/logs/mt-variants.log")
    [ "${#gw[@]}" -gt 0 ] || { log "multiturn: cannot read strategy $strategy"; return 1; }
  fi
  P_PREFIX=$M_PREFIX p_gateway "${gw[0]}" "gateway-$name" "$n" "${gw[@]:1}" || return 1
  log "multiturn: $name, multiturn at $rate conversations/s on $n engines (${M_DURATION}s of arrivals + conversations + up to ${M_DRAIN}s drain)"
  fg scripts/bench_fleet.py --attach "http://127.0.0.1:$GW_PORT" --admin-token "$TOKEN" --fleet "$M_DIR/fleet.yaml" \
    --workloads multiturn --policies "$strategy" --rate "$rate" --duration "$M_DURATION" --drain "$M_DRAIN" \
    --seed "$M_SEED" --pool 4096 --out "$M_DIR/$name.tmp.json" --png "$M_DIR/$name.png" \
    > "$W/logs/multiturn-$name.txt" 2>&1
  rc=$?
  curl -s -m 5 -H "authorization: Bearer $TOKEN" "http://127.0.0.1:$GW_PORT/admin/workers" \
    > "$W/logs/workers-$name.json" 2>/dev/null
  p_stop "gateway-$name" 10
  if [ $rc = 0 ]; then
    mv "$M_DIR/$name.tmp.json" "$M_DIR/$name.json"
    grep -A2 -E "^workload +policy +conv done" "$W/logs/multiturn-$name.txt" | sed -n '1p;3p'   # header + row
  else
    log "multiturn: $name FAILED (rc $rc)"; tail -5 "$W/logs/multiturn-$name.txt"
  fi
}

multiturn() {
  mkdir -p "$M_DIR"
  m_fleet_yaml
  m_model || return 1
  IFS=, read -r -a shapes <<< "$M_SHAPES"
  IFS=, read -r -a strats <<< "$M_STRATEGIES"
  local n=${#strats[@]} shape r i
  for shape in "${shapes[@]}"; do
    [[ $shape =~ ^[1-3]$ ]] || { log "multiturn: bad shape $shape (engines, 1-3)"; return 1; }
  done
  # Every gateway strategy's settings checked before any engine starts (no GPU time spent on
  # a gateway that would refuse its routing options).
  local why strat
  for strat in "${strats[@]}"; do
    m_client_side "$strat" && continue
    if ! why=$(fg -c "import sys; from fleetgate_tools.bench.variants import main; sys.exit(main())" --check "$strat" 2>&1); then
      log "multiturn: strategy $strat cannot run (leave it out of M_STRATEGIES, or fix it): $(grep '^variants:' <<< "$why")"
      return 1
    fi
  done
  p_redis || return 1
  log "multiturn: engines $M_SHAPES, strategies $M_STRATEGIES, $M_RATE (three: $M_RATE_THREE) conversations/s for ${M_DURATION}s each"
  for shape in "${shapes[@]}"; do
    for ((r = 1; r <= M_REPS; r++)); do
      for ((i = 0; i < n; i++)); do
        m_run "$shape" "${strats[$(( (i + r - 1) % n ))]}" "$r" || return 1
      done
    done
  done
  log "multiturn: every run is done"
}

mcollect() {
  local done total
  done=$(find "$M_DIR" -maxdepth 1 -name 'mt*-r*.json' ! -name '*.tmp.json' 2>/dev/null | wc -l)
  IFS=, read -r -a shapes <<< "$M_SHAPES"
  IFS=, read -r -a strats <<< "$M_STRATEGIES"
  total=$(( ${#shapes[@]} * ${#strats[@]} * M_REPS ))
  fg -m fleetgate_tools.bench.multiturn_tables "$M_DIR" "$OUT" > /dev/null
  nvidia-smi > "$W/logs/nvidia-smi-end.txt" 2>&1
  tar -C "$W" -czf "$OUT/logs-multiturn.tgz" logs mt 2>/dev/null
  cat "$OUT/results-multiturn.md"
  if [ "$done" -ge "$total" ]; then
    log "multiturn: all $total runs done"
  else
    log "multiturn: $done of $total runs done: call again with the same command (the machine must still be warm)"
  fi
}

multiturn_all() {
  if [ ! -f "$W/setup.done" ]; then
    if [ "$MODE" != sim ] && [ ! -d .vl2 ]; then
      log "multiturn: this machine has no setup and this call carries no .vl2: start again from call 1"; return 1
    fi
    setup
  fi
  multiturn
  mcollect
}
