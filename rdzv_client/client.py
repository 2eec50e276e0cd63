"""The agent channel: one agent's WebSocket to the server.

:class:`AgentLink` is one agent's WebSocket to the server. It reconnects on its
own with exponential backoff and jitter, re-sends the node's current *intent*
(a join, or a resume of the round it runs) after each reconnect, and sends
heartbeats. It speaks WebSocket through :mod:`rdzv_client.wsclient` (standard
library only) and sends its intent before it imports pydantic: an agent's
first join leaves within a few tens of milliseconds of its start, and every
server message is still validated with the protocol models before the agent
acts on it. It is only a transport: who this node is (its id, the node
secret the server issued it, the job's run) is the
:class:`~rdzv_client.session.NodeSession`'s, which sets the intent and hears
every server message first (``observer``), before the link queues it. A server
hiccup therefore never reaches the agent's loop as an error: the loop just
hears nothing until the server is back.

It takes an endpoint list (``h1:29400,h2:29400``: the replicas of an HA
server, one of which leads) and goes through it as :mod:`rdzv_client.endpoints`
says. The REST client is :mod:`rdzv_client.rest`.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import ssl
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any

from rdzv_common.errors import LEADER_HEADER, SUCCESSOR_HEADER, error_from_body
from rdzv_common.liveness import TCP_USER_TIMEOUT_S
from rdzv_common.tasks import cancel_and_wait
from rdzv_common.wire import AGENT_PATH, HEARTBEAT_FRAME, printable

from . import wsclient
from .endpoints import Endpoints, backoff_delays, election_wait, parse_endpoint
from .quiet import Quiet
from .service import NO_ANSWER, FirstContact, ServiceClock, refusal

if TYPE_CHECKING:
    from pydantic import BaseModel

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
# Detects a frozen or cut-off server (wsclient pings after this long without a
# frame and gives up after half of it without an answer); the workers keep
# running meanwhile. Long, so that a busy server is not mistaken for a dead
# one: a partition heals through the next heartbeat anyway.
WS_PING_S = 15.0
# ... but a server whose *host* died or was cut off acknowledges nothing: the
# kernel fails the connection after TCP_USER_TIMEOUT_S (rdzv_common.liveness,
# the one value both ends use).
# A connection that lasted this long was healthy: the next reconnect starts the
# backoff over. One the server closes sooner (it refused us) keeps backing off.
STABLE_S = 2.0
MAX_MSG_BYTES = 4 * 1024 * 1024


def _dump(msg: dict[str, Any]) -> str:
    """A plain JSON object as the wire has it (compact, as pydantic writes it)."""
    return json.dumps(msg, separators=(",", ":"), ensure_ascii=False)


def _link_ssl(scheme: str, ssl_ctx: ssl.SSLContext | bool | None) -> ssl.SSLContext | None:
    """TLS for https (verified with the system's CAs unless given a context,
    or ``False`` for no verification); none for http."""
    if scheme != "https":
        return None
    if isinstance(ssl_ctx, ssl.SSLContext):
        return ssl_ctx
    if ssl_ctx is False:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    return ssl.create_default_context()


class AgentLink:
    """One agent's channel to the server.

    ``intent`` is what the server must know after every (re)connect: the join
    for the forming round, or a join with ``resume_round`` while workers run,
    as its plain JSON object (:func:`rdzv_common.wire.join_fields`). Server
    messages arrive on :meth:`recv` in order, as protocol models.
    ``endpoint`` may be a list; ``url`` is the endpoint in use (or being
    tried), ``down_for()`` how long no endpoint of the list was reachable.
    """

    def __init__(
        self,
        endpoint: str,
        token: str | None = None,
        ssl_ctx: ssl.SSLContext | bool | None = None,
        heartbeat_s: float = 2.0,
    ) -> None:
        # the servers to try (HA replicas: one leads), and the one in use or tried now
        self.endpoints = Endpoints(endpoint)
        self._tries = self.endpoints.tries()
        self.url = self._tries.url + AGENT_PATH
        self._in_use: str | None = None  # the base URL of the endpoint last connected to
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._ssl_ctx = ssl_ctx
        self.intent: dict[str, Any] | None = None
        # until the server's ``joined`` says otherwise: the first heartbeat must not
        # come later than the job's timeout allows
        self.heartbeat_s = heartbeat_s
        self.connected = asyncio.Event()
        self.ever_connected = False
        self.last_error: str | None = None
        # monotonic time since when the server has been unreachable; None while connected
        self.down_since: float | None = time.monotonic()
        self.service = ServiceClock(STABLE_S)  # the --server-timeout clock: time without a served join
        self.first_contact = FirstContact()  # was any endpoint ever reached (a wrong endpoint fails fast)
        self._logged: collections.deque[str] = collections.deque(maxlen=32)  # protocol errors said once
        self._quiet = Quiet()  # lines a refusal loop would repeat
        self._messages: asyncio.Queue[Any] = asyncio.Queue()
        self._ws: wsclient.WebSocket | None = None
        self._task: asyncio.Task[None] | None = None
        # sends and closes in flight: the loop holds only weak references to tasks
        self._background: set[asyncio.Task[Any]] = set()
        self._pending: list[str] = []  # reports to re-send after a reconnect, until acked
        self._not_leader = False  # a replica of this cycle of the list said not_leader: an election
        self._closing = False  # close() was called
        # hears every message that serves the join before it is queued (the NodeSession: a joined's secret, the run)
        self.observer: Callable[[Any], None] | None = None

    async def start(self) -> None:
        self._closing = False
        self._task = asyncio.create_task(self._run(), name="rdzv-link")

    async def close(self) -> None:
        self._closing = True  # the loop ends even if the cancel is swallowed (a connect's wait_for may)
        await cancel_and_wait(self._task)
        if self._ws is not None and not self._ws.closed:
            await asyncio.wait([asyncio.ensure_future(self._ws.close())], timeout=1.0)

    def set_intent(self, msg: dict[str, Any] | None, send: bool = True) -> None:
        """Remember what to say after a reconnect (as it is: the session built
        it), and say it now."""
        self.intent = msg
        if msg is not None and send:
            # a join that names the run, on a connection being served (the join again after
            # `restart`): the server answers it with the round's `assigned`, or `status` while the
            # round waits (up to N / 1,000 s apart in a round of N nodes), not another `joined`
            # (rdzv_server.rounds.joins); the server is there meanwhile, and a frozen one fails the pings
            again = msg.get("run") is not None and self.service.serving
            if msg.get("op") == "join" and self.connected.is_set() and not again:
                self.service.unserved()  # served again once the server answers this join
            self.send_nowait(_dump(msg))

    def report(self, msg: BaseModel) -> None:
        """A report (failed, succeeded, leave): sent now and after each reconnect until acked."""
        text = msg.model_dump_json()
        self._pending.append(text)
        self.send_nowait(text)

    def clear_reports(self) -> None:
        """The outcome of the reports is known (ack, restart, done or error)."""
        self._pending.clear()

    def send_nowait(self, text: str) -> None:
        ws = self._ws
        if ws is not None and not ws.closed and self.connected.is_set():
            self._spawn(self._send(ws, text))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background, holding a reference until it ends
        (the loop keeps only weak references to tasks)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send(self, ws: wsclient.WebSocket, text: str) -> None:
        try:
            await ws.send_str(text)
        except (ConnectionError, RuntimeError, OSError):
            pass  # the reader notices and reconnects; the intent is re-sent then

    async def recv(self) -> Any:
        """The next server message (a protocol model)."""
        return await self._messages.get()

    def protocol_error(self, what: str) -> None:
        """The server sent something this agent must not act on: say so once
        (escaped), drop the connection and reconnect. Workers are not touched."""
        text = printable(what, limit=500)
        if text not in self._logged:
            self._logged.append(text)
            log.warning("protocol error from %s: %s; reconnecting", self.url, text)
        self.last_error = f"protocol error: {text}"
        ws = self._ws
        if ws is not None and not ws.closed:
            self._spawn(ws.close())

    def down_for(self) -> float:
        """Seconds the server has been unreachable now (0 while connected)."""
        since = self.down_since
        return 0.0 if since is None else time.monotonic() - since

    def unserved_for(self) -> float:
        """Seconds without a served join (0 while served): what --server-timeout counts."""
        return self.service.unserved_for()

    async def _next(
        self, delays: Iterator[float], leader: str | None = None, dropped: bool = False, not_leader: bool = False
    ) -> None:
        """The endpoint in use failed (or its connection ``dropped``): on to the next
        one (the leader its refusal named, if one of ours; after a drop the
        successor the leader named) at once, or after a backoff once every
        endpoint of the list failed (short while replicas say an election is
        on: NOT_LEADER_BACKOFF_MAX_S). ``not_leader``: the endpoint said so."""
        if self._closing:
            return
        if not (self._tries.dropped() if dropped else self._tries.failed(leader, not_leader)):
            await asyncio.sleep(election_wait(next(delays), self._not_leader, self.down_for()))
            self._not_leader = False

    async def _run(self) -> None:
        delays = backoff_delays()
        stable = False  # the last connection was served for STABLE_S
        while not self._closing:
            base = self._tries.url
            self.url = base + AGENT_PATH
            scheme, host, port = parse_endpoint(base)
            try:
                ws = await wsclient.connect(
                    host,
                    port,
                    AGENT_PATH,
                    headers=self.headers,
                    ssl=_link_ssl(scheme, self._ssl_ctx),
                    timeout=CONNECT_TIMEOUT_S,
                    max_msg_size=MAX_MSG_BYTES,
                    ping_s=WS_PING_S,
                    user_timeout_s=TCP_USER_TIMEOUT_S,
                )
            except wsclient.HandshakeError as e:
                self.first_contact.seen()
                if e.status == 401:
                    self._messages.put_nowait(error_from_body("unauthorized", "the server refused the token"))
                leader = e.headers.get(LEADER_HEADER.lower()) if e.status == 503 else None
                self.last_error = f"handshake refused: {e.status} {printable(e.message, 200)} ({base}"
                not_leader = _refusal_code(e.body) == "not_leader" or bool(leader)
                if not_leader:
                    self._not_leader = True
                    self.last_error += ": not the leader" + (f"; leader {printable(leader, 200)}" if leader else "")
                self.last_error += ")"
                await self._next(delays, leader, not_leader=not_leader)
                continue
            except (wsclient.WSError, OSError, asyncio.TimeoutError) as e:
                self.last_error = f"cannot reach {self.url}: {e or type(e).__name__}"
                self.first_contact.failed(base, e)
                await self._next(delays)
                continue
            except Exception as e:  # never let the link die: retry like any failed connect
                log.warning("link to %s: connect failed: %s", self.url, printable(repr(e), 300), exc_info=True)
                self.last_error = f"cannot reach {self.url}: {printable(type(e).__name__, 100)}"
                self.first_contact.failed(base, e)
                await self._next(delays)
                continue
            if self._closing:  # close() came while connecting (its cancel swallowed): say nothing on it
                await asyncio.wait([asyncio.ensure_future(ws.close())], timeout=1.0)
                return
            self._tries.ok()
            self.endpoints.connected(ws.headers.get(SUCCESSOR_HEADER.lower()))
            self.first_contact.seen()
            self._ws = ws
            self.connected.set()
            self.down_since = None
            if len(self.endpoints.urls) > 1 and base != self._in_use:
                # which replica leads: once per switch (the first one is news too)
                (log.warning if self._in_use else log.info)("link: leader is now %s", base)
            elif self.ever_connected and (stable or self._quiet.allow("reconnected") is not None):
                # after a service that held: news; in a refusal loop: at most every 30 s
                log.info("reconnected to %s", self.url)
            self._in_use = base
            self.ever_connected = True
            self.last_error = None
            self.service.connected()
            if self.intent is None:
                self.service.served()  # nothing to ask: a connection is all the service there is
            else:
                self.last_error = NO_ANSWER
            hb = asyncio.create_task(self._heartbeat(ws))
            refused = False  # the server refused the intent (not a drop: no successor's turn)
            try:
                if self.intent is not None:
                    await ws.send_str(_dump(self.intent))
                for text in list(self._pending):
                    await ws.send_str(text)
                # the join is on the wire: now the models that check what the server says
                from pydantic import ValidationError

                from rdzv_common.protocol import SERVER_MESSAGE, ErrorMsg, EvictedMsg, JoinedMsg, PaceMsg

                async for data in ws:
                    try:
                        msg = SERVER_MESSAGE.validate_json(data)
                    except ValidationError as e:
                        errors = e.errors(include_url=False, include_input=False)
                        what = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in errors[:3])
                        if errors and errors[0]["type"] == "union_tag_invalid":
                            # a newer server's new message: tell, do not act
                            text = printable(f"ignoring a message this agent does not understand: {what}", 500)
                            if text not in self._logged:
                                self._logged.append(text)
                                log.warning("%s", text)
                            continue
                        self.protocol_error(f"invalid message: {what}")
                        break
                    if isinstance(msg, (ErrorMsg, EvictedMsg)):
                        refusal = self._refused(msg)
                        self._messages.put_nowait(msg)
                        if refusal:
                            refused = True
                            break  # back off, then reconnect and send the intent the agent set meanwhile
                        continue
                    self.service.served()
                    self.last_error = None
                    if isinstance(msg, (JoinedMsg, PaceMsg)):
                        faster = msg.heartbeat_s < self.heartbeat_s
                        self.heartbeat_s = msg.heartbeat_s
                        if faster:  # the sleep in progress is the old, longer one: the new pace from now
                            hb.cancel()
                            hb = asyncio.create_task(self._heartbeat(ws))
                        if isinstance(msg, PaceMsg):  # the link's own business
                            continue
                    if self.observer is not None:
                        self.observer(msg)
                    self._messages.put_nowait(msg)
                if self.last_error == NO_ANSWER:  # the server closed before it answered: say how
                    self.last_error = None
                why = ws.close_reason or ""
                if why and not why.startswith("closed by") and self.last_error is None:
                    # a reset, no pong, or a protocol error of the framing
                    why = why.removeprefix("connection lost: ")
                    self.last_error = f"connection lost: {printable(why, 300)}"
            except (ConnectionError, RuntimeError, OSError, asyncio.TimeoutError) as e:
                self.last_error = f"connection lost: {e or type(e).__name__}"
            except Exception as e:  # a bug while handling this connection must not end the link
                log.warning("link to %s: %s; reconnecting", self.url, printable(repr(e), 300), exc_info=True)
                self.last_error = f"link error: {printable(type(e).__name__, 100)}"
            finally:
                self.connected.clear()
                self.down_since = time.monotonic()
                stable = self.service.stable()
                self.service.unserved()
                self._ws = None
                hb.cancel()
                if not ws.closed:
                    await asyncio.wait([asyncio.ensure_future(ws.close())], timeout=1.0)
            if self.last_error is None:  # the server closed: with its reason where it gave one ("no join within 10s")
                said = getattr(ws, "server_reason", None)
                self.last_error = f"connection closed by the server ({base})" + (f": {said}" if said else "")
            if stable:  # served long enough: a drop now is news, not a refusal loop
                delays = backoff_delays()
            await self._next(delays, dropped=stable and not refused)  # (EndpointTries.dropped says why stable)

    def _refused(self, msg: Any) -> bool:
        """True when an error or eviction refuses our join or evicts us (service.refusal):
        the link drops the connection and backs off before it joins again."""
        why = refusal(msg, self.service.serving)
        if why is not None:
            self.last_error = why
            self.service.unserved()
        return why is not None

    async def _heartbeat(self, ws: wsclient.WebSocket) -> None:
        try:
            while not ws.closed:
                await asyncio.sleep(self.heartbeat_s)
                await ws.send_str(HEARTBEAT_FRAME)
        except (ConnectionError, RuntimeError, OSError):
            pass


def _refusal_code(body: bytes) -> str | None:
    """The ``code`` of a refusal's JSON body ``{"code","message"}``, if it has one."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: JSON nested too deep (the link must not die of it)
        return None
    code = data.get("code") if isinstance(data, dict) else None
    return code if isinstance(code, str) else None
