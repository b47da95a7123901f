"""The peers the device check times beside kvmulti, from the ``device_peers/`` bundle that
``scripts/build_device_peers.sh`` makes (it is never committed; the device tool carries it):

* ``vLLM-Triton``: vLLM's Triton ``unified_attention`` (decode and prefill), called as vLLM's
  TRITON_ATTN backend calls it (the split-softmax path for decode batches of at most
  ``128 // kv_heads`` sequences, 16 segments, its scratch allocated once);
* ``vLLM-Triton decode``: vLLM's ``decode_attention_fwd`` (decode only; splits as vLLM picks them);
* ``FlashInfer-FA2``: ``BatchDecodeWithPagedKVCacheWrapper`` (decode) and
  ``BatchPrefillWithPagedKVCacheWrapper(backend="fa2")`` (prefill);
* ``FlashInfer-FA3``: ``BatchPrefillWithPagedKVCacheWrapper(backend="fa3")`` for both (a decode
  batch is a prefill of one query row per request).

Every peer reads the kvmulti cache in place: K and V are ``cache[..., :D]`` and ``cache[..., D:]``
(FlashInfer on an HND cache: the same of ``cache.permute(0, 2, 1, 3)`` with ``kv_layout="HND"``).
:func:`prepare` does each peer's planning once (metadata, workspaces, FlashInfer's ``plan``), so
the call it returns launches the kernels only and can be captured in a CUDA graph. A peer that
does not load is reported by :func:`availability` with its error, never raised.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "device_peers"
PEERS = ("vLLM-Triton", "vLLM-Triton decode", "FlashInfer-FA2", "FlashInfer-FA3")
#: the peers that run each kind of problem
KINDS = {"vLLM-Triton": ("decode", "prefill"), "vLLM-Triton decode": ("decode",),
         "FlashInfer-FA2": ("decode", "prefill"), "FlashInfer-FA3": ("decode", "prefill")}
FLASHINFER_WORKSPACE_BYTES = 128 << 20
VLLM_SEGMENTS = 16                 # vLLM's split-softmax segments
VLLM_MIN_GRID_2D = 128             # vLLM's minimum 2D launch grid (sequences x kv heads)


@dataclass(frozen=True)
class PeerProblem:
    """One batch as the peers see it. ``q``: [tokens, q_heads, D]; ``cache``: a kvmulti cache of
    logical shape [blocks, block_size, kv_heads, 2D] (``order``: its physical order, NHD or HND);
    ``query_start_loc`` int32 [seqs + 1], ``seq_lens`` int32 [seqs] (keys per request, the new
    tokens included), ``block_table`` int32 [seqs, max_blocks]; ``scale``: the softmax scale."""

    q: torch.Tensor
    cache: torch.Tensor
    order: str
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int
    scale: float
    causal: bool = True

    @property
    def head_size(self) -> int:
        return self.q.shape[-1]

    @property
    def block_size(self) -> int:
        return self.cache.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.cache.shape[2]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V: zero-copy views [blocks, block_size, kv_heads, D] of the cache."""
        d = self.head_size
        return self.cache[..., :d], self.cache[..., d:]


# ------------------------------------------------------------------------------------ loading
def activate(bundle: Path = BUNDLE, scratch: Path | None = None) -> list[str]:
    """Make the bundle importable in this process: its wheels installed (pip, no index, no
    dependencies) into ``scratch`` (default: a temporary folder), that folder, ``bundle/site`` and
    ``bundle/vllm_triton`` appended to ``sys.path`` (packages this Python already has win), and
    FlashInfer told to load its prebuilt modules only (``FLASHINFER_DISABLE_JIT=1``, its workspace
    in ``scratch``). Returns what was added or the reasons parts are missing."""
    notes = []
    if not bundle.is_dir():
        return [f"no peer bundle at {bundle} (scripts/build_device_peers.sh makes it)"]
    scratch = scratch or Path(tempfile.mkdtemp(prefix="kvmulti_peers_"))
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    marker = scratch / "site" / ".kvmulti_installed"
    if wheels and not marker.exists():
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                               "--target", str(scratch / "site"), *map(str, wheels)], capture_output=True, text=True)
        if done.returncode == 0:
            marker.write_text("\n".join(w.name for w in wheels))
            notes.append(f"{len(wheels)} wheels installed into {scratch / 'site'}")
        else:
            notes.append(f"pip install of the bundle's wheels failed: {done.stderr[-600:]}")
    for path in (scratch / "site", bundle / "site", bundle / "vllm_triton"):
        if path.is_dir() and str(path) not in sys.path:
            sys.path.append(str(path))
            notes.append(f"{path} on sys.path")
    os.environ["FLASHINFER_DISABLE_JIT"] = "1"
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(scratch))
    importlib.invalidate_caches()
    return notes


