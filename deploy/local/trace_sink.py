"""Stands in for Jaeger where its image cannot be pulled: receives OTLP/HTTP trace exports on
4318 (`POST /v1/traces`, protobuf, what jetserve's services send) and lists what it received as
JSON on 16686 (`GET /api/spans`, optionally `?service=NAME`): service, span name, trace and span
ids, parent id. It keeps the latest 100,000 spans in memory; nothing else of Jaeger is here."""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

MAX_SPANS = 100_000
MAX_BODY = 64 << 20
spans: deque[dict] = deque(maxlen=MAX_SPANS)


def take(request: ExportTraceServiceRequest) -> None:
    for resource_spans in request.resource_spans:
        service = next((a.value.string_value for a in resource_spans.resource.attributes
                        if a.key == "service.name"), "")
        for scope in resource_spans.scope_spans:
            for span in scope.spans:
                spans.append({"service": service, "name": span.name,
                              "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                              "parent_id": span.parent_span_id.hex()})


class Handler(BaseHTTPRequestHandler):
    def reply(self, content_type: str, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class Receiver(Handler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        if self.path != "/v1/traces":
            self.send_error(404, "only /v1/traces is served")
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self.send_error(411, "a Content-Length is required")
            return
        if not 0 < length <= MAX_BODY:
            self.send_error(413, f"a body of 1 to {MAX_BODY} bytes is taken")
            return
        try:
            take(ExportTraceServiceRequest.FromString(self.rfile.read(length)))
        except Exception:  # not an OTLP export: say so, keep serving
            self.send_error(400, "not an OTLP/HTTP protobuf trace export")
            return
        self.reply("application/x-protobuf", ExportTraceServiceResponse().SerializeToString())


class Query(Handler):
    def do_GET(self):  # noqa: N802
        url = urlparse(self.path)
        if url.path != "/api/spans":
            self.send_error(404, "only /api/spans is served")
            return
        service = (parse_qs(url.query).get("service") or [None])[0]
        self.reply("application/json", json.dumps(
            [s for s in list(spans) if service is None or s["service"] == service]).encode())


def main() -> None:
    # PID 1 in a container gets no default SIGTERM action: stop at once when told to.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    query = ThreadingHTTPServer(("0.0.0.0", 16686), Query)
    threading.Thread(target=query.serve_forever, daemon=True).start()
    print("trace sink: OTLP/HTTP on :4318, spans on :16686/api/spans", flush=True)
    ThreadingHTTPServer(("0.0.0.0", 4318), Receiver).serve_forever()


if __name__ == "__main__":
    main()
