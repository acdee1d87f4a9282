"""Which hosts the balancer may fetch an image from. Closed by default: only public
(globally routable) addresses, so a client cannot make the balancer, which sits
inside the mesh's network, reach a private service, the loopback interface or a
cloud metadata endpoint (169.254.169.254) on its behalf.

The check runs where the connection is made, on the addresses the connection will
use: ``CheckedResolver`` is the HTTP client's resolver, so a name that resolves to
a public address when checked and to a private one when connecting (DNS rebinding)
cannot slip between the two. aiohttp never asks the resolver about an IP literal,
so ``check_literal`` covers those, for the first URL and every redirect."""

import ipaddress
import socket

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver


class AddressRefused(Exception):
    """A host that resolves to an address the policy refuses (fetch.py names the image)."""

    def __init__(self, host: str, address: str) -> None:
        shown = host if host == address else f"{host} ({address})"
        super().__init__(f"{shown} is not a public address")
        self.host, self.address = host, address


def is_public(address: str) -> bool:
    """Globally routable unicast: not private, loopback, link-local, shared (CGNAT),
    reserved, unspecified or multicast; an IPv4-mapped IPv6 address is judged as its IPv4."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone (fe80::1%eth0) names no other address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def check_literal(host: str, allow_private: bool) -> None:
    """Refuse a host written as an IP address that is not public (names are the resolver's)."""
    try:
        ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return  # a name: CheckedResolver sees what it resolves to
    if not allow_private and not is_public(host.strip("[]")):
        raise AddressRefused(host, host.strip("[]"))


class CheckedResolver(AbstractResolver):
    """The system resolver, refusing a name when any of its addresses is not public
    (any, not all: a name that also resolves privately is someone's trick)."""

    def __init__(self, allow_private: bool) -> None:
        self._inner = ThreadedResolver()
        self._allow_private = allow_private

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        if not self._allow_private:
            for result in results:
                if not is_public(result["host"]):
                    raise AddressRefused(host, result["host"])
        return results

    async def close(self) -> None:
        await self._inner.close()

    def __repr__(self) -> str:
        return f"CheckedResolver(allow_private={self._allow_private})"

