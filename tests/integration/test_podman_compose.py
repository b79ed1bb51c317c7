"""compose.yaml in real containers: the images built with podman (deploy/local/build.sh), the
stack brought up by podman-compose with deploy/local/compose.podman.yaml (stand-ins for the
third-party images) and two executors, NATS with the users compose's `nats-auth` made; a
tenant's request from the host completes on each (a connection without credentials is refused),
every
healthcheck passes, Prometheus scrapes every replica, one request's spans from all four services
reach the trace stand-in, a durable request outlives its executor's SIGKILL, and `down` stops
everything within its bound. Skips, saying why, where podman is not set up
(deploy/local/setup-podman.sh does it; .ci/run runs it)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest

from services.auth import SERVICE_USER, tenant_url
from shared.bus import discover
from shared.client import JetserveClient
from shared.protocol import Completion, GenerateRequest
from shared.subjects import RESULTS_STREAM, Subjects

pytestmark = [pytest.mark.slow, pytest.mark.containers]  # make test-containers, not make test

ROOT = Path(__file__).resolve().parents[2]
JETSERVE = ("admission", "priority", "batcher", "gateway", "executor")
NATS_URL = "nats://127.0.0.1:4222"  # compose.yaml publishes these on the host
BUILD_TIMEOUT_S = 1800  # the first build installs torch and compiles the CPU kernels
DOWN_BOUND_S = 60  # 10 s stop timeouts (podman-compose stops all at once), then the leftovers


def podman_usable() -> str | None:
    """Why the stack cannot run here, or None."""
    for tool in ("podman", "podman-compose"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (deploy/local/setup-podman.sh installs it, as root)"
    base = os.environ.get("BASE", "localhost/debian:bookworm")
    probe = subprocess.run(["podman", "image", "exists", base], capture_output=True)
    if probe.returncode != 0:
        return f"podman has no base image {base} (deploy/local/setup-podman.sh makes it)"
    probe = subprocess.run(["podman", "run", "--rm", base, "true"], capture_output=True,
                           text=True, timeout=120)
    if probe.returncode != 0:
        return f"podman cannot run a container here: {probe.stderr.strip()[-500:]}"
    return None


def run(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {result.returncode}:\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def post_json(url: str, body: dict, api_key: str | None = None):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json",
        **({"Authorization": f"Bearer {api_key}"} if api_key else {})})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


async def until(what: str, probe, timeout: float, every: float = 1.0):
    """probe()'s first truthy answer within `timeout` s (probe errors count as not yet)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            answer = await asyncio.to_thread(probe)
            if answer:
                return answer
            last = answer
        except Exception as exc:  # not up yet
            last = exc
        await asyncio.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:.0f} s (last: {last!r})")


def remove_project(project: str) -> None:
    """Remove what podman-compose 1.6's `down` leaves of a project: the replicas `--scale` added,
    what they depend on, the project's pod, networks and volumes (docs/operations.md)."""
    label = f"label=io.podman.compose.project={project}"

    def listed(*what: str) -> list[str]:
        return run("podman", *what, "--filter", label, check=False).stdout.split()

    replicas = listed("ps", "-a", "-q", "--filter", "label=com.docker.compose.service=executor")
    if replicas:
        run("podman", "rm", "-f", "-t", "10", *replicas, check=False)
    if rest := listed("ps", "-a", "-q"):
        run("podman", "rm", "-f", "-t", "10", *rest, check=False)
    run("podman", "pod", "rm", "-f", "--ignore", f"pod_{project}", check=False)
    networks = set(listed("network", "ls", "--format", "{{.Name}}")) | {f"{project}_default"}
    run("podman", "network", "rm", "-f", *networks, check=False)
    if volumes := listed("volume", "ls", "-q"):
        run("podman", "volume", "rm", "-f", *volumes, check=False)


def remove_stale_projects() -> None:
    """Projects of earlier runs whose pytest process is gone (killed mid-test): they hold the
    ports compose.yaml publishes."""
    names = run("podman", "ps", "-a", "--format",
                "{{index .Labels \"io.podman.compose.project\"}}", check=False).stdout.split()
    networks = run("podman", "network", "ls", "--format", "{{.Name}}", check=False).stdout.split()
    for project in set(names) | {n.removesuffix("_default") for n in networks}:
        pid = project.removeprefix("jetserve-test-")
        if pid != project and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            remove_project(project)


