"""NATS authentication and permissions for the embedded server (`jetserve up --auth`) and the
tenants of a running stack (`jetserve tenant add|remove`).

Every connection logs in with a user and a password. The services share one user, `jetserve`,
allowed what they need and nothing else (jetserve's subjects, inboxes, the $SRV discovery
subjects, the JetStream API calls they make, with no deletes or purges). A tenant's user may
publish only its own public subjects (generate, durable requests, cancel) and the one
JetStream API call its own results need (a direct get, scoped to its result subjects), and
subscribe only to its own results, streams and inboxes (`<inbox prefix>.<tenant>.`, where
`shared.client.JetserveClient` makes them). Everything else, other tenants' subjects, internal
ones and `$SRV`, is a permission violation the client hears about.

The state lives in `<state dir>/auth/` (mode 0700): `users.json` holds the passwords (the
server's configuration needs them in clear text, as do the tenants' URLs) and `users.conf` is the
`authorization` block the server's configuration includes, rewritten on every change, after
which the server is told to reload (SIGHUP to the pid in `<state dir>/nats-server.pid`). Each
tenant also gets an API key for the OpenAI-compatible gateway; `api_keys.json` maps the keys
to their tenants, and the gateway reads it again whenever it changes
(`gateway.api_keys_file`).
docs/operations.md shows a production layout.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
from pathlib import Path

from shared.config import nats_servers
from shared.subjects import RESULTS_STREAM, TENANT_PATTERN, Subjects

SERVICE_USER = "jetserve"
# What the services call in the JetStream API: streams made and brought to the configuration,
# admission's consumer, its fetches, result lookups. No delete, purge or snapshot.
SERVICE_JS_API = ("INFO", "STREAM.INFO.*", "STREAM.CREATE.*", "STREAM.UPDATE.*",
                  "STREAM.MSG.GET.*", "DIRECT.GET.>", "CONSUMER.CREATE.>",
                  "CONSUMER.DURABLE.CREATE.>", "CONSUMER.INFO.>", "CONSUMER.MSG.NEXT.>")


class AuthError(Exception):
    """A tenant command that cannot be carried out; the message says why."""


def service_permissions(prefix: str, inbox_prefix: str) -> dict:
    return {
        "publish": {"allow": [f"{prefix}.>", f"{inbox_prefix}.>", "$SRV.>", "$JS.ACK.>",
                              *(f"$JS.API.{call}" for call in SERVICE_JS_API)]},
        "subscribe": {"allow": [f"{prefix}.>", f"{inbox_prefix}.>", "$SRV.>"]},
    }


def tenant_permissions(prefix: str, inbox_prefix: str, tenant: str) -> dict:
    subjects = Subjects(prefix)
    return {
        "publish": {"allow": [subjects.generate(tenant), subjects.requests(tenant),
                              subjects.cancel(tenant),
                              f"$JS.API.DIRECT.GET.{RESULTS_STREAM}.{subjects.results(tenant)}"]},
        "subscribe": {"allow": [subjects.results(tenant), subjects.stream(tenant, "*"),
                                f"{inbox_prefix}.{tenant}.>"]},
    }


class Users:
    """The users of one stack's server, kept in `<state dir>/auth/`."""

    def __init__(self, state_dir: str | Path):
        self.state_dir = Path(state_dir)
        self.dir = self.state_dir / "auth"
        self.path = self.dir / "users.json"

    def exists(self) -> bool:
        return self.path.exists()

    def load(self) -> dict:
        if not self.exists():
            raise AuthError(f"no jetserve stack with --auth has run in {self.state_dir} (no "
                            f"{self.path}); start one with `jetserve up --auth --state-dir "
                            f"{self.state_dir}`")
        return json.loads(self.path.read_text())

    def create(self, url: str, prefix: str, inbox_prefix: str) -> dict:
        """The service user's password, made once and kept across restarts (tenants too); the
        URL and subject prefixes are this run's."""
        state = json.loads(self.path.read_text()) if self.exists() else {
            "service_password": secrets.token_urlsafe(24), "tenants": {}}
        state.update(url=url, prefix=prefix, inbox_prefix=inbox_prefix)
        keys = state.setdefault("api_keys", {})  # (a state from before keys: each gets one)
        for name in state["tenants"]:
            keys.setdefault(name, new_api_key())
        self.save(state)
        return state

    def save(self, state: dict) -> None:
        """users.json and the users.conf the server includes, each written whole, then moved
        into place (a reload never reads half a file)."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        users = [{"user": SERVICE_USER, "password": state["service_password"],
                  "permissions": service_permissions(state["prefix"], state["inbox_prefix"])}]
        users += [{"user": name, "password": secret,
                   "permissions": tenant_permissions(state["prefix"], state["inbox_prefix"], name)}
                  for name, secret in sorted(state["tenants"].items())]
        api_keys = {key: name for name, key in state.get("api_keys", {}).items()}
        for path, text in ((self.path, json.dumps(state, indent=1)),
                           (self.conf, "authorization: " + json.dumps({"users": users}, indent=1)),
                           (self.dir / "service.password", state["service_password"]),
                           (self.api_keys_path, json.dumps(api_keys, indent=1))):
            part = path.with_suffix(".part")
            part.write_text(text + "\n")
            part.chmod(0o600)
            part.replace(path)

    @property
    def conf(self) -> Path:
        return self.dir / "users.conf"

    @property
    def api_keys_path(self) -> Path:
        return self.dir / "api_keys.json"

    def api_key(self, name: str) -> str:
        """The tenant's API key for the OpenAI-compatible gateway."""
        key = self.load().get("api_keys", {}).get(name)
        if key is None:
            raise AuthError(f"no tenant {name!r} in {self.path}")
        return key

    def service_env(self) -> dict[str, str]:
        """What the services log in with (the environment, never their command line); the
        gateway also takes the tenants' API keys from here."""
        return {"JETSERVE_NATS__USER": SERVICE_USER,
                "JETSERVE_NATS__PASSWORD": self.load()["service_password"],
                "JETSERVE_NATS__TENANT_INBOXES": "true",
                "JETSERVE_GATEWAY__API_KEYS_FILE": str(self.api_keys_path.resolve())}

    def add_tenant(self, name: str, reload: bool = True) -> str:
        """A new tenant's URL, `nats://NAME:SECRET@host:port`, after the server reloaded
        (`reload` False: whoever runs the server reloads it)."""
        if not TENANT_PATTERN.fullmatch(name) or name == SERVICE_USER:
            raise AuthError(f"tenant {name!r} must match [A-Za-z0-9_-]{{1,64}} and not be "
                            f"{SERVICE_USER!r}")
        state = self.load()
        if name in state["tenants"]:
            raise AuthError(f"tenant {name!r} exists; `jetserve tenant remove {name}` first to "
                            f"give it a new secret")
        state["tenants"][name] = secrets.token_urlsafe(24)
        state.setdefault("api_keys", {})[name] = new_api_key()
        self.save(state)
        if reload:
            self.reload()
        return tenant_url(state["url"], name, state["tenants"][name])

    def remove_tenant(self, name: str, reload: bool = True) -> None:
        """Revoke: the server refuses the tenant's credentials from the reload on and closes
        its open connections."""
        state = self.load()
        if state["tenants"].pop(name, None) is None:
            raise AuthError(f"no tenant {name!r} in {self.path}")
        state.get("api_keys", {}).pop(name, None)
        self.save(state)
        if reload:
            self.reload()

    def reload(self) -> None:
        """SIGHUP to the embedded server (every node of a cluster: `nats-server-<i>.pid`)."""
        pid_files = sorted(self.state_dir.glob("nats-server*.pid")) or \
            [self.state_dir / "nats-server.pid"]
        failed = []
        for pid_file in pid_files:  # (a node that is down reads users.conf when it restarts)
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGHUP)
            except (OSError, ValueError) as exc:
                failed.append(f"{pid_file}: {exc}")
        if len(failed) == len(pid_files):
            raise AuthError(f"the credentials are saved, but no running nats-server took them "
                            f"({'; '.join(failed)}); the next `jetserve up --auth` will")


