"""Fills ``device_peers/`` (ignored, never committed) with the peers the device check times beside
kvmulti: vLLM's Triton attention kernels and FlashInfer's paged decode / prefill modules built
ahead of time for one CUDA arch. Runs on a host without a GPU; ``scripts/build_device_peers.sh``
calls it.

    python -m devtools.device_peers_build --part vllm --vllm-ops DIR [--out device_peers]
    python -m devtools.device_peers_build --part flashinfer --downloads DIR [--out device_peers] [--jobs 2]
    python -m devtools.device_peers_build --part check [--out device_peers]

``vllm``: copies :data:`VLLM_FILES` from an installed vLLM's ``vllm/v1/attention/ops`` into
``OUT/vllm_triton/vllm/v1/attention/ops/`` and writes a stand-in ``vllm`` package around them
(:data:`STAND_IN`: the logger, the platform queries, the environment flag, the Triton re-exports and
the KV quantisation enum they import), so that ``OUT/vllm_triton`` on ``sys.path`` imports them
without vLLM.

``flashinfer``: unpacks ``flashinfer-python`` from DIR into a staging tree, builds
:func:`flashinfer_specs` (paged decode FA2, paged prefill FA2 and FA3; bf16, head 128, int32
indices) with FlashInfer's own JIT build and the nvcc of ``$CUDA_HOME`` / PATH for
``$FLASHINFER_CUDA_ARCH_LIST`` (default ``9.0a``), installs them as AOT modules
(``flashinfer/data/aot/<name>/<name>.so``), then copies into ``OUT/site/`` only the files that
loading the three modules and calling the getters the wrappers' ``plan`` calls, with
``FLASHINFER_DISABLE_JIT=1``, open (recorded by an audit hook), the
AOT modules and the wheels of DIR's ``wheels/`` folder (``apache-tvm-ffi`` and the pure-Python
packages FlashInfer's import needs, for the device's Python).

``check``: imports the bundle as the device check does (``devtools.device_peers``) and prints what
loads and what does not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "device_peers"
VLLM_FILES = ("triton_unified_attention.py", "triton_attention_helpers.py", "triton_decode_attention.py")
#: the peers' problem: what device_bench times (bf16 query / cache / output, head 128, int32 indices)
FLASHINFER_HEAD = 128
LIBCUDA_STUB = "libcuda.so"

STAND_IN = {
    "__init__.py": '"""Stand-in for the few vLLM modules its Triton attention kernels import."""\n',
    "envs.py": "VLLM_BATCH_INVARIANT = False\n",
    "logger.py": "import logging\n\n\ndef init_logger(name):\n    return logging.getLogger(name)\n",
    "triton_utils.py": "import triton\nimport triton.language as tl\n",
    "platforms/__init__.py": '''import torch


class _CudaPlatform:
    """The platform queries the kernels make, answered from torch's CUDA device 0."""

    def is_rocm(self) -> bool:
        return bool(torch.version.hip)

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fnuz if self.is_rocm() else torch.float8_e4m3fn

    def is_device_capability_family(self, capability: int) -> bool:
        if not torch.cuda.is_available():
            return False
        major, _ = torch.cuda.get_device_capability()
        return major * 10 == capability // 10 * 10


current_platform = _CudaPlatform()
''',
    "v1/__init__.py": "",
    "v1/attention/__init__.py": "",
    "v1/attention/ops/__init__.py": "",
    "v1/kv_cache_interface.py": '''from enum import IntEnum


class KVQuantMode(IntEnum):
    """The quantisation modes the kernels compare against (the device check uses NONE)."""

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4

    @property
    def is_per_token_head(self) -> bool:
        return self in (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD,
                        KVQuantMode.INT4_PER_TOKEN_HEAD)
