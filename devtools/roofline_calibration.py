"""The roofline model against what a GPU measured: the model's rows for the H200
(:data:`devtools.roofline.H200`) next to ``docs/data/device_check.json``'s benchmark rows, with the error
of each (estimate / measured - 1).

Rows: the Triton ``unified_attention`` launches the backend plans for each measured shape, cross-compiled
for sm_90 (:func:`triton_rows`, in a subprocess without ``TRITON_INTERPRET``, kept in the kvmulti cache),
their hot loop's wave stream read from the SASS control codes (devtools/roofline_sass.py); and the HIP
FMA engine's build the H200 ran, from its recorded sm_90 figures (devtools/roofline_hip_fma.py). The
device check's prefill rows ran the prefill tiles its commit shipped for sm_90
(:data:`DEVICE_CHECK_PREFILL_TILES`); the launches with today's tiles ("TRITON now") are set beside
the device bench's rows, which timed them (``docs/data/device_bench_h200.json``). ``python
devtools/roofline_calibration.py`` prints the table.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":                        # run as a script: the repository root holds devtools/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from devtools.roofline import H200, Case, Estimate, Target, estimate

ROOT = Path(__file__).resolve().parents[1]
DEVICE_CHECK = ROOT / "docs" / "data" / "device_check.json"
#: the same H200's rows after the Hopper prefill tiles changed (devtools/device_bench.py)
DEVICE_BENCH = ROOT / "docs" / "data" / "device_bench_h200.json"
#: (rows, keys, warps, stages) of the prefill tiles the device check's commit shipped for sm_90 (the
#: sweep's "shipped" row, docs/data/triton_gpu_sweep.json); today's Hopper tiles came after it
DEVICE_CHECK_PREFILL_TILES = (128, 64, 8, 3)
TOLERANCE = 0.30
#: the device check's shapes (32 query / 8 KV heads, head 128, bf16, block 16) as model cases
SHAPES: dict[str, Case] = {
    "decode 32x4096": Case("decode", sequences=32, query_len=1, context=4096),
    "decode 1x32768": Case("decode", sequences=1, query_len=1, context=32768),
    "prefill 8x2048": Case("prefill", sequences=8, query_len=2048, context=2048),
    "prefill 1x8192": Case("prefill", sequences=1, query_len=8192, context=8192),
}


def measured(path: Path = DEVICE_CHECK) -> dict[tuple[str, str], float]:
    """``{(impl, shape): milliseconds}`` of the device check's benchmark rows (or the device bench's)."""
    data = json.loads(Path(path).read_text())
    rows = (data["benchmark"] if "benchmark" in data else data)["rows"]      # device check / device bench
    return {(r["impl"], r["shape"]): float(r["ms"]) for r in rows if "ms" in r}


def measured_ceilings(path: Path = DEVICE_CHECK) -> dict[str, float]:
    """The run's copy rate (bytes/s, read + write) and matmul rate (flop/s), recovered from its rows'
    floors (``bytes / floor_ms``) and matmul shares (``flops / (ms x fraction)``)."""
    rows = json.loads(Path(path).read_text())["benchmark"]["rows"]
    copy = next(r["bytes"] / (r["floor_ms"] * 1e-3) for r in rows if r.get("floor_ms"))
    matmul = next(r["flops"] / (r["ms"] * 1e-3 * r["fraction"]) for r in rows if r.get("tflops"))
    return {"copy": copy, "matmul": matmul}


# ------------------------------------------------------------------------------------------ triton
def _specs() -> list:
    from devtools import triton_cross_compile as xc
    base = dict(dtype=xc.BF16, head_size=128, num_kv_heads=8, group=4, order="HND", compute_units=H200.units)
    return [xc.BatchSpec("cal_" + name.replace(" ", "_"), (case.query_len,) * case.sequences,
                         (case.context - case.query_len,) * case.sequences, **base) for name, case in SHAPES.items()]


def _compile(out: str) -> None:
    """(Subprocess) compile every calibration shape's attention launch for sm_90: analyse() figures plus
    ``stream_cycles`` and ``shape``, one row per shape, written as JSON to ``out``."""
    import triton
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    from devtools import roofline_sass as S
    from devtools import triton_cross_compile as xc
    from kvmulti.backends.triton import launch as tl
    from kvmulti.backends.triton import tiles
    target = xc.TARGETS["sm_90"]
    backend = make_backend(target.gpu_target())
    shipped = tl.prefill_tiles
    rows = []
    jobs = [(shape, spec, "device check") for shape, spec in zip(SHAPES, _specs())]
    jobs += [(shape, spec, "now") for shape, spec in zip(SHAPES, _specs()) if SHAPES[shape].query_len > 1]
    for shape, spec, tiling in jobs:
        if tiling == "device check":      # the planner with the tiles the device check ran
            tl.prefill_tiles = lambda *a, **k: (tiles.PrefillTiles(*DEVICE_CHECK_PREFILL_TILES)
                                                if shipped(*a, **k) is not None else None)
        try:
            name, ln = next((n, ln) for n, ln in xc.launches(spec, target.family, target.planner_arch)
                            if ln.kernel == "unified_attention")
        finally:
            tl.prefill_tiles = shipped
        fn = tl.KERNELS[ln.kernel]
        signature, constexprs, attrs = xc.specialise(fn, ln, backend)
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target.gpu_target(),
                                  options={"num_warps": ln.num_warps, "num_stages": ln.num_stages})
        row = {"name": name, "spec": spec.name, "shape": shape, "tiles": tiling, "kernel": ln.kernel,
               "target": "sm_90", "num_warps": ln.num_warps, "num_stages": ln.num_stages,
               "constexprs": {p.name: repr(v) for (i,), v in constexprs.items() for p in [fn.params[i]]}}
        row.update(xc.analyse(compiled, target))
        row.update(hot_loop_figures(S.disassemble(compiled.asm["cubin"])))
        rows.append(row)
    Path(out).write_text(json.dumps(rows))


def hot_loop_figures(sass: str) -> dict:
    """The SASS figures of the KV loops: ``stream_cycles``, one warp's cycles through the innermost
    loop with the most matrix instructions (the loop ``triton_cross_compile`` counts), at
    :data:`devtools.roofline_sass.HOPPER_LATENCY`; ``hot_loop_barriers``, that loop's CTA barriers
    (``BAR.SYNC``); ``masked_stream_cycles``, the same for the longest other loop with as many matrix
    instructions (the prefill kernel's masked loop; None without one)."""
    from devtools import roofline_sass as S
    code = S.parse(sass)
    found = []          # (matrix instructions, loop span, body), innermost first
    for span in S.loops(code):
        body = S.body(code, span)
        found.append((sum(1 for i in body if S.class_of(i.opcode) in ("wgmma", "mma")), span, body))
    most = max((m for m, _, _ in found), default=0)
    loops = [body for m, _, body in found if m == most and most]
    if not loops:
        return {"stream_cycles": None, "hot_loop_barriers": 0, "masked_stream_cycles": None}
    hot = loops[0]
    return {"stream_cycles": S.stream_cycles(hot, S.HOPPER_LATENCY),
            "hot_loop_barriers": sum(1 for i in hot if i.opcode == "BAR" and ".SYNC" in i.modifiers),
            "masked_stream_cycles": S.stream_cycles(loops[-1], S.HOPPER_LATENCY) if len(loops) > 1 else None}


def _cache_path() -> Path:
    from devtools import triton_cross_compile as xc
    mine = [Path(__file__), ROOT / "devtools" / "roofline_sass.py"]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in mine)).hexdigest()[:16]
    return xc._results_cache("calibration-sm_90", [digest], None, xc.worker_env())


