"""The compatibility matrix's oracle: transformers (with peft for LoRA) on the same tiny random
checkpoints the engines load, made to compute what each engine configuration should:

* int8 / int4 weights: the checkpoint's matrices quantized by jaxserve's own host quantizer
  (model/quant/formats.py) and dequantized back, loaded into the transformers model, so the oracle
  runs exactly the weights the engine holds (the engines run with int8_activations=off: a
  float dot over dequantized weights, not int8 activations);
* fp8 KV: an attention function that rounds keys and values to float8_e4m3fn (clipped to
  +-448, scale 1.0) before eager attention, as the engine's fp8 pages store them;
* LoRA: peft's PeftModel over that base;
* structured output, tool calls and a deferred grammar (the reasoning end sequence): at each
  step the argmax of transformers' logits over the tokens the request's grammar allows
  (jaxserve's grammar compiler gives the allowed set; transformers ranks).

Test code only; float32 torch on the CPU.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

import arch_oracle

VOCAB = 270  # tests/model_fixtures.py's byte-level BPE: grammars compile over real token texts
# MLP widths that split over 2 devices into whole int4 groups of 32
DENSE = dict(intermediate_size=128)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
LORA_TARGETS = ["q_proj", "v_proj"]  # attention only: a MoE model's MLP takes no adapter
ADAPTER = "a1"


def make_checkpoints(root: Path) -> dict:
    """{"dense": dir, "moe": dir, "dense-lora": adapter dir, "moe-lora": adapter dir}."""
    import lora_oracle

    dirs = {"dense": root / "dense", "moe": root / "moe"}
    arch_oracle.hf_checkpoint(dirs["dense"], "llama", seed=0, vocab_size=VOCAB, **DENSE)
    arch_oracle.hf_checkpoint(dirs["moe"], "qwen3_moe", seed=1, vocab_size=VOCAB, **MOE)
    for model in ("dense", "moe"):
        dirs[f"{model}-lora"] = lora_oracle.make_adapter(
            dirs[model], root / f"{model}-lora", seed=7, r=4, lora_alpha=8,
            target_modules=LORA_TARGETS)
    return dirs


@functools.lru_cache(maxsize=1)
def _register_fp8_attention() -> str:
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def fp8(x):
        return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype)

    def fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
        return eager_attention_forward(module, query, fp8(key), fp8(value), attention_mask,
                                       **kwargs)

    AttentionInterface.register("fp8_kv_oracle", fp8_kv_attention)
    # a registered attention gets no mask unless its name has a mask function too
    AttentionMaskInterface.register("fp8_kv_oracle", eager_mask)
    return "fp8_kv_oracle"


def dequantized_state(directory: Path, mode: str) -> dict:
    """HF tensor name -> float32 tensor: the checkpoint's matrices as `mode` stores them."""
    from jaxserve.model.loaders.loader import load_model
    from jaxserve.model.quant.formats import QuantizedTensor, quantize_params
    from jaxserve.model.loaders.weights import to_hf_state_dict

    loaded = load_model(str(directory), progress=False)
    params = {k: v.dequantize() if isinstance(v, QuantizedTensor) else v
              for k, v in quantize_params(loaded.params, mode).items()}
    return _fused_experts(to_hf_state_dict(loaded.config, params), loaded.config)


def _fused_experts(state: dict, config) -> dict:
    """Per-expert tensors (experts.{e}.{gate,up,down}_proj.weight, [out, in]) as transformers
    5 holds them: experts.gate_up_proj [E, 2I, H] (gate rows first), experts.down_proj
    [E, H, I]."""
    if not config.num_experts:
        return state
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}.mlp.experts"
        take = lambda part, e: state.pop(f"{prefix}.{e}.{part}_proj.weight")
        experts = range(config.num_experts)
        state[f"{prefix}.gate_up_proj"] = np.stack(
            [np.concatenate([take("gate", e), take("up", e)]) for e in experts])
        state[f"{prefix}.down_proj"] = np.stack([take("down", e) for e in experts])
    return state


class Oracle:
    """transformers (+ peft) for one (model, weights, kv, lora) combination."""

    def __init__(self, dirs: dict, model: str, weights: str, kv: str, lora: bool):
        import peft
        import torch
        import transformers

        attention = _register_fp8_attention() if kv == "fp8" else "eager"
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            dirs[model], dtype=torch.float32, attn_implementation=attention)
        if weights != "float":
            state = {k: torch.from_numpy(np.asarray(v, np.float32))
                     for k, v in dequantized_state(dirs[model], weights).items()}
            missing, unexpected = hf.load_state_dict(state, strict=False)
            assert not unexpected and not [m for m in missing if "rotary" not in m], (
                f"dequantized weights do not fit the transformers model: missing {missing}, "
                f"unexpected {unexpected}")
        self.model = hf.eval()
        self.lora = lora
        self._memo: dict = {}
        if lora:
            self.model = peft.PeftModel.from_pretrained(hf, dirs[f"{model}-lora"],
                                                        adapter_name=ADAPTER).eval()

    def _logits(self, ids: list[int], adapter: str | None) -> np.ndarray:
        import contextlib

        import torch

        ctx = contextlib.nullcontext()
        if self.lora and adapter is None:
            ctx = self.model.disable_adapter()
        with ctx, torch.no_grad():
            return self.model(torch.tensor([ids])).logits[0, -1].numpy().astype(np.float64)

    def greedy(self, prompt: list[int], steps: int, adapter: str | None = None,
               matcher=None, eos: tuple[int, ...] = (),
               key=None) -> tuple[list[int], list[float]]:
        """(tokens, each one's logprob): `steps` greedy tokens, each the argmax over what
        `matcher` (a jaxserve grammar matcher, or None) allows; stops after an EOS token the
        grammar asked for. Logprobs are of the masked logits (the engine's processed ones).
        Remembered by `key` (the caller's name for the grammar) where one is given."""
        from jaxserve.structured.matcher import bitmask_words

        memo = (tuple(prompt), steps, adapter, key)
        if key is not None and memo in self._memo:
            return self._memo[memo]
        ids, tokens, logprobs = list(prompt), [], []
        for _ in range(steps):
            logits = self._logits(ids, adapter)
            constraining = None if matcher is None else matcher.constraining()
            if constraining is not None:
                row = np.zeros(bitmask_words(len(logits)), np.int32)
                constraining.fill_bitmask(row)
                bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:len(logits)]
                logits = np.where(bits.astype(bool), logits, -np.inf)
            token = int(np.argmax(logits))
            shifted = logits - logits.max()
            logprobs.append(float(shifted[token] - np.log(np.exp(shifted).sum())))
            tokens.append(token)
            ids.append(token)
            if matcher is not None:
                matcher.accept([token])
                if constraining is not None and token in eos:
                    break
        if key is not None:
            self._memo[memo] = (tokens, logprobs)
        return tokens, logprobs
