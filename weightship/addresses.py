"""Which peer addresses a node may announce: never link-local or cloud metadata, and inside the cluster's network.

A node's peer address is where other nodes send their tickets and chunk requests. A hostile node
that announced someone else's address could point the swarm at a cloud metadata service
(169.254.169.254) or at any internal service, and harvest tickets at a proxy of its own. So the
control plane (at registration) and the tracker (at announce) both refuse:

- anything but an ``http(s)://host[:port]`` URL;
- link-local addresses (169.254.0.0/16, fe80::/10: where metadata services live), unspecified,
  multicast and broadcast addresses, the other well-known metadata addresses, and the metadata
  host names;
- when the cluster's networks are configured (``networks``): any host that is not an IP address
  inside one of them.

The tracker further requires the announced address to be the one the node registered (the
ticket names it: ``weightship.tickets.Ticket.addr``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from urllib.parse import urlsplit

from weightship.errors import ValidationError

__all__ = ["METADATA_ADDRESSES", "METADATA_HOSTS", "Network", "check_peer_address", "parse_networks"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

#: metadata services outside the link-local ranges (AWS over IPv6, Alibaba Cloud)
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in ("fd00:ec2::254", "100.100.100.200"))
#: host names that resolve to a metadata service
METADATA_HOSTS = frozenset({"metadata", "metadata.google.internal", "metadata.goog", "instance-data",
                            "instance-data.ec2.internal"})  # fmt: skip


def parse_networks(text: str) -> tuple[Network, ...]:
    """``"10.0.0.0/8, fd00::/8"`` as networks; ``ValidationError`` naming a bad entry."""
    found: list[Network] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            found.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValidationError(f"{item!r} is not a network (CIDR, e.g. 10.0.0.0/8)") from None
    return tuple(found)


def check_peer_address(url: str, networks: Sequence[Network] = (), what: str = "peer address") -> None:
    """Raise ``ValidationError`` unless ``url`` is a peer address a node may announce (see the module doc)."""
    parts = urlsplit(url)
    host = (parts.hostname or "").rstrip(".").lower()
    if parts.scheme not in ("http", "https") or not host:
        raise ValidationError(f"{what} {url!r} is not an http(s)://host:port URL")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is None:
        if host in METADATA_HOSTS:
            raise ValidationError(f"{what} {url!r} names a cloud metadata service; announce this node's own address")
        if networks:
            raise ValidationError(
                f"{what} {url!r} is a host name; announce an IP address inside the cluster's networks "
                f"({', '.join(map(str, networks))})"
            )
        return
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if (
        address.is_link_local
        or address.is_unspecified
        or address.is_multicast
        or address in METADATA_ADDRESSES
        or address == ipaddress.IPv4Address("255.255.255.255")
    ):
        raise ValidationError(
            f"{what} {url!r} is a link-local, metadata, unspecified or multicast address, which no peer "
            "listener has; announce this node's own address (--peer-address)"
        )
    if networks and not any(address in network for network in networks):
        raise ValidationError(
            f"{what} {url!r} is outside the cluster's networks ({', '.join(map(str, networks))}); "
            "announce this node's own address (--peer-address)"
        )
