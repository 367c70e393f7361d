# Sourced by the GPU shell tests: the trainer at world size $ranks (default 1), and the weights of
# checkpoints compared.
#   trainer FLAGS...        ./train_gpt at world size $ranks: under mpirun for 2+ ranks, the ranks
#                           sharing the GPUs (TRAIN_GPT_SHARE_GPUS=1) where there are fewer than them
#   rank_pid PID            a process of the run started as PID that is a rank (./train_gpt)
#   same_weights A.bin B.bin   every parameter of two checkpoints the same, bit for bit
#   gpus                    how many GPUs this machine has
#   small_batches           flags of the short test runs: 16k / 32k / 49k tokens a step, 262k of
#                           validation (ranks sharing a GPU are many times slower); the record's paths
ranks=${ranks:-1}
small_batches=(--train_bs_schedule 16384,32768,49152 --train_bs_extension 49152 --val_batch_size 131072 --val_tokens 262144)
gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU ' || true)
if [ "$ranks" -gt 1 ] && [ "${gpus:-0}" -lt "$ranks" ]; then export TRAIN_GPT_SHARE_GPUS=1; fi
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
trainer() {
    if [ "$ranks" = 1 ]; then
        ./train_gpt "$@"
    else
        local x=()
        [ -n "${TRAIN_GPT_SHARE_GPUS:-}" ] && x=(-x TRAIN_GPT_SHARE_GPUS --oversubscribe)
        mpirun --quiet -np "$ranks" --bind-to none "${x[@]}" ./train_gpt "$@"
    fi
}
rank_pid() {
    local p="" m
    for _ in $(seq 1 100); do
        if [ "$(ps -o comm= -p "$1" 2>/dev/null)" = train_gpt ]; then echo "$1"; return; fi
        p=$(pgrep -P "$1" -x train_gpt | head -1)
        for m in $(pgrep -P "$1" -x mpirun); do [ -n "$p" ] || p=$(pgrep -P "$m" -x train_gpt | head -1); done
        if [ -n "$p" ]; then echo "$p"; return; fi
        sleep 0.1
    done
    echo "$1"
}
same_weights() { python3 tests/checkpoint.py same-weights "$1" "$2"; }
