"""The device check's outputs: ``device_check.json`` (the result as built by
:mod:`devtools.device_check`), ``device_check.md`` and the "Measured on a GPU" block of
``docs/performance.md``.

    python -m devtools.device_report docs OUT/device_check.json [--doc docs/performance.md]

rewrites the block between :data:`BEGIN` and :data:`END` in the doc from a run's JSON (one command
after a run); ``python -m devtools.device_report md OUT/device_check.json`` prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .device_model import describe

BEGIN = "<!-- device-check:begin (rendered by python -m devtools.device_report docs) -->"
END = "<!-- device-check:end -->"
ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "performance.md"


def write_json(result: dict, path: Path) -> None:
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]


def steps_table(result: dict) -> list[str]:
    return _table(["step", "status", "seconds (cap)", "summary"],
                  [[s["name"], s["status"], f"{s.get('seconds', 0):.0f} ({s.get('cap_s', '-')})", s.get("summary", "")]
                   for s in result.get("steps", [])])


def _figure(row: dict) -> tuple[str, str]:
    """(rate, % of the measured ceiling) of a timing row."""
    if "gb_per_s" in row:
        return f"{row['gb_per_s']:.0f} GB/s", f"{100 * row['fraction']:.0f}% of the memory floor"
    if "tflops" in row:
        return f"{row['tflops']:.0f} TFLOP/s", f"{100 * row['fraction']:.0f}% of matmul"
    return "-", "-"


def timing_table(result: dict) -> list[str]:
    bench = result.get("benchmark") or {}
    estimates = {(e["impl"], e["shape"]): e for e in result.get("model", {}).get("estimates", [])}
    rows = []
    for r in bench.get("rows", []):
        if "error" in r:
            rows.append([r["shape"], r["impl"], "error", "-", "-", "-", "-", r["error"]])
            continue
        rate, share = _figure(r)
        diff = r.get("max_abs_diff_vs_sdpa")
        rows.append([r["shape"], r["impl"], f"{r['ms']:.3f}", rate, share,
                     describe(estimates.get((r["impl"], r["shape"]))),
                     "-" if diff is None else f"{diff:.3g}", r.get("note", "")])
    return _table(["shape", "impl", "ms (median)", "rate", "measured share", "model", "max abs diff vs SDPA", "note"],
                  rows)


def peers_table(result: dict) -> list[str]:
    """The peers of the carried bundle: loaded (then timed) or not, with the error."""
    peers = result.get("peers") or {}
    if not peers.get("bundle"):
        return [f"Peers: none ({peers.get('reason', 'no device_peers/ bundle')}); kvmulti and SDPA only."]
    rows = [[name, "loaded" if info["loaded"] else "not loaded", info.get("error") or ""]
            for name, info in peers.items() if isinstance(info, dict) and "loaded" in info]
    return _table(["peer", "status", "error"], rows)


def graph_table(result: dict) -> list[str]:
    """Every implementation's call captured in a CUDA graph: replay time beside the eager time of the
    same shape (kvmulti's step prepared for the shape's capture bucket or plain), or why it could not
    be captured."""
    graphs = (result.get("benchmark") or {}).get("graphs") or []
    if not graphs:
        return ["CUDA graphs: not measured."]
    eager = {(r["shape"], r["impl"]): r.get("ms") for r in (result.get("benchmark") or {}).get("rows", [])}
    rows = []
    for g in graphs:
        ms = eager.get((g["shape"], g["impl"]))
        head = [g["shape"], g["impl"], g.get("captured_step", "-"), "-" if ms is None else f"{ms:.3f}"]
        if "graph_error" in g:
            rows.append([*head, "not captured", "-", g["graph_error"]])
        else:
            diff = g.get("graph_max_abs_diff_vs_sdpa")
            rows.append([*head, f"{g['graph_ms']:.3f}", "-" if diff is None else f"{diff:.3g}", ""])
    return _table(["shape", "impl", "kvmulti step", "eager ms", "graph replay ms", "max abs diff vs SDPA (replayed)",
                   "error"], rows)


def decode_step_table(result: dict) -> list[str]:
    """Decode steps, per implementation: one layer and every layer over the same cache (kvmulti: one
    step prepared for graph capture; a peer: one planning per layer), eager and replayed."""
    steps = (result.get("benchmark") or {}).get("decode_steps") or []
    if not steps:
        return ["Decode steps: not measured."]
    rows = []
    for r in steps:
        if "error" in r:
            rows.append([r["shape"], r["impl"], str(r.get("layers", "-")), "-", "-", "-", "-", "-", r["error"]])
            continue
        rows.append([r["shape"], r["impl"], str(r["layers"]), f"{r['eager_layer_ms']:.3f}", f"{r['graph_layer_ms']:.3f}",
                     f"{r['eager_step_ms']:.3f}", f"{r['graph_step_ms']:.3f}", f"{r['graph_step_vs_layers']:.2f}x",
                     f"replayed vs eager: {r['graph_max_abs_diff_vs_eager']:.3g}"])
    return _table(["shape", "impl", "layers", "layer eager ms", "layer replay ms", "step eager ms", "step replay ms",
                   "step replay / layers x layer replay", "note"], rows)


def sweep_table(result: dict) -> list[str]:
    """The tile sweep's rows (benchmarks/triton_gpu_sweep.py): each candidate against the shipped tiles."""
    rows = []
    for r in result.get("sweep") or []:
        if "error" in r:
            rows.append([r["shape"], r["candidate"], "error", "-", "-", r["error"]])
        else:
            speedup = "-" if r["speedup_vs_shipped"] is None else f"{r['speedup_vs_shipped']:.2f}x"
            rows.append([r["shape"], r["candidate"], f"{r['ms']:.3f}", speedup,
                         f"{r['max_abs_diff_vs_sdpa']:.3g}", ""])
    if not rows:
        return ["Tile sweep: not run."]
    return _table(["shape", "candidate (rows x keys, warps, stages)", "ms (median)", "speed-up vs shipped",
                   "max abs diff vs SDPA", "error"], rows)


