#!/usr/bin/env python3
"""Energy per FLOP of the attention at the H200's power limit: our kernels (tests/libattention.so,
`make tests/libattention.so`) and PyTorch's varlen_attn, which the record runs here in place of its
FA3 hub kernel, on the same 49,152-token micro-batch, each launched back to back for 4 s beside
nvidia-smi; then cuBLASLt's bf16 GEMM of c_fc's data gradient. The sampling and the inputs are those
of the attention energy record (attention_energy.py); FLOPs count the visible query-key pairs only.

    python3 records/2026-12-04_H200_energy_budget/attention_energy_vs_torch.py
"""
import os
import random
import sys
import time

import torch
from torch.nn.attention.varlen import varlen_attn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "2026-12-04_H200_attention_energy")]
from attention_energy import ba, report, settled_samples  # noqa: E402


def main():
    torch.manual_seed(0)
    T, H, dev, scale = 49152, 6, "cuda", 0.12
    lens = ba.doc_lengths(T, random.Random(0))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    stream = torch.cuda.current_stream().cuda_stream
    time.sleep(1)
    _, _, idle_w = settled_samples(lambda: time.sleep(0.001), 2)
    print(f"idle: {idle_w:.0f} W")
    for window in (640, 1408):  # the 393k phase's short and long windows (5 and 11 blocks of 128)
        q, k, v = (torch.randn(T, H, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
        dout = torch.randn(T, H, 128, device=dev, dtype=torch.bfloat16) * 0.1
        o, dq, dk, dv = (torch.empty_like(q) for _ in range(4))
        lse, delta = (torch.empty(H, T, device=dev, dtype=torch.float32) for _ in range(2))
        tiles = torch.empty(ba.LIB.attn_tiles_bytes(T, cu.numel()), device=dev, dtype=torch.uint8)
        args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), H * 128, o.data_ptr(), H * 128, lse.data_ptr(),
                cu.data_ptr(), cu.numel(), 1, T, H, window, scale)
        qt, kt, vt = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        out_t = varlen_attn(qt, kt, vt, cu, cu, max(lens), max(lens), scale=scale, window_size=(window, 0))
        flop = 4 * 128 * H * ba.visible_pairs(lens, window)
        def ours_fwd():
            assert ba.LIB.attn_forward(*args, tiles.data_ptr(), stream) == 0

        def ours_bwd():
            assert ba.LIB.attn_backward(*args, dout.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                                        delta.data_ptr(), tiles.data_ptr(), stream) == 0

        runs = {
            "ours forward": ours_fwd,
            "ours backward": ours_bwd,
            "torch varlen_attn forward": lambda: varlen_attn(q, k, v, cu, cu, max(lens), max(lens), scale=scale,
                                                             window_size=(window, 0)),
            "torch varlen_attn backward": lambda: torch.autograd.grad(out_t, (qt, kt, vt), dout, retain_graph=True),
        }
        for label, run in runs.items():
            report(f"{label}, window {window}", run, flop * (2.5 if "backward" in label else 1), idle_w)
    m, n, kk = T, 768, 3072
    a = torch.randn(m, kk, device=dev, dtype=torch.bfloat16)
    b = torch.randn(kk, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    report(f"bf16 GEMM {m}x{n}x{kk} (random)", lambda: torch.mm(a, b, out=c), 2.0 * m * n * kk, idle_w)


if __name__ == "__main__":
    main()
