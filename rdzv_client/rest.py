"""The REST client: :class:`RestClient` wraps the REST paths for the ``rdzv``
command and tests (on aiohttp, imported when one is made). It takes an
endpoint list as the agent's link does (:mod:`rdzv_client.endpoints`).
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from rdzv_common.errors import LEADER_HEADER, NotLeaderError, RdzvError, UnavailableError, error_from_body
from rdzv_common.wire import printable

from .endpoints import BACKOFF_MAX_S, Endpoints, backoff_delays

if TYPE_CHECKING:
    from rdzv_common.protocol import CloseResult, DeleteResult, JobList, JobView

# An event stream that sent nothing (not even its keep-alive comment, every 15 s) this long is dead: reconnect.
STREAM_READ_TIMEOUT_S = 45.0
MAX_EVENT_BYTES = 1024 * 1024


def _refusal(status: int, headers: Any, body: bytes, where: str) -> RdzvError:
    """A REST refusal as its RdzvError (a ``not_leader`` with the leader its header names)."""
    try:
        data = json.loads(body)
        err = error_from_body(data["code"], data["message"])
    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: JSON nested too deep
        return RdzvError(f"HTTP {status} from {where}")
    if isinstance(err, NotLeaderError):
        leader = headers.get(LEADER_HEADER)
        return NotLeaderError(f"{where}: {err.message}", leader=leader if isinstance(leader, str) else None)
    return err


async def _walk(fetch: Callable[[str | None], Awaitable[Any]], max_pages: int) -> list[Any]:
    """Pages of a paged REST list, first to last (at most ``max_pages``): the
    one loop behind every ``all_*`` call."""
    pages = [await fetch(None)]
    while pages[-1].next_cursor and len(pages) < max_pages:
        pages.append(await fetch(pages[-1].next_cursor))
    return pages


class RestClient:
    """The REST API: jobs, one job, close, health. Errors come back as the
    :class:`RdzvError` of their code; an unreachable server as UnavailableError.
    ``endpoint`` may be a list (HA replicas): a call starts at the last one
    that answered and, on an unreachable one or a ``not_leader`` refusal,
    goes on to the leader it named (if in the list) or the next; it raises
    the last error once every endpoint failed."""

    def __init__(
        self,
        endpoint: str,
        token: str | None = None,
        timeout: float = 10.0,
        ssl_ctx: ssl.SSLContext | bool | None = None,
    ) -> None:
        self.endpoints = Endpoints(endpoint)
        import aiohttp

        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.ssl = ssl_ctx if ssl_ctx is not None else True

    @property
    def base(self) -> str:
        """The base URL of the endpoint that answered last (the first before any did)."""
        return self.endpoints.urls[self.endpoints.good]

    async def _call(self, method: str, path: str, json_body: dict[str, Any] | None = None) -> Any:
        import aiohttp

        tries = self.endpoints.tries()
        while True:
            base = tries.url
            try:
                async with aiohttp.ClientSession(timeout=self.timeout) as s:  # noqa: SIM117 - the inner uses s
                    async with s.request(method, base + path, json=json_body, headers=self.headers, ssl=self.ssl) as r:
                        body = await r.read()
                        if r.status >= 400:
                            raise _refusal(r.status, r.headers, body, base + path)
                        tries.ok()
                        return body
            except NotLeaderError as e:
                err: RdzvError = e
                leader = e.leader
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                err = UnavailableError(f"cannot reach rdzv server at {base}: {e or type(e).__name__}")
                err.__cause__ = e
                leader = None
            if not tries.failed(leader):  # every endpoint failed
                raise err

    async def jobs(self, state: str | None = None, limit: int | None = None, cursor: str | None = None) -> JobList:
        """One page of jobs (the server's default page size unless ``limit``)."""
        params = {k: v for k, v in (("state", state), ("limit", limit), ("cursor", cursor)) if v is not None}
        query = "?" + urlencode(params) if params else ""
        from rdzv_common.protocol import JobList

        return JobList.model_validate_json(await self._call("GET", "/v1/jobs" + query))

    async def all_jobs(self, state: str | None = None, page: int = 1000, max_pages: int = 10_000) -> JobList:
        """Every job, ``page`` at a time; ``max_pages`` bounds the walk."""
        from rdzv_common.protocol import JobList

        pages = await _walk(lambda cursor: self.jobs(state, page, cursor), max_pages)
        return JobList(jobs=[j for p in pages for j in p.jobs], next_cursor=pages[-1].next_cursor)

    async def job(self, job_id: str, limit: int | None = None) -> JobView:
        """The job's view; ``limit``: list at most this many of its nodes (all are counted)."""
        from rdzv_common.protocol import JobView

        query = f"?limit={limit}" if limit is not None else ""
        return JobView.model_validate_json(await self._call("GET", f"/v1/jobs/{quote(job_id, safe='')}{query}"))

    async def close_job(self, job_id: str) -> CloseResult:
        from rdzv_common.protocol import CloseResult

        return CloseResult.model_validate_json(await self._call("POST", f"/v1/jobs/{quote(job_id, safe='')}/close"))

    async def delete_job(self, job_id: str) -> DeleteResult:
        from rdzv_common.protocol import DeleteResult

        return DeleteResult.model_validate_json(await self._call("DELETE", f"/v1/jobs/{quote(job_id, safe='')}"))

    async def _send_json(self, path: str, body: dict[str, Any] | None) -> bytes:
        """POST a JSON body (or none); errors as in :meth:`_call`."""
        result: bytes = await self._call("POST", path, body)
        return result

    async def hosts(self, limit: int | None = None, cursor: str | None = None) -> Any:
        """One page of host records (HostList)."""
        from rdzv_common.protocol import HostList

        params = {k: v for k, v in (("limit", limit), ("cursor", cursor)) if v is not None}
        query = "?" + urlencode(params) if params else ""
        return HostList.model_validate_json(await self._call("GET", "/v1/hosts" + query))

    async def all_hosts(self, page: int = 1000, max_pages: int = 100) -> Any:
        from rdzv_common.protocol import HostList

        pages = await _walk(lambda cursor: self.hosts(page, cursor), max_pages)
        return HostList(hosts=[h for p in pages for h in p.hosts], next_cursor=pages[-1].next_cursor)

    async def host(self, host: str) -> Any:
        from rdzv_common.protocol import HostView

        return HostView.model_validate_json(await self._call("GET", f"/v1/hosts/{quote(host, safe='')}"))

    async def cordon(self, host: str, reason: str, ttl_s: float | None = None, drain: bool = False) -> Any:
        from rdzv_common.protocol import HostView

        body: dict[str, Any] = {"reason": reason, "drain": drain}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        return HostView.model_validate_json(await self._send_json(f"/v1/hosts/{quote(host, safe='')}/cordon", body))

    async def uncordon(self, host: str) -> Any:
        from rdzv_common.protocol import HostView

        return HostView.model_validate_json(await self._send_json(f"/v1/hosts/{quote(host, safe='')}/uncordon", None))

    async def report_health(self, host: str, reason: str, job_id: str | None = None) -> Any:
        """A failed health check on ``host`` (``reason``: its last line), for the host record."""
        from rdzv_common.protocol import HostView

        body: dict[str, Any] = {"reason": reason}
        if job_id is not None:
            body["job_id"] = job_id
        return HostView.model_validate_json(await self._send_json(f"/v1/hosts/{quote(host, safe='')}/health", body))

    async def held_events(self, job_id: str | None, since: int) -> dict[str, Any]:
        """One answer of ``GET .../events?since=ID``: the held events after
        ``since`` (``events``, ``last_id``, ``more``: ask again from
        ``last_id``; ``gap``: some are no longer held)."""
        path = f"/v1/jobs/{quote(job_id, safe='')}/events" if job_id else "/v1/events"
        answer: dict[str, Any] = json.loads(await self._call("GET", f"{path}?since={since}"))
        return answer

    async def events(
        self,
        job_id: str | None = None,
        last_id: int | None = None,
        on_retry: Callable[[str], None] | None = None,
        on_open: Callable[[], None] | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """The server's event stream (one job's, or every event) as dicts, for
        as long as the caller iterates: reconnects with backoff and
        ``Last-Event-ID`` when the connection drops (``on_retry`` hears why).
        ``last_id``: start with the held events after it (0: all held);
        ``on_open`` is called each time the stream is open. A
        refusal (token, a bad job id) raises its :class:`RdzvError`. With an
        endpoint list, a dropped stream or a ``not_leader`` goes on to the
        next endpoint (or the leader named) as :meth:`_call` does, backing
        off once every endpoint failed."""
        import aiohttp

        path = f"/v1/jobs/{quote(job_id, safe='')}/events" if job_id else "/v1/events"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout.total, sock_read=STREAM_READ_TIMEOUT_S)
        delays = backoff_delays(cap=BACKOFF_MAX_S)
        tries = self.endpoints.tries()
        several = len(self.endpoints.urls) > 1
        while True:
            headers = dict(self.headers)
            if last_id is not None:
                headers["Last-Event-ID"] = str(last_id)
            base, leader = tries.url, None
            try:
                async with aiohttp.ClientSession(timeout=timeout, read_bufsize=MAX_EVENT_BYTES) as s:  # noqa: SIM117
                    async with s.get(base + path, headers=headers, ssl=self.ssl) as r:
                        if r.status >= 400:
                            err = _refusal(r.status, r.headers, await r.read(), base + path)
                            if not isinstance(err, UnavailableError):  # a stream cap: retry like a drop
                                raise err
                            if isinstance(err, NotLeaderError):
                                leader = err.leader
                            raise aiohttp.ClientError(err.message)
                        tries.ok()
                        delays = backoff_delays(cap=BACKOFF_MAX_S)
                        if on_open is not None:
                            on_open()
                        async for event in _sse(r.content):
                            if isinstance(event.get("id"), int):
                                last_id = event["id"]
                            yield event
                why = "the server ended the stream"
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as e:
                why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if on_retry is not None:
                on_retry(printable(f"{base}: {why}" if several else why, 300))
            if not tries.failed(leader):
                await asyncio.sleep(next(delays))


async def _sse(content: Any) -> AsyncIterator[dict[str, Any]]:
    """Parse Server-Sent Events (``data`` lines of JSON objects); comments and
    ``retry`` lines are skipped, as are events whose data is not a JSON object."""
    data: list[str] = []
    async for raw in content:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if line:
            field, _, value = line.partition(":")
            if field == "data":
                data.append(value[1:] if value.startswith(" ") else value)
            continue
        if data:
            try:
                obj = json.loads("\n".join(data))
            except (ValueError, RecursionError):  # RecursionError: JSON nested too deep
                obj = None
            data = []
            if isinstance(obj, dict):
                yield obj
