"""The fast path's answer headers: one block, UTF-8, and no value that could split the head."""

from __future__ import annotations

from gateway.front.fastpath import _block


def test_header_lines_are_joined_in_order() -> None:
    assert _block([("x-fleetgate-worker", "w1"), ("x-request-id", "abc")]) == (
        b"x-fleetgate-worker: w1\r\nx-request-id: abc\r\n")


def test_a_value_with_cr_or_lf_is_left_out_and_non_ascii_is_utf8() -> None:
    block = _block([("x-fleetgate-model", "m\r\nset-cookie: a=b"), ("x-a", "m\nx"), ("x-fleetgate-model", "modèle")])
    assert block == "x-fleetgate-model: modèle\r\n".encode()
    assert _block([]) == b""
