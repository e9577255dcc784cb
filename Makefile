# Everything a fresh machine needs: `make demo` and `make test` create and
# fill .venv on their own (the first time takes 15-30 min: mmcv's compiled
# ops are built from source; pip caches the wheel, so later venvs take ~2 min).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
JOBS ?= 2
# Where torch comes from, e.g. --index-url https://download.pytorch.org/whl/cpu
# on aarch64 (PyPI's aarch64 torch is a CUDA build; see README).
TORCH_INDEX ?=
STAMP := $(VENV)/.mmseg_gf-installed
NATIVE_STAMP := $(VENV)/.mmseg_gf-native
NATIVE_SOURCES := $(wildcard mmseg_gf/ops/csrc/*.cpp mmseg_gf/ops/csrc/*.h)
PYTEST_ARGS ?=
# Test workers (pytest-xdist): one per core; 0 runs the suite in one process.
TEST_WORKERS ?= auto

# Where `make gpu-check` writes its results.
OUT ?= work_dirs/gpu_check

.PHONY: venv native demo test bench gpu-check arm-check clean

venv: $(STAMP) $(NATIVE_STAMP)

$(STAMP): setup.py pyproject.toml requirements/runtime.txt requirements/tests.txt Makefile
	$(PYTHON) -m venv $(VENV)
	# 1. torch first, pinned: a bare `torch` requirement pulls a CUDA build.
	$(PIP) install torch==2.13.0 $(TORCH_INDEX)
	# 2. mmcv 2.1.0's setup.py needs pkg_resources (setuptools < 81).
	$(PIP) install "setuptools<76" wheel ninja packaging
	$(PIP) install -r requirements/runtime.txt
	# 3. mmcv with its compiled ops ("full" build; mmseg imports mmcv.ops),
	#    without debug info (-g0), which takes compile time and serves no user.
	MMCV_WITH_OPS=1 MAX_JOBS=$(JOBS) CFLAGS="$(CFLAGS) -g0" $(PIP) install --no-build-isolation mmcv==2.1.0
	$(PIP) install mmsegmentation==1.2.2
	$(PIP) install -r requirements/tests.txt
	# 4. this package (editable, without isolation: its CPU kernels compile
	#    against the torch above; mmseg_gf/.mim links configs/ and tools/).
	$(PIP) install --no-build-isolation --no-deps --config-settings editable_mode=compat -e .
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
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

bench: venv
	$(BIN)/python tools/benchmark_layers.py

# On a CUDA machine with the stack (torch, triton, mmcv, mmseg): runs
# $(PYTHON) when given (`make gpu-check PYTHON=...`, e.g. after
# `source .gpu/env.sh`), else .venv's interpreter where .venv exists, else
# python3. About 10 min on one H200: the CUDA tests, the step
# benchmark, the kernels per step, the compiled step and the layer
# benchmark; 8 files in $(OUT). Without CUDA it says so and stops
# (status 3).
GPU_PYTHON := $(if $(filter command line environment,$(origin PYTHON)),$(PYTHON),$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)))
gpu-check:
	$(GPU_PYTHON) tools/gpu_check.py --out-dir $(OUT)

# aarch64 (Raspberry Pi 5, Jetson) from an x86-64 Debian 12 machine: the
# CPU kernels cross-compiled, the op tests (tests/test_ops) on an emulated
# Cortex-A76 with PyPI's aarch64 torch; see .ci/arm_check.sh. The first run
# installs qemu-user-static and g++-aarch64-linux-gnu (apt, as root) and
# fills .arm/ (about 1 GB). ARM_TESTS: other pytest arguments.
arm-check:
	JOBS=$(JOBS) .ci/arm_check.sh $(ARM_TESTS)

clean:
	rm -rf $(VENV) work_dirs/demo data/demo build dist .arm/build mmseg_gf/_*.so mmseg_gf/.mim
