"""Prometheus /metrics of every service, read with the client library's own text parser while a
small load runs: counters move, histograms fill, gauges agree with $SRV.STATS."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jetserve_kernels.cpu_ops import native_bf16
from services.stack import free_port
from shared.bus import discover
from shared.client import JetserveClient
from shared.protocol import Completion, Delta, Error, GenerateRequest
from tests.integration.conftest import running_stack

pytestmark = pytest.mark.asyncio

KINDS = ("admission", "priority", "batcher", "executor")


async def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from one service's /metrics."""
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return response.read().decode()

    text = await asyncio.to_thread(get)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name: str, **labels) -> float:
    """The one sample of `name` whose labels include `labels`."""
    found = [v for (n, ls), v in samples.items()
             if n == name and labels.items() <= dict(ls).items()]
    assert len(found) == 1, (name, labels, found)
    return found[0]


async def executor_stats(nc) -> dict:
    [stats] = await discover(nc, "STATS", "executor", wait_s=0.3)
    return next(ep["data"] for ep in stats["endpoints"] if ep.get("data"))


async def test_every_service_serves_metrics_that_follow_the_load(tmp_path):
    ports = {kind: free_port() for kind in KINDS}
    settings = {f"monitoring.metrics_port.{kind}": port for kind, port in ports.items()}
    settings["kv_cache.compress_below_priority"] = 5  # two KV pools; the long requests: int8
    async with running_stack(tmp_path, settings=settings) as stack, \
            await JetserveClient.connect(stack.url, tenant="metered") as client:
        labels = {"model_name": "dummy:tiny", "executor": "executor-0"}
        # Three long requests run; the gauges say so, as $SRV.STATS does.
        long = [asyncio.create_task(client.generate(GenerateRequest(
            request_id=f"long-{i}", prompt_token_ids=[20, 21, 22], max_tokens=1500,
            ignore_eos=True, priority=1), timeout=60)) for i in range(3)]
        for _ in range(100):
            stats = await executor_stats(client.nc)
            if stats["running"] == 3:
                break
            await asyncio.sleep(0.05)
        executor = await scrape(ports["executor"])
        after = await executor_stats(client.nc)
        assert value(executor, "jetserve:num_requests_running", **labels) == 3
        assert value(executor, "jetserve:num_requests_waiting", **labels) == 0
        # The caches fill as the three decode: the scrape lies between the stats around it.
        usage = value(executor, "jetserve:kv_cache_usage_perc", **labels)
        assert 0 < stats["kv_usage"] - 1e-4 <= usage <= after["kv_usage"] + 1e-4 < 1
        # The first pool holds the model's dtype: bf16 where the CPU has native bf16, else fp32.
        model_dtype = "bfloat16" if native_bf16() else "float32"
        assert [p["dtype"] for p in after["kv_pools"]] == [model_dtype, "int8"]
        assert value(executor, "jetserve:kv_pool_usage_perc", pool=model_dtype, **labels) == 0
        assert value(executor, "jetserve:kv_pool_usage_perc", pool="int8", **labels) > usage
        for i in range(3):
            await client.cancel(f"long-{i}")
        await asyncio.gather(*long)

        before = await scrape(ports["executor"])

        def short(i: int) -> GenerateRequest:
            return GenerateRequest(request_id=f"short-{i}", prompt_token_ids=list(range(20, 60)),
                                   max_tokens=8, ignore_eos=True)

        # One first, so the other three find its prompt in the prefix cache.
        done = [await client.generate(short(0), timeout=30)]
        done += await asyncio.gather(*(client.generate(short(i), timeout=30) for i in (1, 2, 3)))
        assert all(isinstance(c, Completion) for c in done), done
        bad = await client.generate(GenerateRequest(prompt="hi", max_tokens=10**9), timeout=10)
        assert isinstance(bad, Error)
        streamed = [out async for out in client.stream(GenerateRequest(
            request_id="streamed", prompt_token_ids=[30, 31], max_tokens=8, ignore_eos=True,
            stream=True))]
        deltas = sum(isinstance(out, Delta) for out in streamed)
        assert isinstance(streamed[-1], Completion) and deltas >= 2

        executor = await scrape(ports["executor"])

        def moved(name: str, **more) -> float:
            """How far a series moved; one that did not exist before started at 0."""
            earlier = [v for (n, ls), v in before.items()
                       if n == name and {**labels, **more}.items() <= dict(ls).items()]
            return value(executor, name, **labels, **more) - sum(earlier)

        assert moved("jetserve:request_success_total", finished_reason="length") == 5
        assert moved("jetserve:generation_tokens_total") == 5 * 8
        assert moved("jetserve:prompt_tokens_total") == 4 * 40 + 2  # as vLLM: hits included
        block = 16  # the default block size; a cache hit leaves the last token to compute
        hits = 3 * ((40 - 1) // block * block)
        assert moved("jetserve:prefill_tokens_computed_total") == 4 * 40 + 2 - hits
        assert moved("jetserve:prefix_cache_queries_total") == 4 * 40 + 2
        assert moved("jetserve:prefix_cache_hits_total") == hits
        for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                          "request_queue_time_seconds", "request_time_per_output_token_seconds"):
            assert moved(f"jetserve:{histogram}_count") == 5, histogram
        # Only the streamed request had deltas: one interval between each two.
        assert moved("jetserve:inter_token_latency_seconds_count") == deltas - 1
        assert moved("jetserve:e2e_request_latency_seconds_sum") > 0
        assert value(executor, "jetserve:num_requests_running", **labels) == 0
        assert value(executor, "jetserve:request_success_total", **labels,
                     finished_reason="cancelled") == 3

        admission = await scrape(ports["admission"])
        assert value(admission, "jetserve:admitted_requests_total", tenant="metered",
                     durable="false") == 8
        assert value(admission, "jetserve:rejected_requests_total", tenant="metered",
                     code=bad.code) == 1
        priority = await scrape(ports["priority"])
        assert value(priority, "jetserve:priority_queue_wait_seconds_count", priority="5") == 5
        assert value(priority, "jetserve:priority_queue_wait_seconds_count", priority="1") == 3
        assert value(priority, "jetserve:priority_dispatched_total") == 8
        for _ in range(50):  # the executors' reports ride on heartbeats
            priority = await scrape(ports["priority"])
            served = value(priority, "jetserve:tenant_served_tokens_total", tenant="metered",
                           kind="prompt")
            if served == 3 * 3 + 4 * 40 + 2:
                break
            await asyncio.sleep(0.1)
        assert served == 3 * 3 + 4 * 40 + 2
        batcher = await scrape(ports["batcher"])
        assert value(batcher, "jetserve:executors_alive") == 1
        assert value(batcher, "jetserve:batcher_assigned_total") == 8


