"""Submit ``rlmega train ...`` to a running Ray cluster with ``ray job submit``.

    python -m rlmega.launch.ray_job [options] -- train --config tiny_cpu run_dir=/shared/runs/x ...
    bash launch/ray_job_submit.sh [options] -- train ...          # the same, from a checkout

The job's runtime environment uploads the code: ``working_dir`` is the checkout holding the
``rlmega`` package (``--working-dir`` to choose another). Where rlmega is installed in
site-packages rather than from a checkout, or with ``--no-working-dir``, nothing is uploaded and the
job runs the rlmega installed on the cluster. Large or private directories are
excluded (``.venv``, ``.git``, run and checkpoint directories, weights; ``--exclude`` adds more; Ray
refuses uploads over 500 MiB). The entrypoint is ``python -m rlmega.cli.main`` by default, run by
the cluster's ``python`` in the job's working directory, so the uploaded code is the code that runs;
the cluster's Python needs rlmega's dependencies installed.

``cluster.ray_address=auto`` is added unless given: the job then joins the cluster it was submitted
to. Give ``run_dir=`` on storage every node sees; the job's working directory is temporary.

The dashboard address comes from ``--address``, else ``$RAY_API_SERVER_ADDRESS``, else
``http://127.0.0.1:8265`` (the head, or an SSH tunnel to it:
``ssh -L 8265:127.0.0.1:8265 head-node``). With token authentication (Ray's default), the client
needs the cluster's token in ``$RAY_AUTH_TOKEN`` or ``~/.ray/auth_token``.

Without ``--no-wait`` the command follows the job's logs and exits 0 if it succeeded, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

# Never uploaded: environments, VCS data, run outputs and weights (Ray caps uploads at 500 MiB).
DEFAULT_EXCLUDES = [
    ".git", ".venv", "venv", "**/__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis",
    "runs", "outputs", "checkpoints", "wandb", "*.safetensors", "*.pt", "*.bin", "*.parquet",
]


def package_root() -> Path:
    """The directory that holds the ``rlmega`` package: the checkout for an editable install."""
    return Path(__file__).resolve().parents[2]


def runtime_env(
    working_dir: Optional[Path], excludes: List[str], env_vars: Dict[str, str]
) -> Dict:
    env: Dict = {"env_vars": {"PYTHONUNBUFFERED": "1", **env_vars}}
    if working_dir is not None:
        env["working_dir"] = str(working_dir)
        env["excludes"] = excludes
    return env


def entrypoint(prefix: str, train_args: List[str]) -> List[str]:
    """The job's command as words (``ray job submit`` quotes each for the job's shell)."""
    args = list(train_args)
    if not any(arg.startswith("cluster.ray_address=") for arg in args):
        args.append("cluster.ray_address=auto")
    return [*shlex.split(prefix), *args]


def submit_command(args: argparse.Namespace) -> List[str]:
    env_vars = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--env takes KEY=VALUE, got {item!r}")
        env_vars[key] = value
    working_dir = None if args.no_working_dir else Path(args.working_dir or package_root())
    if working_dir is not None and working_dir.name in ("site-packages", "dist-packages"):
        working_dir = None  # an installed rlmega: the cluster's own copy runs
    ray = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    cmd = [ray, "job", "submit", "--address", args.address,
           "--runtime-env-json", json.dumps(runtime_env(working_dir, DEFAULT_EXCLUDES + args.exclude, env_vars))]
    if args.submission_id:
        cmd += ["--submission-id", args.submission_id]
    if args.no_wait:
        cmd += ["--no-wait"]
    return cmd + ["--", *entrypoint(args.entrypoint_prefix, args.train_args)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rlmega.launch.ray_job",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--address",
                        default=os.environ.get("RAY_API_SERVER_ADDRESS", "http://127.0.0.1:8265"),
                        help="the cluster's dashboard (default $RAY_API_SERVER_ADDRESS or http://127.0.0.1:8265)")
    parser.add_argument("--working-dir", help="directory to upload (default: the one holding rlmega/)")
    parser.add_argument("--no-working-dir", action="store_true",
                        help="upload nothing: run the rlmega installed on the cluster")
    parser.add_argument("--exclude", action="append", default=[],
                        help="another path or pattern to leave out of the upload (repeatable)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment variable for the job (repeatable)")
    parser.add_argument("--entrypoint-prefix", default="python -m rlmega.cli.main",
                        help="what comes before the train arguments (default: python -m rlmega.cli.main)")
    parser.add_argument("--submission-id", help="job id to use (default: Ray makes one)")
    parser.add_argument("--no-wait", action="store_true", help="return once submitted")
    parser.add_argument("--dry-run", action="store_true", help="print the ray job submit command only")
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="-- train [--config NAME] [key=value ...]")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.train_args[:1] == ["--"]:
        args.train_args = args.train_args[1:]
    if not args.train_args:
        print("ray_job: give the rlmega command after --, e.g. -- train --config tiny_cpu", file=sys.stderr)
        return 2
    cmd = submit_command(args)
    print("ray_job: " + shlex.join(cmd), file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
