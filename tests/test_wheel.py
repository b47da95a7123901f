"""The wheel carries the CPU kernel compiled ahead of time: built here (``pip wheel
--no-build-isolation``), installed into a fresh venv that sees this interpreter's torch but has no
compiler on PATH (no CXX/CC) and an empty kvmulti cache, its first ``paged_attention`` call loads
the prebuilt kernel (no build folder appears), matches the reference, and takes under a second."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from kvmulti.backends.cpu import native as cpu_native

REPO = Path(__file__).resolve().parents[1]

FIRST_CALL = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    import torch
    import kvmulti
    from kvmulti import reference
    from kvmulti.backends.cpu import native

    torch.manual_seed(0)
    layout = kvmulti.KVCacheLayout(num_blocks=8, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    cache = layout.allocate("cpu")
    cache.copy_(torch.randn_like(cache))
    table = torch.arange(8, dtype=torch.int32).reshape(2, 4)
    md = kvmulti.CommonAttentionMetadata.from_lens([1, 1], [40, 17], table, layout.block_size)
    query = torch.randn(2, 4, 64)
    start = time.perf_counter()
    out = kvmulti.paged_attention(query, cache, layout, md)
    first_call_s = time.perf_counter() - start
    want = reference.paged_attention(query, cache, layout, md)
    print(json.dumps({"first_call_s": first_call_s, "origin": native.origin(),
                      "describe": kvmulti.backends.get_backend("CPU").describe(),
                      "max_err": (out - want).abs().max().item(), "kvmulti": kvmulti.__file__,
                      "cache_entries": sorted(str(p) for p in Path(os.environ["KVMULTI_CACHE_DIR"]).rglob("*"))}))
""")


#: The wheel is built for this host only (the variants this CPU runs, as the JIT build is), so its
#: build is the JIT build already in this environment's cache: what is under test is the wiring
#: (manifest, ABI key, loading without a compiler), not a second compile. Its first call runs with
#: the same flags, which are part of the prebuilt kernel's key.
HOST_ONLY = {"KVMULTI_CPU_EXTRA_CFLAGS": cpu_native.host_only_extra_cflags(
    os.environ.get("KVMULTI_CPU_EXTRA_CFLAGS", ""))}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from this checkout with this interpreter's torch, for this host's variants."""
    dist = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "-w", str(dist), str(REPO)], capture_output=True, text=True, timeout=1800,
                          env={**os.environ, **HOST_ONLY})
    assert done.returncode == 0, done.stdout + done.stderr
    (path,) = dist.glob("kvmulti-*.whl")
    return path


def test_the_wheel_carries_the_kernel_and_its_abi_key(wheel):
    assert not wheel.name.endswith("-none-any.whl"), wheel.name        # tagged for this interpreter/platform
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        manifest = json.loads(zf.read("kvmulti/_prebuilt/cpu/manifest.json"))
    assert f"kvmulti/_prebuilt/cpu/{manifest['file']}" in names
    assert manifest["abi"]["torch"] == torch.__version__
    assert set(manifest["abi"]) == {"machine", "ext_suffix", "torch", "cxx11_abi", "sources"}


def test_first_call_from_the_installed_wheel_without_a_compiler(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    own_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
    # torch (and pip) from this interpreter's site-packages, as a plain path: no other .pth runs
    (Path(own_site) / "outer_torch.pth").write_text(f"{Path(torch.__file__).resolve().parents[1]}\n")
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr

    cache = tmp_path / "empty-cache"
    cache.mkdir()
    env = {"PATH": str(venv / "bin"), "HOME": str(tmp_path), "KVMULTI_CACHE_DIR": str(cache), **HOST_ONLY}
    for tool in ("g++", "gcc", "c++", "cc", "clang++"):
        assert not any((Path(d) / tool).exists() for d in env["PATH"].split(os.pathsep)), tool
    run = subprocess.run([str(python), "-P", "-c", FIRST_CALL], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(result["kvmulti"]).is_relative_to(venv), result["kvmulti"]
    # primary: the kernel came from the wheel, nothing was built, the answer is right
    assert result["origin"].startswith("prebuilt ("), result
    assert "building" not in run.stderr, run.stderr
    assert result["cache_entries"] == [], result["cache_entries"]
    assert ", prebuilt)" in result["describe"], result["describe"]
    assert result["max_err"] < 1e-5, result
    print(f"first paged_attention call from the installed wheel: {result['first_call_s'] * 1e3:.1f} ms")
    assert result["first_call_s"] < 1.0, result


def test_a_prebuilt_kernel_for_another_torch_falls_back(tmp_path):
    """A manifest whose ABI key differs from this interpreter's is a reason, not a load."""
    from kvmulti.backends.cpu import prebuilt
    key = prebuilt.abi_key("0123456789abcdef")
    for field, other in (("torch", "0.0.1"), ("machine", "riscv64"), ("cxx11_abi", not key["cxx11_abi"]),
                         ("sources", "fedcba9876543210")):
        (tmp_path / "x.so").write_bytes(b"not a library")
        manifest = {"module": "x", "file": "x.so", "compiler": "g++", "abi": {**key, field: other}}
        (tmp_path / prebuilt.MANIFEST).write_text(json.dumps(manifest))
        module, why = prebuilt.load("0123456789abcdef", tmp_path)
        assert module is None and why.startswith("prebuilt kernel does not fit") and field in why, why
    # a matching key whose file is no library: refused with the loader's reason, never a crash
    (tmp_path / prebuilt.MANIFEST).write_text(json.dumps({"module": "x", "file": "x.so", "abi": key}))
    module, why = prebuilt.load("0123456789abcdef", tmp_path)
    assert module is None and why.startswith("prebuilt kernel failed to load"), why
    assert prebuilt.load("0123456789abcdef", tmp_path / "absent") == (None, "no prebuilt kernel in this install")
