"""Every Triton kernel specialisation kvmulti launches cross-compiles for NVIDIA sm_80/sm_90 and
AMD gfx90a/gfx942 (``devtools.triton_cross_compile``: the launches the backend builds for
a fixed set of batches, specialised exactly as ``@triton.jit`` does at run time). The gate compiles
for sm_90 and gfx942 (tests/tiers.py); the exhaustive tier for all four.

No GPU is needed: the whole pipeline runs down to PTX/cubin and AMDGCN/hsaco, so a kernel that
only works in the interpreter cannot pass. The compile workers run in subprocesses without
TRITON_INTERPRET (once ``triton.language`` is imported under the interpreter, as
test_triton_backend.py does on CPU hosts, nothing compiles in that process any more). The
figures read from the output and their thresholds are test_gpu_report.py's.
"""

from __future__ import annotations

import json

import pytest
import torch

triton = pytest.importorskip("triton")

from devtools import evidence_targets  # noqa: E402
from devtools import triton_cross_compile as xc  # noqa: E402
from kvmulti.backends.triton import launch, tiles  # noqa: E402

#: the targets compiled here (KVMULTI_EVIDENCE_TARGETS: the gate's, or all in the exhaustive tier)
COMPILED_TARGETS = evidence_targets.selected(list(xc.TARGETS))

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(scope="session")
def compiled() -> dict[str, list[dict]]:
    """{target: results} for every compiled target (a repeat reads the results the first run kept)."""
    return xc.compile_in_subprocesses()


def test_kept_results_are_keyed_by_sources_release_and_selection(compiled, tmp_path, monkeypatch):
    """Each target's results are kept once per run and read back by the next reader; another Triton
    release, batch selection or kernel source gets another entry."""
    env = xc.worker_env()
    for target, results in compiled.items():
        kept = xc._results_cache(target, [], None, env)
        assert json.loads(kept.read_text()) == results
        assert xc.compile_in_subprocesses([target]) == {target: results}
    base = xc._results_cache("sm_90", [], None, env)
    assert xc._results_cache("sm_90", ["decode"], None, env) != base
    assert xc._results_cache("sm_90", [], str(tmp_path), env) != base
    assert xc._results_cache("gfx942", [], None, env) != base
    from kvmulti import native_build
    hashed = []
    real = native_build.build_key
    monkeypatch.setattr(native_build, "build_key", lambda files, extra: hashed.extend(files) or real(files, extra))
    xc._results_cache("sm_90", [], None, env)
    names = {p.name for p in hashed}
    assert {"unified_attention.py", "launch.py", "tiles.py", "triton_cross_compile.py"} <= names, names