@pytest.fixture
def stack():
    reason = podman_usable()
    if reason:
        pytest.skip(reason)
    remove_stale_projects()
    build = run("bash", "deploy/local/build.sh", timeout=BUILD_TIMEOUT_S)
    print(build.stdout)
    project = f"jetserve-test-{os.getpid()}"
    compose = ("podman-compose", "-p", project, "-f", "compose.yaml",
               "-f", "deploy/local/compose.podman.yaml")
    try:
        run(*compose, "up", "-d", "--no-build", "--scale", "executor=2", timeout=300)
        yield compose, project
    finally:
        label = f"label=io.podman.compose.project={project}"
        logs = run("podman", "ps", "-a", "--filter", label,
                   "--format", "{{.Names}} {{.Status}}", check=False)
        print(logs.stdout)
        start = time.monotonic()
        run(*compose, "down", "-v", timeout=600, check=False)
        remove_project(project)
        took = time.monotonic() - start
        left = run("podman", "ps", "-a", "-q", "--filter", label, check=False).stdout.split()
        assert not left, f"containers left after down: {left}"
        assert took < DOWN_BOUND_S, f"compose down took {took:.0f} s"


def inspect(container: str, template: str) -> str:
    return run("podman", "inspect", "--format", template, container).stdout.strip()


def containers(project: str) -> dict[str, str]:
    """Container name -> compose service, for the project's running containers."""
    listing = run("podman", "ps", "--filter", f"label=io.podman.compose.project={project}",
                  "--format", "{{.Names}} {{index .Labels \"com.docker.compose.service\"}}")
    return dict(line.split() for line in listing.stdout.splitlines() if line.strip())


def users(project: str) -> dict:
    """What `nats-auth` made in the project's `auth-state` volume (services/auth.py)."""
    volume = inspect_volume(f"{project}_auth-state", "{{.Mountpoint}}")
    return json.loads((Path(volume) / "auth" / "users.json").read_text())


def inspect_volume(volume: str, template: str) -> str:
    return run("podman", "volume", "inspect", "--format", template, volume).stdout.strip()


