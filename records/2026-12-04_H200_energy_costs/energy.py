#!/usr/bin/env python3
"""What a FLOP and a byte cost on this GPU at its power limit: each kernel back to back for a few
seconds (PyTorch calling cuBLAS(Lt) and its own copy and sum kernels), with nvidia-smi sampling
the SM clock and the power every 50 ms; energy = mean power x time. "above idle" takes off the
power of the idle GPU measured first.

    python3 records/2026-12-04_H200_energy_costs/energy.py
"""
import statistics
import subprocess
import time

import torch


def settled_samples(fn, secs):
    """(seconds a call, mean SM clock in MHz, mean power in W) of fn() called back to back for secs
    seconds, the samples of the first quarter left out (the clock settling)"""
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, t0 = 0, time.time()
    start.record()
    while time.time() - t0 < secs:
        for _ in range(20):
            fn()
        calls += 20
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    rows = [tuple(float(v) for v in line.split(",")) for line in smi.communicate()[0].split("\n") if line.strip()]
    rows = rows[len(rows) // 4:]  # the clock settled
    return start.elapsed_time(end) / 1e3 / calls, statistics.mean(r[0] for r in rows), statistics.mean(r[1] for r in rows)


def sample(fn, secs, label, flop=0.0, nbytes=0.0, idle_w=None):
    s, mhz, watts = settled_samples(fn, secs)
    line = f"{label}: SM clock {mhz:.0f} MHz, {watts:.0f} W"
    above = watts - (idle_w if idle_w is not None else watts)
    if flop:
        line += f", {flop / s / 1e12:.0f} TFLOP/s, {watts * s / flop * 1e12:.3f} pJ/FLOP ({above * s / flop * 1e12:.3f} above idle)"
    if nbytes:
        line += f", {nbytes / s / 1e12:.2f} TB/s, {watts * s / nbytes * 1e12:.0f} mJ/GB ({above * s / nbytes * 1e12:.0f} above idle)"
    print(line, flush=True)
    return watts


def main():
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    M, D, H = 49152, 768, 3072  # a 393k step's micro-batch; the MLP's shapes
    x, w1 = torch.randn(M, D, device=dev, dtype=bf16), torch.randn(D, H, device=dev, dtype=bf16)
    h, w2 = torch.randn(M, H, device=dev, dtype=bf16), torch.randn(H, D, device=dev, dtype=bf16)
    out1, out2 = torch.empty(M, H, device=dev, dtype=bf16), torch.empty(M, D, device=dev, dtype=bf16)
    h_relu = torch.relu(h)
    xf8 = torch.randn(8192, D, device=dev).to(torch.float8_e4m3fn)
    wf8 = torch.randn(50304, D, device=dev).to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    big, big_out = torch.randn(512 << 20, device=dev, dtype=bf16), torch.empty(512 << 20, device=dev, dtype=bf16)
    small, small_out = big[: 8 << 20], big_out[: 8 << 20]
    time.sleep(1)

    idle = sample(lambda: time.sleep(0.001), 3, "idle")
    gemm = 2.0 * M * D * H
    sample(lambda: torch.mm(x, w1, out=out1), 6, "bf16 GEMM 49152x3072x768", flop=gemm, idle_w=idle)
    sample(lambda: torch.mm(h, w2, out=out2), 6, "bf16 GEMM 49152x768x3072", flop=gemm, idle_w=idle)
    sample(lambda: torch.mm(h_relu, w2, out=out2), 6, "bf16 GEMM 49152x768x3072, A = relu(random)", flop=gemm, idle_w=idle)
    sample(lambda: torch._scaled_mm(xf8, wf8.t(), scale_a=one, scale_b=one, out_dtype=bf16), 6,
           "e4m3 GEMM 8192x50304x768 -> bf16", flop=2.0 * 8192 * 50304 * D, idle_w=idle)
    sample(lambda: big_out.copy_(big), 6, "copy 1 GiB (DRAM, half reads)", nbytes=4.0 * big.numel(), idle_w=idle)
    sample(lambda: torch.sum(big), 6, "sum 1 GiB (DRAM reads)", nbytes=2.0 * big.numel(), idle_w=idle)
    sample(lambda: small_out.copy_(small), 6, "copy 16 MiB (in L2)", nbytes=4.0 * small.numel(), idle_w=idle)


if __name__ == "__main__":
    main()
