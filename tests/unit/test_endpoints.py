"""Endpoint lists (issue 11, client side): how ``h1:29400,h2:29400`` is read
everywhere a server endpoint is accepted, and the order in which a client
tries the endpoints of its list (a leader hint is followed only when it names
one of them)."""

from __future__ import annotations

import logging
import os

import pytest

from rdzv_client import cli, endpoints
from rdzv_client.config import UsageError, build_parser, config_from_args
from rdzv_client.endpoints import MAX_ENDPOINTS, Endpoints, EndpointTries, base_url, parse_endpoints

# ------------------------------------------------------------ parsing


def test_a_single_endpoint_is_what_base_url_makes_of_it() -> None:
    for one in ("127.0.0.1:1", "h", "https://h:443/", "[::1]:5", "  h:7  "):
        assert parse_endpoints(one) == [base_url(one)]


def test_a_list_keeps_its_order_and_takes_every_form_parse_endpoint_takes() -> None:
    assert parse_endpoints("h1:1,https://h2:2,[::1]:3,h4") == [
        "http://h1:1",
        "https://h2:2",
        "http://[::1]:3",
        "http://h4:29400",
    ]


def test_whitespace_around_items_is_ignored() -> None:
    assert parse_endpoints(" h1:1 ,\th2:2\n, h3:3") == ["http://h1:1", "http://h2:2", "http://h3:3"]


def test_duplicates_are_removed_first_one_kept() -> None:
    assert parse_endpoints("h2:2,h1:29400,http://h1,h2:2,http://h1:29400/") == ["http://h2:2", "http://h1:29400"]


