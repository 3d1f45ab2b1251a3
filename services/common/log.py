"""Structured logging: constant messages, variable parts as fields, a ``subsys`` field.

    log = get_logger("allocator")
    log.info("identity allocated", id=256, labels="k8s:app=web")

JSON lines on stderr by default (one object per line), or ``key=value`` text.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_FIELDS = "palisade_fields"
_SUBSYS = "palisade_subsys"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "subsys": getattr(record, _SUBSYS, record.name),
            "msg": record.getMessage(),
        }
        out.update(getattr(record, _FIELDS, {}))
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={v}" for k, v in getattr(record, _FIELDS, {}).items())
        subsys = getattr(record, _SUBSYS, record.name)
        line = f"{record.levelname.lower():7} [{subsys}] {record.getMessage()} {fields}".rstrip()
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class Logger:
    """A logger bound to a subsystem that takes fields as keyword arguments."""

    def __init__(self, subsys: str, **bound: Any) -> None:
        self._log = logging.getLogger("palisade." + subsys)
        self._subsys = subsys
        self._bound = bound

    def bind(self, **fields: Any) -> Logger:
        return Logger(self._subsys, **{**self._bound, **fields})

    def _emit(self, level: int, msg: str, exc_info: bool, fields: dict[str, Any]) -> None:
        if self._log.isEnabledFor(level):
            extra = {_FIELDS: {**self._bound, **fields}, _SUBSYS: self._subsys}
            self._log.log(level, msg, extra=extra, exc_info=exc_info, stacklevel=3)

    def debug(self, msg: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, msg, False, fields)

    def info(self, msg: str, **fields: Any) -> None:
        self._emit(logging.INFO, msg, False, fields)

    def warning(self, msg: str, **fields: Any) -> None:
        self._emit(logging.WARNING, msg, False, fields)

    def error(self, msg: str, exc_info: bool = False, **fields: Any) -> None:
        self._emit(logging.ERROR, msg, exc_info, fields)


def get_logger(subsys: str, **bound: Any) -> Logger:
    return Logger(subsys, **bound)


def setup_logging(level: str = "info", fmt: str = "json") -> None:
    """Configure the root logger once per process."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Client libraries are chatty at INFO about reconnects we already log ourselves.
    for noisy in ("nats", "aetcd", "grpc", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
