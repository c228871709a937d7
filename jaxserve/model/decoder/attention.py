"""Paged-attention backends for the step: the XLA reference path or the Pallas kernels.

A backend is called in two phases, so that per-step work is done once and not in every layer:
`prepare(metadata, num_tokens)` runs once per step, before the layer loop, and turns the step's
AttentionMetadata into what its kernels read (per-row request ids and positions for the
reference path; block metadata for the Pallas kernels, once per distinct sliding window);
`backend(q, k_pages, v_pages, layer, prepared, sm_scale=..., sliding_window=..., soft_cap=...,
sinks=...)` then runs one layer. `sinks` (gpt-oss attention sinks: a float32 [Hq] of the heads
this device holds, one extra softmax logit per query head with no value) defaults to None, which
traces exactly the code of a model without sinks. `auto` is resolved per device and model shape
by model/device/select.py (with model/device/kernel_fit.py's limits of the Hopper kernel): Pallas on
TPU and on Hopper where the shape fits, the XLA blocked path on other GPUs, the reference on the
CPU; an explicit `pallas` the device or shape can't run is refused there.

The Pallas and XLA blocked backends split the batch at `num_decode_seqs`: the leading one-row
decode requests go through split-KV decode blocks, the rest through ragged blocks (skipped by a
lax.cond in steps without any), and the two outputs are joined by row. The reference path needs
no split: its own blocks already walk decode rows in small per-row tiles. This module selects
and prepares; the arithmetic lives in pallas_kernels/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from jaxserve.model.cpu import attention as cpu_attention
from jaxserve.model.device import select as device_select
from jaxserve.model.device import kernel_fit
from jaxserve.model.decoder.decode_attention import WIDE_MAX_KV_HEADS, decode_attention, decode_work
from jaxserve.model.device.select import ATTENTION_IMPLS  # noqa: F401  (re-exported)
from jaxserve.model.decoder.step_inputs import AttentionMetadata


class PagedAttention(Protocol):
    def prepare(self, metadata: AttentionMetadata, num_tokens: int) -> Any:
        """Per-step metadata for every layer (a pytree); called once per step."""

    def __call__(self, q, k_pages, v_pages, layer, prepared, *, sm_scale: float,
                 sliding_window: int | None = None, soft_cap: float | None = None,
                 sinks: jax.Array | None = None):
        """q [T, Hq, D] -> [T, Hq, D]; rows past the batch come back zero. sinks: None or
        [Hq] float32, a logit per query head added to its softmax's denominator."""


@dataclass(frozen=True)
class AttentionShape:
    """Static facts a backend sizes its kernels by (per device under tensor parallelism)."""

    group: int                 # query heads per KV head
    num_kv_heads: int          # KV heads on one device
    page_size: int
    sliding_windows: tuple = (None,)  # distinct windows the model's layers use
    head_dim: int | None = None  # None (with the dtypes): the kernel's shape limits unchecked
    dtype: str | None = None     # the query's (compute) dtype, e.g. "bfloat16"
    kv_dtype: str | None = None  # the pages' dtype (default: dtype), e.g. "float8_e4m3fn"
    sinks: bool = False          # the model's layers have attention sinks

    def kernel_shape(self) -> kernel_fit.KernelShape | None:
        """What kernel_fit checks, or None while head_dim / dtype are unknown."""
        if self.head_dim is None or self.dtype is None:
            return None
        return kernel_fit.KernelShape(
            self.head_dim, self.group, self.num_kv_heads, self.dtype,
            self.kv_dtype or self.dtype, self.page_size,
            sliding_window=any(w is not None for w in self.sliding_windows), sinks=self.sinks)


def select_attention(impl: str, backend: str | None = None, dtype: str = "auto",
                     shape: AttentionShape | None = None, log: bool = True,
                     device: device_select.DeviceDescription | None = None):
    """device_select.Selection for `device` (default: the first device of `backend`, JAX's
    default backend) in `dtype` (default: shape's) and, given, the model's attention shape; the
    choice logged once with its reason unless log=False. An explicit impl it can't run is a
    ValueError naming attention_impl."""
    device = device or device_select.DeviceDescription.current(backend)
    if shape is not None and shape.dtype is not None and dtype == "auto":
        dtype = shape.dtype
    chosen = device_select.select(attention_impl=impl, dtype=dtype, device=device,
                                  shape=None if shape is None else shape.kernel_shape())
    if log:
        device_select.log_choice("attention_impl", chosen.attention_impl,
                                 chosen.attention_reason, device)
    return chosen


