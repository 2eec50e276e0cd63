"""The /ui page in headless Chromium against a real server and real agents:
a job forming with its progress bar moving as agents join, the round history
growing when a node is killed, the root cause after a failure, close from the
button, and with --token: the page works after login and refuses without it.

Every wait is Playwright's expect with a deadline; nothing is timed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from playwright.sync_api import expect

from tests.helpers.cluster import Cluster
from tests.helpers.procs import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

WORKER = Path(__file__).parent / "scripts" / "worker.py"
DEADLINE_MS = 30_000
TOKEN = "ui-s3cret-of-16-chars"


def agent(cluster: Cluster, server, job: str, host: str, nnodes: str, *flags: str, script_args: tuple = ()):
    return cluster.start_agent(
        server,
        job,
        WORKER,
        *script_args,
        nnodes=nnodes,
        flags=("--host-name", host, "--heartbeat-timeout", "10", *flags),
        name=host,
    )


def test_a_job_forms_restarts_and_fails_live_on_its_page(cluster: Cluster, page, tmp_path: Path) -> None:
    server = cluster.start_server("--disconnect-grace", "0.5")
    fail = tmp_path / "fail-now"
    common = ("--last-call", "600", "--max-restarts", "0")
    page.goto(f"{server.url}/ui/jobs/live")  # before the job exists: it appears with its first event
    expect(page.locator("#job-title")).to_have_text("live")

    agent(cluster, server, "live", "node-a", "2:3", *common, script_args=("--fail-file", str(fail)))
    progress = page.locator("#progress")
    expect(page.locator("#forming")).to_be_visible(timeout=DEADLINE_MS)
    expect(page.locator("#job-state")).to_have_text("waiting")
    expect(progress).to_have_attribute("data-joined", "1", timeout=DEADLINE_MS)
    expect(progress).to_have_attribute("data-min", "2")
    expect(progress).to_have_attribute("data-max", "3")
    expect(page.locator("#nodes-body .row")).to_have_count(1)
    width1 = page.locator("#progress-fill").evaluate("e => e.getBoundingClientRect().width")

    agent(cluster, server, "live", "node-b", "2:3", *common, script_args=("--fail-file", str(fail)))
    expect(progress).to_have_attribute("data-joined", "2", timeout=DEADLINE_MS)  # min reached: last call
    expect(page.locator("#forming-text")).to_contain_text("last call")
    width2 = page.locator("#progress-fill").evaluate("e => e.getBoundingClientRect().width")
    assert width2 > width1 > 0

    third = agent(cluster, server, "live", "node-c", "2:3", *common)
    expect(page.locator("#job-state")).to_have_text("running", timeout=DEADLINE_MS)  # max reached
    expect(page.locator("#forming")).to_be_hidden()
    expect(page.locator("#nodes-body .row")).to_have_count(3)
    expect(page.locator("#history li")).to_have_count(1)
    expect(page.locator("#history li").first).to_contain_text("world 3")
    # step/s once the workers report progress
    expect(page.locator("#nodes-body .row").first.locator(":scope > span").nth(8)).to_have_text(
        re.compile(r"\d+\.\d\d"), timeout=DEADLINE_MS
    )
    # each running node's workers under its row (issue 25): local rank -> global rank, as the server says
    nodes = server.job("live")["nodes"]
    assert sorted(n["rank_offset"] for n in nodes) == [0, 1, 2], nodes
    for n in nodes:
        workers = page.locator(f"#nodes-body .workers[data-node='{n['node_id']}'] .worker")
        expect(workers).to_have_count(1)
        expect(workers.first).to_have_text(f"local 0 · rank {n['rank_offset']}")

    cluster.kill_node(third)  # lost: a new round (not charged), re-formed by the other two
    expect(page.locator("#history li")).to_have_count(2, timeout=DEADLINE_MS)
    newest = page.locator("#history li").first
    expect(newest).to_contain_text("round 1")
    expect(newest).to_contain_text("node-c")
    expect(newest).to_contain_text("world 2", timeout=DEADLINE_MS)
    expect(page.locator("#nodes-body .row")).to_have_count(2)
    expect(page.locator("#events li[data-type=node_lost]")).to_have_count(1)

    fail.write_text("now")  # the workers exit 3; no restart is left: the job fails
    expect(page.locator("#job-state")).to_have_text("failed", timeout=DEADLINE_MS)
    expect(page.locator("#root-cause")).to_be_visible()
    expect(page.locator("#root-cause-text")).to_contain_text("exit code 3")
    expect(page.locator("#root-cause-text")).to_contain_text("loss is nan <b>(ui test)</b>")  # text, not markup
    expect(page.locator("#root-cause-text b")).to_have_count(0)
    expect(page.locator("#close-btn")).to_be_disabled()
    # a failed job in one place (issue 25): the culprit and its last stderr lines, as text;
    # its row marked; the node that was lost still listed, with when and why
    culprit = server.job("live")["culprit"]
    expect(page.locator("#culprit")).to_be_visible()
    expect(page.locator("#culprit-title")).to_contain_text(f"node {culprit['node_id']} ({culprit['host']}), rank ")
    expect(page.locator("#culprit-stderr")).to_contain_text("ValueError: loss is nan <b>(ui test)</b>")
    expect(page.locator("#culprit-stderr b")).to_have_count(0)
    marked = page.locator("#nodes-body .row.culprit")
    expect(marked).to_have_count(1)
    expect(marked).to_have_attribute("data-node", culprit["node_id"])
    failed = page.locator(f"#nodes-body .workers[data-node='{culprit['node_id']}'] .worker.culprit")
    expect(failed).to_have_count(1)  # the rank that failed, among its node's workers; its cause as text
    expect(failed).to_have_attribute("data-rank", str(culprit["rank"]))
    expect(failed).to_contain_text(f"local {culprit['local_rank']} · rank {culprit['rank']} · failed in round 1")
    expect(failed.locator("b")).to_have_count(0)
    lost = page.locator("#departed li")
    expect(lost).to_have_count(1)
    expect(lost).to_contain_text("node-c")
    expect(lost).to_contain_text("connection lost")
    expect(lost).to_contain_text("in round 0")

    # the hosts page: the culprit's host counts the failure
    page.goto(f"{server.url}/ui/hosts")
    host_row = page.locator(f"#hosts-body tr[data-host='{culprit['host']}']")
    expect(host_row).to_contain_text("worker failure", timeout=DEADLINE_MS)
    expect(host_row.locator("td").nth(3)).to_have_text("1")

    # the job list shows it, filtered by state
    page.goto(f"{server.url}/")
    expect(page).to_have_url(f"{server.url}/ui")
    row = page.locator("#jobs-body tr[data-job=live]")
    expect(row).to_contain_text("failed")
    expect(row.locator("td").nth(4)).to_have_text("2:3")
    expect(row.locator("td.reason")).to_contain_text("exit code 3")  # the reason column: why it ended
    page.select_option("#state-filter", "running")
    expect(page.locator("#jobs-body tr")).to_have_count(0)
    page.select_option("#state-filter", "failed")
    expect(page.locator("#jobs-body tr")).to_have_count(1)


def test_close_from_the_button_after_confirmation(cluster: Cluster, page) -> None:
    server = cluster.start_server()
    node = agent(cluster, server, "closeme", "node-x", "1")
    server.wait_job("closeme", lambda v: v["state"] == "running", 30, "the job runs")
    page.goto(f"{server.url}/ui/jobs/closeme")
    expect(page.locator("#job-state")).to_have_text("running")
    page.click("#close-btn")
    expect(page.locator("#close-confirm")).to_be_visible()
    page.click("#close-no")  # changed its mind: nothing happens
    expect(page.locator("#close-confirm")).to_be_hidden()
    assert server.job("closeme")["state"] == "running"
    page.click("#close-btn")
    page.click("#close-yes")
    expect(page.locator("#job-state")).to_have_text("closed", timeout=DEADLINE_MS)
    assert server.job("closeme")["state"] == "closed"
    wait_until(lambda: node.popen.poll() is not None, 30, "the agent exits after the close")


def test_a_job_ids_next_run_shows_live_with_its_previous_run(cluster: Cluster, page) -> None:
    """A closed job id started again is run 2: the page open on it follows the
    new run (its events carry the run) and lists run 1 under previous runs."""
    server = cluster.start_server()
    first = agent(cluster, server, "again", "node-x", "1")
    server.wait_job("again", lambda v: v["state"] == "running", 30, "run 1 runs")
    page.goto(f"{server.url}/ui/jobs/again")
    expect(page.locator("#job-state")).to_have_text("running")
    expect(page.locator("#runs-box")).to_be_hidden()
    page.click("#close-btn")
    page.click("#close-yes")
    expect(page.locator("#job-state")).to_have_text("closed", timeout=DEADLINE_MS)
    wait_until(lambda: first.popen.poll() is not None, 30, "run 1's agent exits after the close")

    agent(cluster, server, "again", "node-y", "1")  # a fresh join: the job id's run 2
    expect(page.locator("#job-state")).to_have_text("running", timeout=DEADLINE_MS)
    expect(page.locator("#job-facts")).to_contain_text("run 2")
    expect(page.locator("#runs-box")).to_be_visible()
    expect(page.locator("#runs li")).to_have_count(1)
    expect(page.locator("#runs li[data-run='1']")).to_contain_text("closed")
    expect(page.locator("#events li[data-type=round_completed]").first).to_contain_text("run 2 round 0")


def test_with_a_token_the_page_works_after_login_and_refuses_without(cluster: Cluster, browser, page) -> None:
    server = cluster.start_server("--token", TOKEN)
    agent(cluster, server, "secured", "node-t", "1", "--token", TOKEN)
    wait_until(
        lambda: server.request("GET", "/v1/jobs/secured", token=TOKEN)[1].get("state") == "running",
        30,
        "the job runs",
    )
    page.goto(f"{server.url}/ui")
    expect(page.locator("#login")).to_be_visible()
    expect(page.locator("#jobs")).to_be_hidden()
    page.fill("#token", "wrong")
    page.click("#login-form button")
    expect(page.locator("#login-error")).to_have_text("wrong token")
    expect(page.locator("#jobs")).to_be_hidden()
    page.fill("#token", TOKEN)
    page.click("#login-form button")
    expect(page.locator("#jobs-body tr[data-job=secured]")).to_contain_text("running")
    expect(page.locator("#live")).to_have_text("live")  # the event stream is open: the cookie authorizes it
    cookie = next(c for c in page.context.cookies() if c["name"] == "rdzv_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and TOKEN not in cookie["value"]
    assert page.evaluate("document.cookie") == ""  # HttpOnly: the page's scripts cannot read it

    # the job page, live, and close with the cookie
    page.goto(f"{server.url}/ui/jobs/secured")
    expect(page.locator("#job-state")).to_have_text("running")
    page.click("#close-btn")
    page.click("#close-yes")
    expect(page.locator("#job-state")).to_have_text("closed", timeout=DEADLINE_MS)

    # the session's role shows (one token: every role); signing out revokes the cookie
    expect(page.locator("#role")).to_have_text("operator")
    page.click("#logout")
    expect(page.locator("#login")).to_be_visible()
    expect(page.locator("#session")).to_be_hidden()
    assert page.evaluate("fetch('/v1/jobs/secured').then(r => r.status)") == 401

    # another browser (no cookie): the login form, and the API refuses
    other = browser.new_context()
    try:
        p2 = other.new_page()
        p2.goto(f"{server.url}/ui/jobs/secured")
        expect(p2.locator("#login")).to_be_visible()
        expect(p2.locator("#job")).to_be_hidden()
        status = p2.evaluate("fetch('/v1/jobs/secured').then(r => r.status)")
        assert status == 401
        status = p2.evaluate("fetch('/v1/events?since=0').then(r => r.status)")
        assert status == 401
    finally:
        other.close()


def test_a_session_of_the_ordinary_token_cannot_close_and_says_why(cluster: Cluster, page) -> None:
    """With --operator-token, a /ui session signed in with the ordinary token
    shows its role, and the Close button answers with the server's 403 message
    naming the operator token; the job keeps running. Signed in again with the
    operator token, the same button closes it."""
    operator = "operator-s3cret-of-16-chars"
    server = cluster.start_server("--token", TOKEN, "--operator-token", operator)
    agent(cluster, server, "guarded", "node-g", "1", "--token", TOKEN)
    wait_until(
        lambda: server.request("GET", "/v1/jobs/guarded", token=TOKEN)[1].get("state") == "running",
        30,
        "the job runs",
    )
    page.goto(f"{server.url}/ui/jobs/guarded")
    page.fill("#token", TOKEN)
    page.click("#login-form button")
    expect(page.locator("#job-state")).to_have_text("running")
    expect(page.locator("#role")).to_have_text("agent")
    page.click("#close-btn")
    page.click("#close-yes")
    expect(page.locator("#close-error")).to_contain_text("needs the operator token")
    assert server.request("GET", "/v1/jobs/guarded", token=TOKEN)[1]["state"] == "running"
    page.click("#logout")
    page.fill("#token", operator)
    page.click("#login-form button")
    expect(page.locator("#role")).to_have_text("operator")
    page.click("#close-btn")
    page.click("#close-yes")
    expect(page.locator("#job-state")).to_have_text("closed", timeout=DEADLINE_MS)


def test_a_page_on_another_port_of_the_same_host_cannot_join_or_close(cluster: Cluster, page) -> None:
    """Signed in to /ui (the browser holds the session cookie, which SameSite
    does not keep from other ports of 127.0.0.1), a page served from another
    port opens the agent channel and sends a join, and posts a close: the
    upgrade is refused (no message ever arrives, no job is created) and the
    job keeps running."""
    server = cluster.start_server("--token", TOKEN)
    agent(cluster, server, "victim", "node-v", "1", "--token", TOKEN)
    wait_until(
        lambda: server.request("GET", "/v1/jobs/victim", token=TOKEN)[1].get("state") == "running",
        30,
        "the job runs",
    )
    page.goto(f"{server.url}/ui")
    page.fill("#token", TOKEN)
    page.click("#login-form button")
    expect(page.locator("#jobs-body tr[data-job=victim]")).to_contain_text("running")
    assert any(c["name"] == "rdzv_session" for c in page.context.cookies())

    site = _OtherPort()  # a real server: a page Playwright fulfils itself cannot open WebSockets at all
    try:
        page.goto(f"http://127.0.0.1:{site.port}/cats.html")
        _try_to_join_and_close(server, page)
    finally:
        site.close()


class _OtherPort:
    """A page of another site on another port of 127.0.0.1 (a thread of this process)."""

    def __init__(self) -> None:
        import http.server
        import threading

        class Page(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = b"<!doctype html><p>cute cats</p>"
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


def _try_to_join_and_close(server, page) -> None:
    from rdzv_common.protocol import JobSpec, JoinMsg

    join = JoinMsg(
        job_id="evil-job",
        node_id="evil",
        local_world_size=1,
        spec=JobSpec(min_nodes=1, max_nodes=1),
        host="evil",
        addr="10.66.66.66",
        master_port=4444,
    ).model_dump_json()
    result = page.evaluate(
        """([url, join]) => new Promise(resolve => {
            const got = [];
            let opened = false;
            const ws = new WebSocket(url);
            ws.onopen = () => { opened = true; ws.send(join); };
            ws.onmessage = (m) => got.push(m.data);
            ws.onclose = () => resolve({ opened, got });
            setTimeout(() => resolve({ opened, got, hung: true }), 15000);  // a deadline, not a timing
        })""",
        [f"ws://127.0.0.1:{server.port}/v1/agent", join],
    )
    assert result == {"opened": False, "got": []}, result
    page.evaluate(
        "(u) => fetch(u, { method: 'POST', credentials: 'include', mode: 'no-cors' }).catch(() => null)",
        f"{server.url}/v1/jobs/victim/close",
    )
    status, _ = server.request("GET", "/v1/jobs/evil-job", token=TOKEN)
    assert status == 404
    assert server.request("GET", "/v1/jobs/victim", token=TOKEN)[1]["state"] == "running"
