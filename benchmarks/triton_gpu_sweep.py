"""Times the Triton backend's tile and split-KV choices against alternatives on a CUDA GPU.

    python benchmarks/triton_gpu_sweep.py [--cases prefill|decode|all] [--json OUT] [--plans]

Prefill (causal, no context): each candidate :class:`PrefillTiles` (rows, keys, warps, stages) in
place of :func:`kvmulti.backends.triton.tiles.prefill_tiles`' choice. Decode over one or few long
contexts: each split-KV partition size. Shapes and data as in ``devtools/device_bench.py`` (32 query
/ 8 KV heads, head 128, bf16, block 16, HND, a shuffled block table); every candidate of a shape
runs in the same rounds, alternating, and the table gives the median of the rounds' medians, the
ratio to the shipped choice (``time(shipped) / time(candidate)``: above 1 is faster) and the largest
difference from torch SDPA's output. ``--json`` is rewritten after each shape (a stopped run keeps
the shapes it finished). ``--plans`` prints the plans the candidates make (no GPU). The device check
(``devtools/device_check.py``) runs the prefill half.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvmulti.backends.triton import tiles  # noqa: E402

#: prefill candidates (block_m, tile_n, num_warps, num_stages); the first is what ships for the shape
PREFILL_CANDIDATES = (None, (128, 64, 8, 2), (128, 64, 4, 3), (128, 128, 8, 2), (128, 32, 8, 3),
                      (64, 64, 4, 3), (64, 128, 4, 2), (256, 64, 8, 2))
#: decode candidates: split-KV partition sizes (None: the backend's heuristic)
PARTITIONS = (None, 256, 1024, 2048, 4096)
PREFILL_SHAPES = (("prefill 8x2048", 8, 2048), ("prefill 1x8192", 1, 8192))
DECODE_SHAPES = (("decode 1x32768", 1, 32768), ("decode 4x16384", 4, 16384))


def candidate_name(tiles_: tuple | None) -> str:
    return "shipped" if tiles_ is None else "x".join(map(str, tiles_[:2])) + f" w{tiles_[2]} s{tiles_[3]}"


def patched_prefill_tiles(candidate: tuple | None):
    """``prefill_tiles`` returning ``candidate`` wherever the shipped function returns tiles."""
    def choose(*args, **kwargs):
        shipped = tiles.prefill_tiles(*args, **kwargs)
        return shipped if candidate is None or shipped is None else tiles.PrefillTiles(*candidate)
    return choose


def print_plans() -> None:
    """The plan of each prefill candidate and decode partition on an H100 / H200 (no GPU)."""
    import torch

    from kvmulti.backends.triton import launch
    for name, seqs, length in PREFILL_SHAPES:
        for cand in PREFILL_CANDIDATES:
            launch.prefill_tiles = patched_prefill_tiles(cand)
            plan = launch.plan_attention(num_reqs=seqs, num_kv_heads=8, num_qpk=4, max_query_len=length,
                                         max_seq_len=length, head_size=128, head_size_v=128, dtype=torch.bfloat16,
                                         num_compute_units=132, block_size=16, family="nvidia", arch=90)
            print(name, candidate_name(cand), plan)
    launch.prefill_tiles = tiles.prefill_tiles
    for name, seqs, length in DECODE_SHAPES:
        for part in PARTITIONS:
            plan = launch.plan_attention(num_reqs=seqs, num_kv_heads=8, num_qpk=4, max_query_len=1,
                                         max_seq_len=length, head_size=128, head_size_v=128, dtype=torch.bfloat16,
                                         num_compute_units=132, block_size=16, family="nvidia", arch=90,
                                         split_kv=None if part is None else True,
                                         partition_size=part or 512)
            print(name, part, plan)


def time_candidates(shape, candidates: dict, setup, rounds: int = 3) -> list[dict]:
    """Rows for one shape: ``candidates`` name -> value, ``setup(value)`` -> (call, out)."""
    from devtools import device_bench
    problem = device_bench.Problem(shape)
    reference = problem.sdpa_rows(problem.sdpa()[0]()).float()
    fns, errors, diffs = {}, {}, {}
    for name, value in candidates.items():
        try:
            fn, out = setup(problem, value)
            fn()
            diffs[name] = float((out.float() - reference).abs().max())
            fns[name] = fn
        except Exception as e:                        # recorded; the others still run
            errors[name] = f"{type(e).__name__}: {e}"[:300]
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(device_bench.median_ms(fn))
    shipped = statistics.median(times["shipped"]) if "shipped" in times else None
    rows = []
    for name in candidates:
        if name in errors:
            rows.append({"shape": shape.name, "candidate": name, "error": errors[name]})
            continue
        ms = statistics.median(times[name])
        rows.append({"shape": shape.name, "candidate": name, "ms": ms, "ms_rounds": times[name],
                     "speedup_vs_shipped": shipped / ms if shipped else None, "max_abs_diff_vs_sdpa": diffs[name]})
    return rows


def run(cases: str = "all", progress=None) -> list[dict]:
    """The rows of the ``cases`` ("prefill", "decode" or "all"); ``progress(rows)`` after each shape."""
    from devtools import device_bench
    from kvmulti.backends.triton import launch
    from kvmulti.backends.triton.backend import TritonBackend
    rows: list[dict] = []

    def prefill_setup(problem, cand):
        launch.prefill_tiles = patched_prefill_tiles(cand)    # planned in prepare_step, inside paged()
        try:
            return problem.paged(TritonBackend())
        finally:
            launch.prefill_tiles = tiles.prefill_tiles

    for name, seqs, length in PREFILL_SHAPES if cases in ("prefill", "all") else ():
        shape = device_bench.Shape(name, "prefill", seqs, length)
        rows += time_candidates(shape, {candidate_name(c): c for c in PREFILL_CANDIDATES}, prefill_setup)
        print_rows(rows[-len(PREFILL_CANDIDATES):])
        if progress:
            progress(rows)
    for name, seqs, length in DECODE_SHAPES if cases in ("decode", "all") else ():
        shape = device_bench.Shape(name, "decode", seqs, length)
        cands = {("shipped" if p is None else f"partition {p}"): p for p in PARTITIONS}
        rows += time_candidates(shape, cands, lambda problem, p: problem.paged(TritonBackend(partition_size=p)))
        print_rows(rows[-len(PARTITIONS):])
        if progress:
            progress(rows)
    return rows


def print_rows(rows: list[dict]) -> None:
    print("| shape | candidate | ms (median) | speed-up vs shipped | max abs diff vs SDPA |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['candidate']} | error | - | {r['error']} |")
        else:
            speedup = "-" if r["speedup_vs_shipped"] is None else f"{r['speedup_vs_shipped']:.2f}x"
            print(f"| {r['shape']} | {r['candidate']} | {r['ms']:.3f} | {speedup} | {r['max_abs_diff_vs_sdpa']:.3g} |")
    print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", choices=("prefill", "decode", "all"), default="all")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--plans", action="store_true", help="print the candidates' plans (no GPU)")
    args = parser.parse_args()
    if args.plans:
        print_plans()
        return
    def write(rows: list[dict]) -> None:
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
    write(run(args.cases, write))


if __name__ == "__main__":
    main()
