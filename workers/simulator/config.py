"""The simulator's settings (one per process) and its injectable faults."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from workers.timing import PROFILES, Profile

FlavorName = Literal["vllm", "lmdeploy"]
RunnerOption = Literal["auto", "generate", "pooling"]  # vLLM's --runner, less "draft"
ConvertOption = Literal["auto", "none", "embed"]  # vLLM's --convert, less "classify"


@dataclass(kw_only=True)
class Faults:
    """Misbehaviour on demand, for failover tests.

    die_after: after N accepted requests the next one makes the process exit hard
    (os._exit), cutting every open stream. error_rate: that fraction of requests gets a
    500. stall_after_chunks: streams stop after N chunks and hold the connection open (0:
    the response headers are sent, then nothing: an engine hung before its first event).
    hang_before_headers: 1 makes streams hold the connection open before any response
    header (an engine hung between taking a request and answering it).
    die_at: the process exits hard that many (real) seconds after the fault is set.
    slow: every engine step takes this many times its profile's time (2: half speed; 1 or
    null: the profile's): a throttled card, a neighbour on the same GPU. The profile, and
    so the speed the worker registered, stay; only the engine's counters show it.
    kv_events_down: 1 closes the KV cache events publisher for good (its sockets, the replay
    too) while the engine serves on: vLLM's publisher thread gone.
    """

    die_after: int | None = None
    error_rate: float = 0.0
    stall_after_chunks: int | None = None
    hang_before_headers: int | None = None
    die_at: float | None = None
    slow: float = 1.0
    kv_events_down: int | None = None

    def update(self, values: dict[str, Any]) -> None:
        """Set faults from a JSON object or KEY=VALUE pairs; null clears one."""
        types = {f.name: f for f in fields(self)}
        for key, raw in values.items():
            if key not in types:
                raise ValueError(f"unknown fault {key!r}; known: {', '.join(types)}")
            if raw is None or raw == "":
                setattr(self, key, {"error_rate": 0.0, "slow": 1.0}.get(key))
            elif key == "error_rate":
                rate = float(raw)
                if not 0.0 <= rate <= 1.0:
                    raise ValueError("error_rate must be within 0..1")
                self.error_rate = rate
            elif key == "die_at":
                self.die_at = float(raw)
            elif key == "slow":
                factor = float(raw)
                if not 0.0 < factor <= 1000.0:
                    raise ValueError("slow must be a factor above 0 (2: steps take twice as long)")
                self.slow = factor
            else:
                setattr(self, key, int(raw))

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def parse_fault_args(pairs: list[str]) -> Faults:
    faults = Faults()
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--fault wants KEY=VALUE, got {pair!r}")
        faults.update({key.strip(): value.strip()})
    return faults


@dataclass(kw_only=True)
class SimConfig:
    served_model_name: str
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    profile: str = "l40s-7b"
    max_model_len: int = 4096
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    enable_lora: bool = False
    max_loras: int = 4
    # vLLM's --max-cpu-loras: adapters held in host memory (None: as many as max_loras).
    max_cpu_loras: int | None = None
    lora_modules: dict[str, str] = field(default_factory=dict)
    time_scale: float = 1.0
    seed: int = 0
    flavor: FlavorName = "vllm"
    # Keep /v1/responses results for GET and previous_response_id. Off by default, as in
    # vLLM, which stores only with VLLM_ENABLE_RESPONSES_API_STORE=1.
    responses_store: bool = False
    # vLLM's --runner/--convert: `pooling` serves /v1/embeddings instead of generating.
    # "auto" resolves like vLLM for a causal LM: --convert embed implies --runner pooling.
    runner: RunnerOption = "auto"
    convert: ConvertOption = "auto"
    faults: Faults = field(default_factory=Faults)
    # vLLM's --kv-events-config (JSON): publish KV cache events over ZMQ (kv_events.py).
    kv_events_config: str | None = None
    # Profile fields replaced for this process (`--profile-param base_step_s=0.004`), e.g. a
    # profile fitted by scripts/calibrate_sim.py.
    profile_overrides: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_profile()
        if self.lora_modules:
            self.enable_lora = True
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            # vLLM refuses to start so, too.
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        if self.kv_events_config is not None:
            from workers.simulator.kv_events import KvEventsConfig

            KvEventsConfig.from_json(self.kv_events_config)  # raises ValueError
        self._resolve_runner()

    def _check_profile(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; known: {', '.join(PROFILES)}")
        known = {f.name for f in fields(Profile)} - {"name"}
        unknown = set(self.profile_overrides) - known
        if unknown:
            raise ValueError(f"unknown profile field(s) {sorted(unknown)}; known: {sorted(known)}")

    def _resolve_runner(self) -> None:
        """vLLM's --runner and --convert, "auto" resolved, their conflicts refused."""
        if self.runner == "auto":
            self.runner = "pooling" if self.convert == "embed" else "generate"
        if self.runner == "pooling":
            if self.convert == "none":
                raise ValueError("--runner pooling needs --convert embed for a causal LM")
            self.convert = "embed"
            if self.flavor != "vllm":
                raise ValueError("--runner pooling is vLLM's; LMDeploy has no embeddings API")
        elif self.convert == "embed":
            raise ValueError("--convert embed needs --runner pooling (or auto)")

    @property
    def pooling(self) -> bool:
        return self.runner == "pooling"

    @property
    def model_path(self) -> str:
        return self.model or self.served_model_name

    @property
    def timing(self) -> Profile:
        base = PROFILES[self.profile]
        if not self.profile_overrides:
            return base
        types = {f.name: f.type for f in fields(Profile)}
        values: dict[str, Any] = {
            k: int(v) if types[k] in (int, "int") else float(v)
            for k, v in self.profile_overrides.items()
        }
        return replace(base, **values)

    @property
    def lora_slots(self) -> int:
        return self.max_loras if self.enable_lora else 0

    def resolved(self, name: str) -> int:
        """A capacity setting: the flag if given, else the profile's default."""
        value = getattr(self, name)
        return int(value if value is not None else getattr(self.timing, name))
