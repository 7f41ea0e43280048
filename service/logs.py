"""structlog set-up: readable console lines on a terminal, JSON lines otherwise."""

from __future__ import annotations

import logging
import sys

import structlog
from structlog.tracebacks import ExceptionDictTransformer


def configure_logging(level: str = "info", json: bool | None = None) -> None:
    """Route structlog (and stdlib logging) to stderr at `level`."""
    json = not sys.stderr.isatty() if json is None else json
    # an exception is logged with its type, message and frames, never its locals (they hold tenants' prompts)
    if json:
        exceptions = [structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False))]
        renderer = structlog.processors.JSONRenderer()
    else:
        exceptions = []
        renderer = structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            *exceptions,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        # one write per line, newline included: print() writes the text and its newline apart, and with
        # PYTHONUNBUFFERED each is a write(2), so a line from another writer on the same stream (the
        # Dynamo runtime's Rust logger) could land between them and glue two lines into one
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
