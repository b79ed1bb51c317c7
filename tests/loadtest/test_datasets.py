import json
import random

import pytest

from loadtest.datasets import (LONG_PROMPT_OUTPUT, jsonl_dataset, long_prompts, random_dataset,
                               sharegpt_dataset, shared_prefix_dataset, with_ids)


def test_random_lengths_are_in_range_and_exact():
    requests = random_dataset(50, (4, 8), (2, 3), 1000, random.Random(0))
    assert all(4 <= len(r.prompt_token_ids) <= 8 and 2 <= r.max_tokens <= 3 and r.ignore_eos
               for r in requests)
    assert all(17 <= t < 1000 for r in requests for t in r.prompt_token_ids)
    assert random_dataset(50, (4, 8), (2, 3), 1000, random.Random(0)) == requests  # seeded


def test_long_prompts_have_their_lengths_and_are_the_same_for_every_bench():
    requests = long_prompts([2048, 5, 2048], 0, 1000)
    assert [len(r.prompt_token_ids) for r in requests] == [2048, 5, 2048]
    assert [r.request_id for r in requests] == ["long-0", "long-1", "long-2"]
    assert all(r.max_tokens == LONG_PROMPT_OUTPUT and r.ignore_eos and r.temperature == 0.0
               for r in requests)
    assert all(17 <= t < 1000 for r in requests for t in r.prompt_token_ids)
    assert requests[0].prompt_token_ids != requests[2].prompt_token_ids
    assert long_prompts([2048, 5, 2048], 0, 1000) == requests  # engine_bench's and peer_bench's


def test_shared_prefix_groups():
    requests = shared_prefix_dataset(9, groups=3, prefix_len=5, suffix_range=(1, 2),
                                     output_range=(4, 4), vocab_size=1000, rng=random.Random(0))
    prefixes = [tuple(r.prompt_token_ids[:5]) for r in requests]
    assert len(set(prefixes)) == 3 and prefixes[0] == prefixes[3] == prefixes[6]
    assert len({tuple(r.prompt_token_ids) for r in requests}) == 9  # unique suffixes


def test_jsonl_is_validated_with_the_line_number(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": "hi", "max_tokens": 3}\n\n{"prompt": "x", "max_tokens": 0}\n')
    with pytest.raises(ValueError, match=r"requests.jsonl:3: .*\$\.max_tokens"):
        jsonl_dataset(path)
    path.write_text('{"prompt": "hi", "max_tokens": 3}\n{"messages": [{"role": "user", '
                    '"content": "yo"}]}\n')
    first, second = jsonl_dataset(path)
    assert first.prompt == "hi" and second.messages[0].content == "yo"


def test_sharegpt_takes_the_first_turn_and_the_reply_length(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        {"id": "1", "conversations": [{"from": "human", "value": "Tell me a joke"},
                                      {"from": "gpt", "value": "one two three four"}]},
        {"id": "2", "conversations": [{"from": "human", "value": "no reply"}]},
        {"id": "3", "conversations": [{"from": "human", "value": "long"},
                                      {"from": "gpt", "value": "word " * 50}]},
    ]))
    requests = sharegpt_dataset(path, lambda text: len(text.split()), max_output=10,
                                ignore_eos=False)
    assert [r.messages[0].content for r in requests] == ["Tell me a joke", "long"]
    assert [r.max_tokens for r in requests] == [4, 10]
    named = with_ids(requests, "run")
    assert [r.request_id for r in named] == ["run-0", "run-1"] and all(r.stream for r in named)
