"""A rank that leaves a made-up weight fingerprint, without TensorFlow: the launchers' end-of-job
comparison (``hvdkitrun --check-weights``, ``HVDKIT_CHECK_WEIGHTS=1`` under the scheduler).

``python weights_prog.py apart``: rank r's ``dense/kernel`` sums to 1 + r (every rank its own);
``equal``: every rank the same. The rank writing through TensorFlow is checked in
user_scripts_worker.py (``fingerprints_name_the_ranks_that_ended_apart``).
"""

import os
import sys

from hvdkit import config
from hvdkit._comm import fingerprints

rank = int(os.environ.get("HOROVOD_RANK") or os.environ["OMPI_COMM_WORLD_RANK"])
total = 1.0 + (rank if sys.argv[1] == "apart" else 0)
rows = [("dense/kernel", total, 2 * total, 3.0), ("dense/bias", 0.5, 0.5, 0.5)]
fingerprints.write(os.environ[config.WEIGHTS_DIR], rank, rows)
print(f"rank {rank} wrote its fingerprint", flush=True)
