"""The architecture families jaxserve runs, looked up by name or by a config.json's identity.

Adding an architecture: a new file here declaring its `Family` (what differs from Llama), listed
in FAMILIES, and a tests/test_arch_<name>.py checking it against transformers. This package is
data only; it must not import jax.
"""

from __future__ import annotations

from jaxserve.model.families import (gemma3, gpt_oss, llama, mistral, mixtral, phi3, qwen2, qwen3,
                                     qwen3_moe)
from jaxserve.model.families.base import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (
    llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma3.FAMILY, phi3.FAMILY,
    qwen3_moe.FAMILY, mixtral.FAMILY, gpt_oss.FAMILY)}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unsupported architecture {name!r}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return FAMILIES[name]


def family_for_hf(architectures: list | None, model_type: str | None) -> Family:
    """The family a config.json names, by its architectures list first, else its model_type."""
    for family in FAMILIES.values():
        if architectures and architectures[0] in family.hf_architectures:
            return family
    if not architectures:
        for family in FAMILIES.values():
            if model_type in family.model_types:
                return family
    names = sorted(a for f in FAMILIES.values() for a in f.hf_architectures)
    raise ValueError(f"unsupported architecture {architectures or model_type!r}; supported: "
                     f"{', '.join(names)}")
