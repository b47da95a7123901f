"""Speculative decoding: greedy output identical to target-only decoding, per-model backends and
KV groups, rollback leaves exactly the accepted K/V, no shared metadata, clear argument errors."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from kvmulti.engine import ModelRunner
from kvmulti.spec_decode.runner import SpeculativeRunner

transformers = pytest.importorskip("transformers")
from test_models import VOCAB, _COMMON, build_hf_model, save_hf_model, usable_backends  # noqa: E402

BACKENDS = usable_backends()
RUNNER_ARGS = dict(block_size={"full": 4, "sliding": 8}, num_blocks=256)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def gemma3_draft():
    """A second, smaller Gemma3: a draft with two KV groups (sliding + full)."""
    config = transformers.Gemma3TextConfig(**{**_COMMON, "num_hidden_layers": 2, "sliding_window": 3,
                                              "query_pre_attn_scalar": 24,
                                              "layer_types": ["sliding_attention", "full_attention"]})
    torch.manual_seed(7)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Targets: gemma3 (two groups) and llama; drafts: llama (one group) and gemma3 (two groups)."""
    return {
        "target_gemma3": save_hf_model(build_hf_model("gemma3", seed=1), tmp_path_factory.mktemp("tg3")),
        "target_llama": save_hf_model(build_hf_model("llama", seed=2), tmp_path_factory.mktemp("tl")),
        "draft_llama": save_hf_model(build_hf_model("llama", seed=3), tmp_path_factory.mktemp("dl")),
        "draft_gemma3": save_hf_model(gemma3_draft(), tmp_path_factory.mktemp("dg3")),
    }


def random_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 14))] for _ in range(n)]


def batches(prompts, sizes=(1, 3, 8, 2, 5)):
    it, size = iter(prompts), itertools.cycle(sizes)
    while batch := list(itertools.islice(it, next(size))):
        yield batch


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("draft", ["draft_llama", "draft_gemma3"])
def test_greedy_speculative_equals_target_only(models, k, draft):
    """>= 50 random prompts in batches of mixed sizes, a two-group target."""
    target_only = SpeculativeRunner(models["target_gemma3"], **RUNNER_ARGS)
    spec = SpeculativeRunner(models["target_gemma3"], draft=models[draft], num_speculative_tokens=k, **RUNNER_ARGS)
    assert len(spec.target.kv_cache_config.groups) == 2
    assert len(spec.draft.kv_cache_config.groups) == (2 if draft == "draft_gemma3" else 1)
    for batch in batches(random_prompts(50, seed=k)):
        expected = target_only.generate(batch, max_new_tokens=10)
        assert spec.generate(batch, max_new_tokens=10) == expected
        assert spec.stats.num_draft_tokens > 0
    # Random drafts are mostly rejected: the equality above was earned on rejections too.
    assert spec.stats.acceptance_rate < 0.9
    assert all(not r for r in (spec.target.requests, spec.draft.requests))        # everything released


PAIRS = sorted({(t, d) for t in BACKENDS for d in BACKENDS if "CPU" in (t, d) or t == d})


@pytest.mark.parametrize("target_backend,draft_backend", PAIRS)
def test_every_usable_backend_pair(models, target_backend, draft_backend):
    prompts = random_prompts(3, seed=11)
    expected = SpeculativeRunner(models["target_gemma3"], target_backend="CPU", **RUNNER_ARGS).generate(
        prompts, max_new_tokens=6)
    spec = SpeculativeRunner(models["target_gemma3"], draft=models["draft_gemma3"], num_speculative_tokens=3,
                             target_backend=target_backend, draft_backend=draft_backend, **RUNNER_ARGS)
    assert {b.name for b in spec.target.backends.values()} == {target_backend}
    assert {b.name for b in spec.draft.backends.values()} == {draft_backend}
    assert spec.generate(prompts, max_new_tokens=6) == expected


def test_draft_backend_is_never_inherited(models, monkeypatch):
    monkeypatch.delenv("KVMULTI_ATTENTION_BACKEND", raising=False)
    monkeypatch.setenv("KVMULTI_DRAFT_ATTENTION_BACKEND", "NOPE")
    with pytest.raises(ValueError, match="KVMULTI_DRAFT_ATTENTION_BACKEND='NOPE'"):
        SpeculativeRunner(models["target_llama"], draft=models["draft_llama"], target_backend="CPU", **RUNNER_ARGS)
    monkeypatch.delenv("KVMULTI_DRAFT_ATTENTION_BACKEND")
    spec = SpeculativeRunner(models["target_llama"], draft=models["draft_llama"], target_backend="CPU", **RUNNER_ARGS)
    assert {b.name for b in spec.draft.backends.values()} == {"CPU"}                          # dispatch, not the target's arg


