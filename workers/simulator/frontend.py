"""The simulated engine's API front-end, where it shares the machine's cores with the engine.

The profile says when it does (`frontend_per_request_s`, `frontend_per_token_s`; zero on GPU
profiles, whose front-end runs on otherwise idle host cores). vLLM's OpenAI server is one
process that parses and tokenizes each request before handing it to the engine, and
detokenizes and writes an SSE chunk for each token the engine returns. On a small CPU
machine that work runs on the same cores as the engine's compute threads, so it costs
twice: a request is schedulable only after the front-end has admitted it (one request at a
time, `frontend_per_request_s` each), and the front-end's work done while the engine is
busy stretches the engine's next step by as much (admissions during a step, and
`frontend_per_token_s` for every token the previous step sampled). See profiles.py
(cpu-tiny) for the measured figures.

The scheduler (scheduler.py) prices the work from its profile, which an operator may change
at runtime; this keeps the front-end's clock and what the next step owes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from workers.simulator.seqs import Seq


class Frontend:
    """Admits requests one at a time, and counts the CPU seconds the engine's next step pays."""

    def __init__(self) -> None:
        self.admitting: set[Seq] = set()  # in the front-end, not yet in the engine's queue
        self._free_at = 0.0
        self.debt = 0.0  # front-end seconds the next step pays for

    def admit(self, seqs: Sequence[Seq], now: float, cost: float, engine_busy: bool,
              then: Callable[[Seq], None]) -> None:
        """One API request's sequences, admitted together `cost` seconds after the front-end
        is free, each then handed to `then` (the engine's queue); while the engine is busy,
        that work takes the CPU from its step as well."""
        ready = max(now, self._free_at) + cost
        self._free_at = ready
        if engine_busy:
            self.debt += cost
        self.admitting.update(seqs)
        asyncio.get_running_loop().call_at(ready, self._hand_over, list(seqs), then)

    def _hand_over(self, seqs: list[Seq], then: Callable[[Seq], None]) -> None:
        for seq in seqs:
            if seq in self.admitting:  # not aborted meanwhile
                self.admitting.discard(seq)
                then(seq)

    def abort(self, seq: Seq) -> bool:
        """Drop a sequence still in the front-end; False if the engine already has it."""
        if seq not in self.admitting:
            return False
        self.admitting.discard(seq)
        return True

    def charge(self, seconds: float) -> None:
        """Front-end work done during the running step, paid by the next one."""
        self.debt += seconds

    def take_debt(self) -> float:
        debt, self.debt = self.debt, 0.0
        return debt
