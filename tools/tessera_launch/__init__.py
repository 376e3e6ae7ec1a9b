"""tools/launch.py as a package: starts a whole Tessera job (one scheduler, S
servers, W workers) and supervises it. tools/launch.py (installed as
bin/tessera-launch) is the entry point users run; its docstring is the manual.

One module a concern:
  options     the command line, UsageError and SetupError
  hosts       hostfiles, placement over hosts, addresses and ports
  binaries    finding tessera-scheduler and tessera-server
  keys        the job's keys (also for tests and benchmarks that start daemons)
  config      JobConfig and the environment of every process
  remote      the wrapper a process runs under on another host
  supervisor  starting, relaying, restarting and stopping processes (Job)
  local, ssh, mpi, slurm   one launcher each: the job's processes as Nodes
  cli         main(): all of the above in order

    import sys
    sys.path.insert(0, 'tools')
    from tessera_launch import keys
    keys.write_job_keys('/tmp/job-keys')   # scheduler.key, server.key, worker.key

Python 3 standard library only.
"""
