"""GrammarCompiler with the default model's tokenizer: every constraint kind compiles, invalid
ones are errors naming the problem, compiles run off the caller's thread, are cached by key
(LRU, bounded) and time out instead of hanging."""

from __future__ import annotations

import threading

import pytest
from structured_fixtures import compiler, tokenizer  # noqa: F401  (fixtures)

from jaxserve.bench.structured_schemas import ARITHMETIC_LARK, CHOICES, JSON_SCHEMAS, REGEXES
from jaxserve.structured.compiler import GrammarCompiler, GrammarTimeoutError, InvalidGrammarError
from jaxserve.structured.matcher import CompiledGrammar
from jaxserve.structured.params import StructuredOutputs


@pytest.mark.parametrize("name", sorted(JSON_SCHEMAS))
def test_json_schema_compiles(compiler, name):
    compiled = compiler.get(StructuredOutputs(json=JSON_SCHEMAS[name]))
    assert isinstance(compiled, CompiledGrammar) and compiled.kind == "json"


@pytest.mark.parametrize("so", [
    StructuredOutputs(json_object=True),
    StructuredOutputs(regex=REGEXES["date"]),
    StructuredOutputs(choice=CHOICES["colour"]),
    StructuredOutputs(choice=['say "hi"', "back\\slash", "héllo"]),
    StructuredOutputs(grammar=ARITHMETIC_LARK),
    StructuredOutputs(grammar='root ::= "yes" | "no"'),  # GBNF is converted to Lark
], ids=["json_object", "regex", "choice", "choice_escapes", "lark", "gbnf"])
def test_other_kinds_compile(compiler, so):
    assert compiler.get(so).kind == so.kind


@pytest.mark.parametrize("so, message", [
    (StructuredOutputs(json={"type": "objekt"}), "invalid JSON schema: .*objekt"),
    (StructuredOutputs(json={"type": "integer", "minimum": 5, "maximum": 2}),
     "invalid JSON schema: .*minimum"),
    (StructuredOutputs(json={"type": "string", "pattern": "(("}),
     "invalid JSON schema: .*unclosed group"),
    (StructuredOutputs(regex="a(b"), "invalid regex: .*unclosed group"),
    (StructuredOutputs(grammar="start: undefined_rule"), "invalid grammar: .*undefined_rule"),
    (StructuredOutputs(grammar='start: "a'), "invalid grammar"),
], ids=["bad_type", "empty_range", "bad_pattern", "bad_regex", "unknown_rule", "unclosed"])
def test_invalid_constraint_is_a_value_error_naming_the_problem(compiler, so, message):
    with pytest.raises(InvalidGrammarError, match="(?s)" + message) as info:
        compiler.get(so)
    assert isinstance(info.value, ValueError), "INVALID_ARGUMENT maps from ValueError"


def test_invalid_constraint_error_is_raised_by_check_too(compiler):
    so = StructuredOutputs(regex="[z-a]")
    compiler.submit(so).exception(timeout=30)
    with pytest.raises(InvalidGrammarError, match="invalid regex"):
        compiler.check(so)


def test_equal_constraints_share_one_compile(tokenizer):
    c = GrammarCompiler(tokenizer)
    try:
        a = c.get(StructuredOutputs(json={"type": "object", "required": ["x"]}))
        b = c.get(StructuredOutputs(json='{"required": ["x"], "type": "object"}'))
        assert a is b and c.num_compiles == 1
    finally:
        c.close()


def test_cache_is_bounded_and_evicts_least_recently_used(tokenizer):
    c = GrammarCompiler(tokenizer, cache_size=2)
    try:
        so = [StructuredOutputs(regex=f"a{{{i}}}") for i in range(1, 4)]
        first = c.get(so[0])
        c.get(so[1])
        assert c.get(so[0]) is first, "a hit refreshes the entry"
        c.get(so[2])  # evicts so[1], the least recently used
        assert c.num_compiles == 3
        assert c.get(so[0]) is first and c.num_compiles == 3
        c.get(so[1])
        assert c.num_compiles == 4, "the evicted entry compiles again"
    finally:
        c.close()


def _blocked_compiler(tokenizer, timeout_s):
    """A one-thread compiler whose thread is held by a task until the returned event is set."""
    c = GrammarCompiler(tokenizer, max_threads=1, timeout_s=timeout_s)
    release = threading.Event()
    c._pool.submit(release.wait)
    return c, release


def test_compile_runs_off_the_callers_thread(tokenizer):
    c, release = _blocked_compiler(tokenizer, timeout_s=3600)
    try:
        so = StructuredOutputs(regex="[0-9]+")
        assert c.check(so) is None and not c.is_ready(so), "submit returned before compiling"
        release.set()
        assert c.get(so).kind == "regex"
        assert c.is_ready(so) and c.check(so) is not None
    finally:
        release.set()
        c.close()


def test_compile_past_the_timeout_is_an_error_not_a_hang(tokenizer):
    c, release = _blocked_compiler(tokenizer, timeout_s=0.0)
    try:
        so = StructuredOutputs(json={"type": "object"})
        c.submit(so)
        with pytest.raises(GrammarTimeoutError, match="did not compile within 0 s"):
            c.check(so)
        with pytest.raises(GrammarTimeoutError):
            c.get(so, timeout_s=0.0)
    finally:
        release.set()
        c.close()


def test_model_vocab_larger_than_the_tokenizers_is_kept(tokenizer):
    c = GrammarCompiler(tokenizer, vocab_size=tokenizer.vocab_size + 77)
    try:
        compiled = c.get(StructuredOutputs(regex="a"))
        assert compiled.vocab_size == tokenizer.vocab_size + 77
        assert compiled.tokenizer_vocab_size == tokenizer.vocab_size
    finally:
        c.close()
