"""Gloo on a host whose name does not resolve: rlmega binds it to the interface its ranks meet on, so no rank prints
torch's loopback-fallback warning (rlmega.parallel.gloo_interface)."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from rlmega.parallel import gloo_interface
from rlmega.parallel.gloo_interface import GLOO_SOCKET_IFNAME, bind_gloo_where_ranks_meet, interface_holding

UNRESOLVABLE = "rlmega-unresolvable-host.invalid"
FALLBACK_WARNING = "Unable to resolve hostname"


def test_a_hostname_is_usable_only_when_it_resolves_to_a_bindable_address(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    assert gloo_interface.hostname_is_usable()
    monkeypatch.setattr(socket, "gethostname", lambda: UNRESOLVABLE)
    assert not gloo_interface.hostname_is_usable()


def test_the_interface_holding_an_address_is_found_and_a_foreign_address_has_none():
    loopback = interface_holding("127.0.0.1")
    assert loopback is not None and gloo_interface._ipv4_of(loopback).startswith("127.")
    assert interface_holding("localhost") == loopback
    assert interface_holding("203.0.113.77") is None  # documentation range: on no host
    assert interface_holding("no-such-host.invalid") is None


def test_gloo_is_bound_only_where_the_hostname_fails_and_the_user_named_no_interface(monkeypatch):
    monkeypatch.delenv(GLOO_SOCKET_IFNAME, raising=False)
    monkeypatch.setattr(gloo_interface, "hostname_is_usable", lambda: True)
    assert bind_gloo_where_ranks_meet(["127.0.0.1"]) is None
    assert GLOO_SOCKET_IFNAME not in os.environ

    monkeypatch.setattr(gloo_interface, "hostname_is_usable", lambda: False)
    loopback = interface_holding("127.0.0.1")
    # The first address held here wins: a remote store's address is passed over for this node's.
    assert bind_gloo_where_ranks_meet([None, "203.0.113.77", "127.0.0.1"]) == loopback
    assert os.environ[GLOO_SOCKET_IFNAME] == loopback

    monkeypatch.setenv(GLOO_SOCKET_IFNAME, "ib0")
    assert bind_gloo_where_ranks_meet(["127.0.0.1"]) is None
    assert os.environ[GLOO_SOCKET_IFNAME] == "ib0"


def _can_rename_host() -> bool:
    try:
        return subprocess.run(["unshare", "--uts", "hostname", UNRESOLVABLE], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _can_rename_host(), reason="needs `unshare --uts` (root or user namespaces) to give a "
                    "process a host name that does not resolve; the unit tests above cover the choice itself")
def test_ranks_on_a_host_whose_name_does_not_resolve_print_no_gloo_warning(tmp_path, monkeypatch):
    monkeypatch.delenv(GLOO_SOCKET_IFNAME, raising=False)
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent("""
        from rlmega.parallel.gloo_interface import hostname_is_usable
        from rlmega.parallel.spawn import run_on_ranks

        def body(rank, world_size):
            import torch
            import torch.distributed as dist
            value = torch.tensor([rank + 1.0])
            dist.all_reduce(value)
            return value.item()

        if __name__ == "__main__":
            print("hostname usable:", hostname_is_usable())
            print("sums:", run_on_ranks(body, 2, timeout_s=240))
    """))
    result = subprocess.run(["unshare", "--uts", "sh", "-c", f'hostname {UNRESOLVABLE} && exec "$0" "$1"',
                             sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hostname usable: False" in result.stdout  # the condition gloo warns on really held
    assert "sums: [3.0, 3.0]" in result.stdout
    assert FALLBACK_WARNING not in result.stderr, result.stderr[-3000:]
