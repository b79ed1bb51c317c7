"""deploy/compose.cluster.yaml in real containers: podman-compose brings up compose.yaml with the
cluster override (and deploy/local's stand-ins): three NATS nodes, every stream replicated three
ways, two replicas of admission, priority and the batcher, two executors (real SmolLM2). A
generate and a durable request complete from the host; the node leading LLM_STATE (one the
host does not connect through) is SIGKILLed and requests sent at once still complete; it
rejoins; then one replica each of admission, priority and the batcher is SIGKILLed under 16
durable and 16 generate requests, and each gets its one answer (LLM_RESULTS holds one result
per durable request). `make test-containers` runs it with JETSERVE_CONTAINER_CLUSTER=1 (about
80 s more than CI's budget holds; docs/operations.md gives its last run); it skips, saying why,
without that or where podman is not set up."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import nats
import pytest

from services.auth import SERVICE_USER, tenant_url
from shared.client import JetserveClient
from shared.protocol import Completion, GenerateRequest
from shared.request_state import STATE_STREAM
from shared.subjects import REQUESTS_STREAM, RESULTS_STREAM, Subjects
from tests.integration.test_podman_compose import (
    BUILD_TIMEOUT_S,
    NATS_URL,
    containers,
    inspect_volume,
    podman_usable,
    remove_project,
    remove_stale_projects,
    run,
)

pytestmark = [pytest.mark.slow, pytest.mark.containers]  # make test-containers, not make test

FILES = ("-f", "compose.yaml", "-f", "deploy/local/compose.podman.yaml",
         "-f", "deploy/compose.cluster.yaml", "-f", "deploy/local/compose.cluster.podman.yaml")


@pytest.fixture
def cluster():
    if os.environ.get("JETSERVE_CONTAINER_CLUSTER") != "1":
        pytest.skip("the compose cluster in containers runs with JETSERVE_CONTAINER_CLUSTER=1 "
                    "(about 80 s more than CI's budget holds)")
    reason = podman_usable()
    if reason:
        pytest.skip(reason)
    remove_stale_projects()
    run("bash", "deploy/local/build.sh", timeout=BUILD_TIMEOUT_S)
    project = f"jetserve-test-{os.getpid()}"
    compose = ("podman-compose", "-p", project, *FILES)
    try:
        run(*compose, "up", "-d", "--no-build", "--scale", "executor=2", timeout=300)
        # (podman-compose 1.6 takes one --scale a command)
        for service in ("admission", "priority", "batcher"):
            run(*compose, "up", "-d", "--no-build", "--no-deps", "--scale", f"{service}=2",
                service, timeout=300)
        yield project
    finally:
        print(run("podman", "ps", "-a", "--filter", f"label=io.podman.compose.project={project}",
                  "--format", "{{.Names}} {{.Status}}", check=False).stdout)
        run(*compose, "down", "-v", timeout=600, check=False)
        remove_project(project)


def container(project: str, service: str, index: int = 1) -> str:
    return f"{project}_{service}_{index}"


async def test_the_compose_cluster_runs_in_containers_and_loses_a_node(cluster):
    project = cluster
    running = sorted(containers(project).values())
    assert running.count("admission") == running.count("priority") == 2, running
    assert running.count("batcher") == running.count("executor") == 2, running
    assert {"nats", "nats-2", "nats-3"} <= set(running), running
    made = json.loads((Path(inspect_volume(f"{project}_auth-state", "{{.Mountpoint}}"))
                       / "auth" / "users.json").read_text())
    admin = await nats.connect(NATS_URL, user=SERVICE_USER, password=made["service_password"])
    js = admin.jetstream()
    deadline = time.monotonic() + 600  # the first start converts the GGUF
    names: dict = {}
    while time.monotonic() < deadline and len(names) < 2:
        try:
            names = json.loads((await admin.request(Subjects("llm").batcher_executors, b"",
                                                    timeout=5)).data)
        except Exception:
            names = {}
        await asyncio.sleep(2)
    assert len(names) == 2, f"executors joined: {names}"
    for stream in (REQUESTS_STREAM, RESULTS_STREAM, STATE_STREAM):
        info = await js.stream_info(stream)
        assert info.config.num_replicas == 3, info.config
        assert len(info.cluster.replicas or []) == 2, info.cluster

    tenant = tenant_url(NATS_URL, "default", made["tenants"]["default"])
    async with await JetserveClient.connect(tenant, tenant="default") as client:
        async def generate(i: int):
            return await client.generate(GenerateRequest(
                prompt=f"Line {i}:", max_tokens=8, temperature=0.0, ignore_eos=True),
                timeout=180)

        async def durable(request_id: str):
            await client.submit(GenerateRequest(request_id=request_id, prompt=f"{request_id}:",
                                                max_tokens=8, temperature=0.0, ignore_eos=True))
            return await client.result(request_id, timeout=180)

        first = await asyncio.gather(generate(0), durable("before"))
        assert all(isinstance(c, Completion) for c in first), first

        # The node leading LLM_STATE dies, moved off "nats" (the only one the host reaches); if
        # the leadership will not move, another node (a follower of every stream).
        for _ in range(10):
            leader = (await js.stream_info(STATE_STREAM)).cluster.leader
            if leader != "nats-1":
                break
            try:
                await admin.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{STATE_STREAM}", b"",
                                    timeout=5)
            except Exception:
                pass
            await asyncio.sleep(2)
        victim = leader if leader in ("nats-2", "nats-3") else "nats-2"
        run("podman", "kill", "-s", "KILL", container(project, victim))
        after = await asyncio.gather(*(generate(i) for i in range(6)), durable("after"))
        assert all(isinstance(c, Completion) for c in after), after
        run("podman", "start", container(project, victim))

        async def rejoined():
            for stream in (REQUESTS_STREAM, RESULTS_STREAM, STATE_STREAM):
                info = await js.stream_info(stream)
                if not all(r.current for r in info.cluster.replicas or []) \
                        or len(info.cluster.replicas or []) != 2:
                    return False
            return True

        for _ in range(60):
            try:
                if await rejoined():
                    break
            except Exception:  # a stream electing its leader still
                pass
            await asyncio.sleep(1)
        else:
            raise AssertionError(f"{victim} did not rejoin every stream")

        # One replica of each control-plane service dies under load.
        load = [asyncio.create_task(durable(f"load-{i}")) for i in range(16)] + \
            [asyncio.create_task(generate(i)) for i in range(16)]
        # (a generate being admitted at the instant its admission dies gets no reply, by design:
        # these were all admitted long before)
        await asyncio.sleep(3.0)
        for service in ("admission", "priority", "batcher"):
            run("podman", "kill", "-s", "KILL", container(project, service))
        answers = await asyncio.gather(*load)
        assert all(isinstance(c, Completion) and c.usage.completion_tokens == 8
                   for c in answers), answers
    await asyncio.sleep(2.0)
    stored = (await js.stream_info(RESULTS_STREAM)).state.messages
    assert stored == 2 + 16, stored  # "before", "after" and the load's: one result each
    await admin.close()
