"""Placement: puts the model, the KV pages and the step on a device mesh by model/sharding's rules.

`Placement(None, config)` is the single-device path (plain arrays, no shardings); with a mesh,
every weight is written straight into its NamedSharding (each device receives only its shard,
never a full copy on one device), the KV pages are sharded on KV heads, attention runs under
shard_map (each device attends with its own heads, which is also what lets a Pallas kernel run
sharded), a mixture-of-experts FFN runs under shard_map too (each device computes the routed
pairs of its experts and its share of their width, then a psum over the mesh combines them:
model/decoder/moe_shard.py), and the step's outputs are pinned: packed tokens replicated, KV in its
sharding, so every call reuses one executable. `load_model` restores a jaxserve (Orbax)
checkpoint straight into the shardings. The same code runs on one host or many (multi-process
arrays are built from each process's local shards). This module decides no shardings itself
(sharding.py does) and never runs a step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxserve.model.decoder import sharding
from jaxserve.model.decoder.attention import AttentionShape, PagedAttention, get_attention
from jaxserve.model.config import ModelConfig
from jaxserve.model.decoder.decoder import Llama, init_kv_cache
from jaxserve.model.decoder.moe_shard import local_experts
from jaxserve.model.quant.qlinear import QArray
from jaxserve.model.quant.formats import QuantizedTensor

log = logging.getLogger(__name__)


def load_model(spec: str, mesh: Mesh | None, *, progress: bool = True,
               quantization: str = "none", int8_per_channel: bool = False, cache_dir=None):
    """loader.load_model, except that a jaxserve checkpoint is restored into the mesh's
    shardings, quantized matrices as stored (other formats come back as host arrays, a GGUF's
    blocks mapped to `quantization`'s form, or per channel with int8_per_channel, kept in
    cache_dir for the next load; Placement shards them)."""
    from pathlib import Path

    from jaxserve.model.loaders import checkpoint
    from jaxserve.model.loaders.loader import load_model as load_host
    from jaxserve.model.loaders.loader import quantize

    path = Path(spec).expanduser()
    if mesh is None or spec == "default" or not checkpoint.is_checkpoint(path):
        return load_host(spec, progress=progress, quantization=quantization,
                         int8_per_channel=int8_per_channel, cache_dir=cache_dir)
    config = ModelConfig.load(path)
    shardings = sharding.param_shardings(config, mesh, checkpoint.quantized_stand_ins(path))
    return quantize(checkpoint.load_checkpoint(path, shardings=shardings), quantization,
                    int8_per_channel)


def param_of(path, shapes) -> tuple[str | None, str | None, int | None]:
    """NNX state path -> (param name in param_shapes() layout, quantized part or None, layer
    index or None).

    ('embed',) -> ('embed', None, None); ('layers', 'wq') -> ('layers.wq', None, None) (stacked,
    "scan"); ('layers', 3, 'wq') -> ('layers.wq', None, 3) (per-layer, "unroll");
    ('layers', 3, 'wq', 'scale') -> ('layers.wq', 'scale', 3) (a quantized matrix's part).
    """
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    layer = next((k for k in keys if isinstance(k, int)), None)
    name = ".".join(str(k) for k in keys if not isinstance(k, int))
    base, _, part = name.rpartition(".")
    if name not in shapes and base in shapes:
        return base, part, layer
    return name, None, layer


def _stand_in(value):
    """A zero-stride host stand-in of a param (float, or quantized with its parts' dtypes)."""
    zeros = lambda a: np.broadcast_to(np.zeros((), a.dtype), a.shape)
    if isinstance(value, QuantizedTensor):
        return dataclasses.replace(value, q=zeros(value.q), scale=zeros(value.scale),
                                   zero=None if value.zero is None else zeros(value.zero))
    return np.broadcast_to(np.zeros((), np.float32), value.shape)


def _put(source, index: int | None, sharding_: NamedSharding, dtype) -> jax.Array:
    """source (numpy or jax, stacked layout), sliced at layer `index`, cast, in `sharding_`."""
    if isinstance(source, jax.Array):  # e.g. restored into shardings: slice/cast on device
        take = (lambda a: a[index]) if index is not None else (lambda a: a)
        return jax.jit(lambda a: take(a).astype(dtype), out_shardings=sharding_)(source)
    host = np.asarray(source if index is None else source[index])
    return jax.make_array_from_callback(
        host.shape, sharding_, lambda idx: np.asarray(host[idx]).astype(dtype))


class Placement:
    def __init__(self, mesh: Mesh | None, config: ModelConfig):
        self.mesh, self.config = mesh, config
        if mesh is not None:
            sharding.check_tensor_parallel(config, *sharding.parallel_sizes(mesh))

    @property
    def tensor_parallel_size(self) -> int:
        return 1 if self.mesh is None else sharding.parallel_sizes(self.mesh)[0]

    @property
    def expert_parallel_size(self) -> int:
        return 1 if self.mesh is None else sharding.parallel_sizes(self.mesh)[1]

    def model(self, params: dict, dtype, layer_loop: str, kv_scales=None, quant_form=None):
        """(graphdef, state) of Llama(config, params), each weight in its sharding; kv_scales:
        the fp8 KV pages' [2, L] scales (None: 1.0), replicated; quant_form: how quantized
        matrices are multiplied (model/quant/select.py)."""
        if self.mesh is None:
            return nnx.split(Llama(self.config, params, dtype, layer_loop, kv_scales=kv_scales,
                                   quant_form=quant_form))
        shapes = self.config.param_shapes()
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        stacked = sharding.param_specs(self.config, tp, expert_parallel_size=ep)
        per_layer = sharding.param_specs(self.config, tp, per_layer=True,
                                         expert_parallel_size=ep)
        for name, value in params.items():
            if isinstance(value, QuantizedTensor):
                stacked[name] = sharding.quantized_specs(self.config, name, value, tp,
                                                         expert_parallel_size=ep)
                per_layer[name] = sharding.quantized_specs(self.config, name, value, tp,
                                                           per_layer=True,
                                                           expert_parallel_size=ep)
        experts = None
        if self.config.num_experts:
            experts = ShardedExperts(self.mesh, tuple(
                (key, _frozen(per_layer[f"layers.{key}"])) for key in sharding.EXPERT_KEYS
                if f"layers.{key}" in per_layer))
        # The graph and the non-weight variables (RoPE frequencies) come from a model built on
        # the host over zero-stride stand-ins; the weights are then placed shard by shard.
        stand_ins = {name: _stand_in(params[name]) for name in shapes}
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            graphdef, host_state = nnx.split(Llama(self.config, stand_ins, dtype, layer_loop,
                                                   experts=experts, kv_scales=kv_scales,
                                                   quant_form=quant_form))
        replicated = sharding.replicated(self.mesh)

        def place(path, leaf):
            name, part, layer = param_of(path, shapes)
            if name not in shapes:  # not a weight: replicate the value the model computed
                return _put(np.asarray(leaf), None, replicated, leaf.dtype)
            spec = stacked[name] if layer is None else per_layer[name]
            source = params[name]
            if part is not None:  # a quantized matrix's q / scale / zero, in its own dtype
                spec, source = spec[part], getattr(source, part)
            return _put(source, layer, NamedSharding(self.mesh, spec), leaf.dtype)

        state = jax.tree_util.tree_map_with_path(place, host_state)
        del host_state
        return graphdef, state

    def kv_cache(self, num_pages: int, page_size: int, dtype) -> tuple[jax.Array, jax.Array]:
        """Zeroed K and V pages [L, N, page_size, Hkv, Dh], made in place on their devices."""
        if self.mesh is None:
            return init_kv_cache(self.config, num_pages, page_size, dtype)
        c = self.config
        shape = (c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim)
        zeros = _zeros(shape, jnp.dtype(dtype), self.kv_sharding)
        return zeros(), zeros()

    def lora_shardings(self, targets, per_layer: bool) -> dict | None:
        """{target: (A's sharding, B's sharding)} of the LoRA stacks (model/decoder/sharding.py's
        lora_specs), or None without a mesh."""
        if self.mesh is None:
            return None
        specs = sharding.lora_specs(self.config, targets, self.tensor_parallel_size, per_layer,
                                    self.expert_parallel_size)
        return {name: (NamedSharding(self.mesh, a), NamedSharding(self.mesh, b))
                for name, (a, b) in specs.items()}

    @property
    def kv_sharding(self) -> NamedSharding | None:
        return None if self.mesh is None else sharding.kv_sharding(self.mesh)

    def attention(self, impl: str, page_size: int, dtype=None, kv_dtype=None,
                  device=None) -> PagedAttention:
        """The attention backend for this placement's model in `dtype` with pages of `kv_dtype`
        (None: unknown, the kernel's shape limits unchecked); with a mesh, each device attends
        with its own heads (q and K/V pages split on heads, the prepared metadata replicated).
        device: a DeviceDescription to select for (default: this process's device)."""
        c, tp = self.config, self.tensor_parallel_size
        name = lambda dt: None if dt is None else jnp.dtype(dt).name
        shape = AttentionShape(group=c.num_heads // c.num_kv_heads,
                               num_kv_heads=c.num_kv_heads // tp, page_size=page_size,
                               sliding_windows=getattr(c, "sliding_windows", (None,)),
                               head_dim=c.head_dim, dtype=name(dtype), kv_dtype=name(kv_dtype),
                               sinks=c.family.attention_sinks)
        backend = get_attention(impl, shape, device)
        return backend if self.mesh is None else _ShardedAttention(backend, self.mesh)

    def jit_shardings(self, num_caches: int = 1, with_out: bool = True,
                      processor_state: bool = False, adapters: tuple = ()) -> dict:
        """jax.jit keywords for a step -> (out, kv): out (packed tokens) replicated, kv one
        (K, V) pair or a tuple of num_caches pairs, each in the KV sharding; with_out False:
        the step returns (None, kv). processor_state: kv is (KV pair, the logits processors'
        four arrays, batch tokens, page tables by slot; all but the KV replicated). adapters: the
        shardings of the entries kv ends with (a step's adapter stacks: lora/device.py's
        `shardings`, None where no adapter is served; (): kv has no such entry)."""
        if self.mesh is None:
            return {}
        pair = (self.kv_sharding, self.kv_sharding)
        kv = pair if num_caches == 1 else (pair,) * num_caches
        if processor_state:  # (KV, processors, batch tokens, page tables), plain steps
            kv = (kv, (self.replicated,) * 4, self.replicated, self.replicated, *adapters)
        elif adapters:
            kv = (kv, *adapters)
        return {"out_shardings": (sharding.replicated(self.mesh) if with_out else None, kv)}

    @property
    def replicated(self) -> NamedSharding | None:
        return None if self.mesh is None else sharding.replicated(self.mesh)


@functools.lru_cache(maxsize=None)
def _zeros(shape: tuple[int, ...], dtype, sharding: NamedSharding):
    """One jitted maker of zeros per (shape, dtype, sharding): a KV pool made again (the
    rollout API's wake_up) reuses the executable its first making compiled."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


class _ShardedAttention:
    """A backend run per device under shard_map; prepare() runs once, replicated, outside."""

    def __init__(self, backend: PagedAttention, mesh: Mesh):
        self.backend, self.mesh = backend, mesh

    def prepare(self, metadata, num_tokens: int):
        return self.backend.prepare(metadata, num_tokens)

    def __call__(self, q, k_pages, v_pages, layer, prepared, *, sinks=None, **static):
        """sinks ([Hq], or None) goes in split like q's heads, so each device's backend gets
        the sinks of its own heads."""
        q_spec = sharding.activation_spec("q", self.mesh)
        out_spec = sharding.activation_spec("attention_out", self.mesh)
        kv_spec = sharding.kv_sharding(self.mesh).spec
        rep = sharding.activation_spec("step_input")
        args, specs = (q, k_pages, v_pages, layer, prepared), (q_spec, kv_spec, kv_spec, rep, rep)
        if sinks is not None:
            args, specs = args + (sinks,), specs + (sharding.activation_spec("sinks", self.mesh),)

        def attend(q, k_pages, v_pages, layer, prepared, sinks=None):
            return self.backend(q, k_pages, v_pages, layer, prepared, sinks=sinks, **static)

        per_device = jax.shard_map(attend, mesh=self.mesh, in_specs=specs, out_specs=out_spec,
                                   check_vma=False)
        return per_device(*args)


def _frozen(spec):
    """A param's per-layer spec, hashable (a quantized one's {part: spec} as sorted pairs): it
    lives in the model's graph definition."""
    return tuple(sorted(spec.items())) if isinstance(spec, dict) else spec


@dataclasses.dataclass(frozen=True)
class ShardedExperts:
    """moe.moe_mlp's experts_fn on a mesh: the routed pairs (replicated, like the hidden state)
    go to every device under shard_map with each expert weight in its own sharding; each device
    computes its experts' pairs over its share of their width (moe_shard.local_experts) and a
    psum over every mesh axis sums the shares. Plain tensor parallelism: every device holds
    every expert, a share of each one's width; expert parallelism: a device of group g (mesh
    axis "ep") holds experts [g * E / N, (g + 1) * E / N), each cut tp / N ways over "tp"."""

    mesh: Mesh
    specs: tuple  # ((layer key, per-layer spec, or a quantized one's (part, spec) pairs), ...)

    def __call__(self, x, weights, experts, w: dict, config):
        specs = dict(self.specs)
        local = {key: w[key] for key in specs if key in w}
        in_specs = {key: _spec_of(local[key], specs[key]) for key in local}
        ep = sharding.parallel_sizes(self.mesh)[1]
        num_local = config.num_experts // ep

        def per_device(x, weights, experts, local):
            group = jax.lax.axis_index(sharding.EP_AXIS) if ep > 1 else 0
            out = local_experts(x, weights, experts, local, config,
                                first_expert=group * num_local, num_local=num_local,
                                owns_down_bias=jax.lax.axis_index(sharding.TP_AXIS) == 0)
            return jax.lax.psum(out, self.mesh.axis_names)

        rep = sharding.activation_spec("step_input")
        return jax.shard_map(per_device, mesh=self.mesh, in_specs=(rep, rep, rep, in_specs),
                             out_specs=rep, check_vma=False)(x, weights, experts, local)


def _spec_of(value, spec):
    """shard_map's in_spec of one expert weight: its PartitionSpec, or a QArray of its parts'."""
    if isinstance(value, QArray):
        parts = dict(spec)
        return dataclasses.replace(value, q=parts["q"], scale=parts["scale"],
                                   zero=None if value.zero is None else parts["zero"])
    return spec
