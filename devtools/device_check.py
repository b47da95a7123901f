"""The device check's driver: every step on one NVIDIA GPU within a time budget, each step with its
own cap; a failing step is recorded and the next one runs. ``scripts/device_check.sh`` runs it.

    python -m devtools.device_check [OUT_DIR] [--dry-run] [--budget SECONDS]

Steps, in this order (:data:`STEPS`; each waits at most its cap, and what runs in the background
overlaps the steps after it):

1. ``environment``: device, torch / triton / driver / nvcc / compute-sanitizer versions; starts in
   the background the nvcc build of the HIP kernels (:func:`kvmulti.backends.hip.build.build_nvidia_library`
   for the device's arch), the model's report (``benchmarks/gpu_report.py --sections triton --json``)
   and ``pytest -m cuda`` (the cuda-marked suites, KVMULTI_REQUIRE_VENDOR=cuda);
2. ``hip build``: waits for that build;
3. ``hip vs oracle``: the HIP kernels on CUDA tensors against the oracle (``devtools.device_kernels``);
4. ``memcheck hip``: ``compute-sanitizer --tool memcheck`` over the same HIP cases;
5. ``memcheck triton``: the same over one Triton decode and one Triton prefill launch;
6. ``pytest -m cuda``: waits for the suites, stopping them when the benchmark's reserve
   (:data:`BENCH_RESERVE_S`) would be eaten;
7. ``peers``: which peers of the carried ``device_peers/`` bundle (``scripts/build_device_peers.sh``)
   load: vLLM's Triton kernels, FlashInfer FA2 / FA3 (``devtools.device_peers``); one that does not
   is recorded with its error;
8. ``benchmark``: ``devtools.device_bench`` on the then quiet GPU (TRITON, the loaded peers, SDPA,
   and HIP when step 3 passed; copy bandwidth, matmul rate; every call also captured in a CUDA
   graph and replayed, and a 32-layer decode step eager and replayed per implementation);
9. ``model estimates``: waits for the model's report and reads its estimates (``devtools.device_model``);
10. ``tile sweep``: the Triton prefill tiles shipped for this device against alternatives
    (``benchmarks/triton_gpu_sweep.py --cases prefill``).

Writes ``OUT_DIR/device_check.json``, ``device_check.md``, ``device_check.log`` (every step's
output) and ``pytest_cuda.xml``; nothing else lands in OUT_DIR (the device tool returns at most
8 files). Exit status 0 when every step passed.

``--dry-run`` (no GPU): each step's dry form checks its wiring instead (modules import, commands
build, the HIP sources compile with nvcc for sm_90 and the library binds through the launcher ABI,
the cuda-marked tests collect, the peers load or are recorded as not loading, the benchmark's eager,
graph and decode-step code runs on CPU tensors for TRITON and the peers that load here, the report
writers produce valid JSON and markdown from a fake result).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from glob import glob
from pathlib import Path
from typing import Callable

from . import device_bench, device_kernels, device_model, device_peers, device_peers_build, device_report

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 450           # the driver's whole run; the script's set-up comes on top (8 minutes in all)
#: the model report rendered for the committed kernels (benchmarks/gpu_report.py --json)
COMMITTED_REPORT = ROOT / "docs" / "data" / "gpu_report.json"
BENCH_RESERVE_S = 250    # kept for the peers, the benchmark and the model when waiting for pytest
PYTEST_TEST_TIMEOUT_S = 280
DRY_RUN_ARCH = "sm_90"
SANITIZER_EXIT = 86
COMMIT_ENV = "DEVICE_CHECK_COMMIT"


@dataclass
class Context:
    out: Path
    work: Path                           # intermediates (not returned by the device tool)
    dry_run: bool
    deadline: float
    python: str = sys.executable
    background: dict[str, subprocess.Popen] = field(default_factory=dict)
    result: dict = field(default_factory=dict)
    library: str | None = None           # the nvcc-built HIP library, once built
    hip_ok: bool = False                 # it matched the oracle (then the benchmark times it)
    arch: str | None = None
    peers_bundle: Path | None = None     # the device_peers/ bundle whose peers load, once found
    peers_timed: bool = True             # the benchmark times them (the dry run: a bundle built here)
    log: list[str] = field(default_factory=list)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


@dataclass
class Outcome:
    status: str                          # passed | failed | error | timeout | skipped
    summary: str
    details: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    name: str
    cap_s: int
    run: Callable[[Context, float], Outcome]
    dry: Callable[[Context, float], Outcome]


# ------------------------------------------------------------------------------------ processes
def run_capped(ctx: Context, name: str, cmd: list[str], cap: float, env: dict | None = None) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group for at most ``cap`` seconds; (exit status or None on
    timeout, its output). The output also goes to the run's log."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(cap, 1))
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = None
    ctx.log.append(f"===== {name}: $ {' '.join(cmd)}\n{out}\n===== exit {rc if rc is not None else 'timeout'}\n")
    return rc, out


def start_background(ctx: Context, name: str, cmd: list[str], env: dict | None = None) -> None:
    with open(ctx.work / f"{name}.log", "w") as log:
        ctx.background[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                                                env=env, start_new_session=True)


def wait_background(ctx: Context, name: str, cap: float) -> tuple[int | None, str]:
    proc = ctx.background.get(name)
    if proc is None:
        return -1, f"{name} was not started"
    try:
        rc = proc.wait(timeout=max(cap, 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = None
    out = (ctx.work / f"{name}.log").read_text()
    ctx.log.append(f"===== {name} (background): $ {' '.join(proc.args)}\n{out}\n===== exit {rc}\n")
    return rc, out


def tail(text: str, n: int = 1500) -> str:
    return text[-n:]


# ------------------------------------------------------------------------------------ tools
def compute_sanitizer() -> str | None:
    """compute-sanitizer: PATH, $CUDA_HOME/bin, the CUDA and Nsight install folders."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", "")]
    patterns = [f"{r}/bin/compute-sanitizer" for r in roots if r] + [
        "/usr/local/cuda*/bin/compute-sanitizer", "/usr/local/cuda*/compute-sanitizer/compute-sanitizer",
        "/opt/nvidia/*/compute-sanitizer*/compute-sanitizer", "/opt/nvidia/**/compute-sanitizer"]
    for pattern in patterns:
        hits = sorted(p for p in glob(pattern, recursive=True) if os.access(p, os.X_OK) and os.path.isfile(p))
        if hits:
            return hits[-1]
    return None


