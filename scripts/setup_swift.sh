#!/usr/bin/env bash
# Builds the venv that runs a real ms-swift `swift deploy` on a machine without a GPU,
# apart from the project's own venv: ms-swift pins its own torch, transformers and
# FastAPI, which must not leak into fleetgate's environment.
#
#   scripts/setup_swift.sh [VENV_DIR]      (default: .venv-swift at the repository root)
#
# Every package is pinned by scripts/locks/swift.txt (pip constraints, `pip freeze` of a
# venv the tests passed with; scripts/locks/update.sh rewrites it): transitive
# dependencies otherwise resolve afresh on each machine (transformers, openai, ...).
#
# Idempotent: a stamp file inside the venv records a finished install of exactly these
# pins and that lock (its hash); with it present a rerun does nothing. A half-finished
# venv (no stamp) or a changed lock is completed, not rebuilt: pip skips what is already
# installed as the lock says and replaces what is not.
set -euo pipefail

SWIFT_VERSION="4.6.0"
# torch comes from the wheel on this machine's disk (pip's find-links): the CPU build.
# It is installed first so that ms-swift's `torch` requirement is already met and pip
# never reaches for PyPI's CUDA build.
TORCH_VERSION="2.13.0"
TORCH_EXPECTED="2.13.0+cpu"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-swift}"
STAMP="$VENV/.fleetgate-ready"  # the Makefile's target
LOCK="$ROOT/scripts/locks/swift.txt"
WANT="ms-swift==$SWIFT_VERSION torch==$TORCH_EXPECTED lock=$(sha256sum "$LOCK" | cut -c1-16)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    echo "setup_swift: $VENV is ready ($WANT)"
    exit 0
fi

say() { echo "setup_swift: $*"; }
started=$SECONDS

PYTHON="${PYTHON:-python3.11}"
if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating venv $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
# Keep the venv out of git wherever it lives (Python 3.13's venv does this itself).
[[ -f "$VENV/.gitignore" ]] || echo "*" > "$VENV/.gitignore"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# pip's config already names /opt/wheels; say it again so a bare environment (no
# PIP_FIND_LINKS, another pip.conf) still takes the CPU torch instead of PyPI's CUDA one.
FIND_LINKS=()
if compgen -G "/opt/wheels/torch-*+cpu-*.whl" > /dev/null; then
    FIND_LINKS=(--find-links /opt/wheels)
fi
quiet() { grep -v "is ignored: it is neither" >&2 || true; }

say "installing torch==$TORCH_VERSION (the CPU wheel on disk)..."
"${PIP[@]}" install -q "${FIND_LINKS[@]}" -c "$LOCK" "torch==$TORCH_VERSION" 2> >(quiet)

say "installing ms-swift==$SWIFT_VERSION (about 2 min, ~2 GB)..."
"${PIP[@]}" install -q "${FIND_LINKS[@]}" -c "$LOCK" "ms-swift==$SWIFT_VERSION" "torch==$TORCH_VERSION" 2> >(quiet)

say "checking the install"
"$VENV/bin/python" "$ROOT/scripts/locks/check.py" "$LOCK"
"$VENV/bin/python" - "$TORCH_EXPECTED" <<'EOF'
import importlib.metadata as md
import sys

import torch

want = sys.argv[1]
if torch.__version__ != want or torch.version.cuda is not None:
    sys.exit(f"setup_swift: expected CPU torch {want}, got {torch.__version__} (cuda {torch.version.cuda})")
import transformers
import swift.cli.deploy  # noqa: F401
print(f"setup_swift: ms-swift {md.version('ms-swift')}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
EOF

echo "$WANT" > "$STAMP"
say "done in $((SECONDS - started)) s: $VENV"
