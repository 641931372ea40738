"""free_port: with FLEETGATE_PORT_RANGE, ports are handed out in one turn shared by every process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fleetgate.net import PORT_RANGE_ENV, free_port

LOW, SIZE = 19900, 10  # below the tests' own range (tests/conftest.py) and the ephemeral ports


@pytest.fixture
def own_turn(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """The range, with its turn kept in this test's own folder (no other run shares it)."""
    monkeypatch.setenv(PORT_RANGE_ENV, f"{LOW}-{LOW + SIZE}")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return {**os.environ, "TMPDIR": str(tmp_path)}


def test_the_range_is_handed_out_in_turn_across_processes_skipping_a_bound_port(own_turn: dict[str, str]) -> None:
    """Ports come one after another whichever process asks, a port someone listens on is
    skipped, and none comes twice before the whole range went round."""
    first = free_port()
    busy = LOW + (first - LOW + 2) % SIZE
    with socket.socket() as held:
        held.bind(("127.0.0.1", busy))
        held.listen()
        mine = free_port()
        theirs = int(subprocess.run([sys.executable, "-c", "from fleetgate.net import free_port; print(free_port())"],
                                    env=own_turn, capture_output=True, text=True, check=True).stdout)
        rest = [free_port() for _ in range(SIZE - 3)]
    taken = [first, mine, theirs, *rest]
    assert all(LOW <= p < LOW + SIZE for p in taken)
    assert (theirs - mine) % SIZE == 2  # the other process went on from this one's turn, past `busy`
    assert busy not in taken and len(set(taken[:-1])) == SIZE - 1
    assert taken[-1] == first  # round again


def test_an_empty_range_is_refused(own_turn: dict[str, str]) -> None:
    os.environ[PORT_RANGE_ENV] = f"{LOW}-{LOW}"
    with pytest.raises(ValueError):
        free_port()


def test_a_block_of_ports_in_a_row_is_free_whole_and_handed_out_whole(own_turn: dict[str, str]) -> None:
    """`--instances 3` puts engines on port, port + 1, port + 2: a block that holds a busy port
    is passed over, one that would run past the range's end too, and the next turn starts
    after the block."""
    first = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", LOW + (first - LOW + 2) % SIZE))
        held.listen()
        block = free_port(count=3)
        busy = held.getsockname()[1]
        assert busy not in range(block, block + 3) and LOW <= block and block + 3 <= LOW + SIZE
        after = free_port()
    assert after == (block + 3 if block + 3 < LOW + SIZE else LOW) or after == busy + 1


def test_without_a_range_the_os_picks_a_block_that_is_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PORT_RANGE_ENV, raising=False)
    port = free_port(count=4)
    for k in range(4):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port + k))
