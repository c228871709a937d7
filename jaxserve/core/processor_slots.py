"""ProcessorSlots: which row of the device-side logits-processor state each request holds.

A request whose SamplingParams use a logits processor (penalties, logit_bias, allowed tokens,
bad words, min_tokens) gets a slot the first time it samples after admission, and keeps it
until it finishes or is preempted. The device row holds its output-token counts (updated on
device from the step's own samples), its prompt tokens and its fixed masks; the step it is
assigned carries a ProcessorInit so the runner fills the row from the host's histories once.
A preempted request (recompute or swap) gives its slot back and is filled again when it resumes,
from the same histories, so its counts come back intact. Slot 0 is scratch: rows that use no
processor point there and it is never handed out. Plain Python: no jax.
"""

from __future__ import annotations

from jaxserve.core.plan import MAX_BANNED, ProcessorInit, ProcessorRow
from jaxserve.core.request import Request

NEG_INF = float("-inf")


def bad_words_ids(tokenizer, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Each bad word tokenized as written and with a leading space (as it reads mid-text),
    without special tokens; duplicates dropped. Raises ValueError when more multi-token words
    result than one step can ban."""
    seqs: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                seqs[ids] = None
    multi = [s for s in seqs if len(s) > 1]
    if len(multi) > MAX_BANNED:
        raise ValueError(f"bad_words tokenize to {len(multi)} multi-token sequences; at most "
                         f"{MAX_BANNED} are supported")
    return tuple(seqs)


def completed_bans(request: Request) -> tuple[int, ...]:
    """The last tokens of the multi-token bad words whose earlier tokens end the output: banned
    for the next token only (single-token words are banned for good, by ProcessorInit)."""
    outputs = request.output_token_ids
    return tuple(dict.fromkeys(
        seq[-1] for seq in request.bad_words_ids
        if len(seq) > 1 and len(outputs) >= len(seq) - 1
        and tuple(outputs[len(outputs) - len(seq) + 1:]) == seq[:-1]))


class ProcessorSlots:
    def __init__(self, num_slots: int):
        """num_slots: rows of the device state, scratch row 0 included (max_num_seqs + 1)."""
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, 0, -1))
        self._slot_of: dict[str, int] = {}

    @property
    def num_assigned(self) -> int:
        return len(self._slot_of)

    def row(self, request: Request) -> ProcessorRow | None:
        """The request's processors for its sampling row this step (None: it uses none)."""
        sp = request.sampling
        if not sp.uses_processors:
            return None
        init = None
        slot = self._slot_of.get(request.request_id)
        if slot is None:
            slot = self._free.pop()  # a running request holds at most one: never empty
            self._slot_of[request.request_id] = slot
            init = self._init(request)
        outputs = request.output_token_ids
        return ProcessorRow(slot, sp.presence_penalty, sp.frequency_penalty,
                            sp.repetition_penalty,
                            len(outputs) + request.num_pending_tokens < sp.min_tokens,
                            completed_bans(request), init)

    def release(self, request_id: str) -> None:
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    @staticmethod
    def _init(request: Request) -> ProcessorInit:
        sp = request.sampling
        bias = dict(sp.logit_bias)
        for seq in request.bad_words_ids:
            if len(seq) == 1:
                bias[seq[0]] = NEG_INF
        stops = tuple(sp.stop_token_ids) + (() if sp.ignore_eos else request.eos_token_ids)
        return ProcessorInit(tuple(request.prompt_token_ids), tuple(request.output_token_ids),
                             tuple(sorted(bias.items())), sp.allowed_token_ids,
                             tuple(dict.fromkeys(stops)))
