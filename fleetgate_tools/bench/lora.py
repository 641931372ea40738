"""What each engine says of its LoRA adapters during a run (issue 36), and its table.

vLLM exports `vllm:lora_requests_info`, an info gauge whose labels are the figures:
`max_lora` (the engine's adapter slots), `running_lora_adapters` and
`waiting_lora_adapters` (comma lists of adapters with requests running / waiting). It keeps
every label set it ever exported, each series' value the Unix time it was last set, so the
engine's present state is the newest series. The simulator exports the same gauge.

`LoadSampler` (engines.py) takes one `LoraInfo` per engine and sample; `lora_stats` sums a
run up per engine: the distinct adapters it had requests for across the samples (what the
issue's "distinct adapters each engine saw" counts: more than its slots means requests for
some of them waited for a slot), the most at one time, and its slots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
from prometheus_client.parser import text_string_to_metric_families

LORA_INFO = "vllm:lora_requests_info"


class LoraInfo(msgspec.Struct, frozen=True):
    """One engine's adapter state at one moment: its slots, and the adapters with requests
    running and waiting (in the engine's order)."""

    slots: int
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()

    @property
    def active(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.running + self.waiting))


def _names(label: str) -> tuple[str, ...]:
    return tuple(n for n in (part.strip() for part in label.split(",")) if n)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0


def parse_lora_info(text: str) -> LoraInfo | None:
    """The newest `vllm:lora_requests_info` series of one /metrics text; None when the
    engine exports none (LoRA off, or another engine)."""
    if LORA_INFO not in text:  # most engines: skip the parse
        return None
    newest: tuple[float, Mapping[str, str]] | None = None
    for family in text_string_to_metric_families(text):
        if family.name != LORA_INFO:
            continue
        for sample in family.samples:
            if newest is None or sample.value > newest[0]:
                newest = (sample.value, sample.labels)
    if newest is None:
        return None
    labels = newest[1]
    return LoraInfo(slots=_int(labels.get("max_lora", "")),
                    running=_names(labels.get("running_lora_adapters", "")),
                    waiting=_names(labels.get("waiting_lora_adapters", "")))  # fmt: skip


# One sample: seconds since the sampler started, and each engine's LoraInfo at that time.
LoraSample = tuple[float, dict[str, LoraInfo]]


def lora_stats(samples: Sequence[LoraSample]) -> dict[str, Any]:
    """Per engine over a run: `seen` (the distinct adapters it had requests for, sorted),
    `seen_n`, `peak` (most adapters with requests at one time), `running_peak` (most
    running at one time) and `slots`. {"eng_lora": {}} when no engine reported LoRA."""
    per: dict[str, dict[str, Any]] = {}
    for _, engines in samples:
        for wid, info in engines.items():
            row = per.setdefault(wid, {"seen": set(), "peak": 0, "running_peak": 0, "slots": info.slots})
            row["seen"].update(info.active)
            row["peak"] = max(row["peak"], len(info.active))
            row["running_peak"] = max(row["running_peak"], len(info.running))
            row["slots"] = info.slots
    out = {}
    for wid, row in sorted(per.items()):
        seen = sorted(row["seen"], key=_natural)
        out[wid] = {"seen": seen, "seen_n": len(seen), "peak": row["peak"],
                    "running_peak": row["running_peak"], "slots": row["slots"]}  # fmt: skip
    return {"eng_lora": out}


def _natural(name: str) -> tuple[str, int]:
    """a2 before a10."""
    head = name.rstrip("0123456789")
    tail = name[len(head):]
    return head, int(tail) if tail else -1


def engine_columns(run: Mapping[str, Any]) -> dict[str, str]:
    """A run's per-engine cells, engines in id order joined by " / ": distinct adapters
    seen (of its slots), most at once, requests waiting (max) and running (mean)."""
    lora: Mapping[str, Mapping[str, Any]] = run.get("eng_lora") or {}
    load: Mapping[str, Mapping[str, Any]] = run.get("eng_load") or {}
    ids = sorted(set(lora) | set(load))

    def join(cells: list[str]) -> str:
        return " / ".join(cells) if cells else "-"

    def num(v: Any, digits: int = 0) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    return {
        "adapters seen": join([f"{lora[w]['seen_n']}" if w in lora else "-" for w in ids]),
        "at once": join([f"{lora[w]['peak']}" if w in lora else "-" for w in ids]),
        "slots": join([f"{lora[w]['slots']}" if w in lora else "-" for w in ids]),
        "waiting max": join([num((load.get(w) or {}).get("waiting_max")) for w in ids]),
        "running mean": join([num((load.get(w) or {}).get("running_mean"), 1) for w in ids]),
    }


ENGINE_KEYS = ("adapters seen", "at once", "slots", "waiting max", "running mean")


def format_lora(runs: Sequence[Mapping[str, Any]]) -> str:
    """The per-engine LoRA table of `scripts/bench_fleet.py` ("" when no run has LoRA data)."""
    if not any(r.get("eng_lora") for r in runs):
        return ""
    header = ["workload", "policy", *(f"eng {k}" for k in ENGINE_KEYS)]
    rows = []
    for r in runs:
        cells = engine_columns(r)
        rows.append([r["workload"], r["policy"], *(cells[k] for k in ENGINE_KEYS)])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "engines' LoRA adapters (vllm:lora_requests_info, per engine):\n" + "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )
