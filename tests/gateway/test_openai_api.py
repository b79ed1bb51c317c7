"""OpenAI request bodies in jetserve's terms (no I/O): what is taken, how, and the 400s."""

from __future__ import annotations

import pytest

from services.gateway.openai_api import ApiError, api_error, chat_request, completion_request
from shared.protocol import Error

SERVED = ["smol"]


def chat(**fields):
    return chat_request({"model": "smol", "messages": [{"role": "user", "content": "hi"}],
                         **fields}, SERVED, "r1")


def test_vllm_priority_lower_is_earlier_becomes_jetserve_s_higher_is_earlier():
    assert chat().priority == 5  # none sent: jetserve's default
    assert chat(priority=0).priority == 5  # vLLM's default
    assert chat(priority=-3).priority == 8 and chat(priority=2).priority == 3
    assert chat(priority=-100).priority == 10 and chat(priority=100).priority == 0


def test_fields_are_taken_as_openai_and_vllm_clients_send_them():
    request = chat(max_completion_tokens=7, temperature=0, top_p=0.5, seed=3, stop="\n",
                   top_k=0, min_p=0.1, ignore_eos=True, stop_token_ids=[2], stream=True,
                   stream_options={"include_usage": True}, user="u", presence_penalty=0,
                   logprobs=False, n=1, frequency_penalty=None)
    assert (request.max_tokens, request.temperature, request.top_p, request.seed) == \
        (7, 0.0, 0.5, 3)
    assert request.stop == ["\n"] and request.stop_token_ids == [2] and request.top_k == -1
    assert request.ignore_eos and request.stream and request.min_p == 0.1
    assert chat().max_tokens == 256 and chat(max_tokens=9).max_tokens == 9


def test_message_content_parts_and_roles():
    request = chat_request({"model": "smol", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]}, SERVED, "r1")
    # Text parts joined by a newline, as vLLM joins them.
    assert [(m.role, m.content) for m in request.messages] == [("system", "be brief"),
                                                                ("user", "a\nb")]
    # An earlier reply as the OpenAI SDK dumps it: its null fields are absent.
    request = chat_request({"model": "smol", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": None,
         "function_call": None, "audio": None, "annotations": None},
        {"role": "user", "content": "again"}]}, SERVED, "r1")
    assert [m.content for m in request.messages] == ["hi", "hello", "again"]
    with pytest.raises(ApiError) as caught:
        chat_request({"model": "smol", "messages": [
            {"role": "assistant", "content": "x", "tool_calls": []}]}, SERVED, "r1")
    assert caught.value.param == "messages[0].tool_calls"
    with pytest.raises(ApiError) as caught:
        chat_request({"model": "smol", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}, SERVED, "r1")
    assert caught.value.param == "messages[0].content[0]"


def test_completion_prompts():
    assert completion_request({"model": "smol", "prompt": "hi"}, SERVED, "r").prompt == "hi"
    assert completion_request({"model": "smol", "prompt": ["hi"]}, SERVED, "r").prompt == "hi"
    assert completion_request({"model": "smol", "prompt": [1, 2]}, SERVED,
                              "r").prompt_token_ids == [1, 2]
    with pytest.raises(ApiError) as caught:
        completion_request({"model": "smol", "prompt": ["a", "b"]}, SERVED, "r")
    assert caught.value.param == "prompt" and "one prompt" in caught.value.message
    for ids in ([1, -5], [1, 2**40]):  # token ids out of range: said so, not "a batch"
        with pytest.raises(ApiError) as caught:
            completion_request({"model": "smol", "prompt": ids}, SERVED, "r")
        assert caught.value.param == "prompt" and "token ids must be from 0" in caught.value.message
    with pytest.raises(ApiError) as caught:
        completion_request({"model": "smol", "prompt": "hi", "echo": True}, SERVED, "r")
    assert caught.value.param == "echo"


@pytest.mark.parametrize("fields, param, status", [
    ({"model": "gpt-4"}, "model", 404), ({"model": None}, "model", 400),
    ({"n": 3}, "n", 400), ({"temperature": "hot"}, "temperature", 400),
    ({"max_tokens": 0}, "max_tokens", 400), ({"seed": -1}, "seed", 400),
    ({"stop": [""]}, "stop", 400), ({"stop": 5}, "stop", 400),
    ({"messages": []}, "messages", 400), ({"messages": "hi"}, "messages", 400),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", 400),
    ({"stream_options": {"include_usage": True, "x": 1}}, "stream_options", 400),
    ({"logit_bias": {"5": 1}}, "logit_bias", 400), ({"tool_choice": "auto"}, "tool_choice", 400),
    ({"ignore_eos": "yes"}, "ignore_eos", 400), ({"stop_token_ids": [-1]}, "stop_token_ids", 400),
])
def test_bad_fields_are_named(fields, param, status):
    with pytest.raises(ApiError) as caught:
        chat(**fields)
    assert (caught.value.param, caught.value.status) == (param, status)
    assert caught.value.body()["error"]["param"] == param


def test_jetserve_errors_become_http_statuses():
    limited = api_error(Error(request_id="r", code="rate_limited", message="slow down",
                              retry_after_ms=1500))
    assert limited.status == 429 and limited.headers() == {"Retry-After": "2"}
    assert limited.body()["error"]["type"] == "rate_limit_error"
    for code, status in (("invalid_request", 400), ("prompt_too_long", 400),
                         ("overloaded", 503), ("deadline_exceeded", 504), ("internal", 500)):
        assert api_error(Error(request_id="r", code=code, message="m")).status == status


def test_harmless_numbers_are_taken_whatever_their_json_type():
    """vLLM's own client sends `repetition_penalty: 1.0`; a bool is never a number."""
    assert chat(repetition_penalty=1.0, presence_penalty=0.0, best_of=1).max_tokens == 256
    with pytest.raises(ApiError) as caught:
        chat(best_of=True)
    assert caught.value.param == "best_of"
    with pytest.raises(ApiError) as caught:
        chat(repetition_penalty=1.1)
    assert caught.value.param == "repetition_penalty"
