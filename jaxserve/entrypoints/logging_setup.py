"""Logging for the `jaxserve` command: timestamped text or JSON lines, libraries kept quiet.

At INFO (the default) jaxserve's own records show, and other libraries' only from WARNING up:
JAX's "Unable to initialize backend 'tpu'" and similar start-up chatter are INFO records of
theirs. --log-level DEBUG shows everything. Only the command line calls configure(); importing
jaxserve as a library configures nothing. It must not import jax.
"""

from __future__ import annotations

import json
import logging
import sys

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATS = ("text", "json")
OURS = ("jaxserve", "__main__")
TEXT_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


class LibraryFilter(logging.Filter):
    """Records from outside jaxserve pass only at `floor` or above."""

    def __init__(self, floor: int):
        super().__init__()
        self.floor = floor

    def filter(self, record: logging.LogRecord) -> bool:
        ours = record.name.split(".")[0] in OURS
        return ours or record.levelno >= self.floor


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record, DATE_FORMAT) + f".{int(record.msecs):03d}",
                 "level": record.levelname, "logger": record.name,
                 "message": record.getMessage()}
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure(level: str = "INFO", fmt: str = "text", stream=None) -> None:
    """Replace the root logger's handlers with one that writes `fmt` lines to stream (stderr)."""
    level = level.upper()
    if level not in LEVELS:
        raise ValueError(f"--log-level {level!r} is invalid: must be one of {', '.join(LEVELS)}")
    if fmt not in FORMATS:
        raise ValueError(f"--log-format {fmt!r} is invalid: must be one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json"
                         else logging.Formatter(TEXT_FORMAT, DATE_FORMAT))
    numeric = getattr(logging, level)
    handler.addFilter(LibraryFilter(numeric if numeric <= logging.DEBUG
                                    else max(numeric, logging.WARNING)))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)

