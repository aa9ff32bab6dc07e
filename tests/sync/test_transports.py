"""Each transport, with the engine in this process (the cross-process transports' receivers then run
on a thread here, over the same shared memory, store and gloo group as across processes)."""

import pytest
import torch

from rlmega.rollout import EngineNotReadyError, SamplingParams
from rlmega.sync import TRANSPORTS, StaleWeightsError, TransportError, make_transport, require_version, stream_update
from rlmega.sync.buckets import layout, pack, rebucket, unpack

from .helpers import BUCKET_BYTES, RecordingEngine, assert_serves, buckets_of, failing_after, send_all

pytestmark = pytest.mark.timeout(60)

IN_THIS_PROCESS = ["in_process", "shared_memory", "broadcast"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=3)


def _transport(name, engine, timeout_s=20.0):
    return make_transport(name, [engine], bucket_bytes=BUCKET_BYTES, timeout_s=timeout_s)


def test_pack_and_unpack_round_trip_with_aligned_views():
    bucket = [("a", torch.arange(3, dtype=torch.float16)), ("b", torch.randn(2, 5)), ("c", torch.tensor(7, dtype=torch.int64))]
    metas, nbytes = layout(bucket)
    assert [m.offset % 64 for m in metas] == [0, 0, 0]
    flat = torch.empty(nbytes, dtype=torch.uint8)
    pack(bucket, metas, flat)
    for (name, tensor), (got_name, got) in zip(bucket, unpack(flat, metas)):
        assert got_name == name and got.dtype == tensor.dtype and torch.equal(got, tensor)


def test_rebucket_hands_a_bucket_on_as_soon_as_it_is_full():
    pulled = []

    def stream():
        for i in range(5):
            pulled.append(i)
            yield str(i), torch.zeros(10)  # 40 bytes each

    for bucket in rebucket(stream(), 80):
        assert len(pulled) == int(bucket[-1][0]) + 1  # nothing of the next bucket was pulled yet
    assert pulled == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("name", IN_THIS_PROCESS)
def test_delivers_bit_identical_tensors_and_commits_only_after_the_last_bucket(start_dir, target_dir, name):
    engine = RecordingEngine(start_dir)
    buckets = buckets_of(target_dir)
    assert len(buckets) > 3
    stream_update(_transport(name, engine), [engine], buckets, version=1)
    assert engine.weight_version() == 1 and engine.health()["ready"]
    assert_serves(engine.inner.model.state_dict(), target_dir)
    assert len(engine.during) == sum(len(b) for b in buckets)
    assert set(engine.during) == {(0, False)}  # old version and refusing to generate until the end


@pytest.mark.parametrize("name", IN_THIS_PROCESS)
def test_a_sender_failure_mid_stream_leaves_the_engine_refusing_to_generate(start_dir, target_dir, name):
    engine = RecordingEngine(start_dir)
    buckets = buckets_of(target_dir)
    with pytest.raises(RuntimeError, match="export broke"):
        stream_update(_transport(name, engine), [engine], failing_after(buckets, 3, RuntimeError("export broke")), version=1)
    assert engine.during  # some tensors were written before the failure
    assert engine.weight_version() == 0
    with pytest.raises(EngineNotReadyError, match="failed part way"):
        engine.generate([[1, 2]], GREEDY)
    stream_update(_transport(name, engine), [engine], buckets, version=1)  # a complete update recovers
    assert engine.weight_version() == 1 and engine.health()["ready"]
    assert_serves(engine.inner.model.state_dict(), target_dir)


@pytest.mark.parametrize("name", IN_THIS_PROCESS)
def test_an_engine_failure_mid_stream_reaches_the_sender_with_its_cause(start_dir, target_dir, name):
    engine = RecordingEngine(start_dir)
    buckets = buckets_of(target_dir)
    buckets[2] = buckets[2] + [("model.layers.0.no_such_weight", torch.zeros(3))]
    with pytest.raises(TransportError, match="no_such_weight"):
        stream_update(_transport(name, engine), [engine], buckets, version=1)
    assert engine.weight_version() == 0 and not engine.health()["ready"]


