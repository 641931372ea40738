"""Added latency of the gateway over going direct to one simulated engine (issue 2's figure).

    .venv/bin/python scripts/sim_overhead.py     # needs a Redis (FLEETGATE_REDIS_URL or :6379)

One gateway and one simulated worker as real processes; 400 sequential requests each,
direct and through the gateway interleaved; prints the medians and the difference.
"""

import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.conftest import Fleet

tmp = Path(tempfile.mkdtemp(prefix="simoh-"))
f = Fleet(os.environ.get("FLEETGATE_REDIS_URL", "redis://127.0.0.1:6379/13"), "simoh-" + uuid.uuid4().hex[:6], tmp)
try:
    _, url = f.gateway()
    f.worker("w", "--model", "m", "--option", "time_scale=0.01")
    f.wait_ready(url, "w")
    engine = f.workers(url)["w"]["url"]
    body = {"model": "m", "prompt": "hello", "max_tokens": 1}
    res: dict[str, list[float]] = {"direct": [], "gateway": []}
    with httpx.Client() as c:
        for _ in range(50):  # warm-up
            c.post(engine + "/v1/completions", json=body)
            c.post(url + "/v1/completions", json=body)
        for i in range(400):
            order = (("direct", engine), ("gateway", url))
            for name, base in order if i % 2 else order[::-1]:
                t = time.perf_counter()
                r = c.post(base + "/v1/completions", json=body)
                res[name].append(time.perf_counter() - t)
                assert r.status_code == 200
    d, g = statistics.median(res["direct"]) * 1000, statistics.median(res["gateway"]) * 1000
    print(f"simulator, 1 concurrent, max_tokens 1, 400 interleaved requests each: direct p50 {d:.2f} ms, through gateway {g:.2f} ms, added {g - d:.2f} ms")
finally:
    f.close()
