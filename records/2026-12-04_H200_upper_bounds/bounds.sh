#!/bin/bash
# The upper-bound runs: the trainer at COMMIT and its variants (variants.py), each 30 + 5 steps of
# record 61's shortened schedule on textmix, one after the other, N rounds, then their table.
# From the repository root, with textmix in data/textmix:
#   bash records/2026-12-04_H200_upper_bounds/bounds.sh                      # every variant, 2 rounds
#   N=3 VARIANTS="base ring nodq" bash records/2026-12-04_H200_upper_bounds/bounds.sh
set -euo pipefail
N=${N:-2}
COMMIT=${COMMIT:-934e765}
VARIANTS=${VARIANTS:-"base ring nodq noloss noqkrope nonorm noc"}
root=$PWD
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
out=${OUT:-$work/logs}
python3 "$here/variants.py" "$COMMIT" "$work" $VARIANTS
builds=()
for v in $VARIANTS; do (cd "$work/$v" && make -s train_gpt) & builds+=($!); done
for b in "${builds[@]}"; do wait "$b"; done  # a failed build stops here (set -e)
flags=(--train_files "$root/data/textmix/textmix_train_*.bin" --val_files "$root/data/textmix/textmix_val_*.bin"
       --num_scheduled_iterations 30 --num_extension_iterations 5 --val_tokens 2097152 --cycle_data --val_loss_every 0)
groups=()
for v in $VARIANTS; do mkdir -p "$out/$v"; groups+=("$v=$out/$v"); done
for r in $(seq "$N"); do
    for v in $VARIANTS; do
        (cd "$work/$v" && ./train_gpt "${flags[@]}" --run_id "$v$r" > /dev/null && cp "logs/$v$r.txt" "$out/$v/")
    done
done
python3 "$root/records/summarize.py" --phases 30:3,5 "${groups[@]}"
echo "logs: $out"
