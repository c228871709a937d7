"""RequestOutput and CompletionOutput: what the engine hands back after a step (plain data, no jax).

As vLLM shapes them: a RequestOutput is one caller's request (its prompt, its timing) and holds
`outputs`, one CompletionOutput per sample (`n` of them). Each output carries its totals so far
and this step's deltas (`new_*`). For the usual n = 1 the request's own `text`, `token_ids`,
`finish_reason` ... read its only sample. A snapshot: later steps never change an output already
returned, and taking one copies no history (CompletionOutput's totals are cut on first read).
"""

from __future__ import annotations

from dataclasses import dataclass, field


class CompletionOutput:
    """One sample's output: its totals so far and this step's deltas (`new_*`).

    A snapshot shares the running record's append-only lists and keeps their lengths at the
    time it was taken, so taking one costs no copy of the history: token_ids, text, logprobs
    and top_logprobs are cut from the shared lists when a caller first reads them. A one-token
    delta (the usual decode step) keeps its token and logprob as they are: its new_* lists are
    made when a caller first reads them, not in the engine's loop."""

    __slots__ = ("index", "new_text", "cumulative_logprob", "finish_reason", "_tokens", "_texts",
                 "_logprobs", "_tops", "_counts", "_cache", "_marks", "_appends", "_new",
                 "_one_token", "_one_logprob")

    def __init__(self, index: int, token_ids=None, text: str = "", new_token_ids=None,
                 new_text: str = "", cumulative_logprob: float = 0.0, logprobs=None,
                 new_logprobs=None, top_logprobs=None, new_top_logprobs=None,
                 finish_reason: str | None = None):
        self.index = index
        # this step's deltas: (new_token_ids, new_logprobs, new_top_logprobs), or None: one
        # token, _one_token (None: no token) and _one_logprob
        self._new = ([] if new_token_ids is None else new_token_ids,
                     [] if new_logprobs is None else new_logprobs,
                     [] if new_top_logprobs is None else new_top_logprobs)
        self._one_token = self._one_logprob = None
        self.new_text = new_text                        # this step's text delta
        self.cumulative_logprob = cumulative_logprob    # sum of the sampled tokens' logprobs
        self.finish_reason = finish_reason              # stop, length, abort, error
        self._tokens = list(token_ids or ())            # the shared, append-only lists
        self._texts = [text] if text else []
        self._logprobs = None if logprobs is None else list(logprobs)  # sampling.logprobs set
        # sampling.logprobs = k > 0: per output token, its k most likely {token id: logprob}
        self._tops = None if top_logprobs is None else list(top_logprobs)
        self._counts = None  # a snapshot's lengths of the four lists; None: the live record
        self._cache = {}
        # the live record: the lists' lengths at the last hand-out, and appends since it (more
        # than one: a caller that takes final outputs only; the deltas are then cut at hand-out)
        self._marks = (len(self._tokens), len(self._texts), len(self._logprobs or ()),
                       len(self._tops or ()))
        self._appends = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def new_token_ids(self) -> list[int]:
        """This step's tokens."""
        return (self._new or self._one_deltas())[0]

    @property
    def new_logprobs(self) -> list[float]:
        """This step's tokens' logprobs."""
        return (self._new or self._one_deltas())[1]

    @property
    def new_top_logprobs(self) -> list[dict[int, float]]:
        """This step's tokens' alternatives (sampling.logprobs = k > 0; else empty)."""
        return (self._new or self._one_deltas())[2]

    @property
    def num_new_tokens(self) -> int:
        """len(new_token_ids), without making the list."""
        new = self._new
        return len(new[0]) if new is not None else int(self._one_token is not None)

    def _one_deltas(self) -> tuple[list, list, list]:
        token = self._one_token
        new = self._new = ([], [], []) if token is None else ([token], [self._one_logprob], [])
        return new

    def clear_deltas(self) -> None:
        """No deltas this step (an error ends the sample)."""
        self._new, self.new_text = ([], [], []), ""

    def _cut(self, name: str, items, count: int):
        if self._counts is None or items is None:
            return items
        if self._cache is None:
            self._cache = {}
        value = self._cache.get(name)
        if value is None:
            value = self._cache[name] = items[:count]
        return value

    @property
    def num_tokens(self) -> int:
        """len(token_ids), without cutting them."""
        return len(self._tokens) if self._counts is None else self._counts[0]

    @property
    def token_ids(self) -> list[int]:
        """All output tokens so far."""
        return self._cut("token_ids", self._tokens, self._counts and self._counts[0])

    @property
    def text(self) -> str:
        """All output text so far."""
        if self._counts is None:
            return "".join(self._texts)
        if self._cache is None:
            self._cache = {}
        value = self._cache.get("text")
        if value is None:
            value = self._cache["text"] = "".join(self._texts[:self._counts[1]])
        return value

    @property
    def logprobs(self) -> list[float] | None:
        return self._cut("logprobs", self._logprobs, self._counts and self._counts[2])

    @property
    def top_logprobs(self) -> list[dict[int, float]] | None:
        return self._cut("top_logprobs", self._tops, self._counts and self._counts[3])

    def append(self, token_ids, text: str, logprobs, top_logprobs) -> None:
        """The live record takes one step's output (the deltas become new_*)."""
        self._appends += 1
        self._new, self.new_text = (token_ids, logprobs, top_logprobs), text
        self._tokens += token_ids
        if text:
            self._texts.append(text)
        for logprob in logprobs:
            self.cumulative_logprob += logprob
        if self._logprobs is not None:
            self._logprobs += logprobs
        if self._tops is not None:
            self._tops += top_logprobs

    def append_one(self, token_id: int, text: str, logprob: float) -> None:
        """append() of one token, its text and logprob, for a record without logprob lists
        (sampling.logprobs None): no delta lists (a snapshot's are made when read)."""
        self._appends += 1
        self._new, self.new_text = None, text
        self._one_token, self._one_logprob = token_id, logprob
        self._tokens.append(token_id)
        if text:
            self._texts.append(text)
        self.cumulative_logprob += logprob

    def hand_out(self) -> "CompletionOutput":
        """A snapshot: a view of the record as it is now, that later appends never change;
        the deltas since the last hand-out go with it, in lists of its own."""
        snap = CompletionOutput.__new__(CompletionOutput)
        snap.index, snap.finish_reason = self.index, self.finish_reason
        snap.cumulative_logprob = self.cumulative_logprob
        tokens, texts, logprobs, tops = self._tokens, self._texts, self._logprobs, self._tops
        snap._tokens, snap._texts, snap._logprobs, snap._tops = tokens, texts, logprobs, tops
        counts = snap._counts = (len(tokens), len(texts), 0 if logprobs is None else len(logprobs),
                                 0 if tops is None else len(tops))
        snap._cache = None  # made on first read
        appends = self._appends
        if appends == 1:  # the usual: one step's deltas, handed over (the record keeps none)
            snap.new_text, snap._new = self.new_text, self._new
            snap._one_token, snap._one_logprob = self._one_token, self._one_logprob
            self._new = None
        elif appends:  # several steps since the last hand-out: all of their deltas
            m = self._marks
            snap.new_text = "".join(texts[m[1]:])
            snap._new = (tokens[m[0]:], [] if logprobs is None else logprobs[m[2]:],
                         [] if tops is None else tops[m[3]:])
        else:  # nothing new since the hand-out before
            snap.new_text, snap._new, snap._one_token = "", None, None
        self._marks, self._appends = counts, 0
        return snap

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, "
                f"token_ids={self.token_ids}, finish_reason={self.finish_reason})")


