"""Constrained decoding end to end without the engine: random logits, masked on the device side
by apply_bitmask with the bitmasks fill_batch packs on the host, argmax, accept. Whatever the
logits, every output must parse and validate (JSON schemas with jsonschema, regexes with
re.fullmatch, choices by membership, the Lark grammar by a small parser) and end with EOS; an
output still running at the step cap fails loudly."""

from __future__ import annotations

import json
import re
import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from structured_fixtures import compiler, tokenizer  # noqa: F401  (fixtures)

from jaxserve.bench.structured_schemas import ARITHMETIC_LARK, CHOICES, JSON_SCHEMAS, REGEXES
from jaxserve.runner.grammar_mask import apply_bitmask
from jaxserve.structured.matcher import fill_batch
from jaxserve.structured.params import StructuredOutputs

MAX_STEPS = 300
ROWS = 16  # one batch shape for every test: one compile of the masked argmax


POOL = 97  # random logit rows drawn once; step t, row i reads row (31 t + 7 i) % POOL


@jax.jit
def _masked_argmax(pool, step, bitmask, has_mask, bias):
    rows = (31 * step + 7 * jnp.arange(bitmask.shape[0])) % pool.shape[0]
    logits = pool[rows] + bias                                       # [ROWS, V]
    return jnp.argmax(apply_bitmask(logits, bitmask, has_mask), axis=-1)


def closing_bias(tokenizer, vocab_size, strength=2.0):
    """f32 [vocab_size]: a bonus for tokens made of JSON closers and digits, so that free-form
    strings and objects (json_object has no maxLength) end in a few dozen tokens."""
    bias = np.zeros(vocab_size, dtype=np.float32)
    for i in range(tokenizer.vocab_size):
        text = tokenizer.decode([i], skip_special_tokens=False)
        if text and set(text) <= set('"}],:0123456789'):
            bias[i] = strength
    return bias


def constrained_decode(compiler, tokenizer, constraints, seed=0, bias=None):
    """Greedy decoding of random logits (plus `bias`) under each constraint, all rows in one
    batch per step; returns each row's text (without the EOS)."""
    bias = np.zeros(compiler.vocab_size, np.float32) if bias is None else bias
    matchers = [compiler.get(so).new_matcher() for so in constraints]
    outputs = [[] for _ in constraints]
    assert len(matchers) <= ROWS
    bitmask = np.zeros((ROWS, matchers[0].num_words), dtype=np.int32)
    pool = jax.random.normal(jax.random.PRNGKey(seed), (POOL, compiler.vocab_size), jnp.float32)
    for step in range(MAX_STEPS):
        live = [None if m.is_terminated() else m for m in matchers]
        if not any(live):
            break
        has_mask = fill_batch(live, bitmask)
        tokens = np.asarray(_masked_argmax(pool, step, bitmask, has_mask, bias))
        for i, m in enumerate(live):
            if m is not None:
                assert m.accept([int(tokens[i])]), f"row {i}: the mask allowed a refused token"
                outputs[i].append(int(tokens[i]))
    unfinished = [i for i, m in enumerate(matchers) if not m.is_terminated()]
    assert not unfinished, (f"rows {unfinished} still running after {MAX_STEPS} steps: "
                            f"{[tokenizer.decode(outputs[i])[:200] for i in unfinished]}")
    eos = set(tokenizer.eos_token_ids)
    assert all(out[-1] in eos for out in outputs)
    return [tokenizer.decode(out[:-1], skip_special_tokens=False) for out in outputs]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_json_schema_outputs_parse_and_validate(compiler, tokenizer, seed):
    names = sorted(JSON_SCHEMAS)
    texts = constrained_decode(compiler, tokenizer,
                               [StructuredOutputs(json=JSON_SCHEMAS[n]) for n in names], seed)
    for name, text in zip(names, texts):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            pytest.fail(f"{name}: output is not JSON ({e}): {text!r}")
        try:
            jsonschema.validate(value, JSON_SCHEMAS[name])
        except jsonschema.ValidationError as e:
            pytest.fail(f"{name}: output breaks its schema ({e.message}): {text!r}")


def test_json_object_outputs_are_objects(compiler, tokenizer):
    texts = constrained_decode(compiler, tokenizer, [StructuredOutputs(json_object=True)] * 4,
                               bias=closing_bias(tokenizer, compiler.vocab_size))
    for text in texts:
        assert isinstance(json.loads(text), dict), text


def test_regex_outputs_match(compiler, tokenizer):
    names = sorted(REGEXES)
    texts = constrained_decode(compiler, tokenizer,
                               [StructuredOutputs(regex=REGEXES[n]) for n in names] * 2)
    for name, text in zip(names * 2, texts):
        assert re.fullmatch(REGEXES[name], text), f"{name}: {text!r} does not match"


def test_choice_outputs_are_one_of_the_choices(compiler, tokenizer):
    names = sorted(CHOICES)
    texts = constrained_decode(compiler, tokenizer,
                               [StructuredOutputs(choice=CHOICES[n]) for n in names] * 3)
    for name, text in zip(names * 3, texts):
        assert text in CHOICES[name], f"{name}: {text!r}"


def _parse_arithmetic(text: str) -> None:
    """Recursive descent over ARITHMETIC_LARK's language; raises ValueError if text is not in
    it."""
    tokens, pos = re.findall(r"[0-9]+|[-+*/()]|\S", text.replace(" ", "")), 0

    def expect_factor():
        nonlocal pos
        if pos < len(tokens) and tokens[pos] == "(":
            pos += 1
            expect_expr()
            if pos >= len(tokens) or tokens[pos] != ")":
                raise ValueError("unclosed (")
            pos += 1
        elif pos < len(tokens) and re.fullmatch("[0-9]{1,3}", tokens[pos]):
            pos += 1
        else:
            raise ValueError(f"expected a number or ( at token {pos}")

    def expect_chain(inner, ops):
        nonlocal pos
        inner()
        while pos < len(tokens) and tokens[pos] in ops:
            pos += 1
            inner()

    def expect_expr():
        expect_chain(lambda: expect_chain(expect_factor, "*/"), "+-")

    expect_expr()
    if pos != len(tokens):
        raise ValueError(f"trailing {tokens[pos:]}")


def test_lark_grammar_outputs_parse(compiler, tokenizer):
    texts = constrained_decode(compiler, tokenizer,
                               [StructuredOutputs(grammar=ARITHMETIC_LARK)] * 4)
    for text in texts:
        try:
            _parse_arithmetic(text)
        except ValueError as e:
            pytest.fail(f"{text!r} is not in the grammar: {e}")
