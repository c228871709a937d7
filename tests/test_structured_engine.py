"""Structured output through the engine: grammars compiled off the engine thread, bitmasks built
at schedule time and applied inside the compiled step.

A tiny random Llama with a byte-level BPE vocabulary (tests/model_fixtures.py) checks the
mechanics: constrained outputs match their constraint in a busy batch with chunked prefill and
forced preemption (both modes) while their unconstrained neighbours are token-identical to a
run without them, speculation pauses and gives the same tokens, nothing compiles after warm-up,
bad grammars fail with their error. The real default model checks 50 requests over ten JSON
schemas, greedy and sampled, plus regex and choice (slow).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from jaxserve import SamplingParams
from jaxserve.bench.structured_schemas import CHOICES, JSON_SCHEMAS, PROMPTS, REGEXES
from jaxserve.runner.compile_count import CompileCounter
from jaxserve.structured.params import StructuredOutputs
from test_engine import assert_idle_and_no_leak, mixed_requests

TINY_ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=512, page_size=16,
                   token_buckets=(16,), seq_buckets=(8,))


def tiny_llm(**settings):
    from model_fixtures import random_model, tiny_tokenizer
    from tiny_models import TinyLoaded

    from jaxserve.entrypoints.llm import LLM

    config, params = random_model(seed=0)
    return LLM(loaded=TinyLoaded(config, params, tiny_tokenizer()), progress=False,
               **{**TINY_ENGINE, **settings})


def constrained():
    """(prompt ids, params, check) for bounded constraints a random model always completes."""
    cases = []
    for i, (name, pattern) in enumerate(REGEXES.items()):
        cases.append(([5 + i, 6, 7], StructuredOutputs(regex=pattern),
                      lambda text, p=pattern: re.fullmatch(p, text) is not None))
    for i, (name, options) in enumerate(CHOICES.items()):
        cases.append(([9, 10 + i], StructuredOutputs(choice=options),
                      lambda text, o=options: text in o))
    schema = {"type": "object", "properties": {"b": {"enum": ["x", "yy"]},
                                               "n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["b", "n"], "additionalProperties": False}
    cases.append(([11, 12], StructuredOutputs(json=schema),
                  lambda text: jsonschema.validate(json.loads(text), schema) is None))
    return cases


def run_constrained(llm, temperature: float, filler=None):
    cases = constrained()
    params = [SamplingParams(max_tokens=300, temperature=temperature, seed=7 + i,
                             structured_outputs=so) for i, (_, so, _) in enumerate(cases)]
    prompts = [p for p, _, _ in cases]
    if filler is not None:
        prompts, params = filler[0] + prompts, filler[1] + params
    outs = llm.generate(prompts, params, use_tqdm=False)
    tail = outs[len(outs) - len(cases):]
    for (_, so, check), out in zip(cases, tail):
        assert out.finish_reason == "stop", f"{so.kind}: {out.finish_reason} {out.error} {out.text!r}"
        assert check(out.text), f"{so.kind}: {out.text!r}"
    return outs


@pytest.fixture(scope="module")
def llm():
    return tiny_llm()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_outputs_match_their_constraint(llm, temperature):
    run_constrained(llm, temperature)
    assert_idle_and_no_leak(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_busy_preempted_batch_keeps_constraints_and_leaves_neighbours_untouched(mode):
    busy = tiny_llm(preemption_mode=mode, num_pages=24)
    filler = mixed_requests(n=10, seed=2, vocab=270, max_prompt=80, max_out=60)
    alone = [o.token_ids for o in busy.generate(*filler, use_tqdm=False)]
    with CompileCounter() as compiles:
        outs = run_constrained(busy, 0.8, filler)
    assert busy.engine.scheduler.num_preemptions > 0, "meant to force preemption"
    assert [o.token_ids for o in outs[:len(alone)]] == alone, "neighbours changed"
    assert compiles.count == 0, "serving compiled something after warm-up"
    assert_idle_and_no_leak(busy)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ngram_speculation_with_grammars_verifies_drafts_and_keeps_them_valid(llm, temperature):
    """The n-gram drafts are masked by the grammar row by row (a draft it refuses is never
    accepted); greedy, the tokens are those of an engine that does not speculate."""
    spec = tiny_llm(speculative_method="ngram", num_speculative_tokens=3,
                    speculative_disable_by_batch_size=8)
    stats = spec.engine.speculation.policy.stats
    outs = run_constrained(spec, temperature)  # every output matches its constraint
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, "nothing speculated"
    if temperature == 0.0:
        assert [o.token_ids for o in outs] == [o.token_ids for o in run_constrained(llm, 0.0)]
    assert_idle_and_no_leak(spec)


@pytest.mark.parametrize("so, problem", [
    (StructuredOutputs(json={"type": "objekt"}), "JSON schema"),
    (StructuredOutputs(regex="(unclosed"), "regex"),
    (StructuredOutputs(grammar="start: undefined_rule"), "grammar"),
])
def test_an_invalid_constraint_fails_its_request_with_the_problem(llm, so, problem):
    out = llm.generate([[5, 6]], SamplingParams(max_tokens=5, structured_outputs=so),
                       use_tqdm=False)[0]
    assert out.finish_reason == "error" and problem.lower() in out.error.lower(), out.error
    assert_idle_and_no_leak(llm)


def test_structured_outputs_with_ignore_eos_is_refused():
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a+"})


@pytest.mark.slow
def test_default_model_fifty_requests_over_ten_schemas_all_validate():
    from jaxserve.entrypoints.llm import LLM

    # scanned layers and two token buckets: a third of the unrolled default engine's compile
    llm = LLM("default", progress=False, max_model_len=1024, max_num_seqs=16,
              max_num_batched_tokens=128, token_buckets=(16, 128), seq_buckets=(16,),
              layer_loop="scan")
    tok = llm.tokenizer
    names = list(JSON_SCHEMAS)
    prompts, params, schemas = [], [], []
    for i in range(50):
        name = names[i % len(names)]
        text = tok.apply_chat_template([{"role": "user", "content": PROMPTS[name]}])
        prompts.append(tok.encode(text, add_special_tokens=False))
        params.append(SamplingParams(max_tokens=400, temperature=0.0 if i < 25 else 0.7,
                                     seed=i, structured_outputs={"json": JSON_SCHEMAS[name]}))
        schemas.append(JSON_SCHEMAS[name])
    for name, pattern in REGEXES.items():
        prompts.append(tok.encode(f"Write a {name}:", add_special_tokens=False))
        params.append(SamplingParams(max_tokens=60, temperature=0.0,
                                     structured_outputs={"regex": pattern}))
        schemas.append(("regex", pattern))
    for name, options in CHOICES.items():
        prompts.append(tok.encode(f"Pick a {name}:", add_special_tokens=False))
        params.append(SamplingParams(max_tokens=10, temperature=0.0,
                                     structured_outputs={"choice": options}))
        schemas.append(("choice", options))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, schema in zip(outs, schemas):
        assert out.finish_reason == "stop", f"ended with {out.finish_reason}: {out.text!r}"
        if isinstance(schema, dict):
            jsonschema.validate(json.loads(out.text), schema)
        elif schema[0] == "regex":
            assert re.fullmatch(schema[1], out.text), out.text
        else:
            assert out.text in schema[1], out.text


def test_async_engine_refuses_an_invalid_grammar_before_queueing_and_serves_a_valid_one():
    import asyncio

    from jaxserve.engine.async_engine import AsyncEngine

    llm = tiny_llm()
    engine = AsyncEngine(llm.engine)
    engine.start()

    async def scenario():
        bad = SamplingParams(max_tokens=5, structured_outputs={"regex": "(unclosed"})
        with pytest.raises(ValueError, match="regex"):
            async for _ in engine.generate([5, 6], bad):
                pass
        good = SamplingParams(max_tokens=20, temperature=0.0,
                              structured_outputs={"choice": ["the sun", "sky"]})
        async for out in engine.generate([5, 6], good):
            last = out
        return last

    try:
        out = asyncio.run(scenario())
    finally:
        engine.stop(timeout=10.0)
    assert out.finish_reason == "stop" and out.text in ("the sun", "sky")
    assert llm.engine.stats.num_waiting == 0


def test_n_samples_with_penalties_each_follow_their_own_grammar_state(llm):
    pattern = REGEXES["word_list"]
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=3, n=4, presence_penalty=0.8,
                            logit_bias={40: 2.0}, structured_outputs={"regex": pattern})
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), c.text
    assert len({c.text for c in out.outputs}) > 1, "each sample has its own seed"
    assert_idle_and_no_leak(llm)
