"""The device check (scripts/device_check.sh) stays runnable between GPU runs: its dry run on this
CPU host wires every step (the HIP sources compile with nvcc for sm_90 and bind through the
launcher's ABI, the cuda-marked tests collect, the peers load or are recorded as not loading, the
benchmark's eager, graph and decode-step code runs on CPU tensors, the report writers work on a fake
result), and its parsers read pytest's and compute-sanitizer's output. The peers' own calls run on
CPU tensors under Triton's interpreter in the exhaustive tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from devtools import device_bench, device_check, device_peers, device_peers_build  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def test_dry_run_wires_every_step(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), str(tmp_path), "--dry-run"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads((tmp_path / "device_check.json").read_text())
    assert result["dry_run"] is True
    names = [s["name"] for s in result["steps"]]
    assert names[:len(device_check.STEPS)] == [s.name for s in device_check.STEPS]
    assert all(s["status"] == "passed" for s in result["steps"]), result["steps"]
    assert "hip build" in names[1] and "ABI bound" in result["steps"][1]["summary"]
    steps = {s["name"]: s for s in result["steps"]}
    peers = result["peers"]
    if peers.get("bundle"):                       # each peer loaded or recorded with its error
        assert all(peers[p]["loaded"] or peers[p]["error"] for p in device_peers.PEERS), peers
    bench = steps["benchmark"]["details"]["benchmark"]
    triton = [g for g in bench["graphs"] if g["impl"] == "TRITON"]
    assert [g["captured_step"] for g in triton] == ["capture bucket"] * len(device_bench.DRY_SHAPES), triton
    assert all("graph_ms" in g for g in bench["graphs"]) and {"TRITON", "SDPA"} <= {g["impl"] for g in bench["graphs"]}
    assert [r["impl"] for r in bench["decode_steps"]][:1] == ["TRITON"]
    assert all(r["graph_max_abs_diff_vs_eager"] == 0.0 for r in bench["decode_steps"]), bench["decode_steps"]
    assert (tmp_path / "device_check.md").read_text().startswith("# kvmulti device check")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["device_check.json", "device_check.log", "device_check.md"]


def test_pytest_counts_from_the_final_line_or_the_progress_lines():
    final = "....\n===== 40 passed, 2 failed, 3 skipped, 1 error in 81.20s (0:01:21) =====\n"
    assert device_check.pytest_counts(final) == {"passed": 40, "failed": 2, "skipped": 3, "error": 1}
    stopped = ("[gw0] [  2%] PASSED tests/test_triton_gpu.py::test_gpu_corners[a-cuda]\n"
               "[gw1] [  4%] FAILED tests/test_triton_gpu.py::test_gpu_corners[b-cuda]\n"
               "tests/test_triton_gpu.py::test_gpu_corners[c-cuda] PASSED                 [  6%]\n")
    assert device_check.pytest_counts(stopped) == {"passed": 2, "failed": 1}


def test_sanitizer_summary_and_junit_failures(tmp_path):
    assert device_check.sanitizer_errors("========= ERROR SUMMARY: 2 errors\n") == 2
    assert device_check.sanitizer_errors("killed before the summary") is None
    junit = tmp_path / "j.xml"
    junit.write_text('<testsuites><testsuite><testcase classname="t" name="a"/>'
                     '<testcase classname="t" name="b"><failure message="boom">x</failure></testcase>'
                     '</testsuite></testsuites>')
    assert device_check.junit_failures(junit) == [{"test": "t::b", "message": "boom"}]


def test_cuda_marked_modules_are_found():
    files = device_check.cuda_test_files()
    assert "tests/test_triton_gpu.py" in files and "tests/test_ci.py" not in files


def test_peer_page_description_and_split_count():
    """FlashInfer's indptr / indices / last-page lengths from a block table; vLLM's decode splits."""
    table = torch.tensor([[5, 2, 9], [7, 1, 0]], dtype=torch.int32)
    p = device_peers.PeerProblem(q=torch.zeros(2, 4, 16), cache=torch.zeros(10, 4, 2, 32), order="NHD",
                                 query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
                                 seq_lens=torch.tensor([9, 4], dtype=torch.int32), block_table=table,
                                 max_query_len=1, max_seq_len=9, scale=0.25)
    indptr, indices, last = device_peers.paged_indices(p)
    assert indptr.tolist() == [0, 3, 4] and indices.tolist() == [5, 2, 9, 7] and last.tolist() == [1, 4]
    k, v = p.kv()
    assert k.data_ptr() == p.cache.data_ptr() and v.data_ptr() == p.cache[..., 16:].data_ptr()
    assert [device_peers.vllm_decode_splits(n, 132) for n in (100, 4096, 32768, 10 ** 7)] == [1, 8, 64, 264]


def test_a_missing_bundle_is_recorded_not_raised(tmp_path):
    assert device_peers.activate(tmp_path / "none") == [f"no peer bundle at {tmp_path / 'none'} "
                                                        "(scripts/build_device_peers.sh makes it)"]


@pytest.mark.exhaustive
def test_vllm_peers_run_on_cpu_tensors_beside_triton(tmp_path):
    """vLLM's Triton kernels, copied with the stand-in for their vLLM imports, run in the dry
    benchmark under Triton's interpreter: eager, "replayed" and in a decode step, matching SDPA."""
    if not VLLM_PYTHON.is_file():
        message = f"{VLLM_PYTHON} missing: run scripts/setup.sh --test"
        pytest.fail(message) if IN_CI else pytest.skip(message)
    ops = subprocess.run([str(VLLM_PYTHON), "-c", "import importlib.util; "
                          "print(importlib.util.find_spec('vllm').submodule_search_locations[0])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    bundle = tmp_path / "device_peers"
    device_peers_build.build_vllm(bundle, Path(ops) / "v1" / "attention" / "ops")
    out = tmp_path / "bench.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "devtools.device_bench", "--dry-run", "--json", str(out), "--peers",
                           str(bundle), "--peers-scratch", str(tmp_path / "scratch")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    bench = json.loads(out.read_text())
    assert bench["peers"] == ["vLLM-Triton", "vLLM-Triton decode"], bench["unavailable_peers"]
    for key in ("rows", "graphs", "decode_steps"):
        assert not [r for r in bench[key] if "error" in r or "graph_error" in r], bench[key]
    vllm = [r for r in bench["rows"] if r["impl"].startswith("vLLM")]
    assert len(vllm) == 3 and all(r["max_abs_diff_vs_sdpa"] < 1e-4 for r in vllm), vllm
    assert {r["impl"] for r in bench["decode_steps"]} == {"TRITON", "vLLM-Triton", "vLLM-Triton decode"}