async def test_prometheus_scrapes_the_projects_scrape_config(tmp_path):
    """Prometheus itself, with deploy/prometheus.yml's jobs pointed at this host's ports, scrapes
    every service (the gateway on its HTTP port) and answers a query for a jetserve series."""
    import json
    import shutil
    import subprocess
    import urllib.parse
    from pathlib import Path

    import yaml

    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no `prometheus` on PATH (Debian: apt-get install prometheus; CI does)")
    ports = {kind: free_port() for kind in KINDS}
    http_port = free_port()
    config = yaml.safe_load((Path(__file__).parents[2] / "deploy" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    for job in config["scrape_configs"]:
        kind = job["job_name"].removeprefix("jetserve-")
        del job["dns_sd_configs"]  # compose's DNS names, made local
        port = http_port if kind == "gateway" else ports[kind]
        job["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert jobs == {f"jetserve-{kind}" for kind in (*KINDS, "gateway")}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    web = free_port()
    settings = {f"monitoring.metrics_port.{kind}": port for kind, port in ports.items()}
    settings["kv_cache.compress_below_priority"] = 5  # two KV pools; the long requests: int8
    prometheus = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def query(expr: str) -> list:
        url = f"http://127.0.0.1:{web}/api/v1/query?query={urllib.parse.quote(expr)}"
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())["data"]["result"]

    try:
        async with running_stack(tmp_path / "stack", settings=settings,
                                 http_port=http_port) as stack, \
                await JetserveClient.connect(stack.url, tenant="scraped") as client:
            completion = await client.generate(GenerateRequest(
                prompt_token_ids=[20, 21, 22], max_tokens=4, ignore_eos=True), timeout=30)
            assert isinstance(completion, Completion)
            for _ in range(100):
                try:
                    success = await asyncio.to_thread(query, "jetserve:request_success_total")
                    up = await asyncio.to_thread(query, "up")
                except OSError:  # not listening yet
                    success, up = [], []
                if success and len(up) == len(jobs) and all(s["value"][1] == "1" for s in up):
                    break
                await asyncio.sleep(0.2)
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)
    assert {s["metric"]["job"] for s in up} == jobs
    assert all(s["value"][1] == "1" for s in up), up
    [series] = success
    assert series["metric"]["model_name"] == "dummy:tiny"
    assert series["metric"]["executor"] == "executor-0"
    assert (series["metric"]["finished_reason"], series["value"][1]) == ("length", "1")
