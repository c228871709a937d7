"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder): Qwen3's attention with a mixture-of-experts FFN in
every layer (softmax router, top k renormalised when norm_topk_prob), no shared expert."""

from jaxserve.model.families.base import Family

FAMILY = Family(
    name="qwen3moe", hf_architectures=("Qwen3MoeForCausalLM",), model_types=("qwen3_moe",),
    qk_norm=True, window_rule="max_window_layers",
    extra_keys={"use_sliding_window": None, "max_window_layers": None,
                # every layer sparse: a dense layer among sparse ones is not supported
                "decoder_sparse_step": (1,), "mlp_only_layers": ([],),
                "output_router_logits": None, "router_aux_loss_coef": None},
    num_experts_keys=("num_experts", "num_local_experts"),
    expert_size_key="moe_intermediate_size", norm_topk_key="norm_topk_prob",
    hf_layer_names={"router": "mlp.gate.weight"},
    hf_expert_names={"e_gate": "mlp.experts.{e}.gate_proj.weight",
                     "e_up": "mlp.experts.{e}.up_proj.weight",
                     "e_down": "mlp.experts.{e}.down_proj.weight"},
    gguf_layer_names={"q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight"})
