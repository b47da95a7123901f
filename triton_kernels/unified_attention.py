"""Paged attention over the canonical kvmulti KV-cache layout, in Triton.

Two kernels serve every batch:

* ``unified_attention_kernel``: ONE launch for a mixed batch (prefill, chunked prefill, decode,
  multi-token verification). Grid ``(q_blocks, num_kv_heads, num_partitions)``. A program owns
  ``block_q`` consecutive new tokens of one request and all ``G = Hq // Hkv`` query heads that
  share one KV head, packed as the ``BLOCK_M = block_q * G`` (padded to a power of two) rows of the
  tile, so each K/V tile is loaded once for the whole group. The program finds its request by a
  binary search over ``query_start_loc`` (request ``i``'s q-blocks start at program
  ``query_start_loc[i] // block_q + i``). It walks the keys in tiles of ``TILE_N`` positions;
  per position it computes block id (through the block table) and offset in the block, so a tile
  never assumes ``TILE_N == block_size`` and any block size >= 1 works. A tile that lies in one
  block or covers ``TABLE_READS`` (<= 8) whole blocks reads the table once per block, as scalars
  (uniform registers; 0: one read per key position). Keys are addressed
  through the cache's named strides (block, token, head; content stride 1), so both NHD and HND
  caches are read in place. Causal masking uses positions (a request's new tokens are its last
  ``query_len`` positions; ``CAUSAL=False``: every row sees all ``seq_len`` keys of its request,
  encoder-only attention; with a window ``w`` only keys with ``|q_pos - k_pos| < w``); with a
  sliding window whole tiles before the window are skipped and positions before it are never
  loaded (their block-table entries may be garbage). Softcap is
  ``c * tanh(s / c)``; accumulation is fp32 (online softmax), fp32 inputs use exact ("ieee") dots.
  Head sizes are padded to powers of two inside the kernel and masked.
* Memory safety: metadata values are not trusted. ``num_rows`` (query/output rows the kernel may
  touch), ``num_blocks`` and the block table's ``table_rows`` x ``table_cols`` are passed in; a
  request whose rows leave ``[0, num_rows)`` is skipped, keys stop at the table's width, a request
  without a table row sees no keys, and a block id outside ``[0, num_blocks)`` is a masked key.
* Block size, head sizes, G, ``block_q``, the sliding window, the softcap and the cache's named
  strides are constexprs (fixed per
  model shape, so one specialisation per model): the per-key block/offset split is a shift and a
  mask for power-of-two block sizes, and the scalar registers they would hold are free (gfx942
  prefill spilled SGPRs with them as arguments).
* Prefill (``PREFILL=True``, the tiles of ``launch.prefill_tiles``: 64-128 rows against 32-64 keys
  on the matrix units): the key range is walked in three loops, each a whole number of tiles: the
  tiles before the window start of the q-block's last row (masked), the tiles every row sees whole
  (no per-score mask: only keys in blocks outside the cache are masked, per key), and the tiles from
  the causal (non-causal with a window: window) end of the q-block's first row on (masked). Tiles
  past that end of the last row or wholly before the window start of the first row are never loaded. Scores are kept
  in log2 units (log2(e) folded into the scale) and the softmax runs on ``exp2``.
* Split-KV (``SPLIT=True``): the same kernel with the context cut in partitions of
  ``PART_SIZE`` positions (grid dim 2; the last one runs to the request's end); each program writes its unnormalised partial output,
  running max and sum to a fp32 workspace, and ``reduce_partitions_kernel`` combines them.

* Attention sinks (``SINKS``): query head h's fp32 logit ``sinks[h]`` joins each row's softmax
  denominator once, where the row is normalised (the single pass's store, or the partition
  reduction: never per partition), as ``exp(sink - m)`` in the running max's units; it adds no value.

* ALiBi (``ALIBI``): query head h's fp32 slope times (key position - query position) joins every
  score after scale and softcap, in the scores' units; partitions merge as without it.

* fp8 caches (``FP8`` != 0; kvmulti/fp8.py): the cache arrives as its uint8 bytes; each K/V tile
  is decoded in registers (``fp8_decode``, exact) to the query's dtype (every fp8 value is exact
  in fp16 and bf16), so the dots are those of a query-dtype cache holding the unscaled values. The
  program's KV head has one ``k_scale`` and one ``v_scale``, read at ``kvh * stride_ks`` /
  ``kvh * stride_vs`` (stride 0: one per-tensor scale for every head, as an engine's ``[]`` scale
  tensor is passed, uncopied): ``k_scale`` joins the softmax scale and ``v_scale`` multiplies the
  fp32 accumulator before it is stored.

``DOT_F32`` exists for the Triton interpreter only (TRITON_INTERPRET=1), whose ``tl.dot`` on
bf16 operands is wrong (numpy has no bf16): the operands are rounded to their real dtype first
and then widened to fp32, so the products equal those of a bf16 tensor-core dot.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8 import fp8_decode

# Row max / row sum as ``tl.reduce`` over Triton's own combine functions: exactly what tl.max /
# tl.sum lower to for fp32 inputs; zeros as tl.full. Not tl.max / tl.sum / tl.zeros themselves:
# those are @triton.jit functions of triton.language, and when triton was imported before
# TRITON_INTERPRET=1 was set (importing kvmulti imports torch's custom-op machinery, which imports
# triton) the interpreter cannot call them. The kernels below use only builtins and these.
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine
_LOG2E = tl.constexpr(1.4426950408889634)       # scores in log2 units: exp2 in the softmax


@triton.jit
def _table_entry(bt_row, stride_bn, first, SPAN: tl.constexpr, k_lo, k_end, BLOCK_SIZE: tl.constexpr):
    """The block-table entry of the block holding key position ``first`` (a scalar), read only when
    the keys [first, first + SPAN) meet [k_lo, k_end); else -1."""
    return tl.load(bt_row + (first // BLOCK_SIZE) * stride_bn, mask=(first < k_end) & (first + SPAN > k_lo),
                   other=-1)


@triton.jit
def _kv_tile(acc, m_i, l_i, q, q_pos, start, k_lo, k_end, kv_ptr, bt_row, stride_bn, head_off, num_blocks,
             qk_scale, q_ptr,
             STRIDE_CB: tl.constexpr, STRIDE_CT: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
             BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_SIZE_V: tl.constexpr, TILE_N: tl.constexpr,
             HEAD_PAD: tl.constexpr, HEAD_PAD_V: tl.constexpr, DOT_F32: tl.constexpr, FP8: tl.constexpr,
             TABLE_READS: tl.constexpr, MASKED: tl.constexpr, LOG2: tl.constexpr, CAUSAL: tl.constexpr = True,
             slope=None, ALIBI: tl.constexpr = False):
    """One key tile [start, start + TILE_N) folded into the online softmax; ``LOG2``: scores and
    ``m_i`` in log2 units (the scale folds log2(e), the softmax runs on exp2), else natural units.
    Keys outside [k_lo, k_end) or in a block outside the cache are masked. ``MASKED``: also those a row
    cannot see (causal unless not ``CAUSAL`` / window), one compare per score; otherwise the caller guarantees every key
    of the tile is in range and visible to every row, and the mask is per key. ``ALIBI``: each row's
    scores gain ``slope * (k_pos - q_pos)`` (``slope`` [BLOCK_M], natural units) after softcap."""
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_SIZE
    offs_dv = tl.arange(0, HEAD_PAD_V)
    dv_ok = offs_dv < HEAD_SIZE_V
    k_pos = start + offs_n
    in_range = (k_pos >= k_lo) & (k_pos < k_end)     # never touch table entries outside [k_lo, k_end)
    if TABLE_READS > 0:
        # The tile lies in one block or covers TABLE_READS whole ones: one scalar table read per
        # block (a uniform value) instead of one per key position.
        SPAN: tl.constexpr = TILE_N // TABLE_READS
        blk = _table_entry(bt_row, stride_bn, start, SPAN, k_lo, k_end, BLOCK_SIZE)
        for j in tl.static_range(1, TABLE_READS):
            blk = tl.where(offs_n >= j * SPAN,
                           _table_entry(bt_row, stride_bn, start + j * SPAN, SPAN, k_lo, k_end, BLOCK_SIZE), blk)
    else:
        blk = tl.load(bt_row + (k_pos // BLOCK_SIZE) * stride_bn, mask=in_range, other=0)
    # A block id outside the cache: a masked key. (A scalar blk goes through tl.where: the
    # interpreter cannot & a scalar mask with a vector one.)
    if TABLE_READS == 1:
        k_ok = tl.where((blk >= 0) & (blk < num_blocks), in_range, False)
    else:
        k_ok = in_range & (blk >= 0) & (blk < num_blocks)
    off = blk.to(tl.int64) * STRIDE_CB + (k_pos % BLOCK_SIZE).to(tl.int64) * STRIDE_CT + head_off
    k = tl.load(kv_ptr + off[None, :] + offs_d[:, None], mask=d_ok[:, None] & k_ok[None, :], other=0)
    v = tl.load(kv_ptr + off[:, None] + HEAD_SIZE + offs_dv[None, :], mask=k_ok[:, None] & dv_ok[None, :],
                other=0)
    if FP8 > 0:
        k = fp8_decode(k, FP8).to(q_ptr.dtype.element_ty)
        v = fp8_decode(v, FP8).to(q_ptr.dtype.element_ty)
    if DOT_F32:
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision="ieee")                  # [BLOCK_M, TILE_N], fp32
    units: tl.constexpr = _LOG2E if LOG2 else 1.0
    if SOFTCAP > 0:
        # softcap * tanh(s / softcap), tanh via exp(-2|x|): no overflow, exact sign.
        s = s * qk_scale
        e = tl.exp(-2.0 * tl.abs(s / SOFTCAP))
        t = (1.0 - e) / (1.0 + e)
        s = (SOFTCAP * units) * tl.where(s < 0, -t, t)
    elif LOG2:
        s = s * (qk_scale * units)
    else:
        s = s * qk_scale
    if ALIBI:
        s = s + (slope * units)[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
    if MASKED:
        # One compare per score: a masked key gets a position no row reaches. Rows past the tile's
        # (not row_ok) are never stored, and their finite scores harm nothing.
        k_vis = tl.where(k_ok, k_pos, 2147483647)
        if CAUSAL:
            visible = k_vis[None, :] <= q_pos[:, None]
        else:
            visible = (k_vis[None, :] < 2147483647) & (q_pos[:, None] >= 0)
        if WINDOW > 0:
            visible = visible & ((q_pos[:, None] - k_pos[None, :]) < WINDOW)
            if not CAUSAL:   # non-causal rows see the window on both sides
                visible = visible & ((k_pos[None, :] - q_pos[:, None]) < WINDOW)
        s = tl.where(visible, s, float("-inf"))
    else:
        s = tl.where(k_ok[None, :], s, float("-inf"))        # a block id outside the cache: a masked key

    m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)      # a row with nothing visible yet
    if LOG2:
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
    else:
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
    l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
    p_dot = p.to(v.dtype)
    if DOT_F32:
        p_dot = p_dot.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p_dot, v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def unified_attention_kernel(
    q_ptr, kv_ptr, out_ptr,
    qsl_ptr, seq_lens_ptr, block_table_ptr,
    part_acc_ptr, part_ml_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr, alibi_ptr,
    scale,
    num_reqs, num_q_heads, num_parts,
    num_rows, num_blocks, table_rows, table_cols,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_bt, stride_bn, stride_ks, stride_vs,
    STRIDE_CB: tl.constexpr, STRIDE_CT: tl.constexpr, STRIDE_CH: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    NUM_QPK: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_SIZE_V: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, HEAD_PAD: tl.constexpr, HEAD_PAD_V: tl.constexpr,
    SPLIT: tl.constexpr, PART_SIZE: tl.constexpr, DOT_F32: tl.constexpr, FP8: tl.constexpr,
    TABLE_READS: tl.constexpr, PREFILL: tl.constexpr, SINKS: tl.constexpr = False, CAUSAL: tl.constexpr = True,
    ALIBI: tl.constexpr = False,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)

    # The request of this program: the largest i with query_start_loc[i] // block_q + i <= pid
    # (binary search over query_start_loc; request i's q-blocks are programs
    # query_start_loc[i] // block_q + i ... + ceil(query_len_i / block_q) - 1).
    req = num_reqs * 0
    hi = num_reqs - 1
    while req < hi:
        mid = (req + hi + 1) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= pid:
            req = mid
        else:
            hi = mid - 1
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + req)
    # Memory safety: metadata is not trusted. A request whose rows leave [0, num_rows) is skipped.
    if (q_block < 0) | (q_block * BLOCK_Q >= q_len) | (q_start < 0) | (q_start > num_rows - q_len):
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    # Rows of the tile: (new token, query head of this KV head) pairs.
    offs_m = tl.arange(0, BLOCK_M)
    q_local = q_block * BLOCK_Q + offs_m // NUM_QPK
    head = kvh * NUM_QPK + offs_m % NUM_QPK
    row_ok = (offs_m < BLOCK_Q * NUM_QPK) & (q_local < q_len)
    q_pos = ctx_len + q_local
    tok = (q_start + q_local).to(tl.int64)

    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_SIZE
    offs_dv = tl.arange(0, HEAD_PAD_V)
    dv_ok = offs_dv < HEAD_SIZE_V

    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    qk_scale = scale
    if FP8 > 0:
        qk_scale = scale * tl.load(k_scale_ptr + kvh * stride_ks)
    slope = tl.full([BLOCK_M], 0.0, tl.float32)
    if ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0)

    # Keys this program can need: causal end of its last row (non-causal: all seq_len, or the window
    # end of its last row), window start of its first row.
    last_local = tl.minimum(q_len, (q_block + 1) * BLOCK_Q) - 1
    k_end = ctx_len + last_local + 1
    if not CAUSAL:
        k_end = seq_len
        if WINDOW > 0:
            k_end = tl.minimum(seq_len, ctx_len + last_local + WINDOW)
    k_lo = num_reqs * 0
    if WINDOW > 0:
        k_lo = tl.maximum(ctx_len + q_block * BLOCK_Q - WINDOW + 1, 0)
    if SPLIT:
        # the last partition runs to the request's end: a launch planned for fewer partitions than
        # the request spans (a captured step whose contexts outgrew its bucket) still reads every key
        k_lo = tl.maximum(k_lo, part * PART_SIZE)
        k_end = tl.where(part + 1 < num_parts, tl.minimum(k_end, (part + 1) * PART_SIZE), k_end)
    # Never past the block table's width; a request without a table row sees no keys.
    k_end = tl.minimum(k_end, tl.where(req < table_rows, table_cols * BLOCK_SIZE, 0))
    tile_start = (k_lo // TILE_N) * TILE_N          # whole tiles before the window are skipped

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_PAD_V], 0.0, tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    head_off = kvh.to(tl.int64) * STRIDE_CH

    if PREFILL:
        # Tiles every row sees whole (after the window start of the tile's last row, up to the causal
        # end of its first row) run without a per-score mask; the tiles before them (window) and after
        # them (the diagonal) are masked. [tile_start, full_lo) masked, [full_lo, full_hi) whole,
        # [full_hi, k_end) masked; all three start on multiples of TILE_N.
        full_lo = tile_start
        if (WINDOW > 0) | SPLIT:
            lo = k_lo
            if WINDOW > 0:
                lo = tl.maximum(lo, ctx_len + last_local - WINDOW + 1)
            full_lo = tl.maximum(tile_start, ((lo + TILE_N - 1) // TILE_N) * TILE_N)
            for start in range(tile_start, tl.minimum(full_lo, k_end), TILE_N):
                acc, m_i, l_i = _kv_tile(acc, m_i, l_i, q, q_pos, start, k_lo, k_end, kv_ptr, bt_row, stride_bn,
                                         head_off, num_blocks, qk_scale, q_ptr, STRIDE_CB, STRIDE_CT, WINDOW,
                                         SOFTCAP, BLOCK_SIZE, HEAD_SIZE, HEAD_SIZE_V, TILE_N, HEAD_PAD, HEAD_PAD_V,
                                         DOT_F32, FP8, TABLE_READS, True, PREFILL, CAUSAL, slope, ALIBI)
        seen_by_all = k_end
        if CAUSAL:
            seen_by_all = tl.minimum(ctx_len + q_block * BLOCK_Q + 1, k_end)
        elif WINDOW > 0:   # the window end of the first row
            seen_by_all = tl.minimum(ctx_len + q_block * BLOCK_Q + WINDOW, k_end)
        full_hi = tl.maximum(full_lo, (seen_by_all // TILE_N) * TILE_N)
        for start in range(full_lo, full_hi, TILE_N):
            acc, m_i, l_i = _kv_tile(acc, m_i, l_i, q, q_pos, start, k_lo, k_end, kv_ptr, bt_row, stride_bn,
                                     head_off, num_blocks, qk_scale, q_ptr, STRIDE_CB, STRIDE_CT, WINDOW, SOFTCAP,
                                     BLOCK_SIZE, HEAD_SIZE, HEAD_SIZE_V, TILE_N, HEAD_PAD, HEAD_PAD_V, DOT_F32, FP8,
                                     TABLE_READS, False, PREFILL, CAUSAL, slope, ALIBI)
        tile_start = full_hi
    for start in range(tile_start, k_end, TILE_N):
        acc, m_i, l_i = _kv_tile(acc, m_i, l_i, q, q_pos, start, k_lo, k_end, kv_ptr, bt_row, stride_bn, head_off,
                                 num_blocks, qk_scale, q_ptr, STRIDE_CB, STRIDE_CT, WINDOW, SOFTCAP, BLOCK_SIZE,
                                 HEAD_SIZE, HEAD_SIZE_V, TILE_N, HEAD_PAD, HEAD_PAD_V, DOT_F32, FP8, TABLE_READS,
                                 True, PREFILL, CAUSAL, slope, ALIBI)

    if FP8 > 0:
        acc = acc * tl.load(v_scale_ptr + kvh * stride_vs)
    if SPLIT:
        row = (tok * num_q_heads + head) * num_parts + part
        tl.store(part_acc_ptr + row[:, None] * HEAD_PAD_V + offs_dv[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)
    else:
        if SINKS:   # m_i is in log2 units on the prefill loop (PREFILL), natural units otherwise
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0)
            if PREFILL:
                l_i = l_i + tl.exp2(sink * _LOG2E - m_i)
            else:
                l_i = l_i + tl.exp(sink - m_i)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])


@triton.jit
def reduce_partitions_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, sinks_ptr,
    num_q_heads, num_parts,
    stride_ot, stride_oh, stride_od,
    HEAD_SIZE_V: tl.constexpr, HEAD_PAD_V: tl.constexpr, PART_CHUNK: tl.constexpr, SINKS: tl.constexpr = False,
):
    """out[t, h] = sum_p exp(m_p - M) acc_p / (sum_p exp(m_p - M) l_p [+ exp(sinks[h] - M)]), over the
    partitions (natural units: the split path never takes the prefill loop)."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (tok * num_q_heads + head) * num_parts
    offs_dv = tl.arange(0, HEAD_PAD_V)
    offs_p = tl.arange(0, PART_CHUNK)
    m_run = tl.reduce(tl.full([PART_CHUNK], float("-inf"), tl.float32), 0, _MAX)
    l_run = tl.reduce(tl.full([PART_CHUNK], 0.0, tl.float32), 0, _SUM)
    o = tl.full([HEAD_PAD_V], 0.0, tl.float32)
    for p0 in range(0, num_parts, PART_CHUNK):
        p = p0 + offs_p
        p_ok = p < num_parts
        m = tl.load(part_ml_ptr + (base + p) * 2, mask=p_ok, other=float("-inf"))
        l = tl.load(part_ml_ptr + (base + p) * 2 + 1, mask=p_ok, other=0.0)
        m_new = tl.maximum(m_run, tl.reduce(m, 0, _MAX))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_run - m_use)
        w = tl.exp(m - m_use)
        l_run = l_run * alpha + tl.reduce(l * w, 0, _SUM)
        a = tl.load(part_acc_ptr + (base + p)[:, None] * HEAD_PAD_V + offs_dv[None, :], mask=p_ok[:, None],
                    other=0.0)
        o = o * alpha + tl.reduce(a * w[:, None], 0, _SUM)
        m_run = m_new
    if SINKS:
        l_run = l_run + tl.exp(tl.load(sinks_ptr + head) - m_run)
    o = o / tl.where(l_run == 0.0, 1.0, l_run)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_dv * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=offs_dv < HEAD_SIZE_V)
