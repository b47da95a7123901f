"""Which vendor platform a device belongs to: ``rocm``, ``cuda``, ``xpu`` or ``cpu``."""

from __future__ import annotations

import torch

PLATFORMS: tuple[str, ...] = ("rocm", "cuda", "xpu", "cpu")


def platform_of(device: torch.device | str) -> str:
    """The platform of ``device``: a ``cuda`` device is ``rocm`` on a ROCm build of torch."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return "rocm" if torch.version.hip else "cuda"
    if device.type == "xpu":
        return device.type
    raise ValueError(f"kvmulti does not know the device type {device.type!r}; known: cuda, xpu, cpu")


def torch_build() -> str:
    """What this torch was built for: ``rocm``, ``cuda``, ``xpu`` or ``cpu``."""
    if torch.version.hip:
        return "rocm"
    if torch.version.cuda:
        return "cuda"
    if getattr(torch.version, "xpu", None):
        return "xpu"
    return "cpu"


def default_device() -> torch.device:
    """The accelerator this host has, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu")
    return torch.device("cpu")

