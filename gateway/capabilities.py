"""What a worker's engine can do, as its record declares it: the gateway shapes requests by
capability, never by engine name (gateway/resume.py knows no engine).

Continuing a cut chat stream on another engine means sending the text so far as a trailing
assistant message. LMDeploy and ms-swift continue such a message by themselves; vLLM (and
the simulator's vLLM flavour) need `continue_final_message: true, add_generation_prompt:
false`, or they start a new reply after it.
"""

from __future__ import annotations

from collections.abc import Callable

from fleetgate.schema import WorkerInfo, WorkerView

# Records that do not declare `continues_trailing_assistant` (agents from before the field)
# say only their engine's name: these engines are known to continue by themselves.
_LEGACY_CONTINUES_TRAILING = ("lmdeploy", "swift")


def continues_trailing_assistant(info: WorkerInfo) -> bool:
    """Whether the worker's engine continues a trailing assistant message without vLLM's flags."""
    declared = getattr(info, "continues_trailing_assistant", None)
    if declared is not None:
        return bool(declared)
    return any(name in info.engine for name in _LEGACY_CONTINUES_TRAILING)


def shaped(build: Callable[[bool], bytes]) -> Callable[[WorkerView], bytes]:
    """A body built for each worker it is sent to: `build(continues_trailing_assistant)`."""
    return lambda worker: build(continues_trailing_assistant(worker.info))
