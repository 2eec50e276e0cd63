"""A small client of etcd v3's JSON gateway (``/v3/kv/...``, ``/v3/lease/...``),
on the aiohttp the server already uses: no gRPC, no protobuf, no new dependency.

Only what the HA replicas need (:mod:`rdzv_server.ha`): range reads (paged),
transactions (compare + puts/deletes), and leases (grant, keep-alive, revoke).
Keys and values are bytes on the wire (base64 in the gateway's JSON); 64-bit
numbers come back as strings, and fields at their zero value are left out
(``succeeded`` is absent when a transaction's compare failed).

Endpoints are tried in turn: a call that cannot reach one (refused, reset,
timed out) goes to the next, up to one pass over the list, then raises
:class:`EtcdUnavailable`. A transaction is safe to send again: every write of
rdzv compares on the leader key, so a repeat writes the same values or nothing.
Auth: ``user``/``password`` get a token from ``/v3/auth/authenticate``, renewed
when etcd says it is no longer valid. TLS: an ``ssl.SSLContext`` (CA, client
certificate)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import aiohttp

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
MAX_RESPONSE_BYTES = 64 * 1024 * 1024  # a page of ranges is far below this; a hostile endpoint is cut off
RANGE_PAGE = 200  # keys per range request (a job's record can be large: pages stay small)
MAX_TXN_OPS = 100  # etcd's default --max-txn-ops is 128
MAX_TXN_BYTES = 700_000  # keys and values of a transaction, about: under etcd's --max-request-bytes (1.5 MiB by
# default), and its JSON (base64) under the 1 MiB of a body aiohttp sends without a warning


class EtcdError(Exception):
    """etcd refused a request (an error in its answer)."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered (refused, reset, timed out), or the cluster has no quorum."""


