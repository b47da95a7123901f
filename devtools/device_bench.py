"""Timings on a CUDA GPU, with CUDA events (``triton.testing.do_bench``, median), against ceilings
measured in the same run:

* the device's copy bandwidth: a 1 GiB device-to-device copy, counting bytes read plus written;
* dense bf16 matmul: 8192 x 8192 x 8192 on random data (torch / cuBLAS).

Shapes (:data:`SHAPES`; 32 query / 8 KV heads, head 128, bf16, block 16, HND, a shuffled block
table): decode 32 x 4096, decode 1 x 32768, causal prefill 8 x 2048 and 1 x 8192 (no context). Implementations:
``TRITON`` (kvmulti's Triton backend), ``HIP`` (the HIP kernels built with nvcc,
:mod:`devtools.hip_on_cuda`), ``SDPA`` (torch's flash attention on contiguous K/V: the dense
reference). Each prepared step is timed as a layer calls it (``kvmulti.paged_attention`` with the
``prepare_step`` result and an ``out`` buffer). The implementations alternate within each of
:data:`ROUNDS` rounds; the figure is the median of the rounds' medians.

Decode: % of the memory floor = (K/V read + query + out bytes) / measured copy bandwidth over the
measured time. Prefill: TFLOP/s of the causal attention's useful flops (4 * heads * head * the
causal (query, key) pairs) and their % of the measured matmul rate. Each implementation's output on
the timed shape is also compared with SDPA's (``max_abs_diff_vs_sdpa``). After the eager timings,
each kvmulti implementation's prepared call is captured in a CUDA graph and its replay timed
(:func:`graph_rows`: the GPU's time without the host's, the replayed output checked against SDPA's,
or the reason the call cannot be captured). Last, per decode shape, a step prepared for graph capture
(:func:`capture_bucket`) runs one layer and a :data:`DECODE_STEP_LAYERS`-layer decode step over the
same cache, eager and replayed (:func:`decode_step_rows`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import kvmulti

HQ, HKV, HEAD, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16
ROUNDS = 3
COPY_BYTES = 1 << 30
MATMUL_N = 8192
DEVICE = "cuda"
DECODE_STEP_LAYERS = 32


@dataclass(frozen=True)
class Shape:
    name: str
    kind: str            # "decode" | "prefill"
    seqs: int
    length: int          # keys per sequence (decode: context incl. the new token; prefill: prompt)

    @property
    def query_len(self) -> int:
        return 1 if self.kind == "decode" else self.length


SHAPES = (Shape("decode 32x4096", "decode", 32, 4096), Shape("decode 1x32768", "decode", 1, 32768),
          Shape("prefill 8x2048", "prefill", 8, 2048), Shape("prefill 1x8192", "prefill", 1, 8192))


def median_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth() -> dict:
    """Device-to-device copy of COPY_BYTES: bytes read + written per second."""
    src = torch.empty(COPY_BYTES // 2, dtype=DTYPE, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return {"bytes": 2 * COPY_BYTES, "ms": ms, "gb_per_s": 2 * COPY_BYTES / (ms * 1e-3) / 1e9}


def matmul_rate() -> dict:
    """bf16 MATMUL_N^3 matmul on random data: TFLOP/s."""
    a = torch.randn(MATMUL_N, MATMUL_N, dtype=DTYPE, device=DEVICE)
    b = torch.randn(MATMUL_N, MATMUL_N, dtype=DTYPE, device=DEVICE)
    ms = median_ms(lambda: a @ b)
    return {"n": MATMUL_N, "ms": ms, "tflops": 2 * MATMUL_N ** 3 / (ms * 1e-3) / 1e12}


def shape_work(shape: Shape) -> dict:
    """Bytes (decode floor) and useful flops (prefill) of one shape."""
    kv = shape.seqs * shape.length * HKV * 2 * HEAD * DTYPE.itemsize
    q_out = 2 * shape.seqs * shape.query_len * HQ * HEAD * DTYPE.itemsize
    causal_pairs = shape.seqs * (shape.length * (shape.length + 1) // 2 if shape.kind == "prefill" else shape.length)
    return {"bytes": kv + q_out, "flops": 4 * HQ * HEAD * causal_pairs}


class Problem:
    """One shape's tensors: dense K/V [seqs, HKV, length, HEAD] and the same data in a paged cache."""

    def __init__(self, shape: Shape):
        self.shape = shape
        b, s, qlen = shape.seqs, shape.length, shape.query_len
        self.k = torch.randn(b, HKV, s, HEAD, dtype=DTYPE, device=DEVICE)
        self.v = torch.randn(b, HKV, s, HEAD, dtype=DTYPE, device=DEVICE)
        self.q = torch.randn(b * qlen, HQ, HEAD, dtype=DTYPE, device=DEVICE)
        blocks_per_seq = s // BLOCK
        self.layout = kvmulti.KVCacheLayout(num_blocks=b * blocks_per_seq, block_size=BLOCK, num_kv_heads=HKV,
                                            head_size=HEAD, dtype=DTYPE, order="HND")
        self.cache = self.layout.allocate(DEVICE)
        table = torch.randperm(b * blocks_per_seq, device=DEVICE).to(torch.int32).view(b, blocks_per_seq)
        pos = torch.arange(s, device=DEVICE)
        slots = (table.long()[:, pos // BLOCK] * BLOCK + pos % BLOCK).reshape(-1)
        kvmulti.write_kv(self.k.transpose(1, 2).reshape(b * s, HKV, HEAD), self.v.transpose(1, 2).reshape(b * s, HKV, HEAD),
                         self.cache, self.layout, slots, backend="TRITON")
        self.metadata = kvmulti.CommonAttentionMetadata.from_lens([qlen] * b, [s] * b, table, BLOCK, device=DEVICE)

    def paged(self, backend) -> tuple[Callable[[], object], torch.Tensor]:
        """A prepared layer call of ``backend`` (a name or a backend object) and its output buffer."""
        step = kvmulti.prepare_step(self.metadata, self.layout, HQ, backend=backend)
        out = torch.empty_like(self.q)
        return (lambda: kvmulti.paged_attention(self.q, self.cache, self.layout, step, out=out)), out

    def sdpa(self) -> tuple[Callable[[], torch.Tensor], str]:
        """torch SDPA restricted to flash attention on contiguous K/V (GQA through enable_gqa, else K/V
        repeated to HQ heads) and the variant used."""
        from torch.nn.attention import SDPBackend, sdpa_kernel
        b, qlen = self.shape.seqs, self.shape.query_len
        q = self.q.view(b, qlen, HQ, HEAD).transpose(1, 2)
        causal = self.shape.kind == "prefill"

        def gqa():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, self.k, self.v, is_causal=causal, enable_gqa=True)
        try:
            gqa()
            return gqa, "flash, enable_gqa"
        except RuntimeError:
            k, v = (t.repeat_interleave(HQ // HKV, dim=1) for t in (self.k, self.v))

            def repeated():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            repeated()
            return repeated, "flash, K/V repeated to 32 heads (4x the K/V bytes)"

    def sdpa_rows(self, result: torch.Tensor) -> torch.Tensor:
        """SDPA's [b, HQ, qlen, HEAD] output as the paged ops' [tokens, HQ, HEAD]."""
        return result.transpose(1, 2).reshape(-1, HQ, HEAD)


def bench_shape(shape: Shape, implementations: dict[str, object], ceilings: dict) -> list[dict]:
    """Rows for one shape: each implementation's median ms (over ROUNDS alternating rounds), its
    fraction of the measured floor / matmul rate and its max abs difference from SDPA."""
    problem = Problem(shape)
    work = shape_work(shape)
    fns, outs, notes, errors = {}, {}, {}, {}
    for name, backend in implementations.items():
        try:
            fns[name], outs[name] = problem.paged(backend)
        except Exception as e:                        # recorded; the others still run
            errors[name] = f"{type(e).__name__}: {e}"[:600]
    try:
        sdpa_fn, notes["SDPA"] = problem.sdpa()
        fns["SDPA"] = sdpa_fn
    except Exception as e:
        errors["SDPA"] = f"{type(e).__name__}: {e}"[:600]
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in list(fns.items()):
            try:
                times[name].append(median_ms(fn))
            except Exception as e:                    # recorded; the others still run
                errors[name] = f"{type(e).__name__}: {e}"[:600]
                del fns[name]
    try:
        reference = problem.sdpa_rows(fns["SDPA"]()).float() if "SDPA" in fns else None
    except Exception:
        reference = None
    rows = []
    for name in [*implementations, "SDPA"]:
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
    torch.cuda.empty_cache()
    return rows


def captured(fn: Callable[[], object]) -> "torch.cuda.CUDAGraph":
    """``fn`` captured once in a CUDA graph, after warm-up calls on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_rows(shape: Shape, implementations: dict[str, object]) -> list[dict]:
    """Per implementation: a prepared layer call of ``shape`` captured in a CUDA graph and replayed
    (``graph_ms``; its output checked against SDPA's, ``graph_max_abs_diff_vs_sdpa``), or why it could
    not be captured (``graph_error``)."""
    problem = Problem(shape)
    reference = problem.sdpa_rows(problem.sdpa()[0]()).float()
    rows = []
    for name, backend in implementations.items():
        row: dict = {"shape": shape.name, "impl": name}
        try:
            fn, out = problem.paged(backend)
            graph = captured(fn)
            row["graph_ms"] = median_ms(graph.replay)      # the GPU's time for the call, without the host's
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            row["graph_max_abs_diff_vs_sdpa"] = float((out.float() - reference).abs().max())
        except Exception as e:                        # recorded; the others still run
            row["graph_error"] = f"{type(e).__name__}: {e}"[:600]
        rows.append(row)
    del problem
    torch.cuda.empty_cache()
    return rows


def capture_bucket(shape: Shape) -> "kvmulti.CaptureBucket":
    """The capture bucket of one shape's batch: its requests, rows, query length and sequence length."""
    return kvmulti.CaptureBucket(max_num_seqs=shape.seqs, max_num_tokens=shape.seqs * shape.query_len,
                                 max_query_len=shape.query_len, max_seq_len=shape.length)


def decode_step_rows(shape: Shape, name: str, backend, layers: int = DECODE_STEP_LAYERS) -> dict:
    """One layer and a ``layers``-layer decode step (the same cache per layer, an out buffer each) of a
    step prepared for capture: eager and replayed medians (``eager_layer_ms``, ``eager_step_ms``,
    ``graph_layer_ms``, ``graph_step_ms``), the replayed step against ``layers`` replayed layers
    (``graph_step_vs_layers``), the replayed output against the eager one; or ``error``."""
    problem = Problem(shape)
    row: dict = {"shape": shape.name, "impl": name, "layers": layers}
    try:
        step = kvmulti.prepare_step(problem.metadata, problem.layout, HQ, backend=backend,
                                    capture=capture_bucket(shape))
        outs = [torch.empty_like(problem.q) for _ in range(layers)]

        def layer() -> None:
            kvmulti.paged_attention(problem.q, problem.cache, problem.layout, step, out=outs[0])

        def decode_step() -> None:
            for out in outs:
                kvmulti.paged_attention(problem.q, problem.cache, problem.layout, step, out=out)
        row["eager_layer_ms"], row["eager_step_ms"] = median_ms(layer), median_ms(decode_step)
        eager = outs[-1].clone()
        layer_graph, step_graph = captured(layer), captured(decode_step)
        row["graph_layer_ms"], row["graph_step_ms"] = median_ms(layer_graph.replay), median_ms(step_graph.replay)
        row["graph_step_vs_layers"] = row["graph_step_ms"] / (layers * row["graph_layer_ms"])
        outs[-1].zero_()
        step_graph.replay()
        torch.cuda.synchronize()
        row["graph_max_abs_diff_vs_eager"] = float((outs[-1].float() - eager.float()).abs().max())
    except Exception as e:                            # recorded; the others still run
        row["error"] = f"{type(e).__name__}: {e}"[:600]
    del problem
    torch.cuda.empty_cache()
    return row


def run(implementations: dict[str, object], shapes: tuple[Shape, ...] = SHAPES,
        progress: Callable[[dict], None] | None = None) -> dict:
    """``{"ceilings": {"copy", "matmul"}, "rows": [...], "graphs": [...]}``; ``implementations``:
    name -> backend (a name or object) timed beside SDPA; ``graphs``: :func:`graph_rows` of every
    shape, after all eager timings (a failed capture cannot disturb them); ``decode_steps``:
    :func:`decode_step_rows` of every decode shape for the implementations that prepare steps for
    capture. ``progress`` gets the result so far after each shape."""
    result: dict = {"ceilings": {"copy": copy_bandwidth(), "matmul": matmul_rate()}, "rows": [], "graphs": [],
                    "decode_steps": []}
    torch.cuda.empty_cache()
    for shape in shapes:
        try:
            result["rows"] += bench_shape(shape, implementations, result["ceilings"])
        except Exception as e:                        # recorded; the next shape still runs
            result["rows"].append({"shape": shape.name, "impl": "all", "error": f"{type(e).__name__}: {e}"[:600]})
        if progress:
            progress(result)
    for shape in shapes:
        try:
            result["graphs"] += graph_rows(shape, implementations)
        except Exception as e:                        # recorded; the next shape still runs
            result["graphs"].append({"shape": shape.name, "impl": "all", "graph_error": f"{type(e).__name__}: {e}"[:600]})
        if progress:
            progress(result)
    for shape in (s for s in shapes if s.kind == "decode"):
        for name, backend in implementations.items():
            if kvmulti.resolve_backend(kvmulti.KVCacheLayout(1, BLOCK, HKV, HEAD, dtype=DTYPE, order="HND"), DEVICE,
                                       backend=backend).supports_capture:
                result["decode_steps"].append(decode_step_rows(shape, name, backend))
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
    a = p.parse_args(argv)
    implementations: dict[str, object] = {"TRITON": "TRITON"}
    if a.library:
        from .hip_on_cuda import NvidiaHipBackend
        implementations["HIP"] = NvidiaHipBackend(Path(a.library))
    result = run(implementations, progress=lambda r: a.json.write_text(json.dumps(r, indent=1)))
    return 0 if not any("error" in r for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
