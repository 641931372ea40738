"""Chaos under steady load, with real processes and a real Redis: kill a worker, drain and
stop one, restart Redis, drop clients. Each test prints its figures (requests sent, failed,
resumed, p99) and asserts that nothing was lost."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path

import httpx
import pytest

from fleetgate.keys import LEASE_FIELD
from fleetgate.registry import Registry, connect
from fleetgate.schema import Load
from fleetgate_tools.redis_server import EmbeddedRedis
from tests.conftest import Fleet, children, wait_until

MODEL = "chaos-model"
TOKENS = 48


@dataclass
class Figures:
    sent: int = 0
    failed: list[str] = field(default_factory=list)
    streams: int = 0
    streams_complete: int = 0
    latencies: list[float] = field(default_factory=list)

    def report(self, name: str, resumed: int) -> str:
        p99 = statistics.quantiles(self.latencies, n=100)[98] if len(self.latencies) >= 2 else 0.0
        line = (f"chaos[{name}]: sent={self.sent} failed={len(self.failed)} streams={self.streams} "
                f"streams_complete={self.streams_complete} resumed={resumed} p99={p99 * 1000:.0f}ms")
        print(line)
        return line


class SteadyLoad:
    """A few client threads sending alternately whole and streamed requests until stopped."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.url = url
        self.figures = Figures()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> SteadyLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _run(self, index: int) -> None:
        n = 0
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while not self._stop.is_set():
                n += 1
                started = time.monotonic()
                stream = n % 2 == 0
                try:
                    ok, why = self._stream(client, index, n) if stream else self._plain(client, index, n)
                except httpx.HTTPError as exc:
                    ok, why = False, repr(exc)
                with self._lock:
                    self.figures.sent += 1
                    self.figures.latencies.append(time.monotonic() - started)
                    if stream:
                        self.figures.streams += 1
                        self.figures.streams_complete += ok
                    if not ok:
                        self.figures.failed.append(why)

    def _body(self, index: int, n: int) -> dict[str, object]:
        return {"model": MODEL, "max_tokens": TOKENS, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"client {index} request {n}"}]}

    def _plain(self, client: httpx.Client, index: int, n: int) -> tuple[bool, str]:
        resp = client.post("/v1/chat/completions", json=self._body(index, n))
        if resp.status_code != 200:
            return False, f"{resp.status_code} {resp.text[:200]}"
        return resp.json()["usage"]["completion_tokens"] == TOKENS, resp.text[:200]

    def _stream(self, client: httpx.Client, index: int, n: int) -> tuple[bool, str]:
        pieces, ids, finishes, done = 0, set(), 0, False
        with client.stream("POST", "/v1/chat/completions", json={**self._body(index, n), "stream": True}) as resp:
            if resp.status_code != 200:
                return False, f"{resp.status_code}"
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return False, f"error event {event}"
                    ids.add(event["id"])
                    for choice in event["choices"]:
                        pieces += bool(choice["delta"].get("content"))
                        finishes += bool(choice.get("finish_reason"))
        ok = done and len(ids) == 1 and finishes == 1 and pieces == TOKENS
        return ok, f"stream pieces={pieces} ids={len(ids)} finishes={finishes} done={done}"


def resumed_count(fleet: Fleet) -> int:
    return sum(p.output().count("gateway.stream_resumed") for p in fleet.procs if "gateway" in p.log_path.name)


@pytest.fixture
def three_workers(fleet_factory) -> Iterator[tuple[Fleet, str, dict[str, object]]]:  # type: ignore[no-untyped-def]
    fleet = fleet_factory()
    _, url = fleet.gateway("--set", "stall_timeout_s=2")
    agents = {wid: fleet.worker(wid, "--model", MODEL, "--option", "time_scale=0.3") for wid in ("a", "b", "c")}
    fleet.wait_ready(url, *agents)
    yield fleet, url, agents  # type: ignore[misc]


