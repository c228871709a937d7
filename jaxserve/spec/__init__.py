"""Speculative decoding: proposers (n-gram prompt lookup, draft model), verification inside the
engine's ragged step, rejection sampling, and the policy that turns it on or off per step.

Host side (no jax): ngram.py, policy.py, spec_inputs.py, setup.py. Device side: draft.py,
rejection.py, step.py, runner.py. The scheduler only sees the policy; the engine only sees a
runner that executes plans with draft rows in them.
"""
