"""The gateway's API keys file (`gateway.api_keys_file`, what `jetserve tenant add|remove`
writes): read off the event loop when it changes, hostile contents refused without losing the
keys read before."""

from __future__ import annotations

import json
import os

import pytest

from services.gateway.service import Gateway
from shared.config import load_config

pytestmark = pytest.mark.asyncio


def gateway(path) -> Gateway:
    config = load_config(None, {"JETSERVE_MODEL__NAME": "dummy:tiny",
                                "JETSERVE_GATEWAY__API_KEYS_FILE": str(path)})
    return Gateway(config, nc=None, js=None, tracer=None)


def write(path, text: str) -> None:
    part = path.with_suffix(".part")
    part.write_text(text)
    part.replace(path)  # as services/auth.py writes it: a new inode each time


async def test_keys_come_and_go_with_the_file_and_bad_entries_are_dropped(tmp_path):
    path = tmp_path / "api_keys.json"
    gw = gateway(path)
    await gw.read_keys()
    assert gw.api_keys() == {}  # missing: no key works
    write(path, json.dumps({"sk-a": "acme", "": "eve", "sk b": "bob", "sk-c": "not a tenant",
                            "sk-d": "beta"}))
    await gw.read_keys()
    assert gw.api_keys() == {"sk-a": "acme", "sk-d": "beta"}  # no empty key logs in anyone
    for hostile in ("not json", "[1, 2]", json.dumps({"sk-x": 3})):
        write(path, hostile)
        await gw.read_keys()
        assert gw.api_keys() == {"sk-a": "acme", "sk-d": "beta"}  # the keys read before stay
    write(path, json.dumps({"sk-d": "beta"}))  # a removed tenant's key stops working
    await gw.read_keys()
    assert gw.api_keys() == {"sk-d": "beta"}
    path.unlink()
    await gw.read_keys()
    assert gw.api_keys() == {}


async def test_a_fifo_or_a_huge_file_is_not_read(tmp_path):
    path = tmp_path / "api_keys.json"
    write(path, json.dumps({"sk-a": "acme"}))
    gw = gateway(path)
    await gw.read_keys()
    path.unlink()
    os.mkfifo(path)  # reading it would block until a writer came
    await gw.read_keys()
    assert gw.api_keys() == {"sk-a": "acme"}
    path.unlink()
    with open(path, "wb") as huge:
        huge.truncate(17 << 20)
    await gw.read_keys()
    assert gw.api_keys() == {"sk-a": "acme"}
