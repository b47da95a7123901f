"""Every Triton kernel specialisation kvmulti launches cross-compiles for NVIDIA sm_90 and AMD gfx942.

No GPU is needed: ``triton.compile(ASTSource(...), target=GPUTarget(...))`` runs the whole
pipeline down to PTX/cubin and AMDGCN/hsaco, so a kernel that only works in the interpreter
cannot pass. The launches compiled here are the ones the backend builds
(``launch.attention_launches`` / ``launch.write_kv_launches``) for representative batches over
every dtype x head-size padding x path, plus corner batches; their signatures, constexprs and
alignment attributes are derived from the launch arguments exactly as ``@triton.jit`` does at
run time (so an int argument equal to 1 is compiled as a constexpr, as on a GPU). The kernels are
loaded from their source files as fresh JIT functions with the interpreter off, so this module
also runs in a process that set TRITON_INTERPRET=1.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest
import torch

triton = pytest.importorskip("triton")
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402

import kvmulti.triton_kernels  # noqa: E402
from kvmulti.triton_kernels import launch  # noqa: E402

from batches import CaseSpec, build_case  # noqa: E402

KERNEL_DIR = pathlib.Path(kvmulti.triton_kernels.__file__).parent
TARGETS = {
    # name: (target, asm key, text that must be in it, binary key, shared-memory limit in bytes)
    "sm90": (GPUTarget("cuda", 90, 32), "ptx", ".target sm_90", "cubin", 227 * 1024),
    "gfx942": (GPUTarget("hip", "gfx942", 64), "amdgcn", "gfx942", "hsaco", 64 * 1024),
}
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPE_NAMES = {F32: "fp32", F16: "fp16", BF16: "bf16"}


def _load_jit(module_file: str):
    """A fresh copy of a kernel module whose @triton.jit functions are JITFunctions."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        spec = importlib.util.spec_from_file_location(f"_kvmulti_compile_copy_{module_file[:-3]}",
                                                      KERNEL_DIR / module_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return module


_attn = _load_jit("unified_attention.py")
_write = _load_jit("write_kv.py")
JIT_KERNELS = {"unified_attention": _attn.unified_attention_kernel,
               "reduce_partitions": _attn.reduce_partitions_kernel,
               "write_kv": _write.write_kv_kernel}


# ---------------------------------------------------------------- the batches whose launches we compile
def _batches() -> list[tuple[str, CaseSpec, bool | None, int]]:
    """(name, case, split_kv, partition_size)."""
    out = []
    for dtype in (F32, F16, BF16):
        for hs in (16, 32, 64, 80, 256):              # pads 16, 32, 64, 128, 256
            d = f"{DTYPE_NAMES[dtype]}_hs{hs}"
            base = dict(order="NHD", block_size=16, num_kv_heads=2, group=4, head_size=hs, dtype=dtype)
            out.append((f"{d}_mixed", CaseSpec(query_lens=(7, 1, 3), context_lens=(0, 40, 9), sliding_window=20,
                                               softcap=10.0, **base), None, 512))
            out.append((f"{d}_decode", CaseSpec(query_lens=(1, 1, 1), context_lens=(40, 9, 100), **base), None, 512))
            out.append((f"{d}_split", CaseSpec(query_lens=(1, 1), context_lens=(1100, 300), **base), True, 512))
    c = dict(order="NHD", block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=F16)
    corners = [
        # ints equal to 1 become constexprs at run time: one request, G=1, block_size=1, window=1.
        ("ones", dict(c, num_kv_heads=1, group=1, block_size=1, query_lens=(5,), context_lens=(3,),
                      sliding_window=1), None, 512),
        ("decode_g16_blockq1", dict(c, group=16, query_lens=(1, 1), context_lens=(30, 7)), None, 512),
        ("split_one_part", dict(c, query_lens=(1,), context_lens=(20,)), True, 512),
        ("split_prefill_rows", dict(c, query_lens=(9, 1), context_lens=(0, 40), order="HND"), True, 16),
        ("hnd_bf16", dict(c, dtype=BF16, order="HND", block_size=32), None, 512),
        ("hsv_differs", dict(c, head_size=64, head_size_v=32, query_lens=(4, 1), context_lens=(10, 40)), None, 512),
        ("gqa32", dict(c, group=32, num_kv_heads=1, query_lens=(3, 1), context_lens=(0, 20)), None, 512),
        ("single_token_seq", dict(c, query_lens=(1,), context_lens=(0,)), None, 512),
    ]
    for name, kw, split, part in corners:
        kw.setdefault("query_lens", (6, 1))
        kw.setdefault("context_lens", (2, 25))
        out.append((name, CaseSpec(**kw), split, part))
    return out


