"""Internal messages' bounds: what a buggy or forged one cannot carry."""

import msgspec
import pytest

from shared.messages import Heartbeat, decoder

BEAT = dict(executor="e", model="m", max_num_seqs=4, queue_depth=0, running=1, waiting=0,
            assigned_total=3, free_kv_blocks=10, total_kv_blocks=10, step_ms=12.5,
            started_at=1.0, tenants={"a": 1})


@pytest.mark.parametrize("bad", [dict(running=-1), dict(waiting=-5), dict(max_num_seqs=-1),
                                 dict(tenants={"a": -2}), dict(step_ms=1e12),
                                 dict(step_ms=-1.0)])
def test_a_heartbeat_out_of_its_bounds_is_refused_whole(bad):
    """A negative count read as room at the batcher (more pulled than an executor can take);
    a huge step time made every deadline request look hopeless at priority."""
    decode = decoder(Heartbeat).decode
    assert decode(msgspec.msgpack.encode(BEAT)) == Heartbeat(**BEAT)
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode({**BEAT, **bad}))
