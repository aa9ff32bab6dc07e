"""torchrun, with its rendezvous checked before it starts and every way it fails told in one line.

    python -m rlmega.launch.checked_torchrun --nnodes N --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:PORT -m rlmega.launch.torchrun [launcher options] -- rlmega train ...

takes torchrun's own arguments and runs torchrun's agent in this process. Plain torchrun, given a rendezvous
port that some other program holds, connects to that program and waits for an answer without end, silently.
So, before the agent starts:

- the node that must host the rendezvous store (``--node-rank 0`` with the static backend, ``is_host=1``
  with c10d) needs its port free;
- on any node, something that accepts connections at the endpoint must answer as a torch store: with c10d,
  the port being taken on the endpoint's own host is then another node's agent of the same launch.

Every rendezvous wait is bounded by torch's timeouts (c10d: ``join_timeout``, 600 s, and ``read_timeout``,
60 s, for a store not up yet; static: ``timeout``, 600 s; all set with ``--rdzv-conf key=SECONDS``). A failed
check or rendezvous prints one line naming HOST:PORT and what to do, and exits with 2 (a port to change) or 1.
Once the rendezvous is done, the exit code is the launcher's (torchrun says 1 for any failure).
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional

from rlmega.errors import UserError
from rlmega.launch.ports import accepts_connections, port_in_use, require_free_port
from rlmega.launch.ray_cluster import log

STORE_ANSWER_S = 10.0
"""A torch store answers a new client within milliseconds: what stays silent this long at the endpoint is not one."""
C10D_DEFAULT_PORT = 29400
STATIC_DEFAULT_PORT = 29500


@dataclass
class Rendezvous:
    """The endpoint torchrun's agent will host or join."""

    backend: str
    host: str
    port: int
    hosts_store: Optional[bool]
    """True: this node must host the store; False: it joins one; None: torch decides by the host's name."""
    port_option: str
    """Where the user sets the port, for the messages."""
    timeouts: Dict[str, float]
    """The ``--rdzv-conf`` keys that bound its waits, with their values in seconds."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def fix(self) -> str:
        return f"pick another port with {self.port_option} on every node"

    def timeout_settings(self) -> str:
        return ",".join(f"{key}={value:g}" for key, value in self.timeouts.items())


def rendezvous_of(args) -> Optional[Rendezvous]:
    """The endpoint of torchrun's parsed ``args``, as ``torch.distributed.run.run`` will use it; None where
    torchrun picks a free port itself (``--standalone``; one static node without ``--master-port``) and for
    backends other than static and c10d."""
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config, parse_rendezvous_endpoint
    from torch.distributed.run import parse_min_max_nnodes

    if args.standalone:
        return None
    conf = _parse_rendezvous_config(args.rdzv_conf)
    if args.rdzv_backend == "static":
        if not args.rdzv_endpoint and args.master_port is None and parse_min_max_nnodes(args.nnodes)[1] == 1:
            return None
        if args.rdzv_endpoint:
            host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=STATIC_DEFAULT_PORT)
            option = "--rdzv-endpoint"
        else:
            host, port = args.master_addr, args.master_port or STATIC_DEFAULT_PORT
            option = "--master-port (MASTER_PORT)"
        return Rendezvous("static", host, port, args.node_rank == 0, option,
                          {"timeout": float(conf.get("timeout", 600))})
    if args.rdzv_backend == "c10d":
        host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=C10D_DEFAULT_PORT)
        if port == 0:
            return None
        is_host = conf.get("is_host")
        hosts_store = None if is_host is None else is_host.lower() in ("1", "true", "yes", "y")
        # join_timeout: for all nodes to join; read_timeout: for the store to come up and for each request
        return Rendezvous("c10d", host, port, hosts_store, "--rdzv-endpoint HOST:PORT",
                          {"join_timeout": float(conf.get("join_timeout", 600)),
                           "read_timeout": float(conf.get("read_timeout", 60))})
    return None


def check_rendezvous(rendezvous: Rendezvous) -> None:
    """UserError naming the endpoint when the agent would fail to host it or wait on something that is not a
    torch store there."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    if rendezvous.hosts_store:
        require_free_port(rendezvous.port, f"the rendezvous store this node hosts ({rendezvous.backend})",
                          rendezvous.fix())
        return
    may_host = rendezvous.hosts_store is None and _matches_machine_hostname(rendezvous.host)
    if may_host and not port_in_use(rendezvous.port):
        return  # this node's agent will host the store
    if not accepts_connections(rendezvous.host, rendezvous.port):
        return  # not up yet: torch retries within its own timeout
    if not answers_as_store(rendezvous.host, rendezvous.port):
        raise UserError(f"something at {rendezvous.address} accepts connections but is not a torch rendezvous "
                        f"store (another program holds the port); {rendezvous.fix()}")


