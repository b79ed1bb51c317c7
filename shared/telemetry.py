"""OpenTelemetry tracing: one trace per request, W3C trace context carried in NATS headers.

Spans are exported over OTLP when the standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or
`..._TRACES_ENDPOINT`) variable is set, over HTTP/protobuf or, with
`OTEL_EXPORTER_OTLP_PROTOCOL=grpc` (or `..._TRACES_PROTOCOL`), gRPC; otherwise they are still
made, so context propagates. `OTEL_SERVICE_NAME` overrides the service's own name.
"""

from __future__ import annotations

import os

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind

__all__ = ["SpanKind", "Span", "setup_tracing", "context_from", "context_of", "carrier_of", "shutdown_tracing"]


def setup_tracing(service_name: str) -> trace.Tracer:
    env = os.environ
    service_name = env.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    exporting = (env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                 or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    if exporting and env.get("OTEL_SDK_DISABLED", "").lower() != "true":
        protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                    or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return trace.get_tracer(service_name)


def shutdown_tracing() -> None:
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()  # flushes spans still batched


# The most of a client's `tracestate` carried on (as the gateway takes it): the context rides
# with the request in every hop's headers and in its WorkItem, inside ENVELOPE_BYTES.
MAX_TRACESTATE_CHARS = 512


def context_from(carrier: dict[str, str] | None) -> otel_context.Context:
    """The trace context a message carries (NATS headers or a WorkItem's `trace`); a
    `tracestate` longer than MAX_TRACESTATE_CHARS is left out (the trace itself goes on)."""
    carrier = carrier or {}
    if len(carrier.get("tracestate", "")) > MAX_TRACESTATE_CHARS:
        carrier = {k: v for k, v in carrier.items() if k != "tracestate"}
    return extract(carrier)


def context_of(span: Span) -> otel_context.Context:
    """A context whose current span is `span`: the parent for spans made beside it."""
    return trace.set_span_in_context(span)


def carrier_of(span: Span, headers: dict[str, str] | None = None) -> dict[str, str]:
    """`headers` (or a new dict) with the W3C `traceparent` of `span` added."""
    carrier = dict(headers or {})
    inject(carrier, context=trace.set_span_in_context(span))
    return carrier
