"""Cross-compilation of every Triton specialisation kvmulti launches, for real GPU targets, with no
GPU, and what the compilers' output says about each one.

``triton.compile(ASTSource(...), target=GPUTarget(...))`` runs the whole pipeline down to
PTX/cubin and AMDGCN/hsaco. The launches compiled are the ones the backend builds
(:func:`launch.attention_launches` / :func:`launch.write_kv_launches`) for a fixed set of batches
(:func:`batch_specs`); their signatures, constexprs and alignment attributes are derived from the
launch arguments exactly as ``@triton.jit`` does at run time (an int argument equal to 1 becomes a
constexpr; on AMD a tensor of at most 2 GiB is marked for buffer loads, a larger one is not, which
is why the large-cache batches hold their cache in a > 2 GiB ``meta`` tensor).

Per specialisation, :func:`analyse` reads from the compiler output: registers (NVIDIA: ``cuobjdump
-res-usage`` of the cubin; AMD: the kernel descriptor's VGPR/AGPR/SGPR counts), spills, shared
memory / LDS bytes, matrix instructions (``mma.sync``/``wgmma`` in PTX, ``v_mfma`` in AMDGCN),
global load widths, ``cp.async.wait_group`` immediates; :func:`occupancy` turns registers and shared
memory into resident CTAs per SM / work-groups per CU with the target's limits (:data:`TARGETS`).

Compilation must run in a process where ``TRITON_INTERPRET`` was never set (once
``triton.language`` is imported under the interpreter nothing compiles any more), hence
:func:`compile_in_subprocesses`, which runs this module as a script once per target::

    python devtools/triton_cross_compile.py sm_90 results.json [SPEC,SPEC...]

With another Triton release first on PYTHONPATH (``compile_in_subprocesses(triton_dir=...)``) the
same launches are planned and compiled for that release (devtools/triton_versions.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch


# --------------------------------------------------------------------------------------- targets
@dataclass(frozen=True)
class Target:
    """A compile target and the per-SM / per-CU limits occupancy is computed from."""
    name: str                   # "sm_90", "gfx942"
    backend: str                # "cuda" | "hip"
    arch: int | str             # GPUTarget arch
    warp_size: int
    device: str                 # the product the figures stand for
    compute_units: int          # SMs / CUs of that product (one GCD for MI250X)
    shared_per_unit: int        # bytes of shared memory / LDS per SM / CU
    shared_per_block: int       # largest allocation one CTA / work-group may have
    regs_per_unit: int          # NVIDIA: 32-bit registers per SM; AMD: VGPRs per lane per SIMD
    max_warps_per_unit: int     # NVIDIA: warps per SM; AMD: waves per SIMD
    max_blocks_per_unit: int    # CTAs per SM / work-groups per CU
    simds_per_unit: int = 1     # AMD: SIMDs per CU (a work-group's waves spread over them)
    sgprs_per_simd: int = 0     # AMD: scalar registers per SIMD

    @property
    def family(self) -> str:
        """The launch planner's target family (``launch.FAMILIES``)."""
        return "nvidia" if self.backend == "cuda" else "amd"

    @property
    def planner_arch(self) -> int | None:
        """The launch planner's ``arch`` (``launch.device_arch``): NVIDIA's compute capability."""
        return self.arch if self.backend == "cuda" else None

    @property
    def asm_key(self) -> str:
        return "ptx" if self.backend == "cuda" else "amdgcn"

    @property
    def binary_key(self) -> str:
        return "cubin" if self.backend == "cuda" else "hsaco"

    @property
    def marker(self) -> str:
        return f".target sm_{self.arch}" if self.backend == "cuda" else str(self.arch)

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget(self.backend, self.arch, self.warp_size)


TARGETS: dict[str, Target] = {t.name: t for t in (
    # NVIDIA: 64 K registers, 64 warps, 32 CTAs per SM; 1 KiB of every CTA's shared memory is reserved.
    Target("sm_80", "cuda", 80, 32, "A100 SXM", 108, 164 * 1024, 163 * 1024, 65536, 64, 32),
    Target("sm_90", "cuda", 90, 32, "H100 SXM", 132, 228 * 1024, 227 * 1024, 65536, 64, 32),
    # AMD CDNA: 4 SIMDs per CU, 512 VGPRs (arch + acc) per lane per SIMD, 8 waves per SIMD, 64 KiB LDS.
    Target("gfx90a", "hip", "gfx90a", 64, "MI250X (one GCD)", 110, 64 * 1024, 64 * 1024, 512, 8, 32, 4, 800),
    Target("gfx942", "hip", "gfx942", 64, "MI300X", 304, 64 * 1024, 64 * 1024, 512, 8, 32, 4, 800),
)}

