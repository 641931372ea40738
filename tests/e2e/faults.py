"""What the fault tests (tests/e2e/test_faults_*.py) share: a TCP proxy that a test cuts and heals
between a process and Redis, streams held open in threads, and the one counts line each prints."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field

import httpx

# host:port or a URL: what an engine's address looks like in a client's body.
ADDRESS = re.compile(r"\d{1,3}(\.\d{1,3}){3}:\d+|https?://|localhost")


@dataclass
class Counts:
    """sent: requests sent; ok: answered in full; failed: answered with an error (a clear one, or
    the test says otherwise); lost: neither (a hang, a cut without an error, a traceback)."""

    sent: int = 0
    ok: int = 0
    failed: int = 0
    lost: int = 0
    why: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, outcome: str, why: str = "") -> None:
        with self._lock:
            self.sent += 1
            setattr(self, outcome, getattr(self, outcome) + 1)
            if why:
                self.why.append(why)

    def report(self, name: str) -> str:
        line = f"fault[{name}]: sent={self.sent} ok={self.ok} failed={self.failed} lost={self.lost}"
        print(line)
        return line


class TcpProxy:
    """A TCP relay on loopback to `target`: `cut()` drops every connection through it and refuses
    new ones (the listening socket closes), `heal()` listens again on the same port."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self.accepted = 0
        self._serve()

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def _serve(self) -> None:
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # cut
                return
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # cut meanwhile
                    client.close()
                    upstream.close()
                    return
                self._socks |= {client, upstream}
                self.accepted += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with self._lock:
                    self._socks.discard(s)
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._socks) // 2

    def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None  # type: ignore[assignment]
            socks, self._socks = list(self._socks), set()
        listener.close()
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def heal(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port))
        with self._lock:
            self._listener = listener
        self._serve()

    def close(self) -> None:
        if self._listener is not None:
            self.cut()


class HeldStream:
    """A streamed chat request in a thread of its own: `first` is set once its first event came;
    at the end `outcome` is "ok" (every token, one finish, [DONE]), "failed" (an error status or
    an error event, its text in `why`) or "lost" (anything else)."""

    def __init__(self, url: str, model: str, tokens: int, name: str, timeout_s: float = 90.0) -> None:
        self.url, self.model, self.tokens, self.name, self.timeout_s = url, model, tokens, name, timeout_s
        self.first = threading.Event()
        self.worker = ""
        self.outcome = ""
        self.why = ""
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {"model": self.model, "max_tokens": self.tokens, "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": self.name}]}
        pieces, finishes, done = 0, 0, False
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=self.timeout_s) as resp:
                self.worker = resp.headers.get("x-fleetgate-worker", "")
                if resp.status_code != 200:
                    self.outcome, self.why = "failed", f"{resp.status_code} {resp.read()[:300]!r}"
                    return
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    self.first.set()
                    if line == "data: [DONE]":
                        done = True
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.outcome, self.why = "failed", json.dumps(event)
                        return
                    for choice in event["choices"]:
                        pieces += bool(choice["delta"].get("content"))
                        finishes += bool(choice.get("finish_reason"))
        except Exception as exc:  # a hang (timeout), a cut: lost
            self.outcome, self.why = "lost", repr(exc)
            return
        finally:
            self.first.set()
        ok = done and finishes == 1 and pieces == self.tokens
        self.outcome = "ok" if ok else "lost"
        self.why = "" if ok else f"pieces={pieces} finishes={finishes} done={done}"

    def join(self, counts: Counts) -> None:
        self.thread.join(self.timeout_s + 10)
        counts.add(self.outcome or "lost", f"{self.name}: {self.why}" if self.why else "")


def wait_for(predicate: object, timeout: float, interval: float = 0.05) -> float:
    """Seconds until `predicate()` held; fails the test after `timeout`."""
    start = time.monotonic()
    while not predicate():  # type: ignore[operator]
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - start
