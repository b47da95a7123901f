"""The TRITON backend against the oracle, run by Triton's interpreter on CPU tensors.

TRITON_INTERPRET=1 must be set before the kernels are imported (``@triton.jit`` picks the
interpreter at decoration time), so this module sets it on hosts without a GPU; CI may also set
it in the job's environment. On a GPU host these CPU-tensor tests skip (the same suite runs on
the GPU in test_triton_gpu.py). The helpers here are shared with test_triton_gpu.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available() and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tiers import examples

import kvmulti  # noqa: E402
from kvmulti import reference  # noqa: E402
from kvmulti.backends import get_backend, select_backend  # noqa: E402
from kvmulti.backends import triton as triton_backend  # noqa: E402
from kvmulti.backends.triton import TritonBackend  # noqa: E402
from kvmulti.backends.base import AttentionConfig  # noqa: E402

from batches import (CaseSpec, assert_close_to_reference, batch_cases, build_case, check_against_reference,  # noqa: E402
                     record_triton_launches)

triton = pytest.importorskip("triton")

ON_CPU = pytest.mark.skipif(not triton_backend.interpreting(),
                            reason="CPU-tensor Triton tests need TRITON_INTERPRET=1 (on GPU hosts see test_triton_gpu.py)")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


# ---------------------------------------------------------------- shared with test_triton_gpu.py
def corner_specs() -> list:
    """Explicit corners: each is a pytest.param with an id."""
    def spec(id_, **kw):
        base = dict(order="NHD", block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=F32,
                    query_lens=(5, 1), context_lens=(0, 20))
        base.update(kw)
        return pytest.param(CaseSpec(**base), id=id_)
    return [
        # num_blocks == 2 (and 1): a shape[0] == 2 test would misread the cache.
        spec("two_blocks_nhd", block_size=16, query_lens=(3, 1), context_lens=(0, 9)),
        spec("two_blocks_hnd", order="HND", block_size=16, query_lens=(3, 1), context_lens=(0, 9), dtype=BF16),
        spec("one_block_hnd", order="HND", block_size=32, query_lens=(5,), context_lens=(20,), dtype=F16),
        # block sizes 1, odd, and block_size == num_kv_heads (HND vs NHD strides coincide in size).
        spec("bs1_gqa8_window", block_size=1, group=8, query_lens=(6, 1, 3), context_lens=(0, 30, 12),
             sliding_window=7, dtype=BF16),
        spec("bs3_hnd", order="HND", block_size=3, group=2, query_lens=(4, 1), context_lens=(5, 17), dtype=F16),
        spec("bs_eq_heads_hnd", order="HND", block_size=4, num_kv_heads=4, group=2, head_size=32,
             query_lens=(6, 1, 2), context_lens=(0, 13, 7), sliding_window=5, softcap=10.0, dtype=F16),
        spec("bs32_gqa1", block_size=32, group=1, num_kv_heads=1, query_lens=(9, 1), context_lens=(40, 70)),
        # head sizes: 80 (padded to 128), small, 256, and K/V of different sizes.
        spec("hs80_bf16_softcap_hnd", order="HND", head_size=80, softcap=5.0, dtype=BF16,
             query_lens=(7, 1, 4), context_lens=(0, 33, 21)),
        spec("hs80_fp32_window", head_size=80, sliding_window=9, query_lens=(12, 1), context_lens=(3, 40)),
        spec("hs8", head_size=8, group=2, dtype=F16),
        spec("hs256_fp32", head_size=256, group=1, num_kv_heads=1, query_lens=(3, 1), context_lens=(2, 20)),
        spec("hsv_differs", head_size=64, head_size_v=32, query_lens=(4, 1), context_lens=(10, 40)),
        # GQA groups that are not powers of two, and one wider than the default tile.
        spec("gqa3", group=3, num_kv_heads=1, query_lens=(11, 1), context_lens=(0, 9), dtype=BF16),
        spec("gqa6_window", group=6, query_lens=(5, 2), context_lens=(4, 25), sliding_window=6),
        spec("gqa32", group=32, num_kv_heads=1, head_size=16, query_lens=(3, 1), context_lens=(0, 20)),
        # windows: 1 (only itself), wider than the context, far behind a long context (garbage skipped).
        spec("window1", sliding_window=1, query_lens=(4, 1), context_lens=(0, 12)),
        spec("window_wide", sliding_window=1000, query_lens=(4, 1), context_lens=(3, 12)),
        spec("window_far", block_size=1, sliding_window=3, query_lens=(2, 1), context_lens=(60, 75), dtype=F16),
        # many q-blocks in one request (long prefill / chunk), verification rows against a context.
        spec("long_prefill", group=4, query_lens=(70,), context_lens=(0,), dtype=BF16),
        spec("chunked_and_verify", query_lens=(33, 5, 5, 1), context_lens=(17, 40, 0, 3), softcap=20.0, dtype=F16),
        # a request with no new tokens in the middle of the batch.
        spec("empty_request", query_lens=(3, 0, 2), context_lens=(0, 8, 5)),
    ]


def run_split_vs_single(spec: CaseSpec, device, partition_size: int = 32) -> None:
    """Both paths equal the oracle and each other on the same case."""
    case = build_case(spec, device)
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend="CPU"
                     if case.cache.device.type == "cpu" else "TRITON")
    expected = reference.paged_attention(case.query.cpu(), case.cache.cpu(), case.layout, _cpu_md(case.metadata),
                                         sliding_window=spec.sliding_window, softcap=spec.softcap)
    scale = spec.head_size ** -0.5
    outs = {}
    for split in (False, True):
        backend = TritonBackend(partition_size=partition_size if split else 0)
        step = backend.build_metadata(case.metadata, case.layout, case.query.shape[1], spec.sliding_window)
        out = torch.zeros(case.query.shape[0], case.query.shape[1], case.layout.value_size, dtype=spec.dtype,
                          device=case.query.device)
        backend.paged_attention(case.query, case.cache, step, scale, spec.softcap, out)
        outs[split] = out
        assert step.plan.split is split
        assert step.plan.num_parts == (-(-max(spec.seq_lens) // partition_size) if split else 1)
        assert_close_to_reference(out, expected, spec.dtype, f"split_kv={split} differs from the oracle: {spec}")
    assert_close_to_reference(outs[True], outs[False].float(), spec.dtype, f"split and single disagree: {spec}")


def split_specs() -> list:
    def spec(id_, **kw):
        base = dict(order="NHD", block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=F32,
                    query_lens=(1, 1), context_lens=(90, 37))
        base.update(kw)
        return pytest.param(CaseSpec(**base), id=id_)
    return [
        spec("decode_fp32"),
        spec("decode_bf16_hnd_window", order="HND", dtype=BF16, sliding_window=40, block_size=1),
        spec("decode_fp16_softcap_hs80", dtype=F16, head_size=80, softcap=8.0, group=8),
        # > 16 partitions: the reduce kernel walks several chunks of partial results.
        spec("decode_many_parts", num_kv_heads=1, group=2, context_lens=(620,), query_lens=(1,), block_size=32),
        # the forced split path also serves mixed batches (prefill rows see few partitions).
        spec("mixed_batch", query_lens=(9, 1, 4), context_lens=(0, 70, 30), sliding_window=25, dtype=BF16),
    ]


def run_cross_backend_cache(spec: CaseSpec, device, other: str) -> None:
    """A cache written by TRITON equals one written by ``other``; each reads the other's cache alike."""
    case = build_case(spec, device)
    cache_t, cache_o = case.cache, case.cache.clone()
    md = case.metadata
    kvmulti.write_kv(case.key, case.value, cache_t, case.layout, md.slot_mapping, backend="TRITON")
    other_args = _to_device(case, "cpu") if other == "CPU" else case
    cache_o = cache_o.to(other_args.cache.device)
    kvmulti.write_kv(other_args.key, other_args.value, cache_o, case.layout, other_args.metadata.slot_mapping,
                     backend=other)
    assert torch.equal(cache_t.cpu(), cache_o.cpu()), f"TRITON and {other} wrote different caches"
    kwargs = dict(sliding_window=spec.sliding_window, softcap=spec.softcap)
    # TRITON reads the other backend's cache, the other backend reads TRITON's.
    out_t = kvmulti.paged_attention(case.query, cache_o.to(cache_t.device), case.layout, md, backend="TRITON",
                                    **kwargs)
    out_o = kvmulti.paged_attention(other_args.query, cache_t.to(cache_o.device), case.layout, other_args.metadata,
                                    backend=other, **kwargs)
    expected = reference.paged_attention(case.query.cpu(), cache_t.cpu(), case.layout, _cpu_md(md), **kwargs)
    assert_close_to_reference(out_t, expected, spec.dtype, "TRITON on the other backend's cache")
    assert_close_to_reference(out_o, expected, spec.dtype, f"{other} on TRITON's cache")


