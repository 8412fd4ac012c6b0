# Two commands from a fresh clone (see README):
#   make test      create .venv, install, run the tests but the slow ones (simulator without a GPU)
#                  + PTX compile check; make test-all runs every test (CI does)
#   make figures   create .venv if missing, run every experiment, write results/ and figures/
# On a machine whose python3 already has the packages (the GPU machine): make test VENV=
PYTHON ?= python3
VENV ?= .venv
PY := $(if $(VENV),$(VENV)/bin/python,$(PYTHON))
STAMP := $(if $(VENV),$(VENV)/.installed,)
# On the simulator (PROTO_BACKEND=sim, as CI sets it, or no GPU on this machine) the venv's
# pytest-xdist runs the tests in two processes: CI has 2 cores, and `make test` takes under
# 4 minutes of pytest instead of 6. On a GPU one process: tests that read the device's free
# memory must not share it.
NO_GPU := $(if $(shell nvidia-smi -L 2>/dev/null),,1)
PYTEST_ARGS ?= $(if $(and $(VENV),$(or $(filter sim,$(PROTO_BACKEND)),$(and $(NO_GPU),$(if $(PROTO_BACKEND),,1)))),-n 2,)

.PHONY: test test-all figures compile-check gpu-lane sanitize clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS) -m "not slow"
	@$(MAKE) --no-print-directory compile-check PY=$(PY)

test-all: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory compile-check PY=$(PY)

# Compile every kernel for a real GPU (sm_90) even where none is present.
compile-check: $(STAMP)
	PROTO_BACKEND=ptx PROTO_QUIET=1 $(PY) -m kernels.compile_check
	PROTO_BACKEND=ptx PROTO_QUIET=1 $(PY) -m proto.graph.compile_check
	PROTO_BACKEND=ptx PROTO_QUIET=1 $(PY) -m dev.compile_check

figures: $(STAMP)
	$(PY) -m experiments $(EXPERIMENT_ARGS)

# GPU machine only: every test file in parallel pytest processes (the files that read free
# memory alone, after), one log at results/<device>/gpu_tests_<commit>.txt (tests/gpu_lane.py).
gpu-lane: $(STAMP)
	$(PY) -m tests.gpu_lane

# GPU machine only: compute-sanitizer's four tools over the GPU tests, one process per tool
# and test file; summary in results/<device>/sanitize.txt, logs beside it (tests/sanitize.py).
sanitize: $(STAMP)
	$(PY) -m tests.sanitize

clean:
	rm -rf $(VENV) results/sim figures/sim .pytest_cache .hypothesis
