"""gateway/engines/capabilities.py: what the gateway reads from a worker's record, as a table of records."""

from __future__ import annotations

import pytest

from fleetgate.schema import WorkerInfo
from gateway.engines.capabilities import continues_trailing_assistant


def _info(engine: str, declared: bool | None) -> WorkerInfo:
    return WorkerInfo(id="w", url="http://x", engine=engine, model="m", continues_trailing_assistant=declared)


@pytest.mark.parametrize(("engine", "declared", "continues"), [
    # Declared by the engine file: the record's value, whatever the engine is called.
    ("vllm", False, False),
    ("sim", False, False),
    ("sim", True, True),  # the simulator in LMDeploy's flavour
    ("lmdeploy", True, True),
    ("swift", True, True),
    ("external:lmdeploy", True, True),
    ("external:vllm", False, False),
    ("lmdeploy", False, False),  # a name never overrides a declaration...
    ("my-engine", True, True),  # ...nor is one needed
    # Records from agents older than the field (None): known by the engine's name.
    ("lmdeploy", None, True),
    ("external:lmdeploy", None, True),
    ("swift", None, True),
    ("vllm", None, False),
    ("sim", None, False),
    ("external:vllm", None, False),
])
def test_continues_trailing_assistant_from_records(engine: str, declared: bool | None, continues: bool) -> None:
    """A record that declares the capability is taken at its word; only one without it (None)
    falls back on the engine's name."""
    assert continues_trailing_assistant(_info(engine, declared)) is continues


def test_a_record_from_an_older_agent_decodes_without_the_field() -> None:
    """A record written before the field existed reads as None (the fallback's case), not False."""
    import msgspec

    raw = b'{"id": "w", "url": "http://x", "engine": "lmdeploy", "model": "m"}'
    info = msgspec.json.decode(raw, type=WorkerInfo)
    assert info.continues_trailing_assistant is None and continues_trailing_assistant(info)
