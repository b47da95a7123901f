"""A vLLM KV connector over kvmulti's interchange format: prefill in one engine, decode in another.

Registered by the plugin as :data:`kvmulti.integrations.vllm.CONNECTOR_NAME`; configured with
``KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role="kv_both",
kv_connector_extra_config={"shared_storage_path": DIR})``.

* Save: when a request's prompt is computed (the step whose tokens reach its end), the worker
  exports every layer's tokens ``0 .. len(prompt) - 1`` with :func:`kvmulti.export_blocks` (the
  engine's own layout, block size and cache dtype; fp8 scales travel in the buffer) into one file
  ``DIR/<sha256 of the prompt token ids>.kvx``, written to a temporary name and renamed, so a
  reader never sees half a file. A prompt whose file exists is not saved again.
* Load: a new request whose prompt has a file is reported as ``align_down(len(prompt) - 1,
  block_size) - num_computed_tokens`` matched tokens (the last prompt token is always recomputed:
  vLLM needs its logits; whole blocks only). Before the step's forward the worker imports the file
  with :func:`kvmulti.import_blocks` into a scratch cache of the engine's layout, block size and
  cache dtype (fp8: read with the layer's scales), then copies the matched blocks, and only those,
  into the request's blocks: blocks vLLM's prefix cache already holds are left as they are.

The engines may differ in attention backend (vLLM's CPU_ATTN or KVMULTI), KV-cache layout, block
size and cache dtype (conversions as docs/interchange.md states); layer names, KV heads and head
sizes must agree. A file that is corrupt, truncated, of another version, or does not hold exactly
the prompt's tokens of exactly this engine's layers raises (:class:`kvmulti.InterchangeError` or
:class:`ConnectorFileError`) in the step that loads it: never a silent wrong cache. Full-attention
KV-cache groups only (a sliding-window group's freed blocks are not saved); refused at start-up.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                 KVConnectorRole)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from ... import fp8
from ...interchange import InterchangeError, export_blocks, import_blocks
from ...layout import KVCacheLayout
from .backend import KvmultiAttentionImpl, fp8_cache_dtype, layout_for_cache
from .cpu_attn_pages import from_rows, page_order, to_rows

#: ``kv_connector_extra_config`` key naming the shared directory.
STORAGE_KEY = "shared_storage_path"
SUFFIX = ".kvx"
#: The module of vLLM's CPU_ATTN implementation, whose pages need converting.
CPU_ATTN_MODULE = "vllm.v1.attention.backends.cpu_attn"


class ConnectorFileError(ValueError):
    """A stored file that parses but does not hold the request's prompt tokens."""


