"""DeferredMatcher (SamplingParams.structured_outputs_after): nothing is masked or consumed until
the output holds the start sequence; the tokens after it, in the same call or later, are the
grammar's; speculative drafts that cross the sequence get masks only after it, and rolling
back to before it makes the grammar wait again. Over reasoning_fixtures' vocabulary, whose
</think> is one token, with a regex grammar "ab" (EOS after it)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from reasoning_fixtures import think_ids, think_tokenizer

from jaxserve.structured.compiler import GrammarCompiler
from jaxserve.structured.deferred import DeferredMatcher, request_matcher
from jaxserve.structured.matcher import GrammarMatcher, fill_batch, fill_draft_rows
from jaxserve.structured.params import StructuredOutputs

EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return think_tokenizer()


@pytest.fixture(scope="module")
def grammar(tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    constraint = StructuredOutputs(regex="ab")
    compiler.submit(constraint)
    deadline = time.monotonic() + 60
    while (compiled := compiler.check(constraint)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert compiled is not None, "the grammar did not compile"
    yield compiled
    compiler.close()


@pytest.fixture(scope="module")
def ids(tokenizer):
    one = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    _, end = think_ids(tokenizer)
    return dict(a=one("a")[0], b=one("b")[0], z=one("z")[0], end=end)


def allowed(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_without_a_start_sequence_the_grammar_is_the_plain_one(grammar):
    assert type(request_matcher(grammar)) is GrammarMatcher
    assert type(request_matcher(grammar, (5,))) is DeferredMatcher


def test_nothing_is_masked_or_consumed_before_the_sequence(grammar, ids):
    m = request_matcher(grammar, (ids["end"],))
    assert m.constraining() is None
    assert m.num_valid([ids["z"], ids["z"], EOS]) == 3
    assert m.accept([ids["z"], ids["b"]]), "free text before the sequence was refused"
    rows = np.empty((2, m.num_words), np.int32)
    has = fill_batch([m, None], rows)
    assert not has.any() and (rows == -1).all(), "a row was masked before the sequence"
    assert m.matcher.num_accepted == 0, "the grammar consumed tokens before the sequence"


def test_tokens_after_the_sequence_in_the_same_call_go_to_the_grammar(grammar, ids):
    m = request_matcher(grammar, (ids["end"],))
    assert not m.accept([ids["z"], ids["end"], ids["b"]]), "b cannot open the regex ab"
    assert m.constraining() is None, "a refused call changed the state"
    assert m.num_valid([ids["z"], ids["end"], ids["a"], ids["a"]]) == 3
    assert m.accept([ids["z"], ids["end"], ids["a"]])
    assert m.constraining() is m.matcher and m.matcher.num_accepted == 1
    row = np.empty(m.num_words, np.int32)
    m.fill_bitmask(row)
    assert allowed(row) == {ids["b"]}
    assert m.accept([ids["b"], EOS]) and m.is_terminated()


def test_a_sequence_of_several_tokens_may_be_split_across_calls(grammar, ids):
    m = request_matcher(grammar, (ids["z"], ids["end"]))
    assert m.accept([ids["end"], ids["z"]]) and m.constraining() is None
    assert m.accept([ids["end"]]) and m.constraining() is not None
    assert m.num_valid([ids["a"], ids["b"]]) == 2
    m2 = request_matcher(grammar, (ids["z"], ids["end"]))
    assert m2.accept([ids["z"], ids["z"], ids["a"]]) and m2.constraining() is None


def test_rolling_back_to_before_the_sequence_makes_the_grammar_wait_again(grammar, ids):
    m = request_matcher(grammar, (ids["end"],))
    assert m.accept([ids["z"], ids["end"], ids["a"]])
    m.rollback(1)
    assert m.constraining() is not None and m.matcher.num_accepted == 0
    m.rollback(1)
    assert m.constraining() is None
    assert m.accept([ids["b"], ids["end"], ids["a"], ids["b"]]), "the state did not unwind"
    with pytest.raises(ValueError):
        m.rollback(10)


def test_draft_rows_are_masked_only_after_the_sequence(grammar, ids):
    m = request_matcher(grammar, (ids["end"],))
    assert m.accept([ids["z"]])
    drafts = [ids["z"], ids["end"], ids["a"], ids["a"]]  # the second a breaks the regex
    rows = np.empty((len(drafts) + 2, m.num_words), np.int32)
    has = fill_draft_rows([(m, drafts, 0)], rows)
    # rows 0, 1: before and after the first z (no mask); 2: after </think>, the regex opens
    # (a only); 3: after a (b only); 4: past the refused a, and 5: unused
    assert has.tolist() == [False, False, True, True, False, False]
    assert allowed(rows[2]) == {ids["a"]} and allowed(rows[3]) == {ids["b"]}
    assert (rows[:2] == -1).all()
    assert m.constraining() is None and m.matcher.num_accepted == 0, "drafts left state behind"



def test_the_engine_masks_nothing_before_the_sequence_with_ngram_speculation():
    """Through an engine that verifies n-gram drafts (a random model's greedy replies repeat
    themselves, so drafts are accepted and cross the start sequence): a constrained reply is
    token for token the unconstrained one up to and including the sequence's first token, then
    JSON of the schema, finished by the grammar."""
    import json

    import jsonschema
    from conftest import SMALL_ENGINE
    from reasoning_fixtures import think_loaded

    from jaxserve import SamplingParams
    from jaxserve.entrypoints.llm import LLM

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    loaded = think_loaded()
    llm = LLM(loaded=loaded, progress=False, speculative_method="ngram",
              num_speculative_tokens=3, speculative_disable_by_batch_size=8,
              **{**SMALL_ENGINE, "max_num_seqs": 8, "seq_buckets": (8,)})
    prompts = [loaded.tokenizer.encode(text, add_special_tokens=False)
               for text in ("think, then answer", "a b a b a", "{\"n\": 1} or {\"n\": 2}")]
    free = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        use_tqdm=False)]
    starts = [ids[6] for ids in free]  # each reply's own 7th token starts its constraint
    stats = llm.engine.speculation.policy.stats
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    outs = llm.generate(prompts, [SamplingParams(
        temperature=0.0, max_tokens=200, structured_outputs=StructuredOutputs(json=schema),
        structured_outputs_after=(start,)) for start in starts], use_tqdm=False)
    for ids, start, out in zip(free, starts, outs):
        cut = ids.index(start) + 1
        got = out.outputs[0]
        assert got.token_ids[:cut] == ids[:cut], "a token before the start sequence was masked"
        assert got.finish_reason == "stop", got
        jsonschema.validate(json.loads(loaded.tokenizer.decode(got.token_ids[cut:])), schema)
    assert stats.num_draft_tokens > drafted and stats.num_accepted_tokens > accepted, (
        f"the constrained requests did not speculate: {stats}")
    assert not llm.engine.has_unfinished()
    llm.close()
