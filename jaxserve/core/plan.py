"""StepPlan: the scheduler's decision for one step, as plain data for the runner.

No jax, no references to live Request objects: everything the runner needs is copied in, so
the runner can never mutate scheduler state and a plan can be logged or replayed. The steady
decoders (DecodeRows) come as arrays, one row per request, not an object each. Rows of the
device batch are the runner's: a plan names requests, never a row; the runner gives a request
a row when a plan first lays it out and frees it when a plan lists it in `released` (as
vLLM's InputBatch.req_id_to_index and SchedulerOutput.finished_req_ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ProcessorInit:
    """What a freshly assigned processor slot is filled with on device, once per admission
    (first sampling step after arrival or after a preemption): the token histories the
    penalties count, and the request's fixed vocabulary masks and biases."""

    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    logit_bias: tuple[tuple[int, float], ...]   # single-token bad words included, as -inf
    allowed_token_ids: tuple[int, ...] | None
    stop_token_ids: tuple[int, ...]             # masked while below min_tokens


MAX_BANNED = 16  # multi-token bad words' last tokens one row can ban in one step


@dataclass(slots=True)  # built per request and step: cheap to make, never changed
class ProcessorRow:
    """A request's logits processors for the token it samples this step."""

    slot: int                     # its row in the device-side processor state (0: scratch)
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    suppress_stop: bool           # fewer than min_tokens outputs so far
    banned: tuple[int, ...]       # multi-token bad words' last tokens, banned this step
    init: ProcessorInit | None    # set on the step the slot was assigned


