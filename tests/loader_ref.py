#!/usr/bin/env python3
"""Reference of record 61's data loader and schedules, in plain Python (no torch, no numpy).

The host tests run the C++ loader and this reference on the same synthetic shards and compare
the micro-batches byte for byte. It follows the record's distributed_data_generator: a
generator that takes new batch sizes through .send(), BOS-aligned training batches found by
walking one BOS index for all ranks, the first shard's quick BOS scan, the next shard
preloaded, and contiguous unaligned validation batches.

Output: for each micro-batch of each rank, int32 little-endian words
    num_tokens_local, max_num_docs, inputs[num_tokens_local], targets[num_tokens_local],
    cu_seqlens[max_num_docs]
written to <out>.r<rank>.
"""
import argparse
import glob
import math
import struct
import sys
from array import array
from itertools import cycle

BOS_ID = 50256


def next_multiple_of_n(v, *, n):
    return next(x for x in range(n, int(v) + 1 + n, n) if x >= v)


def load_shard(path):
    with open(path, "rb") as f:
        header = array("i")
        header.frombytes(f.read(256 * 4))
        assert header[0] == 20240520, f"{path}: magic number mismatch"
        assert header[1] == 1, f"{path}: unsupported version"
        num_tokens = header[2]
        tokens = array("H")
        data = f.read()
        assert len(data) == 2 * num_tokens, f"{path}: token count does not match header"
        tokens.frombytes(data)
    if sys.byteorder != "little":
        tokens.byteswap()
    return tokens


class Finder:
    """Document starts and ends for every rank, from one BOS index walked in order."""

    def __init__(self, tokens, quickload_tokens=None, quickload_batches=5):
        self.tokens = tokens
        self.size = len(tokens)
        full = [i for i, t in enumerate(tokens) if t == BOS_ID]
        if quickload_tokens is not None:
            # the record's first shard only scans its first tokens for the first batches
            self.bos = [i for i in full if i < quickload_tokens]
            self.full_bos = full
        else:
            self.bos = full
            self.full_bos = None
        self.quickload_batches = quickload_batches
        self.i = 0
        self.batches = 0

    def next_batch(self, world_size, num_tokens_local, max_seq_len):
        if self.full_bos is not None and self.batches == self.quickload_batches:
            self.bos = self.full_bos
            self.full_bos = None
        bos, n = self.bos, len(self.bos)
        idx = self.i
        spans = []
        for _ in range(world_size):
            rank_spans = []
            taken = 0
            while taken <= num_tokens_local:
                if idx >= n:
                    return None  # shard exhausted
                start = bos[idx]
                stop = bos[idx + 1] if idx + 1 < n else self.size
                stop = min(stop, start + max_seq_len, start + num_tokens_local - taken + 1)
                rank_spans.append((start, stop))
                taken += stop - start
                idx += 1
            assert taken == num_tokens_local + 1
            spans.append(rank_spans)
        self.i = idx
        self.batches += 1
        return spans


