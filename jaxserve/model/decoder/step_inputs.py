"""The inputs of one compiled step, as dataclasses of fixed-shape arrays (a pytree per step).

runner/prepare_inputs.py fills them with numpy arrays padded to a bucket; the compiled step
receives the same dataclasses with device arrays inside, so the step is `step(state, kv, inputs)`
and a new per-step input (a grammar mask, penalty counts) is one new field here and nowhere else in the
call chain. Plain data: this module must not import jax (model/decoder/pytrees.py registers the
classes
as pytrees on the jax side) and holds no logic beyond empty-batch constructors.

Row layout of a ragged batch: requests in order, decode requests first (one row each), then
prefill chunks; rows past cu_q_lens[num_seqs] are padding that writes to scratch page 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.core.plan import MAX_BANNED  # multi-token bad words a row bans in one step
from jaxserve.core.request import MAX_LOGPROBS as MAX_TOP_LOGPROBS  # alternatives a row can report


@dataclass
class ModelInputs:
    """What the decoder reads per token row."""

    token_ids: np.ndarray       # [T] i32
    positions: np.ndarray       # [T] i32 (padding rows: 0)
    slot_mapping: np.ndarray    # [T] i32 flat page * page_size + offset (padding -> page 0)
    logits_indices: np.ndarray  # [R] i32 rows whose logits are needed
    # [T] i32 async scheduling: a row > 0 reads its token from that batch slot's last sampled
    # token (on the device) instead of token_ids; 0: token_ids holds it. Only the plain step
    # reads it (before the model): a caller of the model alone leaves it None.
    token_slots: np.ndarray | None = None
    # [T] i32 each row's LoRA adapter slot (0: the base model; padding rows: 0). Read only
    # where the step has adapter stacks (model/decoder/lora.py's Adapters); a caller of the model
    # alone may leave it None.
    adapter_slots: np.ndarray | None = None

    @classmethod
    def empty(cls, t: int, r: int) -> "ModelInputs":
        return cls(np.zeros(t, np.int32), np.zeros(t, np.int32), np.zeros(t, np.int32),
                   np.zeros(r, np.int32), np.zeros(t, np.int32), np.zeros(t, np.int32))


@dataclass
class AttentionMetadata:
    """What paged attention reads per request; one object for every layer of the step."""

    cu_q_lens: np.ndarray       # [S+1] i32 row offsets of each request's query rows
    kv_lens: np.ndarray         # [S] i32 context per request, this step's tokens included
    page_table: np.ndarray      # [S, P] i32
    num_seqs: np.ndarray        # [] i32 requests in use
    # [] i32 requests 0..num_decode_seqs-1 are one-row decodes at rows 0..num_decode_seqs-1:
    # a backend with a decode kernel takes them there, the rest through the ragged kernel.
    num_decode_seqs: np.ndarray

    @classmethod
    def empty(cls, s: int, p: int) -> "AttentionMetadata":
        return cls(np.zeros(s + 1, np.int32), np.zeros(s, np.int32), np.zeros((s, p), np.int32),
                   np.zeros((), np.int32), np.zeros((), np.int32))


@dataclass
class SamplingInputs:
    """Per-request sampling settings for the token each request samples this step."""

    temperature: np.ndarray     # [S] f32 (0 = greedy)
    top_k: np.ndarray           # [S] i32 (0 = off)
    top_p: np.ndarray           # [S] f32
    min_p: np.ndarray           # [S] f32
    seeds: np.ndarray           # [S] u32
    output_index: np.ndarray    # [S] i32 keys derive from (seed, output_index)
    any_sampling: np.ndarray    # [] bool: False lets the step skip sampling (greedy only)
    # Logits processors (runner/logits_processors.py); a row without any points at slot 0.
    processor_slot: np.ndarray      # [S] i32 row of the device processor state
    presence_penalty: np.ndarray    # [S] f32
    frequency_penalty: np.ndarray   # [S] f32
    repetition_penalty: np.ndarray  # [S] f32 (1: off)
    suppress_stop: np.ndarray       # [S] bool: below min_tokens, stop tokens are masked
    banned: np.ndarray              # [S, MAX_BANNED] i32 tokens masked this step (-1: none)
    any_processors: np.ndarray      # [] bool: False skips every processor
    any_top_logprobs: np.ndarray    # [] bool: False skips the top-k of the log-probabilities
    # prompt_logprobs: per token row, the prompt token that follows it (-1: not such a row)
    prompt_next_token: np.ndarray   # [T] i32
    any_prompt_logprobs: np.ndarray  # [] bool: False skips the logits of every row
    # structured output: allowed next tokens, W = ceil(V / 32) bitmask words per row
    grammar_bitmask: np.ndarray     # [S, W] i32
    has_grammar: np.ndarray         # [S] bool: the row's bitmask applies
    any_grammar: np.ndarray         # [] bool: False skips unpacking bitmasks
    # [S] i32 the batch slot that keeps the row's sampled token for the next step (0: scratch)
    sample_slots: np.ndarray

    @classmethod
    def empty(cls, s: int, t: int, w: int = 1) -> "SamplingInputs":
        return cls(np.zeros(s, np.float32), np.zeros(s, np.int32), np.ones(s, np.float32),
                   np.zeros(s, np.float32), np.zeros(s, np.uint32), np.zeros(s, np.int32),
                   np.zeros((), np.bool_), np.zeros(s, np.int32), np.zeros(s, np.float32),
                   np.zeros(s, np.float32), np.ones(s, np.float32), np.zeros(s, np.bool_),
                   np.full((s, MAX_BANNED), -1, np.int32), np.zeros((), np.bool_),
                   np.zeros((), np.bool_), np.full(t, -1, np.int32), np.zeros((), np.bool_),
                   np.full((s, w), -1, np.int32), np.zeros(s, np.bool_), np.zeros((), np.bool_),
                   np.zeros(s, np.int32))


@dataclass
class PageTableInputs:
    """The plain step's page tables kept on the device by batch slot (runner/input_batch.py's
    DevicePageTables): each request's slot, and this step's changed rows. The step writes the
    rows, then gathers attention.page_table [S, P] by slot on the device, so
    attention.page_table itself is not sent (None)."""

    slots: np.ndarray         # [S] i32 batch slot of each request (padding: 0, scratch, zeros)
    update_slots: np.ndarray  # [K] i32 slots whose row changed (unused: 0)
    update_rows: np.ndarray   # [K, P] i32 their rows (unused: zeros)

    @classmethod
    def empty(cls, s: int, p: int) -> "PageTableInputs":
        k = num_table_updates(s)
        return cls(np.zeros(s, np.int32), np.zeros(k, np.int32), np.zeros((k, p), np.int32))


def num_table_updates(s: int) -> int:
    """Changed page-table rows a step of S requests carries itself (more: a separate scatter
    before it). A decoding request gains a page every page_size tokens, so most steps change
    a few rows; admissions change more."""
    return min(s, max(8, s // 4))


@dataclass
class StepInputs:
    """Everything one plain step reads: the model's rows, attention metadata, sampling."""

    model: ModelInputs
    attention: AttentionMetadata
    sampling: SamplingInputs
    # The plain step's device page tables; None: attention.page_table is sent whole.
    tables: PageTableInputs | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """The (tokens, requests) bucket."""
        return self.model.token_ids.shape[0], self.attention.kv_lens.shape[0]

    @classmethod
    def empty(cls, t: int, s: int, p: int, w: int = 1,
              device_tables: bool = False) -> "StepInputs":
        """All-padding inputs of bucket (t, s): also what warm-up compiles and runs. w: bitmask
        words per row (ceil(V / 32) for steps that apply grammars); device_tables: page tables
        as PageTableInputs (attention.page_table None)."""
        inputs = cls(ModelInputs.empty(t, s), AttentionMetadata.empty(s, p),
                     SamplingInputs.empty(s, t, w))
        if device_tables:
            inputs.attention.page_table = None
            inputs.tables = PageTableInputs.empty(s, p)
        return inputs


