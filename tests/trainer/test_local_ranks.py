"""The child ranks of a run in one process (``rlmega.trainer.local_ranks``): a call's driver-only objects stay
behind, and a child that raises or dies is named with what it was doing (in a real run, and with a killed driver:
``tests/faults/test_child_rank_killed.py``)."""

import io
import os
import signal

import pytest

from rlmega.trainer.local_ranks import RankChild, _CallPickler, _CallUnpickler
from rlmega.trainer.remote import WorkerFailure

pytestmark = pytest.mark.timeout(180)


class _Engine:
    """Stands for the driver's engine object (which holds a model and threads, and cannot be pickled)."""

    def __reduce__(self):
        raise AssertionError("an engine was pickled for a child rank")


def test_driver_only_objects_reach_a_child_as_none():
    buffer = io.BytesIO()
    _CallPickler(buffer, (_Engine,)).dump(("push_weights", ([_Engine()], 3), {"engine": _Engine()}))
    method, args, kwargs = _CallUnpickler(io.BytesIO(buffer.getvalue())).load()
    assert (method, args, kwargs) == ("push_weights", ([None], 3), {"engine": None})


def _child(tmp_path) -> RankChild:
    return RankChild(1, 2, "training rank 1", str(tmp_path / "logs" / "training-rank-1.log"), threads=1)


def test_a_child_that_raises_is_named_and_exits(tmp_path):
    child = _child(tmp_path)
    try:
        child.handle.compute_logprobs.remote("actor", None)  # before set-up: it has no actor
        with pytest.raises(WorkerFailure, match=r"^actor log-probs: training rank 1 raised KeyError: 'actor'$"):
            child.answer("actor log-probs", timeout_s=120)
        # It exits, so that rank 0, if it were blocked in a collective with it, would fail at once.
        assert child.process.wait(timeout=60) == 1
        assert "KeyError" in (tmp_path / "logs" / "training-rank-1.log").read_text()  # the traceback, in its log
    finally:
        child.stop()


def test_a_killed_child_is_named_with_its_signal_and_log(tmp_path):
    child = _child(tmp_path)
    try:
        os.kill(child.process.pid, signal.SIGKILL)
        child.handle.compute_logprobs.remote("actor", None)
        log = tmp_path / "logs" / "training-rank-1.log"
        with pytest.raises(WorkerFailure, match=rf"^update: training rank 1 died \(killed by signal SIGKILL\); "
                                                rf"its output is in {log}$"):
            child.answer("update", timeout_s=120)
    finally:
        child.stop()
