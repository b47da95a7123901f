"""The interface every attention backend implements, and the configuration it is judged on."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

import torch

from ..capture import CaptureBucket
from ..layout import Allocator, KVCacheLayout
from ..metadata import CommonAttentionMetadata
from .. import settings
from ..platform import platform_of

from ..fp8 import (ACTIVATION_DTYPES as ALL_DTYPES, FNUZ_FP8_DTYPES, FP8_DTYPES,  # noqa: F401 (re-exported
                  OCP_FP8_DTYPES, activation_dtypes)                                # for backends)


@dataclass(frozen=True)
class AttentionConfig:
    """What backend selection looks at. Hashable, so selections are cached per configuration."""

    platform: str
    dtype: torch.dtype
    head_size: int
    head_size_v: int
    num_kv_heads: int
    block_size: int
    order: str
    sliding_window: bool = False
    softcap: bool = False
    causal: bool = True
    #: the layers pass attention sinks (one fp32 logit per query head in the softmax denominator)
    sinks: bool = False
    #: the layers pass ALiBi slopes (fp32 [num_q_heads]; score += slope * (key pos - query pos))
    alibi: bool = False

    @classmethod
    def from_layout(cls, layout: KVCacheLayout, device: torch.device | str,
                    sliding_window: int | None = None, softcap: float | None = None,
                    causal: bool = True, sinks: bool = False, alibi: bool = False) -> "AttentionConfig":
        return cls(platform=platform_of(device), dtype=layout.dtype, head_size=layout.head_size,
                   head_size_v=layout.value_size, num_kv_heads=layout.num_kv_heads,
                   block_size=layout.block_size, order=layout.order,
                   sliding_window=sliding_window is not None, softcap=bool(softcap), causal=bool(causal),
                   sinks=bool(sinks), alibi=bool(alibi))


@dataclass
class StepMetadata:
    """One step's attention metadata for one KV-cache group, prepared ONCE by the group's backend
    (:meth:`Backend.build_metadata`) and reused by every layer of the group.

    ``common`` has been validated against ``layout`` when this was built; ``plan`` is whatever the
    backend derived from it (tiles, split-KV partitions, int32 / device copies). Layers pass it to
    :func:`kvmulti.paged_attention` in place of the common metadata: that call then does no
    selection, no validation of the metadata and no planning, only the kernel launch.
    """

    common: CommonAttentionMetadata
    backend: "Backend"
    layout: KVCacheLayout
    num_query_heads: int
    sliding_window: int | None
    plan: Any = None
    extras: dict = field(default_factory=dict)
    #: the backend's own checked entry points for this step's layer calls (:meth:`Backend.prepared_calls`), or None
    calls: Any = None
    #: the step was prepared for layers that pass attention sinks (its backend serves them)
    sinks: bool = False
    #: the step was prepared for layers that pass ALiBi slopes (its backend serves them)
    alibi: bool = False
    #: the bucket of a step prepared for graph capture (fixed launch shapes, see kvmulti/capture.py), or None
    capture: CaptureBucket | None = None

    @cached_property
    def call_signature(self) -> tuple:
        """What a layer call of this step is checked against on the prepared paths of
        :mod:`kvmulti.input_rules` (``prepared_*_fits``): the cache's (dtype, shape,
        strides), then num_kv_heads, head_size, head_size_v, num_query_heads, num_actual_tokens,
        the activation dtypes the cache takes (:func:`kvmulti.fp8.activation_dtypes`) and whether
        the layout takes the fast paths at all (not latent)."""
        layout = self.layout
        return (layout._exact_signature, layout.num_kv_heads, layout.head_size, layout.value_size,
                self.num_query_heads, self.common.num_actual_tokens, activation_dtypes(layout.dtype),
                not layout.is_latent)


class Backend(abc.ABC):
    """One attention implementation over the canonical layout.

    Subclasses declare their capabilities as class attributes and implement :meth:`write_kv`,
    :meth:`paged_attention` and, when they derive anything from a step's metadata,
    :meth:`plan`. Inputs reaching these methods are already validated by :mod:`kvmulti.ops` (or
    by the per-step hook); backends never re-validate and never repack the cache, and their
    kernels never touch memory outside the tensors they are given, whatever the metadata says.

    ``partition_size`` is the split-KV contract shared by every backend: -1 decides from the step,
    0 never splits, N > 0 always splits long key ranges into partitions of N keys.
    """

    name: ClassVar[str]
    platforms: ClassVar[tuple[str, ...]]
    #: cache dtypes served; a backend listing an fp8 dtype reads and writes it by kvmulti/fp8.py's rule
    #: for queries, keys and values of any of ALL_DTYPES.
    dtypes: ClassVar[tuple[torch.dtype, ...]] = ALL_DTYPES
    head_sizes: ClassVar[tuple[int, ...] | None] = None      # None: any head size
    max_head_size: ClassVar[int | None] = None
    min_block_size: ClassVar[int] = 1
    max_block_size: ClassVar[int | None] = None
    orders: ClassVar[tuple[str, ...]] = ("NHD", "HND")
    supports_sliding_window: ClassVar[bool] = True
    supports_softcap: ClassVar[bool] = True
    supports_latent: ClassVar[bool] = False
    supports_non_causal: ClassVar[bool] = False
    #: non-causal rows with a sliding window see keys with |query position - key position| < window
    supports_non_causal_window: ClassVar[bool] = True
    #: attention sinks: ``paged_attention(..., sinks=)`` fp32 [num_q_heads] logits joining each
    #: softmax denominator (no value); a backend without them reports "does not serve attention sinks"
    supports_sinks: ClassVar[bool] = False
    #: ALiBi: ``paged_attention(..., alibi_slopes=)`` fp32 [num_q_heads], score += slope[h] * (k_pos - q_pos)
    #: after scale and softcap; a backend without it reports "ALiBi not supported"
    supports_alibi: ClassVar[bool] = False
    #: steps prepared for graph capture (``prepare_step(..., capture=CaptureBucket(...))``): launches
    #: fixed for the bucket, lengths read on the device, workspaces owned by the step
    supports_capture: ClassVar[bool] = False

    def __init__(self, partition_size: int | None = None):
        """``partition_size``: split-KV (see the class doc); None reads ``KVMULTI_PARTITION_SIZE``."""
        self.partition_size = settings.partition_size() if partition_size is None else int(partition_size)
        if self.partition_size < -1:
            raise ValueError(f"partition_size must be -1 (auto), 0 (never) or positive, got {self.partition_size}")

    def unavailable_reasons(self) -> list[str]:
        """Why this backend cannot run on this host at all (missing library, not built, ...)."""
        return []

    def platform_reasons(self, platform: str) -> list[str]:
        """Why this backend cannot serve tensors of ``platform``."""
        if platform not in self.platforms:
            return [f"{self.name} runs on {', '.join(self.platforms)}, not {platform}"]
        return []

    def describe(self) -> str:
        """One line for ``kvmulti info``: what this backend runs on here."""
        return ", ".join(self.platforms)

    def cache_allocator(self, device: torch.device | str) -> Allocator | None:
        """Memory this backend wants its KV caches in on ``device`` (see ``KVCacheLayout.allocate``);
        None: plain torch memory."""
        return None

    def capability_reasons(self, config: AttentionConfig) -> list[str]:
        """Why this backend's kernels cannot serve ``config`` (dtype, sizes, features)."""
        reasons = []
        if config.dtype in FNUZ_FP8_DTYPES and config.dtype not in self.dtypes:
            reasons.append(f"fp8 FNUZ cache {config.dtype} not supported: {self.name}'s kernels decode "
                           f"{', '.join(str(d) for d in self.dtypes if d in FP8_DTYPES) or 'no fp8 format'}")
        elif config.dtype not in self.dtypes:
            reasons.append(f"dtype {config.dtype} not supported (supports {', '.join(map(str, self.dtypes))})")
        for what, size in (("head_size", config.head_size), ("head_size_v", config.head_size_v)):
            if size == 0:
                continue
            if self.head_sizes is not None and size not in self.head_sizes:
                reasons.append(f"{what} {size} not supported (supports {list(self.head_sizes)})")
            if self.max_head_size is not None and size > self.max_head_size:
                reasons.append(f"{what} {size} exceeds the maximum {self.max_head_size}")
        if config.head_size_v == 0 and not self.supports_latent:
            reasons.append("latent caches (head_size_v=0) not supported")
        if config.block_size < self.min_block_size:
            reasons.append(f"block_size {config.block_size} below the minimum {self.min_block_size}")
        if self.max_block_size is not None and config.block_size > self.max_block_size:
            reasons.append(f"block_size {config.block_size} exceeds the maximum {self.max_block_size}")
        if config.order not in self.orders:
            reasons.append(f"layout order {config.order} not supported")
        if config.sliding_window and not self.supports_sliding_window:
            reasons.append("sliding window not supported")
        if config.softcap and not self.supports_softcap:
            reasons.append("softcap not supported")
        if not config.causal and not self.supports_non_causal:
            reasons.append("non-causal attention not supported (metadata.causal is False)")
        elif not config.causal and config.sliding_window and not self.supports_non_causal_window:
            reasons.append(f"{self.name} has no sliding window for non-causal attention (the contract's window "
                           "is |query position - key position| < window)")
        if config.sinks and not self.supports_sinks:
            reasons.append(f"{self.name} does not serve attention sinks")
        if config.alibi and not self.supports_alibi:
            reasons.append("ALiBi not supported")
        return reasons

    def not_supported_reasons(self, config: AttentionConfig) -> list[str]:
        """Every reason this backend cannot serve ``config`` here; empty means usable."""
        return self.unavailable_reasons() + self.platform_reasons(config.platform) + self.capability_reasons(config)

    def build_metadata(self, common: CommonAttentionMetadata, layout: KVCacheLayout, num_query_heads: int,
                       sliding_window: int | None, capture: CaptureBucket | None = None) -> StepMetadata:
        """The per-step hook: everything this backend derives from ``common`` for a group whose
        layers have ``num_query_heads`` query heads and ``sliding_window``, computed once per step.
        ``common`` must already be validated (:func:`kvmulti.validation.check_metadata`), and with
        ``capture`` checked against the bucket (:func:`kvmulti.validation.check_capture`); a backend
        without ``supports_capture`` raises ValueError for it."""
        if capture is not None and not self.supports_capture:
            raise ValueError(f"backend {self.name} cannot prepare steps for graph capture")
        step = StepMetadata(common, self, layout, num_query_heads, sliding_window, capture=capture)
        step.plan = self.plan(common, layout, num_query_heads, sliding_window) if capture is None else \
            self.capture_plan(common, layout, num_query_heads, sliding_window, capture)
        step.calls = self.prepared_calls(step)
        return step

    def plan(self, common: CommonAttentionMetadata, layout: KVCacheLayout, num_query_heads: int,
             sliding_window: int | None) -> Any:
        """What :meth:`build_metadata` stores as ``StepMetadata.plan`` (None: nothing to prepare)."""
        return None

    def capture_plan(self, common: CommonAttentionMetadata, layout: KVCacheLayout, num_query_heads: int,
                     sliding_window: int | None, capture: CaptureBucket) -> Any:
        """:meth:`plan` for a step prepared for graph capture: decided from the bucket's maxima, not
        from ``common``'s lengths (a backend with ``supports_capture`` implements it)."""
        raise ValueError(f"backend {self.name} cannot prepare steps for graph capture")

    def prepared_calls(self, step: StepMetadata) -> Any:
        """What :func:`kvmulti.paged_attention` / :func:`kvmulti.write_kv` hand a layer call of
        ``step`` to first, or None (the default): an object whose ``attend(query, kv_cache, out,
        scale: float, softcap: float, sinks, alibi_slopes) -> bool`` and ``write(key, value, kv_cache,
        slot_mapping) -> bool`` check the call against the step (every ``native`` rule of
        :mod:`kvmulti.input_rules`, including the slot values once per slot tensor) and run it, or
        return False having done nothing. ``softcap`` is 0.0 for off; ``sinks`` / ``alibi_slopes``
        are None or the layer's tensors (passed only for a step prepared with them); ``out`` rows
        past ``num_actual_tokens`` are zeroed. Calls of a step over an fp8 cache also take the
        layer's scales as they were given, ``attend(..., alibi_slopes, k_scale, v_scale)`` and
        ``write(..., slot_mapping, k_scale, v_scale)`` (each None, a float or a plain tensor, checked
        by kvmulti/fp8.py's ``check_scale_*``); no scales are passed for other caches."""
        return None

    @abc.abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 layout: KVCacheLayout, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        """Write key [T, Hkv, head_size] / value [T, Hkv, head_size_v] to their slots; -1 skips.
        ``k_scale`` / ``v_scale``: fp32 [Hkv] for an fp8 cache (quantise by kvmulti/fp8.py's rule),
        else None."""

    @abc.abstractmethod
    def paged_attention(self, query: torch.Tensor, kv_cache: torch.Tensor, step: StepMetadata, scale: float,
                        softcap: float | None, out: torch.Tensor, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> None:
        """Write every row [:num_actual_tokens] of ``out`` [T, Hq, head_size_v] (query dtype; rows
        after those are the caller's). ``step`` comes from this backend's :meth:`build_metadata`.
        ``k_scale`` / ``v_scale``: fp32 [Hkv] for an fp8 cache (keys read as float(k) * k_scale),
        else None. A backend with ``supports_sinks`` also takes ``sinks=``: fp32 [Hq] contiguous on
        the cache's device, passed only when the layer has sinks (the logit joins each row's softmax
        denominator once, after any split-KV merge, and contributes no value). A backend with
        ``supports_alibi`` also takes ``alibi_slopes=``: fp32 [Hq] contiguous on the cache's device,
        passed only when the layer has them (score += slope[h] * (k_pos - q_pos) after scale and softcap)."""
