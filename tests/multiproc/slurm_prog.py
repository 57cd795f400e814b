"""Started by srun in tests/test_slurm.py: join the job (and, with 'watch', install the
preemption handler, which checks the job's Slurm settings); print the rank and size."""

import sys

import hvdkit

hvdkit.init()
if sys.argv[1:] == ["watch"]:
    from hvdkit import preemption

    preemption.watch()
print(f"rank {hvdkit.rank()} of {hvdkit.size()}", flush=True)
