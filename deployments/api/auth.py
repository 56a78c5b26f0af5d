"""Bearer API keys (`CHARACTERS_API_KEYS`, declared here with `deployments.settings.EnvVar`) and the caller
they make of a request (`Caller`: a tenant, or an operator who sees every tenant).

`CHARACTERS_API_KEYS` is a comma-separated list of `key_id:key` pairs (e.g. `backend:4f9c...,ops@operator:77ab...`);
`key_id@operator:key` gives the key the operator role; a bare `key` gets the id `key-<first 8 hex of its
SHA-256>`. Unset or empty: no keys, the API is open (one tenant: every caller sees everything).
Keys live in memory only as SHA-256 digests; a presented key is hashed and compared with every stored
digest by `hmac.compare_digest`. Only the key *id* ever leaves this module (into `SessionSpec.api_key_id`
and logs), never a key or a digest.

Tenancy: a key is a tenant. Its sessions (`SessionInfo.owner`) and avatars are its own: another tenant's are
404 everywhere (never 403: ids do not leak); an operator key sees, feeds and ends every tenant's. The
front end applies it (`deployments.api.frontend`, `Caller.owns`).

When keys are configured every route except `/healthz`, `/readyz` and the watch page's files (`/`, `/watch/...`)
needs `Authorization: Bearer <key>` (HTTP and WebSocket handshakes) or `authorization: Bearer <key>` metadata
(gRPC). `POST /v1/realtime_sessions/{id}/consume` is the one route whose bearer is not an API key but the
session's own key (a browser holds it; the route checks it). The quota of live sessions per key
(`CHARACTERS_MAX_SESSIONS_PER_KEY`) is kept by the scheduler, by key id (HTTP 429 `quota_exceeded`);
docs/security.md has the threat model and every limit.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from deployments.api.errors import ApiError, ErrorCode
from deployments.settings import EnvVar

API_KEYS = EnvVar("CHARACTERS_API_KEYS", str, "", "comma-separated key_id[@operator]:key pairs (or bare keys); "
                  "empty: no auth")
API_KEYS_ENV = API_KEYS.name
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/", "/watch"})
OPEN_PREFIXES = ("/watch/",)  # the watch page's static files: no data (its API calls carry the key)
SESSION_KEY_PATHS = re.compile(r"^/v1/realtime_sessions/[^/]+/consume$")  # bearer: the session key (the route's)
MIN_KEY_LENGTH = 16
ROLES = ("tenant", "operator")
_KEY_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass(frozen=True)
class Caller:
    """Who a request is: the id of its API key (None: keys are off) and whether that key is an operator's.

    `owns(owner)`: may this caller see, feed and end what `owner` (a key id) made? Its own things, or
    everything for an operator; with keys off there is one tenant and everything is everyone's."""

    key_id: str | None = None
    operator: bool = False

    @property
    def sees_all(self) -> bool:
        return self.operator or self.key_id is None

    def owns(self, owner: str | None) -> bool:
        return self.sees_all or owner == self.key_id


