"""Prompt tokens counted with the tokenizer a worker registered, with no `tokenizers:` setting.

Real gateway, agents and simulators (which tokenize with the tiny model's tokenizer.json,
built by `make vllm`, as the real engine would): the agents register the model folder's
tokenizer.json and the gateway loads it on the first request for that model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import msgspec
import openai
from structlog.testing import capture_logs

from fleetgate.schema import WorkerInfo, WorkerView
from gateway.fleet import FleetSnapshot
from gateway.request.tokenizers import Tokenizers
from tests.conftest import Fleet, require_setup
from tests.e2e.test_context_length import SENTENCE, TINY


def test_a_prompt_the_estimate_fits_but_the_tokenizer_does_not_goes_to_the_big_worker_first(
    fleet_factory: Callable[[], Fleet],
) -> None:
    """Eight ~3.9 KB Chinese prompts (~1,000 tokens by the 4-bytes estimate, ~4,000 by the
    tokenizer) on a 2k and a 16k worker: each goes to the 16k worker at its first attempt, none
    is refused by the 2k worker's engine first; the gateway says it loaded the registered tokenizer."""
    require_setup("tokenizer", [TINY / "tokenizer.json"], "vllm", "FLEETGATE_REQUIRE_VLLM")
    fleet = fleet_factory()
    gateway, url = fleet.gateway()
    for wid, length in (("small", 2048), ("big", 16384)):
        fleet.worker(wid, "--model", str(TINY), "--max-model-len", str(length), "--option", "time_scale=0.05")
    fleet.wait_ready(url, "small", "big")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    served = []
    for i in range(8):
        messages = [{"role": "system", "content": f"助手编号 {i}。"}, {"role": "user", "content": SENTENCE * 35}]
        raw = client.chat.completions.with_raw_response.create(
            model="model", messages=messages, max_tokens=8, stream=bool(i % 2))  # type: ignore[arg-type]
        raw.parse()
        served.append(raw.headers["x-fleetgate-worker"])
    log = gateway.output()
    loaded = [json.loads(line) for line in log.splitlines() if '"gateway.tokenizer_loaded"' in line]
    print(f"tokenizer-registry: served={served} refused_first={log.count('gateway.context_refused')} "
          f"retries={log.count('gateway.retry')}")
    assert served == ["big"] * 8
    assert log.count("gateway.context_refused") == 0 and log.count('"gateway.retry"') == 0
    assert [e["path"] for e in loaded] == [str((TINY / "tokenizer.json").resolve())]


def _snapshot(*infos: WorkerInfo) -> FleetSnapshot:
    return FleetSnapshot.build([WorkerView(info=i, state="ready") for i in infos], version=1)


def test_an_unreadable_registered_tokenizer_is_logged_once_and_the_estimate_stays(tmp_path: Path) -> None:
    """A path the gateway cannot load gives no counter (the estimate is used), is logged once
    however many snapshots and requests follow, and a readable one beside it is used."""
    missing = str(tmp_path / "elsewhere" / "tokenizer.json")
    snap = _snapshot(WorkerInfo(id="a", url="http://a", engine="sim", model="m", tokenizer=missing))
    current = [snap]
    tokenizers = Tokenizers({}, lambda: current[0])
    with capture_logs() as logs:
        assert tokenizers.get("m") is None
        current[0] = _snapshot(WorkerInfo(id="a", url="http://a", engine="sim", model="m", tokenizer=missing))
        assert tokenizers.get("m") is None and tokenizers.get("m") is None
        assert tokenizers.get("not-served") is None
    assert [e["event"] for e in logs] == ["gateway.tokenizer_unusable"]
    require_setup("tokenizer", [TINY / "tokenizer.json"], "vllm", "FLEETGATE_REQUIRE_VLLM")
    current[0] = _snapshot(
        WorkerInfo(id="a", url="http://a", engine="sim", model="m", tokenizer=missing),
        WorkerInfo(id="b", url="http://b", engine="sim", model="m", tokenizer=str(TINY / "tokenizer.json")),
    )
    assert tokenizers.get("m") is not None


def test_settings_win_over_the_registry_and_old_records_read() -> None:
    """A `tokenizers:` setting is used even when workers registered another path; a record
    written before the field existed decodes, with no tokenizer."""
    require_setup("tokenizer", [TINY / "tokenizer.json"], "vllm", "FLEETGATE_REQUIRE_VLLM")
    old = msgspec.json.decode(b'{"id":"a","url":"http://a","engine":"sim","model":"m","schema":1}', type=WorkerInfo)
    assert old.tokenizer == ""
    snap = _snapshot(WorkerInfo(id="a", url="http://a", engine="sim", model="m", tokenizer="/nowhere/tokenizer.json"))
    tokenizers = Tokenizers({"m": str(TINY / "tokenizer.json")}, lambda: snap)
    with capture_logs() as logs:
        assert tokenizers.get("m") is not None
    assert logs == []


def test_the_agent_registers_the_model_folders_tokenizer(tmp_path: Path) -> None:
    """workers/tokenizer.py: a folder with tokenizer.json, the file itself, vLLM's --tokenizer
    (which replaces the model's), and a model by name (nothing)."""
    from workers.engines.base import EngineSpec
    from workers.tokenizer import tokenizer_path

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "tokenizer.json").write_text("{}")
    spec = EngineSpec(model=str(tmp_path / "m"), served_name="m", port=1)
    assert tokenizer_path(spec) == str(tmp_path / "m" / "tokenizer.json")
    assert tokenizer_path(EngineSpec(model=str(tmp_path / "m" / "tokenizer.json"), served_name="m", port=1)) \
        == str(tmp_path / "m" / "tokenizer.json")
    for extra in (("--tokenizer", str(tmp_path / "t")), (f"--tokenizer={tmp_path / 't'}",)):
        with_tok = EngineSpec(model=str(tmp_path / "m"), served_name="m", port=1, extra_args=extra)
        assert tokenizer_path(with_tok) == str(tmp_path / "t" / "tokenizer.json")
    assert tokenizer_path(EngineSpec(model="Qwen/Qwen2.5-7B-Instruct", served_name="m", port=1)) == ""
    hub_tok = EngineSpec(model=str(tmp_path / "m"), served_name="m", port=1, extra_args=("--tokenizer", "org/tok"))
    assert tokenizer_path(hub_tok) == ""
