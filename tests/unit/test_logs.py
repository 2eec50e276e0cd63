"""--log-format: the json formatter, the agent's json stderr, the round
machine's lines and what they carry, and the text format left as it was."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys

import pytest

from rdzv_common import logs
from rdzv_common.protocol import ExitRecord, JobSpec
from rdzv_server import rounds
from tests.unit.test_rounds import form, join_msg, rejoin, spec

ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def _format(record_msg: str, *args: object, extra: dict | None = None, context=None, exc: bool = False) -> dict:
    """One record through the json formatter, parsed back."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter(context))
    logger = logging.getLogger(f"test_logs.{id(stream)}")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        if exc:
            try:
                raise RuntimeError("bad\nthing")
            except RuntimeError:
                logger.exception(record_msg, *args, extra=extra)
        else:
            logger.warning(record_msg, *args, extra=extra)
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1, text  # one line
    assert text.isascii(), text
    return json.loads(text)


def test_a_json_line_has_every_key_and_the_fields_of_a_line():
    line = logs.Line("job j round 3: node n1 succeeded", "node_succeeded", job="j", round=3, node="n1", extra_n=7)
    out = _format("%s", line, extra=logs.extra(line))
    assert list(out)[:8] == list(logs.CORE_KEYS)
    assert ISO.match(out["time"]), out["time"]
    assert out["level"] == "WARNING"
    assert out["logger"].startswith("test_logs.")
    assert (out["job"], out["round"], out["node"], out["event"]) == ("j", 3, "n1", "node_succeeded")
    assert out["message"] == "job j round 3: node n1 succeeded"
    assert out["extra_n"] == 7


def test_a_plain_line_has_null_job_round_node_and_event():
    out = _format("listening on %s", "x")
    assert {k: out[k] for k in ("job", "round", "node", "event")} == dict.fromkeys(("job", "round", "node", "event"))
    assert out["message"] == "listening on x"


def test_network_text_stays_one_ascii_line_and_cannot_forge_keys():
    """Control characters, escapes and non-ASCII text from a client: escaped, one
    line; a field named like a core key does not replace what the record says."""
    evil = 'x\n{"level":"INFO","message":"forged"}\x1b[2J\u202e\u00e9'
    line = logs.Line(f"node {evil} failed", "node_failed", job="j", round=0, node=evil, message="forged", level="X")
    out = _format("%s", line, extra=logs.extra(line))
    assert out["level"] == "WARNING"
    assert out["message"].startswith("node x\\n{")  # printable() escaped the newline in the message
    assert out["node"] == evil  # the field itself: exact, json escapes it
    assert "forged" not in {out["level"], out["message"]}


def test_a_long_field_is_cut():
    line = logs.Line("x", "node_failed", job="j", reason="r" * (3 * logs.MAX_MESSAGE))
    out = _format("%s", line, extra=logs.extra(line))
    assert len(out["reason"]) == logs.MAX_MESSAGE and out["reason"].endswith("...")


def test_an_exception_is_one_field_of_the_same_line():
    out = _format("tick failed", exc=True)
    assert out["message"] == "tick failed"
    assert "RuntimeError: bad\nthing" in out["exc"] and "Traceback" in out["exc"]


def test_context_fills_job_round_node_and_a_broken_context_does_not_lose_the_line():
    out = _format("hello", context=lambda: {"job": "j", "node": "n", "round": 2, "other": 1})
    assert (out["job"], out["node"], out["round"]) == ("j", "n", 2)
    assert "other" not in out  # a context gives only the core keys

    def broken() -> dict:
        raise KeyError("nope")

    assert _format("hello", context=broken)["message"] == "hello"


def test_an_unknown_event_name_is_a_bug():
    with pytest.raises(ValueError, match="unknown log event"):
        logs.Line("x", "node_exploded")


