"""GrammarCompiler: turns StructuredOutputs into compiled llguidance grammars, off the caller's
thread, cached by the constraint's canonical text.

Compiles run on a small thread pool (llguidance drops the GIL while it builds a grammar), so the
engine thread only submits and polls: a request whose grammar is not ready yet waits without
holding up the batch. Results (and errors) are cached in a bounded LRU keyed by
`StructuredOutputs.key`; a key already compiling shares its future. An invalid schema, regex or
grammar is an `InvalidGrammarError` (a ValueError naming the problem); a compile still running
`timeout_s` after it was submitted is a `GrammarTimeoutError`, never a wait without end
(llguidance's parser limits bound the work itself). `check_json_schema` validates a schema
without a tokenizer (tool parameters are checked so). This module must not import jax, and never
touches a per-request matcher state: `CompiledGrammar.new_matcher` (matcher.py) hands each
request its own.
"""

from __future__ import annotations

import collections
import functools
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import llguidance as llg

from jaxserve.structured.matcher import CompiledGrammar
from jaxserve.structured.params import StructuredOutputs

# JSON whitespace between tokens: at most 16 characters per gap. llguidance's default (any run
# of whitespace) lets a model emit whitespace forever; compact JSON (no whitespace) forbids the
# spaces and indentation models like to write.
BOUNDED_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
               "choice": "choice", "grammar": "grammar"}


class InvalidGrammarError(ValueError):
    """The constraint can't be compiled: the message names the kind and the library's reason."""


class GrammarTimeoutError(TimeoutError):
    """The grammar did not compile within the compiler's `timeout_s`."""


def build_ll_tokenizer(tokenizer, vocab_size: int | None = None) -> tuple["llg.LLTokenizer", int]:
    """llguidance's view of a jaxserve Tokenizer (its `tokenizers` backend and EOS ids) and the
    model's vocab size; llguidance's vocabulary covers both the tokenizer's and the model's."""
    own = tokenizer.vocab_size
    vocab_size = own if vocab_size is None else int(vocab_size)
    eos = list(tokenizer.eos_token_ids)
    if not eos:
        raise ValueError("structured output needs the tokenizer's EOS token id")
    ll_tok = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=max(own, vocab_size),
                             eos_token=eos)
    return ll_tok, vocab_size


@functools.lru_cache(maxsize=256)
def _json_schema_problem(schema_text: str) -> str | None:
    grammar = llg.LLMatcher.grammar_from_json_schema(schema_text)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(
        grammar, None, limits=llg.LLParserLimits(verbose_errors=False))
    return messages[0].strip() if is_error else None