@pytest.mark.parametrize("version", tiles.GATED_TRITON)
@pytest.mark.parametrize("target_name", ["sm_80", "sm_90", "gfx942"])
def test_launch_set_covers_every_tile_choice(target_name, version):
    """Every (cache dtype, head pad, BLOCK_M, TILE_N, path, table reads, stages, warps, prefill loop,
    window and softcap in the prefill loop) the planner picks on the target for head sizes <= 256,
    GQA groups <= 16, with and without a sliding window and softcap, at block size 16 (fp8 caches:
    head 128), and for blocks small enough that a tile reads the table per key position, is among
    the launches compiled for the target, with each Triton release the compiles cover
    (test_triton_versions.py compiles the pinned one's); all kernels are there."""
    target = xc.TARGETS[target_name]
    family, arch = target.family, target.planner_arch
    launches = xc.all_launches(target.name, version=version)
    compiled = {((ln.args["kv_ptr"].dtype, ln.args["FP8"]), ln.args["HEAD_PAD"], ln.args["HEAD_PAD_V"], ln.args["BLOCK_M"],
                 ln.args["TILE_N"], ln.args["SPLIT"], ln.args["TABLE_READS"], ln.num_stages, ln.num_warps,
                 ln.args["PREFILL"], ln.args["PREFILL"] and ln.args["WINDOW"] > 0, ln.args["PREFILL"] and ln.args["SOFTCAP"] > 0)
                for _, ln in launches if ln.kernel == "unified_attention"}
    assert {ln.kernel for _, ln in launches} == set(launch.KERNELS)

    def key(dtype, hs, group, max_q, split, block_size, window=None, query_dtype=None, softcap=None):
        plan = launch.plan_attention(num_reqs=2, num_kv_heads=2, num_qpk=group, max_query_len=max_q,
                                     max_seq_len=4096, head_size=hs, head_size_v=hs, dtype=dtype,
                                     num_compute_units=132, block_size=block_size, split_kv=split, family=family,
                                     sliding_window=window, query_dtype=query_dtype, softcap=softcap, arch=arch,
                                     version=version)
        cache = (launch.raw_cache(torch.empty(0, dtype=dtype)).dtype, launch.fp8_code(dtype))
        return (cache, plan.head_pad, plan.head_pad_v, plan.block_m, plan.tile_n, plan.split, plan.table_reads,
                plan.num_stages, plan.num_warps, plan.prefill, plan.prefill and bool(window),
                plan.prefill and bool(softcap))

    for dtype in (F32, F16, BF16):
        for hs in (8, 16, 24, 40, 64, 80, 96, 128, 160, 256):
            for group in (1, 2, 3, 4, 8, 16):
                for max_q, split in ((1, False), (1, True), (7, False), (300, False)):
                    assert key(dtype, hs, group, max_q, split, 16) in compiled, (dtype, hs, group, max_q, split)
                for max_q in (7, 300):
                    assert key(dtype, hs, group, max_q, False, 16, 40, softcap=30.0) in compiled, (dtype, hs, max_q)
    for window, softcap in ((40, None), (None, 30.0)):
        assert key(F16, 128, 4, 300, False, 16, window, softcap=softcap) in compiled, (window, softcap)
    for dtype in (xc.E4M3, xc.E5M2):
        for window in (None, 40):
            assert key(dtype, 128, 4, 300, False, 16, window, BF16) in compiled, (dtype, window)
    for max_q in (1, 7, 300):
        per_key = key(F16, 64, 4, max_q, False, 1)
        assert per_key[6] == 0 and per_key in compiled, per_key


def test_large_cache_variant_is_compiled_separately_on_amd(compiled):
    """A cache over 2 GiB loses Triton's AMD buffer-load specialisation: both variants compile."""
    amd = [t for t in COMPILED_TARGETS if xc.TARGETS[t].family == "amd"]
    assert amd
    for target in amd:
        names = {r["name"] for r in compiled[target]}
        for case in ("decode", "prefill"):
            small = f"unified_attention-model_{case}_{target}"
            assert small in names and small + "_large_cache" in names, (target, case)


@pytest.mark.parametrize("target_name", COMPILED_TARGETS)
def test_cross_compiles(target_name, compiled):
    results = compiled[target_name]
    # Every dtype x head pad x {prefill, decode, split} launch, its reduce and write, plus corners.
    assert len(results) >= 3 * 5 * 5, len(results)
    assert {r["kernel"] for r in results} == set(launch.KERNELS)
    for dt in ("fp32", "fp16", "bf16"):
        for hs in (16, 32, 64, 80, 256):
            for kind in ("mixed", "decode", "split", "prefill") + (("prefill_window",) if dt != "fp32" else ()):
                assert any(r["name"] == f"unified_attention-{dt}_hs{hs}_{kind}" for r in results), (dt, hs, kind)
    failed = [f"{r['name']} {r['constexprs']}: {r['problem']}" for r in results if r["problem"]]
    assert not failed, f"{len(failed)} of {len(results)} specialisations fail on {target_name}:\n" + "\n".join(failed)
    spilled = [(r["name"], r["num_warps"], r["num_stages"], r["spills"]) for r in results if r["spills"]]
    assert not spilled, f"{len(spilled)} specialisations spill on {target_name}: {spilled}"


MATRIX_KIND = {"sm_80": "mma.sync", "sm_90": "wgmma.mma_async", "gfx90a": "v_mfma", "gfx942": "v_mfma"}


