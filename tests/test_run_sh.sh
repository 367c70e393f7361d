#!/usr/bin/env bash
# Tests of run.sh that need no GPU: a fake nvidia-smi and a fake mpirun first in PATH stand in for
# the machine, and the fake mpirun records what run.sh would have launched.
#   bash tests/test_run_sh.sh          (from the repository root; make test runs it)
# One rebuild of ./train_gpt (after touching train_gpt.cu) checks that run.sh builds what is stale.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

passed=0 failed=0
ok() { echo "ok $1"; passed=$((passed + 1)); }
fail() { echo "FAIL $1"; sed 's/^/    | /' "$tmp/out"; failed=$((failed + 1)); }
check() { # check NAME COMMAND...: ok when COMMAND succeeds (the last run's output shown otherwise)
    local name=$1
    shift
    if "$@"; then ok "$name"; else fail "$name"; fi
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin" "$tmp/mpi_only" "$tmp/empty" "$tmp/data/data/fineweb10B" "$tmp/abs"
: >"$tmp/out"

# mpirun: its arguments one per line, and whether mpirun would run as root
cat >"$tmp/bin/mpirun" <<'EOF'
#!/usr/bin/env bash
printf '%s\n' "$@" >"$FAKE_DIR/mpirun.args"
echo "${OMPI_ALLOW_RUN_AS_ROOT:-unset} ${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-unset}" >"$FAKE_DIR/mpirun.env"
EOF
cp "$tmp/bin/mpirun" "$tmp/mpi_only/mpirun"
# nvidia-smi -L: FAKE_GPUS lines as the driver prints them; "fail": as without a driver
cat >"$tmp/bin/nvidia-smi" <<'EOF'
#!/usr/bin/env bash
if [ "$FAKE_GPUS" = fail ]; then
    echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver." >&2
    exit 9
fi
for ((i = 0; i < FAKE_GPUS; i++)); do echo "GPU $i: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-00000000000$i)"; done
EOF
chmod +x "$tmp/bin/mpirun" "$tmp/mpi_only/mpirun" "$tmp/bin/nvidia-smi"
# data: empty files that match the default globs under DATA_PATH, and elsewhere by absolute path
touch "$tmp/data/data/fineweb10B/fineweb_train_000001.bin" "$tmp/data/data/fineweb10B/fineweb_val_000000.bin"
touch "$tmp/abs/train_000001.bin" "$tmp/abs/val_000000.bin"

# run [VAR=value ...] ./run.sh ARGS: with the fakes, none of NGPU/DATA_PATH/LD_LIBRARY_PATH/NCCL_*
# from this shell; output in $tmp/out, exit status in $rc
real_path=$PATH
unset_nccl=()
for v in $(compgen -e | grep '^NCCL_' || true); do unset_nccl+=(-u "$v"); done
run() {
    rm -f "$tmp/mpirun.args" "$tmp/mpirun.env"
    env -u NGPU -u DATA_PATH -u LD_LIBRARY_PATH -u SHARE_GPUS -u TRAIN_GPT_SHARE_GPUS "${unset_nccl[@]}" PATH="$tmp/bin:$real_path" FAKE_DIR="$tmp" \
        FAKE_GPUS=0 "$@" >"$tmp/out" 2>&1
    rc=$?
}
has() { grep -qF -- "$1" "$tmp/out"; }
out_is() { [ "$(cat "$tmp/out")" = "$1" ]; }
not() { ! "$@"; }
launched() { [ -f "$tmp/mpirun.args" ]; }
not_launched() { [ ! -f "$tmp/mpirun.args" ]; }
# the mpirun arguments, one per line, contain these consecutive lines
args_have() { python3 - "$tmp/mpirun.args" "$@" <<'EOF'
import sys
lines = open(sys.argv[1]).read().split("\n")[:-1]
want = sys.argv[2:]
sys.exit(0 if any(lines[i:i + len(want)] == want for i in range(len(lines))) else 1)
EOF
}
# everything after ./train_gpt is exactly these arguments
trainer_args_are() { python3 - "$tmp/mpirun.args" "$@" <<'EOF'
import sys
lines = open(sys.argv[1]).read().split("\n")[:-1]
sys.exit(0 if "./train_gpt" in lines and lines[lines.index("./train_gpt") + 1:] == sys.argv[2:] else 1)
EOF
}

# --- the build: a stale trainer is rebuilt (once), an up-to-date one prints nothing; a run that
# cannot start (no GPU, no data, an unknown flag) says so before it builds
before=$(stat -c %Y train_gpt 2>/dev/null || echo 0)
sleep 1 # a new mtime is a different second
touch train_gpt.cu
run FAKE_GPUS=0 DATA_PATH="$tmp/data" ./run.sh
check "stale trainer, no GPU: the one line, no build" out_is "run.sh: no NVIDIA GPU or driver found (nvidia-smi -L lists none); the trainer needs a Hopper GPU"
run NGPU=1 DATA_PATH="$tmp/empty" ./run.sh
check "stale trainer, no data: no build" not has "building"
run NGPU=1 DATA_PATH="$tmp/data" ./run.sh --val_tokens 2097152 --no_such_flag=3
check "unknown flag: exit 1" [ "$rc" = 1 ]
check "unknown flag: the one line, no build" out_is "run.sh: unknown flag --no_such_flag (./run.sh --help lists the flags)"
check "unknown flag: no mpirun" not_launched
check "still stale after them" not make -q train_gpt
rm -f "$tmp/mpirun.args"
env PATH="$tmp/bin:$real_path" FAKE_DIR="$tmp" ./run.sh --print-source >"$tmp/src" 2>"$tmp/out"
rc=$?
check "stale trainer rebuilt by ./run.sh --print-source (exit 0)" [ "$rc" = 0 ]
check "after it, make -q train_gpt: up to date" make -q train_gpt
check "the binary is new" [ "$(stat -c %Y train_gpt 2>/dev/null || echo 0)" != "$before" ]
check "a rebuild says so (on stderr)" has "run.sh: building ./train_gpt"
# --print-source's stdout is the sources only: the build's messages go to stderr
check "--print-source: the sources on stdout" [ -s "$tmp/src" ]
check "--print-source: nothing of the build on stdout" not grep -q '^run.sh:' "$tmp/src"
check "--print-source starts no mpirun" not_launched

# --- --check: the trainer's, no GPU and no mpirun; NGPU is the world size it checks
run NGPU=2 ./run.sh --check --train_files "$tmp/abs/train_*.bin" --val_files "$tmp/abs/val_*.bin"
check "--check runs the trainer's check (refusing empty shards, exit 1)" \
    eval '[ "$rc" = 1 ] && has "shorter than its 1024-byte header"'
check "--check starts no mpirun" not_launched
run NGPU=3 ./run.sh --check
check "--check with NGPU=3: refused" eval '[ "$rc" = 1 ] && has "TRAIN_GPT_WORLD_SIZE must be 1, 2, 4 or 8"'

# --- --help: run.sh's usage once, then the trainer's flags; no mpirun
run ./run.sh --help
check "--help exits 0" [ "$rc" = 0 ]
check "--help prints run.sh's usage once" [ "$(grep -c '^usage: \[NGPU=N\]' "$tmp/out")" = 1 ]
check "--help: the first line is the usage (nothing from make when up to date)" \
    [ "$(head -1 "$tmp/out" | cut -c1-13)" = "usage: [NGPU=" ]
check "--help lists the trainer's flags" has "--train_files"
check "--help: the trainer's help once" [ "$(grep -c -- '--val_tokens  ' "$tmp/out")" = 1 ]
check "--help starts no mpirun" not_launched
run ./run.sh -h
check "-h prints the usage" [ "$rc" = 0 ]
check "-h prints the usage once" [ "$(grep -c '^usage: \[NGPU=N\]' "$tmp/out")" = 1 ]

# --- NGPU and the GPUs
run NGPU=3 DATA_PATH="$tmp/data" ./run.sh
check "NGPU=3: exit 1" [ "$rc" = 1 ]
check "NGPU=3: says 1, 2, 4 or 8" has "NGPU=3: the trainer runs on 1, 2, 4 or 8 GPUs"
check "NGPU=3: no mpirun" not_launched
run NGPU=x DATA_PATH="$tmp/data" ./run.sh
check "NGPU=x: exit 1" [ "$rc" = 1 ]
no_gpu="run.sh: no NVIDIA GPU or driver found (nvidia-smi -L lists none); the trainer needs a Hopper GPU"
run FAKE_GPUS=0 DATA_PATH="$tmp/data" ./run.sh
check "no GPU listed: exit 1" [ "$rc" = 1 ]
check "no GPU listed: the one line" out_is "$no_gpu"
check "no GPU listed: no mpirun" not_launched
run FAKE_GPUS=fail DATA_PATH="$tmp/data" ./run.sh
check "nvidia-smi fails: exit 1" [ "$rc" = 1 ]
check "nvidia-smi fails: the one line" out_is "$no_gpu"
if ! command -v nvidia-smi >/dev/null; then
    rm -f "$tmp/mpirun.args"
    env -u NGPU PATH="$tmp/mpi_only:$real_path" FAKE_DIR="$tmp" DATA_PATH="$tmp/data" ./run.sh >"$tmp/out" 2>&1
    rc=$?
    check "no nvidia-smi at all: exit 1" [ "$rc" = 1 ]
    check "no nvidia-smi at all: the one line" out_is "$no_gpu"
else
    echo "skip no nvidia-smi at all (this machine has one)"
fi
for pair in 1:1 2:2 3:2 7:4 8:8 16:8; do
    found=${pair%:*} want=${pair#*:}
    run FAKE_GPUS="$found" DATA_PATH="$tmp/data" ./run.sh
    gpus="$found GPU"
    [ "$found" = 1 ] || gpus+="s"
    check "nvidia-smi lists $found: NGPU=$want, said on one line" out_is "run.sh: $gpus found, NGPU=$want"
    check "nvidia-smi lists $found: mpirun -np $want" args_have -np "$want"
done
run NGPU=4 FAKE_GPUS=0 DATA_PATH="$tmp/data" ./run.sh
check "NGPU=4 set: no detection, mpirun -np 4" args_have -np 4
check "NGPU=4 set: nothing printed" [ ! -s "$tmp/out" ]

# --- SHARE_GPUS=1: the ranks share the GPUs (a test mode)
run SHARE_GPUS=1 NGPU=8 FAKE_GPUS=1 DATA_PATH="$tmp/data" ./run.sh
check "SHARE_GPUS=1 NGPU=8 on 1 GPU: mpirun -np 8" args_have -np 8
check "SHARE_GPUS=1: the trainer told" args_have -x TRAIN_GPT_SHARE_GPUS
check "SHARE_GPUS=1: --oversubscribe" grep -qx -- --oversubscribe "$tmp/mpirun.args"
check "SHARE_GPUS=1: says it is a test mode" has "a test of the multi-rank paths"
run SHARE_GPUS=1 FAKE_GPUS=1 DATA_PATH="$tmp/data" ./run.sh
check "SHARE_GPUS=1 without NGPU: exit 1" [ "$rc" = 1 ]
check "SHARE_GPUS=1 without NGPU: says so" has "SHARE_GPUS=1 needs NGPU=2, 4 or 8"
check "SHARE_GPUS=1 without NGPU: no mpirun" not_launched
run SHARE_GPUS=1 NGPU=2 FAKE_GPUS=0 DATA_PATH="$tmp/data" ./run.sh
check "SHARE_GPUS=1 without a GPU: the one line" out_is "$no_gpu"
run SHARE_GPUS=yes NGPU=2 FAKE_GPUS=1 DATA_PATH="$tmp/data" ./run.sh
check "SHARE_GPUS=yes: exit 1" [ "$rc" = 1 ]
run NGPU=2 FAKE_GPUS=1 DATA_PATH="$tmp/data" ./run.sh
check "without SHARE_GPUS: the trainer not told" not grep -qx TRAIN_GPT_SHARE_GPUS "$tmp/mpirun.args"
check "without SHARE_GPUS: no --oversubscribe" not grep -qx -- --oversubscribe "$tmp/mpirun.args"

# --- the data
run NGPU=1 DATA_PATH="$tmp/empty" ./run.sh
check "no data: exit non-zero" [ "$rc" != 0 ]
check "no data: the download command" has "python3 data/cached_fineweb10B.py"
check "no data: names the pattern" has "no train files match $tmp/empty/data/fineweb10B/fineweb_train_*.bin"
check "no data: no mpirun" not_launched
run FAKE_GPUS=1 DATA_PATH="$tmp/empty" ./run.sh --val_tokens 2097152
check "no data (1 GPU found): no mpirun" not_launched
run NGPU=1 DATA_PATH="$tmp/data" ./run.sh --train_files 'nothing/*.bin'
check "--train_files matching nothing: exit 1" [ "$rc" = 1 ]
check "--train_files matching nothing: says to check it" has "check --train_files"
check "--train_files matching nothing: no download command" not has "cached_fineweb10B"
check "--train_files matching nothing: no mpirun" not_launched
run NGPU=1 DATA_PATH="$tmp/data" ./run.sh --val_files="$tmp/abs/nothing_*.bin"
check "--val_files=X matching nothing: names it" has "no val files match $tmp/abs/nothing_*.bin"
check "--val_files=X matching nothing: no mpirun" not_launched
run NGPU=1 ./run.sh --train_files "$tmp/abs/train_*.bin"
check "default val files absent from .: named" has "no val files match ./data/fineweb10B/fineweb_val_*.bin"

# --- the launch
run FAKE_GPUS=2 DATA_PATH="$tmp/data" ./run.sh --val_tokens 2097152 --run_id "a b" --seed=3
check "data present: exit 0" [ "$rc" = 0 ]
check "data present: mpirun started" launched
check "mpirun --quiet -np 2 --bind-to none" args_have --quiet -np 2 --bind-to none
check "-x DATA_PATH when set" args_have -x DATA_PATH
check "-x PATH" args_have -x PATH
check "no -x LD_LIBRARY_PATH when unset" not grep -qx LD_LIBRARY_PATH "$tmp/mpirun.args"
check "the trainer's flags unchanged" trainer_args_are --val_tokens 2097152 --run_id "a b" --seed=3
if [ "$(id -u)" = 0 ]; then
    check "as root: OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1" [ "$(cat "$tmp/mpirun.env")" = "1 1" ]
fi
run NGPU=1 ./run.sh --train_files="$tmp/abs/train_*.bin" --val_files "$tmp/abs/val_*.bin"
check "absolute data paths, DATA_PATH unset: launched" launched
check "DATA_PATH unset: no -x DATA_PATH" not grep -qx DATA_PATH "$tmp/mpirun.args"
check "absolute data paths: flags unchanged" trainer_args_are --train_files="$tmp/abs/train_*.bin" --val_files "$tmp/abs/val_*.bin"
run NGPU=1 DATA_PATH="$tmp/data" LD_LIBRARY_PATH=/nowhere NCCL_DEBUG=INFO ./run.sh
check "-x LD_LIBRARY_PATH when set" args_have -x LD_LIBRARY_PATH
check "-x NCCL_DEBUG when set" args_have -x NCCL_DEBUG
run NGPU=1 DATA_PATH="$tmp/data/" ./run.sh --train_files 'data/fineweb10B/*train*.bin'
check "relative --train_files joined to DATA_PATH/" launched

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
