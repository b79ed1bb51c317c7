"""structlog setup: JSON lines in containers, console on a terminal; trace ids on every line."""

from __future__ import annotations

import logging
import sys

import structlog
from opentelemetry import trace

from shared.config import MonitoringSection


def _add_trace_id(_, __, event: dict) -> dict:
    span_context = trace.get_current_span().get_span_context()
    if span_context.is_valid:
        event["trace_id"] = format(span_context.trace_id, "032x")
    return event


def setup_logging(service: str, monitoring: MonitoringSection) -> None:
    as_json = monitoring.log_format == "json" or (
        monitoring.log_format == "auto" and not sys.stderr.isatty())
    level = getattr(logging, monitoring.log_level.upper())
    renderer = (structlog.processors.JSONRenderer() if as_json
                else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True), _add_trace_id,
                    structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True)
    # Libraries that log through the standard module (the engine, nats) go to the same stream.
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")
