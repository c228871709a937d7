"""Picks the paged-attention implementation for the step: XLA reference or Pallas kernel.

`auto` means Pallas on TPU/GPU and the XLA reference on CPU. Every choice has the signature of
pallas_kernels.reference.ragged_paged_attention. This module only selects; it computes nothing.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

ATTENTION_IMPLS = ("auto", "reference", "pallas", "pallas-interpret")


def resolve_attention_impl(impl: str, backend: str | None = None) -> str:
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {', '.join(ATTENTION_IMPLS)}, "
                         f"got {impl!r}")
    if impl != "auto":
        return impl
    backend = backend or jax.default_backend()
    return "pallas" if backend in ("tpu", "gpu", "cuda", "rocm") else "reference"


def get_attention_fn(impl: str) -> Callable:
    impl = resolve_attention_impl(impl)
    if impl == "reference":
        from pallas_kernels.reference import ragged_paged_attention
        return ragged_paged_attention
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention
    if impl == "pallas-interpret":
        return functools.partial(ragged_paged_attention, interpret=True)
    return ragged_paged_attention
