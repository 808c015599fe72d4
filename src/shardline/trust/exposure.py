"""Whether a node reaches beyond its own machine: an open cluster (no key, no TLS) is fine on a laptop, and
refused on a network unless the operator says `--insecure` (anyone there could start runners on it)."""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = ("localhost", "ip6-localhost")


def is_loopback(endpoint: str) -> bool:
    """Whether a zenoh endpoint (proto/host:port) names this machine only. 0.0.0.0 and :: are every
    interface; a host name other than localhost may be anything."""
    rest = endpoint.split("/", 1)[-1]
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    host = host.strip("[]").split("%", 1)[0]
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure(listen: str, peers: list[str], multicast_interface: str | None) -> str | None:
    """What takes this node off its machine (one phrase), or None when everything stays on loopback."""
    if not is_loopback(listen):
        return f"it listens on {listen}"
    if outside := [p for p in peers if not is_loopback(p)]:
        return f"it connects to {outside[0]}"
    if multicast_interface is not None:
        return f"it scouts on interface {multicast_interface}"
    return None


def open_refusal(
    listen: str, peers: list[str], multicast_interface: str | None, keyed: bool, insecure: bool
) -> str | None:
    """The one line `shardline node` exits with when it would run an open cluster on a network; None when it
    may start."""
    if keyed or insecure or (why := exposure(listen, peers, multicast_interface)) is None:
        return None
    return (
        f"refusing to run an open cluster off this machine ({why}): anyone who reaches it could start "
        "runners; give a key (--cluster-key-file or $SHARDLINE_CLUSTER_KEY) or TLS (--tls), or --insecure "
        "to run it open anyway"
    )
