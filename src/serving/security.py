"""Who may talk to `mudpuppy serve`: an API key, and no requests from other web sites.

- `--api-key KEY` (or MUDPUPPY_API_KEY): every request needs `Authorization: Bearer KEY`,
  compared in constant time; otherwise 401 with OpenAI's body (code invalid_api_key).
- A web page on another site can make a browser send requests to a server on your machine.
  Three rules stop it, all answered 403 or 415 before anything runs:
  * a request with an `Origin` header is refused unless that origin is the server's own
    (http://HOST:PORT as the request's Host names it) or one given with `--allow-origin`
    (`*` allows any; allowed origins get CORS headers, so browser apps can read answers);
  * a POST must say `Content-Type: application/json`: the only bodies a page can send
    across sites without asking the server first (a "simple request") are text/plain and
    form encodings, so this closes the one door the Origin rule leaves to old browsers;
  * bound to a loopback address, the `Host` header must name a loopback host (localhost,
    127.x.x.x, [::1]): a page on evil.example whose name is made to resolve to 127.0.0.1
    (DNS rebinding) sends Host: evil.example and is refused.
"""

from __future__ import annotations

import hmac
import ipaddress
from urllib.parse import urlsplit

from .requests import RequestError

LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def is_loopback(host: str) -> bool:
    """A name or address only this machine can reach."""
    name = host.strip("[]").lower()
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """'example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    try:
        return urlsplit(f"//{header}").hostname or ""
    except ValueError:
        return ""


class Guard:
    def __init__(self, api_key: str | None, allow_origins: tuple[str, ...], loopback: bool):
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.allow_origins = {o.rstrip("/") for o in allow_origins}
        self.loopback = loopback

    def check(self, method: str, headers) -> None:
        """Raises the RequestError to answer with, or returns when the request may go on."""
        host = headers.get("Host")
        if self.loopback and host is not None and not is_loopback(host_name(host)):
            raise RequestError(403, f"Host {host!r} is not this server's: bound to a loopback address, it answers "
                                    "only requests for localhost or a loopback address.", code="invalid_host")
        origin = headers.get("Origin")
        if origin is not None and not self.origin_allowed(origin, host):
            raise RequestError(403, f"Requests from the web origin {origin!r} are refused; start the server with "
                                    f"--allow-origin {origin} to let that site in.", code="origin_not_allowed")
        if method == "OPTIONS":
            return
        if self.expected is not None:
            given = (headers.get("Authorization") or "").strip().encode("utf-8", "replace")
            if not hmac.compare_digest(given, self.expected):
                what = "Incorrect API key provided." if given else "You didn't provide an API key."
                raise RequestError(401, f"{what} Send it as 'Authorization: Bearer KEY' (the key given to "
                                        "--api-key or MUDPUPPY_API_KEY).", code="invalid_api_key")
        if method == "POST":
            kind = (headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
            if kind != "application/json":
                raise RequestError(415, f"Content-Type {kind or 'missing'!s}: the body must be sent as "
                                        "application/json.", code="unsupported_media_type")

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        origin = origin.rstrip("/")
        if "*" in self.allow_origins or origin in self.allow_origins:
            return True
        return host is not None and origin in (f"http://{host}", f"https://{host}")

    def cors_origin(self, headers) -> str | None:
        """The Access-Control-Allow-Origin to send back: the request's origin when --allow-origin lets it in."""
        origin = headers.get("Origin")
        if origin is None or not self.allow_origins:
            return None
        if "*" in self.allow_origins or origin.rstrip("/") in self.allow_origins:
            return origin
        return None
