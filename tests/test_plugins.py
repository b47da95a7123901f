"""Backends and platforms from outside kvmulti: ``tests/plugin_pkg`` (its own pyproject.toml with
``kvmulti.backends`` / ``kvmulti.platforms`` entry points) installed into a temporary venv next to
kvmulti is listed by ``kvmulti info``, selected by ``KVMULTI_ATTENTION_BACKEND``, runs steps against
the oracle, and its platform resolves a device type kvmulti does not know. The registry's rules
(names taken twice, imports that fail) are checked in this process."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kvmulti
from kvmulti import platform, plugins
from kvmulti.backends import registry

PLUGIN = Path(__file__).resolve().parent / "plugin_pkg"

STEP_SCRIPT = textwrap.dedent("""
    import json, torch, kvmulti
    from kvmulti import reference
    from kvmulti.backends.registry import dispatch_order, select_backend
    import kvmulti_example_plugin

    kvmulti_example_plugin.name_the_device_type()
    torch.manual_seed(0)
    layout = kvmulti.KVCacheLayout(num_blocks=16, block_size=4, num_kv_heads=2, head_size=16, dtype=torch.float32)
    cache = layout.allocate("cpu")
    table = torch.randperm(16, dtype=torch.int32).reshape(2, 8)
    errors, used = [], set()
    for query_lens, seq_lens, window, softcap in (([7, 3], [7, 3], None, None), ([1, 1], [8, 4], None, 5.0),
                                                  ([2, 3], [10, 7], 3, None)):
        md = kvmulti.CommonAttentionMetadata.from_lens(query_lens, seq_lens, table, layout.block_size)
        tokens = sum(query_lens)
        key, value = torch.randn(tokens, 2, 16), torch.randn(tokens, 2, 16)
        query = torch.randn(tokens, 4, 16)
        kvmulti.write_kv(key, value, cache, layout, md.slot_mapping)
        step = kvmulti.prepare_step(md, layout, 4, sliding_window=window)
        used.add(step.backend.name)
        out = kvmulti.paged_attention(query, cache, layout, step, sliding_window=window, softcap=softcap)
        want = reference.paged_attention(query, cache, layout, md, sliding_window=window, softcap=softcap)
        errors.append((out - want).abs().max().item())
    config = kvmulti.AttentionConfig.from_layout(layout, "cpu")
    print(json.dumps({"selected": select_backend(config), "used": sorted(used), "errors": errors,
                      "platform": kvmulti.platform.platform_of(torch.device("toydev", 0)),
                      "toyplat_order": list(dispatch_order("toyplat"))}))
""")


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory) -> Path:
    """A venv that sees this interpreter's packages (kvmulti from this checkout) with the plugin
    installed into it from tests/plugin_pkg (no network, no build isolation)."""
    root = tmp_path_factory.mktemp("plugin_venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    own_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
    ours = [p for p in site.getsitepackages() if os.path.isdir(p)]
    (Path(own_site) / "outer_venv.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({p!r})" for p in ours) + "\n")
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                           str(PLUGIN)], capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    return python


def _run(python: Path, args: list[str], **env: str) -> str:
    """Run the venv's python; native builds are keyed on the venv, so the CPU kernel's and the SYCL
    shim's are left out (torch path; no runtime): the plugin is what is under test."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVMULTI_") or k == "KVMULTI_CACHE_DIR"}
    environ.update(KVMULTI_CPU_NATIVE="0", KVMULTI_SYCL_ROOT=str(python.parent / "no-sycl-runtime"))
    done = subprocess.run([str(python), *args], capture_output=True, text=True, env={**environ, **env},
                          cwd=python.parent, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_kvmulti_info_lists_the_plugin_backends(venv_python):
    info = json.loads(_run(venv_python, ["-m", "kvmulti.cli", "info", "--json"]))
    assert info["backends"]["EXAMPLE"] == {"usable": True, "reasons": [], "runs_on": "cpu (torch, out of tree)"}
    broken = info["backends"]["BROKEN"]
    assert not broken["usable"] and "kvmulti_example_plugin_missing_dependency" in broken["reasons"][0], broken
    assert set(kvmulti.backends.backend_names()) < set(info["backends"])     # kvmulti's own are all there


def test_the_plugin_backend_is_selected_runs_steps_and_its_platform_resolves(venv_python):
    result = json.loads(_run(venv_python, ["-c", STEP_SCRIPT], KVMULTI_ATTENTION_BACKEND="example"))
    assert result["selected"] == "EXAMPLE" and result["used"] == ["EXAMPLE"], result
    assert max(result["errors"]) < 1e-5, result
    assert result["platform"] == "toyplat" and result["toyplat_order"] == ["EXAMPLE"], result


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made by a test are forgotten after it."""
    registry.backend_names()
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    monkeypatch.setattr(platform, "_PLATFORMS", dict(platform._PLATFORMS))
    monkeypatch.setattr(platform, "_BY_DEVICE_TYPE", {})
    yield
    for cached in (registry._instance, registry._select_cached, registry._select_for_layout):
        cached.cache_clear()


def test_a_name_registered_twice_is_an_error_naming_both(scratch_registry):
    with pytest.raises(plugins.RegistrationError,
                       match=r"backend CPU is registered twice: by kvmulti\.backends\.cpu\.backend\.CPUBackend "
                             r"and by somewhere\.else:Backend"):
        kvmulti.register_backend("cpu", "somewhere.else:Backend")
    with pytest.raises(plugins.RegistrationError, match="platform 'cuda' is registered twice: by kvmulti.platform"):
        kvmulti.register_platform("cuda", "cuda")


def test_a_backend_that_fails_to_import_is_its_reason(scratch_registry):
    kvmulti.register_backend("ghost", "kvmulti_no_such_module:GhostBackend", platforms=("cpu",), priority=99)
    reasons = kvmulti.available_backends("cpu")["GHOST"]
    assert len(reasons) == 1 and "kvmulti_no_such_module" in reasons[0] and "ModuleNotFoundError" in reasons[0]
    assert registry.dispatch_order("cpu")[0] == "GHOST"
    layout = kvmulti.KVCacheLayout(num_blocks=4, block_size=4, num_kv_heads=1, head_size=16, dtype=torch.float32)
    config = kvmulti.AttentionConfig.from_layout(layout, "cpu")
    assert kvmulti.select_backend(config) == "CPU"                  # tried first, passed over with its reason


def test_an_unknown_device_type_names_the_way_to_add_it():
    with pytest.raises(ValueError, match="device type 'meta'.*kvmulti.register_platform"):
        platform.platform_of("meta")


def test_readme_backend_table_is_the_registry():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert registry.markdown_table() in readme, registry.markdown_table()
