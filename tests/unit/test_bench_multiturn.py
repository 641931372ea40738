"""Issue 31's multi-turn benchmark pieces: the seeded conversation plan, the driver that plays a
conversation turn by turn with the engine's own answers, the client oracle, strategies with
gateway routing options, and the figures and tables of a run."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web

from fleetgate_tools.bench.conversations import (
    TURN_IDS,
    TurnLog,
    conversation_stats,
    conversations,
    live_context,
    plan_conversations,
    run_conversations,
)
from fleetgate_tools.bench.engines import WorkerRef
from fleetgate_tools.bench.fleet import FleetSpec, WorkerSpec
from fleetgate_tools.bench.loadgen import Outcome
from fleetgate_tools.bench.multiturn_tables import format_conversations, main
from fleetgate_tools.bench.strategies import make_route
from fleetgate_tools.bench.variants import gateway_args, parse
from fleetgate_tools.bench.workloads import BenchRequest, FleetFacts

FACTS = FleetFacts(model="m")
SMALL = {"system_prompts": 2, "system_tokens": 20, "context_tokens": 30, "turns_min": 2, "turns_max": 4,
         "user_tokens": 5, "max_tokens": 4, "think_s": 0.05, "think_min_s": 0.01}  # fmt: skip


def test_the_plan_is_seeded_and_shares_a_few_system_prompts() -> None:
    """Same seed, same conversations; each has its own document, 2-4 turns, and one of two
    shared system prompts; starts are a Poisson process inside the run."""
    first = list(itertools.islice(conversations("multiturn", 1, FACTS, SMALL), 30))
    assert first == list(itertools.islice(conversations("multiturn", 1, FACTS, SMALL), 30))
    assert first != list(itertools.islice(conversations("multiturn", 2, FACTS, SMALL), 30))
    assert len({c.system for c in first}) == 2 and len({c.context for c in first}) == 30
    assert all(2 <= len(c.turns) <= 4 and c.turns[0].think_s == 0 for c in first)
    assert all(t.think_s >= 0.01 for c in first for t in c.turns[1:])
    planned = plan_conversations(conversations("multiturn", 1, FACTS, SMALL), 2.0, 10.0, 1)
    assert planned == sorted(planned, key=lambda c: c.at) and 0 < planned[-1].at < 10 and 8 < len(planned) < 40


async def _engine(seen: list[dict[str, Any]]) -> tuple[web.AppRunner, str]:
    """A fake OpenAI engine: streams `answer-<n>` (n: the messages it got) in two pieces."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append({"body": body, "session": request.headers.get("x-session-id")})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for piece in ("answer-", str(len(body["messages"]))):
            chunk = {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_each_turn_carries_the_engines_own_answer_and_no_session() -> None:
    """Turn k+1 is the whole conversation so far with the answer the engine streamed for
    turn k; no x-session-id header and no `user` field go out; every planned turn is sent."""
    convs = plan_conversations(conversations("multiturn", 0, FACTS, SMALL), 4.0, 1.0, 0)
    seen: list[dict[str, Any]] = []

    async def go() -> tuple[list[Outcome], float, TurnLog]:
        runner, url = await _engine(seen)
        try:
            return await run_conversations(url, convs, drain_s=5)
        finally:
            await runner.cleanup()

    outcomes, _, log = asyncio.run(go())
    assert log.planned == log.sent == len(outcomes) == sum(len(c.turns) for c in convs)
    assert log.completed == len(convs) and all(not o.error for o in outcomes)
    assert all(s["session"] is None and "user" not in s["body"] for s in seen)
    for c in convs:
        bodies = [s["body"] for s in seen if s["body"]["messages"][0]["content"] == c.system
                  and c.context in s["body"]["messages"][1]["content"]]  # fmt: skip
        assert len(bodies) == len(c.turns)
        for earlier, later in itertools.pairwise(bodies):
            n = len(earlier["messages"])
            assert later["messages"][:n] == earlier["messages"]
            assert later["messages"][n] == {"role": "assistant", "content": f"answer-{n}"}
    assert {log.turn_of[o.id] for o in outcomes} == set(range(max(len(c.turns) for c in convs)))


def test_a_failed_turn_ends_its_conversation_and_the_drain_cuts_the_rest() -> None:
    """Against nothing listening, each conversation sends its first turn only (a transport
    error), and the figures count the turns sent against the planned."""
    convs = plan_conversations(conversations("multiturn", 0, FACTS, SMALL), 4.0, 1.0, 0)
    outcomes, _, log = asyncio.run(run_conversations("http://127.0.0.1:9", convs, drain_s=2))
    assert log.sent == len(convs) < log.planned and all(o.error == "transport" for o in outcomes)
    stats = conversation_stats(outcomes, log, len(convs))
    assert stats["turns_sent"] == len(convs) and stats["conversations_completed"] == 0


def test_stats_split_first_and_later_turns_and_count_moves() -> None:
    """TTFT of first turns apart from later ones; `moved`: later turns on another worker."""
    log = TurnLog(planned=5, sent=5, completed=2)
    outs = []
    for cid, workers in ((0, ["a", "a", "b"]), (1, ["b", "b"])):
        for k, w in enumerate(workers):
            rid = cid * TURN_IDS + k
            log.turn_of[rid] = k
            outs.append(Outcome(id=rid, tag=f"conv-{cid}", worker=w, ttft=1.0 if k == 0 else 0.1, prompt_tokens=100 * (k + 1)))
    stats = conversation_stats(outs, log, 2)
    assert stats["ttft_p50_first"] == 1.0 and stats["ttft_p99_later"] == 0.1
    assert stats["moved"] == 0.3333 and stats["later_prompt_tokens_mean"] == 233.3
    run = {"workload": "multiturn", "policy": "p", "requests": 5, "ok": 5, "http_429": 0,
           "preemptions": 0.0, "prefix_hit_rate": 0.5, **stats}  # fmt: skip
    assert "2/2" in format_conversations([run]) and "5/5/5" in format_conversations([run])


def test_conversation_affinity_keeps_a_conversation_on_one_worker() -> None:
    """The oracle sends conversation k to worker k % N for every turn."""
    workers = [WorkerRef("w1", "http://b"), WorkerRef("w0", "http://a")]
    route = make_route("conversation_affinity", workers)
    req = lambda cid, k: BenchRequest(id=cid * TURN_IDS + k, at=0, model="m", messages=[], max_tokens=1, tag=f"conv-{cid}")  # noqa: E731
    assert [route(req(3, k)).id for k in range(3)] == ["w1"] * 3 and route(req(4, 0)).id == "w0"


def test_a_strategy_name_carries_routing_options(tmp_path: Path) -> None:
    """`fleet+kv_events=false` starts the fleet policy with the config's routing block and
    kv_events on top; a key the gateway does not know is left out and reported."""
    assert parse("fleet+kv_events=false+balance=0.3") == ("fleet+kv_events=false+balance=0.3", "fleet",
                                                          {"kv_events": False, "balance": 0.3})  # fmt: skip
    config = tmp_path / "gateway.yaml"
    config.write_text("gateway:\n  routing: {balance: 0.25, kv_high: 0.9}\n")
    knobs = frozenset({"balance", "kv_high", "kv_events"})
    got = gateway_args("fleet+kv_events=false+nope=1", config, knobs)
    assert got.policy == "fleet" and got.ignored == ["nope"]
    assert got.args[0] == "--set" and json.loads(got.args[1].split("=", 1)[1]) == {
        "balance": 0.25, "kv_high": 0.9, "kv_events": False}  # fmt: skip
    assert gateway_args("fleet", config, knobs).args == [] and gateway_args("fleet+nope=1", config, knobs).args == []
    with pytest.raises(ValueError, match="key=value"):
        parse("fleet+kv_events")


def test_a_fleet_with_a_model_folder_gives_agents_its_tokenizer() -> None:
    """model_path: agents get the folder as --model and serve it as the fleet's model name."""
    spec = FleetSpec(model="chat-7b", model_path="/m/tiny", workers=(WorkerSpec(id="w0"),))
    argv = spec.worker_argv(spec.workers[0], Path("/ad"))
    assert argv[argv.index("--model") + 1] == "/m/tiny" and argv[argv.index("--served-model-name") + 1] == "chat-7b"
    assert "--served-model-name" not in FleetSpec(model="x", workers=(WorkerSpec(id="w"),)).worker_argv(
        WorkerSpec(id="w"), Path("/ad"))  # fmt: skip


def test_the_gpu_tables_compare_precise_with_placed(tmp_path: Path) -> None:
    """results-multiturn.md: every run, the means, and issue 31's checks of the precise policy."""
    base = {"workload": "multiturn", "requests": 100, "ok": 100, "turns_planned": 100, "http_429": 0,
            "out_tok_s": 50.0, "preemptions": 0.0, "worker_share": {"a": 0.5, "b": 0.5}}  # fmt: skip
    for strategy, p99, hits in (("fleet+kv_events=false", 3.0, 0.6), ("fleet+kv_events=true", 1.0, 0.8),
                                ("direct_round_robin", 4.0, 0.4)):  # fmt: skip
        run = base | {"policy": strategy, "ttft_p50": 0.1, "ttft_p99": p99, "prefix_hit_rate": hits}
        (tmp_path / f"mt2-{strategy}-r1.json").write_text(json.dumps({"runs": [run], "meta": {"rate": 2.0}}))
    (tmp_path / "mt2-fleet+kv_events=true-r2.tmp.json").write_text("not json")
    assert main([str(tmp_path), str(tmp_path / "out")]) == 0
    text = (tmp_path / "out/results-multiturn.md").read_text()
    assert "| mt2: TTFT p99 of fleet+kv_events=false >= 1.5x fleet+kv_events=true's | PASS | 3.00x |" in text
    assert "| mt2: engine hit rate of fleet+kv_events=true above fleet+kv_events=false's | PASS |" in text
    data = msgspec.json.decode((tmp_path / "out/results-multiturn.json").read_bytes())
    assert [r["strategy"] for r in data["runs"]] == ["direct_round_robin", "fleet+kv_events=false", "fleet+kv_events=true"]


def test_live_context_holds_each_conversation_from_its_turn_to_the_next() -> None:
    """A conversation holds its last answered prompt + answer from that turn's start until its
    next turn starts (or its last answer ends); a failed turn holds nothing; the figures put
    the mean after the first 10 s over the fleet's KV cache."""
    turns = [Outcome(id=0, tag="conv-0", at=0.0, e2e=1.0, prompt_tokens=100, out_tokens=10),
             Outcome(id=1, tag="conv-0", at=2.0, e2e=1.0, prompt_tokens=200, out_tokens=10)]  # fmt: skip
    other = [Outcome(id=1000, tag="conv-1", at=1.0, e2e=0.5, prompt_tokens=50, error="timeout")]
    assert live_context({"conv-0": turns, "conv-1": other}, 3.5) == [110, 110, 110, 110, 210, 210, 0, 0]
    log = TurnLog(planned=3, sent=3, turn_of={0: 0, 1: 1, 1000: 0})
    stats = conversation_stats([*turns, *other], log, 2, window_s=3.5, kv_tokens=100)
    assert stats["live_tokens_max"] == 210 and stats["live_over_kv"] == pytest.approx(stats["live_tokens_mean"] / 100, abs=0.02)


def test_a_gateway_that_would_refuse_its_routing_options_is_found_before_a_run(tmp_path: Path) -> None:
    """variants.refusal checks the settings as the gateway does at start: a known option with a
    value of the wrong type is refused with the gateway's reason; a good one passes; and a
    gateway's log tail is boiled down to its `error:` line for the report of runs not run."""
    from fleetgate_tools.bench.runner import _refusal
    from fleetgate_tools.bench.variants import refusal

    config = tmp_path / "gateway.yaml"
    config.write_text("gateway:\n  routing: {balance: 0.25}\n")
    assert "routing.balance" in refusal("fleet+balance=[1]", config)
    assert refusal("fleet+balance=0.3", config) == "" and refusal("round_robin", config) == ""
    tail = "fleetgate: running the source\nusage: python -m gateway [-h]\npython -m gateway: error: bad setting `x`\n"
    assert _refusal(tail) == "python -m gateway: error: bad setting `x`"
