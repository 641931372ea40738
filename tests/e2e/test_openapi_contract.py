"""The OpenAPI document is the wire: schemathesis runs every check it has (`-c all`) against
`/schema/openapi.json` of a real gateway and fleet, public and admin operations, with the
stateful phase (the links from `POST /v1/responses` to its retrieve and cancel), and finds
nothing. Generated bodies stay within the fleet's models (tests/e2e/openapi_hooks.py says
how and why); nothing is left outside the document.
"""

from __future__ import annotations

import os
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ADMIN_TOKEN, ROOT, Fleet

API_KEY = "sk-contract-0123456789abcdef"
GEN, EMBED = "contract-gen", "contract-embed"
FAST = ("--option", "time_scale=0.02")
# vLLM keeps Responses API answers only with this set; the links need them kept.
STORE = ("--option", "env={VLLM_ENABLE_RESPONSES_API_STORE: 1}")
# Cases per operation and phase: about a minute for each half on two cores.
EXAMPLES = 40

# Realistic values for what a document cannot know: the fleet's model names.
CONFIG = f"""
[dictionaries.generating]
values = ["{GEN}"]

[dictionaries.embedding]
values = ["{EMBED}"]

[dictionaries.models]
values = ["{GEN}", "{EMBED}"]

[parameters]
"body.model" = {{ dictionary = "generating", probability = 0.8 }}

[[operations]]
include-path = "/v1/embeddings"
parameters = {{ "body.model" = {{ dictionary = "embedding", probability = 0.8 }} }}

[[operations]]
include-path = "/v1/models/{{model_id}}"
parameters = {{ "path.model_id" = {{ dictionary = "models", probability = 0.5 }} }}
"""


@pytest.fixture(scope="module")
def contract_fleet(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[tuple[Fleet, str]]:
    fleet = Fleet(redis_url, f"fgtest-{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("contract"))
    try:
        _, url = fleet.gateway(env={"FLEETGATE_API_KEYS": API_KEY})
        fleet.worker("gen", "--model", GEN, *FAST, *STORE)
        fleet.worker("embed", "--model", EMBED, *FAST, "--option", "runner=pooling", "--option", "convert=embed")
        fleet.wait_ready(url, "gen", "embed")
        yield fleet, url
    finally:
        fleet.close()


def _schemathesis(url: str, tmp: Path, token: str, *select: str) -> str:
    config = tmp / "schemathesis.toml"
    config.write_text(CONFIG)
    argv = [str(ROOT / ".venv" / "bin" / "st"), "--config-file", str(config), "run", f"{url}/schema/openapi.json",
            "-c", "all", "-n", str(EXAMPLES), "--generation-deterministic", "--workers", "1",
            "-H", f"Authorization: Bearer {token}", "--request-timeout", "10", "--no-color", *select]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.e2e.openapi_hooks", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp, env=env)
    report = out.stdout + out.stderr
    summary = report[report.find("= SUMMARY ="):] if "= SUMMARY =" in report else report[-3000:]
    print(" ".join(argv[3:]), "\n", summary)
    assert out.returncode == 0, report[-12000:]
    assert re.search(r"\d+ generated, \d+ passed", summary), summary
    return report


def test_public_operations_match_their_document(contract_fleet: tuple[Fleet, str], tmp_path: Path) -> None:
    """The OpenAI routes, /v1/models and /health with an API key: every check passes."""
    _, url = contract_fleet
    _schemathesis(url, tmp_path, API_KEY, "--exclude-path-regex", "^/admin")


def test_created_responses_follow_their_links(contract_fleet: tuple[Fleet, str], tmp_path: Path) -> None:
    """The stateful phase on the Responses API alone (among every public operation it seldom
    starts there): both links, from a created response to its retrieve and its cancel, are
    followed, and every check passes on what they lead to."""
    _, url = contract_fleet
    report = _schemathesis(url, tmp_path, API_KEY, "--phases", "stateful", "--include-path-regex", "^/v1/responses")
    assert re.search(r"API Links:\s+2 covered / 2 selected", report), report[-4000:]


def test_admin_operations_match_their_document(contract_fleet: tuple[Fleet, str], tmp_path: Path) -> None:
    """Every admin operation with the admin token: every check passes (auth enforced,
    errors in the documented shape, `Allow` right on OPTIONS and 405)."""
    _, url = contract_fleet
    _schemathesis(url, tmp_path, ADMIN_TOKEN, "--include-path-regex", "^/admin")


def test_every_error_status_is_the_openai_error_object(contract_fleet: tuple[Fleet, str]) -> None:
    """The document gives every 4xx and 5xx of every operation the one shared error schema."""
    _, url = contract_fleet
    document = httpx.get(f"{url}/schema/openapi.json").json()
    error = {"$ref": "#/components/schemas/ErrorEnvelope"}
    assert document["components"]["schemas"]["ErrorBody"]["required"] == ["code", "message", "param", "type"]
    for path, item in document["paths"].items():
        for method, operation in item.items():
            errors = {s: r for s, r in operation["responses"].items() if s[0] in "45"}
            assert {"414", "431", "500", "503"} <= errors.keys(), (method, path)
            for status, response in errors.items():
                assert response["content"]["application/json"]["schema"] == error, (method, path, status)


