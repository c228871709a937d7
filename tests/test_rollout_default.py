"""update_weights on the default model (SmolLM2-135M-Instruct): after an update to perturbed
weights, greedy tokens equal those of a fresh engine loaded with the same perturbed weights,
with no compilation and the device's bytes unchanged.

The perturbation adds a seeded 2% of each matrix's own spread to every float matrix, enough to
change the greedy continuation (checked, so the comparison can fail)."""

from __future__ import annotations

import dataclasses
import gc

import numpy as np

from jaxserve import SamplingParams
from jaxserve.runner.compile_count import CompileCounter
from jaxserve.runner.rollout_memory import device_bytes
from model_fixtures import real_default_model

# the engine settings of tests/test_default_generation.py: its compiled steps are reused
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=64, token_buckets=(64,), layer_loop="scan")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def perturbed(params: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for name, value in params.items():
        value = np.asarray(value)
        if value.ndim >= 2 and np.issubdtype(value.dtype, np.floating):
            noise = rng.standard_normal(value.shape).astype(value.dtype)
            value = value + 0.02 * float(value.std()) * noise
        out[name] = value
    return out


def greedy(llm) -> list[list[int]]:
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def live_bytes() -> int:
    gc.collect()
    return device_bytes()


def test_update_weights_on_the_default_model_gives_a_fresh_engines_tokens():
    from jaxserve.entrypoints.llm import LLM

    loaded = real_default_model()
    new = perturbed(loaded.params)
    fresh = LLM(loaded=dataclasses.replace(loaded, params=new), progress=False, **ENGINE)
    want = greedy(fresh)
    fresh.close()
    del fresh

    llm = LLM(loaded=loaded, progress=False, **ENGINE)
    before_tokens = greedy(llm)
    assert before_tokens != want, "the perturbation changed nothing: the test could not fail"
    before = live_bytes()
    with CompileCounter() as compiles:
        llm.update_weights(new)
        got = greedy(llm)
    assert compiles.count == 0, f"update_weights + generate compiled {compiles.count} times"
    assert live_bytes() == before, "device bytes changed across the update"
    assert got == want, "greedy tokens differ from an engine loaded with the new weights"
    llm.close()
