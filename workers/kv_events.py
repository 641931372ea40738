"""The agent's subscriber to its engine's KV cache events, and whether they can be trusted.

One task (`KvEventSubscriber.run`) reads vLLM's (or the simulator's) ZMQ PUB stream
(fleetgate/kv_events.py), applies each batch to a `BlockIndex` (fleetgate/kv_index.py) in
sequence order, and keeps a health state that the agent publishes beside the index
(fleetgate/kv_registry.py):

- "events": every batch since the publisher's first (seq 0) or since the last
  AllBlocksCleared was applied, and the publisher is there;
- "lost", with the reason: the gateway falls back to its approximate placement for this
  worker. Reasons: the publisher disconnected (the engine died or restarted: the index is
  cleared), it is silent (no batch and no answer on the replay socket for `silence_s`), a gap
  the replay buffer no longer holds, a batch that does not decode, or not synced yet.

How it stays in sync:

- On every (re)connection to the publisher: resync. Clear the index and replay from seq 0
  ("lost" until the replay's end marker: a partial index is not to be trusted); a
  replay that starts later means the engine published before the buffer's window (vLLM keeps
  10,000 batches): lost until an AllBlocksCleared makes the index whole again.
- A batch whose seq skips ahead: replay the missing ones (the ROUTER answers with every
  buffered batch from the asked seq on). Batches at or below the last applied are replayed
  duplicates and are dropped.
- An idle engine publishes nothing, so silence alone says nothing: after `probe_every_s`
  without a batch, ask the replay socket for what follows the last applied batch. Its answer
  proves the publisher lives and brings any trailing batch the PUB socket lost; no answer
  within `silence_s` of the last sign of life is "lost". Without a replay endpoint, liveness is
  the connection (ZMQ's socket monitor) and any gap is lost for good.
- A dropped connection (the socket monitor's DISCONNECTED) is "lost" at once: on loopback
  that is the engine process closing its sockets.

The engine may bind its PUB socket and we connect (vLLM's `tcp://*:port`), or we bind and it
connects (`bind=True`; vLLM connects when the endpoint has no wildcard): the agent binds on
loopback, so the events, which carry prompts' token ids, never leave the host.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Literal

import msgspec
import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from fleetgate.kv_events import (
    AllBlocksCleared,
    decode_batch,
    decode_seq,
    parse_replay_reply,
    replay_request,
)
from fleetgate.kv_index import BlockIndex

__all__ = ["KvEventSubscriber", "State"]

log = structlog.get_logger("workers.kv_events")

State = Literal["events", "lost"]

_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


class KvEventSubscriber:
    def __init__(
        self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
        bind: bool = False, index: BlockIndex | None = None, silence_s: float = 1.0,
        probe_every_s: float = 0.25, replay_timeout_s: float = 1.0, name: str = "",
    ) -> None:  # fmt: skip
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.bind = bind
        self.index = index if index is not None else BlockIndex()
        self.silence_s = silence_s
        self.probe_every_s = probe_every_s
        self.replay_timeout_s = replay_timeout_s
        self.log = log.bind(worker=name) if name else log
        self.state: State = "lost"
        self.reason = "not synced yet"
        self.next_seq = 0  # the seq of the next batch to apply
        self.applied = 0  # batches applied
        self.resyncs = 0
        self._complete = False  # the index holds every batch since seq 0 or a clear
        self._gap_reason = "not synced yet"
        self._peers = 0
        self._need_resync = True
        self._joining = False
        self._replaying = False  # a resync's replay is under way: the index is partial
        self._last_sign = -math.inf  # monotonic time of the last batch or replay answer
        self._ctx: zmq.asyncio.Context | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._changed = asyncio.Event()

    @property
    def connected(self) -> bool:
        return self._peers > 0

    async def changed(self) -> None:
        """Wait until the state or the reason changes."""
        self._changed.clear()
        await self._changed.wait()

    async def run(self) -> None:
        """Subscribe until cancelled."""
        self._ctx = ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.RCVHWM, 0)  # never drop here: a dropped batch is a replay
        sub.setsockopt(zmq.LINGER, 0)
        self._monitor = monitor = sub.get_monitor_socket(_MONITORED)
        if self.bind:
            sub.bind(self.endpoint)
        else:
            sub.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        tick_ms = int(min(self.probe_every_s, 0.1) * 1000)
        me = asyncio.current_task()
        try:
            while True:
                if me is not None and me.cancelling():
                    # pyzmq's asyncio poll can lose a cancel (the task waits on a fresh poll,
                    # cancelling but never cancelled): without this the agent never stops.
                    raise asyncio.CancelledError
                ready = dict(await poller.poll(tick_ms))
                if monitor in ready:
                    await self._drain_monitor(monitor)
                if sub in ready:
                    await self._drain(sub)
                await self._maintain()
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            self._drop_dealer()
            ctx.term()

    # --- what arrives --------------------------------------------------------------------
    async def _drain_monitor(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            if event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                self._peers += 1
                self._need_resync = True
            elif event == zmq.EVENT_DISCONNECTED:
                self._peers = max(0, self._peers - 1)
                if not self._peers:
                    self.index.clear()  # the engine's cache went with it
                    self._gap("publisher disconnected")
                    self._need_resync = True
            self._update()

    async def _drain(self, sub: zmq.asyncio.Socket) -> None:
        for _ in range(1000):  # then let the monitor and the probes have a turn
            try:
                frames = await sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                self.log.warning("kv_events.bad_message", frames=len(frames))
                continue
            try:
                seq = decode_seq(frames[1])
            except ValueError:
                self.log.warning("kv_events.bad_seq", frame=frames[1].hex())
                continue
            await self._live(seq, frames[2])

    async def _live(self, seq: int, payload: bytes) -> None:
        self._last_sign = time.monotonic()
        if self._need_resync:
            if self.replay_endpoint:
                return  # the resync's replay brings it
            await self._resync()
        if self._joining:
            self._joining = False
            self._start_without_replay(seq)
        if seq < self.next_seq:  # replayed already
            return
        if seq > self.next_seq and self.replay_endpoint:
            await self._replay_from(self.next_seq)
            if seq < self.next_seq or self._need_resync:  # replayed, or the publisher went
                return
        self._apply(seq, payload)

    # --- keeping in sync -----------------------------------------------------------------
    async def _maintain(self) -> None:
        now = time.monotonic()
        if self._need_resync and self._peers:
            await self._resync()
        elif self.replay_endpoint and self._peers and now - self._last_sign >= self.probe_every_s:
            left = self.silence_s - (now - self._last_sign)
            await self._replay_from(
                self.next_seq, wait_s=max(0.1, min(left, self.replay_timeout_s))
            )
        self._update()

    async def _resync(self) -> None:
        self._need_resync = False
        self.resyncs += 1
        self.index.clear()
        self.next_seq = 0
        self._complete = True
        if not self.replay_endpoint:
            self._joining = True  # the first batch seen says whether history is missing
        else:
            self._replaying = True
            try:
                replayed = await self._replay_from(0)
            finally:
                self._replaying = False
            if not replayed:
                if self._peers:  # else the monitor said why
                    self._gap("the replay endpoint did not answer")
                self._need_resync = True
        self._update()
        self.log.info(
            "kv_events.resync", state=self.state, next_seq=self.next_seq, blocks=len(self.index)
        )

    def _start_without_replay(self, seq: int) -> None:
        self.index.clear()
        self.next_seq = seq
        self._complete = True
        if seq > 0:
            self._gap(f"joined at seq {seq} with no replay endpoint: earlier batches unknown")

    async def _replay_from(self, start: int, wait_s: float | None = None) -> bool:
        """Apply what the replay socket holds from `start` on; False when it did not answer
        within `wait_s` of the request or of its last answer, or the publisher disconnected
        meanwhile (the socket monitor is watched while waiting)."""
        assert self._ctx is not None and self._monitor is not None and self.replay_endpoint
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.setsockopt(zmq.RCVHWM, 0)
            self._dealer.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a peer that is not there
            self._dealer.connect(self.replay_endpoint)
        wait_ms = int((wait_s if wait_s is not None else self.replay_timeout_s) * 1000)
        dealer, monitor = self._dealer, self._monitor
        poller = zmq.asyncio.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            await asyncio.wait_for(dealer.send_multipart(replay_request(start)), wait_ms / 1000)
            while True:
                ready = dict(await poller.poll(wait_ms))
                if monitor in ready:
                    await self._drain_monitor(monitor)
                    if not self._peers:
                        raise TimeoutError("publisher disconnected")
                if dealer not in ready:
                    if not ready:
                        raise TimeoutError("no answer")
                    continue
                seq, payload = parse_replay_reply(await dealer.recv_multipart())
                self._last_sign = time.monotonic()
                if seq < 0:
                    return True
                self._replayed(seq, payload)
        except (TimeoutError, ValueError) as exc:
            # A late answer must not be taken for the next request's: a fresh socket.
            self._drop_dealer()
            if isinstance(exc, ValueError):
                self.log.warning("kv_events.bad_replay", error=str(exc))
            return False

    def _replayed(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            return
        if seq > self.next_seq:
            self._gap(f"batches {self.next_seq}..{seq - 1} are gone from the replay buffer")
            self.next_seq = seq
        self._apply(seq, payload)

    def _drop_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq > self.next_seq:  # a gap the replay socket could not fill, or there is none
            self._gap(f"batches {self.next_seq}..{seq - 1} lost and not replayed")
        self.next_seq = seq + 1
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError as exc:
            self._gap(f"batch {seq} does not decode: {exc}")
            return
        self.index.apply(batch)
        self.applied += 1
        if not self._complete and any(isinstance(e, AllBlocksCleared) for e in batch.events):
            self._complete = True  # everything before the clear is gone anyway
        self._update()

    # --- health --------------------------------------------------------------------------
    def _gap(self, reason: str) -> None:
        if self._complete or reason != self._gap_reason:
            self.log.warning("kv_events.gap", reason=reason, next_seq=self.next_seq)
        self._complete = False
        self._gap_reason = reason

    def _update(self) -> None:
        state: State = "lost"
        if not self._complete:
            reason = self._gap_reason
        elif self._replaying:  # not "events" until the whole history is in
            reason = "replaying the engine's history"
        elif not self._peers:
            reason = "publisher disconnected" if self.resyncs else "not connected yet"
        elif self.replay_endpoint and time.monotonic() - self._last_sign > self.silence_s:
            reason = f"publisher silent for {self.silence_s:g} s (no batch, no replay answer)"
        else:
            state, reason = "events", ""
        if (state, reason) != (self.state, self.reason):
            self.state, self.reason = state, reason
            self.log.info("kv_events.state", state=state, reason=reason or None,
                          next_seq=self.next_seq, blocks=len(self.index))  # fmt: skip
            self._changed.set()
