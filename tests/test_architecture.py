"""The package's shape: one settings module, one metadata preparation per group per step, native
builds keyed on everything that goes into them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvmulti
from kvmulti import settings
from kvmulti.backends.cpu import native as cpu_native
from kvmulti.backends.registry import get_backend

from availability import unavailable
from batches import registered_backends

REPO = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("kvmulti", "hip", "sycl", "triton_kernels", "cpu", "devtools", "benchmarks", "scripts", "tests")
SOURCE_FILES = ("setup.py", ".ci/run", ".github/workflows/ci.yml", "README.md")
VARIABLE = re.compile(r"\bKVMULTI_[A-Z0-9_]*[A-Z0-9]\b")
#: In C/C++/HIP sources KVMULTI_* names are macros; an environment variable there is a getenv().
GETENV = re.compile(r"getenv\(\s*\"(KVMULTI_[A-Z0-9_]+)\"")
C_SUFFIXES = (".h", ".cpp", ".hip")


def source_files():
    for folder in SOURCE_DIRS:
        for path in sorted((REPO / folder).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".sh", ".h", ".cpp", ".hip", ".yml", ".md") \
                    and "__pycache__" not in path.parts:
                yield path
    for name in SOURCE_FILES:
        if (REPO / name).is_file():
            yield REPO / name


def test_every_variable_named_anywhere_is_declared():
    """A KVMULTI_* variable that code reads (or a doc names) must be declared in kvmulti.settings."""
    undeclared = {}
    for path in source_files():
        pattern = GETENV if path.suffix in C_SUFFIXES else VARIABLE
        for name in pattern.findall(path.read_text(errors="replace")):
            if name not in settings.SETTINGS:
                undeclared.setdefault(name, str(path.relative_to(REPO)))
    assert not undeclared, f"undeclared KVMULTI_* variables (declare them in kvmulti/settings.py): {undeclared}"


def test_reading_an_undeclared_variable_fails():
    with pytest.raises(KeyError, match="not declared"):
        settings.get("KVMULTI_" + "NO_SUCH_THING")


def test_no_module_reads_kvmulti_variables_around_settings():
    """Only kvmulti/settings.py touches os.environ for KVMULTI_* names."""
    offenders = []
    for path in (REPO / "kvmulti").rglob("*.py"):
        if path.name == "settings.py":
            continue
        for line in path.read_text().splitlines():
            if re.search(r"environ(\.get\(|\.setdefault\(|\.pop\(|\[)\s*[\"']KVMULTI_", line):
                offenders.append(f"{path.relative_to(REPO)}: {line.strip()}")
    assert not offenders, offenders


def test_readme_variable_table_matches_settings():
    readme = (REPO / "README.md").read_text()
    assert settings.markdown_table() in readme, "README's variable table differs from settings.markdown_table()"


def test_bad_values_are_errors(monkeypatch):
    monkeypatch.setenv("KVMULTI_PARTITION_SIZE", "-7")
    with pytest.raises(ValueError, match="KVMULTI_PARTITION_SIZE='-7'"):
        settings.partition_size()
    monkeypatch.setenv("KVMULTI_VALIDATE", "maybe")
    with pytest.raises(ValueError, match="KVMULTI_VALIDATE='maybe'"):
        settings.get("KVMULTI_VALIDATE")


def test_kvmulti_info_lists_set_variables(monkeypatch):
    from kvmulti.backends import registry
    from kvmulti.cli import collect_info
    monkeypatch.setenv("KVMULTI_PARTITION_SIZE", "64")
    try:
        assert collect_info()["env"]["KVMULTI_PARTITION_SIZE"] == "64"
    finally:   # backends constructed here read the variable: later tests get ones built without it
        for cached in (registry._instance, registry._select_cached, registry._select_for_layout):
            cached.cache_clear()


def _four_layer_runner(backend: str):
    from kvmulti.engine import ModelRunner
    from kvmulti.models import CausalLM, ModelConfig
    types = ["sliding_attention", "full_attention"] * 2
    cfg = ModelConfig.from_hf(dict(model_type="gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=32,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   sliding_window=8, layer_types=types))
    torch.manual_seed(0)
    return ModelRunner(CausalLM(cfg), backend=backend, block_size={"full": 16, "sliding": 4}, num_blocks=64)


@pytest.mark.parametrize("backend", registered_backends())
def test_one_plan_per_group_per_step(backend, monkeypatch):
    """A 4-layer model with 2 KV-cache groups: its backend prepares metadata twice per step (once
    per group), and every layer's attention call reuses what was prepared."""
    if get_backend(backend).not_supported_reasons(
            kvmulti.AttentionConfig("cpu", torch.float32, 16, 16, 2, 4, "NHD", True)):
        pytest.skip(f"{backend} cannot run on this host")
    import warnings
    warnings.filterwarnings("ignore", "kvmulti HIP backend on a CPU tensor", RuntimeWarning)
    runner = _four_layer_runner(backend)
    impl = runner.backends[0]
    assert len(runner.backends) == 2 and all(b is impl for b in runner.backends.values())
    counts = {"plan": 0, "attention": 0}
    real_plan, real_attention = type(impl).plan, type(impl).paged_attention

    def plan(self, *args):
        counts["plan"] += 1
        return real_plan(self, *args)

    def attention(self, query, kv_cache, step, *args):
        assert isinstance(step, kvmulti.StepMetadata) and step.backend is self
        counts["attention"] += 1
        return real_attention(self, query, kv_cache, step, *args)

    real_calls = type(impl).prepared_calls

    class CountedCalls:                       # a backend's native step calls (CPU) run layers too
        def __init__(self, calls):
            self.calls = calls

        def attend(self, *args):
            ran = self.calls.attend(*args)
            counts["attention"] += ran
            return ran

        def write(self, *args):
            return self.calls.write(*args)

    def prepared_calls(self, step):
        calls = real_calls(self, step)
        return None if calls is None else CountedCalls(calls)

    monkeypatch.setattr(type(impl), "plan", plan)
    monkeypatch.setattr(type(impl), "paged_attention", attention)
    monkeypatch.setattr(type(impl), "prepared_calls", prepared_calls)
    runner.add_request("a", list(range(1, 12)))
    runner.add_request("b", list(range(3, 9)))
    for step in range(3):
        before = dict(counts)
        runner.run({"a": [5] if step else [], "b": [6] if step else []})
        assert counts["plan"] - before["plan"] == 2, counts          # 2 groups
        assert counts["attention"] - before["attention"] == 4, counts  # 4 layers