NVIDIA_RESERVED_SHARED = 1024


# --------------------------------------------------------------------------------------- batches
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPE_NAMES = {F32: "fp32", F16: "fp16", BF16: "bf16", E4M3: "e4m3", E5M2: "e5m2"}
TWO_GIB = 2 ** 31


@dataclass(frozen=True)
class BatchSpec:
    """A batch whose launches are compiled. ``large_cache``: the cache is a > 2 GiB meta tensor.
    ``dtype``: the cache's; ``query_dtype``: queries, keys, values and outputs (None: the cache's;
    an fp8 cache needs one)."""
    name: str
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    dtype: torch.dtype = F16
    query_dtype: torch.dtype | None = None
    head_size: int = 64
    head_size_v: int | None = None
    num_kv_heads: int = 2
    group: int = 4
    block_size: int = 16
    order: str = "NHD"
    sliding_window: int | None = None
    softcap: float | None = None
    split_kv: bool | None = None
    partition_size: int = 512
    large_cache: bool = False
    compute_units: int = 132


def batch_specs(target_name: str | None = None) -> list[BatchSpec]:
    """Every dtype x head-size padding x {mixed, decode, split}, plus corner batches whose int
    arguments equal 1 (constexprs at run time), HND caches, K/V head sizes that differ, and the
    batches of the paper model (:func:`model_specs`) on ``target_name``'s device (every target's
    when None) with small and > 2 GiB caches."""
    out = []
    for dtype in (F32, F16, BF16):
        for hs in (16, 32, 64, 80, 256):              # pads 16, 32, 64, 128, 256
            d = f"{DTYPE_NAMES[dtype]}_hs{hs}"
            base = dict(dtype=dtype, head_size=hs)
            out.append(BatchSpec(f"{d}_mixed", (7, 1, 3), (0, 40, 9), sliding_window=20, softcap=10.0, **base))
            out.append(BatchSpec(f"{d}_decode", (1, 1, 1), (40, 9, 100), **base))
            out.append(BatchSpec(f"{d}_split", (1, 1), (1100, 300), split_kv=True, **base))
            out.append(BatchSpec(f"{d}_prefill", (PREFILL_LEN, 1, 9), (0, 40, 100), **base))
            if dtype != F32:      # prefill_tiles picks other tiles under a window
                out.append(BatchSpec(f"{d}_prefill_window", (PREFILL_LEN, 1, 9), (0, 40, 100), sliding_window=40,
                                     softcap=30.0, **base))
    out += prefill_specs()
    out += [
        BatchSpec("ones", (5,), (3,), num_kv_heads=1, group=1, block_size=1, sliding_window=1),
        BatchSpec("decode_g16_blockq1", (1, 1), (30, 7), group=16),
        BatchSpec("split_one_part", (1,), (20,), split_kv=True),
        BatchSpec("split_prefill_rows", (9, 1), (0, 40), order="HND", split_kv=True, partition_size=16),
        BatchSpec("hnd_bf16", (6, 1), (2, 25), dtype=BF16, order="HND", block_size=32),
        BatchSpec("hsv_differs", (4, 1), (10, 40), head_size_v=32),
        BatchSpec("gqa32", (3, 1), (0, 20), group=32, num_kv_heads=1),
        BatchSpec("single_token_seq", (1,), (0,)),
        BatchSpec("decode_block1", (1, 1), (40, 9), block_size=1),        # the block table read per key
        BatchSpec("mixed_block1", (5, 1), (3, 20), block_size=1),
    ]
    out += fp8_specs()
    for target in TARGETS.values():
        if target_name in (None, target.name):
            out += model_specs(target)
    return out


PREFILL_LEN = 70        # a query at least launch.PREFILL_MIN_QUERY_LEN long: the step is planned as prefill


