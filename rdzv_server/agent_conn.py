"""One agent's connection once its WebSocket is open: join, heartbeats,
reports in; assignments out. The same rules whichever way the upgrade came:
aiohttp's (``handlers.agent_channel``, an :class:`~.ws_inline.AgentSocket`)
or the server's own (:mod:`.upgrade`, an :class:`~.own_socket.OwnSocket`).

A frame is taken where it is parsed when it can be (:meth:`AgentConn.inline`,
rdzv_server.ws_inline), else by the connection's loop (:meth:`AgentConn.run`),
which keeps every rule. A connection that has not joined (yet, or since it
left) within the join deadline is closed, and so is one silent for the idle
timeout once joined (rdzv_server.silence)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import WSCloseCode, WSMessage, WSMsgType, web
from pydantic import ValidationError

from rdzv_common.protocol import (
    AGENT_MESSAGE,
    HEARTBEAT_FRAME,
    AckMsg,
    AgentMessage,
    ErrorCode,
    ErrorMsg,
    FailedMsg,
    HeartbeatMsg,
    JobSecretMismatchError,
    JoinMsg,
    LeaveMsg,
    NotJoinedError,
    RdzvError,
    RequestError,
    SucceededMsg,
    SuspectMsg,
    printable,
)

from .keys import AUDIT, GUESSES, IDLE_TIMEOUT, JOIN_DEADLINE, METRICS, STORE
from .quotas import FRAME_BURST, FRAME_RATE, TokenBucket
from .silence import Silence
from .store import Store
from .ws_channel import Socket as ChannelSocket
from .ws_channel import WsChannel, bug_log, close_log

_DONE_TYPES = (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED)


class Socket(ChannelSocket, Protocol):
    """What the connection needs of its WebSocket beyond the channel's: frames in, and where
    parsed frames are offered first."""

    inline: Callable[[Any], bool] | None

    def receive(self) -> Awaitable[WSMessage]: ...


class AgentConn:
    """The agent channel's rules for one connection (``chan``), from ``remote``."""

    def __init__(self, app: web.Application, chan: WsChannel, remote: str | None) -> None:
        self.store: Store = app[STORE]
        self.guesses = app[GUESSES]
        self.audit = app[AUDIT]
        self.counted = app[METRICS].agent_message
        self.join_deadline: float = app[JOIN_DEADLINE]
        self.idle_s: float = app[IDLE_TIMEOUT]
        self.chan = chan
        self.remote = remote
        self.bound: tuple[str, str] | None = None
        # the join deadline (fixed), then the idle timeout (from the last frame): one timer per
        # connection, not one per frame (rdzv_server.silence); the job's heartbeat timeout is the
        # client's to set (up to days): the idle timeout is not
        self.silence = Silence(self.join_deadline)
        self.frames = TokenBucket(FRAME_BURST, FRAME_RATE)
        self.close_next = False  # inline refused a message and the connection must close: the loop does it

    def handle(self, msg: AgentMessage, held: float) -> bool:
        """One valid message, taken by either path; False: close the connection
        (``held``: a job secret's guess was slowed: one guess per connection)."""
        chan = self.chan
        self.counted(msg.op)
        try:
            now_bound = _dispatch(self.store, msg, self.bound, chan)
        except RdzvError as e:
            if isinstance(msg, JoinMsg):
                self.audit.event(
                    "join",
                    f"join refused: job {msg.job_id} node {msg.node_id} from "
                    f"{printable(self.remote)}: {e.code.value}: {e.message}",
                )
                if msg.job_secret and isinstance(e, JobSecretMismatchError):
                    self.guesses.wrong(msg.job_id, chan.peer)
                    if held:  # one guess per connection while slowed
                        chan.tell(ErrorMsg(code=e.code, message=f"{e.message} ({self.guesses.why})"))
                        return False
            return chan.refuse(ErrorMsg(code=e.code, message=e.message))
        if self.bound is not None and now_bound is None:  # it left: join again in time, or go
            self.silence.restart(self.join_deadline)
        elif self.bound is None and now_bound is not None:  # joined: the idle timeout from now on
            self.silence.restart(self.idle_s)
        self.bound = now_bound
        return True

    def handled(self, msg: AgentMessage, held: float) -> bool:
        """:meth:`handle`, where a bug (anything but the RdzvError it answers) closes the connection,
        as on either path, saying so once in a while with its traceback; the agent reconnects."""
        try:
            return self.handle(msg, held)
        except Exception:
            chan = self.chan
            bug_log("an agent message (op %s) from %s failed: closing its connection", msg.op, chan.peer, exc_info=True)
            chan.close_code, chan.close_reason = WSCloseCode.INTERNAL_ERROR, f"the server failed on {msg.op!r}"
            if isinstance(msg, JoinMsg) and self.store.channels.get((msg.job_id, msg.node_id)) is chan:
                self.bound = (msg.job_id, msg.node_id)  # a join that failed once its channel was in: let it go below
            return False

    def inline(self, frame: WSMessage) -> bool:
        """The hot path, taken where the frame is parsed (rdzv_server.ws_inline): a joined
        node's frames (its heartbeats, a ping, its join again after ``restart``: at 16,384
        nodes a round change is 16,384 joins), and a new connection's join (a formation, or a
        failover's 16,384 resumes). False: the loop takes the frame, as any other: one
        that does not parse (it says why), a guess to slow, any other frame before the join."""
        store = self.store
        if not store.serving or not self.frames.take():
            return False
        bound = self.bound
        if frame.type is WSMsgType.TEXT:
            if frame.data == HEARTBEAT_FRAME and bound is not None:
                self.silence.heard()
                store.heartbeat(*bound)
                return True
            try:
                msg = AGENT_MESSAGE.validate_json(frame.data)
            except ValidationError:
                return False
            if bound is None and not isinstance(msg, JoinMsg):
                return False
            if isinstance(msg, JoinMsg) and msg.job_secret and self.guesses.hold(msg.job_id, self.chan.peer):
                return False
            if bound is not None:  # (before the join, its deadline is fixed: frames do not move it)
                self.silence.heard()
            if not self.handled(msg, 0.0):
                self.close_next = True  # queued: the loop reads it next (nothing is taken behind it) and closes
                return False
            return True
        if frame.type is WSMsgType.PING and bound is not None and self.chan.pong(frame.data):
            self.silence.heard()
            return True
        return False

    @classmethod
    async def serve(cls, app: web.Application, ws: Socket, transport: Any, remote: str | None) -> None:
        """A new connection's loop, from its upgrade to its end (in the task that runs it: its
        timer cancels it); ``transport``: where its channel writes directly."""
        app[STORE].gc_hold.busy()  # a reconnect storm (a failover, a restart) is a round change's too
        chan = WsChannel(ws, transport, printable(remote, limit=64))
        await cls(app, chan, remote).run(ws)

    async def run(self, ws: Socket) -> None:
        """The connection's loop, until it closes: the frames ``inline`` declines, in order."""
        chan, store, silence, frames = self.chan, self.store, self.silence, self.frames
        ws.inline = self.inline
        try:
            while True:
                frame = await ws.receive()
                if self.close_next:
                    break
                if self.bound is not None:
                    silence.heard()
                if frame.type in _DONE_TYPES:
                    break
                if not frames.take():  # far more frames than any agent sends: each one costs the loop
                    chan.close_code = WSCloseCode.POLICY_VIOLATION
                    chan.close_reason = f"more than {FRAME_BURST} frames at over {FRAME_RATE:g}/s"
                    close_log("closing agent connection from %s: %s", chan.peer, chan.close_reason)
                    break
                if not store.serving:  # an HA replica that stopped leading: its agents go to the new leader
                    break
                if frame.type != WSMsgType.TEXT:
                    if frame.type == WSMsgType.BINARY and not chan.refuse(
                        ErrorMsg(code=ErrorCode.BAD_REQUEST, message="send JSON text frames")
                    ):
                        break
                    continue
                if frame.data == HEARTBEAT_FRAME and self.bound is not None:  # the hot path: no parsing
                    store.heartbeat(*self.bound)
                    continue
                try:
                    msg = AGENT_MESSAGE.validate_json(frame.data)
                except ValidationError as e:
                    if not chan.refuse(ErrorMsg(code=ErrorCode.VALIDATION_ERROR, message=short_error(e))):
                        break
                    continue
                # a job secret: guessing it is slowed (rdzv_server.guesses); the right one is never refused
                held = self.guesses.hold(msg.job_id, chan.peer) if isinstance(msg, JoinMsg) and msg.job_secret else 0.0
                if held:
                    await asyncio.sleep(held)
                    if not store.serving:
                        break
                if not self.handled(msg, held):
                    break
        except asyncio.CancelledError:
            if not silence.caught():
                raise
            # a close frame that says why, not an error message: an agent just reconnects,
            # as after any closed connection
            chan.close_code = WSCloseCode.POLICY_VIOLATION
            chan.close_reason = (
                f"no join within {self.join_deadline:g}s"
                if self.bound is None
                else f"nothing received for {self.idle_s:g}s"
            )
            close_log("closing agent connection from %s: %s", chan.peer, chan.close_reason)
        finally:
            ws.inline = None
            silence.stop()
            if self.bound is not None:
                store.disconnected(*self.bound, chan)
            chan.drop()
            if not await chan.closed(1.0):  # the close did not go through (an agent that does not read): cut it
                chan.abort()


