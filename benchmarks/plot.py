#!/usr/bin/env python
"""Render the benchmarks' JSON into the PNGs under docs/img/ that docs/performance.md shows.

    python benchmarks/plot.py [--attention FILE] [--vllm-e2e FILE] [--gpu-report FILE] [--out DIR]

Inputs (defaults: the files under docs/data/, which hold the runs the docs quote):
  --attention   ``benchmarks/attention.py --json`` of the context-length sweep, e.g.
                ``--cases "decode 8x256,decode 8x1024,decode 8x4096,decode 8x16384" --dtypes bf16
                --block-sizes 16 --no-torch-path --no-sdpa --rounds 3`` -> cpu_decode.png: cold and
                hot decode time per context length, kvmulti's native kernel and vLLM's CPU kernel,
                one line per cache order;
  --vllm-e2e    ``benchmarks/vllm_e2e.py --json`` -> vllm_e2e.png: tokens/s of vLLM's CPU engine
                with CPU_ATTN and with kvmulti's plugin, per batch and mode;
  --gpu-report  ``benchmarks/gpu_report.py --json`` -> gpu_roofline.png: the roofline model's
                estimate (fraction of the bound it is judged against) per kernel x target, decode
                and prefill, each bar labelled with the bound it hits. These are ESTIMATES.
An input that is missing is reported and its plot skipped; nothing else is drawn from it.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"


def plot_cpu_decode(report: dict, out: Path) -> None:
    """Decode time (ms, median) against context length per order, ours and vLLM's, cold and hot."""
    rows = [r for r in report["rows"] if re.fullmatch(r"decode 8x\d+", r["case"])]
    if not rows:
        raise ValueError("no 'decode 8xN' rows: run the context-length sweep (see --help)")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=False)
    for ax, mode in zip(axes, ("cold", "hot")):
        for order, style in (("HND", "-"), ("NHD", "--")):
            for impl, color in (("native", "tab:blue"), ("vLLM", "tab:orange")):
                pts = sorted((int(r["case"].split("x")[1]), r[impl][0] * 1e3) for r in rows
                             if r["mode"] == mode and r["order"] == order and r.get(impl))
                if pts:
                    label = f"{'kvmulti' if impl == 'native' else 'vLLM CPU kernel'}, {order}"
                    ax.plot(*zip(*pts), style, marker="o", color=color, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens per request, 8 requests)")
        ax.set_ylabel("ms per call (median)")
        ax.set_title(f"CPU decode, {mode}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    block = sorted({r["block_size"] for r in rows})
    fig.suptitle(f"bf16, 8 query / 2 KV heads, head 64, block {'/'.join(map(str, block))}; "
                 f"{report.get('machine', '')[:80]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_vllm_e2e(report: dict, out: Path) -> None:
    """Tokens/s of vLLM's CPU engine with CPU_ATTN and with kvmulti, per (batch, mode)."""
    rows = report["rows"]
    labels = [f"batch {r['batch']}\n{r['mode']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([i - 0.2 for i in x], [r["cpu_attn_tok_s"] for r in rows], 0.4, label="CPU_ATTN", color="tab:orange")
    ax.bar([i + 0.2 for i in x], [r["kvmulti_tok_s"] for r in rows], 0.4, label="kvmulti plugin", color="tab:blue")
    for i, r in zip(x, rows):
        ax.annotate(f"{r['ratio']:.2f}x", (i + 0.2, r["kvmulti_tok_s"]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"vLLM CPU engine, tiny target ({report.get('dtype', '?')}), {report.get('source', '')}"[:100],
                 fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_gpu_roofline(report: dict, out: Path) -> None:
    """Estimated fraction of the judged bound per kernel x target, decode and prefill."""
    rows = report["roofline"]
    best: dict[tuple, dict] = {}
    for r in rows:     # one bar per (kernel, target, case): the kernel's own best specialisation
        key = (r.get("kernel", r.get("section")), r["target"], r["case"])
        if key not in best or r["fraction"] > best[key]["fraction"]:
            best[key] = r
    keys = sorted(best, key=lambda k: (k[2], k[0], k[1]))
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(keys) + 1.2))
    colors = {"memory": "tab:blue", "issue": "tab:red", "latency": "tab:purple", "grid": "tab:green"}
    for i, key in enumerate(keys):
        r = best[key]
        ax.barh(i, r["fraction"], color=colors.get(r["bound"], "grey"))
        ax.annotate(f"{r['fraction']:.2f} {r['bound']}", (r["fraction"], i), va="center", fontsize=7,
                    xytext=(3, 0), textcoords="offset points")
    ax.set_yticks(range(len(keys)), [f"{k[2]}: {k[0]}, {k[1]}" for k in keys], fontsize=7)
    ax.set_xlim(0, 1.15)
    ax.invert_yaxis()
    ax.set_xlabel("ESTIMATE: fraction of the judged bound (decode: memory floor; prefill: dense matrix peak)")
    ax.set_title("GPU roofline model (benchmarks/gpu_report.py), estimates from compiler output", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, [f"{b}-bound" for b in colors], fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


PLOTS = {"attention": ("cpu_decode.png", plot_cpu_decode), "vllm_e2e": ("vllm_e2e.png", plot_vllm_e2e),
         "gpu_report": ("gpu_roofline.png", plot_gpu_roofline)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in PLOTS:
        ap.add_argument(f"--{name.replace('_', '-')}", default=str(DATA / f"{name}.json"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, (png, plot) in PLOTS.items():
        source = Path(getattr(args, name))
        if not source.is_file():
            print(f"{png}: skipped, {source} missing")
            continue
        plot(json.loads(source.read_text()), out / png)
        print(f"{png}: from {source}")


if __name__ == "__main__":
    main()
