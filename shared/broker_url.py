"""The message broker's address: a plain Redis URL (redis://, rediss://, unix://) or a Sentinel
one, `redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]`, whose hosts are
Sentinels and whose service is the monitored primary's name. The password belongs to the primary
and its replicas; `?sentinel_password=...` authenticates to the Sentinels themselves.

Pure functions: parsing and redaction, no connection.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote

SENTINEL_SCHEMES = ("redis+sentinel", "valkey+sentinel", "rediss+sentinel")


@dataclass(frozen=True)
class SentinelTarget:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    ssl: bool = False


def is_sentinel(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelTarget:
    """ValueError naming what is wrong with a redis+sentinel:// URL."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SENTINEL_SCHEMES:
        raise ValueError(f"not a Sentinel URL (want redis+sentinel://...): {redact(url)}")
    # urlsplit refuses several comma-separated host:port pairs, so the netloc is split by hand.
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        userinfo, hosts = "", netloc
    username = password = None
    if userinfo:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    sentinels = []
    for item in hosts.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon or not host or not port.isdigit():
            raise ValueError(f"Sentinel address {item.strip()!r} in {redact(url)} is not host:port")
        sentinels.append((host.strip("[]"), int(port)))
    parts = [p for p in path.split("/") if p]
    if not parts:
        raise ValueError(
            f"{redact(url)} names no service: redis+sentinel://host:port/<service>[/db]"
        )
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError(f"{redact(url)}: the path must be /<service>[/<db number>]")
    params = parse_qs(query)
    unknown = sorted(set(params) - {"sentinel_password"})
    if unknown:
        raise ValueError(f"{redact(url)}: unknown option(s) {unknown} (known: sentinel_password)")
    return SentinelTarget(
        sentinels=tuple(sentinels),
        service=unquote(parts[0]),
        db=int(parts[1]) if len(parts) == 2 else 0,
        username=username,
        password=password,
        sentinel_password=params.get("sentinel_password", [None])[0],
        ssl=scheme.lower() == "rediss+sentinel",
    )


def redact(url: str) -> str:
    """The URL with its password replaced by ***, for logs and error messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:***@{hosts}"
    if "sentinel_password=" in tail:
        path, _, query = tail.partition("?")
        tail = f"{path}?sentinel_password=***"
    return f"{scheme}://{netloc}{slash}{tail}"