def prefill_specs() -> list[BatchSpec]:
    """Prefill steps (the longest query at least ``launch.PREFILL_MIN_QUERY_LEN``) beyond the
    dtype x head-size ones (each with and without window + softcap): window and softcap alone, head
    sizes below their pads, GQA
    1 / 8 / 16, HND, block sizes 1 and 128, K/V head sizes that differ, fp8 caches with and without a
    window."""
    q, c = (PREFILL_LEN, 1, 9), (0, 40, 100)
    return [
        BatchSpec("prefill_window_softcap", q, c, dtype=BF16, head_size=128, sliding_window=40, softcap=30.0),
        BatchSpec("prefill_window_fp16", q, c, dtype=F16, head_size=128, sliding_window=40),
        BatchSpec("prefill_window_softcap_fp16", q, c, dtype=F16, head_size=128, sliding_window=40, softcap=30.0),
        BatchSpec("prefill_softcap_fp16", q, c, dtype=F16, head_size=128, softcap=30.0),
        BatchSpec("prefill_window_hs32", q, c, dtype=BF16, head_size=32, sliding_window=40),
        *(BatchSpec(f"prefill_hs{hs}_{DTYPE_NAMES[dt]}", q, c, dtype=dt, head_size=hs)   # masked head lanes
          for hs in (8, 24, 40) for dt in (F16, BF16)),
        BatchSpec("prefill_e4m3_bf16_no_window", q, c, dtype=E4M3, query_dtype=BF16, head_size=128),
        BatchSpec("prefill_e5m2_bf16_window", q, c, dtype=E5M2, query_dtype=BF16, head_size=128, sliding_window=40),
        BatchSpec("prefill_gqa1_hnd", q, c, dtype=F16, head_size=128, group=1, order="HND"),
        BatchSpec("prefill_gqa8_block128", q, c, dtype=BF16, head_size=128, group=8, block_size=128),
        BatchSpec("prefill_gqa16", q, c, dtype=BF16, head_size=64, group=16),
        BatchSpec("prefill_block1", q, c, dtype=F16, head_size=64, block_size=1),
        BatchSpec("prefill_hsv_differs", q, c, dtype=BF16, head_size=128, head_size_v=64),
        BatchSpec("prefill_e4m3_bf16", q, c, dtype=E4M3, query_dtype=BF16, head_size=128, sliding_window=40),
        BatchSpec("prefill_e5m2_fp16", q, c, dtype=E5M2, query_dtype=F16, head_size=128, order="HND"),
        BatchSpec("prefill_e4m3_fp32", q, c, dtype=E4M3, query_dtype=F32, head_size=64),
    ]


def fp8_specs() -> list[BatchSpec]:
    """fp8 caches (kvmulti/fp8.py): both formats x {mixed, decode, split} with bf16/fp16 queries,
    plus an fp32-query and an HND batch."""
    out = []
    for dtype, act in ((E4M3, BF16), (E5M2, F16)):
        d = f"{DTYPE_NAMES[dtype]}_{DTYPE_NAMES[act]}"
        base = dict(dtype=dtype, query_dtype=act, head_size=128)
        out.append(BatchSpec(f"{d}_mixed", (7, 1, 3), (0, 40, 9), sliding_window=20, softcap=10.0, **base))
        out.append(BatchSpec(f"{d}_decode", (1, 1, 1), (40, 9, 100), **base))
        out.append(BatchSpec(f"{d}_split", (1, 1), (1100, 300), split_kv=True, **base))
    out += [BatchSpec("e4m3_fp32_mixed", (5, 1), (0, 30), dtype=E4M3, query_dtype=F32, head_size=64),
            BatchSpec("e5m2_bf16_hnd_decode", (1, 1), (30, 70), dtype=E5M2, query_dtype=BF16, order="HND")]
    return out


def model_specs(target: Target) -> list[BatchSpec]:
    """The paper model's batches on ``target``'s device: decode of 32 sequences x 4096 positions
    and prefill of 8 prompts x 2048 tokens, 32 query / 8 KV heads, head 128, bf16, block 16, HND;
    each with a cache of at most 2 GiB and (AMD compiles it separately) one larger than 2 GiB."""
    base = dict(dtype=BF16, head_size=128, num_kv_heads=8, group=4, order="HND", compute_units=target.compute_units)
    out = []
    for large in (False, True):
        suffix = "_large_cache" if large else ""
        out.append(BatchSpec(f"model_decode_{target.name}{suffix}", (1,) * 32, (4095,) * 32, large_cache=large,
                             **base))
        out.append(BatchSpec(f"model_prefill_{target.name}{suffix}", (2048,) * 8, (0,) * 8, large_cache=large,
                             **base))
    return out


