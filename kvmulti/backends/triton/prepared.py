"""The TRITON backend's step calls (``StepMetadata.calls``): a layer call's checks and launches with
everything but the layer's tensors resolved once per step.

A group's layers call attention with tensors of one form: the same shapes, strides and dtypes,
scale and softcap, only other memory. The first call of a form is checked by every prepared input
rule (:func:`kvmulti.validation.prepared_attention_tensors_fit`) and builds the launches
(:func:`launch.attention_launches` / :func:`launch.write_kv_launches`: plan, argument dict, grid)
once; a later call of that form costs a key of its shapes and strides (which imply the rules'
shapes and dtypes), a device check, and the launch with its own tensors in the argument slots.
A call of another form is checked in full and gets launches of its own; one that breaks a rule is
refused (False) untouched, and the public op then raises the rule's error.

A launch (:class:`PreparedLaunch`) keeps the argument list in the kernel's parameter order. Its
first run goes through ``JITFunction.run`` (which binds, specialises and compiles); a compiled
kernel (not under the interpreter) is then launched directly through ``CompiledKernel[grid]``, with
no binding per call, as long as the layer's tensors share the alignment it was specialised for
(16 bytes, what Triton specialises pointers on); a call whose tensors do not goes through
``JITFunction.run`` again.

The split-KV workspace is allocated once with the step (:func:`launch.split_workspace`) and shared
by its layers, whose launches run one after another on the stream.

fp8 caches: the layer's ``k_scale`` / ``v_scale`` are launch arguments, never copied: a tensor
(fp32 ``[]``, read with head stride 0, or ``[num_kv_heads]`` with its own stride) goes to the
kernels as it is, its form part of the call's form (checked once per form by kvmulti/fp8.py's
``check_scale_tensor``), its values checked once per step (CPU tensors only:
``check_scale_values``); a float (checked the first time the step sees its value) and None (1.0)
go as a constant fp32 ``[]`` tensor the calls keep, so its address is valid as long as the step.
The kernels address the cache through a uint8 view made once per cache and step. A per-layer call
then allocates nothing and reads nothing back, as without fp8.
"""

from __future__ import annotations

import weakref

import torch

from ...capture import CaptureBucket
from ...fp8 import FP8_DTYPES, check_scale_float, check_scale_tensor, check_scale_values, constant_scale
from ...triton_kernels.fp8 import raw_cache
from ...validation import (check_alibi_values_once, check_scale_values_once, check_slot_values_once,
                           prepared_attention_tensors_fit, prepared_write_tensors_fit)
from ..base import StepMetadata
from . import launch as kernels
from .launch import KERNELS, Launch


def _aligned(tensors: tuple) -> bool:
    """Every tensor's address is a multiple of 16 bytes (Triton's pointer specialisation)."""
    bits = 0
    for tensor in tensors:
        bits |= tensor.data_ptr()
    return not bits & 15


class PreparedLaunch:
    """One kernel launch with every argument fixed except the layer's tensors (``layer_args``)."""

    __slots__ = ("fn", "grid", "values", "positions", "num_warps", "num_stages", "runner")

    def __init__(self, launch: Launch, layer_args: tuple[str, ...]):
        fn = KERNELS[launch.kernel]
        names = list(fn.arg_names)
        if set(names) != set(launch.args):
            raise ValueError(f"launch of {launch.kernel} names {sorted(set(launch.args) ^ set(names))} "
                             "unlike the kernel's parameters")
        self.fn, self.grid = fn, tuple(launch.grid) + (1,) * (3 - len(launch.grid))   # the runner takes 3 dims
        self.num_warps, self.num_stages = launch.num_warps, launch.num_stages
        self.values = [launch.args[name] for name in names]
        self.positions = tuple(names.index(name) for name in layer_args)
        self.runner = None

    def __call__(self, tensors: tuple) -> None:
        """Launch with ``tensors`` in the ``layer_args`` slots (same order)."""
        values = self.values.copy()
        for position, tensor in zip(self.positions, tensors):
            values[position] = tensor
        if self.runner is not None and _aligned(tensors):
            self.runner(*values)
            return
        kernel = self.fn.run(*values, grid=self.grid, warmup=False, num_warps=self.num_warps,
                             num_stages=self.num_stages)
        if self.runner is None and hasattr(kernel, "packed_metadata") and _aligned(tensors):
            self.runner = kernel[self.grid]          # a CompiledKernel: later calls skip the binder


