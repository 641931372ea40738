"""The fleetgate gateway. `ACCEL` says whether the request path runs compiled (gateway/accel.py)."""

from gateway import accel as _accel

ACCEL = _accel.guard(__name__, __path__[0])
