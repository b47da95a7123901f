"""The input rules of the public ops, each written once: the table every check of a layer call's
arguments is generated from.

A :class:`Rule` has an id, the ops it applies to (``write``, ``attention``), a condition under which
it applies (``when``), the predicate (``check``: a Python expression, true when the input obeys) and
the error it raises (type and an f-string message naming the offending values; the raised text ends
with ``(rule <id>)``). ``paths`` says who evaluates it:

* ``full``: the full checks (:func:`check_write`, :func:`check_attention`), every rule in table
  order, raising the first one broken;
* ``prepared``: the fast checks of a prepared layer call (:func:`prepared_write_fits`,
  :func:`prepared_attention_fits`), one expression that is false when any of their rules is broken
  (the call then goes through the full checks, which name the rule). They are the full rules minus
  the ones a prepared call's gate implies (exact ``torch.Tensor`` types, the step's own layout
  object), with the layout's sizes read from ``StepMetadata.call_signature``;
* ``native``: the CPU backend's ``PreparedStep`` (cpu/prepared_step.cpp), which refuses a call
  with the rule's id (``last_refusal``). Rules with only ``native`` are what the native calls need
  beyond the API's rules (a contiguous last dimension, a CPU cache): such calls are legal and run
  the Python way.

Names a rule may use: the op's arguments (write: ``key, value, kv_cache, layout, slot_mapping``;
attention: ``query, kv_cache, layout, out, scale, sliding_window, softcap, step, sinks, alibi_slopes``) and, after the
cache rule, ``heads`` (num_kv_heads), ``size`` / ``vsize`` (head_size / head_size_v), ``dtypes``
(the activation dtypes the cache takes), ``device`` (the cache's); step rules ``qheads`` / ``rows``
(the step's num_query_heads / num_actual_tokens). tests/test_input_rules.py walks every rule
through every path that evaluates it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .fp8 import activation_dtypes
from .layout import KVCacheLayout

INDEX_DTYPES = (torch.int32, torch.int64)
FULL, PREPARED, NATIVE = "full", "prepared", "native"
CHECKED = frozenset({FULL, PREPARED})
EVERYWHERE = frozenset({FULL, PREPARED, NATIVE})
NATIVE_ONLY = frozenset({NATIVE})


@dataclass(frozen=True)
class Rule:
    """One input rule (see the module docstring)."""

    id: str
    ops: tuple[str, ...]
    check: str
    message: str
    error: type[Exception] | None = ValueError
    paths: frozenset[str] = CHECKED
    when: str = ""
    #: a statement run before ``check`` on the full path (names the check or the message needs)
    binds: str = ""
    #: on the full path, a statement that decides a failed ``check`` itself: it raises the precise
    #: error, or returns and the input is accepted (a cheaper ``check`` than the full rule)
    explain: str = ""

    @property
    def condition(self) -> str:
        return f"(not ({self.when}) or ({self.check}))" if self.when else f"({self.check})"


W, A, WA = ("write",), ("attention",), ("write", "attention")
#: full-path names after the cache rule
_DERIVED = ("heads, size, vsize, dtypes, device = layout.num_kv_heads, layout.head_size, layout.value_size, "
            "activation_dtypes(layout.dtype), kv_cache.device")


def _rows(name: str, ops: tuple[str, ...], heads_id: str, heads_check: str, heads_message: str, size: str,
          when: str = "", heads_paths: frozenset[str] = EVERYWHERE) -> list[Rule]:
    """The rules of a [tokens, heads, size] argument of the cache's dtype and device."""
    return [
        Rule(f"{name}.type", ops, f"isinstance({name}, torch.Tensor)",
             f"{name} must be a torch.Tensor, got {{type({name}).__name__}}", TypeError, frozenset({FULL}), when),
        Rule(f"{name}.dtype", ops, f"{name}.dtype in dtypes",
             f"{name} has dtype {{{name}.dtype}}, the cache holds {{layout.dtype}}", TypeError, EVERYWHERE, when),
        Rule(f"{name}.dim", ops, f"{name}.dim() == 3",
             f"{name} must be 3-D [num_tokens, num_heads, head_size], got shape {{tuple({name}.shape)}}",
             ValueError, EVERYWHERE, when),
        Rule(heads_id, ops, heads_check, heads_message, ValueError, heads_paths, when),
        Rule(f"{name}.head_size", ops, f"{name}.shape[2] == {size}",
             f"{name} has head size {{{name}.shape[2]}}, the layout expects {{{size}}}", ValueError, EVERYWHERE, when),
        Rule(f"{name}.device", ops, f"{name}.device == device",
             f"{name} is on {{{name}.device}} but the kv_cache is on {{device}}", ValueError, EVERYWHERE, when),
        Rule(f"{name}.contiguous", ops, f"{name}.shape[2] <= 1 or {name}.stride(2) == 1",
             f"{name}'s last dimension is strided", None, NATIVE_ONLY, when),
    ]