#: the kernels' per-layer arguments (the rest are the step's; sinks and ALiBi only where the layer has them,
#: the scales where the layer passes its own)
ATTENTION_LAYER_ARGS = {"unified_attention": ("q_ptr", "kv_ptr", "out_ptr"), "reduce_partitions": ("out_ptr",)}
WRITE_LAYER_ARGS = ("key_ptr", "value_ptr", "kv_ptr")
SCALE_LAYER_ARGS = ("k_scale_ptr", "v_scale_ptr")


def _scale_form(scale: float | torch.Tensor | None) -> object:
    """A scale argument's part of a call form: ``float`` for any Python float (its value is a
    per-call argument, not part of the form), else the tensor's shape, strides, dtype and device."""
    if type(scale) is not torch.Tensor:
        return type(scale)
    return (scale.shape, scale.stride(), scale.dtype, scale.device)


class _AttentionForm:
    """The launches of one form of attention call (the split path's reduction: ``reduce``), the
    rows its calls zero, and whether the layer's scales are launch arguments (``scaled``)."""

    __slots__ = ("main", "reduce", "zero_from", "scaled")

    def __init__(self, main: PreparedLaunch | None, reduce: PreparedLaunch | None, zero_from: int | None,
                 scaled: bool):
        self.main, self.reduce, self.zero_from, self.scaled = main, reduce, zero_from, scaled


class _WriteForm:
    """The launches of one form of write, for the slot tensor whose values were checked."""

    __slots__ = ("slot_mapping", "launches", "scaled")

    def __init__(self, slot_mapping: torch.Tensor, launches: list[PreparedLaunch], scaled: bool):
        self.slot_mapping, self.launches, self.scaled = slot_mapping, launches, scaled


