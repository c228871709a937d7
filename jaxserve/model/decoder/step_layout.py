"""StepLayout: a plain step's inputs as views of one int32 buffer, sent to the device as one array.

A plain step reads some thirty small arrays (step_inputs.StepInputs). Handed to the executable
one by one, each is a separate pytree leaf, argument and host-to-device transfer on every step.
A StepLayout, one per bucket, gives every field but the grammar bitmask a fixed place in one
int32 buffer (float32 and uint32 fields by their bits, bool fields one word each, 0 or 1):
runner/prepare_inputs.py writes the fields through numpy views of a fresh copy of the layout's
all-padding template (so the same code fills it as a plain StepInputs), and the step receives
(buffer, bitmask) and slices the fields back out (runner/packed_inputs.py). The bitmask stays
its own array: it is [S, ceil(V / 32)] words, most steps have no grammar and send a
device-resident one instead.

Plain data and numpy: this module must not import jax (model/decoder/pytrees.py registers
PackedStepInputs as a pytree; the layout is its static part). On the host the bool fields are
int32 views (0 / 1): code that fills them writes True / False and reads them as truth values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from jaxserve.model.decoder.step_inputs import StepInputs

BITMASK = ("sampling", "grammar_bitmask")  # the one field kept as its own array


@dataclass(frozen=True)
class LaidOutField:
    path: tuple[str, str]  # (StepInputs field, field of that dataclass)
    offset: int            # in words
    shape: tuple[int, ...]
    dtype: str             # the field's numpy dtype name (bool: one int32 word each, 0 / 1)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _words(value: np.ndarray) -> np.ndarray:
    """A field's values as int32 words: bools as 0 / 1, 4-byte types by their bits."""
    if value.dtype == np.bool_:
        return value.astype(np.int32).reshape(-1)
    if value.dtype.itemsize != 4:
        raise TypeError(f"step input of dtype {value.dtype}: only 4-byte types and bool pack")
    return np.ascontiguousarray(value).reshape(-1).view(np.int32)


class StepLayout:
    """Where each field of bucket (T, S)'s StepInputs (device page tables) lies in the buffer."""

    def __init__(self, t: int, s: int, max_pages: int, mask_words: int = 1):
        template = StepInputs.empty(t, s, max_pages, mask_words, device_tables=True)
        self.shape = (t, s)
        self.mask_shape = (s, mask_words)
        fields, parts, offset = [], [], 0
        self._groups = []  # (StepInputs field, its class, packed field names, None field names)
        for group in dataclasses.fields(template):
            part = getattr(template, group.name)
            packed, absent = [], []
            for f in dataclasses.fields(part):
                value = getattr(part, f.name)
                if value is None or (group.name, f.name) == BITMASK:
                    absent.append(f.name)
                    continue
                fields.append(LaidOutField((group.name, f.name), offset, value.shape,
                                           value.dtype.name))
                parts.append(_words(value))
                offset += value.size
                packed.append(f.name)
            self._groups.append((group.name, type(part), tuple(packed), tuple(absent)))
        self.fields = tuple(fields)
        self.size = offset
        # new()'s work per field: (path, start, end, dtype to view as, shape to reshape to)
        self._slices = [(f.path, f.offset, f.offset + f.size,
                         None if f.dtype in ("int32", "bool") else np.dtype(f.dtype),
                         None if len(f.shape) == 1 else f.shape) for f in fields]
        self._template = np.concatenate(parts)
        self._key = (self.shape, self.mask_shape, self.fields)

    def __eq__(self, other) -> bool:
        return isinstance(other, StepLayout) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"StepLayout(T, S={self.shape}, {self.size} words)"

    def new(self, with_bitmask: bool = True) -> "PackedStepInputs":
        """All-padding inputs in a fresh buffer, with their host views to fill. with_bitmask
        False: no [S, W] bitmask yet (None; runner/prepare_inputs.py makes one for a step that
        has a grammar, the runner sends a device-resident one otherwise): W is ceil(V / 32)
        words, a few MiB a step at large vocabularies and batches."""
        words = self._template.copy()
        views = {}
        for path, start, end, dtype, shape in self._slices:
            view = words[start:end]
            if dtype is not None:
                view = view.view(dtype)
            views[path] = view if shape is None else view.reshape(shape)
        bitmask = np.full(self.mask_shape, -1, np.int32) if with_bitmask else None
        return PackedStepInputs(words, bitmask, self, self.assemble(views, bitmask))

    def assemble(self, values: dict[tuple[str, str], object], bitmask) -> StepInputs:
        """A StepInputs of `values` by field path (numpy views on the host, traced arrays in
        the step); the fields the layout leaves out are None, the bitmask is `bitmask`."""
        parts = {}
        # (instances made without __init__'s argument parsing: step_inputs.py's classes are
        # plain dataclasses, without __post_init__ or slots)
        for name, cls, packed, absent in self._groups:
            part = parts[name] = object.__new__(cls)
            fields = part.__dict__
            for field in packed:
                fields[field] = values[(name, field)]
            for field in absent:
                fields[field] = None
            if name == BITMASK[0]:
                fields[BITMASK[1]] = bitmask
        inputs = object.__new__(StepInputs)
        inputs.__dict__.update(parts)
        return inputs


@dataclass
class PackedStepInputs:
    """What a plain step receives: the buffer, the bitmask, and (static) their layout. `views`
    is the host's StepInputs over `words` (None on the device side: it is not sent)."""

    words: np.ndarray            # [layout.size] i32
    # [S, W] i32; None from runner/prepare_inputs.py when no row has a grammar (the runner then
    # sends a device-resident one)
    grammar_bitmask: np.ndarray | None
    layout: StepLayout
    views: StepInputs | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.layout.shape


def layouts_for(shapes, max_pages: int, mask_words: int) -> dict[tuple[int, int], StepLayout]:
    """One layout per (T, S) bucket."""
    return {shape: StepLayout(*shape, max_pages, mask_words) for shape in shapes}
