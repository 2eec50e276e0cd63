"""Owned job ids and job-secret guessing on the real app (issue 19, items 3
and 7): a finished job whose run had a job secret starts its next run only
for that secret; wrong job secrets are slowed past a limit, the right one
never refused; a job secret is at least 16 characters."""

from __future__ import annotations

import asyncio

import pytest

from rdzv_common.protocol import SucceededMsg
from rdzv_server.app import Settings
from rdzv_server.guesses import DEFAULT_LIMIT
from rdzv_server.keys import GUESSES

from .conftest import TIMEOUT, join_msg
from .test_hostile import expect_error, snapshot

OWNER = "team-secret-0123456789"  # what the team's batch script exports as RDZV_JOB_SECRET
STRANGER = dict(addr="10.66.66.66", host="evil", master_port=4444)


async def run_once(connect, job_id: str, secret: str | None) -> None:
    """Run 1 of ``job_id`` (one node) succeeds; its agent is told it is done."""
    agent = await connect()
    await agent.send(join_msg(job_id, "a", (1, 1), job_secret=secret))
    await agent.expect("joined")
    await agent.expect("assigned")
    await agent.send(SucceededMsg(round=0))
    while (msg := await agent.recv()).op != "done":
        pass
    assert msg.state == "succeeded", msg


async def test_a_stranger_cannot_take_the_next_run_of_an_owned_id(client, connect):
    """The issue's probe: run 1 of "nightly" (with a job secret) ends; a
    stranger's fresh join, without the secret or with its own, other settings
    and its own address, is refused saying how the id is reused, and changes
    nothing (the job still shows run 1). The owner's next join starts run 2,
    with other settings if it likes."""
    await run_once(connect, "nightly", OWNER)
    before = await snapshot(client)
    for secret in (None, "stranger-s3cret-0123456789"):
        stranger = await connect()
        await stranger.send(join_msg("nightly", "evil-node", (1, 2), job_secret=secret, **STRANGER))
        text = await expect_error(stranger, "job_secret_mismatch")
        assert "owned by its run 1 (succeeded)" in text and "RDZV_JOB_SECRET" in text, text
        assert "rdzv delete nightly" in text, text
    assert await snapshot(client) == before
    view = before["views"]["nightly"]
    assert (view["run"], view["state"]) == (1, "succeeded"), view
    owner = await connect()
    await owner.send(join_msg("nightly", "b", (1, 2), job_secret=OWNER))
    assert (await owner.expect("joined")).run == 2
    view = (await snapshot(client))["views"]["nightly"]
    assert (view["run"], view["state"], view["max_nodes"]) == (2, "waiting", 2), view
    assert [(r["run"], r["state"]) for r in view["runs"]] == [(1, "succeeded")], view


async def test_a_run_without_a_secret_is_anyones_next_run(client, connect):
    """Without a job secret, as before: any fresh join starts the next run."""
    await run_once(connect, "open", None)
    other = await connect()
    await other.send(join_msg("open", "x", (1, 1), **STRANGER))
    assert (await other.expect("joined")).run == 2


async def test_an_owned_id_stays_owned_across_a_restart_and_delete_releases_it(make_client, connect, tmp_path):
    """The finished job keeps its secret's hash on disk: after a restart the
    stranger is still refused; the operator's DELETE releases the id."""
    first = await make_client(Settings(data_dir=tmp_path))
    await run_once(lambda: connect(on=first), "kept", OWNER)
    await first.close()
    second = await make_client(Settings(data_dir=tmp_path))
    stranger = await connect(on=second)
    await stranger.send(join_msg("kept", "evil-node", (1, 1), **STRANGER))
    await expect_error(stranger, "job_secret_mismatch")
    resp = await second.delete("/v1/jobs/kept")
    assert resp.status == 200, await resp.text()
    await stranger.send(join_msg("kept", "evil-node", (1, 1), **STRANGER))
    assert (await stranger.expect("joined")).run == 1  # a new job, the stranger's now


