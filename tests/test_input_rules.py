"""Every rule of the input-rule table (kvmulti/input_rules.py), walked through every path that
evaluates it: for each rule an input that breaks exactly that rule is rejected by the full checks
(the public op without a prepared step, or with one but a backend named), by the prepared fast
checks (``prepared_*_fits`` false, and the public op with a step raising), and by the CPU backend's
native ``PreparedStep`` (refused with the rule's id), each where the rule's ``paths`` say so. The
error is the rule's type and its text ends with ``(rule <id>)``."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import kvmulti
from kvmulti import input_rules, reference
from kvmulti.input_rules import BY_ID, FULL, NATIVE, NATIVE_ONLY, PREPARED
from availability import unavailable

HQ, HKV, HEAD = 4, 2, 16


def base_args() -> dict:
    gen = torch.Generator().manual_seed(0)
    layout = kvmulti.KVCacheLayout(12, 4, HKV, HEAD, dtype=torch.float32)
    cache = layout.allocate()
    table = torch.randperm(12, generator=gen).to(torch.int32)[:9].view(3, 3)
    md = kvmulti.CommonAttentionMetadata.from_lens([3, 1, 1], [7, 9, 4], table, 4)
    t = md.num_actual_tokens
    return dict(layout=layout, kv_cache=cache, md=md, query=torch.randn(t, HQ, HEAD, generator=gen),
                key=torch.randn(t, HKV, HEAD, generator=gen), value=torch.randn(t, HKV, HEAD, generator=gen),
                slot_mapping=md.slot_mapping, out=None, scale=None, sliding_window=None, softcap=None, sinks=None,
                alibi_slopes=None)


def strided(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a last dimension of stride 2 (a legal input the native calls do not take)."""
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)[..., ::2]
    return wide.copy_(x)


def _set(**changes):
    return lambda a: a.update({k: f(a) for k, f in changes.items()})


#: rule id -> how to break exactly that rule in :func:`base_args`' input
VIOLATIONS = {
    "layout.type": _set(layout=lambda a: "a layout"),
    "cache.layout": _set(kv_cache=lambda a: a["kv_cache"][:6]),
    "cache.device": _set(kv_cache=lambda a: a["kv_cache"].to("meta"), query=lambda a: a["query"].to("meta"),
                         key=lambda a: a["key"].to("meta"), value=lambda a: a["value"].to("meta"),
                         slot_mapping=lambda a: a["slot_mapping"].to("meta")),
    "slots.type": _set(slot_mapping=lambda a: a["slot_mapping"].tolist()),
    "slots.dtype": _set(slot_mapping=lambda a: a["slot_mapping"].float()),
    "slots.dim": _set(slot_mapping=lambda a: a["slot_mapping"][:, None]),
    "slots.device": _set(slot_mapping=lambda a: a["slot_mapping"].to("meta")),
    "slots.tokens": _set(slot_mapping=lambda a: a["slot_mapping"][:-1]),
    "slots.contiguous": _set(slot_mapping=lambda a: torch.stack([a["slot_mapping"]] * 2, 1)[:, 0]),
    "slots.range": _set(slot_mapping=lambda a: torch.tensor([0, 1, 48, 2, 3])),
    "value.missing": _set(value=lambda a: None),
    "value.tokens": _set(value=lambda a: a["value"][:-1]),
    "query.heads": _set(query=lambda a: a["query"][:, :3]),
    "step.query_heads": _set(query=lambda a: a["query"][:, :2]),
    "step.query_rows": _set(query=lambda a: a["query"][:-1]),
    "scale.type": _set(scale=lambda a: "0.5"),
    "scale.finite": _set(scale=lambda a: float("nan")),
    "window": _set(sliding_window=lambda a: 0),
    "softcap": _set(softcap=lambda a: -1.0),
    "out.type": _set(out=lambda a: "a buffer"),
    "out.shape": _set(out=lambda a: torch.zeros(a["query"].shape[0] - 1, HQ, HEAD)),
    "out.dtype": _set(out=lambda a: torch.zeros(a["query"].shape[0], HQ, HEAD, dtype=torch.float64)),
    "out.device": _set(out=lambda a: torch.zeros(a["query"].shape[0], HQ, HEAD, device="meta")),
    "out.contiguous": _set(out=lambda a: strided(torch.zeros(a["query"].shape[0], HQ, HEAD))),
    "sinks.type": _set(sinks=lambda a: [0.0] * HQ),
    "sinks.dtype": _set(sinks=lambda a: torch.zeros(HQ, dtype=torch.bfloat16)),
    "sinks.shape": _set(sinks=lambda a: torch.zeros(HQ - 1)),
    "sinks.device": _set(sinks=lambda a: torch.zeros(HQ, device="meta")),
    "sinks.contiguous": _set(sinks=lambda a: torch.zeros(2 * HQ)[::2]),
    "step.sinks": _set(sinks=lambda a: torch.zeros(HQ)),
    "alibi.type": _set(alibi_slopes=lambda a: [0.5] * HQ),
    "alibi.dtype": _set(alibi_slopes=lambda a: torch.ones(HQ, dtype=torch.float64)),
    "alibi.shape": _set(alibi_slopes=lambda a: torch.ones(HQ + 1)),
    "alibi.device": _set(alibi_slopes=lambda a: torch.ones(HQ, device="meta")),
    "alibi.contiguous": _set(alibi_slopes=lambda a: torch.ones(2 * HQ)[::2]),
    "alibi.finite": _set(alibi_slopes=lambda a: torch.tensor([float("nan")] + [0.5] * (HQ - 1))),
    "step.alibi": _set(alibi_slopes=lambda a: torch.ones(HQ)),
}
for _name in ("key", "value", "query"):
    VIOLATIONS |= {
        f"{_name}.type": _set(**{_name: lambda a, n=_name: a[n].numpy()}),
        f"{_name}.dtype": _set(**{_name: lambda a, n=_name: a[n].double()}),
        f"{_name}.dim": _set(**{_name: lambda a, n=_name: a[n].flatten(1)}),
        f"{_name}.head_size": _set(**{_name: lambda a, n=_name: a[n][..., :8]}),
        f"{_name}.device": _set(**{_name: lambda a, n=_name: a[n].to("meta")}),
        f"{_name}.contiguous": _set(**{_name: lambda a, n=_name: strided(a[n])}),
    }