def test_sampling_runs_and_is_seeded(models):
    spec = SpeculativeRunner(models["target_llama"], draft=models["draft_llama"], num_speculative_tokens=3,
                             **RUNNER_ARGS)
    prompts = random_prompts(4, seed=5)
    a = spec.generate(prompts, max_new_tokens=12, temperature=0.9, seed=3)
    b = spec.generate(prompts, max_new_tokens=12, temperature=0.9, seed=3)
    assert a == b and all(len(o) == 12 for o in a)
    assert spec.generate(prompts, max_new_tokens=12, temperature=0.9, seed=4) != a
    assert len(spec.stats.per_position_acceptance) == 3


def test_target_cache_after_rejections_equals_fresh_prefill(models, monkeypatch):
    """Stop a run full of rejections mid-way; the target's K/V for every computed position equal
    those of a fresh target-only prefill of the same tokens."""
    spec = SpeculativeRunner(models["target_gemma3"], draft=models["draft_llama"], num_speculative_tokens=4,
                             **RUNNER_ARGS)
    kept = {}
    original = spec._remove

    def keep_last_state(rid):
        req = spec.target.requests[rid]
        kept[rid] = (list(req.tokens), req.num_computed, snapshot(spec.target, rid, req.num_computed))
        original(rid)

    monkeypatch.setattr(spec, "_remove", keep_last_state)
    spec.generate(random_prompts(3, seed=9), max_new_tokens=15)
    assert spec.stats.acceptance_rate < 0.9
    for rid, (tokens, computed, kv) in kept.items():
        fresh = ModelRunner(models["target_gemma3"], **RUNNER_ARGS)
        fresh.add_request("f", tokens[:computed])
        fresh.forward({"f": computed})
        expected = snapshot(fresh, "f", computed)
        for layer in kv:
            torch.testing.assert_close(kv[layer], expected[layer], atol=1e-5, rtol=1e-5)


def snapshot(runner: ModelRunner, rid, length: int) -> dict[str, torch.Tensor]:
    """K/V of positions the layer's group still holds (sliding groups keep only their window)."""
    row = runner.requests[rid].row
    out = {}
    for layer, gid in runner.layer_to_group.items():
        table, layout = runner.tables[gid], runner.layouts[gid]
        start = table.visible_from(row) if table.window is not None else 0
        start = max(start, length - table.window + 1) if table.window is not None else 0
        pos = torch.arange(start, length)
        blocks = torch.as_tensor(table.table[row])[pos // layout.block_size].long()
        out[layer] = runner.kv_caches[layer][blocks, pos % layout.block_size].clone()
    return out


def test_no_tensor_shared_between_target_and_draft_metadata(models, monkeypatch):
    spec = SpeculativeRunner(models["target_gemma3"], draft=models["draft_gemma3"], num_speculative_tokens=2,
                             **RUNNER_ARGS)
    seen = {"target": [], "draft": []}      # the tensors themselves: alive, so no address is reused
    for role, runner in (("target", spec.target), ("draft", spec.draft)):
        prepare = runner.prepare

        def recording(*args, _prepare=prepare, _role=role, **kwargs):
            batch = _prepare(*args, **kwargs)
            for md in batch.metadata.values():
                for t in (md.query_start_loc, md.seq_lens, md.block_table, md.slot_mapping, md.query_start_loc_cpu,
                          md.seq_lens_cpu):
                    seen[_role].append(t)
            return batch

        monkeypatch.setattr(runner, "prepare", recording)
    spec.generate(random_prompts(2, seed=1), max_new_tokens=4)
    assert seen["target"] and seen["draft"]
    addresses = {role: {t.untyped_storage().data_ptr() for t in ts if t.numel()} for role, ts in seen.items()}
    assert not addresses["target"] & addresses["draft"]
    caches = [{c.untyped_storage().data_ptr() for c in r.kv_caches.values()} for r in (spec.target, spec.draft)]
    assert not caches[0] & caches[1]


def test_argument_errors(models, tmp_path):
    for k in (0, 33, 2.5):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            SpeculativeRunner(models["target_llama"], draft=models["draft_llama"], num_speculative_tokens=k)
    other = build_hf_model("llama", seed=4)
    other.resize_token_embeddings(VOCAB + 8)
    path = save_hf_model(other, tmp_path / "bigger_vocab")
    with pytest.raises(ValueError, match="share the vocabulary"):
        SpeculativeRunner(models["target_llama"], draft=path, **RUNNER_ARGS)


def test_eos_and_budget_do_not_overshoot(models):
    spec = SpeculativeRunner(models["target_llama"], draft=models["target_llama"], num_speculative_tokens=5,
                             **RUNNER_ARGS)
    prompts = random_prompts(4, seed=2)
    outs = spec.generate(prompts, max_new_tokens=7)
    assert all(len(o) == 7 or o[-1] in spec.eos_token_ids for o in outs)
    assert spec.stats.acceptance_rate == 1.0          # the draft IS the target
