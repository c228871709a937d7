"""Rotary position embedding settings: read from a checkpoint's config, turned into frequencies.

`RopeScaling` is the one record of a rope type's parameters (default, linear, dynamic, llama3,
yarn); `parse_rope` reads a transformers 4 (`rope_theta` + `rope_scaling`) or transformers 5
(`rope_parameters`) dict and refuses any type or key it does not implement, naming it.
`inv_freq` and `attention_factor` give what the model multiplies positions and cos/sin by, the
way transformers' ROPE_INIT_FUNCTIONS compute them. Plain numpy: this module must not import jax.

"dynamic" (NTK) equals the default rope up to `max_position_embeddings`, where transformers starts
rescaling by the longest sequence in the batch (batch-dependent, which a serving engine cannot
reproduce); "longrope" (Phi-3-128k, Phi-4-mini) likewise switches every position of a sequence to
its long factors once the sequence passes `original_max_position_embeddings`. jaxserve computes
both exactly only below that length (`ModelConfig.max_exact_len`): short factors for longrope.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

# Keys each rope type reads (besides rope_type/type, rope_theta, partial_rotary_factor).
_TYPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor", "original_max_position_embeddings"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "attention_factor", "mscale", "mscale_all_dim", "truncate"},
    "longrope": {"factor", "original_max_position_embeddings", "attention_factor",
                 "short_factor", "long_factor"},
}
_COMMON_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


@dataclass(frozen=True)
class RopeScaling:
    """Frequency scaling of one rope type. The positional order (factor, low, high, original) is
    the Llama-3 one, the type this class first described."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None  # longrope
    long_factor: tuple[float, ...] | None = None   # longrope (kept for the config round trip)

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES or self.rope_type == "default":
            raise ValueError(f"unsupported rope_type {self.rope_type!r}; supported: "
                             f"{', '.join(ROPE_TYPES)}")

    def to_hf_dict(self) -> dict:
        d = {"rope_type": self.rope_type, "factor": self.factor,
             "original_max_position_embeddings": self.original_max_position_embeddings}
        if self.rope_type == "llama3":
            d.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)
        elif self.rope_type == "yarn":
            d.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate)
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, key) is not None:
                    d[key] = getattr(self, key)
        elif self.rope_type == "longrope":
            d.update(short_factor=list(self.short_factor), long_factor=list(self.long_factor))
            if self.attention_factor is not None:
                d["attention_factor"] = self.attention_factor
        elif self.rope_type == "linear":
            del d["original_max_position_embeddings"]
        return d


@dataclass(frozen=True)
class RopeSettings:
    """What one rope dict says: base, scaling (None: default rope), rotated fraction of a head."""

    theta: float
    scaling: RopeScaling | None
    partial_rotary_factor: float | None  # None: the dict does not say


def parse_rope(rope: dict | None, *, theta: float | None, max_position_embeddings: int,
               original_max_position_embeddings: int | None = None,
               where: str = "rope_parameters") -> RopeSettings:
    """One (non-nested) rope dict; `theta` is the top-level rope_theta when the dict has none.

    Raises ValueError naming the key and value of anything that would change the frequencies and
    is not implemented here."""
    rope = dict(rope or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported {where} rope_type={kind!r}; jaxserve implements "
                         f"{', '.join(ROPE_TYPES)}")
    unknown = sorted(set(rope) - _COMMON_KEYS - _TYPE_KEYS[kind])
    if unknown:
        raise ValueError(f"unsupported {where} key {unknown[0]}={rope[unknown[0]]!r} for "
                         f"rope_type {kind!r}; jaxserve reads "
                         f"{', '.join(sorted(_COMMON_KEYS | _TYPE_KEYS[kind]))}")
    base = float(rope.get("rope_theta", theta if theta is not None else 10000.0))
    partial = rope.get("partial_rotary_factor")
    partial = None if partial is None else float(partial)
    if kind == "default":
        return RopeSettings(base, None, partial)
    original = int(original_max_position_embeddings or rope.get(
        "original_max_position_embeddings") or max_position_embeddings)
    factor = rope.get("factor")
    if factor is None:
        if kind not in ("yarn", "longrope"):
            raise ValueError(f"{where} rope_type {kind!r} needs a factor")
        factor = max_position_embeddings / original
    get = lambda key, default: default if rope.get(key) is None else rope[key]
    scaling = RopeScaling(
        float(factor), float(get("low_freq_factor", 1.0)), float(get("high_freq_factor", 4.0)),
        original, kind, float(get("beta_fast", 32.0)), float(get("beta_slow", 1.0)),
        None if rope.get("attention_factor") is None else float(rope["attention_factor"]),
        None if rope.get("mscale") is None else float(rope["mscale"]),
        None if rope.get("mscale_all_dim") is None else float(rope["mscale_all_dim"]),
        bool(get("truncate", True)),
        None if rope.get("short_factor") is None else tuple(map(float, rope["short_factor"])),
        None if rope.get("long_factor") is None else tuple(map(float, rope["long_factor"])))
    if kind == "longrope" and (scaling.short_factor is None or scaling.long_factor is None):
        raise ValueError(f"{where} rope_type 'longrope' needs short_factor and long_factor")
    return RopeSettings(base, scaling, partial)


def rotary_dim(head_dim: int, partial_rotary_factor: float) -> int:
    return int(head_dim * partial_rotary_factor)


def inv_freq(theta: float, dim: int, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies [dim // 2] (float32) for a rotary dimension `dim`."""
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    inv = 1.0 / (theta ** exponents.astype(np.float64))
    if scaling is None or scaling.rope_type == "dynamic":
        return inv.astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv / scaling.factor).astype(np.float32)
    if scaling.rope_type == "llama3":
        return _llama3(inv, scaling).astype(np.float32)
    if scaling.rope_type == "longrope":
        if len(scaling.short_factor) != dim // 2:
            raise ValueError(f"longrope short_factor has {len(scaling.short_factor)} values, "
                             f"the rotary dimension {dim} needs {dim // 2}")
        ext = np.asarray(scaling.short_factor, np.float32)
        return (1.0 / (ext * theta ** exponents)).astype(np.float32)
    return _yarn(theta, dim, scaling)


def attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by (yarn's mscale, longrope's; 1 for the other types)."""
    if scaling is None or scaling.rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.rope_type == "longrope":
        original = scaling.original_max_position_embeddings
        return 1.0 if scaling.factor <= 1.0 else math.sqrt(
            1 + math.log(scaling.factor) / math.log(original))

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return float(mscale(scaling.factor, scaling.mscale)
                     / mscale(scaling.factor, scaling.mscale_all_dim))
    return mscale(scaling.factor)


def _llama3(inv: np.ndarray, rs: RopeScaling) -> np.ndarray:
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    mid = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_mid, mid, scaled)


def _yarn(theta: float, dim: int, rs: RopeScaling) -> np.ndarray:
    """transformers' _compute_yarn_parameters, in float32 where it computes in float32."""
    def correction_dim(rotations):
        return (dim * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = (theta ** (np.arange(0, dim, 2).astype(np.float32) / dim)).astype(np.float32)
    extrapolation = (1.0 / pos_freqs).astype(np.float32)
    interpolation = (1.0 / (rs.factor * pos_freqs)).astype(np.float32)
    keep = (1 - ramp).astype(np.float32)
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)
