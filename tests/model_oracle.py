#!/usr/bin/env python3
"""Oracle of the record-61 model, in plain eager PyTorch (no compile, no Triton), written from the
record's code. Reads the weights, batch and schedule that tests/test_gpu writes to a folder, prints
"train_loss <x>" (fp8 lm_head, multi-token prediction, summed and scaled), "eval_loss <x>" (bf16
lm_head, mean next-token loss), and, where the folder holds the trainer's gradients
(grad_<label>.bin), "grad <label> <relative error>" for every parameter: autograd through this
model, with the record's fp8 lm_head backward.

    python3 tests/model_oracle.py DIR
"""
import os
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

dev = "cuda"


def load(d):
    params = {}
    for line in open(f"{d}/params.txt"):
        label, dtype, *dims = line.split()
        shape = tuple(int(x) for x in dims)
        if dtype == "bf16":
            raw = np.fromfile(f"{d}/{label}.bin", dtype=np.int16)
            t = torch.from_numpy(raw).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.fromfile(f"{d}/{label}.bin", dtype=np.float32))
        params[label] = t.reshape(shape).to(dev)
    args = {}
    for line in open(f"{d}/args.txt"):
        key, *vals = line.split()
        args[key] = [float(v) for v in vals]
    tokens = torch.from_numpy(np.fromfile(f"{d}/tokens.bin", dtype=np.int32)).to(dev)
    cu = torch.from_numpy(np.fromfile(f"{d}/cu.bin", dtype=np.int32)).to(dev)
    return params, args, tokens, cu


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def rotary(x, f1, f2):
    x_flip = x.view(*x.shape[:-1], x.shape[-1] // 2, 2).flip(-1).view(x.shape)
    return f1 * x + f2 * x_flip


def tables(freq, T, paired):
    t = torch.arange(T, dtype=torch.float32, device=dev)
    if paired:
        th1, th2 = torch.outer(2 * t, freq), torch.outer(2 * t + 1, freq)
        f1 = torch.cat((th1.cos(), th2.cos()), dim=-1).to(torch.bfloat16)
        f2 = torch.cat((th1.sin(), th2.sin()), dim=-1).to(torch.bfloat16)
    else:
        th = torch.outer(t, freq)
        f1, f2 = th.cos().to(torch.bfloat16), th.sin().to(torch.bfloat16)
    f2[..., 1::2] *= -1
    return f1[None, :, None, :], f2[None, :, None, :]


class FP8Head(torch.autograd.Function):
    """x @ w with fp8 inputs (e4m3, fast accumulation) and an e5m2 gradient, as the record's mm_t."""

    @staticmethod
    def forward(ctx, x, w, x_s, w_s, grad_s):
        x_f8 = x.div(x_s).to(torch.float8_e4m3fn)
        w_f8 = w.div(w_s).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(x_f8, w_f8.T.contiguous().T, out_dtype=torch.bfloat16,
                               scale_a=torch.tensor(x_s, device=dev), scale_b=torch.tensor(w_s, device=dev),
                               use_fast_accum=True)
        ctx.save_for_backward(x_f8, w_f8)
        ctx.scales = (x_s, w_s, grad_s)
        return out

    @staticmethod
    def backward(ctx, g):
        x_f8, w_f8 = ctx.saved_tensors
        x_s, w_s, grad_s = ctx.scales
        t = lambda v: torch.tensor(v, device=dev, dtype=torch.float32)
        g_f8 = g.div(grad_s).to(torch.float8_e5m2)
        grad_x = torch._scaled_mm(g_f8, w_f8.T, out_dtype=torch.bfloat16, scale_a=t(grad_s), scale_b=t(w_s),
                                  use_fast_accum=False)
        grad_w = torch._scaled_mm(x_f8.T.contiguous(), g_f8.T.contiguous().T, out_dtype=torch.float32,
                                  scale_a=t(x_s), scale_b=t(grad_s), use_fast_accum=False)
        return grad_x, grad_w.to(torch.bfloat16), None, None, None


def forward(P, A, tokens, cu, training):
    T = int(A["T"][0])
    inp, tgt = tokens[:T], tokens[1:T + 1].long()
    H, Dh, D = 6, 128, 768
    freq = torch.tensor(A["freq"], dtype=torch.float32, device=dev)
    attn_scale = A["attn_scale"][0]
    ws_short, ws_long, block = int(A["ws_short"][0]), int(A["ws_long"][0]), int(A["block_size"][0])
    sc = P["scalars"]
    resid, sa, smear_l, backout_l, skip_l = sc[:11], sc[11:33].view(-1, 2), sc[33], sc[34], sc[35]
    x0l = P["x0_lambdas"]
    x = P["embed"][inp]
    ve = [P[f"ve{k}"][inp] for k in range(3)]
    ve = [ve[1], ve[2]] + [None] * 6 + [ve[0], ve[1], ve[2]]
    smear_out = smear_l * torch.sigmoid(x[1:, :12] @ P["smear_gate"].T)
    x = torch.cat([x[:1], x[1:] + smear_out * x[:-1]])
    x = x0 = norm(x[None])
    ag = list(P["attn_gate_bank"].unbind(0))
    vg = list(P["ve_gate_bank"].unbind(0))
    attn_gates = ag[:6] + [None] + ag[6:]
    ve_gates = [vg[0], vg[1]] + [None] * 6 + [vg[2], vg[3], vg[4]]
    attn_w = P["attn"].unbind(0)
    mlp = P["mlp"]
    short_bm, long_bm = ws_short * block, ws_long * block
    bm = [short_bm, short_bm, short_bm, long_bm, short_bm, short_bm, None, short_bm, short_bm, short_bm, long_bm]
    paired_layers = [0, 2, 5, 9]
    skip, x_backout = None, None
    lens = (cu[1:] - cu[:-1])
    max_len = int(lens.max())
    for i in range(11):
        if i == 6:
            x = x + torch.sigmoid(skip_l) * 2 * torch.sigmoid(x0[..., :12] @ P["skip_gate"].T) * skip
        x = (resid[0] + x0l[0]) * x if i == 0 else resid[i] * x + x0l[i] * x0
        if i != 6:
            w = attn_w[i if i < 6 else i - 1]
            xn = norm(x)
            qkv = F.linear(xn, sa[i][0] * w[:3 * D].type_as(xn))
            q, k, v = qkv.view(1, T, 3 * H, Dh).chunk(3, dim=-2)
            q, k = norm(q), norm(k)
            paired = i in paired_layers
            if paired:
                q, k = q.reshape(1, T, H // 2, 2 * Dh), k.reshape(1, T, H // 2, 2 * Dh)
                v = v.reshape(1, 2 * T, H // 2, Dh)
                f1, f2 = tables(freq, T, True)
                q, k = rotary(q, f1, f2), rotary(k, f1, f2)
                q, k = q.view(1, 2 * T, H // 2, Dh), k.view(1, 2 * T, H // 2, Dh)
            else:
                f1, f2 = tables(freq, T, False)
                q, k = rotary(q, f1, f2), rotary(k, f1, f2)
                if bm[i] == long_bm:
                    k = k.clone()
                    k[:, 1:, :, Dh // 4:Dh // 2] = k[:, :-1, :, Dh // 4:Dh // 2].clone()
                    k[:, 1:, :, 3 * Dh // 4:] = k[:, :-1, :, 3 * Dh // 4:].clone()
            if ve[i] is not None:
                g = 2 * torch.sigmoid(F.linear(xn[..., :12], ve_gates[i]))
                if paired:
                    v = v + g.view(1, 2 * T, H // 2, 1) * ve[i].view_as(v)
                else:
                    v = v + g.view(1, T, H, 1) * ve[i].view_as(v)
            m = 2 if paired else 1
            y = varlen_attn(q[0].contiguous(), k[0].contiguous(), v[0].contiguous(), cu * m, cu * m, max_len * m, max_len * m,
                            scale=attn_scale, window_size=(bm[i], 0))
            y = y.view(1, T, H, Dh)
            y = y * torch.sigmoid(F.linear(xn[..., :12], attn_gates[i])).view(1, T, H, 1)
            y = y.contiguous().view(1, T, D)
            x = x + F.linear(y, sa[i][1] * w[3 * D:].type_as(y))
        xn = norm(x)
        pre = xn.view(T, D) @ mlp[i, 0].T
        post = torch.relu(pre) ** 2
        x = x + (post @ mlp[i, 1]).view(1, T, D)
        if i == 3:
            skip = x
        if i == 7:
            x_backout = x
    x = x - backout_l * x_backout
    x = norm(x).view(T, D)
    if not training:  # the trainer's final hidden state against ours
        theirs = torch.from_numpy(np.fromfile(f"{sys.argv[1]}/hidden.bin", dtype=np.int16)).view(torch.bfloat16)
        theirs = theirs.to(dev).view(T, D).float()
        print(f"hidden_rel_err {((theirs - x.float()).norm() / x.float().norm()).item()!r}")
        # how far the hidden state moved from the embeddings alone: the scale a wrong block would show at
        e = norm(P["embed"][inp].float()[None]).view(T, D)
        print(f"hidden_vs_embedding {((e - x.float()).norm() / x.float().norm()).item()!r}")
    a, b, c = A["softcap"]
    if training:
        logits = FP8Head.apply(x, P["lm_head"], *A["fp8_scales"][:3])
        z = a * torch.sigmoid((logits.float() + b) / c)
        lse = torch.logsumexp(z, dim=-1)
        loss = torch.zeros(T, device=dev)
        for kk, wk in enumerate(A["mtp"]):
            rows = T - kk
            loss = loss + F.pad(wk * (lse[:rows] - z[torch.arange(rows, device=dev), tgt[kk:kk + rows]]), (0, kk))
        return loss.sum() * A["loss_scale"][0]
    logits = x @ P["lm_head"]
    logits = a * torch.sigmoid((logits + b) / c)
    return F.cross_entropy(logits.float(), tgt, reduction="mean").item()


def main():
    d = sys.argv[1]
    P, A, tokens, cu = load(d)
    with torch.no_grad():
        print(f"train_loss {forward(P, A, tokens, cu, True).item()!r}")
        print(f"eval_loss {forward(P, A, tokens, cu, False)!r}")
    if not os.path.exists(f"{d}/grad_embed.bin"):
        return
    for t in P.values():
        t.requires_grad_(True)
    forward(P, A, tokens, cu, True).backward()
    for label, t in P.items():
        raw = np.fromfile(f"{d}/grad_{label}.bin", dtype=np.int16 if t.dtype == torch.bfloat16 else np.float32)
        theirs = torch.from_numpy(raw)
        theirs = (theirs.view(torch.bfloat16) if t.dtype == torch.bfloat16 else theirs).to(dev).float().view(t.shape)
        ours = t.grad.float()
        err = ((theirs - ours).norm() / ours.norm().clamp_min(1e-30)).item()
        print(f"grad {label} {err!r}")


if __name__ == "__main__":
    main()
