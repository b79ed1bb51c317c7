"""What an executor's heartbeat carries stays within one message, however many tenants it serves."""

from types import SimpleNamespace

import msgspec

from services.executor.service import ExecutorService
from shared.bus import payload_budget
from shared.config import load_config
from shared.messages import encode


def test_the_tenant_load_report_keeps_to_a_quarter_of_a_message_busiest_first():
    config = load_config(None, {"JETSERVE_MODEL__NAME": "dummy:tiny",
                                "JETSERVE_MONITORING__METRICS": "false"})
    service = ExecutorService(config, nc=None, js=None, tracer=None, name="e")
    # 20,000 tenants with 64-byte names: about 1.4 MB, more than a whole 1 MiB message.
    tenants = [f"{i:064d}" for i in range(20_000)] + ["busy"] * 7
    service.running = {i: SimpleNamespace(item=SimpleNamespace(tenant=t))
                       for i, t in enumerate(tenants)}
    report = service.tenants_report()
    assert len(msgspec.msgpack.encode(report)) <= payload_budget(None) // 4
    assert report["busy"] == 7 and 3000 < len(report) < 20_000
    heartbeat = service.heartbeat(step_ms=1.0)
    assert len(encode(heartbeat)) < payload_budget(None)


def test_a_client_gone_is_noticed_however_far_apart_its_deltas_are():
    """"No responders" answers to a gone client's deltas, 2 s apart (slow steps): one
    absence from the first, so it is gone after client_gone_after_s (3 s). Each was a new
    absence when they came more than 1 s apart. Deltas that reached it in between (a gap of
    several of its intervals) start a new one."""
    from services.executor.service import absent_since

    unheard = None
    for now in (10.0, 12.0, 14.0):
        first = absent_since(unheard, now, interval=2.0)
        unheard = (first, now)
    assert first == 10.0 and now - first >= 3.0
    assert absent_since((10.0, 14.0), 20.0, interval=2.0) == 20.0  # back in between
    assert absent_since((10.0, 10.5), 11.0, interval=0.05) == 10.0  # fast deltas, as before
    assert absent_since((10.0, 10.5), 12.0, interval=0.05) == 12.0
