"""How the device benchmark times a call and captures it in a graph: :class:`CudaRuntime` on the
GPU (CUDA events through ``triton.testing.do_bench``, CUDA graphs), :class:`StandInRuntime` for the
dry run on CPU tensors (wall-clock medians; a "graph" that re-runs the call it was given, so the
capture, replay and comparison code paths run without a GPU, though nothing is captured: whether
a call can be captured is the GPU run's finding)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

Call = Callable[[], object]


class CudaRuntime:
    """Timing and graphs on the current CUDA device."""

    device = "cuda"
    captures = True          # replays are real CUDA graphs

    def median_ms(self, fn: Call) -> float:
        """Median ms of ``fn`` over ~100 ms of calls after ~25 ms of warm-up (CUDA events)."""
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))

    def capture(self, fn: Call) -> Call:
        """``fn`` captured once in a CUDA graph after warm-up calls on a side stream; the graph's replay."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def release(self) -> None:
        torch.cuda.empty_cache()


class StandInRuntime:
    """The dry run's CPU stand-in: ``calls`` wall-clock calls per median; a "capture" whose replay
    calls ``fn`` again."""

    device = "cpu"
    captures = False

    def __init__(self, calls: int = 1):
        self.calls = calls

    def median_ms(self, fn: Call) -> float:
        times = []
        for _ in range(self.calls):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def capture(self, fn: Call) -> Call:
        return fn

    def synchronize(self) -> None:
        pass

    def release(self) -> None:
        pass
