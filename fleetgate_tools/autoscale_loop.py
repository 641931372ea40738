"""`fleetgate autoscale`'s loop: poll the gateway's scaling signal, start and retire workers.

Once a tick it reads `GET /admin/scaling`, asks fleetgate_tools/autoscale.py's `decide` what
each managed model needs, and acts:

- up: runs the start command (a template: `{model} {worker_id} {port} {n}`; by default
  scripts/spawn_worker.sh with the simulator) in its own process group, then watches the
  registry until the worker is ready (or the command failed, or start_timeout_s passed).
  When a worker it was retiring is still only drained, it undrains that one instead.
- down: drain-then-stop, never losing a request: an admin drain (no gateway routes new
  requests to it), then it waits until the gateways' account has no request in flight
  there for two polls in a row and at least settle_s, then stops it: SIGTERM to the
  process group it started if that still runs, else the stop command template, else
  the admin `drain?stop=true` (its agent stops itself; it too waits for in-flight work
  first). It is retired when it has left the registry.

It manages only the workers it started, and any whose id begins with its id prefix (those
it started before a restart). Every action is one structlog event (`autoscale.*`).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
import structlog

from fleetgate.background import Outage
from fleetgate.net import free_port
from fleetgate_tools.admin_client import Admin, CliError
from fleetgate_tools.autoscale import History, Observed, Policy, decide

log = structlog.get_logger("fleetgate.autoscale")

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_START = "scripts/spawn_worker.sh --engine sim --model {model} --id {worker_id} --port {port} --wait"
PLACEHOLDERS = ("model", "worker_id", "port", "n")


class SignalWorker(msgspec.Struct, kw_only=True):
    id: str
    state: str
    routable: bool
    inflight: int = 0
    capacity: int = 1


class SignalModel(msgspec.Struct, kw_only=True):
    model: str
    ready: int = 0
    starting: int = 0
    draining: int = 0
    capacity: int = 0
    outstanding: int = 0
    queue_depth: int = 0
    workers: list[SignalWorker] = []
    saturation: float | None = None
    kv_use_ratio: float | None = None


class Signal(msgspec.Struct):
    data: list[SignalModel]


def render(template: str, **values: object) -> str:
    """`template` with each placeholder replaced by its shell-quoted value."""
    return template.format_map({k: shlex.quote(str(v)) for k, v in values.items()})


def check_template(template: str) -> None:
    """Fail at start on a placeholder the loop does not fill."""
    try:
        render(template, **dict.fromkeys(PLACEHOLDERS, "x"))
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"command template {template!r}: unknown placeholder {exc}; "
                         f"known: {', '.join('{' + p + '}' for p in PLACEHOLDERS)}") from None


@dataclass
class Launched:
    worker_id: str
    model: str
    port: int
    proc: subprocess.Popen[bytes] | None
    started_at: float
    log_path: Path | None = None
    ready: bool = False


@dataclass
class Retiring:
    worker_id: str
    model: str
    since: float
    idle_polls: int = 0
    stopped_at: float | None = None
    stopper: subprocess.Popen[bytes] | None = None
    how: str = ""


@dataclass
class Options:
    gateway: str
    token: str
    policies: Mapping[str, Policy]
    start: str = DEFAULT_START
    stop: str = ""
    interval_s: float = 1.0
    settle_s: float = 1.0
    start_timeout_s: float = 300.0
    stop_timeout_s: float = 120.0
    id_prefix: str = "autoscale-"
    log_dir: Path = field(default_factory=lambda: ROOT / ".run" / "autoscale")


def _slug(model: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in model.rsplit("/", 1)[-1]).strip("-")[:24] or "model"


def _kill_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Autoscaler:
    def __init__(self, opts: Options, clock: Callable[[], float] = time.monotonic) -> None:
        check_template(opts.start)
        if opts.stop:
            check_template(opts.stop)
        self.opts = opts
        self.clock = clock
        self.admin = Admin(opts.gateway, opts.token, timeout=5.0)
        self.history: dict[str, History] = {m: History() for m in opts.policies}
        self.launched: dict[str, Launched] = {}
        self.retiring: dict[str, Retiring] = {}
        self.run_tag = uuid.uuid4().hex[:4]
        self.serial = 0
        self._outage = Outage(log, "autoscale.signal_failed", "autoscale.signal_resumed", gateway=opts.gateway)
        self._held: dict[str, str] = {}
        opts.log_dir.mkdir(parents=True, exist_ok=True)

    # -- reading ---------------------------------------------------------------------------

    def read(self) -> dict[str, SignalModel] | None:
        try:
            signal_ = msgspec.convert(self.admin.call("GET", "/admin/scaling"), Signal)
        except (CliError, msgspec.ValidationError) as exc:
            self._outage.failed(exc)
            return None
        self._outage.ok()
        return {m.model: m for m in signal_.data}

    def managed(self, worker_id: str) -> bool:
        return worker_id in self.launched or worker_id.startswith(self.opts.id_prefix)

    def observe(self, model: str, sig: SignalModel | None) -> Observed:
        workers = sig.workers if sig else []
        present = {w.id for w in workers}
        pending = sum(1 for launch in self.launched.values()
                      if launch.model == model and launch.worker_id not in present and not launch.ready)
        retirable = sum(1 for w in workers if w.routable and self.managed(w.id) and w.id not in self.retiring)
        if sig is None:
            return Observed(ready=0, starting=pending)
        # Drained by this loop, and the gateway's snapshot does not show it yet (a refresh away).
        lagging = [w for w in workers if w.routable and w.id in self.retiring]
        return Observed(
            ready=sig.ready - len(lagging), starting=sig.starting + pending, draining=sig.draining + len(lagging),
            capacity=sig.capacity - sum(w.capacity for w in lagging),
            outstanding=sum(w.inflight for w in workers if w.routable and w.id not in self.retiring),
            queue_depth=sig.queue_depth, kv_use_ratio=sig.kv_use_ratio, retirable=retirable,
        )

    # -- one tick ----------------------------------------------------------------------------

    def tick(self) -> None:
        signals = self.read()
        if signals is None:
            return
        now = self.clock()
        self._follow_launches(signals, now)
        self._follow_retiring(signals, now)
        for model, policy in self.opts.policies.items():
            sig = signals.get(model)
            observed = self.observe(model, sig)
            decision = decide(policy, observed, self.history[model], now)
            self.history[model] = decision.history
            if decision.action == "hold":
                # Once per kind of reason (countdowns aside), not every tick.
                kind = re.sub(r"[\d.]+", "#", decision.reason)
                if self._held.get(model) != kind:
                    self._held[model] = kind
                    log.info("autoscale.hold", model=model, reason=decision.reason, ready=observed.ready,
                             saturation=decision.saturation)
            else:
                self._held.pop(model, None)
            if decision.action == "up":
                log.info("autoscale.scale_up", model=model, add=decision.count, reason=decision.reason,
                         ready=observed.ready, starting=observed.starting)
                for _ in range(decision.count):
                    if not self._undrain_one(model, signals):
                        self._start(model)
            elif decision.action == "down" and sig is not None:
                log.info("autoscale.scale_down", model=model, reason=decision.reason, ready=observed.ready)
                self._retire_one(model, sig, now)

    def run(self, stop: Callable[[], bool] = lambda: False) -> None:
        log.info("autoscale.started", gateway=self.opts.gateway, models=sorted(self.opts.policies),
                 start=self.opts.start, stop=self.opts.stop or "admin drain?stop=true")
        try:
            while not stop():
                began = self.clock()
                self.tick()
                time.sleep(max(0.0, self.opts.interval_s - (self.clock() - began)))
        finally:
            self.admin.close()
            log.info("autoscale.stopped", left_running=sorted(self.launched))

    # -- up ------------------------------------------------------------------------------------

    def _start(self, model: str) -> None:
        self.serial += 1
        worker_id = f"{self.opts.id_prefix}{_slug(model)}-{self.run_tag}-{self.serial}"
        port = free_port()
        command = render(self.opts.start, model=model, worker_id=worker_id, port=port, n=self.serial)
        log_path = self.opts.log_dir / f"{worker_id}.start.log"
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(["bash", "-c", command], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.launched[worker_id] = Launched(worker_id, model, port, proc, self.clock(), log_path)
        log.info("autoscale.worker_starting", model=model, worker=worker_id, port=port, pid=proc.pid,
                 command=command, log=str(log_path))

    def _undrain_one(self, model: str, signals: Mapping[str, SignalModel]) -> bool:
        """Put back a worker that is being retired but not stopped yet; False if there is none."""
        for worker_id, r in list(self.retiring.items()):
            if r.model == model and r.stopped_at is None and self._admin("POST", f"/admin/workers/{worker_id}/undrain"):
                del self.retiring[worker_id]
                log.info("autoscale.worker_undrained", model=model, worker=worker_id)
                return True
        return False

    def _follow_launches(self, signals: Mapping[str, SignalModel], now: float) -> None:
        by_id = {w.id: w for s in signals.values() for w in s.workers}
        for worker_id, launch in list(self.launched.items()):
            seen = by_id.get(worker_id)
            rc = launch.proc.poll() if launch.proc is not None else None
            if launch.ready:
                if seen is None and worker_id not in self.retiring:
                    log.warning("autoscale.worker_lost", model=launch.model, worker=worker_id, exit=rc)
                    del self.launched[worker_id]
                continue
            if seen is not None and seen.state == "ready":
                launch.ready = True
                log.info("autoscale.worker_ready", model=launch.model, worker=worker_id,
                         s=round(now - launch.started_at, 1))
            elif rc not in (None, 0) or now - launch.started_at > self.opts.start_timeout_s:
                why = f"start command exited {rc}" if rc not in (None, 0) else \
                    f"not ready within {self.opts.start_timeout_s:g}s"
                log.error("autoscale.start_failed", model=launch.model, worker=worker_id, reason=why,
                          log=str(launch.log_path), tail=_tail(launch.log_path))
                if launch.proc is not None:
                    _kill_group(launch.proc, signal.SIGKILL)
                del self.launched[worker_id]

    # -- down ------------------------------------------------------------------------------------

    def _retire_one(self, model: str, sig: SignalModel, now: float) -> None:
        order = {wid: i for i, wid in enumerate(self.launched)}
        candidates = [w for w in sig.workers if w.routable and self.managed(w.id) and w.id not in self.retiring]
        if not candidates:
            return
        # The least busy; among equals the newest (an old one's caches are warmer).
        pick = min(candidates, key=lambda w: (w.inflight, -order.get(w.id, -1)))
        if not self._admin("POST", f"/admin/workers/{pick.id}/drain"):
            return
        self.retiring[pick.id] = Retiring(pick.id, model, now)
        log.info("autoscale.worker_draining", model=model, worker=pick.id, inflight=pick.inflight)

    def _follow_retiring(self, signals: Mapping[str, SignalModel], now: float) -> None:
        by_id = {w.id: w for s in signals.values() for w in s.workers}
        for worker_id, r in list(self.retiring.items()):
            seen = by_id.get(worker_id)
            if seen is None:
                self._retired(r, now)
                continue
            if r.stopped_at is None:
                # Idle counts only once the gateway routes nothing there any more.
                r.idle_polls = r.idle_polls + 1 if seen.inflight == 0 and not seen.routable else 0
                if r.idle_polls >= 2 and now - r.since >= self.opts.settle_s:
                    self._stop(r, now)
            elif now - r.stopped_at > self.opts.stop_timeout_s:
                launch = self.launched.pop(worker_id, None)
                if launch is not None and launch.proc is not None and launch.proc.poll() is None:
                    _kill_group(launch.proc, signal.SIGKILL)
                log.error("autoscale.stop_timeout", model=r.model, worker=worker_id, how=r.how,
                          s=round(now - r.stopped_at, 1), killed=launch is not None)
                del self.retiring[worker_id]

    def _stop(self, r: Retiring, now: float) -> None:
        launch = self.launched.get(r.worker_id)
        if launch is not None and launch.proc is not None and launch.proc.poll() is None:
            _kill_group(launch.proc, signal.SIGTERM)
            r.how = "sigterm"
        elif self.opts.stop:
            command = render(self.opts.stop, model=r.model, worker_id=r.worker_id,
                             port=launch.port if launch else "", n=0)
            r.stopper = subprocess.Popen(["bash", "-c", command], cwd=ROOT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
            r.how = "stop command"
        elif self._admin("POST", f"/admin/workers/{r.worker_id}/drain?stop=true"):
            r.how = "admin stop"
        else:
            return
        r.stopped_at = now
        log.info("autoscale.worker_stopping", model=r.model, worker=r.worker_id, how=r.how,
                 drained_s=round(now - r.since, 1))

    def _retired(self, r: Retiring, now: float) -> None:
        launch = self.launched.pop(r.worker_id, None)
        rc = None
        if launch is not None and launch.proc is not None:
            try:
                rc = launch.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                rc = None
        if r.stopper is not None:
            r.stopper.poll()
        del self.retiring[r.worker_id]
        log.info("autoscale.worker_retired", model=r.model, worker=r.worker_id, how=r.how or "gone",
                 s=round(now - r.since, 1), exit=rc)

    # -- the admin API -------------------------------------------------------------------------

    def _admin(self, method: str, path: str) -> bool:
        try:
            self.admin.call(method, path)
        except CliError as exc:
            log.warning("autoscale.admin_failed", path=path, error=str(exc))
            return False
        return True


def _tail(path: Path | None, lines: int = 5) -> list[str]:
    if path is None or not path.exists():
        return []
    return path.read_text(errors="replace").splitlines()[-lines:]


def parse_models(specs: list[str], base: Policy) -> dict[str, Policy]:
    """`--model NAME` or `--model NAME=MIN:MAX` -> a policy per model."""
    out: dict[str, Policy] = {}
    for spec in specs:
        name, sep, bounds = spec.partition("=")
        if not name:
            raise ValueError(f"--model {spec!r}: no model name")
        if not sep:
            out[name] = base
            continue
        low, colon, high = bounds.partition(":")
        try:
            kwargs: dict[str, Any] = {"min_workers": int(low)}
            if colon:
                kwargs["max_workers"] = int(high)
        except ValueError:
            raise ValueError(f"--model {spec!r}: want NAME=MIN:MAX with whole numbers") from None
        out[name] = replace(base, **kwargs)
    return out


__all__ = ["DEFAULT_START", "Autoscaler", "Options", "check_template", "parse_models", "render"]
