# Everything a fresh machine needs: `make demo` and `make test` create and
# fill .venv on their own (the first time takes 15-30 min: mmcv's compiled
# ops are built from source; pip caches the wheel, so later venvs take ~2 min).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
JOBS ?= 2
STAMP := $(VENV)/.mmseg_gf-installed
NATIVE_STAMP := $(VENV)/.mmseg_gf-native
NATIVE_SOURCES := $(wildcard mmseg_gf/ops/csrc/*.cpp mmseg_gf/ops/csrc/*.h)
PYTEST_ARGS ?=
# Test workers (pytest-xdist): one per core; 0 runs the suite in one process.
TEST_WORKERS ?= auto

# Where `make gpu-check` writes its results.
OUT ?= work_dirs/gpu_check

.PHONY: venv native demo test bench gpu-check clean

venv: $(STAMP) $(NATIVE_STAMP)

$(STAMP): setup.py requirements/runtime.txt requirements/tests.txt Makefile
	$(PYTHON) -m venv $(VENV)
	# 1. torch first, pinned: a bare `torch` requirement pulls a CUDA build.
	$(PIP) install torch==2.13.0
	# 2. mmcv 2.1.0's setup.py needs pkg_resources (setuptools < 81).
	$(PIP) install "setuptools<76" wheel ninja packaging
	$(PIP) install -r requirements/runtime.txt
	# 3. mmcv with its compiled ops ("full" build; mmseg imports mmcv.ops).
	MMCV_WITH_OPS=1 MAX_JOBS=$(JOBS) $(PIP) install --no-build-isolation mmcv==2.1.0
	$(PIP) install mmsegmentation==1.2.2
	$(PIP) install -r requirements/tests.txt
	# 4. this package (editable); also compiles its optional CPU kernels.
	$(PIP) install --no-build-isolation --no-deps -e .
	$(BIN)/python -c "import mmcv.ops, mmseg.utils, mmseg_gf; print('stack ok')"
	touch $@

# Rebuild the CPU kernels (mmseg_gf/_*.so) when their source changed
# since they were last built; a no-op otherwise.
native: $(NATIVE_STAMP)

$(NATIVE_STAMP): $(STAMP) setup.py $(NATIVE_SOURCES)
	$(BIN)/python setup.py -q build_ext --inplace
	touch $@

demo: venv
	$(BIN)/python tools/demo.py

test: venv
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench: venv
	$(BIN)/python tools/benchmark_layers.py

# On a CUDA machine whose $(PYTHON) has the stack (torch, triton, mmcv,
# mmseg: e.g. after `source .gpu/env.sh`); needs no .venv. About 8 min on
# one H100: the CUDA tests, the layer and step benchmarks, at most 8 files
# in $(OUT). Without CUDA it says so and stops (status 3).
gpu-check:
	$(PYTHON) tools/gpu_check.py --out-dir $(OUT)

clean:
	rm -rf $(VENV) work_dirs/demo data/demo build mmseg_gf/_*.so
