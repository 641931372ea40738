"""One calibration run: the fit pass on vLLM alone, the simulator's own TTFT floor, the
comparison in alternating pairs (refitting after each vLLM run unless --no-fit), and the
verdict. `scripts/calibrate_sim.py` is its command line and describes the method."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from fleetgate_tools.calibrate.engines import Engine, start_sim, start_vllm
from fleetgate_tools.calibrate.fit import fit
from fleetgate_tools.calibrate.procfs import QUIET_CORES, QUIET_WAIT_S, quiet_window
from fleetgate_tools.calibrate.table import (
    DISTURBED,
    TOLERANCE,
    group_spread,
    median_figures,
    table,
)
from fleetgate_tools.calibrate.workload import ADMIT, GROUPS, OUT, closed_loop, prefix_counts
from workers.timing import PROFILES

REPS = 3
BUDGET_S = 200  # no re-runs of disturbed groups after this much time
FIT_BUDGET_S = 90  # no re-runs of disturbed fit-pass runs after this much time

Figures = dict[str, float]
Runs = dict[str, list[Figures]]


@dataclass(frozen=True, kw_only=True)
class Options:
    model_dir: str
    vllm_python: str
    no_fit: bool  # compare with the stored cpu-tiny profile as is
    log_dir: Path


class Busy(Exception):
    """The machine is too busy for a measurement that means anything."""


def _print_fields(fields: Figures) -> None:
    stored = PROFILES["cpu-tiny"]
    for k, val in fields.items():
        print(f"  {k:<24}= {val:<12g}(stored: {getattr(stored, k):g})")


class Calibration:
    """The state of one run: both engines, every vLLM run the fit draws on, and the pairs."""

    def __init__(self, opts: Options) -> None:
        opts.log_dir.mkdir(parents=True, exist_ok=True)
        self.opts = opts
        self.vocab = int(
            json.loads((Path(opts.model_dir) / "config.json").read_text())["vocab_size"]
        )
        self.started = time.monotonic()
        self.vllm = start_vllm(opts.vllm_python, opts.model_dir, opts.log_dir)
        self.sim: Engine | None = None
        # Only undisturbed runs feed the fit; the comparison's vLLM runs join them.
        self.fit_runs: Runs = {"admit": [], **{g: [] for g in GROUPS}}
        self.fit_medians: dict[str, Figures] = {}
        self.floor_ttft = 0.0
        self.v: Runs = {}
        self.s: Runs = {}
        self.busy: dict[str, int] = dict.fromkeys(GROUPS, 0)
        self.seed = 100

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def say(self, msg: str) -> None:
        print(f"[{self.elapsed():5.0f} s] {msg}", file=sys.stderr, flush=True)

    def measure(self, engine: Engine, shape: tuple[int, int, int], seed: int) -> Figures:
        return asyncio.run(closed_loop(engine, shape, seed, self.vocab))

    def run(self) -> int:
        try:
            self.fit_medians, cache, other = self.fit_pass()
            self.floor_ttft = self.measure_floor(cache)
            fitted = fit(self.fit_medians, self.floor_ttft)
            print(f"fit pass ({REPS} runs each, median other load {other:.2f} cores; "
                  f"simulator's own TTFT floor {self.floor_ttft * 1000:.1f} ms):")  # fmt: skip
            _print_fields(fitted)
            print(
                f"  num_gpu_blocks = {cache['num_gpu_blocks']:.0f}, block_size = {cache['block_size']:.0f}"
            )
            if self.opts.no_fit:
                print("  (--no-fit: the comparison uses the stored profile)")
            self.sim = self.start_sim("sim", cache, {} if self.opts.no_fit else fitted)
            s_prefix = asyncio.run(prefix_counts(self.sim, self.vocab))
            self.v, self.s = {"prefix": [cache]}, {"prefix": [s_prefix]}
            self.compare()
        except Busy as exc:
            print(f"\nBUSY: {exc} (other processes used more than {QUIET_CORES} cores): the machine "
                  "is too busy to calibrate; run again when it is quiet")  # fmt: skip
            return 2
        finally:
            self.vllm.stop()
            if self.sim:
                self.sim.stop()
        return self.verdict()

    def fit_pass(self) -> tuple[dict[str, Figures], Figures, float]:
        """vLLM alone: medians of REPS undisturbed runs of each group, its prefix counts and
        cache figures, and the median other load meanwhile."""
        self.say(f"starting vLLM (log {self.vllm.log}) ...")
        self.vllm.wait_healthy(300)
        self.say(f"vLLM up (processes {self.vllm.tree}); warm-up, then the fit pass ...")
        for clients in (1, 4, 16):  # the first batches of each size are slow
            self.measure(self.vllm, (clients, 1, OUT), 1)
        # A disturbed run is measured again (twice at most, and not after FIT_BUDGET_S:
        # then the machine is too busy to calibrate).
        for rep in range(REPS):
            for name, shape in (("admit", ADMIT), *GROUPS.items()):
                for attempt in range(3):
                    late = self.elapsed() > FIT_BUDGET_S
                    quiet_window(patience=0.0 if late else QUIET_WAIT_S)
                    r = self.measure(self.vllm, shape, 10 + 3 * rep + attempt)
                    if r["other_cores"] <= QUIET_CORES:
                        self.fit_runs[name].append(r)
                        break
                    if self.elapsed() > FIT_BUDGET_S:
                        raise Busy(f"the fit pass's {name} runs are disturbed")
                    self.say(
                        f"  fit pass: {name} disturbed (other load {r['other_cores']:.2f} cores)"
                    )
        for name, runs in self.fit_runs.items():
            if not runs:
                raise Busy(f"no undisturbed {name} run in the fit pass")
        medians = {name: median_figures(runs) for name, runs in self.fit_runs.items()}
        cache = asyncio.run(prefix_counts(self.vllm, self.vocab))
        other = statistics.median(r["other_cores"] for runs in self.fit_runs.values() for r in runs)
        return medians, cache, other

    def start_sim(self, name: str, cache: Figures, params: Figures) -> Engine:
        eng = start_sim(name, self.opts.model_dir, cache, params, self.opts.log_dir)
        eng.wait_healthy(60)
        self.measure(eng, (1, 2, OUT), 1)
        return eng

    def measure_floor(self, cache: Figures) -> float:
        """The simulator's own latency: its HTTP path plus the client's, with ~zero steps."""
        zero = dict.fromkeys(("base_step_s", "decode_per_seq_s", "prefill_per_token_s",
                              "frontend_per_request_s", "frontend_per_token_s"), 0.0)  # fmt: skip
        floor_sim = self.start_sim("sim-floor", cache, {**zero, "base_step_s": 1e-4})
        try:
            return statistics.median(
                self.measure(floor_sim, GROUPS["c1"], 3 + k)["ttft_p50_c1"] for k in range(REPS)
            )
        finally:
            floor_sim.stop()

    def within_budget(self) -> bool:
        return self.elapsed() < BUDGET_S

    def pair(self, name: str) -> bool:
        """One vLLM run then one sim run of a group; False (and no sim run) when the
        vLLM run was disturbed: other processes took more than QUIET_CORES."""
        self.seed += 1
        assert self.sim is not None
        patience = QUIET_WAIT_S if self.within_budget() else 0.0
        waited, load = quiet_window(patience=patience)
        if waited >= 1:
            self.say(f"  waited {waited:.0f} s for a quieter machine (other load {load:.2f} cores)")
        for eng, into in ((self.vllm, self.v), (self.sim, self.s)):
            r = self.measure(eng, GROUPS[name], self.seed)
            self.say(f"  {eng.name:<4} {name:<3}: TTFT p50 {r[f'ttft_p50_{name}'] * 1000:7.1f} ms, "
                     f"{r[f'tok_s_{name}']:6.0f} tok/s, other load {r['other_cores']:.2f} cores")  # fmt: skip
            if eng is self.vllm and r["other_cores"] > QUIET_CORES:
                self.busy[name] += 1
                self.say(f"  (disturbed: other load {r['other_cores']:.2f} cores; not counted)")
                return False
            into.setdefault(name, []).append(r)
            if eng is self.vllm:
                self.fit_runs[name].append(r)
                if not self.opts.no_fit:  # follow the machine: refit on the latest runs
                    latest = {g: median_figures(runs[-REPS:]) for g, runs in self.fit_runs.items()}
                    httpx.post(
                        self.sim.url + "/sim/profile", json=fit(latest, self.floor_ttft)
                    ).raise_for_status()
        return True

    def compare(self) -> None:
        """REPS undisturbed pairs of each group (within BUDGET_S), then up to two more of a
        group whose vLLM figures spread more than DISTURBED."""
        self.say(f"comparison: vLLM and sim alternating, {REPS} pairs per group ...")
        for _ in range(REPS):
            for name in GROUPS:
                while self.within_budget() and not self.pair(name):
                    pass
        v = self.v
        for name in GROUPS:
            extra = 0
            while len(v.get(name, [])) >= 2 and (spread := group_spread(v[name], name)) > DISTURBED:
                if extra == 2 or not self.within_budget():
                    print(f"note: {name} still spread {spread:.0%} (vLLM); medians of "
                          f"{len(v[name])} pairs")  # fmt: skip
                    break
                print(
                    f"note: {name} spread {spread:.0%} (vLLM) > {DISTURBED:.0%}: measuring it again"
                )
                extra += self.pair(name)

    def verdict(self) -> int:
        """Print the refit and the table: 0 when every figure passes, 1 on a FAIL, 2 (BUSY)
        without 2 undisturbed pairs of every group."""
        v = self.v
        for name, n in self.busy.items():
            if n:
                print(f"note: {n} {name} run(s) of vLLM left out: other processes used more than "
                      f"{QUIET_CORES} cores meanwhile")  # fmt: skip
        short = [name for name in GROUPS if len(v.get(name, [])) < 2]
        if short:
            print(f"\nBUSY: fewer than 2 undisturbed pairs for {', '.join(short)} within "
                  f"{BUDGET_S} s: the machine is too busy to calibrate; run again when it is quiet")  # fmt: skip
            return 2
        med = {name: median_figures(v[name]) for name in GROUPS}
        med["admit"] = self.fit_medians["admit"]
        print("\nfit from the comparison's vLLM medians (what profiles.py stores):")
        _print_fields(fit(med, self.floor_ttft))
        table_text, ok = table(v, self.s)
        print()
        print(table_text)
        used = "stored" if self.opts.no_fit else "fitted"
        print(f"\n{'PASS' if ok else 'FAIL'}: every figure within {TOLERANCE:.0%} ({used} profile; "
              f"{len(v['c1'])}/{len(v['c4'])}/{len(v['c16'])} pairs at 1/4/16; "
              f"{self.elapsed():.0f} s)")  # fmt: skip
        return 0 if ok else 1


def calibrate(opts: Options) -> int:
    """Run the whole calibration; the exit status (0 PASS, 1 FAIL, 2 BUSY)."""
    return Calibration(opts).run()
