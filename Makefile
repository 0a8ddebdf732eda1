# Two commands do the whole set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python

# Which torch to install, and from where (both may be given on the command line):
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu    # PyTorch's CPU-only wheels
#   make test TORCH="torch==2.12.0"
# Where no CUDA GPU is visible torch is pinned to 2.13.0. Which build that is depends on the index:
# PyPI's Linux wheel is the CUDA build (several GB); PyTorch's CPU index has the CPU build.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(HAS_GPU),yes)
TORCH ?= torch>=2.11
else
TORCH ?= torch==2.13.0
endif
TORCH_INDEX ?=
TORCH_FROM := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)

.PHONY: demo test bench clean

# Each target installs what it needs, and says so as it goes: the demo torch, phalanx and the
# examples' data (scikit-learn); the tests also the trackers, Keras, transformers and the checkers.
PIP := $(PY) -m pip install --disable-pip-version-check --progress-bar on

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch-installed: $(PY)
	@echo "== installing $(TORCH) into $(VENV)"
	$(PIP) $(TORCH_FROM) "$(TORCH)"
	touch $@

$(VENV)/.demo-installed: $(VENV)/.torch-installed pyproject.toml
	@echo "== installing phalanx and what its examples need (scikit-learn)"
	$(PIP) -e ".[examples]"
	touch $@

$(VENV)/.test-installed: $(VENV)/.demo-installed pyproject.toml
	@echo "== installing what the tests need (trackers, Keras, transformers, pytest, ruff, mypy)"
	$(PIP) -e ".[dev]"
	touch $@

demo: $(VENV)/.demo-installed
	$(VENV)/bin/phalanx train examples/digits/config.yaml
	$(VENV)/bin/phalanx eval "$$(ls -td runs/digits-2* | head -n 1)" --stream test

test: $(VENV)/.test-installed
	$(VENV)/bin/ruff format --check src tests bench examples
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -p no:cacheprovider tests

bench: $(VENV)/.test-installed
	$(PIP) -e ".[bench]"
	$(PY) bench/overhead.py
	$(PY) bench/overhead.py --public
	$(PY) bench/ddp_overhead.py
	$(PY) bench/mesh_overhead.py
	$(PY) bench/pipeline_overhead.py
	$(PY) bench/targets.py

clean:
	rm -rf $(VENV) runs