def triton_rows(timeout: float = 900) -> list[dict]:
    """The calibration shapes' Triton rows for sm_90 (compiled once per source state, then cached)."""
    from devtools import triton_cross_compile as xc
    kept = _cache_path()
    if kept.exists():
        return json.loads(kept.read_text())
    with tempfile.TemporaryDirectory(prefix="kvmulti_cal_") as tmp:
        out = os.path.join(tmp, "rows.json")
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--compile", out], env=xc.worker_env(),
                              capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
        if done.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"calibration compile failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
        text = Path(out).read_text()
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(text)
    return json.loads(text)


# ------------------------------------------------------------------------------------------ rows
def triton_estimates(target: Target = H200, tiling: str = "device check") -> dict[str, Estimate]:
    """``{shape: estimate}`` of the Triton launches on ``target``: with the tiles the device check ran
    (``tiling="device check"``) or today's (``"now"``, prefill shapes only)."""
    from devtools import roofline_triton as T
    return {r["shape"]: estimate(T.launch(r, SHAPES[r["shape"]], target), target) for r in triton_rows()
            if r["tiles"] == tiling}


#: the HIP launcher's default prefill threshold (launcher.hip's kDefaultPrefillMinQuery): a step whose longest
#: query has at least this many tokens runs the prefill kernel
HIP_PREFILL_MIN_QUERY = 64


