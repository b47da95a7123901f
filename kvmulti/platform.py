"""Which vendor platform a device belongs to (``rocm``, ``cuda``, ``xpu``, ``cpu``, or a registered one).

A platform is a name for a torch device type on a torch build: a ``cuda`` device is ``rocm`` on a
ROCm build of torch and ``cuda`` otherwise. :func:`register_platform` teaches kvmulti another one
(an ``npu`` device, say) without editing it; distributions do that through the entry-point group
``kvmulti.platforms`` (:mod:`kvmulti.plugins`), read at the first lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import plugins


@dataclass(frozen=True)
class Platform:
    """``name`` serves tensors of ``device_type``; ``torch_build()`` says whether this torch was built
    for it (None: never claims the build). Among the platforms of one device type the first whose
    ``torch_build()`` is true, by ``priority`` (highest first), wins; none true: the last one."""
    name: str
    device_type: str
    torch_build: Callable[[], bool] | None
    priority: int
    origin: str


_PLATFORMS: dict[str, Platform] = {}
_BY_DEVICE_TYPE: dict[str, str] = {}       # device type -> platform name, resolved once per type
_plugins_loaded = False


def register_platform(name: str, device_type: str, *, torch_build: Callable[[], bool] | None = None,
                      priority: int = 0) -> None:
    """Register platform ``name`` for torch device type ``device_type``. RegistrationError if the
    name is taken (naming both registrations)."""
    if not name or not device_type:
        raise ValueError("a platform needs a name and a device type")
    entry = Platform(name, device_type, torch_build, priority, plugins.caller_module())
    if name in _PLATFORMS:
        raise plugins.RegistrationError(f"platform {name!r} is registered twice: by {_PLATFORMS[name].origin} "
                                        f"and by {entry.origin}")
    _PLATFORMS[name] = entry
    _BY_DEVICE_TYPE.clear()


def _load_plugins() -> None:
    global _plugins_loaded
    if not _plugins_loaded:
        _plugins_loaded = True
        plugins.load_group(plugins.PLATFORM_GROUP, _plugin_failed)


def _plugin_failed(name: str, reason: str) -> None:
    import warnings
    warnings.warn(f"kvmulti platform plugin {name!r}: {reason}", RuntimeWarning, stacklevel=3)


def platforms() -> tuple[Platform, ...]:
    """Every registered platform, highest priority first (registration order among equals)."""
    _load_plugins()
    order = {name: i for i, name in enumerate(_PLATFORMS)}
    return tuple(sorted(_PLATFORMS.values(), key=lambda p: (-p.priority, order[p.name])))


def platform_names() -> tuple[str, ...]:
    return tuple(p.name for p in platforms())


def platform_of(device: torch.device | str) -> str:
    """The platform of ``device`` (see :class:`Platform`); ValueError for an unknown device type."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    name = _BY_DEVICE_TYPE.get(kind)
    if name is None:
        candidates = [p for p in platforms() if p.device_type == kind]
        if not candidates:
            known = sorted({p.device_type for p in platforms()})
            raise ValueError(f"kvmulti does not know the device type {kind!r}; known: {', '.join(known)} "
                             "(kvmulti.register_platform adds one)")
        name = next((p.name for p in candidates if p.torch_build is not None and p.torch_build()),
                    candidates[-1].name)
        _BY_DEVICE_TYPE[kind] = name
    return name


def torch_build() -> str:
    """What this torch was built for: the first platform whose ``torch_build()`` is true, else ``cpu``."""
    return next((p.name for p in platforms() if p.torch_build is not None and p.torch_build()), "cpu")


def default_device() -> torch.device:
    """The accelerator this host has, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu")
    return torch.device("cpu")


def _rocm_build() -> bool:
    return bool(torch.version.hip)


def _cuda_build() -> bool:
    return bool(torch.version.cuda)


def _xpu_build() -> bool:
    return bool(getattr(torch.version, "xpu", None))


register_platform("rocm", "cuda", torch_build=_rocm_build, priority=30)
register_platform("cuda", "cuda", torch_build=_cuda_build, priority=20)
register_platform("xpu", "xpu", torch_build=_xpu_build, priority=10)
register_platform("cpu", "cpu")
