#!/usr/bin/env bash
# Launch a run: one process per GPU. NGPU=8 by default; extra arguments go to the trainer.
#   ./run.sh                                    record 61 on 8 GPUs, data in ./data/fineweb10B
#   NGPU=1 DATA_PATH=/data ./run.sh --val_tokens 2097152
set -euo pipefail
cd "$(dirname "$0")"
NGPU="${NGPU:-8}"
[ -x ./train_gpt ] || make
# every NCCL_* setting of this shell (e.g. NCCL_DEBUG=INFO) reaches every rank
nccl_env=()
for v in $(compgen -e | grep '^NCCL_' || true); do nccl_env+=(-x "$v"); done
exec mpirun -np "$NGPU" --bind-to none -x DATA_PATH -x PATH -x LD_LIBRARY_PATH "${nccl_env[@]}" ./train_gpt "$@"
