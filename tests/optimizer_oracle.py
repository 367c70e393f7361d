#!/usr/bin/env python3
"""Oracle of record 61's NorMuonAndAdam on one GPU, in plain eager PyTorch, written from the
record's code: Adam with bias correction and cautious weight decay on odd steps, NorMuon (Nesterov
momentum, Polar Express in bf16, second-moment normalisation, cautious update of bf16 weights
through a 16-bit mantissa buffer), the tied embedding and the untie. Reads the initial weights and
each step's gradients that tests/test_gpu writes and runs the same steps twice: as the record
does ("record") and with Polar Express in fp32 ("ref", everything else identical). Polar Express in
bf16 makes a few % of noise in the banks' updates, so the trainer is measured against the fp32
reference: "param <label> <ours> <record>" holds the error of the trainer's (ours) and of the
record's weight change, relative to the reference's weight change, for every parameter and for
each layer's matrices of the banks ("attn[i]": bank row i, "mlp[i].fc", "mlp[i].proj"), and
"state <label>.<kind> <ours> <record>" the same for the state the steps leave (state.txt lists it:
Adam's m and v, NorMuon's momentum buffer and second moment, relative to the reference's, and its
fp32 weights, "shadow", relative to their change).

    python3 tests/optimizer_oracle.py DIR
"""
import sys

import numpy as np
import torch

