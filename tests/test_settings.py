"""Every typed ``KVMULTI_*`` variable is checked by :func:`kvmulti.settings.validate` with one message
format (``NAME='value': expected ...``), and the CLI turns a bad value into one line and exit 2
before it imports anything heavy."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvmulti import cli, settings

#: a bad value for every variable kvmulti reads whose type can reject text
BAD = {s.name: ("-7" if s.name == "KVMULTI_PARTITION_SIZE" else "x1" if s.kind == "int" else "maybe")
       for s in settings.SETTINGS.values()
       if s.kind in ("bool", "int", "choice") and s.read_by in ("kvmulti", "install")}


def test_every_typed_variable_is_covered():
    assert {"KVMULTI_VALIDATE", "KVMULTI_VLLM", "KVMULTI_PARTITION_SIZE", "KVMULTI_CPU_ISA",
            "KVMULTI_HIP_CPU_WAVE", "KVMULTI_SYCL_STAGE"} <= set(BAD)


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_is_refused_in_one_format(name, monkeypatch, capsys):
    monkeypatch.setenv(name, BAD[name])
    with pytest.raises(settings.SettingError, match=f"^{name}='{BAD[name]}': expected "):
        settings.validate()
    assert cli.main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvmulti: error: {name}='{BAD[name]}': expected ") and err.count("\n") == 1, err


def test_several_bad_values_make_one_line(monkeypatch):
    monkeypatch.setenv("KVMULTI_VALIDATE", "maybe")
    monkeypatch.setenv("KVMULTI_VLLM", "xyz")
    with pytest.raises(settings.SettingError) as error:
        settings.validate()
    assert str(error.value) == ("KVMULTI_VALIDATE='maybe': expected 1 or 0 (or true/false, yes/no, on/off); "
                                "KVMULTI_VLLM='xyz': expected 1 or 0 (or true/false, yes/no, on/off)")


def test_good_values_pass(monkeypatch):
    for name, value in (("KVMULTI_VALIDATE", "yes"), ("KVMULTI_VLLM", "0"), ("KVMULTI_PARTITION_SIZE", "-1"),
                        ("KVMULTI_CPU_ISA", "AVX2"), ("KVMULTI_HIP_CPU_WAVE", "32")):
        monkeypatch.setenv(name, value)
    settings.validate()


def test_the_command_line_exits_2_with_one_line():
    env = {"PATH": "", "KVMULTI_VALIDATE": "maybe", "KVMULTI_VLLM": "xyz"}
    for command in (["info"], ["build"], ["generate", "x", "--no-baseline"]):
        run = subprocess.run([sys.executable, "-m", "kvmulti.cli", *command], capture_output=True, text=True, env=env,
                             timeout=300)
        assert run.returncode == 2, (command, run.stdout, run.stderr)
        assert run.stderr.count("\n") == 1 and "KVMULTI_VALIDATE='maybe'" in run.stderr, run.stderr
        assert "KVMULTI_VLLM='xyz'" in run.stderr and run.stdout == ""
