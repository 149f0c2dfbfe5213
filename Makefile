# The two commands of the README. Each sets itself up on a fresh machine (a venv in .venv).
#   make demo   the main job: two training runs, shown bit-identical (CPU path without a GPU)
#   make test   the test suite (GPU tests are skipped where CUDA is absent)
VENV ?= .venv
PY := $(VENV)/bin/python
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: test demo setup
setup: $(VENV)/.installed

# Without a GPU take the small CPU build of torch (a plain "torch" requirement pulls a
# multi-GB CUDA build); with one, reuse the system's CUDA torch through system site-packages.
# The dev extra holds what the tests need: pytest, hypothesis and Triton (whose kernels the tests
# run in its CPU interpreter; the CPU path itself never imports it).
$(VENV)/.installed: setup.cfg pyproject.toml
# With a GPU the hopper extra comes too: the Hopper backend's kernels (used on sm90 GPUs only).
ifeq ($(HAS_GPU),1)
	python3 -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q -e '.[dev,hopper]'
else
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
endif
	touch $@

test: setup
	$(PY) -m pytest -q -p no:cacheprovider

demo: setup
	$(VENV)/bin/dash-repro demo
