"""EngineConfig: every engine setting, in its group (`config.cache.page_size`,
`config.scheduler.max_num_seqs`), built from the flat keywords the CLI and LLM(...) take.

Each setting has one name: its group field's, its CLI flag's (`--page-size`) and its LLM(...)
keyword's. from_kwargs() places each flat keyword in its group, converts sizes given with a unit
and validates; as_kwargs() is the way back. Frozen plain data; no jax import.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import NamedTuple

from jaxserve.config import compatibility
from jaxserve.config.groups import (CacheConfig, ModelSettings, ParallelConfig, RunnerConfig,
                                    SchedulerConfig, SpeculativeConfig)
from jaxserve.config.lora import LoRAConfig
from jaxserve.config.settings import parse_size

_BUCKETS = ("token_buckets", "seq_buckets")  # any iterable of sizes; kept sorted and unique


class Setting(NamedTuple):
    """One engine setting: its group's attribute name on EngineConfig, its field (name, default,
    documentation in metadata) and its type."""
    group: str
    field: dataclasses.Field
    type: object


@dataclass(frozen=True)
class EngineConfig:
    model: ModelSettings = dataclasses.field(default_factory=ModelSettings)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)
    runner: RunnerConfig = dataclasses.field(default_factory=RunnerConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    # the flat names the caller set (from_kwargs' keywords, replace's changes); not compared
    explicit: frozenset = dataclasses.field(default=frozenset(), compare=False)

    def __post_init__(self):
        for name, cls in GROUPS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"EngineConfig({name}=...) takes a {cls.__name__}, not "
                                f"{getattr(self, name)!r}; flat settings go through "
                                "EngineConfig.from_kwargs(...)")

    def validate(self) -> "EngineConfig":
        for name in GROUPS:
            getattr(self, name).validate()
        compatibility.check_engine(self)
        return self

    def is_explicit(self, name: str) -> bool:
        """Whether the caller set flat setting `name`: given to from_kwargs / replace, or (a
        config built from groups directly) different from the field's default."""
        s = _SETTINGS[name]
        return name in self.explicit or getattr(getattr(self, s.group), name) != s.field.default

    @staticmethod
    def settings() -> list[Setting]:
        """Every setting, group by group: the CLI's flags and docs/cli.md's table."""
        return list(_SETTINGS.values())

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """The validated config from flat settings (`page_size=32`); unset ones keep their
        defaults. Sizes take bytes or a string with a unit ('4GiB')."""
        unknown = sorted(set(kwargs) - set(_SETTINGS))
        if unknown:
            raise TypeError(f"unknown engine setting(s): {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(_SETTINGS))}")
        per_group: dict[str, dict] = {name: {} for name in GROUPS}
        for name, value in kwargs.items():
            s = _SETTINGS[name]
            if s.field.metadata.get("cli_plain_unit") and isinstance(value, str):
                value = parse_size(value)  # "4GiB"; a plain int is bytes
            if name in _BUCKETS and value is not None:
                value = tuple(sorted(set(int(b) for b in value)))
            per_group[s.group][name] = value
        return cls(**{name: GROUPS[name](**values) for name, values in per_group.items()},
                   explicit=frozenset(n for n, v in kwargs.items() if v is not None)).validate()

    def as_kwargs(self) -> dict:
        """Every setting by its flat name: from_kwargs(**config.as_kwargs()) == config."""
        return {name: getattr(getattr(self, s.group), name) for name, s in _SETTINGS.items()}

    def replace(self, **changes) -> "EngineConfig":
        """A validated copy with some flat settings changed (`config.replace(num_pages=64)`)."""
        config = type(self).from_kwargs(**{**self.as_kwargs(), **changes})
        return dataclasses.replace(config, explicit=self.explicit | frozenset(changes))


GROUPS: dict[str, type] = {  # attribute name -> group class
    name: cls for name, cls in typing.get_type_hints(EngineConfig).items() if name != "explicit"}


def _settings() -> dict[str, Setting]:
    found: dict[str, Setting] = {}
    for group, cls in GROUPS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in found:
                raise TypeError(f"setting {f.name!r} is in both {found[f.name].group} and "
                                f"{group}: a flat keyword must name one field")
            found[f.name] = Setting(group, f, hints[f.name])
    return found


_SETTINGS = _settings()  # flat name -> Setting, group by group