@pytest.mark.parametrize("name", ["shared_memory", "broadcast"])
def test_a_receiver_that_never_answers_times_out_instead_of_hanging(start_dir, target_dir, name):
    transport = make_transport(name, [], bucket_bytes=BUCKET_BYTES, timeout_s=1.5)
    transport.listen(1)  # a receiver is announced but nobody runs it
    with pytest.raises(TransportError, match="timed out after 1.5 s"):
        send_all(transport, buckets_of(target_dir))


def test_unknown_transport_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="'broadcast', 'in_process', 'object_store', 'shared_memory'"):
        make_transport("carrier_pigeon", [], bucket_bytes=1)
    assert sorted(TRANSPORTS) == ["broadcast", "in_process", "object_store", "shared_memory"]


def test_require_version_names_both_versions(start_dir, target_dir):
    engine = RecordingEngine(start_dir)
    require_version(engine, 0)
    with pytest.raises(StaleWeightsError, match="serves weight version 0, expected version 1") as raised:
        require_version(engine, 1)
    assert (raised.value.served, raised.value.expected) == (0, 1)
    stream_update(_transport("in_process", engine), [engine], buckets_of(target_dir), version=1)
    require_version(engine, 1)
    assert all(g.weight_version == 1 for g in engine.generate([[1, 2]], GREEDY))


@pytest.mark.parametrize("name", ["shared_memory", "broadcast"])
def test_one_transport_object_serves_update_after_update(start_dir, target_dir, name):
    engine = RecordingEngine(start_dir)
    transport = _transport(name, engine)
    for version, directory in enumerate([target_dir, start_dir, target_dir], start=1):
        stream_update(transport, [engine], buckets_of(directory), version)
        require_version(engine, version)
        assert_serves(engine.inner.model.state_dict(), directory)


class _EngineElsewhere:
    """Stands for a RemoteEngine: it starts updates itself, and knows whether it runs on this host."""

    def __init__(self, local: bool):
        self.local = local

    def start_update(self, named_tensors, version):
        raise AssertionError("not started in this test")

    def is_local(self) -> bool:
        return self.local


def test_auto_picks_by_where_the_engine_runs(start_dir):
    def auto(engines):
        return make_transport("auto", engines, bucket_bytes=BUCKET_BYTES).name

    assert auto([RecordingEngine(start_dir)]) == "in_process"
    assert auto([_EngineElsewhere(local=True), _EngineElsewhere(local=True)]) == "shared_memory"
    assert auto([_EngineElsewhere(local=True), _EngineElsewhere(local=False)]) == "object_store"


@pytest.mark.parametrize("name", IN_THIS_PROCESS)
def test_one_update_feeds_several_engines(start_dir, target_dir, name):
    engines = [RecordingEngine(start_dir), RecordingEngine(start_dir)]
    stream_update(make_transport(name, engines, bucket_bytes=BUCKET_BYTES, timeout_s=20), engines,
                  buckets_of(target_dir), version=1)
    for engine in engines:
        require_version(engine, 1)
        assert_serves(engine.inner.model.state_dict(), target_dir)


def _shm_files() -> set[str]:
    import os

    from rlmega.sync.shared_memory import SHM_PREFIX

    return {name for name in os.listdir("/dev/shm") if name.startswith(SHM_PREFIX)}


def test_shared_memory_sets_up_once_and_keeps_nothing_of_a_finished_update(start_dir, target_dir):
    """The second and third updates reuse the store, the region and the receiver's connection and
    mapping; the store holds no key between updates; /dev/shm holds nothing of it."""
    from rlmega.sync import control

    engine = RecordingEngine(start_dir)
    transport = _transport("shared_memory", engine)
    before = _shm_files()
    seen = []
    for version, directory in enumerate([target_dir, start_dir, target_dir], start=1):
        stream_update(transport, [engine], buckets_of(directory), version)
        assert_serves(engine.inner.model.state_dict(), directory)
        address = transport._address
        kept = control._KEPT[0]
        assert kept.address == address
        seen.append((transport._channel, transport._region.handle.generation, kept.channel, kept.state["generation"]))
        assert transport._channel.store.num_keys() == 0
        assert _shm_files() == before
    assert seen[0][0] is seen[1][0] is seen[2][0] and seen[0][2] is seen[1][2] is seen[2][2]
    # The region grew once in the first update (a tensor larger than a slot), then stayed.
    assert seen[0][1] == seen[1][1] == seen[2][1] and seen[0][3] == seen[0][1]


