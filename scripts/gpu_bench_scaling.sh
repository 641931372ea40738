#!/usr/bin/env bash
# Issue 17's scaling table on a machine with cores to spare (the 16-core GPU host, no network):
# fleetgate with 1, 2, 4, 8 gateway processes (`python -m gateway --workers N`), vllm-router
# and direct, side by side in one run of scripts/bench_overhead.py.
#
#   here, with the index: scripts/gpu_payload.sh's step 4 (fleetgate's wheels) into .whl/, then
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       -d .whl vllm-router==0.1.17 setproctitle orjson pydantic pydantic-core annotated-types \
#       typing-inspection fastapi==0.115.12 starlette==0.46.2
#     (a newer fastapi imports opentelemetry, which the GPU image lacks)
#   T0=$(date +%s) DEADLINE_S=300 OUT=$OUT bash scripts/gpu_bench_scaling.sh   # there, carry .whl
#
# GPU_BENCH_ENGINE=sim (any machine): the same run with this checkout's .venv, for a dry run.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-.run/scaling}
mkdir -p "$out"
T0=${T0:-$(date +%s)}
DEADLINE_S=${DEADLINE_S:-300}
left() { echo $(( DEADLINE_S - ($(date +%s) - T0) )); }
if [ "${GPU_BENCH_ENGINE:-}" = sim ]; then
  python=.venv/bin/python
else
  python=python3
  rm -rf /tmp/site && mkdir -p /tmp/site /tmp/bin  # pip --target keeps what a warm machine has
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    > "$out/pip.log" 2>&1 || { tail -20 "$out/pip.log"; exit 1; }
  export PYTHONPATH=/tmp/site:$root
  printf '#!/bin/sh\nexec %s -m vllm_router.launch_router "$@"\n' "$(command -v "$python")" > /tmp/bin/vllm-router
  chmod +x /tmp/bin/vllm-router
  export PATH=/tmp/bin:$PATH
fi
echo "scaling: $(nproc) cores, $("$python" --version), $(left) s left"
timeout "$(( $(left) - 10 ))" "$python" scripts/bench_overhead.py \
  --gateway-workers "${S_WORKERS:-1,2,4,8}" --concurrency "${S_CONCURRENCY:-64,256}" --modes plain,stream \
  --stubs "${S_STUBS:-4}" --loadgen-procs "${S_LOADGEN:-4}" --rounds "${S_ROUNDS:-2}" \
  --duration "${S_DURATION:-2.5}" --warmup 0.5 --timing-requests 0 \
  --json "$out/scaling.json" --run-dir "$out/run" 2> "$out/progress.log" | tee "$out/table.txt"
rc=${PIPESTATUS[0]}
tail -5 "$out/progress.log"
exit "$rc"
