"""Attention backends over the canonical layout, their registry and the selector."""

from .base import AttentionConfig, Backend
from .registry import (ENV_BACKEND, ENV_DRAFT_BACKEND, BackendSelectionError, available_backends, backend_names,
                       canonical_name, check_environment, dispatch_order, get_backend, register_backend,
                       select_backend)

__all__ = ["AttentionConfig", "Backend", "BackendSelectionError", "ENV_BACKEND", "ENV_DRAFT_BACKEND",
           "available_backends", "backend_names", "canonical_name", "check_environment", "dispatch_order",
           "get_backend", "register_backend", "select_backend"]