def make_certificates(directory: Path) -> dict[str, str]:
    """A local CA and a server certificate it signs (for 127.0.0.1 and localhost), made once
    with the openssl command: the embedded server's TLS (`jetserve up --tls`). Clients trust
    the server by the CA (`nats.tls.ca`); a client without it cannot connect."""
    files = {name: str(directory / f"{name}.pem") for name in ("ca", "server", "server-key")}
    if all(Path(f).exists() for f in files.values()):
        return files
    if shutil.which("openssl") is None:
        raise AuthError("--tls makes its certificates with the openssl command, which is not "
                        "installed; or configure a server of your own (docs/operations.md)")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca_key, csr = directory / "ca-key.pem", directory / "server.csr"
    extensions = directory / "server.ext"
    extensions.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                          "extendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature\n")
    for argv in (
            ["req", "-x509", *key, "-keyout", ca_key, "-out", files["ca"], "-days", "3650",
             "-subj", "/CN=jetserve local CA"],
            ["req", *key, "-keyout", files["server-key"], "-out", csr, "-subj", "/CN=localhost"],
            ["x509", "-req", "-in", csr, "-CA", files["ca"], "-CAkey", ca_key,
             "-CAcreateserial", "-out", files["server"], "-days", "825", "-extfile", extensions]):
        done = subprocess.run(["openssl", *map(str, argv)], capture_output=True, text=True)
        if done.returncode != 0:
            raise AuthError(f"openssl {argv[0]} failed: {done.stderr.strip()[-500:]}")
    return files


