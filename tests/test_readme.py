"""The README is a front page: short, its links resolve, and its quick start runs as printed."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_readme_is_a_front_page():
    assert len(README.splitlines()) <= 350


def test_readme_and_docs_links_resolve():
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(REPO)} links to missing {target}"


def test_quick_start_runs():
    """The quick start's code, executed as printed: it checks itself against the oracle."""
    code = re.search(r"## Quick start\n\n```python\n(.*?)```", README, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md quick start", "exec"), namespace)
    out = namespace["step"]([2, 1], [8, 44])
    assert tuple(out.shape) == (3, 8, 64)


def test_plots_regenerate_from_the_committed_data(tmp_path):
    """benchmarks/plot.py renders every docs/img PNG the docs show from docs/data/."""
    import subprocess
    import sys
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plot.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    shown = set(re.findall(r"\(img/([\w.]+\.png)\)", (REPO / "docs" / "performance.md").read_text()))
    assert shown, "docs/performance.md shows no plot"
    for name in shown:
        assert (tmp_path / name).stat().st_size > 10_000, f"{name} was not rendered"
        assert (REPO / "docs" / "img" / name).is_file(), f"docs/img/{name} is not committed"
