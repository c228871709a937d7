"""ModelConfig: the shape of a decoder of one supported family, read from HF config.json or GGUF.

Plain data only; it must not import jax or hold weights. The parameter naming contract lives
here too (PARAM_SHAPES), so loaders, the model and checkpoints agree on one layout. What an
architecture family changes (norm kind, q/k norm, ...) is declared in `families/`; the
per-checkpoint settings (rope, windows per layer, soft caps) are fields here. config.json reading
and writing live in hf_config.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from jaxserve.model.families import SUPPORTED_ARCHITECTURES, get_family
from jaxserve.model.families.base import FULL, SLIDING, Family
from jaxserve.model.loaders.hf_config import read_hf_config, write_hf_config
from jaxserve.model.decoder.rope import RopeScaling, rotary_dim

__all__ = ["ModelConfig", "RopeScaling", "SUPPORTED_ARCHITECTURES", "FULL", "SLIDING"]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # q, k, v biases
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos_token: bool = False
    architecture: str = "llama"
    name: str = "model"
    output_bias: bool = False         # o_proj bias (Llama/Qwen3/Gemma3 attention_bias=true)
    hidden_act: str = "silu"
    partial_rotary_factor: float = 1.0
    sliding_window: int | None = None
    # Per layer FULL or SLIDING; () means every layer is FULL.
    layer_types: tuple[str, ...] = ()
    # RoPE of SLIDING layers when it differs from the global one (Gemma 3's local base).
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: RopeScaling | None = None
    query_pre_attn_scalar: float | None = None  # attention scale (q·k) * this ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Mixture of experts (num_experts 0: dense). Each expert is a gated FFN of width
    # moe_intermediate_size; a token goes to num_experts_per_tok of them (families/base.py:
    # Family.router says how the router scores them).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True        # renormalise the top-k weights to sum to 1
    swiglu_alpha: float | None = None  # gpt-oss's clamped SwiGLU: gate * sigmoid(alpha * gate)
    swiglu_limit: float | None = None  # ... with gate <= limit and |up| <= limit
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        family = get_family(self.architecture)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported {family.activation_key}={self.hidden_act!r}; "
                             f"supported: {', '.join(ACTIVATIONS)}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_layers} layers")
        bad = [t for t in self.layer_types if t not in (FULL, SLIDING)]
        if bad:
            raise ValueError(f"unsupported layer_types entry {bad[0]!r}; supported: "
                             f"{FULL}, {SLIDING}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if family.is_moe != (self.num_experts > 0):
            raise ValueError(f"{family.hf_architecture} {'needs' if family.is_moe else 'has no'} "
                             f"experts; got num_experts={self.num_experts}")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0):
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"[1, num_experts={self.num_experts}], and moe_intermediate_size="
                             f"{self.moe_intermediate_size} positive")
        if (family.expert_activation == "clamped_swiglu") != (self.swiglu_limit is not None):
            raise ValueError(f"swiglu_limit={self.swiglu_limit} is {family.hf_architecture}'s "
                             f"clamped SwiGLU setting; it must be given exactly for that form")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} gives an odd "
                             f"or empty rotary dimension for head_dim={self.head_dim}")

    def check_runnable(self, max_model_len: int | None = None) -> None:
        """Raise ValueError naming the setting decoder/decoder.py cannot compute exactly.

        Every setting config reading accepts is computed; what remains is length: dynamic and
        longrope RoPE match transformers only up to `max_exact_len`, so an engine that serves
        longer sequences (max_model_len) is refused rather than drift silently."""
        limit = self.max_exact_len
        if max_model_len is not None and limit is not None and max_model_len > limit:
            kinds = sorted({s.rope_type for s in (self.rope_scaling, self.sliding_rope_scaling)
                            if s is not None and s.rope_type in ("dynamic", "longrope")})
            raise ValueError(f"{self.name}: rope_type={kinds[0]!r} is computed exactly only up "
                             f"to {limit} tokens (transformers rescales past it by the "
                             f"sequence length); max_model_len={max_model_len} exceeds it, "
                             f"set max_model_len <= {limit}")

    @property
    def family(self) -> Family:
        return get_family(self.architecture)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return rotary_dim(self.head_dim, self.partial_rotary_factor)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (HF convention: a query at p sees keys in (p - W, p])."""
        types = self.layer_types or (FULL,) * self.num_layers
        return tuple(self.sliding_window if t == SLIDING else None for t in types)

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """The distinct windows over layers, in layer order; (None,) when no layer has one."""
        return tuple(dict.fromkeys(self.layer_windows))

    def layer_rope(self, layer: int) -> tuple[float, RopeScaling | None]:
        """(theta, scaling) of a layer's RoPE."""
        sliding = bool(self.layer_types) and self.layer_types[layer] == SLIDING
        if sliding and self.sliding_rope_theta is not None:
            return self.sliding_rope_theta, self.sliding_rope_scaling
        return self.rope_theta, self.rope_scaling

    @property
    def attention_scale(self) -> float:
        """sm_scale: q·k is multiplied by this before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def max_exact_len(self) -> int | None:
        """The longest sequence whose RoPE jaxserve computes exactly as transformers, when
        shorter than max_position_embeddings allows (dynamic and longrope scaling: rope.py)."""
        limits = [s.original_max_position_embeddings if s.rope_type == "longrope"
                  else self.max_position_embeddings
                  for s in (self.rope_scaling, self.sliding_rope_scaling)
                  if s is not None and s.rope_type in ("dynamic", "longrope")]
        return min(limits) if limits else None

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's name and shape. Matrices are [in, out] (x @ w)."""
        L, D, F, V = self.num_layers, self.hidden_size, self.intermediate_size, self.vocab_size
        family = self.family
        shapes = {
            "embed": (V, D),
            "layers.attn_norm": (L, D),
            "layers.wq": (L, D, self.q_size),
            "layers.wk": (L, D, self.kv_size),
            "layers.wv": (L, D, self.kv_size),
            "layers.wo": (L, self.q_size, D),
            "layers.mlp_norm": (L, D),
            "layers.w_gate": (L, D, F),
            "layers.w_up": (L, D, F),
            "layers.w_down": (L, F, D),
            "final_norm": (D,),
        }
        if self.num_experts:  # (this order keeps random_params' draws of dense models)
            for name in ("layers.w_gate", "layers.w_up", "layers.w_down"):
                del shapes[name]
        if self.attention_bias:
            shapes["layers.bq"] = (L, self.q_size)
            shapes["layers.bk"] = (L, self.kv_size)
            shapes["layers.bv"] = (L, self.kv_size)
        if self.output_bias:
            shapes["layers.bo"] = (L, D)
        if family.qk_norm:
            shapes["layers.q_norm"] = (L, self.head_dim)
            shapes["layers.k_norm"] = (L, self.head_dim)
        if family.sandwich_norms:
            shapes["layers.post_attn_norm"] = (L, D)
            shapes["layers.post_mlp_norm"] = (L, D)
        if family.attention_sinks:
            shapes["layers.sinks"] = (L, self.num_heads)
        if self.num_experts:
            shapes.update(self._expert_shapes())
        if not self.tie_word_embeddings:
            shapes["lm_head"] = (D, V)
        return shapes

    def _expert_shapes(self) -> dict[str, tuple[int, ...]]:
        """The MoE FFN's parameters, replacing the dense w_gate / w_up / w_down: the router
        [L, D, E] and each expert's matrices stacked [L, E, in, out]."""
        L, D, E, F = self.num_layers, self.hidden_size, self.num_experts, \
            self.moe_intermediate_size
        family = self.family
        shapes = {"layers.router": (L, D, E),
                  "layers.e_gate": (L, E, D, F), "layers.e_up": (L, E, D, F),
                  "layers.e_down": (L, E, F, D)}
        if family.router_bias:
            shapes["layers.router_bias"] = (L, E)
        if family.expert_bias:
            shapes.update({"layers.e_gate_bias": (L, E, F), "layers.e_up_bias": (L, E, F),
                           "layers.e_down_bias": (L, E, D)})
        return shapes

    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes().values())

    def num_active_params(self) -> int:
        """The parameters one token's forward pass reads: all but the experts it is not routed
        to (num_params for a dense model)."""
        total = self.num_params()
        if not self.num_experts:
            return total
        expert = sum(math.prod(s[2:]) * s[0] for name, s in self._expert_shapes().items()
                     if name.startswith("layers.e_"))
        return total - expert * (self.num_experts - self.num_experts_per_tok)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    # ---- HF config.json round trip -------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict, name: str = "model") -> "ModelConfig":
        """Read a config.json dict (transformers 4 or 5 layout); raises ValueError naming any key
        that would change the forward pass and is not supported."""
        config = cls(**read_hf_config(d), name=name)
        config.check_runnable()
        return config

    def to_hf_dict(self) -> dict:
        return write_hf_config(self)

    def save(self, directory: str | Path) -> None:
        (Path(directory) / "config.json").write_text(json.dumps(self.to_hf_dict(), indent=2))

    @classmethod
    def load(cls, directory: str | Path, name: str | None = None) -> "ModelConfig":
        path = Path(directory) / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no config.json in {directory}")
        return cls.from_hf_dict(json.loads(path.read_text()), name=name or Path(directory).name)


# MLP activations by their transformers names.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_new", "gelu")
