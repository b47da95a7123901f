"""Triton kernels of the TRITON backend, shipped as ``kvmulti.triton_kernels`` (see docs/design.md).

- ``unified_attention``: the paged-attention kernel (single pass and split-KV) and the
  split-KV reduce kernel.
- ``write_kv``: the KV-cache write kernel.
- ``launch``: tile choices, the split-KV heuristic, launch descriptions and launchers.

Importing this package does not import triton; the modules above do (imported lazily by
``kvmulti.backends.triton``).
"""