@dataclass
class VerifyInputs:
    """Speculative verification: R = min(T, S*(k+1)) logit rows (model.logits_indices)."""

    row_seq: np.ndarray           # [R] i32 request of each row (padding: S, dropped)
    row_j: np.ndarray             # [R] i32 index of the row within its request's rows
    row_draft: np.ndarray         # [R] i32 draft verified at the row (-1: none or on-device)
    row_device_draft: np.ndarray  # [R] bool: the draft model proposes this row's draft
    # structured output: each row's allowed tokens (after the drafts before it), as SamplingInputs
    grammar_bitmask: np.ndarray   # [R, W] i32
    has_grammar: np.ndarray       # [R] bool
    any_grammar: np.ndarray       # [] bool

    @classmethod
    def empty(cls, r: int, s: int, w: int = 1) -> "VerifyInputs":
        return cls(np.full(r, s, np.int32), np.zeros(r, np.int32), np.full(r, -1, np.int32),
                   np.zeros(r, np.bool_), np.full((r, w), -1, np.int32), np.zeros(r, np.bool_),
                   np.zeros((), np.bool_))


@dataclass
class DraftInputs:
    """The draft model's view of a speculative step: the plan without draft rows."""

    model: ModelInputs            # rows as scheduled (logits_indices: [S] last row per request)
    attention: AttentionMetadata  # the same requests without their draft rows
    draft_rows: np.ndarray        # [S, k] i32 verify rows that hold draft tokens (padding: T)
    num_drafts: np.ndarray        # [S] i32 draft rows per request

    @classmethod
    def empty(cls, t: int, s: int, p: int, k: int) -> "DraftInputs":
        return cls(ModelInputs.empty(t, s), AttentionMetadata.empty(s, p),
                   np.full((s, k), t, np.int32), np.zeros(s, np.int32))


@dataclass
class SpecStepInputs:
    """A speculative step: the target's rows with draft rows appended (`step`), the rows to
    verify, and (draft-model method) the draft's own view."""

    step: StepInputs
    verify: VerifyInputs
    draft: DraftInputs | None  # None: drafts come from the host (n-gram)

    @property
    def shape(self) -> tuple[int, int]:
        return self.step.shape


def num_logit_rows(t: int, s: int, num_speculative_tokens: int) -> int:
    return min(t, s * (num_speculative_tokens + 1))
