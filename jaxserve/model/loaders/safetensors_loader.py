"""Read and write Hugging Face model directories: config.json, *.safetensors, tokenizer.json.

Tensors keep the dtype they are stored in (bf16 arrives as an ml_dtypes bfloat16 numpy array);
the model casts later. HF's nn.Linear [out, in] weights are transposed into our [in, out] stacks.
An fp8 checkpoint's KV-cache scales (vLLM / compressed-tensors names: `self_attn.k_scale` and
`v_scale`, the older `kv_scale` and `k_proj.output_scale` / `v_proj.output_scale`) become
LoadedModel.kv_scales; a layer without them gets 1.0.
This module must not import jax, and never guesses a tensor it does not recognise.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm.auto import tqdm

from jaxserve.model.quant import mxfp4
from jaxserve.model.config import ModelConfig
from jaxserve.model.text.tokenizer import Tokenizer
from jaxserve.model.loaders.weights import (HF_GLOBAL_NAMES, TRANSPOSED, LoadedModel, ParamBuilder,
                                    hf_expert_names, hf_fused_parts, hf_layer_names,
                                    shape_error, to_hf_state_dict)

_FROM_HF_GLOBAL = {hf: ours for ours, hf in HF_GLOBAL_NAMES.items()}
# Buffers some checkpoints carry that are recomputed from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


_PACKED_SUFFIXES = ("_blocks", "_scales")  # MXFP4 halves of one matrix (gpt-oss experts)
# KV-cache scale tensors under `model.layers.{i}.` -> which of (k_scale, v_scale) they set
_KV_SCALE_NAMES = {"self_attn.k_scale": (0,), "self_attn.v_scale": (1,),
                   "self_attn.kv_scale": (0, 1), "self_attn.k_proj.output_scale": (0,),
                   "self_attn.v_proj.output_scale": (1,)}
# Scales of fp8 attention itself, which jaxserve does not run (its query stays in float).
_IGNORED_SCALE_NAMES = ("self_attn.q_scale", "self_attn.prob_scale")


class _KVScales:
    """The KV-cache scales met while loading: [2, L], NaN where none was given."""

    def __init__(self, num_layers: int):
        self.scales = np.full((2, num_layers), np.nan, np.float32)

    @staticmethod
    def claims(hf_name: str) -> bool:
        """Whether hf_name is a KV scale or an attention scale that is ignored."""
        parts = hf_name.split(".", 3)
        return (len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
                and (parts[3] in _KV_SCALE_NAMES or parts[3] in _IGNORED_SCALE_NAMES))

    def take(self, hf_name: str, value) -> None:
        """Record a tensor that claims(hf_name)."""
        _, _, layer, rest = hf_name.split(".", 3)
        which, layer = _KV_SCALE_NAMES.get(rest), int(layer)
        if which is None:
            return
        if not 0 <= layer < self.scales.shape[1] or np.size(value) != 1:
            raise ValueError(f"KV-cache scale {hf_name!r}: expected one value of a layer "
                             f"below {self.scales.shape[1]}, got shape {np.shape(value)}")
        self.scales[list(which), layer] = float(np.asarray(value, np.float32).reshape(()))

    def result(self) -> np.ndarray | None:
        """[2, L] (1.0 where a layer had none), or None when the checkpoint had no scales."""
        if np.isnan(self.scales).all():
            return None
        return np.where(np.isnan(self.scales), 1.0, self.scales).astype(np.float32)


class _PackedPairs:
    """MXFP4 tensors arrive as two halves (`X_blocks`, `X_scales`); each pair becomes X, the
    dequantized float32 [..., in, out] matrix (model/quant/mxfp4.py)."""

    def __init__(self):
        self.waiting: dict[str, dict[str, np.ndarray]] = {}

    def add(self, hf_name: str, value: np.ndarray) -> tuple[str, np.ndarray | None]:
        base, _, half = hf_name.rpartition("_")
        pair = self.waiting.setdefault(base, {})
        pair[half] = value
        if len(pair) < 2:
            return base, None
        del self.waiting[base]
        return base, mxfp4.dequantize(pair["blocks"], pair["scales"])

    def check_done(self) -> None:
        if self.waiting:
            base, pair = next(iter(self.waiting.items()))
            missing = "scales" if "blocks" in pair else "blocks"
            raise ValueError(f"MXFP4 tensor {base}_{next(iter(pair))} has no {base}_{missing}")


def is_hf_directory(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _our_names(hf_name: str, config: ModelConfig, from_hf_layer: dict, from_hf_expert: dict
               ) -> tuple[list[tuple[str, int | None]], int | None, int | None] | None:
    """([(our name, rows or None for the whole tensor)], layer, expert or None), or None for a
    tensor we deliberately skip. A fused HF tensor (Phi-3's qkv_proj) names several of ours."""
    if hf_name.endswith(_IGNORED_SUFFIXES):
        return None
    if hf_name in _FROM_HF_GLOBAL:
        return [(_FROM_HF_GLOBAL[hf_name], None)], None, None
    parts = hf_name.split(".", 3)  # model.layers.{i}.<rest>
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        if parts[3] in from_hf_layer:
            return [(f"layers.{from_hf_layer[parts[3]]}", None)], int(parts[2]), None
        if parts[3] in from_hf_expert:
            ours, expert = from_hf_expert[parts[3]]
            return [(f"layers.{ours}", None)], int(parts[2]), expert
        if parts[3] in config.family.hf_expert_stacked:
            stacked = config.family.hf_expert_stacked[parts[3]]
            return ([(f"layers.{name}", None) for name in stacked],
                    int(parts[2]), None)
        if parts[3] in config.family.hf_fused:
            return ([(f"layers.{name}", rows) for name, rows in hf_fused_parts(config, parts[3])],
                    int(parts[2]), None)
    raise ValueError(f"unexpected tensor {hf_name!r} in safetensors checkpoint of "
                     f"{config.family.hf_architecture}")


def _set(builder: ParamBuilder, hf_name: str, value: np.ndarray, targets, layer,
         expert=None) -> None:
    """One HF tensor into the builder, split on its rows when it is fused."""
    if hf_name.split(".", 3)[-1] in builder.config.family.hf_expert_stacked:
        # [E, ..., out] already in our [in, out] layout; two names interleave their columns
        for i, (ours, _) in enumerate(targets):
            builder.set(ours, value[..., i::len(targets)], layer=layer, source_name=hf_name)
        return
    if sum(rows or 0 for _, rows in targets) not in (0, value.shape[0]):
        raise shape_error(hf_name, value.shape,
                          (sum(rows for _, rows in targets), *value.shape[1:]))
    start = 0
    for ours, rows in targets:
        part = value if rows is None else value[start:start + rows]
        start += rows or 0
        builder.set(ours, part, layer=layer, expert=expert,
                    transpose=ours.split(".")[-1] in TRANSPOSED, source_name=hf_name)


def _merged_eos(config: ModelConfig, tokenizer: Tokenizer) -> tuple[int, ...]:
    return tuple(dict.fromkeys(config.eos_token_ids + tokenizer.eos_token_ids))


def load_hf_directory(directory: str | Path, *, progress: bool = True) -> LoadedModel:
    """Config, params (stored dtype) and tokenizer of a Hugging Face directory of any supported
    family (tensor names and fused tensors as its Family declares)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"model directory not found: {directory}")
    hf_config = json.loads((directory / "config.json").read_text()) \
        if (directory / "config.json").is_file() else {}
    config = ModelConfig.load(directory, name=Path(hf_config.get("_name_or_path")
                                                   or directory.absolute()).name)
    tokenizer = Tokenizer.load(directory)
    # config.json and generation_config.json may each name stop tokens the other lacks; the
    # tokenizer's own post-processor is what decides whether BOS is added.
    if tokenizer.bos_token_id is None:
        tokenizer.bos_token_id = config.bos_token_id
    tokenizer.eos_token_ids = _merged_eos(config, tokenizer)
    config = dataclasses.replace(config, eos_token_ids=tokenizer.eos_token_ids,
                                 add_bos_token=tokenizer.add_bos_token,
                                 bos_token_id=config.bos_token_id if config.bos_token_id is not None
                                 else tokenizer.bos_token_id)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    handles = [safe_open(str(f), framework="numpy") for f in files]
    names = [(n, h.get_tensor) for h in handles for n in h.keys()]
    kv_scales = _KVScales(config.num_layers)
    params = params_from_hf(config, tqdm(names, desc=f"loading {directory.name}",
                                         unit="tensor", disable=not progress), kv_scales)
    return LoadedModel(config=config, params=params, tokenizer=tokenizer,
                       source=str(directory), kv_scales=kv_scales.result())


def params_from_hf(config: ModelConfig, tensors, kv_scales=None) -> dict[str, np.ndarray]:
    """Hugging Face tensors -> our params (ModelConfig.param_shapes() layout, every shape
    checked, every parameter present). tensors: (HF name, read(name) -> array) pairs, or a
    {HF name: array} dict (a trainer's state dict: the rollout API's weight updates).
    kv_scales: a _KVScales that takes the checkpoint's KV-cache scales (None: they are
    skipped)."""
    if isinstance(tensors, dict):
        tensors = [(name, tensors.__getitem__) for name in tensors]
    builder = ParamBuilder(config)
    from_hf_layer = {hf: ours for ours, hf in hf_layer_names(config).items()}
    from_hf_expert = hf_expert_names(config)
    packed = _PackedPairs()
    for hf_name, read in tensors:
        value = None
        if hf_name.endswith(_PACKED_SUFFIXES):
            hf_name, value = packed.add(hf_name, np.asarray(read(hf_name)))
            if value is None:
                continue  # its other half is still to come
        if kv_scales is not None and kv_scales.claims(hf_name):
            kv_scales.take(hf_name, np.asarray(read(hf_name)))
            continue
        found = _our_names(hf_name, config, from_hf_layer, from_hf_expert)
        if found is None:
            continue
        targets, layer, expert = found
        if targets[0][0] == "lm_head" and config.tie_word_embeddings:
            continue  # tied checkpoints sometimes save the shared matrix twice
        _set(builder, hf_name, np.asarray(read(hf_name)) if value is None else value, targets,
             layer, expert)
    packed.check_done()
    return builder.finish()


def save_hf_directory(directory: str | Path, config: ModelConfig, params: dict[str, np.ndarray],
                      tokenizer: Tokenizer) -> None:
    """Write config.json, model.safetensors (HF names, [out, in]) and the tokenizer files, so
    that both `load_hf_directory` and transformers' `from_pretrained` read the model back."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf_config = dict(config.to_hf_dict(), _name_or_path=config.name)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2))
    if config.eos_token_ids:
        generation = {"bos_token_id": config.bos_token_id,
                      "eos_token_id": list(config.eos_token_ids)}
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    save_file(to_hf_state_dict(config, params), str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    tokenizer.save(directory)
