"""Entry points of installed distributions: how code outside kvmulti registers backends and platforms.

A distribution declares ``[project.entry-points."kvmulti.backends"]`` (or ``"kvmulti.platforms"``)
``NAME = "package.module:register"``; kvmulti calls each ``register()`` once, at the first lookup in
that registry, and ``register()`` calls :func:`kvmulti.register_backend` / :func:`kvmulti.register_platform`.
"""

from __future__ import annotations

from collections.abc import Callable
import sys
from importlib import metadata

BACKEND_GROUP = "kvmulti.backends"
PLATFORM_GROUP = "kvmulti.platforms"


def load_group(group: str, on_error: Callable[[str, str], None]) -> None:
    """Call the ``register`` function of every entry point of ``group`` (each distinct name = value
    once: a package seen through two environments' paths registers once). A plugin whose import or
    ``register()`` raises anything but a registration conflict is reported to ``on_error(name,
    reason)`` and skipped; conflicts (:class:`RegistrationError`) propagate."""
    seen = set()
    for point in metadata.entry_points(group=group):
        if (point.name, point.value) in seen:
            continue
        seen.add((point.name, point.value))
        try:
            point.load()()
        except RegistrationError:
            raise
        except Exception as error:   # a broken plugin is that plugin's reason, never kvmulti's failure
            on_error(point.name, f"plugin {point.value} ({_dist(point)}) failed to load: "
                                 f"{type(error).__name__}: {error}")


class RegistrationError(ValueError):
    """A name registered twice; the message names both registrations."""


def caller_module(depth: int = 2) -> str:
    """The module that called the function calling this one (a registration's origin)."""
    return sys._getframe(depth).f_globals.get("__name__", "?")


def _dist(point: metadata.EntryPoint) -> str:
    dist = getattr(point, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else "entry point"
