"""ModelRunner: per-group metadata, KV groups with different block sizes, sliding-window block
bound, pool exhaustion, rollback, runner isolation; SpeculativeRunner plain generation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from kvmulti.kv_cache import OutOfBlocksError
from kvmulti.metadata import CommonAttentionMetadata
from kvmulti.engine import ModelRunner
from kvmulti.spec_decode.runner import GenerationError, SpeculativeRunner
from kvmulti.spec_decode.sampling import request_generator, sample

from test_models import PROMPTS, TOL, build_hf_model, hf_logits, run_decode, run_full_prefill, save_hf_model

pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for family in ("llama", "mistral", "gemma3"):
        model = build_hf_model(family, seed=1)
        out[family] = (model, save_hf_model(model, tmp_path_factory.mktemp(family)))
    return out


def group_of_kind(runner: ModelRunner, kind: str) -> int:
    (gid,) = [g.group_id for g in runner.kv_cache_config.groups if g.spec.kind == kind]
    return gid


def test_gemma3_two_groups_with_different_block_sizes(models):
    model, path = models["gemma3"]
    runner = ModelRunner(path, block_size={"full": 8, "sliding": 2}, num_blocks=64)
    groups = runner.kv_cache_config.groups
    assert len(groups) == 2
    full, sliding = group_of_kind(runner, "full"), group_of_kind(runner, "sliding")
    assert runner.layouts[full].block_size == 8 and runner.layouts[sliding].block_size == 2
    assert groups[sliding].spec.sliding_window == 5
    types = model.config.layer_types
    assert runner.layer_to_group == {f"model.layers.{i}.self_attn": (sliding if t == "sliding_attention" else full)
                                     for i, t in enumerate(types)}
    # Each layer has its own cache, of its group's layout.
    assert len({c.data_ptr() for c in runner.kv_caches.values()}) == len(types)

    # A mixed step: one request decoding next to two prefilling.
    runner.add_request("a", PROMPTS[0])
    runner.forward({"a": len(PROMPTS[0]) - 1}, 0)
    runner.add_request("b", PROMPTS[2])
    runner.add_request("c", PROMPTS[1])
    schedule = {"a": 1, "b": 7, "c": 3}
    batch = runner.prepare(schedule, {"a": 1, "b": 7, "c": 3})
    assert set(batch.metadata) == {full, sliding}
    for gid, md in batch.metadata.items():
        bs = runner.layouts[gid].block_size
        ref = CommonAttentionMetadata.from_lens([1, 7, 3], [len(PROMPTS[0]), 7, 3], md.block_table, bs)
        assert torch.equal(md.slot_mapping, ref.slot_mapping) and torch.equal(md.query_start_loc, ref.query_start_loc)
        assert md.seq_lens.tolist() == [len(PROMPTS[0]), 7, 3] and md.max_query_len == 7
        assert md.block_table.shape[1] == -(-len(PROMPTS[0]) // bs)
    assert not torch.equal(batch.metadata[full].slot_mapping, batch.metadata[sliding].slot_mapping)

    # The step itself, checked against transformers, then the rest of b by decode.
    logits = runner.forward(schedule, {"a": 1, "b": 7, "c": 3})
    a, b, c = logits.split([1, 7, 3])
    torch.testing.assert_close(a[0], hf_logits(model, PROMPTS[0])[-1], **TOL)
    torch.testing.assert_close(b, hf_logits(model, PROMPTS[2])[:7], **TOL)
    torch.testing.assert_close(c, hf_logits(model, PROMPTS[1]), **TOL)


def test_sliding_window_block_bound_on_a_long_request(models):
    """W=5, sliding block size 2: at most ceil(5/2)+1 = 4 blocks held, from a pool of only 5,
    over a 160-token request -- logits still equal transformers' at every position."""
    model, path = models["gemma3"]
    runner = ModelRunner(path, block_size={"full": 16, "sliding": 2}, num_blocks={0: 5, 1: 16})
    sliding = group_of_kind(runner, "sliding")
    assert sliding == 0 and runner.layouts[sliding].num_blocks == 5
    bound = runner.kv_cache_config.groups[sliding].spec.max_blocks_held()
    assert bound == 4
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 300, (160,), generator=gen).tolist()
    expected = hf_logits(model, tokens)
    runner.add_request("long", tokens[:9])
    got = [runner.forward({"long": 9}, 9)]
    for t in range(9, 160):
        held = runner.num_blocks_held("long")[sliding]
        assert held <= bound, f"after {t} tokens the sliding group holds {held} blocks"
        runner.append_tokens("long", [tokens[t]])
        got.append(runner.forward({"long": 1}))
    torch.testing.assert_close(torch.cat(got), expected, **TOL)
    assert runner.num_blocks_held("long")[1 - sliding] == 10           # the full group keeps everything
    runner.remove_request("long")
    assert runner.num_free_blocks() == {0: 5, 1: 16}


