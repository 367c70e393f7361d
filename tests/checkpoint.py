#!/usr/bin/env python3
"""A checkpoint's blobs, for the GPU shell tests. The file is a text header ("blob NAME BYTES" lines,
in file order, up to a line "end"), then the blobs' bytes in that order; what is not asked for is
seeked past (the optimizer's state is most of the bytes).
  checkpoint.py same-weights A.bin B.bin   exit 0 if every param/* blob of the two is the same, bit for bit
  checkpoint.py blob CKPT NAME             blob NAME's bytes to stdout"""
import hashlib
import sys


def blobs(path, wanted):
    """(name, bytes) of each blob whose name wanted(name) accepts, in file order"""
    with open(path, "rb") as f:
        sizes = []
        while (line := f.readline().decode().rstrip("\n")) != "end":
            if line.startswith("blob "):
                _, name, n = line.split(" ")
                sizes.append((name, int(n)))
            elif not line and f.tell() > 1 << 20:
                sys.exit(f"{path}: no header end in its first MiB")
        for name, n in sizes:
            if wanted(name):
                yield name, f.read(n)
            else:
                f.seek(n, 1)


def main(argv):
    if len(argv) == 3 and argv[0] == "same-weights":
        a, b = ({name: hashlib.sha256(data).hexdigest() for name, data in blobs(p, lambda n: n.startswith("param/"))}
                for p in argv[1:])
        differ = sorted(k for k in a if a[k] != b.get(k))
        if not a or a.keys() != b.keys() or differ:
            sys.exit("weights differ: " + (", ".join(differ) or "other parameters"))
    elif len(argv) == 3 and argv[0] == "blob":
        found = [data for _, data in blobs(argv[1], lambda n: n == argv[2])]
        if not found:
            sys.exit(f"{argv[1]}: no blob {argv[2]}")
        sys.stdout.buffer.write(found[0])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
