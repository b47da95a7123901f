"""Every Triton kernel specialisation kvmulti launches cross-compiles for NVIDIA sm_90 and AMD gfx942.

No GPU is needed: ``triton.compile(ASTSource(...), target=GPUTarget(...))`` runs the whole
pipeline down to PTX/cubin and AMDGCN/hsaco, so a kernel that only works in the interpreter
cannot pass. The launches compiled here are the ones the backend builds
(``launch.attention_launches`` / ``launch.write_kv_launches``) for representative batches over
every dtype x head-size padding x path, plus corner batches; their signatures, constexprs and
alignment attributes are derived from the launch arguments exactly as ``@triton.jit`` does at
run time (so an int argument equal to 1 is compiled as a constexpr, as on a GPU).

The compilation runs in a subprocess (this file as a script, one per target) with
TRITON_INTERPRET unset: once ``triton.language`` has been imported with the interpreter on (as
test_triton_backend.py does on CPU hosts), Triton's own library functions are interpreter
objects and nothing compiles in that process any more.

    python tests/test_triton_compile.py sm90 results.json     # what the test runs
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402

from kvmulti.triton_kernels import launch  # noqa: E402

from batches import CaseSpec, build_case  # noqa: E402

TARGETS = {
    # name: (target, asm key, text that must be in it, binary key, shared-memory limit in bytes)
    "sm90": (GPUTarget("cuda", 90, 32), "ptx", ".target sm_90", "cubin", 227 * 1024),
    "gfx942": (GPUTarget("hip", "gfx942", 64), "amdgcn", "gfx942", "hsaco", 64 * 1024),
}
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPE_NAMES = {F32: "fp32", F16: "fp16", BF16: "bf16"}


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
    """(name, Launch) for every launch of every batch (the worker deduplicates by specialisation)."""
    result = []
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
            result.append((f"{ln.kernel}-{name}", ln))
    return result


def _specialise(fn, ln: launch.Launch, backend):
    """signature, constexprs, attrs for ``ln`` as the JIT computes them from the arguments."""
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




def test_launch_set_covers_every_tile_choice():
    """Every (dtype, head pad, BLOCK_M, TILE_N, path) the planner picks for head sizes <= 256 and
    GQA groups <= 16 is among the compiled launches; all three kernels are there."""
    launches = _launches()
    compiled = {(ln.args["kv_ptr"].dtype, ln.args["HEAD_PAD"], ln.args["HEAD_PAD_V"], ln.args["BLOCK_M"],
                 ln.args["TILE_N"], ln.args["SPLIT"]) for _, ln in launches if ln.kernel == "unified_attention"}
    assert {ln.kernel for _, ln in launches} == set(launch.KERNELS)
    for dtype in (F32, F16, BF16):
        for hs in (8, 16, 24, 40, 64, 80, 96, 128, 160, 256):
            for group in (1, 2, 3, 4, 8, 16):
                for max_q, split in ((1, False), (1, True), (7, False), (300, False)):
                    plan = launch.plan_attention(num_reqs=2, num_kv_heads=2, num_qpk=group, max_query_len=max_q,
                                                 max_seq_len=4096, head_size=hs, head_size_v=hs, dtype=dtype,
                                                 num_compute_units=132, split_kv=split)
                    key = (dtype, plan.head_pad, plan.head_pad_v, plan.block_m, plan.tile_n, plan.split)
                    assert key in compiled, key


def compile_all(target_name: str) -> list[dict]:
    """Compile every distinct specialisation for one target (run in a process without the interpreter)."""
    import triton.runtime.jit
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    target, asm_key, marker, binary_key, shared_limit = TARGETS[target_name]
    backend = make_backend(target)
    seen, results = set(), []
    for name, ln in _launches():
        fn = launch.KERNELS[ln.kernel]
        assert isinstance(fn, triton.runtime.jit.JITFunction), f"{ln.kernel} is {type(fn).__name__}"
        signature, constexprs, attrs = _specialise(fn, ln, backend)
        key = (ln.kernel, repr(signature), repr(sorted(constexprs.items())), repr(sorted(attrs.items())))
        if key in seen:
            continue
        seen.add(key)
        result = {"name": name, "kernel": ln.kernel, "problem": None, "shared": None,
                  "constexprs": {p.name: repr(v) for (i,), v in constexprs.items() for p in [fn.params[i]]}}
        try:
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                      options={"num_warps": ln.num_warps, "num_stages": ln.num_stages})
            asm, binary = compiled.asm.get(asm_key), compiled.asm.get(binary_key)
            result["shared"] = compiled.metadata.shared
            if not (isinstance(asm, str) and marker in asm):
                result["problem"] = f"no {asm_key} mentioning {marker!r}"
            elif not (isinstance(binary, bytes) and binary):
                result["problem"] = f"no {binary_key} binary"
            elif compiled.metadata.shared > shared_limit:
                result["problem"] = f"needs {compiled.metadata.shared} B shared memory (limit {shared_limit})"
        except Exception as exc:   # reported per specialisation by the test
            result["problem"] = f"{type(exc).__name__}: {str(exc)[-3000:]}"
        results.append(result)
    return results


@pytest.mark.parametrize("target_name", list(TARGETS))
def test_cross_compiles(target_name, tmp_path):
    out = tmp_path / f"{target_name}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__, target_name, str(out)], env=env, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0 and out.exists(), done.stdout[-2000:] + done.stderr[-4000:]
    results = json.loads(out.read_text())
    # Every dtype x head pad x {prefill, decode, split} launch, its reduce and write, plus corners.
    assert len(results) >= 3 * 5 * 5, len(results)
    assert {r["kernel"] for r in results} == set(launch.KERNELS)
    for dt in ("fp32", "fp16", "bf16"):
        for hs in (16, 32, 64, 80, 256):
            for kind in ("mixed", "decode", "split"):
                assert any(r["name"] == f"unified_attention-{dt}_hs{hs}_{kind}" for r in results), (dt, hs, kind)
    failed = [f"{r['name']} {r['constexprs']}: {r['problem']}" for r in results if r["problem"]]
    assert not failed, f"{len(failed)} of {len(results)} specialisations fail on {target_name}:\n" + "\n".join(failed)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run the compile worker without TRITON_INTERPRET"
    target_arg, out_path = sys.argv[1], sys.argv[2]
    all_results = compile_all(target_arg)
    with open(out_path, "w") as fh:
        json.dump(all_results, fh, indent=1)
    bad = sum(1 for r in all_results if r["problem"])
    print(f"{target_arg}: {len(all_results)} specialisations compiled, {bad} with problems")