def test_pool_exhaustion_fails_one_request_and_leaves_others_identical(models):
    _, path = models["llama"]
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[0]]                      # 3, 12, 19 tokens
    kw = dict(block_size=4, max_num_batched_tokens=64)
    big = SpeculativeRunner(path, num_blocks=64, **kw)
    reference = big.generate(prompts, max_new_tokens=4)

    # At the prompt: 1 + 3 blocks fit in 7, the third prompt's 5 do not -> it fails; the others
    # finish in 2 + 4 blocks and their tokens are those of the roomy run.
    small = SpeculativeRunner(path, num_blocks=7, **kw)
    with pytest.raises(GenerationError) as info:
        small.generate(prompts, max_new_tokens=4)
    err = info.value
    assert set(err.failures) == {2} and isinstance(err.failures[2], OutOfBlocksError)
    assert "request (" in str(err.failures[2]) and "needs 5 more KV block(s) in group 0 but only 3 of 7" in str(err)
    assert err.outputs[:2] == reference[:2] and err.outputs[2] is None
    assert small.stats.failures.keys() == {2}
    assert small.target.num_free_blocks() == {0: 7} and not small.target.requests

    # While decoding: 3 + 19 tokens with 8 new need 3 + 7 blocks, 9 exist -> exactly one request
    # fails when it needs a block none is left for; the other's tokens are unchanged.
    reference = big.generate(prompts[::2], max_new_tokens=8)
    small = SpeculativeRunner(path, num_blocks=9, **kw)
    with pytest.raises(GenerationError) as info:
        small.generate(prompts[::2], max_new_tokens=8)
    (failed,) = info.value.failures
    assert info.value.outputs[1 - failed] == reference[1 - failed] and info.value.outputs[failed] is None
    assert small.target.num_free_blocks() == {0: 9}


def test_failed_step_changes_nothing(models):
    _, path = models["llama"]
    runner = ModelRunner(path, block_size=4, num_blocks=6)
    runner.add_request("x", PROMPTS[2])                                  # 12 tokens: 3 blocks
    runner.add_request("y", PROMPTS[0])                                  # 19 tokens: 5 blocks
    with pytest.raises(OutOfBlocksError) as info:
        runner.forward({"x": 12, "y": 19})
    assert info.value.req_id == "y"
    assert runner.num_free_blocks() == {0: 6}
    assert [r.num_computed for r in runner.requests.values()] == [0, 0]
    runner.remove_request("y")
    torch.testing.assert_close(runner.forward({"x": 12}, 12), hf_logits(models["llama"][0], PROMPTS[2]), **TOL)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_verify_and_rollback(models, family):
    """k + 1 positions scored in one forward against a cached context, then a rollback to a
    shorter length and different tokens: logits equal a fresh computation every time."""
    model, path = models[family]
    k = 4
    runner = ModelRunner(path, block_size={"full": 4, "sliding": 2}, num_blocks=64, rollback_tokens=k + 1)
    prompt = PROMPTS[0]
    runner.add_request("r", prompt)
    runner.forward({"r": len(prompt)}, 0)
    guess = [11, 12, 13, 14, 15]                                         # k + 1 tokens to verify
    runner.append_tokens("r", guess)
    logits = runner.forward({"r": k + 1}, k + 1)
    torch.testing.assert_close(logits, hf_logits(model, prompt + guess)[-(k + 1):], **TOL)

    runner.truncate("r", len(prompt) + 1)                                # accept one token
    assert runner.requests["r"].num_computed == len(prompt) + 1
    other = [40, 41, 42, 43, 44]
    logits = runner.run({"r": other}, 5)                                 # append + compute the pending 5
    torch.testing.assert_close(logits, hf_logits(model, prompt + guess[:1] + other)[-5:], **TOL)
    runner.truncate("r", len(prompt) + 3)                                # keep 2 of them, one new token
    logits = runner.run({"r": [7]})
    torch.testing.assert_close(logits[0], hf_logits(model, prompt + guess[:1] + other[:2] + [7])[-1], **TOL)
    with pytest.raises(ValueError, match="cannot truncate"):
        runner.truncate("r", 10_000)


