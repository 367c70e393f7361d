#!/usr/bin/env bash
# Runs that repeat and resume, on a GPU (make test-gpu): a short run with checkpoints; --rerun of its
# log (the same validation losses and weights, bit for bit); the rerun stopped by SIGTERM after step
# 10 and resumed from its checkpoint (the uninterrupted run's losses and weights); the NaN stop;
# --diff-logs of real logs. The 21 steps, at small batches (tests/ranks.sh), hold Adam steps and the
# untie (step 15). RANKS=N runs each at world size N, the ranks sharing the GPUs where there are fewer
# than N (TRAIN_GPT_SHARE_GPUS=1).
# Needs a GPU and shards in $TEST_DATA (a folder of *_train_*.bin and *_val_*.bin; make test-gpu
# sets it: FineWeb's first shards where present, else data/textmix); skips without them.
#   [RANKS=2] bash tests/test_resume.sh            last line "N passed, N failed"
set -uo pipefail
cd "$(dirname "$0")/.."
data=${TEST_DATA:-data/textmix}
case "$data" in /*) ;; *) data=$PWD/$data ;; esac
ranks=${RANKS:-1}
if ! nvidia-smi -L >/dev/null 2>&1 || ! compgen -G "$data/*_train_*.bin" >/dev/null || ! compgen -G "$data/*_val_*.bin" >/dev/null; then
    echo "SKIP: test_resume needs a GPU and shards $data/*_{train,val}_*.bin (TEST_DATA; FineWeb's first: python3 data/cached_fineweb10B.py 1)"
    echo "0 passed, 0 failed"
    exit 0
fi
source tests/ranks.sh
echo "world size $ranks$([ -n "${TRAIN_GPT_SHARE_GPUS:-}" ] && echo ", the ranks sharing the GPUs")"
passed=0 failed=0
check() {
    local what=$1
    shift
    if "$@"; then passed=$((passed + 1)); echo "ok $what"; else failed=$((failed + 1)); echo "FAIL $what"; fi
}
vals() { grep -E '^step:[0-9]+/[0-9]+ val_loss' "$1" | sed 's/ train_time.*//'; }
id=test_resume_${ranks}_$$
set -f
flags=(--train_files "$data/*_train_*.bin" --val_files "$data/*_val_*.bin" "${small_batches[@]}"
       --cycle_data --num_scheduled_iterations 21 --num_extension_iterations 0 --val_loss_every 7 --checkpoint_every 14 --save_checkpoint)
set +f
out=$(mktemp -d)
trap 'rm -rf "$out" logs/${id}_* logs/${id}_*.txt' EXIT

trainer "${flags[@]}" --run_id ${id}_a > "$out/a" 2>&1
check "a run with checkpoints every 14 steps" [ $? = 0 ]
check "its checkpoints" [ -f logs/${id}_a/state_step000014.bin -a -f logs/${id}_a/state_step000021.bin ]
check "its GEMM plan in the log" grep -q '^gemm_plan_for = ' logs/${id}_a.txt

trainer --rerun logs/${id}_a.txt --run_id ${id}_b > "$out/b" 2>&1
check "--rerun of its log" [ $? = 0 ]
check "--rerun: the same validation losses" [ "$(vals logs/${id}_a.txt)" = "$(vals logs/${id}_b.txt)" ]
check "--rerun: the same weights" same_weights logs/${id}_a/state_step000021.bin logs/${id}_b/state_step000021.bin
./train_gpt --diff-logs logs/${id}_a.txt logs/${id}_b.txt > "$out/diff" 2>&1
check "--diff-logs of a run and its rerun: exit 0" [ $? = 0 ]

trainer --rerun logs/${id}_a.txt --run_id ${id}_c > "$out/c" 2>&1 &
pid=$!
for _ in $(seq 1 1200); do grep -q '^step:10/21 train' "$out/c" && break; sleep 0.1; done
kill -TERM $(rank_pid $pid)  # one rank: the stop reaches every rank after the step
wait $pid
check "SIGTERM: exit 0" [ $? = 0 ]
ckpt=$(sed -n 's/.*continue with: .\/train_gpt --resume //p' "$out/c")
check "SIGTERM: a checkpoint named ($ckpt)" [ -n "$ckpt" -a -f "$ckpt" ]
trainer --resume "$ckpt" --run_id ${id}_d > "$out/d" 2>&1
check "--resume" [ $? = 0 ]
steps=$(sed -n 's/^resumed from .*: \([0-9]*\) steps done$/\1/p' "$out/d")
after() { vals "$1" | awk -F'[:/ ]' -v s="${steps:-0}" '$2 > s'; }
check "--resume: the uninterrupted run's losses after step ${steps:-?}" \
    [ -n "$(after logs/${id}_a.txt)" -a "$(after logs/${id}_a.txt)" = "$(after logs/${id}_d.txt)" ]