def _per_head(rule: str, name: str, meaning: str, flag: str) -> list[Rule]:
    """The rules of an optional fp32 [num_query_heads] attention argument on the cache's device, which
    a call with a step passes only when the step was prepared with it (``step.<flag>``)."""
    when = f"{name} is not None"
    return [
        Rule(f"{rule}.type", A, f"isinstance({name}, torch.Tensor)",
             f"{name} must be a torch.Tensor, got {{type({name}).__name__}}", TypeError, frozenset({FULL}), when),
        Rule(f"{rule}.dtype", A, f"{name}.dtype == torch.float32",
             f"{name} has dtype {{{name}.dtype}}, must be torch.float32", TypeError, EVERYWHERE, when),
        Rule(f"{rule}.shape", A, f"{name}.shape == (query.shape[1],)",
             f"{name} has shape {{tuple({name}.shape)}}, expected ({{query.shape[1]}},) ({meaning})",
             ValueError, EVERYWHERE, when),
        Rule(f"{rule}.device", A, f"{name}.device == device",
             f"{name} is on {{{name}.device}} but the kv_cache is on {{device}}", ValueError, EVERYWHERE, when),
        Rule(f"{rule}.contiguous", A, f"{name}.is_contiguous()", f"{name} is strided", None, NATIVE_ONLY, when),
        Rule(f"step.{flag}", A, f"{name} is None or step.{flag}",
             f"the call passes {name} but the metadata was prepared without them (prepare_step(..., {name}=...))",
             ValueError, CHECKED, "step is not None"),
    ]


