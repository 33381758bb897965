# Two entry points for a fresh machine: `make run` (the main job) and `make test`.
# Both bootstrap .venv once; the stamps make a second invocation skip every install step, and
# only a change to the requirements (or to the Cython sources) redoes the part it affects.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
BUILT := $(VENV)/.kernels-built
PYX := $(wildcard kernels_cy/*.pyx kernels_cy/*.pxd kernels_cy/*.h kernels_cy/isa_*.c)
SNAKEMAKE_ARGS ?=
PYTEST_ARGS ?=
TEST_WORKERS ?= 2

.PHONY: run test setup clean-results

run: $(BUILT)
	$(BIN)/snakemake --cores all $(SNAKEMAKE_ARGS)

# The suite runs in two phases: on $(TEST_WORKERS) pytest-xdist workers all but the `timing`
# tests, then those alone, since they assert on wall-clock time and would measure the other
# worker's load. Whole test files go to a worker (loadfile): module fixtures run once, and
# tests/test_workflow.py starts its runs for the tests it finds in the session, which on a
# worker handed single tests would be every one of them. Files go out in collection order
# (--no-loadscope-reorder), which tests/conftest.py starts with the longest (LONGEST_FIRST).
# PYTEST_ARGS go to both phases.
# Exit status 5 (no test collected) counts only when neither phase had a test to run (make
# reports it as "Error 5", which .ci/run looks for).
test: $(BUILT)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --timing-tests=without $(PYTEST_ARGS); a=$$?; \
	$(BIN)/python -m pytest -p no:xdist --timing-tests=only $(PYTEST_ARGS); b=$$?; \
	echo "make test: suite on $(TEST_WORKERS) workers exited $$a, timing tests alone exited $$b"; \
	for s in $$a $$b; do if [ $$s -ne 0 ] && [ $$s -ne 5 ]; then exit $$s; fi; done; \
	if [ $$a -eq 5 ] && [ $$b -eq 5 ]; then exit 5; fi

setup: $(BUILT)

$(INSTALLED): requirements.txt constraints.txt pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements.txt -c constraints.txt
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $@

$(BUILT): $(INSTALLED) $(PYX)
	$(BIN)/python setup.py --quiet build_ext --inplace
	touch $@

clean-results:
	rm -rf results .snakemake
