"""Requests refused before the app sees them: a foreign Host header (DNS rebinding), a
cross-site state-changing request (CSRF), and bodies over the size limit.

Each guard is a small ASGI middleware that answers with a one-line JSON ``{"detail": ...}``.

- :class:`HostCheck`: on a loopback address the server answers only to loopback names
  (``localhost``, ``127.0.0.1`` and the rest of 127/8, ``[::1]``, with or without a port). A page
  elsewhere that points a DNS name it controls at 127.0.0.1 sends that name as Host: refused
  (400). An IP literal can never be rebound, so every loopback literal is accepted.
- :class:`OriginCheck`: a browser sends ``Origin`` (and ``Sec-Fetch-Site``) with a POST, and
  a form or ``fetch`` from any page may POST a multipart upload without asking first (no CORS
  preflight). So requests other than GET/HEAD/OPTIONS whose Origin is not this server's own, or
  which the browser marks as ``cross-site``/``same-site``, are refused (403). Requests without
  these headers (curl, scripts) are not from a browser page and pass.
- :class:`BodyLimit`: bodies over ``max_bytes`` are refused (413) as they arrive.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from typing import Any

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


async def refuse(send: Any, status: int, detail: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Answer ``{"detail": detail}`` with ``status`` (the message kept to one line)."""
    body = json.dumps({"detail": " ".join(detail.split())}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"x-content-type-options", b"nosniff"), *headers]})
    await send({"type": "http.response.body", "body": body})


def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header (or the netloc of an Origin) -> (host, port): ``'[::1]:8000'`` ->
    ``('::1', 8000)``, ``'LocalHost.'`` -> ``('localhost', None)``; None if malformed.

    Hosts are lower-cased, without IPv6 brackets or a trailing dot. A bare IPv6 literal
    (``::1``, not valid in a Host header but unambiguous) is read as a host without a port.
    """
    v = value.strip().lower()
    port_text = ""
    if v.startswith("["):
        end = v.find("]")
        if end < 0:
            return None
        host, rest = v[1:end], v[end + 1:]
        if rest:
            if not rest.startswith(":"):
                return None
            port_text = rest[1:]
        if not _is_ip(host) or ":" not in host:
            return None
    elif v.count(":") > 1:
        host = v
        if not _is_ip(host):
            return None
    else:
        host, colon, port_text = v.partition(":")
        if colon and not port_text:
            return None
    port = None
    if port_text:
        if not (port_text.isascii() and port_text.isdigit()) or int(port_text) > 65535:
            return None
        port = int(port_text)
    host = host[:-1] if host.endswith(".") and not _is_ip(host) else host
    if not host or any(c in host for c in "/\\@ \t?#") or not host.isascii():
        return None
    return host, port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP literal (127.0.0.0/8, ::1, ::ffff:127.x.y.z)."""
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _matches(host: str, pattern: str) -> bool:
    """``pattern``: a host, ``*`` (any) or ``*.example.com`` (its subdomains)."""
    if pattern == "*":
        return True
    if pattern.startswith("*."):
        return host.endswith(pattern[1:])
    wanted = split_host(pattern)
    return wanted is not None and host == wanted[0]


