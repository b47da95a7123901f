"""Backend registry and selector: registered backends, platform priority, env-var overrides,
cached per configuration.

Every backend, kvmulti's own included, is added by :func:`register_backend`. kvmulti's own are the
packages ``kvmulti/backends/<name>/``, each with a ``register()`` function; other distributions
point the entry-point group ``kvmulti.backends`` at theirs (:mod:`kvmulti.plugins`). Both are read
once, at the first lookup. A backend whose package or plugin cannot be imported is listed with
that as its reason.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import plugins, settings
from ..layout import KVCacheLayout
from ..platform import platform_names, platform_of
from .base import AttentionConfig, Backend


@dataclass(frozen=True)
class BackendEntry:
    """One registration: ``factory`` (a callable returning the backend, or ``"module:attr"`` imported
    at first use); tried unnamed on ``platforms``, highest ``priority`` first."""
    name: str
    factory: Callable[[], Backend] | str
    platforms: tuple[str, ...]
    priority: int
    origin: str


_ENTRIES: dict[str, BackendEntry] = {}
_loaded = False


def register_backend(name: str, factory_or_path: Callable[[], Backend] | str, *, platforms: tuple[str, ...] = (),
                     priority: int = 0) -> None:
    """Register backend ``name`` (stored upper-case). ``factory_or_path``: a callable (a Backend
    subclass) or ``"module:attr"``; ``platforms``: where the selector tries it when no backend is
    named, in order of ``priority`` (highest first; registration order among equals); elsewhere it
    runs only when named. RegistrationError if the name is taken, naming both registrations."""
    canonical = name.strip().upper() if isinstance(name, str) else ""
    if not canonical or any(c.isspace() for c in canonical):
        raise ValueError(f"a backend name is one word, got {name!r}")
    if isinstance(factory_or_path, str):
        origin = factory_or_path
    else:
        origin = f"{factory_or_path.__module__}.{getattr(factory_or_path, '__qualname__', factory_or_path)}"
    entry = BackendEntry(canonical, factory_or_path, tuple(platforms), int(priority), origin)
    if canonical in _ENTRIES:
        raise plugins.RegistrationError(f"backend {canonical} is registered twice: by {_ENTRIES[canonical].origin} "
                                        f"and by {origin}")
    _ENTRIES[canonical] = entry
    _instance.cache_clear()
    _select_cached.cache_clear()
    _select_for_layout.cache_clear()


def _load() -> None:
    """Register kvmulti's own backend packages, then the entry points' (once)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from .. import backends
    for module in pkgutil.iter_modules(backends.__path__):
        if module.ispkg:
            try:
                importlib.import_module(f"{backends.__name__}.{module.name}").register()
            except ImportError as error:
                _unloadable(module.name, f"kvmulti.backends.{module.name} failed to import: {error}")
    plugins.load_group(plugins.BACKEND_GROUP, _unloadable)


def _unloadable(name: str, reason: str) -> None:
    register_backend(name, functools.partial(UnloadableBackend, name.strip().upper(), reason))


class UnloadableBackend(Backend):
    """What a backend whose code cannot be imported is in the registry: its reason, nothing else."""

    platforms = ()

    def __init__(self, name: str, reason: str):
        super().__init__(partition_size=0)
        self.name, self.reason = name, reason

    def unavailable_reasons(self) -> list[str]:
        return [self.reason]

    def platform_reasons(self, platform: str) -> list[str]:
        return []                           # the one reason is that it did not load

    def capability_reasons(self, config: AttentionConfig) -> list[str]:
        return []

    def describe(self) -> str:
        return "not loaded"

    def write_kv(self, *args, **kwargs) -> None:
        raise RuntimeError(self.reason)

    def paged_attention(self, *args, **kwargs) -> None:
        raise RuntimeError(self.reason)


def dispatch_order(platform: str) -> tuple[str, ...]:
    """Backends tried, in order, on ``platform`` when none is named."""
    _load()
    order = {name: i for i, name in enumerate(_ENTRIES)}
    tried = [e for e in _ENTRIES.values() if platform in e.platforms]
    return tuple(e.name for e in sorted(tried, key=lambda e: (-e.priority, order[e.name])))


def markdown_table() -> str:
    """The README's table: each platform and the backends tried there in order."""
    rows = ["| platform | tried in order |", "|---|---|"]
    rows += [f"| {p} | {', '.join(dispatch_order(p)) or '-'} |" for p in platform_names()]
    named = [n for n in backend_names() if not _ENTRIES[n].platforms]
    if named:
        rows.append(f"| any, only when named | {', '.join(named)} |")
    return "\n".join(rows)