def tool_version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "not found"
    return out.splitlines()[-1] if out else "not found"


def commit() -> tuple[str, bool]:
    """(commit, dirty): $DEVICE_CHECK_COMMIT, else git; the device tool's copy has no .git."""
    env = os.environ.get(COMMIT_ENV)
    if env:
        return env, False
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            return head.stdout.strip(), bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return f"unknown (no git here; set {COMMIT_ENV})", False


def cuda_test_files() -> list[str]:
    """Test modules holding cuda-marked tests (a marker decorator, ``marks=`` or ``pytestmark``)."""
    marker = re.compile(r"^\s*@pytest\.mark\.cuda\b|marks=pytest\.mark\.cuda\b|^pytestmark\s*=.*\bmark\.cuda\b",
                        re.M)
    return [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").glob("test_*.py")) if marker.search(p.read_text())]


# ------------------------------------------------------------------------------------ parsers
def pytest_counts(output: str) -> dict[str, int]:
    """Outcome counts from pytest's output: its final line when it got there, else the verbose
    progress lines (a run stopped at its cap)."""
    final = re.findall(r"=+ (.*?) in [\d.]+s", output)
    counts: dict[str, int] = {}
    if final:
        for n, what in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)", final[-1]):
            counts["error" if what.startswith("error") else what] = int(n)
        return counts
    for what in re.findall(r"^(?:\[gw\d+\] \[\s*\d+%\] |\S+::\S+ )(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b",
                           output, re.M):
        key = {"ERROR": "error", "XFAIL": "xfailed", "XPASS": "xpassed"}.get(what, what.lower())
        counts[key] = counts.get(key, 0) + 1
    return counts


def junit_failures(path: Path, limit: int = 20) -> list[dict]:
    """(test, message) of the failed / errored test cases in a junit XML file."""
    if not path.is_file():
        return []
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            out.append({"test": f"{case.get('classname')}::{case.get('name')}",
                        "message": (bad.get("message") or "")[:400]})
    return out[:limit]


def sanitizer_errors(log: str) -> int | None:
    """The count in compute-sanitizer's "ERROR SUMMARY: N errors" line (None: no summary)."""
    m = re.findall(r"ERROR SUMMARY: (\d+) error", log)
    return int(m[-1]) if m else None