def _launches():
    """Unique (name, Launch) pairs over all batches, deduplicated by their JIT specialisation."""
    seen, result = set(), []
    for name, spec, split, part in _batches():
        case = build_case(spec)
        md, layout = case.metadata, case.layout
        s = layout.strides(case.cache)
        strides = (s.block, s.token, s.head)
        out = torch.zeros(case.query.shape[0], case.query.shape[1], layout.value_size, dtype=spec.dtype)
        _, attn = launch.attention_launches(
            case.query, case.cache, out, md.query_start_loc, md.seq_lens, md.block_table, cache_strides=strides,
            block_size=layout.block_size, num_kv_heads=layout.num_kv_heads, head_size=layout.head_size,
            head_size_v=layout.value_size, num_reqs=md.num_reqs, num_tokens=md.num_actual_tokens,
            max_query_len=md.max_query_len, max_seq_len=md.max_seq_len, scale=spec.head_size ** -0.5,
            sliding_window=spec.sliding_window, softcap=spec.softcap, split_kv=split, partition_size=part,
            num_compute_units_=132)
        writes = launch.write_kv_launches(case.key, case.value, case.cache, md.slot_mapping, cache_strides=strides,
                                          block_size=layout.block_size, num_kv_heads=layout.num_kv_heads,
                                          head_size=layout.head_size, head_size_v=layout.value_size)
        for ln in attn + writes:
            if "DOT_F32" in ln.args:
                ln.args["DOT_F32"] = False        # the interpreter-only flag is off on GPUs
            key = (ln.kernel, repr(_specialise(ln, make_backend(TARGETS["sm90"][0]))))
            if key not in seen:
                seen.add(key)
                result.append((f"{ln.kernel}-{name}", ln))
    return result


def _specialise(ln: launch.Launch, backend):
    """signature, constexprs, attrs for ``ln`` as the JIT computes them from the arguments."""
    fn = JIT_KERNELS[ln.kernel]
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


LAUNCHES = _launches()


def test_launch_set_covers_every_tile_choice():
    """Every (dtype, head pad, BLOCK_M, TILE_N, path) the planner picks for head sizes <= 256 and
    GQA groups <= 16 is among the compiled launches; all three kernels are there."""
    compiled = {(ln.args["kv_ptr"].dtype, ln.args["HEAD_PAD"], ln.args["HEAD_PAD_V"], ln.args["BLOCK_M"],
                 ln.args["TILE_N"], ln.args["SPLIT"]) for _, ln in LAUNCHES if ln.kernel == "unified_attention"}
    assert {ln.kernel for _, ln in LAUNCHES} == set(JIT_KERNELS)
    for dtype in (F32, F16, BF16):
        for hs in (8, 16, 24, 40, 64, 80, 96, 128, 160, 256):
            for group in (1, 2, 3, 4, 8, 16):
                for max_q, split in ((1, False), (1, True), (7, False), (300, False)):
                    plan = launch.plan_attention(num_reqs=2, num_kv_heads=2, num_qpk=group, max_query_len=max_q,
                                                 max_seq_len=4096, head_size=hs, head_size_v=hs, dtype=dtype,
                                                 num_compute_units=132, split_kv=split)
                    key = (dtype, plan.head_pad, plan.head_pad_v, plan.block_m, plan.tile_n, plan.split)
                    assert key in compiled, key


@pytest.mark.parametrize("target_name", list(TARGETS))
@pytest.mark.parametrize("ln", [ln for _, ln in LAUNCHES], ids=[name for name, _ in LAUNCHES])
def test_cross_compiles(ln, target_name):
    target, asm_key, marker, binary_key, shared_limit = TARGETS[target_name]
    backend = make_backend(target)
    signature, constexprs, attrs = _specialise(ln, backend)
    compiled = triton.compile(ASTSource(JIT_KERNELS[ln.kernel], signature, constexprs, attrs), target=target,
                              options={"num_warps": ln.num_warps, "num_stages": ln.num_stages})
    asm = compiled.asm[asm_key]
    assert isinstance(asm, str) and marker in asm, f"no {asm_key} for {target_name}"
    binary = compiled.asm[binary_key]
    assert isinstance(binary, bytes) and len(binary) > 0
    assert compiled.metadata.shared <= shared_limit, (
        f"needs {compiled.metadata.shared} B of shared memory on {target_name} (limit {shared_limit})")
