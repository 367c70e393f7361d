#!/usr/bin/env python3
"""How far is our attention from the best attention kernels at hand, in energy per FLOP? On a
49,152-token micro-batch of equal documents, each causal over the whole document (the window as
long as a document), 6 heads of 128: our kernels (tests/libattention.so, `make
tests/libattention.so`), then PyTorch's scaled_dot_product_attention on cuDNN's fused attention
(FlashAttention-3-like on Hopper) and on its FlashAttention-2 backend, each launched back to back
for 4 s while nvidia-smi samples the SM clock and the power (energy.py's sampling, as in the
attention energy record), and cuBLASLt's bf16 GEMM of c_fc's data gradient for comparison. FLOPs
count the visible query-key pairs (4 x 128 a pair and head forward, 2.5 times that backward)."""
import os
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "..", "tests"), os.path.join(HERE, "..", "2026-12-04_H200_energy_costs")]
import bench_attention as ba  # noqa: E402  (the library's bindings, the pair count)
from energy import settled_samples  # noqa: E402


def report(label, run, flop, idle_w):
    s, mhz, watts = settled_samples(run, 4)
    print(f"{label}: {s * 1e6:.1f} us a call, SM clock {mhz:.0f} MHz, {watts:.0f} W, {flop / s / 1e12:.0f} TFLOP/s, "
          f"{watts * s * 1e12 / flop:.2f} pJ/FLOP ({(watts - idle_w) * s * 1e12 / flop:.2f} above idle)", flush=True)


def main():
    torch.manual_seed(0)
    T, H, dev = 49152, 6, "cuda"
    stream = torch.cuda.current_stream().cuda_stream
    time.sleep(1)
    _, _, idle_w = settled_samples(lambda: time.sleep(0.001), 2)
    print(f"idle: {idle_w:.0f} W")
    for n in (1024, 2048, 8192):
        B = T // n
        lens = [n] * B
        cu = torch.arange(0, T + 1, n, device=dev, dtype=torch.int32)
        q, k, v = (torch.randn(T, H, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
        dout = torch.randn(T, H, 128, device=dev, dtype=torch.bfloat16) * 0.1
        o, dq, dk, dv = (torch.empty_like(q) for _ in range(4))
        lse, delta = (torch.empty(H, T, device=dev, dtype=torch.float32) for _ in range(2))
        tiles = torch.empty(ba.LIB.attn_tiles_bytes(T, cu.numel()), device=dev, dtype=torch.uint8)
        args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), H * 128, o.data_ptr(), H * 128, lse.data_ptr(),
                cu.data_ptr(), cu.numel(), 1, T, H, n, 0.12)

        def fwd():
            assert ba.LIB.attn_forward(*args, tiles.data_ptr(), stream) == 0

        def bwd():
            assert ba.LIB.attn_backward(*args, dout.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                                        delta.data_ptr(), tiles.data_ptr(), stream) == 0

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
                ref = o.view(B, n, H, 128).transpose(1, 2)  # ours, from fwd() above
                err = (out.float() - ref.float()).abs().max().item()
            except RuntimeError as e:
                print(f"{name}: not available ({str(e).splitlines()[0]})")
                continue
            print(f"{name}, documents of {n}: output vs ours max |diff| {err:.3g}")
            report(f"{name}, documents of {n}, forward", lambda: sdpa(qt.detach(), kt.detach(), vt.detach()), flop, idle_w)
            report(f"{name}, documents of {n}, backward",
                   lambda: torch.autograd.grad(out, (qt, kt, vt), db, retain_graph=True), 2.5 * flop, idle_w)
    m, nn, kk = T, 768, 3072
    a = torch.randn(m, kk, device=dev, dtype=torch.bfloat16)
    b = torch.randn(kk, nn, device=dev, dtype=torch.bfloat16)
    c = torch.empty(m, nn, device=dev, dtype=torch.bfloat16)
    report(f"bf16 GEMM {m}x{nn}x{kk} (random)", lambda: torch.mm(a, b, out=c), 2.0 * m * nn * kk, idle_w)


if __name__ == "__main__":
    main()