def test_rollback_beyond_the_sliding_margin_is_refused(models):
    _, path = models["mistral"]                                          # every layer slides, W = 6
    runner = ModelRunner(path, block_size=2, num_blocks=32, rollback_tokens=0)
    runner.add_request("r", PROMPTS[0])
    runner.forward({"r": 19})
    before = (list(runner.requests["r"].tokens), runner.num_blocks_held("r"))
    with pytest.raises(ValueError, match="rollback_tokens"):
        runner.truncate("r", 5)
    assert (runner.requests["r"].tokens, runner.num_blocks_held("r")) == before


def test_runners_share_no_tensors(models):
    _, path = models["gemma3"]
    a, b = (ModelRunner(path, block_size={"full": 4, "sliding": 2}, num_blocks=32, role=role)
            for role in ("target", "draft"))
    for r in (a, b):
        r.add_request("q", PROMPTS[2])
    ba, bb = a.prepare({"q": 12}), b.prepare({"q": 12})

    def storages(runner, batch):
        tensors = [batch.input_ids, batch.positions, batch.logits_indices, *runner.kv_caches.values()]
        for md in batch.metadata.values():
            tensors += [md.query_start_loc, md.seq_lens, md.block_table, md.slot_mapping, md.query_start_loc_cpu,
                        md.seq_lens_cpu]
        return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}

    assert not storages(a, ba) & storages(b, bb)
    # Within a runner, the groups share query_start_loc / seq_lens but not their block tables or slots.
    m0, m1 = ba.metadata.values()
    assert m0.block_table.data_ptr() != m1.block_table.data_ptr()
    assert m0.slot_mapping.data_ptr() != m1.slot_mapping.data_ptr()


def test_scheduler_puts_decodes_first_and_chunks_prefills(models):
    _, path = models["llama"]
    runner = ModelRunner(path, block_size=4, num_blocks=64, max_num_batched_tokens=8)
    runner.add_request("p1", PROMPTS[0])
    runner.add_request("d", PROMPTS[1])
    runner.forward({"d": 3})
    runner.append_tokens("d", [5])
    runner.add_request("p2", PROMPTS[2])
    assert runner.schedule() == {"d": 1, "p1": 7}
    assert runner.schedule(30) == {"d": 1, "p1": 19, "p2": 10}
    with pytest.raises(ValueError, match="4 tokens scheduled, 1 pending"):
        runner.forward({"d": 4})
    with pytest.raises(ValueError, match="0 tokens scheduled, 1 pending"):
        runner.forward({"d": 0, "p1": 1})
    with pytest.raises(ValueError, match="'p2': 0 tokens scheduled, 12 pending"):
        runner.forward({"d": 1, "p1": 1, "p2": 0})
    with pytest.raises(ValueError, match="empty schedule"):
        runner.forward({})
    assert runner.requests["d"].num_computed == 3 and runner.num_free_blocks() == {0: 63}


def test_sampling_is_seeded_per_request(models):
    _, path = models["llama"]
    runner = SpeculativeRunner(path, block_size=4, num_blocks=64)
    prompts = PROMPTS[:3]
    a = runner.generate(prompts, max_new_tokens=10, temperature=1.0, seed=7)
    assert a == runner.generate(prompts, max_new_tokens=10, temperature=1.0, seed=7)
    assert a != runner.generate(prompts, max_new_tokens=10, temperature=1.0, seed=8)
    # A request's tokens do not depend on its batch: prompt 0 alone draws the same tokens.
    assert runner.generate(prompts[:1], max_new_tokens=10, temperature=1.0, seed=7)[0] == a[0]
    assert all(len(x) == 10 or (x and x[-1] in runner.eos_token_ids) for x in a)
    assert runner.generate(prompts, max_new_tokens=0) == [[], [], []]


