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

.PHONY: run test setup clean-results

run: $(BUILT)
	$(BIN)/snakemake --cores all $(SNAKEMAKE_ARGS)

test: $(BUILT)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

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
