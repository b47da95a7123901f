"""Integrations of kvmulti into serving engines (each imports its engine only when that engine loads it)."""