def test_sampler_follows_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    temperature, n = 0.7, 4000
    gens = [request_generator(0, 0)]
    counts = np.bincount([sample(logits, temperature, gens)[0] for _ in range(n)], minlength=5)
    p = torch.softmax(logits[0] / temperature, -1).numpy()
    sigma = np.sqrt(n * p * (1 - p))
    assert np.all(np.abs(counts - n * p) < 4.5 * sigma), (counts, n * p)
    assert sample(logits, 0.0, gens) == [0]


def test_byte_level_str_prompts(tmp_path):
    import transformers
    config = transformers.LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                      bos_token_id=256, eos_token_id=257, tie_word_embeddings=True)
    torch.manual_seed(0)
    path = save_hf_model(transformers.LlamaForCausalLM(config), tmp_path / "bytes")
    cfg_file = tmp_path / "bytes" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["kvmulti_vocab"] = {"type": "bytes", "bytes": "0-255", "bos": 256, "eos": 257, "pad": 258}
    cfg_file.write_text(json.dumps(cfg))
    runner = SpeculativeRunner(path, block_size=4, num_blocks=32)
    assert runner.encode("hé") == [256, 104, 0xC3, 0xA9]
    out = runner.generate(["def f(x):", "é"], max_new_tokens=5)
    assert out == runner.generate([[256, *b"def f(x):"], [256, 0xC3, 0xA9]], max_new_tokens=5)
    assert runner.decode([104, 105, 257]) == "hi"


def test_speculative_runner_argument_checks(models):
    import kvmulti
    assert kvmulti.SpeculativeRunner is SpeculativeRunner
    _, path = models["llama"]
    for k in (0, 33, 2.5):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            SpeculativeRunner(path, num_speculative_tokens=k)
    runner = SpeculativeRunner(path, block_size=4, num_blocks=16)
    with pytest.raises(TypeError, match="byte-level"):
        runner.generate(["hello"])
    with pytest.raises(TypeError, match="list of prompts"):
        runner.generate("hello")
    assert {b.name for b in runner.target.backends.values()} == {"CPU"} and runner.target.role == "target"


def test_decode_with_joins_on_a_draft_role_runner(models):
    """A draft-role runner (env override for drafts applies) runs the same mixed steps."""
    model, path = models["mistral"]
    runner = ModelRunner(path, role="draft", block_size=2, num_blocks=64)
    got = run_decode(runner, PROMPTS, join_every=3)
    for g, p in zip(got, PROMPTS):
        torch.testing.assert_close(g, hf_logits(model, p), **TOL)
    assert run_full_prefill(runner, PROMPTS)[0].shape == (len(PROMPTS[0]), 320)


def test_bad_prompt_leaves_no_request_behind(models):
    _, path = models["llama"]
    runner = SpeculativeRunner(path, block_size=4, num_blocks=16)
    with pytest.raises(ValueError, match="empty prompt"):
        runner.generate([PROMPTS[1], []], max_new_tokens=3)
    with pytest.raises(ValueError, match="token ids must be in 0..319"):
        runner.generate([[5, 320]], max_new_tokens=3)
    assert not runner.target.requests and runner.target.num_free_blocks() == {0: 16}
    assert runner.generate([PROMPTS[1]], max_new_tokens=3) == SpeculativeRunner(
        path, block_size=4, num_blocks=16).generate([PROMPTS[1]], max_new_tokens=3)


def test_runner_sized_from_a_memory_budget(models):
    _, path = models["gemma3"]
    budget = 3 * 2**20
    runner = ModelRunner(path, block_size={"full": 4, "sliding": 8}, memory_bytes=budget)
    counts = {lay.num_blocks for lay in runner.layouts.values()}
    assert len(counts) == 1 and counts.pop() > 1
    used = runner.kv_cache_config.memory_bytes()
    assert used <= budget and sum(c.numel() * c.element_size() for c in runner.kv_caches.values()) == used
    per_block = sum(g.spec.page_size_bytes * len(g.layer_names) for g in runner.kv_cache_config.groups)
    assert budget - used < per_block


