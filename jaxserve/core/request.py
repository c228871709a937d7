"""Request host state, SamplingParams (validated) and the events a request emits.

Plain Python over integers: no jax, no tokenizer, no device state. The scheduler owns the
lifecycle (status, num_computed_tokens); the engine owns text.
"""

from __future__ import annotations

import enum
import functools
import math
import time
from dataclasses import dataclass, field

from jaxserve.core.errors import RequestError
from jaxserve.structured.params import StructuredOutputs


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS, a stop token id or a stop string
    LENGTH = "length"    # max_tokens or max_model_len
    ABORT = "abort"      # cancelled by the caller
    ERROR = "error"      # rejected or failed; Request.error says why


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


MAX_LOGPROBS = 20          # top alternatives per token (logprobs=k), as vLLM's default cap
MAX_LOGIT_BIAS = 1024      # logit_bias entries (OpenAI documents no cap; vLLM none either)
MAX_N = 64                 # parallel samples per prompt
OUTPUT_KINDS = ("cumulative", "final_only")  # SamplingParams.output_kind


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request with `n > 1`: sample 0 keeps the request's seed,
    so SamplingParams(seed=sample_seed(s, i), n=1) reproduces sample i of a seeded n-request."""
    return (seed + 0x9E3779B9 * index) % 2**32


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off.

    n: parallel samples of the prompt, which is prefilled once (the samples share its KV pages);
    sample i draws with sample_seed(seed, i).
    Logits processors (vLLM / OpenAI semantics), applied in this order before temperature and
    the filters: allowed_token_ids (every other token masked), logit_bias (token id -> added
    bias), bad_words (a word's last token masked where its earlier tokens end the output),
    min_tokens (EOS and stop_token_ids masked until that many outputs), then
    repetition_penalty (over prompt and output tokens: positive logits divided, negative
    multiplied), frequency_penalty (minus count in the output), presence_penalty (minus once if
    in the output).
    logprobs: None (off), 0 (the sampled token's), k (plus the k most likely alternatives);
    True / False mean 0 / None. Logprobs are of the processed logits, before temperature.
    output_kind (vLLM's RequestOutputKind): "cumulative", an output every step the request
    makes progress (its totals so far and the step's deltas, new_*), or "final_only", one
    output when it finishes (its new_* then hold everything; LLM.generate asks for this).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()   # a dict is accepted
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    n: int = 1
    prompt_logprobs: int | None = None         # per prompt token: its logprob and k alternatives
    include_stop_str_in_output: bool = False   # the stop string that ended the text stays in it
    skip_special_tokens: bool = True           # special tokens are left out of the text
    # the output must match a JSON schema, regex, choice or grammar (a dict is accepted)
    structured_outputs: StructuredOutputs | None = None
    # structured_outputs applies only to the output after the first occurrence of this token
    # sequence (nothing before it is masked; the tokens after it must match); (): from the
    # first output token
    structured_outputs_after: tuple[int, ...] = ()
    output_kind: str = "cumulative"             # or "final_only": one output, at the end

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if isinstance(self.logprobs, bool):
            object.__setattr__(self, "logprobs", 0 if self.logprobs else None)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids",
                               tuple(int(t) for t in self.allowed_token_ids))
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs",
                               StructuredOutputs(**self.structured_outputs))
        object.__setattr__(self, "structured_outputs_after",
                           tuple(int(t) for t in self.structured_outputs_after))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        self.validate()

    def validate(self) -> None:
        """Ranges of each setting alone (core/intake.py checks them against the model);
        raises RequestError naming the field, the value and the limit."""
        def bad(name, value, limit):
            raise RequestError(name, f"{name}={value!r} is invalid: must be {limit}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", self.temperature, ">= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", self.top_k, "an integer >= 0 (0 disables top-k)")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", self.top_p, "in (0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", self.min_p, "in [0, 1]")
        if self.seed is not None and not (0 <= self.seed < 2**32):
            bad("seed", self.seed, "in [0, 2**32)")
        if any(not s for s in self.stop):
            bad("stop", self.stop, "non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "non-negative token ids")
        if self.logprobs is not None and (not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", self.logprobs, f"None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                bad(name, value, "in [-2, 2]")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10):
            bad("repetition_penalty", self.repetition_penalty, "in (0, 10] (1 is off)")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad("logit_bias", f"<{len(self.logit_bias)} entries>", f"at most {MAX_LOGIT_BIAS} "
                "entries")
        for token, value in self.logit_bias:
            if token < 0 or not (math.isfinite(value) and -100 <= value <= 100):
                bad("logit_bias", {token: value}, "token ids >= 0 mapped to biases in [-100, 100]")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            bad("logit_bias", self.logit_bias, "one bias per token id")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or any(t < 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list of token ids >= 0")
        if any(not isinstance(w, str) or not w for w in self.bad_words):
            bad("bad_words", self.bad_words, "non-empty strings")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad("prompt_logprobs", self.prompt_logprobs,
                f"None or an integer in [0, {MAX_LOGPROBS}]")
        if self.structured_outputs_after and (self.structured_outputs is None
                                              or any(t < 0 for t in self.structured_outputs_after)):
            bad("structured_outputs_after", self.structured_outputs_after,
                "token ids >= 0, set only with structured_outputs (it says where that "
                "constraint starts)")
        if self.structured_outputs is not None and self.ignore_eos:
            bad("ignore_eos", True, "false with structured_outputs (a complete output ends "
                "with EOS)")
        if self.output_kind not in OUTPUT_KINDS:
            bad("output_kind", self.output_kind, f"one of {OUTPUT_KINDS} (every output carries "
                "its step's deltas as new_text / new_token_ids: there is no \"delta\" kind)")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            bad("n", self.n, f"an integer in [1, {MAX_N}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property  # read per request and step; the params never change
    def uses_processors(self) -> bool:
        """Whether any logits processor changes this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias or self.min_tokens
                    or self.allowed_token_ids is not None or self.bad_words)

    def needs_plain_steps(self, host_drafts: bool) -> bool:
        """Whether only plain steps compute this request: speculative verification applies no
        logits processor and reports no alternatives or prompt logprobs; it masks a grammar only
        where the host proposes the drafts (host_drafts: n-gram), not a draft model's."""
        return (self.uses_processors or self.top_logprobs > 0 or self.prompt_logprobs is not None
                or (self.structured_outputs is not None and not host_drafts))

    @property
    def top_logprobs(self) -> int:
        """Alternatives reported per token (0: none)."""
        return self.logprobs or 0