VIOLATIONS |= {f"{n}.heads": _set(**{n: lambda a, n=n: a[n][:, :1]}) for n in ("key", "value")}


def broken(rule_id: str) -> tuple[dict, dict]:
    """(the unbroken input, a copy with the rule broken)."""
    base = base_args()
    args = dict(base)
    VIOLATIONS[rule_id](args)
    return base, args


def steps(base: dict, sinks: bool = False, alibi: bool = False):
    """(the step with its native calls, the same step without them) for the unbroken input, prepared
    for layers with sinks / ALiBi slopes as asked."""
    step = kvmulti.prepare_step(base["md"], base["layout"], HQ, backend="CPU", sinks=sinks, alibi_slopes=alibi)
    return step, dataclasses.replace(step, calls=None)


def steps_for(rule_id: str, base: dict, args: dict):
    """:func:`steps` prepared with the per-head arguments ``args`` passes, unless ``rule_id`` is the
    rule that a step prepared without them is broken by."""
    return steps(base, sinks=args["sinks"] is not None and rule_id != "step.sinks",
                 alibi=args["alibi_slopes"] is not None and rule_id != "step.alibi")


def write(args: dict, step=None, backend=None) -> None:
    kvmulti.write_kv(args["key"], args["value"], args["kv_cache"], args["layout"], args["slot_mapping"],
                     step=step, backend=backend)


def attend(args: dict, metadata, backend=None) -> None:
    kvmulti.paged_attention(args["query"], args["kv_cache"], args["layout"], metadata, scale=args["scale"],
                            sliding_window=args["sliding_window"], softcap=args["softcap"], out=args["out"],
                            backend=backend, sinks=args["sinks"], alibi_slopes=args["alibi_slopes"])


def op_of(rule) -> str:
    """The op a rule's input goes to (the value rules: slots to a write, ALiBi slopes to attention)."""
    return "write" if "write" in rule.ops or rule.ops == ("slots",) else "attention"


def value_rule(rule) -> bool:
    """A rule on tensor values, checked once per step and tensor, not by ``prepared_*_fits``."""
    return rule.ops in (("slots",), ("alibi",))


def native_attend(step, args: dict) -> bool:
    out = args["out"] if args["out"] is not None else torch.zeros(args["query"].shape[0], HQ, HEAD)
    scale = args["scale"] if args["scale"] is not None else 0.25
    return step.calls.attend(args["query"], args["kv_cache"], out, scale, args["softcap"] or 0.0, args["sinks"],
                             args["alibi_slopes"])


def rejects(rule, call) -> None:
    with pytest.raises(rule.error, match=re.escape(f"(rule {rule.id})")):
        call()


def test_every_rule_has_a_violation_and_unique_id():
    ids = [r.id for r in input_rules.RULES if isinstance(r, input_rules.Rule)]
    assert len(ids) == len(set(ids))
    assert set(VIOLATIONS) == set(ids)


def test_the_unbroken_input_passes_every_path():
    args = base_args()
    step, py = steps(args)
    assert input_rules.prepared_write_fits(args["key"], args["value"], args["kv_cache"], args["slot_mapping"], py)
    assert input_rules.prepared_attention_fits(args["query"], args["kv_cache"], None, None, None, py)
    write(args), write(args, step), write(args, py)
    attend(args, args["md"]), attend(args, step), attend(args, py)
    if step.calls is not None:
        assert step.calls.write(args["key"], args["value"], args["kv_cache"], args["slot_mapping"])
        assert step.calls.last_refusal == ""


