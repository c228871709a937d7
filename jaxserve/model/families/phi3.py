"""Phi-3 / Phi-4-mini: Llama with fused qkv and gate_up projections, partial rotary, and an
optional sliding window on every layer."""

from jaxserve.model.families.base import Family

FAMILY = Family(
    name="phi3", hf_architectures=("Phi3ForCausalLM",), model_types=("phi3",),
    attention_bias="none", window_rule="all",
    extra_keys={"embd_pdrop": None, "resid_pdrop": None},
    hf_fused={"self_attn.qkv_proj.weight": ("wq", "wk", "wv"),
              "mlp.gate_up_proj.weight": ("w_gate", "w_up")},
    gguf_fused={"attn_qkv.weight": ("wq", "wk", "wv"), "ffn_up.weight": ("w_gate", "w_up")})
