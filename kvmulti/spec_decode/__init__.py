"""Speculative decoding: runner, proposer, rejection sampler."""
