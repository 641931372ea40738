"""A simulated inference engine: vLLM's (or LMDeploy's) OpenAI server over a small scheduler.

Not canned text: continuous batching with chunked prefill, a block KV cache with prefix
caching and preemption, LoRA slots, and step times from GPU x model profiles, so that a
gateway sees queues, cache hits and latencies shaped like a real engine's.
"""

from workers.simulator.config import Faults, SimConfig
from workers.simulator.server import create_app
from workers.timing import PROFILES, Profile

__all__ = ["PROFILES", "Faults", "Profile", "SimConfig", "create_app"]