def ceilings_lines(result: dict) -> list[str]:
    c = (result.get("benchmark") or {}).get("ceilings")
    if not c:
        return ["Ceilings: not measured."]
    return [f"Ceilings measured in the same run: device-to-device copy {c['copy']['gb_per_s']:.0f} GB/s "
            f"(read + write bytes of a {c['copy']['bytes'] // 2 >> 20} MiB copy), dense bf16 matmul "
            f"{c['matmul']['tflops']:.0f} TFLOP/s ({c['matmul']['n']}^3, random data)."]


def header_lines(result: dict) -> list[str]:
    d, v = result.get("device", {}), result.get("versions", {})
    return [f"- date: {result.get('date')}; commit {result.get('commit')}"
            + (" (uncommitted changes)" if result.get("dirty") else ""),
            f"- device: {d.get('name')} ("
            + ", ".join(f"{d[k]}{unit}" for k, unit in (("arch", ""), ("multiprocessors", " SMs"), ("memory_gib", " GiB"))
                        if d.get(k) is not None) + ")",
            "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
            f"- total {result.get('seconds', 0):.0f} s of a {result.get('budget_s')} s budget"
            + ("; DRY RUN (no GPU: fake figures)" if result.get("dry_run") else "")]


def render_markdown(result: dict) -> str:
    lines = ["# kvmulti device check", "", *header_lines(result), "", "## Steps", "", *steps_table(result), "",
             "## Peers", "", *peers_table(result), "",
             "## Timings (CUDA events)", "", *ceilings_lines(result), "", *timing_table(result), ""]
    model = result.get("model", {})
    lines.append(f"Model estimates: {model.get('source') or 'no model estimate (no model output found)'}.")
    lines += ["", "## CUDA graphs", "", *graph_table(result), "", *decode_step_table(result), "",
              "## Triton prefill tiles", "", *sweep_table(result)]
    return "\n".join(lines) + "\n"


def write_markdown(result: dict, path: Path) -> None:
    path.write_text(render_markdown(result))


def render_docs_block(result: dict) -> str:
    """The doc's block for one run: header, steps, ceilings, timings and (where measured) CUDA graphs
    and the tile sweep."""
    lines = [BEGIN, f"Last run: {result.get('date')} on {result.get('device', {}).get('name')} "
             f"(commit {result.get('commit')}).", "", *header_lines(result), "", *steps_table(result), "",
             *peers_table(result), "", *ceilings_lines(result), "", *timing_table(result), "",
             *((graph_table(result) + [""]) if (result.get("benchmark") or {}).get("graphs") else []),
             *((decode_step_table(result) + [""]) if (result.get("benchmark") or {}).get("decode_steps") else []),
             *((sweep_table(result) + [""]) if result.get("sweep") else []), END]
    return "\n".join(lines)


def update_doc(doc: Path, result: dict) -> None:
    """Replace the block between BEGIN and END in ``doc`` with ``result``'s."""
    text = doc.read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{doc}: no device-check block ({BEGIN} ... {END})")
    doc.write_text(text[:start] + render_docs_block(result) + text[end + len(END):])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("docs", "md"))
    p.add_argument("json", type=Path)
    p.add_argument("--doc", type=Path, default=DOC)
    a = p.parse_args(argv)
    result = json.loads(a.json.read_text())
    if a.what == "md":
        sys.stdout.write(render_markdown(result))
    else:
        update_doc(a.doc, result)
        print(f"updated {a.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