def _cache(spec: BatchSpec, num_blocks: int):
    """(layout, cache) on the ``meta`` device (nothing is allocated; the JIT's specialisation only
    looks at the data pointer's alignment and, on AMD, the storage size): ``num_blocks`` blocks,
    or enough for more than 2 GiB when ``spec.large_cache``."""
    import kvmulti

    def layout_of(blocks: int):
        return kvmulti.KVCacheLayout(num_blocks=blocks, block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                                     head_size=spec.head_size, head_size_v=spec.head_size_v, dtype=spec.dtype,
                                     order=spec.order)
    layout = layout_of(num_blocks)
    if spec.large_cache:
        block_bytes = math.prod(layout.shape[1:]) * spec.dtype.itemsize
        layout = layout_of(max(num_blocks, TWO_GIB // block_bytes + 1))
    return layout, layout.allocate("meta", zero=False)


def launches(spec: BatchSpec, family: str, arch: int | None = None, version: tuple[int, int] | None = None):
    """[(name, launch.Launch)] of one batch planned for ``family`` (and the NVIDIA ``arch``, 90 for
    sm_90) and the Triton release ``version`` (None: the running one): its attention launches and
    its write_kv launch."""
    import kvmulti
    from kvmulti.backends.triton import launch
    seq_lens = [c + q for c, q in zip(spec.context_lens, spec.query_lens)]
    bs = spec.block_size
    width = max(-(-s // bs) for s in seq_lens)
    table = torch.arange(len(seq_lens) * width, dtype=torch.int32).reshape(len(seq_lens), width)
    layout, cache = _cache(spec, len(seq_lens) * width)
    md = kvmulti.CommonAttentionMetadata.from_lens(list(spec.query_lens), seq_lens, table, bs)
    tokens, hkv = md.num_actual_tokens, spec.num_kv_heads
    act = spec.query_dtype or spec.dtype
    query = torch.zeros(tokens, hkv * spec.group, spec.head_size, dtype=act)
    key = torch.zeros(tokens, hkv, spec.head_size, dtype=act)
    value = torch.zeros(tokens, hkv, layout.value_size, dtype=act)
    out = torch.zeros(tokens, hkv * spec.group, layout.value_size, dtype=act)
    scales = {}
    if spec.dtype in (E4M3, E5M2):
        scales = dict(k_scale=torch.ones(hkv), v_scale=torch.ones(hkv))
    s = layout.strides(cache)
    strides = (s.block, s.token, s.head)
    _, attn = launch.attention_launches(
        query, cache, out, md.query_start_loc, md.seq_lens, md.block_table, cache_strides=strides,
        block_size=bs, num_kv_heads=hkv, head_size=spec.head_size, head_size_v=layout.value_size,
        num_reqs=md.num_reqs, num_tokens=tokens, max_query_len=md.max_query_len, max_seq_len=md.max_seq_len,
        scale=spec.head_size ** -0.5, sliding_window=spec.sliding_window, softcap=spec.softcap,
        split_kv=spec.split_kv, partition_size=spec.partition_size, num_compute_units_=spec.compute_units,
        family=family, arch=arch, version=version, **scales)
    writes = launch.write_kv_launches(key, value, cache, md.slot_mapping, cache_strides=strides, block_size=bs,
                                      num_kv_heads=hkv, head_size=spec.head_size, head_size_v=layout.value_size,
                                      **scales)
    result = []
    for ln in attn + writes:
        if "DOT_F32" in ln.args:
            ln.args["DOT_F32"] = False        # the interpreter-only flag is off on GPUs
        result.append((f"{ln.kernel}-{spec.name}", ln))
    return result


def all_launches(target_name: str, specs: list[BatchSpec] | None = None, version: tuple[int, int] | None = None):
    """[(name, Launch)] for every batch of ``specs`` (default: :func:`batch_specs` of the target),
    planned for ``target_name`` and the Triton release ``version`` (None: the running one)."""
    specs = batch_specs(target_name) if specs is None else specs
    target = TARGETS[target_name]
    return [item for spec in specs for item in launches(spec, target.family, target.planner_arch, version)]


# --------------------------------------------------------------------------------------- compile
def specialise(fn, ln, backend) -> tuple[dict, dict, dict]:
    """signature, constexprs, attrs of launch ``ln`` of JIT function ``fn`` as the JIT computes them."""
    from triton._C.libtriton import native_specialize_impl
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        value = ln.args[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[(i,)] = "constexpr", value
            continue
        ty, key = native_specialize_impl(backend, value, p.is_const, not p.do_not_specialize,
                                         not p.do_not_specialize_on_alignment)
        signature[p.name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = value
        elif isinstance(key, str):
            attrs[(i,)] = backend.parse_attr(key)
    return signature, constexprs, attrs


def compile_target(target_name: str, specs: list[BatchSpec] | None = None) -> list[dict]:
    """Compile every distinct specialisation for one target (in a process without the interpreter).

    One dict per specialisation: name (of the first launch that needs it), kernel, triton (the
    release that compiled it), constexprs, num_warps, num_stages, problem (None, or why it failed),
    and the :func:`analyse` figures."""
    import triton
    import triton.runtime.jit
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from kvmulti.backends.triton import launch
    target = TARGETS[target_name]
    backend = make_backend(target.gpu_target())
    seen, results = set(), []
    for name, ln in all_launches(target_name, specs):
        fn = launch.KERNELS[ln.kernel]
        assert isinstance(fn, triton.runtime.jit.JITFunction), f"{ln.kernel} is {type(fn).__name__}"
        signature, constexprs, attrs = specialise(fn, ln, backend)
        key = (ln.kernel, repr(signature), repr(sorted(constexprs.items())), repr(sorted(attrs.items())),
               ln.num_warps, ln.num_stages)
        if key in seen:
            continue
        seen.add(key)
        result = {"name": name, "kernel": ln.kernel, "target": target_name, "triton": triton.__version__,
                  "problem": None,
                  "num_warps": ln.num_warps, "num_stages": ln.num_stages,
                  "constexprs": {p.name: repr(v) for (i,), v in constexprs.items() for p in [fn.params[i]]}}
        try:
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target.gpu_target(),
                                      options={"num_warps": ln.num_warps, "num_stages": ln.num_stages})
            result.update(analyse(compiled, target))
            result["problem"] = _problem(compiled, target)
        except Exception as exc:   # reported per specialisation by the callers
            result["problem"] = f"{type(exc).__name__}: {str(exc)[-3000:]}"
        results.append(result)
    return results


def _problem(compiled, target: Target) -> str | None:
    asm, binary = compiled.asm.get(target.asm_key), compiled.asm.get(target.binary_key)
    if not (isinstance(asm, str) and target.marker in asm):
        return f"no {target.asm_key} mentioning {target.marker!r}"
    if not (isinstance(binary, bytes) and binary):
        return f"no {target.binary_key} binary"
    if compiled.metadata.shared > target.shared_per_block:
        return f"needs {compiled.metadata.shared} B shared memory (limit {target.shared_per_block})"
    return None


def compile_in_subprocesses(target_names: list[str] | None = None, jobs: int = 2, timeout: float = 1800,
                            triton_dir: str | None = None,
                            spec_names: dict[str, list[str]] | None = None) -> dict[str, list[dict]]:
    """{target: compile_target(target)} with one worker process per target (``jobs`` at a time),
    TRITON_INTERPRET removed from their environment; ``target_names`` defaults to the
    :data:`TARGETS` that ``KVMULTI_EVIDENCE_TARGETS`` selects (devtools/evidence_targets.py).
    ``triton_dir``: a directory holding another Triton release (``pip install --target``), put first
    on the workers' PYTHONPATH so that they compile with it (devtools/triton_versions.py); None: the
    installed one. ``spec_names``: {target: names of the :func:`batch_specs` to compile} (a target
    left out: all of them). Raises RuntimeError when a worker fails."""
    from devtools import evidence_targets
    names = list(evidence_targets.selected(list(TARGETS))) if target_names is None else list(target_names)
    env = worker_env(triton_dir)

    def work(name: str) -> list[dict]:
        selection = [",".join(spec_names[name])] if spec_names and name in spec_names else []
        kept = _results_cache(name, selection, triton_dir, env)
        if kept.exists():
            return json.loads(kept.read_text())
        with tempfile.TemporaryDirectory(prefix="kvmulti_xc_") as tmp:
            out = os.path.join(tmp, f"{name}.json")
            done = subprocess.run([sys.executable, os.path.abspath(__file__), name, out, *selection],
                                  env=env, capture_output=True, text=True, timeout=timeout)
            if done.returncode != 0 or not os.path.exists(out):
                raise RuntimeError(f"cross-compile worker for {name} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
            text = Path(out).read_text()
        kept.parent.mkdir(parents=True, exist_ok=True)
        staged = kept.with_suffix(f".{os.getpid()}.tmp")
        staged.write_text(text)
        os.replace(staged, kept)
        return json.loads(text)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return dict(zip(names, pool.map(work, names)))


def worker_env(triton_dir: str | None = None) -> dict[str, str]:
    """The compile workers' environment: this process's without TRITON_INTERPRET, with ``triton_dir``
    (another Triton release) first on PYTHONPATH when given."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")      # Triton 3.9's default, without its warning
    if triton_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(triton_dir), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _triton_release(triton_dir: str | None) -> str:
    """The version of the Triton the compile workers import: ``triton_dir``'s, else the installed one."""
    if triton_dir is not None:
        return ",".join(sorted(p.name for p in Path(triton_dir).glob("triton-*.dist-info"))) or str(triton_dir)
    from importlib.metadata import version
    return version("triton")


def _results_cache(name: str, selection: list[str], triton_dir: str | None, env: dict) -> Path:
    """Where one worker's results are kept (``<kvmulti cache>/triton_xc/``), under the hash of every
    Python source of kvmulti and its Triton kernels, this module, the Triton release, the batch
    selection and the TRITON_* / KVMULTI_* settings: the suite's several readers of one target's
    compiles (the GPU report, the compile checks) compile it once."""
    from kvmulti import native_build
    root = Path(__file__).resolve().parents[1]
    sources = sorted(p for folder in ("kvmulti", "triton_kernels") for p in (root / folder).rglob("*.py"))
    settings = sorted(f"{k}={v}" for k, v in env.items()
                      if k.startswith(("TRITON_", "KVMULTI_")) and k not in ("TRITON_CACHE_DIR", "KVMULTI_CACHE_DIR"))
    extra = [name, *selection, _triton_release(triton_dir), *settings,
             *(str(p.relative_to(root)) for p in sources)]
    key = native_build.build_key([*sources, Path(__file__).resolve()], extra)
    return native_build.cache_root() / "triton_xc" / f"{name}-{key}.json"


# --------------------------------------------------------------------------------------- analysis
def analyse(compiled, target: Target) -> dict:
    """Figures read from one compiled kernel: regs, spills (bytes on NVIDIA, registers on AMD),
    shared_bytes, matrix_instructions (static count), load_widths {bytes: static count of global
    loads of that width}, wait_groups (cp.async.wait_group immediates, NVIDIA), and occupancy."""
    asm = compiled.asm[target.asm_key]
    shared = int(compiled.metadata.shared)
    if target.backend == "cuda":
        figures = _nvidia_resources(compiled.asm["cubin"])
        figures["shared_bytes"] = shared + figures.pop("static_shared")
        figures.update(matrix_instructions=len(re.findall(r"\b(?:mma\.sync|wgmma\.mma_async)\S*", asm)),
                       matrix_kind=sorted(set(re.findall(r"\b(mma\.sync|wgmma\.mma_async)", asm))),
                       load_widths=_ptx_load_widths(asm),
                       wait_groups=[int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", asm)],
                       cp_async=len(re.findall(r"\bcp\.async\.(?:ca|cg)\.shared", asm)))
    else:
        figures = _amd_resources(asm)
        figures["shared_bytes"] = shared + figures.pop("static_lds")
        figures.update(matrix_instructions=len(re.findall(r"^\s*v_mfma\S*", asm, re.M)),
                       matrix_kind=sorted(set(re.findall(r"^\s*(v_mfma\S*)", asm, re.M))),
                       load_widths=_amdgcn_load_widths(asm),
                       buffer_loads=len(re.findall(r"^\s*buffer_load_", asm, re.M)),
                       wait_groups=[])
    # A software-pipelined loop has its dots peeled into an epilogue: more dots in TTGIR than in
    # the source (two per tile in the attention kernel). On AMD that is the prefetched next tile.
    ttgir = compiled.asm.get("ttgir", "")
    figures["ttgir_dots"] = len(_DOT.findall(ttgir))
    figures["prefetched_tile"] = target.backend == "hip" and figures["ttgir_dots"] > 2
    figures["kv_tiles_in_flight_at_dot"] = kv_tiles_in_flight_at_dot(ttgir)
    figures["occupancy"] = occupancy(target, figures, compiled.metadata.num_warps)
    figures["hot_loop_instructions"], figures["hot_loop_serial_share"] = hot_loop_instructions(compiled, target)
    return figures


# SASS opcode (before the first dot) -> the roofline model's NVIDIA instruction classes
_SASS_CLASSES = (("HGMMA", "wgmma"), ("HMMA", "mma"), ("MUFU", "sfu"), ("LDSM", "lds"), ("LDS", "lds"),
                 ("STS", "lds"), ("LDGSTS", "ldg"), ("LDG", "ldg"), ("STG", "ldg"), ("UTMALDG", "ldg"),
                 ("BRA", "branch"), ("BAR", "branch"), ("WARPSYNC", "branch"), ("BSYNC", "branch"),
                 ("BSSY", "branch"), ("SYNCS", "branch"), ("DEPBAR", "branch"), ("WARPGROUP", "branch"))
_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[.\s;]")
_SASS_BRANCH = re.compile(r"\bBRA\s+(?:`?\()?0x([0-9a-f]+)")


def hot_loop_instructions(compiled, target: Target) -> tuple[dict[str, int], float | None]:
    """(static instruction counts by the roofline model's classes (devtools/roofline.py), serial
    share) of the innermost loop with the most matrix instructions, from the cubin's SASS (NVIDIA:
    wgmma, mma, sfu, lds, ldg, branch, alu; serial share None: see ``kv_tiles_in_flight_at_dot``)
    or the AMDGCN (AMD: mfma, valu, salu, lds, vmem; serial share: hip_compile_check.serial_share);
    ({}, None) without such a loop. One loop trip = one K/V tile of the kernel's KV loop."""
    if target.backend == "cuda":
        from devtools.roofline_sass import disassemble
        return _sass_loop_mix(disassemble(compiled.asm["cubin"])), None
    from devtools import hip_compile_check as compile_check
    best: tuple[dict[str, int], float | None] = ({}, None)
    for body in compile_check._loop_bodies(compiled.asm["amdgcn"].splitlines()).values():
        mix = compile_check.instruction_mix(body)
        if mix["mfma"] > best[0].get("mfma", 0):
            best = mix, round(compile_check.serial_share(body), 4)
    return best


def _sass_loop_mix(sass: str) -> dict[str, int]:
    """Classes of the instructions from a branch's target up to the branch, where the target lies
    before it (a loop), for the innermost such loop with the most matrix instructions."""
    code = [(int(m.group(1), 16), m.group(2), line) for line in sass.splitlines() if (m := _SASS_LINE.match(line))]
    loops = sorted(((int(b.group(1), 16), addr) for addr, _, line in code
                    if (b := _SASS_BRANCH.search(line)) and int(b.group(1), 16) < addr), key=lambda ab: ab[1] - ab[0])
    best: dict[str, int] = {}
    for start, end in loops:
        mix: Counter = Counter(next((c for prefix, c in _SASS_CLASSES if op.startswith(prefix)), "alu")
                               for addr, op, _ in code if start <= addr <= end and op != "NOP")
        if mix["wgmma"] + mix["mma"] > best.get("wgmma", 0) + best.get("mma", 0):
            best = dict(mix)
    return best


_ASYNC_COPY = re.compile(r"(%[\w.#]+) = ttg\.async_copy_global_to_local .*-> <([0-9x]+)x[a-z]")
_COMMIT = re.compile(r"= ttg\.async_commit_group tokens ([^:]+?)(?:\s+loc\(|$)")
_WAIT = re.compile(r"ttg\.async_wait .*\{num = (\d+) : i32\}")
_DOT = re.compile(r"= (?:tt\.dot|ttng\.warp_group_dot) ")


def kv_tiles_in_flight_at_dot(ttgir: str) -> float:
    """K/V tiles whose ``cp.async`` loads are still in flight when the KV loop's first dot runs,
    in the loop's steady state, read from the TTGIR (0.0 without async copies or a loop with dots).

    The prologue and three trips of the loop body are replayed in program order: each
    ``async_commit_group`` opens a group (a K/V group when it commits a 2-D tile; block-table reads
    are 1-D), ``async_wait {num = N}`` completes all but the N newest groups. At the third trip's
    first dot the open K/V groups are counted, in tiles (the body's K/V groups per trip = one
    tile). ``cp.async.wait_group N > 0`` alone does not show overlap: the groups left open may be
    block-table reads issued after the next tile's K/V loads were already waited for."""
    lines = ttgir.splitlines()
    loop = next((i for i, line in enumerate(lines) if " scf.for " in line
                 and any(_DOT.search(x) for x in _loop_body(lines, i))), None)
    if loop is None:
        return 0.0
    body = _loop_body(lines, loop)
    tile_kinds: dict[str, bool] = {}
    for line in lines:
        m = _ASYNC_COPY.search(line)
        if m:
            tile_kinds[m.group(1)] = m.group(2).count("x") >= 1      # "128x64": a 2-D K/V tile

    def events(block: list[str]) -> list[tuple[str, object]]:
        out = []
        for line in block:
            if (m := _COMMIT.search(line)):
                tokens = [t.strip() for t in m.group(1).split(",")]
                out.append(("commit", any(tile_kinds.get(t, False) for t in tokens)))
            elif (m := _WAIT.search(line)):
                out.append(("wait", int(m.group(1))))
            elif _DOT.search(line):
                out.append(("dot", None))
        return out

    prologue, trip_events = events(lines[:loop]), events(body)
    per_trip = sum(1 for kind, is_kv in trip_events if kind == "commit" and is_kv)
    if per_trip == 0:
        return 0.0
    open_groups: list[bool] = []
    for trip, replay in enumerate((prologue, trip_events, trip_events, trip_events)):
        for kind, value in replay:
            if kind == "commit":
                open_groups.append(value)
            elif kind == "wait":
                open_groups = open_groups[-value:] if value else []
            elif kind == "dot" and trip == 3:
                return sum(open_groups) / per_trip
    return 0.0


def _loop_body(lines: list[str], start: int) -> list[str]:
    """The lines of the region opened at ``lines[start]``, up to its closing brace."""
    indent = len(lines[start]) - len(lines[start].lstrip())
    for end in range(start + 1, len(lines)):
        line = lines[end]
        if line.strip().startswith("}") and len(line) - len(line.lstrip()) == indent:
            return lines[start + 1:end]
    return lines[start + 1:]


def _nvidia_resources(cubin: bytes) -> dict:
    from triton import knobs
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", fh.name], capture_output=True,
                              text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {"regs": int(fields["REG"]), "spills": int(fields["LOCAL"]) + int(fields["STACK"]),
            "static_shared": int(fields["SHARED"])}


def _amd_resources(asm: str) -> dict:
    def note(key: str) -> int:
        m = re.search(rf"^\s*\.{key}:\s+(\d+)", asm, re.M)
        return int(m.group(1)) if m else 0
    return {"regs": note("vgpr_count"), "vgprs": note("vgpr_count"), "agprs": note("agpr_count"),
            "sgprs": note("sgpr_count"), "spills": note("vgpr_spill_count") + note("sgpr_spill_count"),
            "vgpr_spills": note("vgpr_spill_count"), "sgpr_spills": note("sgpr_spill_count"),
            "scratch_bytes": note("private_segment_fixed_size"), "static_lds": note("group_segment_fixed_size")}


_PTX_BITS = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2,
             "b32": 4, "u32": 4, "s32": 4, "f32": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8}


def _ptx_load_widths(ptx: str) -> dict[int, int]:
    widths: Counter = Counter()
    for vec, ty in re.findall(r"\bld\.global(?:\.[a-z0-9:]+)*?(?:\.v(\d))?\.([bsuf]\d+)\b", ptx):
        widths[int(vec or 1) * _PTX_BITS[ty]] += 1
    for size in re.findall(r"\bcp\.async\.c[ag]\.shared\.global(?:\.[a-zA-Z0-9:]+)*\s+\[[^\]]+\],\s*\[[^\]]+\],\s*(0x[0-9a-fA-F]+|\d+)",
                           ptx):
        widths[int(size, 0)] += 1
    return dict(sorted(widths.items()))


_AMD_LOAD_BYTES = {"ubyte": 1, "sbyte": 1, "ushort": 2, "sshort": 2, "short_d16": 2, "short_d16_hi": 2,
                   "ubyte_d16": 1, "dword": 4, "dwordx2": 8, "dwordx3": 12, "dwordx4": 16,
                   "b32": 4, "b64": 8, "b96": 12, "b128": 16, "u16": 2, "i16": 2, "u8": 1, "i8": 1}


def _amdgcn_load_widths(asm: str) -> dict[int, int]:
    widths: Counter = Counter()
    for kind in re.findall(r"^\s*(?:global|buffer|flat)_load_(?:lds_)?([a-z0-9_]+)", asm, re.M):
        if kind in _AMD_LOAD_BYTES:
            widths[_AMD_LOAD_BYTES[kind]] += 1
    return dict(sorted(widths.items()))


def occupancy(target: Target, figures: dict, num_warps: int) -> int:
    """Resident CTAs per SM (NVIDIA) / work-groups per CU (AMD) allowed by registers, shared
    memory / LDS, warps / waves and the block limit."""
    shared = figures["shared_bytes"]
    if target.backend == "cuda":
        regs_per_warp = math.ceil(max(figures["regs"], 1) * 32 / 256) * 256
        by_regs = (target.regs_per_unit // regs_per_warp) // num_warps
        by_shared = target.shared_per_unit // (shared + NVIDIA_RESERVED_SHARED)
        by_warps = target.max_warps_per_unit // num_warps
    else:
        vgprs = math.ceil(max(figures["regs"], 1) / 8) * 8
        sgprs = math.ceil(max(figures.get("sgprs", 0), 1) / 16) * 16
        waves_per_simd = min(target.max_warps_per_unit, target.regs_per_unit // vgprs,
                             target.sgprs_per_simd // sgprs)
        simd_slots = waves_per_simd * target.simds_per_unit
        by_regs = simd_slots // num_warps
        by_shared = target.shared_per_unit // shared if shared else target.max_blocks_per_unit
        by_warps = target.max_warps_per_unit * target.simds_per_unit // num_warps
    return int(min(by_regs, by_shared, by_warps, target.max_blocks_per_unit))


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run the compile worker without TRITON_INTERPRET"
    target_arg, out_path = sys.argv[1], sys.argv[2]
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # devtools as a package
    chosen = None
    if len(sys.argv) > 3:        # a comma-separated selection of batch_specs' names
        wanted = set(sys.argv[3].split(","))
        chosen = [spec for spec in batch_specs(target_arg) if spec.name in wanted]
        missing = wanted - {spec.name for spec in chosen}
        assert not missing, f"no batch specs named {sorted(missing)} for {target_arg}"
    all_results = compile_target(target_arg, chosen)
    with open(out_path, "w") as fh:
        json.dump(all_results, fh, indent=1)
    bad = sum(1 for r in all_results if r["problem"])
    print(f"{target_arg}: {len(all_results)} specialisations compiled, {bad} with problems")
