"""Which Host a request to the HTTP front may name: the defence against DNS rebinding.

A web page can re-point its own name to 127.0.0.1 once loaded; the browser then takes a router on loopback for the
page's origin and lets the page post JSON to it and read the answers. The browser still names the page's host in
the Host header, so a front that listens only on loopback answers only Hosts that are loopback names or addresses
(localhost, *.localhost, 127.0.0.0/8, [::1]) or that the operator listed in `allowed_hosts` (`*`: any). A front on
another address is reached by names of its own (a Service's DNS name), so it takes any Host unless the list is set.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from yarl import URL

from router_service.errors import clipped
from router_service.openai_errors import ApiError

if TYPE_CHECKING:
    from aiohttp import web

ANY_HOST = "*"
LOOPBACK_NAME = "localhost"
# A host name as DNS writes it (letters, digits, hyphens, underscores, dots; an IPv4 address is one too), and an
# allowed_hosts entry, which may begin with a `*.` wildcard.
_LABELS = r"[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?"
_NAME = re.compile(_LABELS)
_ENTRY = re.compile(r"(\*\.)?" + _LABELS)


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _is_loopback_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    return address.is_loopback


def is_loopback_name(name: str) -> bool:
    """`name` (lower case, IPv6 without brackets) is localhost, a name under .localhost, or a loopback address."""
    if name == LOOPBACK_NAME or (name.endswith("." + LOOPBACK_NAME) and name[0] != "."):
        return True
    address = _address(name)
    return address is not None and _is_loopback_address(address)


def host_name(value: str) -> str | None:
    """The name a Host header value gives (`name`, `name:port`, `[v6]`, `[v6]:port`), lower case and without
    brackets; None when it is not one (an IPv6 address outside brackets, a port that is not digits, a space)."""
    value = value.lower()
    if value.startswith("["):
        name, bracket, rest = value[1:].partition("]")
        if not bracket or not isinstance(_address(name), ipaddress.IPv6Address) or rest[:1] not in ("", ":"):
            return None
        port = rest[1:]
    else:
        name, _, port = value.partition(":")
        if _NAME.fullmatch(name) is None:
            return None
    if port and not (port.isascii() and port.isdigit()):
        return None
    return name


def allowed_hosts_problem(entries: Iterable[str]) -> str | None:
    """Why the allowed_hosts setting cannot be applied, or None: each entry is `*`, a host name (`*.example.com`
    for its subdomains) or an IP address (IPv6 with or without brackets), without a scheme, port or path."""
    for entry in entries:
        bare = entry.strip().lower()
        if bare == ANY_HOST:
            continue
        inside = bare[1:-1] if bare.startswith("[") and bare.endswith("]") else bare
        if _address(inside) is None and _ENTRY.fullmatch(bare) is None:
            return (
                f"{clipped(entry)!r} is not a host name or an IP address (write it without a scheme, port or path; "
                "*.example.com for its subdomains, * for any host)"
            )
    return None


def _target_host(target: str) -> str | None:
    """The host of an absolute-form request target (http://name:port/path), None when it names none."""
    try:
        return URL(target).raw_host
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class HostCheck:
    """The Hosts one listener answers: `enforced` off takes any; else loopback names and addresses, `names` and the
    subdomains of `suffixes`."""

    enforced: bool
    names: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()

    @classmethod
    def for_listener(cls, allowed_hosts: Iterable[str], bound: Iterable[str]) -> HostCheck:
        """The check of a listener bound to the addresses `bound` (its sockets' own) under the allowed_hosts
        setting: enforced when the list is set and has no `*`, or when it is empty and every address is loopback."""
        entries = [entry.strip().lower() for entry in allowed_hosts]
        if ANY_HOST in entries:
            return cls(enforced=False)
        addresses = [_address(host.partition("%")[0]) for host in bound]
        loopback_only = all(a is not None and _is_loopback_address(a) for a in addresses)
        if not entries and not loopback_only:
            return cls(enforced=False)
        names = frozenset(e[1:-1] if e.startswith("[") else e for e in entries if not e.startswith("*."))
        # an IP address is compared by value: 0:0::1 is ::1
        names |= {str(address) for name in names if (address := _address(name)) is not None}
        suffixes = tuple(e[1:] for e in entries if e.startswith("*."))
        return cls(enforced=True, names=names, suffixes=suffixes)

    def allows(self, name: str) -> bool:
        address = _address(name)
        return (
            is_loopback_name(name)
            or name in self.names
            or (address is not None and str(address) in self.names)
            or (address is None and name.endswith(self.suffixes) and bool(self.suffixes))
        )

    def refusal(self, request: web.Request) -> ApiError | None:
        """A 403 naming the request's Host when this listener does not answer it (or the authority of an
        absolute-form target, which RFC 9112 has a server take instead), else None."""
        if not self.enforced:
            return None
        value = request.headers.get("Host")
        name = host_name(value) if value is not None else None
        target = request.raw_path
        if name is not None and not target.startswith("/") and target != "*":
            value, name = target, _target_host(target)  # absolute-form: its authority is the request's host
        if name is not None and self.allows(name.lower()):
            return None
        shown = "none (an HTTP/1.0 request without one)" if value is None else repr(clipped(value))
        return ApiError(
            403,
            f"Host header: {shown} is neither a loopback name nor in allowed_hosts; add it to allowed_hosts if "
            "clients reach this router by that name (the check guards against DNS rebinding)",
            code="host_not_allowed",
        )
