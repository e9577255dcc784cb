#!/usr/bin/env bash
# `make arm-check`: cross-compile the CPU kernels for aarch64 (Raspberry Pi
# 5, Jetson) and run the op-level tests on an emulated Cortex-A76 (the Pi
# 5's core; qemu-aarch64), from an x86-64 Debian 12 machine. Nothing is
# installed system-wide but the toolchain's Debian packages (and the arm64
# architecture in dpkg); the rest lives in $ARM_DIR (git-ignored):
#   sysroot/     Debian 12's aarch64 CPython 3.11 and the libraries it
#                loads, extracted from the arm64 .deb files (no dpkg
#                install), and a Cortex-A76's /proc/cpuinfo (qemu 7.2 shows
#                the host's, on which torch's CPU detection crashes; qemu
#                reads files under QEMU_LD_PREFIX first)
#   site/        torch 2.13.0 (PyPI's aarch64 wheel) and the tests'
#                packages, installed with the host's pip --target
#   cuda-stubs/  stand-ins for the CUDA libraries that wheel links against
#                (.ci/arm_cuda_stubs.py says why that is enough)
# The kernels are built by setup.py itself, run by the aarch64 interpreter
# under qemu with Debian's cross compiler (the interpreter's own sysconfig
# names aarch64-linux-gnu-gcc); the modules land next to the x86-64 ones
# (mmseg_gf/_*.cpython-311-aarch64-linux-gnu.so), which stay untouched.
# Steps are skipped when their result is already there.
#
# Usage: .ci/arm_check.sh [pytest arguments]   (default: tests/test_ops)
set -euo pipefail
cd "$(dirname "$0")/.."

ARM_DIR=$(realpath -m "${ARM_DIR:-.arm}")
HOST_PYTHON=${HOST_PYTHON:-python3}
JOBS=${JOBS:-2}
TORCH_VERSION=2.13.0
SYSROOT=$ARM_DIR/sysroot
SITE=$ARM_DIR/site
PY=$SYSROOT/usr/bin/python3.11
# The interpreter, its libraries and the toolchain's runtime, all arm64.
DEBS="python3.11-minimal libpython3.11-minimal libpython3.11-stdlib
      libpython3.11-dev libc6 libgcc-s1 libstdc++6 libgomp1 libexpat1 zlib1g
      libffi8 libssl3 libbz2-1.0 liblzma5 libcrypt1 libuuid1 libsqlite3-0
      libncursesw6 libtinfo6 libreadline8 libnsl2 libtirpc3 libdb5.3
      libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2
      libkeyutils1"
# The tests' packages (torch's own requirements but its CUDA wheels), and
# mmengine (pure Python; the lean modules log through it) with the
# requirements its import needs (not opencv and matplotlib). No mmcv: it
# would be built from source; the tests that need mmcv or mmseg skip.
DEPS="numpy pytest hypothesis setuptools filelock typing-extensions sympy
      networkx jinja2 fsspec addict yapf termcolor rich pyyaml"
PIP_ARM="--only-binary=:all: --platform manylinux_2_28_aarch64
         --platform manylinux2014_aarch64 --platform any --python-version 3.11
         --implementation cp --abi cp311"

log() { printf '[arm-check] %s\n' "$*"; }

toolchain() {
  if command -v qemu-aarch64-static >/dev/null &&
     command -v aarch64-linux-gnu-g++ >/dev/null &&
     command -v ninja >/dev/null &&
     dpkg --print-foreign-architectures | grep -qx arm64; then
    return
  fi
  log "installing qemu-user-static, g++-aarch64-linux-gnu, ninja (apt)"
  dpkg --add-architecture arm64
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
    qemu-user-static g++-aarch64-linux-gnu ninja-build
}

