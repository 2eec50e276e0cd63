"""The job view of a big job, a page at a time (issue 24): ``?limit=&cursor=``
walks every node once, in the view's order (members by rank, spares last), and
``node_counts`` counts all of them whatever the page; bad paging input is a
validation error that changes nothing."""

from __future__ import annotations

from .conftest import form, join_msg


async def _get(client, path: str, status: int = 200):
    resp = await client.get(path)
    assert resp.status == status, (resp.status, await resp.text())
    return await resp.json()


async def test_a_job_view_pages_its_nodes_and_counts_them_all(client, connect):
    agents, got = await form(connect, "paged", [f"node{i}" for i in range(5)], nnodes=(5, 5))
    spare = await connect()
    await spare.send(join_msg("paged", "node5", (5, 5)))
    await spare.expect("joined")
    await spare.expect("spare")
    whole = await _get(client, "/v1/jobs/paged")
    assert whole["next_cursor"] is None and whole["nodes_omitted"] == 0
    assert whole["node_counts"] == {"running": 5, "spare": 1}
    seen, spares, path, pages = [], [], "/v1/jobs/paged?limit=2", 0
    while True:
        page = await _get(client, path)
        pages += 1
        assert len(page["nodes"]) + len(page["spares"]) <= 2
        assert page["node_counts"] == {"running": 5, "spare": 1}  # every page: all of them
        seen += [n["group_rank"] for n in page["nodes"]]
        spares += [n["node_id"] for n in page["spares"]]
        if page["next_cursor"] is None:
            break
        path = f"/v1/jobs/paged?limit=2&cursor={page['next_cursor']}"
    assert (seen, spares, pages) == ([0, 1, 2, 3, 4], ["node5"], 3)
    first = await _get(client, "/v1/jobs/paged?limit=2")
    assert first["nodes_omitted"] == 4 and first["next_cursor"]


async def test_bad_paging_of_a_job_view_is_refused(client, connect):
    await form(connect, "paged2", ["node0", "node1"])
    for query in ("limit=0", "limit=x", "limit=10001", "cursor=bm90IGEgY3Vyc29y", "cursor=%00"):
        body = await _get(client, f"/v1/jobs/paged2?{query}", 422)
        assert body["code"] == "validation_error", (query, body)
    assert len((await _get(client, "/v1/jobs/paged2?limit=1"))["nodes"]) == 1
