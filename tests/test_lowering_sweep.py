"""Every supported family's step lowers for a TPU and for an H100, at its real shapes.

Each case builds the plain step of a family at its published size (tests/real_shapes.py, read
through transformers' config classes) with no weights (bench/abstract_step.py) and lowers it
with `lowering_platforms=("tpu",)` or `("cuda",)` on this CPU host, with the attention the engine
would select on that device for that model (a kernel, or its fallback). Lowering runs every
Python-side check of the device path, the Pallas kernels' Mosaic lowering included (shared
memory, tiling, head_dim rules); what the device's own compiler then decides is left to the
device checks (scripts/gpu_check.py, scripts/tpu_check.py).

Buckets are the per-device defaults' smallest and largest (model/device/defaults.py); the
variants (fp8 KV, int8 weights, LoRA) are turned on together in one engine, and each family
gets one bucket with them and the other without, alternating between families so that every
(bucket, variant set) pair occurs on each platform: a pairwise cover, not the full product.
A plain case lowers the published depth; a variants case one period of the family's layer
kinds (real_shapes.PERIOD, else 2 layers): every per-layer shape is the same, and the unrolled
int8 + LoRA layers are what make a lowering slow.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from real_shapes import DRAFT, FAMILIES, PERIOD, model_config  # noqa: E402
from jaxserve.model.cpu import attention as cpu_attention
from jaxserve.model.cpu import int8 as cpu_int8
from jaxserve.model.device import defaults as device_defaults  # noqa: E402
from jaxserve.model.device.select import DeviceDescription  # noqa: E402
from jaxserve.bench.abstract_step import (AbstractEngine, lower_draft_step,  # noqa: E402
                                           lower_plain_step, target_attention)

H100 = DeviceDescription("gpu", "NVIDIA H100 80GB HBM3", "9.0")
TPU_V6E = DeviceDescription("tpu", "TPU v6 lite")
TARGETS = {"cuda": H100, "tpu": TPU_V6E}
VARIANTS = dict(kv_cache_dtype="fp8", quantization="int8", max_loras=4)
KERNEL_CALL = {"cuda": "mosaic_gpu", "tpu": "tpu_custom_call"}


def buckets(device: DeviceDescription) -> tuple[tuple[int, int], tuple[int, int]]:
    """The smallest and largest (T, S) buckets of the device's defaults."""
    cls = device_defaults.chip(device)
    tokens = cls.token_buckets(cls.max_num_batched_tokens)
    shape = lambda t: (t, min(t, cls.max_num_seqs))  # noqa: E731  (runner/buckets.py's rule)
    return shape(tokens[0]), shape(tokens[-1])


def cases():
    for platform, device in TARGETS.items():
        small, large = buckets(device)
        for i, family in enumerate(FAMILIES):
            with_variants = large if i % 2 == 0 else small
            for shape in (small, large):
                variants = VARIANTS if shape == with_variants else {}
                label = "variants" if variants else "plain"
                yield pytest.param(platform, family, shape, variants,
                                   id=f"{platform}-{family}-{shape[0]}x{shape[1]}-{label}")


@pytest.mark.parametrize("platform,family,shape,variants", list(cases()))
def test_family_step_lowers(platform, family, shape, variants):
    device = TARGETS[platform]
    config = model_config(family, num_layers=PERIOD.get(family, 2) if variants else None)
    engine = AbstractEngine(config, device, max_num_seqs=shape[1], **variants)
    attention = target_attention(engine)
    text = lower_plain_step(engine, shape, platform, attention).as_text()
    if attention.uses_kernel:
        assert f"custom_call @{KERNEL_CALL[platform]}" in text, (
            f"{family} on {platform}: the selected kernel is not in the lowered step")
    assert cpu_int8.TARGET not in text and cpu_attention.TARGET not in text, (
        f"{family} on {platform}: a CPU kernel's custom call reached a device lowering")


@pytest.mark.parametrize("platform", list(TARGETS))
def test_draft_model_step_lowers(platform):
    device = TARGETS[platform]
    target = AbstractEngine(model_config("Llama-3-8B"), device, max_num_seqs=16)
    draft = AbstractEngine(model_config("Llama-3.2-1B", DRAFT), device, max_num_seqs=16)
    lowered = lower_draft_step(target, draft.config, (64, 16), 4, platform,
                               target_attention(target), target_attention(draft))
    assert lowered.as_text(), "the speculative step lowered to nothing"


def test_cover_has_every_bucket_and_variant_pair():
    """The pairwise claim of the module docstring, checked on the generated cases."""
    seen = {(p.values[0], p.values[2], bool(p.values[3])) for p in cases()}
    for platform, device in TARGETS.items():
        for shape in buckets(device):
            for with_variants in (False, True):
                assert (platform, shape, with_variants) in seen, (platform, shape, with_variants)
