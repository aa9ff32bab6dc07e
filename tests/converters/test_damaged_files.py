"""A damaged file among a checkpoint's many is named on one line: a safetensors shard (hf-to-mcore, verify), a file
of a torch_dist checkpoint (mcore-to-hf). Exit code 2, nothing written."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from rlmega.cli.main import main

NUM_SHARDS = 3


def _rlmega(*arguments):
    return subprocess.run([sys.executable, "-m", "rlmega.cli", *arguments], capture_output=True, text=True,
                          timeout=300)


def _assert_one_line(stderr: str, command: str, *parts: str) -> None:
    assert stderr.count("\n") == 1 and stderr.startswith(f"rlmega convert {command}: error: "), stderr
    for part in parts:
        assert part in stderr, stderr


@pytest.fixture(scope="module")
def sharded(hf_models, tmp_path_factory):
    """The tiny Llama split into three safetensors shards with their index, as save_pretrained writes large models."""
    directory = tmp_path_factory.mktemp("sharded") / "llama"
    shutil.copytree(hf_models["llama"], directory)
    tensors = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for shard in range(NUM_SHARDS):
        file = f"model-{shard + 1:05d}-of-{NUM_SHARDS:05d}.safetensors"
        part = names[shard::NUM_SHARDS]
        save_file({name: tensors[name] for name in part}, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


@pytest.fixture
def damaged_shard(sharded, tmp_path):
    """A copy of ``sharded`` whose second shard lost its second half (a copy cut short)."""
    directory = tmp_path / "damaged"
    shutil.copytree(sharded, directory)
    shard = directory / f"model-00002-of-{NUM_SHARDS:05d}.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return shard


def test_hf_to_mcore_names_the_damaged_shard(damaged_shard, tmp_path):
    result = _rlmega("convert", "hf-to-mcore", str(damaged_shard.parent), str(tmp_path / "out"), "--quiet")
    assert result.returncode == 2
    _assert_one_line(result.stderr, "hf-to-mcore", f"{damaged_shard} is damaged", "copy that file again")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged"]


def test_verify_names_the_damaged_shard(damaged_shard, sharded):
    result = _rlmega("convert", "verify", str(sharded), str(damaged_shard.parent))
    assert result.returncode == 2
    _assert_one_line(result.stderr, "verify", f"{damaged_shard} is damaged")


@pytest.fixture(scope="module")
def tied_checkpoint(hf_models, tmp_path_factory):
    """A torch_dist checkpoint of the tied Qwen2 (mcore-to-hf reads its common state for the tied
    head's record)."""
    root = tmp_path_factory.mktemp("torch-dist") / "checkpoint"
    assert main(["convert", "hf-to-mcore", str(hf_models["qwen2-tied"]), str(root), "--iteration", "1", "--quiet"]) == 0
    return root


def _zeros(path):
    path.write_bytes(b"\0" * path.stat().st_size)


def _cut(path):
    path.write_bytes(path.read_bytes()[:100])


def _common_state(path):
    """The state every rank shares, damaged where it lives: ``common.pt`` up to Megatron-Core 0.18, else (0.19) the
    ``common_state`` object's chunk inside a ``.distcp`` file, zeroed at its place. Returns the damaged file."""
    if path.is_file():
        _cut(path)
        return path
    from rlmega.bridge.torch_dist_files import COMMON_OBJECT, read_index

    index = read_index(path.parent)
    info = next(info for key, info in index.storage_data.items() if key.fqn == COMMON_OBJECT)
    shard = path.parent / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset:info.offset + info.length] = bytes(info.length)
    shard.write_bytes(bytes(data))
    return shard


@pytest.mark.parametrize("name, damage", [
    (".metadata", _cut),
    ("common.pt", _common_state),
    ("metadata.json", lambda path: path.write_text("{not json")),
    ("__0_0.distcp", _zeros),  # the right size, garbled
])
def test_mcore_to_hf_names_the_torn_file(tied_checkpoint, hf_models, tmp_path, capsys, name, damage):
    root = tmp_path / "checkpoint"
    shutil.copytree(tied_checkpoint, root)
    torn = root / "iter_0000001" / name
    damaged = damage(torn)
    torn = damaged if isinstance(damaged, Path) else torn
    capsys.readouterr()
    code = main(["convert", "mcore-to-hf", str(root), str(tmp_path / "hf"), "--hf-base", str(hf_models["qwen2-tied"]),
                 "--quiet"])
    assert code == 2
    _assert_one_line(capsys.readouterr().err, "mcore-to-hf", f"{torn} is damaged (")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
