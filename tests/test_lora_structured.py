"""Multi-LoRA with structured output: constrained requests under three PEFT adapters and the
base model, in one batch, obey their constraint and pick, at every constrained step, the token
transformers + peft rank highest among the allowed ones under the same adapter.

The tiny Llama's vocabulary is tests/model_fixtures.py's byte-level BPE (the checkpoint is
sized to it), so grammars compile over real token texts.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import lora_oracle  # noqa: E402
from model_fixtures import tiny_vocab  # noqa: E402

# Letters no merge of the tiny BPE starts or ends with: each is one token, and a run of them
# tokenizes letter by letter, so a [LETTERS]{n} regex allows exactly these n tokens in turn.
LETTERS = "bcdfgkm"
NUM_LETTERS = 4
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=16, token_buckets=(16,), seq_buckets=(8,),
              max_model_len=384, page_size=4, num_pages=512, enable_lora=True, max_loras=3,
              max_lora_rank=lora_oracle.MAX_LORA_RANK)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    vocab = len(tiny_vocab()["tokenizer.ggml.tokens"])
    return lora_oracle.make_lora_case(tmp_path_factory.mktemp("lora_structured"), "llama",
                                      vocab_size=vocab)


@pytest.fixture(scope="module")
def llm(case):
    from jaxserve.entrypoints.llm import LLM

    return LLM(loaded=case.load(), progress=False, **ENGINE)


def hf_constrained(case, name, prompt, allowed: list[int], steps: int) -> list[int]:
    """transformers + peft under adapter `name`: `steps` greedy tokens, each the argmax of the
    next-token logits over `allowed` only."""
    import contextlib

    import torch

    model = case.peft_model
    if name is not None:
        model.set_adapter(name)
    ctx = model.disable_adapter() if name is None else contextlib.nullcontext()
    ids, out = list(prompt), []
    with ctx, torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].numpy()
            pick = allowed[int(np.argmax(logits[allowed]))]
            out.append(pick)
            ids.append(pick)
    return out


def test_constrained_tokens_under_each_adapter_match_transformers_peft(llm, case):
    from jaxserve import SamplingParams
    from jaxserve.structured.params import StructuredOutputs

    tokenizer = case.load().tokenizer
    letter_ids = [tokenizer.encode(c, add_special_tokens=False) for c in LETTERS]
    assert all(len(ids) == 1 for ids in letter_ids), letter_ids
    letter_ids = [ids[0] for ids in letter_ids]
    choices = list(LETTERS)
    regex = StructuredOutputs(regex=f"[{LETTERS}]{{{NUM_LETTERS}}}")
    choice = StructuredOutputs(choice=choices)
    names = list(lora_oracle.ASSIGN)
    prompts = case.batch + case.batch
    params = ([SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=regex)]
              * len(case.batch) +
              [SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=choice)]
              * len(case.batch))
    outs = llm.generate(prompts, params, use_tqdm=False,
                        lora_request=[case.lora_request(n) for n in names + names])
    want_regex = [hf_constrained(case, n, p, letter_ids, NUM_LETTERS)
                  for n, p in zip(names, case.batch)]
    want_choice = [hf_constrained(case, n, p, letter_ids, 1) for n, p in zip(names, case.batch)]
    base = [hf_constrained(case, None, p, letter_ids, NUM_LETTERS) for p in case.batch]
    assert any(w != b for w, b in zip(want_regex, base)), (
        "the adapters change no constrained pick: this batch cannot tell them apart")
    for i, (name, out) in enumerate(zip(names + names, outs)):
        assert out.finish_reason == "stop", f"{i} under {name}: {out.finish_reason} {out.error}"
        want = want_regex[i] if i < len(names) else want_choice[i - len(names)]
        got = [t for t in out.token_ids if t not in llm.engine.model_config.eos_token_ids]
        assert got == want, f"request {i} under {name}: got {out.text!r} {got}, want {want}"


def test_a_json_schema_under_an_adapter_is_obeyed(llm, case):
    from jaxserve import SamplingParams
    from jaxserve.structured.params import StructuredOutputs

    schema = {"type": "object", "properties": {"b": {"enum": ["x", "yy"]},
                                               "n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["b", "n"], "additionalProperties": False}
    params = SamplingParams(max_tokens=320, temperature=0.0,
                            structured_outputs=StructuredOutputs(json=schema))
    names = ["a1", "a2", None, "a3"]
    outs = llm.generate(case.batch[:4], params, use_tqdm=False,
                        lora_request=[case.lora_request(n) for n in names])
    for name, out in zip(names, outs):
        assert out.finish_reason == "stop", f"under {name}: {out.finish_reason} {out.text!r}"
        jsonschema.validate(json.loads(out.text), schema)
