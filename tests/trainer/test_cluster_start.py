"""``start_workers`` starts the engines while the training ranks set up, and shuts down what it started when
either part fails (Ray's calls replaced by recorders: what is checked is the order of the calls)."""

import importlib

import pytest

from rlmega.config.load import load_config
from rlmega.trainer import cluster, rollout_group, training_group


class _Recorder:
    def __init__(self, fail_in=None):
        self.calls, self.fail_in = [], fail_in
        self.nodes = [{"rank": 0, "node_id": "node-a", "gpus": ""}]
        self.engine_bundles, self.engine_env = [], []

    def rollout_group(self, config, scheduling, record_routing=False, wait=True, env=None):
        recorder = self

        class Group:
            nodes = [{"engine": 0}]

            def wait_started(self):
                recorder.calls.append("engines: wait started")
                if recorder.fail_in == "engines":
                    raise RuntimeError("engine 0 died")

            def shutdown(self):
                recorder.calls.append("engines: shutdown")

        self.calls.append(f"engines: start (wait={wait})")
        for index in range(config.rollout.num_engines):
            self.engine_bundles.append(scheduling(index).placement_group_bundle_index)
            self.engine_env.append(env(index) if env else {})
        return Group()

    def ranks(self, config, placement_group, total_steps, placed=None):
        recorder = self

        class Ranks:
            nodes = [{"rank": 0}]

            def shutdown(self):
                recorder.calls.append("ranks: shutdown")

        if placed is not None:
            self.calls.append("ranks: placed")
            placed(self.nodes)
        self.calls.append("ranks: start and set up")
        if self.fail_in == "ranks":
            raise RuntimeError("rank 0 died")
        return Ranks()


@pytest.fixture
def recorder(monkeypatch, tmp_path):
    ray_placement = importlib.import_module("ray.util.placement_group")  # the module (ray.util's name is the function)
    made = _Recorder()
    monkeypatch.setattr(cluster, "connect", lambda config: None)
    monkeypatch.setattr(cluster, "_wait_ready", lambda group, what, timeout_s: None)
    monkeypatch.setattr(ray_placement, "placement_group", lambda bundles, strategy: ("pg", strategy))
    monkeypatch.setattr(rollout_group, "RolloutGroup", made.rollout_group)
    monkeypatch.setattr(training_group.TrainingRanks, "for_policy", staticmethod(made.ranks))
    return made


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_engines_start_before_the_ranks_set_up_and_are_awaited_after(recorder, tmp_path, placement):
    config = load_config("tiny_cpu", [f"run_dir={tmp_path}", f"rollout.placement={placement}", "cluster.in_process=never"],
                         check=False)
    training, rollout, placement_info = cluster.start_workers(config)
    assert recorder.calls == ["engines: start (wait=False)", "ranks: start and set up", "engines: wait started"]
    assert placement_info["engines"] == [{"engine": 0}] and placement_info["training_ranks"] == [{"rank": 0}]


@pytest.mark.parametrize("fail_in,stopped", [("ranks", ["engines: shutdown"]),
                                             ("engines", ["engines: shutdown", "ranks: shutdown"])])
def test_a_failed_start_stops_what_was_started(recorder, tmp_path, fail_in, stopped):
    recorder.fail_in = fail_in
    config = load_config("tiny_cpu", [f"run_dir={tmp_path}", "cluster.in_process=never"], check=False)
    with pytest.raises(RuntimeError, match="died"):
        cluster.start_workers(config)
    assert recorder.calls[-len(stopped):] == stopped


def test_without_rollout_no_engine_starts(recorder, tmp_path):
    config = load_config("tiny_cpu", [f"run_dir={tmp_path}", "cluster.in_process=never"], check=False)
    training, rollout, _ = cluster.start_workers(config, with_rollout=False)
    assert rollout is None and recorder.calls == ["ranks: start and set up"]


def test_private_cluster_settings_keep_ray_quiet_and_yield_to_the_users_variables(monkeypatch):
    for name in cluster.private_cluster_settings():
        monkeypatch.delenv(f"RAY_{name}", raising=False)
    settings = cluster.private_cluster_settings()
    assert settings == {"task_events_report_interval_ms": 0, "task_events_max_num_task_in_gcs": 1000,
                        "enable_metrics_collection": False,
                        "event_stats": False, "enable_worker_prestart": False, "prestart_worker_first_driver": False}
    monkeypatch.setenv("RAY_event_stats", "1")  # the user's own choice is left to Ray, which reads it
    assert "event_stats" not in cluster.private_cluster_settings()
    assert len(cluster.private_cluster_settings()) == len(settings) - 1


KEEP = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


@pytest.mark.parametrize("engines, engine_tp, bundles, devices", [
    (2, 1, [0, 1], ["3", "5"]),  # one engine per rank's GPU
    (1, 2, [0], ["3,5"]),  # one engine over both ranks' GPUs
    (4, 1, [0, 1, 0, 1], ["3", "5", "3", "5"]),  # two engines share each GPU
])
def test_colocated_gpu_engines_start_once_the_ranks_are_placed_on_their_devices(recorder, tmp_path, engines, engine_tp,
                                                                                bundles, devices):
    recorder.nodes = [{"rank": 0, "node_id": "node-a", "gpus": "3"}, {"rank": 1, "node_id": "node-a", "gpus": "5"}]
    config = load_config("tiny_cpu", [f"run_dir={tmp_path}", "cluster.in_process=never", "rollout.backend=vllm",
                                      "cluster.gpus_per_rank=1", f"rollout.num_engines={engines}",
                                      f"rollout.tensor_parallel_size={engine_tp}"], check=False)
    cluster.start_workers(config)
    assert recorder.calls == ["ranks: placed", "engines: start (wait=False)", "ranks: start and set up",
                              "engines: wait started"]
    assert recorder.engine_bundles == bundles
    assert recorder.engine_env == [{"CUDA_VISIBLE_DEVICES": device, **KEEP} for device in devices]


@pytest.mark.parametrize("overrides", [
    ["rollout.backend=vllm", "rollout.gpus_per_engine=1"],  # engines with GPUs of their own: Ray names them
    ["rollout.backend=hf", "cluster.gpus_per_rank=1"],  # the hf engine without GPUs of its own runs on the CPU
    ["rollout.backend=vllm"],  # no GPUs anywhere (a CPU run with a fake engine)
])
def test_other_engines_start_as_before_without_devices_of_the_ranks(recorder, tmp_path, overrides):
    config = load_config("tiny_cpu", [f"run_dir={tmp_path}", "cluster.in_process=never", *overrides], check=False)
    cluster.start_workers(config)
    assert recorder.calls[0] == "engines: start (wait=False)" and recorder.engine_env == [{}]
