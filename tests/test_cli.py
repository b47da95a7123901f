import json
import subprocess
import sys

import pytest

from kvmulti import cli


def test_info_text(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "platform: cpu" in out
    for name in ("HIP", "SYCL", "TRITON", "CPU"):
        assert name in out


def test_info_json(capsys):
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["platform"] == "cpu" and info["priority"] == ["CPU"]
    assert info["backends"]["CPU"]["usable"] is True
    assert all(entry["usable"] or entry["reasons"] for entry in info["backends"].values())


@pytest.mark.parametrize("var", ["KVMULTI_ATTENTION_BACKEND", "KVMULTI_DRAFT_ATTENTION_BACKEND"])
def test_bad_env_value_exits_nonzero_with_library_message(var):
    env = {"PATH": "", var: "nonsense"}
    run = subprocess.run([sys.executable, "-m", "kvmulti.cli", "info"], capture_output=True, text=True, env=env)
    assert run.returncode != 0
    assert f"{var}='nonsense' is not a kvmulti backend; valid names: HIP, SYCL, TRITON, CPU" in run.stderr


def test_generate_main_job_on_the_shipped_pair():
    """The README's main job, shortened: backends per model and group, text, stats, identity check."""
    run = subprocess.run([sys.executable, "-m", "kvmulti.cli", "generate", "def fib(n):", "--max-new-tokens", "24"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "(1 CPU threads)" in out                      # the tiny pair runs single-threaded by default
    assert out.count("backend=CPU") == 2                 # target group 0 and draft group 0
    assert "\ndef fib(n):" in out and "acceptance rate" in out and "speculative speed-up" in out
    assert "greedy output identical to target-only decoding: yes" in out
