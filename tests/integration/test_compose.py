"""compose.yaml without Docker: validated against the Compose Specification's schema, then brought
to life as host processes — its `nats-auth` command making the users, a real nats-server with
deploy/nats-server.conf, and each jetserve service of the file with its own `command` and
`environment` (service host names mapped to 127.0.0.1, published ports to free ones, the
`auth-state` volume to a folder) — whose healthchecks must pass, which serve a tenant's request
(and refuse a connection without credentials), expose /metrics, and send their spans over OTLP
to a collector standing in for Jaeger."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import nats
import nats.errors
import pytest
import yaml

from services.stack import free_port, nats_server_binary
from shared.client import JetserveClient
from shared.protocol import Completion, GenerateRequest
from shared.subjects import Subjects
from tests.integration.test_metrics import scrape, value
from tests.integration.test_tracing import OtlpReceiver

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT.parent / "shared" / "vendor" / "compose-spec.json"
JETSERVE = ("admission", "priority", "batcher", "gateway", "executor")


def post_json(url: str, body: dict, api_key: str) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_file_follows_the_compose_specification():
    if not SCHEMA.exists():
        pytest.skip(f"the Compose Specification's schema is not at {SCHEMA} (the team handbook's "
                    f"vendor/compose-spec.json beside the repository)")
    import jsonschema

    spec = compose()
    schema = json.loads(SCHEMA.read_text())  # draft 7, named without the trailing '#'
    jsonschema.Draft7Validator(schema).validate(spec)
    assert "version" not in spec
    services = spec["services"]
    assert {"nats", "jaeger", "prometheus", *JETSERVE} <= set(services)
    for name in JETSERVE:
        service = services[name]
        # The executor runs the full image; the control plane its own, without torch.
        image, target = (("jetserve:latest", None) if name == "executor"
                         else ("jetserve-control:latest", "control-plane"))
        build = service["build"]
        assert service["image"] == image
        assert (build if isinstance(build, str) else build.get("target")) == (target or ".")
        assert service["healthcheck"]["test"][:4] == ["CMD", "python", "-m", "shared.health"]
        assert service["environment"]["OTEL_SERVICE_NAME"] == name
    assert "--name" not in services["executor"]["command"]  # replicas name themselves
    gpu = services["executor-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    scrape_config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape_config["scrape_configs"]}
    assert jobs["jetserve-executor"]["dns_sd_configs"][0]["names"] == ["executor", "executor-gpu"]


CLUSTER_NODES = ("nats", "nats-2", "nats-3")


@pytest.mark.asyncio
async def test_the_cluster_override_runs_three_nodes_of_one_cluster(tmp_path):
    """deploy/compose.cluster.yaml: every jetserve service gets the three nodes and R3, each
    node its own name and store; its nats-server configuration, run as three host processes
    (compose's host names made local), forms one cluster that keeps a stream three ways."""

    from nats.js.api import StreamConfig
    from nats.js.errors import ServiceUnavailableError

    services = yaml.safe_load((ROOT / "deploy" / "compose.cluster.yaml").read_text())["services"]
    for name in (*JETSERVE, "executor-gpu"):
        environment = services[name]["environment"]
        assert environment["NATS_URL"].split(",") == [f"nats://{n}:4222" for n in CLUSTER_NODES]
        assert environment["JETSERVE_NATS__REPLICAS"] == "3"
        assert set(services[name]["depends_on"]) == set(CLUSTER_NODES)  # all three up first
    commands = [services[n]["command"] for n in CLUSTER_NODES]
    assert len({c[c.index("--name") + 1] for c in commands}) == 3
    assert len({services[n]["volumes"][0] for n in CLUSTER_NODES}) == 3  # a store each
    for node in CLUSTER_NODES:  # (paths relative to the first compose file's folder)
        assert all((ROOT / v.split(":")[0]).exists() for v in services[node]["volumes"]
                   if v.startswith("./"))
    conf = (ROOT / "deploy" / "nats-cluster.conf").read_text()
    clients, routes = [free_port() for _ in CLUSTER_NODES], [free_port() for _ in CLUSTER_NODES]
    processes = []
    try:
        for i, command in enumerate(commands):
            folder = tmp_path / f"node-{i}"
            (folder / "state" / "auth").mkdir(parents=True)
            (folder / "state" / "auth" / "users.conf").write_text("")  # (no users here)
            text = conf.replace("port: 4222", f"port: {clients[i]}").replace(
                "http_port: 8222", f"http_port: {free_port()}").replace(
                "/data", str(folder / "data")).replace(
                "0.0.0.0:6222", f"127.0.0.1:{routes[i]}")
            for host, port in zip(CLUSTER_NODES, routes):
                text = text.replace(f"nats://{host}:6222", f"nats://127.0.0.1:{port}")
            (folder / "nats-cluster.conf").write_text(text)
            argv = [str(folder / "nats-cluster.conf") if a == "/etc/nats/nats-cluster.conf"
                    else a for a in command]
            processes.append(subprocess.Popen([nats_server_binary(), *argv],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        nc = await nats.connect([f"nats://127.0.0.1:{p}" for p in clients], connect_timeout=2)
        try:
            js = nc.jetstream()
            for _ in range(100):  # until the cluster has a JetStream leader
                try:
                    await js.add_stream(StreamConfig(name="R3", subjects=["r3.>"],
                                                     num_replicas=3))
                    break
                except (ServiceUnavailableError, nats.errors.TimeoutError,
                        nats.errors.NoRespondersError):
                    await asyncio.sleep(0.2)
            info = await js.stream_info("R3")
        finally:
            await nc.close()
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=10)
    assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2, info.cluster


def host_env(environment: dict, hosts: dict[str, int], kind: str, metrics_port: int,
             state: Path) -> dict:
    """The service's compose environment with `name:port` of compose services made local, and
    the `auth-state` volume (/state) a folder."""
    env = {}
    for key, raw in environment.items():
        text = str(raw)
        for host, port in hosts.items():
            text = re.sub(rf"//{host}:\d+", f"//127.0.0.1:{port}", text)
        env[key] = re.sub(r"^/state/", f"{state}/", text)
    # (The gateway serves /metrics on its own HTTP port.)
    port_key = "JETSERVE_GATEWAY__PORT" if kind == "gateway" else \
        f"JETSERVE_MONITORING__METRICS_PORT__{kind.upper()}"
    return {**os.environ, **env, "PYTHONUNBUFFERED": "1", port_key: str(metrics_port)}


@pytest.mark.slow
@pytest.mark.asyncio
async def test_compose_services_run_as_host_processes(tmp_path):
    services = compose()["services"]
    nats_port = free_port()
    collector = OtlpReceiver()  # standing in for Jaeger's OTLP/HTTP port
    hosts = {"nats": nats_port, "jaeger": collector.port}
    ports = {kind: free_port() for kind in JETSERVE}
    # The server's configuration beside the users nats-auth makes (as compose mounts them).
    etc = tmp_path / "etc"
    state = etc / "state"
    auth = services["nats-auth"]["command"]
    assert auth[:3] == ["python", "-m", "services.auth"]
    auth = [str(state) if arg == "/state" else
            arg.replace("//localhost:4222", f"//127.0.0.1:{nats_port}") for arg in auth]
    made = subprocess.run([sys.executable, *auth[1:]], capture_output=True, text=True, cwd=ROOT)
    assert made.returncode == 0, made.stderr
    tenant_url = made.stdout.split("tenant default: ")[1].split()[0]
    api_key = made.stdout.split("tenant default api key: ")[1].split()[0]
    conf = (ROOT / "deploy" / "nats-server.conf").read_text()
    conf = conf.replace("port: 4222", f"port: {nats_port}").replace(
        "http_port: 8222", f"http_port: {free_port()}").replace(
        "store_dir: /data", f"store_dir: {tmp_path / 'nats'}")
    (etc / "nats-server.conf").write_text(conf)
    envs = {kind: host_env(services[kind]["environment"], hosts, kind, ports[kind], state)
            for kind in JETSERVE}
    processes = [subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1",
                                   "-c", str(etc / "nats-server.conf")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    logs = {kind: open(tmp_path / f"{kind}.log", "wb") for kind in JETSERVE}
    try:
        for kind in JETSERVE:
            command = services[kind]["command"]
            assert command[:2] == ["python", "-m"]
            processes.append(subprocess.Popen([sys.executable, *command[1:]], env=envs[kind],
                                              stdout=logs[kind], stderr=subprocess.STDOUT,
                                              cwd=ROOT))
        # Each healthcheck, as Docker would run it, until it passes.
        for kind in JETSERVE:
            test = services[kind]["healthcheck"]["test"]
            assert test[0] == "CMD" and test[1] == "python"
            for _ in range(240):
                probe = await asyncio.to_thread(
                    subprocess.run, [sys.executable, *test[2:]], env=envs[kind], cwd=ROOT,
                    capture_output=True, text=True)
                if probe.returncode == 0:
                    break
                assert all(p.poll() is None for p in processes), (tmp_path / f"{kind}.log")
                await asyncio.sleep(0.5)
            assert probe.returncode == 0, (kind, probe.stderr)

        with pytest.raises(nats.errors.Error):  # no credentials, no connection
            await nats.connect(f"nats://127.0.0.1:{nats_port}", allow_reconnect=False,
                               max_reconnect_attempts=0)
        service = await nats.connect(f"nats://127.0.0.1:{nats_port}", user="jetserve",
                                     password=(state / "auth" / "service.password").read_text()
                                     .strip())
        async with await JetserveClient.connect(tenant_url, tenant="default") as client:
            for _ in range(100):  # healthy executor, then the batcher hears its heartbeat
                completion = await client.generate(GenerateRequest(
                    request_id="compose-1", prompt="The capital of France is", max_tokens=8,
                    temperature=0.0), timeout=60)
                if isinstance(completion, Completion):
                    break
                await asyncio.sleep(0.2)
            assert isinstance(completion, Completion), completion
            assert completion.usage.completion_tokens == 8
            # Started without --name, the executor named itself after its host (a container's
            # hostname is unique per replica, so `--scale executor=3` gives three names).
            reply = await service.request(Subjects("llm").batcher_executors, b"", timeout=5)
            await service.close()
            [name] = json.loads(reply.data)
            assert name.startswith(f"executor-{socket.gethostname()}-")
            assert completion.scheduling.executor == name
            # The OpenAI-compatible gateway, with tenant default's API key (nats-auth made it).
            answer = await asyncio.to_thread(post_json, f"http://127.0.0.1:{ports['gateway']}"
                                             f"/v1/completions", {
                "model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is",
                "max_tokens": 8, "temperature": 0}, api_key)
            assert answer["choices"][0]["text"] == completion.text, answer

        admission = await scrape(ports["admission"])
        assert value(admission, "jetserve:admitted_requests_total", tenant="default") >= 1
        executor = await scrape(ports["executor"])
        # (the request over NATS and the one through the gateway)
        assert value(executor, "jetserve:request_success_total", finished_reason="length") == 2
        assert (await scrape(ports["batcher"]))[("jetserve:executors_alive", ())] == 1
        assert ("jetserve:priority_dispatched_total", ()) in await scrape(ports["priority"])
        assert value(await scrape(ports["gateway"]), "jetserve:gateway_requests_total",
                     endpoint="completions", status="200") == 1
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        for log in logs.values():
            log.close()
        collector.close()
    # Every service's spans reached the collector, each under its OTEL_SERVICE_NAME.
    assert {s["service"] for s in collector.spans} == set(JETSERVE)
