"""Backend registry and selector: platform priority, env-var overrides, cached per configuration.

A backend is a package ``kvmulti/backends/<name>/`` exporting its class; adding one means that
folder plus one line in :data:`BACKEND_CLASSES` (and, to be picked without being named, a place in
:data:`PLATFORM_PRIORITY`).
"""

from __future__ import annotations

import functools
import importlib

import torch

from .. import settings
from ..layout import KVCacheLayout
from ..platform import platform_of
from .base import AttentionConfig, Backend

#: name -> (package, class); packages are imported on first use, so a missing optional
#: dependency only ever shows up as that backend's reason.
BACKEND_CLASSES: dict[str, tuple[str, str]] = {
    "HIP": ("kvmulti.backends.hip", "HipBackend"),
    "SYCL": ("kvmulti.backends.sycl", "SyclBackend"),
    "TRITON": ("kvmulti.backends.triton", "TritonBackend"),
    "CPU": ("kvmulti.backends.cpu", "CPUBackend"),
    "IPEX": ("kvmulti.backends.ipex", "IpexBackend"),
}

#: Backends tried, in order, when none is named. On a CPU-only host TRITON (interpreter),
#: SYCL (OpenCL CPU device) and HIP (CPU harness) run only when named: they exist there to verify;
#: IPEX runs only when named (README: slower than CPU on the hosts measured; XPU not served).
PLATFORM_PRIORITY: dict[str, tuple[str, ...]] = {
    "rocm": ("HIP", "TRITON"),
    "xpu": ("SYCL", "TRITON"),
    "cuda": ("TRITON",),
    "cpu": ("CPU",),
}

ENV_BACKEND = "KVMULTI_ATTENTION_BACKEND"
ENV_DRAFT_BACKEND = "KVMULTI_DRAFT_ATTENTION_BACKEND"
ROLES: tuple[str, ...] = ("target", "draft")


class BackendSelectionError(ValueError):
    """No backend can serve a configuration, or the one named cannot; the message says why."""


def backend_names() -> tuple[str, ...]:
    return tuple(BACKEND_CLASSES)


def canonical_name(name: str, source: str = "backend") -> str:
    """Upper-case ``name`` and check it is a known backend; ValueError listing valid names otherwise."""
    if not isinstance(name, str) or name.strip().upper() not in BACKEND_CLASSES:
        raise ValueError(f"{source}={name!r} is not a kvmulti backend; valid names: {', '.join(BACKEND_CLASSES)} "
                         "(case-insensitive)")
    return name.strip().upper()


def get_backend(name: str) -> Backend:
    """The singleton instance of backend ``name`` (case-insensitive)."""
    if name in BACKEND_CLASSES:                       # already canonical: the per-layer hot path
        return _instance(name)
    return _instance(canonical_name(name))


@functools.lru_cache(maxsize=None)
def _instance(name: str) -> Backend:
    module_name, class_name = BACKEND_CLASSES[name]
    return getattr(importlib.import_module(module_name), class_name)()


def env_override(role: str = "target") -> tuple[str, str] | None:
    """``(variable, backend name)`` the environment names for ``role``, validated; None when unset.

    ``KVMULTI_ATTENTION_BACKEND`` applies to every model; ``KVMULTI_DRAFT_ATTENTION_BACKEND``
    applies to draft models only and takes precedence there.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    variables = (ENV_DRAFT_BACKEND, ENV_BACKEND) if role == "draft" else (ENV_BACKEND,)
    for var in variables:
        value = settings.raw(var)
        if value:
            return var, canonical_name(value, var)
    return None


def check_environment() -> None:
    """Raise ValueError if either override variable holds an unknown backend name."""
    env_override("target")
    env_override("draft")


def select_backend(config: AttentionConfig, role: str = "target", requested: str | None = None) -> str:
    """Name of the backend serving ``config``: ``requested``, else the env override, else priority.

    A named backend that cannot serve ``config`` raises BackendSelectionError listing its reasons;
    nothing falls back silently.
    """
    if requested is not None:
        return _select_cached(config, canonical_name(requested), "backend")
    override = env_override(role)
    if override is not None:
        var, name = override
        return _select_cached(config, name, var)
    return _select_cached(config, None, "")


@torch.compiler.assume_constant_result
def select_backend_for_layout(layout: KVCacheLayout, device: torch.device, sliding_window: bool, softcap: bool,
                              causal: bool, role: str, requested: str | None) -> str:
    """:func:`select_backend` for a cache of ``layout`` on ``device`` (the public ops' path when no
    step was prepared); torch.compile treats the result as a constant. Memoised per call signature
    and the override variables' current values."""
    env = (settings.raw(ENV_BACKEND), settings.raw(ENV_DRAFT_BACKEND) if role == "draft" else None)
    return _select_for_layout(layout, device, sliding_window, softcap, causal, role, requested, env)


@functools.lru_cache(maxsize=1024)
def _select_for_layout(layout: KVCacheLayout, device: torch.device, sliding_window: bool, softcap: bool,
                       causal: bool, role: str, requested: str | None, env: tuple) -> str:
    config = AttentionConfig.from_layout(layout, device, 1 if sliding_window else None, 1.0 if softcap else None,
                                         causal)
    return select_backend(config, role, requested)


@functools.lru_cache(maxsize=1024)
def _select_cached(config: AttentionConfig, requested: str | None, source: str) -> str:
    if requested is not None:
        reasons = get_backend(requested).not_supported_reasons(config)
        if reasons:
            raise BackendSelectionError(f"{source}={requested} cannot serve {describe_config(config)}: "
                                        + "; ".join(reasons))
        return requested
    tried = []
    for name in PLATFORM_PRIORITY.get(config.platform, ()):
        reasons = get_backend(name).not_supported_reasons(config)
        if not reasons:
            return name
        tried.append(f"{name}: {'; '.join(reasons)}")
    raise BackendSelectionError(f"no backend can serve {describe_config(config)}: " + " | ".join(tried))


def describe_config(config: AttentionConfig) -> str:
    features = [f for f, on in (("sliding window", config.sliding_window), ("softcap", config.softcap),
                                ("non-causal attention", not config.causal)) if on]
    return (f"{config.platform} {str(config.dtype).removeprefix('torch.')} head_size={config.head_size}"
            f"/{config.head_size_v} kv_heads={config.num_kv_heads} block_size={config.block_size} "
            f"order={config.order}" + (f" with {', '.join(features)}" if features else ""))


def available_backends(device: torch.device | str = "cpu") -> dict[str, list[str]]:
    """``{name: []}`` for each backend usable on ``device`` here, ``{name: [reasons]}`` otherwise."""
    platform = platform_of(device)
    result = {}
    for name in BACKEND_CLASSES:
        backend = get_backend(name)
        result[name] = backend.unavailable_reasons() + backend.platform_reasons(platform)
    return result
