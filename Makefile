# Two commands do the whole set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.phalanx-installed

# Where no CUDA GPU is visible, pin the CPU build: an unpinned torch pulls a multi-GB CUDA build.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(HAS_GPU),yes)
TORCH := torch>=2.11
else
TORCH := torch==2.13.0
endif

.PHONY: demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/phalanx train examples/digits/config.yaml
	$(VENV)/bin/phalanx eval "$$(ls -td runs/digits-2* | head -n 1)" --stream test

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) bench/overhead.py
	$(PY) bench/ddp_overhead.py

clean:
	rm -rf $(VENV) runs