def test_sigkill_a_worker_under_load_loses_nothing(three_workers) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL a worker's agent and engine under load: no request fails, streams are resumed."""
    fleet, url, agents = three_workers
    engine = fleet.workers(url)["a"]["url"]
    with SteadyLoad(url) as load:
        time.sleep(1)
        # Kill it while it is streaming, so some answers must be continued elsewhere.
        wait_until(lambda: httpx.get(f"{engine}/sim/state").json()["running"] > 0, timeout=10, interval=0.01)
        victim = agents["a"]
        pids = children(victim.pid)
        victim.kill_group(signal.SIGKILL)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: "a" not in fleet.workers(url), timeout=6)
        time.sleep(1)
    figures = load.figures
    figures.report("sigkill", resumed_count(fleet))
    assert figures.sent > 20
    assert not [f for f in figures.failed if not f.startswith("stream")], figures.failed
    assert figures.streams_complete >= 0.99 * figures.streams, figures.failed


def test_drain_then_stop_under_load_loses_nothing(three_workers) -> None:  # type: ignore[no-untyped-def]
    """drain?stop=true under load: the worker finishes its requests, its agent stops, nothing fails."""
    fleet, url, agents = three_workers
    with SteadyLoad(url) as load:
        time.sleep(1.5)
        with fleet.admin(url) as admin:
            assert admin.post("/admin/workers/b/drain", params={"stop": "true"}).status_code == 200
        assert agents["b"].popen.wait(30) == 0
        assert "b" not in fleet.workers(url)
        time.sleep(0.5)
    figures = load.figures
    figures.report("drain-stop", resumed_count(fleet))
    assert figures.sent > 10 and figures.failed == []
    assert "agent.stop_requested" in agents["b"].output() and "agent.drained" in agents["b"].output()


