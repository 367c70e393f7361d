#!/usr/bin/env python3
"""Attention benchmark: our kernels (tests/libattention.so) and PyTorch's varlen_attn, side by side
on the same inputs, at the record's shapes: micro-batches of 16,384 / 32,768 / 49,152 tokens (and a
262,144-token validation batch) of
FineWeb-like documents (log-normal lengths, median ~450, cut at 2048, as the loader cuts them),
windows of 384 / 768 / 1408 / 2560 tokens, the 6-head layout and the paired-head layout (3 heads
over 2T positions). TFLOP/s count only the visible (unmasked) query-key pairs: 4*128 flops per
pair and head forward, 2.5x that backward."""
import ctypes
import math
import os
import random
import sys

import torch
from torch.nn.attention.varlen import AuxRequest, varlen_attn

LIB = ctypes.CDLL(os.path.join(os.path.dirname(os.path.abspath(__file__)), "libattention.so"))
P = ctypes.c_void_p
for fn, extra in ((LIB.attn_forward, []), (LIB.attn_backward, [P, P, P, P, P])):
    fn.restype = ctypes.c_int
    fn.argtypes = [P, P, P, ctypes.c_longlong, P, ctypes.c_longlong, P, P, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int, ctypes.c_float] + extra + [P, P]
LIB.attn_tiles_bytes.restype = ctypes.c_longlong
LIB.attn_tiles_bytes.argtypes = [ctypes.c_int, ctypes.c_int]


def doc_lengths(total, rng):
    out, s = [], 0
    while s < total:
        n = min(2048, max(1, int(rng.lognormvariate(math.log(450), 0.9))), total - s)
        out.append(n)
        s += n
    return out


def visible_pairs(lens, window):
    total = 0
    for n in lens:
        k = min(n, window + 1)  # rows i >= window see window + 1 keys
        total += k * (k + 1) // 2 + (n - k) * (window + 1)
    return total


def timeit(fn, iters=20):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    torch.manual_seed(0)
    rng = random.Random(0)
    dev = "cuda"
    stream = torch.cuda.current_stream().cuda_stream
    print(f"{'tokens':>6} {'layout':>7} {'window':>6} | {'fwd ms':>7} {'torch':>7} {'TF/s':>5} {'torch':>5} | "
          f"{'bwd ms':>7} {'torch':>7} {'TF/s':>5} {'torch':>5} | {'out err':>8} {'dq err':>8}")
    # training micro-batches, then one validation micro-batch (forward only in training, but timed both ways)
    for T in (16384, 32768, 49152, 262144):
        lens = doc_lengths(T, rng)
        for paired in (False, True):
            mult, H = (2, 3) if paired else (1, 6)
            pos_lens = [n * mult for n in lens]
            Pn = T * mult
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=dev)
            cu_pos = cu * mult
            max_len = max(pos_lens)
            for window in ((384, 768, 1408, 2560) if T < 262144 else (768, 2560)):
                scale = 0.12
                q, k, v = (torch.randn(Pn, H, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
                dout = torch.randn(Pn, H, 128, device=dev, dtype=torch.bfloat16) * 0.1
                o = torch.empty_like(q)
                lse = torch.empty(H, Pn, device=dev, dtype=torch.float32)
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                delta = torch.empty(H, Pn, device=dev, dtype=torch.float32)
                tiles = torch.empty(LIB.attn_tiles_bytes(Pn, cu.numel()), device=dev, dtype=torch.uint8)
                args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), H * 128, o.data_ptr(), H * 128, lse.data_ptr(),
                        cu.data_ptr(), cu.numel(), mult, Pn, H, window, scale)

                def ours_fwd():
                    assert LIB.attn_forward(*args, tiles.data_ptr(), stream) == 0

                def ours_bwd():
                    assert LIB.attn_backward(*args, dout.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                                             delta.data_ptr(), tiles.data_ptr(), stream) == 0

                qt, kt, vt = (x.detach().clone().requires_grad_(True) for x in (q, k, v))

                def torch_fwd():
                    return varlen_attn(qt, kt, vt, cu_pos, cu_pos, max_len, max_len, scale=scale,
                                       window_size=(window, 0))

                out_t = torch_fwd()

                def torch_bwd():
                    torch.autograd.grad(out_t, (qt, kt, vt), dout, retain_graph=True)

                t_f, t_tf = timeit(ours_fwd), timeit(lambda: torch_fwd())
                t_b, t_tb = timeit(ours_bwd), timeit(torch_bwd)
                ours_fwd(), ours_bwd()
                gq = torch.autograd.grad(out_t, (qt,), dout, retain_graph=True)[0]
                err_o = ((o.float() - out_t.float()).norm() / out_t.float().norm()).item()
                err_q = ((dq.float() - gq.float()).norm() / gq.float().norm()).item()
                flops = 4 * 128 * H * visible_pairs(pos_lens, window)
                print(f"{T:>6} {'paired' if paired else '6 head':>7} {window:>6} | {t_f:7.3f} {t_tf:7.3f} "
                      f"{flops / t_f / 1e9:5.0f} {flops / t_tf / 1e9:5.0f} | {t_b:7.3f} {t_tb:7.3f} "
                      f"{2.5 * flops / t_b / 1e9:5.0f} {2.5 * flops / t_tb / 1e9:5.0f} | {err_o:8.1e} {err_q:8.1e}",
                      flush=True)


if __name__ == "__main__":
    sys.exit(main())