async def test_the_compose_stack_runs_in_containers(stack):
    compose, project = stack
    made = users(project)
    with pytest.raises(nats.errors.Error):  # no credentials, no connection
        await nats.connect(NATS_URL, allow_reconnect=False, max_reconnect_attempts=0)
    admin = await nats.connect(NATS_URL, user=SERVICE_USER, password=made["service_password"])
    tenant = tenant_url(NATS_URL, "default", made["tenants"]["default"])
    async with await JetserveClient.connect(tenant, tenant="default") as client:
        async def executors() -> list[str]:
            reply = await admin.request(Subjects("llm").batcher_executors, b"", timeout=5)
            return json.loads(reply.data)

        deadline = time.monotonic() + 600  # the first start converts the GGUF
        names: list[str] = []
        while time.monotonic() < deadline and len(names) < 2:
            try:
                names = await executors()
            except Exception:
                names = []
            await asyncio.sleep(2)
        assert len(names) == 2, f"executors joined: {names}"
        print(f"both executors joined {time.monotonic() - deadline + 600:.0f} s after up")
        assert len(set(names)) == 2  # each replica named after its own container's hostname

        # Podman 4.3 runs healthchecks on systemd timers, which a container host without systemd
        # lacks: run each container's own check now, as the timer would.
        running = containers(project)
        assert sorted(set(running.values())) == sorted(
            {"nats", "jaeger", "prometheus", *JETSERVE}), running
        images = dict(line.split() for line in run(
            "podman", "ps", "--filter", f"label=io.podman.compose.project={project}",
            "--format", "{{.Names}} {{.Image}}").stdout.splitlines() if line.strip())
        for name, service in running.items():  # the control plane runs the image without torch
            if service in ("admission", "priority", "batcher", "gateway"):
                assert images[name].endswith("/jetserve-control:latest"), (name, images[name])
            elif service == "executor":
                assert images[name].endswith("/jetserve:latest"), (name, images[name])
        for name, service in running.items():
            if service in ("jaeger", "prometheus"):
                continue  # compose.yaml gives them no healthcheck
            await until(f"{name}'s healthcheck",
                        lambda name=name: run("podman", "healthcheck", "run", name,
                                              check=False).returncode == 0, timeout=120, every=2)

        # Requests from the host: both executors serve.
        completions = await asyncio.gather(*(client.generate(GenerateRequest(
            request_id=f"podman-{i}", prompt=f"Count to {i}:", max_tokens=8, temperature=0.0,
            ignore_eos=True), timeout=300) for i in range(8)))
        assert all(isinstance(c, Completion) for c in completions), completions
        assert all(c.usage.completion_tokens == 8 for c in completions)
        served_by = {c.scheduling.executor for c in completions}
        assert served_by == set(names), served_by
        # ... and through the OpenAI-compatible gateway, with tenant default's API key (none:
        # 401, the gateway is no way around the server's logins).
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "Count to 3:", "max_tokens": 8,
                "temperature": 0, "ignore_eos": True}
        with pytest.raises(urllib.error.HTTPError, match="401"):
            await asyncio.to_thread(post_json, "http://127.0.0.1:8000/v1/completions", body)
        answer = await asyncio.to_thread(post_json, "http://127.0.0.1:8000/v1/completions", body,
                                         made["api_keys"]["default"])
        assert answer["usage"]["completion_tokens"] == 8, answer

        # That request is one trace, with spans from every service, the gateway's first. Checked
        # now, before an executor is killed below: a killed executor's spans still batched for
        # export (up to 5 s of them) are lost with it.
        def one_trace():
            spans = get_json("http://127.0.0.1:16686/api/spans")
            by_trace: dict[str, set[str]] = {}
            for span in spans:
                by_trace.setdefault(span["trace_id"], set()).add(span["service"])
            if whole := [t for t, services in by_trace.items() if set(JETSERVE) <= services]:
                return whole
            # until() reports the latest: what the gateway's traces have so far
            raise AssertionError([sorted(s) for s in by_trace.values() if "gateway" in s])

        assert await until("a trace with spans from every service", one_trace, timeout=60)

        # Prometheus (the stand-in, with compose's scrape config) finds and scrapes every replica.
        def scraped():
            targets = get_json("http://127.0.0.1:9090/api/v1/targets")["data"]["activeTargets"]
            up = {}
            for target in targets:
                if target["health"] == "up":
                    up.setdefault(target["labels"]["job"], set()).add(target["scrapeUrl"])
            # DNS service discovery finds both executor replicas.
            if all(up.get(f"jetserve-{kind}") for kind in JETSERVE) and \
                    len(up["jetserve-executor"]) == 2:
                return up
            raise AssertionError(f"targets up so far: {up}")  # until() reports the latest

        await until("Prometheus scraping every service and both executors", scraped,
                    timeout=120, every=2)

        # A durable request whose executor is SIGKILLed mid-run still gets its one result, with
        # the tokens an undisturbed run gives (podman restarts the container, `restart:
        # unless-stopped`; the other executor or the restarted one runs the request again).
        # The executors' container names by host name, looked up before the request goes out:
        # podman's own calls take about a second each, and a request must still be running
        # when its executor is killed (512 tokens: ~5 s at ~10 ms a token here).
        hostnames = {}
        for name, service in (await asyncio.to_thread(containers, project)).items():
            if service == "executor":
                hostname = await asyncio.to_thread(inspect, name, "{{.Config.Hostname}}")
                hostnames[hostname] = name
        request = GenerateRequest(request_id="podman-durable", prompt="Tell a long story.",
                                  max_tokens=512, temperature=0.0, ignore_eos=True)
        await client.submit(request)

        async def holder() -> str | None:
            """The host name of the executor running a request now."""
            for answer in await discover(admin, "STATS", "executor", wait_s=1.0):
                for endpoint in answer.get("endpoints") or []:
                    if ((endpoint.get("data") or {}).get("running") or 0) > 0:
                        return answer["metadata"]["host"]
            return None

        host = None
        for _ in range(60):
            if host := await holder():
                break
            await asyncio.sleep(0.5)
        assert host, "no executor reported the durable request running"
        victim = hostnames[host]
        state = await asyncio.to_thread(inspect, victim, "{{.State.Running}} {{.State.Pid}}")
        running, pid = state.split()
        assert running == "true" and int(pid) > 1, state  # never os.kill(0): the process group
        subject = Subjects("llm").results("default", "podman-durable")
        with pytest.raises(nats.js.errors.NotFoundError):  # still running when it is killed
            await client.js.get_last_msg(RESULTS_STREAM, subject, direct=True)
        os.kill(int(pid), 9)  # the container dies with its first process
        result = await client.result("podman-durable", timeout=300)
        assert isinstance(result, Completion), result
        assert result.usage.completion_tokens == 512
        after = await asyncio.to_thread(inspect, victim, "{{.State.Pid}}")
        assert after != pid, "the killed executor's container still has its first process"
        undisturbed = await client.generate(GenerateRequest(
            request_id="podman-undisturbed", prompt=request.prompt, max_tokens=512,
            temperature=0.0, ignore_eos=True), timeout=300)
        assert isinstance(undisturbed, Completion), undisturbed
        assert result.token_ids == undisturbed.token_ids
    await admin.close()
