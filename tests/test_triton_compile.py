"""Every Triton kernel specialisation kvmulti launches cross-compiles for NVIDIA sm_90 and AMD gfx942.

No GPU is needed: ``triton.compile(ASTSource(...), target=GPUTarget(...))`` runs the whole
pipeline down to PTX/cubin and AMDGCN/hsaco. A kernel that only works in the interpreter cannot
pass. The kernels are loaded from their source files as fresh JIT functions with the
interpreter switched off, so this also runs in a process that set TRITON_INTERPRET=1.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kvmulti.triton_kernels  # noqa: E402
from kvmulti.triton_kernels import launch  # noqa: E402

KERNEL_DIR = pathlib.Path(kvmulti.triton_kernels.__file__).parent
TARGETS = {
    # name: (target, asm key, text that must be in it, shared-memory limit in bytes)
    "sm90": (GPUTarget("cuda", 90, 32), "ptx", ".target sm_90", 227 * 1024),
    "gfx942": (GPUTarget("hip", "gfx942", 64), "amdgcn", "gfx942", 64 * 1024),
}


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
KERNELS = {"unified_attention": _attn.unified_attention_kernel,
           "reduce_partitions": _attn.reduce_partitions_kernel,
           "write_kv": _write.write_kv_kernel}
SPECS = launch.specialisations(kernels=KERNELS)


def test_kernels_are_jit_functions():
    for fn in KERNELS.values():
        assert isinstance(fn, triton.runtime.jit.JITFunction), type(fn)


def test_specialisations_cover_what_is_shipped():
    names = [s.name for s in SPECS]
    assert len(names) == len(set(names))
    for dt in ("fp32", "fp16", "bf16"):
        for hp in launch.HEAD_PADS:
            for kind in ("single]", "split]"):
                assert any(n.startswith(f"unified_attention[{dt},hp{hp},") and n.endswith(kind) for n in names)
            assert f"reduce_partitions[{dt},hp{hp}]" in names
            assert any(n.startswith(f"write_kv[{dt},hp{hp},") for n in names)
    # The tiles the launcher picks for declared head sizes and GQA groups are all in the list.
    shipped = {(s.constexprs.get("BLOCK_M"), s.constexprs.get("TILE_N"), s.constexprs.get("HEAD_PAD"),
                s.constexprs.get("SPLIT")) for s in SPECS if s.name.startswith("unified")}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for head_size in (8, 16, 40, 64, 80, 96, 128, 160, 256):
            for group in (1, 2, 4, 8, 16):
                for max_q, split in ((1, False), (1, True), (7, False)):
                    plan = launch.plan_attention(num_reqs=2, num_kv_heads=2, num_qpk=group, max_query_len=max_q,
                                                 max_seq_len=4096, head_size=head_size, head_size_v=head_size,
                                                 dtype=dtype, num_compute_units=132, split_kv=split)
                    assert (plan.block_m, plan.tile_n, plan.head_pad, plan.split) in shipped, plan


@pytest.mark.parametrize("target_name", list(TARGETS))
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_cross_compiles(spec, target_name):
    target, asm_key, marker, shared_limit = TARGETS[target_name]
    compiled = triton.compile(ASTSource(spec.fn, spec.signature, spec.constexprs), target=target,
                              options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
    asm = compiled.asm[asm_key]
    assert isinstance(asm, str) and marker in asm, f"no {asm_key} for {target_name}"
    binary = compiled.asm["cubin" if target.backend == "cuda" else "hsaco"]
    assert isinstance(binary, bytes) and len(binary) > 0
    assert compiled.metadata.shared <= shared_limit, (
        f"{spec.name} needs {compiled.metadata.shared} B of shared memory on {target_name} (limit {shared_limit})")
