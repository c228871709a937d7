"""Paged attention for the engine step: Pallas kernels and the jnp reference they must match.

reference.py is the oracle (and the CPU path); paged_attention.py (decode) and
ragged_paged_attention.py (mixed prefill/decode) are the Pallas kernels; tuning.py holds their
block sizes per backend. Nothing is imported here, so importing the reference stays cheap.
"""
