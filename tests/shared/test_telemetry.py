"""Trace context from a client's headers: what is carried on."""

from opentelemetry import trace

from shared.telemetry import MAX_TRACESTATE_CHARS, context_from

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_long_tracestate_is_left_out_and_the_trace_goes_on():
    """It rides in every hop's headers and in the WorkItem: 8 KB of it passed the headers'
    room and, at a small max_payload, the message's."""
    kept = context_from({"traceparent": PARENT, "tracestate": "a=b"})
    assert str(trace.get_current_span(kept).get_span_context().trace_state) == "['{key=a, value=b}']"
    long = context_from({"traceparent": PARENT,
                         "tracestate": "a=" + "x" * MAX_TRACESTATE_CHARS})
    span = trace.get_current_span(long).get_span_context()
    assert format(span.trace_id, "032x") == PARENT.split("-")[1]
    assert len(span.trace_state) == 0
