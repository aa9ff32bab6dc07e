"""Transports into an engine in a Ray actor: the receiving side runs inside the actor's process."""

import time

import pytest
import ray

from rlmega.trainer.engine_actor import RemoteEngine, start_engine_actor
from rlmega.sync import TransportError, make_transport, require_version, stream_update

from .helpers import BUCKET_BYTES, assert_serves, buckets_of

CALL_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=100 * 1024**2, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def remote(local_ray, start_dir):
    actor = start_engine_actor(start_dir, attn_implementation="eager")
    engine = RemoteEngine(actor, bucket_bytes=BUCKET_BYTES)
    ray.get(actor.weight_version.remote(), timeout=CALL_TIMEOUT_S)  # loaded
    yield engine
    ray.kill(actor)


def _state_dict_in(engine: RemoteEngine) -> dict:
    # A lambda travels by value; a function of this test module would have to be importable in the actor.
    fetch = engine.actor.__ray_call__.remote(lambda actor: {n: t.clone() for n, t in actor.model.state_dict().items()})
    return ray.get(fetch, timeout=CALL_TIMEOUT_S)


@pytest.mark.timeout(180)
def test_every_transport_reaches_an_engine_actor_bit_identically(remote, start_dir, target_dir):
    assert make_transport("auto", [remote], bucket_bytes=BUCKET_BYTES).name == "shared_memory"  # same host
    plan = [("shared_memory", target_dir), ("broadcast", start_dir), ("object_store", target_dir)]
    for version, (name, directory) in enumerate(plan, start=1):
        transport = make_transport(name, [remote], bucket_bytes=BUCKET_BYTES, timeout_s=CALL_TIMEOUT_S)
        stream_update(transport, [remote], buckets_of(directory), version)
        require_version(remote, version)
        assert_serves(_state_dict_in(remote), directory)


def _killing_the_actor_after(buckets, num_good, actor):
    yield from buckets[:num_good]
    ray.kill(actor, no_restart=True)
    yield from buckets[num_good:]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["shared_memory", "broadcast"])
def test_an_engine_actor_dying_mid_stream_fails_the_sender_quickly(remote, target_dir, name):
    transport = make_transport(name, [remote], bucket_bytes=BUCKET_BYTES, timeout_s=CALL_TIMEOUT_S)
    started = time.monotonic()
    with pytest.raises(TransportError, match="engine 0 failed while receiving weights|broadcast to the engines failed"):
        stream_update(transport, [remote], _killing_the_actor_after(buckets_of(target_dir), 2, remote.actor), 1)
    assert time.monotonic() - started < CALL_TIMEOUT_S / 2  # noticed, not waited out


def _kept_in(engine: RemoteEngine) -> list:
    def read(actor):
        from rlmega.sync import control

        return [(key, id(kept.channel), kept.state.get("generation")) for key, kept in control._KEPT.items()]

    return ray.get(engine.actor.__ray_call__.remote(read), timeout=CALL_TIMEOUT_S)


@pytest.mark.timeout(180)
def test_push_by_name_keeps_one_transport_and_one_engine_connection(remote, start_dir, target_dir):
    """Syncs after the first into an engine actor set nothing up: the same transport (found by the actor's
    id from a new handle), and inside the actor the same connection and mapping."""
    from rlmega.sync import kept_transport

    actor_id = ray.get(remote.actor.__ray_call__.remote(lambda actor: ray.get_runtime_context().get_actor_id()),
                       timeout=CALL_TIMEOUT_S)
    remote = RemoteEngine(remote.actor, bucket_bytes=BUCKET_BYTES, key=actor_id)  # as RolloutGroup names them
    again = RemoteEngine(remote.actor, bucket_bytes=BUCKET_BYTES, key=actor_id)  # a rank's copy at the next sync
    transports, kept = [], []
    for version, (engine, directory) in enumerate([(remote, target_dir), (again, start_dir), (remote, target_dir)], 1):
        transport = kept_transport("auto", [engine], bucket_bytes=BUCKET_BYTES, timeout_s=CALL_TIMEOUT_S)
        stream_update(transport, [engine], buckets_of(directory), version)
        require_version(engine, version)
        assert_serves(_state_dict_in(engine), directory)
        transports.append(transport)
        kept.append(_kept_in(engine))
    assert transports[0].name == "shared_memory" and transports[0] is transports[1] is transports[2]
    assert len(kept[0]) == 1 and kept[0] == kept[1] == kept[2]