@dataclass(slots=True)  # (one object: fewer cache lines per request and step)
class Request:
    # The engine's id of this admission, unique for the engine's life (the caller's id and a
    # serial): everything keyed by it ends with the request, so a caller may reuse its id
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seed: int                      # sampling keys derive from (seed, output index)
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0              # lower value runs first
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # sampling.bad_words, tokenized
    # n > 1: which sample this is, and (samples 1..n-1) the id of sample 0, whose prompt KV
    # pages it shares once sample 0 has prefilled them
    sample_index: int = 0
    shares_prompt_of: str | None = None
    external_id: str = ""          # the caller's id, which its outputs carry ("": request_id)
    # sampling.prompt_logprobs: {token id: logprob} for prompt positions 1, 2, ... so far
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    # sampling.structured_outputs: the request's GrammarMatcher once its grammar compiled
    # (jaxserve/structured/matcher.py; with structured_outputs_after, a DeferredMatcher that
    # masks nothing until that sequence is out); it has accepted every output token
    grammar: object = None
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = 0           # tie-break: earlier arrival wins
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0   # tokens whose KV is in the cache, or is being computed
    # async scheduling: tokens sampled by steps in flight, not yet on the host (0 or 1)
    num_pending_tokens: int = 0
    lora_id: int = 0               # its LoRA adapter (lora_int_id; 0: the base model)
    num_cached_tokens: int = 0     # prompt tokens served by the prefix cache at admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    # set by the scheduler when queued: the token ids that stop it, and its output budget
    # (max_tokens within max_model_len)
    stop_ids: frozenset = frozenset()
    max_output_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def prefix_cache_tokens(self) -> list[int]:
        """The token ids a prefix-cache lookup may match: none when every prompt position's
        logits are needed (prompt logprobs, reported by sample 0)."""
        wants_prompt_logits = (self.sampling.prompt_logprobs is not None
                               and self.sample_index == 0)
        return [] if wants_prompt_logits else self.prompt_token_ids + self.output_token_ids

    def take_token(self, token: int) -> FinishReason | None:
        """Append one sampled token; the reason it ends the request (a stop token id, or its
        output budget max_output_tokens), or None."""
        outputs = self.output_token_ids
        outputs.append(token)
        if token in self.stop_ids:
            return FinishReason.STOP
        return FinishReason.LENGTH if len(outputs) >= self.max_output_tokens else None

    def take_tokens(self, tokens: list[int]) -> FinishReason | None:
        """Append a step's tokens up to the first that ends the request (the rest of `tokens`
        is cut off in place: a stop inside a verified run); its finish reason, or None."""
        for j, token in enumerate(tokens):
            reason = self.take_token(token)
            if reason is not None:
                del tokens[j + 1:]
                return reason
        return None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens the next step may read: the host's, then those still on the device."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def needs_host_tokens(self) -> bool:
        """Whether its next step's inputs depend on its last sampled token on the host (a
        grammar's bitmask, a multi-token bad word's ban): such a request rules out async
        scheduling while it runs."""
        return (self.sampling.structured_outputs is not None
                or any(len(seq) > 1 for seq in self.bad_words_ids))

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: priority first, then arrival (a request's samples in order)."""
        return (self.priority, self.arrival_seq, self.sample_index)


class StopSets:
    """One shared frozenset per distinct set of stop token ids: update() reads a request's per
    step, and requests alike then share its cache lines. A bounded memo, as clients choose
    stop_token_ids."""

    def __init__(self, max_size: int = 256):
        self.max_size = max_size
        self._sets: dict[frozenset, frozenset] = {}

    def of(self, request: Request) -> frozenset:
        sp = request.sampling
        stop_ids = frozenset(sp.stop_token_ids) | frozenset(
            () if sp.ignore_eos else request.eos_token_ids)
        if len(self._sets) >= self.max_size:
            self._sets.clear()
        return self._sets.setdefault(stop_ids, stop_ids)


@dataclass(slots=True)  # one per request and step: cheap to make, never changed
class TokenEvent:
    """What one step produced for one request (the scheduler's output, before text)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[float, ...]
    finish_reason: FinishReason | None = None
    error: str | None = None
    # sampling.logprobs = k > 0: per new token, its k most likely (token id, logprob) pairs
    new_top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    # an error that is the request's own (bad input, which no retry passes: the front ends
    # answer 400 / INVALID_ARGUMENT): the request field at fault; None: the engine failed
    error_field: str | None = None


@dataclass(slots=True)  # one per step
class DecodeTokens:
    """One step's plain decode tokens (plan.DecodeRows' that did not finish the request): what
    a TokenEvent(request_ids[i], (token_ids[i],), (logprobs[i],)) each would say, in lists."""

    request_ids: list[str]
    token_ids: list[int]
    logprobs: list[float]

    def events(self) -> list[TokenEvent]:
        return [TokenEvent(rid, (token,), (logprob,))
                for rid, token, logprob in zip(self.request_ids, self.token_ids, self.logprobs)]