def test_json_stream_turns_prints_into_json_lines():
    target = io.StringIO()
    s = logs.JsonStream(target, lambda: {"job": "j", "node": "n"})
    print("[rdzv-agent] job j failed: boom\n[rdzv-agent] root cause: x", file=s)  # type: ignore[arg-type]
    s.write("half a ")
    assert target.getvalue().count("\n") == 2  # the half line waits for its end
    s.write("line\n\n")
    s.write("rdzv-agent: error: bad flag\n")
    s.write("tail without newline")
    s.flush()
    rows = [json.loads(ln) for ln in target.getvalue().splitlines()]
    assert [r["message"] for r in rows] == [
        "[rdzv-agent] job j failed: boom",
        "[rdzv-agent] root cause: x",
        "half a line",
        "rdzv-agent: error: bad flag",
        "tail without newline",
    ]
    assert [r["level"] for r in rows] == ["INFO", "INFO", "INFO", "ERROR", "INFO"]
    assert all(r["job"] == "j" and r["node"] == "n" and r["logger"] == "stderr" for r in rows)
    assert s.isatty() is False


def test_json_stream_bounds_a_line_without_newline():
    target = io.StringIO()
    s = logs.JsonStream(target)
    s.write("x" * (3 * logs.MAX_MESSAGE))
    assert len(s._pending) <= logs.MAX_MESSAGE
    s.flush()
    assert all(len(json.loads(ln)["message"]) <= logs.MAX_MESSAGE for ln in target.getvalue().splitlines())


# ------------------------------------------------------------ the round machine's lines


def _lines(fx: rounds.Effects) -> list[logs.Line]:
    assert all(isinstance(line, logs.Line) for line in fx.logs), fx.logs
    return [line for line in fx.logs if isinstance(line, logs.Line)]


def _events(fx: rounds.Effects) -> list[tuple]:
    return [(ln.fields["event"], ln.fields["job"], ln.fields["round"], ln.fields["node"]) for ln in _lines(fx)]


def test_round_machine_lines_carry_their_event_job_round_and_node():
    sp = spec(min_nodes=2, max_nodes=2, max_restarts=1)
    job = rounds.new_job("j", sp, 0.0)
    rounds.join(job, join_msg("a", sp=sp), 0.0)
    fx = rounds.join(job, join_msg("b", sp=sp), 0.5)  # max reached: the round completes
    assert _events(fx) == [("node_joined", "j", 0, "b"), ("round_completed", "j", 0, None), ("job_state", "j", 0, None)]
    done = _lines(fx)[1].fields
    assert done["nodes"] == 2 and done["world_size"] == 2 and done["formation_s"] == 0.5
    fail = ExitRecord(local_rank=0, rank=1, pid=9, exit_code=3, message="boom")
    fx = rounds.fail(job, "b", 0, [fail], 5.0)
    assert _events(fx) == [
        ("node_failed", "j", 0, "b"),
        ("restart_charged", "j", 1, None),
        ("round_opened", "j", 1, None),
        ("job_state", "j", 1, None),
    ]
    exit_record = _lines(fx)[0].fields["exit"]
    assert exit_record["rank"] == 1 and exit_record["exit_code"] == 3 and exit_record["message"] == "boom"
    assert "restart 1/1" in _lines(fx)[2].fields["reason"] and _lines(fx)[2].fields["restarts"] == 1
    fx = rejoin(job, ["a", "b"], 6.0)
    assert ("round_completed", "j", 1, None) in _events(fx)
    fx = rounds.succeed(job, "a", 1, 7.0)
    assert _events(fx) == [("node_succeeded", "j", 1, "a")]
    fx = rounds.succeed(job, "b", 1, 8.0)
    assert _events(fx) == [("node_succeeded", "j", 1, "b"), ("job_state", "j", 1, None)]
    assert [ev.kind for ev in fx.events] == [e for e, *_ in _events(fx)]  # the lines are the events' lines
    assert _lines(fx)[1].fields["state"] == "succeeded"


