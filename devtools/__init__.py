"""Evidence and analysis tools for kvmulti's kernels; not shipped in the wheel."""
