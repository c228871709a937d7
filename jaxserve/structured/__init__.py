"""Structured output on the host: constraints (params), grammar compilation (compiler) and
per-request matchers that fill the allowed-token bitmask (matcher). Must not import jax; the
device half (applying the bitmask to logits) is jaxserve/runner/grammar_mask.py."""
