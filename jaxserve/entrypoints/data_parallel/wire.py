"""The messages between the data-parallel front end and its rank processes (msgpack over ZMQ).

Front end -> rank (one PUSH socket per rank): `add` (request id, prompt token ids, pickled
SamplingParams, priority, deadline as a time.monotonic() instant: CLOCK_MONOTONIC is one clock
for every process on the host), `abort` (request id), `stop`, `reset` (a serial: empty the
prefix cache, then answer `reset_done`).
Rank -> front end (one PULL socket all ranks push to), in batches (a list of items per send):
`ready` (rank, pid, CPU set, pickled EngineInfo and tokenizer), `out` (one RequestOutput as
this step's deltas per sample: the front end rebuilds the totals, so a long output never
crosses again at every step), `err` (request id, the pickled exception: the front ends map
its type to a status as they do for one engine), `stats` (rank, pickled EngineStats, the
rank's Prometheus exposition), `failed` (rank, the error that stopped its engine from
starting, as text), `reset_done` (rank, the reset's serial).

Pickle only carries the engine's own types between two processes of the same program that the
front end started itself; nothing read from a network is unpickled. Encoding and decoding only:
no sockets, no engine.
"""

from __future__ import annotations

import pickle

import msgpack

from jaxserve.engine.outputs import CompletionOutput, RequestOutput

ADD, ABORT, STOP, RESET = "add", "abort", "stop", "reset"
READY, OUT, ERR, STATS, FAILED = "ready", "out", "err", "stats", "failed"
RESET_DONE = "reset_done"


def pack(item) -> bytes:
    return msgpack.packb(item, use_bin_type=True)


def unpack(data: bytes):
    # top logprobs are {token id: logprob}: integer map keys
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def add_message(request_id: str, prompt_token_ids: list[int], params, priority: int,
                deadline: float | None) -> bytes:
    return pack([ADD, request_id, prompt_token_ids, pickle.dumps(params), priority, deadline])


def output_item(out: RequestOutput) -> list:
    """One step's output of a request as an `out` item: per sample only this step's deltas."""
    samples = [[c.index, c.new_token_ids, c.new_text, c.new_logprobs, c.new_top_logprobs,
                c.cumulative_logprob, c.finish_reason] for c in out.outputs]
    prompt_logprobs = None if out.prompt_logprobs is None else pickle.dumps(out.prompt_logprobs)
    return [OUT, out.request_id, out.finished, out.error, out.num_cached_tokens,
            out.time_to_first_token, out.latency, prompt_logprobs, samples, out.error_field]


def error_item(request_id: str, exc: BaseException) -> list:
    """An exception as its class, args and attributes: pickling an exception alone calls its
    class with its args, which a class with other constructor arguments (RequestError) fails."""
    try:
        data = pickle.dumps((type(exc), exc.args, vars(exc)))
    except Exception:  # a class or attribute pickle cannot name
        data = pickle.dumps((RuntimeError, (f"{type(exc).__name__}: {exc}",), {}))
    return [ERR, request_id, data]


def load_error(data: bytes) -> BaseException:
    cls, args, attributes = pickle.loads(data)
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(attributes)
    return exc


class OutputRebuilder:
    """The front end's record of one request's samples: each `out` item's deltas are appended
    to a live CompletionOutput per sample (as the rank's output processor keeps them), and a
    snapshot of it is handed on, so callers see the RequestOutputs one engine would give."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params):
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids
        self.logprobs = params.logprobs is not None
        self.top_logprobs = bool(params.top_logprobs)
        self.records: dict[int, CompletionOutput] = {}
        self.started = False  # a token has come

    def _record(self, index: int) -> CompletionOutput:
        record = self.records.get(index)
        if record is None:
            record = self.records[index] = CompletionOutput(
                index, logprobs=[] if self.logprobs else None,
                top_logprobs=[] if self.top_logprobs else None)
        return record

    def rebuild(self, item: list) -> RequestOutput:
        (_, _, finished, error, num_cached, ttft, latency, prompt_logprobs, samples,
         error_field) = item
        outputs = []
        for index, ids, text, logprobs, tops, cumulative, finish_reason in samples:
            record = self._record(index)
            record.append(ids, text, logprobs, tops)
            record.cumulative_logprob, record.finish_reason = cumulative, finish_reason
            self.started = self.started or bool(ids)
            outputs.append(record.hand_out())
        return RequestOutput(self.request_id, self.prompt_token_ids, outputs, finished, error,
                             num_cached, ttft, latency,
                             None if prompt_logprobs is None else pickle.loads(prompt_logprobs),
                             error_field=error_field)
