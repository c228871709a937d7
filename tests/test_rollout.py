"""The rollout API on the offline LLM: weights updated in place (every layout, checked, no
compilation, same device bytes), sleep / wake_up (device bytes counted with jax.live_arrays),
pause / resume in each mode, and the weight version on every output.

One engine (tiny model, seed 0) is shared; each test leaves it awake, resumed, idle and
holding the seed-0 weights.
"""

from __future__ import annotations

import gc

import jax
import numpy as np
import pytest

from conftest import make_llm
from jaxserve import SamplingParams
from jaxserve.runner.compile_count import CompileCounter
from jaxserve.runner.rollout_memory import device_bytes
from tiny_models import hf_state_dict, tiny_loaded

PROMPTS = [[5, 9, 13, 17, 21], [40, 41, 42], list(range(30, 70))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def greedy(llm, prompts=PROMPTS):
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def live_bytes() -> int:
    gc.collect()
    return device_bytes()


@pytest.fixture(scope="module")
def llm():
    engine = make_llm(seed=0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def want(llm):
    """Greedy tokens of the seed-0 and seed-1 weights, each from an engine loaded with them."""
    other = make_llm(seed=1)
    try:
        return {0: greedy(llm), 1: greedy(other)}
    finally:
        other.close()


@pytest.fixture(autouse=True)
def restore(llm):
    yield
    if llm.is_paused:
        llm.pause_generation("abort")
        llm.resume_generation()
    if llm.is_sleeping:
        llm.wake_up()
        if llm.is_sleeping:
            llm.update_weights(tiny_loaded(0).params)
    llm.update_weights(tiny_loaded(0).params)


@pytest.mark.parametrize("layout", ["params", "nested", "hf", "state", "device"])
def test_update_weights_gives_a_fresh_engines_tokens_without_compiling(llm, want, layout):
    before = live_bytes()
    params = tiny_loaded(1).params
    if layout == "nested":
        params = {"embed": params["embed"], "final_norm": params["final_norm"],
                  "lm_head": params["lm_head"],
                  "layers": {k[len("layers."):]: v for k, v in params.items()
                             if k.startswith("layers.")}}
    elif layout == "hf":
        params = hf_state_dict(tiny_loaded(1).config, params)
    elif layout == "device":
        params = jax.tree.map(jax.numpy.asarray, params)
    version = llm.weight_version
    with CompileCounter() as compiles:
        if layout == "state":  # the engine's own pytree, as a trainer gets and returns it
            state = llm.get_weights()
            llm.update_weights(tiny_loaded(1).params)
            state = llm.get_weights()
            llm.update_weights(tiny_loaded(0).params)
            llm.update_weights(state)
            del state
        else:
            llm.update_weights(params)
        del params
        got = greedy(llm)
    assert compiles.count == 0, f"update_weights + generate compiled {compiles.count} times"
    assert got == want[1], "greedy tokens differ from an engine loaded with the new weights"
    assert live_bytes() == before, "device bytes changed across the update"
    assert llm.weight_version > version
    assert got != want[0]


def test_outputs_carry_the_weight_version_that_sampled_them(llm):
    first = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
    version = llm.update_weights(tiny_loaded(0).params)
    second = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
    assert second.weight_version == version == first.weight_version + 1
    assert second.token_ids == first.token_ids  # same weights, prefix cache flushed


def test_a_bad_update_names_the_parameter_and_changes_nothing(llm, want):
    params = dict(tiny_loaded(1).params)
    params["layers.wq"] = params["layers.wq"][:, :, :8]
    with pytest.raises(ValueError, match="layers.wq"):
        llm.update_weights(params)
    del params["layers.wq"]
    with pytest.raises(ValueError, match="missing.*layers.wq"):
        llm.update_weights(params)
    wrong = jax.numpy.asarray(tiny_loaded(1).params["embed"], jax.numpy.bfloat16)
    with pytest.raises(ValueError, match="embed.*bfloat16"):
        llm.update_weights({**tiny_loaded(1).params, "embed": wrong})
    assert greedy(llm) == want[0]


def test_sleep_frees_kv_then_weights_and_wake_up_restores_the_same_tokens(llm, want):
    runner = llm.engine.runner
    kv_bytes = sum(a.nbytes for a in runner.kv)
    weight_bytes = sum(a.nbytes for a in runner.step.leaves)
    greedy(llm)
    assert llm.engine.pages.stats().num_cached > 0  # the prefix cache holds pages now
    kv_arrays = list(runner.kv)  # this engine's pages (other tests' engines may share shapes)
    awake = live_bytes()
    with CompileCounter() as compiles:
        llm.sleep(level=1)
        assert llm.is_sleeping
        asleep = live_bytes()
        assert all(a.is_deleted() for a in kv_arrays), "a KV page array is still live"
        assert awake - asleep >= kv_bytes + weight_bytes - 4096  # (RoPE frequencies stay)
        assert llm.engine.pages.stats().num_cached == 0, "the prefix cache was not flushed"
        llm.wake_up()
        assert not llm.is_sleeping
        assert live_bytes() == awake
        assert greedy(llm) == want[0], "tokens after wake_up differ from before sleeping"
        llm.sleep(level=2)
        assert awake - live_bytes() >= kv_bytes + weight_bytes - 4096
        llm.wake_up()
        assert llm.is_sleeping, "level 2 discarded the weights: still asleep until updated"
        with pytest.raises(RuntimeError, match="asleep"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.update_weights(tiny_loaded(0).params)
        assert not llm.is_sleeping
        assert greedy(llm) == want[0]
    assert compiles.count == 0, f"the sleep / wake cycle compiled {compiles.count} times"


def test_update_weights_while_asleep_at_level_2_then_wake_kv_only(llm, want):
    llm.sleep(level=2)
    llm.update_weights(tiny_loaded(1).params)
    assert llm.is_sleeping  # the KV pool is still freed
    llm.wake_up(tags=["kv_cache"])
    assert greedy(llm) == want[1]
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(tags=["everything"])
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)


def _start(llm, prompts, params):
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    outputs = {}
    for _ in range(3):  # a few steps: the requests are mid-generation
        for out in engine.step():
            outputs[out.request_id] = out
    return ids, outputs


def _finish(llm, outputs):
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            outputs[out.request_id] = out
    return outputs


def test_pause_keep_then_resume_gives_an_uninterrupted_runs_tokens(llm, want):
    ids, outputs = _start(llm, PROMPTS, GREEDY)
    llm.pause_generation("keep")
    assert llm.is_paused and not llm.engine.has_unfinished()
    assert llm.engine.step() == []  # paused: nothing runs
    with pytest.raises(RuntimeError, match="paused"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.resume_generation()
    outputs = _finish(llm, outputs)
    assert [outputs[i].token_ids for i in ids] == want[0]


def test_pause_keep_sleep_wake_resume_recomputes_the_kept_requests(llm, want):
    ids, outputs = _start(llm, PROMPTS, GREEDY)
    llm.pause_generation("keep")
    llm.sleep(level=1)
    llm.wake_up()
    llm.resume_generation()
    outputs = _finish(llm, outputs)
    assert [outputs[i].token_ids for i in ids] == want[0]


def test_pause_abort_returns_every_partial_output(llm):
    ids, _ = _start(llm, PROMPTS, GREEDY)
    outs = {o.request_id: o for o in llm.pause_generation("abort")}
    assert set(ids) <= set(outs), "a request was lost"
    for rid in ids:
        assert outs[rid].finished and outs[rid].finish_reason == "abort"
        assert 0 < len(outs[rid].token_ids) < GREEDY.max_tokens
    llm.resume_generation()
    assert not llm.engine.has_unfinished()


def test_pause_wait_finishes_the_requests_and_holds_new_ones(llm, want):
    ids, outputs = _start(llm, PROMPTS, GREEDY)
    for out in llm.pause_generation("wait"):
        outputs[out.request_id] = out
    assert [outputs[i].token_ids for i in ids] == want[0]
    late = llm.engine.add_request(PROMPTS[0], GREEDY)
    assert llm.engine.step() == [] and not llm.engine.has_unfinished()
    llm.resume_generation()
    assert _finish(llm, {})[late].token_ids == want[0][0]


def test_sleep_and_update_are_refused_while_requests_run(llm):
    ids, _ = _start(llm, PROMPTS, GREEDY)
    with pytest.raises(RuntimeError, match="pause_generation"):
        llm.sleep()
    with pytest.raises(RuntimeError, match="pause_generation"):
        llm.update_weights(tiny_loaded(0).params)
    with pytest.raises(ValueError, match="mode"):
        llm.pause_generation("later")
    _finish(llm, {})


def test_update_weights_from_disk_reads_a_safetensors_directory(llm, want, tmp_path):
    from jaxserve.model.loaders.safetensors_loader import save_hf_directory
    from model_fixtures import tiny_tokenizer

    loaded = tiny_loaded(1)
    save_hf_directory(tmp_path / "m", loaded.config, loaded.params, tiny_tokenizer())
    llm.update_weights_from_disk(str(tmp_path / "m"))
    assert greedy(llm) == want[1]
    with pytest.raises(FileNotFoundError):
        llm.update_weights_from_disk(str(tmp_path / "nothing"))
