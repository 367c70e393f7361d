#!/usr/bin/env python3
"""The trees of the upper-bound runs: the trainer's sources at COMMIT, each variant with one piece of
work dropped or cheapened. The math is wrong on purpose; the data each kernel reads stays realistic
(a pass skipped on all but a step's first micro-step leaves that micro-step's values in its outputs).

usage: variants.py COMMIT OUT_DIR VARIANT [VARIANT ...]   (writes OUT_DIR/VARIANT/{Makefile,*.cu})
"""
import pathlib
import subprocess
import sys

FILES = ("Makefile", "train_gpt.cu", "triton_kernels.cu")

# edits that more than one variant makes: (file, the line as at the commit, what replaces it)
RING = ("triton_kernels.cu", "    return id * p.ds_slots + slot;", "    return (id * p.ds_slots + slot) % 2048;")
O_WITHOUT_C = ("train_gpt.cu", "l.yg, D, wo, D, l.x_attn, D, false, 1.f, 1.f, l.x_mix);", "l.yg, D, wo, D, l.x_attn, D, false);")
CPROJ_WITHOUT_C = ("train_gpt.cu", "l.post, 4 * D, c_proj(i), D, out, D, false, 1.f, 1.f, l.x_attn);",
                   "l.post, 4 * D, c_proj(i), D, out, D, false);")

# variant: [(file, the line as at the commit, what replaces it)]
EDITS = {
    "base": [],
    # the dK/dV pass's dS^T tiles in a 16 MB ring that stays in L2 (dQ wrong), the dQ pass's copies
    # keeping their evict-first hint; "ring" drops the hint too
    "ring_hint": [RING],
    # the dK/dV pass's dS^T tiles in a 16 MB ring that stays in L2 (dQ wrong): the most any L2-resident
    # handoff between the dK/dV and dQ passes could save; the dQ pass's copies without the evict-first hint
    "ring": [
        RING,
        ("triton_kernels.cu", "tk::tma_load_2d_once(sDS + (2 * st + w) * DS_TILE_BYTES",
         "tk::tma_load_2d(sDS + (2 * st + w) * DS_TILE_BYTES"),
    ],
    # no dQ pass at all
    "nodq": [
        ("triton_kernels.cu", "    attn::attn_bwd_dq_kernel<<<grid, attn::DQ_THREADS, attn::DQ_SMEM, stream>>>(p, dq_maps);",
         "    if (0) attn::attn_bwd_dq_kernel<<<grid, attn::DQ_THREADS, attn::DQ_SMEM, stream>>>(p, dq_maps);"),
    ],
    # the loss pass (lse) on a micro-batch's first logit chunk only, its lse reused by the other chunks:
    # what a loss folded into the lm_head GEMM could save at most
    "noloss": [
        ("train_gpt.cu", "            CUDA_CHECK(softcapped_cross_entropy(cp, s));\n            if (training) {",
         "            if (!training || r0 == 0) CUDA_CHECK(softcapped_cross_entropy(cp, s));\n            if (training) {"),
    ],
    # QK norm + rotary, forward and backward, on a step's first micro-step only
    "noqkrope": [
        ("train_gpt.cu", "        CUDA_CHECK(qk_norm_rope_forward(rope_params(i), s));",
         "        if (!fa_.training || fa_.first_micro) CUDA_CHECK(qk_norm_rope_forward(rope_params(i), s));"),
        ("train_gpt.cu", "        CUDA_CHECK(qk_norm_rope_backward(rope_params(i), s));",
         "        if (fa_.first_micro) CUDA_CHECK(qk_norm_rope_backward(rope_params(i), s));"),
    ],
    # the MLP's RMSNorm in attention layers, forward and backward, on a step's first micro-step only
    "nonorm": [
        ("train_gpt.cu", "            if (attn) CUDA_CHECK(rms_norm_forward(",
         "            if (attn && (!fa_.training || fa_.first_micro)) CUDA_CHECK(rms_norm_forward("),
        ("train_gpt.cu", "                CUDA_CHECK(rms_norm_backward(l.x_attn, D, dxn_, D, l.rstd_m, dx_, D, T, D, s, true));",
         "                if (fa_.first_micro) CUDA_CHECK(rms_norm_backward(l.x_attn, D, dxn_, D, l.rstd_m, dx_, D, T, D, s, true));"),
    ],
    # the O and c_proj forward GEMMs without the residual (no C): the residual stream is lost, so the
    # activations (and what their bits cost) are not the trainer's
    "noc": [
        O_WITHOUT_C,
        CPROJ_WITHOUT_C,
    ],
    # not bounds, the simplest correct forms of folding those residuals out of the GEMMs (the record's
    # rounding: the sum of two bf16 values): O without C, its residual added by the MLP's norm pass
    # (combine_norm: reads x_mix and the product, writes x_attn and the norm)
    "o_pass": [
        O_WITHOUT_C,
        ("train_gpt.cu", "            if (attn) CUDA_CHECK(rms_norm_forward(l.x_attn, D, l.xn_m, D, l.rstd_m, T, D, RMS_NORM_EPS, s));",
         "            if (attn) CUDA_CHECK(combine_norm(l.x_attn, l.x_mix, l.x_attn, T, D, {nullptr, 0.f, 1.f}, "
         "{nullptr, 0.f, 1.f}, l.xn_m, l.rstd_m, RMS_NORM_EPS, s));"),
    ],
    # c_proj without C, its residual added by a pass of its own (reads two, writes one)
    "cproj_pass": [
        (CPROJ_WITHOUT_C[0], CPROJ_WITHOUT_C[1], CPROJ_WITHOUT_C[2] + "\n"
         "            CUDA_CHECK(combine(out, l.x_attn, out, TD, {nullptr, 0.f, 1.f}, {nullptr, 0.f, 1.f}, s));"),
    ],
}


def main():
    if len(sys.argv) < 4 or any(v not in EDITS for v in sys.argv[3:]):
        sys.exit(f"usage: variants.py COMMIT OUT_DIR VARIANT [VARIANT ...]; variants: {' '.join(EDITS)}")
    commit, out = sys.argv[1], pathlib.Path(sys.argv[2])
    sources = {f: subprocess.run(["git", "show", f"{commit}:{f}"], check=True, capture_output=True, text=True).stdout
               for f in FILES}
    for v in sys.argv[3:]:
        tree = dict(sources)
        for f, old, new in EDITS[v]:
            if tree[f].count(old) != 1:
                sys.exit(f"{v}: {f} at {commit} does not hold this line once: {old.strip()}")
            tree[f] = tree[f].replace(old, new)
        (out / v).mkdir(parents=True, exist_ok=True)
        for f, text in tree.items():
            (out / v / f).write_text(text)


if __name__ == "__main__":
    main()
