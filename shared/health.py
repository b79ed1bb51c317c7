"""`python -m shared.health <service>`: a container's healthcheck. Exits 0 when this host's
instance of the service answers `$SRV.PING.<service>` on NATS (`NATS_URL` or the config's
`nats.url`, with the config's credentials and TLS); 1 when it does not answer within the wait or NATS cannot be reached (Docker reserves
2), with the reason on stderr."""

from __future__ import annotations

import asyncio
import socket
import sys

import nats

from shared.bus import connect_options, discover, redacted
from shared.config import NatsSection, load_config, nats_servers


async def healthy(service: str, section: NatsSection, wait_s: float) -> bool:
    nc = await nats.connect(nats_servers(section.url), connect_timeout=wait_s, allow_reconnect=False,
                            inbox_prefix=section.client_inbox_prefix, **connect_options(section))
    try:
        answers = await discover(nc, "PING", service, wait_s=wait_s)
    finally:
        await nc.close()
    host = socket.gethostname()
    return any((answer.get("metadata") or {}).get("host") == host for answer in answers)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m shared.health")
    parser.add_argument("service", choices=["admission", "priority", "batcher", "executor",
                                                "gateway"])
    parser.add_argument("--wait", type=float, default=1.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    section = load_config(None).nats
    try:
        ok = asyncio.run(healthy(args.service, section, args.wait))
    except Exception as exc:  # no NATS: unhealthy, and say why
        print(f"{args.service}: cannot reach NATS at {redacted(section.url)}: {exc!r}",
              file=sys.stderr)
        return 1
    if not ok:
        print(f"{args.service}: no answer from this host ({socket.gethostname()}) "
              f"to $SRV.PING.{args.service}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
