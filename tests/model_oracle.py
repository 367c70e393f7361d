#!/usr/bin/env python3
"""Oracle of the record-61 model, in plain eager PyTorch (no compile, no Triton), written from the
record's code. Reads the weights, batch and schedule that tests/test_gpu writes to a folder and
prints "train_loss <x>" (fp8 lm_head, multi-token prediction, summed and scaled) and "eval_loss <x>"
(bf16 lm_head, mean next-token loss) in the record's bf16 arithmetic.

The trainer's hidden state and gradients cannot match bf16 PyTorch to a fixed tolerance (the fp8
head's e5m2 gradient alone makes a few % of noise), so they are measured against a reference: the
same model in fp32 (dense fp32 attention, fp8 head with the same quantisation and fp32 products).
Each "<key> <label> <ours> <record>" line holds the relative error ||x - ref|| / ||ref|| of the
trainer (ours) and of the bf16 oracle (record): "hidden final" for the final hidden state and,
where the folder holds the trainer's gradients (grad_<label>.bin), "grad <label>" for every
parameter and for each slice of the banks (a wrong block shows as O(1) error in its slice).
Also "train_loss_ref", "eval_loss_ref" and "hidden_vs_embedding" (how far the blocks move the
hidden state: the scale a wrong block would show at).

The layer layout comes from args.txt, as the trainer's layer table states it: "layers L",
"attn" (per layer 0: none, 1: attention, 2: paired-head attention), "long" (per layer 1: the long
window with its key offset), "ve" (per layer the value embedding's index, -1: none), "skip IN OUT"
(layer IN's output joins layer OUT's input) and "backout B" (layer B's output is backed out).

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


def tables(freq, T, paired, dtype):
    t = torch.arange(T, dtype=torch.float32, device=dev)
    if paired:
        th1, th2 = torch.outer(2 * t, freq), torch.outer(2 * t + 1, freq)
        f1 = torch.cat((th1.cos(), th2.cos()), dim=-1).to(dtype)
        f2 = torch.cat((th1.sin(), th2.sin()), dim=-1).to(dtype)
    else:
        th = torch.outer(t, freq)
        f1, f2 = th.cos().to(dtype), th.sin().to(dtype)
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


class FP8HeadRef(torch.autograd.Function):
    """FP8Head for the fp32 reference: the same e4m3/e5m2 roundings (part of the model), the products
    in fp32 (products of fp8 values are exact in fp32; only the accumulation rounds)."""

    @staticmethod
    def forward(ctx, x, w, x_s, w_s, grad_s):
        x_q = x.div(x_s).to(torch.float8_e4m3fn).float()
        w_q = w.div(w_s).to(torch.float8_e4m3fn).float()
        ctx.save_for_backward(x_q, w_q)
        ctx.scales = (x_s, w_s, grad_s)
        return (x_q @ w_q) * (x_s * w_s)

    @staticmethod
    def backward(ctx, g):
        x_q, w_q = ctx.saved_tensors
        x_s, w_s, grad_s = ctx.scales
        g_q = g.div(grad_s).to(torch.float8_e5m2).float()
        return (g_q @ w_q.T) * (grad_s * w_s), (x_q.T @ g_q) * (x_s * grad_s), None, None, None


def dense_attn(q, k, v, cu, scale, window):
    """varlen_attn(..., window_size=(window, 0)) in fp32 (varlen_attn takes only bf16/fp16): q, k, v
    are (positions, heads, Dh); key j is seen by query i iff both lie in one document of cu and
    i - window <= j <= i. A dense masked softmax, so autograd gives its backward."""
    pos = torch.arange(q.size(0), device=dev)
    doc = torch.searchsorted(cu.long(), pos, right=True)  # cu's padding (= positions) is past every position
    i, j = pos[:, None], pos[None, :]
    allowed = (doc[:, None] == doc[None, :]) & (j <= i) & (j >= i - window)
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    p = s.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return torch.einsum("hij,jhd->ihd", p, v).contiguous()


class Layout:
    """The layer table of args.txt: per layer whether it has attention, paired heads, the long
    window, its value embedding (or None); the skip's and the backout's layers."""

    def __init__(self, A):
        self.n = int(A["layers"][0])
        kinds = [int(v) for v in A["attn"]]
        self.long = [bool(v) for v in A["long"]]
        self.ve = [int(v) if v >= 0 else None for v in A["ve"]]
        assert len(kinds) == len(self.long) == len(self.ve) == self.n, "args.txt: a layer table row per layer"
        assert all(k in (0, 1, 2) for k in kinds), "args.txt: attn is 0, 1 or 2"
        self.attn = [k != 0 for k in kinds]
        self.paired = [k == 2 for k in kinds]
        self.skip_in, self.skip_out = (int(v) for v in A["skip"])
        self.backout = int(A["backout"][0])
        # the attention bank, its gate bank and the ve-gate bank: one slot per layer that uses them, in layer order
        self.n_attn = sum(self.attn)
        self.n_ve = sum(v is not None for v in self.ve)

    def check(self, P):
        """The parameters' shapes as the layout makes them (the attention bank may hold padding slots)."""
        L = self.n
        assert P["attn"].size(0) >= self.n_attn and P["mlp"].size(0) >= L, "banks smaller than the layout"
        assert P["attn_gate_bank"].size(0) == self.n_attn and P["ve_gate_bank"].size(0) == self.n_ve, "gate banks"
        assert P["x0_lambdas"].numel() == L and P["scalars"].numel() >= 3 * L + 3, "lambdas"


