#!/usr/bin/env python3
"""Compile the gateway's request path with mypyc, in place (issue 17: CPU per request).

    python scripts/compile.py            # compile (make venv runs this)
    python scripts/compile.py --clean    # remove what it built: back to pure Python
    FLEETGATE_PURE=1 python -m gateway   # run the sources although compiled copies exist

The modules below are ordinary typed Python; mypyc turns their classes into C structs
and their calls into C calls. The `.so` files land beside the sources, where Python
imports them first, with `gateway/_accel.json` (the SHA-256 of each compiled source);
gateway/accel.py runs the sources instead whenever one of them no longer matches. It
needs mypy (the dev venv has it) and a C compiler. Without either, or if the build
fails, it says so and leaves pure Python in place: same behaviour, more CPU.

Measured (scripts/bench_instructions.py, user-space instructions per request): see
docs/benchmarks.md, "Issue 17, seventh pass".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GROUP = "gateway._accel"
MANIFEST = ROOT / "gateway" / "_accel.json"
# The request path. Left out: modules that define msgspec Structs (mypyc keeps only plain
# types of a class's annotations, `list` for `list[Message]`, so msgspec would decode less:
# gateway/wire.py and gateway/routing/records.py hold those shapes), Litestar handlers,
# relay.py (mypyc has no async generators; the stream's books and timers are in
# relay_books.py, compiled), tracing.py (its tests hand it stand-ins) and server.py (its
# protocol subclasses uvicorn's; compiled, a closed connection's protocol crashed the cycle
# collector in tests/e2e/test_connection_garbage.py).
MODULES = (
    "gateway/front/fastpath.py",
    "gateway/front/answer.py",
    "gateway/front/front.py",
    "gateway/front/hooks.py",
    "gateway/request/proxy.py",
    "gateway/request/reply.py",
    "gateway/request/attempts.py",
    "gateway/request/dispatch.py",
    "gateway/request/retries.py",
    "gateway/engines/engine_conn.py",
    "gateway/engines/patience.py",
    "gateway/engines/upstream.py",
    "gateway/request/requests.py",
    "gateway/accounts/inflight.py",
    "gateway/accounts/admission.py",
    "gateway/accounts/placement.py",
    "gateway/accounts/waiting.py",
    "gateway/tenants/quota.py",
    "gateway/tenants/usage.py",
    "gateway/tenants/ratelimit.py",
    "gateway/accounts/circuit.py",
    "gateway/observe/metrics.py",
    "gateway/observe/cells.py",
    "gateway/routing/base.py",
    "gateway/routing/fleet.py",
    "gateway/routing/table.py",
    "gateway/routing/homes.py",
    "gateway/request/resume.py",
    "gateway/request/sse.py",
    "gateway/request/relay_books.py",
)


def log(message: str) -> None:
    print(f"compile: {message}", file=sys.stderr, flush=True)


def clean() -> None:
    MANIFEST.unlink(missing_ok=True)
    for path in (ROOT / "gateway").rglob("*.so"):
        path.unlink()
    shutil.rmtree(ROOT / "build" / "accel", ignore_errors=True)


def module_of(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def compile_all(jobs: int) -> None:
    from mypyc.build import mypycify
    from setuptools import Distribution

    os.chdir(ROOT)  # mypycify takes paths relative to here and reads pyproject.toml's [tool.mypy]
    extensions = mypycify(list(MODULES), group_name=GROUP, opt_level="3", target_dir="build/accel")
    dist = Distribution({"name": "fleetgate-accel", "ext_modules": extensions})
    cmd = dist.get_command_obj("build_ext")
    cmd.inplace = True
    cmd.build_temp = "build/accel/temp"
    cmd.parallel = jobs
    dist.run_command("build_ext")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clean", action="store_true", help="remove the compiled modules and stop")
    p.add_argument("--strict", action="store_true", help="fail (exit 1) when it cannot compile")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    clean()
    if args.clean:
        log("removed the compiled modules: the gateway runs pure Python")
        return 0
    try:
        import mypyc.build  # noqa: F401
    except ImportError:
        log("mypy is not installed here: the gateway runs pure Python (same behaviour, more CPU)")
        return 1 if args.strict else 0
    started = time.monotonic()
    log(f"compiling {len(MODULES)} modules with mypyc (a minute or two)")
    # The sources' digests are taken before compiling: a source edited while mypyc runs then
    # no longer matches the manifest, and the guard runs it instead of the older compiled copy.
    digests = {module_of(m): hashlib.sha256((ROOT / m).read_bytes()).hexdigest() for m in MODULES}
    try:
        compile_all(args.jobs)
        missing = [m for m in MODULES if not list((ROOT / m).parent.glob(Path(m).stem + ".*.so"))]
        if missing:
            raise RuntimeError(f"no compiled module for {', '.join(missing)}")
    except (Exception, SystemExit) as exc:  # setuptools reports a compiler error as SystemExit
        clean()
        log(f"could not compile ({type(exc).__name__}: {exc}): the gateway runs pure Python")
        return 1 if args.strict else 0
    MANIFEST.write_text(json.dumps({"group": GROUP, "modules": digests}, indent=1) + "\n")
    log(f"compiled {len(MODULES)} modules in {time.monotonic() - started:.0f} s; FLEETGATE_PURE=1 runs the sources")
    return 0


if __name__ == "__main__":
    sys.exit(main())
