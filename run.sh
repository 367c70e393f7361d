#!/usr/bin/env bash
# Launch a run: one process per GPU. NGPU=8 by default; extra arguments go to the trainer.
#   ./run.sh                                    record 61 on 8 GPUs, data in ./data/fineweb10B
#   NGPU=1 DATA_PATH=/data ./run.sh --val_tokens 2097152
set -euo pipefail
cd "$(dirname "$0")"
NGPU="${NGPU:-8}"
[ -x ./train_gpt ] || make
exec mpirun -np "$NGPU" --bind-to none -x DATA_PATH -x NCCL_DEBUG -x PATH -x LD_LIBRARY_PATH ./train_gpt "$@"
