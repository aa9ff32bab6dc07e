"""The checks a launch makes before it waits on a port, against real sockets on 127.0.0.1: a port held by a
listener, a closed port, a program that answers but is not the service expected, and a real torch store."""

import datetime
import socket
import threading
import time

import pytest
from launch_helpers import free_ports

from rlmega.errors import UserError
from rlmega.launch.checked_torchrun import answers_as_store, rendezvous_of
from rlmega.launch.ports import port_in_use, ray_head_problem, require_free_port

pytestmark = pytest.mark.timeout(60)


def listener(host="127.0.0.1", reply=None):
    """A listening socket on a port of its own; ``reply``: bytes sent to each connection, then closed."""
    sock = socket.socket()
    sock.bind((host, 0))
    sock.listen(8)
    if reply is not None:
        def answer():
            while True:
                try:
                    connection, _ = sock.accept()
                except OSError:
                    return
                with connection:
                    connection.sendall(reply)
        threading.Thread(target=answer, daemon=True).start()
    return sock


def test_a_port_held_by_a_listener_on_one_address_is_in_use_for_all():
    sock = listener("127.0.0.1")
    port = sock.getsockname()[1]
    with sock:
        assert port_in_use(port)
        with pytest.raises(UserError, match=rf"port {port} for the thing is already in use on .*; do this"):
            require_free_port(port, "the thing", "do this")
    assert not port_in_use(port)
    require_free_port(port, "the thing", "do this")


def test_ray_head_probe_tells_a_closed_port_a_silent_listener_and_another_protocol_apart():
    closed, = free_ports(1)
    started = time.monotonic()
    assert "nothing accepted a connection within 1 s" in ray_head_problem(f"127.0.0.1:{closed}", 1.0)
    with listener() as silent:
        problem = ray_head_problem(f"127.0.0.1:{silent.getsockname()[1]}", 1.0)
        assert "accepts connections there but gave no answer within 1 s" in problem
    with listener(reply=b"HTTP/1.1 400 Bad Request\r\n\r\n") as http1:
        problem = ray_head_problem(f"127.0.0.1:{http1.getsockname()[1]}", 10.0)
        assert "does not speak Ray's protocol" in problem
    assert time.monotonic() - started < 30
    # What a gRPC server (Ray's GCS) sends first: a SETTINGS frame.
    with listener(reply=bytes([0, 0, 0, 0x4, 0, 0, 0, 0, 0])) as grpc_like:
        assert ray_head_problem(f"127.0.0.1:{grpc_like.getsockname()[1]}", 10.0) is None


def test_store_probe_tells_a_torch_store_from_a_plain_listener():
    from torch.distributed import TCPStore

    port, = free_ports(1)
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=30))
    assert answers_as_store("127.0.0.1", port, timeout_s=30)
    del store
    with listener() as silent:
        started = time.monotonic()
        assert not answers_as_store("127.0.0.1", silent.getsockname()[1], timeout_s=1)
        assert time.monotonic() - started < 20


def test_rendezvous_endpoint_as_torchrun_uses_it():
    from torch.distributed.run import parse_args

    def rendezvous(*argv):
        return rendezvous_of(parse_args([*argv, "--no-python", "true"]))

    static0 = rendezvous("--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "29601")
    assert (static0.address, static0.hosts_store, static0.timeouts) == ("10.0.0.1:29601", True, {"timeout": 600})
    assert "--master-port" in static0.fix()
    static1 = rendezvous("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1")
    assert (static1.address, static1.hosts_store) == ("10.0.0.1:29500", False)
    c10d = rendezvous("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head",
                      "--rdzv-conf", "join_timeout=5")
    assert (c10d.address, c10d.hosts_store, c10d.timeouts["join_timeout"]) == ("head:29400", None, 5)
    assert "--rdzv-endpoint" in c10d.fix()
    assert rendezvous("--standalone", "--nnodes", "1") is None
    assert rendezvous("--nnodes", "1") is None  # torchrun picks a free port itself
