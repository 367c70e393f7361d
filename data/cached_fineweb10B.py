#!/usr/bin/env python3
"""Download the GPT-2-tokenized FineWeb-10B shards that the speedrun trains on.

    python3 data/cached_fineweb10B.py        # validation shard + 8 train shards (800M tokens)
    python3 data/cached_fineweb10B.py 103    # all of FineWeb-10B

Each shard holds 100M tokens (256 int32 header words, then uint16 tokens); they land in
data/fineweb10B/, where ./run.sh looks by default. Shards already present are kept.
Plain Python 3, no packages needed.
"""
import os
import sys
import urllib.error
import urllib.request

REPO = os.environ.get("FINEWEB_REPO", "kjj0/fineweb10B-gpt2")
BASE = f"https://huggingface.co/datasets/{REPO}/resolve/main"
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fineweb10B")


def fetch(name):
    dst = os.path.join(OUT, name)
    if os.path.exists(dst):
        print(f"{name}: present")
        return
    tmp = dst + ".part"
    url = f"{BASE}/{name}"
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(tmp, "wb") as f:
            total = int(r.headers.get("Content-Length", 0))
            done = 0
            while chunk := r.read(1 << 22):
                f.write(chunk)
                done += len(chunk)
                if total:
                    print(f"\r{name}: {done / total:6.1%}", end="", flush=True)
        print()
    except (urllib.error.URLError, OSError) as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        sys.exit(f"cannot download {url}: {e}\n"
                 "This needs network access to huggingface.co. Offline, copy the shards into "
                 f"{OUT} by other means, or point DATA_PATH/--train_files/--val_files at your own shards.")
    os.replace(tmp, dst)


def main():
    num_chunks = 8
    if len(sys.argv) > 1:
        try:
            num_chunks = int(sys.argv[1])
        except ValueError:
            sys.exit(f"usage: {sys.argv[0]} [number of train shards, 1..103]")
        if not 1 <= num_chunks <= 103:
            sys.exit("the number of train shards must be between 1 and 103")
    os.makedirs(OUT, exist_ok=True)
    fetch("fineweb_val_000000.bin")
    for i in range(1, num_chunks + 1):
        fetch(f"fineweb_train_{i:06d}.bin")


if __name__ == "__main__":
    main()
