"""gpt-oss: attention with q/k/v/o biases and a learned sink logit per head, sliding-window and
full layers alternating, YaRN RoPE, and a mixture-of-experts FFN in every layer: a router with a
bias (top k logits, then a softmax over them), experts with biases and a clamped SwiGLU, stored
as [E, in, out] stacks with gate and up interleaved (MXFP4 blocks in the released checkpoints,
dequantized on load)."""

from jaxserve.model.families.base import ROUTE_TOPK_SOFTMAX, Family

FAMILY = Family(
    name="gpt-oss", hf_architectures=("GptOssForCausalLM",), model_types=("gpt_oss",),
    window_rule="pattern", window_pattern=2, default_rope_theta=150000.0,
    extra_keys={"output_router_logits": None, "router_aux_loss_coef": None},
    hf_quantization=("mxfp4",),
    num_experts_keys=("num_local_experts",), router=ROUTE_TOPK_SOFTMAX, router_bias=True,
    expert_bias=True, expert_activation="clamped_swiglu", attention_sinks=True,
    hf_layer_names={"router": "mlp.router.weight", "router_bias": "mlp.router.bias",
                    "sinks": "self_attn.sinks"},
    hf_expert_stacked={"mlp.experts.gate_up_proj": ("e_gate", "e_up"),
                       "mlp.experts.gate_up_proj_bias": ("e_gate_bias", "e_up_bias"),
                       "mlp.experts.down_proj": ("e_down",),
                       "mlp.experts.down_proj_bias": ("e_down_bias",)})
