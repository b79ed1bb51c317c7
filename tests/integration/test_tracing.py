"""One generate request is one trace: spans from all four services, each hop parented by the last.

The services export over OTLP (the standard OTEL_* variables), HTTP/protobuf or gRPC, to a
receiver in this test.
"""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)

from services.stack import free_port
from shared.client import JetserveClient
from shared.protocol import Completion, GenerateRequest
from tests.integration.conftest import running_stack


CALLER_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN_ID = "b7ad6b7169203331"
CALLER_TRACEPARENT = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"


class OtlpReceiver:
    """Collects spans exported over OTLP/HTTP (posted to /v1/traces) or, with `grpc`, over
    OTLP/gRPC, as dicts of service, name, trace id, span id, parent id, times and attributes."""

    def __init__(self, grpc: bool = False):
        self.spans: list[dict] = []
        self.grpc = grpc
        receiver = self
        if grpc:
            self._serve_grpc()
            return

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.take(ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _serve_grpc(self) -> None:
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceResponse,
        )

        receiver = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 (the proto's name)
                receiver.take(request)
                return ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def take(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes
                           if a.key == "service.name")
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.append(dict(
                        service=service, name=span.name, trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(), parent_id=span.parent_span_id.hex(),
                        start=span.start_time_unix_nano, end=span.end_time_unix_nano,
                        attributes={a.key: getattr(a.value, a.value.WhichOneof("value"))
                                    for a in span.attributes}))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What points a service at this receiver (with spans exported every 100 ms)."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc" if self.grpc else "http/protobuf"}

    def close(self):
        if self.grpc:
            self.server.stop(grace=None)
        else:
            self.server.shutdown()


@pytest.mark.asyncio
@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
async def test_one_request_is_one_trace_across_all_four_services(tmp_path, protocol):
    receiver = OtlpReceiver(grpc=protocol == "grpc")
    try:
        async with running_stack(tmp_path, env=receiver.env) as stack:
            async with await JetserveClient.connect(stack.url, tenant="traced") as client:
                completion = await client.generate(
                    GenerateRequest(request_id="traced-1", prompt="Trace me", max_tokens=4),
                    timeout=30)
                assert isinstance(completion, Completion)
                # A caller's own trace context joins the request to the caller's trace.
                request = GenerateRequest(request_id="traced-2", prompt="Join me", max_tokens=2)
                await client.nc.request("llm.generate.traced", msgspec.json.encode(request),
                                        headers={"traceparent": CALLER_TRACEPARENT}, timeout=30)
                names = {"admission", "priority.queue", "batcher.route", "executor.generate",
                         "prefill", "decode"}
                for _ in range(100):  # exported in batches every 100 ms
                    if len([s for s in receiver.spans if s["name"] == "decode"]) == 2:
                        break
                    await asyncio.sleep(0.1)
    finally:
        receiver.close()

    admission = next(s for s in receiver.spans
                     if s["name"] == "admission" and s["trace_id"] != CALLER_TRACE_ID)
    trace = [s for s in receiver.spans if s["trace_id"] == admission["trace_id"]]
    by_name = {s["name"]: s for s in trace}
    assert set(by_name) == names, sorted(by_name)
    assert {s["service"] for s in trace} == {"admission", "priority", "batcher", "executor"}
    assert admission["parent_id"] == ""  # the client sent no trace context: admission is the root
    for child, parent in [("priority.queue", "admission"), ("batcher.route", "priority.queue"),
                          ("executor.generate", "batcher.route"), ("prefill", "executor.generate"),
                          ("decode", "executor.generate")]:
        assert by_name[child]["parent_id"] == by_name[parent]["span_id"], child
    assert by_name["prefill"]["end"] <= by_name["decode"]["start"] + 1_000_000
    assert by_name["priority.queue"]["start"] <= by_name["executor.generate"]["start"]
    # The score is on the queue span with its terms, and in the Completion.
    queued = by_name["priority.queue"]["attributes"]
    assert queued["priority_score"] == completion.scheduling.priority_score
    terms = ("score.base", "score.urgency", "score.resource", "score.fairness")
    assert queued["priority_score"] == pytest.approx(sum(queued[t] for t in terms))
    assert queued["score.base"] == 5.0 and queued["score.aged"] == 0.0
    assert queued["overtaking_pull"] is False
    assert queued["queue_wait_ms"] == completion.scheduling.queue_wait_ms >= 0

    joined = [s for s in receiver.spans if s["trace_id"] == CALLER_TRACE_ID]
    assert {s["name"] for s in joined} == names
    assert next(s for s in joined if s["name"] == "admission")["parent_id"] == CALLER_SPAN_ID
