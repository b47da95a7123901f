"""ModelRunner: one model, its KV-cache groups, one backend per group, and its requests.

A runner is self-contained: its caches, block pools, block tables and every metadata tensor it
builds belong to it alone, so a target and a draft runner never share a buffer.

Per request it keeps the known tokens, how many of them are already in the KV cache
(``num_computed``) and one block table per group (a row of each group's :class:`BlockTables`).
A step (:meth:`ModelRunner.forward`) computes, for each scheduled request, its next ``n`` known
tokens -- a prefill chunk, one decode token, or ``k + 1`` tokens to verify -- in ONE packed
forward. It allocates the blocks the step needs (or raises :class:`OutOfBlocksError` for the
first request that cannot get them, allocating nothing), builds one
:class:`~kvmulti.metadata.CommonAttentionMetadata` per group, runs the model and returns the
logits asked for. :meth:`truncate` rolls a request back (speculative rejection).
"""

from __future__ import annotations

import os
import time
from typing import Hashable, Mapping, Sequence

import numpy as np
import torch

from .. import (FP8_DTYPES, ROLES, Backend, CommonAttentionMetadata, KVCacheLayout, prepare_steps,
               resolve_backend)
from ..kv_cache import AttentionSpec, BlockPool, BlockTables, KVCacheConfig, OutOfBlocksError
from ..models.decoder import AttentionContext, CausalLM
from ..models.loader import load_model
from .batch import StepBatch
from .blocks import allocate
from .requests import Request, RowArrays

#: KV-cache memory when neither num_blocks nor memory_bytes is given.
DEFAULT_KV_MEMORY_BYTES = 64 * 2**20

__all__ = ["DEFAULT_KV_MEMORY_BYTES", "ModelRunner", "OutOfBlocksError", "Request", "StepBatch"]


#: ``kv_cache_dtype`` names (``kvmulti generate --kv-cache-dtype``): "auto" is the model's dtype.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn,
                                                  "fp8_e5m2": torch.float8_e5m2}


