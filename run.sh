#!/usr/bin/env bash
# Launch a run: check the GPUs, the data and the flags, build if a source changed, then one process per GPU.
#   ./run.sh                                    record 61 on every GPU (1, 2, 4 or 8), data in ./data/fineweb10B
#   NGPU=1 ./run.sh --val_tokens 2097152
#   ./run.sh --help                             this launcher's usage, then the trainer's flags
set -euo pipefail
cd "$(dirname "$0")"

usage() {
    cat <<'EOF'
usage: [NGPU=N] [DATA_PATH=DIR] ./run.sh [--flag value ...]
       [NGPU=N] ./run.sh --rerun LOG [--flag value ...]      a logged run again, bit for bit
       [NGPU=N] ./run.sh --resume CHECKPOINT [--flag ...]    continue a stopped run
       [NGPU=N] ./run.sh --check [--flag ... | --rerun LOG | --resume CHECKPOINT]   every input checked,
                                                   the configuration printed; no GPU (NGPU: the world size)
       ./run.sh --help | --print-source | --diff-logs A.txt B.txt   (the trainer's, no mpirun)

Checks the GPUs, that the train and validation files exist and the flags' names, then builds
./train_gpt where a source is newer (make -s train_gpt) and runs mpirun -np NGPU ./train_gpt with
every argument passed on.

  NGPU       processes, one GPU each: 1, 2, 4 or 8 (8/NGPU gradient accumulation steps, the same
             batch at any count). Default: the most of 1, 2, 4, 8 that nvidia-smi -L lists.
  DATA_PATH  folder that relative --train_files/--val_files are joined to (default .).
  NCCL_*     settings of this shell (e.g. NCCL_DEBUG=INFO) reach every rank.
  SHARE_GPUS=1  a test mode: NGPU ranks (2, 4 or 8, given) on however many GPUs there are, rank
             r on GPU r % count, NCCL over sockets on loopback (TRAIN_GPT_SHARE_GPUS=1 for the
             trainer and the tests). It checks every multi-rank path on one GPU; it is slow and
             its times mean nothing.

examples:
  python3 data/cached_fineweb10B.py 8     # FineWeb shards into data/fineweb10B
  ./run.sh                                # record 61 on all GPUs
  NGPU=1 ./run.sh --val_tokens 2097152
  SHARE_GPUS=1 NGPU=8 ./run.sh --train_bs_schedule 16384,32768,49152 --val_batch_size 131072
  DATA_PATH=/mnt/data ./run.sh --train_files 'textmix/textmix_train_*.bin' --val_files 'textmix/textmix_val_*.bin'

The trainer's flags (./train_gpt --help):
EOF
}

# make decides whether a source is newer; its output goes to stderr so --print-source stays clean
# (a make that runs run.sh, as make test does, hands down no jobserver: MAKEFLAGS is its own)
build() {
    if ! env -u MAKEFLAGS -u MFLAGS make -q --no-print-directory train_gpt 2>/dev/null; then
        echo "run.sh: building ./train_gpt (make -s train_gpt)" >&2
    fi
    env -u MAKEFLAGS -u MFLAGS make -s --no-print-directory train_gpt >&2 || exit $?
}

# the trainer's own modes need no GPU, no data and no mpirun
case "${1:-}" in
    --help | -h)
        build
        usage
        exec ./train_gpt --help
        ;;
    --print-source | --diff-logs)
        build
        exec ./train_gpt "$@"
        ;;
    --check)  # the world size of the run it checks: NGPU where given (else the log's, or 8)
        build
        if [ -n "${NGPU:-}" ]; then export TRAIN_GPT_WORLD_SIZE=$NGPU; fi
        exec ./train_gpt "$@"
        ;;
esac
# A run: the GPUs, the data and the flags' names are checked before the build (a minute); the
# trainer checks the values, a --rerun log and a --resume checkpoint before it touches a GPU.

share=${SHARE_GPUS:-0}
case "$share" in
    0 | 1) ;;
    *)
        echo "run.sh: SHARE_GPUS=$share: 1 (ranks share the GPUs, a test mode) or 0" >&2
        exit 1
        ;;
esac
if [ "$share" = 1 ]; then
    case "${NGPU:-}" in
        2 | 4 | 8) ;;
        *)
            echo "run.sh: SHARE_GPUS=1 needs NGPU=2, 4 or 8 (the ranks that share the GPUs)" >&2
            exit 1
            ;;
    esac
    if ! (nvidia-smi -L 2>/dev/null || true) | grep -q '^GPU '; then
        echo "run.sh: no NVIDIA GPU or driver found (nvidia-smi -L lists none); the trainer needs a Hopper GPU" >&2
        exit 1
    fi
    echo "run.sh: SHARE_GPUS=1: $NGPU ranks share the GPUs over NCCL's sockets (a test of the multi-rank paths, slow)" >&2