@pytest.mark.parametrize("target_name", COMPILED_TARGETS)
def test_prefill_tiles_run_on_the_matrix_units(target_name, compiled):
    """Every prefill specialisation with 16-bit dots (launch.prefill_tiles) compiles to the target's
    matrix instruction (wgmma on sm_90, mma.sync on sm_80, v_mfma on gfx9) without spills; on NVIDIA
    the model prefill keeps the next K/V tile in flight during the dots."""
    kind = MATRIX_KIND[target_name]
    rows = [r for r in compiled[target_name] if r["kernel"] == "unified_attention"
            and r["constexprs"].get("PREFILL") == "True"]
    assert len(rows) >= 10, len(rows)
    big = [r for r in rows if "fp32" not in r["name"]]
    assert big and all(int(r["constexprs"]["BLOCK_M"]) >= 64 for r in big)
    for r in rows:
        assert not r["problem"] and r["spills"] == 0, (r["name"], r["problem"], r["spills"])
    for r in big:
        assert r["matrix_instructions"] > 0 and any(k.startswith(kind) for k in r["matrix_kind"]), (
            r["name"], r["matrix_kind"])
    if target_name.startswith("sm_"):
        model = next(r for r in rows if r["name"] == f"unified_attention-model_prefill_{target_name}")
        assert model["kv_tiles_in_flight_at_dot"] >= 1, model["wait_groups"]


def _ttgir(prologue: list[str], body: list[str]) -> str:
    """A TTGIR function with one KV loop: ``K``/``V`` copies are 2-D tiles, ``B`` 1-D block-table reads."""
    def ops(lines: list[str], indent: str) -> list[str]:
        out = []
        for n, op in enumerate(lines):
            if op.startswith("wait"):
                out.append(f"{indent}%w{n} = ttg.async_wait %x {{num = {op[4:]} : i32}} loc(#loc1)")
            elif op == "dot":
                out.append(f"{indent}%s{n} = tt.dot %q, %k, %c : tensor<16x128xbf16> * tensor<128x64xbf16> -> "
                           "tensor<16x64xf32, #mma> loc(#loc2)")
            else:
                shape = "64xi32" if op == "B" else "128x64xbf16"
                out.append(f"{indent}%{op}{n} = ttg.async_copy_global_to_local %p, %buf mask %m : "
                           f"tensor<{shape}> -> <{shape}, #shared, #smem, mutable> loc(#loc3)")
                out.append(f"{indent}%{op}{n}c = ttg.async_commit_group tokens %{op}{n} loc(#loc3)")
        return out
    return "\n".join(["  tt.func public @k() {", *ops(prologue, "    "),
                      "    %acc:3 = scf.for %i = %c0 to %n step %c64 iter_args(%a = %z) -> (f32) : i32 {",
                      *ops(body, "      "), "      scf.yield %a : f32 loc(#loc4)", "    } loc(#loc5)", "  }"])


@pytest.mark.parametrize("prologue, body, tiles", [
    # every group waited for at the top of the loop (Triton at 3 stages): nothing in flight
    (["B", "B", "K", "V", "B"], ["wait0", "dot", "dot", "B", "K", "V", "B"], 0.0),
    # wait_group 2 > 0, but the two groups left open are block-table reads issued after the K/V loads
    (["B", "K", "V", "B", "B"], ["wait2", "dot", "dot", "wait0", "B", "K", "V", "B", "B"], 0.0),
    # K/V loads one tile ahead: the next tile's K and V are open at the dots (5 stages)
    (["B", "B", "K", "V", "B", "B", "K", "V", "B", "B"], ["wait5", "dot", "dot", "B", "K", "V", "B", "B"], 1.0),
    # only the next tile's V is open at the first dot
    (["K", "V", "K", "V"], ["wait1", "dot", "dot", "K", "V"], 0.5),
    # a wait allowing more groups than are open completes none (here at the first two trips)
    (["K", "V", "B"], ["wait5", "dot", "dot", "K", "V"], 2.0),
    # no async copies at all (AMD, or an unpipelined loop)
    ([], ["dot", "dot"], 0.0),
])
def test_kv_tiles_in_flight_at_dot_replays_the_loop(prologue, body, tiles):
    assert xc.kv_tiles_in_flight_at_dot(_ttgir(prologue, body)) == tiles