''',
}


# ------------------------------------------------------------------------------------ vLLM
def build_vllm(out: Path, ops_dir: Path) -> list[Path]:
    """Copy :data:`VLLM_FILES` from ``ops_dir`` and write the stand-in package; the files written."""
    missing = [f for f in VLLM_FILES if not (ops_dir / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{ops_dir} lacks {missing} (an installed vLLM's vllm/v1/attention/ops)")
    root = out / "vllm_triton" / "vllm"
    if root.exists():
        shutil.rmtree(root)
    written = []
    for rel, text in STAND_IN.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    for name in VLLM_FILES:
        written.append(Path(shutil.copy2(ops_dir / name, root / "v1" / "attention" / "ops" / name)))
    return written


# ------------------------------------------------------------------------------------ FlashInfer
def flashinfer_args() -> tuple:
    """The module arguments FlashInfer's wrappers derive for the device check's problem: query, cache
    and output dtypes (bf16), index dtype (int32), QK and VO head sizes, positional encoding (none),
    sliding window, soft cap (neither)."""
    import torch
    return (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, FLASHINFER_HEAD, FLASHINFER_HEAD, 0, False,
            False)


def flashinfer_specs() -> dict[str, object]:
    """FlashInfer's JIT specs of the three modules the device check loads, by role (``decode fa2``,
    ``prefill fa2``, ``prefill fa3``): bf16 query / cache / output, int32 indices, head 128, no
    positional encoding, window, soft cap or fp16 QK reduction. Imports ``flashinfer``."""
    from flashinfer.jit.attention import modules
    dtypes = flashinfer_args()
    return {"decode fa2": modules.gen_batch_decode_module(*dtypes),
            # what BatchPrefillWithPagedKVCacheWrapper(backend="fa2") loads when K and V share strides
            "prefill fa2": modules._gen_batch_prefill_primary_module("fa2", *dtypes, False),
            "prefill fa3": modules.gen_batch_prefill_module("fa3", *dtypes, False)}


def _unpack(wheel: Path, into: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(into)


def _one(pattern: str, folder: Path) -> Path:
    hits = sorted(folder.glob(pattern))
    if len(hits) != 1:
        raise FileNotFoundError(f"expected one {pattern} in {folder}, found {[h.name for h in hits]}")
    return hits[0]


def libcuda_stub(folder: Path) -> Path:
    """An empty ``libcuda.so`` (soname ``libcuda.so.1``) for the link step on a host without the
    driver: the modules resolve the driver's symbols at load time on the device."""
    folder.mkdir(parents=True, exist_ok=True)
    source, lib = folder / "empty.c", folder / LIBCUDA_STUB
    if not lib.exists():
        source.write_text("")
        subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(source)], check=True)
        shutil.copy2(lib, folder / "libcuda.so.1")
    return lib


def cuda_home(env: dict[str, str]) -> Path:
    """The CUDA toolkit to build with: $CUDA_HOME / $CUDA_PATH, the folder above the real nvcc on
    PATH, /usr/local/cuda; the first with ``bin/nvcc`` and ``lib64/libcudart.so``."""
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    homes = [env.get("CUDA_HOME"), env.get("CUDA_PATH"), nvcc and str(Path(nvcc).resolve().parents[1]),
             "/usr/local/cuda"]
    for home in homes:
        if home and (Path(home) / "bin" / "nvcc").exists() and (Path(home) / "lib64" / "libcudart.so").exists():
            return Path(home)
    raise FileNotFoundError(f"no CUDA toolkit with bin/nvcc and lib64/libcudart.so among {homes}")


def build_env(staging: Path, downloads: Path, jobs: int) -> dict[str, str]:
    """The environment of the build: the staging tree first on PYTHONPATH, FlashInfer's workspace in
    the downloads folder, the arch list, the job count, the stub's folder on the link path and the
    cuRAND headers (a header some FA3 sources include) on the include path."""
    stubs = libcuda_stub(downloads / "stubs")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(staging), str(ROOT)]), MAX_JOBS=str(jobs),
               FLASHINFER_WORKSPACE_BASE=str(downloads / "workspace"))
    env.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    env["FLASHINFER_EXTRA_LDFLAGS"] = (env.get("FLASHINFER_EXTRA_LDFLAGS", "") + f" -L{stubs.parent}").strip()
    curand = downloads / "curand" / "nvidia" / "cu13" / "include"
    if curand.is_dir():
        env["FLASHINFER_EXTRA_CUDAFLAGS"] = (env.get("FLASHINFER_EXTRA_CUDAFLAGS", "") + f" -I{curand}").strip()
    # FlashInfer links against $CUDA_HOME/lib64 (else the folder above nvcc's, which a wrapper
    # script on PATH gets wrong); loading the modules here to list what they open needs it too
    home = cuda_home(env)
    env["CUDA_HOME"] = str(home)
    cudart = [str(home / "lib64")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(stubs.parent), *cudart, env.get("LD_LIBRARY_PATH", ""))
                                             if p)
    env.pop("FLASHINFER_DISABLE_JIT", None)
    return env


def stage_flashinfer(downloads: Path) -> Path:
    """Unpack the flashinfer-python wheel and this Python's apache-tvm-ffi wheel (and, when present,
    the cuRAND headers' wheel) into ``downloads/staging``; the staging folder."""
    staging = downloads / "staging"
    if not (staging / "flashinfer" / "__init__.py").is_file():
        staging.mkdir(parents=True, exist_ok=True)
        _unpack(_one("flashinfer_python-*.whl", downloads), staging)
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    if not (staging / "tvm_ffi").is_dir():
        _unpack(_one(f"apache_tvm_ffi-*-{tag}-*.whl", downloads), staging)
    for wheel in sorted((downloads / "wheels").glob("*-py3-none-any.whl")):   # requests and the like
        if not (staging / wheel.name.split("-")[0]).exists():
            _unpack(wheel, staging)
    curand = sorted((downloads / "curand").glob("nvidia_curand-*.whl"))
    if curand and not (downloads / "curand" / "nvidia").is_dir():
        _unpack(curand[0], downloads / "curand")
    return staging


BUILD_ONE = """
import json, shutil, sys, time
from pathlib import Path
from devtools.device_peers_build import flashinfer_specs
from flashinfer.jit import env as jit_env
role = sys.argv[1]
spec = flashinfer_specs()[role]
t0 = time.monotonic()
if not spec.aot_path.exists():
    spec.build(verbose=False)
    spec.aot_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(spec.jit_library_path, spec.aot_path)
seconds = round(time.monotonic() - t0, 1)
print(json.dumps({"role": role, "name": spec.name, "so": str(spec.aot_path), "seconds": seconds}))
"""


def build_flashinfer_modules(staging: Path, env: dict[str, str], log) -> list[dict]:
    """Build every spec of :func:`flashinfer_specs` missing from the staging tree's AOT folder, one
    process each (a failure names its module); the built modules' ``{"role", "name", "so",
    "seconds"}``."""
    built = []
    for role in ("decode fa2", "prefill fa2", "prefill fa3"):
        done = subprocess.run([sys.executable, "-c", BUILD_ONE, role], cwd=ROOT, env=env, capture_output=True,
                              text=True)
        log.write(done.stdout + done.stderr)
        log.flush()
        if done.returncode != 0:
            raise RuntimeError(f"FlashInfer {role} module did not build:\n{done.stderr[-4000:]}")
        built.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"[device_peers] flashinfer {role}: {built[-1]['name']} ({built[-1]['seconds']} s)", flush=True)
    return built


LIST_OPENED = """
import json, os, sys
opened = set()
sys.addaudithook(lambda event, args: opened.add(str(args[0])) if event == "open" and isinstance(args[0], str) else None)
from devtools.device_peers_build import flashinfer_args, flashinfer_specs
import flashinfer, flashinfer.decode, flashinfer.prefill
for role, spec in flashinfer_specs().items():
    spec.build_and_load()
# what the wrappers' plan() calls: it also writes the sources of modules loaded lazily
flashinfer.decode.get_batch_decode_module(*flashinfer_args())
for backend in ("fa2", "fa3"):
    flashinfer.prefill.get_batch_prefill_module(backend, *flashinfer_args(), False)
files = {m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None)}
print(json.dumps(sorted(opened | files)))
"""


def opened_files(staging: Path, env: dict[str, str]) -> list[Path]:
    """The staging tree's files that importing FlashInfer, loading the three AOT modules and calling
    the module getters of its wrappers' ``plan`` (which write the sources of lazily loaded modules)
    open with ``FLASHINFER_DISABLE_JIT=1``: module sources, templates, the modules."""
    load_env = dict(env, FLASHINFER_DISABLE_JIT="1")
    done = subprocess.run([sys.executable, "-c", LIST_OPENED], cwd=ROOT, env=load_env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the built FlashInfer modules do not load here:\n{done.stderr[-4000:]}")
    root = staging.resolve()
    out = []
    for name in json.loads(done.stdout.strip().splitlines()[-1]):
        path = Path(name).resolve()
        if path.is_file() and root in path.parents:
            out.append(path)
    return out


def trim_into(staging: Path, files: list[Path], site: Path) -> int:
    """Copy ``files`` (under ``staging``), every AOT module and the packages' metadata into ``site``;
    bytes copied."""
    if site.exists():
        shutil.rmtree(site)
    keep = set(files) | set((staging / "flashinfer" / "data" / "aot").rglob("*.so"))
    keep |= {p for d in staging.glob("flashinfer_python-*.dist-info") for p in d.rglob("*") if p.is_file()}
    total = 0
    for path in sorted(keep):
        rel = path.resolve().relative_to(staging.resolve())
        if rel.parts[0] != "flashinfer" and not rel.parts[0].startswith("flashinfer_python"):
            continue                                  # tvm_ffi and the pure-Python packages come as wheels
        target = site / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        total += path.stat().st_size
    return total


def build_flashinfer(out: Path, downloads: Path, jobs: int, log) -> dict:
    """Stage, build, trim; ``{"modules": [...], "site_bytes", "wheels": [...]}``."""
    staging = stage_flashinfer(downloads)
    env = build_env(staging, downloads, jobs)
    modules = build_flashinfer_modules(staging, env, log)
    site_bytes = trim_into(staging, opened_files(staging, env), out / "site")
    wheels_out = out / "wheels"
    wheels_out.mkdir(parents=True, exist_ok=True)
    wheels = []
    for wheel in sorted((downloads / "wheels").glob("*.whl")):
        shutil.copy2(wheel, wheels_out / wheel.name)
        wheels.append(wheel.name)
    return {"modules": modules, "site_bytes": site_bytes, "wheels": wheels}


def bundle_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("vllm", "flashinfer", "check"), required=True)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--vllm-ops", type=Path, help="an installed vLLM's vllm/v1/attention/ops folder")
    p.add_argument("--downloads", type=Path, help="the downloaded wheels (flashinfer-python, apache-tvm-ffi, wheels/)")
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.part == "vllm":
        if a.vllm_ops is None:
            p.error("--part vllm needs --vllm-ops")
        written = build_vllm(a.out, a.vllm_ops)
        print(f"[device_peers] vLLM Triton: {len(written)} files under {a.out / 'vllm_triton'}")
    elif a.part == "flashinfer":
        if a.downloads is None:
            p.error("--part flashinfer needs --downloads")
        with open(a.downloads / "build.log", "a") as log:
            info = build_flashinfer(a.out, a.downloads, a.jobs, log)
        (a.out / "flashinfer_build.json").write_text(json.dumps(info, indent=1))
        print(f"[device_peers] FlashInfer: {len(info['modules'])} modules, trimmed package "
              f"{info['site_bytes'] / 2 ** 20:.1f} MiB, {len(info['wheels'])} wheels")
    else:
        from devtools import device_peers
        print(json.dumps(device_peers.availability(a.out), indent=1))
    print(f"[device_peers] bundle {a.out}: {bundle_bytes(a.out) / 2 ** 20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
