#!/usr/bin/env bash
# Install kvmulti into ./.venv. With --test, also everything the full test suite needs:
# the test/triton/sycl extras and, where apt-get can run, Debian's HIP compiler packages.
# Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
python=${PYTHON:-python3}

if [ "$mode" = "--test" ] && ! command -v hipcc >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian's HIP toolchain (hipcc, libamdhip64-dev, rocm-device-libs) for the HIP compile checks"
    apt-get -o DPkg::Lock::Timeout=900 update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 install -y -qq hipcc libamdhip64-dev rocm-device-libs >/dev/null
  elif [ "${CI:-}" = true ]; then
    echo "setup: error: CI needs hipcc for the HIP compile checks and cannot install it (no root apt-get)" >&2
    exit 1
  else
    echo "setup: warning: hipcc missing and not installable here; the HIP compile checks will be skipped" >&2
  fi
fi

# Debian's intel-opencl-icd ships ocloc (Intel's offline GPU compiler, IGC 1.0.12504): the SYCL
# kernels' Intel GPU compile evidence (sycl/gpu_evidence.py) compiles their SPIR-V with it.
if [ "$mode" = "--test" ] && ! command -v ocloc >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian's intel-opencl-icd (ocloc) for the SYCL Intel GPU compile evidence"
    apt-get -o DPkg::Lock::Timeout=900 update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 install -y -qq intel-opencl-icd >/dev/null
  elif [ "${CI:-}" = true ]; then
    echo "setup: error: CI needs ocloc (apt-get install intel-opencl-icd) and cannot install it (no root apt-get)" >&2
    exit 1
  else
    echo "setup: warning: ocloc missing and not installable here; the SYCL GPU compile evidence test will be skipped" >&2
  fi
fi

# On vendor runners, KVMULTI_SYSTEM_SITE_PACKAGES=1 lets the venv see the preinstalled ROCm/CUDA/XPU torch.
if [ "$mode" = "--test" ] && [ "${CI:-}" = true ]; then
  for tool in hipcc nvcc g++; do
    command -v "$tool" >/dev/null || { echo "setup: error: CI needs $tool for the compile checks" >&2; exit 1; }
  done
fi

[ -x .venv/bin/python ] || "$python" -m venv ${KVMULTI_SYSTEM_SITE_PACKAGES:+--system-site-packages} .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# torch 2.13.0: a CPU build where a local wheel is provided, else whatever the index serves for this host.
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" "torch==2.13.0"
if [ "$mode" = "--test" ]; then
  "${pip[@]}" -e ".[test,triton,sycl]"
else
  "${pip[@]}" -e .
fi
echo "setup: kvmulti installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
