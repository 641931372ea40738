#!/usr/bin/env bash
# Does compose.yaml's GPU worker really start LMDeploy on an LMDeploy card? Runs, on the
# H200 GPU machine, the exact engine argv that worker-gpu0's command plans on a T4 and on
# an RTX 4090 (the cards' nvidia-smi output from tests/data; adapters given, so the
# PyTorch backend), with a small random-weight model and LoRA in place of the real ones.
#
#   scripts/gpu_compose_lmdeploy.sh prepare .lm0   # here: LMDeploy payload + the planned argvs (~1 min)
#   scripts/gpu_compose_lmdeploy.sh run .lm0       # on the GPU machine (send .lm0; ~4 min), results in $OUT
#
# .lm0 must be git-ignored (e.g. in .git/info/exclude) and carried to the GPU machine.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cmd=${1:?usage: gpu_compose_lmdeploy.sh prepare|run DIR}
dir=$(cd "${2:?usage: gpu_compose_lmdeploy.sh prepare|run DIR}" 2>/dev/null && pwd || echo "$2")
cards=(t4 rtx4090)

if [ "$cmd" = prepare ]; then
  set -e
  mkdir -p "$dir"
  shared=${FLEETGATE_SHARED:-$root/../shared}
  bash "$shared/gpu/build_lmdeploy_payload.sh" "$dir"
  cp "$shared/gpu/make_weights_model.py" "$dir/"
  python=${FLEETGATE_PYTHON:-$root/.venv/bin/python}
  for card in "${cards[@]}"; do
    # worker-gpu0's command as compose.yaml writes it (defaults of its ${VAR:-...}), dry-run on the card.
    argv=$("$python" - "$root" "$card" <<'PY'
import re, subprocess, sys, yaml
root, card = sys.argv[1], sys.argv[2]
cmd = yaml.safe_load(open(f"{root}/compose.yaml"))["services"]["worker-gpu0"]["command"]
cmd = [re.sub(r"\$\{(\w+)(?::?-([^}]*)|:\?[^}]*)?\}", lambda m: m.group(2) or "x", str(a)) for a in cmd]
out = subprocess.run(["bash", f"{root}/{cmd[0]}", *cmd[1:], "--dry-run", "--nvidia-smi-output",
                      f"{root}/tests/data/nvidia-smi/{card}.txt"], capture_output=True, text=True, check=True).stdout
print(out.strip().splitlines()[-1])
PY
)
    # The image's python, and the small model and LoRA in place of /models and /adapters.
    echo "$argv" | sed -E "s#[^ ]*/python[0-9.]* -m lmdeploy#python3 -m lmdeploy#; s#/models/[^ ]+#/tmp/lmd/m05#; s#=/adapters/[^ ,]+#=/tmp/lmd/lora#g" \
      > "$dir/argv_$card.txt"
    echo "$card: $(cat "$dir/argv_$card.txt")"
  done
  exit 0
fi

[ "$cmd" = run ] || { echo "usage: gpu_compose_lmdeploy.sh prepare|run DIR" >&2; exit 2; }
out=${OUT:-/tmp/lmd/out}
mkdir -p "$out"
test "$(cat "$dir"/lmdeploy018-slim.tar.xz.part* | sha256sum | cut -d' ' -f1)" = "$(cat "$dir/lmdeploy018-slim.sha256")" \
  || { echo "payload sha256 mismatch" >&2; exit 1; }
mkdir -p /tmp/lmd/site && cat "$dir"/lmdeploy018-slim.tar.xz.part* | tar -xJ -C /tmp/lmd/site
export PYTHONPATH=/tmp/lmd/site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
python3 "$dir/make_weights_model.py" /tmp/lmd/m05 /tmp/lmd/lora > "$out/make_model.log" 2>&1 \
  || { tail -20 "$out/make_model.log"; exit 1; }
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits | tee "$out/nvidia-smi.txt"
failed=0
for card in "${cards[@]}"; do
  read -r -a argv < "$dir/argv_$card.txt"
  port=$(printf '%s\n' "${argv[@]}" | grep -A1 -- '--server-port' | tail -1)
  echo "== $card: ${argv[*]}" | tee -a "$out/summary.txt"
  start=$(date +%s)
  setsid env "${argv[@]}" > "$out/lmdeploy_$card.log" 2>&1 &
  pid=$!
  up=0
  for _ in $(seq 1 300); do
    kill -0 "$pid" 2>/dev/null || { echo "$card: the engine exited" | tee -a "$out/summary.txt"; break; }
    if curl -sf "http://127.0.0.1:$port/v1/models" > "$out/models_$card.json"; then up=1; break; fi
    sleep 1
  done
  echo "$card: up=$up after $(( $(date +%s) - start )) s: $(cat "$out/models_$card.json" 2>/dev/null)" | tee -a "$out/summary.txt"
  for model in qwen2.5-7b-instruct support-bot; do
    [ "$up" = 1 ] || break
    code=$(curl -s -o "$out/completion_${card}_$model.json" -w '%{http_code}' "http://127.0.0.1:$port/v1/completions" \
      -H 'content-type: application/json' -d "{\"model\":\"$model\",\"prompt\":\"hello\",\"max_tokens\":16}")
    echo "$card $model: HTTP $code $(head -c 200 "$out/completion_${card}_$model.json")" | tee -a "$out/summary.txt"
    [ "$code" = 200 ] || failed=1
  done
  [ "$up" = 1 ] || { failed=1; tail -20 "$out/lmdeploy_$card.log"; }
  kill -TERM -- -"$pid" 2>/dev/null; sleep 5; kill -KILL -- -"$pid" 2>/dev/null; sleep 2
done
exit $failed