def kernels_outcome(result: dict | None, rc: int | None, what: str) -> Outcome:
    if rc is None:
        return Outcome("timeout", f"{what}: stopped at its cap")
    if not result or "cases" not in result:
        return Outcome("error", f"{what}: no result (exit {rc})", {"result": result})
    bad = [c for c in result["cases"] if not c["ok"]]
    summary = f"{len(result['cases']) - len(bad)}/{len(result['cases'])} cases match the oracle"
    return Outcome("passed" if not bad and rc == 0 else "failed", summary, {"cases": result["cases"]})


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------------ steps
def step_environment(ctx: Context, cap: float) -> Outcome:
    import torch
    import triton
    if not torch.cuda.is_available() or torch.version.hip:
        return Outcome("error", "no NVIDIA GPU visible to torch")
    props = torch.cuda.get_device_properties(0)
    from kvmulti.backends.hip.build import cuda_arch, nvcc
    ctx.arch = cuda_arch(0)
    ctx.result["device"] = {"name": props.name, "capability": f"{props.major}.{props.minor}", "arch": ctx.arch,
                            "multiprocessors": props.multi_processor_count,
                            "memory_gib": round(props.total_memory / 2 ** 30, 1)}
    sanitizer = compute_sanitizer()
    ctx.result["versions"] = {
        "python": sys.version.split()[0], "torch": torch.__version__, "torch cuda": torch.version.cuda,
        "triton": triton.__version__,
        "driver": tool_version(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        "nvcc": tool_version([nvcc() or "nvcc", "--version"]),
        "compute-sanitizer": tool_version([sanitizer, "--version"]) if sanitizer else "not found"}
    start_background(ctx, "hip_build", [ctx.python, "-c", "import sys; from kvmulti.backends.hip.build import "
                                        f"build_nvidia_library; print(build_nvidia_library({ctx.arch!r}))"])
    start_background(ctx, "gpu_report", [ctx.python, "benchmarks/gpu_report.py", "--sections", "triton",
                                         "--json", str(ctx.work / "gpu_report.json"), "-j", "6"])
    env = dict(os.environ, KVMULTI_REQUIRE_VENDOR="cuda", PYTHONUNBUFFERED="1")   # a stopped run keeps its lines
    env.pop("TRITON_INTERPRET", None)
    start_background(ctx, "pytest", _pytest_cmd(ctx, ctx.out / "pytest_cuda.xml"), env)
    return Outcome("passed", f"{props.name} ({ctx.arch}); nvcc build, model report and pytest started", {})


def dry_environment(ctx: Context, cap: float) -> Outcome:
    from kvmulti.backends.hip.build import nvcc
    ctx.arch = DRY_RUN_ARCH
    ctx.result["device"] = {"name": "dry run (no GPU)", "arch": DRY_RUN_ARCH}
    ctx.result["versions"] = {"python": sys.version.split()[0], "nvcc": tool_version([nvcc() or "nvcc", "--version"])}
    missing = [m for m in ("torch", "triton") if importlib.util.find_spec(m) is None]
    if nvcc() is None:
        missing.append("nvcc")
    return Outcome("failed" if missing else "passed", f"missing: {missing}" if missing else "imports and nvcc found")


def step_hip_build(ctx: Context, cap: float) -> Outcome:
    rc, out = wait_background(ctx, "hip_build", cap)
    lines = [line for line in out.strip().splitlines() if line.endswith(".so")]
    if rc == 0 and lines:
        ctx.library = lines[-1]
        return Outcome("passed", f"nvcc built {Path(ctx.library).name} for {ctx.arch}")
    return Outcome("timeout" if rc is None else "failed", tail(out, 800))


def dry_hip_build(ctx: Context, cap: float) -> Outcome:
    """The real build for sm_90 (nvcc needs no GPU), then the library's ABI through the binding."""
    import ctypes

    from kvmulti.backends.hip.build import build_nvidia_library
    from kvmulti.backends.hip.library import load_library
    path = build_nvidia_library(DRY_RUN_ARCH)
    lib = load_library(str(path))
    sizes = (ctypes.c_int * 8)()
    n = lib.kvmulti_hip_head_sizes(sizes, 8)
    ctx.library = str(path)
    return Outcome("passed", f"nvcc built {path.name}; ABI bound, head sizes {list(sizes)[:n]}")


def step_hip_oracle(ctx: Context, cap: float) -> Outcome:
    if not ctx.library:
        return Outcome("skipped", "no HIP library (the build step failed)")
    out_json = ctx.work / "hip_oracle.json"
    rc, out = run_capped(ctx, "hip vs oracle", [ctx.python, "-m", "devtools.device_kernels", "--backend", "HIP",
                                                "--library", ctx.library, "--json", str(out_json)], cap)
    outcome = kernels_outcome(read_json(out_json), rc, "HIP (nvcc) on CUDA tensors")
    ctx.hip_ok = outcome.status == "passed"
    return outcome


def dry_hip_oracle(ctx: Context, cap: float) -> Outcome:
    assert device_kernels.CASES and device_kernels.LAUNCHES and callable(device_kernels.main)
    from .hip_on_cuda import NvidiaHipBackend
    assert NvidiaHipBackend.platforms == ("cuda",)
    return Outcome("passed", f"{len(device_kernels.CASES)} HIP cases, {len(device_kernels.LAUNCHES)} launches wired")


def step_benchmark(ctx: Context, cap: float) -> Outcome:
    out_json = ctx.work / "bench.json"
    cmd = _bench_cmd(ctx, out_json)
    if ctx.library and ctx.hip_ok:
        cmd += ["--library", ctx.library]
    rc, out = run_capped(ctx, "benchmark", cmd, cap)
    bench = read_json(out_json)             # written after each shape: a stopped run keeps its shapes
    if bench is None:
        return Outcome("timeout" if rc is None else "error", tail(out, 800))
    ctx.result["benchmark"] = bench
    errors = [f"{r['impl']} {r['shape']}" for r in bench["rows"] if "error" in r]
    summary = f"{len(bench['rows'])} rows" + (f"; errors: {', '.join(errors)}" if errors else "")
    graphs = bench.get("graphs") or []
    if graphs:
        uncaptured = [f"{g['impl']} {g['shape']}" for g in graphs if "graph_error" in g]
        summary += f"; CUDA graphs: {len(graphs) - len(uncaptured)} of {len(graphs)} calls captured" + (
            f" (not: {', '.join(uncaptured)})" if uncaptured else "")
    steps = bench.get("decode_steps") or []
    if steps:
        replayed = [f"{r['impl']} {r['shape']}: {r['layers']} layers replayed in {r['graph_step_ms']:.3f} ms "
                    f"({r['graph_step_vs_layers']:.2f}x {r['layers']} replayed layers)" for r in steps if "error" not in r]
        failed = [f"{r['impl']} {r['shape']}" for r in steps if "error" in r]
        summary += "; decode steps: " + "; ".join(replayed) + (f" (failed: {', '.join(failed)})" if failed else "")
    unavailable = bench.get("unavailable_peers") or {}
    summary += f"; peers timed: {', '.join(bench.get('peers') or []) or 'none'}" + (
        f" (not loaded: {', '.join(unavailable)})" if unavailable else "")
    if "--library" not in cmd:
        summary += "; HIP not timed (it did not pass the oracle step)"
    status = "timeout" if rc is None else "passed" if rc == 0 and not errors else "failed"
    return Outcome(status, summary if rc is not None else summary + " (stopped at its cap)")


def _bench_cmd(ctx: Context, out_json: Path) -> list[str]:
    cmd = [ctx.python, "-m", "devtools.device_bench", "--json", str(out_json)]
    if ctx.peers_bundle is not None and ctx.peers_timed:
        cmd += ["--peers", str(ctx.peers_bundle), "--peers-scratch", str(ctx.work / "peers_scratch")]
    return cmd + (["--dry-run"] if ctx.dry_run else [])


def dry_benchmark(ctx: Context, cap: float) -> Outcome:
    """The benchmark's own code on CPU tensors (``device_bench --dry-run``: tiny shapes, Triton's
    interpreter, the stand-in runtime): eager rows, the graph path (capture-bucket steps, replays
    compared with SDPA) and the decode steps of TRITON and of every peer that loads here."""
    work = device_bench.shape_work(device_bench.SHAPES[0])
    assert work["bytes"] == 32 * 4096 * 8 * 256 * 2 + 2 * 32 * 32 * 128 * 2, work
    bucket = device_bench.capture_bucket(device_bench.SHAPES[0])
    assert (bucket.max_num_seqs, bucket.max_num_tokens, bucket.max_query_len, bucket.max_seq_len) == (32, 32, 1, 4096)
    out_json = ctx.work / "bench_dry.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    rc, out = run_capped(ctx, "benchmark (dry: CPU tensors)", _bench_cmd(ctx, out_json), cap, env)
    bench = read_json(out_json)
    if rc != 0 or bench is None:
        return Outcome("timeout" if rc is None else "failed", tail(out, 800))
    impls = ["TRITON", *bench["peers"]]              # no peers: no bundle was built here
    bad = [f"{r['impl']} {r['shape']}: {r.get('error') or r.get('graph_error')}"
           for r in bench["rows"] + bench["graphs"] + bench["decode_steps"] if "error" in r or "graph_error" in r]
    graphed = {g["impl"] for g in bench["graphs"] if "graph_ms" in g}
    stepped = {r["impl"] for r in bench["decode_steps"] if "graph_step_ms" in r}
    missing = [i for i in impls if i not in graphed or i not in stepped]
    capture = [g for g in bench["graphs"] if g["impl"] == "TRITON" and g.get("captured_step") == "capture bucket"]
    ok = not bad and not missing and capture
    return Outcome("passed" if ok else "failed",
                   f"{len(device_bench.SHAPES)} shapes wired; on CPU tensors: {len(bench['rows'])} eager rows, "
                   f"{len(bench['graphs'])} graph rows, {len(bench['decode_steps'])} decode steps "
                   f"({', '.join(impls)}; SDPA)" + (f"; errors: {bad}" if bad else "")
                   + (f"; no graph or decode step: {missing}" if missing else ""),
                   {"benchmark": bench})


def step_peers(ctx: Context, cap: float) -> Outcome:
    """Which peers of the carried ``device_peers/`` bundle load (``devtools.device_peers``); the
    benchmark times those. No bundle: the benchmark times kvmulti and SDPA only."""
    return _peers(ctx, cap, device_peers.BUNDLE)


def dry_peers(ctx: Context, cap: float) -> Outcome:
    """The same on this host: the bundle when one was built here (the dry benchmark then runs its
    loaded peers under Triton's interpreter), else the vLLM part built into the run's scratch from
    .venv-vllm when it exists, to check that it loads (timing it under the interpreter is the
    exhaustive tier's: tests/test_device_check.py). FlashInfer loads only where its modules were
    built; elsewhere it is recorded as not loaded."""
    bundle = device_peers.BUNDLE
    if not bundle.is_dir():
        ctx.peers_timed = False
        vllm_python = ROOT / ".venv-vllm" / "bin" / "python"
        if not vllm_python.exists():
            ctx.result["peers"] = {"bundle": None, "reason": f"no {bundle.name}/ and no {vllm_python}"}
            return Outcome("passed", "no peer bundle and no .venv-vllm: the benchmark times kvmulti and SDPA only")
        bundle = ctx.work / "device_peers"
        done = subprocess.run([str(vllm_python), "-c", "import importlib.util; "
                               "print(importlib.util.find_spec('vllm').submodule_search_locations[0])"],
                              capture_output=True, text=True, timeout=60)
        device_peers_build.build_vllm(bundle, Path(done.stdout.strip()) / "v1" / "attention" / "ops")
    return _peers(ctx, cap, bundle)


def _peers(ctx: Context, cap: float, bundle: Path) -> Outcome:
    if not bundle.is_dir():
        ctx.result["peers"] = {"bundle": None, "reason": f"no {bundle}"}
        return Outcome("passed", f"no peer bundle ({bundle.name}/ was not carried): kvmulti and SDPA only")
    if ctx.dry_run:                     # this process imports them (a second interpreter costs more)
        found = device_peers.availability(bundle, ctx.work / "peers_scratch")
    else:                               # the GPU run keeps FlashInfer's import out of the driver
        out_json = ctx.work / "peers.json"
        rc, out = run_capped(ctx, "peers", [ctx.python, "-m", "devtools.device_peers", "--bundle", str(bundle),
                                            "--scratch", str(ctx.work / "peers_scratch"), "--json", str(out_json)],
                             cap)
        found = read_json(out_json)
        if rc != 0 or found is None:
            return Outcome("timeout" if rc is None else "error", tail(out, 800))
    ctx.result["peers"] = found
    ctx.peers_bundle = bundle
    loaded = [p for p in device_peers.PEERS if found[p]["loaded"]]
    missing = [f"{p} ({found[p]['error']})" for p in device_peers.PEERS if not found[p]["loaded"]]
    return Outcome("passed", f"loaded: {', '.join(loaded) or 'none'}" + (f"; not loaded: {'; '.join(missing)}"
                                                                          if missing else ""), found)


def _model_result(ctx: Context, path: Path | None) -> Outcome:
    estimates = device_model.estimates_from_gpu_report(path, ctx.arch or DRY_RUN_ARCH)
    sources = sorted({e["source"] for e in estimates.values()})
    ctx.result["model"] = {"source": "benchmarks/gpu_report.py --json (" + ", ".join(sources) + ")"
                           if estimates else None,
                           "estimates": [dict(e, impl=k[0], shape=k[1]) for k, e in estimates.items()]}
    return Outcome("passed" if estimates else "failed",
                   f"{len(estimates)} estimates" if estimates else device_model.NO_ESTIMATE)


def step_model(ctx: Context, cap: float) -> Outcome:
    """The live report's estimates; when it did not finish inside its cap (it compiles every Triton
    configuration it models), the committed report's (``COMMITTED_REPORT``, the same script's output
    for the committed kernels), named as the source."""
    rc, out = wait_background(ctx, "gpu_report", cap)
    outcome = _model_result(ctx, ctx.work / "gpu_report.json")
    if rc is not None and outcome.status == "passed":
        return outcome
    why = "the live report was stopped at its cap" if rc is None else f"the live report failed (exit {rc})"
    committed = _model_result(ctx, COMMITTED_REPORT)
    if committed.status == "passed":
        ctx.result["model"]["source"] += f", committed in {COMMITTED_REPORT.relative_to(ROOT)}"
        return Outcome("passed", f"{committed.summary} from {COMMITTED_REPORT.relative_to(ROOT)} ({why})")
    outcome.status = "timeout" if rc is None else "failed"
    outcome.summary += f"; {why}"
    return outcome


def dry_model(ctx: Context, cap: float) -> Outcome:
    """The hook on a fake report: a roofline row wins over the paper model's for the same shape."""
    fake = ctx.work / "fake_gpu_report.json"
    paper = [{"device": "H100 SXM", "target": DRY_RUN_ARCH, "case": case, "estimate_us": us, "fraction_of_floor": 0.5}
             for case, us in (("decode", 250.0), ("prefill", 900.0))]
    roofline = [{"kernel": "unified_attention", "target": DRY_RUN_ARCH, "case": "decode", "estimate_us": 300.0,
                 "fraction": 0.6, "bound": "memory"},
                {"kernel": "unified_attention", "target": "gfx942", "case": "decode", "estimate_us": 1.0,
                 "fraction": 0.9, "bound": "memory"}]
    fake.write_text(json.dumps({"paper_model": paper, "roofline": roofline}))
    outcome = _model_result(ctx, fake)
    got = {(e["impl"], e["shape"]): e for e in ctx.result["model"]["estimates"]}
    assert set(got) == {("TRITON", "decode 32x4096"), ("TRITON", "prefill 8x2048")}, got
    assert got[("TRITON", "decode 32x4096")]["bound"] == "memory", got
    assert got[("TRITON", "prefill 8x2048")]["estimate_ms"] == 0.9, got
    assert device_model.estimates_from_gpu_report(None, DRY_RUN_ARCH) == {}
    fallback = device_model.estimates_from_gpu_report(COMMITTED_REPORT, DRY_RUN_ARCH)
    assert ("TRITON", "decode 32x4096") in fallback, f"{COMMITTED_REPORT} has no {DRY_RUN_ARCH} decode estimate"
    ctx.result["model"]["source"] = "dry run: a fake gpu_report JSON"
    return Outcome(outcome.status, "hook reads a gpu_report JSON: " + outcome.summary)


def _pytest_cmd(ctx: Context, junit: Path) -> list[str]:
    cmd = [ctx.python, "-m", "pytest", "-m", "cuda", "-v", "-rfE", "-p", "no:cacheprovider", f"--junitxml={junit}",
           *cuda_test_files()]
    if importlib.util.find_spec("xdist"):
        cmd += ["-n", "4"]
    if importlib.util.find_spec("pytest_timeout"):
        cmd += ["--timeout", str(PYTEST_TEST_TIMEOUT_S)]   # the hypothesis suite is one long test
    return cmd


def step_pytest(ctx: Context, cap: float) -> Outcome:
    junit = ctx.out / "pytest_cuda.xml"
    rc, out = wait_background(ctx, "pytest", min(cap, ctx.remaining() - BENCH_RESERVE_S))
    counts = pytest_counts(out)
    summary = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no tests reported"
    if rc is None:
        return Outcome("timeout", summary + " (stopped at its cap)", {"counts": counts})
    return Outcome("passed" if rc == 0 else "failed", summary,
                   {"counts": counts, "failures": junit_failures(junit), "exit": rc})


def dry_pytest(ctx: Context, cap: float) -> Outcome:
    files = cuda_test_files()
    assert files, "no cuda-marked test modules found"
    rc, out = run_capped(ctx, "pytest --collect-only -m cuda",
                         [ctx.python, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                          *files], cap)
    m = re.search(r"(\d+)(?:/\d+)? tests? (?:collected|selected)", out)
    if rc != 0 or not m or int(m.group(1)) == 0:
        return Outcome("failed", tail(out, 600))
    return Outcome("passed", f"{m.group(1)} cuda tests collect in {', '.join(files)}")


def _memcheck_cmd(ctx: Context, backend: str, which: str, log: Path, out_json: Path) -> list[str]:
    cmd = [compute_sanitizer() or "compute-sanitizer", "--tool", "memcheck", "--error-exitcode", str(SANITIZER_EXIT),
           "--print-limit", "20", "--log-file", str(log), ctx.python, "-m", "devtools.device_kernels",
           "--backend", backend, "--set", which, "--json", str(out_json)]
    if backend == "HIP" and ctx.library:
        cmd += ["--library", ctx.library]
    return cmd


def _memcheck(ctx: Context, cap: float, backend: str, which: str) -> Outcome:
    if compute_sanitizer() is None:
        return Outcome("error", "compute-sanitizer not found")
    if backend == "HIP" and not ctx.library:
        return Outcome("skipped", "no HIP library (the build step failed)")
    log, out_json = ctx.work / f"memcheck_{backend}.log", ctx.work / f"memcheck_{backend}.json"
    # one cudaMalloc per tensor, so that an access past a tensor leaves its allocation
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    rc, out = run_capped(ctx, f"memcheck {backend}", _memcheck_cmd(ctx, backend, which, log, out_json), cap, env)
    text = log.read_text() if log.is_file() else ""
    ctx.log.append(f"===== memcheck {backend} log\n{text}\n")
    errors = sanitizer_errors(text)
    outcome = kernels_outcome(read_json(out_json), rc, f"{backend} under memcheck")
    outcome.details["sanitizer_errors"] = errors
    outcome.summary += f"; memcheck: {'no summary' if errors is None else f'{errors} errors'}"
    if outcome.status == "passed" and errors != 0:
        outcome.status = "failed"
    if errors:
        outcome.details["sanitizer_log"] = tail(text, 3000)
    return outcome


def dry_memcheck(ctx: Context, cap: float) -> Outcome:
    cmd = _memcheck_cmd(ctx, "HIP", "oracle", ctx.work / "x.log", ctx.work / "x.json")
    assert "--tool" in cmd and "devtools.device_kernels" in cmd
    assert sanitizer_errors("========= ERROR SUMMARY: 0 errors\n") == 0
    assert sanitizer_errors("========= ERROR SUMMARY: 3 errors\n") == 3
    return Outcome("passed", f"command wired ({'found' if compute_sanitizer() else 'not on this host'})")


SWEEP = ROOT / "benchmarks" / "triton_gpu_sweep.py"


def step_sweep(ctx: Context, cap: float) -> Outcome:
    """The prefill half of benchmarks/triton_gpu_sweep.py: the shipped Triton prefill tiles against
    the alternatives on this device."""
    out_json = ctx.work / "sweep.json"
    rc, out = run_capped(ctx, "tile sweep", [ctx.python, str(SWEEP), "--cases", "prefill", "--json", str(out_json)],
                         cap)
    rows = read_json(out_json)               # written after each shape
    if not rows:
        return Outcome("timeout" if rc is None else "error", tail(out, 800))
    ctx.result["sweep"] = rows
    best = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        timed = [r for r in rows if r["shape"] == shape and "ms" in r]
        if timed:
            fastest = min(timed, key=lambda r: r["ms"])
            ratio = fastest["speedup_vs_shipped"]
            best.append(f"{shape}: {fastest['candidate']} fastest"
                        + ("" if ratio is None else f" ({ratio:.2f}x the shipped)"))
    status = "timeout" if rc is None else "passed" if rc == 0 else "failed"
    return Outcome(status, "; ".join(best) or tail(out, 800))


def dry_sweep(ctx: Context, cap: float) -> Outcome:
    rc, out = run_capped(ctx, "tile sweep (plans)", [ctx.python, str(SWEEP), "--plans"], cap)
    ok = rc == 0 and "prefill 8x2048 shipped" in out
    return Outcome("passed" if ok else "failed", "candidates' plans printed" if ok else tail(out, 800))


STEPS = (
    Step("environment", 30, step_environment, dry_environment),
    Step("hip build (nvcc)", 150, step_hip_build, dry_hip_build),
    Step("hip vs oracle", 60, step_hip_oracle, dry_hip_oracle),
    Step("memcheck hip", 90, lambda c, cap: _memcheck(c, cap, "HIP", "oracle"), dry_memcheck),
    Step("memcheck triton", 100, lambda c, cap: _memcheck(c, cap, "TRITON", "launches"), dry_memcheck),
    Step("pytest -m cuda", 300, step_pytest, dry_pytest),
    Step("peers", 40, step_peers, dry_peers),
    Step("benchmark", 180, step_benchmark, dry_benchmark),
    Step("model estimates", 30, step_model, dry_model),
    Step("tile sweep", 100, step_sweep, dry_sweep),
)


# ------------------------------------------------------------------------------------ driver
def run_steps(ctx: Context) -> None:
    steps = []
    for step in STEPS:
        cap = min(step.cap_s, ctx.remaining())
        t0 = time.monotonic()
        if cap < 5:
            outcome = Outcome("skipped", "out of the run's time budget")
        else:
            try:
                outcome = (step.dry if ctx.dry_run else step.run)(ctx, cap)
            except Exception as e:                                # recorded; the next step runs
                outcome = Outcome("error", f"{type(e).__name__}: {e}"[:800])
        seconds = round(time.monotonic() - t0, 1)
        steps.append({"name": step.name, "status": outcome.status, "seconds": seconds, "cap_s": int(cap),
                      "summary": outcome.summary, "details": outcome.details})
        print(f"[device_check] {step.name}: {outcome.status} ({seconds:.0f} s): {outcome.summary}", flush=True)
        if step.name == "environment" and outcome.status == "error":
            break                                                  # no GPU: nothing else can run
    for name, proc in ctx.background.items():                      # a step skipped or failed before waiting
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    ctx.result["steps"] = steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", type=Path, default=ROOT / "device_check_out")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all steps together")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    sha, dirty = commit()
    with tempfile.TemporaryDirectory(prefix="kvmulti_device_check_") as work:
        ctx = Context(out=a.out.resolve(), work=Path(work), dry_run=a.dry_run, deadline=t0 + a.budget)
        ctx.result.update(schema=1, date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                          dry_run=a.dry_run, commit=sha, dirty=dirty, budget_s=a.budget)
        run_steps(ctx)
        if a.dry_run:
            try:
                check_writers(ctx)
            except Exception as e:
                ctx.result["steps"].append({"name": "report writers (fake result)", "status": "failed", "seconds": 0,
                                            "cap_s": 0, "summary": f"{type(e).__name__}: {e}"[:800], "details": {}})
        ctx.result["seconds"] = round(time.monotonic() - t0, 1)
        device_report.write_json(ctx.result, ctx.out / "device_check.json")
        device_report.write_markdown(ctx.result, ctx.out / "device_check.md")
        (ctx.out / "device_check.log").write_text("\n".join(ctx.log))
    print(device_report.render_markdown(ctx.result))
    return 0 if all(s["status"] == "passed" for s in ctx.result["steps"]) else 1