elif [ -n "${NGPU:-}" ]; then
    case "$NGPU" in
        1 | 2 | 4 | 8) ;;
        *)
            echo "run.sh: NGPU=$NGPU: the trainer runs on 1, 2, 4 or 8 GPUs" >&2
            exit 1
            ;;
    esac
else
    count=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU ' || true)
    if [ "${count:-0}" -eq 0 ]; then
        echo "run.sh: no NVIDIA GPU or driver found (nvidia-smi -L lists none); the trainer needs a Hopper GPU" >&2
        exit 1
    fi
    NGPU=1
    for n in 2 4 8; do if [ "$n" -le "$count" ]; then NGPU=$n; fi; done
    echo "run.sh: $count GPU$([ "$count" -eq 1 ] || echo s) found, NGPU=$NGPU" >&2
fi

# The data the trainer would look for (its defaults and its joining to DATA_PATH); the last
# --train_files/--val_files wins, as in the trainer.
train_files="data/fineweb10B/fineweb_train_*.bin"
val_files="data/fineweb10B/fineweb_val_*.bin"
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
        --train_files=*) train_files="${args[i]#*=}" ;;
        --val_files=*) val_files="${args[i]#*=}" ;;
        --train_files) if [ $((i + 1)) -lt ${#args[@]} ]; then train_files="${args[i + 1]}"; fi ;;
        --val_files) if [ $((i + 1)) -lt ${#args[@]} ]; then val_files="${args[i + 1]}"; fi ;;
    esac
done
data_path="${DATA_PATH-.}"
join() {
    if [ -z "$data_path" ] || [ "${1:0:1}" = / ]; then echo "$1"; else echo "${data_path%/}/$1"; fi
}
missing=0 download=0 check=()
# --rerun LOG / --resume CHECKPOINT take their data from the log or checkpoint: the trainer checks it
case "${1:-}" in --rerun | --resume) kinds="" ;; *) kinds="train val" ;; esac
for kind in $kinds; do
    if [ "$kind" = train ]; then flag=--train_files pattern=$train_files; else flag=--val_files pattern=$val_files; fi
    if compgen -G "$(join "$pattern")" >/dev/null; then continue; fi
    missing=1
    echo "run.sh: no $kind files match $(join "$pattern")" >&2
    if [ "$pattern" = "data/fineweb10B/fineweb_${kind}_*.bin" ]; then download=1; else check+=("$flag"); fi
done
if [ "$download" = 1 ]; then
    echo "run.sh: download FineWeb (into ./data/fineweb10B): python3 data/cached_fineweb10B.py 8" >&2
    if [ "$data_path" != . ] && [ -n "$data_path" ]; then
        echo "run.sh: with DATA_PATH=$data_path the trainer looks in $(join data/fineweb10B)" >&2
    fi
fi
if [ ${#check[@]} -gt 0 ]; then
    echo "run.sh: check ${check[*]} and DATA_PATH (a relative pattern is joined to DATA_PATH)" >&2
fi
[ "$missing" = 0 ] || exit 1

# the flags' names, from the lists in train_gpt.cu that make them
known=$(sed -n 's/^ *X([A-Z0-9_]*, *\([a-z0-9_]*\),.*/\1/p' train_gpt.cu)
first=0
case "${1:-}" in --rerun | --resume) first=2 ;; esac
for ((i = first; i < ${#args[@]}; i++)); do
    a=${args[i]}
    case "$a" in
        --*) name=${a#--} name=${name%%=*} ;;
        *) continue ;;  # a value
    esac
    if ! grep -qx -- "$name" <<<"$known"; then
        echo "run.sh: unknown flag --$name (./run.sh --help lists the flags)" >&2
        exit 1
    fi
done

build

# mpirun refuses root without these (containers run as root)
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
# -x of an unset variable makes mpirun warn: pass only those that are set
env_args=(-x PATH)
for v in DATA_PATH LD_LIBRARY_PATH; do if [ -n "${!v+x}" ]; then env_args+=(-x "$v"); fi; done
# every NCCL_* setting of this shell (e.g. NCCL_DEBUG=INFO) reaches every rank
for v in $(compgen -e | grep '^NCCL_' || true); do env_args+=(-x "$v"); done
mpi_args=(--quiet -np "$NGPU" --bind-to none)
if [ "$share" = 1 ]; then
    export TRAIN_GPT_SHARE_GPUS=1
    env_args+=(-x TRAIN_GPT_SHARE_GPUS)
    mpi_args+=(--oversubscribe)  # more ranks than the machine may have cores
fi
# --quiet: no banners after a rank's own error message (the trainer says what went wrong)
exec mpirun "${mpi_args[@]}" "${env_args[@]}" ./train_gpt "$@"
