"""Multi-LoRA through the engine (one shared tiny Llama engine with three PEFT adapters, checked
against transformers + peft): the prefix cache never shares KV across adapters, adapters
rotating through fewer device slots change nothing compiled, adapters named at start
(lora_modules) serve by name, and bad adapters or requests are refused by name while the engine
keeps serving.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import lora_oracle  # noqa: E402

NUM_TOKENS = 8
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(16,), seq_buckets=(4,),
              max_model_len=96, page_size=4, num_pages=96, enable_lora=True, max_loras=2,
              max_cpu_loras=4, max_lora_rank=lora_oracle.MAX_LORA_RANK)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return lora_oracle.make_lora_case(tmp_path_factory.mktemp("lora_engine"), "llama")


@pytest.fixture(scope="module")
def llm(case):
    from jaxserve.entrypoints.llm import LLM

    return LLM(loaded=case.load(), progress=False,
               lora_modules=[f"a1={case.adapter_dirs['a1']}"], **ENGINE)


def generate(llm, prompts, names, case):
    from jaxserve import SamplingParams

    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False,
                        lora_request=[case.lora_request(n) for n in names])


def test_the_same_prompt_under_two_adapters_never_shares_kv(llm, case):
    prompt = case.batch[0]  # 30 tokens: 7 full pages of 4
    runs = [None, "a2", "a2", None, "a3"]
    outs = [generate(llm, [prompt], [name], case)[0] for name in runs]
    cached = [o.num_cached_tokens for o in outs]
    assert cached[1] == 0 and cached[4] == 0, f"an adapter read another's prefix KV: {cached}"
    assert cached[2] == 28 and cached[3] == 28, f"the same adapter missed its own: {cached}"
    for name, out in zip(runs, outs):
        assert out.token_ids == case.hf_greedy(name, prompt, NUM_TOKENS), (
            f"under {name}: got {out.token_ids}")


def test_adapters_rotating_through_fewer_slots_compile_nothing_and_stay_exact(llm, case):
    from jaxserve.runner.compile_count import CompileCounter

    slots = llm.engine.scheduler.lora_slots
    evictions = slots.num_evictions
    rounds = [("a1", "a2", None), ("a3", "a1"), ("a2", "a3", None), ("a1", None, "a3")]
    with CompileCounter() as compiles:
        for names in rounds:
            prompts = case.batch[1:1 + len(names)]
            outs = generate(llm, prompts, names, case)
            for name, prompt, out in zip(names, prompts, outs):
                assert out.token_ids == case.hf_greedy(name, prompt, NUM_TOKENS), (
                    f"under {name}: got {out.token_ids}")
    assert compiles.count == 0, f"{compiles.count} compilations while adapters changed"
    assert slots.num_evictions > evictions, "three adapters in two slots must evict"


def test_an_adapter_named_at_start_serves_by_name_and_id(llm, case):
    from jaxserve import LoRARequest, SamplingParams

    held = llm.engine.lora_registry.requests[0]
    assert (held.lora_name, held.lora_int_id) == ("a1", 1)
    out = llm.generate(case.batch[2], SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0,
                                                     ignore_eos=True),
                       use_tqdm=False, lora_request=LoRARequest("a1", 1))[0]
    assert out.token_ids == case.hf_greedy("a1", case.batch[2], NUM_TOKENS)


def test_a_bad_adapter_is_refused_by_name_and_the_engine_keeps_serving(llm, case, tmp_path):
    import json
    import shutil

    from jaxserve import LoRARequest, RequestError

    bad = tmp_path / "bad"
    shutil.copytree(case.adapter_dirs["a3"], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "r": 32}))
    with pytest.raises(RequestError, match="rank r=32 exceeds max_lora_rank=16") as err:
        llm.engine.make_request(case.batch[0], lora_request=LoRARequest("bad", 9, str(bad)))
    assert err.value.field == "lora_request"
    with pytest.raises(RequestError, match="lora_int_id=1 already names adapter 'a1'"):
        llm.engine.make_request(case.batch[0], lora_request=LoRARequest("a9", 1, str(bad)))
    out = generate(llm, [case.batch[3]], ["a3"], case)[0]
    assert out.token_ids == case.hf_greedy("a3", case.batch[3], NUM_TOKENS)


def test_an_engine_without_lora_refuses_a_lora_request(small_llm):
    from jaxserve import LoRARequest, RequestError

    with pytest.raises(RequestError, match="serves no LoRA adapters") as err:
        small_llm.engine.make_request("hi", lora_request=LoRARequest("x", 1, "/nowhere"))
    assert err.value.field == "lora_request"