def data_generator(files, num_tokens, max_seq_len, grad_accum_steps, rank, world_size, align_to_bos,
                   cycle_files, quickload_tokens):
    assert num_tokens % (world_size * grad_accum_steps) == 0
    num_tokens //= grad_accum_steps
    file_iter = cycle(files) if cycle_files else iter(files)
    tokens = load_shard(next(file_iter))
    if align_to_bos:
        finder = Finder(tokens, quickload_tokens)
    pos = 0
    while True:
        ntl = num_tokens // world_size
        max_num_docs = next_multiple_of_n(ntl // 300, n=128)
        if align_to_bos:
            spans = finder.next_batch(world_size, ntl, max_seq_len)
            if spans is None:
                nxt = next(file_iter, None)
                if nxt is None:
                    raise RuntimeError("train data exhausted")
                tokens = load_shard(nxt)
                finder = Finder(tokens)
                continue
            mine = spans[rank]
            buf = array("H")
            for a, b in mine:
                buf.extend(tokens[a:b])
            lengths = [b - a for a, b in mine]
            lengths[-1] -= 1  # the last token is a target only
            cum = []
            total = 0
            for length in lengths:
                total += length
                cum.append(total)
        else:
            if pos + num_tokens + 1 >= len(tokens):
                nxt = next(file_iter, None)
                if nxt is None:
                    raise RuntimeError("validation data exhausted")
                tokens, pos = load_shard(nxt), 0
            start = pos + rank * ntl
            buf = tokens[start:start + ntl + 1]
            assert len(buf) == ntl + 1
            cum = [j for j in range(ntl) if buf[j] == BOS_ID]
            pos += num_tokens
        if len(cum) + 1 > max_num_docs:
            raise RuntimeError("too many documents for max_num_docs")
        cu = [ntl] * max_num_docs
        cu[0] = 0
        cu[1:len(cum) + 1] = cum
        new = yield ntl, max_num_docs, list(buf[:-1]), list(buf[1:]), cu
        if new is not None:
            new_num_tokens, new_max_seq_len, new_accum = new
            assert new_num_tokens % (world_size * new_accum) == 0
            num_tokens = new_num_tokens // new_accum
            max_seq_len = new_max_seq_len


# --- schedules, written from the record's formulas -------------------------------------------

def get_bs(step, sched, n_sched, bs_ext):
    if step >= n_sched:
        return bs_ext
    x = step / n_sched
    return sched[int(len(sched) * x)]


def get_ws(step, ws_sched, n_sched, ws_final):
    if step >= n_sched:
        return ws_final // 2, ws_final
    x = step / n_sched
    w = ws_sched[int(len(ws_sched) * x)]
    return w // 2, w


def get_lr(step, n_sched, cooldown_frac):
    if step > n_sched:
        return 0.1
    lr_max = 1.0
    x = step / n_sched
    if x > 1 / 3:
        lr_max = 1.52
    if x > 2 / 3:
        lr_max = 1.73
    if x >= 1 - cooldown_frac:
        w = (1 - x) / cooldown_frac
        return lr_max * w + (1 - w) * 0.1
    return lr_max


def get_momentum(step, num_iterations, warmup=300, cooldown=50, lo=0.85, hi=0.95):
    cd_start = num_iterations - cooldown
    if step < warmup:
        return lo + step / warmup * (hi - lo)
    if step > cd_start:
        return hi - (step - cd_start) / cooldown * (hi - lo)
    return hi


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def get_mtp(step, n_sched):
    x = step / n_sched
    if x < 1 / 3:
        w = [1.0, 0.5, 0.25 * (1 - 3 * x)]
    elif x < 2 / 3:
        w = [1.0, 0.5 * (1 - (3 * x - 1))]
    else:
        w = [1.0]
    return [f32(v) for v in w]


def yarn_scales_and_freqs(transitions, ws_at, block_size=128, head_dim=128):
    """attn_scale and angular frequencies after each window change, in double precision."""
    n = head_dim // 4
    freq = [(1 / 1024) ** (i / (n - 1)) for i in range(n) for _ in range(2)] + [0.0] * (head_dim // 2)
    scale = 0.1
    out = [(scale, list(freq))]
    old = ws_at(0)
    for s in transitions:
        new = ws_at(s)
        sf = old / new
        for k, f in enumerate(freq):
            rot = block_size * old * f / (2 * math.pi)
            w = min(1.0, max(0.0, (rot - 1) / (32 - 1)))
            freq[k] = f * (sf + w * (1 - sf))
        scale *= 0.2 * math.log(new / old) + 1
        old = new
        out.append((scale, list(freq)))
    return out


def schedules(n_sched, n_ext, cooldown_frac, split_frac):
    """One line per step: step bs ws_short ws_long lr momentum adam mtp..., then split/transitions."""
    sched = (8 * 2048 * 8, 16 * 2048 * 8, 24 * 2048 * 8)
    n_iter = n_sched + n_ext
    lines = []
    for s in range(n_iter + 1):
        ws = get_ws(s, (3, 7, 11), n_sched, 13)
        mtp = get_mtp(s, n_sched)
        lines.append(" ".join([str(s), str(get_bs(s, sched, n_sched, 24 * 2048 * 8)), str(ws[0]), str(ws[1]),
                               repr(get_lr(s, n_sched, cooldown_frac)), repr(get_momentum(s, n_iter)),
                               str(s % 2), *[repr(v) for v in mtp]]))
    transitions = []
    long_ws = get_ws(0, (3, 7, 11), n_sched, 13)[1]
    for s in range(1, n_iter):
        w = get_ws(s, (3, 7, 11), n_sched, 13)[1]
        if w != long_ws:
            transitions.append(s)
            long_ws = w
    warmup = sorted({0, 1, 2} | {s + o for s in transitions for o in (-1, 0, 1) if s + o >= 0})
    lines.append("split " + str(math.ceil(split_frac * n_sched) | 1))
    lines.append("transitions " + " ".join(map(str, transitions)))
    lines.append("warmup " + " ".join(map(str, warmup)))
    for scale, freq in yarn_scales_and_freqs(transitions, lambda s: get_ws(s, (3, 7, 11), n_sched, 13)[1]):
        lines.append("yarn " + repr(scale) + " " + " ".join(repr(f) for f in freq))
    return lines


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pattern", required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--accum", type=int, required=True)
    p.add_argument("--max-seq-len", type=int, default=-1)
    p.add_argument("--unaligned", action="store_true")
    p.add_argument("--cycle", action="store_true")
    p.add_argument("--quickload-tokens", type=int, default=4_000_000)
    p.add_argument("--steps", required=True, help="comma-separated tokens per step (all ranks), one per step")
    p.add_argument("--out", required=True)
    p.add_argument("--schedules", action="store_true", help="print the record's schedules instead")
    a = p.parse_args()
    files = sorted(glob.glob(a.pattern))
    if not files:
        raise FileNotFoundError(a.pattern)
    steps = [int(x) for x in a.steps.split(",")]
    for rank in range(a.world):
        gen = data_generator(files, steps[0], a.max_seq_len, a.accum, rank, a.world, not a.unaligned, a.cycle,
                             a.quickload_tokens)
        out = bytearray()
        bs = steps[0]
        for i, step_bs in enumerate(steps):
            # the training loop sends new batch sizes on every micro-step of the step that changes them
            send = (step_bs, a.max_seq_len, a.accum) if step_bs != bs and i > 0 else None
            bs = step_bs
            for _ in range(a.accum):
                ntl, mnd, inputs, targets, cu = gen.send(send) if send is not None else next(gen)
                out += array("i", [ntl, mnd]).tobytes()
                out += array("i", inputs).tobytes() + array("i", targets).tobytes() + array("i", cu).tobytes()
        with open(f"{a.out}.r{rank}", "wb") as f:
            f.write(out)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--schedules":
        n_sched, n_ext = 1725, 40
        print("\n".join(schedules(n_sched, n_ext, 0.5, 2 / 3)))
    else:
        main()
