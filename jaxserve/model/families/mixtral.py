"""Mixtral: Mistral's attention with a mixture-of-experts FFN in every layer (softmax router,
top-2 renormalised)."""

from jaxserve.model.families.base import Family

FAMILY = Family(
    name="mixtral", hf_architectures=("MixtralForCausalLM",), model_types=("mixtral",),
    attention_bias="none", window_rule="all",
    # router_jitter_noise only perturbs the router in training
    extra_keys={"output_router_logits": None, "router_aux_loss_coef": None,
                "router_jitter_noise": None},
    num_experts_keys=("num_local_experts",),
    hf_layer_names={"router": "block_sparse_moe.gate.weight"},
    hf_expert_names={"e_gate": "block_sparse_moe.experts.{e}.w1.weight",
                     "e_up": "block_sparse_moe.experts.{e}.w3.weight",
                     "e_down": "block_sparse_moe.experts.{e}.w2.weight"},
    gguf_permute_qk=True)