@pytest.mark.parametrize("text", ["h1:1,,h2:2", "h1:1,", ",h1:1", "h1:1, ,h2:2", "", "  "])
def test_an_empty_item_is_one_clear_line(text: str) -> None:
    with pytest.raises(ValueError, match="empty") as e:
        parse_endpoints(text)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("h1:1,ftp://x", "'ftp://x'"),
        ("h1:1,h2:port", "'h2:port'"),
        ("h1:1,h2:70000", "'h2:70000'"),
        ("h1:1,:5", "':5'"),
    ],
)
def test_a_bad_item_is_one_line_naming_it(text: str, named: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_endpoints(text)
    assert named in str(e.value)
    assert "\n" not in str(e.value)


def test_the_list_is_capped() -> None:
    ok = ",".join(f"h{i}:1" for i in range(MAX_ENDPOINTS))
    assert len(parse_endpoints(ok)) == MAX_ENDPOINTS
    with pytest.raises(ValueError, match=f"at most {MAX_ENDPOINTS}"):
        parse_endpoints(ok + ",one-more:1")


# ------------------------------------------------------------ the order of tries


def test_a_single_endpoint_backs_off_after_each_failure() -> None:
    e = Endpoints("h:1").tries()
    for _ in range(3):
        assert e.url == "http://h:1"
        assert e.failed() is False  # a full cycle: back off, then the same one again
    assert e.url == "http://h:1"


def test_the_next_endpoint_comes_at_once_and_a_full_cycle_backs_off() -> None:
    e = Endpoints("a:1,b:2,c:3").tries()
    seen = [e.url]
    nows = []
    for _ in range(6):
        nows.append(e.failed())
        seen.append(e.url)
    assert seen == ["http://a:1", "http://b:2", "http://c:3", "http://a:1", "http://b:2", "http://c:3", "http://a:1"]
    assert nows == [True, True, False, True, True, False]


def test_a_success_starts_the_cycle_over_and_is_where_the_next_tries_start() -> None:
    eps = Endpoints("a:1,b:2,c:3")
    e = eps.tries()
    assert e.failed() is True
    e.ok()  # b answered
    assert eps.good == 1
    assert eps.tries().url == "http://b:2"  # a new call starts at the last good one
    assert (e.failed(), e.url) == (True, "http://c:3")  # b failed later: c, a, then back off
    assert (e.failed(), e.url) == (True, "http://a:1")
    assert (e.failed(), e.url) == (False, "http://b:2")


def test_a_hint_in_the_list_is_tried_next_at_once() -> None:
    e = Endpoints("a:1,b:2,c:3").tries()
    assert e.failed(leader="http://c:3") is True
    assert e.url == "http://c:3"  # b skipped
    # the leader's advertise URL may be spelled otherwise: compared as base URLs
    e2 = Endpoints("http://a:1,c:3,b:29400").tries()
    assert (e2.failed(leader="http://B"), e2.url) == (True, "http://b:29400")


def test_a_hint_already_tried_in_this_cycle_is_not_followed_again() -> None:
    e = Endpoints("a:1,b:2,c:3").tries()
    assert (e.failed(), e.url) == (True, "http://b:2")
    assert (e.failed(leader="http://a:1"), e.url) == (True, "http://c:3")  # a failed already: next untried
    # c hints at a too: every one tried, back off; the hint is tried first after it
    assert (e.failed(leader="http://a:1"), e.url) == (False, "http://a:1")


def test_a_hint_not_in_the_list_is_ignored_and_said_once_escaped(caplog: pytest.LogCaptureFixture) -> None:
    e = Endpoints("a:1,b:2,c:3").tries()
    with caplog.at_level(logging.WARNING, logger="rdzv_client.endpoints"):
        assert (e.failed(leader="http://evil:1\x1b[2J"), e.url) == (True, "http://b:2")
        assert (e.failed(leader="http://evil:1\x1b[2J"), e.url) == (True, "http://c:3")
        assert (e.failed(leader="not a url at all:x"), e.url) == (False, "http://a:1")
    said = [r.getMessage() for r in caplog.records if "hint" in r.getMessage()]
    assert len(said) == 2, said
    assert "\x1b" not in said[0] and "\\x1b" in said[0]
    assert "evil" in said[0]


def led_by_a_naming(successor: str) -> tuple[Endpoints, EndpointTries]:
    eps = Endpoints("a:1,b:2,c:3")
    e = eps.tries()
    e.ok()  # a leads
    eps.connected(successor)  # its 101 named the successor
    return eps, e


def test_a_dropped_connection_goes_to_the_successor_its_leader_named_first() -> None:
    _, e = led_by_a_naming("http://c:3")
    assert (e.dropped(), e.url) == (True, "http://c:3")  # c before b


def test_a_successor_in_its_election_is_waited_for_not_walked_past() -> None:
    _, e = led_by_a_naming("http://c:3")
    e.dropped()
    assert (e.failed(None, not_leader=True), e.url) == (False, "http://c:3")  # back off, then c again
    assert (e.failed("http://c:3", not_leader=True), e.url) == (False, "http://c:3")  # elected, loading
    assert (e.failed(None, not_leader=True), e.url) == (False, "http://c:3")


def test_a_successor_naming_a_leader_is_followed_and_the_dropped_one_if_gone_sends_it_back() -> None:
    _, e = led_by_a_naming("http://c:3")
    e.dropped()
    assert (e.failed("http://a:1", not_leader=True), e.url) == (True, "http://a:1")  # a blip? a still leads
    assert (e.failed(), e.url) == (False, "http://c:3")  # a refused: gone; back off, then c
    # c names a still (its probe has not seen it refuse): a is not tried again, c is waited for
    assert (e.failed("http://a:1", not_leader=True), e.url) == (False, "http://c:3")
    _, e2 = led_by_a_naming("http://c:3")
    e2.dropped()
    assert (e2.failed("http://b:2", not_leader=True), e2.url) == (True, "http://b:2")  # b won the election


def test_a_dropped_leader_that_answers_not_leader_is_alive_and_the_list_is_walked() -> None:
    """It reloads (or was deposed and leads again): not gone, so not back to the successor to wait."""
    _, e = led_by_a_naming("http://c:3")
    e.dropped()
    assert (e.failed("http://a:1", not_leader=True), e.url) == (True, "http://a:1")
    assert (e.failed(None, not_leader=True), e.url) == (True, "http://b:2")  # a: alive, no leader now
    assert (e.failed("http://a:1", not_leader=True), e.url) == (False, "http://a:1")  # a full cycle: back off, a


def test_a_successor_gone_too_walks_the_rest_of_the_list() -> None:
    _, e = led_by_a_naming("http://c:3")
    e.dropped()
    assert (e.failed(), e.url) == (True, "http://b:2")  # c refused the connection: b, not a again
    assert (e.failed(None, not_leader=True), e.url) == (False, "http://c:3")  # a full cycle: back off


def test_the_successor_is_waited_for_only_so_long(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(endpoints, "SUCCESSOR_WAIT_S", 0.0)
    _, e = led_by_a_naming("http://c:3")
    e.dropped()
    assert e.url == "http://c:3"
    assert e.failed(None, not_leader=True) is True and e.url != "http://c:3"  # the list, as before


def test_without_a_successor_a_drop_is_a_failure_as_before() -> None:
    _, e = led_by_a_naming("http://a:1")  # it named itself (not the successor of itself): ignored
    assert (e.dropped(), e.url) == (True, "http://b:2")


def test_a_refusals_leader_hint_comes_before_the_successor() -> None:
    eps = Endpoints("a:1,b:2,c:3")
    e = eps.tries()
    e.ok()
    eps.connected("http://c:3")
    assert (e.failed(leader="http://b:2"), e.url) == (True, "http://b:2")


def test_a_successor_not_in_the_list_or_none_or_one_endpoint_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    eps = Endpoints("a:1,b:2,c:3")
    e = eps.tries()
    e.ok()
    with caplog.at_level(logging.WARNING, logger="rdzv_client.endpoints"):
        eps.connected("http://elsewhere:9")
    assert eps.successor is None and "elsewhere" in caplog.text  # said, as a leader hint elsewhere is
    assert (e.failed(), e.url) == (True, "http://b:2")
    eps.connected("http://c:3")
    eps.connected(None)  # the next leader named none (an older server, or no other replica registered)
    assert eps.successor is None
    one = Endpoints("a:1")
    one.connected("http://a:1")
    assert one.successor is None


# ------------------------------------------------------------ where lists are accepted


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("PET_", "RDZV_", "SLURM_")):
            monkeypatch.delenv(name)


def _agent_cfg(*argv: str):
    return config_from_args(build_parser().parse_args([*argv, "--job-id", "j", "train.py"]))


@pytest.mark.usefixtures("no_env")
def test_the_agent_takes_a_list_and_refuses_a_bad_one_in_one_line() -> None:
    assert _agent_cfg("--rdzv-endpoint", "h1:1, h2:2").endpoint == "h1:1, h2:2"
    with pytest.raises(UsageError, match="empty") as e:
        _agent_cfg("--endpoint", "h1:1,,h2:2")
    assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match="'h2:x'"):
        _agent_cfg("--endpoint", "h1:1,h2:x")