def test_lost_and_evicted_nodes_are_told_apart():
    job = form(["a", "b", "c"])
    fx = rounds.leave(job, "c", "agent got SIGTERM", 10.0)
    assert ("node_lost", "j", 0, "c") in _events(fx) and ("round_opened", "j", 1, None) in _events(fx)
    job = form(["a", "b"], sp=spec(min_nodes=1, max_nodes=4, heartbeat_timeout_s=6.0))
    rounds.heartbeat(job, "a", 20.0)
    fx = rounds.tick(job, 20.0)  # b silent since 1.0: evicted
    assert ("node_evicted", "j", 0, "b") in _events(fx)


def test_scale_up_arrivals_and_spares_are_node_joined():
    sp = JobSpec(min_nodes=1, max_nodes=2, scale_up_window_s=0.5)
    job = form(["a"], sp=sp)
    fx = rounds.join(job, join_msg("b", sp=sp), 3.0)
    assert _events(fx) == [("node_joined", "j", 0, "b")] and _lines(fx)[0].fields["state"] == "waiting"


def test_a_round_machine_line_is_still_the_same_text():
    """Line is a str: the text format, and everything that compares log text, see the same words."""
    line = logs.event_line(form(["a"]), "job_state", "job j round 0: closed: by request", state="closed")
    assert line == "job j round 0: closed: by request" and str(line) == line


# ------------------------------------------------------------ text format unchanged

_COMPARE = r"""
import io, logging, sys
from rdzv_common import logs
fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
a, b = io.StringIO(), io.StringIO()
if sys.argv[1] == "setup":
    logs.setup("text", "INFO", fmt, stream=a)
else:
    logging.basicConfig(level="INFO", format=fmt, stream=a)
rec = logging.LogRecord("rdzv_server.store", logging.INFO, "", 0, "job %s round %d: x", ("j", 1), None)
rec.created, rec.msecs = 1_700_000_000.25, 250.0
h = logging.getLogger().handlers[0]
print(repr(h.format(rec)), h.stream is a, logging.getLogger().level)
"""


def test_text_format_is_byte_for_byte_what_basic_config_wrote():
    outs = [
        subprocess.run([sys.executable, "-c", _COMPARE, how], capture_output=True, text=True, check=True).stdout
        for how in ("setup", "basic")
    ]
    assert outs[0] == outs[1] and "INFO rdzv_server.store: job j round 1: x" in outs[0], outs


def test_log_format_flag_and_env_default(monkeypatch: pytest.MonkeyPatch):
    from rdzv_client.config import build_parser as agent_parser
    from rdzv_server.flags import build_parser as server_parser

    monkeypatch.delenv(logs.ENV_FORMAT, raising=False)
    assert server_parser().parse_args([]).log_format == "text"
    assert server_parser().parse_args(["--log-format", "json"]).log_format == "json"
    assert agent_parser().parse_args(["--log-format", "json", "x.py"]).log_format == "json"
    monkeypatch.setenv(logs.ENV_FORMAT, "JSON")
    assert server_parser().parse_args([]).log_format == "json"
    assert agent_parser().parse_args(["x.py"]).log_format == "json"
    monkeypatch.setenv(logs.ENV_FORMAT, "yaml")  # not a format: the default
    assert server_parser().parse_args([]).log_format == "text"
    with pytest.raises(SystemExit):
        server_parser().parse_args(["--log-format", "xml"])


def test_a_records_own_fields_win_over_the_context_even_when_none():
    """The embedded server (--standalone) logs through the agent's handler: a
    server line about job j (no node) must not carry the agent's node id."""
    agent = lambda: {"job": "agent-job", "node": "agent-node", "round": 7}  # noqa: E731
    line = logs.Line("job j round 0 opened", "round_opened", job="j", round=0, node=None)
    out = _format("%s", line, extra=logs.extra(line), context=agent)
    assert (out["job"], out["round"], out["node"], out["event"]) == ("j", 0, None, "round_opened")
    out = _format("job j deleted", extra={"rdzv": {"job": "j"}}, context=agent)
    assert (out["job"], out["round"], out["node"]) == ("j", None, None)
    out = _format("agent line", context=agent)  # no fields of its own: the context says what it is about
    assert (out["job"], out["round"], out["node"]) == ("agent-job", 7, "agent-node")
