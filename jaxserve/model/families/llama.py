"""Llama 2/3.x, SmolLM2, TinyLlama: the reference decoder every other family differs from."""

from jaxserve.model.families.base import Family

FAMILY = Family(
    name="llama", hf_architectures=("LlamaForCausalLM",), model_types=("llama",),
    extra_keys={"pretraining_tp": None, "mlp_bias": (False,), "rope_interleaved": (False,),
                "is_llama_config": None},
    gguf_permute_qk=True, bos_by_default=True)