def test_redis_restart_under_load_loses_nothing(fleet_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Redis dies and comes back empty: the gateway serves from its snapshot, agents re-register within 5 s."""
    server = EmbeddedRedis().start()
    try:
        fleet = Fleet(server.url, f"fgtest-{uuid.uuid4().hex[:8]}", tmp_path)
        try:
            _, url = fleet.gateway()
            for wid in ("a", "b", "c"):
                fleet.worker(wid, "--model", MODEL, "--option", "time_scale=0.1")
            fleet.wait_ready(url, "a", "b", "c")
            with SteadyLoad(url) as load:
                time.sleep(1)
                server.stop()
                wait_until(lambda: httpx.get(f"{url}/health").json()["status"] == "degraded", timeout=5)
                health = httpx.get(f"{url}/health").json()
                assert health["ready_workers"] == 3 and health["snapshot_age_s"] is not None
                time.sleep(1.5)
                server.start()
                restarted = time.monotonic()

                def registered() -> int:
                    with fleet.admin(url) as client:
                        resp = client.get("/admin/workers")
                    # A dead pooled connection is retried on a new one (fleetgate/connection.py):
                    # no call after the restart fails.
                    assert resp.status_code == 200, resp.text
                    return len(resp.json()["data"])

                wait_until(lambda: registered() == 3, timeout=5)
                back_s = time.monotonic() - restarted
                wait_until(lambda: httpx.get(f"{url}/health").json()["status"] == "ok", timeout=5)
                time.sleep(1)
            figures = load.figures
            print(f"chaos[redis-restart]: workers back in the registry after {back_s:.2f} s")
            figures.report("redis-restart", resumed_count(fleet))
            assert figures.sent > 10 and figures.failed == []
        finally:
            fleet.close()
    finally:
        server.stop()


def test_client_disconnect_aborts_the_engine_request_within_a_second(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    """A client that hangs up mid-stream: the engine's running count drops within 1 s."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    fleet.worker("w", "--model", MODEL, "--option", "time_scale=1.0")
    fleet.wait_ready(url, "w")
    engine = fleet.workers(url)["w"]["url"]

    def running() -> int:
        return int(httpx.get(f"{engine}/sim/state").json()["running"])

    body = {"model": MODEL, "prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()  # held: dropping the iterator would close the stream
        next(line for line in lines if line.startswith("data: "))
        assert running() == 1
    hung_up = time.monotonic()
    wait_until(lambda: running() == 0, timeout=1.0, interval=0.01)
    print(f"chaos[client-disconnect]: engine request aborted {1000 * (time.monotonic() - hung_up):.0f} ms after the hang-up")


def test_gateway_sigterm_finishes_streams_in_flight(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM to the gateway: it stops accepting, but a stream in flight runs to its end."""
    fleet = fleet_factory()
    gateway, url = fleet.gateway()
    fleet.worker("w", "--model", MODEL, "--option", "time_scale=0.3")
    fleet.wait_ready(url, "w")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 40, "ignore_eos": True, "stream": True}
    lines = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if len(lines) == 3:
                    gateway.send(signal.SIGTERM)
    assert lines[-1] == "data: [DONE]" and len(lines) == 41
    # uvicorn exits by re-raising the signal once its graceful shutdown is done.
    assert gateway.popen.wait(15) in (0, -signal.SIGTERM)


def _chat(client: httpx.Client, system: str) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 8, "ignore_eos": True,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]}
    return client.post("/v1/chat/completions", json=body)


def test_hung_engine_leaves_routing_within_seconds_and_comes_back(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    """SIGSTOP one of two engines: within a few seconds its agent publishes it unhealthy and every
    request goes to the other; after SIGCONT it is routable again."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    agents = {wid: fleet.worker(wid, "--model", MODEL, "--option", "time_scale=0.1") for wid in ("a", "b")}
    fleet.wait_ready(url, "a", "b")
    [engine] = children(agents["a"].pid)
    figures = Figures()
    os.kill(engine, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        wait_until(lambda: fleet.workers(url)["a"]["state"] == "unhealthy", timeout=8, interval=0.1)
        out_s = time.monotonic() - stopped
        fleet.wait_snapshot(url, since=time.time())  # the gateway routes on what the registry says now
        with httpx.Client(base_url=url, timeout=10) as client:
            for i in range(16):
                started = time.monotonic()
                resp = _chat(client, f"You are assistant number {i}. " * 20)
                figures.sent += 1
                figures.latencies.append(time.monotonic() - started)
                if resp.status_code != 200 or resp.headers.get("x-fleetgate-worker") != "b":
                    figures.failed.append(f"{resp.status_code} {resp.headers.get('x-fleetgate-worker')}")
        hung = fleet.workers(url)["a"]
        assert hung["unhealthy"] and "probes failed in a row" in str(hung["unhealthy"])
    finally:
        os.kill(engine, signal.SIGCONT)
    continued = time.monotonic()
    wait_until(lambda: fleet.workers(url)["a"]["state"] == "ready", timeout=5, interval=0.1)
    back_s = time.monotonic() - continued
    time.sleep(0.3)
    with httpx.Client(base_url=url, timeout=10) as client:
        served = {_chat(client, f"Another system prompt, {i}. " * 20).headers.get("x-fleetgate-worker")
                  for i in range(24)}
    print(f"chaos[hung-engine]: unhealthy {out_s:.2f} s after SIGSTOP, ready {back_s:.2f} s after SIGCONT")
    figures.report("hung-engine", resumed_count(fleet))
    assert out_s < 6 and figures.sent == 16 and figures.failed == [], figures.failed
    assert served == {"a", "b"}
    out = agents["a"].output()
    assert "agent.engine_unhealthy" in out and "agent.engine_recovered" in out and "agent.reregister" not in out


def test_redis_restart_keeps_an_operators_drain(fleet_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Drain a worker, restart Redis empty: its agent registers it again drained; it never turns
    ready and takes no traffic, while the load on the other worker loses nothing."""
    server = EmbeddedRedis().start()
    try:
        fleet = Fleet(server.url, f"fgtest-{uuid.uuid4().hex[:8]}", tmp_path)
        try:
            _, url = fleet.gateway()
            agents = {wid: fleet.worker(wid, "--model", MODEL, "--option", "time_scale=0.1") for wid in ("a", "b")}
            fleet.wait_ready(url, "a", "b")
            with fleet.admin(url) as admin:
                assert admin.post("/admin/workers/a/drain").status_code == 200
            wait_until(lambda: "agent.admin_drain" in agents["a"].output(), timeout=5)
            states: list[object] = []
            with SteadyLoad(url) as load:
                time.sleep(1)
                server.stop()
                time.sleep(1.5)
                server.start()
                restarted = time.monotonic()
                while time.monotonic() - restarted < 4:
                    try:
                        states.append(fleet.workers(url).get("a", {}).get("state"))
                    except (httpx.HTTPError, KeyError, ValueError):
                        pass  # the gateway has not reconnected yet
                    time.sleep(0.1)
            a = fleet.workers(url)["a"]
            engine = a["url"]
            figures = load.figures
            print(f"chaos[redis-restart-drain]: states of the drained worker after the restart: "
                  f"{sorted({str(s) for s in states})}")
            figures.report("redis-restart-drain", resumed_count(fleet))
            assert "ready" not in states and states[-1] == "draining"
            assert a["admin_drain"] is True and a["agent_state"] == "ready"
            assert figures.sent > 10 and figures.failed == []
            with httpx.Client(base_url=url, timeout=10) as client:
                assert {_chat(client, f"prompt {i}").headers.get("x-fleetgate-worker") for i in range(8)} == {"b"}
            assert httpx.get(f"{engine}/sim/state").json()["running"] == 0
            assert "agent.reregister" in agents["a"].output()
        finally:
            fleet.close()
    finally:
        server.stop()


# Two slots held by the long streams, one for the whole requests that take turns in it.
ADAPTER_SLOTS = 3
STREAM_TOKENS = 1000
# The engine's base step while the evictions run: x time_scale 0.1 (and the LoRA factor), a
# step of ~0.23 s, so that a stream of STREAM_TOKENS lasts over 200 s. The simulator sleeps
# out each step and never catches up when it falls behind, so a slower machine only makes a
# stream last longer; the evictions take ~6 s. Afterwards the streams finish at full speed.
SLOW_STEP_S = 2.0
WHOLE_ADAPTERS = [f"adp{i}" for i in range(3, 9)]


class HeldStream(threading.Thread):
    """One long adapter stream read to its end in a thread. Records the worker it ran on and
    (unix times, as the gateways' logs) when its first token came and when it ended."""

    def __init__(self, url: str, adapter: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.adapter = adapter
        self.worker = ""
        self.first_at = 0.0
        self.end_at = 0.0
        self.pieces = 0
        self.finishes = 0
        self.done = False
        self.error = ""

    def run(self) -> None:
        body = {"model": self.adapter, "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": "a long answer"}]}
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=60) as resp:
                if resp.status_code != 200:
                    self.error = f"{resp.status_code} {resp.read()[:200]!r}"
                    return
                self.worker = resp.headers["x-fleetgate-worker"]
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.error = f"error event {event}"
                            return
                        for choice in event["choices"]:
                            self.pieces += bool(choice["delta"].get("content"))
                            self.finishes += bool(choice.get("finish_reason"))
                        if self.pieces and not self.first_at:
                            self.first_at = time.time()
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        finally:
            self.end_at = time.time()

    def under_way(self) -> bool:
        """Its first token came (or it failed before one)."""
        return bool(self.first_at or self.error)

    @property
    def whole(self) -> bool:
        return not self.error and self.done and self.finishes == 1 and self.pieces == STREAM_TOKENS


def _text(raw: object) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


async def _eviction_inputs(fleet: Fleet, worker_id: str) -> tuple[Load | None, dict[str, tuple[float, set[str]]]]:
    """What a gateway about to evict from `worker_id` reads in Redis: the worker's last
    published load (the adapters its engine runs, as scraped at `load.ts`), and per gateway
    the adapters it has requests in flight for there, with the time it took that count."""
    redis = connect(fleet.redis_url)
    try:
        registry = Registry(redis, fleet.prefix)
        view = await registry.read(worker_id)
        published: dict[str, tuple[float, set[str]]] = {}
        for member in await redis.smembers(registry.keys.gateways):  # type: ignore[misc]
            gateway_id = _text(member)
            row = {_text(k): _text(v) for k, v in (await redis.hgetall(registry.keys.lora(gateway_id))).items()}  # type: ignore[misc]
            at = float(row.pop(LEASE_FIELD, 0.0))
            published[gateway_id] = (at, {key.partition("\t")[2] for key in row if key.partition("\t")[0] == worker_id})
        return (view.load if view else None), published
    finally:
        await redis.aclose()


def _streams_seen(fleet: Fleet, worker_id: str, adapters: set[str]) -> bool:
    """Every gateway can see that `adapters` are in use on the worker: its engine reports them
    running, and the gateways' published in-flight counts hold them."""
    load, published = asyncio.run(_eviction_inputs(fleet, worker_id))
    in_flight = set().union(*(held for _, held in published.values()))
    return load is not None and adapters <= set(load.lora_active) and adapters <= in_flight


def _idle_everywhere(fleet: Fleet, worker_id: str, adapter: str, after: float, gateways: int) -> bool:
    """`adapter`, whose last request was answered at `after`, is idle by everything a gateway's
    eviction reads: a load scraped since shows it not running, and each gateway has published
    its in-flight counts since (the count and its time are taken together), without it."""
    load, published = asyncio.run(_eviction_inputs(fleet, worker_id))
    return (load is not None and load.ts > after and adapter not in load.lora_active
            and len(published) == gateways
            and all(at > after and adapter not in held for at, held in published.values()))


def _evictions(log: str) -> list[tuple[str, str, float]]:
    """(worker, evicted adapter, unix time) of every eviction a gateway logged."""
    out: list[tuple[str, str, float]] = []
    for line in log.splitlines():
        if '"gateway.adapter_loaded"' not in line:
            continue
        event = json.loads(line)
        if event.get("evicted"):
            at = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
            out.extend((event["worker"], adapter, at) for adapter in event["evicted"].split(","))
    return out


def test_adapter_eviction_under_streams_loses_nothing(fleet_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """One worker with three LoRA slots, two gateways, eight adapters. A long stream of adp1
    (through one gateway) and one of adp2 (through the other) hold two slots; whole requests for
    adp3..adp8, one at a time and through the gateways in turn, each need the third slot, so from
    adp4 on each load must evict the adapter before it: five evictions, each by the gateway that
    did not serve the victim, all while both streams run. No adapter of a live stream is evicted,
    no load is oversubscribed, every request is answered and both streams arrive whole."""
    adapters = {}
    for i in range(1, 9):
        (tmp_path / f"adp{i}").mkdir()
        adapters[f"adp{i}"] = {"path": str(tmp_path / f"adp{i}"), "base": MODEL}
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(json.dumps({"gateway": {"adapters": adapters}}))
    fleet = fleet_factory()
    gateways = [fleet.gateway("--config", str(cfg)) for _ in range(2)]
    urls = [url for _, url in gateways]
    fleet.worker("w", "--model", MODEL, "--option", "time_scale=0.1", "--option", "enable_lora=true",
                 "--option", f"max_loras={ADAPTER_SLOTS}")
    for url in urls:
        fleet.wait_ready(url, "w")
    engine = fleet.workers(urls[0])["w"]["url"]
    assert httpx.post(f"{engine}/sim/profile", json={"base_step_s": SLOW_STEP_S}).status_code == 200

    streams = [HeldStream(urls[0], "adp1"), HeldStream(urls[1], "adp2")]
    for stream in streams:  # one at a time: each placed, and running, before the next is sent
        stream.start()
        wait_until(stream.under_way, timeout=60)
        assert stream.worker == "w" and not stream.error, stream.error
    wait_until(lambda: _streams_seen(fleet, "w", {"adp1", "adp2"}), timeout=30)

    figures = Figures(streams=len(streams))
    evicting = time.monotonic()
    with httpx.Client(timeout=60) as client:
        for i, adapter in enumerate(WHOLE_ADAPTERS):
            body = {"model": adapter, "max_tokens": 1, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"request {i}"}]}
            started = time.monotonic()
            resp = client.post(f"{urls[i % 2]}/v1/chat/completions", json=body)
            answered = time.time()
            figures.sent += 1
            figures.latencies.append(time.monotonic() - started)
            assert resp.status_code == 200 and resp.headers["x-fleetgate-worker"] == "w", resp.text
            assert resp.json()["usage"]["completion_tokens"] == 1
            placed = set(fleet.workers(urls[0])["w"]["adapters"])
            assert placed == {"adp1", "adp2", adapter}, f"after {adapter} the worker holds {sorted(placed)}"
            # The next load evicts this adapter only if every gateway can tell it is idle.
            wait_until(partial(_idle_everywhere, fleet, "w", adapter, answered, len(urls)), timeout=30)
    evicting_s = time.monotonic() - evicting
    # The precondition, checked: both streams still run on the engine after the last eviction.
    assert httpx.get(f"{engine}/sim/state").json()["running_lora_adapters"] == ["adp1", "adp2"]
    assert not any(s.end_at for s in streams), [(s.adapter, s.pieces, s.error) for s in streams]
    assert httpx.post(f"{engine}/sim/profile", json={"base_step_s": 0.0}).status_code == 200
    for stream in streams:
        stream.join(120)
        assert not stream.is_alive()
    figures.streams_complete = sum(s.whole for s in streams)

    logs = [proc.output() for proc, _ in gateways]
    by_gateway = [[a for _, a, _ in _evictions(log)] for log in logs]
    evictions = [e for log in logs for e in _evictions(log)]
    under = [(w, a, at) for w, a, at in evictions for s in streams
             if (w, a) == (s.worker, s.adapter) and s.first_at < at < s.end_at]
    oversubscribed = sum(log.count("gateway.adapter_oversubscribed") for log in logs)
    print(f"chaos[eviction-under-stream]: evictions={len(evictions)} under_a_stream={len(under)} "
          f"oversubscribed={oversubscribed} evicting_s={evicting_s:.1f} (streams last > 200 s)")
    figures.report("eviction-under-stream", resumed_count(fleet))
    # Each eviction by the gateway that did not serve the victim (the first gateway served
    # adp3, adp5, adp7), all from the worker and all while both streams ran.
    assert by_gateway == [["adp4", "adp6"], ["adp3", "adp5", "adp7"]], by_gateway
    assert {w for w, _, _ in evictions} == {"w"}
    assert all(s.first_at < at < s.end_at for _, _, at in evictions for s in streams)
    assert under == [] and oversubscribed == 0
    assert figures.streams_complete == 2, [(s.adapter, s.pieces, s.finishes, s.done, s.error) for s in streams]


def test_slow_engine_under_load_loses_nothing(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    """One of three engines turns ~80x slower under load (and back): its whole answers outlast the
    2 s first-byte base but are waited for (the limit grows with max_tokens), not given up on and
    redone elsewhere; its streams go on at its pace; no request fails."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--set", "stall_timeout_s=2", "--set", "first_byte_timeout_s=2")
    for wid in ("a", "b", "c"):
        fleet.worker(wid, "--model", MODEL, "--option", "time_scale=0.3")
    fleet.wait_ready(url, "a", "b", "c")
    engine = fleet.workers(url)["a"]["url"]
    normal = httpx.get(f"{engine}/sim/profile").json()["base_step_s"]
    slow_s = 0.0
    with SteadyLoad(url) as load:
        time.sleep(1)
        assert httpx.post(f"{engine}/sim/profile", json={"base_step_s": 0.2}).status_code == 200
        slowed = time.monotonic()
        time.sleep(8)
        slow_s = time.monotonic() - slowed
        assert httpx.post(f"{engine}/sim/profile", json={"base_step_s": normal}).status_code == 200
        time.sleep(1)
    figures = load.figures
    logs = "".join(p.output() for p in fleet.procs if "gateway" in p.log_path.name)
    retried = logs.count('"gateway.retry"')
    print(f"chaos[slow-engine]: worker a at 0.06 s a token for {slow_s:.0f} s, retried={retried}")
    figures.report("slow-engine", resumed_count(fleet))
    assert figures.sent > 10 and figures.failed == [], figures.failed
    assert retried == 0  # no slow answer was given up on and done again elsewhere