def test_runner_layers_do_no_selection(monkeypatch):
    """Choose once: after construction, a step never consults the selector or the environment."""
    from kvmulti.backends import registry
    runner = _four_layer_runner("CPU")
    runner.add_request("a", [1, 2, 3])

    def forbidden(*args, **kwargs):
        raise AssertionError("selection on the per-step path")

    monkeypatch.setattr(registry, "select_backend", forbidden)
    monkeypatch.setattr(registry, "select_backend_for_layout", forbidden)
    monkeypatch.setattr(kvmulti.ops, "select_backend_for_layout", forbidden)
    monkeypatch.setattr(settings, "raw", forbidden)
    runner.run({"a": []})
    runner.run({"a": [4]})


def test_non_causal_is_a_capability_reason():
    config = kvmulti.AttentionConfig("cpu", torch.float32, 64, 64, 2, 16, "NHD", causal=False)
    assert not get_backend("CPU").not_supported_reasons(config)
    assert any("non-causal" in r for r in get_backend("IPEX").capability_reasons(config))


def test_build_key_covers_the_environment(monkeypatch):
    from kvmulti import native_build
    files = [REPO / "cpu" / "attention_kernel.h"]
    key = native_build.build_key(files, ["-O3"])
    monkeypatch.setattr(native_build, "environment_fingerprint", lambda: ["/other/venv/site-packages/torch"])
    assert native_build.build_key(files, ["-O3"]) != key
    assert native_build.build_key(files, ["-O2"]) != key