def resolve_kv_cache_dtype(kv_cache_dtype: torch.dtype | str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype for a ``kv_cache_dtype`` argument: a name of :data:`KV_CACHE_DTYPES`, a torch
    dtype (the model's or an fp8 format), or None (the model's dtype)."""
    if isinstance(kv_cache_dtype, str):
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        kv_cache_dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    if kv_cache_dtype is None:
        return model_dtype
    if kv_cache_dtype != model_dtype and kv_cache_dtype not in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype must be the model's dtype ({model_dtype}) or an fp8 format, "
                         f"got {kv_cache_dtype}")
    return kv_cache_dtype


class ModelRunner:
    """Runs one model over paged KV caches for a changing set of requests.

    Args:
        model: a :class:`CausalLM` or an HF model directory.
        role: ``"target"`` or ``"draft"`` (which env override applies when no backend is named).
        backend: None (dispatch), a backend name for every group, or ``{group_id: name}``.
        block_size: an int for every group, or ``{"full": 16, "sliding": 32}`` by attention kind.
        num_blocks / memory_bytes: pool size per group, or a budget for all caches (default
            :data:`DEFAULT_KV_MEMORY_BYTES`).
        max_num_batched_tokens: per-step token budget of :meth:`schedule` (prefills are chunked).
        rollback_tokens: how far :meth:`truncate` may go back behind the computed length;
            sliding-window groups keep that many extra positions before freeing blocks.
        kv_cache_dtype: the KV caches' dtype: None / ``"auto"`` (the model's dtype), or an fp8 format
            (``"fp8_e4m3"`` / ``"fp8_e5m2"`` or the torch dtype; see :data:`KV_CACHE_DTYPES`). fp8
            caches use scales of 1.0 (docs/fp8.md: why no calibration).
    """

    def __init__(self, model: CausalLM | str | os.PathLike, *, role: str = "target",
                 backend: str | Mapping[int, str] | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, block_size: int | Mapping[str, int] = 16,
                 num_blocks: int | Mapping[int, int] | None = None, memory_bytes: int | None = None,
                 max_num_batched_tokens: int = 512, rollback_tokens: int = 0, order: str = "NHD",
                 kv_cache_dtype: torch.dtype | str | None = None):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if max_num_batched_tokens < 1 or rollback_tokens < 0:
            raise ValueError("max_num_batched_tokens must be >= 1 and rollback_tokens >= 0")
        self.device = torch.device(device)
        self._on_cpu = self.device.type == "cpu"
        if isinstance(model, (str, os.PathLike)):
            model = load_model(model, self.device, dtype)
        self.model, self.config, self.role = model, model.config, role
        self.dtype = next(model.parameters()).dtype
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)
        self.max_num_batched_tokens, self.rollback_tokens = max_num_batched_tokens, rollback_tokens
        if num_blocks is None and memory_bytes is None:
            memory_bytes = DEFAULT_KV_MEMORY_BYTES
        self.kv_cache_config = KVCacheConfig.build(self.attention_specs(block_size), num_blocks, memory_bytes, order)
        groups = self.kv_cache_config.groups
        self.layer_to_group = self.kv_cache_config.layer_to_group()
        self.layouts: dict[int, KVCacheLayout] = {g.group_id: lay for g, lay in zip(groups, self.kv_cache_config.layouts)}
        self.backends: dict[int, Backend] = {g.group_id: self._select(g.group_id, g.spec, backend) for g in groups}
        self.windows = {g.group_id: g.spec.sliding_window for g in groups}
        self.kv_caches = self.kv_cache_config.allocate_caches(
            self.device, {gid: b.cache_allocator(self.device) for gid, b in self.backends.items()})
        self.pools = {g.group_id: BlockPool(self.layouts[g.group_id].num_blocks) for g in groups}
        self.tables = {g.group_id: BlockTables(g, self.pools[g.group_id]) for g in groups}
        self.requests: dict[Hashable, Request] = {}
        self._rows = RowArrays()
        self._row_of: dict[Hashable, int] = {}
        self._free_rows: list[int] = []
        self.num_steps = 0
        self.forward_time_s = 0.0

    # -- construction ----------------------------------------------------------------------
    def attention_specs(self, block_size: int | Mapping[str, int]) -> dict[str, AttentionSpec]:
        """One spec per attention layer (by layer name), block size chosen by attention kind."""
        cfg, specs = self.config, {}
        for attn in self.model.attention_layers():
            kind = "full" if attn.sliding_window is None else "sliding"
            bs = block_size[kind] if isinstance(block_size, Mapping) else block_size
            specs[attn.layer_name] = AttentionSpec(block_size=bs, num_kv_heads=cfg.num_key_value_heads,
                                                   head_size=cfg.head_dim, dtype=self.kv_cache_dtype,
                                                   sliding_window=attn.sliding_window)
        return specs

    def _select(self, group_id: int, spec: AttentionSpec, backend) -> Backend:
        """The backend object of one group, chosen once by :func:`kvmulti.ops.resolve_backend`."""
        requested = backend.get(group_id) if isinstance(backend, Mapping) else backend
        return resolve_backend(self.layouts[group_id], self.device, sliding_window=spec.sliding_window,
                               softcap=self.config.attn_softcap, backend=requested, role=self.role)

    def describe(self) -> str:
        """One line per group: kind, sizes, cache dtype and the backend chosen."""
        return "\n".join(f"{line} kv_dtype={str(self.layouts[g.group_id].dtype).removeprefix('torch.')} "
                         f"backend={self.backends[g.group_id].name}" for g, line in
                         zip(self.kv_cache_config.groups, self.kv_cache_config.describe().splitlines()))

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        """Register a request with its prompt tokens; nothing is computed until a step."""
        if req_id in self.requests:
            raise ValueError(f"request {req_id!r} already exists")
        tokens = self._check_tokens(tokens, req_id)
        if not tokens:
            raise ValueError(f"request {req_id!r}: empty prompt")
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row = len(self.requests)
        for table in self.tables.values():
            table.add_row(row)
        self._rows.ensure(row)
        self._rows.set(row, tokens, 0)
        self.requests[req_id] = Request(req_id, row, tokens, self._rows)
        self._row_of[req_id] = row

    def append_tokens(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        req = self.requests[req_id]
        req.tokens.extend(self._check_tokens(tokens, req_id))
        self._rows.set(req.row, req.tokens, req.num_computed)

    def remove_request(self, req_id: Hashable) -> None:
        """Forget a request and return all its blocks to the pools."""
        req = self.requests.pop(req_id)
        del self._row_of[req_id]
        for table in self.tables.values():
            table.release(req.row)
        self._free_rows.append(req.row)

    def truncate(self, req_id: Hashable, length: int) -> None:
        """Roll a request back to its first ``length`` tokens (speculative rejection).

        Tokens past ``length`` are forgotten, ``num_computed`` drops to at most ``length`` and blocks
        past those covering ``length`` positions go back to the pools; slots of rolled-back
        positions are simply overwritten later. Sliding-window groups can roll back only as far
        as the blocks they still hold: ``rollback_tokens`` behind the LONGEST computed length the
        request has reached (enough for speculative decoding, whose accepted length only grows);
        further back is a ValueError and nothing changes.
        """
        req = self.requests[req_id]
        if not 1 <= length <= len(req.tokens):
            raise ValueError(f"request {req_id!r}: cannot truncate {len(req.tokens)} tokens to {length}")
        computed = min(req.num_computed, length)
        for gid, table in self.tables.items():
            if table.window is not None and computed > 0:
                needed_from = max(0, computed - table.window + 1)
                if needed_from < table.visible_from(req.row):
                    raise ValueError(
                        f"request {req_id!r}: rolling back to {computed} computed tokens needs positions from "
                        f"{needed_from} in sliding group {gid}, whose blocks before {table.visible_from(req.row)} "
                        f"were freed; create the runner with rollback_tokens >= the rollback distance")
        del req.tokens[length:]
        self._rows.set(req.row, req.tokens, computed)
        for table in self.tables.values():
            table.truncate(req.row, length)

    def _check_tokens(self, tokens: Sequence[int], req_id) -> list[int]:
        tokens = [int(t) for t in tokens]
        if tokens and (min(tokens) < 0 or max(tokens) >= self.config.vocab_size):
            raise ValueError(f"request {req_id!r}: token ids must be in 0..{self.config.vocab_size - 1}")
        return tokens

    def num_blocks_held(self, req_id: Hashable) -> dict[int, int]:
        row = self.requests[req_id].row
        return {gid: table.num_held(row) for gid, table in self.tables.items()}

    def num_free_blocks(self) -> dict[int, int]:
        return {gid: pool.num_free for gid, pool in self.pools.items()}

    # -- scheduling ----------------------------------------------------------------------------
    def schedule(self, token_budget: int | None = None) -> dict[Hashable, int]:
        """Tokens to compute this step per request: decodes first (1 each), then prefill chunks
        (arrival order) until ``token_budget`` (default ``max_num_batched_tokens``) is spent."""
        budget = self.max_num_batched_tokens if token_budget is None else token_budget
        out: dict[Hashable, int] = {}
        for req in self.requests.values():
            if budget == 0:
                return out
            if req.num_pending == 1:
                out[req.req_id] = 1
                budget -= 1
        for req in self.requests.values():
            if budget == 0:
                break
            if req.num_pending > 1:
                n = min(req.num_pending, budget)
                out[req.req_id] = n
                budget -= n
        return out

    # -- one step ------------------------------------------------------------------------------
    def prepare(self, schedule: Mapping[Hashable, int],
                num_logits: int | Mapping[Hashable, int] | None = None) -> StepBatch:
        """Allocate the step's blocks and build its inputs and per-group metadata.

        ``schedule`` maps request -> number of its pending tokens to compute now. ``num_logits``:
        how many of each request's LAST scheduled positions need logits (None: 1 where the chunk
        reaches the request's last known token, else 0).

        Vectorised over requests (numpy on the host, one copy to the device per tensor): the
        groups of one runner share its ``query_start_loc`` / ``seq_lens`` tensors and differ in
        ``block_table`` / ``slot_mapping``; nothing is shared with another runner.
        """
        r = len(schedule)
        if not r:
            raise ValueError("empty schedule")
        req_ids = list(schedule)
        q = np.fromiter(schedule.values(), dtype=np.int64, count=r)
        rows = np.fromiter(map(self._row_of.__getitem__, req_ids), dtype=np.int64, count=r)
        ctx = self._rows.computed[rows]
        pending = self._rows.length[rows] - ctx
        t = int(q.sum())
        if t == r:                                            # one token per request (if all q >= 1)
            low, high = int(pending.min()), int(pending.max())
            valid, pure_decode = low >= 1 and int(q.min()) >= 1, high == 1
        else:
            valid, pure_decode = int(q.min()) >= 1 and int((pending - q).min()) >= 0, False
        if not valid:
            i = int(np.nonzero((q < 1) | (q > pending))[0][0])
            raise ValueError(f"request {req_ids[i]!r}: {int(q[i])} tokens scheduled, {int(pending[i])} pending")
        seq = ctx + q
        allocate(self.tables, req_ids, rows, seq)

        if t == r:
            qsl = np.arange(r + 1, dtype=np.int64)
            req_of_token, positions = None, ctx
            if pure_decode:
                ids = self._rows.last_token[rows]             # pure decode: the last known tokens
            else:
                ids = np.array([self.requests[rid].tokens[c] for rid, c in zip(req_ids, ctx.tolist())],
                               dtype=np.int64)
        else:
            qsl = np.zeros(r + 1, dtype=np.int64)
            np.cumsum(q, out=qsl[1:])
            req_of_token = np.repeat(np.arange(r), q)
            positions = np.arange(t) - qsl[:-1][req_of_token] + ctx[req_of_token]
            ids = np.empty(t, dtype=np.int64)
            decode = (q == 1) & (pending == 1)                # their token is the last known one
            ids[qsl[:-1][decode]] = self._rows.last_token[rows[decode]]
            for i in np.nonzero(~decode)[0].tolist():
                c, start = int(ctx[i]), int(qsl[i])
                ids[start:start + int(q[i])] = self.requests[req_ids[i]].tokens[c:c + int(q[i])]
        token_index = np.arange(r) if req_of_token is None else req_of_token   # token -> its batch row

        qsl32 = torch.from_numpy(qsl.astype(np.int32))
        seq32 = torch.from_numpy(seq.astype(np.int32))
        qsl_dev, seq_dev = self._to_device(qsl32), self._to_device(seq32)
        max_q, max_seq = (1 if t == r else int(q.max())), int(seq.max())
        metadata, split = {}, {}
        for gid, table in self.tables.items():
            bs = table.block_size
            if bs not in split:
                split[bs] = np.divmod(positions, bs)
            col, offset = split[bs]
            block_table = table.table[rows, : -(-max_seq // bs)]                 # fancy index: a fresh copy
            slots = block_table[token_index, col].astype(np.int64)
            slots *= bs
            slots += offset
            metadata[gid] = CommonAttentionMetadata(
                query_start_loc=qsl_dev, seq_lens=seq_dev, block_table=self._to_device(torch.from_numpy(block_table)),
                slot_mapping=self._to_device(torch.from_numpy(slots)), num_reqs=r, num_actual_tokens=t,
                max_query_len=max_q, max_seq_len=max_seq, causal=True, query_start_loc_cpu=qsl32,
                seq_lens_cpu=seq32)
        # one hook for every group: the lengths they share are checked once; the block ids' values are
        # not (they come from this runner's own pools)
        steps = prepare_steps(metadata, self.layouts, self.config.num_attention_heads, sliding_windows=self.windows,
                              backends=self.backends, device=self.device, check_values=False)

        if num_logits is None and pure_decode:
            m = None                                          # decodes: one logit row each
        elif num_logits is None:
            m = (pending == q).astype(np.int64)
        elif isinstance(num_logits, Mapping):
            m = np.array([int(num_logits.get(rid, 0)) for rid in req_ids], dtype=np.int64)
        else:
            m = np.full(r, int(num_logits), dtype=np.int64)
        if m is not None and bool(((m < 0) | (m > q)).any()):
            raise ValueError("num_logits must be between 0 and the scheduled tokens of each request")
        one_each = m is None or bool((m == 1).all())
        if one_each:
            logits_idx = qsl[1:] - 1
        else:
            first = np.repeat(qsl[1:] - m, m)                 # each request's first logits row, per row
            logits_idx = first + np.arange(int(m.sum())) - np.repeat(np.cumsum(m) - m, m)
        return StepBatch(req_ids=req_ids, query_lens=q, rows=rows,
                         input_ids=self._to_device(torch.from_numpy(ids)),
                         positions=self._to_device(torch.from_numpy(np.ascontiguousarray(positions))),
                         metadata=metadata, steps=steps, logits_indices=self._to_device(torch.from_numpy(logits_idx)),
                         num_logits=[1] * r if m is None else m.tolist(),
                         logits_all_rows=one_each and t == r)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self._on_cpu else tensor.to(self.device, non_blocking=True)

    def commit(self, batch: StepBatch) -> None:
        """Mark the batch's tokens computed; sliding groups free blocks that left every window."""
        rows = batch.rows
        computed = self._rows.computed[rows] + batch.query_lens
        self._rows.computed[rows] = computed
        for table in self.tables.values():
            if table.window is not None:
                for i in table.rows_to_release(rows, computed, self.rollback_tokens).tolist():
                    table.release_out_of_window(int(rows[i]), int(computed[i]), self.rollback_tokens)

    def attention_context(self, batch: StepBatch) -> AttentionContext:
        return AttentionContext(batch.steps, self.layer_to_group, self.kv_caches)

    def run(self, new_tokens: Mapping[Hashable, Sequence[int]],
            num_logits: int | Mapping[Hashable, int] | None = None) -> torch.Tensor:
        """Append ``new_tokens[req]`` to each request, then compute ALL its pending tokens in one
        forward (e.g. the last sampled token + k draft tokens = k + 1 verification positions).

        ``num_logits`` as in :meth:`prepare` (None: one, the last position). If the step fails
        (OutOfBlocksError) the appended tokens stay pending; nothing was computed.
        """
        for rid, tokens in new_tokens.items():
            if tokens:
                self.append_tokens(rid, tokens)
        schedule = {rid: self.requests[rid].num_pending for rid in new_tokens}
        return self.forward(schedule, num_logits)

    @torch.inference_mode()
    def forward(self, schedule: Mapping[Hashable, int],
                num_logits: int | Mapping[Hashable, int] | None = None) -> torch.Tensor:
        """Compute the scheduled tokens of each request in one forward; return their logits.

        Returns float32 logits [sum(num_logits), vocab]: for each request in schedule order, its
        ``num_logits`` LAST scheduled positions (see :meth:`prepare`). Raises OutOfBlocksError,
        changing nothing, when a request cannot get the blocks it needs.
        """
        start = time.perf_counter()
        batch = self.prepare(schedule, num_logits)
        hidden = self.model(batch.input_ids, batch.positions, self.attention_context(batch))
        logits = self.model.compute_logits(hidden if batch.logits_all_rows else hidden[batch.logits_indices]).float()
        self.commit(batch)
        self.num_steps += 1
        self.forward_time_s += time.perf_counter() - start
        return logits
