"""The benchmark's fleet, read from YAML (config/bench/*.yaml), and what it can carry.

    model: bench-7b
    model_path: .cache/tiny/model             # optional: a folder with tokenizer.json (+ chat
                                              # template) the agents get as --model, served as
                                              # `model`: the gateway then has the tokenizer
    time_scale: 1.0
    adapters: {count: 16, prefix: lora-}      # or a list of names
    workers:
      - id: big-0
        profile: h100-7b                      # a workers/timing.py name
        flavor: vllm                          # or lmdeploy
        max_model_len: 32768
        adapters: "0-11"                      # indices into `adapters`, "*" or a list
        options: {num_gpu_blocks: 2048, max_num_seqs: 64, max_loras: 4}
    workloads:                                # per-workload generator parameters
      prefix: {system_prompts: 48}

`capacity()` estimates how many requests a second the fleet can finish for a given mix of
requests, from the simulator's profiles: a worker at full batch spends, per request,
`out x (base_step / batch + decode_per_seq) + uncached_prompt x prefill_per_token`, where
the batch is bounded by max_num_seqs and by how many such sequences fit its KV cache. It
assumes no prefix-cache hits, so it is what a cache-blind router can count on.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import yaml

from fleetgate_tools.bench.workloads import BenchRequest, Draft, FleetFacts
from workers.timing import PROFILES

ROOT = Path(__file__).resolve().parents[2]


class WorkerSpec(msgspec.Struct, kw_only=True, frozen=True):
    id: str
    profile: str = "h100-7b"
    flavor: str = "vllm"
    max_model_len: int = 4096
    adapters: tuple[str, ...] = ()
    options: dict[str, Any] = msgspec.field(default_factory=dict)

    def option(self, name: str) -> int:
        value = self.options.get(name)
        return int(value) if value is not None else int(getattr(PROFILES[self.profile], name))


class FleetSpec(msgspec.Struct, kw_only=True, frozen=True):
    model: str = "bench-7b"
    # A model folder (tokenizer.json, chat template) for the agents' --model: they register
    # its tokenizer and the simulators count with it. "" gives them the bare name.
    model_path: str = ""
    time_scale: float = 1.0
    adapters: tuple[str, ...] = ()
    workers: tuple[WorkerSpec, ...] = ()
    workloads: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)

    @property
    def facts(self) -> FleetFacts:
        lens = [w.max_model_len for w in self.workers] or [4096]
        return FleetFacts(model=self.model, adapters=self.adapters,
                          max_context=max(lens), min_context=min(lens))  # fmt: skip

    def worker_argv(self, w: WorkerSpec, adapter_dir: Path) -> list[str]:
        """`python -m workers` arguments (without Redis and logs) for one worker."""
        model = ["--model", self.model]
        if self.model_path:
            path = Path(self.model_path)
            model = ["--model", str(path if path.is_absolute() else ROOT / path), "--served-model-name", self.model]
        argv = ["--engine", "sim", "--sim-profile", w.profile, *model, "--id", w.id, "--max-model-len", str(w.max_model_len),
                "--option", f"time_scale={self.time_scale}"]  # fmt: skip
        if w.flavor != "vllm":
            argv += ["--option", f"flavor={w.flavor}"]
        for key, value in sorted(w.options.items()):
            argv += ["--option", f"{key}={value}"]
        if w.adapters:
            argv += ["--adapters", ",".join(f"{a}={adapter_dir / a}" for a in w.adapters)]
        return argv


def _indices(spec: Any, names: Sequence[str]) -> tuple[str, ...]:
    """Adapters of a worker: "*", "0-5,9", or a list of names."""
    if spec is None:
        return ()
    if isinstance(spec, list):
        return tuple(str(s) for s in spec)
    text = str(spec).strip()
    if text == "*":
        return tuple(names)
    out: list[str] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"bad adapter range {part!r}")
        lo, hi = int(m[1]), int(m[2] or m[1])
        out.extend(names[lo : hi + 1])
    return tuple(out)


def load_fleet(path: str | Path) -> FleetSpec:
    data = yaml.safe_load(Path(path).read_text()) or {}
    adapters = data.get("adapters") or ()
    if isinstance(adapters, dict):
        n, prefix = int(adapters.get("count", 0)), str(adapters.get("prefix", "lora-"))
        adapters = [f"{prefix}{i:02d}" for i in range(n)]
    names = tuple(str(a) for a in adapters)
    workers = []
    for raw in data.get("workers") or ():
        count = int(raw.get("count", 1))
        for i in range(count):
            wid = str(raw["id"]) if count == 1 else f"{raw['id']}-{i}"
            workers.append(WorkerSpec(
                id=wid,
                profile=str(raw.get("profile", "h100-7b")),
                flavor=str(raw.get("flavor", "vllm")),
                max_model_len=int(raw.get("max_model_len", 4096)),
                adapters=_indices(raw.get("adapters"), names),
                options=dict(raw.get("options") or {}),
            ))  # fmt: skip
    for w in workers:
        if w.profile not in PROFILES:
            raise ValueError(f"worker {w.id}: unknown profile {w.profile!r}")
    return FleetSpec(
        model=str(data.get("model", "bench-7b")),
        model_path=str(data.get("model_path") or ""),
        time_scale=float(data.get("time_scale", 1.0)),
        adapters=names,
        workers=tuple(workers),
        workloads={str(k): dict(v or {}) for k, v in (data.get("workloads") or {}).items()},
    )


def _tokens(r: BenchRequest | Draft) -> int:
    if isinstance(r, BenchRequest):
        return r.prompt_tokens()
    return BenchRequest(id=0, at=0, model=r.model, messages=r.messages, max_tokens=1).prompt_tokens()


def worker_capacity(w: WorkerSpec, requests: Sequence[BenchRequest | Draft], time_scale: float) -> float:
    """Requests/s one worker finishes at full batch for the requests that fit it."""
    p = PROFILES[w.profile]
    fitting = [r for r in requests if _tokens(r) < w.max_model_len]
    if not fitting:
        return 0.0
    prompt = sum(_tokens(r) for r in fitting) / len(fitting)
    # Answers cut short (BenchRequest.answer_tokens) generate that many, not max_tokens.
    out = sum(min(r.max_tokens, r.answer_tokens or r.max_tokens) for r in fitting) / len(fitting)
    kv_tokens = w.option("num_gpu_blocks") * w.option("block_size")
    batch = max(1, min(w.option("max_num_seqs"), int(kv_tokens // (prompt + out))))
    lora = sum(1 for r in fitting if r.model in w.adapters) / len(fitting)
    plain = p.base_step_s / batch + p.decode_per_seq_s  # a step's share per output token
    with_lora = p.lora_step(p.base_step_s) / batch + p.decode_per_seq_s * p.lora_step_factor
    cost = out * (lora * with_lora + (1 - lora) * plain) + prompt * p.prefill_per_token_s
    return 1.0 / (cost * max(time_scale, 1e-9))


def capacity(spec: FleetSpec, requests: Sequence[BenchRequest | Draft]) -> float:
    """The fleet's requests/s for this mix: each request counted where it can go."""
    total = 0.0
    for w in spec.workers:
        servable = [r for r in requests if r.model == spec.model or r.model in w.adapters]
        if servable:
            # A worker only sees its share of the mix; its rate for that share.
            total += worker_capacity(w, servable, spec.time_scale)
    return total
