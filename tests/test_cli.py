import json
import os
import subprocess
import sys

import pytest

from kvmulti import cli
from kvmulti.backends.registry import backend_names


def test_info_text(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "platform: cpu" in out
    for name in backend_names():
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
    assert f"{var}='nonsense' is not a kvmulti backend; valid names: {', '.join(backend_names())}" in run.stderr


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
    assert "CPU backend: cpu: native (" in out           # the header says which CPU path runs


def run_cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmulti.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args,message", [
    (["--model", "/nonexistent-model"], "--model /nonexistent-model: no such directory"),
    (["--model", "/tmp"], "--model /tmp: not a model directory (no config.json)"),
    (["--draft", "/tmp"], "--draft /tmp: not a model directory (no config.json)"),
    (["--max-new-tokens", "-1"], "argument --max-new-tokens: must be >= 1, got -1"),
    (["-k", "0"], "argument -k/--num-speculative-tokens: must be in 1..32, got 0"),
    (["-k", "33"], "argument -k/--num-speculative-tokens: must be in 1..32, got 33"),
    (["--temperature", "nan"], "argument --temperature: must be a finite number >= 0"),
    (["--backend", "cudnn"], f"backend='cudnn' is not a kvmulti backend; valid names: {', '.join(backend_names())}"),
    (["--threads", "0"], "argument --threads: must be >= 1, got 0"),
    (["--max-new-tokens", "2000"], "leaves no room for a prompt in the model's context of 1024 positions"),
])
def test_generate_user_errors_are_one_line_exit_2(args, message):
    """Every user error: one line on stderr, exit code 2, before any model loads (fast)."""
    run = run_cli("generate", "hello", "--no-baseline", *args)
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert run.stderr.count("\n") == 1 and message in run.stderr, run.stderr
    assert run.stdout == ""


def test_generate_prompt_longer_than_the_context():
    long_prompt = "x" * 5000
    run = run_cli("generate", long_prompt, "--no-baseline")
    assert run.returncode == 2 and "exceeds the model's context of 1024 positions" in run.stderr, run.stderr
    assert "--truncate-prompt" in run.stderr
    run = run_cli("generate", long_prompt, "--no-baseline", "--truncate-prompt", "--max-new-tokens", "8",
                  "--kv-memory-mb", "64", timeout=300)
    assert run.returncode == 0, run.stderr


def test_generate_out_of_kv_memory_names_the_option():
    run = run_cli("generate", "def f(x):" * 40, "--no-baseline", "--kv-memory-mb", "1", "--max-new-tokens", "8",
                  timeout=300)
    assert run.returncode == 2 and "raise --kv-memory-mb (now 1)" in run.stderr, run.stderr
    assert run.stderr.strip().count("\n") == 0


def test_version_and_help():
    run = run_cli("--version")
    assert run.returncode == 0 and run.stdout.startswith("kvmulti 0.1.0")
    help_text = " ".join(run_cli("generate", "--help").stdout.split())
    for text in ("(default: 96)", "(default: 4)", f"{', '.join(backend_names())} (default: dispatch)", "--kv-memory-mb", "--truncate-prompt",
                 "attention backend of the draft model", "--backend names the target's only"):
        assert text in help_text, text
    assert "never the target's" not in help_text


HELP_IMPORTS = """
import sys
from kvmulti import cli
try:
    cli.main(["--help"])
except SystemExit as exit:
    assert exit.code == 0
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("kvmulti.backends")))
"""


def test_help_imports_no_torch():
    """``kvmulti --help`` stays fast: neither torch nor any backend is imported for it."""
    run = subprocess.run([sys.executable, "-c", HELP_IMPORTS], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout
    assert "usage: kvmulti" in run.stdout and "generate" in run.stdout and "build" in run.stdout


def test_generate_into_a_closed_pipe_exits_quietly():
    """``kvmulti generate x | head -1``: the first line, then no traceback and exit 0 (unbuffered, so
    the lines after the first one are written after ``head`` has gone)."""
    gen = subprocess.Popen([sys.executable, "-m", "kvmulti.cli", "generate", "x", "--max-new-tokens", "8", "--no-baseline"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    head = subprocess.run(["head", "-1"], stdin=gen.stdout, capture_output=True, text=True, timeout=300)
    gen.stdout.close()
    err = gen.stderr.read().decode()
    assert gen.wait(timeout=300) == 0, err
    assert head.stdout.startswith("target: ")
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_info_prints_no_reason_twice():
    info = cli.collect_info()
    for name, entry in info["backends"].items():
        assert len(set(entry["reasons"])) == len(entry["reasons"]), (name, entry)
        assert not any(reason in entry["runs_on"] for reason in entry["reasons"]), (name, entry)


def test_build_reports_per_backend(capsys):
    assert cli.main(["build", "--backend", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "kvmulti build: CPU ..." in out and "kvmulti build: CPU: native kernel, " in out, out
    assert "variants usable here: " in out
    assert cli.main(["build", "--backend", "triton"]) == 0
    assert "kvmulti build: TRITON: nothing to build ahead" in capsys.readouterr().out


def test_build_names_an_unknown_backend_in_one_line(capsys):
    assert cli.main(["build", "--backend", "cudnn"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "backend='cudnn' is not a kvmulti backend" in err, err
