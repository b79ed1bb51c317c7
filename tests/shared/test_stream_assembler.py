"""The client's rule for deltas: each token once, across a stream that restarts from index 0."""

import pytest

from shared.client import StreamAssembler
from shared.protocol import Delta


def d(index, tokens, text):
    return Delta(request_id="r", index=index, token_ids=tokens, text=text)


def test_a_resumed_stream_restates_and_only_the_rest_is_new():
    out = StreamAssembler()
    # The first executor sends tokens 0-4 ("abcde"), holding back nothing.
    assert out.add(d(0, [1, 2], "ab")) == d(0, [1, 2], "ab")
    assert out.add(d(2, [3, 4, 5], "cde")) == d(2, [3, 4, 5], "cde")
    # It dies; its last checkpoint had 3 tokens. The next one restates them, then goes on.
    assert out.add(d(0, [1, 2, 3], "abc")) is None
    assert out.add(d(3, [4, 5, 6], "def")) == d(5, [6], "f")
    assert out.add(d(6, [7], "g")) == d(6, [7], "g")
    assert out.token_ids == [1, 2, 3, 4, 5, 6, 7] and out.text == "abcdefg" and out.restarts == 1


def test_text_held_back_by_the_first_stream_is_not_lost():
    out = StreamAssembler()
    out.add(d(0, [1, 2, 3], "ab"))  # "c" held back (it could start a stop string)
    assert out.add(d(0, [1, 2, 3, 4], "abcd")) == d(3, [4], "cd")
    assert out.text == "abcd"


def test_a_gap_is_an_error():
    out = StreamAssembler()
    out.add(d(0, [1], "a"))
    with pytest.raises(ValueError, match="a gap"):
        out.add(d(3, [4], "d"))