def hip_estimates(target: Target = H200, current: bool = False) -> dict[str, Estimate]:
    """``{shape: estimate}`` of the HIP launches on NVIDIA ``target`` (no matrix instructions): the build the H200
    measured (its recorded sm_90 figures; it ran every shape through the attention kernel's FMA engine), or with
    ``current`` the current source's (nvcc's sm_90 build): decodes on the attention kernel's FMA engine, prefills
    on the prefill kernel's FMA tile engine."""
    from devtools import roofline_hip_fma as F
    from devtools import roofline_hip_prefill_fma as P
    fma = F.current_sass() if current else F.MEASURED_KERNEL
    tiles = P.current_sass() if current else None
    return {shape: estimate(P.launch(tiles, case, target) if tiles and case.query_len >= HIP_PREFILL_MIN_QUERY
                            else F.launch(fma, case, target), target) for shape, case in SHAPES.items()}


def calibration_rows(target: Target = H200, path: Path = DEVICE_CHECK, bench: Path = DEVICE_BENCH) -> list[dict]:
    """One row per (impl, shape) the device check measured and the model covers: ``impl``, ``shape``,
    ``estimate_ms``, ``measured_ms``, ``error`` (estimate / measured - 1), ``bound``, ``kernel``; and
    "TRITON now": today's prefill tiles against the device bench's rows (``bench``)."""
    ms = measured(path)
    ms.update({("TRITON now", shape): v for (impl, shape), v in measured(bench).items() if impl == "TRITON"})
    rows = []
    for impl, estimates in (("TRITON", triton_estimates(target)), ("TRITON now", triton_estimates(target, "now")),
                            ("HIP", hip_estimates(target))):
        for shape, e in estimates.items():
            if (impl, shape) in ms:
                rows.append({"impl": impl, "shape": shape, "estimate_ms": e.time_s * 1e3,
                             "measured_ms": ms[(impl, shape)], "error": e.time_s * 1e3 / ms[(impl, shape)] - 1,
                             "bound": e.bound, "kernel": e.kernel, "notes": e.notes})
    return rows


def format_rows(rows: list[dict]) -> str:
    """A markdown table of :func:`calibration_rows`."""
    lines = ["| impl | shape | model (H200) | measured | error | bound |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['impl']} | {r['shape']} | {r['estimate_ms']:.3f} ms | {r['measured_ms']:.3f} ms | "
              f"{100 * r['error']:+.0f}% | {r['bound']} |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compile"]:
        _compile(sys.argv[2])
    else:
        print(format_rows(calibration_rows()))