async def wait_login(url: str, accepted: bool, tls=None, timeout_s: float = 10.0) -> None:
    """Until every server of `url` (one, or a cluster's list) that answers accepts its
    credentials (or, `accepted` False, refuses them: an authorization error, not any failure
    to connect); a reload takes effect a moment after the signal, node by node. A node that
    does not answer is not waited for (it reads the users file when it starts). `tls`: an
    SSLContext trusting the servers."""
    import nats
    import nats.errors

    async def works(server: str) -> bool | None:
        try:
            nc = await nats.connect([server], connect_timeout=1, allow_reconnect=False,
                                    max_reconnect_attempts=0, error_cb=_quiet, tls=tls)
            await nc.close()
            return True
        except nats.errors.Error as exc:
            return False if "authorization" in str(exc).lower() else None
        except Exception:
            return None  # not reachable: neither

    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        answers = [a for a in await asyncio.gather(*map(works, nats_servers(url)))
                   if a is not None]
        if answers and all(a is accepted for a in answers):
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AuthError(f"the server did not {'take' if accepted else 'drop'} the "
                            f"credentials within {timeout_s:g} s of the reload")
        await asyncio.sleep(0.1)


async def _quiet(_exc: Exception) -> None:
    pass


def new_api_key() -> str:
    return "sk-jetserve-" + secrets.token_urlsafe(24)


def tenant_url(url: str, name: str, secret: str) -> str:
    """`url` (one server, or a comma-separated list of a cluster's) with the tenant's login."""
    def one(server: str) -> str:
        scheme, rest = server.strip().split("://", 1)
        return f"{scheme}://{name}:{secret}@{rest}"
    return ",".join(one(server) for server in url.split(","))


def main(argv: list[str] | None = None) -> int:
    """`python -m services.auth --state-dir DIR --url URL [--tenant NAME]... [--remove NAME]...`:
    the users of a server someone else runs and reloads (compose.yaml's `nats-auth` runs it
    before the server starts): made if absent, kept if present; each `--tenant` not yet there
    added (its URL printed), each `--remove` revoked. The server's configuration includes
    `<DIR>/auth/users.conf`; the services read their password from
    `<DIR>/auth/service.password`."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m services.auth", description=main.__doc__)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--url", required=True, help="the server as clients reach it")
    parser.add_argument("--prefix", default="llm")
    parser.add_argument("--inbox-prefix", default="_INBOX")
    parser.add_argument("--tenant", action="append", default=[])
    parser.add_argument("--remove", action="append", default=[])
    args = parser.parse_args(argv)
    users = Users(args.state_dir)
    users.create(args.url, args.prefix, args.inbox_prefix)
    try:
        for name in args.remove:
            users.remove_tenant(name, reload=False)
        state = users.load()
        for name in args.tenant:
            if name in state["tenants"]:
                url = tenant_url(args.url, name, state["tenants"][name])
            else:
                url = users.add_tenant(name, reload=False)
            print(f"tenant {name}: {url}", flush=True)
            print(f"tenant {name} api key: {users.api_key(name)}", flush=True)
    except AuthError as exc:
        print(f"services.auth: {exc}", file=sys.stderr)
        return 1
    print(f"users in {users.conf}; a running server takes changes when reloaded (SIGHUP)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
