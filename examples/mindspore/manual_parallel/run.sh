#!/bin/bash
# Port of the manual-parallelism tutorial's run.sh: 8 processes under mpirun.
# DATA_PATH: the directory of the MNIST training files.
set -e
HERE=$(dirname "$0")  # hvdkit: train.py beside this script
echo "start training"
# hvdkit: RANK_SIZE processes (the tutorial: 8)
mpirun -n "${RANK_SIZE:-8}" --output-filename log_output --merge-stderr-to-stdout \
    python "$HERE/train.py"
