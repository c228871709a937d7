"""A PEFT LoRA adapter directory, read on the host and checked against the base model.

`read_adapter(path, model_config, max_lora_rank)` reads `adapter_config.json` and
`adapter_model.safetensors` as `peft`'s save_pretrained writes them and returns a LoRAAdapter:
per targeted projection, by our parameter name ("wq", ..., "w_down"), A [L, in, r] and
B [L, r, out] in float32 with the scaling (lora_alpha / r, or lora_alpha / sqrt(r) with
use_rslora) folded into B, so the step adds (x @ A) @ B. Layers the adapter lacks are zeros.

Every problem is a ValueError naming the adapter's directory and what is wrong: a missing file,
a rank above max_lora_rank, an unknown target module, tensor shapes that do not match the base
model, a dense-MLP target on a mixture-of-experts model, and any adapter_config setting that
changes the math and is not supported here (use_dora, lora_bias, bias, fan_in_fan_out,
rank_pattern / alpha_pattern, layers_to_transform, modules_to_save, ...; a setting this reader
does not know is refused too unless it is off). Plain numpy: no jax, no device memory.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's module name -> our parameter name (model/config.py's param_shapes, without "layers.")
TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
           "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
# Settings read elsewhere, or that only concern training or initialization.
_IGNORED = {"task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
            "inference_mode", "lora_dropout", "init_lora_weights", "megatron_core",
            "loftq_config", "eva_config", "corda_config", "lora_ga_config", "velora_config",
            "qalora_group_size", "runtime_config", "ensure_weight_tying", "exclude_modules",
            "peft_type", "r", "lora_alpha", "use_rslora", "target_modules"}
# Settings that change the math: each must hold this value (or be absent).
_REQUIRED_OFF = {"use_dora": False, "lora_bias": False, "bias": "none", "fan_in_fan_out": False,
                 "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
                 "rank_pattern": {}, "alpha_pattern": {}, "megatron_config": None,
                 "trainable_token_indices": None, "alora_invocation_tokens": None,
                 "use_qalora": False, "monteclora_config": None, "layer_replication": None,
                 "target_parameters": None, "use_bdlora": None, "arrow_config": None,
                 "kasa_config": None}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.\w+)?\.weight$")


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter on the host, ready to be written into a device slot."""

    path: str
    rank: int
    scaling: float
    # our parameter name -> (A [L, in, r], B [L, r, out] * scaling), float32
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _off(value) -> bool:
    return value in (None, False, "none", "", {}, [], ())


def _fail(path, problem: str):
    raise ValueError(f"LoRA adapter {str(path)!r}: {problem}")


