#!/usr/bin/env bash
# kvmulti's device check on one NVIDIA GPU: one command, at most 8 minutes including set-up, no
# network. Usage:
#
#   bash scripts/device_check.sh [OUT_DIR] [--dry-run]      (default OUT_DIR: device_check_out/)
#
# It installs kvmulti from this working tree into the machine's Python ($PYTHON, else python3)
# with `pip install --no-deps --no-build-isolation -e .` (nothing is downloaded), prints the torch /
# triton / driver / nvcc versions, then runs `python -m devtools.device_check OUT_DIR`: the HIP
# kernels built with nvcc and checked against the oracle, timings (Triton, HIP via nvcc, the peers of
# device_peers/ -- vLLM's Triton kernels, FlashInfer FA2 / FA3 --, torch SDPA, eager and replayed
# from CUDA graphs; measured copy bandwidth and matmul rate, the model's estimates), `pytest -m cuda`, and
# compute-sanitizer memcheck runs. Each step has its own cap inside a 450 s budget; a failing step
# is recorded and the next one runs. Results: OUT_DIR/device_check.json, device_check.md,
# device_check.log, pytest_cuda.xml (four files). docs/performance.md says what is measured.
#
# --dry-run (no GPU; tests/test_device_check.py runs it): checks every step is wired, compiles the HIP sources with nvcc for
# sm_90, and writes the reports from a fake result; exit 0 when all of that holds. It uses the
# Python that already has kvmulti ($PYTHON, else python3) and installs nothing.
#
# With the device tool (a later session whose task is lent a GPU): the `run` tool copies the
# working tree (tracked and untracked-not-ignored files; .git does not travel); carry the ignored
# peer bundle that scripts/build_device_peers.sh made (without it the peers are recorded as absent)
# and pass the commit in. One call, leaving room under the 10-minute limit:
#   run(command="DEVICE_CHECK_COMMIT=<git rev-parse HEAD here> bash scripts/device_check.sh \"$OUT\"",
#       carry=["device_peers"], timeout_s=540)
# The four files come back under the reply's files_at (the tail of the output shows the markdown
# tables). Then, here: python -m devtools.device_report docs <files_at>/device_check.json, and
# commit the JSON and markdown under docs/ with the device named. Call give_back unless you rerun.
set -uo pipefail
cd "$(dirname "$0")/.."

out=device_check_out
dry=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=(--dry-run) ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) out=$arg ;;
  esac
done
python=${PYTHON:-python3}
mkdir -p "$out"
# tools installed beside that Python (CI's nvcc from PyPI is .venv/bin/nvcc) come first on PATH
PATH="$(dirname "$(command -v "$python")"):$PATH"
export PATH

if [ ${#dry[@]} -eq 0 ]; then
  start=$(date +%s)
  export PYTHONUNBUFFERED=1
  echo "== installing kvmulti from $(pwd) into $($python -c 'import sys; print(sys.prefix)')"
  if ! $python -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$out/install.log" 2>&1; then
    echo "pip install -e . failed (see $out/install.log); the check runs with what imports as it is"
    tail -5 "$out/install.log"
  fi
  unset TRITON_INTERPRET
  $python -c "import torch, triton, kvmulti, kvmulti.triton_kernels; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, '| kvmulti from', kvmulti.__file__)" \
    || echo "kvmulti does not import (see above)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi: not available"
  (nvcc --version || "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" --version) 2>/dev/null | tail -1 || echo "nvcc: not found"
  budget=$(( 465 - ($(date +%s) - start) ))
  $python -m devtools.device_check "$out" --budget "$budget"
  rc=$?
  # the device tool returns at most 8 files from OUT_DIR: the install log goes into the run's log
  [ -f "$out/install.log" ] && { echo "===== install log"; cat "$out/install.log"; } >>"$out/device_check.log" \
    && rm -f "$out/install.log"
  exit $rc
fi
exec $python -m devtools.device_check "$out" "${dry[@]}"