@lru_cache(maxsize=None)
def _load(peer: str):
    """The peer's entry point module (raises ImportError and the like when it does not load)."""
    if peer == "vLLM-Triton":
        return importlib.import_module("vllm.v1.attention.ops.triton_unified_attention")
    if peer == "vLLM-Triton decode":
        return importlib.import_module("vllm.v1.attention.ops.triton_decode_attention")
    if peer in ("FlashInfer-FA2", "FlashInfer-FA3"):
        return importlib.import_module("flashinfer")
    raise KeyError(peer)


def load_error(peer: str) -> str | None:
    """None when ``peer`` imports, else the error's text."""
    try:
        _load(peer)
    except Exception as e:                               # recorded: a peer that does not load is not fatal
        return f"{type(e).__name__}: {e}"[:600]
    return None


def availability(bundle: Path = BUNDLE, scratch: Path | None = None) -> dict:
    """:func:`activate` the bundle, then ``{"bundle", "activate": notes, peer: {"loaded": bool,
    "error": str | None} for every peer}``."""
    result: dict = {"bundle": str(bundle), "activate": activate(bundle, scratch)}
    for peer in PEERS:
        error = load_error(peer)
        result[peer] = {"loaded": error is None, "error": error}
    return result


# ------------------------------------------------------------------------------------ calls
Call = Callable[[], object]


def prepare(peer: str, p: PeerProblem) -> tuple[Call, torch.Tensor]:
    """``peer``'s call on ``p`` (everything but the kernels done here, once) and its output
    buffer [tokens, q_heads, D]. Raises when the peer does not load or does not run this kind."""
    kind = "decode" if p.max_query_len == 1 else "prefill"
    if kind not in KINDS[peer]:
        raise ValueError(f"{peer} runs {KINDS[peer]} only, not {kind}")
    module = _load(peer)
    out = torch.empty_like(p.q)
    if peer == "vLLM-Triton":
        return _vllm_unified(module, p, out), out
    if peer == "vLLM-Triton decode":
        return _vllm_decode(module, p, out), out
    return _flashinfer(module, p, out, "fa3" if peer == "FlashInfer-FA3" else "fa2", kind), out


def _vllm_unified(module, p: PeerProblem, out: torch.Tensor) -> Call:
    k, v = p.kv()
    hq, dev = p.q.shape[1], p.q.device
    ones = torch.ones(1, dtype=torch.float32, device=dev).expand(p.num_seqs, p.num_kv_heads)
    threshold = VLLM_MIN_GRID_2D // p.num_kv_heads
    rows = threshold
    pad = 1 << (p.head_size - 1).bit_length()
    segm_out = torch.empty(rows, hq, VLLM_SEGMENTS, pad, dtype=torch.float32, device=dev)
    segm_max = torch.empty(rows, hq, VLLM_SEGMENTS, dtype=torch.float32, device=dev)
    segm_sum = torch.empty_like(segm_max)

    def call():
        module.unified_attention(
            q=p.q, k=k, v=v, out=out, cu_seqlens_q=p.query_start_loc, max_seqlen_q=p.max_query_len,
            seqused_k=p.seq_lens, max_seqlen_k=p.max_seq_len, softmax_scale=p.scale, causal=p.causal,
            window_size=(-1, -1), block_table=p.block_table, softcap=0, q_descale=None, k_descale=ones,
            v_descale=ones, seq_threshold_3D=threshold, num_par_softmax_segments=VLLM_SEGMENTS,
            softmax_segm_output=segm_out, softmax_segm_max=segm_max, softmax_segm_expsum=segm_sum)
    return call