def read_config(path: Path, max_lora_rank: int) -> dict:
    """adapter_config.json, checked: a LORA adapter with rank in [1, max_lora_rank], a numeric
    lora_alpha, and no setting that changes the math beyond what is supported."""
    file = path / CONFIG_FILE
    if not path.is_dir():
        _fail(path, "is not a directory (a PEFT adapter directory holds "
                    f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    if not file.is_file():
        _fail(path, f"missing file {CONFIG_FILE}")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        _fail(path, f"{CONFIG_FILE} is not readable JSON: {exc}")
    if not isinstance(config, dict):
        _fail(path, f"{CONFIG_FILE} holds {type(config).__name__}, not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        _fail(path, f"peft_type={peft_type!r} is not supported: only LORA adapters are")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        _fail(path, f"r={rank!r} is invalid: the rank must be an integer >= 1")
    if rank > max_lora_rank:
        _fail(path, f"rank r={rank} exceeds max_lora_rank={max_lora_rank} (raise "
                    "--max-lora-rank to serve it)")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        _fail(path, f"lora_alpha={alpha!r} is invalid: must be a finite number")
    for name, value in config.items():
        if name in _REQUIRED_OFF:
            want = _REQUIRED_OFF[name]
            if not (value == want or (_off(want) and _off(value))):
                _fail(path, f"adapter_config setting {name}={value!r} is not supported "
                            f"(only {want!r}): it changes the adapter's math")
        elif name not in _IGNORED and not _off(value):
            _fail(path, f"adapter_config setting {name}={value!r} is not supported: this "
                        "reader does not know it, and it is not off")
    return config


def _target_modules(path: Path, config: dict, is_moe: bool) -> set[str] | None:
    """The module names target_modules lists, each checked (None: a pattern, which the
    tensors' names resolve)."""
    targets = config.get("target_modules")
    if targets is None or isinstance(targets, str):
        return None
    names = set(targets)
    for name in sorted(names):
        _check_module(path, name, is_moe)
    return names


def _check_module(path: Path, name: str, is_moe: bool) -> None:
    if name not in TARGETS:
        _fail(path, f"unknown target module {name!r}: supported are "
                    f"{', '.join(TARGETS)}")
    if is_moe and name in MLP_TARGETS:
        _fail(path, f"target module {name!r} is a dense-MLP projection, but the base model's "
                    "MLP is a mixture of experts: only q_proj, k_proj, v_proj and o_proj can "
                    "be adapted on it")


def read_adapter(path, model_config, max_lora_rank: int) -> LoRAAdapter:
    """The adapter at `path` for a base model of `model_config` (model/config.py's
    ModelConfig): see the module docstring."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    config = read_config(path, max_lora_rank)
    rank, alpha = config["r"], config.get("lora_alpha", 8)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    is_moe = bool(model_config.num_experts)
    listed = _target_modules(path, config, is_moe)
    file = path / WEIGHTS_FILE
    if not file.is_file():
        extra = " (adapter_model.bin, a pickle, is not read)" if (
            path / "adapter_model.bin").exists() else ""
        _fail(path, f"missing file {WEIGHTS_FILE}{extra}")
    shapes = model_config.param_shapes()
    num_layers = model_config.num_layers
    halves: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    try:
        with safe_open(str(file), framework="numpy") as f:
            for key in f.keys():
                match = _KEY.search(key)
                if match is None:
                    _fail(path, f"tensor {key!r} is not a LoRA A or B weight of a decoder "
                                f"layer's projection ({', '.join(TARGETS)})")
                layer, _, module, half = match.groups()
                _check_module(path, module, is_moe)
                if listed is not None and module not in listed:
                    _fail(path, f"tensor {key!r} adapts {module!r}, which target_modules "
                                f"({sorted(listed)}) does not list")
                if int(layer) >= num_layers:
                    _fail(path, f"tensor {key!r} is for layer {layer}, but the base model "
                                f"has {num_layers} layers")
                halves.setdefault((module, half), {})[int(layer)] = f.get_tensor(key)
    except SafetensorError as exc:
        _fail(path, f"{WEIGHTS_FILE} is not a readable safetensors file: {exc}")
    if not halves:
        _fail(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for module in sorted({m for m, _ in halves}):
        ours = TARGETS[module]
        _, d_in, d_out = shapes[f"layers.{ours}"]
        a_layers, b_layers = halves.get((module, "A"), {}), halves.get((module, "B"), {})
        if set(a_layers) != set(b_layers):
            lone = sorted(set(a_layers) ^ set(b_layers))[0]
            _fail(path, f"{module} of layer {lone} has only one of lora_A and lora_B")
        a = np.zeros((num_layers, d_in, rank), np.float32)
        b = np.zeros((num_layers, rank, d_out), np.float32)
        for layer, value in a_layers.items():
            _check_shape(path, module, "lora_A", layer, value, (rank, d_in))
            a[layer] = np.asarray(value, np.float32).T
        for layer, value in b_layers.items():
            _check_shape(path, module, "lora_B", layer, value, (d_out, rank))
            b[layer] = np.asarray(value, np.float32).T * np.float32(scaling)
        weights[ours] = (a, b)
    return LoRAAdapter(str(path), rank, float(scaling), weights)


def _check_shape(path: Path, module: str, half: str, layer: int, value, want) -> None:
    if tuple(value.shape) != want:
        _fail(path, f"{module}.{half} of layer {layer} has shape {tuple(value.shape)}, but "
                    f"the base model and r={want[0] if half == 'lora_A' else want[1]} need "
                    f"{want} ([r, in] for lora_A, [out, r] for lora_B)")
