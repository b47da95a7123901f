"""An out-of-tree kvmulti backend (``EXAMPLE``: attention in plain torch, vectorised per request) and
platform (``toyplat``: torch's private-use device type renamed ``toydev``)."""

from __future__ import annotations

import torch

DEVICE_TYPE = "toydev"


def register() -> None:
    import kvmulti
    kvmulti.register_backend("EXAMPLE", "kvmulti_example_plugin.backend:ExampleBackend",
                             platforms=("toyplat",), priority=5)


def register_platform() -> None:
    import kvmulti
    kvmulti.register_platform("toyplat", DEVICE_TYPE, torch_build=lambda: False)


def name_the_device_type() -> None:
    """Give torch's private-use device type the name ``toydev`` (once per process)."""
    if torch._C._get_privateuse1_backend_name() != DEVICE_TYPE:
        torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
