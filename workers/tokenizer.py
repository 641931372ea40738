"""Which tokenizer.json a worker's model has, for its registry record.

Every launcher (the simulator, vLLM, LMDeploy, ms-swift) gets the model as `--model PATH`
and vLLM may get `--tokenizer PATH` on top (an extra argument after `--`): when
one of them is a local folder holding tokenizer.json, or such a file itself, the agent
registers its absolute path (`WorkerInfo.tokenizer`) and a gateway that can read it counts
prompt tokens exactly. A model given by name (a hub id) registers nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from workers.engines.base import EngineSpec

TOKENIZER_FILE = "tokenizer.json"


def _flag(args: Sequence[str], name: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` in `args` (the last one given)."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _file(candidate: str) -> str:
    path = Path(candidate).expanduser()
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if path.name == TOKENIZER_FILE and path.is_file():
        return str(path.resolve())
    return ""


def tokenizer_path(spec: EngineSpec) -> str:
    """The absolute path of the model's tokenizer.json, or "" when there is none locally.
    An explicit tokenizer is the engine's, in place of the model's folder (as in vLLM)."""
    explicit = _flag(spec.extra_args, "--tokenizer")
    return _file(str(explicit or spec.model))
