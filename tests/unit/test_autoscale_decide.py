"""fleetgate_tools/autoscale.py's decisions, table-driven: thresholds, hysteresis, cool-downs and
min/max, each case one tick of `decide`; plus the loop's template and --model parsing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fleetgate_tools.autoscale import History, Observed, Policy, decide
from fleetgate_tools.autoscale_loop import check_template, parse_models, render
from fleetgate_tools.cli import app

P = Policy(min_workers=1, max_workers=4, up_saturation=0.8, down_saturation=0.3, up_queue=1, up_kv=0.9,
           up_cooldown_s=30, down_cooldown_s=60, down_after_s=20, step=2)
NOW = 1000.0
LONG_AGO = History(last_up=0.0, last_down=0.0)
COLD_LONG = History(last_up=0.0, last_down=0.0, cold_since=NOW - 25)


def ready(n: int, outstanding: int, **kw: object) -> Observed:
    """`n` ready workers of 8 slots each, all retirable unless said otherwise."""
    return Observed(**{"ready": n, "capacity": 8 * n, "outstanding": outstanding, "retirable": n, **kw})  # type: ignore[arg-type]


CASES = [
    # (what it shows, observed, history, action, count, reason contains)
    ("below min: add at once, whatever the load", Observed(ready=0), History(), "up", 1, "< min"),
    ("below min counts starting workers", Observed(ready=0, starting=1), History(), "hold", 0, "cold, at min"),
    ("hot by saturation", ready(1, 7), LONG_AGO, "up", 1, "saturation 0.88"),
    ("hot by queue, with room below saturation", ready(2, 4, queue_depth=3), LONG_AGO, "up", 1, "queue 3"),
    ("hot by KV use", ready(2, 2, kv_use_ratio=0.95), LONG_AGO, "up", 1, "kv use 0.95"),
    ("adds what brings saturation to the threshold, at most `step`", ready(1, 16, queue_depth=8), LONG_AGO,
     "up", 2, "saturation"),
    ("never past max", ready(4, 40), LONG_AGO, "hold", 0, "at max 4"),
    ("step capped by max", ready(3, 40), LONG_AGO, "up", 1, "saturation"),
    ("not while a worker is starting", ready(1, 8, starting=1), LONG_AGO, "hold", 0, "1 starting"),
    ("up cool-down", ready(1, 8), History(last_up=NOW - 10), "hold", 0, "up cool-down 20s"),
    ("between the thresholds: steady", ready(2, 8), COLD_LONG, "hold", 0, "steady"),
    ("cold, first tick: the clock starts", ready(2, 1), LONG_AGO, "hold", 0, "cold for 0s of 20s"),
    ("cold long enough: retire one", ready(2, 1), COLD_LONG, "down", 1, "saturation 0.06 <= 0.3"),
    ("cold but at min", ready(1, 0), COLD_LONG, "hold", 0, "at min 1"),
    ("one retirement at a time", ready(3, 1, draining=1), COLD_LONG, "hold", 0, "1 draining"),
    ("down cool-down after an addition", ready(2, 1), History(last_up=NOW - 30, cold_since=NOW - 25),
     "hold", 0, "down cool-down 30s"),
    ("a queue is never cold", ready(3, 0, queue_depth=1), COLD_LONG, "up", 1, "queue"),
    ("only its own workers", ready(2, 1, retirable=0), COLD_LONG, "hold", 0, "no worker this autoscaler"),
    # 3 of 8 slots busy on 2 workers (0.19) would be 0.375 on one: fine; KV 0.5 -> 1.0 is not.
    ("hysteresis: one fewer would be hot by KV", ready(2, 3, kv_use_ratio=0.5), COLD_LONG, "hold", 0,
     "one worker fewer would be hot"),
    ("the last worker above min goes only when idle", Observed(ready=1, capacity=8, outstanding=1, retirable=1),
     COLD_LONG, "hold", 0, "one worker fewer"),
]


# Rows that need another policy than P: the row's name -> the policy.
POLICIES = {"the last worker above min goes only when idle": Policy(min_workers=0, max_workers=4,
                                                                    down_after_s=20, down_cooldown_s=60)}


@pytest.mark.parametrize(("name", "observed", "history", "action", "count", "reason"), CASES,
                         ids=[c[0] for c in CASES])
def test_decide(name: str, observed: Observed, history: History, action: str, count: int, reason: str) -> None:
    """Each row: one tick's observation and memory -> the action, how many, and why."""
    d = decide(POLICIES.get(name, P), observed, history, NOW)
    assert (d.action, d.count) == (action, count), d.reason
    assert reason in d.reason