ANYONE = Caller()  # keys off: the one tenant


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True)
class ApiKeys:
    """The configured keys as (key id, SHA-256 digest) pairs. Empty: authentication is off."""

    entries: tuple[tuple[str, bytes], ...] = ()
    operators: frozenset[str] = frozenset()  # key ids with the operator role

    @property
    def enabled(self) -> bool:
        return bool(self.entries)

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(key_id for key_id, _ in self.entries)

    @classmethod
    def parse(cls, spec: str) -> ApiKeys:
        """Parse the `CHARACTERS_API_KEYS` syntax; a ValueError names the entry by position, never its key."""
        entries: list[tuple[str, bytes]] = []
        operators: set[str] = set()
        for n, raw in enumerate(part.strip() for part in spec.split(",")):
            if not raw:
                continue
            key_id, sep, key = raw.partition(":")
            if not sep:
                key, key_id = raw, f"key-{hashlib.sha256(raw.encode()).hexdigest()[:8]}"
            key_id, at, role = key_id.partition("@")
            if at and role not in ROLES:
                raise ValueError(f"{API_KEYS_ENV} entry {n + 1} (id {key_id!r}): role {role[:16]!r} is unknown; write "
                                 f"id:key for a tenant or id@operator:key for an operator (roles: {', '.join(ROLES)})")
            if not _KEY_ID.match(key_id):
                raise ValueError(f"{API_KEYS_ENV} entry {n + 1}: key id {key_id!r} must be 1-64 characters of "
                                 "letters, digits, '.', '_' or '-'")
            if len(key) < MIN_KEY_LENGTH or any(c.isspace() for c in key):
                raise ValueError(f"{API_KEYS_ENV} entry {n + 1} (id {key_id!r}): the key must be at least "
                                 f"{MIN_KEY_LENGTH} characters without spaces; generate one with "
                                 "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
            if key_id in (e[0] for e in entries):
                raise ValueError(f"{API_KEYS_ENV} entry {n + 1}: key id {key_id!r} appears twice; ids must be unique")
            entries.append((key_id, _digest(key)))
            if role == "operator":
                operators.add(key_id)
        return cls(tuple(entries), frozenset(operators))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ApiKeys:
        return cls.parse(API_KEYS.get() if environ is None else environ.get(API_KEYS_ENV, ""))

    @classmethod
    def from_keys(cls, pairs: Iterable[tuple[str, str]], operators: Iterable[str] = ()) -> ApiKeys:
        """From (key id, key) pairs (tests, embedding); `operators`: the ids with the operator role."""
        return cls(tuple((key_id, _digest(key)) for key_id, key in pairs), frozenset(operators))

    def key_id(self, key: str) -> str | None:
        """The id of `key`, or None. Compares against every digest (no early exit on a match)."""
        presented = _digest(key)
        found: str | None = None
        for key_id, digest in self.entries:
            if hmac.compare_digest(presented, digest):
                found = key_id
        return found

    def authenticate(self, authorization: str | None) -> str | None:
        """Check an `Authorization` header value. Returns the key id (None when auth is off); raises ApiError 401."""
        if not self.enabled:
            return None
        if not authorization:
            raise ApiError(401, ErrorCode.MISSING_API_KEY,
                           "this server requires an API key; send the header 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, ErrorCode.MISSING_API_KEY,
                           f"the Authorization header must be 'Bearer <key>', got scheme {scheme[:16]!r}")
        key_id = self.key_id(key.strip())
        if key_id is None:
            raise ApiError(401, ErrorCode.INVALID_API_KEY,
                           "the API key is not valid; check it, or ask the operator for a key")
        return key_id

    def caller(self, authorization: str | None) -> Caller:
        """`authenticate`, as the `Caller` it makes (keys off: `ANYONE`)."""
        key_id = self.authenticate(authorization)
        return ANYONE if key_id is None else Caller(key_id, key_id in self.operators)


WS_POLICY_VIOLATION = 1008  # WebSocket close code for a refused key (the server answers the handshake 403)


class BearerAuthMiddleware:
    """ASGI middleware: enforce `ApiKeys` on every HTTP and WebSocket route but the open paths and the
    session-key paths (whose route checks its own bearer); put the caller in the scope. The route reads it as
    `request.state.caller` (a `Caller`) and `request.state.api_key_id` (None when keys are off). A refused
    WebSocket handshake is closed with 1008 before it is accepted.
    """

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        caller: Caller | None = ANYONE if not self.keys.enabled else None  # None: no API key on this path
        path = scope["path"]
        if path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES) and not SESSION_KEY_PATHS.match(path):
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            try:
                caller = self.keys.caller(header)
            except ApiError as err:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": WS_POLICY_VIOLATION, "reason": err.code})
                else:
                    await err.response()(scope, receive, send)
                return
        state = scope.setdefault("state", {})
        state["caller"], state["api_key_id"] = caller, caller.key_id if caller is not None else None
        await self.app(scope, receive, send)