ENV_BACKEND = "KVMULTI_ATTENTION_BACKEND"
ENV_DRAFT_BACKEND = "KVMULTI_DRAFT_ATTENTION_BACKEND"
ROLES: tuple[str, ...] = ("target", "draft")


class BackendSelectionError(ValueError):
    """No backend can serve a configuration, or the one named cannot; the message says why."""


def backend_names() -> tuple[str, ...]:
    """Every registered backend, in registration order (kvmulti's own first)."""
    _load()
    return tuple(_ENTRIES)


def canonical_name(name: str, source: str = "backend") -> str:
    """Upper-case ``name`` and check it is a known backend; ValueError listing valid names otherwise."""
    if not isinstance(name, str) or name.strip().upper() not in backend_names():
        raise ValueError(f"{source}={name!r} is not a kvmulti backend; valid names: {', '.join(backend_names())} "
                         "(case-insensitive)")
    return name.strip().upper()


def get_backend(name: str) -> Backend:
    """The singleton instance of backend ``name`` (case-insensitive)."""
    if name in _ENTRIES:                              # already canonical: the per-layer hot path
        return _instance(name)
    return _instance(canonical_name(name))


@functools.lru_cache(maxsize=None)
def _instance(name: str) -> Backend:
    factory = _ENTRIES[name].factory
    if isinstance(factory, str):
        module_name, _, attr = factory.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as error:
            return UnloadableBackend(name, f"{factory} failed to import: {type(error).__name__}: {error}")
    return factory()


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


def construct_for(device: torch.device | str, role: str = "target") -> tuple[str, ...]:
    """Construct now the backends a call on ``device`` may dispatch to (the env override for
    ``role``, else the platform's priority list): each builds or loads its native code in its
    constructor, so an engine calling this at start-up never builds inside an attention call.
    Returns their names."""
    override = env_override(role)
    names = (override[1],) if override else dispatch_order(platform_of(torch.device(device)))
    for name in names:
        get_backend(name)
    return names


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
                              causal: bool, role: str, requested: str | None, sinks: bool = False,
                              alibi: bool = False) -> str:
    """:func:`select_backend` for a cache of ``layout`` on ``device`` (the public ops' path when no
    step was prepared); torch.compile treats the result as a constant. Memoised per call signature
    and the override variables' current values."""
    env = (settings.raw(ENV_BACKEND), settings.raw(ENV_DRAFT_BACKEND) if role == "draft" else None)
    return _select_for_layout(layout, device, sliding_window, softcap, causal, role, requested, env, sinks, alibi)


@functools.lru_cache(maxsize=1024)
def _select_for_layout(layout: KVCacheLayout, device: torch.device, sliding_window: bool, softcap: bool,
                       causal: bool, role: str, requested: str | None, env: tuple, sinks: bool = False,
                       alibi: bool = False) -> str:
    config = AttentionConfig.from_layout(layout, device, 1 if sliding_window else None, 1.0 if softcap else None,
                                         causal, sinks, alibi)
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
    for name in dispatch_order(config.platform):
        reasons = get_backend(name).not_supported_reasons(config)
        if not reasons:
            return name
        tried.append(f"{name}: {'; '.join(reasons)}")
    raise BackendSelectionError(f"no backend can serve {describe_config(config)}: " + " | ".join(tried))


def describe_config(config: AttentionConfig) -> str:
    features = [f for f, on in (("sliding window", config.sliding_window), ("softcap", config.softcap),
                                ("non-causal attention", not config.causal), ("attention sinks", config.sinks),
                                ("ALiBi", config.alibi))
                if on]
    return (f"{config.platform} {str(config.dtype).removeprefix('torch.')} head_size={config.head_size}"
            f"/{config.head_size_v} kv_heads={config.num_kv_heads} block_size={config.block_size} "
            f"order={config.order}" + (f" with {', '.join(features)}" if features else ""))


def available_backends(device: torch.device | str = "cpu") -> dict[str, list[str]]:
    """``{name: []}`` for each backend usable on ``device`` here, ``{name: [reasons]}`` otherwise."""
    platform = platform_of(device)
    result = {}
    for name in backend_names():
        backend = get_backend(name)
        result[name] = backend.unavailable_reasons() + backend.platform_reasons(platform)
    return result
