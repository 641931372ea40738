"""gateway/routing/table.py with measured speeds: load and weight follow the speed the agent
measures (Load.speed), the affinity ring stays on the registered start-up figure."""

from __future__ import annotations

from fleetgate.hashing import stable_hash
from fleetgate.schema import Load, WorkerInfo, WorkerView
from gateway.routing import Live, RequestFacts, Routes, decide, make_policy


def view(wid: str, *, registered: float = 1.0, measured: float = 0.0, running: int = 0) -> WorkerView:
    return WorkerView(
        info=WorkerInfo(id=wid, url=f"http://{wid}", engine="sim", model="base", capacity=64,
                        speed=registered, speed_source="profile"),
        state="ready",
        load=Load(running=running, speed=measured, speed_source="engine" if measured else ""),
        id_hash=stable_hash(wid),
    )


def test_slots_weigh_by_the_measured_speed_else_the_registered_one() -> None:
    """A measured speed replaces the start-up figure in a slot's speed and weight; a record
    without one (an older agent) keeps the start-up figure."""
    routes = Routes.build([view("a", registered=1.0, measured=0.5), view("b", registered=0.8)])
    slots = {s.id: s for s in routes.by_model["base"].slots}
    assert (slots["a"].speed, slots["a"].weight) == (0.5, 32.0)
    assert (slots["b"].speed, slots["b"].weight) == (0.8, 64 * 0.8)


def test_the_ring_does_not_move_with_the_measurement() -> None:
    """Keys' ring order depends on the registered figure only: a worker measured at half
    speed keeps its points, so no key moves when a measurement changes."""
    before = Routes.build([view("a"), view("b"), view("c")]).by_model["base"]
    after = Routes.build([view("a", measured=0.5), view("b", measured=1.3), view("c")]).by_model["base"]
    assert (before.ring_points, before.ring_owner) == (after.ring_points, after.ring_owner)


def test_least_load_prefers_the_worker_measured_faster() -> None:
    """Two workers registered alike with the same batch in flight: the one measured at half
    speed counts as twice as loaded, so a request without a key goes to the other."""
    routes = Routes.build([view("a", measured=0.5, running=8), view("b", measured=1.0, running=8)])
    choice = decide(routes, RequestFacts("base"), Live(requests={"a": 8, "b": 8}), make_policy("fleet"))
    assert choice.choices[0].slot.id == "b"
