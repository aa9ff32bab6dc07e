"""Launchers: bring up a Ray cluster on the nodes a scheduler gave us and run ``rlmega train`` on it.

- :mod:`rlmega.launch.ray_cluster`  one Ray node (``ray start --block``), node IPs, waiting for nodes;
  also the per-node command the SLURM scripts run with ``srun``.
- :mod:`rlmega.launch.torchrun`     a bootstrap run by ``torchrun`` on every node.
- :mod:`rlmega.launch.checked_torchrun`  torchrun with its rendezvous endpoint checked first and its failures in one line.
- :mod:`rlmega.launch.ports`        a port that must be free, and whether a Ray head answers at an address.
- :mod:`rlmega.launch.ray_job`      ``ray job submit`` to a running cluster with a working runtime env.
- :mod:`rlmega.launch.guardian`     stops a driver's private Ray session when the driver dies, even by SIGKILL.

Users' entry points (sbatch scripts, shell helpers) and the documentation live in ``launch/``.
"""
