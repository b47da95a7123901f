"""The vLLM plugin's packaging and opt-in, checked without vLLM (the engine runs are
tests/test_vllm_engine.py): the entry point is declared, the plugin module imports no vLLM, and
CPU_ATTN is replaced only with KVMULTI_VLLM=1."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from kvmulti.integrations import vllm as plugin

ROOT = Path(__file__).resolve().parents[1]


def test_entry_point_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"]["kvmulti"] == "kvmulti.integrations.vllm:register"


def test_plugin_module_imports_no_vllm():
    code = "import sys, kvmulti.integrations.vllm, kvmulti.cli; print('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_cpu_attn_replaced_only_on_opt_in(monkeypatch):
    monkeypatch.delenv("KVMULTI_VLLM", raising=False)
    assert not plugin.replaces_cpu_attn()
    monkeypatch.setenv("KVMULTI_VLLM", "1")
    assert plugin.replaces_cpu_attn()


def test_info_line_names_what_the_plugin_does():
    line = plugin.describe()
    assert ("not importable" in line) or ("KVMULTI" in line)
