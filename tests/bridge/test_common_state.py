"""Megatron's common state (``content_metadata`` among it) read from either home, whichever megatron-core is
installed: ``common.pt`` (up to 0.18) or the ``common_state`` object inside the torch_dist files (0.19). Each
release's own writer is exercised by the converter tests run on it; here both layouts are written directly, so
the default run (0.16) also reads a 0.19 checkpoint."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from rlmega.bridge.hf_checkpoint import CheckpointError
from rlmega.bridge.torch_dist_files import COMMON, COMMON_OBJECT, read_common

STATE = {"content_metadata": {"stores_tied_head": True}, "iteration": 7}


def _torch_dist(directory, common_in_files: bool):
    """A torch_dist checkpoint of one tensor, its common state where ``common_in_files`` says: the 0.19 layout (a
    ``ShardedObject``'s chunk: ``torch.save([state])``) or the older ``common.pt``."""
    state_dict = {"w": torch.arange(6.0).reshape(2, 3)}
    if common_in_files:  # as 0.19 stores it: one object, the list of the state, saved whole (not flattened)
        state_dict[COMMON_OBJECT] = [STATE]
    dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True,
             planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
    if not common_in_files:
        torch.save(STATE, directory / COMMON)
    return directory


@pytest.mark.parametrize("common_in_files", [False, True], ids=["common.pt", "in-the-files"])
def test_read_common_finds_the_state_in_either_home(tmp_path, common_in_files):
    assert read_common(_torch_dist(tmp_path, common_in_files)) == STATE


def test_no_common_state_reads_as_empty(tmp_path):
    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    assert read_common(tmp_path) == {}


def test_damaged_common_state_in_the_files_names_the_shard_file(tmp_path):
    directory = _torch_dist(tmp_path, common_in_files=True)
    index = dcp.FileSystemReader(str(directory)).read_metadata()
    info = next(info for key, info in index.storage_data.items() if key.fqn == COMMON_OBJECT)
    shard = directory / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset:info.offset + info.length] = bytes(info.length)  # zeroed: must not read as "no record"
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"shard file {shard} is damaged .*in the common state"):
        read_common(directory)
