"""SLM bytes and barriers of the SYCL attention kernels, counted from their loop structure.

Every local-memory access a work-item issues is counted at its size (no broadcast or bank
merging), per work-group. ``before_*`` is the v1 kernel (git 5778bf1, sycl/kernels.cpp: fp32 K/V
staging in SLM, KC = 32 keys per chunk, 5 group_barriers per chunk); ``after_*`` is v2 (K/V in
registers, one merge through SLM per pass of RB rows). sycl/README.md quotes these numbers;
tests/test_sycl_backend.py checks the >= 4x claims.
"""

from __future__ import annotations

F32, I64 = 4, 8


def before_slm_bytes_per_chunk(rows: int, d: int, dv: int, kc: int = 32) -> int:
    """SLM bytes one v1 work-group moves per chunk of kc keys (all kc keys visible)."""
    offsets = kc * I64                               # loff[j] written
    stage_k = kc * d * (I64 + F32)                   # each K element: read loff[j], write k_lm
    stage_v = kc * dv * (I64 + F32)                  # each V element: read loff[j], write v_lm
    scores = rows * kc * (d * 2 * F32 + F32)         # q_lm and k_lm reads per dot, s_lm write
    softmax = rows * (3 * kc * F32 + 5 * F32)        # two passes over s_lm + p write; m, l, alpha
    pv = rows * dv * (F32 + kc * 2 * F32)            # alpha, then p and v_lm per key
    return offsets + stage_k + stage_v + scores + softmax + pv


def before_offset_bytes_per_chunk(d: int, dv: int, kc: int = 32) -> int:
    """The part of before_slm_bytes_per_chunk that is the int64 key-offset table."""
    return kc * I64 + kc * (d + dv) * I64


def after_slm_bytes_per_pass(rows: int, dv: int, wg: int = 128, sg: int = 16) -> int:
    """SLM bytes one v2 work-group moves per pass (rows <= RB), whatever the number of keys."""
    nsg = wg // sg
    writes = nsg * rows * (dv * F32 + 2 * F32)       # each sub-group's accumulator, max, sum
    reads = rows * dv * nsg * (F32 + 3 * F32)        # per output element: max pass, then max, sum, acc
    return writes + reads


def kv_bytes(keys: int, d: int, dv: int, elem: int) -> int:
    return keys * (d + dv) * elem


BEFORE_BARRIERS_PER_CHUNK = 5
AFTER_BARRIERS_PER_PASS = 1      # + 1 between passes when a tile has more than RB rows


def summary(rows: int = 4, d: int = 128, dv: int = 128, elem: int = 2, span: int = 512) -> dict[str, float]:
    """Per-KV-byte SLM traffic and barriers per 32 keys, before/after, for one work-group that sees
    ``span`` keys (512: a split-KV partition of the decode case; 32: the worst case, one chunk)."""
    chunks = -(-span // 32)
    before = before_slm_bytes_per_chunk(rows, d, dv) * chunks / kv_bytes(span, d, dv, elem)
    before_no_off = (before_slm_bytes_per_chunk(rows, d, dv) - before_offset_bytes_per_chunk(d, dv)) * chunks \
        / kv_bytes(span, d, dv, elem)
    after = after_slm_bytes_per_pass(rows, dv) / kv_bytes(span, d, dv, elem)
    return {"slm_per_kv_byte_before": before, "slm_per_kv_byte_before_without_offsets": before_no_off,
            "slm_per_kv_byte_after": after, "barriers_per_32_keys_before": BEFORE_BARRIERS_PER_CHUNK,
            "barriers_per_32_keys_after": AFTER_BARRIERS_PER_PASS / chunks}


if __name__ == "__main__":
    for span in (32, 512, 4096):
        print(span, {k: round(v, 3) for k, v in summary(span=span).items()})