def _dispatch(
    store: Store, msg: AgentMessage, bound: tuple[str, str] | None, chan: WsChannel
) -> tuple[str, str] | None:
    if isinstance(msg, JoinMsg):
        if bound is not None and bound != (msg.job_id, msg.node_id):
            raise RequestError(
                f"this connection belongs to node {bound[1]!r} of job {bound[0]!r}", ErrorCode.ALREADY_JOINED
            )
        store.join(msg, chan)
        return (msg.job_id, msg.node_id)
    if bound is None:
        raise NotJoinedError(f"send a join before {msg.op!r}")
    if isinstance(msg, HeartbeatMsg):
        lag = tuple(msg.nccl_lag) if msg.nccl_lag is not None else None  # (): none lags any more
        store.heartbeat(*bound, msg.step, msg.rate, tuple(msg.timings) if msg.timings else None, lag)
    elif isinstance(msg, FailedMsg):
        store.fail(*bound, msg.round, msg.failures, give_up=msg.give_up)
        store.reply(bound[0], chan, AckMsg(of="failed"))  # after what the report caused is persisted
    elif isinstance(msg, SucceededMsg):
        store.succeed(*bound, msg.round)
        store.reply(bound[0], chan, AckMsg(of="succeeded"))
    elif isinstance(msg, LeaveMsg):
        store.leave(*bound, msg.reason, chan)
        store.reply(bound[0], chan, AckMsg(of="leave"))
        return None
    elif isinstance(msg, SuspectMsg):  # a reason to probe the suspects, never more (rdzv_server.suspicion)
        store.suspicion.report(*bound, msg.round, msg.nodes)
    return bound


def short_error(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)[:1000]
