"""Multi-LoRA with n-gram speculative decoding: a batch mixing three PEFT adapters and the base
model, on an engine that speculates at every batch size with fewer device slots than adapters
(so adapters load while others verify drafts), gives each request transformers + peft's greedy
tokens under its adapter, with drafts proposed and accepted, and nothing compiled after
warm-up. A draft model with adapters is refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import lora_oracle  # noqa: E402

NUM_TOKENS = 16
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(16, 32),
              seq_buckets=(4,), max_model_len=96, page_size=4, num_pages=128, enable_lora=True,
              max_loras=2, max_cpu_loras=4, max_lora_rank=lora_oracle.MAX_LORA_RANK,
              speculative_method="ngram", num_speculative_tokens=3,
              speculative_disable_by_batch_size=16)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return lora_oracle.make_lora_case(tmp_path_factory.mktemp("lora_spec"), "llama")


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts repeating a short unit, so n-gram lookup finds drafts."""
    rng = np.random.default_rng(seed)
    return [np.resize(rng.integers(3, 256, int(rng.integers(2, 6))),
                      int(rng.integers(12, 40))).tolist() for _ in range(n)]


def test_ngram_speculation_under_mixed_adapters_gives_transformers_greedy_tokens(case):
    from jaxserve import SamplingParams
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.runner.compile_count import CompileCounter

    llm = LLM(loaded=case.load(), progress=False, **ENGINE)
    names = ["a1", None, "a2", "a3", "a2", "a1", None, "a3"]
    prompts = repetitive_prompts(len(names))
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    stats = llm.engine.speculation.policy.stats
    with CompileCounter() as compiles:
        outs = llm.generate(prompts, params, use_tqdm=False,
                            lora_request=[case.lora_request(n) for n in names])
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, (
        f"{stats.num_draft_tokens} drafts, {stats.num_accepted_tokens} accepted: the test "
        "meant to verify drafts under adapters")
    assert llm.engine.scheduler.lora_slots.num_evictions > 0, "three adapters in two slots"
    bad = []
    for i, (name, prompt, out) in enumerate(zip(names, prompts, outs)):
        want = case.hf_greedy(name, prompt, NUM_TOKENS)
        if out.token_ids != want:
            bad.append(f"{i} under {name}: got {out.token_ids}, want {want}")
    assert not bad, "speculative tokens differ from transformers + peft:\n" + "\n".join(bad)
    assert compiles.count == 0, f"{compiles.count} compilations after warm-up"


def test_a_draft_model_with_adapters_is_refused_by_name(case):
    from jaxserve.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="enable_lora=True is invalid with "
                                         "speculative_method='draft'"):
        LLM(loaded=case.load(), progress=False, **{**ENGINE, "speculative_method": "draft",
                                                   "speculative_draft": "layers:1"})
