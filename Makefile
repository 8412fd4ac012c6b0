# Two commands from a fresh clone (see README):
#   make test      create .venv, install, run every test (simulator without a GPU) + PTX compile check
#   make figures   create .venv if missing, run every experiment, write results/ and figures/
# On a machine whose python3 already has the packages (the GPU machine): make test VENV=
PYTHON ?= python3
VENV ?= .venv
PY := $(if $(VENV),$(VENV)/bin/python,$(PYTHON))
STAMP := $(if $(VENV),$(VENV)/.installed,)

.PHONY: test figures compile-check sanitize clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory compile-check PY=$(PY)

# Compile every kernel for a real GPU (sm_90) even where none is present.
compile-check: $(STAMP)
	PROTO_BACKEND=ptx PROTO_QUIET=1 $(PY) -m kernels.compile_check

figures: $(STAMP)
	$(PY) -m experiments $(EXPERIMENT_ARGS)

# GPU machine only: compute-sanitizer's memcheck, racecheck, initcheck and synccheck over the
# GPU tests (Numba's symbol probes are API errors, not bugs: --report-api-errors no), the four
# tools at once (one process each on the same GPU: a sanitized run is slow). Each tool's
# ERROR SUMMARY line goes to results/<device>/sanitize.txt, its whole log beside it.
SANITIZE_TOOLS ?= memcheck racecheck initcheck synccheck
SANITIZE_TESTS ?= tests/test_graph_gpu.py tests/test_control.py tests/test_predicate.py \
	tests/test_search_loop.py tests/test_attention.py tests/test_gemm.py tests/test_sampling.py
sanitize: $(STAMP)
	@dir=results/$$($(PY) -c 'from proto import backend; print(backend.device_name())' 2>/dev/null); \
	mkdir -p $$dir; : > $$dir/sanitize.txt; \
	for tool in $(SANITIZE_TOOLS); do \
	  HYPOTHESIS_PROFILE=ci PROTO_QUIET=1 compute-sanitizer --tool $$tool --report-api-errors no \
	    $(PY) -m pytest -q -p no:cacheprovider $(SANITIZE_TESTS) > $$dir/sanitize-$$tool.log 2>&1 & \
	done; wait; \
	for tool in $(SANITIZE_TOOLS); do \
	  echo "$$tool: $$(grep 'ERROR SUMMARY' $$dir/sanitize-$$tool.log | tail -1); pytest: $$(tail -1 $$dir/sanitize-$$tool.log)" \
	    | tee -a $$dir/sanitize.txt; \
	done

clean:
	rm -rf $(VENV) results/sim figures/sim .pytest_cache .hypothesis
