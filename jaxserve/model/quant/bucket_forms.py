"""Which form each token bucket multiplies per-channel int8 matrices in, on the CPU: chosen
from timings measured on this machine at warm-up, kept beside the compile cache so that a
restart over the same cache reads the choice instead of measuring again.

Why per bucket: on a CPU the fastest form depends on the step's row count. With few rows a
step reads every weight once and does little arithmetic, so int8 activations through
jaxserve's kernel (the weights read as stored) win; with many rows it is arithmetic, where the
two-level int8 activations do twice float32's multiply-adds and a dequantize-then-dot (one
convert per weight, then XLA's float dot) can be faster. Where the cross-over lies depends on
the CPU (AVX-512 VNNI or only AVX2, cache sizes, cores), so it is measured, never assumed.

The candidates (`candidates`): "int8-kernel" (int8 activations, jaxserve's int8 kernel),
"int8-xla" (int8 activations, XLA's int8 dot), "dequantize" (the weights dequantized next to
a float dot, in the runner's dequant form). `choose` picks the fastest of each bucket's
timings (ties: the earlier candidate). `select` reads a stored choice whose key matches, else
calls `measure` per bucket, chooses and stores the result (atomically, owner-only directory:
quant_cache.usable). This module only chooses and remembers: it must not import jax or time
anything itself (model/quant/measure.py does).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Callable, Mapping

from jaxserve.model.quant.select import MatmulForm

log = logging.getLogger(__name__)
VERSION = 1
SUBDIR = "jaxserve-int8-forms"  # inside the compile cache directory (model_runner)
NAMES = ("int8-kernel", "int8-xla", "dequantize")


def candidates(base: MatmulForm, kernel_available: bool) -> dict[str, MatmulForm]:
    """The forms worth timing, by name; base: the runner's form (its dequant form is kept).
    Without the kernel "int8-kernel" would be XLA's dot again, so it is left out."""
    forms = {"int8-kernel": MatmulForm(True, base.chunked, True),
             "int8-xla": MatmulForm(True, base.chunked, False),
             "dequantize": MatmulForm(False, base.chunked)}
    if not kernel_available:
        del forms["int8-kernel"]
    return forms


def fastest(timings: Mapping[str, float]) -> str:
    """The name with the least time; of equal times the first in `timings`' order."""
    if not timings:
        raise ValueError("no timings to choose from")
    return min(timings, key=lambda name: (timings[name], list(timings).index(name)))


def choose(timings: Mapping[int, Mapping[str, float]]) -> dict[int, str]:
    """{token bucket: the fastest candidate} from {token bucket: {candidate: seconds}}."""
    return {int(t): fastest(per) for t, per in timings.items()}


def key(fingerprint: Mapping) -> str:
    """The stored choice's name: a hash of everything the timings depend on (the CPU and its
    flags, library versions, threads, the matrices' shapes and formats, buckets, candidates)."""
    text = json.dumps({"fingerprint": fingerprint, "version": VERSION}, sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _path(cache_dir: str | Path, name: str) -> Path:
    return Path(cache_dir) / SUBDIR / f"{name}.json"


def load(cache_dir: str | Path | None, name: str) -> dict | None:
    """The stored record {"forms": {T: name}, "timings_s": {...}}, or None (none, unreadable,
    or in a directory quant_cache.usable refuses)."""
    if cache_dir is None:
        return None
    from jaxserve.model.quant import cache as quant_cache
    if quant_cache.usable(Path(cache_dir) / SUBDIR) is not None:
        return None
    try:
        record = json.loads(_path(cache_dir, name).read_text())
        forms = {int(t): str(f) for t, f in record["forms"].items()}
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None
    if not all(f in NAMES for f in forms.values()):
        return None
    return {**record, "forms": forms}


def save(cache_dir: str | Path | None, name: str, record: dict) -> None:
    """Write `record` as the choice `name` (best effort: a failure is logged, not raised)."""
    if cache_dir is None:
        return
    from jaxserve.model.quant import cache as quant_cache
    root = Path(cache_dir) / SUBDIR
    problem = quant_cache.usable(root)
    if problem is not None:
        log.warning("the int8 form per bucket is not kept: %s", problem)
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=root)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
        os.replace(tmp, _path(cache_dir, name))
    except OSError as exc:
        log.warning("the int8 form per bucket could not be kept in %s: %s", root, exc)


def select(buckets: Mapping[int, object], names: tuple[str, ...], fingerprint: Mapping,
           cache_dir: str | Path | None,
           measure: Callable[[object], Mapping[str, float]]) -> tuple[dict[int, str], dict]:
    """({token bucket: chosen name}, the record): read where a stored record's key matches,
    else measure(buckets[T]) -> {name: seconds} for each T (names only), chosen and stored.
    The record says where it came from ("measured" or "cached") for the log."""
    name = key({**fingerprint, "buckets": {str(t): buckets[t] for t in sorted(buckets)},
                "candidates": list(names)})
    stored = load(cache_dir, name)
    if stored is not None and set(stored["forms"]) == set(buckets):
        return stored["forms"], {**stored, "source": "cached"}
    timings = {t: {n: float(s) for n, s in measure(buckets[t]).items() if n in names}
               for t in sorted(buckets)}
    forms = choose(timings)
    record = {"forms": {str(t): f for t, f in forms.items()},
              "timings_s": {str(t): per for t, per in timings.items()}}
    save(cache_dir, name, record)
    return forms, {**record, "forms": forms, "source": "measured"}


def describe(forms: Mapping[int, str], record: Mapping) -> str:
    """One log line: each bucket's form and, where measured, every candidate's milliseconds."""
    timings = record.get("timings_s", {})
    parts = []
    for t in sorted(forms):
        per = timings.get(str(t), timings.get(t, {}))
        times = ", ".join(f"{n} {1e3 * per[n]:.1f} ms" for n in NAMES if n in per)
        parts.append(f"T={t} {forms[t]}" + (f" ({times})" if times else ""))
    return "; ".join(parts)
