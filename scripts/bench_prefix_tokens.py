#!/usr/bin/env python
"""What precise prefix routing costs the gateway per request: the old path (render the chat
template, tokenize the whole text) beside the new one (the text tokenized piece by piece
between the template's special tokens, pieces seen before taken from the cache;
gateway/request/token_pieces.py), side by side in one run; issue 31.

    FLEETGATE_PURE=1 .venv/bin/python scripts/bench_prefix_tokens.py
    .venv/bin/python scripts/bench_prefix_tokens.py --model .cache/tiny/model --requests 400 --rounds 3

Each round times `PrefixCache.held` (what the gateway calls per chat when events are on) over
the same requests with a fresh cache for each path, the paths in turn, against two workers
whose indexes hold the prompts of the first requests; the answers (exact token count, tokens
held per worker) must be the same for both. `count-0` and `count`: the token count the gateway
makes without events (gateway/request/requests.py `TokenCounter.count`), every text encoded
(`max_chars=0`) beside long texts' counts kept (the default); their counts must agree. Workloads: the
bench's `pressure` (16 tenants, ~1,500-token system prompts, a ~65-token question each) and
`multiturn` (shared system prompts, a document per conversation, the turns' history).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleetgate.kv_index import chain_keys  # noqa: E402
from fleetgate.kv_registry import KvMirror, WorkerKv  # noqa: E402
from fleetgate_tools.bench.conversations import conversations, sample_turns  # noqa: E402
from fleetgate_tools.bench.workloads import FleetFacts, contents, words  # noqa: E402
from gateway.request.prefix_cache import PrefixCache  # noqa: E402
from gateway.request.requests import CACHED_CHARS, TokenCounter  # noqa: E402
from gateway.wire import Probe  # noqa: E402

BLOCK = 16


class _Mirror(KvMirror):
    """Two workers' indexes, fixed."""

    def __init__(self, workers: dict[str, WorkerKv]) -> None:
        super().__init__()
        self.fixed = workers

    def get(self, worker_id: str) -> WorkerKv | None:
        return self.fixed.get(worker_id)


def probes(workload: str, n: int, seed: int) -> list[Probe]:
    fleet = FleetFacts(model="m")
    if workload == "multiturn":
        params = {"system_prompts": 4, "system_tokens": 1000, "context_tokens": 2000, "turns_min": 3,
                  "turns_max": 8, "user_tokens": 100, "max_tokens": 64}  # fmt: skip
        rng = random.Random(seed)
        convs = conversations("multiturn", seed, fleet, params)
        drafts = sample_turns([next(convs) for _ in range(max(1, n // 5))], lambda k: words(rng, k))
        # In arrival order, roughly: conversations interleave.
        rng.shuffle(drafts)
        messages = [d.messages for d in drafts[:n]]
    else:
        gen = contents(workload, seed, fleet, {})
        messages = [next(gen).messages for _ in range(n)]
    raw = [msgspec.json.encode({"model": "m", "messages": m, "max_tokens": 64}) for m in messages]
    return [msgspec.json.decode(r, type=Probe) for r in raw]


def indexes(counter: TokenCounter, reqs: Sequence[Probe], warm: int) -> dict[str, WorkerKv]:
    """w0 and w1 holding the prompts of the first `warm` requests, in turn."""
    cache = PrefixCache(_Mirror({}), cut_pieces=False)
    builder = cache._builder(counter)
    held: dict[str, set[int]] = {"w0": set(), "w1": set()}
    for k, probe in enumerate(reqs[:warm]):
        ids = builder.ids(probe) or []
        held[f"w{k % 2}"].update(chain_keys(ids, BLOCK))
    return {w: WorkerKv(gen=1, version=1, state="events", reason="", block_size=BLOCK, keys=keys)
            for w, keys in held.items()}  # fmt: skip


def timed(call: Callable[[Probe], Any], reqs: Sequence[Probe]) -> tuple[list[float], float, list[Any]]:
    """Each call's wall time (µs), the process's CPU time per call (µs: the tokenizer's own
    threads included; steadier than wall time on a busy machine), the answers."""
    times, answers = [], []
    cpu0 = time.process_time()
    for probe in reqs:
        t0 = time.perf_counter()
        answers.append(call(probe))
        times.append((time.perf_counter() - t0) * 1e6)
    return times, (time.process_time() - cpu0) / len(reqs) * 1e6, answers


def row(name: str, times: Sequence[float], cpu: float) -> str:
    q = statistics.quantiles(times, n=100)
    return f"{name:<8} {statistics.fmean(times):>9.0f} {q[49]:>8.0f} {q[98]:>8.0f} {cpu:>9.0f}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".cache/tiny/model"), help="folder with tokenizer.json and a chat template")
    ap.add_argument("--workloads", default="pressure,multiturn")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    counter = TokenCounter(str(Path(args.model) / "tokenizer.json"))
    print(f"tokenizer {args.model}; PrefixCache.held per request, µs (a fresh cache each round)")
    for workload in args.workloads.split(","):
        reqs = probes(workload, args.requests, args.seed)
        mirror = _Mirror(indexes(counter, reqs, 32))
        slots: Any = [SimpleNamespace(id=w) for w in ("w0", "w1")]
        print(f"\n{workload}: {len(reqs)} requests, {statistics.fmean(len(p.messages or []) for p in reqs):.1f} messages each")
        print(f"{'round':<6} {'path':<8} {'wall mean':>9} {'p50':>8} {'p99':>8} {'CPU mean':>9}")
        p50s: dict[str, list[float]] = {"old": [], "new": [], "count-0": [], "count": []}
        cpus: dict[str, list[float]] = {"old": [], "new": [], "count-0": [], "count": []}
        for r in range(args.rounds):
            answers = {}
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for path in order:
                cache = PrefixCache(mirror, cut_pieces=path == "new")
                times, cpu, answers[path] = timed(partial(cache.held, slots, counter), reqs)
                p50s[path].append(statistics.median(times))
                cpus[path].append(cpu)
                print(f"{r + 1:<6} {row(path, times, cpu)}")
            if answers["old"] != answers["new"]:
                print("DIFFERENT ANSWERS: old and new paths disagree", file=sys.stderr)
                return 1
            counts = {}
            for path, kept in (("count-0", 0), ("count", CACHED_CHARS)):  # a fresh counter each
                fresh = TokenCounter(counter.path, max_chars=kept)
                times, cpu, counts[path] = timed(fresh.count, reqs)
                p50s[path].append(statistics.median(times))
                cpus[path].append(cpu)
                print(f"{r + 1:<6} {row(path, times, cpu)}")
            if counts["count-0"] != counts["count"]:
                print("DIFFERENT COUNTS: kept and fresh token counts disagree", file=sys.stderr)
                return 1
        hits = sum(1 for n, held in answers["new"] if n and held)
        print(f"{workload}: answers identical; {hits}/{len(reqs)} with a hit; median over rounds, µs per request:")
        for path in ("old", "new", "count-0", "count"):
            print(f"  {path:<6} CPU {statistics.median(cpus[path]):>7.0f}   wall p50 {statistics.median(p50s[path]):>7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