async def test_a_short_job_secret_is_a_validation_error_and_changes_nothing(client, connect):
    before = await snapshot(client)
    agent = await connect()
    for secret in ("x", "0123456789abcde"):  # 15 characters: one too few
        frame = join_msg("short", "a", (1, 1)).model_dump() | {"job_secret": secret}
        await agent.send(frame)
        text = await expect_error(agent, "validation_error")
        assert "job_secret" in text and "16 characters" in text, text
    assert await snapshot(client) == before


async def _guess(connect, job_id: str, n: int) -> None:
    """``n`` wrong job secrets for ``job_id``, at most 20 per connection (the error replies a connection gets)."""
    agent = None
    for i in range(n):
        if i % 20 == 0:
            agent = await connect()
        assert agent is not None
        await agent.send(join_msg(job_id, f"guess{i}", job_secret=f"guess-{i:06d}-0123456789"))
        text = await expect_error(agent, "job_secret_mismatch")
        assert "too many" not in text, (i, text)


async def test_guessing_a_job_secret_is_slowed_and_the_right_one_still_joins(client, connect):
    """Past the limit every join with a job secret to that job (or from that
    address) waits the throttle's delay before its secret is checked; a wrong
    one is then refused, saying why, and its connection closed (one guess per
    connection); the right one joins. A join to another job without a secret
    is not held."""
    throttle = client.server.app[GUESSES]
    delay = throttle.delay_s
    member = await connect()
    await member.send(join_msg("guarded", "node1", job_secret=OWNER))
    await member.expect("joined")
    await _guess(connect, "guarded", DEFAULT_LIMIT)
    assert throttle.slowed("guarded", "127.0.0.1")
    before = await snapshot(client)
    guesser = await connect()
    await guesser.send(join_msg("guarded", "guess-late", job_secret="guess-late-0123456789"))
    with pytest.raises(asyncio.TimeoutError):  # held: nothing comes before the delay (sleep never ends early)
        await guesser.recv(timeout=delay / 5)
    text = await expect_error(guesser, "job_secret_mismatch")
    assert "too many wrong job secrets" in text and f"waits {delay:g}s" in text, text
    await guesser.wait_closed(TIMEOUT + delay)
    assert await snapshot(client) == before
    plain = await connect()  # no job secret: nothing to guess, not held
    await plain.send(join_msg("open", "n1", (1, 1)))
    assert (await plain.expect("joined")).run == 1
    teammate = await connect()  # the right secret, from the same (slowed) address: never locked out
    await teammate.send(join_msg("guarded", "node2", job_secret=OWNER))
    assert (await teammate.recv(timeout=TIMEOUT + delay)).op == "joined"
    assert (await teammate.expect("assigned")).assignment.world_size == 2


async def test_a_refused_stranger_takes_no_room_from_a_waiting_job(make_client, connect):
    """Ownership is checked before room is made: with --max-waiting-jobs full of a job no connected node
    holds, a stranger's join to an owned finished id is refused (job_secret_mismatch) and the waiting job
    is not closed to make room for it (issue 19 review: the room check ran first and reclaimed it)."""
    from rdzv_common.protocol import JobSpec, LeaveMsg

    client = await make_client(Settings(max_waiting_jobs=1))
    await run_once(lambda: connect(on=client), "nightly", OWNER)
    team = await connect(on=client)  # a team's job that waits, its one node gone for now
    await team.send(join_msg("team", "n0", spec=JobSpec(min_nodes=2, max_nodes=2)))
    await team.expect("joined")
    await team.send(LeaveMsg(reason="preempted"))
    await team.expect("ack")
    stranger = await connect(on=client)
    await stranger.send(join_msg("nightly", "evil-node", (1, 2), **STRANGER))
    await expect_error(stranger, "job_secret_mismatch")
    view = await (await client.get("/v1/jobs/team")).json()
    assert view["state"] == "waiting", view  # before: closed to make room for a join then refused