def run_strided_write(device, dtype, order) -> None:
    """key/value as column slices of a fused qkv projection; padding slots (-1) untouched."""
    gen = torch.Generator().manual_seed(3)
    layout = kvmulti.KVCacheLayout(num_blocks=5, block_size=4, num_kv_heads=2, head_size=32, dtype=dtype, order=order)
    cache = layout.allocate(device)
    cache.copy_(torch.randn(layout.shape, generator=gen).to(dtype))
    before = cache.clone()
    tokens, hq = 9, 4
    qkv = torch.randn(tokens, hq + 2 * 2, 32, generator=gen).to(dtype).to(device)
    key, value = qkv[:, hq:hq + 2], qkv[:, hq + 2:]
    assert not key.is_contiguous() or not value.is_contiguous()
    slots = torch.tensor([3, -1, 7, 19, -1, 0, 12, 8, -1], dtype=torch.int64, device=device)
    kvmulti.write_kv(key, value, cache, layout, slots, backend="TRITON")
    expected = before.cpu().clone()
    reference.write_kv(key.cpu(), value.cpu(), expected, layout, slots.cpu())
    assert torch.equal(cache.cpu(), expected)
    untouched = torch.ones(layout.num_slots, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    flat_now = cache.cpu().reshape(layout.num_slots, 2, -1)     # logical (slot, head, entry) view
    flat_before = before.cpu().reshape(layout.num_slots, 2, -1)
    assert torch.equal(flat_now[untouched], flat_before[untouched])


def _cpu_md(md):
    if md.device.type == "cpu":
        return md
    return kvmulti.CommonAttentionMetadata(md.query_start_loc.cpu(), md.seq_lens.cpu(), md.block_table.cpu(),
                                           md.slot_mapping.cpu(), md.num_reqs, md.num_actual_tokens,
                                           md.max_query_len, md.max_seq_len, md.causal)


class _Args:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _to_device(case, device):
    return _Args(key=case.key.to(device), value=case.value.to(device), query=case.query.to(device),
                 cache=case.cache.to(device), metadata=_cpu_md(case.metadata))


# ---------------------------------------------------------------- interpreter suite (CPU tensors)
@ON_CPU
@settings(max_examples=examples(40))
@given(batch_cases(head_sizes=(64, 80)))
def test_triton_matches_reference(spec):
    check_against_reference(spec, "TRITON")


@ON_CPU
@pytest.mark.parametrize("spec", corner_specs())
def test_triton_corners(spec):
    check_against_reference(spec, "TRITON")


def prefill_specs() -> list:
    """Prefill steps (the longest query at least ``launch.PREFILL_MIN_QUERY_LEN``): several q-blocks and
    key tiles per request, whole tiles skipped before a window, interior tiles without a per-score
    mask and the diagonal tile, next to decode and chunked rows of the same step."""
    def spec(id_, **kw):
        base = dict(order="NHD", block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=BF16)
        base.update(kw)
        return pytest.param(CaseSpec(**base), id=id_)
    return [
        spec("varlen_bf16_gqa4", query_lens=(70, 1, 9, 40), context_lens=(0, 130, 20, 90)),
        spec("chunked_window_softcap_fp16_gqa8_hnd", order="HND", block_size=32, group=8, head_size=80, dtype=F16,
             query_lens=(66, 5), context_lens=(150, 10), sliding_window=50, softcap=20.0),
        spec("gqa1_fp32_block1_window", block_size=1, group=1, dtype=F32, query_lens=(64, 2), context_lens=(100, 7),
             sliding_window=30),
        spec("gqa1_bf16_block128_two_qblocks", block_size=128, group=1, num_kv_heads=1, query_lens=(130,),
             context_lens=(70,)),
        spec("hs256_fp16_gqa2_hnd", order="HND", group=2, head_size=256, dtype=F16, query_lens=(65,),
             context_lens=(40,)),
        spec("hsv_differs_softcap", head_size=128, head_size_v=64, query_lens=(64, 1), context_lens=(30, 50),
             softcap=10.0),
        spec("hs32_window_fp16", head_size=32, dtype=F16, query_lens=(80, 1), context_lens=(20, 60),
             sliding_window=40),
        spec("hs256_window_bf16", head_size=256, group=1, query_lens=(66,), context_lens=(10,), sliding_window=30),
    ]


def run_with_target_tiles(spec: CaseSpec, family: str, monkeypatch, arch: int | None = None) -> list:
    """check_against_reference with the tiles the planner picks for ``family`` ("nvidia" / "amd") and
    ``arch`` (NVIDIA's compute capability, 90: Hopper): the interpreter runs the kernel those targets
    compile. Returns the attention launches."""
    from kvmulti.backends.triton import launch
    monkeypatch.setattr(launch, "device_family", lambda device: family)
    monkeypatch.setattr(launch, "device_arch", lambda device: arch)
    launches = record_triton_launches(monkeypatch)
    check_against_reference(spec, "TRITON")
    return [ln for ln in launches if ln.kernel == "unified_attention"]


@ON_CPU
@pytest.mark.parametrize("family", ["nvidia", "amd"])
@pytest.mark.parametrize("spec", prefill_specs())
def test_prefill_tiles_match_reference(spec, family, monkeypatch):
    from kvmulti.backends.triton import launch
    (ln,) = run_with_target_tiles(spec, family, monkeypatch)
    hs, hsv = spec.head_size, spec.head_size_v or spec.head_size
    hp = max(launch.head_pad(hs), launch.head_pad(hsv))
    tiles = launch.prefill_tiles(family, hp, spec.dtype != F32,      # fp32 dots: None, the mixed tiles
                                 exact_head=(launch.head_pad(hs), launch.head_pad(hsv)) == (hs, hsv),
                                 window=bool(spec.sliding_window), softcap=bool(spec.softcap))
    assert ln.args["PREFILL"] == (tiles is not None)
    if tiles is not None:
        assert (ln.args["BLOCK_M"], ln.args["TILE_N"], ln.num_warps, ln.num_stages) == (
            tiles.block_m, tiles.tile_n, tiles.num_warps, tiles.num_stages)


@ON_CPU
@pytest.mark.parametrize("spec", [p for p in prefill_specs() if p.id in ("varlen_bf16_gqa4", "gqa1_bf16_block128_two_qblocks")])
def test_hopper_prefill_tiles_match_reference(spec, monkeypatch):
    """Hopper's own prefill tiles (64 x 64 over 4 warps where other NVIDIA GPUs take 128 x 64)."""
    from kvmulti.backends.triton import launch
    (ln,) = run_with_target_tiles(spec, "nvidia", monkeypatch, arch=90)
    assert (ln.args["PREFILL"], ln.args["BLOCK_M"], ln.args["TILE_N"], ln.num_warps) == (True, 64, 64, 4)
    assert launch.prefill_tiles("nvidia", 64, True) == launch.PrefillTiles(128, 64, 8, 3)


@ON_CPU
@pytest.mark.parametrize("spec", split_specs())
def test_split_kv_matches_single_pass(spec):
    run_split_vs_single(spec, "cpu")


@ON_CPU
@settings(max_examples=examples(12))
@given(batch_cases(head_sizes=(64, 80), max_reqs=3, max_query=4, block_sizes=(1, 16)), st.sampled_from([16, 32]))
def test_split_kv_matches_single_pass_random(spec, partition_size):
    run_split_vs_single(spec, "cpu", partition_size)


@ON_CPU
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_cache_written_by_triton_reads_through_cpu_and_back(order, dtype):
    spec = CaseSpec(order=order, block_size=16, num_kv_heads=2, group=4, head_size=80, dtype=dtype,
                    query_lens=(6, 1, 3), context_lens=(0, 40, 18), sliding_window=30 if dtype == F16 else None)
    run_cross_backend_cache(spec, "cpu", "CPU")


@ON_CPU
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_write_kv_strided_inputs_and_padding(order):
    run_strided_write("cpu", BF16, order)


@ON_CPU
def test_partition_size_setting_forces_path(monkeypatch):
    """KVMULTI_PARTITION_SIZE (the one split-KV contract): N always splits, 0 never, -1 decides."""
    spec = CaseSpec(order="NHD", block_size=16, num_kv_heads=1, group=2, head_size=16, dtype=F32,
                    query_lens=(1,), context_lens=(40,))
    case = build_case(spec)
    for value, split in (("16", True), ("0", False), ("-1", False)):   # -1: 1 compute unit on CPU, short context
        monkeypatch.setenv("KVMULTI_PARTITION_SIZE", value)
        step = TritonBackend().build_metadata(case.metadata, case.layout, 2, None)
        assert step.plan.split is split
    monkeypatch.setenv("KVMULTI_PARTITION_SIZE", "24")
    with pytest.raises(ValueError, match="power of two >= 16"):
        TritonBackend()
    monkeypatch.setenv("KVMULTI_PARTITION_SIZE", "sometimes")
    with pytest.raises(ValueError, match="KVMULTI_PARTITION_SIZE='sometimes'"):
        TritonBackend()


# ---------------------------------------------------------------- heuristic and reporting (any host)
def test_split_heuristic():
    from kvmulti.backends.triton.launch import plan_attention

    def plan(**kw):
        args = dict(num_reqs=2, num_kv_heads=8, num_qpk=4, max_query_len=1, max_seq_len=8192, head_size=128,
                    head_size_v=128, dtype=BF16, num_compute_units=132, block_size=16)
        args.update(kw)
        return plan_attention(**args)

    assert plan().split and plan().num_parts == 16                 # 16 programs on 132 SMs, long context
    assert not plan(max_query_len=2).split                        # any prefill / verification row
    assert not plan(num_reqs=32).split                            # 256 programs already fill the GPU
    assert not plan(max_seq_len=1000).split                       # fewer than two partitions
    assert plan(max_seq_len=1024).split
    assert not plan(split_kv=False).split and plan(max_query_len=5, split_kv=True).split
    p = plan(head_size=80, num_qpk=3, max_query_len=9)
    assert (p.head_pad, p.block_m, p.block_q) == (128, 64, 21)
    with pytest.raises(ValueError):
        plan(partition_size=100)


def test_backend_reports_interpreter_and_cpu_rules(monkeypatch):
    backend = get_backend("TRITON")
    assert backend.name == "TRITON" and backend.platforms == ("cuda", "rocm", "xpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.platform_reasons("cpu") == []
    assert "interpreter" in backend.describe()
    if triton_backend.interpreting() and not torch.cuda.is_available():
        assert backend.unavailable_reasons() == []
    # Never chosen by default on a CPU tensor, even while interpreting: the cpu priority is CPU only.
    config = AttentionConfig(platform="cpu", dtype=F16, head_size=64, head_size_v=64, num_kv_heads=2,
                             block_size=16, order="NHD")
    assert select_backend(config) == "CPU"
    assert select_backend(config, requested="triton") == "TRITON"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reasons = backend.platform_reasons("cpu")
    assert reasons and "TRITON_INTERPRET=1" in reasons[0]
    assert "interpreter" not in backend.describe()
    assert backend.platform_reasons("cuda") == [] and backend.platform_reasons("xpu") == []
    assert backend.not_supported_reasons(AttentionConfig(platform="cuda", dtype=F16, head_size=512,
                                                         head_size_v=512, num_kv_heads=2, block_size=16,
                                                         order="HND"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-driver reason on a host without a GPU")
def test_no_driver_reason_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    triton_backend.backend._driver_reasons.cache_clear()
    try:
        reasons = get_backend("TRITON").unavailable_reasons()
        assert reasons and "no active GPU driver" in reasons[0]
    finally:
        triton_backend.backend._driver_reasons.cache_clear()


def test_interpreter_mode_change_is_reported(monkeypatch):
    from kvmulti.triton_kernels import unified_attention
    interpreted = type(unified_attention.unified_attention_kernel).__name__ == "InterpretedFunction"
    monkeypatch.setenv("TRITON_INTERPRET", "0" if interpreted else "1")
    reasons = get_backend("TRITON").unavailable_reasons()
    assert any("were loaded with TRITON_INTERPRET" in r for r in reasons), reasons


def test_interpreter_works_when_triton_was_imported_first():
    """`import kvmulti` imports triton (through torch's custom-op machinery) before a test can set
    TRITON_INTERPRET=1; the kernels must still run under the interpreter then."""
    code = ("import os, sys\n"
            "sys.path.insert(0, os.path.join(os.getcwd(), 'tests'))\n"
            "os.environ.pop('TRITON_INTERPRET', None)\n"
            "import kvmulti, torch\n"
            "import triton.language\n"
            "os.environ['TRITON_INTERPRET'] = '1'\n"
            "from batches import CaseSpec, check_against_reference\n"
            "from kvmulti.backends.registry import get_backend\n"
            "for partition in (0, 16):\n"
            "    get_backend('TRITON').partition_size = partition\n"
            "    check_against_reference(CaseSpec(order='HND', block_size=4, num_kv_heads=2, group=2, head_size=16,\n"
            "        dtype=torch.bfloat16, query_lens=(3, 1), context_lens=(2, 9), sliding_window=6, softcap=5.0),\n"
            "        'TRITON')\n"
            "print('ok')\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root,
                          timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]


def test_import_without_triton_reports_reason():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import kvmulti\n"
            "from kvmulti.backends import get_backend, available_backends\n"
            "r = get_backend('TRITON').unavailable_reasons()\n"
            "assert r and 'not importable' in r[0], r\n"
            "assert available_backends('cpu')['TRITON']\n"
            "print('ok')\n")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


def test_gpu_sweep_candidates_reach_the_plan():
    """benchmarks/triton_gpu_sweep.py (run on a CUDA GPU) swaps each candidate's tiles into the
    planner; --plans shows that without a GPU: every candidate and partition size gets its own plan."""
    sweep = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_gpu_sweep.py"
    out = subprocess.run([sys.executable, str(sweep), "--plans"], capture_output=True, text=True, check=True).stdout
    assert "prefill 8x2048 shipped" in out and "block_m=256, block_q=64, tile_n=64" in out
    assert "num_warps=4, num_stages=3, prefill=True" in out
    assert "decode 1x32768 4096" in out and "num_parts=8" in out
