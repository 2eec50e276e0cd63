"""Audit lines of host cordons carry their event and fields in the json format (the real app)."""

from __future__ import annotations

import json
import logging

from rdzv_common.logs import JsonFormatter
from tests.api.test_hosts import post_json


async def test_cordon_and_uncordon_log_their_events_with_the_host(client, caplog):
    caplog.set_level(logging.INFO, logger="rdzv_server.audit")
    await post_json(client, "/v1/hosts/gpu-7/cordon", {"reason": "bad\nDIMM", "ttl_s": 60, "drain": False})
    await post_json(client, "/v1/hosts/gpu-7/uncordon")
    rows = [json.loads(JsonFormatter().format(r)) for r in caplog.records if r.name == "rdzv_server.audit"]
    by_event = {r["event"]: r for r in rows}
    cordoned, uncordoned = by_event["host_cordoned"], by_event["host_uncordoned"]
    assert cordoned["host"] == "gpu-7" and cordoned["reason"] == "bad\nDIMM" and cordoned["ttl_s"] == 60
    assert cordoned["drain"] is False and "\\n" in cordoned["message"]  # the message stays one line
    assert uncordoned["host"] == "gpu-7" and "uncordoned" in uncordoned["message"]
