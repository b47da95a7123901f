"""The model's estimates for the device check's shapes, read from ``benchmarks/gpu_report.py
--json`` output: :func:`estimates_from_gpu_report` is the hook the device check calls.

What it reads: every list in the report whose entries carry ``target``, ``case`` ("decode" /
"prefill") and ``estimate_us``. Rows of the roofline model (``devtools.roofline.Estimate.row()``:
``kernel``, ``bound``, ``fraction``) win over the older paper model's (``paper_model``: device,
``fraction_of_floor``, no kernel: the Triton kernel). Both model the decode 32 x 4096 and prefill
8 x 2048 shapes of the device check (32 / 8 heads, head 128, bf16, block 16) on the spec-sheet
device of the target (:data:`devtools.roofline.TARGETS`), which may not be the measured card (the
report names the model's device). Anything else (another shape, a target or kernel the report does
not model, no report) has no model estimate, and the report says so.
"""

from __future__ import annotations

import json
from pathlib import Path

NO_ESTIMATE = "no model estimate"
#: the model case of each device-check shape it models
MODELLED_SHAPES = {"decode 32x4096": "decode", "prefill 8x2048": "prefill"}
#: kernel name fragment -> the device check's implementation name
KERNEL_IMPLS = {"unified_attention": "TRITON", "paged_attention": "HIP"}


def _model_rows(report: dict) -> list[tuple[str, dict]]:
    """(list name, row) for every estimate row in the report's top-level lists."""
    return [(key, row) for key, value in report.items() if isinstance(value, list)
            for row in value if isinstance(row, dict) and {"target", "case", "estimate_us"} <= row.keys()]


def _impl(row: dict) -> str | None:
    kernel = row.get("kernel")
    if kernel is None:
        return "TRITON"                              # the paper model models the Triton kernel only
    return next((impl for part, impl in KERNEL_IMPLS.items() if part in kernel), None)


def _model_device(row: dict, target: str) -> str:
    if row.get("device"):
        return row["device"]
    from .roofline import TARGETS
    return TARGETS[target].name if target in TARGETS else target


def estimates_from_gpu_report(path: Path | None, target: str) -> dict[tuple[str, str], dict]:
    """``{(impl, shape): {"estimate_ms", "fraction", "bound", "model_device", "source"}}`` from a
    gpu_report JSON at ``path`` for the NVIDIA ``target`` (``sm_90``); empty when there is none."""
    if path is None or not Path(path).is_file():
        return {}
    rows = _model_rows(json.loads(Path(path).read_text()))
    rows.sort(key=lambda kr: "bound" not in kr[1])   # roofline rows first
    out: dict[tuple[str, str], dict] = {}
    for key, row in rows:
        impl = _impl(row)
        shapes = [s for s, case in MODELLED_SHAPES.items() if case == row["case"]]
        if row["target"] != target or impl is None or not shapes or (impl, shapes[0]) in out:
            continue
        out[(impl, shapes[0])] = {"estimate_ms": row["estimate_us"] / 1e3,
                                  "fraction": row.get("fraction", row.get("fraction_of_floor")),
                                  "bound": row.get("bound"), "model_device": _model_device(row, target),
                                  "source": f"{Path(path).name}: {key}"}
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
    return "estimate " + ", ".join(parts) + f" ({estimate.get('model_device') or 'model'}, {estimate['source']})"
