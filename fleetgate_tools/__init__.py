"""fleetgate's top floor: the benchmarks, calibration, the `fleetgate` CLI and the embedded Redis.

Nothing in `fleetgate/`, `gateway/` or `workers/` imports this package; it stands on all three.
"""