RULES: tuple[Rule | str, ...] = (
    Rule("layout.type", WA, "isinstance(layout, KVCacheLayout)",
         "layout must be a kvmulti.KVCacheLayout, got {type(layout).__name__}", TypeError, frozenset({FULL})),
    Rule("cache.layout", WA, "isinstance(kv_cache, torch.Tensor) "
         "and (kv_cache.dtype, kv_cache.shape, kv_cache.stride()) == signature",
         "kv_cache is not a cache of the layout", ValueError, EVERYWHERE,
         binds="signature = layout._exact_signature", explain="layout.validate(kv_cache)"),
    Rule("cache.device", WA, "kv_cache.device.type == 'cpu'", "the native step calls serve CPU caches", None,
         NATIVE_ONLY),
    _DERIVED,
    # write: key, value, slots
    *_rows("key", W, "key.heads", "key.shape[1] == heads",
           "key has {key.shape[1]} heads, the layout has num_kv_heads={heads}", "size"),
    Rule("value.missing", W, "value is not None",
         "value must be a tensor (only a latent cache with head_size_v=0 takes value=None)", TypeError,
         frozenset({FULL}), "not layout.is_latent"),
    *_rows("value", W, "value.heads", "value.shape[1] == heads",
           "value has {value.shape[1]} heads, the layout has num_kv_heads={heads}", "vsize", "not layout.is_latent"),
    Rule("value.tokens", W, "value.shape[0] == key.shape[0]",
         "value has {value.shape[0]} tokens but key has {key.shape[0]}", ValueError, EVERYWHERE,
         "not layout.is_latent"),
    Rule("slots.type", W, "isinstance(slot_mapping, torch.Tensor)",
         "slot_mapping must be a torch.Tensor, got {type(slot_mapping).__name__}", TypeError, frozenset({FULL})),
    Rule("slots.dtype", W, "slot_mapping.dtype in INDEX_DTYPES",
         "slot_mapping must be an integer tensor of torch.int32, torch.int64, got {slot_mapping.dtype}", TypeError,
         EVERYWHERE),
    Rule("slots.dim", W, "slot_mapping.dim() == 1", "slot_mapping must be 1-D, got shape {tuple(slot_mapping.shape)}",
         ValueError, EVERYWHERE),
    Rule("slots.device", W, "slot_mapping.device == device",
         "slot_mapping is on {slot_mapping.device} but the kv_cache is on {device}", ValueError, EVERYWHERE),
    Rule("slots.tokens", W, "slot_mapping.shape[0] == key.shape[0]",
         "slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens", ValueError, EVERYWHERE),
    Rule("slots.contiguous", W, "slot_mapping.is_contiguous()", "slot_mapping is strided", None, NATIVE_ONLY),
    # attention: query, step, scalars, out
    *_rows("query", A, "query.heads", "query.shape[1] % heads == 0",
           "query has {query.shape[1]} heads, not a multiple of num_kv_heads={heads}", "size",
           heads_paths=frozenset({FULL})),     # prepared: step.query_heads (a multiple since the step's prepared)
    Rule("step.query_heads", A, "query.shape[1] == qheads",
         "query has {query.shape[1]} heads, metadata was prepared for {qheads}", ValueError, EVERYWHERE,
         "step is not None", binds="qheads, rows = step.num_query_heads, step.common.num_actual_tokens"),
    Rule("step.query_rows", A, "query.shape[0] >= rows",
         "query has {query.shape[0]} tokens, metadata.num_actual_tokens is {rows}", ValueError, EVERYWHERE,
         "step is not None"),
    # per query head fp32 tensors
    *_per_head("sinks", "sinks", "one logit per query head", "sinks"),
    *_per_head("alibi", "alibi_slopes", "one slope per query head", "alibi"),
    Rule("scale.type", A, "not isinstance(scale, bool) and isinstance(scale, (int, float))",
         "scale must be a float or None, got {type(scale).__name__}", TypeError, CHECKED, "scale is not None"),
    Rule("scale.finite", A, "math.isfinite(scale)", "scale must be finite, got {scale}", ValueError, EVERYWHERE,
         "scale is not None"),
    Rule("window", ("attention", "step"), "not isinstance(sliding_window, bool) and isinstance(sliding_window, int) "
         "and sliding_window >= 1", "sliding_window must be None or an int >= 1, got {sliding_window!r}",
         ValueError, frozenset({FULL}), "sliding_window is not None"),
    Rule("softcap", A, "not isinstance(softcap, bool) and isinstance(softcap, (int, float)) and softcap >= 0 "
         "and not math.isinf(softcap)", "softcap must be None or a finite float >= 0 (0 = off), got {softcap!r}",
         ValueError, EVERYWHERE, "softcap is not None"),
    Rule("out.type", A, "isinstance(out, torch.Tensor)", "out must be a torch.Tensor, got {type(out).__name__}",
         TypeError, frozenset({FULL}), "out is not None"),
    Rule("out.shape", A, "out.shape == (query.shape[0], query.shape[1], vsize)",
         "out has shape {tuple(out.shape)}, expected {(query.shape[0], query.shape[1], vsize)} "
         "(query rows, query heads, head_size_v)", ValueError, EVERYWHERE, "out is not None"),
    Rule("out.dtype", A, "out.dtype == query.dtype", "out has dtype {out.dtype}, the query {query.dtype}", TypeError,
         EVERYWHERE, "out is not None"),
    Rule("out.device", A, "out.device == query.device", "out is on {out.device} but the kv_cache is on {query.device}",
         ValueError, EVERYWHERE, "out is not None"),
    Rule("out.contiguous", A, "out.shape[2] <= 1 or out.stride(2) == 1", "out's last dimension is strided", None,
         NATIVE_ONLY, "out is not None"),
    # slot values (CPU tensors, or KVMULTI_VALIDATE=1), once per slot tensor and step when prepared
    Rule("slots.range", ("slots",), "low >= -1 and high < layout.num_slots",
         "slot_mapping holds slot {low if low < -1 else high}, outside -1 (skip) .. {layout.num_slots - 1} "
         "(num_blocks {layout.num_blocks} x block_size {layout.block_size})", ValueError, EVERYWHERE,
         binds="low, high = map(int, torch.aminmax(slot_mapping))"),
    # ALiBi slope values (CPU tensors, or KVMULTI_VALIDATE=1), once per slopes tensor and step when prepared
    Rule("alibi.finite", ("alibi",), "bool(torch.isfinite(alibi_slopes).all())", "alibi_slopes must be finite",
         ValueError, EVERYWHERE),
)

#: every rule by id
BY_ID: dict[str, Rule] = {r.id: r for r in RULES if isinstance(r, Rule)}