def prompt_key(token_ids: list[int]) -> str:
    """The file stem for a prompt: sha256 of its token ids as little-endian int64."""
    return hashlib.sha256(torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class Transfer:
    """One request's save or load in a step. ``block_ids``: per KV-cache group, the request's
    blocks from its first; a load fills tokens ``[start, stop)`` (block-aligned)."""

    req_id: str
    path: str
    prompt_len: int
    block_ids: tuple[tuple[int, ...], ...]
    start: int = 0
    stop: int = 0


@dataclass
class KvmultiConnectorMetadata(KVConnectorMetadata):
    saves: list[Transfer] = field(default_factory=list)
    loads: list[Transfer] = field(default_factory=list)


@dataclass
class _Pending:
    """A request whose prompt is still being computed (chunked prefill), scheduler side."""
    token_ids: list[int]
    block_ids: list[list[int]]


class KvmultiSharedStorageConnector(KVConnectorBase_V1):
    """Saves each prompt's KV as one interchange file in a shared directory and loads it into any
    engine whose layers match (see the module's docstring for the contract).

    ``loaded_tokens`` (worker side): ``{request id: tokens written from a file}``, kept for the
    engine's lifetime."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        path = self._kv_transfer_config.get_from_extra_config(STORAGE_KEY, None)
        if not path:
            raise ValueError(f"kvmulti's KV connector needs kv_connector_extra_config={{{STORAGE_KEY!r}: DIR}}")
        self.storage = os.fspath(path)
        os.makedirs(self.storage, exist_ok=True)
        self.block_size: int = vllm_config.cache_config.block_size
        self._groups: list[list[str]] = []
        if kv_cache_config is not None:
            for group in kv_cache_config.kv_cache_groups:
                if type(group.kv_cache_spec) is not FullAttentionSpec:
                    raise NotImplementedError(f"kvmulti's KV connector serves full-attention KV-cache groups only, "
                                              f"not {type(group.kv_cache_spec).__name__}")
                self._groups.append(list(group.layer_names))
        # scheduler side
        self._matched: dict[str, tuple[int, int]] = {}      # req id -> (local tokens, external tokens)
        self._need_load: dict[str, Any] = {}
        self._pending: dict[str, _Pending] = {}
        # worker side
        self._caches: dict[str, tuple[torch.Tensor, KVCacheLayout]] = {}
        self._pages: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}   # CPU_ATTN layers: (cache, page order)
        self.loaded_tokens: dict[str, int] = {}

    def path_for(self, token_ids: list[int]) -> str:
        return os.path.join(self.storage, prompt_key(token_ids) + SUFFIX)

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens loadable beyond ``num_computed_tokens``: the prompt's, less the last one, in whole
        blocks, when the prompt has a file."""
        prompt = list(request.prompt_token_ids or [])
        if not prompt or not os.path.exists(self.path_for(prompt)):
            return 0, False
        loadable = (len(prompt) - 1) // self.block_size * self.block_size
        external = max(loadable - num_computed_tokens, 0)
        self._matched[request.request_id] = (num_computed_tokens, external)
        return external, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._need_load[request.request_id] = request

    def build_connector_meta(self, scheduler_output: Any) -> KvmultiConnectorMetadata:
        """This step's loads (requests allocated with external tokens) and saves (requests whose
        prompt the step completes, without a file yet)."""
        meta = KvmultiConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or [])
            if new.req_id in self._need_load:
                self._add_load(meta, new.req_id, new.block_ids)
            elif prompt:
                self._pending[new.req_id] = _Pending(prompt, [list(ids) for ids in new.block_ids])
                self._maybe_save(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in self._need_load and req_id in cached.resumed_req_ids and new_ids is not None:
                self._add_load(meta, req_id, new_ids)      # resumed after preemption: all its blocks anew
                continue
            pending = self._pending.get(req_id)
            if pending is None:
                continue
            if req_id in cached.resumed_req_ids:
                pending.block_ids = [[] for _ in pending.block_ids]
            if new_ids is not None:
                for group, ids in zip(pending.block_ids, new_ids):
                    group.extend(ids)
            self._maybe_save(meta, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        self._need_load.clear()
        return meta

    def _add_load(self, meta: KvmultiConnectorMetadata, req_id: str, block_ids: tuple[list[int], ...]) -> None:
        request = self._need_load[req_id]
        local, external = self._matched.pop(req_id)
        prompt = list(request.prompt_token_ids)
        meta.loads.append(Transfer(req_id, self.path_for(prompt), len(prompt), tuple(map(tuple, block_ids)),
                                   local, local + external))

    def _maybe_save(self, meta: KvmultiConnectorMetadata, req_id: str, computed_after_step: int) -> None:
        pending = self._pending[req_id]
        if computed_after_step < len(pending.token_ids):
            return
        del self._pending[req_id]
        path = self.path_for(pending.token_ids)
        if not os.path.exists(path):
            meta.saves.append(Transfer(req_id, path, len(pending.token_ids), tuple(map(tuple, pending.block_ids))))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        return False, None

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Each layer's kvmulti view and layout (fp8: vLLM's uint8 bytes read as the cache dtype);
        for a layer on vLLM's CPU_ATTN also its page order (:mod:`.cpu_attn_pages`), through which
        its pages are converted, as kvmulti serves the layer otherwise. Other vLLM backends are refused."""
        from vllm.platforms import current_platform
        fp8_dtype = fp8_cache_dtype(self._vllm_config.cache_config.cache_dtype, current_platform.is_fp8_fnuz())
        head_size = self._vllm_config.model_config.get_head_size()
        layers = self._vllm_config.compilation_config.static_forward_context
        for group in self._groups:
            for name in group:
                cache = kv_caches[name]
                impl = getattr(layers[name], "impl", None)
                if type(impl).__module__ == CPU_ATTN_MODULE:
                    self._pages[name] = cache, page_order(layers[name].isa, cache.dtype, cache.shape[2], head_size)
                elif not isinstance(impl, KvmultiAttentionImpl):
                    raise NotImplementedError(f"kvmulti's KV connector reads caches of kvmulti's backend and "
                                              f"CPU_ATTN, not {type(impl).__name__} (layer {name!r})")
                if fp8_dtype is not None and cache.dtype != fp8_dtype:
                    cache = cache.view(fp8_dtype)
                view, layout = layout_for_cache(cache, head_size)
                if layout.block_size != self.block_size:
                    raise NotImplementedError(f"kvmulti's KV connector: layer {name!r} has kernel blocks of "
                                              f"{layout.block_size} tokens, the scheduler's are {self.block_size}")
                self._caches[name] = view, layout

    def _scales(self) -> tuple[dict[str, float] | None, dict[str, float] | None]:
        """fp8 caches: each layer's per-tensor (k, v) scales; otherwise (None, None)."""
        if not any(fp8.is_fp8(layout.dtype) for _, layout in self._caches.values()):
            return None, None
        layers = self._vllm_config.compilation_config.static_forward_context
        return ({name: layers[name]._k_scale_float for name in self._caches},
                {name: layers[name]._v_scale_float for name in self._caches})

    def _per_layer_ids(self, block_ids: tuple[tuple[int, ...], ...]) -> dict[str, list[int]]:
        return {name: list(ids) for group, ids in zip(self._groups, block_ids) for name in group}

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Write this step's loads into the request's blocks before the forward reads them."""
        meta = self._get_connector_metadata()
        k_scale, v_scale = self._scales()
        for load in meta.loads:
            with open(load.path, "rb") as f:
                data = f.read()
            blocks = -(-load.prompt_len // self.block_size)
            scratch = {name: _scratch_like(layout, blocks, view.device) for name, (view, layout) in self._caches.items()}
            imported = import_blocks(data, {n: v for n, (v, _) in scratch.items()},
                                     {n: lay for n, (_, lay) in scratch.items()}, list(range(blocks)),
                                     k_scale=k_scale, v_scale=v_scale)
            if imported.num_tokens != load.prompt_len or any(imported.start_tokens.values()):
                raise ConnectorFileError(f"{load.path}: holds tokens {min(imported.start_tokens.values())}.."
                                         f"{imported.num_tokens - 1}, the prompt has {load.prompt_len}")
            ids = self._per_layer_ids(load.block_ids)
            first, last = load.start // self.block_size, load.stop // self.block_size
            for name, (view, _) in self._caches.items():
                dst = torch.tensor(ids[name][first:last], dtype=torch.long, device=view.device)
                rows = scratch[name][0][first:last]
                if name in self._pages:
                    pages, order = self._pages[name]
                    from_rows(rows.transpose(1, 2), pages, dst, order)
                else:
                    view[dst] = rows
            self.loaded_tokens[load.req_id] = load.stop - load.start

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return                                      # every layer is saved at once, in wait_for_save

    def wait_for_save(self) -> None:
        """Export this step's completed prompts, one file each (written whole, then renamed)."""
        meta = self._get_connector_metadata()
        if not meta.saves:
            return
        k_scale, v_scale = self._scales()
        for save in meta.saves:
            ids = self._per_layer_ids(save.block_ids)
            cache = {name: view for name, (view, _) in self._caches.items()}
            layout = {name: lay for name, (_, lay) in self._caches.items()}
            for name, (pages, order) in self._pages.items():      # CPU_ATTN pages: converted first
                held = torch.tensor(ids[name][:-(-save.prompt_len // self.block_size)], dtype=torch.long)
                cache[name], layout[name] = layout_for_cache(to_rows(pages, held, order), layout[name].head_size)
                ids[name] = list(range(len(held)))
            data = export_blocks(cache, layout, ids, save.prompt_len, k_scale=k_scale, v_scale=v_scale)
            fd, tmp = tempfile.mkstemp(dir=self.storage, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, save.path)


def _scratch_like(layout: KVCacheLayout, blocks: int, device: torch.device) -> tuple[torch.Tensor, KVCacheLayout]:
    """A per-layer cache of ``blocks`` blocks of ``layout``'s block size, heads, sizes, dtype and order."""
    scratch = replace(layout, num_blocks=blocks, cross_layer_order=None, num_layers=1)
    return scratch.allocate(device, zero=False, huge_pages=False), scratch


__all__ = ["ConnectorFileError", "InterchangeError", "KvmultiConnectorMetadata", "KvmultiSharedStorageConnector",
           "STORAGE_KEY", "Transfer", "prompt_key"]
