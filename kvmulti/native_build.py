"""The one native-build helper of the CPU, HIP and SYCL backends: sources, compilers, build keys
and locked builds into a cache directory.

A build's directory is named by a hash of EVERYTHING that goes into it: the source files, the
flags, the compiler (path and ``--version``), the Python and torch versions and where torch and the
Python environment are installed (a build embeds those include paths; two virtual environments
with the same torch version must not keep rebuilding each other's library). Every build says on
stderr when it starts and where it goes; concurrent processes wait on a file lock and then reuse
the result.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator

from . import settings

#: Flags that add AddressSanitizer + UndefinedBehaviorSanitizer to a build (KVMULTI_SANITIZE=1).
SANITIZER_FLAGS: tuple[str, ...] = ("-O1", "-fsanitize=address,undefined", "-fno-omit-frame-pointer",
                                    "-fno-sanitize-recover=undefined")


class NativeBuildError(RuntimeError):
    """A native build failed; the message holds the command and the compiler's output."""


def cache_root() -> Path:
    """Root of kvmulti's build cache: ``$KVMULTI_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvmulti``,
    else ``~/.cache/kvmulti``."""
    root = settings.get("KVMULTI_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvmulti"


def source_dir(package: str, folder: str, env_var: str | None, marker: str) -> Path:
    """Folder of a kernel source package: ``$env_var`` (when given), else the installed ``package``
    when it holds ``marker``, else ``<repo>/folder``."""
    env = settings.get(env_var) if env_var else None
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


def find_compiler(*candidates: str | None) -> str | None:
    """Absolute path of the first candidate (name or path) that exists; None when none does."""
    for name in candidates:
        if name:
            path = shutil.which(name)
            if path:
                return path
    return None


def cxx_compiler(override_var: str | None = None) -> tuple[str, str | None]:
    """(name asked for, its path or None): ``$override_var``, else ``$CXX``, else g++."""
    name = (settings.get(override_var) if override_var else None) or os.environ.get("CXX") or "g++"
    return name, find_compiler(name)


@functools.lru_cache(maxsize=None)
def compiler_version(exe: str) -> str:
    """First line of ``exe --version`` ('' when it cannot run)."""
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.strip().splitlines()[0] if out.strip() else ""


def sanitizer_flags() -> tuple[str, ...]:
    """The sanitizer flags when ``KVMULTI_SANITIZE=1``, else none."""
    return SANITIZER_FLAGS if settings.get("KVMULTI_SANITIZE") else ()


def environment_fingerprint() -> list[str]:
    """What about this Python environment a native build depends on (versions and install paths)."""
    parts = [sys.version, sys.prefix]
    try:
        import torch
        parts += [torch.__version__, str(Path(torch.__file__).resolve().parent)]
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return parts


def build_key(files: Iterable[Path], extra: Iterable[str], environment: bool = True) -> str:
    """16 hex digits hashing the files (names and contents), ``extra`` and, with ``environment``, the
    Python environment (:func:`environment_fingerprint`); without it, for a build that neither
    includes Python's nor torch's headers and so serves every environment."""
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    for part in [*extra, *(environment_fingerprint() if environment else [])]:
        h.update(str(part).encode() + b"\0")
    return h.hexdigest()[:16]


def announce(what: str, where: Path) -> None:
    print(f"kvmulti: building {what} into {where} (one time for this configuration) ...", file=sys.stderr,
          flush=True)


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s build lock: an advisory file lock the kernel releases when its holder
    exits, however it exits. Inside it, a ``lock`` file that torch's cpp_extension left behind
    (its own lock is a file that only a clean exit removes; a killed build would make every later
    process wait forever) is stale, and is removed."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        yield


def locked_build(out: Path, cmd: list[str], what: str, env: dict | None = None,
                 units: list[list[str]] = ()) -> Path:
    """Run ``cmd`` (which writes the placeholder ``{tmp}``) under a lock next to ``out``, then move
    the result to ``out`` atomically. Returns ``out``; a build another process finished is reused.
    ``units``: compile commands run first, in parallel on the CPUs this process may use, each writing
    its placeholder ``{obj}`` (an object file in a scratch directory); ``cmd``'s ``{objs}`` stands for
    those objects (a library of several translation units)."""
    if out.exists():
        return out
    with build_lock(out.parent):
        if out.exists():
            return out
        announce(what, out.parent)
        with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
            objs = [str(Path(scratch) / f"unit{i}.o") for i in range(len(units))]
            jobs = max(1, min(len(units), len(os.sched_getaffinity(0))))
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                list(pool.map(lambda i: _run_step([objs[i] if c == "{obj}" else c for c in units[i]], what, env),
                              range(len(units))))
            tmp = str(Path(scratch) / f"out{out.suffix}")
            cmd = [tmp if c == "{tmp}" else c for c in cmd]
            if "{objs}" in cmd:
                at = cmd.index("{objs}")
                cmd = cmd[:at] + objs + cmd[at + 1:]
            _run_step(cmd, what, env)
            os.replace(tmp, out)
    return out


def _run_step(cmd: list[str], what: str, env: dict | None) -> None:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    except OSError as e:
        raise NativeBuildError(f"cannot run {cmd[0]}: {e}") from e
    if res.returncode != 0:
        raise NativeBuildError(f"building {what} failed ({' '.join(cmd)}):\n{res.stdout}{res.stderr}")
