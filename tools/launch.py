#!/usr/bin/env python3
"""Starts a whole Tessera job: one scheduler, S servers and W workers.

Command-line compatible with MXNet's tools/launch.py (the dmlc tracker) for the
launchers people use with a parameter server: local, ssh and mpi; and slurm, for
jobs inside a Slurm allocation. Python 3 standard library only.

    # 2 workers and 2 servers on this host; worker flags pass through.
    tools/launch.py -n 2 build/worker/my_trainer --epochs 3

    # 4 workers, 2 servers spread over the hosts of a hostfile, code synced first.
    tools/launch.py -n 4 -s 2 --launcher ssh -H hosts --sync-dst-dir /tmp/job \\
        --interface eth0 ./train.sh

    # Inside a Slurm allocation (salloc, or an sbatch script: tools/slurm/): one
    # srun step per process over the allocation's nodes, the scheduler on the first.
    salloc -N 2 -n 4 tools/launch.py --launcher slurm -n 2 -s 2 build/worker/my_trainer

What every process gets in its environment:
  DMLC_ROLE              scheduler | server | worker
  DMLC_PS_ROOT_URI/PORT  where the scheduler listens
  DMLC_NUM_SERVER/WORKER how many of each the scheduler waits for
  DMLC_TASK_ID           servers 0..S-1, workers S..S+W-1 (as in dmlc-core):
                         the start order, which the scheduler ranks each role
                         in (see Names below)
  DMLC_JOB_CLUSTER       local | ssh | mpi | slurm
  TESSERA_RESTART_COUNT  0 on the first start, k on the k-th restart (--restarts)
  TESSERA_KEY_FILE       this process's role key file (see Security below), or
  TESSERA_KEY_DIR        (mpi) a folder with the keys of the roles on that host
  TESSERA_JOB_ID         launch- and 16 random hex digits, fresh for every job
                         whose keys launch.py makes (kept when set in the
                         launcher's environment or by --env; with the user's
                         TESSERA_KEY_DIR only the user's): bound into every
                         sealed link's key, so no process of another job opens
                         this one's records
  PORT                   with --restarts: a fixed port per server and worker, so a
                         restarted node rejoins under the same identity
  TESSERA_METRICS_PORT   with --metrics-port BASE: BASE + the process's index
                         (scheduler 0, servers 1..S, workers S+1..S+W, that is
                         DMLC_TASK_ID + 1); the list is printed at the start
  forwarded              DMLC_INTERFACE, DMLC_NODE_HOST (local processes only),
                         LD_LIBRARY_PATH, PS_*, TESSERA_*, and --env/--env-server/
                         --env-worker values. Local processes inherit the whole
                         environment of the launcher.

Job semantics: the job succeeds (exit 0) when every worker exits 0 and then the
scheduler and servers exit 0 within --timeout seconds. When any process exits
non-zero or is killed by a signal (and has no --restarts left), every other
process is stopped (SIGTERM, SIGKILL 3 s later), one line names it:

    launch.py: worker 1 (pid 4242) exited with status 3; stopping the job
    launch.py: server 0 on host2 (pid 77) killed by signal SIGKILL; stopping the job

and the launcher exits with that worker's status (1 for anything else). Every
process runs in its own session, so stopping it stops what it started. Usage
errors are one line and exit 2.

Names: a process is named by its rank, the same name the daemons' logs give
it. Each process registers with its DMLC_TASK_ID and the scheduler ranks the
servers and the workers in that order (not by address, as it does for nodes
started without one), so launch.py's [worker 1] is the scheduler's "worker 1
(id 11 at HOST:PORT)" and the worker's own "[worker 1]" log tag; a process
restarted by --restarts takes its rank back. With --max-servers M above -s S
the servers take ranks spread over the M, i x M / S, and are named by them
(server 0, server 2 for -s 2 --max-servers 4). Spares (spare j) and processes
added later (added worker j, added server j) get a rank only when they take
one: the scheduler's line saying so names their pid.

Security (docs/security.md): every job gets fresh CURVE keys, one key pair per
role; each process is given its own role's secret key and the public keys,
never on a command line or in the environment: local processes (and, with mpi,
every rank) read a 0600 file in this launcher's 0700 temporary folder
(TESSERA_KEY_FILE / TESSERA_KEY_DIR name its path); over ssh the key travels on
the ssh channel's stdin into a 0600 file in a fresh 0700 folder on the remote
host, removed when the process ends; mpi ranks on other hosts read a 0700 folder
of random name that the launcher creates there over ssh first and removes at the
end. With slurm the key travels like over ssh, on the stdin of the process's
srun step (srun relays it to the task), into a 0600 file in a fresh 0700 folder
on its node, removed when the process ends. TESSERA_KEY_DIR set by the user:
those keys are used as they are (the folder must hold <role>.key on every host).
TESSERA_INSECURE=1: no keys at all.

Slurm (--launcher slurm): run launch.py inside an allocation (salloc, or an
sbatch script; SLURM_JOB_ID and SLURM_JOB_NODELIST must be set). The hosts are
the allocation's nodes (`scontrol show hostnames $SLURM_JOB_NODELIST`), each
with as many slots as SLURM_TASKS_PER_NODE gives it; servers then workers fill
them like the ssh launcher's hostfile. The scheduler runs on the first node and
listens on its NodeAddr (`scontrol show node`), unless DMLC_PS_ROOT_URI says
otherwise. Every process is its own one-task step, `srun --nodes=1 --ntasks=1
--nodelist=NODE --overlap`, in the launcher's working folder (the nodes share
the file system, as on a Slurm cluster), so each has its exit status, its
[role i] prefix, and --restarts; srun exports the launcher's environment plus
the variables above. -H and --sync-dst-dir do not apply.
"""

import os
import sys

# The folder that holds the tessera_launch package, relative to this script's:
# the same folder in the source tree; an install rewrites this line
# (tools/CMakeLists.txt) to where it put the package.
PACKAGE_PARENT = '.'

sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(os.path.realpath(__file__)),
                                                 PACKAGE_PARENT)))
try:
    from tessera_launch import cli  # noqa: E402
except ImportError as e:
    sys.stderr.write('launch.py: error: cannot load its package tessera_launch from %s (%s): '
                     'keep launch.py beside its tessera_launch folder, or install both\n'
                     % (sys.path[0], e))
    sys.exit(2)

if __name__ == '__main__':
    sys.exit(cli.main(script=os.path.abspath(__file__)))
