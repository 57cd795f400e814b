#!/bin/bash
# run data parallel training on CPU (port of the MindSpore tutorial's run.sh)

echo "=============================================================================="
echo "Please run the script with dataset path, such as: "
echo "bash run.sh DATA_PATH"
echo "For example: bash run.sh /path/dataset"
echo "It is better to use the absolute path."
echo "=============================================================================="
set -e
DATA_PATH=$1
export DATA_PATH=${DATA_PATH}
HERE=$(dirname "$0")  # hvdkit: train.py beside this script; logs go to the current directory

export MS_WORKER_NUM=${MS_WORKER_NUM:-8}  # hvdkit: 8 as in the tutorial, unless set
export MS_SCHED_HOST=127.0.0.1
export MS_SCHED_PORT=${MS_SCHED_PORT:-8117}  # hvdkit: 8117 as in the tutorial, unless set

# Launch 1 scheduler.
export MS_ROLE=MS_SCHED
python3 "$HERE/train.py" >scheduler.txt 2>&1 &  # hvdkit: "$HERE/"
sched_pid=$!  # hvdkit: remembered, to return the job's status
echo "scheduler start success!"

# Launch 8 workers.
export MS_ROLE=MS_WORKER
for((i=0;i<${MS_WORKER_NUM};i++));
do
    python3 "$HERE/train.py" >worker_$i.txt 2>&1 &  # hvdkit: "$HERE/"
    echo "worker ${i} start success with pid ${!}"
done

# hvdkit: wait for the job; the scheduler exits with the job's status
set +e
wait "$sched_pid"
status=$?
wait
exit $status