def answers_as_store(host: str, port: int, timeout_s: float = STORE_ANSWER_S) -> bool:
    """Whether a torch store answers a client at ``host:port`` within ``timeout_s``. The client waits for an
    answer without a bound of its own, so it waits in a thread that is abandoned when nothing answers."""
    from torch.distributed import TCPStore

    result: List[bool] = []
    done = threading.Event()

    def connect() -> None:
        try:
            TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                     wait_for_workers=False)
            result.append(True)
        except Exception:  # any failure to talk to it means: not a store that answers
            result.append(False)
        finally:
            done.set()

    threading.Thread(target=connect, name="rlmega-store-probe", daemon=True).start()
    return done.wait(timeout_s) and result == [True]


def describe_failure(error: BaseException, rendezvous: Optional[Rendezvous], num_nodes: str) -> str:
    """One line for a rendezvous that failed with ``error``: where, torch's reason, what to do."""
    cause = error
    while cause.__cause__ is not None:  # torch wraps the store's error in "see inner exception"
        cause = cause.__cause__
    lines = str(cause).strip().splitlines()
    reason = f" ({lines[0].rstrip('.')})" if lines else ""
    if rendezvous is None:
        return f"the rendezvous failed{reason or ': ' + type(error).__name__}"
    where = f"the rendezvous at {rendezvous.address} ({rendezvous.backend})"
    if "EADDRINUSE" in reason or "address already in use" in reason.lower():
        return f"{where}: the port is already in use on this host; {rendezvous.fix()}"
    if "timed out" in reason.lower() or "timeout" in type(error).__name__.lower():
        return (f"{where} timed out{reason}; start the launch on all {num_nodes} nodes with the same "
                f"{rendezvous.port_option}, check that {rendezvous.host} is reachable from every node, or wait "
                f"longer by raising --rdzv-conf {rendezvous.timeout_settings()} (seconds)")
    return (f"{where} failed{reason or ': ' + type(error).__name__}; check that {rendezvous.host} is node 0's "
            f"address and reachable from this node, or {rendezvous.fix()}")


def _import_torch_quietly() -> None:
    """torch's store client logs each failed attempt with a C++ stack trace, which this process replaces with
    one line. The level is read once, as torch loads: the variable is gone again before the agent starts the
    launcher, which logs as usual."""
    quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ and "torch" not in sys.modules
    if quiet:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        import torch  # noqa: F401
    finally:
        if quiet:
            del os.environ["TORCH_CPP_LOG_LEVEL"]


def main(argv: Optional[List[str]] = None) -> int:
    _import_torch_quietly()
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        rendezvous = rendezvous_of(args)
        if rendezvous is not None:
            check_rendezvous(rendezvous)
    except (UserError, ValueError) as error:
        log(f"error: {error}")
        return 2
    if rendezvous is not None:
        log(f"rendezvous {rendezvous.backend} at {rendezvous.address} for {args.nnodes} node(s), timeouts "
            f"--rdzv-conf {rendezvous.timeout_settings()} (seconds)")
    try:
        run(args)
    except ChildFailedError as error:  # the launcher said why; its exit code is this node's
        codes = [failure.exitcode for failure in error.failures.values()]
        code = codes[0] if codes else 1
        return 128 - code if code < 0 else code
    except SignalException as error:
        return 128 + int(error.sigval)
    except (RendezvousError, DistError, TimeoutError) as error:
        log(f"error: {describe_failure(error, rendezvous, args.nnodes)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