def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with ``prefix`` (etcd's rule)."""
    p = bytearray(prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return b"\0"


@dataclass
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int

    @classmethod
    def from_json(cls, kv: dict[str, Any]) -> KeyValue:
        return cls(
            key=unb64(kv.get("key")),
            value=unb64(kv.get("value")),
            create_revision=int(kv.get("create_revision", 0)),
            mod_revision=int(kv.get("mod_revision", 0)),
            lease=int(kv.get("lease", 0)),
        )


def put(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    """A transaction operation: put ``value`` at ``key`` (bound to ``lease`` if given)."""
    op: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        op["lease"] = str(lease)
    return {"request_put": op}


def delete(key: bytes, range_end: bytes | None = None) -> dict[str, Any]:
    """A transaction operation: delete ``key``, or every key in [key, range_end)."""
    op = {"key": b64(key)}
    if range_end is not None:
        op["range_end"] = b64(range_end)
    return {"request_delete_range": op}


def get(key: bytes) -> dict[str, Any]:
    return {"request_range": {"key": b64(key)}}


def created_at(key: bytes, revision: int) -> dict[str, Any]:
    """A compare: ``key`` exists and was created at ``revision`` (0: it does not exist)."""
    return {"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": str(revision)}


def batches(ops: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """``ops`` in order, cut into transactions of at most MAX_TXN_OPS operations
    and about MAX_TXN_BYTES of keys and values (an op larger than that goes
    alone); at least one (maybe empty) transaction."""
    out: list[list[dict[str, Any]]] = [[]]
    size = 0
    for op in ops:
        body = next(iter(op.values()))
        n = len(body.get("key", "")) + len(body.get("value", ""))  # base64: 4/3 of the bytes etcd counts
        if out[-1] and (len(out[-1]) >= MAX_TXN_OPS or size + n > MAX_TXN_BYTES * 4 // 3):
            out.append([])
            size = 0
        out[-1].append(op)
        size += n
    return out


@dataclass
class TxnResult:
    succeeded: bool
    revision: int  # the store's revision after the transaction
    responses: list[dict[str, Any]]

    def ranged(self, i: int) -> list[KeyValue]:
        """The key-values of the i-th response (a ``request_range``)."""
        r = self.responses[i].get("response_range", {}) if i < len(self.responses) else {}
        return [KeyValue.from_json(kv) for kv in r.get("kvs", [])]


async def _read_body(content: aiohttp.StreamReader) -> bytes:
    """The whole body, up to MAX_RESPONSE_BYTES + 1 bytes (one more says: too
    large). ``read(n)`` returns what has arrived, not n bytes: a large answer
    (a page of job records) comes in many reads."""
    raw = bytearray()
    while len(raw) <= MAX_RESPONSE_BYTES:
        chunk = await content.read(MAX_RESPONSE_BYTES + 1 - len(raw))
        if not chunk:
            break
        raw += chunk
    return bytes(raw)


class EtcdClient:
    """etcd's v3 JSON gateway over one aiohttp session. Coroutines; open with
    :meth:`start`, close with :meth:`close`."""

    def __init__(
        self,
        endpoints: list[str],
        *,
        ssl_ctx: ssl.SSLContext | None = None,
        user: str | None = None,
        password: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self._i = 0
        self._ti = 0  # the keep-alive thread's position in the list (call_blocking)
        self._ssl = ssl_ctx
        self._user, self._password = user, password
        self._token: str | None = None
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        # the largest request body sent (its JSON, keys and values in base64: more than the
        # request etcd's --max-request-bytes counts); rdzv_storage_max_request_bytes
        self.max_request_bytes = 0

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._i]

    async def start(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=64, ssl=self._ssl if self._ssl is not None else True),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, path: str, body: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on the current endpoint, then the next
        ones while they cannot be reached; the answer's JSON. Raises EtcdError
        for etcd's own refusals, EtcdUnavailable when no endpoint answered."""
        await self.start()
        assert self._session is not None
        last: str = "no endpoint tried"
        for _ in range(len(self.endpoints)):
            url = f"{self.endpoint}/v3/{path}"
            try:
                return await self._post(url, body, timeout_s, reauth=True)
            except EtcdUnavailable as e:
                last = str(e)
                self._i = (self._i + 1) % len(self.endpoints)
        raise EtcdUnavailable(last)

    async def _post(
        self, url: str, body: dict[str, Any], timeout_s: float | None, reauth: bool, auth: bool = True
    ) -> dict[str, Any]:
        assert self._session is not None
        if auth and self._user and self._token is None:  # (not for the authenticate request itself)
            answer = await self._post(_auth_url(url), self._credentials(), timeout_s, reauth=False, auth=False)
            self._token = _token_of(url, answer)
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = self._token
        data = json.dumps(body).encode()  # (what json=body did; its size is counted)
        self.max_request_bytes = max(self.max_request_bytes, len(data))
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            async with self._session.post(url, data=data, headers=headers, timeout=timeout) as r:
                raw = await _read_body(r.content)
                status = r.status
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            raise EtcdUnavailable(f"{url}: {type(e).__name__}: {e}"[:300]) from e
        try:
            return _answer(url, status, raw)
        except _Expired:
            if not (reauth and self._user):
                raise
            self._token = None
            return await self._post(url, body, timeout_s, reauth=False)

    def _credentials(self) -> dict[str, Any]:
        return {"name": self._user, "password": self._password}

    # --------------------------------------------------------------- kv

    async def range_prefix(self, prefix: bytes, revision: int = 0) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix``, in pages, all read at one revision (``revision``,
        or the newest): (kvs, revision)."""
        out: list[KeyValue] = []
        end = prefix_end(prefix)
        start = prefix
        while True:
            body: dict[str, Any] = {"key": b64(start), "range_end": b64(end), "limit": RANGE_PAGE}
            if revision:
                body["revision"] = str(revision)
            data = await self.call("kv/range", body)
            revision = revision or int(data.get("header", {}).get("revision", 0))
            kvs = [KeyValue.from_json(kv) for kv in data.get("kvs", [])]
            out.extend(kvs)
            if not data.get("more") or not kvs:
                return out, revision
            start = kvs[-1].key + b"\0"

    async def revision(self, key: bytes) -> int:
        """etcd's revision now (read with ``key``, a small one)."""
        data = await self.call("kv/range", {"key": b64(key), "keys_only": True})
        return int(data.get("header", {}).get("revision", 0))

    async def newest(self, prefix: bytes, revision: int = 0) -> tuple[int, int, int]:
        """Under ``prefix`` (at ``revision``, or the newest): (the revision read, the
        highest mod revision of a key there (0: none), how many keys there are).
        Sorted, so etcd reads every key of the range (its limit applies after the sort)."""
        body: dict[str, Any] = {"key": b64(prefix), "range_end": b64(prefix_end(prefix)), "limit": 1}
        body.update(sort_order="DESCEND", sort_target="MOD", keys_only=True)
        if revision:
            body["revision"] = str(revision)
        data = await self.call("kv/range", body)
        kvs = data.get("kvs", [])
        mod = int(kvs[0].get("mod_revision", 0)) if kvs else 0
        return int(data.get("header", {}).get("revision", 0)), mod, int(data.get("count", 0))

    async def get(self, key: bytes) -> KeyValue | None:
        data = await self.call("kv/range", {"key": b64(key)})
        kvs = data.get("kvs", [])
        return KeyValue.from_json(kvs[0]) if kvs else None

    async def txn(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]] | None = None,
        timeout_s: float | None = None,
    ) -> TxnResult:
        data = await self.call(
            "kv/txn", {"compare": compare, "success": success, "failure": failure or []}, timeout_s=timeout_s
        )
        return TxnResult(
            succeeded=bool(data.get("succeeded", False)),
            revision=int(data.get("header", {}).get("revision", 0)),
            responses=list(data.get("responses", [])),
        )

    # ------------------------------------------- blocking, for a thread

    def call_blocking(self, path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """:meth:`call` with the standard library, blocking: for the lease
        keep-alive thread (rdzv_server.ha), which must not wait for a busy event
        loop. Tries the endpoints in turn from its own position."""
        last = "no endpoint tried"
        for _ in range(len(self.endpoints)):
            base = self.endpoints[self._ti]
            try:
                return self._post_blocking(base, path, body, timeout_s, reauth=True)
            except EtcdUnavailable as e:
                last = str(e)
                self._ti = (self._ti + 1) % len(self.endpoints)
        raise EtcdUnavailable(last)

    def _post_blocking(
        self, base: str, path: str, body: dict[str, Any], timeout_s: float, reauth: bool
    ) -> dict[str, Any]:
        url = f"{base}/v3/{path}"
        if self._user and self._token is None:
            self._token = _token_of(
                url, _answer(_auth_url(url), *self._urlopen(_auth_url(url), self._credentials(), timeout_s))
            )
        try:
            return _answer(url, *self._urlopen(url, body, timeout_s))
        except _Expired:
            if not (reauth and self._user):
                raise
            self._token = None
            return self._post_blocking(base, path, body, timeout_s, reauth=False)

    def _urlopen(self, url: str, body: dict[str, Any], timeout_s: float) -> tuple[int, bytes]:
        """One blocking POST: (status, body) of any answer; EtcdUnavailable when none came."""
        req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
        req.add_header("Content-Type", "application/json")
        if self._token:
            req.add_header("Authorization", self._token)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s, context=self._ssl) as r:
                return r.status, r.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as e:  # etcd's refusals come with a JSON body
            with e:
                return e.code, e.read(MAX_RESPONSE_BYTES + 1)
        except (OSError, ValueError) as e:  # refused, reset, timed out (URLError is an OSError)
            raise EtcdUnavailable(f"{url}: {type(e).__name__}: {e}"[:300]) from e

    # ------------------------------------------------------------ leases

    async def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (id, the TTL etcd granted; it may raise a short one to its minimum)."""
        data = await self.call("lease/grant", {"TTL": ttl_s})
        return int(data["ID"]), int(data.get("TTL", ttl_s))

    def keepalive_blocking(self, lease: int, timeout_s: float) -> int:
        """Refresh ``lease`` from a thread (standard library, blocking; the
        lease's keep-alive must not wait for a busy event loop): its remaining
        TTL (0: it is gone)."""
        result = self.call_blocking("lease/keepalive", {"ID": str(lease)}, timeout_s).get("result", {})
        return int(result.get("TTL", 0)) if isinstance(result, dict) else 0

    async def revoke(self, lease: int) -> None:
        await self.call("lease/revoke", {"ID": str(lease)})


class _Expired(EtcdError):
    """etcd no longer takes the auth token (it expires): authenticate again."""


def _auth_url(url: str) -> str:
    return url.rsplit("/v3/", 1)[0] + "/v3/auth/authenticate"


def _answer(url: str, status: int, raw: bytes) -> dict[str, Any]:
    """An answer of the gateway (either transport's) as its JSON object, or the
    error it is: EtcdUnavailable for no quorum, no leader or not an answer of
    etcd's; _Expired for an expired token; EtcdError for any other refusal."""
    if len(raw) > MAX_RESPONSE_BYTES:
        raise EtcdError(f"{url}: answer larger than {MAX_RESPONSE_BYTES} bytes")
    try:
        data = json.loads(raw) if raw else {}
    except (ValueError, RecursionError):
        raise EtcdUnavailable(f"{url}: HTTP {status}, not JSON") from None
    if not isinstance(data, dict):
        raise EtcdError(f"{url}: HTTP {status}, unexpected answer")
    if status >= 400 or "error" in data:
        message = str(data.get("message") or data.get("error") or f"HTTP {status}")[:300]
        code = data.get("code")
        if "token" in message or code == 16:  # Unauthenticated
            raise _Expired(f"{url}: {message}")
        if code in (4, 14) or status in (502, 503, 504):  # DeadlineExceeded, Unavailable: no quorum / leader
            raise EtcdUnavailable(f"{url}: {message}")
        raise EtcdError(f"{url}: {message}")
    return data


def _token_of(url: str, answer: dict[str, Any]) -> str:
    token = answer.get("token")
    if not token:
        raise EtcdError(f"{url}: etcd gave no auth token: {str(answer.get('message', ''))[:200]}")
    return str(token)
