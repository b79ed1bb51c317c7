import pytest

from shared.protocol import MAX_NESTING, ProtocolError, decode_cancel, decode_generate_request


@pytest.mark.parametrize("payload, needle", [
    ('{"prompt": "hi", "max_tokens": 0}', "$.max_tokens"),
    ('{"prompt": "hi", "temperature": -0.5}', "$.temperature"),
    ('{"prompt": "hi", "top_p": 0}', "$.top_p"),
    ('{"prompt": "hi", "top_p": 1.5}', "$.top_p"),
    ('{"prompt": "hi", "priority": 11}', "$.priority"),
    ('{"prompt": "hi", "colour": "red"}', "unknown field `colour`"),
    ('{"prompt": 5}', "$.prompt"),
    ('{"prompt": ""}', "`prompt` is empty"),
    ('{"max_tokens": 5}', "exactly one of"),
    ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "exactly one of"),
    ('{"messages": [{"role": "user"}]}', "content"),
    ('[1, 2]', "Expected `object`"),
    ('{"prompt": "hi"', "malformed JSON"),
    ('{"type": "delta", "prompt": "hi"}', "$.type"),
])
def test_bad_requests_name_the_problem(payload, needle):
    with pytest.raises(ProtocolError) as info:
        decode_generate_request(payload)
    assert info.value.code == "invalid_request"
    assert needle in info.value.message


def test_defaults():
    request = decode_generate_request('{"type": "generate", "prompt": "hi"}')
    assert (request.max_tokens, request.temperature, request.top_p, request.top_k) == (256, 1.0, 1.0, -1)
    assert (request.priority, request.stream, request.seed, request.stop) == (5, False, None, [])


@pytest.mark.parametrize("payload", [
    "[" * 33 + "]" * 33,
    '{"a":' * 5000 + "1" + "}" * 5000,
    '{"prompt": "hi", "stop": ' + "[" * 3000 + "]" * 3000 + "}",
])
def test_payloads_nested_past_the_limit_are_refused_naming_it(payload):
    with pytest.raises(ProtocolError) as info:
        decode_generate_request(payload)
    assert info.value.code == "invalid_request"
    assert f"more than {MAX_NESTING} levels" in info.value.message
    with pytest.raises(ProtocolError):
        decode_cancel(payload)


def test_a_string_left_open_is_scanned_once():
    """Brackets past the limit, then a string never closed, full of escaped quotes: not a
    request, refused as such. The nesting scan tried its string match again from each escaped
    quote, each time to the end: 32 KB took 5 s, this 256 KB some 5 minutes, 8 MiB (the
    gateway's body limit) days, on the event loop of the gateway or admission. Now one pass."""
    payload = '"' + "[" * (MAX_NESTING + 1) + '""' + '\\"' * (128 * 1024)
    with pytest.raises(ProtocolError) as info:
        decode_generate_request(payload)
    assert info.value.code == "invalid_request"
    # Brackets before a string left open still count.
    with pytest.raises(ProtocolError) as info:
        decode_generate_request("[" * (MAX_NESTING + 1) + '"' + '\\"' * 1000)
    assert f"more than {MAX_NESTING} levels" in info.value.message


def test_brackets_inside_strings_do_not_count_as_nesting():
    prompt = '[{' * 5000 + '\\"]' + '[' * 100
    request = decode_generate_request('{"prompt": "' + prompt + '", "stop": ["x"]}')
    assert request.prompt == prompt.replace('\\"', '"')
    # 32 levels are fine (a ProtocolError from the fields' types, not from the nesting)
    with pytest.raises(ProtocolError) as info:
        decode_generate_request('{"prompt": "hi", "stop": ' + "[" * 31 + "]" * 31 + "}")
    assert "levels" not in info.value.message


def test_an_error_quoting_the_input_quotes_at_most_a_thousand_characters():
    """An unknown field (or model) of 600 KB is named, shortened: the answer's body and its
    Nats-Service-Error header each held the whole of it, together over max_payload, and the
    server closed the connection of the service answering (again at each try)."""
    from shared.protocol import MAX_MESSAGE_CHARS, Error, service_error_headers

    with pytest.raises(ProtocolError) as info:
        decode_generate_request('{"prompt": "hi", "' + "k" * 600_000 + '": 1}')
    message = info.value.message
    assert len(message) <= MAX_MESSAGE_CHARS and "unknown field" in message
    assert message.endswith("chars)")
    header = service_error_headers(Error(request_id="r", code="invalid_request",
                                         message="x" * 600_000))
    assert len(header["Nats-Service-Error"]) <= MAX_MESSAGE_CHARS
