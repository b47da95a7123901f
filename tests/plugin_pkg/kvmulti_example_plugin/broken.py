"""A plugin whose import fails: kvmulti lists BROKEN with this as its reason."""

import kvmulti_example_plugin_missing_dependency  # noqa: F401


def register() -> None:
    raise AssertionError("never reached")
