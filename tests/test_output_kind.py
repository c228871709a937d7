"""SamplingParams.output_kind: "cumulative" outputs every step, "final_only" one output at the
end whose deltas hold everything (what LLM.generate asks for); the metrics count both alike."""

import pytest

from jaxserve.engine.metrics import PREFIX, EngineMetrics
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.core.request import FinishReason, Request, SamplingParams, TokenEvent
from tiny_models import CharTokenizer


def _processor(kinds):
    outputs = OutputProcessor(CharTokenizer())
    for i, kind in enumerate(kinds):
        outputs.add([Request(f"r{i}", [70, 71], SamplingParams(logprobs=0, output_kind=kind),
                             0)])
    return outputs


def _step(outputs, tokens, last=False):
    """Both requests take one token each ('a' + k)."""
    reason = FinishReason.LENGTH if last else None
    return outputs.process([TokenEvent(f"r{i}", (t,), (-0.5,), reason) for i, t in
                            enumerate(tokens)], lambda *_: None)


def test_final_only_hands_out_one_output_holding_every_delta():
    outputs = _processor(["cumulative", "final_only"])
    steps = [_step(outputs, (100, 100)), _step(outputs, (101, 101)),
             _step(outputs, (102, 102), last=True)]
    assert [[o.request_id for o in step] for step in steps] == [["r0"], ["r0"], ["r0", "r1"]]
    every = [step[0].outputs[0] for step in steps]
    assert [c.new_token_ids for c in every] == [[100], [101], [102]]
    assert [c.new_text for c in every] == ["a", "b", "c"]
    final = steps[2][1]
    c = final.outputs[0]
    assert final.finished and c.finish_reason == "length"
    assert c.token_ids == c.new_token_ids == [100, 101, 102]
    assert c.text == c.new_text == "abc" and c.new_logprobs == [-0.5] * 3
    assert final.time_to_first_token is not None
    # the cumulative request's final output is the same text, its deltas its last step's
    assert steps[2][0].outputs[0].text == "abc" and steps[2][0].outputs[0].new_text == "c"


def _sample(metric, name: str) -> float:
    return next(s.value for family in metric.collect() for s in family.samples
                if s.name == PREFIX + name)


def test_metrics_count_a_final_only_request_as_a_streamed_one():
    counts = {}
    for kind in ("cumulative", "final_only"):
        metrics, outputs = EngineMetrics(lambda: None), _processor([kind, kind])
        for k in range(3):
            metrics.observe_outputs(_step(outputs, (100 + k, 100 + k), last=k == 2))
        counts[kind] = (_sample(metrics.generation_tokens, "generation_tokens_total"),
                        _sample(metrics.prompt_tokens, "prompt_tokens_total"),
                        _sample(metrics.ttft, "time_to_first_token_seconds_count"),
                        _sample(metrics.finished, "requests_finished_total"))
    assert counts["final_only"] == counts["cumulative"] == (6.0, 4.0, 2.0, 2.0)


def test_an_abort_ends_a_final_only_request_with_its_output():
    outputs = _processor(["final_only"])
    assert outputs.process([TokenEvent("r0", (100,), (-0.5,), None)], lambda *_: None) == []
    out, = outputs.process([TokenEvent("r0", (), (), FinishReason.ABORT)], lambda *_: None)
    assert out.finished and out.outputs[0].new_token_ids == [100]
    assert out.outputs[0].finish_reason == "abort"


def test_an_unknown_output_kind_names_the_field():
    with pytest.raises(ValueError, match="output_kind='delta'.*cumulative.*final_only"):
        SamplingParams(output_kind="delta")


def test_generate_asks_for_final_outputs_and_matches_a_stepped_engine(small_llm):
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
    got = small_llm.generate(["hello", "abc"], params, use_tqdm=False)
    assert params.output_kind == "cumulative"  # the caller's params are left as they were
    engine = small_llm.engine
    ids = [engine.add_request(engine.tokenizer.encode(p), params) for p in ("hello", "abc")]
    last = {}
    while engine.has_unfinished():
        for out in engine.step():
            last[out.request_id] = out
    for out, rid in zip(got, ids):
        assert out.finished and out.token_ids == last[rid].token_ids
        assert out.outputs[0].new_token_ids == out.token_ids  # every delta in the one output
        assert out.text == last[rid].text and out.outputs[0].new_text == out.text


def test_generate_with_samples_and_a_stop_string_hands_each_sample_whole(small_llm):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=2, stop=("e",))
    out, = small_llm.generate(["hello"], params, use_tqdm=False)
    engine = small_llm.engine
    rid = engine.add_request(engine.tokenizer.encode("hello"), params)
    last = None
    while engine.has_unfinished():
        for o in engine.step():
            last = o if o.request_id == rid else last
    assert out.finished and len(out.outputs) == 2
    for got, want in zip(out.outputs, last.outputs):
        assert got.token_ids == want.token_ids and got.new_token_ids == got.token_ids
        assert got.text == want.text == got.new_text and got.finish_reason == want.finish_reason


def test_a_hand_out_takes_exactly_the_deltas_since_the_one_before():
    """CompletionOutput.hand_out after no, one and several appends: no, one and every step's
    deltas; a snapshot handed out keeps its own, whatever the record takes later."""
    from jaxserve.engine.outputs import CompletionOutput

    record = CompletionOutput(0, logprobs=[])
    record.append([5], "a", [-1.0], [])
    first = record.hand_out()
    empty = record.hand_out()
    record.append([6], "b", [-2.0], [])
    record.append([7, 8], "cd", [-3.0, -4.0], [])
    both = record.hand_out()
    record.append_one(9, "e", -5.0)
    last = record.hand_out()
    assert (first.new_token_ids, first.new_text, first.new_logprobs) == ([5], "a", [-1.0])
    assert (empty.new_token_ids, empty.new_text, empty.new_logprobs) == ([], "", [])
    assert empty.new_token_ids is not first.new_token_ids
    assert (both.new_token_ids, both.new_text, both.new_logprobs) == (
        [6, 7, 8], "bcd", [-2.0, -3.0, -4.0])
    assert (last.new_token_ids, last.new_text, last.new_logprobs) == ([9], "e", [-5.0])
    record.append_one(10, "f", -1.0)
    after = record.hand_out()
    assert after.new_top_logprobs == [] and after.new_top_logprobs is not last.new_top_logprobs
    assert after.new_token_ids == [10] and last.new_token_ids == [9]
    assert after.new_token_ids is after.new_token_ids  # made once, on the first read
    assert [s.num_new_tokens for s in (first, empty, both, last, record.hand_out())] == [
        1, 0, 3, 1, 0]
    assert (first.token_ids, empty.token_ids, both.token_ids, last.token_ids) == (
        [5], [5], [5, 6, 7, 8], [5, 6, 7, 8, 9])
    assert (first.text, both.text, last.text) == ("a", "abcd", "abcde")
    assert last.cumulative_logprob == -15.0
