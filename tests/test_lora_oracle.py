"""Multi-LoRA against transformers + peft, on tiny random Llama and Qwen3 checkpoints with three
random PEFT adapters (ranks 4, 8 and 16, different target sets, one rsLoRA; tests/lora_oracle.py):

* one ragged step batching prompts under all three adapters and the base model gives each
  prompt transformers' last-position logits with its adapter (within 1e-4), in both forms of
  the delta and both layer loops;
* the engine's greedy tokens for the same mix equal transformers', with chunked prefill (a
  16-token budget) and forced preemption by recompute and by swap, and with tensor
  parallelism over two fake CPU devices;
* on a Qwen3-MoE checkpoint, an adapter on the attention projections matches peft, and one
  naming a dense-MLP projection is refused.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import arch_oracle  # noqa: E402
import lora_oracle  # noqa: E402

MODELS = {"llama": {},
          "qwen3": dict(rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})}


@pytest.fixture(scope="module", params=sorted(MODELS))
def case(request, tmp_path_factory):
    return lora_oracle.make_lora_case(tmp_path_factory.mktemp(request.param), request.param,
                                      **MODELS[request.param])


@pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
@pytest.mark.parametrize("form", ["masked", "gather"])
def test_one_step_mixing_three_adapters_and_the_base_model_gives_peft_logits(
        case, form, layer_loop, monkeypatch):
    from jaxserve.model.decoder import lora as lora_ops

    monkeypatch.setattr(lora_ops, "FORM", form)
    loaded = case.load()
    stacks = lora_oracle.device_stacks(loaded, case, per_layer=layer_loop == "unroll")
    got = arch_oracle.last_logits(loaded, case.batch, layer_loop=layer_loop, lora=stacks,
                                  lora_slots=lora_oracle.slots())
    arch_oracle.assert_logits_close(got, case.want_logits)


def test_the_adapters_move_the_logits_far_beyond_the_tolerance(case):
    """Without the adapters the prompts under one get other logits: the check above can fail."""
    base = arch_oracle.last_logits(case.load(), case.batch)
    moved = np.abs(base - case.want_logits).max(axis=-1)
    under_adapter = lora_oracle.slots() > 0
    assert (moved[under_adapter] > 1e-2).all(), f"adapters barely change the logits: {moved}"
    assert (moved[~under_adapter] < 1e-4).all(), f"the base model's prompt moved: {moved}"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_greedy_tokens_under_mixed_adapters_match_peft_through_preemption(case, mode):
    from jaxserve import SamplingParams
    from jaxserve.entrypoints.llm import LLM

    llm = LLM(loaded=case.load(), progress=False,
              **{**arch_oracle.ENGINE, "preemption_mode": mode, "enable_lora": True,
                 "max_loras": len(lora_oracle.ADAPTERS),
                 "max_lora_rank": lora_oracle.MAX_LORA_RANK})
    params = SamplingParams(max_tokens=arch_oracle.NUM_GREEDY, temperature=0.0,
                            ignore_eos=True)
    outs = llm.generate(case.batch, params, use_tqdm=False, lora_request=case.requests())
    scheduler = llm.engine.scheduler
    arch_oracle.assert_greedy_equal([o.token_ids for o in outs], case.want_greedy,
                                    scheduler.num_preemptions)
    if mode == "swap":
        assert scheduler.num_swaps > 0, "the page pool was meant to force swapping"
    assert scheduler.lora_slots.num_loads == len(lora_oracle.ADAPTERS)


def test_tensor_parallel_engine_with_adapters_gives_the_same_greedy_tokens(case):
    """Two fake CPU devices: base weights sharded on heads and FFN, each adapter stack
    sharded as its base weight (column-split projections: A replicated, B split on its output
    columns; row-split ones: A split on its input rows, B replicated); the same mixed batch
    through the same preemption."""
    settings = {**arch_oracle.ENGINE, "enable_lora": True,
                "max_loras": len(lora_oracle.ADAPTERS),
                "max_lora_rank": lora_oracle.MAX_LORA_RANK}
    got, placement = lora_oracle.engine_greedy_tp(case, 2, **settings)
    assert got == case.want_greedy, f"TP 2 with adapters: {got}, want {case.want_greedy}"
    assert sorted(placement) == sorted(["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"])
    for name, arrays in placement.items():
        (a_spec, a_shard, a_shape), (b_spec, b_shard, b_shape) = arrays["a"], arrays["b"]
        if name in ("wo", "w_down"):  # input rows split, like the base weight
            want = ([a_shape[0] // 2, a_shape[1]], b_shape)
            assert a_spec[0] == "tp" and not any(b_spec), f"{name}: {arrays}"
        else:  # output columns split, like the base weight
            want = (a_shape, [b_shape[0], b_shape[1] // 2])
            assert not any(a_spec) and b_spec[-1] == "tp", f"{name}: {arrays}"
        assert (a_shard, b_shard) == want, f"{name}: shards {a_shard}, {b_shard}"


def test_attention_adapters_on_a_mixture_of_experts_model_give_peft_logits(tmp_path):
    """Qwen3-MoE: an adapter on q/k/v/o matches peft; one on a dense-MLP name is refused."""
    import json

    import peft
    import torch
    import transformers

    from jaxserve.lora.device import DeviceLoRA
    from jaxserve.lora.peft import read_adapter
    from jaxserve.model.loaders.loader import load_model

    base_dir = tmp_path / "base"
    arch_oracle.hf_checkpoint(base_dir, "qwen3_moe", num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, norm_topk_prob=True)
    path = lora_oracle.make_adapter(base_dir, tmp_path / "attn", 5, r=8, lora_alpha=16,
                                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    hf = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32, attn_implementation="eager"), path).eval()
    batch = arch_oracle.prompts(0)
    slots = np.array([1, 0, 1, 0, 1], np.int32)
    want = arch_oracle.hf_last_logits(hf, batch)
    with hf.disable_adapter():
        want[slots == 0] = arch_oracle.hf_last_logits(hf, [p for p, s in zip(batch, slots)
                                                           if s == 0])
    loaded = load_model(str(base_dir), progress=False)
    device = DeviceLoRA(loaded.config, 1, 8)
    assert sorted(device.targets) == ["wk", "wo", "wq", "wv"]
    device.write(1, read_adapter(path, loaded.config, 8))
    got = arch_oracle.last_logits(loaded, batch, lora=device.arrays, lora_slots=slots)
    arch_oracle.assert_logits_close(got, want)
    config = json.loads((path / "adapter_config.json").read_text())
    config["target_modules"] += ["up_proj"]
    (path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'up_proj' is a dense-MLP projection"):
        read_adapter(path, loaded.config, 8)
