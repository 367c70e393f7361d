#!/usr/bin/env bash
# The trainer at several world sizes on one machine (make test-gpu), on real data at small batches
# (16k / 32k / 49k tokens a step, 22 + 2 steps: Adam steps, the untie at step 15 and the extension):
#   - world sizes 4 and 8 against world size 1: every validation loss within 3x the noise floor
#     (at least 1e-3), the largest difference from world size 1 of the runs that differ from it only
#     in rounding: the lm_head's gradient summed over chunks of 1024 rows instead of one; the GEMMs
#     autotuned (other cuBLASLt algorithms, where the timing picks them); world size 2, whose reduces
#     sum every gradient in another order (the same kind of change as 4 and 8 ranks;
#     tests/test_distributed checks world size 2 parameter by parameter). Early in training
#     the loss amplifies rounding differences several times over, and a change of one gradient's
#     rounding alone understated it: a layout with the skip at 2 -> 7 gave world size 8 off by 0.0109
#     against a floor of 0.0021 from the chunked run alone (the three give 0.0057, from world size 2:
#     limit 0.0171; world size 4 off by 0.0039);
#   - world size 2 with --early_reduce true and false: the same losses and weights, bit for bit.
# Ranks share the GPUs where there are fewer than them (TRAIN_GPT_SHARE_GPUS=1: NCCL over sockets,
# slow; a correctness test). Needs a GPU and shards in $TEST_DATA (as tests/test_resume.sh).
#   bash tests/test_ranks.sh            last line "N passed, N failed"
set -uo pipefail
cd "$(dirname "$0")/.."
data=${TEST_DATA:-data/textmix}
case "$data" in /*) ;; *) data=$PWD/$data ;; esac
if ! nvidia-smi -L >/dev/null 2>&1 || ! compgen -G "$data/*_train_*.bin" >/dev/null || ! compgen -G "$data/*_val_*.bin" >/dev/null; then
    echo "SKIP: test_ranks needs a GPU and shards $data/*_{train,val}_*.bin (TEST_DATA; FineWeb's first: python3 data/cached_fineweb10B.py 1)"
    echo "0 passed, 0 failed"
    exit 0
fi
passed=0 failed=0
check() {
    local what=$1
    shift
    if "$@"; then passed=$((passed + 1)); echo "ok $what"; else failed=$((failed + 1)); echo "FAIL $what"; fi
}
vals() { grep -E '^step:[0-9]+/[0-9]+ val_loss' "$1" | sed 's/ train_time.*//'; }
id=test_ranks_$$
source tests/ranks.sh
set -f
flags=(--train_files "$data/*_train_*.bin" --val_files "$data/*_val_*.bin" --cycle_data "${small_batches[@]}"
       --num_scheduled_iterations 22 --num_extension_iterations 2 --val_loss_every 6 --gemm_autotune false)
set +f
out=$(mktemp -d)
trap 'rm -rf "$out" logs/${id}_* logs/${id}_*.txt' EXIT
at() {  # at WORLD_SIZE NAME FLAGS...: a run, its log logs/${id}_NAME.txt
    local world=$1 name=$2
    shift 2
    (ranks=$world && source tests/ranks.sh && trainer "${flags[@]}" --run_id ${id}_$name "$@") > "$out/$name" 2>&1
    check "world size $world ($name) runs" [ $? = 0 ]
}
weights() { echo logs/${id}_$1/state_step000024.bin; }

if [ "$gpus" -lt 2 ]; then  # without the switch, two ranks on one GPU are refused, saying how to share
    (ranks=2 && source tests/ranks.sh && unset TRAIN_GPT_SHARE_GPUS && trainer "${flags[@]}" --run_id ${id}_refused) > "$out/refused" 2>&1
    check "two ranks on one GPU without TRAIN_GPT_SHARE_GPUS: refused" [ $? != 0 ]
    check "two ranks on one GPU: the message" grep -q "local rank 1 has no GPU: this node has 1 (TRAIN_GPT_SHARE_GPUS=1" "$out/refused"
fi
at 1 one
at 1 one_chunked --logit_chunk_rows 1024
at 1 one_tuned --gemm_autotune true
at 2 two --save_checkpoint  # a checkpoint (seconds at every world size) only where the weights are compared
at 2 two_early --early_reduce true --save_checkpoint
at 4 four
at 8 eight
# each validation's loss in the runs; the floor and the limit from the runs that differ in rounding
python3 - logs/${id}_{one,one_chunked,one_tuned,two,four,eight}.txt > "$out/compare" <<'PY'
import re, sys
def vals(path):
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^step:(\d+)/\d+ val_loss:([0-9.]+)", open(path).read(), re.M)}
one, chunked, tuned, two, four, eight = (vals(p) for p in sys.argv[1:])
runs = {"chunked": chunked, "autotuned": tuned, "world size 2": two, "world size 4": four, "world size 8": eight}
ok = len(one) >= 4 and all(r.keys() == one.keys() for r in runs.values())
off = {name: max(abs(one[s] - r.get(s, float("inf"))) for s in one) for name, r in runs.items()}
floor = max(off["chunked"], off["autotuned"], off["world size 2"])
limit = 3 * max(floor, 1e-3)
for s in sorted(one):
    print(f"  step {s:3d}: world size 1 {one[s]:.4f}, " + ", ".join(f"{n} {r.get(s, float('nan')):.4f}" for n, r in runs.items()))
print("  off by: " + ", ".join(f"{n} {d:.4f}" for n, d in off.items()) + f"; noise floor {floor:.4f}, limit {limit:.4f}")
sys.exit(0 if ok and off["world size 4"] <= limit and off["world size 8"] <= limit else 1)
PY
rc=$?
cat "$out/compare"
check "world sizes 4 and 8 within 3x the noise floor of world size 1" [ $rc = 0 ]

check "--early_reduce: the same validation losses" [ -n "$(vals logs/${id}_two.txt)" -a "$(vals logs/${id}_two.txt)" = "$(vals logs/${id}_two_early.txt)" ]
check "--early_reduce: the same weights" same_weights $(weights two) $(weights two_early)
check "--early_reduce: its plan in the log" grep -q '^backward_reduce_plan\[adam,tied\] = .*attn' logs/${id}_two_early.txt

[ "$failed" = 0 ] || for f in "$out"/*; do echo "--- $f"; tail -5 "$f"; done
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
