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
