#!/usr/bin/env bash
# Fills device_peers/ (ignored, never committed) with the peers the device check times beside
# kvmulti, on a host without a GPU; the device tool carries the folder (under its 64 MiB limit):
#
#   bash scripts/build_device_peers.sh [vllm|flashinfer|all]      (default: all)
#
# vllm: vLLM's Triton unified_attention and decode_attention_fwd, copied from the vLLM that
#   setup.sh --test installs into .venv-vllm ($VLLM_PYTHON, else .venv-vllm/bin/python; or name
#   the folder with $VLLM_OPS), with a stand-in for their few vLLM imports. Seconds.
# flashinfer: downloads flashinfer-python, apache-tvm-ffi (for this Python and the device's,
#   $DEVICE_PYTHON_VERSION, default 3.12), the pure-Python packages FlashInfer's import needs and
#   the cuRAND headers into $DEVICE_PEERS_DOWNLOADS (default ~/.cache/kvmulti/device_peers), then
#   builds FlashInfer's paged decode (FA2) and prefill (FA2, FA3) modules ahead of time with the
#   nvcc of $CUDA_HOME / PATH for $FLASHINFER_CUDA_ARCH_LIST (default 9.0a; the H200's sm_90a) and
#   copies the package trimmed to what loading them opens. About 30 minutes of 2 cores (niced);
#   the build log is $DEVICE_PEERS_DOWNLOADS/build.log; modules already built are kept.
#
# Python: $PYTHON (default .venv/bin/python, else python3), which needs torch (any build) and pip.
# On the device, devtools.device_peers loads the bundle with FLASHINFER_DISABLE_JIT=1 after
# installing device_peers/wheels into a scratch folder (docs/performance.md, "Measured on a GPU").
set -euo pipefail
cd "$(dirname "$0")/.."

part=${1:-all}
case "$part" in vllm|flashinfer|all) ;; -h|--help) sed -n '2,20p' "$0"; exit 0 ;; *) echo "unknown part: $part" >&2; exit 2 ;; esac
python=${PYTHON:-.venv/bin/python}
[ -x "$python" ] || python=python3
out=device_peers
mkdir -p "$out"

if [ "$part" != flashinfer ]; then
  ops=${VLLM_OPS:-}
  if [ -z "$ops" ]; then
    vllm_python=${VLLM_PYTHON:-.venv-vllm/bin/python}
    [ -x "$vllm_python" ] || { echo "no vLLM Python at $vllm_python (setup.sh --test makes .venv-vllm; or set VLLM_OPS)" >&2; exit 1; }
    ops=$("$vllm_python" -c 'import importlib.util, os; print(os.path.join(importlib.util.find_spec("vllm").submodule_search_locations[0], "v1", "attention", "ops"))')
  fi
  "$python" -m devtools.device_peers_build --part vllm --vllm-ops "$ops" --out "$out"
fi

if [ "$part" != vllm ]; then
  downloads=${DEVICE_PEERS_DOWNLOADS:-$HOME/.cache/kvmulti/device_peers}
  device_py=${DEVICE_PYTHON_VERSION:-3.12}
  mkdir -p "$downloads/wheels" "$downloads/curand"
  get() { "$python" -m pip download -q --no-deps --only-binary=:all: "$@" 2>&1 | grep -v 'is ignored' || true; }
  [ -n "$(ls "$downloads"/flashinfer_python-0.7.4-*.whl 2>/dev/null)" ] || get -d "$downloads" flashinfer-python==0.7.4
  get -d "$downloads" apache-tvm-ffi==0.1.15.post2
  get -d "$downloads/wheels" --python-version "$device_py" --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    apache-tvm-ffi==0.1.15.post2 requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1 \
    charset-normalizer==3.5.3 nvidia-ml-py==13.615.71 tqdm==4.70.1
  [ -n "$(ls "$downloads"/curand/nvidia_curand-*.whl 2>/dev/null)" ] || get -d "$downloads/curand" \
    --python-version "$device_py" --platform manylinux_2_27_x86_64 nvidia-curand==10.4.0.35
  start=$(date +%s)
  nice -n 10 "$python" -m devtools.device_peers_build --part flashinfer --downloads "$downloads" --out "$out"
  echo "[device_peers] FlashInfer part: $(( $(date +%s) - start )) s"
fi
du -sh "$out"