@dataclass(slots=True)  # one per request and step
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=lambda: [CompletionOutput(0)])
    finished: bool = False          # every sample has finished
    error: str | None = None
    num_cached_tokens: int = 0
    time_to_first_token: float | None = None  # arrival to the first token of any sample
    latency: float | None = None    # arrival to finish, seconds (set when finished)
    # sampling.prompt_logprobs = k: per prompt position None (the first), then {token id:
    # logprob} of the prompt token there and the k most likely; set with the first tokens
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # the weights that sampled this output's newest tokens (engine/rollout.py: 0 as loaded,
    # one more per update_weights)
    weight_version: int = 0
    # set with `error` when the request itself is at fault (its bans leave its grammar no
    # token: bad input, the front ends answer 400): the request field named, e.g. bad_words
    error_field: str | None = None

    # ---- the first sample's fields (the only sample, unless n > 1) ------------------------
    @property
    def num_tokens(self) -> int:
        """len(token_ids), without cutting them."""
        return self.outputs[0].num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def new_token_ids(self) -> list[int]:
        return self.outputs[0].new_token_ids

    @property
    def new_text(self) -> str:
        return self.outputs[0].new_text

    @property
    def logprobs(self) -> list[float] | None:
        return self.outputs[0].logprobs

    @property
    def new_logprobs(self) -> list[float]:
        return self.outputs[0].new_logprobs

    @property
    def top_logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].top_logprobs

    @property
    def new_top_logprobs(self) -> list[dict[int, float]]:
        return self.outputs[0].new_top_logprobs

    @property
    def finish_reason(self) -> str | None:
        """The first sample's (abort and error end every sample)."""
        return self.outputs[0].finish_reason