dev = "cuda"
COEFFS = [(8.156554524902461, -22.48329292557795, 15.878769915207462),
          (4.042929935166739, -2.808917465908714, 0.5000178451051316),
          (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
          (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
          (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)]
TABLE = {  # label: optim, betas, lr_mul, wd_mul
    "attn": ("normuon", None, 1.0, 1.0), "mlp": ("normuon", None, 1.0, 1.0),
    "scalars": ("adam", (0.9, 0.99), 5.0, 0.0),
    "ve0": ("adam", (0.75, 0.95), 75.0, 5.0), "ve1": ("adam", (0.75, 0.95), 75.0, 5.0),
    "ve2": ("adam", (0.75, 0.95), 75.0, 5.0),
    "smear_gate": ("adam", (0.9, 0.99), 0.01, 0.0), "skip_gate": ("adam", (0.9, 0.99), 0.05, 0.0),
    "attn_gate_bank": ("adam", (0.9, 0.99), 1.0, 1.0), "ve_gate_bank": ("adam", (0.9, 0.99), 1.0, 1.0),
    "x0_lambdas": ("adam", (0.65, 0.95), 5.0, 0.0),
    "lm_head": ("adam", (0.5, 0.95), 1.0, 150.0), "embed": ("adam", (0.5, 0.95), 1.0, 150.0),
}
WORK_ORDER = ["scalars", "smear_gate", "skip_gate", "attn_gate_bank", "ve_gate_bank", "x0_lambdas",
              "ve0", "ve1", "ve2", "lm_head", "embed", "attn", "mlp"]
RESHAPE = {}  # NorMuon's view of each bank as (matrices, rows, cols): set from params.txt in main()


def bank_reshape(label, dims):
    """attn (slots, 4 x 768, 768): its q, k, v, o matrices of 768 x 768; mlp (slots, 2, 3072, 768):
    its c_fc and c_proj of 3072 x 768. The slot counts follow the layer table."""
    if label == "attn":
        return (dims[0] * dims[1] // dims[2], dims[2], dims[2])
    return (dims[0] * dims[1], dims[2], dims[3])


def load_tensor(path, dtype, shape):
    if dtype == "bf16":
        t = torch.from_numpy(np.fromfile(path, dtype=np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.fromfile(path, dtype=np.float32))
    return t.reshape(shape).to(dev)


def polar_express(G, dtype):
    X = G.to(dtype)  # the record's bf16, or fp32 for the reference
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * (1 + 2e-2) + 1e-6)
    for a, b, c in COEFFS:
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def run(d, meta, start, polar_dtype):
    """The steps of steps.txt from the weights start; returns the final weights and the state."""
    P = dict(start)  # entries are replaced, never written in place
    steps = [line.split() for line in open(f"{d}/steps.txt")]  # step lr_mult momentum untie
    adam_lr, adam_eps, adam_wd = 0.008, 1e-10, 0.005
    mu_lr, mu_wd, mu_beta2 = 0.023, 1.2, 0.95
    state = {l: {"m": torch.zeros_like(p, dtype=torch.float32), "v": torch.zeros_like(p, dtype=torch.float32), "t": 0}
             for l, p in P.items() if TABLE[l][0] == "adam"}
    for l in RESHAPE:
        n, r, c = RESHAPE[l]
        state[l] = {"buf": torch.zeros(RESHAPE[l], device=dev), "sm": torch.zeros(n, r, 1, device=dev),
                    "mant": torch.zeros(RESHAPE[l], dtype=torch.int64, device=dev)}
    grads = {l: torch.zeros_like(p) for l, p in P.items()}
    split = False
    for k, (step, lr_mult, momentum, untie) in enumerate(steps):
        step, lr_mult, momentum, untie = int(step), float(lr_mult), float(momentum), int(untie)
        for l, t, *dims in meta:  # gradients accumulate (Adam's over two steps)
            grads[l] = grads[l] + load_tensor(f"{d}/grad{k}_{l}.bin", t, tuple(int(x) for x in dims))
        do_adam = step % 2 == 1
        if do_adam and not split:
            grads["lm_head"] = grads["lm_head"] + grads["embed"].T
        for l in WORK_ORDER:
            optim, betas, lr_mul, wd_mul = TABLE[l]
            p = P[l]
            if optim == "adam":
                if not do_adam or (l == "embed" and not split):
                    continue
                st = state[l]
                b1, b2 = betas
                lr = adam_lr * lr_mult * lr_mul
                st["t"] += 1
                bias1, bias2 = 1 - b1 ** st["t"], 1 - b2 ** st["t"]
                step_size, eff_wd = lr * (bias2 ** 0.5 / bias1), lr * lr * adam_wd * wd_mul
                g = grads[l].float()
                st["m"].mul_(b1).add_(g, alpha=1 - b1)
                st["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
                update = st["m"].div(st["v"].sqrt().add_(adam_eps)).mul_(step_size)
                pf = p.float()
                mask = (update * pf) > 0
                update.addcmul_(pf, mask, value=eff_wd)
                P[l] = (pf - update).to(p.dtype)
                if l == "lm_head" and not split:
                    P["embed"] = P["lm_head"].T.contiguous()
            else:
                st = state[l]
                lr = mu_lr * lr_mult
                n = RESHAPE[l][0]
                g = grads[l].view(RESHAPE[l]).float()
                st["buf"].lerp_(g, 1 - momentum)
                g = g.lerp_(st["buf"], momentum)
                v = polar_express(g, polar_dtype)
                v_mean = v.float().square().mean(dim=-1, keepdim=True)
                red = v.size(-1)
                v_norm = (v_mean.sum(dim=(-2, -1), keepdim=True) * red).sqrt()
                st["sm"].lerp_(v_mean, 1 - mu_beta2)
                step_size = st["sm"].clamp_min(1e-10).rsqrt()
                v_norm_new = ((v_mean * red) * step_size.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
                v = v * (step_size * (v_norm / v_norm_new.clamp_min(1e-10))).to(v.dtype)
                per = torch.tensor([(2.0 if (l == "mlp" and i % 2 == 1) else 1.0) for i in range(n)], device=dev)
                shape_mult = max(1.0, RESHAPE[l][1] / RESHAPE[l][2]) ** 0.5
                eff_lr = (shape_mult * lr_mul * per * lr).view(n, 1, 1)
                eff_wd = wd_mul * mu_wd * lr
                raw = ((p.view(RESHAPE[l]).view(torch.int16).to(torch.int64) & 0xFFFF) << 16) | st["mant"]
                x = raw.to(torch.int32).view(torch.float32)
                gv = v.float()
                mask = (gv * x) >= 0
                x = x - (x * mask * eff_wd * eff_lr) - gv * eff_lr
                bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
                st["mant"] = bits & 0xFFFF
                P[l] = ((bits >> 16) & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.bfloat16).view(p.shape)
        for l in P:
            if TABLE[l][0] == "normuon" or do_adam:
                grads[l] = torch.zeros_like(grads[l])
        if untie:
            state["embed"]["m"] = state["lm_head"]["m"].T.contiguous()
            state["embed"]["v"] = state["lm_head"]["v"].T.contiguous()
            state["embed"]["t"] = state["lm_head"]["t"]
            split = True
    return P, state


def state_tensor(P, state, label, kind):
    """A state tensor as the trainer writes it: m, v, buf, sm, or shadow (the fp32 weights)."""
    if kind != "shadow":
        return state[label][kind].float()
    bits = ((P[label].view(RESHAPE[label]).view(torch.int16).to(torch.int64) & 0xFFFF) << 16) | state[label]["mant"]
    return bits.to(torch.int32).view(torch.float32)


def pieces(label, t):
    """The parameter and, for the banks, each layer's matrices: a bug in one shows as O(1) error in
    its slice but may hide in the whole. mlp's padding slot 11 is included: here it has gradients."""
    out = [(label, t)]
    if label == "attn":
        out += [(f"attn[{i}]", t[i]) for i in range(t.size(0))]
    if label == "mlp":
        out += [(f"mlp[{i}].{name}", t[i, j]) for i in range(t.size(0)) for j, name in enumerate(("fc", "proj"))]
    return out


def main():
    torch.set_float32_matmul_precision("highest")  # no TF32 in the fp32 reference
    d = sys.argv[1]
    meta = [line.split() for line in open(f"{d}/params.txt")]
    for l, t, *dims in meta:
        if TABLE[l][0] == "normuon":
            RESHAPE[l] = bank_reshape(l, [int(x) for x in dims])
    start = {l: load_tensor(f"{d}/init_{l}.bin", t, tuple(int(x) for x in dims)) for l, t, *dims in meta}
    record, record_state = run(d, meta, start, torch.bfloat16)
    ref, ref_state = run(d, meta, start, torch.float32)
    for l, t, *dims in meta:
        theirs = load_tensor(f"{d}/final_{l}.bin", t, tuple(int(x) for x in dims))
        sliced = zip(*(pieces(l, x.float()) for x in (theirs, record[l], ref[l], start[l])))
        for (name, ours), (_, rec), (_, r), (_, s0) in sliced:
            change = (r - s0).norm().clamp_min(1e-30)
            print(f"param {name} {((ours - r).norm() / change).item()!r} {((rec - r).norm() / change).item()!r}")
    # the state: relative to the reference's state, the fp32 weights relative to their change
    for line in open(f"{d}/state.txt"):
        l, kind = line.split()
        r = state_tensor(ref, ref_state, l, kind)
        rec = state_tensor(record, record_state, l, kind)
        ours = torch.from_numpy(np.fromfile(f"{d}/state_{l}_{kind}.bin", dtype=np.float32)).to(dev).view(r.shape)
        scale = (r - start[l].float().view(r.shape)) if kind == "shadow" else r
        scale = scale.norm().clamp_min(1e-30)
        print(f"state {l}.{kind} {((ours - r).norm() / scale).item()!r} {((rec - r).norm() / scale).item()!r}")


if __name__ == "__main__":
    main()