class HostCheck:
    """Refuse (400) requests whose Host header this server must not answer to.

    ``allowed``: the Host patterns accepted (see :func:`_matches`); None: decided by the
    address the server listens on (``bound``, else the address the connection came in on):
    a loopback address accepts loopback names only, any other address any name.
    """

    def __init__(self, app: Any, allowed: Sequence[str] | None = None, bound: str | None = None) -> None:
        self.app = app
        self.allowed = None if allowed is None else [p.strip().lower() for p in allowed]
        self.bound = None if bound is None else (split_host(bound) or (bound.lower(), None))[0]

    def _bound(self, scope: dict) -> str | None:
        if self.bound is not None:
            return self.bound
        server = scope.get("server") or (None, None)
        return None if server[0] is None else str(server[0]).lower()

    def accepts(self, host_header: str, scope: dict) -> bool:
        """Whether a request with this Host header, on this connection, is served."""
        bound = self._bound(scope)
        if self.allowed is None and (bound is None or not is_loopback(bound)):
            return True  # listening on the network: any name may reach it
        parsed = split_host(host_header)
        if parsed is None:
            return False
        host = parsed[0]
        if self.allowed is not None:
            return any(_matches(host, p) for p in self.allowed)
        return is_loopback(host) or host == bound

    def _refusal(self, header: str, scope: dict) -> str:
        shown = repr(header[:100]) if header else "(none)"
        if self.allowed is not None:
            return f"invalid Host header {shown}: this server answers only to {', '.join(self.allowed)}"
        bound = self._bound(scope) or "127.0.0.1"
        port = (scope.get("server") or (None, None))[1]
        where = f"[{bound}]" if ":" in bound else bound
        where += f":{port}" if port else ""
        return (f"invalid Host header {shown}: on a loopback address this server answers only to "
                f"loopback names (DNS rebinding protection); open http://{where}/")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if not self.accepts(header, scope):
            if scope["type"] == "websocket":  # refused before the handshake: the server answers 403
                await send({"type": "websocket.close", "code": 1008})
            else:
                await refuse(send, 400, self._refusal(header, scope))
            return
        await self.app(scope, receive, send)


def _origin_parts(origin: str) -> tuple[str, str, int] | None:
    scheme, sep, netloc = origin.strip().lower().partition("://")
    if not sep or scheme not in _DEFAULT_PORTS or "/" in netloc:
        return None
    parsed = split_host(netloc)
    if parsed is None:
        return None
    return scheme, parsed[0], parsed[1] or _DEFAULT_PORTS[scheme]


def own_origin(scope: dict) -> tuple[str, str, int] | None:
    """(scheme, host, port) of this server as the request reached it (its Host header)."""
    scheme = scope.get("scheme", "http")
    header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
    parsed = split_host(header) if header else None
    if parsed is None:
        server = scope.get("server")
        if not server:
            return None
        parsed = (str(server[0]).lower(), server[1])
    return scheme, parsed[0], parsed[1] or _DEFAULT_PORTS.get(scheme, 80)


class OriginCheck:
    """Refuse (403) state-changing requests that a browser says come from another site."""

    def __init__(self, app: Any) -> None:
        self.app = app

    @staticmethod
    def refusal(scope: dict) -> str | None:
        """Why this request is refused (None: it is not)."""
        if scope["type"] != "http" or scope.get("method", "GET") in SAFE_METHODS:
            return None
        headers = dict(scope["headers"])
        site = headers.get(b"sec-fetch-site", b"").decode("latin-1").strip().lower()
        if site in ("cross-site", "same-site"):
            return (f"a {site} request (Sec-Fetch-Site) was refused: this server accepts "
                    f"{scope.get('method')} requests only from its own page")
        origin = headers.get(b"origin")
        if origin is None:
            return None
        text = origin.decode("latin-1")
        mine = own_origin(scope)
        if mine is None or _origin_parts(text) != mine:
            return (f"a cross-origin request (Origin {text[:100]!r}) was refused: this server "
                    f"accepts {scope.get('method')} requests only from its own page")
        return None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        why = self.refusal(scope)
        if why is not None:
            await refuse(send, 403, why)
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` with 413, counting what arrives (a missing or
    false Content-Length cannot get around it), before anything is parsed or spooled."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, send: Any) -> None:
        await refuse(send, 413, f"the request is larger than the {self.max_bytes:,} bytes allowed; "
                     "send a smaller file")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send)
            return
        seen, over, started = 0, False, False

        async def limited_receive() -> dict:
            nonlocal seen, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict) -> None:
            nonlocal started
            if over:  # the app's answer to a cut-off body: ours goes out instead
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not over:
                raise
        if over and not started:
            await self._refuse(send)