# ------------------------------------------------------------------------------------ dry run: writers
def fake_result() -> dict:
    """A complete result with made-up figures (dry run only: the writers' input, never reported)."""
    rows = []
    for shape in device_bench.SHAPES:
        work = device_bench.shape_work(shape)
        for impl, ms in (("TRITON", 1.0), ("HIP", 2.0), ("vLLM-Triton", 1.5), ("FlashInfer-FA3", 0.8), ("SDPA", 0.5)):
            row = {"shape": shape.name, "impl": impl, **work, "ms": ms, "ms_rounds": [ms] * 3, "note": ""}
            if shape.kind == "decode":
                row.update(gb_per_s=work["bytes"] / ms / 1e6, floor_ms=0.4, fraction=0.4 / ms)
            else:
                row.update(tflops=work["flops"] / ms / 1e9, fraction=0.5)
            if impl != "SDPA":
                row["max_abs_diff_vs_sdpa"] = 0.0078
            rows.append(row)
    rows.append({"shape": "decode 1x32768", "impl": "HIP", "error": "RuntimeError: fake | with a bar"})
    sweep = [{"shape": "prefill 8x2048", "candidate": "shipped", "ms": 1.0, "ms_rounds": [1.0] * 3,
              "speedup_vs_shipped": 1.0, "max_abs_diff_vs_sdpa": 0.0078},
             {"shape": "prefill 8x2048", "candidate": "128x128 w8 s2", "error": "OutOfResources: fake"}]
    graphs = [{"shape": "decode 32x4096", "impl": "TRITON", "captured_step": "capture bucket", "graph_ms": 0.9,
               "graph_max_abs_diff_vs_sdpa": 0.0005},
              {"shape": "decode 32x4096", "impl": "HIP", "captured_step": "plain",
               "graph_error": "RuntimeError: fake capture failure"},
              {"shape": "decode 32x4096", "impl": "vLLM-Triton", "graph_ms": 1.2, "graph_max_abs_diff_vs_sdpa": 0.0005}]
    steps = [{"shape": "decode 32x4096", "impl": "FlashInfer-FA3", "layers": 32, "eager_layer_ms": 0.9,
              "eager_step_ms": 40.0, "graph_layer_ms": 0.8, "graph_step_ms": 26.0, "graph_step_vs_layers": 1.02,
              "graph_max_abs_diff_vs_eager": 0.0}]
    peers = {"bundle": "device_peers", "activate": [],
             **{p: {"loaded": p != "FlashInfer-FA2", "error": None if p != "FlashInfer-FA2" else "OSError: fake"}
                for p in device_peers.PEERS}}
    return {"schema": 1, "date": "2000-01-01 00:00 UTC", "dry_run": True, "commit": "0" * 40, "dirty": False,
            "budget_s": BUDGET_S, "seconds": 1.0,
            "device": {"name": "FAKE GPU", "arch": "sm_90", "multiprocessors": 132, "memory_gib": 79.2},
            "versions": {"torch": "x", "triton": "y"},
            "steps": [{"name": s.name, "status": "passed", "seconds": 1.0, "cap_s": s.cap_s, "summary": "fake",
                       "details": {}} for s in STEPS],
            "benchmark": {"ceilings": {"copy": {"bytes": 2 << 30, "ms": 1.0, "gb_per_s": 3000.0},
                                       "matmul": {"n": 8192, "ms": 1.0, "tflops": 700.0}}, "rows": rows,
                          "graphs": graphs, "decode_steps": steps, "peers": ["vLLM-Triton", "FlashInfer-FA3"],
                          "unavailable_peers": {"FlashInfer-FA2": "OSError: fake"}},
            "peers": peers,
            "sweep": sweep,
            "model": {"source": "fake", "estimates": [{"impl": "TRITON", "shape": "decode 32x4096", "estimate_ms": 0.25,
                                                       "fraction": 0.6, "bound": "memory", "model_device": "H100 SXM",
                                                       "source": "fake.json: roofline"}]}}


