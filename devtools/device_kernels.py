"""kvmulti's kernels on a CUDA GPU against the oracle (``kvmulti.reference``), one process per
backend so that ``compute-sanitizer`` can wrap it:

    python -m devtools.device_kernels --backend TRITON|HIP [--set oracle|launches] [--library SO] [--json OUT]

``TRITON`` is kvmulti's Triton backend; ``HIP`` the HIP kernels built with nvcc
(:mod:`devtools.hip_on_cuda`). ``--set oracle``: the small shapes of :data:`CASES` (decode and
prefill, GQA, fp16 / bf16 / fp32, blocks 16 / 32, a window with softcap, split-KV, an fp8 cache);
``--set launches``: one decode and one prefill (what the memcheck step runs for Triton). Each case
writes the new tokens with the backend and attends, and both must match the oracle (tests/batches.py:
the write exactly, the attention within the dtype's tolerance). Prints one JSON object (and writes
it to ``--json``): ``{"backend", "set", "device", "cases": [{"name", "ok", "seconds", "error"}]}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from batches import CaseSpec, check_against_reference, check_fp8_against_reference  # noqa: E402

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@dataclass(frozen=True)
class DeviceCase:
    name: str
    spec: CaseSpec
    fp8: torch.dtype | None = None          # an fp8 cache of this type (query / key / value: spec.dtype)
    partition_size: int | None = None       # a backend with this split-KV partition (None: its heuristic)


def _spec(order: str, block: int, hkv: int, group: int, head: int, dtype: torch.dtype, q: tuple, ctx: tuple,
          **kw) -> CaseSpec:
    return CaseSpec(order=order, block_size=block, num_kv_heads=hkv, group=group, head_size=head, dtype=dtype,
                    query_lens=q, context_lens=ctx, extra_blocks=1, seed=7, **kw)


CASES = (
    DeviceCase("decode GQA 4, bf16, block 16, HND", _spec("HND", 16, 2, 4, 128, BF16, (1, 1, 1, 1), (37, 300, 1, 1000))),
    DeviceCase("prefill GQA 4, fp16, block 32, NHD", _spec("NHD", 32, 2, 4, 64, F16, (64, 17), (0, 0))),
    DeviceCase("mixed, window 32 + softcap 20, bf16, block 16, HND",
               _spec("HND", 16, 2, 4, 128, BF16, (48, 5, 1), (0, 30, 90), sliding_window=32, softcap=20.0)),
    DeviceCase("chunked prefill GQA 2, fp32, head 80, block 16, NHD", _spec("NHD", 16, 2, 2, 80, F32, (9, 1), (50, 20))),
    DeviceCase("long decode GQA 8, fp16, block 32, NHD (heuristic split)",
               _spec("NHD", 32, 2, 8, 128, F16, (1, 1), (3000, 1500))),
    DeviceCase("long decode GQA 8, bf16, block 16, HND, split in 256-key partitions",
               _spec("HND", 16, 2, 8, 128, BF16, (1, 1, 1), (2000, 700, 33)), partition_size=256),
    DeviceCase("decode + prefill over an fp8 e4m3 cache, bf16, block 16, NHD",
               _spec("NHD", 16, 2, 4, 128, BF16, (1, 1, 20), (300, 41, 0)), fp8=torch.float8_e4m3fn),
)
#: the memcheck step's Triton launches: one decode, one prefill
LAUNCHES = tuple(c for c in CASES if c.name.startswith(("decode GQA", "prefill GQA")))


def make_backend(name: str, library: str | None, partition_size: int | None):
    """The backend object for ``name`` (TRITON or HIP = the nvcc build) with ``partition_size``."""
    if name == "HIP":
        from .hip_on_cuda import NvidiaHipBackend
        return NvidiaHipBackend(Path(library) if library else None, partition_size=partition_size)
    from kvmulti.backends import get_backend
    backend = get_backend(name)
    return backend if partition_size is None else type(backend)(partition_size=partition_size)


def run_case(case: DeviceCase, backend_name: str, library: str | None, device: str = "cuda") -> dict:
    """One case against the oracle on ``device``: ``{"name", "ok", "seconds", "error"}`` (error: None
    or the text)."""
    t0 = time.monotonic()
    error = None
    try:
        backend = make_backend(backend_name, library, case.partition_size)
        if case.fp8 is not None:
            check_fp8_against_reference(case.spec, backend, case.fp8, device=device)
        else:
            check_against_reference(case.spec, backend, device=device)
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception:                                   # recorded; the next case still runs
        error = traceback.format_exc(limit=4)[-3000:]
    return {"name": case.name, "ok": error is None, "seconds": round(time.monotonic() - t0, 3), "error": error}


def run(backend_name: str, which: str, library: str | None) -> dict:
    cases = CASES if which == "oracle" else LAUNCHES
    results = [run_case(c, backend_name, library) for c in cases]
    return {"backend": backend_name, "set": which, "device": torch.cuda.get_device_name(), "cases": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("TRITON", "HIP"), required=True)
    p.add_argument("--set", choices=("oracle", "launches"), default="oracle")
    p.add_argument("--library", help="HIP: the nvcc-built library (default: build it for this device)")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.version.hip:
        print(json.dumps({"backend": a.backend, "set": a.set, "error": "no NVIDIA GPU visible to torch"}))
        return 2
    result = run(a.backend, a.set, a.library)
    text = json.dumps(result)
    if a.json:
        a.json.write_text(text)
    print(text)
    return 0 if all(c["ok"] for c in result["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