sysroot() {
  [ -x "$PY" ] && return
  log "extracting Debian's arm64 CPython 3.11 into $SYSROOT"
  mkdir -p "$ARM_DIR/debs" "$SYSROOT"
  local pkgs=()
  for p in $DEBS; do pkgs+=("$p:arm64"); done
  (cd "$ARM_DIR/debs" && apt-get download -q "${pkgs[@]}")
  for deb in "$ARM_DIR"/debs/*.deb; do dpkg-deb -x "$deb" "$SYSROOT"; done
  # Debian's multiarch pyconfig.h includes <aarch64-linux-gnu/python3.11/
  # pyconfig.h> from the system include path, which the cross compiler
  # does not search here: put the aarch64 one in its place.
  cp "$SYSROOT/usr/include/aarch64-linux-gnu/python3.11/pyconfig.h" \
    "$SYSROOT/usr/include/python3.11/pyconfig.h"
  fake_cpuinfo
}

# A Cortex-A76 r4p1 (MIDR 0x414fd0b1) for each of this machine's cores.
fake_cpuinfo() {
  mkdir -p "$SYSROOT/proc"
  : >"$SYSROOT/proc/cpuinfo"
  local cpu
  for cpu in $(seq 0 $(($(nproc) - 1))); do
    printf '%s\n' "processor	: $cpu" "BogoMIPS	: 108.00" \
      "Features	: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp" \
      "CPU implementer	: 0x41" "CPU architecture: 8" "CPU variant	: 0x4" \
      "CPU part	: 0xd0b" "CPU revision	: 1" "" >>"$SYSROOT/proc/cpuinfo"
    mkdir -p "$SYSROOT/sys/devices/system/cpu/cpu$cpu/regs/identification"
    echo 0x00000000414fd0b1 \
      >"$SYSROOT/sys/devices/system/cpu/cpu$cpu/regs/identification/midr_el1"
  done
}

site() {
  if [ ! -d "$SITE/torch" ]; then
    log "installing PyPI's aarch64 torch $TORCH_VERSION into $SITE"
    # --no-deps: its CUDA wheels are several GB and of no use here.
    "$HOST_PYTHON" -m pip install -q --target "$SITE" $PIP_ARM --no-deps \
      "torch==$TORCH_VERSION"
    "$HOST_PYTHON" -m pip install -q --target "$SITE" $PIP_ARM $DEPS
    "$HOST_PYTHON" -m pip install -q --target "$SITE" $PIP_ARM --no-deps \
      mmengine==0.10.7
  fi
  if [ ! -d "$ARM_DIR/cuda-stubs" ]; then
    "$HOST_PYTHON" .ci/arm_cuda_stubs.py "$SITE/torch/lib" "$SYSROOT" \
      "$ARM_DIR/cuda-stubs"
  fi
}

# The aarch64 interpreter under qemu, seeing $SITE and this checkout.
arm_python() {
  QEMU_CPU=cortex-a76 QEMU_LD_PREFIX="$SYSROOT" \
    LD_LIBRARY_PATH="$ARM_DIR/cuda-stubs" PYTHONPATH="$SITE:$PWD" \
    PYTHONDONTWRITEBYTECODE=1 qemu-aarch64-static "$PY" "$@"
}

build() {
  log "cross-compiling the kernels (setup.py build_ext, MAX_JOBS=$JOBS)"
  local start=$SECONDS
  # CPPFLAGS: the sysroot's Python.h ahead of the one its sysconfig names
  # (/usr/include/python3.11, the host's x86-64 headers where installed).
  CC=aarch64-linux-gnu-gcc CXX=aarch64-linux-gnu-g++ MAX_JOBS=$JOBS \
    CPPFLAGS="-I$SYSROOT/usr/include/python3.11" \
    arm_python setup.py -q build_ext --inplace --build-temp "$ARM_DIR/build"
  log "built in $((SECONDS - start)) s: $(ls mmseg_gf/_*aarch64*.so | xargs)"
}

run_tests() {
  log "op tests under qemu-aarch64: $*"
  local start=$SECONDS
  arm_python - <<'EOF'
import platform, torch, mmseg_gf._patch_ops, mmseg_gf._bit_mask, \
    mmseg_gf._resized_loss
print('[arm-check]', platform.machine(), 'torch', torch.__version__,
      'kernels', mmseg_gf._patch_ops.__file__)
EOF
  arm_python -m pytest -p no:cacheprovider "$@"
  log "tests took $((SECONDS - start)) s under qemu"
}

toolchain
sysroot
site
build
# By default tests/test_ops but two tests whose 512-channel convs take
# many minutes each when emulated (they are not about the architecture;
# hypothesis refuses the Linear's random layers as too slow to generate)
# and two that start sys.executable in a subprocess (an aarch64 binary:
# without binfmt_misc only qemu runs it); and torch.compile's inductor
# cases (inductor compiles C++ with the host's x86-64 g++).
if [ $# -eq 0 ]; then
  T=tests/test_ops
  set -- $T -q -rs -k 'not inductor' \
    --deselect $T/test_gf_native.py::test_fused_gemms_on_onednn_only_when_large \
    --deselect $T/test_gf_native.py::test_fused_backward_float32_large_map \
    --deselect $T/test_native_checks.py::test_every_entry_point_checks_its_arguments \
    --deselect $T/test_gf_triton.py::test_package_runs_without_triton \
    --deselect $T/test_gf_linear_properties.py::test_random_linear_layers_match_reference
fi
run_tests "$@"