def test_a_failed_update_releases_the_kept_transport_and_the_next_starts_afresh(start_dir, target_dir):
    from rlmega.sync import control

    engine = RecordingEngine(start_dir)
    transport = _transport("shared_memory", engine)
    stream_update(transport, [engine], buckets_of(target_dir), 1)
    first = transport._address
    with pytest.raises(RuntimeError, match="export broke"):
        stream_update(transport, [engine], failing_after(buckets_of(start_dir), 2, RuntimeError("export broke")), 2)
    assert transport._channel is None and transport._region is None
    assert 0 not in control._KEPT  # the receiver dropped its side too
    stream_update(transport, [engine], buckets_of(start_dir), 2)
    assert transport._address.port != first.port
    assert engine.weight_version() == 2
    assert_serves(engine.inner.model.state_dict(), start_dir)


def test_a_receiver_of_a_new_sender_lets_go_of_the_old_ones_region(start_dir, target_dir):
    """One sender per receiver rank and process: an engine fed by a new transport (its sender made a new
    one) keeps only the new one's connection and mapping."""
    from rlmega.sync import control

    engine = RecordingEngine(start_dir)
    old, new = _transport("shared_memory", engine), _transport("shared_memory", engine)
    stream_update(old, [engine], buckets_of(target_dir), 1)
    old_region = control._KEPT[0].state["region"]
    stream_update(new, [engine], buckets_of(start_dir), 2)
    assert control._KEPT[0].address == new._address and control._KEPT[0].state["region"] is not old_region
    assert_serves(engine.inner.model.state_dict(), start_dir)


def test_kept_transport_is_one_per_set_of_engines():
    from rlmega.sync import kept_transport

    class Handle:  # a RemoteEngine made anew for every call: told apart by its actor's key
        def __init__(self, key):
            self.key = key

        def start_update(self, named_tensors, version):
            raise AssertionError("not started in this test")

        def is_local(self):
            return True

    one = kept_transport("auto", [Handle("a")], bucket_bytes=BUCKET_BYTES)
    keyless = Handle(None)  # a handle not named by RolloutGroup: nothing is kept for it
    assert kept_transport("auto", [keyless], bucket_bytes=BUCKET_BYTES) is not kept_transport(
        "auto", [keyless], bucket_bytes=BUCKET_BYTES)
    assert one.name == "shared_memory"
    assert kept_transport("auto", [Handle("a")], bucket_bytes=BUCKET_BYTES) is one
    assert kept_transport("auto", [Handle("b")], bucket_bytes=BUCKET_BYTES) is not one
    assert kept_transport("auto", [Handle("a"), Handle("b")], bucket_bytes=BUCKET_BYTES) is not one
    assert kept_transport("shared_memory", [Handle("a")], bucket_bytes=BUCKET_BYTES) is not one


def test_broadcast_builds_its_group_once_and_rebuilds_it_after_a_failure(start_dir, target_dir):
    from rlmega.sync import control

    engine = RecordingEngine(start_dir)
    transport = _transport("broadcast", engine)
    groups = []
    for version, directory in enumerate([target_dir, start_dir], start=1):
        stream_update(transport, [engine], buckets_of(directory), version)
        assert_serves(engine.inner.model.state_dict(), directory)
        assert control._KEPT[1].address == transport._address
        groups.append((transport._group, control._KEPT[1].state["group"]))
    assert groups[0][0] is groups[1][0] and groups[0][1] is groups[1][1]
    with pytest.raises(RuntimeError, match="export broke"):
        stream_update(transport, [engine], failing_after(buckets_of(target_dir), 2, RuntimeError("export broke")), 3)
    assert transport._group is None and 1 not in control._KEPT
    stream_update(transport, [engine], buckets_of(target_dir), 3)
    assert transport._group is not None and transport._group is not groups[0][0]
    assert engine.weight_version() == 3
    assert_serves(engine.inner.model.state_dict(), target_dir)
