"""ModelConfig: the shape of a Llama-family decoder, read from HF config.json or GGUF metadata.

Plain data only; it must not import jax or hold weights. The parameter naming contract lives
here too (PARAM_SHAPES), so loaders, the model and checkpoints agree on one layout.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos_token: bool = False
    architecture: str = "llama"
    name: str = "model"
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's name and shape. Matrices are [in, out] (x @ w)."""
        L, D, F, V = self.num_layers, self.hidden_size, self.intermediate_size, self.vocab_size
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
        if self.attention_bias:
            shapes["layers.bq"] = (L, self.q_size)
            shapes["layers.bk"] = (L, self.kv_size)
            shapes["layers.bv"] = (L, self.kv_size)
        if not self.tie_word_embeddings:
            shapes["lm_head"] = (D, V)
        return shapes

    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes().values())

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    # ---- HF config.json round trip -------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict, name: str = "model") -> "ModelConfig":
        archs = d.get("architectures") or []
        model_type = d.get("model_type", "llama")
        arch = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "qwen2"}.get(archs[0] if archs else "", model_type)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {archs or model_type!r}; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if arch == "mistral" and d.get("sliding_window"):
            raise ValueError("Mistral with sliding_window is not supported "
                             f"(sliding_window={d['sliding_window']})")
        num_heads = d["num_attention_heads"]
        rs = d.get("rope_scaling")
        scaling = None
        if rs:
            kind = rs.get("rope_type", rs.get("type"))
            if kind == "llama3":
                scaling = RopeScaling(float(rs["factor"]), float(rs["low_freq_factor"]),
                                      float(rs["high_freq_factor"]),
                                      int(rs["original_max_position_embeddings"]))
            elif kind not in (None, "default"):
                raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: llama3")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
            num_heads=num_heads, num_kv_heads=d.get("num_key_value_heads", num_heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5), rope_theta=d.get("rope_theta", 10000.0),
            rope_scaling=scaling, tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", arch == "qwen2"),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids,
            add_bos_token=d.get("add_bos_token", arch == "llama" and d.get("bos_token_id") is not None),
            architecture=arch, name=name)

    def to_hf_dict(self) -> dict:
        arch_name = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                     "qwen2": "Qwen2ForCausalLM"}[self.architecture]
        d = {
            "architectures": [arch_name], "model_type": self.architecture,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1
            else self.eos_token_ids[0],
            "add_bos_token": self.add_bos_token, "hidden_act": "silu",
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        return d

    def save(self, directory: str | Path) -> None:
        (Path(directory) / "config.json").write_text(json.dumps(self.to_hf_dict(), indent=2))

    @classmethod
    def load(cls, directory: str | Path, name: str | None = None) -> "ModelConfig":
        path = Path(directory) / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no config.json in {directory}")
        return cls.from_hf_dict(json.loads(path.read_text()), name=name or Path(directory).name)