def resolve_attention_impl(impl: str, backend: str | None = None, dtype: str = "auto",
                           log: bool = True) -> str:
    """"auto" -> the implementation for the device alone (select_attention without a shape)."""
    return select_attention(impl, backend, dtype, log=log).attention_impl


def get_attention(impl: str, shape: AttentionShape,
                  device: device_select.DeviceDescription | None = None) -> PagedAttention:
    """The backend for `impl` ("auto" resolved for the device and shape, logged). device: the
    one the step will run on (default: this process's first; another one, for a step lowered
    ahead of time for it: bench/abstract_step.py)."""
    chosen = select_attention(impl, shape=shape, device=device)
    if chosen.attention_impl == "reference":
        return ReferenceAttention(shape)
    if chosen.attention_impl == "xla":
        return XlaAttention(shape)
    return PallasAttention(shape, interpret=chosen.attention_impl == "pallas-interpret",
                           max_kv_splits=chosen.max_kv_splits,
                           platform=None if device is None else device.platform)


class _RowMetadata(NamedTuple):
    page_table: jax.Array  # [S, P]
    kv_lens: jax.Array     # [S]
    seq_ids: jax.Array     # [T] request of each row (padding: 0)
    positions: jax.Array   # [T] position of each row (padding: -1)
    num_decode_seqs: jax.Array  # []
    any_ragged: jax.Array  # [] bool: some request has more than one row this step
    decode: tuple          # per sliding window: decode_attention.DecodeWork


