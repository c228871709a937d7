"""Device-check stages that need no kernel call of their own: the device probe, and decode
throughput of a random-weight model of real shapes against the HBM roofline.

`probe` records the JAX backend (the runner reads it to refuse a run without the device), the
device and its class in model/device/defaults.py (nominal bandwidth and memory), JAX's
version and what model/device/select.py picks here (attention path, dtype).

`decode` builds a Llama-3-8B-shaped model (hidden 4096, 32 query / 8 KV heads of 128, MLP
14336, vocabulary 128256) with a few layers, its weights drawn on the device in bf16 (no
download, no host-side generation: numpy would take minutes for the 128k x 4096 tables), and
times decode steps with N requests all decoding (jaxserve.bench.device_check.decode_rates)
next to the roofline bound. Without the device it uses a tiny model of the same family.
Both run in a stage process of stage_runner.py; neither writes anything outside its rows.
"""

from __future__ import annotations

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_heads=32,
                 num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                 tie_word_embeddings=False, max_position_embeddings=8192, bos_token_id=1,
                 eos_token_ids=(2,))
TINY_LLAMA = dict(LLAMA3_8B, vocab_size=512, hidden_size=128, intermediate_size=256,
                  num_heads=4, num_kv_heads=2, head_dim=32)


class IdTokenizer:
    """Token ids as text ("12 7 301"): the engine's tokenizer seat for models made here, whose
    prompts are token ids already; 0 pad, 1 BOS, 2 EOS."""

    def __init__(self, vocab_size: int, eos_token_ids=(2,)):
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(t) % self.vocab_size for t in text.split()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i < 3))

    def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
        return " ".join(m["content"] for m in messages)


def on_device(platform: str) -> bool:
    import jax

    return jax.default_backend() == platform


def probe(rec, cfg: dict) -> None:
    import jax

    from jaxserve.engine.memory_profile import device_memory_bytes
    from jaxserve.model.device import defaults as device_defaults
    from jaxserve.model.device.select import DeviceDescription, select

    backend = jax.default_backend()
    device = jax.local_devices()[0]
    description = DeviceDescription.from_device(device)
    chip = device_defaults.chip(description, device_memory_bytes(device))
    bandwidth = cfg.get("bandwidth_gbs") or chip.bandwidth_gbs
    rec.row("backend", f"{backend} (JAX {jax.__version__}, {len(jax.local_devices())} "
            "local devices)", "OK" if backend == cfg["platform"] else "NO DEVICE",
            backend=backend, jax=jax.__version__)
    rec.row("device", f"{description} as {chip.name}",
            f"nominal {bandwidth or '?'} GB/s, {chip.memory_gib or '?'} GiB",
            chip=chip.name, bandwidth_gbs=bandwidth, memory_gib=chip.memory_gib)
    selection = select()
    rec.row("selection", f"attention {selection.attention_impl}, dtype {selection.dtype}",
            "", attention_reason=selection.attention_reason,
            dtype_reason=selection.dtype_reason)


def llama3_shaped(num_layers: int, tiny: bool):
    from jaxserve.model.config import ModelConfig

    return ModelConfig(**(TINY_LLAMA if tiny else LLAMA3_8B), num_layers=num_layers,
                       name=f"random llama-3-8b-shaped x{num_layers} layers")


def random_loaded(config, seed: int = 0, scale: float = 0.02):
    """A LoadedModel of bf16 weights (norms about 1), drawn on the accelerator and brought to
    the host once as the engine's loader expects; on the CPU drawn by numpy (no compile per
    shape, as jax.random would cost there)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.model.loaders.weights import LoadedModel

    key, rng = jax.random.key(seed), np.random.default_rng(seed)
    params = {}
    for index, (name, shape) in enumerate(sorted(config.param_shapes().items())):
        if jax.default_backend() == "cpu":
            draw = rng.standard_normal(shape, np.float32).astype(jnp.bfloat16)
        else:
            draw = jax.random.normal(jax.random.fold_in(key, index), shape, jnp.bfloat16)
        value = 1 + 0.1 * draw if name.endswith("norm") else scale * draw
        params[name] = np.asarray(value, jnp.bfloat16)
        del draw, value
    return LoadedModel(config=config, params=params, source="random (drawn on the device)",
                       tokenizer=IdTokenizer(config.vocab_size, config.eos_token_ids))


def decode(rec, cfg: dict) -> None:
    import time

    import jax

    from jaxserve.bench import device_check

    device = on_device(cfg["platform"])
    layers = cfg.get("layers", 4) if device else 2
    config = llama3_shaped(layers, tiny=not device)
    start = time.perf_counter()
    loaded = random_loaded(config)
    rec.row("random model", f"{config.name}: {config.num_params() / 1e9:.2f} B parameters, "
            f"bf16, drawn in {time.perf_counter() - start:.1f} s", "",
            num_params=config.num_params(), layers=layers)
    counts = cfg.get("counts", [1, 16, 64, 256]) if device else [2]
    steps = cfg.get("steps", 32) if device else 4
    prompt_len = cfg.get("prompt_len", 128) if device else 8
    rates = device_check.decode_rates(loaded, counts, steps, prompt_len=prompt_len,
                                      bandwidth_gbs=cfg.get("bandwidth_gbs"),
                                      on_row=lambda r: rec.row(*device_check.decode_row(r), **r))
    peak = device_check.peak_memory_bytes()
    rec.row("peak device memory", "not reported by this backend" if peak is None
            else f"{peak / 2**30:.2f} GiB", "", peak_bytes=peak, backend=jax.default_backend(),
            measured=len(rates))