@pytest.mark.parametrize("per_head", ["sinks", "alibi_slopes", "both"])
def test_sinks_and_alibi_take_every_path_with_one_result(per_head):
    """A layer call with sinks and / or ALiBi slopes runs the native step calls, the prepared Python
    path and the full path, all with the oracle's output."""
    args = base_args()
    gen = torch.Generator().manual_seed(1)
    args["kv_cache"].copy_(torch.randn(args["kv_cache"].shape, generator=gen))
    if per_head in ("sinks", "both"):
        args["sinks"] = torch.randn(HQ, generator=gen)
    if per_head in ("alibi_slopes", "both"):
        args["alibi_slopes"] = torch.rand(HQ, generator=gen)
    step, py = steps(args, sinks=args["sinks"] is not None, alibi=args["alibi_slopes"] is not None)
    expected = reference.paged_attention(
        args["query"], args["kv_cache"], args["layout"], args["md"], sinks=args["sinks"],
        alibi_slopes=args["alibi_slopes"])
    results = {}
    for name, metadata in (("full", args["md"]), ("prepared", py), ("native", step)):
        args["out"] = torch.full((args["query"].shape[0], HQ, HEAD), float("nan"))
        attend(args, metadata)
        results[name] = args["out"]
    for name, got in results.items():
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5, msg=name)
    require_native_calls(step)
    assert native_attend(step, args) and step.calls.last_refusal == ""


@pytest.mark.parametrize("rule_id", sorted(BY_ID))
def test_rule_is_enforced_by_every_path_that_evaluates_it(rule_id):
    rule, (base, args) = BY_ID[rule_id], broken(rule_id)
    op = op_of(rule)
    step, py = steps_for(rule_id, base, args)
    before = args["kv_cache"].clone() if args["kv_cache"].device.type == "cpu" else None
    if rule.paths == NATIVE_ONLY:              # a legal input: the Python rules accept it
        if op == "write":
            input_rules.check_write(args["key"], args["value"], args["kv_cache"], args["layout"], args["slot_mapping"])
            assert input_rules.prepared_write_fits(args["key"], args["value"], args["kv_cache"],
                                                   args["slot_mapping"], py)
        else:
            input_rules.check_attention(args["query"], args["kv_cache"], args["layout"], args["out"], None, None,
                                        None, py, args["sinks"], args["alibi_slopes"])
            assert input_rules.prepared_attention_fits(args["query"], args["kv_cache"], args["out"], None, None, py,
                                                       args["sinks"], args["alibi_slopes"])
    if FULL in rule.paths:
        if rule.ops == ("attention", "step"):
            rejects(rule, lambda: kvmulti.prepare_step(args["md"], args["layout"], HQ, sliding_window=0))
        if op == "write":
            rejects(rule, lambda: write(args))
            rejects(rule, lambda: write(args, step, backend="CPU"))
        elif rule.when == "step is not None":          # the full checks of a call with a step
            rejects(rule, lambda: attend(args, step, backend="CPU"))
        else:
            rejects(rule, lambda: attend(args, args["md"]))
            rejects(rule, lambda: attend(args, step, backend="CPU"))
    if PREPARED in rule.paths:
        if op == "write" and not value_rule(rule):
            assert not input_rules.prepared_write_fits(args["key"], args["value"], args["kv_cache"],
                                                       args["slot_mapping"], py)
        elif op == "attention" and not value_rule(rule):
            assert not input_rules.prepared_attention_fits(args["query"], args["kv_cache"], args["out"],
                                                           args["scale"], args["softcap"], py, args["sinks"],
                                                           args["alibi_slopes"])
        for prepared in (py, step):               # the fast path refuses, the full checks name the rule
            rejects(rule, lambda: write(args, prepared) if op == "write" else attend(args, prepared))
    if before is not None:
        assert torch.equal(args["kv_cache"], before)
    if NATIVE in rule.paths:
        require_native_calls(step)
        if op == "write":
            assert step.calls.write(args["key"], args["value"], args["kv_cache"], args["slot_mapping"]) is False
        else:
            assert native_attend(step, args) is False
        assert step.calls.last_refusal == rule.id


def require_native_calls(step) -> None:
    """The step's C++ calls exist; without them the native path is a skip here and a failure in CI."""
    if step.calls is not None:
        return
    unavailable(f"the native CPU kernel is not built here: {kvmulti.backends.cpu.native.status()[1]}")


def test_the_native_calls_refuse_with_the_tables_ids_only():
    step, _ = steps(base_args())
    require_native_calls(step)
    assert set(type(step.calls).rule_ids) == {r.id for r in BY_ID.values() if NATIVE in r.paths}
