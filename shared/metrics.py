"""Prometheus metrics: each service serves `/metrics` on its own port (`monitoring.metrics_port`,
one per service kind, `--metrics-port` per process, 0 turns it off).

Names follow vLLM's (`vllm:num_requests_running` is `jetserve:num_requests_running` here) where
vLLM has one, so existing dashboards and alerts carry over; the pipeline's own metrics (queue per
priority, tenants, executors alive, requeues) use the same prefix. What a service already counts
for `$SRV.STATS` is read at scrape time by a collector, so the step loop pays nothing for it; the
rest are counter increments and histogram observations off the step loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from typing import Literal, NamedTuple
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import structlog
from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector

log = structlog.get_logger()

PREFIX = "jetserve:"
SCRAPE_TIMEOUT_S = 5.0  # a service whose event loop does not answer in this long fails the scrape
TENANT_LABELS_MAX = 100  # distinct tenant label values; later tenants are counted as "other"

# Buckets as vLLM's, in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def counter(name: str, doc: str, labels: Iterable[str] = ()) -> Counter:
    return Counter(PREFIX + name, doc, list(labels))


def histogram(name: str, doc: str, labels: Iterable[str], buckets: tuple[float, ...]) -> Histogram:
    return Histogram(PREFIX + name, doc, list(labels), buckets=buckets)


class Reading(NamedTuple):
    """One value a service reads out at scrape time (StatsCollector)."""

    kind: Literal["gauge", "counter"]
    name: str  # without the `jetserve:` prefix (and a counter's without `_total`)
    doc: str
    value: float
    labels: dict[str, str] = {}


class StatsCollector(Collector):
    """Gauges and counters read at scrape time from a function that returns Readings, in the
    default registry from creation to `unregister`. Scrapes arrive on the metrics thread; `read`
    runs on the event loop that made the collector, so it sees the service's state between two
    of its steps, never halfway through a change."""

    def __init__(self, read: Callable[[], list[Reading]]):
        self.read = read
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None
        REGISTRY.register(self)

    def unregister(self) -> None:
        REGISTRY.unregister(self)

    def _rows(self) -> list[Reading]:
        if self.loop is None or not self.loop.is_running():
            return self.read()

        async def read():
            return self.read()

        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(SCRAPE_TIMEOUT_S)

    def describe(self) -> Iterable[Metric]:
        return []  # names are only known at scrape time; nothing to check at registration

    def collect(self) -> Iterable[Metric]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for kind, name, doc, value, labels in self._rows():
            family = families.get(name)
            if family is None:
                cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                family = families[name] = cls(PREFIX + name, doc, labels=list(labels))
            family.add_metric(list(labels.values()), value)
        return list(families.values())


class TenantLabels:
    """A tenant's label value: its name for the first TENANT_LABELS_MAX tenants seen, then
    "other". Tenant names come from clients' subjects, and every label value is a series
    Prometheus keeps: unbounded, a client could make any number."""

    def __init__(self):
        self.seen: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self.seen or len(self.seen) < TENANT_LABELS_MAX:
            self.seen.add(tenant)
            return tenant
        return "other"


class _MetricsHandler(BaseHTTPRequestHandler):
    """`/metrics` in Prometheus's classic text format, whatever the scraper's Accept header.
    prometheus-client 0.26 writes OpenMetrics sample names with label-name rules, so
    `jetserve:request_success_total` would reach Prometheus as `jetserve_request_success_total`
    (while its HELP and TYPE lines keep the colon); the text format keeps the names as made."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path.split("?")[0] not in ("/", "/metrics"):
            self.send_error(404)
            return
        body = generate_latest(REGISTRY)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass  # a scrape every few seconds is not news


def serve_metrics(port: int, service: str) -> None:
    """Serve the default registry on `port` (0: not at all), on a thread of its own. A port
    already taken is logged and the service runs on without metrics: they are not worth losing
    requests over."""
    if not port:
        return
    try:
        server = ThreadingHTTPServer(("", port), _MetricsHandler)
    except OSError as exc:
        log.error("metrics port unavailable; serving without /metrics",
                  port=port, key=f"monitoring.metrics_port.{service}", error=str(exc))
        return
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
