"""The model's estimates for the device check's shapes, read from ``benchmarks/gpu_report.py
--json`` output: :func:`estimates_from_gpu_report` is the hook the device check calls.

What it reads: the report's ``paper_model`` entries (device, target, case "decode" / "prefill",
``estimate_us``, ``fraction_of_floor``, and ``bound`` when the entry names one). They model the
Triton kernel on the decode 32 x 4096 and prefill 8 x 2048 shapes of the device check
(32 / 8 heads, head 128, bf16, block 16), on the spec-sheet device of the same target. Anything
else (another implementation or shape, a target the report does not model, no report) has no
model estimate, and the report says so.
"""

from __future__ import annotations

import json
from pathlib import Path

NO_ESTIMATE = "no model estimate"
#: the gpu_report model case of each device-check shape it models
MODELLED_SHAPES = {"decode 32x4096": "decode", "prefill 8x2048": "prefill"}


def estimates_from_gpu_report(path: Path | None, target: str) -> dict[tuple[str, str], dict]:
    """``{(impl, shape): {"estimate_ms", "fraction", "bound", "model_device", "source"}}`` from a
    gpu_report JSON at ``path`` for the NVIDIA ``target`` (``sm_90``); empty when there is none."""
    if path is None or not Path(path).is_file():
        return {}
    report = json.loads(Path(path).read_text())
    out = {}
    for shape, case in MODELLED_SHAPES.items():
        rows = [r for r in report.get("paper_model", [])
                if r.get("target") == target and r.get("case") == case and "estimate_us" in r]
        if rows:
            r = rows[0]
            out[("TRITON", shape)] = {"estimate_ms": r["estimate_us"] / 1e3, "fraction": r.get("fraction_of_floor"),
                                      "bound": r.get("bound"), "model_device": r.get("device"),
                                      "source": f"{Path(path).name}: paper_model"}
    return out


def describe(estimate: dict | None) -> str:
    """One cell of text for an estimate (or :data:`NO_ESTIMATE`)."""
    if not estimate:
        return NO_ESTIMATE
    parts = [f"{estimate['estimate_ms']:.3f} ms"]
    if estimate.get("fraction") is not None:
        parts.append(f"{100 * estimate['fraction']:.0f}% of its floor")
    if estimate.get("bound"):
        parts.append(f"{estimate['bound']}-bound")
    return "estimate " + ", ".join(parts) + f" ({estimate.get('model_device') or 'model'})"