class TritonStepCalls:
    """``StepMetadata.calls`` of a TRITON step (the contract of :meth:`Backend.prepared_calls`)."""

    def __init__(self, step: StepMetadata, device: torch.device):
        # the step holds these calls: a weak reference back keeps the pair out of a reference cycle,
        # so a step and its workspace are freed as soon as the engine drops the step
        self._step, self.device = weakref.ref(step), device
        self.layout, self.common, self.plan = step.layout, step.common, step.plan
        self.sliding_window = step.sliding_window
        capture: CaptureBucket | None = step.capture
        self.capture = capture
        common, plan = self.common, self.plan
        #: query rows the kernels cover, requests they walk, and the lengths their plan is for
        if capture is None:
            self.rows, self.num_reqs = common.num_actual_tokens, common.num_reqs
            self.max_query_len, self.max_seq_len = common.max_query_len, common.max_seq_len
        else:
            self.rows, self.num_reqs = capture.max_num_tokens, capture.max_num_seqs
            self.max_query_len, self.max_seq_len = capture.max_query_len, capture.max_seq_len
        self.workspace = (kernels.split_workspace(plan, self.rows, step.num_query_heads, device)
                          if plan.split and self.rows > 0 else None)
        self.fp8 = self.layout.dtype in FP8_DTYPES
        self._attention: dict[tuple, _AttentionForm] = {}
        self._writes: dict[tuple, _WriteForm] = {}
        #: the fp32 [] tensors of the float scales (and None's 1.0) these calls launched with: held
        #: here, so their addresses stay valid as long as the step (a captured graph reads them)
        self._constants: dict[float, torch.Tensor] = {}
        #: fp8 caches' uint8 views (what the kernels address), made once per cache and step
        self._bytes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _cache_bytes(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The tensor the kernels address for ``kv_cache``: an fp8 cache's uint8 view (kept per
        cache, so a layer call makes no view of its own), any other cache as it is."""
        if not self.fp8:
            return kv_cache
        entry = self._bytes.get(id(kv_cache))
        if entry is None or entry[0] is not kv_cache:
            entry = self._bytes[id(kv_cache)] = (kv_cache, raw_cache(kv_cache))
        return entry[1]

    # ------------------------------------------------------------------ scales
    def _constant(self, scale: float | None, name: str) -> torch.Tensor:
        """A float scale (None: 1.0) as the kernels' fp32 [] tensor; checked when first seen."""
        value = 1.0 if scale is None else scale
        tensor = self._constants.get(value) if type(value) is float else None   # never a bool's 1.0
        if tensor is None:
            value = check_scale_float(value, name)
            tensor = self._constants[value] = constant_scale(value, self.device)
        return tensor

    def _layer_scales(self, step: StepMetadata | None, k_scale: float | torch.Tensor | None,
                      v_scale: float | torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernels' scale tensors of a layer call: a tensor as it is (its values checked once
        per step, CPU tensors only; every call once the step is gone), a float or None as
        :meth:`_constant`."""
        scales = []
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if type(scale) is torch.Tensor:
                if step is None:
                    check_scale_values(scale, name)
                else:
                    check_scale_values_once(step, scale, name)
                scales.append(scale)
            else:
                scales.append(self._constant(scale, name))
        return scales[0], scales[1]

    def _form_scales(self, step: StepMetadata, k_scale: float | torch.Tensor | None,
                     v_scale: float | torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_layer_scales` for the first call of a form, each tensor's form checked first
        (kvmulti/fp8.py's rules, with the public op's errors)."""
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if type(scale) is torch.Tensor:
                check_scale_tensor(scale, name, self.layout.num_kv_heads, self.device)
        return self._layer_scales(step, k_scale, v_scale)

    # ------------------------------------------------------------------ attention
    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, scale: float, softcap: float,
               sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
               k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None) -> bool:
        """Check the call against the step and run it (True), or refuse it untouched (False).

        ``k_scale`` / ``v_scale`` (an fp8 cache's; a scale for another cache is refused): None (1.0),
        a float, or an fp32 ``[]`` / ``[num_kv_heads]`` tensor on the cache's device, passed to the
        kernels as it is. A tensor's shape, strides, dtype and device belong to the call's form (checked
        when the form is first seen), its values are checked once per step (CPU tensors only); a
        float is checked when first seen. A bad scale raises the public op's error."""
        device = self.device
        if query.device != device or out.device != device or kv_cache.device != device:
            return False
        key = (query.shape, query.stride(), out.shape, out.stride(), kv_cache.shape, kv_cache.stride(),
               query.dtype, out.dtype, kv_cache.dtype, scale, softcap,
               None if sinks is None else (sinks.shape, sinks.stride(), sinks.dtype, sinks.device),
               None if alibi_slopes is None else (alibi_slopes.shape, alibi_slopes.stride(), alibi_slopes.dtype,
                                                  alibi_slopes.device))
        scaled = k_scale is not None or v_scale is not None
        if scaled:
            key += (_scale_form(k_scale), _scale_form(v_scale))
        form = self._attention.get(key)
        if form is None:
            step = self._step()
            if step is None or scaled and not self.fp8 or not prepared_attention_tensors_fit(
                    query, kv_cache, step, out, scale, softcap or None, sinks, alibi_slopes):
                return False
            scales = self._form_scales(step, k_scale, v_scale) if self.fp8 else (None, None)
            form = self._attention[key] = self._attention_form(query, kv_cache, out, scale, softcap, sinks,
                                                               alibi_slopes, *scales, scaled=scaled)
        if alibi_slopes is not None:
            check_alibi_values_once(self._step(), alibi_slopes)
        self._run_attention(form, query, kv_cache, out, sinks, alibi_slopes,
                            self._layer_scales(self._step(), k_scale, v_scale) if scaled else None)
        return True

    def run_attention(self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, scale: float,
                      softcap: float, sinks: torch.Tensor | None = None,
                      alibi_slopes: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
        """:meth:`attend` for a call already checked (the backend's ``paged_attention``; an fp8
        cache's scales normalised by :func:`kvmulti.fp8.scale_tensor`): rows past the step's are
        the caller's."""
        key = ("checked", query.shape, query.stride(), out.shape, out.stride(), kv_cache.shape, kv_cache.stride(),
               query.dtype, scale, softcap, sinks is None, alibi_slopes is None)
        scaled = k_scale is not None
        if scaled:
            key += (_scale_form(k_scale), _scale_form(v_scale))
        form = self._attention.get(key)
        if form is None:
            form = self._attention[key] = self._attention_form(query, kv_cache, out, scale, softcap, sinks,
                                                               alibi_slopes, k_scale, v_scale, zero=False,
                                                               scaled=scaled)
        self._run_attention(form, query, kv_cache, out, sinks, alibi_slopes, (k_scale, v_scale) if scaled else None)

    def _run_attention(self, form: _AttentionForm, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                       sinks: torch.Tensor | None, alibi_slopes: torch.Tensor | None,
                       scales: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        if form.zero_from is not None:
            out[form.zero_from:].zero_()
        if form.main is None:
            return
        tensors = (query, self._cache_bytes(kv_cache), out)
        if sinks is not None:
            tensors += (sinks,)
        if alibi_slopes is not None:
            tensors += (alibi_slopes,)
        if form.scaled:
            tensors += scales
        form.main(tensors)
        if form.reduce is not None:
            form.reduce((out,) if sinks is None else (out, sinks))

    def _attention_form(self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, scale: float,
                        softcap: float, sinks: torch.Tensor | None, alibi_slopes: torch.Tensor | None,
                        k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, zero: bool = True,
                        scaled: bool = False) -> _AttentionForm:
        """The launches of a form; an fp8 cache's scales (``scaled``: the layer's, launch arguments
        per call; else None's 1.0, fixed in the launch)."""
        layout, common = self.layout, self.common
        if self.capture is not None and (query.shape[0], out.shape[0]) != (self.rows, self.rows):
            raise ValueError(f"a step prepared for graph capture takes query and out of the bucket's "
                             f"max_num_tokens={self.rows} rows, got {query.shape[0]} and {out.shape[0]}")
        s = layout.strides(kv_cache)
        _, launches = kernels.attention_launches(
            query, kv_cache, out, common.query_start_loc, common.seq_lens, common.block_table,
            cache_strides=(s.block, s.token, s.head), block_size=layout.block_size,
            num_kv_heads=layout.num_kv_heads, head_size=layout.head_size, head_size_v=layout.value_size,
            num_reqs=self.num_reqs, num_tokens=self.rows, max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len, scale=scale, sliding_window=self.sliding_window,
            softcap=softcap or None, plan=self.plan, k_scale=k_scale, v_scale=v_scale, sinks=sinks,
            alibi_slopes=alibi_slopes, causal=common.causal, workspace=self.workspace)
        zero_from = self.rows if zero and self.capture is None and out.shape[0] > self.rows else None
        prepared = []
        for launch in launches:
            layer_args = ATTENTION_LAYER_ARGS[launch.kernel] + (("sinks_ptr",) if sinks is not None else ())
            if launch.kernel == "unified_attention":
                layer_args += ("alibi_ptr",) if alibi_slopes is not None else ()
                layer_args += SCALE_LAYER_ARGS if scaled else ()
            prepared.append(PreparedLaunch(launch, layer_args))
        return _AttentionForm(prepared[0] if prepared else None, prepared[1] if len(prepared) > 1 else None,
                              zero_from, scaled)

    # ------------------------------------------------------------------ write
    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
              k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None) -> bool:
        """Check the write against the step and run it (True), or refuse it untouched (False);
        scales as in :meth:`attend`."""
        device = self.device
        if key.device != device or value.device != device or kv_cache.device != device:
            return False
        form_key = (key.shape, key.stride(), value.shape, value.stride(), kv_cache.shape, kv_cache.stride(),
                    key.dtype, value.dtype, kv_cache.dtype, id(slot_mapping), slot_mapping.shape)
        scaled = k_scale is not None or v_scale is not None
        if scaled:
            form_key += (_scale_form(k_scale), _scale_form(v_scale))
        form = self._writes.get(form_key)
        if form is None or form.slot_mapping is not slot_mapping:
            step = self._step()
            if step is None or scaled and not self.fp8 or not prepared_write_tensors_fit(key, value, kv_cache,
                                                                                         slot_mapping, step):
                return False
            scales = self._form_scales(step, k_scale, v_scale) if self.fp8 else (None, None)
            check_slot_values_once(step, slot_mapping, self.layout)
            form = self._writes[form_key] = _WriteForm(
                slot_mapping, self._write_launches(key, value, kv_cache, slot_mapping, *scales, scaled), scaled)
        tensors = (key, value, self._cache_bytes(kv_cache))
        if form.scaled:
            tensors += self._layer_scales(self._step(), k_scale, v_scale)
        for launch in form.launches:
            launch(tensors)
        return True

    def _write_launches(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                        scaled: bool) -> list[PreparedLaunch]:
        layout = self.layout
        s = layout.strides(kv_cache)
        launches = kernels.write_kv_launches(key, value, kv_cache, slot_mapping,
                                             cache_strides=(s.block, s.token, s.head), block_size=layout.block_size,
                                             num_kv_heads=layout.num_kv_heads, head_size=layout.head_size,
                                             head_size_v=layout.value_size, k_scale=k_scale, v_scale=v_scale)
        layer_args = WRITE_LAYER_ARGS + (SCALE_LAYER_ARGS if scaled else ())
        return [PreparedLaunch(launch, layer_args) for launch in launches]
