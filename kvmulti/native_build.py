"""Where native pieces find their sources and put their builds (shared by CPU, HIP and SYCL)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path


def cache_root() -> Path:
    """Root of kvmulti's build cache: ``$KVMULTI_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvmulti``,
    else ``~/.cache/kvmulti``."""
    root = os.environ.get("KVMULTI_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvmulti"


def source_dir(package: str, folder: str, env_var: str, marker: str) -> Path:
    """Folder of a kernel source package: ``$env_var``, else the installed ``package`` when it
    holds ``marker``, else ``<repo>/folder``."""
    env = os.environ.get(env_var)
    if env:
        return Path(env)
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0])
        if (path / marker).is_file():
            return path
    return Path(__file__).resolve().parents[1] / folder
