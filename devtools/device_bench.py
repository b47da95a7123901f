"""Timings on a CUDA GPU, with CUDA events (``triton.testing.do_bench``, median), against ceilings
measured in the same run:

* the device's copy bandwidth: a 1 GiB device-to-device copy, counting bytes read plus written;
* dense bf16 matmul: 8192 x 8192 x 8192 on random data (torch / cuBLAS).

Shapes (:data:`SHAPES`; :data:`GPU`: 32 query / 8 KV heads, head 128, bf16, block 16, HND, a
shuffled block table): decode 32 x 4096, decode 1 x 32768, causal prefill 8 x 2048 and 1 x 8192
(no context). Implementations: ``TRITON`` (kvmulti's Triton backend), ``HIP`` (the HIP kernels
built with nvcc, :mod:`devtools.hip_on_cuda`), the peers of :mod:`devtools.device_peers` that
load (vLLM's Triton kernels, FlashInfer FA2 / FA3; each on the same cache, zero copy) and ``SDPA``
(torch's flash attention on contiguous K/V: the dense reference). Each kvmulti step is timed as a
layer calls it (``kvmulti.paged_attention`` with the ``prepare_step`` result and an ``out``
buffer), each peer's call with its planning done beforehand. The implementations alternate within
each of ``rounds`` rounds; the figure is the median of the rounds' medians.

Decode: % of the memory floor = (K/V read + query + out bytes) / measured copy bandwidth over the
measured time. Prefill: TFLOP/s of the causal attention's useful flops (4 * heads * head * the
causal (query, key) pairs) and their % of the measured matmul rate. Each implementation's output on
the timed shape is also compared with SDPA's (``max_abs_diff_vs_sdpa``). After the eager timings,
every implementation's call is captured in a CUDA graph and its replay timed (:func:`graph_rows`:
the GPU's time without the host's, the replayed output checked against SDPA's, or the reason the
call cannot be captured); a kvmulti backend that prepares steps for capture is captured from a step
prepared for the shape's bucket (:func:`capture_bucket`). Last, per decode shape, a ``layers``-layer
decode step over the same cache (one output buffer per layer), eager and replayed, for every
implementation (:func:`decode_step_rows`).

``--dry-run`` runs the same code on CPU tensors (:data:`DRY`: tiny shapes, the Triton kernels under
Triton's interpreter, :class:`devtools.device_runtime.StandInRuntime` for timing and "graphs").
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import kvmulti

from . import device_peers
from .device_runtime import CudaRuntime, StandInRuntime

COPY_BYTES = 1 << 30
MATMUL_N = 8192
DECODE_STEP_LAYERS = 32
Call = Callable[[], object]


@dataclass(frozen=True)
class Config:
    """The problem's fixed dimensions, dtype and device, and how much is timed."""

    hq: int = 32
    hkv: int = 8
    head: int = 128
    block: int = 16
    dtype: torch.dtype = torch.bfloat16
    order: str = "HND"
    device: str = "cuda"
    rounds: int = 3
    layers: int = DECODE_STEP_LAYERS


@dataclass(frozen=True)
class Shape:
    name: str
    kind: str            # "decode" | "prefill"
    seqs: int
    length: int          # keys per sequence (decode: context incl. the new token; prefill: prompt)

    @property
    def query_len(self) -> int:
        return 1 if self.kind == "decode" else self.length


GPU = Config()
SHAPES = (Shape("decode 32x4096", "decode", 32, 4096), Shape("decode 1x32768", "decode", 1, 32768),
          Shape("prefill 8x2048", "prefill", 8, 2048), Shape("prefill 1x8192", "prefill", 1, 8192))
#: the dry run: CPU tensors, fp32, shapes small enough for Triton's interpreter
DRY = Config(hq=4, hkv=2, head=16, block=4, dtype=torch.float32, device="cpu", rounds=1, layers=2)
DRY_SHAPES = (Shape("decode 2x8", "decode", 2, 8), Shape("prefill 1x8", "prefill", 1, 8))


def median_ms(fn: Call) -> float:
    """Median ms of ``fn`` on the GPU (:meth:`CudaRuntime.median_ms`)."""
    return CudaRuntime().median_ms(fn)


def copy_bandwidth(rt: CudaRuntime, cfg: Config) -> dict:
    """Device-to-device copy of COPY_BYTES: bytes read + written per second."""
    src = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device=cfg.device).normal_()
    dst = torch.empty_like(src)
    ms = rt.median_ms(lambda: dst.copy_(src))
    return {"bytes": 2 * COPY_BYTES, "ms": ms, "gb_per_s": 2 * COPY_BYTES / (ms * 1e-3) / 1e9}


