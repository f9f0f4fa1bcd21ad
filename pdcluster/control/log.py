"""Process-wide logging: human text or JSON lines, tagged with the node id and the request id.

The request id comes from `logger.info(..., extra={"request_id": rid})` or, for everything logged
while a request is being handled, from the `request_id` context variable (`with bind_request_id(rid):`).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from typing import Iterator, TextIO

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdcluster_request_id", default=None)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(node_id)s %(name)s: %(message)s%(rid_suffix)s"


@contextlib.contextmanager
def bind_request_id(rid: str) -> Iterator[None]:
    """Tag every log record emitted in this context (task) with `rid`."""
    token = request_id.set(rid)
    try:
        yield
    finally:
        request_id.reset(token)


class _ContextFilter(logging.Filter):
    """Adds node_id and request_id (from `extra` or the context variable) to every record."""

    def __init__(self, node_id: str):
        super().__init__()
        self.node_id = node_id

    def filter(self, record: logging.LogRecord) -> bool:
        record.node_id = self.node_id
        rid = getattr(record, "request_id", None)
        if rid is None:
            rid = record.request_id = request_id.get()
        record.rid_suffix = f" [rid={rid}]" if rid else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, node_id, request_id (when set), exc."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "node_id": getattr(record, "node_id", ""),
        }
        rid = getattr(record, "request_id", None)
        if rid:
            entry["request_id"] = rid
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def setup_logging(level: str | int = "INFO", fmt: str = "text", node_id: str = "",
                  stream: TextIO | None = None) -> logging.Handler:
    """Configure the root logger once per process (replacing earlier handlers set here); returns the handler."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log_format: {fmt!r} is not one of text, json")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(_ContextFilter(node_id))
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        formatter = logging.Formatter(TEXT_FORMAT)
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    handler._pdcluster = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_pdcluster", False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    # Chatty third-party loggers that otherwise drown the node's own lines at INFO.
    for name in ("grpc", "aetcd", "asyncio", "httpx"):
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    return handler
