import pytest

from shared.protocol import ProtocolError, decode_generate_request


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
