"""Paged-attention backends for the step: the XLA reference path or the Pallas kernels.

A backend is called in two phases, so that per-step work is done once and not in every layer:
`prepare(metadata, num_tokens)` runs once per step, before the layer loop, and turns the step's
AttentionMetadata into what its kernels read (per-row request ids and positions for the
reference path; block metadata for the Pallas kernels, once per distinct sliding window);
`backend(q, k_pages, v_pages, layer, prepared, sm_scale=..., sliding_window=..., soft_cap=...)`
then runs one layer. `auto` is resolved per device by model/device_select.py: Pallas on TPU and
Hopper GPUs, the reference elsewhere; an explicit `pallas` the device can't run is refused there.

The Pallas backend splits the batch at `num_decode_seqs`: the leading one-row decode requests
go through the paged decode kernel (split-KV where it pays), the rest through the ragged
kernel, and the two outputs are joined by row. The reference path needs no split: its own
blocks already walk decode rows in small per-row tiles. This module selects and prepares; the
arithmetic lives in pallas_kernels/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from jaxserve.model import device_select
from jaxserve.model.device_select import ATTENTION_IMPLS  # noqa: F401  (re-exported)
from jaxserve.step_inputs import AttentionMetadata


class PagedAttention(Protocol):
    def prepare(self, metadata: AttentionMetadata, num_tokens: int) -> Any:
        """Per-step metadata for every layer (a pytree); called once per step."""

    def __call__(self, q, k_pages, v_pages, layer, prepared, *, sm_scale: float,
                 sliding_window: int | None = None, soft_cap: float | None = None):
        """q [T, Hq, D] -> [T, Hq, D]; rows past the batch come back zero."""


@dataclass(frozen=True)
class AttentionShape:
    """Static facts a backend sizes its kernels by (per device under tensor parallelism)."""

    group: int                 # query heads per KV head
    num_kv_heads: int          # KV heads on one device
    page_size: int
    sliding_windows: tuple = (None,)  # distinct windows the model's layers use


def resolve_attention_impl(impl: str, backend: str | None = None, dtype: str = "auto") -> str:
    """"auto" -> the implementation for the first device of `backend` (default: JAX's default
    backend) in `dtype`, logged once with the reason; an explicit one it can't run is a
    ValueError naming attention_impl."""
    device = device_select.DeviceDescription.current(backend)
    chosen = device_select.select(attention_impl=impl, dtype=dtype, device=device)
    device_select.log_choice("attention_impl", chosen.attention_impl, chosen.attention_reason,
                             device)
    return chosen.attention_impl


def get_attention(impl: str, shape: AttentionShape) -> PagedAttention:
    impl = resolve_attention_impl(impl)
    if impl == "reference":
        return ReferenceAttention()
    return PallasAttention(shape, interpret=impl == "pallas-interpret")


class _RowMetadata(NamedTuple):
    page_table: jax.Array  # [S, P]
    seq_ids: jax.Array     # [T] request of each row (padding: 0)
    positions: jax.Array   # [T] position of each row (padding: -1)


class ReferenceAttention:
    """pallas_kernels.reference over rows whose request and position are computed once."""

    def prepare(self, metadata: AttentionMetadata, num_tokens: int) -> _RowMetadata:
        from pallas_kernels.reference import token_metadata
        seq_ids, positions = token_metadata(metadata.kv_lens, metadata.cu_q_lens,
                                            metadata.num_seqs, num_tokens)
        return _RowMetadata(metadata.page_table, seq_ids, positions)

    def __call__(self, q, k_pages, v_pages, layer, prepared: _RowMetadata, *, sm_scale,
                 sliding_window=None, soft_cap=None):
        from pallas_kernels.reference import attend_rows
        return attend_rows(q, k_pages, v_pages, layer, prepared.page_table, prepared.seq_ids,
                           prepared.positions, sm_scale=sm_scale, soft_cap=soft_cap,
                           sliding_window=sliding_window)


class _KernelMetadata(NamedTuple):
    page_table: jax.Array      # [S, P]
    num_decode_seqs: jax.Array  # []
    decode_kv_lens: jax.Array  # [S] context of decode requests, 0 for the others
    ragged: tuple              # per sliding window: metadata.RaggedBlocks
    decode: tuple              # per sliding window: [S * splits, 5] split metadata


class PallasAttention:
    """Decode rows through paged_attention's kernel, the rest through the ragged kernel."""

    def __init__(self, shape: AttentionShape, interpret: bool = False):
        from pallas_kernels import tuning
        self.shape = shape
        self.formulation, self.sizes, self.interpret = tuning.plan(interpret)

    def _configs(self, page_table_shape, sliding_window, sm_scale=1.0, soft_cap=None):
        from pallas_kernels.paged_attention import decode_config
        from pallas_kernels.ragged_paged_attention import ragged_config
        num_seqs, pages_per_seq = page_table_shape
        sh = self.shape
        ragged = ragged_config(sh.group, sh.page_size, pages_per_seq, self.sizes,
                               sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window)
        decode, num_splits = decode_config(sh.group, sh.page_size, pages_per_seq,
                                           sh.num_kv_heads, num_seqs, self.sizes,
                                           sm_scale=sm_scale, soft_cap=soft_cap,
                                           sliding_window=sliding_window)
        return ragged, decode, num_splits

    def prepare(self, metadata: AttentionMetadata, num_tokens: int) -> _KernelMetadata:
        from pallas_kernels import metadata as blocks
        md = metadata
        num_decode = jnp.reshape(md.num_decode_seqs, ()).astype(jnp.int32)
        num_seqs_max = md.kv_lens.shape[0]
        decode_kv_lens = jnp.where(jnp.arange(num_seqs_max) < num_decode, md.kv_lens, 0)
        ragged, decode = [], []
        for window in self.shape.sliding_windows:
            rc, dc, num_splits = self._configs(md.page_table.shape, window)
            ragged.append(blocks.ragged_blocks(
                md.cu_q_lens, md.kv_lens, md.num_seqs, num_tokens, tokens=rc.tokens,
                tile=rc.tile, sliding_window=window, first_seq=num_decode))
            decode.append(blocks.kv_split_metadata(decode_kv_lens, num_splits, dc.tile, window))
        return _KernelMetadata(md.page_table, num_decode, decode_kv_lens, tuple(ragged),
                               tuple(decode))

    def __call__(self, q, k_pages, v_pages, layer, prepared: _KernelMetadata, *, sm_scale,
                 sliding_window=None, soft_cap=None):
        from pallas_kernels.paged_attention import decode_attend
        from pallas_kernels.ragged_paged_attention import ragged_attend
        index = self.shape.sliding_windows.index(sliding_window)
        rc, dc, num_splits = self._configs(prepared.page_table.shape, sliding_window,
                                           sm_scale, soft_cap)
        out = ragged_attend(q, k_pages, v_pages, layer, prepared.page_table,
                            prepared.ragged[index], c=rc, formulation=self.formulation,
                            interpret=self.interpret)                    # [T, Hq, D]
        num_tokens, num_seqs = q.shape[0], prepared.page_table.shape[0]
        q_decode = q[:num_seqs]  # decode rows are the batch's first rows, one per request
        if num_tokens < num_seqs:
            q_decode = jnp.pad(q_decode, ((0, num_seqs - num_tokens), (0, 0), (0, 0)))
        decoded = decode_attend(q_decode, k_pages, v_pages, layer, prepared.page_table,
                                prepared.decode_kv_lens, prepared.decode[index], c=dc,
                                num_splits=num_splits, formulation=self.formulation,
                                interpret=self.interpret)               # [S, Hq, D]
        rows = jnp.arange(num_tokens)
        from_decode = decoded[jnp.minimum(rows, num_seqs - 1)]
        return jnp.where((rows < prepared.num_decode_seqs)[:, None, None], from_decode, out)
