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
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence

import numpy as np
import torch

from .backends.base import AttentionConfig
from .backends.registry import ROLES, select_backend
from .kv_cache import AttentionSpec, BlockPool, BlockTables, KVCacheConfig, OutOfBlocksError
from .layout import KVCacheLayout
from .metadata import CommonAttentionMetadata
from .models.decoder import AttentionContext, CausalLM
from .models.loader import load_model

#: KV-cache memory when neither num_blocks nor memory_bytes is given.
DEFAULT_KV_MEMORY_BYTES = 64 * 2**20

__all__ = ["DEFAULT_KV_MEMORY_BYTES", "ModelRunner", "OutOfBlocksError", "Request", "StepBatch"]


@dataclass
class Request:
    """A request's state in one runner."""

    req_id: Hashable
    row: int                        # its row in every group's block tables
    tokens: list[int]               # every known token (prompt + generated so far)
    num_computed: int = 0           # tokens whose K/V are in the cache

    @property
    def num_pending(self) -> int:
        return len(self.tokens) - self.num_computed


@dataclass
class StepBatch:
    """The inputs of one forward: packed tokens, positions, per-group metadata, logits rows."""

    req_ids: list
    query_lens: list[int]
    input_ids: torch.Tensor                         # int64 [T]
    positions: torch.Tensor                         # int64 [T]
    metadata: dict[int, CommonAttentionMetadata]    # group id -> metadata
    logits_indices: torch.Tensor                    # int64 [L], rows of the packed tokens
    num_logits: list[int] = field(default_factory=list)


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
    """

    def __init__(self, model: CausalLM | str | os.PathLike, *, role: str = "target",
                 backend: str | Mapping[int, str] | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, block_size: int | Mapping[str, int] = 16,
                 num_blocks: int | Mapping[int, int] | None = None, memory_bytes: int | None = None,
                 max_num_batched_tokens: int = 512, rollback_tokens: int = 0, order: str = "NHD"):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if max_num_batched_tokens < 1 or rollback_tokens < 0:
            raise ValueError("max_num_batched_tokens must be >= 1 and rollback_tokens >= 0")
        self.device = torch.device(device)
        if isinstance(model, (str, os.PathLike)):
            model = load_model(model, self.device, dtype)
        self.model, self.config, self.role = model, model.config, role
        self.dtype = next(model.parameters()).dtype
        self.max_num_batched_tokens, self.rollback_tokens = max_num_batched_tokens, rollback_tokens
        if num_blocks is None and memory_bytes is None:
            memory_bytes = DEFAULT_KV_MEMORY_BYTES
        self.kv_cache_config = KVCacheConfig.build(self.attention_specs(block_size), num_blocks, memory_bytes, order)
        groups = self.kv_cache_config.groups
        self.layer_to_group = self.kv_cache_config.layer_to_group()
        self.layouts: dict[int, KVCacheLayout] = {g.group_id: lay for g, lay in zip(groups, self.kv_cache_config.layouts)}
        self.kv_caches = self.kv_cache_config.allocate_caches(self.device)
        self.backends = {g.group_id: self._select(g.group_id, g.spec, backend) for g in groups}
        self.pools = {g.group_id: BlockPool(self.layouts[g.group_id].num_blocks) for g in groups}
        self.tables = {g.group_id: BlockTables(g, self.pools[g.group_id]) for g in groups}
        self.requests: dict[Hashable, Request] = {}
        self._free_rows: list[int] = []
        self.num_steps = 0
        self.forward_time_s = 0.0

    # -- construction ----------------------------------------------------------------------
    def attention_specs(self, block_size: int | Mapping[str, int]) -> dict[str, AttentionSpec]:
        """One spec per attention layer (by layer name), block size chosen by attention kind."""
        cfg, specs = self.config, {}
        for i, attn in enumerate(self.model.attention_layers()):
            kind = "full" if attn.sliding_window is None else "sliding"
            bs = block_size[kind] if isinstance(block_size, Mapping) else block_size
            specs[attn.layer_name] = AttentionSpec(block_size=bs, num_kv_heads=cfg.num_key_value_heads,
                                                   head_size=cfg.head_dim, dtype=self.dtype,
                                                   sliding_window=attn.sliding_window)
        return specs

    def _select(self, group_id: int, spec: AttentionSpec, backend) -> str:
        requested = backend.get(group_id) if isinstance(backend, Mapping) else backend
        config = AttentionConfig.from_layout(self.layouts[group_id], self.device, spec.sliding_window,
                                             self.config.attn_softcap)
        return select_backend(config, self.role, requested)

    def describe(self) -> str:
        """One line per group: kind, sizes and the backend chosen."""
        return "\n".join(f"{line} backend={self.backends[g.group_id]}" for g, line in
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
        self.requests[req_id] = Request(req_id, row, tokens)

    def append_tokens(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        self.requests[req_id].tokens.extend(self._check_tokens(tokens, req_id))

    def remove_request(self, req_id: Hashable) -> None:
        """Forget a request and return all its blocks to the pools."""
        req = self.requests.pop(req_id)
        for table in self.tables.values():
            table.release(req.row)
        self._free_rows.append(req.row)

    def truncate(self, req_id: Hashable, length: int) -> None:
        """Roll a request back to its first ``length`` tokens (speculative rejection).

        Tokens past ``length`` are forgotten, ``num_computed`` drops to at most ``length`` and blocks
        past those covering ``length`` positions go back to the pools; slots of rolled-back
        positions are simply overwritten later. Sliding-window groups can roll back only as far
        as the blocks they still hold (``rollback_tokens``): ValueError otherwise, nothing changed.
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
        req.num_computed = computed
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
        """
        reqs = [self.requests[rid] for rid in schedule]
        qlens = [int(n) for n in schedule.values()]
        if not reqs:
            raise ValueError("empty schedule")
        for req, n in zip(reqs, qlens):
            if not 1 <= n <= req.num_pending:
                raise ValueError(f"request {req.req_id!r}: {n} tokens scheduled, {req.num_pending} pending")
        self._allocate(reqs, qlens)

        r = len(reqs)
        q = np.array(qlens, dtype=np.int64)
        ctx = np.fromiter((req.num_computed for req in reqs), dtype=np.int64, count=r)
        seq = ctx + q
        rows = np.fromiter((req.row for req in reqs), dtype=np.int64, count=r)
        qsl = np.zeros(r + 1, dtype=np.int64)
        np.cumsum(q, out=qsl[1:])
        t = int(qsl[-1])
        if t == r:                                            # all decodes
            req_of_token, positions = np.arange(r), ctx
            ids = [req.tokens[req.num_computed] for req in reqs]
        else:
            req_of_token = np.repeat(np.arange(r), q)
            positions = np.arange(t) - qsl[:-1][req_of_token] + ctx[req_of_token]
            ids = [tok for req, n in zip(reqs, qlens) for tok in req.tokens[req.num_computed:req.num_computed + n]]

        metadata = {gid: self._group_metadata(table, rows, qsl, seq, positions, req_of_token, max(qlens))
                    for gid, table in self.tables.items()}

        if num_logits is None:
            m = [1 if req.num_pending == n else 0 for req, n in zip(reqs, qlens)]
        elif isinstance(num_logits, Mapping):
            m = [int(num_logits.get(req.req_id, 0)) for req in reqs]
        else:
            m = [int(num_logits)] * r
        if any(not 0 <= mi <= n for mi, n in zip(m, qlens)):
            raise ValueError("num_logits must be between 0 and the scheduled tokens of each request")
        if all(mi == 1 for mi in m):
            logits_idx = qsl[1:] - 1
        else:
            logits_idx = np.concatenate([np.arange(qsl[i + 1] - mi, qsl[i + 1]) for i, mi in enumerate(m)]
                                        + [np.zeros(0, dtype=np.int64)])
        dev = self.device
        return StepBatch(req_ids=list(schedule), query_lens=qlens,
                         input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
                         positions=torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)).to(dev),
                         metadata=metadata, logits_indices=torch.from_numpy(logits_idx.astype(np.int64)).to(dev),
                         num_logits=m)

    def _allocate(self, reqs: list[Request], qlens: list[int]) -> None:
        """Allocate every scheduled request's new blocks, or raise for the first that cannot get
        them -- before allocating anything, so no request is changed by a failed step."""
        for gid, table in self.tables.items():
            free = table.pool.num_free
            for req, n in zip(reqs, qlens):
                need = table.blocks_needed(req.row, req.num_computed + n)
                if need > free:
                    raise OutOfBlocksError(req.req_id, gid, need, free, table.pool.num_blocks)
                free -= need
        for table in self.tables.values():
            for req, n in zip(reqs, qlens):
                table.ensure(req.row, req.num_computed + n, req.req_id)

    def _group_metadata(self, table: BlockTables, rows, qsl, seq, positions, req_of_token,
                        max_query_len: int) -> CommonAttentionMetadata:
        bs = table.block_size
        max_seq = int(seq.max())
        block_table = table.table[rows, : -(-max_seq // bs)]                # fancy index: a fresh copy
        slots = block_table[req_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        qsl_t = torch.from_numpy(qsl.astype(np.int32))
        seq_t = torch.from_numpy(seq.astype(np.int32))
        dev = self.device
        return CommonAttentionMetadata(
            query_start_loc=qsl_t.to(dev), seq_lens=seq_t.to(dev),
            block_table=torch.from_numpy(block_table).to(dev), slot_mapping=torch.from_numpy(slots).to(dev),
            num_reqs=len(rows), num_actual_tokens=int(qsl[-1]), max_query_len=max_query_len, max_seq_len=max_seq,
            causal=True, query_start_loc_cpu=qsl_t, seq_lens_cpu=seq_t)

    def attention_context(self, batch: StepBatch) -> AttentionContext:
        return AttentionContext(batch.metadata, self.layer_to_group, self.kv_caches, self.layouts, self.backends,
                                self.role)

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
        logits = self.model.compute_logits(hidden[batch.logits_indices]).float()
        for rid, n in zip(batch.req_ids, batch.query_lens):
            req = self.requests[rid]
            req.num_computed += n
            for table in self.tables.values():
                table.release_out_of_window(req.row, req.num_computed, self.rollback_tokens)
        self.num_steps += 1
        self.forward_time_s += time.perf_counter() - start
        return logits
