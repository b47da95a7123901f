"""The Triton kernels on both Triton releases the compile evidence covers (tiles.GATED_TRITON):
the newest, which the venv installs, and the one torch 2.13's CUDA wheels pin
(devtools/triton_versions.py; scripts/setup.sh --test installs it into .triton/). The tiles that
spill with the pinned release take their alternatives there, and only there; with the pinned
release every specialisation cross-compiles without spills: in the gate the batches whose launches
differ per release and the serving model's, for sm_90 and gfx942 (tests/tiers.py); in the
exhaustive tier every batch for every target.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

import tiers  # noqa: E402
from availability import unavailable  # noqa: E402
from devtools import evidence_targets, triton_versions  # noqa: E402
from devtools import triton_cross_compile as xc  # noqa: E402
from kvmulti.backends.triton import launch, tiles  # noqa: E402

pytestmark = pytest.mark.evidence

ROOT = Path(__file__).resolve().parents[1]
PINNED, NEWEST = tiles.GATED_TRITON
COMPILED_TARGETS = evidence_targets.selected(list(xc.TARGETS))
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def test_the_gated_releases_are_the_installed_and_the_pinned_one():
    assert tiles.parse_triton_version(triton.__version__) == NEWEST
    assert triton_versions.pinned_version() == PINNED < NEWEST and tiles.LEAN_FROM == NEWEST
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert re.search(r"^triton_pinned=(\S+)$", setup, re.M).group(1) == triton_versions.PINNED
    assert ".triton/" in (ROOT / ".gitignore").read_text().split()


@pytest.mark.parametrize("text, version", [("3.7.1", (3, 7)), ("3.9.0+git1a2b3c", (3, 9)), ("3.10.0", (3, 10))])
def test_parse_triton_version(text, version):
    assert tiles.parse_triton_version(text) == version


def test_a_version_string_that_is_not_one_is_an_error():
    with pytest.raises(ValueError, match="cannot read a Triton version from 'main'"):
        tiles.parse_triton_version("main")


def _plan(version, *, family="nvidia", dtype=F16, hs=64, max_q=1, split=False, softcap=None):
    return launch.plan_attention(num_reqs=2, num_kv_heads=2, num_qpk=4, max_query_len=max_q, max_seq_len=4096,
                                 head_size=hs, head_size_v=hs, dtype=dtype, num_compute_units=132, block_size=16,
                                 split_kv=split, family=family, softcap=softcap, arch=90 if family == "nvidia" else None,
                                 version=version)


@pytest.mark.parametrize("case, newest, pinned", [
    # NVIDIA fp32 tiles of 256-wide heads: 4 warps spill 8 B on sm_90 with 3.7.1, 8 warps none
    (dict(dtype=F32, hs=256), (4, 3), (8, 3)),
    (dict(dtype=F32, hs=256, max_q=7), (4, 3), (8, 3)),
    (dict(dtype=F32, hs=256, split=True), (4, 3), (8, 3)),
    # NVIDIA fp16 / bf16 decode of 32-wide heads: 3 stages spill 8 B on sm_90 with 3.7.1, 4 none
    (dict(dtype=F16, hs=32), (4, 3), (4, 4)),
    (dict(dtype=BF16, hs=32, split=True), (4, 3), (4, 4)),
    # NVIDIA fp32 decode of 16-wide heads: 3 stages spill 8 B on sm_80 (split) with 3.7.1, 4 none
    (dict(dtype=F32, hs=16, split=True), (4, 3), (4, 4)),
    (dict(dtype=F32, hs=16), (4, 3), (4, 4)),
    # AMD prefill with a softcap: 128 x 32 spills 15 VGPRs on gfx90a with 3.7.1, 128 x 16 none
    (dict(family="amd", hs=128, max_q=300, softcap=30.0), (4, 2, 128, 32), (4, 2, 128, 16)),
])
def test_tiles_that_spill_on_the_pinned_release_take_their_alternative_there_only(case, newest, pinned):
    for version, expected in ((NEWEST, newest), ((3, 10), newest), (PINNED, pinned), ((3, 8), pinned)):
        plan = _plan(version, **case)
        got = (plan.num_warps, plan.num_stages) + ((plan.block_m, plan.tile_n) if len(expected) == 4 else ())
        assert got == expected, (version, case, plan)


def test_every_other_choice_is_the_same_on_both_releases():
    """Only the batches of the alternatives above plan differently per release."""
    for target in ("sm_90", "gfx942"):
        differing = set(triton_versions.differing_spec_names(target, (PINNED, NEWEST)))
        expected = ({"fp32_hs256_mixed", "fp32_hs256_decode", "fp32_hs256_split", "fp32_hs256_prefill",
                     "fp16_hs32_decode", "fp16_hs32_split", "bf16_hs32_decode", "bf16_hs32_split",
                     "fp32_hs16_decode", "fp32_hs16_split"}
                    if target == "sm_90" else {"prefill_softcap_fp16"})
        assert differing == expected, target


@pytest.fixture(scope="module")
def compiled_pinned() -> dict[str, list[dict]]:
    """{target: results} compiled with the pinned release: the gate's subset, every batch in the
    exhaustive tier."""
    reason = triton_versions.missing_reason()
    if reason:
        unavailable(reason)
    names = None if tiers.full() else {t: triton_versions.gate_spec_names(t) for t in COMPILED_TARGETS}
    return xc.compile_in_subprocesses(list(COMPILED_TARGETS), triton_dir=str(triton_versions.pinned_dir()),
                                      spec_names=names)


@pytest.mark.parametrize("target_name", COMPILED_TARGETS)
def test_pinned_release_cross_compiles_without_spills(target_name, compiled_pinned):
    results = compiled_pinned[target_name]
    assert {r["triton"] for r in results} == {triton_versions.PINNED}
    wanted = ({s.name for s in xc.batch_specs(target_name)} if tiers.full()
              else set(triton_versions.gate_spec_names(target_name)))
    assert {r["name"].split("-", 1)[1] for r in results} <= wanted
    alternatives = triton_versions.differing_spec_names(target_name, (PINNED, NEWEST))
    assert {r["name"] for r in results} >= {f"unified_attention-{name}" for name in alternatives}
    assert {r["kernel"] for r in results} == set(launch.KERNELS)
    failed = [f"{r['name']} {r['constexprs']}: {r['problem']}" for r in results if r["problem"]]
    assert not failed, f"{len(failed)} specialisations fail on {target_name}:\n" + "\n".join(failed)
    spilled = [(r["name"], r["num_warps"], r["num_stages"], r["spills"]) for r in results if r["spills"]]
    assert not spilled, f"{len(spilled)} specialisations spill on {target_name} with Triton {PINNED}: {spilled}"
    prefill = [r for r in results if r["constexprs"].get("PREFILL") == "True" and "fp32" not in r["name"]]
    assert prefill and all(r["matrix_instructions"] > 0 for r in prefill), target_name