def rules(op: str | None = None, path: str | None = None) -> list[Rule]:
    """The table's rules of ``op`` evaluated on ``path`` (None: any), in table order."""
    return [r for r in BY_ID.values() if (op is None or op in r.ops) and (path is None or path in r.paths)]


def _fail(rule: Rule, message: str) -> Exception:
    return rule.error(f"{message} (rule {rule.id})")


def _explained(rule: Rule, error: Exception) -> Exception:
    return type(error)(f"{error} (rule {rule.id})")


def _full_source(name: str, op: str, params: str) -> str:
    """A function raising the first broken rule of ``op``, statements in table order (consecutive
    rules of one ``when`` under one ``if``)."""
    lines, current = [f"def {name}({params}):"], ""
    for i, entry in enumerate(RULES):
        if isinstance(entry, str):          # the cache rule's derived names: ops over a cache only
            if op in WA:
                lines.append(f"    {entry}")
            current = ""
            continue
        if op not in entry.ops or FULL not in entry.paths:
            continue
        if entry.when and entry.when != current:
            lines.append(f"    if {entry.when}:")
        current = entry.when
        indent = "        " if entry.when else "    "
        if entry.binds:
            lines.append(f"{indent}{entry.binds}")
        lines.append(f"{indent}if not ({entry.check}):")
        if entry.explain:
            lines += [f"{indent}    try:", f"{indent}        {entry.explain}",
                      f"{indent}    except (TypeError, ValueError) as e:",
                      f"{indent}        raise _explained(_R[{i}], e) from None"]
        else:
            lines.append(f"{indent}    raise _fail(_R[{i}], f{entry.message!r})")
    return "\n".join(lines) + "\n"


def _prepared_source(name: str, op: str, params: str) -> str:
    """One expression: every ``prepared`` rule of ``op`` holds (sizes from the step's signature)."""
    terms = [r.condition for r in rules(op, PREPARED)]
    return (f"def {name}({params}):\n"
            "    signature, heads, size, vsize, qheads, rows, dtypes, fast = step.call_signature\n"
            "    device, layout = kv_cache.device, step.layout\n"
            f"    return fast and {' and '.join(terms)}\n")


def _compile(source: str, name: str):
    namespace = {"torch": torch, "math": math, "KVCacheLayout": KVCacheLayout, "INDEX_DTYPES": INDEX_DTYPES,
                 "activation_dtypes": activation_dtypes, "_R": RULES, "_fail": _fail, "_explained": _explained}
    exec(compile(source, f"<kvmulti.input_rules:{name}>", "exec"), namespace)
    return namespace[name]


_WRITE = "key, value, kv_cache, layout, slot_mapping"
_ATTENTION = "query, kv_cache, layout, out, scale, sliding_window, softcap, step, sinks=None, alibi_slopes=None"

#: ``check_write(key, value, kv_cache, layout, slot_mapping)``: raises the first broken write rule
check_write = _compile(_full_source("check_write", "write", _WRITE), "check_write")
#: ``check_attention(query, kv_cache, layout, out, scale, sliding_window, softcap, step, sinks=None,
#: alibi_slopes=None)``: raises
#: the first broken attention rule (step rules only with a step)
check_attention = _compile(_full_source("check_attention", "attention", _ATTENTION), "check_attention")
#: ``check_window(sliding_window)``
check_window = _compile(_full_source("check_window", "step", "sliding_window"), "check_window")
#: ``check_slot_range(slot_mapping, layout)``: a non-empty slot tensor's values
check_slot_range = _compile(_full_source("check_slot_range", "slots", "slot_mapping, layout"), "check_slot_range")
#: ``check_alibi_values(alibi_slopes)``: the slopes' values
check_alibi_values = _compile(_full_source("check_alibi_values", "alibi", "alibi_slopes"), "check_alibi_values")
#: ``prepared_write_fits(key, value, kv_cache, slot_mapping, step) -> bool``
prepared_write_fits = _compile(_prepared_source("prepared_write_fits", "write",
                                                "key, value, kv_cache, slot_mapping, step"), "prepared_write_fits")
#: ``prepared_attention_fits(query, kv_cache, out, scale, softcap, step, sinks=None, alibi_slopes=None) -> bool``
prepared_attention_fits = _compile(_prepared_source("prepared_attention_fits", "attention",
                                                    "query, kv_cache, out, scale, softcap, step, sinks=None, "
                                                    "alibi_slopes=None"),
                                   "prepared_attention_fits")
