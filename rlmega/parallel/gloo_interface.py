"""Which network interface gloo binds to when this host's name does not resolve.

Each gloo group binds to the address the host's name resolves to. Where it resolves to nothing usable (a container
or chroot whose ``/etc/hosts`` lacks the name), torch falls back to the loopback address and prints a C++ warning
from every rank in front of rlmega's own output; across hosts that fallback cannot even connect. rlmega knows the
address its ranks meet on, so in that case it names the interface holding that address in ``GLOO_SOCKET_IFNAME``
(the variable gloo reads): the loopback interface for a run on one host, Ray's node address otherwise. A host whose
name resolves, or a ``GLOO_SOCKET_IFNAME`` the user set, is left as it is.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from typing import Iterable, Optional

GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def hostname_is_usable() -> bool:
    """Whether this host's name resolves to an address a socket can bind, the test gloo makes before falling back."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((address[0], 0) + tuple(address[2:]))
            return True
        except OSError:
            continue
    return False


def _ipv4_of(interface: str) -> Optional[str]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:  # no IPv4 address on this interface
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_holding(address: str) -> Optional[str]:
    """The local interface with IPv4 ``address`` (any loopback interface for a 127.x address), or None."""
    try:
        wanted = ipaddress.ip_address(socket.gethostbyname(address))
    except (OSError, ValueError):
        return None
    for _, interface in socket.if_nameindex():
        held = _ipv4_of(interface)
        if held is None:
            continue
        held = ipaddress.ip_address(held)
        if held == wanted or (wanted.is_loopback and held.is_loopback):
            return interface
    return None


def bind_gloo_where_ranks_meet(addresses: Iterable[Optional[str]]) -> Optional[str]:
    """Before this process makes gloo groups: where the host's name is unusable and ``GLOO_SOCKET_IFNAME`` unset,
    set it to the interface holding the first of ``addresses`` found on this host. Returns the interface set."""
    if os.environ.get(GLOO_SOCKET_IFNAME) or hostname_is_usable():
        return None
    for address in addresses:
        interface = interface_holding(address) if address else None
        if interface is not None:
            os.environ[GLOO_SOCKET_IFNAME] = interface
            return interface
    return None