def vllm_decode_splits(max_seq_len: int, multiprocessors: int) -> int:
    """vLLM's split count for decode_attention_fwd: min(next_pow2(max_seq_len // 512), 2 x SMs), >= 1."""
    n = max(max_seq_len // 512, 1)
    return max(min(1 << (n - 1).bit_length(), 2 * multiprocessors), 1)


def _vllm_decode(module, p: PeerProblem, out: torch.Tensor) -> Call:
    k, v = p.kv()
    hq, dev = p.q.shape[1], p.q.device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    splits = vllm_decode_splits(p.max_seq_len, sms)
    logits = torch.empty(p.num_seqs, hq, splits, p.head_size + 1, dtype=torch.float32, device=dev)
    lse = torch.empty(p.num_seqs, hq, dtype=torch.float32, device=dev)
    one = torch.ones((), dtype=torch.float32, device=dev)

    def call():
        module.decode_attention_fwd(p.q, k, v, out, lse, p.block_table, p.seq_lens, logits, splits, p.scale,
                                    page_size=p.block_size, k_scale=one, v_scale=one)
    return call


def paged_indices(p: PeerProblem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's page description of ``p``: ``indptr`` int32 [seqs + 1], ``indices`` int32 (the
    used blocks of each request, in order), ``last_page_len`` int32 [seqs] (1..block_size)."""
    lens = p.seq_lens.long().cpu()
    pages = (lens + p.block_size - 1) // p.block_size
    table = p.block_table.cpu()
    indices = torch.cat([table[i, :n] for i, n in enumerate(pages.tolist())]).to(torch.int32)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(pages, 0)
    last = ((lens - 1) % p.block_size + 1).to(torch.int32)
    dev = p.q.device
    return indptr.to(dev), indices.to(dev), last.to(dev)


def _flashinfer(module, p: PeerProblem, out: torch.Tensor, backend: str, kind: str) -> Call:
    if p.order == "HND":
        k, v = (t.permute(0, 2, 1, 3) for t in p.kv())     # [blocks, kv_heads, block_size, D]
    else:
        k, v = p.kv()
    dev, hq = p.q.device, p.q.shape[1]
    workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    indptr, indices, last = paged_indices(p)
    if kind == "decode" and backend == "fa2":
        wrapper = module.BatchDecodeWithPagedKVCacheWrapper(workspace, p.order, use_tensor_cores=False)
        wrapper.plan(indptr, indices, last, hq, p.num_kv_heads, p.head_size, p.block_size, pos_encoding_mode="NONE",
                     q_data_type=p.q.dtype, kv_data_type=p.cache.dtype, sm_scale=p.scale)
    else:
        wrapper = module.BatchPrefillWithPagedKVCacheWrapper(workspace, p.order, backend=backend)
        wrapper.plan(p.query_start_loc, indptr, indices, last, hq, p.num_kv_heads, p.head_size, p.block_size,
                     causal=p.causal, q_data_type=p.q.dtype, kv_data_type=p.cache.dtype, sm_scale=p.scale)

    def call():
        wrapper.run(p.q, (k, v), out=out)
    return call


def main(argv: list[str] | None = None) -> int:
    """``python -m devtools.device_peers [--bundle DIR] [--scratch DIR] [--json OUT]``: activate the
    bundle and print (and write) :func:`availability`'s JSON; exit 0 (a peer that does not load is
    a result, not a failure)."""
    import argparse
    import json
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--bundle", type=Path, default=BUNDLE)
    p.add_argument("--scratch", type=Path)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    result = availability(a.bundle, a.scratch)
    text = json.dumps(result, indent=1)
    if a.json:
        a.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