class ReferenceAttention:
    """The XLA path. Decode rows (one per request, the batch's first num_decode_seqs rows) as
    one work list (model/decoder/decode_attention.py), or on a CPU through jaxserve's decode kernel
    (model/cpu/attention.py) where it can run and the layer has no sinks (the kernel has
    none); the other rows through pallas_kernels.reference (skipped by a lax.cond when the
    step has none). Without the kernel, a model with more than WIDE_MAX_KV_HEADS KV heads
    (per device) sends every row through the reference, where the work list measured slower.
    Per-row metadata and work lists are made once a step."""

    uses_kernel = False  # (cpu_attention's C++ kernel is not a device kernel)

    def __init__(self, shape: AttentionShape | None = None, *, tile_pages: int = 4,
                 items_per_chunk: int = 64, cpu_kernel: bool | None = None):
        """shape: what the model's layers use (None: no sliding window; each layer then makes
        its own work list); tile_pages: KV pages per decode work item; items_per_chunk: items
        one loop iteration gathers (measured on the 2-core CPU, docs/host_loop.md); cpu_kernel:
        decode rows through model/cpu/attention.py's kernel (None: wherever it can run)."""
        self.cpu_kernel = cpu_kernel
        self.sliding_windows = (None,) if shape is None else shape.sliding_windows
        self.page_size = None if shape is None else shape.page_size
        self.work_list = shape is None or shape.num_kv_heads <= WIDE_MAX_KV_HEADS
        self.tile_pages, self.items_per_chunk = tile_pages, items_per_chunk

    def prepare(self, metadata: AttentionMetadata, num_tokens: int) -> _RowMetadata:
        from pallas_kernels.reference import token_metadata
        md = metadata
        seq_ids, positions = token_metadata(md.kv_lens, md.cu_q_lens, md.num_seqs, num_tokens)
        num_decode = jnp.reshape(md.num_decode_seqs, ()).astype(jnp.int32)
        works = () if self.page_size is None or not self.work_list else tuple(
            self._work(md.kv_lens, num_decode, md.page_table, self.page_size, w)
            for w in self.sliding_windows)
        return _RowMetadata(md.page_table, md.kv_lens, seq_ids, positions, num_decode,
                            jnp.reshape(md.num_seqs, ()) > num_decode, works)

    def _work(self, kv_lens, num_decode, page_table, page_size, window):
        return decode_work(kv_lens, num_decode, page_table, page_size,
                           tile_pages=self.tile_pages, sliding_window=window)

    def __call__(self, q, k_pages, v_pages, layer, prepared: _RowMetadata, *, sm_scale,
                 sliding_window=None, soft_cap=None, sinks=None):
        from pallas_kernels.reference import attend_rows
        pr = prepared
        kw = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
        kernel = cpu_attention.usable(k_pages) if self.cpu_kernel is None else self.cpu_kernel
        kernel = kernel and sinks is None
        if k_pages.shape[3] > WIDE_MAX_KV_HEADS and not kernel:
            return attend_rows(q, k_pages, v_pages, layer, pr.page_table, pr.seq_ids,
                               pr.positions, sinks=sinks, **kw)
        num_tokens, num_seqs = q.shape[0], pr.page_table.shape[0]
        q_decode = q[:num_seqs] if num_tokens >= num_seqs else jnp.pad(
            q, ((0, num_seqs - num_tokens), (0, 0), (0, 0)))
        if kernel:  # (the step's work lists, then unused, are dropped by XLA)
            decoded = cpu_attention.decode(q_decode, k_pages, v_pages, layer, pr.page_table,
                                           pr.kv_lens, pr.num_decode_seqs, **kw)
        else:
            if pr.decode:
                work = pr.decode[self.sliding_windows.index(sliding_window)]
            else:  # made without the page size (a model run alone): this layer makes its own
                work = self._work(pr.kv_lens, pr.num_decode_seqs, pr.page_table,
                                  k_pages.shape[2], sliding_window)
            decoded = decode_attention(q_decode, k_pages, v_pages, layer, work,
                                       sm_scale=sm_scale, items_per_chunk=self.items_per_chunk,
                                       soft_cap=soft_cap, sinks=sinks)
        rows = jnp.arange(num_tokens)
        is_decode = rows < pr.num_decode_seqs
        ragged = jax.lax.cond(  # the other rows; decode rows as padding (no work)
            pr.any_ragged, lambda a: attend_rows(*a, sinks=sinks, **kw),
            lambda a: jnp.zeros_like(a[0]),
            (q, k_pages, v_pages, layer, pr.page_table, pr.seq_ids,
             jnp.where(is_decode, -1, pr.positions)))
        from_decode = decoded[jnp.minimum(rows, num_seqs - 1)]
        return jnp.where(is_decode[:, None, None], from_decode, ragged)


class _KernelMetadata(NamedTuple):
    page_table: jax.Array      # [S, P]
    num_decode_seqs: jax.Array  # []
    decode_kv_lens: jax.Array  # [S] context of decode requests, 0 for the others
    any_ragged: jax.Array      # [] bool: some request has more than one row this step
    ragged: tuple              # per sliding window: metadata.RaggedBlocks
    decode: tuple              # per sliding window: [S * splits, 5] split metadata