def forward(P, A, tokens, cu, training, fp32=False):
    """The loss (a 0-d tensor) and the final hidden state. fp32=False: the record's bf16 arithmetic
    on bf16 P; fp32=True: the reference, P in fp32, fp32 rotary tables and attention."""
    T = int(A["T"][0])
    inp, tgt = tokens[:T], tokens[1:T + 1].long()
    H, Dh, D = 6, 128, 768
    lay = Layout(A)
    L = lay.n
    dt = torch.float32 if fp32 else torch.bfloat16
    freq = torch.tensor(A["freq"], dtype=torch.float32, device=dev)
    attn_scale = A["attn_scale"][0]
    ws_short, ws_long, block = int(A["ws_short"][0]), int(A["ws_long"][0]), int(A["block_size"][0])
    sc = P["scalars"]
    resid, sa = sc[:L], sc[L:3 * L].view(-1, 2)
    smear_l, backout_l, skip_l = sc[3 * L], sc[3 * L + 1], sc[3 * L + 2]
    x0l = P["x0_lambdas"]
    x = P["embed"][inp]
    ve_tables = [P[f"ve{k}"][inp] for k in range(3)]
    ve = [None if k is None else ve_tables[k] for k in lay.ve]
    smear_out = smear_l * torch.sigmoid(x[1:, :12] @ P["smear_gate"].T)
    x = torch.cat([x[:1], x[1:] + smear_out * x[:-1]])
    x = x0 = norm(x[None])
    # the banks' slots in layer order: layer i's is the next slot if it uses that bank, else None
    ag = iter(P["attn_gate_bank"].unbind(0))
    vg = iter(P["ve_gate_bank"].unbind(0))
    aw = iter(P["attn"].unbind(0))
    attn_gates = [next(ag) if lay.attn[i] else None for i in range(L)]
    ve_gates = [next(vg) if ve[i] is not None else None for i in range(L)]
    attn_w = [next(aw) if lay.attn[i] else None for i in range(L)]
    mlp = P["mlp"]
    short_bm, long_bm = ws_short * block, ws_long * block
    bm = [(long_bm if lay.long[i] else short_bm) if lay.attn[i] else None for i in range(L)]
    skip, x_backout = None, None
    lens = (cu[1:] - cu[:-1])
    max_len = int(lens.max())
    for i in range(L):
        if i == lay.skip_out:
            x = x + torch.sigmoid(skip_l) * 2 * torch.sigmoid(x0[..., :12] @ P["skip_gate"].T) * skip
        x = (resid[0] + x0l[0]) * x if i == 0 else resid[i] * x + x0l[i] * x0
        if lay.attn[i]:
            w = attn_w[i]
            xn = norm(x)
            qkv = F.linear(xn, sa[i][0] * w[:3 * D].type_as(xn))
            q, k, v = qkv.view(1, T, 3 * H, Dh).chunk(3, dim=-2)
            q, k = norm(q), norm(k)
            paired = lay.paired[i]
            if paired:
                q, k = q.reshape(1, T, H // 2, 2 * Dh), k.reshape(1, T, H // 2, 2 * Dh)
                v = v.reshape(1, 2 * T, H // 2, Dh)
                f1, f2 = tables(freq, T, True, dt)
                q, k = rotary(q, f1, f2), rotary(k, f1, f2)
                q, k = q.view(1, 2 * T, H // 2, Dh), k.view(1, 2 * T, H // 2, Dh)
            else:
                f1, f2 = tables(freq, T, False, dt)
                q, k = rotary(q, f1, f2), rotary(k, f1, f2)
            if lay.long[i]:  # the long window's partial key offset: key dims 32-63 and 96-127 move one token
                # forward (the record has no long paired layer; its keys, in the same token-major
                # memory, move the same way)
                k = k.reshape(1, T, H, Dh).clone()
                k[:, 1:, :, Dh // 4:Dh // 2] = k[:, :-1, :, Dh // 4:Dh // 2].clone()
                k[:, 1:, :, 3 * Dh // 4:] = k[:, :-1, :, 3 * Dh // 4:].clone()
                k = k.view(1, 2 * T, H // 2, Dh) if paired else k
            if ve[i] is not None:
                g = 2 * torch.sigmoid(F.linear(xn[..., :12], ve_gates[i]))
                if paired:
                    v = v + g.view(1, 2 * T, H // 2, 1) * ve[i].view_as(v)
                else:
                    v = v + g.view(1, T, H, 1) * ve[i].view_as(v)
            m = 2 if paired else 1
            if fp32:
                y = dense_attn(q[0], k[0], v[0], cu * m, attn_scale, bm[i])
            else:
                y = varlen_attn(q[0].contiguous(), k[0].contiguous(), v[0].contiguous(), cu * m, cu * m, max_len * m,
                                max_len * m, scale=attn_scale, window_size=(bm[i], 0))
            y = y.view(1, T, H, Dh)
            y = y * torch.sigmoid(F.linear(xn[..., :12], attn_gates[i])).view(1, T, H, 1)
            y = y.contiguous().view(1, T, D)
            x = x + F.linear(y, sa[i][1] * w[3 * D:].type_as(y))
        xn = norm(x)
        pre = xn.view(T, D) @ mlp[i, 0].T
        post = torch.relu(pre) ** 2
        x = x + (post @ mlp[i, 1]).view(1, T, D)
        if i == lay.skip_in:
            skip = x
        if i == lay.backout:
            x_backout = x
    x = x - backout_l * x_backout
    x = norm(x).view(T, D)
    a, b, c = A["softcap"]
    if training:
        logits = (FP8HeadRef if fp32 else FP8Head).apply(x, P["lm_head"], *A["fp8_scales"][:3])
        z = a * torch.sigmoid((logits.float() + b) / c)
        lse = torch.logsumexp(z, dim=-1)
        loss = torch.zeros(T, device=dev)
        for kk, wk in enumerate(A["mtp"]):
            rows = T - kk
            loss = loss + F.pad(wk * (lse[:rows] - z[torch.arange(rows, device=dev), tgt[kk:kk + rows]]), (0, kk))
        return loss.sum() * A["loss_scale"][0], x
    logits = x @ P["lm_head"]
    logits = a * torch.sigmoid((logits + b) / c)
    return F.cross_entropy(logits.float(), tgt, reduction="mean"), x


def rel(x, ref):
    return ((x.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def pieces(label, t, lay):
    """The parameter and, for the banks, its slices: a bug in one block shows as O(1) error in its
    slice but may hide in the whole. attn[a] and attn_gate_bank[a] are the slots of the attention
    layers in layer order, ve_gate_bank[g] those of the value-embedding layers; mlp[i] is layer i.
    The banks' padding slots (gradient zero) are left out."""
    out = [(label, t)]
    n = {"attn": lay.n_attn, "attn_gate_bank": lay.n_attn, "ve_gate_bank": lay.n_ve}.get(label)
    if n is not None:
        out += [(f"{label}[{i}]", t[i]) for i in range(n)]
    if label == "mlp":
        out += [(f"mlp[{i}].{name}", t[i, j]) for i in range(lay.n) for j, name in enumerate(("fc", "proj"))]
    return out


def main():
    torch.set_float32_matmul_precision("highest")  # no TF32 in the fp32 reference
    d = sys.argv[1]
    P, A, tokens, cu = load(d)
    T, D = int(A["T"][0]), 768
    lay = Layout(A)
    lay.check(P)
    with torch.no_grad():
        print(f"train_loss {forward(P, A, tokens, cu, True)[0].item()!r}")
        eval_loss, hidden_rec = forward(P, A, tokens, cu, False)
        print(f"eval_loss {eval_loss.item()!r}")
    # the fp32 reference: its hidden state and gradients from one training pass
    # copies: .float() of the fp32 params would be P's own tensors, and the record's backward would add to their .grad
    R = {label: t.to(torch.float32, copy=True).requires_grad_(True) for label, t in P.items()}
    loss_ref, hidden_ref = forward(R, A, tokens, cu, True, fp32=True)
    loss_ref.backward()
    hidden_ref = hidden_ref.detach()
    print(f"train_loss_ref {loss_ref.item()!r}")
    with torch.no_grad():
        print(f"eval_loss_ref {forward(R, A, tokens, cu, False, fp32=True)[0].item()!r}")
    theirs = torch.from_numpy(np.fromfile(f"{d}/hidden.bin", dtype=np.int16)).view(torch.bfloat16).to(dev).view(T, D)
    print(f"hidden final {rel(theirs, hidden_ref)!r} {rel(hidden_rec, hidden_ref)!r}")
    e = norm(P["embed"][tokens[:T]].float()[None]).view(T, D)
    print(f"hidden_vs_embedding {rel(e, hidden_ref)!r}")
    if not os.path.exists(f"{d}/grad_embed.bin"):
        return
    ref_grads = {label: t.grad for label, t in R.items()}
    del R
    for t in P.values():
        t.requires_grad_(True)
    forward(P, A, tokens, cu, True)[0].backward()
    for label, t in P.items():
        raw = np.fromfile(f"{d}/grad_{label}.bin", dtype=np.int16 if t.dtype == torch.bfloat16 else np.float32)
        theirs = torch.from_numpy(raw)
        theirs = (theirs.view(torch.bfloat16) if t.dtype == torch.bfloat16 else theirs).to(dev).view(t.shape)
        sliced = zip(pieces(label, theirs, lay), pieces(label, t.grad, lay), pieces(label, ref_grads[label], lay))
        for (name, ours), (_, rec), (_, ref) in sliced:
            print(f"grad {name} {rel(ours, ref)!r} {rel(rec, ref)!r}")


if __name__ == "__main__":
    main()
