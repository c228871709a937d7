"""The engine's compiled steps as abstract values, lowered for a TPU or a GPU on any host.

`lower_plain_step(engine, shape, platform)` builds the plain step (runner/model_runner.py's
`plain_step`) of a model at its real shapes with no weights at all: the model is made under
`nnx.eval_shape` over ShapeDtypeStructs (int8 matrices as abstract QuantizedTensors), and
every other argument (KV pages, processor state, page tables, the bucket's packed inputs,
the LoRA stacks) is a ShapeDtypeStruct of the shape the runner would allocate. Lowering with
`lowering_platforms=(platform,)` runs every Python-side check of the accelerator path (the
Pallas kernels' Mosaic lowering included) without the device. `lower_draft_step` does the same
for a speculative step whose draft model has its own cache.

What a lowering cannot show: whether the device's compiler (libtpu, XLA's GPU backend) then
accepts the module, and how fast it runs. This module allocates nothing of the model's size,
never compiles and never runs a step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.quant import kv as kv_quant
from jaxserve.model.quant import select as quant_select
from jaxserve.model.decoder.attention import PagedAttention
from jaxserve.model.config import ModelConfig
from jaxserve.model.device.select import DeviceDescription
from jaxserve.model.decoder.decoder import Llama
from jaxserve.model.quant.formats import MATRIX_NAMES, QuantizedTensor
from jaxserve.model.decoder.step_layout import StepLayout
from jaxserve.runner.logits_processors import empty_arrays
from jaxserve.runner.model_runner import plain_step
from jaxserve.runner.tensor_parallel import Placement
from jaxserve.spec.spec_inputs import empty_spec_inputs
from jaxserve.spec.step import draft_model_step

SDS = jax.ShapeDtypeStruct


@dataclasses.dataclass(frozen=True)
class AbstractEngine:
    """The settings a compiled step's shapes depend on."""

    config: ModelConfig
    device: DeviceDescription      # the target the forms and kernels are chosen for
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"   # model/quant/kv.py's names
    quantization: str = "none"     # "none" | "int8"
    max_num_seqs: int = 256
    max_model_len: int = 8192
    page_size: int = 16
    num_pages: int = 4096
    max_loras: int = 0
    max_lora_rank: int = 16

    @property
    def kv_dtype(self):
        return kv_quant.resolve(self.kv_cache_dtype, jnp.dtype(self.dtype))

    @property
    def max_pages(self) -> int:
        return -(-self.max_model_len // self.page_size)


def abstract_params(config: ModelConfig, quantization: str = "none") -> dict:
    """{name: ShapeDtypeStruct} of the parameters; int8: each matrix as its q [..., out, in]
    int8 and per-channel scale [..., out, 1] float32, under "name.q" / "name.scale"."""
    params = {}
    for name, shape in config.param_shapes().items():
        if quantization == "int8" and name in MATRIX_NAMES:
            *lead, a, b = shape
            out, inp = (a, b) if name == "embed" else (b, a)  # matrices are stored [in, out]
            params[f"{name}.q"] = SDS((*lead, out, inp), jnp.int8)
            params[f"{name}.scale"] = SDS((*lead, out, 1), jnp.float32)
        elif quantization in ("none", "int8"):
            params[name] = SDS(shape, jnp.float32)
        else:
            raise ValueError(f"abstract steps take quantization 'none' or 'int8', "
                             f"not {quantization!r}")
    return params


def _regroup(flat: dict) -> dict:
    """Traced "name.q" / "name.scale" pairs -> QuantizedTensor params (int8 per channel)."""
    params = {}
    for key, value in flat.items():
        name, _, part = key.rpartition(".")
        if part == "q":
            params[name] = QuantizedTensor(value, flat[f"{name}.scale"], None, 8,
                                           value.shape[-1], name != "embed")
        elif part != "scale" or f"{name}.q" not in flat:
            params[key] = value
    return params


def abstract_model(config: ModelConfig, dtype, quantization: str = "none",
                   quant_form=None, layer_loop: str = "unroll"):
    """(graphdef, state of ShapeDtypeStructs) of Llama(config) with no weights made."""
    model = nnx.eval_shape(
        lambda flat: Llama(config, _regroup(flat), jnp.dtype(dtype), layer_loop,
                           quant_form=quant_form), abstract_params(config, quantization))
    return nnx.split(model)


def _kv(engine: AbstractEngine, config: ModelConfig | None = None):
    c = config or engine.config
    shape = (c.num_layers, engine.num_pages, engine.page_size, c.num_kv_heads, c.head_dim)
    return SDS(shape, engine.kv_dtype), SDS(shape, engine.kv_dtype)


def _abstract(tree):
    return jax.tree.map(lambda a: SDS(np.shape(a), np.asarray(a).dtype), tree)


def _lora_stacks(engine: AbstractEngine):
    """The resident adapters' stacks as lora/device.py's DeviceLoRA lays them out for the
    unrolled loop, traced (nothing allocated)."""
    from jaxserve.lora.device import DeviceLoRA
    return jax.eval_shape(lambda: DeviceLoRA(engine.config, engine.max_loras,
                                             engine.max_lora_rank, jnp.dtype(engine.dtype),
                                             per_layer=True).arrays)


def target_attention(engine: AbstractEngine, impl: str = "auto",
                     config: ModelConfig | None = None) -> PagedAttention:
    """The attention backend the engine would select on its device for `config` (default:
    the engine's model): runner/tensor_parallel.py's Placement.attention, told the device."""
    return Placement(None, config or engine.config).attention(
        impl, engine.page_size, jnp.dtype(engine.dtype), engine.kv_dtype, engine.device)


def lower_plain_step(engine: AbstractEngine, shape: tuple[int, int], platform: str,
                     attention: PagedAttention) -> jax.stages.Lowered:
    """The plain step of bucket shape (T, S) lowered for `platform` ("tpu" | "cuda")."""
    form = quant_select.select(device=engine.device).form
    graphdef, state = abstract_model(engine.config, engine.dtype, engine.quantization, form)
    num_slots = engine.max_num_seqs + 1
    vocab = engine.config.vocab_size
    processors = tuple(SDS((num_slots, vocab), a.dtype) for a in empty_arrays(1, vocab))
    last_tokens = SDS((num_slots,), jnp.int32)
    tables = SDS((num_slots, engine.max_pages), jnp.int32)
    caches = (_kv(engine), processors, last_tokens, tables,
              _lora_stacks(engine) if engine.max_loras else None)
    layout = StepLayout(*shape, engine.max_pages, -(-vocab // 32))
    inputs = _abstract(layout.new())
    step = functools.partial(plain_step, graphdef, attention, ())  # (no measured forms)
    return jax.jit(step).trace(state, caches, inputs).lower(lowering_platforms=(platform,))


def lower_draft_step(engine: AbstractEngine, draft: ModelConfig, shape: tuple[int, int],
                     num_speculative_tokens: int, platform: str, attention: PagedAttention,
                     draft_attention: PagedAttention) -> jax.stages.Lowered:
    """The speculative verify step with a draft model in its own cache, lowered."""
    form = quant_select.select(device=engine.device).form
    target = abstract_model(engine.config, engine.dtype, engine.quantization, form)
    drafted = abstract_model(draft, engine.dtype, "none", form)
    inputs = _abstract(empty_spec_inputs(*shape, engine.max_pages, num_speculative_tokens,
                                         True, -(-engine.config.vocab_size // 32)))
    step = functools.partial(draft_model_step, target[0], drafted[0], attention,
                             draft_attention, num_speculative_tokens, True)
    state = (target[1], drafted[1])
    kv = (_kv(engine), _kv(engine, draft))
    return jax.jit(step).trace(state, kv, inputs).lower(lowering_platforms=(platform,))