class PallasAttention:
    """Decode rows through paged_attention's kernel, the rest through the ragged kernel (not
    run at all in a step of one-row requests only). With sinks, both kernels also report their
    log-sum-exp and the sinks scale their outputs (ragged_paged_attention.sink_weight): the
    kernel bodies are the same either way."""

    uses_kernel = True  # the step holds a Pallas kernel call

    def __init__(self, shape: AttentionShape, interpret: bool = False,
                 max_kv_splits: int | None = None, platform: str | None = None):
        """max_kv_splits: the most decode KV splits (kernel_fit's cap where more would not fit
        in a Hopper block's shared memory; None: tuning.py's); platform: "tpu" | "gpu", the
        kernels' target (None: JAX's default backend)."""
        self.shape = shape
        self.max_kv_splits = max_kv_splits
        self.formulation, self.sizes, self.interpret = self._plan(interpret, platform)

    @staticmethod
    def _plan(interpret, platform=None):
        from pallas_kernels import tuning
        return tuning.plan(interpret, platform)

    def _configs(self, page_table_shape, sliding_window, sm_scale=1.0, soft_cap=None):
        from pallas_kernels import tuning
        from pallas_kernels.paged_attention import decode_config
        from pallas_kernels.ragged_paged_attention import ragged_config
        num_seqs, pages_per_seq = page_table_shape
        sh = self.shape
        ragged = ragged_config(sh.group, sh.page_size, pages_per_seq, self.sizes,
                               sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window)
        tile_pages = tuning.pages_per_tile(sh.page_size, self.sizes)
        splits = tuning.num_kv_splits(sh.num_kv_heads, num_seqs,
                                      -(-pages_per_seq // tile_pages), self.sizes)
        decode, num_splits = decode_config(
            sh.group, sh.page_size, pages_per_seq, sh.num_kv_heads, num_seqs, self.sizes,
            sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
            tile_pages=tile_pages, num_kv_splits=min(splits, self.max_kv_splits or splits))
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
        return _KernelMetadata(md.page_table, num_decode, decode_kv_lens,
                               jnp.reshape(md.num_seqs, ()) > num_decode, tuple(ragged),
                               tuple(decode))

    def _ragged(self, q, k_pages, v_pages, layer, page_table, blocks, sinks, c):
        from pallas_kernels.ragged_paged_attention import ragged_attend
        return ragged_attend(q, k_pages, v_pages, layer, page_table, blocks, sinks, c=c,
                             formulation=self.formulation, interpret=self.interpret)

    def _decode(self, q, k_pages, v_pages, layer, page_table, kv_lens, meta, sinks, c,
                num_splits):
        from pallas_kernels.paged_attention import decode_attend
        return decode_attend(q, k_pages, v_pages, layer, page_table, kv_lens, meta, sinks, c=c,
                             num_splits=num_splits, formulation=self.formulation,
                             interpret=self.interpret)

    def __call__(self, q, k_pages, v_pages, layer, prepared: _KernelMetadata, *, sm_scale,
                 sliding_window=None, soft_cap=None, sinks=None):
        pr = prepared
        index = self.shape.sliding_windows.index(sliding_window)
        rc, dc, num_splits = self._configs(pr.page_table.shape, sliding_window, sm_scale,
                                           soft_cap)
        out = jax.lax.cond(  # [T, Hq, D]; a step of one-row requests has no ragged block
            pr.any_ragged,
            lambda a: self._ragged(*a, pr.page_table, pr.ragged[index], sinks, rc),
            lambda a: jnp.zeros_like(a[0]), (q, k_pages, v_pages, layer))
        num_tokens, num_seqs = q.shape[0], pr.page_table.shape[0]
        q_decode = q[:num_seqs]  # decode rows are the batch's first rows, one per request
        if num_tokens < num_seqs:
            q_decode = jnp.pad(q_decode, ((0, num_seqs - num_tokens), (0, 0), (0, 0)))
        decoded = self._decode(q_decode, k_pages, v_pages, layer, pr.page_table,
                               pr.decode_kv_lens, pr.decode[index], sinks, dc,
                               num_splits)                               # [S, Hq, D]
        rows = jnp.arange(num_tokens)
        from_decode = decoded[jnp.minimum(rows, num_seqs - 1)]
        return jnp.where((rows < pr.num_decode_seqs)[:, None, None], from_decode, out)


class XlaAttention(PallasAttention):
    """The Pallas backend's blocks and split-KV decode, run by pallas_kernels/xla_blocked.py's
    XLA ops with tuning.py's "xla" block sizes: for GPUs (and shapes) the compiled kernel can't
    serve."""

    uses_kernel = False

    def __init__(self, shape: AttentionShape):
        super().__init__(shape)

    @staticmethod
    def _plan(interpret, platform=None):
        from pallas_kernels import tuning
        return "xla", tuning.block_sizes("xla"), False

    def _ragged(self, q, k_pages, v_pages, layer, page_table, blocks, sinks, c):
        from pallas_kernels.xla_blocked import ragged_attend
        return ragged_attend(q, k_pages, v_pages, layer, page_table, blocks, sinks, c=c)

    def _decode(self, q, k_pages, v_pages, layer, page_table, kv_lens, meta, sinks, c,
                num_splits):
        from pallas_kernels.xla_blocked import decode_attend
        return decode_attend(q, k_pages, v_pages, layer, page_table, kv_lens, meta, sinks, c=c,
                             num_splits=num_splits)
