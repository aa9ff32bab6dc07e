"""Ports checked before anything waits on them: a port this host is to listen on must be free, and what answers
at an address must be the service expected there. A busy or wrong port then ends a launch in one line naming it,
instead of a traceback from the service that could not bind, or a silent wait of minutes for an answer that
never comes."""

from __future__ import annotations

import errno
import os
import socket
import time

from rlmega.errors import UserError

# The HTTP/2 client preface and an empty SETTINGS frame. Ray's GCS is a gRPC server, and every HTTP/2 server
# answers a new connection with a SETTINGS frame of its own (RFC 9113, 3.4) before any request is made.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 0x4, 0, 0, 0, 0, 0])
HTTP2_SETTINGS = 0x4
RETRY_S = 0.5


def port_in_use(port: int) -> bool:
    """Whether some socket on this host is bound to ``port`` (on any address), so that a server binding all
    addresses there, as Ray's GCS and torch's store do, would fail. Sockets merely waiting out a closed
    connection (TIME_WAIT) do not count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as error:
            return error.errno == errno.EADDRINUSE
    return False


def require_free_port(port: int, what: str, fix: str) -> None:
    """UserError naming ``port``, ``what`` was to listen there and ``fix`` when the port is taken on this host."""
    if port and port_in_use(port):
        raise UserError(f"port {port} for {what} is already in use on {socket.gethostname()} (another program, "
                        f"often another Ray cluster or launch, listens on it); {fix}")


def accepts_connections(host: str, port: int, timeout_s: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def ray_head_problem(address: str, timeout_s: float) -> str | None:
    """None once a Ray head's GCS answers at ``address`` (HOST:PORT), else why none did within ``timeout_s``:
    nothing accepted a connection (retried until then), or what accepted one did not answer as a gRPC server.
    With TLS (``RAY_USE_TLS``) only the connection is checked: the preface would be refused."""
    host, port = split_address(address)
    tls = os.environ.get("RAY_USE_TLS", "").lower() in ("1", "true")
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = max(0.1, deadline - time.monotonic())
        try:
            sock = socket.create_connection((host, port), timeout=min(remaining, 5.0))
        except OSError as error:
            if time.monotonic() >= deadline:
                return f"nothing accepted a connection within {timeout_s:g} s: {error.strerror or error}"
            time.sleep(RETRY_S)
            continue
        with sock:
            if tls:
                return None
            try:
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                sock.sendall(HTTP2_PREFACE)
                header = _receive(sock, 9)
            except TimeoutError:
                return f"something accepts connections there but gave no answer within {timeout_s:g} s"
            except OSError as error:
                return f"something accepts connections there but dropped them ({error.strerror or error})"
        if len(header) == 9 and header[3] == HTTP2_SETTINGS:
            return None
        return "something accepts connections there but does not speak Ray's protocol"


def _receive(sock: socket.socket, size: int) -> bytes:
    """Up to ``size`` bytes; fewer when the peer closes the connection first."""
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data