def matmul_rate(rt: CudaRuntime, cfg: Config) -> dict:
    """bf16 MATMUL_N^3 matmul on random data: TFLOP/s."""
    a = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device=cfg.device)
    b = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device=cfg.device)
    ms = rt.median_ms(lambda: a @ b)
    return {"n": MATMUL_N, "ms": ms, "tflops": 2 * MATMUL_N ** 3 / (ms * 1e-3) / 1e12}


def shape_work(shape: Shape, cfg: Config = GPU) -> dict:
    """Bytes (decode floor) and useful flops (prefill) of one shape."""
    kv = shape.seqs * shape.length * cfg.hkv * 2 * cfg.head * cfg.dtype.itemsize
    q_out = 2 * shape.seqs * shape.query_len * cfg.hq * cfg.head * cfg.dtype.itemsize
    causal_pairs = shape.seqs * (shape.length * (shape.length + 1) // 2 if shape.kind == "prefill" else shape.length)
    return {"bytes": kv + q_out, "flops": 4 * cfg.hq * cfg.head * causal_pairs}


class Problem:
    """One shape's tensors: dense K/V [seqs, hkv, length, head] and the same data in a paged cache."""

    def __init__(self, shape: Shape, cfg: Config = GPU):
        self.shape, self.cfg = shape, cfg
        b, s, qlen, dev = shape.seqs, shape.length, shape.query_len, cfg.device
        self.k = torch.randn(b, cfg.hkv, s, cfg.head, dtype=cfg.dtype, device=dev)
        self.v = torch.randn(b, cfg.hkv, s, cfg.head, dtype=cfg.dtype, device=dev)
        self.q = torch.randn(b * qlen, cfg.hq, cfg.head, dtype=cfg.dtype, device=dev)
        blocks_per_seq = s // cfg.block
        self.layout = kvmulti.KVCacheLayout(num_blocks=b * blocks_per_seq, block_size=cfg.block,
                                            num_kv_heads=cfg.hkv, head_size=cfg.head, dtype=cfg.dtype,
                                            order=cfg.order)
        self.cache = self.layout.allocate(dev)
        table = torch.randperm(b * blocks_per_seq, device=dev).to(torch.int32).view(b, blocks_per_seq)
        pos = torch.arange(s, device=dev)
        slots = (table.long()[:, pos // cfg.block] * cfg.block + pos % cfg.block).reshape(-1)
        kvmulti.write_kv(self.k.transpose(1, 2).reshape(b * s, cfg.hkv, cfg.head),
                         self.v.transpose(1, 2).reshape(b * s, cfg.hkv, cfg.head), self.cache, self.layout, slots,
                         backend="TRITON")
        self.metadata = kvmulti.CommonAttentionMetadata.from_lens([qlen] * b, [s] * b, table, cfg.block, device=dev)

    def paged(self, backend, capture: bool = False) -> tuple[Call, torch.Tensor]:
        """A prepared layer call of ``backend`` (a name or a backend object) and its output buffer;
        ``capture``: the step prepared for this shape's :func:`capture_bucket`."""
        bucket = capture_bucket(self.shape) if capture else None
        step = kvmulti.prepare_step(self.metadata, self.layout, self.cfg.hq, backend=backend, capture=bucket)
        out = torch.empty_like(self.q)
        return (lambda: kvmulti.paged_attention(self.q, self.cache, self.layout, step, out=out)), out

    def peer_problem(self) -> device_peers.PeerProblem:
        """This batch as the peers see it (the same query and cache tensors)."""
        m = self.metadata
        return device_peers.PeerProblem(q=self.q, cache=self.cache, order=self.cfg.order,
                                        query_start_loc=m.query_start_loc, seq_lens=m.seq_lens,
                                        block_table=m.block_table, max_query_len=m.max_query_len,
                                        max_seq_len=m.max_seq_len, scale=self.layout.default_scale)

    def sdpa(self) -> tuple[Call, str]:
        """torch SDPA restricted to flash attention on contiguous K/V (GQA through enable_gqa, else K/V
        repeated to hq heads) and the variant used."""
        from torch.nn.attention import SDPBackend, sdpa_kernel
        b, qlen, hq, head = self.shape.seqs, self.shape.query_len, self.cfg.hq, self.cfg.head
        q = self.q.view(b, qlen, hq, head).transpose(1, 2)
        causal = self.shape.kind == "prefill"

        def gqa():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, self.k, self.v, is_causal=causal, enable_gqa=True)
        try:
            gqa()
            return gqa, "flash, enable_gqa"
        except RuntimeError:
            k, v = (t.repeat_interleave(hq // self.cfg.hkv, dim=1) for t in (self.k, self.v))

            def repeated():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            repeated()
            return repeated, f"flash, K/V repeated to {hq} heads ({hq // self.cfg.hkv}x the K/V bytes)"

    def sdpa_rows(self, result: torch.Tensor) -> torch.Tensor:
        """SDPA's [b, hq, qlen, head] output as the paged ops' [tokens, hq, head]."""
        return result.transpose(1, 2).reshape(-1, self.cfg.hq, self.cfg.head)

    def calls(self, implementations: dict[str, object], peers: tuple[str, ...], capture: bool = False
              ) -> tuple[dict[str, Call], dict[str, torch.Tensor], dict[str, str], dict[str, str]]:
        """Every implementation's call on this problem: (calls, output buffers, notes, errors by name).
        kvmulti's (``implementations``: name -> backend) first, then the ``peers`` that run this
        kind, then SDPA (its output: the call's return value, no buffer); ``capture``: kvmulti's
        steps prepared for capture where their backend supports it."""
        fns, outs, notes, errors = {}, {}, {}, {}
        for name, backend in implementations.items():
            try:
                fns[name], outs[name] = self.paged(backend, capture=capture and supports_capture(backend, self.cfg))
            except Exception as e:                    # recorded; the others still run
                errors[name] = _error(e)
        for peer in peers:
            if self.shape.kind not in device_peers.KINDS[peer]:
                continue
            try:
                fns[peer], outs[peer] = device_peers.prepare(peer, self.peer_problem())
            except Exception as e:
                errors[peer] = _error(e)
        try:
            fns["SDPA"], notes["SDPA"] = self.sdpa()
        except Exception as e:
            errors["SDPA"] = _error(e)
        return fns, outs, notes, errors


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:600]


def supports_capture(backend, cfg: Config) -> bool:
    """Whether ``backend`` prepares steps for graph capture (``prepare_step(capture=...)``)."""
    layout = kvmulti.KVCacheLayout(1, cfg.block, cfg.hkv, cfg.head, dtype=cfg.dtype, order=cfg.order)
    return kvmulti.resolve_backend(layout, cfg.device, backend=backend).supports_capture


def bench_shape(rt, shape: Shape, implementations: dict[str, object], peers: tuple[str, ...], ceilings: dict,
                cfg: Config = GPU) -> list[dict]:
    """Rows for one shape: each implementation's median ms (over ``cfg.rounds`` alternating rounds),
    its fraction of the measured floor / matmul rate and its max abs difference from SDPA."""
    problem = Problem(shape, cfg)
    work = shape_work(shape, cfg)
    fns, outs, notes, errors = problem.calls(implementations, peers)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(cfg.rounds):
        for name, fn in list(fns.items()):
            try:
                times[name].append(rt.median_ms(fn))
            except Exception as e:                    # recorded; the others still run
                errors[name] = _error(e)
                del fns[name]
    try:
        reference = problem.sdpa_rows(fns["SDPA"]()).float() if "SDPA" in fns else None
    except Exception:
        reference = None
    rows = []
    for name in [*implementations, *peers, "SDPA"]:
        if name not in fns and name not in errors:
            continue                                  # a peer that does not run this kind
        row = {"shape": shape.name, "impl": name, **work}
        if name in errors:
            rows.append(dict(row, error=errors[name]))
            continue
        ms = statistics.median(times[name])
        row.update(ms=ms, ms_rounds=times[name], note=notes.get(name, ""))
        if shape.kind == "decode":
            floor_ms = work["bytes"] / (ceilings["copy"]["gb_per_s"] * 1e9) * 1e3
            row.update(gb_per_s=work["bytes"] / (ms * 1e-3) / 1e9, floor_ms=floor_ms, fraction=floor_ms / ms)
        else:
            tflops = work["flops"] / (ms * 1e-3) / 1e12
            row.update(tflops=tflops, fraction=tflops / ceilings["matmul"]["tflops"])
        if reference is not None and name != "SDPA":
            row["max_abs_diff_vs_sdpa"] = float((outs[name].float() - reference).abs().max())
        rows.append(row)
    del problem
    rt.release()
    return rows


def graph_rows(rt, shape: Shape, implementations: dict[str, object], peers: tuple[str, ...],
               cfg: Config = GPU) -> list[dict]:
    """Per implementation: its call on ``shape`` captured in a graph and replayed (``graph_ms``; the
    replayed output checked against SDPA's eager one, ``graph_max_abs_diff_vs_sdpa``), or why it
    could not be captured (``graph_error``). kvmulti's steps are prepared for the shape's bucket
    where their backend supports it (``captured_step``)."""
    problem = Problem(shape, cfg)
    fns, outs, _, errors = problem.calls(implementations, peers, capture=True)
    reference = problem.sdpa_rows(fns["SDPA"]()).float() if "SDPA" in fns else None
    rows = []
    for name in [*implementations, *peers, "SDPA"]:
        if name not in fns and name not in errors:
            continue
        row: dict = {"shape": shape.name, "impl": name}
        if name in implementations:
            row["captured_step"] = "capture bucket" if supports_capture(implementations[name], cfg) else "plain"
        if name in errors:
            rows.append(dict(row, graph_error=errors[name]))
            continue
        try:
            if name == "SDPA":
                result: dict = {}
                replay = rt.capture(lambda: result.__setitem__("o", fns["SDPA"]()))
                row["graph_ms"] = rt.median_ms(replay)
                replay()
                rt.synchronize()
                got = problem.sdpa_rows(result["o"])
            else:
                replay = rt.capture(fns[name])
                row["graph_ms"] = rt.median_ms(replay)      # the GPU's time for the call, without the host's
                outs[name].zero_()
                replay()
                rt.synchronize()
                got = outs[name]
            if reference is not None:
                row["graph_max_abs_diff_vs_sdpa"] = float((got.float() - reference).abs().max())
        except Exception as e:                        # recorded; the others still run
            row["graph_error"] = _error(e)
        rows.append(row)
    del problem
    rt.release()
    return rows


def capture_bucket(shape: Shape) -> "kvmulti.CaptureBucket":
    """The capture bucket of one shape's batch: its requests, rows, query length and sequence length."""
    return kvmulti.CaptureBucket(max_num_seqs=shape.seqs, max_num_tokens=shape.seqs * shape.query_len,
                                 max_query_len=shape.query_len, max_seq_len=shape.length)


def layer_calls(problem: Problem, name: str, implementations: dict[str, object], layers: int
                ) -> tuple[list[Call], list[torch.Tensor]]:
    """``layers`` calls of ``name`` over ``problem``'s cache, one output buffer each: kvmulti's from one
    step (prepared for capture where its backend supports it), a peer's from one planning each."""
    if name in implementations:
        backend = implementations[name]
        bucket = capture_bucket(problem.shape) if supports_capture(backend, problem.cfg) else None
        step = kvmulti.prepare_step(problem.metadata, problem.layout, problem.cfg.hq, backend=backend, capture=bucket)
        outs = [torch.empty_like(problem.q) for _ in range(layers)]

        def call(out: torch.Tensor) -> Call:
            return lambda: kvmulti.paged_attention(problem.q, problem.cache, problem.layout, step, out=out)
        return [call(o) for o in outs], outs
    pairs = [device_peers.prepare(name, problem.peer_problem()) for _ in range(layers)]
    return [fn for fn, _ in pairs], [out for _, out in pairs]


def decode_step_rows(rt, shape: Shape, name: str, implementations: dict[str, object], cfg: Config = GPU) -> dict:
    """One layer and a ``cfg.layers``-layer decode step (the same cache per layer, an out buffer
    each) of ``name``: eager and replayed medians (``eager_layer_ms``, ``eager_step_ms``,
    ``graph_layer_ms``, ``graph_step_ms``), the replayed step against ``layers`` replayed layers
    (``graph_step_vs_layers``), the replayed output against the eager one; or ``error``."""
    problem = Problem(shape, cfg)
    row: dict = {"shape": shape.name, "impl": name, "layers": cfg.layers}
    try:
        calls, outs = layer_calls(problem, name, implementations, cfg.layers)

        def decode_step() -> None:
            for fn in calls:
                fn()
        row["eager_layer_ms"], row["eager_step_ms"] = rt.median_ms(calls[0]), rt.median_ms(decode_step)
        eager = outs[-1].clone()
        layer_replay, step_replay = rt.capture(calls[0]), rt.capture(decode_step)
        row["graph_layer_ms"], row["graph_step_ms"] = rt.median_ms(layer_replay), rt.median_ms(step_replay)
        row["graph_step_vs_layers"] = row["graph_step_ms"] / (cfg.layers * row["graph_layer_ms"])
        outs[-1].zero_()
        step_replay()
        rt.synchronize()
        row["graph_max_abs_diff_vs_eager"] = float((outs[-1].float() - eager.float()).abs().max())
    except Exception as e:                            # recorded; the others still run
        row["error"] = _error(e)
    del problem
    rt.release()
    return row


def run(implementations: dict[str, object], shapes: tuple[Shape, ...] = SHAPES, peers: tuple[str, ...] = (),
        progress: Callable[[dict], None] | None = None, cfg: Config = GPU, rt=None) -> dict:
    """``{"ceilings": {"copy", "matmul"}, "rows": [...], "graphs": [...], "decode_steps": [...]}``;
    ``implementations``: kvmulti's, name -> backend (a name or object); ``peers``: the
    :mod:`devtools.device_peers` names timed beside them and SDPA. ``graphs``: :func:`graph_rows` of
    every shape, after all eager timings (a failed capture cannot disturb them); ``decode_steps``:
    :func:`decode_step_rows` of every decode shape and implementation. ``progress`` gets the result
    so far after each shape. ``rt``: a :mod:`devtools.device_runtime` runtime (default CUDA; the
    stand-in measures no ceilings)."""
    rt = rt or CudaRuntime()
    ceilings = ({"copy": copy_bandwidth(rt, cfg), "matmul": matmul_rate(rt, cfg)} if rt.captures else
                {"copy": {"gb_per_s": 1.0}, "matmul": {"tflops": 1.0}})
    result: dict = {"ceilings": ceilings, "peers": list(peers), "rows": [], "graphs": [], "decode_steps": []}
    rt.release()
    for shape in shapes:
        try:
            result["rows"] += bench_shape(rt, shape, implementations, peers, result["ceilings"], cfg)
        except Exception as e:                        # recorded; the next shape still runs
            result["rows"].append({"shape": shape.name, "impl": "all", "error": _error(e)})
        if progress:
            progress(result)
    for shape in shapes:
        try:
            result["graphs"] += graph_rows(rt, shape, implementations, peers, cfg)
        except Exception as e:                        # recorded; the next shape still runs
            result["graphs"].append({"shape": shape.name, "impl": "all", "graph_error": _error(e)})
        if progress:
            progress(result)
    for shape in (s for s in shapes if s.kind == "decode"):
        for name in [*implementations, *(p for p in peers if "decode" in device_peers.KINDS[p])]:
            result["decode_steps"].append(decode_step_rows(rt, shape, name, implementations, cfg))
        if progress:
            progress(result)
    return result


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    from pathlib import Path
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, required=True, help="write the result here")
    p.add_argument("--library", help="the nvcc-built HIP library (absent: HIP is not timed)")
    p.add_argument("--peers", type=Path, help="the device_peers/ bundle (absent: no peers are timed)")
    p.add_argument("--peers-scratch", type=Path, help="where the bundle's wheels are installed (default: a temp dir)")
    p.add_argument("--dry-run", action="store_true", help="CPU tensors, tiny shapes, Triton's interpreter")
    a = p.parse_args(argv)
    implementations: dict[str, object] = {"TRITON": "TRITON"}
    if a.library:
        from .hip_on_cuda import NvidiaHipBackend
        implementations["HIP"] = NvidiaHipBackend(Path(a.library))
    peers: tuple[str, ...] = ()
    unavailable = {}
    if a.peers:
        found = device_peers.availability(a.peers, a.peers_scratch)
        peers = tuple(peer for peer in device_peers.PEERS if found[peer]["loaded"])
        unavailable = {peer: found[peer]["error"] for peer in device_peers.PEERS if not found[peer]["loaded"]}
    cfg, shapes, rt = (DRY, DRY_SHAPES, StandInRuntime()) if a.dry_run else (GPU, SHAPES, CudaRuntime())

    def write(r: dict) -> None:
        a.json.write_text(json.dumps(dict(r, unavailable_peers=unavailable), indent=1))
    result = run(implementations, shapes, peers, progress=write, cfg=cfg, rt=rt)
    write(result)
    return 0 if not any("error" in r for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
