"""Compares a venv with its lock: `VENV/bin/python scripts/locks/check.py LOCK`.

Prints a warning for each installed distribution that the lock does not pin (it was
resolved afresh on this machine: run scripts/locks/update.sh) or pins at another
version. Never fails the install: the tests decide whether the venv works.
Stdlib only: it runs in the engines' venvs.
"""

import importlib.metadata as md
import re
import sys


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(lock_path: str) -> int:
    pins: dict[str, str] = {}
    with open(lock_path) as lock:
        for line in lock:
            if "==" in line and not line.startswith("#"):
                name, version = line.strip().split("==", 1)
                pins[_norm(name)] = version
    lock_name = lock_path.rsplit("/", 1)[-1]
    for dist in sorted(md.distributions(), key=lambda d: _norm(d.metadata["Name"])):
        name = _norm(dist.metadata["Name"])
        if name == "pip":
            continue
        if name not in pins:
            print(f"locks: warning: {dist.metadata['Name']}=={dist.version} is not in {lock_name}")
        elif pins[name] != dist.version:
            print(f"locks: warning: {dist.metadata['Name']}=={dist.version}, {lock_name} says {pins[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
