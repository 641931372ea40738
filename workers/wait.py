"""`python -m workers.wait`: block until a detached agent's worker is ready, or has failed.

    python -m workers.wait --pid PID [--log FILE] [--engine-log FILE] -- AGENT ARGS...

AGENT ARGS are the agent's own command line (its --redis-url, --redis-prefix, --id,
--instances, --health-timeout are read from it). Progress lines go to stderr: each state
the registry shows, and every 10 s how long it has been. Exit status 0 once every worker
the agent runs is `ready`; 1 when the agent exits first (its log's last lines and the
engine's are printed) or the agent's health timeout passes; the agent is left running
then, and the message says so.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from fleetgate.registry import Registry, connect
from workers.warmup import log_tail

PROGRESS_EVERY_S = 10.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (the spawner's shell never reaped it) has exited.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def _states(registry: Registry, ids: list[str]) -> dict[str, str]:
    """Each worker's state as the registry shows it (or why it cannot say)."""
    try:
        views = {i: await registry.read(i) for i in ids}
        return {i: (v.effective_state if v else "not registered yet") for i, v in views.items()}
    except Exception as exc:
        return {i: f"Redis unreachable ({exc})" for i in ids}


def _show_tails(logs: list[str]) -> None:
    for path in logs:
        tail = log_tail(path, 15)
        if tail:
            say(f"--- the last {len(tail)} lines of {path} ---")
            for line in tail:
                say(line)


def _outcome(ids: list[str], states: dict[str, str], pid: int, elapsed: float, timeout_s: float,
             logs: list[str]) -> int | None:
    """The exit status once the wait is over (ready, the agent gone, or too long); else None."""
    if all(state in ("ready", "draining", "unhealthy") for state in states.values()):
        say(f"worker {', '.join(ids)} ready after {elapsed:.0f} s")
        return 0
    if not _alive(pid):
        say(f"worker {', '.join(ids)} failed to start: its agent (pid {pid}) exited")
        _show_tails(logs)
        return 1
    if elapsed > timeout_s:
        say(f"worker {', '.join(ids)} not ready after {elapsed:.0f} s; its agent (pid {pid}) "
            "keeps trying in the background: stop it with kill, or wait and check `fleetgate status`")
        return 1
    return None


async def wait(ids: list[str], pid: int, redis_url: str, prefix: str, timeout_s: float,
               logs: list[str]) -> int:
    redis = connect(redis_url)
    registry = Registry(redis, prefix)  # states only: no secret needed to read them
    started = time.monotonic()
    seen: dict[str, str] = {}
    last_progress = started
    try:
        while True:
            elapsed = time.monotonic() - started
            states = await _states(registry, ids)
            for worker_id, state in states.items():
                if seen.get(worker_id) != state:
                    seen[worker_id] = state
                    say(f"worker {worker_id}: {state} ({elapsed:.0f} s)")
            code = _outcome(ids, states, pid, elapsed, timeout_s, logs)
            if code is not None:
                return code
            if time.monotonic() - last_progress >= PROGRESS_EVERY_S:
                last_progress = time.monotonic()
                say(f"worker {', '.join(ids)}: still {', '.join(sorted(set(states.values())))} "
                    f"({elapsed:.0f} s)")
            await asyncio.sleep(0.5)
    finally:
        await redis.aclose()


def main(argv: list[str] | None = None) -> None:
    from workers.__main__ import build_parser

    argv = sys.argv[1:] if argv is None else list(argv)
    own, _, agent_argv = (argv[: argv.index("--")], "--", argv[argv.index("--") + 1:]) if "--" in argv else (
        argv, "", [])
    p = argparse.ArgumentParser(prog="python -m workers.wait", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pid", type=int, required=True, help="the detached agent's process id")
    p.add_argument("--log", action="append", default=[], help="a log to show if it fails; repeatable")
    p.add_argument("--timeout", type=float, default=0.0, help="seconds (default: its --health-timeout + 120)")
    args = p.parse_args(own)
    agent, _ = build_parser().parse_known_args(agent_argv)
    if not agent.id:
        raise SystemExit("python -m workers.wait: the agent's arguments must name its --id")
    ids = [f"{agent.id}-{k}" for k in range(agent.instances)] if agent.instances > 1 else [agent.id]
    timeout = args.timeout or agent.health_timeout + 120
    sys.exit(asyncio.run(wait(ids, args.pid, agent.redis_url, agent.redis_prefix, timeout, args.log)))


if __name__ == "__main__":
    main()
