#!/usr/bin/env python3
"""Does the attention run at the H200's power limit? Our attention kernels (tests/libattention.so,
`make tests/libattention.so`) at a 49,152-token micro-batch, each launched back to back for 4 s
while nvidia-smi samples the SM clock and the power every 50 ms; then cuBLASLt's bf16 GEMM of
c_fc's data gradient the same way, for comparison (the sampling is energy.py's, in the energy
costs record). FLOPs count the visible query-key pairs only (as tests/bench_attention.py does):
4 x 128 a pair and head forward, 2.5 times that backward.
--with-torch: PyTorch's varlen_attn too, after ours on the same inputs (what the record runs in
place of its FA3 hub kernel offline; the energy budget record).
--vs-cudnn: instead of the FineWeb-like documents and the 393k phase's windows, equal documents of
1,024, 2,048 and 8,192 tokens, each causal over the whole document (our window as long as a
document), ours beside PyTorch's scaled_dot_product_attention on cuDNN's fused attention and on
FlashAttention 2 (neither takes varlen windowed batches; the attention vs cuDNN record)."""
import os
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "..", "tests"), os.path.join(HERE, "..", "2026-12-04_H200_energy_costs")]
import bench_attention as ba  # noqa: E402  (the library's bindings, the document lengths, the pair count)
from energy import settled_samples  # noqa: E402  (a kernel back to back beside nvidia-smi)

T, H, DEV = 49152, 6, "cuda"


def report(label, run, flop, idle_w):
    s, mhz, watts = settled_samples(run, 4)
    print(f"{label}: {s * 1e6:.1f} us a call, SM clock {mhz:.0f} MHz, {watts:.0f} W, {flop / s / 1e12:.0f} TFLOP/s, "
          f"{watts * s * 1e12 / flop:.2f} pJ/FLOP ({(watts - idle_w) * s * 1e12 / flop:.2f} above idle)", flush=True)


def idle_power():
    time.sleep(1)
    _, _, idle_w = settled_samples(lambda: time.sleep(0.001), 2)
    print(f"idle: {idle_w:.0f} W")
    return idle_w


def ours(cu, window):
    """random q, k, v, dout of (T, H, 128), our output o, and our forward and backward on them"""
    stream = torch.cuda.current_stream().cuda_stream
    q, k, v = (torch.randn(T, H, 128, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn(T, H, 128, device=DEV, dtype=torch.bfloat16) * 0.1
    o, dq, dk, dv = (torch.empty_like(q) for _ in range(4))
    lse, delta = (torch.empty(H, T, device=DEV, dtype=torch.float32) for _ in range(2))
    tiles = torch.empty(ba.LIB.attn_tiles_bytes(T, cu.numel()), device=DEV, dtype=torch.uint8)
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), H * 128, o.data_ptr(), H * 128, lse.data_ptr(),
            cu.data_ptr(), cu.numel(), 1, T, H, window, 0.12)

    def fwd():
        assert ba.LIB.attn_forward(*args, tiles.data_ptr(), stream) == 0

    def bwd():
        assert ba.LIB.attn_backward(*args, dout.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                                    delta.data_ptr(), tiles.data_ptr(), stream) == 0

    return q, k, v, dout, o, fwd, bwd


def gemm(idle_w):
    m, n, kk = T, 768, 3072
    a = torch.randn(m, kk, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(kk, n, device=DEV, dtype=torch.bfloat16)
    c = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
    report(f"bf16 GEMM {m}x{n}x{kk} (random)", lambda: torch.mm(a, b, out=c), 2.0 * m * n * kk, idle_w)


def main(with_torch=False):
    torch.manual_seed(0)
    lens = ba.doc_lengths(T, random.Random(0))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    idle_w = idle_power()
    for window in (640, 1408):  # the 393k phase's short and long windows (5 and 11 blocks of 128)
        q, k, v, dout, _, fwd, bwd = ours(cu, window)
        flop = 4 * 128 * H * ba.visible_pairs(lens, window)
        report(f"attention forward, window {window}", fwd, flop, idle_w)
        report(f"attention backward, window {window}", bwd, 2.5 * flop, idle_w)
        if with_torch:
            from torch.nn.attention.varlen import varlen_attn

            def torch_fwd(x=q, y=k, z=v):
                return varlen_attn(x, y, z, cu, cu, max(lens), max(lens), scale=0.12, window_size=(window, 0))

            qt, kt, vt = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
            out_t = torch_fwd(qt, kt, vt)
            report(f"torch varlen_attn forward, window {window}", torch_fwd, flop, idle_w)
            report(f"torch varlen_attn backward, window {window}",
                   lambda: torch.autograd.grad(out_t, (qt, kt, vt), dout, retain_graph=True), 2.5 * flop, idle_w)
    gemm(idle_w)


def vs_cudnn():
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    idle_w = idle_power()
    for n in (1024, 2048, 8192):
        B, lens = T // n, [n] * (T // n)
        cu = torch.arange(0, T + 1, n, device=DEV, dtype=torch.int32)
        q, k, v, dout, o, fwd, bwd = ours(cu, n)
        flop = 4 * 128 * H * ba.visible_pairs(lens, n)
        fwd()
        bwd()
        report(f"ours, documents of {n}, forward", fwd, flop, idle_w)
        report(f"ours, documents of {n}, backward", bwd, 2.5 * flop, idle_w)
        # (B, H, n, 128) views of the same (T, H, 128) tensors
        qb, kb, vb, db = (x.view(B, n, H, 128).transpose(1, 2) for x in (q, k, v, dout))
        for name, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("FlashAttention-2", SDPBackend.FLASH_ATTENTION)):
            qt, kt, vt = (x.detach().clone().requires_grad_(True) for x in (qb, kb, vb))

            def sdpa(x=qt, y=kt, z=vt, backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(x, y, z, is_causal=True, scale=0.12)

            try:
                out = sdpa()
            except RuntimeError as e:
                print(f"{name}: not available ({str(e).splitlines()[0]})")
                continue
            ref = o.view(B, n, H, 128).transpose(1, 2)  # ours, from fwd() above
            print(f"{name}, documents of {n}: output vs ours max |diff| {(out.float() - ref.float()).abs().max().item():.3g}")
            report(f"{name}, documents of {n}, forward", lambda: sdpa(qt.detach(), kt.detach(), vt.detach()), flop, idle_w)
            report(f"{name}, documents of {n}, backward",
                   lambda: torch.autograd.grad(out, (qt, kt, vt), db, retain_graph=True), 2.5 * flop, idle_w)
    gemm(idle_w)


if __name__ == "__main__":
    if "--vs-cudnn" in sys.argv[1:]:
        vs_cudnn()
    else:
        main(with_torch="--with-torch" in sys.argv[1:])