check "--resume: the uninterrupted run's weights" same_weights logs/${id}_a/state_step000021.bin logs/${id}_d/state_step000021.bin

trainer "${flags[@]}" --adam_lr 1e6 --run_id ${id}_e > "$out/e" 2>&1
check "--adam_lr 1e6: stops with an error" [ $? != 0 ]
check "--adam_lr 1e6: names the layer and the step" grep -qE "NaN or infinity in layer [0-9]+.s output.*step [0-9]+" "$out/e"

./train_gpt --resume logs/${id}_a.txt > "$out/f" 2>&1
check "--resume of a file that is not a checkpoint: refused" grep -q "not a train_gpt checkpoint" "$out/f"
head -c 100000 logs/${id}_a/state_step000014.bin > "$out/trunc.bin"
./train_gpt --resume "$out/trunc.bin" > "$out/g" 2>&1
check "--resume of a truncated checkpoint: refused" grep -q "truncated" "$out/g"

# inputs checked through before any GPU work: a checkpoint whose data position asks for more than
# the run's buffers hold (its checksum recomputed, as anyone can) and one with a corrupt byte are
# refused with no log written; --check takes the good ones
ckpt14=logs/${id}_a/state_step000014.bin
./train_gpt --check --resume $ckpt14 > "$out/h" 2>&1
check "--check --resume of a good checkpoint: exit 0" [ $? = 0 ]
./train_gpt --check --rerun logs/${id}_a.txt > "$out/i" 2>&1
check "--check --rerun of a good log: exit 0" [ $? = 0 ]
# rank 0's data position, its batch past what the run's buffers hold
pos=$(python3 tests/checkpoint.py blob $ckpt14 rank0/data | sed '$d'; echo "batch 1048576 2048")
./tests/test_host --rewrite-checkpoint $ckpt14 "$out/pos.bin" rank0/data "$pos"$'\n'
trainer --resume "$out/pos.bin" --run_id ${id}_h > "$out/j" 2>&1
rc=$?
check "--resume of a data position past the buffers: refused before a log" \
    eval '[ $rc = 1 ] && grep -q "is not one this run.s buffers hold" "$out/j" && [ ! -e logs/${id}_h.txt ]'
cp $ckpt14 "$out/flip.bin"
python3 -c "import sys; f = open(sys.argv[1], 'r+b'); f.seek(-12345, 2); b = f.read(1); f.seek(-12345, 2); f.write(bytes([b[0] ^ 1]))" "$out/flip.bin"
trainer --resume "$out/flip.bin" --run_id ${id}_i > "$out/k" 2>&1
rc=$?
check "--resume of a corrupt checkpoint: refused before a log" \
    eval '[ $rc = 1 ] && grep -q "checksum mismatch" "$out/k" && [ ! -e logs/${id}_i.txt ]'

# a full disk, as a file size limit (SIGXFSZ ignored: writes fail with EFBIG; one rank, as NCCL's
# shared memory files would hit the limit too): every checkpoint fails and the run goes on to its
# end, then says so and exits 1; a log that cannot be written stops the run with exit 1
if [ "$ranks" = 1 ]; then
    (ulimit -f 65536; trap '' XFSZ; trainer "${flags[@]}" --run_id ${id}_j) > "$out/l" 2>&1
    rc=$?
    check "checkpoints that fail: the run goes on to its end, then exits 1" \
        eval '[ $rc = 1 ] && grep -q "^checkpoint after step 14 failed: .*there is no earlier one; the run goes on" "$out/l" &&
              grep -q "^step:21/21 val_loss" logs/${id}_j.txt'
    check "checkpoints that fail: no temporary file left" eval '[ -z "$(ls logs/${id}_j/ 2>/dev/null)" ]'
    limit=$(( ($(stat -c %s logs/${id}_a.txt) - 2000) / 1024 ))
    (ulimit -f $limit; trap '' XFSZ; trainer "${flags[@]}" --checkpoint_every 0 --run_id ${id}_k) > "$out/m" 2>&1
    rc=$?
    check "a log that cannot be written: exit 1 and why" eval '[ $rc = 1 ] && grep -q "writing the log failed: File too large" "$out/m"'
fi

[ "$failed" = 0 ] || for f in "$out"/?; do echo "--- $f"; tail -5 "$f"; done
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