def check_json_schema(schema: dict | bool) -> None:
    """InvalidGrammarError naming the problem when `schema` is not a JSON schema the grammar
    library can enforce (bad types, a $ref to nowhere, an unsatisfiable one...); no tokenizer
    needed, results cached by the schema's canonical text."""
    try:
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise InvalidGrammarError(f"invalid JSON schema: {e}") from None
    problem = _json_schema_problem(text)
    if problem is not None:
        raise InvalidGrammarError(f"invalid JSON schema: {problem}")


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer; `submit` / `check` from the engine thread,
    `get` where blocking is fine (offline use, tests)."""

    def __init__(self, tokenizer, vocab_size: int | None = None, *, max_threads: int = 2,
                 cache_size: int = 256, timeout_s: float = 10.0,
                 json_whitespace: str | None = BOUNDED_WHITESPACE):
        """`vocab_size`: the model's embedding rows (default: the tokenizer's vocab).
        `json_whitespace`: regex of the whitespace allowed between JSON tokens; None for
        compact JSON (no whitespace at all)."""
        if cache_size < 1 or max_threads < 1:
            raise ValueError("cache_size and max_threads must be >= 1")
        self.ll_tokenizer, self.vocab_size = build_ll_tokenizer(tokenizer, vocab_size)
        self.tokenizer_vocab_size = tokenizer.vocab_size
        self.timeout_s = float(timeout_s)
        self.cache_size = cache_size
        self._json_options = ({"whitespace_flexible": False} if json_whitespace is None
                              else {"whitespace_pattern": json_whitespace})
        self._limits = llg.LLParserLimits(verbose_errors=False)
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, Future] = collections.OrderedDict()
        self._submitted_at: dict[str, float] = {}
        self.num_compiles = 0        # compiles started (cache misses)

    # ---- the engine's verbs --------------------------------------------------------------------
    def submit(self, so: StructuredOutputs) -> Future:
        """Start compiling `so` unless it is cached or already compiling; its future."""
        key = so.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, so)
            self._cache[key] = future
            self._submitted_at[key] = time.monotonic()
            self.num_compiles += 1
            self._evict()
            return future

    def is_ready(self, so: StructuredOutputs) -> bool:
        """Whether `so` has finished compiling (successfully or not); submits it if unknown."""
        return self.submit(so).done()

    def check(self, so: StructuredOutputs) -> CompiledGrammar | None:
        """Non-blocking poll: the grammar when ready, None while compiling; raises
        InvalidGrammarError if it can't compile, GrammarTimeoutError once it has been compiling
        longer than `timeout_s`."""
        future = self.submit(so)
        if future.done():
            return future.result()
        if time.monotonic() - self._submitted_at.get(so.key, time.monotonic()) > self.timeout_s:
            raise GrammarTimeoutError(f"{_KIND_NAMES[so.kind]} did not compile within "
                                      f"{self.timeout_s:g} s")
        return None

    def get(self, so: StructuredOutputs, timeout_s: float | None = None) -> CompiledGrammar:
        """Block until compiled (at most `timeout_s`, default the compiler's)."""
        future = self.submit(so)
        waited = self.timeout_s if timeout_s is None else timeout_s
        try:
            return future.result(timeout=waited)
        except FutureTimeout:
            raise GrammarTimeoutError(f"{_KIND_NAMES[so.kind]} did not compile within "
                                      f"{waited:g} s") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- internals -----------------------------------------------------------------------------
    def _evict(self) -> None:
        """Drop least-recently-used finished entries past `cache_size` (compiling ones stay:
        they are bounded by the requests waiting for them)."""
        excess = len(self._cache) - self.cache_size
        for key in [k for k, f in self._cache.items() if f.done()][:max(excess, 0)]:
            del self._cache[key]
            self._submitted_at.pop(key, None)

    def _grammar_text(self, so: StructuredOutputs) -> str:
        if so.json is not None:
            return llg.LLMatcher.grammar_from_json_schema(so.json, defaults=self._json_options)
        if so.json_object:
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                          defaults=self._json_options)
        if so.regex is not None:
            return llg.LLMatcher.grammar_from_regex(so.regex)
        if so.choice is not None:
            return llg.grammar_from("choice", list(so.choice))
        return llg.grammar_from("grammar", so.grammar)  # Lark, or GBNF converted to Lark

    def _compile(self, so: StructuredOutputs) -> CompiledGrammar:
        name = _KIND_NAMES[so.kind]
        try:
            grammar = self._grammar_text(so)
        except (ValueError, TypeError) as e:
            raise InvalidGrammarError(f"invalid {name}: {e}") from None
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(
            grammar, self.ll_tokenizer, limits=self._limits)
        if is_error:
            raise InvalidGrammarError(f"invalid {name}: {messages[0].strip()}")
        template = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=self._limits)
        if template.is_error():
            raise InvalidGrammarError(f"invalid {name}: {template.get_error()}")
        return CompiledGrammar(key=so.key, kind=so.kind, grammar=grammar,
                               tokenizer=self.ll_tokenizer, vocab_size=self.vocab_size,
                               tokenizer_vocab_size=self.tokenizer_vocab_size, template=template)