@settings(max_examples=examples(10), deadline=None)
@given(data=st.data())
def test_random_schedules_match_transformers(models, data):
    """Random joins, token budgets (chunked prefill next to decodes), appends, rollbacks and
    finishes: every logit row equals transformers' logits for the tokens it was computed on."""
    family = data.draw(st.sampled_from(["llama", "gemma3"]), label="family")
    model, path = models[family]
    runner = ModelRunner(path, block_size={"full": 4, "sliding": 2}, num_blocks=96, rollback_tokens=3)
    n = data.draw(st.integers(1, 4), label="requests")
    prompts = [data.draw(st.lists(st.integers(3, 319), min_size=1, max_size=14), label=f"prompt{i}") for i in range(n)]
    joins = [data.draw(st.integers(0, 5), label=f"join{i}") for i in range(n)]
    rows: dict[int, list] = {i: [] for i in range(n)}
    high: dict[int, int] = {}                       # longest computed length per request
    checked = 0

    def check(rid):
        nonlocal checked
        ref = hf_logits(model, runner.requests[rid].tokens)
        for pos, row in rows[rid]:
            torch.testing.assert_close(row, ref[pos], **TOL)
        checked += len(rows[rid])
        rows[rid].clear()

    step = 0
    while step < 60 and (runner.requests or step <= max(joins)):
        for i in range(n):
            if joins[i] == step:
                runner.add_request(i, prompts[i])
        step += 1
        if not runner.requests:
            continue
        schedule = runner.schedule(data.draw(st.integers(1, 12), label="budget"))
        start = {rid: runner.requests[rid].num_computed for rid in schedule}
        logits = runner.forward(schedule, num_logits=dict(schedule))
        for (rid, count), chunk in zip(schedule.items(), logits.split(list(schedule.values()))):
            rows[rid] += [(start[rid] + j, chunk[j]) for j in range(count)]
            high[rid] = max(high.get(rid, 0), start[rid] + count)
        for rid in [r for r in runner.requests if runner.requests[r].num_pending == 0]:
            action = data.draw(st.sampled_from(["append", "append", "rollback", "finish"]), label="action")
            tokens = runner.requests[rid].tokens
            if action == "finish" or len(tokens) > 40:
                check(rid)
                runner.remove_request(rid)
            elif action == "rollback" and len(tokens) > 3 and len(tokens) > high[rid] - 3:
                # At most rollback_tokens (3) behind the longest computed length, as in speculative
                # decoding (accepted lengths only grow); further back is refused (tested elsewhere).
                check(rid)
                back = data.draw(st.integers(1, 3), label="back")
                runner.truncate(rid, max(len(tokens) - back, high[rid] - 3))
                runner.append_tokens(rid, data.draw(st.lists(st.integers(3, 319), min_size=1, max_size=4)))
            else:
                runner.append_tokens(rid, [data.draw(st.integers(3, 319), label="token")])
    for rid in list(runner.requests):
        check(rid)
        runner.remove_request(rid)
    assert checked >= sum(len(p) for p in prompts)
    assert runner.num_free_blocks() == {gid: 96 for gid in runner.pools}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_generation_with_chunked_prefill_is_unchanged(models, family):
    """A 5-token step budget splits prompts into chunks that share steps with decodes; greedy
    and sampled tokens are those of an unconstrained run."""
    _, path = models[family]
    kw = dict(block_size={"full": 4, "sliding": 2}, num_blocks=96)
    small, big = (SpeculativeRunner(path, max_num_batched_tokens=b, **kw) for b in (5, 512))
    for temperature in (0.0, 0.9):
        a = small.generate(PROMPTS, max_new_tokens=8, temperature=temperature, seed=3)
        assert a == big.generate(PROMPTS, max_new_tokens=8, temperature=temperature, seed=3)
    assert small.stats.num_target_steps > big.stats.num_target_steps
