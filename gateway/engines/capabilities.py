"""What a worker's engine can do, as its record declares it: the gateway shapes requests by
capability, never by engine name (gateway/request/resume.py knows no engine).

Continuing a cut chat stream on another engine means sending the text so far as a trailing
assistant message. Some engines continue such a message by themselves; others need
`continue_final_message: true, add_generation_prompt: false`, or they start a new reply
after it. Each engine file says which (`Engine.continues_trailing_assistant`), and the
agent puts it in the worker's record.
"""

from __future__ import annotations

from collections.abc import Callable

from fleetgate.schema import WorkerInfo, WorkerView

# Only for records that do not declare the capability (None): agents from before the field
# existed say just their engine's name, and these engines continue by themselves. Records
# that declare it are never judged by name.
_LEGACY_CONTINUES_TRAILING = ("lmdeploy", "swift")


def continues_trailing_assistant(info: WorkerInfo) -> bool:
    """Whether the worker's engine continues a trailing assistant message without being told to."""
    if info.continues_trailing_assistant is not None:
        return info.continues_trailing_assistant
    return any(name in info.engine for name in _LEGACY_CONTINUES_TRAILING)


def shaped(build: Callable[[bool], bytes]) -> Callable[[WorkerView], bytes]:
    """A body built for each worker it is sent to: `build(continues_trailing_assistant)`."""
    return lambda worker: build(continues_trailing_assistant(worker.info))