def test_locked_build_compiles_units_in_parallel_then_links(tmp_path):
    """``units``: each compile writes its {obj}; the link gets them for {objs}; a failing unit raises with the
    compiler's message and leaves neither the library nor its scratch objects behind."""
    import ctypes
    import shutil
    from kvmulti import native_build
    cxx = shutil.which("g++")
    if cxx is None:
        unavailable("g++ missing (apt-get install g++)")
    (tmp_path / "part.cpp").write_text('extern "C" int part() { return PART; }\n')
    (tmp_path / "whole.cpp").write_text('extern "C" int part();\nextern "C" int whole() { return part() + 1; }\n')
    units = [[cxx, "-fPIC", "-DPART=41", "-c", str(tmp_path / "part.cpp"), "-o", "{obj}"],
             [cxx, "-fPIC", "-c", str(tmp_path / "whole.cpp"), "-o", "{obj}"]]
    out = tmp_path / "build" / "libwhole.so"
    native_build.locked_build(out, [cxx, "-shared", "{objs}", "-o", "{tmp}"], "two units", units=units)
    assert ctypes.CDLL(str(out)).whole() == 42
    assert sorted(p.name for p in out.parent.iterdir()) == [".lock", "libwhole.so"]
    broken = tmp_path / "broken" / "libwhole.so"
    with pytest.raises(native_build.NativeBuildError, match="PART"):
        native_build.locked_build(broken, [cxx, "-shared", "{objs}", "-o", "{tmp}"], "two units",
                                  units=[[c for c in units[0] if c != "-DPART=41"], units[1]])
    assert sorted(p.name for p in broken.parent.iterdir()) == [".lock"]


def _make_venv(path: Path) -> Path:
    """A virtual environment with its OWN torch directory (hard-linked from this one: same files,
    another install path), kvmulti importable from the repository."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    site = next((path / "lib").glob("python3*")) / "site-packages"
    src = Path(torch.__file__).resolve().parent.parent
    for name in os.listdir(src):
        target = site / name
        if name.startswith(("kvmulti", "_kvmulti", "__editable__")) or target.exists():
            continue
        subprocess.run(["cp", "-al", str(src / name), str(target)], check=True)
    (site / "kvmulti_repo.pth").write_text(str(REPO) + "\n")
    return path / "bin" / "python"


@pytest.mark.slow
def test_two_venvs_do_not_rebuild_each_other(tmp_path):
    """Two venvs with the same torch version, alternating `kvmulti info` on one build cache: each
    builds the CPU kernel's torch bindings once (and says so), the first one also the ISA variants,
    which the second links as they are; then neither rebuilds. Built at -O0 (the build keys are under
    test, not the kernel's speed) with the generic variant only."""
    if os.environ.get("KVMULTI_CPU_NATIVE") == "0":
        pytest.skip("native CPU kernel disabled")
    pythons = [_make_venv(tmp_path / name) for name in ("venv-a", "venv-b")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMULTI_")}
    env["KVMULTI_CACHE_DIR"] = str(tmp_path / "cache")
    env["KVMULTI_CPU_EXTRA_CFLAGS"] = "-O0 " + cpu_native.skip_flags(())   # the generic variant only

    def info(python: Path) -> str:
        res = subprocess.run([str(python), "-m", "kvmulti.cli", "info"], env=env, capture_output=True, text=True,
                             timeout=900, cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        assert "native (" in res.stdout, res.stdout
        return res.stderr

    first = [info(p) for p in pythons]
    assert all("building the native CPU attention kernel's torch bindings" in err for err in first), first
    variants = ["building the native CPU attention kernel's ISA variants" in err for err in first]
    assert variants == [True, False], first
    again = [info(p) for p in pythons + pythons]
    assert not any("building" in err for err in again), again