def test_history_is_carried_through_a_load_cycle() -> None:
    """Ticks feeding `decide` its own History: hot adds (then waits for the start, then the
    cool-down), cold waits down_after_s, retires one, and the cool-down spaces the next."""
    p = Policy(min_workers=1, max_workers=3, up_cooldown_s=5, down_after_s=4, down_cooldown_s=6)
    h = History()
    actions = []
    for t, o in [
        (0, ready(1, 8)), (1, ready(1, 8, starting=1)), (2, ready(2, 16)), (4, ready(2, 16)),  # up, wait, cool, cool
        (7, ready(2, 16)),  # cool-down over: up again
        (8, ready(3, 1)), (12, ready(3, 1)), (14, ready(3, 1)),  # cold: clock starts at 8; 12: down cool-down
        (15, ready(2, 1)), (19, ready(2, 1)), (21, ready(2, 1)),  # cold again from 15; 19: cooling; 21: down
    ]:
        d = decide(p, o, h, float(t))
        h = d.history
        actions.append(d.action)
    assert actions == ["up", "hold", "hold", "hold", "up", "hold", "hold", "down", "hold", "hold", "down"]
    assert h.last_down == 21 and h.cold_since is None


@pytest.mark.parametrize("kwargs", [
    {"min_workers": 3, "max_workers": 2}, {"down_saturation": 0.8, "up_saturation": 0.8}, {"step": 0},
])
def test_bad_policies_fail_at_start(kwargs: dict[str, object]) -> None:
    """A policy without a hysteresis band, or with min above max, is refused when built."""
    with pytest.raises(ValueError):
        Policy(**kwargs)  # type: ignore[arg-type]


def test_templates_quote_values_and_refuse_unknown_placeholders() -> None:
    """Placeholders are shell-quoted (a model name cannot inject a command); a typo in the
    template fails at start, naming the known ones."""
    assert render("start {model} --port {port}", model="m; rm -rf /", port=5) == "start 'm; rm -rf /' --port 5"
    check_template("ssh gpu-host spawn --id {worker_id} --model {model} --port {port} {n}")
    with pytest.raises(ValueError, match=r"\{worker_id\}"):
        check_template("spawn {workerid}")


def test_model_specs() -> None:
    """`--model NAME` takes the shared bounds; `NAME=MIN:MAX` its own."""
    base = Policy(min_workers=1, max_workers=4)
    policies = parse_models(["a", "b=2:6", "c=0"], base)
    assert (policies["a"].min_workers, policies["a"].max_workers) == (1, 4)
    assert (policies["b"].min_workers, policies["b"].max_workers) == (2, 6)
    assert (policies["c"].min_workers, policies["c"].max_workers) == (0, 4)
    with pytest.raises(ValueError):
        parse_models(["d=x:y"], base)
    assert math.isinf(History().last_up)


@pytest.mark.parametrize(("args", "says"), [
    (["--model", "m"], "no admin token"),
    (["--model", "m", "--token", "t", "--start", "spawn {modle}"], "unknown placeholder"),
    (["--model", "m", "--token", "t", "--min", "3", "--max", "2"], "min_workers <= max_workers"),
    (["--model", "m", "--token", "t", "--up-saturation", "0.2"], "hysteresis band"),
])
def test_cli_refuses_bad_settings_in_one_line(args: list[str], says: str, tmp_path: Path) -> None:
    """`fleetgate autoscale` with a mistake exits 1 at once with one line saying what is wrong."""
    result = CliRunner().invoke(app, ["autoscale", *args, "--log-dir", str(tmp_path)], env={"FLEETGATE_ADMIN_TOKEN": ""})
    assert result.exit_code == 1
    assert says in result.output and "Traceback" not in result.output
