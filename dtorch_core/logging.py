"""structlog configuration for dtorch's entry points.

Library modules only do ``log = structlog.get_logger(__name__)``; the process's entry point (the
``dtorch`` command, a worker's main, or ``dt.init()`` in a user's script when nothing else has
configured structlog) calls :func:`configure` once. Records go to stderr, so a program's own
output on stdout stays clean.

``DTORCH_LOG_LEVEL`` (``debug``, ``info``, ``warning``, ``error``, ``critical``; default
``warning``) sets the level when :func:`configure` is given none.
"""

from __future__ import annotations

import logging as _stdlib_logging
import os
import sys

import structlog

LEVEL_ENV = "DTORCH_LOG_LEVEL"
DEFAULT_LEVEL = "warning"
LEVELS = {
    "debug": _stdlib_logging.DEBUG,
    "info": _stdlib_logging.INFO,
    "warning": _stdlib_logging.WARNING,
    "warn": _stdlib_logging.WARNING,
    "error": _stdlib_logging.ERROR,
    "critical": _stdlib_logging.CRITICAL,
}


def level_from(value: str | int | None = None) -> int:
    """The numeric level for ``value``, or for ``$DTORCH_LOG_LEVEL`` (default warning) if None."""
    if value is None:
        value = os.environ.get(LEVEL_ENV, "").strip() or DEFAULT_LEVEL
    if isinstance(value, int):
        return value
    name = value.strip().lower()
    if name.isdigit():
        return int(name)
    try:
        return LEVELS[name]
    except KeyError:
        raise ValueError(
            f"unknown log level {value!r} (from the argument or {LEVEL_ENV}); "
            f"use one of {', '.join(k for k in LEVELS if k != 'warn')}"
        ) from None


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of the write (it may be replaced later,
    e.g. by pytest's capture or a redirect, and the one seen at configure time closed)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def configure(level: str | int | None = None, *, stream=None) -> None:
    """Configure structlog for this process: records at ``level`` and above, to ``stream``.

    ``level`` defaults to ``$DTORCH_LOG_LEVEL`` or ``"warning"``; ``stream`` to the current
    ``sys.stderr``. Call it from entry points only; calling it again replaces the configuration.
    """
    numeric = level_from(level)
    stream = _CurrentStderr() if stream is None else stream
    colors = bool(getattr(stream, "isatty", lambda: False)()) and "NO_COLOR" not in os.environ
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False),
            structlog.dev.ConsoleRenderer(colors=colors),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(stream),
        # not cached: a later configure() (tests, a CLI sub-command) must reach existing loggers
        cache_logger_on_first_use=False,
    )


def ensure_configured(level: str | int | None = None) -> bool:
    """:func:`configure` unless structlog was already configured (by the user or an entry point).

    For library entry points such as ``dt.init()``: a program that set up structlog itself keeps
    its set-up. Returns True if this call configured structlog.
    """
    if structlog.is_configured():
        return False
    configure(level)
    return True
