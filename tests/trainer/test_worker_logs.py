"""Worker output goes to the run's log files, not the console; a dead worker is one line naming it and its log."""

import re
import subprocess
import sys
import textwrap

import pytest

from rlmega.errors import RunFailure
from rlmega.trainer import build
from rlmega.trainer.remote import WorkerFailure
from rlmega.trainer.worker_logs import LOG_ENV, actor_env, log_of, log_path, logged, tail


def test_redirected_process_writes_nothing_to_the_console(tmp_path):
    log = tmp_path / "logs" / "workers" / "rank-0.log"
    script = textwrap.dedent("""
        import os, sys, warnings
        from rlmega.trainer.worker_logs import redirect_output
        print("before")
        redirect_output()
        print("from print")
        warnings.warn("a library warning")
        os.write(2, b"from fd 2\\n")
        print("to stderr", file=sys.stderr)
    """)
    result = subprocess.run([sys.executable, "-c", script], env={**_env(), LOG_ENV: str(log)},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "before\n" and result.stderr == ""
    text = log.read_text()
    for line in ("from print", "a library warning", "from fd 2", "to stderr"):
        assert line in text
    assert tail(log, 1) == "to stderr"


def test_without_the_variable_nothing_is_redirected(tmp_path):
    script = "from rlmega.trainer.worker_logs import redirect_output; redirect_output(); print('here')"
    env = {key: value for key, value in _env().items() if key != LOG_ENV}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.stdout == "here\n"


def test_logged_class_keeps_its_name_and_arguments(tmp_path, monkeypatch):
    class Engine:
        def __init__(self, model, *, seed=0):
            self.model, self.seed = model, seed

    calls = []
    monkeypatch.setattr("rlmega.trainer.worker_logs.redirect_output", lambda: calls.append(1))
    engine = logged(Engine)("path", seed=3)
    assert isinstance(engine, Engine) and type(engine).__name__ == "Engine"
    assert (engine.model, engine.seed, calls) == ("path", 3, [1])


def test_actor_env_names_the_log_and_remembers_it(tmp_path):
    env = actor_env(tmp_path, "training rank 1")
    assert env == {LOG_ENV: str(tmp_path / "logs" / "workers" / "training-rank-1.log")}
    assert log_of("training rank 1") == env[LOG_ENV]
    assert actor_env(None, "judge engine 0") == {}
    assert log_path(tmp_path, "Judge engine 0").name == "judge-engine-0.log"


def test_a_failed_start_keeps_its_logs_in_the_run_directory_and_names_them(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "assets").mkdir()
    worker_log = log_path(run_dir, "rollout engine 0")

    def failing_start(config, datasets=None):
        worker_log.parent.mkdir(parents=True)
        worker_log.write_text("Traceback: the engine's own story\n")
        (run_dir / "placement.json").write_text("{}")
        raise WorkerFailure(f"starting engines: rollout engine 0 died (killed); its output is in {worker_log}")

    monkeypatch.setattr(build, "build_trainer", failing_start)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # nothing of the run may land in the temporary directory
    (tmp_path / "tmp").mkdir()
    config = type("Config", (), {"run_dir": str(run_dir)})()
    with pytest.raises(RunFailure) as failure:
        build.run(config)
    assert sorted(p.name for p in run_dir.iterdir()) == ["assets", "logs"]  # placement.json removed
    [kept] = (run_dir / "logs").iterdir()
    assert re.fullmatch(r"failed-start-\d{8}-\d{6}", kept.name)
    message = str(failure.value)
    assert message.endswith(f"its output is in {kept / 'workers' / 'rollout-engine-0.log'}")
    assert open(message.split("its output is in ")[1]).read() == "Traceback: the engine's own story\n"
    assert failure.value.details == str(kept / "error.log") and "WorkerFailure" in open(failure.value.details).read()
    assert list((tmp_path / "tmp").glob("rlmega-*")) == []


def test_cli_prints_a_run_failure_as_one_line(monkeypatch, capsys):
    from rlmega.cli import main as cli

    def failing(args):
        error = RunFailure("update: training rank 1 died (killed); its output is in /runs/a/logs/workers/training-rank-1.log")
        error.details = "/runs/a/logs/error.log"
        raise error

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: _with_run(parser, failing))
    assert cli.main(["train"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rlmega train: update: training rank 1 died (killed)")
    assert "(details: /runs/a/logs/error.log)" in err


def _with_run(parser, run):
    original = parser.parse_known_args

    def parse_known_args(argv=None):
        args, extras = original(argv)
        args.run = run
        return args, extras

    parser.parse_known_args = parse_known_args
    return parser


def _env():
    import os

    return dict(os.environ)


def test_dead_worker_reasons_are_short():
    from rlmega.trainer.remote import _why

    sigkill = ("The actor died unexpectedly before finishing this task.\n\tclass_name: A\n\tpid: 5459\nThe actor is dead "
               "because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker "
               "unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) ...")
    assert _why(RuntimeError(sigkill)) == ("its process ended unexpectedly: killed by a signal, out of memory, "
                                           "or crashed")
    assert _why(RuntimeError("The actor is dead because it was killed by `ray.kill`.")) == "killed by ray.kill"
    assert _why(RuntimeError("The actor died because its node has died. Node Id: ab")) == "its node died"


def test_ray_dead_worker_paragraphs_leave_the_console(tmp_path, capsys):
    import ray
    from ray._private import worker

    from rlmega.trainer.ray_console import quiet_worker_deaths

    original = worker.print_to_stdstream
    try:
        assert quiet_worker_deaths(tmp_path / "ray-errors.log") is True, f"not written for Ray {ray.__version__}"
        worker.print_to_stdstream({"lines": ["A worker died or was killed while executing a task ..."],
                                   "pid": "raylet", "is_err": False}, ignore_prefix=False)
        worker.print_to_stdstream({"lines": ["something else"], "pid": "raylet", "is_err": False},
                                  ignore_prefix=False)
    finally:
        worker.print_to_stdstream = original
    out = capsys.readouterr()
    assert "A worker died" not in out.out + out.err and "something else" in out.out + out.err
    assert (tmp_path / "ray-errors.log").read_text().startswith("A worker died or was killed")



@pytest.mark.parametrize("through", ["call", "transfer"])
def test_a_worker_that_dies_inside_another_workers_call_is_the_one_named(local_ray, through):
    """A training rank calls an engine (weight sync, post-sync probes); when the engine dies then, the rank's call
    fails with an error that Ray makes a RayActorError too, or (``transfer``: the engine's update call on a
    sender's thread) with a TransportError carrying it. The one-line failure names the engine, not the rank."""
    import ray

    from rlmega.trainer.remote import name_actors, wait_all

    class Callee:  # defined here, so that Ray ships the classes by value (the workers cannot import tests)
        def actor_id(self):
            return ray.get_runtime_context().get_actor_id()

        def die(self):
            import os

            os._exit(1)

    class Caller:
        def call(self, callee):
            return ray.get(callee.die.remote())

        def transfer(self, callee):  # as a transport's sender waits on the engines' update calls
            from rlmega.sync.control import Watch
            from rlmega.sync.transports import in_thread

            Watch([in_thread(self.call, callee)], 120.0).until(lambda: False, "the engine to take a bucket")

    callee, caller = ray.remote(Callee).remote(), ray.remote(Caller).remote()
    name_actors([ray.get(callee.actor_id.remote(), timeout=120)], ["rollout engine 0"])
    with pytest.raises(WorkerFailure) as failure:
        wait_all([getattr(caller, through).remote(callee)], ["training rank 0"], 120.0, "post-sync check")
    message = str(failure.value)
    assert message.startswith("post-sync check: rollout engine 0 died (its process ended unexpectedly"), message
    # (then "; its output is in <log>" when this process started an engine of that name, as earlier tests do)
    assert "died (its process ended unexpectedly" in message and "\n" not in message
    assert re.search(r"\) while training rank 0 was calling it(; its output is in \S+)?$", message), message
    assert ray.get(caller.__ray_ready__.remote(), timeout=60)  # the caller itself lives on