def check_writers(ctx: Context) -> None:
    """The writers on a fake result: valid JSON back, markdown tables, the doc's block replaced."""
    fake = fake_result()
    json_path, md_path = ctx.work / "fake.json", ctx.work / "fake.md"
    device_report.write_json(fake, json_path)
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(fake))
    device_report.write_markdown(fake, md_path)
    md = md_path.read_text()
    table_rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert "| decode 32x4096 | TRITON |" in md and "FAKE GPU" in md and len(table_rows) > 10, md
    assert "| decode 32x4096 | TRITON | capture bucket | 1.000 | 0.900 |" in md and "not captured" in md, md
    assert "| decode 32x4096 | vLLM-Triton | - | 1.500 | 1.200 |" in md, md
    assert "| FlashInfer-FA2 | not loaded | OSError: fake |" in md, md
    assert "| decode 32x4096 | FlashInfer-FA3 | 32 |" in md, md
    assert "| prefill 8x2048 | shipped | 1.000 | 1.00x |" in md and "OutOfResources: fake" in md, md
    assert all(line.endswith(" |") for line in table_rows), md
    doc = ctx.work / "performance.md"
    shutil.copy(device_report.DOC, doc)
    device_report.update_doc(doc, fake)
    assert "FAKE GPU" in doc.read_text() and doc.read_text().count(device_report.BEGIN) == 1
    ctx.result["steps"].append({"name": "report writers (fake result)", "status": "passed", "seconds": 0,
                                "cap_s": 0, "summary": f"JSON, markdown ({len(table_rows)} table rows) "
                                "and the docs block", "details": {}})


if __name__ == "__main__":
    sys.exit(main())