@dataclass(slots=True)  # never changed once made
class SamplingRow:
    """Sampling settings of one request for the token it samples this step. A request without
    logits processors or a grammar has one for its whole life (the scheduler makes it when the
    request is queued), so the runner's persistent batch (runner/input_batch.py) finds its
    row holding equal settings and writes them once per row."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    top_logprobs: int = 0                    # alternatives to report (sampling.logprobs = k)
    processors: ProcessorRow | None = None   # None: no logits processor changes this row
    # structured output: the allowed next tokens, int32 [ceil(V / 32)] bitmask words as bytes;
    # speculative steps: then those after each draft (None after one the grammar refuses)
    grammar_bitmask: bytes | None = None
    grammar_draft_bitmasks: tuple[bytes | None, ...] = ()


@dataclass(frozen=True, slots=True)
class PageUpdate:
    """How a request's page table changed since its device row last got it (the runner keeps
    each row's table): its first num_kept entries stay, the leading num_released of them now
    NULL_PAGE (pages a sliding window gave back), new_pages follow, and nothing after (a
    table shortened by rejected drafts ends at num_kept). num_kept 0: the whole table (a
    request new to its row). Applying it twice gives the same table."""

    num_kept: int
    new_pages: tuple[int, ...]
    num_released: int = 0

    @classmethod
    def whole(cls, page_table) -> "PageUpdate":
        return cls(0, tuple(page_table))

    def apply(self, held: tuple[int, ...]) -> tuple[int, ...]:
        """The table this makes of the one the row held."""
        return ((0,) * self.num_released + tuple(held[self.num_released:self.num_kept])
                + self.new_pages)


@dataclass(slots=True)  # built per request and step: cheap to make, never changed
class ScheduledChunk:
    """Tokens of one request whose K/V this step writes (1 for a decode, many for prefill)."""

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int            # position of token_ids[0]
    pages: PageUpdate | None       # its page table's change (None: its row holds it as is)
    sampling: SamplingRow | None   # None: a prefill chunk that is not the last one
    # prompt_logprobs = k: rows from prompt_logprob_first_row on report the log-probability of
    # the prompt token that follows them (prompt_logprob_next, in order) and k alternatives
    prompt_logprobs: int = 0
    prompt_logprob_first_row: int = 0
    prompt_logprob_next: tuple[int, ...] = ()
    # The last of token_ids is a placeholder, read on the device from the request's row of the
    # runner's batch state: the token the step before sampled, not yet on the host (async
    # scheduling).
    token_on_device: bool = False
    # with sampling: which output token it samples (keys derive from (seed, output_index))
    output_index: int = 0
    # its LoRA adapter's device slot (0: the base model), the same for each of its rows
    lora_slot: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def kv_len(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclass(slots=True)
class DecodeRows:
    """The step's steady decode rows, laid out before every chunk: one token each, of running
    requests whose device row already holds their sampling settings and page table, unchanged
    (they came with an earlier chunk of the request since it got that row), with a plain
    SamplingRow (no processors, grammar, top or prompt logprobs). Row i is request
    request_ids[i]; `meta` [D, 5] int64 holds its start position, its token (0: a placeholder
    when on the device), whether the token is on the device (the step before sampled it), the
    output index it samples, and its LoRA adapter's device slot (0: none). sampling is the
    settings its row holds (chunks() makes the chunks these rows stand for, for any reader
    that wants objects)."""

    request_ids: list[str]
    sampling: list[SamplingRow]
    meta: np.ndarray

    POSITION, TOKEN, ON_DEVICE, OUTPUT_INDEX, LORA_SLOT = range(5)
    WIDTH = 5

    def __len__(self) -> int:
        return len(self.request_ids)

    def __eq__(self, other) -> bool:  # (meta is an array: compared by value, not truth)
        return (isinstance(other, DecodeRows) and self.request_ids == other.request_ids
                and self.sampling == other.sampling
                and np.array_equal(self.meta, other.meta))

    @classmethod
    def empty(cls) -> "DecodeRows":
        return cls([], [], np.zeros((0, cls.WIDTH), np.int64))

    def chunks(self) -> list[ScheduledChunk]:
        return [ScheduledChunk(rid, (token,), pos, None, row, token_on_device=bool(dev),
                               output_index=index, lora_slot=lora)
                for rid, row, (pos, token, dev, index, lora)
                in zip(self.request_ids, self.sampling, self.meta.tolist())]


@dataclass(frozen=True)
class DraftRows:
    """Speculative decoding: rows after a decode chunk's token that verify proposed tokens.

    Their ids are token_ids (host proposals, e.g. n-gram) or, when that is empty, tokens the
    runner's draft model proposes during the step. Positions follow the chunk's token."""

    num_tokens: int
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class StaticPadding:
    """Static batching: rows a padded batch computes for nothing this step.

    num_finished_slots of them are finished members' slots, each computed like a decode row
    over the longest member's context (a padded batch's rows all share one length), reading its
    pages and writing only scratch page 0; the other rows are prompt padding."""

    num_rows: int
    num_finished_slots: int


@dataclass(frozen=True)
class SwapOut:
    request_id: str
    page_ids: tuple[int, ...]      # device pages to copy to host before the step runs


@dataclass(frozen=True)
class SwapIn:
    request_id: str
    page_ids: tuple[int, ...]      # new device pages to fill from host before the step runs


@dataclass
class StepPlan:
    # rows in order: decode's, then chunks (decode chunks first); token results likewise
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decode chunks first
    decode: DecodeRows = field(default_factory=DecodeRows.empty)  # steady decoders (decode_rows)
    drafts: dict[str, DraftRows] = field(default_factory=dict)  # request id -> its draft rows
    static_padding: StaticPadding | None = None
    swap_out: list[SwapOut] = field(default_factory=list)
    swap_in: list[SwapIn] = field(default_factory=list)
    dropped_swaps: list[str] = field(default_factory=list)  # host copies no longer needed
    preempted: list[str] = field(default_factory=list)
    # prefix cache host tier (page_manager.take_prefix_ops), done before the step: evicted
    # cached pages to host slots [(device page, slot)], host hits into fresh pages [(slot, page)]
    prefix_stores: list[tuple[int, int]] = field(default_factory=list)
    prefix_loads: list[tuple[int, int]] = field(default_factory=list)
    # LoRA adapters into device slots before the step: [(slot, adapter id)] (core/lora_slots.py)
    lora_loads: list[tuple[int, int]] = field(default_factory=list)
    # requests that stopped running since the last plan (finished, preempted): the runner frees
    # their device rows before laying this plan out (one that runs again here gets a new row)
    released: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_decode_rows + sum(c.num_tokens for c in self.chunks)

    @property
    def num_decode_rows(self) -> int:
        return len(self.decode.request_ids)

    @property
    def num_seqs(self) -> int:
        """Requests the step computes rows for (decode rows and chunks)."""
        return self.num_decode_rows + len(self.chunks)

    def all_chunks(self) -> list[ScheduledChunk]:
        """Every request's rows as chunks, in row order (decode rows made into chunks)."""
        return self.decode.chunks() + self.chunks if self.decode else self.chunks

    @property
    def num_padding_rows(self) -> int:
        return 0 if self.static_padding is None else self.static_padding.num_rows

    @property
    def num_draft_tokens(self) -> int:
        return sum(d.num_tokens for d in self.drafts.values())

    def add_drafts(self, request_id: str, num_tokens: int, token_ids) -> None:
        """A decoding request's draft rows to verify (none when num_tokens is 0)."""
        if num_tokens:
            self.drafts[request_id] = DraftRows(num_tokens, tuple(token_ids))

    def num_drafts_of(self, request_id: str) -> int:
        draft = self.drafts.get(request_id)
        return 0 if draft is None else draft.num_tokens

    @property
    def is_empty(self) -> bool:
        return not (self.chunks or self.decode or self.swap_out or self.swap_in
                    or self.prefix_stores or self.prefix_loads or self.lora_loads
                    or self.released)


@dataclass
class StepResult:
    """What one step gives back, in the plan's row order (its DecodeRows, then its chunks):
    plain numpy arrays, the only thing that crosses from the runner to the scheduler."""

    # [num_chunks] i32, or [num_chunks, k+1] for speculative steps (-1 after the accepted run);
    # entries of chunks that do not sample are meaningless.
    token_ids: np.ndarray
    logprobs: np.ndarray   # f32, the shape of token_ids
    # Plain steps: [num_chunks, MAX_TOP_LOGPROBS] most likely token ids and their logprobs
    # (zeros when no row asked); None from speculative steps (which never carry such rows).
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    # Steps with prompt-logprob rows: [T, 1 + K] per token row (the next prompt token, then
    # the alternatives), None otherwise.
    prompt_ids: np.ndarray | None = None
    prompt_logprobs: np.ndarray | None = None