def test_the_cli_refuses_a_bad_list_as_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--endpoint", "127.0.0.1:1,,127.0.0.1:2", "status"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("rdzv: ") and "empty" in err and err.count("\n") == 1


def test_the_torchrun_handler_takes_a_list() -> None:
    pytest.importorskip("torch")
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from rdzv_client.torch_plugin import RdzvRendezvousHandler

    params = RendezvousParameters(
        backend="rdzv", endpoint="127.0.0.1:1,127.0.0.1:2", run_id="exp1", min_nodes=1, max_nodes=1
    )
    h = RdzvRendezvousHandler(params)
    assert h.endpoints.urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    bad = RendezvousParameters(backend="rdzv", endpoint="127.0.0.1:1,,x:2", run_id="exp1", min_nodes=1, max_nodes=1)
    with pytest.raises(ValueError, match="empty"):
        RdzvRendezvousHandler(bad)


def test_the_clock_check_asks_the_first_endpoint_of_the_list_that_answers() -> None:
    import http.server
    import threading

    from rdzv_client.health import check_clock
    from tests.helpers.procs import free_port

    class Healthz(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/healthz" else 404)  # with a Date header
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Healthz)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        dead = f"127.0.0.1:{free_port()}"
        assert check_clock(f"{dead}, 127.0.0.1:{server.server_port}", 5.0, timeout=2.0) is None
        other = f"127.0.0.1:{free_port()}"
        failed = check_clock(f"{dead},{other}", 5.0, timeout=2.0)
        assert failed is not None and failed.startswith(f"clock: cannot reach the server at http://{other}: ")
        assert (check_clock("h1:1,,h2:2", 5.0) or "").startswith("clock: ")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
