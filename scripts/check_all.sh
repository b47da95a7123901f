#!/usr/bin/env bash
# The exhaustive tier: everything the gate (the README's test command, .ci/run) leaves out, to run
# before touching kernels and on CI's schedule. docs/ci.md lists what it covers:
# - the tests marked `exhaustive` (the sanitizer rebuilds, the long vLLM engine matrices, the
#   portable and poisoned CPU-kernel builds, ...);
# - the compile evidence (the modules conftest.py marks `evidence`) for every target, not only
#   the gate's one per vendor family (KVMULTI_CHECK_TIER=all);
# - the property tests (hypothesis marks them `hypothesis`) at their full example counts.
# Arguments are passed to pytest (e.g. -x, -k, a file).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --test
export KVMULTI_CHECK_TIER=all
.venv/bin/python -m pytest -q -n auto --dist loadgroup --durations=25 \
  -m "not ipex and (exhaustive or evidence or hypothesis)" "$@"
