"""Asks for AMX tile permission in every Python process that vLLM starts (issue 13).

vllm_launcher.py puts this folder first on PYTHONPATH, so each Python interpreter
started below vLLM's API server imports this file at start-up: the engine-core and
worker processes (multiprocessing `spawn` execs a fresh interpreter) and the ones vLLM
runs with subprocess (the model-registry inspection, multiprocessing's resource
tracker). The permission is reset on exec, so it cannot be inherited from the launcher.

Stdlib only: it runs inside vLLM's venv. It then runs the sitecustomize it shadows,
if the interpreter has one (Debian's Python does).
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_LAUNCHER = os.path.join(os.path.dirname(_HERE), "vllm_launcher.py")


def _ask_for_amx() -> None:
    spec = importlib.util.spec_from_file_location("_fleetgate_vllm_launcher", _LAUNCHER)
    if spec is None or spec.loader is None:
        return
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)  # as a module of that name, its entry-point code does not run
    launcher.report(launcher.request_amx_permission())


def _run_shadowed_sitecustomize() -> None:
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


# Only as the interpreter's own sitecustomize, not when a test imports this file.
if __name__ == "sitecustomize":
    try:
        _ask_for_amx()
    except Exception as exc:  # start-up must go on whatever happens here
        print(f"vllm_launcher: sitecustomize in pid {os.getpid()}: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
    _run_shadowed_sitecustomize()
