"""Greedy tokens and step timings of the jaxserve checkout it runs in, as JSON on stdout.

scripts/ab_commits.py runs this file inside two checkouts (cwd and PYTHONPATH set to each), so
it must use only the public API both have: LLM, EngineConfig settings, SamplingParams,
LoadedModel, random_params, the bench workloads. It measures; it never compares.

  python scripts/engine_probe.py tokens   # greedy/seeded tokens: default model + tiny models
  python scripts/engine_probe.py bench    # decode step ms at batch 1 and 16, anyscale16/64 tok/s

Step times are reported as the median and the minimum over the timed steps: on a shared machine
the minimum is the least disturbed. The 16-request decode is also timed with every logits
processor and top-5 logprobs on, where the checkout has them (else that figure is absent).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

import jaxserve
from jaxserve import LLM, SamplingParams  # (the package's own names: every commit has them)
from jaxserve.model.config import ModelConfig
try:  # model/ grouped by job; the flat layout before (the A/B's base may have either)
    from jaxserve.model.decoder.decoder import random_params
    from jaxserve.model.loaders.loader import load_model
    from jaxserve.model.loaders.weights import LoadedModel
except ImportError:
    from jaxserve.model.llama import random_params
    from jaxserve.model.loader import load_model
    from jaxserve.model.weights import LoadedModel

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
            tie_word_embeddings=False, max_position_embeddings=512, bos_token_id=1,
            eos_token_ids=(2,), name="tiny")
# (name, model overrides, engine settings, sampling overrides)
TINY_CASES = [
    ("chunked16", {}, dict(max_num_batched_tokens=16), {}),
    ("scan", {}, dict(layer_loop="scan", max_num_batched_tokens=16), {}),
    ("qkv-bias", dict(attention_bias=True, architecture="qwen2"), {}, {}),
    ("preempt-recompute", {}, dict(num_pages=24, page_size=4, max_num_seqs=4,
                                   max_num_batched_tokens=16), {}),
    ("preempt-swap", {}, dict(num_pages=24, page_size=4, max_num_seqs=4,
                              max_num_batched_tokens=16, preemption_mode="swap"), {}),
    ("static", {}, dict(batching="static", max_num_seqs=2), {}),
    ("seeded-t0.8", {}, {}, dict(temperature=0.8, top_p=0.9, seed=7)),
    ("ngram-k3", {}, dict(speculative_method="ngram", num_speculative_tokens=3), {}),
    ("draft-layers1-k2", dict(num_layers=3), dict(
        speculative_method="draft", speculative_draft="layers:1", num_speculative_tokens=2), {}),
]


def tiny_prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 23, 40, 9)]
    prompts.append([7, 8, 9, 10] * 6)  # repetitive: n-gram drafts find matches
    return prompts


def tokens() -> dict:
    default = load_model("default", progress=False)
    llm = LLM("default", loaded=default, progress=False, max_model_len=512)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
               "List three colors:"]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    out = {"default": [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]}
    preemptions = {}
    del llm
    for name, model, engine, sampling in TINY_CASES:
        config = ModelConfig(**{**TINY, **model})
        loaded = LoadedModel(config, random_params(config, seed=1, scale=0.08),
                             default.tokenizer, "random")
        llm = LLM("tiny", loaded=loaded, progress=False, max_model_len=128, **engine)
        params = SamplingParams(**{"max_tokens": 20, "temperature": 0.0, "ignore_eos": True,
                                   **sampling})
        outs = llm.generate(tiny_prompts(), params, use_tqdm=False)
        if any(o.error or len(o.token_ids) != params.max_tokens for o in outs):
            raise RuntimeError(f"{name}: a request failed or ended early: {outs}")
        out[name] = [o.token_ids for o in outs]
        preemptions[name] = llm.engine.scheduler.num_preemptions
        del llm
    return {"tokens": out, "preemptions": preemptions}


def _decode_steps(engine, prompts, params) -> list[float]:
    """Seconds of each step once every request is past its prefill."""
    waiting = {engine.add_request(prompt, sp) for prompt, sp in zip(prompts, params)}
    while waiting:  # prefill: until every request has its first token
        waiting -= {o.request_id for o in engine.step() if o.new_token_ids}
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[:-1]  # the last step may run fewer requests


def _ms(name: str, times: list[float]) -> dict:
    return {f"{name}_step_ms_median": 1000 * statistics.median(times),
            f"{name}_step_ms_min": 1000 * min(times)}


def bench() -> dict:
    from jaxserve.bench.workloads import anyscale_workload

    default = load_model("default", progress=False)
    llm = LLM("default", loaded=default, progress=False, max_model_len=1024, max_num_seqs=16)
    engine = llm.engine
    greedy = dict(temperature=0.0, ignore_eos=True)
    result = _ms("decode1", _decode_steps(engine, [list(range(100, 164))],
                                          [SamplingParams(max_tokens=97, **greedy)]))
    prompts = [list(range(100 + i, 164 + i)) for i in range(16)]
    result.update(_ms("decode16", _decode_steps(
        engine, prompts, [SamplingParams(max_tokens=49, **greedy)] * 16)))
    try:
        featured = SamplingParams(max_tokens=49, logprobs=5, presence_penalty=0.5,
                                  frequency_penalty=0.5, repetition_penalty=1.2,
                                  logit_bias={100: 2.0}, min_tokens=4, bad_words=["foo bar"],
                                  allowed_token_ids=list(range(50, 40000)), **greedy)
    except TypeError:  # a checkout without logits processors
        featured = None
    if featured is not None:
        result.update(_ms("decode16_all_features", _decode_steps(engine, prompts,
                                                                 [featured] * 16)))
    # 16 and 64 concurrent: the anyscale workload, all added at t=0 (64: through an engine
    # that runs 64 at once).
    result.update(_anyscale(engine, 16))
    del llm, engine
    llm64 = LLM("default", loaded=default, progress=False, max_model_len=1024,
                max_num_seqs=64)
    result.update(_anyscale(llm64.engine, 64))
    return result


def _anyscale(engine, n: int) -> dict:
    from jaxserve.bench.workloads import anyscale_workload

    requests = anyscale_workload(n, engine.model_config.vocab_size, seed=0)
    start = time.perf_counter()
    for r in requests:
        engine.add_request(r.prompt_token_ids, SamplingParams(
            max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
    num_tokens = 0
    while engine.has_unfinished():
        num_tokens += sum(len(o.new_token_ids) for o in engine.step())
    wall = time.perf_counter() - start
    return {f"anyscale{n}_output_tok_s": num_tokens / wall, f"anyscale{n}_wall_s": wall}


if __name__ == "__main__":
    result = {"tokens": tokens, "bench": bench}[sys.argv[1]]()
    result["jaxserve_path"] = jaxserve.__file__
    print(json.dumps(result))
