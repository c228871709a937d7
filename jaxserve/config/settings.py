"""The parts every settings group is made of: `setting()` (a field with its documentation),
`parse_size()` (sizes with units), `need()` (one validation check) and the choice lists.

No jax import, no defaults that depend on the device (those are resolved by the runner, e.g.
dtype="auto").
"""

from __future__ import annotations

import dataclasses

PREEMPTION_MODES = ("recompute", "swap")
BATCHING_MODES = ("continuous", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's names; fp8 is fp8_e4m3; auto: the activation dtype (jaxserve/model/quant/kv.py)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
QUANTIZATIONS = ("none", "int8", "int4")  # jaxserve/model/quant/formats.py
LAYER_LOOPS = ("auto", "scan", "unroll")
SPECULATIVE_METHODS = ("ngram", "draft")
CPU_KERNEL_MODES = ("auto", "off")  # jaxserve/model/cpu/ffi.py
INT8_ACTIVATION_MODES = ("auto", "on", "off")  # jaxserve/model/quant/select.py
DEQUANT_FORMS = ("auto", "chunked", "fused")   # jaxserve/model/quant/select.py
SIZE_UNITS = {"b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20,
              "mb": 10**6, "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40,
              "tb": 10**12}


def parse_size(text: str | int | float, plain_unit: str = "B") -> int:
    """Bytes from '4GiB', '512MiB', '1.5G' (binary), '2GB' (decimal) or a plain number in
    plain_unit (vLLM's unit for the same flag: --swap-space 4 is 4 GiB)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        number, unit = float(text), plain_unit
    else:
        t = str(text).strip().lower().replace(" ", "")
        digits = t.rstrip("abcdefghijklmnopqrstuvwxyz")
        number, unit = digits, t[len(digits):] or plain_unit
        try:
            number = float(number)
        except ValueError:
            raise ValueError(f"{text!r} is not a size: expected a number with an optional "
                             f"unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)") from None
    scale = SIZE_UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(f"{text!r}: unknown size unit {unit!r}; known: B, KiB, MiB, GiB, "
                         "TiB (also K, M, G, T) and KB, MB, GB, TB")
    if number < 0:
        raise ValueError(f"{text!r} is not a size: negative")
    return int(number * scale)


def setting(default, help: str, *, unit: str | None = None, choices=None, vllm: str = "",
            cli_plain_unit: str | None = None, cli_alias: tuple[str, ...] = ()):
    """A field with its documentation: the CLI's help, docs/cli.md's table and errors read it.

    unit: what a number means (tokens, bytes, ...); cli_plain_unit: sizes only, the unit of a
    plain number on the command line (vLLM's for the same flag; the Python API takes bytes or a
    string with a unit); vllm: vLLM's name for the same setting ("=" when it is the same);
    cli_alias: extra flag spellings (vLLM's)."""
    return dataclasses.field(default=default, metadata=dict(
        help=help, unit=unit, choices=choices, vllm=vllm, cli_plain_unit=cli_plain_unit,
        cli_alias=cli_alias))


def need(ok: bool, name: str, value, limit: str) -> None:
    """One check of validate(): the error names the setting as the CLI and LLM(...) spell it."""
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: must be {limit}")
