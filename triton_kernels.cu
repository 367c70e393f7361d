// triton_kernels.cu: the custom CUDA kernels of the trainer and their host wrappers, included by
// train_gpt.cu.
//
// Named after record 61's triton_kernels.py, whose kernels it holds, together with the rest of the
// record's forward, backward and optimizer step that is neither a GEMM (cuBLASLt, in train_gpt.cu)
// nor a collective (NCCL): what the record gets from FlashAttention-3, eager torch and torch.compile.
// Each op has a namespace for its kernels, followed by its host wrappers (plain functions returning
// the launch's cudaError_t: what train_gpt.cu calls); an op's forward and backward sit side by side.
// tests/test_gpu.cu checks each, alone against a CPU reference or within the model and optimizer
// oracles. Credits, as the record gives them, are in the sections' comments.
//
// Index (sections in file order): record 61's op        namespace  host wrapper(s)
//   (shared device helpers; the SM count)               tk         num_sms, grid_stride_blocks, allow_smem
//   flash_attn_varlen_func (FA3), forward               attn       attention_forward (attention_schedule,
//                                                                  attention_tiles_bytes)
//   flash_attn_varlen_func (FA3), backward              attn       attention_backward (attention_ds_bytes)
//   FusedSoftcappedCrossEntropy forward                 ce         softcapped_cross_entropy
//     (fused_softcapped_entropy_fwd_kernel; in eval,
//     23 sigmoid((logits + 5) / 7.5) + F.cross_entropy)
//   FusedSoftcappedCrossEntropy backward                ce         softcapped_ce_grad_fp8
//     (fused_softcapped_entropy_bwd_kernel) and the
//     grad.div(grad_s) e5m2 cast of mm_t_backward_op
//   norm = F.rms_norm, forward / backward               rmsnorm    rms_norm_forward / rms_norm_backward
//   linear_relu_square (FusedLinearReLUSquare-          lrs        linear_relu_square_forward /
//     Function): the c_fc GEMM with relu(pre)^2, the               linear_relu_square_backward
//     dpost GEMM with 2 dpost relu(pre)
//   mm_t_op's fp8 casts of x and w (e4m3), row-major    fp8cast    cast_to_fp8
//     and transposed (the backward's x_f8.T, w_f8.T)
//   QK norm + rotary (Yarn, YarnPairedHead) + the       qkrope     rope_table (Yarn's cos/sin tables),
//     key_offset shift: forward / backward                         qk_norm_rope_forward / qk_norm_rope_backward
//   polar_express's X / (||X||_F (1 + 2e-2) + 1e-6)     opt        frobenius_normalize
//   polar_express's X.mT of tall matrices               opt        transpose_bf16
//   NorMuon momentum (_normuon_update's two lerp_)      opt        nesterov_momentum
//   NorMuon _apply_normuon_variance_reduction           opt        normuon_variance (normuon_variance_workspace)
//   NorMuon _cautious_wd_and_update_inplace             opt        normuon_apply
//   Adam _adam_update_step (cautious wd too)            opt        adam_update
//   tied embedding: embed.grad.T into lm_head.grad;     opt        transpose (accumulate / copy)
//     lm_head.data.T into embed.data
//   nn.Embedding forward (embed, value_embeds)          embed      embedding_forward
//   nn.Embedding backward                               embed      EmbeddingBackward::sort, ::accumulate
//   value-embedding gate, forward / backward            gate       gate_forward / gate_backward, ValueEmbedding
//   attention output gate (attn_gate_w)                 gate       gate_forward / gate_backward, Output
//   smear gate                                          gate       gate_forward / gate_backward, Smear
//   skip gate                                           gate       gate_forward / gate_backward, Skip
//   resid_lambdas x + x0_lambdas x0; backout            scal       combine_norm / combine_backward
//     (with the norm after them, in one pass)
//   norm(x)'s backward + the mixing's, in one pass      scal       norm_mix_backward
//   sa_lambdas * qkvo_w (QKV's and O's)                 scal       scale_weight / scale_weight_backward
//   losses.sum() (training); the mean loss (eval)       red        sum_floats
//   mm_t_backward_op's fp32 grad_w into lm_head.grad    red        add_to_bf16
//   NaN / inf check of the layers' outputs (ours)       red        check_finite
// (ValueEmbedding .. Skip: the GateKind argument.)

#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cub/device/device_radix_sort.cuh>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <atomic>
#include <cstdint>

// -----------------------------------------------------------------------------
// Building blocks: wgmma (Hopper warpgroup MMA, bf16 in, fp32 accumulate) and cp.async, bf16 vector
// loads, warp and block sums, and the host's launch helpers (shared memory, the SM count that caps
// the grid-stride grids). Register fragments follow the PTX ISA's wgmma m64nNk16 layouts: warp w of
// the group holds rows 16w..16w+15; accumulator element [n8 tile i][e] sits at row lane/4
// (+8 for e >= 2), column 8i + 2(lane%4) + e%2.

namespace tk {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// Hopper warpgroup MMA (wgmma): 4 warps compute a 64-row tile together, operands read by the
// tensor cores straight from shared memory. Tiles use the 128-byte swizzle (16-byte chunk c of
// row r of a 128-byte row at c ^ (r % 8), 8-row atoms of 1024 bytes, 1024-aligned).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}
// The same descriptor as a base and steps: at(off) = smem_desc(addr + off, lbo, sbo) for any off (a
// multiple of 16) that stays in shared memory (addresses below 2^18, so (addr + off) >> 4 never carries
// into the lbo field): one 32-bit add an MMA operand, where smem_desc's masks, shifts and 64-bit
// halves took the attention loops four or five uniform instructions each.
struct DescBase {
    uint32_t lo, hi;
    __device__ __forceinline__ DescBase(uint32_t addr, uint32_t lbo, uint32_t sbo)
        : lo((uint32_t)smem_desc(addr, lbo, sbo)), hi((uint32_t)(smem_desc(addr, lbo, sbo) >> 32)) {}
    __device__ __forceinline__ uint64_t at(uint32_t off) const {
        uint64_t d;
        asm("mov.b64 %0, {%1, %2};" : "=l"(d) : "r"(lo + (off >> 4)), "r"(hi));
        return d;
    }
};
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// keeps the compiler from moving accumulator uses across the asynchronous MMA
template <int N>
__device__ __forceinline__ void fence_regs(float* d) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// the same for A fragments an MMA in flight reads: they stay live (and unmoved) until this point
template <int N>
__device__ __forceinline__ void fence_regs(uint32_t* a) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i])::"memory");
}
// d (64 x 64) += A (64 x 16, smem, K-major) . B (16 x 64, smem, K-major); ACCUMULATE 0: d = A . B,
// d's registers neither read nor needing zeros
template <int ACCUMULATE = 1>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float* d, uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "n"(ACCUMULATE));
}
// d (64 x 128) += A (64 x 16, registers) . B (16 x 128, smem, N-major)
__device__ __forceinline__ void wgmma_m64n128k16_rs_nmajor(float* d, const uint32_t a[4], uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
// d (64 x 128) += A (64 x 16, smem) . B (16 x 128, smem): both K-major (MN_MAJOR 0: A rows and B^T rows
// hold K, the layout of row-major A and B^T) or both M/N-major (1: A^T and B rows hold M and N)
template <int MN_MAJOR>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float* d, uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %66, %66;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "n"(MN_MAJOR));
}
// the 128 accumulator operands of an m64n256 MMA, and their places in its instruction
#define TK_ACC128(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
#define TK_D128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
// d (64 x 256) = A (64 x 16, smem) . B (16 x 256, smem) + (accumulate ? d : 0), both K-major: B's tile
// read once for 256 columns (the MLP's GEMMs). A tile's first MMA takes accumulate = false: no 128
// registers zeroed before it
__device__ __forceinline__ void wgmma_m64n256k16_ss(float* d, uint64_t da, uint64_t db, bool accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " TK_D128 ", %128, %129, p, 1, 1, 0, 0;\n}\n"
        : TK_ACC128(d)
        : "l"(da), "l"(db), "r"((int)accumulate));
}
__device__ __forceinline__ void wgmma_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// mbarriers and TMA loads (the fused MLP GEMMs' pipeline, the attention kernels' tile copies)
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
// the same, the lines marked first to go from L2 (data read once)
__device__ __forceinline__ void tma_load_2d_once(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
    asm volatile(
        "{\n.reg .b64 pol;\ncreatepolicy.fractional.L2::evict_first.b64 pol, 1.0;\n"
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, %3}], [%4], pol;\n}\n"
        ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
        ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
// A bf16 tensor of `rank` dimensions (dims innermost first, byte strides of the outer ones) as TMA
// boxes of `box` elements, in the 128-byte swizzle that wgmma reads; coordinates past dims read zeros
inline CUresult make_tensor_map(CUtensorMap* map, const void* ptr, int rank, const cuuint64_t* dims,
                                const cuuint64_t* strides, const cuuint32_t* box) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
    if (!encode) {
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", (void**)&encode, 12000, cudaEnableDefault, &q) !=
                cudaSuccess || q != cudaDriverEntryPointSuccess)
            return CUDA_ERROR_NOT_FOUND;
    }
    const cuuint32_t estr[3] = {1, 1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(ptr), dims, strides, box, estr,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}
// a row-major rows x cols bf16 matrix (row stride ld elements) as TMA boxes of box_rows x 64
inline CUresult make_matrix_map(CUtensorMap* map, const void* ptr, int64_t rows, int64_t cols, int64_t ld,
                                int box_rows) {
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)ld * 2};
    const cuuint32_t box[2] = {64, (cuuint32_t)box_rows};
    return make_tensor_map(map, ptr, 2, dims, strides, box);
}

// 2^x on the SFU (ex2.approx.ftz: 2 ulp, results below 2^-126 flushed to zero; exp2f adds range
// fix-ups, instructions that the attention and cross-entropy passes do not need)
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// 2^x on the FMA pipe (FlashAttention 4's software exponential), for passes the SFU bounds: x = j + f
// with j the nearest integer (adding 1.5 * 2^23 rounds it into the low mantissa bits), 2^f on
// [-1/2, 1/2] by a degree-4 polynomial (relative error 2.7e-6, minimax; ex2.approx's is 2 ulp), and j
// added to its exponent bits. For x in [-125, 125] (callers keep it there); 7 operations, none on
// the SFU
__host__ __device__ __forceinline__ float poly_exp2(float x) {
    const float r = x + 12582912.f, f = x - (r - 12582912.f);
    const float p = fmaf(fmaf(fmaf(fmaf(0.009570096619427204f, f, 0.05591785907745361f), f, 0.240247443318367f), f,
                              0.6931217908859253f),
                         f, 0.9999992847442627f);
#ifdef __CUDA_ARCH__
    return __int_as_float(__float_as_int(p) + (__float_as_int(r) << 23));  // r's low bits hold j
#else
    uint32_t pb, rb;  // (the host's: the unit test's)
    memcpy(&pb, &p, 4);
    memcpy(&rb, &r, 4);
    pb += rb << 23;
    float y;
    memcpy(&y, &pb, 4);
    return y;
#endif
}

// tanh on the SFU (tanh.approx: relative error about 2^-11), one operation where the sigmoid takes an
// exp2 and a reciprocal
__device__ __forceinline__ float fast_tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Lets a kernel use more than 48 KB of dynamic shared memory (once: `done` remembers).
template <typename Kernel>
inline cudaError_t allow_smem(Kernel kernel, int bytes, bool& done) {
    if (done) return cudaSuccess;
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    done = e == cudaSuccess;
    return e;
}

// The device's SM count (132 on an H200), queried once per device and kept: it caps the grids of
// the grid-stride kernels at a few CTAs an SM, enough to fill any device (their results do not
// depend on the grid). Where the runtime cannot tell, 132: the H200's, which the caps were tuned on.
inline int num_sms() {
    constexpr int MAX_DEVICES = 64;
    static std::atomic<int> count[MAX_DEVICES];  // zero-initialized: not queried yet
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= MAX_DEVICES) return 132;
    int n = count[dev].load(std::memory_order_relaxed);
    if (n > 0) return n;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) return 132;
    count[dev].store(n, std::memory_order_relaxed);
    return n;
}
// CTAs of 256 threads for a grid-stride loop over n items: one item a thread, at most per_sm CTAs an SM
inline unsigned grid_stride_blocks(int64_t n, int per_sm) {
    return (unsigned)std::min<int64_t>((n + 255) / 256, (int64_t)num_sms() * per_sm);
}

// 16-byte async copy global -> shared; src_bytes 0 fills the 16 bytes with zeros
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
// an arrival on the mbarrier once this thread's earlier cp.async copies have landed (one of the arrivals
// its count expects)
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// this thread's copies but the last N groups have landed (a compiler barrier too: its reads come after)
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// four 8 x 8 b16 matrices from a warp's mma fragments (register j: matrix j) into shared memory,
// lane i giving the address of row i % 8 of matrix i / 8
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t r[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
                 "r"(r[2]), "r"(r[3])
                 : "memory");
}
// 16 bytes to global memory in one store (a uint4 assignment through a computed pointer can come
// out of the compiler as four 4-byte stores)
__device__ __forceinline__ void stg128(void* p, uint4 v) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
// 16 bytes from shared memory
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// Sum of v over the warp (or over each 16-lane half), in every lane: the same butterfly order
// every run.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}
__device__ __forceinline__ float half_warp_sum(float v) {
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// Sum of v over the block, valid in thread 0: warps first, then the warp totals in order (the
// same bits every run). red: 32 floats of shared memory; has a __syncthreads.
__device__ __forceinline__ float block_sum0(float v, float* red) {
    v = tk::warp_sum(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    float t = 0.f;
    if (threadIdx.x == 0)
        for (int w = 0; w < (int)blockDim.x / 32; ++w) t += red[w];
    return t;
}

// 8 bf16 (one 16-byte access) to and from fp32
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float f[8]) {
    uint4 u = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float2 t = __bfloat1622float2(h[k]);
        f[2 * k] = t.x, f[2 * k + 1] = t.y;
    }
}
// 8 fp32 (two 16-byte accesses; p 16-byte aligned)
__device__ __forceinline__ void load8(const float* p, float f[8]) {
    const float4 lo = reinterpret_cast<const float4*>(p)[0], hi = reinterpret_cast<const float4*>(p)[1];
    f[0] = lo.x, f[1] = lo.y, f[2] = lo.z, f[3] = lo.w, f[4] = hi.x, f[5] = hi.y, f[6] = hi.z, f[7] = hi.w;
}
__device__ __forceinline__ void store8(__nv_bfloat16* p, const float f[8]) {
    uint4 u;
    u.x = pack_bf16(f[0], f[1]), u.y = pack_bf16(f[2], f[3]), u.z = pack_bf16(f[4], f[5]), u.w = pack_bf16(f[6], f[7]);
    *reinterpret_cast<uint4*>(p) = u;
}

}  // namespace tk

// -----------------------------------------------------------------------------
// Attention: what record 61 gets from FlashAttention-3's flash_attn_varlen_func with causal=True
// and window_size=(window, 0): query i sees key j of the same sequence iff i - window <= j <= i.
// bf16 q, k, v of (positions, heads, 128) with any position stride (so q, k, v can be views of
// one QKV buffer), sequences given by cu_seqlens (int32, padded with repeated final values, each
// entry times cu_mult: 2 for the paired-head layout, whose 2T positions interleave head pairs).
// Online-softmax tiles (FlashAttention-2 schedule) on Hopper wgmma, the MMAs asynchronous where one
// can run behind another; the backward is deterministic, no atomic sums: dK/dV by key tile, which also
// stores each tile pair's dS^T, then dQ by pairs of query tiles from those dS^T (one product per pair, as
// FlashAttention's atomic dQ has, where recomputing S and dP would take three). (In the record:
// flash_attn over flex_attn by @varunneal, flash_attn_varlen suggested by @YouJiacheng.)

namespace attn {

constexpr int D = 128;        // head dim
constexpr int BLOCK = 64;     // queries (or keys) per CTA and keys (or queries) per inner tile
constexpr int THREADS = 128;  // 4 warps, 16 rows each
constexpr int TILE_BYTES = BLOCK * D * 2;
constexpr int DS_PITCH = BLOCK * 2 + 16;  // bytes a row of dS^T staged in shared memory (conflict-free)
constexpr float LOG2E = 1.4426950408889634f;
constexpr float RESCALE_LOG2 = 8.f;  // the forward moves a row's softmax maximum once it grows by 2^8

struct Params {
    const __nv_bfloat16 *q, *k, *v;
    int64_t q_stride, k_stride, v_stride;  // elements between positions; heads are D apart
    __nv_bfloat16* o;
    int64_t o_stride;
    float* lse;  // (heads, positions), natural log
    const int* cu_seqlens;
    int cu_len;      // entries of cu_seqlens (sequences + 1)
    int cu_mult;     // positions per cu_seqlens unit
    int positions;   // total positions
    int heads;
    int window;      // left window in positions
    float scale;     // softmax scale
    // v's and dv's rows: position p at row p >> v_shift (rows v_stride, dv_stride apart), plus
    // (p & v_shift) * v_half elements: 1 and 384 read the paired layout's 2T positions in place
    // from T token rows of 768 (position 2t the row's first half, 2t + 1 its second); 0: one row
    // per position
    int v_shift;
    int64_t v_half;
    // backward
    const __nv_bfloat16* dout;
    int64_t dout_stride;
    __nv_bfloat16 *dq, *dk, *dv;
    int64_t dq_stride, dk_stride, dv_stride;
    float* delta;  // (heads, positions) workspace: rowsum(dout * out)
    int4* tiles;   // workspace of attention_tiles_bytes(): the tile schedule the forward writes
    __nv_bfloat16* ds;  // workspace of attention_ds_bytes(): the dK/dV pass's dS^T tiles, for dQ
    int ds_slots;       // query tiles a key tile can meet (set by attention_backward)
};

// Tile schedule: every 64-row tile of every sequence as {seq start, seq end, tile start, sequence}, in two
// orders, heaviest first so the last wave is short: by query tile (forward, dQ: later tiles of a
// sequence see more keys) and by key tile (dK/dV: earlier tiles are seen by more queries).
// tiles[0].x holds the count (.y and .z 0: the dK/dV pass's counters); the lists follow at tiles + 1
// and tiles + 1 + max_tiles.
__host__ __device__ inline int max_tiles(int positions, int cu_len) { return positions / BLOCK + cu_len; }
// dS^T tiles: the backward's dK/dV pass keeps each (key tile, query tile) pair's dS^T (64 x 64
// bf16, rows = keys) for the dQ pass, which then needs one product per pair where it would need
// three (S and dP again, then dS K). A key tile meets at most ds_slots query tiles (its own and
// those its window reaches, no more than a sequence has), stored at slot (query tile - key tile).
// A key tile's id within its head: tiles start at s0 + 64 t, so k0 / 64 plus the sequence index
// grows from one tile to the next, across sequences too, and stays below max_tiles.
__host__ __device__ inline int ds_slots(int positions, int window) {
    return (window < positions ? window : positions) / BLOCK + 2;
}
__host__ __device__ __forceinline__ int64_t ds_index(const Params& p, int h, int k0, int seq, int slot) {
    const int64_t id = (int64_t)h * max_tiles(p.positions, p.cu_len) + k0 / BLOCK + seq;
    return id * p.ds_slots + slot;
}
__device__ __forceinline__ __nv_bfloat16* ds_tile(const Params& p, int h, int k0, int seq, int slot) {
    return p.ds + ds_index(p, h, k0, seq, slot) * (BLOCK * BLOCK);
}

constexpr int SCHED_BUCKETS = 128;

__global__ void __launch_bounds__(1024) attn_schedule_kernel(const Params p) {
    __shared__ int hist_q[SCHED_BUCKETS], hist_k[SCHED_BUCKETS];
    const int cap = min(SCHED_BUCKETS - 1, p.window / BLOCK + 2);  // tiles past this cost the same
    const int nseq = p.cu_len - 1, mt = max_tiles(p.positions, p.cu_len);
    for (int b = threadIdx.x; b < SCHED_BUCKETS; b += blockDim.x) hist_q[b] = hist_k[b] = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < nseq; s += blockDim.x) {
        int a = p.cu_seqlens[s] * p.cu_mult, e = p.cu_seqlens[s + 1] * p.cu_mult;
        int n = e > a ? (e - a + BLOCK - 1) / BLOCK : 0;
        for (int t = 0; t < n; ++t) {
            atomicAdd(&hist_q[min(t, cap)], 1);
            atomicAdd(&hist_k[min(n - 1 - t, cap)], 1);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // bucket offsets, heaviest bucket first
        int oq = 0, ok = 0;
        for (int b = cap; b >= 0; --b) {
            int tq = hist_q[b], tk = hist_k[b];
            hist_q[b] = oq, hist_k[b] = ok;
            oq += tq, ok += tk;
        }
        p.tiles[0] = make_int4(oq, 0, 0, 0);
    }
    __syncthreads();
    for (int s = threadIdx.x; s < nseq; s += blockDim.x) {
        int a = p.cu_seqlens[s] * p.cu_mult, e = p.cu_seqlens[s + 1] * p.cu_mult;
        int n = e > a ? (e - a + BLOCK - 1) / BLOCK : 0;
        for (int t = 0; t < n; ++t) {  // order within a bucket does not matter: tiles are independent
            int iq = atomicAdd(&hist_q[min(t, cap)], 1), ik = atomicAdd(&hist_k[min(n - 1 - t, cap)], 1);
            p.tiles[1 + iq] = make_int4(a, e, a + t * BLOCK, s);
            p.tiles[1 + mt + ik] = make_int4(a, e, a + t * BLOCK, s);
        }
    }
}

// A 64 x 128 bf16 tile in shared memory: two 64 x 64 halves (columns 0-63, 64-127) of 8 KB,
// each in the 128-byte swizzle layout that wgmma reads (K-major when rows are M or N, N-major when
// rows are K). Tiles start 1024-aligned.
__device__ __forceinline__ uint32_t tile_addr(uint32_t base, int row, int col) {
    return base + (col >> 6) * (BLOCK * 128) + row * 128 + ((((col >> 3) & 7) ^ (row & 7)) << 4) + (col & 7) * 2;
}

// element offset of position g's row: g >> shift rows of stride, plus (g & shift) * half (shift 0 or 1)
__device__ __forceinline__ int64_t row_offset(int g, int64_t stride, int shift, int64_t half) {
    return (int64_t)(g >> shift) * stride + (g & shift) * half;
}

// Async copy of rows [row0, row0 + 64) of one head into a tile; rows >= row_end are zeros.
// A thread copies 16 bytes of every ROWS-th row from its first: ROWS is even, so from one row to the
// next the source moves by (ROWS >> shift) rows of stride and the swizzle (row & 7) stays, and the
// addresses are one offset and one step (the loops' per-iteration instructions were mostly these).
__device__ __forceinline__ void load_tile(uint32_t smem, const __nv_bfloat16* base, int64_t stride, int row0,
                                          int row_end, int shift = 0, int64_t half = 0) {
    constexpr int ROWS = THREADS / 16;
    static_assert(ROWS % 8 == 0, "the swizzle repeats every 8 rows");
    const int tid = threadIdx.x, chunk = tid & 15, g0 = row0 + (tid >> 4);
    const __nv_bfloat16* src = base + row_offset(g0, stride, shift, half) + chunk * 8;
    const int64_t step = (int64_t)(ROWS >> shift) * stride;
    const uint32_t dst = tile_addr(smem, tid >> 4, chunk * 8);
#pragma unroll
    for (int i = 0; i < BLOCK / ROWS; ++i) {
        const bool ok = g0 + i * ROWS < row_end;
        tk::cp_async16(dst + i * ROWS * 128, ok ? src + i * step : base, ok ? 16 : 0);
    }
}

// acc (64 x 64: this thread's [8][4] fragments) = A (64 x 128 tile) . B^T (B: 64 x 128 tile), both
// tiles row-major in the head dim (K-major); acc must hold zeros on entry. The _issue forms start
// the MMAs as one commit group and return: the tiles and acc stay untouched until a wgmma wait
// covers the group (then fence_regs on acc, and on the A fragments of gemm_pb_issue).
// d (+)= A . B^T over the head dim, 16 at a time; OVERWRITE: the first k-step writes d (no zeros needed)
template <bool OVERWRITE>
__device__ __forceinline__ void abt_mmas(float* d, uint32_t a_tile, uint32_t b_tile) {
    const tk::DescBase a(a_tile, 16, 1024), b(b_tile, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t off = (kk >> 2) * (BLOCK * 128) + (kk & 3) * 32;
        const uint64_t da = a.at(off), db = b.at(off);
        if (OVERWRITE && kk == 0) tk::wgmma_m64n64k16_ss<0>(d, da, db);
        else tk::wgmma_m64n64k16_ss(d, da, db);
    }
}
template <bool OVERWRITE = false>
__device__ __forceinline__ void gemm_abt_issue(float acc[8][4], uint32_t a_tile, uint32_t b_tile) {
    float* d = &acc[0][0];
    tk::fence_regs<32>(d);
    tk::wgmma_fence();
    abt_mmas<OVERWRITE>(d, a_tile, b_tile);
    tk::wgmma_commit();
}
__device__ __forceinline__ void gemm_abt(float acc[8][4], uint32_t a_tile, uint32_t b_tile) {
    gemm_abt_issue(acc, a_tile, b_tile);
    tk::wgmma_wait_all();
    tk::fence_regs<32>(&acc[0][0]);
}
// acc (64 x 128: [16][4] fragments) += P (64 x 64, bf16 A fragments) . B (64 x 128 tile, rows = K): the
// MMAs alone, for a group whose registers were fenced before an earlier wgmma_fence
__device__ __forceinline__ void pb_mmas(float acc[16][4], uint32_t pf[4][4], uint32_t b_tile) {
    const tk::DescBase b(b_tile, BLOCK * 128, 1024);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) tk::wgmma_m64n128k16_rs_nmajor(&acc[0][0], pf[ks], b.at(ks * 2048));
}
__device__ __forceinline__ void gemm_pb_issue(float acc[16][4], uint32_t pf[4][4], uint32_t b_tile) {
    float* d = &acc[0][0];
    tk::fence_regs<64>(d);
    tk::fence_regs<16>(&pf[0][0]);
    tk::wgmma_fence();
    pb_mmas(acc, pf, b_tile);
    tk::wgmma_commit();
}
// after a wait: the accumulators of the MMAs it covered, and the A fragments they read
__device__ __forceinline__ void settle(float acc[16][4], uint32_t pf[4][4]) {
    tk::fence_regs<64>(&acc[0][0]);
    tk::fence_regs<16>(&pf[0][0]);
}

// Stores a warp's 16 x 64 bf16 tile, held as mma fragments (f[kk]: the 8 x 8 blocks at rows 0 / 8,
// columns 16 kk / 16 kk + 8), to rows row0.. of base (row_offset's layout); rows >= row_end are
// skipped. Through the warp's 16 rows of shared memory at stage (DS_PITCH apart, free on entry): in by
// stmatrix, out as 16-byte pieces of whole rows, four stores a thread where the 4-byte pairs took sixteen.
__device__ __forceinline__ void store_frag_rows(uint32_t stage, const uint32_t f[4][4], __nv_bfloat16* base, int64_t stride,
                                                int row0, int row_end, int shift = 0, int64_t half = 0) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
        tk::stmatrix_x4(stage + ((lane & 7) + 8 * ((lane >> 3) & 1)) * DS_PITCH + (16 * kk + 8 * (lane >> 4)) * 2, f[kk]);
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int c = lane + 32 * i, row = c >> 3, chunk = c & 7;
        if (row0 + row < row_end)
            tk::stg128(base + row_offset(row0 + row, stride, shift, half) + 8 * chunk, tk::lds128(stage + row * DS_PITCH + 16 * chunk));
    }
    __syncwarp();  // read before the next stmatrix
}
// Stores a warp's 16 x 128 fp32 accumulator rows as bf16 (times mul_lo on its rows 0-7, mul_hi on
// 8-15), 64 columns at a time through store_frag_rows; rows >= row_end are skipped.
__device__ __forceinline__ void store_rows(uint32_t stage, __nv_bfloat16* base, int64_t stride, int row0, int row_end,
                                           const float acc[16][4], float mul_lo, float mul_hi, int shift = 0,
                                           int64_t half = 0) {
#pragma unroll
    for (int hc = 0; hc < 2; ++hc) {
        uint32_t f[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const float *a = acc[8 * hc + 2 * kk], *b = acc[8 * hc + 2 * kk + 1];
            f[kk][0] = tk::pack_bf16(a[0] * mul_lo, a[1] * mul_lo), f[kk][1] = tk::pack_bf16(a[2] * mul_hi, a[3] * mul_hi);
            f[kk][2] = tk::pack_bf16(b[0] * mul_lo, b[1] * mul_lo), f[kk][3] = tk::pack_bf16(b[2] * mul_hi, b[3] * mul_hi);
        }
        store_frag_rows(stage, f, base + 64 * hc, stride, row0, row_end, shift, half);
    }
}

// C fragments of a 16 x 64 fp32 tile -> bf16 A fragments of the same 16 x 64 (4 k-steps)
__device__ __forceinline__ void to_a_frags(uint32_t pf[4][4], const float s[8][4]) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        pf[kk][0] = tk::pack_bf16(s[2 * kk][0], s[2 * kk][1]);
        pf[kk][1] = tk::pack_bf16(s[2 * kk][2], s[2 * kk][3]);
        pf[kk][2] = tk::pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pf[kk][3] = tk::pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
}

// The visible keys of query i in sequence [.., s1): i - window <= j <= min(i, s1 - 1) (a query
// past the end sees keys of no other sequence; its row is never stored). As bounds on the column
// c of a 64-key tile at k0 whose thread columns start at cb: lo <= c <= hi.
struct ColumnRange {
    int lo, hi;
};
__device__ __forceinline__ ColumnRange query_columns(const Params& p, int i, int s1, int k0, int cb) {
    return {i - p.window - k0 - cb, min(i, s1 - 1) - k0 - cb};
}
// The queries that see key j, as columns of a 64-query tile at q0: j <= i <= min(j + window,
// s1 - 1); none for a key past the end.
__device__ __forceinline__ ColumnRange key_columns(const Params& p, int j, int s1, int q0, int cb) {
    return j < s1 ? ColumnRange{j - q0 - cb, min(j + p.window, s1 - 1) - q0 - cb} : ColumnRange{1, 0};
}
__device__ __forceinline__ bool in_range(ColumnRange r, int c) { return c >= r.lo && c <= r.hi; }
// s's scores outside the rows' column ranges (r0: the thread's rows 0-7, r1: 8-15) set to -inf. Called
// under its own branch, only for tiles that need a mask: with the test inside the softmax loop ptxas
// computed the 64 predicates on every tile (predicated off, but issued) and kept them packed in a
// register, about a third of the forward's instructions.
__device__ __forceinline__ void mask_scores(float s[8][4], ColumnRange r0, ColumnRange r1) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (!in_range(e >> 1 ? r1 : r0, nt * 8 + (e & 1))) s[nt][e] = -INFINITY;
}

// The key tiles the query tile [q0, q0 + 64) of sequence [s0, s1) sees: nblocks from kb_first
// (tiles aligned to the sequence start).
__host__ __device__ __forceinline__ void key_blocks(const Params& p, int s0, int s1, int q0, int& kb_first, int& nblocks) {
    const int q_end = min(q0 + BLOCK, s1);
    const int k_lo = max(s0, q0 - p.window);
    kb_first = s0 + (k_lo - s0) / BLOCK * BLOCK;
    nblocks = (q_end - kb_first + BLOCK - 1) / BLOCK;
}
// The query tiles that see the key tile [k0, k0 + 64) of a sequence ending at s1: k0, k0 + 64, ..
__host__ __device__ __forceinline__ int query_blocks(const Params& p, int s1, int k0) {
    const int k_end = min(k0 + BLOCK, s1);
    const int q_hi = (int)min((int64_t)s1, (int64_t)k_end + p.window);  // queries [k0, q_hi) see this tile
    return (q_hi - k0 + BLOCK - 1) / BLOCK;
}
// whether some (query, key) pair of the tiles is not visible: past the diagonal, out of the
// window, or a key past the sequence end
__device__ __forceinline__ bool key_tile_needs_mask(const Params& p, int q0, int k0, int s1) {
    return k0 + BLOCK - 1 > q0 || k0 < q0 + BLOCK - 1 - p.window || k0 + BLOCK > s1;
}

// ---- forward: one CTA per (64-query tile, head) ----
// The MMAs run asynchronously, and the softmax of one key tile runs under the P V of the one before
// (FlashAttention 3's intra-warpgroup overlap): iteration nb issues S = Q K^T of tile nb, then P V of
// tile nb - 1, waits for S alone, refills the free slots, does the softmax, and only then waits for
// the P V (O is rescaled after it). One slot holds K (tile nb + 1 comes there once every warp's S of
// tile nb is done), two hold V (tile nb where tile nb - 2 was). With 64 KB of tiles three CTAs fit
// an SM (the kernel waits on latency, not on the tensor cores, and a third CTA hides more of it).
// The tiles come by TMA (one thread issues a tile's two 64-column boxes; no thread computes an
// address): q and k as (positions, heads x 128) maps, v as (rows, positions a row, heads x 128), the
// paired layout's two positions a row its middle dimension. Rows past the sequence hold the next
// one's (finite) values where load_tile wrote zeros: their keys are masked, and P is 0 on them.
struct FwdMaps {
    CUtensorMap q, k, v;
};
__device__ __forceinline__ void tma_tile(uint32_t dst, const CUtensorMap* map, int col, int row, uint32_t bar) {
    tk::tma_load_2d(dst, map, col, row, bar);
    tk::tma_load_2d(dst + BLOCK * 128, map, col + 64, row, bar);
}
__device__ __forceinline__ void tma_v_tile(uint32_t dst, const CUtensorMap* map, int col, int row, int shift,
                                           uint32_t bar) {
    tk::tma_load_3d(dst, map, col, 0, row >> shift, bar);
    tk::tma_load_3d(dst + BLOCK * 128, map, col + 64, 0, row >> shift, bar);
}

__device__ __forceinline__ void attn_fwd_tile(const Params& p, const FwdMaps& maps, unsigned char* smem, int s0, int s1,
                                              int q0) {
    const int h = blockIdx.y, col = h * D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint32_t sQ = tk::smem_u32(smem), kt = sQ + TILE_BYTES;
    // K of tile nb (Q with the first) arrives on bark (parity nb & 1); V of tile nb in its slot, on
    // barv + 8 (nb & 1) (parity (nb >> 1) & 1)
    const uint32_t bark = sQ + 4 * TILE_BYTES, barv = bark + 8;
    auto vslot = [&](int nb) { return sQ + (2 + (nb & 1)) * TILE_BYTES; };
    auto wait_v = [&](int nb) { tk::mbar_wait(barv + 8 * (nb & 1), (nb >> 1) & 1); };

    int kb_first, nblocks;
    key_blocks(p, s0, s1, q0, kb_first, nblocks);

    if (threadIdx.x == 0) {
        tk::mbar_init(bark, 1);
        tk::mbar_init(barv, 1);
        tk::mbar_init(barv + 8, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        tk::mbar_expect_tx(bark, 2 * TILE_BYTES);
        tma_tile(sQ, &maps.q, col, q0, bark);
        tma_tile(kt, &maps.k, col, kb_first, bark);
    }
    __syncthreads();  // the barriers initialized before anyone waits on them

    const float sl2 = p.scale * LOG2E;
    float o[16][4] = {};
    uint32_t pf[4][4] = {};  // P of tile nb - 1: read by its P V, issued in iteration nb, until the wait after the softmax
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    const int row_lo = q0 + warp * 16 + (lane >> 2);  // this thread's rows: row_lo, row_lo + 8
    const int cb = (lane & 3) * 2;                     // and its first column in each 8-column group

    for (int nb = 0; nb < nblocks; ++nb) {
        const int k0 = kb_first + nb * BLOCK;
        tk::mbar_wait(bark, nb & 1);  // K of tile nb (and Q) has landed
        float s[8][4];  // written whole by the MMAs' first k-step
        // one wgmma_fence for both groups: no instruction between them may define their registers
        // (ptxas would serialize the MMAs), so O and P are fenced before S's MMAs
        tk::fence_regs<32>(&s[0][0]);
        tk::fence_regs<64>(&o[0][0]);
        tk::fence_regs<16>(&pf[0][0]);
        tk::wgmma_fence();
        abt_mmas<true>(&s[0][0], sQ, kt);
        tk::wgmma_commit();
        if (nb > 0) {
            wait_v(nb - 1);
            pb_mmas(o, pf, vslot(nb - 1));
            tk::wgmma_commit();
            tk::wgmma_wait1();  // S (the P V goes on)
        } else {
            tk::wgmma_wait_all();
        }
        tk::fence_regs<32>(&s[0][0]);
        __syncthreads();  // every warp's S is done (K's slot is free), and every P V of tile nb - 2 (its V's)
        if (threadIdx.x == 0) {
            if (nb + 1 < nblocks) {
                tk::mbar_expect_tx(bark, TILE_BYTES);
                tma_tile(kt, &maps.k, col, k0 + BLOCK, bark);
            }
            const uint32_t bar = barv + 8 * (nb & 1);
            tk::mbar_expect_tx(bar, TILE_BYTES);
            tma_v_tile(vslot(nb), &maps.v, col, k0, p.v_shift, bar);
        }

        if (key_tile_needs_mask(p, q0, k0, s1))
            mask_scores(s, query_columns(p, row_lo, s1, k0, cb), query_columns(p, row_lo + 8, s1, k0, cb));
        // the rows' maxima of the raw scores (the scale is positive: the same keys as the scaled ones')
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
        bool grow = false;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            mx[r] *= sl2;  // (-inf stays -inf)
            grow |= mx[r] > m[r] + RESCALE_LOG2;
        }
        // Lazy rescaling (FlashAttention 4): a row keeps its stale maximum m while the tile's stays within
        // 2^RESCALE_LOG2 of it (its exponentials then reach at most that, far from fp32's or bf16's
        // limits; l and O are sums over the same m, so O / l is the same softmax, and lse = m + log l);
        // only where some row of the warp grows further are m, l and O moved to the new maxima (the
        // 64 multiplications of O a tile, which the stale maxima skip on most tiles). O's wait for the
        // P V in flight comes after this tile's exponentials.
        const bool warp_grows = __any_sync(0xffffffffu, grow);
        float alpha[2] = {1.f, 1.f};
        if (warp_grows) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float mn = fmaxf(m[r], mx[r]);
                alpha[r] = tk::fast_exp2(m[r] - (mn == -INFINITY ? 0.f : mn));  // (0 while m is -inf)
                m[r] = mn;
                l[r] *= alpha[r];
            }
        }
        float mu[2];  // 0 for a row with nothing visible yet (its scores are all -inf)
#pragma unroll
        for (int r = 0; r < 2; ++r) mu[r] = m[r] == -INFINITY ? 0.f : m[r];
        float rs[2] = {0.f, 0.f};
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                // the scale and the maximum in one FMA (-inf gives 2^-inf = 0)
                const float pv = tk::fast_exp2(fmaf(s[nt][e], sl2, -mu[e >> 1]));
                s[nt][e] = pv;
                rs[e >> 1] += pv;
            }
#pragma unroll
        for (int r = 0; r < 2; ++r) l[r] += rs[r];
        uint32_t pn[4][4];
        to_a_frags(pn, s);
        tk::wgmma_wait_all();  // the P V of tile nb - 1: O and its P are free
        settle(o, pf);
        if (warp_grows) {
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int dt = 0; dt < 16; ++dt) o[dt][2 * r] *= alpha[r], o[dt][2 * r + 1] *= alpha[r];
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) pf[kk][e] = pn[kk][e];
    }
    if (nblocks > 0) {  // the last tile's P V
        wait_v(nblocks - 1);
        gemm_pb_issue(o, pf, vslot(nblocks - 1));
        tk::wgmma_wait_all();
        settle(o, pf);
    }

    float inv[2], lse[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        inv[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
        lse[r] = l[r] > 0.f ? (m[r] + log2f(l[r])) / LOG2E : -INFINITY;
    }
    // staged in this warp's rows of Q's tile: only S's MMAs read it, and every warp waited for the last
    // one before the last iteration's barrier
    store_rows(sQ + warp * 16 * DS_PITCH, p.o + h * D, p.o_stride, q0 + warp * 16, s1, o, inv[0], inv[1]);
    if ((lane & 3) == 0) {
        if (row_lo < s1) p.lse[(int64_t)h * p.positions + row_lo] = lse[0];
        if (row_lo + 8 < s1) p.lse[(int64_t)h * p.positions + row_lo + 8] = lse[1];
    }
}

// ---- backward preprocess: delta = rowsum(dout * out), one warp per (position, head) ----
__global__ void attn_bwd_delta_kernel(const Params p) {
    const int64_t w = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (w >= (int64_t)p.positions * p.heads) return;
    const int i = (int)(w / p.heads), h = (int)(w % p.heads);
    const uint2 a = *reinterpret_cast<const uint2*>(p.dout + i * p.dout_stride + h * D + lane * 4);
    const uint2 b = *reinterpret_cast<const uint2*>(p.o + i * p.o_stride + h * D + lane * 4);
    const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
    const __nv_bfloat162* b2 = reinterpret_cast<const __nv_bfloat162*>(&b);
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        float2 x = __bfloat1622float2(a2[k]), y = __bfloat1622float2(b2[k]);
        sum += x.x * y.x + x.y * y.y;
    }
    sum = tk::warp_sum(sum);
    if (lane == 0) p.delta[(int64_t)h * p.positions + i] = sum;
}

// this thread's float of 64 of a (heads, positions) row from i0 (threads below 64; past the end: 0)
__device__ __forceinline__ float fetch_row_stat(const float* src, int i0, int end) {
    const int t = threadIdx.x;
    return t < BLOCK && i0 + t < end ? src[i0 + t] : 0.f;
}
// loads 64 floats of a (heads, positions) row into shared memory, log2-scaled; past the end: 0
__device__ __forceinline__ void load_row_stats(float* dst, const float* src, int i0, int end, float mul) {
    if (threadIdx.x < BLOCK) dst[threadIdx.x] = fetch_row_stat(src, i0, end) * mul;
}

// ---- backward dK, dV: per (64-key tile, head), over the query tiles that see it ----
// Per query tile: S^T = K Q^T and dP^T = V dO^T issued together, then P^T and dS^T, then dV += P^T dO
// (waited for in the iteration) and dK += dS^T Q, left in flight into the next iteration, where the
// wait for S^T covers it; the refill of the other Q and dO buffers (which dK read) waits for it too.
// (Both products once left in flight across the back edge made ptxas serialize every wgmma of the
// kernel, its C7515 warning, 8 ms more a 393k step; dK alone, with the fences before each group's
// first MMA, compiles without.)
// dS^T also goes to p.ds for the dQ pass.
// Persistent: two CTAs an SM (the registers and shared memory allow two) over the (head, key tile)
// items, head by head, each head's tiles heaviest first; a CTA takes the next item when it starts
// one (an atomic counter, two items ahead), so the CTAs work on one or two heads at a time and the
// heads' Q and dO tiles stay in L2 (all six heads at once, each CTA its head's tiles in a fixed
// order, read them from DRAM several times over), and the lightest items come last. The order of
// the items does not change a bit: every item writes its own dK, dV and dS^T rows. A tile's last
// iteration issues the next item's K, V and first Q and dO tiles, so their copies run under its
// last products and its dK / dV stores (one CTA a tile spent about a quarter of its warps' time in
// its first loads and last stores).
// the dK/dV pass's maps: the forward's and dout's (as q's)
struct BwdMaps {
    FwdMaps f;
    CUtensorMap dout;
};
constexpr int BWD_CTAS_PER_SM = 2;
// The items' counter: tiles[0].y, the next item past the CTAs' first ones; tiles[0].z counts the
// CTAs that have finished, and the last one sets both back to 0 (as the schedule leaves them) for
// the next launch on this schedule.
__device__ __forceinline__ int next_item(const Params& p) { return gridDim.x + atomicAdd(&p.tiles[0].y, 1); }
__device__ __forceinline__ void items_done(const Params& p) {
    if (threadIdx.x != 0) return;
    __threadfence();  // this CTA's counter increments before its count of the finished
    if (atomicAdd(&p.tiles[0].z, 1) == (int)gridDim.x - 1) {
        atomicExch(&p.tiles[0].y, 0);
        atomicExch(&p.tiles[0].z, 0);
    }
}
// item e: key tile e % count (of the list by key tile, heaviest first) of head e / count
struct Item {
    int4 t;  // {seq start, seq end, tile start, sequence}
    int h;
};
__device__ __forceinline__ Item item_at(const Params& p, int e, int count) {
    return {p.tiles[1 + max_tiles(p.positions, p.cu_len) + e % count], e / count};
}
__device__ __forceinline__ void attn_bwd_dkdv_tiles(const Params& p, const BwdMaps& maps, unsigned char* smem) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int count = p.tiles[0].x, items = count * p.heads;
    if ((int)blockIdx.x >= items) return items_done(p);
    const uint32_t sK = tk::smem_u32(smem), sV = sK + TILE_BYTES, sQ = sK + 2 * TILE_BYTES,
                   sO = sK + 4 * TILE_BYTES;  // sQ[2], sdO[2]
    float* sL = reinterpret_cast<float*>(smem + 6 * TILE_BYTES);  // [2][64] lse * log2e
    float* sDl = sL + 2 * BLOCK;                                    // [2][64] delta
    // this warp's 16 rows of dS^T on their way to p.ds (rows DS_PITCH bytes apart: no bank conflicts)
    const uint32_t sDS = tk::smem_u32(smem + 6 * TILE_BYTES + 4 * BLOCK * 4) + warp * 16 * DS_PITCH;
    // the CTA's query iteration `it` (over all its key tiles) uses buffers it & 1, its Q and dO arrive
    // (by TMA, as the forward's tiles) on the mbarrier at bars + 8 (it & 1); K and V on bars + 16
    const uint32_t bars = tk::smem_u32(smem + 6 * TILE_BYTES + 4 * BLOCK * 4 + BLOCK * DS_PITCH);
    const uint32_t bar_kv = bars + 16;
    // the items of the CTA's n-th key tile at slot[n & 1]: taken by thread 0 when tile n - 2 starts,
    // read by all when tile n - 1 starts (a barrier of tile n - 2's iterations between)
    int* slot = reinterpret_cast<int*>(smem + 6 * TILE_BYTES + 4 * BLOCK * 4 + BLOCK * DS_PITCH + 24);

    Item cur = item_at(p, blockIdx.x, count);
    if (threadIdx.x == 0) {
        slot[1] = next_item(p);
        tk::mbar_init(bars, 1);
        tk::mbar_init(bars + 8, 1);
        tk::mbar_init(bar_kv, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        const int col = cur.h * D;
        tk::mbar_expect_tx(bar_kv, 2 * TILE_BYTES);
        tma_tile(sK, &maps.f.k, col, cur.t.z, bar_kv);
        tma_v_tile(sV, &maps.f.v, col, cur.t.z, p.v_shift, bar_kv);
        tk::mbar_expect_tx(bars, 2 * TILE_BYTES);
        tma_tile(sQ, &maps.f.q, col, cur.t.z, bars);
        tma_tile(sO, &maps.dout, col, cur.t.z, bars);
    }
    load_row_stats(sL, p.lse + (int64_t)cur.h * p.positions, cur.t.z, cur.t.y, LOG2E);
    load_row_stats(sDl, p.delta + (int64_t)cur.h * p.positions, cur.t.z, cur.t.y, 1.f);
    __syncthreads();  // the barriers initialized before anyone waits on them

    const float sl2 = p.scale * LOG2E;
    const int cb = (lane & 3) * 2;
    int it = 0;
    for (int n = 0;; ++n) {
        const int s1 = cur.t.y, k0 = cur.t.z, seq = cur.t.w, h = cur.h;
        const int e_next = slot[(n + 1) & 1];
        const bool has_next = e_next < items;
        const Item next = has_next ? item_at(p, e_next, count) : cur;  // read now, first needed in the last iteration
        if (threadIdx.x == 0 && has_next) slot[n & 1] = next_item(p);  // tile n + 2's
        const int nblocks = query_blocks(p, s1, k0);
        float dk[16][4] = {}, dv[16][4] = {};
        uint32_t pf[4][4] = {}, dsf[4][4] = {};  // P^T and dS^T: the A fragments of the dV and dK MMAs
        const int key_lo = k0 + warp * 16 + (lane >> 2);  // this thread's keys: key_lo, key_lo + 8
        tk::mbar_wait(bar_kv, n & 1);                     // K and V of this tile have landed

        for (int nb = 0; nb < nblocks; ++nb, ++it) {
            const int qb = k0 + nb * BLOCK;
            const int buf = it & 1;
            const uint32_t qt = sQ + buf * TILE_BYTES, ot = sO + buf * TILE_BYTES;
            const float* L = sL + buf * BLOCK;
            const float* Dl = sDl + buf * BLOCK;
            const bool last = nb + 1 == nblocks;
            tk::mbar_wait(bars + 8 * buf, (it >> 1) & 1);  // Q and dO of query tile nb have landed
            // P^T = exp(S^T - lse), S^T = K Q^T; dP^T = V dO^T (16 keys x 64 queries per warp)
            float s[8][4], dp[8][4];  // written whole by the MMAs' first k-steps
            // two commit groups, so that P^T's exponentials and dV's MMAs run while dP^T's are in flight
            gemm_abt_issue<true>(s, sK, qt);
            gemm_abt_issue<true>(dp, sV, ot);
            tk::wgmma_wait1();  // S^T, and the last iteration's dK
            tk::fence_regs<32>(&s[0][0]);
            settle(dk, dsf);
            // every warp's dK of the last iteration is done (the other Q buffer is free: refill the other
            // buffers, under this iteration's products), and its stores of this tile's lse and delta are
            // visible. The next tile's lse and delta: loaded into registers here, stored at the end of
            // the iteration (a store right after its load would hold warps 0-1 for the DRAM latency)
            __syncthreads();
            float lse_next = 0.f, delta_next = 0.f;
            const bool refill = !last || has_next;
            if (refill) {
                const int q_next = last ? next.t.z : qb + BLOCK, s1_next = last ? next.t.y : s1;
                const int h_next = last ? next.h : h;
                if (threadIdx.x == 0) {
                    const uint32_t bar = bars + 8 * (buf ^ 1);
                    tk::mbar_expect_tx(bar, 2 * TILE_BYTES);
                    tma_tile(sQ + (buf ^ 1) * TILE_BYTES, &maps.f.q, h_next * D, q_next, bar);
                    tma_tile(sO + (buf ^ 1) * TILE_BYTES, &maps.dout, h_next * D, q_next, bar);
                }
                lse_next = fetch_row_stat(p.lse + (int64_t)h_next * p.positions, q_next, s1_next);
                delta_next = fetch_row_stat(p.delta + (int64_t)h_next * p.positions, q_next, s1_next);
            }
            if (qb < k0 + BLOCK - 1 || qb + BLOCK - 1 - k0 > p.window || qb + BLOCK > s1)  // P^T 0 there:
                mask_scores(s, key_columns(p, key_lo, s1, qb, cb), key_columns(p, key_lo + 8, s1, qb, cb));
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                // this thread's two columns' lse, one 8-byte load (cb is even)
                const float2 l2 = *reinterpret_cast<const float2*>(L + nt * 8 + cb);
#pragma unroll
                for (int e = 0; e < 4; ++e) s[nt][e] = tk::fast_exp2(s[nt][e] * sl2 - (e & 1 ? l2.y : l2.x));  // 2^-inf = +0
            }
            to_a_frags(pf, s);          // P in bf16, as it enters the product
            gemm_pb_issue(dv, pf, ot);  // dV += P^T dO
            tk::wgmma_wait1();          // dP^T (dV's MMAs may still run)
            tk::fence_regs<32>(&dp[0][0]);
            if (last && has_next) {  // K and V are read by no MMA after this: the next tile's go there
                __syncthreads();
                if (threadIdx.x == 0) {
                    tk::mbar_expect_tx(bar_kv, 2 * TILE_BYTES);
                    tma_tile(sK, &maps.f.k, next.h * D, next.t.z, bar_kv);
                    tma_v_tile(sV, &maps.f.v, next.h * D, next.t.z, p.v_shift, bar_kv);
                }
            }
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                const float2 d2 = *reinterpret_cast<const float2*>(Dl + nt * 8 + cb);
#pragma unroll
                for (int e = 0; e < 4; ++e)  // dS^T = P^T (dP^T - delta), P in fp32 (as FA2)
                    dp[nt][e] = s[nt][e] * (dp[nt][e] - (e & 1 ? d2.y : d2.x));
            }
            to_a_frags(dsf, dp);
            gemm_pb_issue(dk, dsf, qt);  // dK += dS^T Q (waited for with the next S^T)
            tk::wgmma_wait1();
            settle(dv, pf);
            // dS^T for the dQ pass: the warp's 16 rows of its tile
            store_frag_rows(sDS, dsf, ds_tile(p, h, k0, seq, nb) + warp * 16 * BLOCK, BLOCK, 0, 16);
            if (refill && threadIdx.x < BLOCK) {  // read after the next iteration's barrier
                sL[(buf ^ 1) * BLOCK + threadIdx.x] = lse_next * LOG2E;
                sDl[(buf ^ 1) * BLOCK + threadIdx.x] = delta_next;
            }
        }
        tk::wgmma_wait_all();
        settle(dk, dsf);
        store_rows(sDS, p.dk + h * D, p.dk_stride, k0 + warp * 16, s1, dk, p.scale, p.scale);  // staged in the dS^T rows
        store_rows(sDS, p.dv + h * D, p.dv_stride, k0 + warp * 16, s1, dv, 1.f, 1.f, p.v_shift, p.v_half);
        if (!has_next) break;
        cur = next;
    }
    items_done(p);
}

// ---- backward dQ: one CTA per pair of query tiles (a sequence's tiles 2j and 2j + 1) and head ----
// dQ += dS K with the dK/dV pass's dS^T tiles (rows = keys: the MMA reads them transposed). The two
// tiles see nearly the same key tiles: the CTA walks the union of the two ranges once, each K tile
// copied once for both, and each of its two warpgroups sums one query tile's products, in the order
// of its keys as one CTA a tile did (the same bits); the pass reads dS^T tiles, 8 KB a product, and
// K, 16 KB a key tile, which a CTA a tile copied for every product.
constexpr int DS_TILE_BYTES = BLOCK * BLOCK * 2;
constexpr int DQ_STAGES = 3;
constexpr int DQ_THREADS = 2 * THREADS;

// the dQ pass's maps: the dS^T workspace as rows of 64 (a tile: 64 rows from ds_index * 64), and k
struct DqMaps {
    CUtensorMap ds, k;
};
__device__ __forceinline__ void attn_bwd_dq_pair(const Params& p, const DqMaps& maps, unsigned char* smem, int s0, int s1,
                                                 int q0, int seq) {
    const int h = blockIdx.y, col = h * D;
    const int warp = threadIdx.x >> 5, wg = warp >> 2;
    // DQ_STAGES stages of (K tile, the two query tiles' dS^T tiles): each product is short, so the loads
    // run ahead; stage st's copies arrive (by TMA) on the mbarrier at bars + 8 st
    const uint32_t sK = tk::smem_u32(smem), sDS = sK + DQ_STAGES * TILE_BYTES, bars = sDS + DQ_STAGES * 2 * DS_TILE_BYTES;

    // the key tiles of query tile w (0: q0, 1: q0 + 64, if the sequence has it): [lo[w], hi[w]); the
    // second's range starts and ends no earlier than the first's, and starts before the first's ends
    const bool two = q0 + BLOCK < s1;
    int lo0, n0, lo1 = 0, n1 = 0;
    key_blocks(p, s0, s1, q0, lo0, n0);
    if (two) key_blocks(p, s0, s1, q0 + BLOCK, lo1, n1);
    const int hi0 = lo0 + n0 * BLOCK, hi1 = lo1 + n1 * BLOCK;  // (n1 = 0: the second sees none)
    const int kb_first = lo0, nblocks = ((two ? hi1 : hi0) - kb_first) / BLOCK;
    auto sees = [&](int w, int k0) { return w ? k0 >= lo1 && k0 < hi1 : k0 >= lo0 && k0 < hi0; };
    auto load = [&](int nb) {  // key tile nb into its stage (thread 0)
        if (nb < nblocks && threadIdx.x == 0) {
            const int k0 = kb_first + nb * BLOCK, st = nb % DQ_STAGES;
            const uint32_t bar = bars + 8 * st;
            const bool a = sees(0, k0), b = sees(1, k0);
            tk::mbar_expect_tx(bar, TILE_BYTES + (a + b) * DS_TILE_BYTES);
            tma_tile(sK + st * TILE_BYTES, &maps.k, col, k0, bar);
            // a dS^T tile is read once: evicted first, it leaves L2 to the K tiles other CTAs read again
            for (int w = 0; w < 2; ++w)
                if (w ? b : a)
                    tk::tma_load_2d_once(sDS + (2 * st + w) * DS_TILE_BYTES, &maps.ds, 0,
                                         (int)ds_index(p, h, k0, seq, (q0 + w * BLOCK - k0) / BLOCK) * BLOCK, bar);
        }
    };
    if (threadIdx.x == 0) {
        for (int st = 0; st < DQ_STAGES; ++st) tk::mbar_init(bars + 8 * st, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
#pragma unroll
    for (int nb = 0; nb < DQ_STAGES - 1; ++nb) load(nb);
    __syncthreads();  // the barriers initialized before anyone waits on them

    // Each tile's product stays in flight while the next tile's is issued: the wait after an issue
    // covers the one before, so the barrier, the next copies and the wait for the next stage run under
    // an MMA. Only MMAs touch dq between the fences before the loop and after it (a fence in the loop
    // would make ptxas serialize them).
    float dq[16][4] = {};
    float* d = &dq[0][0];
    tk::fence_regs<64>(d);
    for (int nb = 0; nb < nblocks; ++nb) {
        const int st = nb % DQ_STAGES, k0 = kb_first + nb * BLOCK;
        const uint32_t dst = sDS + (2 * st + wg) * DS_TILE_BYTES, kt = sK + st * TILE_BYTES;
        tk::mbar_wait(bars + 8 * st, (nb / DQ_STAGES) & 1);  // key tile nb has landed
        if (sees(wg, k0)) {
            tk::wgmma_fence();
            const tk::DescBase a(dst, BLOCK * 128, 1024), b(kt, BLOCK * 128, 1024);
#pragma unroll
            for (int ks = 0; ks < 4; ++ks)  // dQ += dS K: 16 keys a step, A = (dS^T)^T, B = K (rows = keys)
                tk::wgmma_m64n128k16_ss<1>(d, a.at(ks * 2048), b.at(ks * 2048));
            tk::wgmma_commit();
            tk::wgmma_wait1();  // tile nb - 1's product
        } else {
            tk::wgmma_wait_all();
        }
        __syncthreads();  // every warp is done with tile nb - 1's stage: the copies of tile nb + 2 go there
        load(nb + DQ_STAGES - 1);
    }
    tk::wgmma_wait_all();
    tk::fence_regs<64>(d);
    // staged in the K slots (8 warps' 16 rows: 18 KB of their 48): every copy landed, and after the
    // barrier every warp has waited for its part of the last MMA (which may read them)
    __syncthreads();
    if (wg == 0 || two)
        store_rows(sK + warp * 16 * DS_PITCH, p.dq + h * D, p.dq_stride, q0 + warp * 16, s1, dq, p.scale, p.scale);
}

constexpr int FWD_SMEM = 4 * TILE_BYTES + 24 + 1024;             // Q, K, V[2], 3 mbarriers (+ alignment)
constexpr int BWD_SMEM = 6 * TILE_BYTES + 4 * BLOCK * 4 + BLOCK * DS_PITCH + 32 + 1024;  // dK/dV: K, V, Q[2],
                                                        // dO[2], lse[2], delta[2], dS^T rows, 3 mbarriers, 2 item slots
constexpr int DQ_SMEM = DQ_STAGES * (TILE_BYTES + 2 * DS_TILE_BYTES + 8) + 1024;  // dQ: (K, dS^T[2], mbarrier)[DQ_STAGES]

__global__ void __launch_bounds__(THREADS, 3) attn_fwd_kernel(const Params p, const __grid_constant__ FwdMaps maps) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (tk::smem_u32(smem_raw) & 1023)) & 1023);
    const int total = p.tiles[0].x;
    if ((int)blockIdx.x >= total) return;
    const int4 t = p.tiles[1 + blockIdx.x];
    attn_fwd_tile(p, maps, smem, t.x, t.y, t.z);
}

// dK/dV by key tile (heaviest first), writing dS^T; then, in a second launch, dQ by pairs of query tiles
__global__ void __launch_bounds__(THREADS, BWD_CTAS_PER_SM) attn_bwd_dkdv_kernel(const Params p,
                                                                                const __grid_constant__ BwdMaps maps) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (tk::smem_u32(smem_raw) & 1023)) & 1023);
    attn_bwd_dkdv_tiles(p, maps, smem);
}
// the list by query tile, heaviest first; a CTA whose tile is a sequence's odd one leaves it to the
// CTA of the tile before
__global__ void __launch_bounds__(DQ_THREADS) attn_bwd_dq_kernel(const Params p, const __grid_constant__ DqMaps maps) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (tk::smem_u32(smem_raw) & 1023)) & 1023);
    if ((int)blockIdx.x >= p.tiles[0].x) return;
    const int4 t = p.tiles[1 + blockIdx.x];
    if ((t.z - t.x) / BLOCK % 2) return;
    attn_bwd_dq_pair(p, maps, smem, t.x, t.y, t.z, t.w);
}

}  // namespace attn

// Workspace bytes for p.tiles
inline size_t attention_tiles_bytes(int positions, int cu_len) {
    return (1 + 2 * (size_t)attn::max_tiles(positions, cu_len)) * sizeof(int4);
}

// The tile schedule of p.cu_seqlens, p.cu_mult and p.window into p.tiles (the forward makes it;
// a backward whose tiles were overwritten since remakes it).
inline cudaError_t attention_schedule(const attn::Params& p, cudaStream_t stream) {
    attn::attn_schedule_kernel<<<1, 1024, 0, stream>>>(p);
    return cudaGetLastError();
}

// A TMA map of a (positions, heads x 128) operand whose positions lie `stride` elements apart (q, k,
// dout); false where TMA cannot take it (a pointer or stride not 16-byte aligned)
inline bool attention_rows_map(CUtensorMap* map, const attn::Params& p, const __nv_bfloat16* ptr, int64_t stride) {
    return tk::make_matrix_map(map, ptr, p.positions, (int64_t)p.heads * attn::D, stride, attn::BLOCK) == CUDA_SUCCESS;
}
// The forward's TMA maps of q, k and v (attn::FwdMaps); an invalid layout (misaligned, v_shift not
// 0 or 1) is cudaErrorInvalidValue
inline cudaError_t attention_maps(const attn::Params& p, attn::FwdMaps& m) {
    if (p.v_shift < 0 || p.v_shift > 1 || (p.v_shift && p.positions % 2)) return cudaErrorInvalidValue;
    const cuuint64_t cols = (cuuint64_t)p.heads * attn::D, per_row = 1u << p.v_shift;
    const cuuint64_t dims_v[3] = {cols, per_row, (cuuint64_t)p.positions >> p.v_shift};
    const cuuint64_t stride_v[2] = {(cuuint64_t)(p.v_shift ? p.v_half : (int64_t)cols) * 2, (cuuint64_t)p.v_stride * 2};
    const cuuint32_t box_v[3] = {64, (cuuint32_t)per_row, (cuuint32_t)(attn::BLOCK / per_row)};
    if (!attention_rows_map(&m.q, p, p.q, p.q_stride) || !attention_rows_map(&m.k, p, p.k, p.k_stride) ||
        tk::make_tensor_map(&m.v, p.v, 3, dims_v, stride_v, box_v) != CUDA_SUCCESS)
        return cudaErrorInvalidValue;
    return cudaSuccess;
}

// Forward: out and lse from q, k, v; writes the tile schedule to p.tiles. Returns the launch error.
// make_schedule false: p.tiles already holds the schedule of these cu_seqlens, layout and window
// (an earlier layer's forward made it).
inline cudaError_t attention_forward(const attn::Params& p, cudaStream_t stream, bool make_schedule = true) {
    static bool configured = false;
    if (cudaError_t e = tk::allow_smem(attn::attn_fwd_kernel, attn::FWD_SMEM, configured)) return e;
    attn::FwdMaps maps;
    if (cudaError_t e = attention_maps(p, maps)) return e;
    if (make_schedule)
        if (cudaError_t e = attention_schedule(p, stream)) return e;
    attn::attn_fwd_kernel<<<dim3(attn::max_tiles(p.positions, p.cu_len), p.heads), attn::THREADS, attn::FWD_SMEM, stream>>>(
        p, maps);
    return cudaGetLastError();
}

// Workspace bytes for p.ds: the dS^T tiles of a backward with this layout and window
inline size_t attention_ds_bytes(int positions, int cu_len, int heads, int window) {
    return (size_t)heads * attn::max_tiles(positions, cu_len) * attn::ds_slots(positions, window) * attn::DS_TILE_BYTES;
}

// Backward: dq, dk, dv from dout, out, lse and the schedule in p.tiles, all as the forward with
// the same cu_seqlens and window left them (p.delta: a heads x positions fp32 workspace; p.ds:
// attention_ds_bytes). delta_ready: p.delta already holds rowsum(dout * out) (the output gate's
// backward writes it).
inline cudaError_t attention_backward(attn::Params p, cudaStream_t stream, bool delta_ready = false) {
    static bool configured_dkdv = false, configured_dq = false;
    if (cudaError_t e = tk::allow_smem(attn::attn_bwd_dkdv_kernel, attn::BWD_SMEM, configured_dkdv)) return e;
    if (cudaError_t e = tk::allow_smem(attn::attn_bwd_dq_kernel, attn::DQ_SMEM, configured_dq)) return e;
    if (!p.ds) return cudaErrorInvalidValue;
    p.ds_slots = attn::ds_slots(p.positions, p.window);
    const int64_t warps = (int64_t)p.positions * p.heads;
    if (!delta_ready) attn::attn_bwd_delta_kernel<<<(unsigned)((warps + 7) / 8), 256, 0, stream>>>(p);
    attn::BwdMaps maps;
    if (cudaError_t e = attention_maps(p, maps.f)) return e;
    if (!attention_rows_map(&maps.dout, p, p.dout, p.dout_stride)) return cudaErrorInvalidValue;
    const int tiles = attn::max_tiles(p.positions, p.cu_len);
    const int persistent = attn::BWD_CTAS_PER_SM * tk::num_sms();  // all resident
    attn::attn_bwd_dkdv_kernel<<<std::min(tiles * p.heads, persistent), attn::THREADS, attn::BWD_SMEM, stream>>>(p, maps);
    const dim3 grid(tiles, p.heads);
    attn::DqMaps dq_maps;
    dq_maps.k = maps.f.k;
    const int64_t ds_rows = attention_ds_bytes(p.positions, p.cu_len, p.heads, p.window) / (attn::BLOCK * 2);
    if (tk::make_matrix_map(&dq_maps.ds, p.ds, ds_rows, attn::BLOCK, attn::BLOCK, attn::BLOCK) != CUDA_SUCCESS)
        return cudaErrorInvalidValue;
    attn::attn_bwd_dq_kernel<<<grid, attn::DQ_THREADS, attn::DQ_SMEM, stream>>>(p, dq_maps);
    return cudaGetLastError();
}

// -----------------------------------------------------------------------------
// Fused soft-capped cross-entropy with multi-token prediction (record 61's
// FusedSoftcappedCrossEntropy): z = a * sigmoid((logit + b) / c), lse = log sum exp z, and the row's
// loss sum_k w_k (lse - z[target[row + k]]) over the k with row + k < rows. Evaluation (weights
// {1}) gives the plain next-token loss. z < a bounds exp(z), so the sum needs no running maximum.
// One CTA per row; vocab a multiple of 8 (16-byte loads). In training a second kernel (below)
// turns the logits and each row's lse into the gradient, already in fp8:
//   dlogit = grad_scale * (sum_k w_k * softmax(z) - sum_k w_k [col == target[row + k]]) * z (1 - z/a) / c
// The soft-cap, as the record tells it: @Grad62304977 added tanh softcapping following the Gemma 2
// paper, @KoszarskyB reduced it from 30 to 15, @YouJiacheng shifted it by +15
// (2 sigmoid(2x) = tanh(x) + 1), @classiclarryd updated it to 23 sigmoid((logits + 5) / 7.5)
// (a, b, c = 23, 5, 7.5). Multi-token prediction's weight schedule: @varunneal.

namespace ce {

constexpr int THREADS = 512;
constexpr int MAX_PREDICT = 4;

struct Params {
    const __nv_bfloat16* logits;  // rows x vocab, row stride ld
    int64_t ld;
    const int* targets;           // target_rows, from this call's first row
    int rows, vocab;
    int target_rows;              // targets available from the first row (>= rows; more when the
                                  // logits come in chunks: a row's later MTP targets lie past them)
    int n_predict;                // weights used (1 in evaluation)
    float w[MAX_PREDICT];
    float a, b, c;                // soft-cap
    float* losses;                // rows
    float* lse;                   // rows, or null (the gradient needs it)
    float grad_scale;             // the gradient's factor (the loss scale)
    bool fast_softcap;            // the forward's soft-cap on tanh.approx (training; evaluation's
                                  // losses keep the exact sigmoid)
};

// a / (1 + exp(-(x + b) / c)) with fast reciprocals (nic = -1/c): IEEE divisions here would make
// these passes over the logits compute-bound
__device__ __forceinline__ float softcap(const Params& p, float nic, float x) {
    return __fdividef(p.a, 1.f + __expf((x + p.b) * nic));
}

// The soft-cap through tanh.approx (training's passes): a sigmoid((x + b) / c) = h (1 + t) with
// h = a / 2, t = tanh((x + b) / 2c)
struct TanhCap {
    float h = 0.f, T1 = 0.f, T0 = 0.f;
    TanhCap() = default;
    __host__ __device__ explicit TanhCap(const Params& p) : h(0.5f * p.a), T1(0.5f / p.c), T0(0.5f * p.b / p.c) {}
    __device__ float t(float x) const { return tk::fast_tanh(fmaf(x, T1, T0)); }
};

__device__ __forceinline__ float block_sum(float v, float* red) {
    v = tk::warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < THREADS / 32 ? red[lane] : 0.f;
        v = tk::warp_sum(v);
        if (lane == 0) red[0] = v;
    }
    __syncthreads();
    return red[0];
}

// ---- forward: each row's loss and lse, one CTA per row ----
//
// Bound by the SFU. Exact (evaluation): exp(softcap(x)) = 2^(a log2e / (1 + 2^(x A1 + B1))), three
// operations of it per logit. FAST (training): the soft-cap as a (1 + t) / 2 with
// t = tanh((x + b) / 2c) on tanh.approx (its relative error of 2^-11 on single values leaves the
// losses within about 2e-6 of the exact ones: the errors of a row's 50K terms average out), and every
// other exponential on the FMA pipe (tk::poly_exp2): 1.5 SFU operations a logit instead of 2, 299 ->
// 275 us a chunk of 8192 rows under ncu (neither three of every four nor a warp a row did better).

template <bool FAST>
__global__ void __launch_bounds__(THREADS) softcapped_ce_kernel(const Params p) {
    __shared__ float red[THREADS / 32];
    const int row = blockIdx.x;
    const __nv_bfloat16* x = p.logits + (int64_t)row * p.ld;
    const int nvec = p.vocab / 8;
    const float nic = -1.f / p.c;
    const float L2E = 1.4426950408889634f, A1 = nic * L2E, B1 = p.b * nic * L2E, aL = p.a * L2E;
    const TanhCap tc(p);
    const float hL = tc.h * L2E;
    float sum = 0.f;
    auto add8 = [&](const float f[8]) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            if (FAST) {  // every other exponential on the FMA pipe; its argument z log2e in [0, a log2e]
                const float y = fmaf(tc.t(f[e]), hL, hL);
                sum += e & 1 ? tk::poly_exp2(y) : tk::fast_exp2(y);
            } else {
                sum += tk::fast_exp2(__fdividef(aL, 1.f + tk::fast_exp2(fmaf(f[e], A1, B1))));
            }
        }
    };
    auto cap = [&](float x) { return FAST ? fmaf(tc.h, tc.t(x), tc.h) : softcap(p, nic, x); };
    int v = threadIdx.x;
    for (; v + 3 * THREADS < nvec; v += 4 * THREADS) {  // four loads in flight (64 KB an SM at 4 CTAs)
        float f[4][8];
#pragma unroll
        for (int u = 0; u < 4; ++u) tk::load8(x + (v + u * THREADS) * 8, f[u]);
#pragma unroll
        for (int u = 0; u < 4; ++u) add8(f[u]);
    }
    for (; v + THREADS < nvec; v += 2 * THREADS) {  // the rest: the same order of terms
        float f[8], g[8];
        tk::load8(x + v * 8, f);
        tk::load8(x + (v + THREADS) * 8, g);
        add8(f);
        add8(g);
    }
    if (v < nvec) {
        float f[8];
        tk::load8(x + v * 8, f);
        add8(f);
    }
    int tgt[MAX_PREDICT];
    float zt[MAX_PREDICT];
#pragma unroll
    for (int k = 0; k < MAX_PREDICT; ++k) {
        bool on = k < p.n_predict && row + k < p.target_rows;
        tgt[k] = on ? p.targets[row + k] : -1;
        zt[k] = threadIdx.x == 0 && tgt[k] >= 0 && tgt[k] < p.vocab ? cap(__bfloat162float(x[tgt[k]])) : 0.f;
    }
    const float lse = logf(block_sum(sum, red));
    if (threadIdx.x == 0) {
        float loss = 0.f;
#pragma unroll
        for (int k = 0; k < MAX_PREDICT; ++k)
            if (tgt[k] >= 0 && tgt[k] < p.vocab) loss += p.w[k] * (lse - zt[k]);
        p.losses[row] = loss;
        if (p.lse) p.lse[row] = lse;
    }
}

// ---- backward: the gradient, in fp8 for the lm_head's GEMMs ----
//
// The cross-entropy's gradient straight to fp8 (e5m2, / grad_s), in both layouts the lm_head's
// backward GEMMs read: g8 (rows x vocab) for d norm(x) = g w^T and g8t (vocab x rows) for
// d lm_head = x^T g (fp8 GEMMs take K-major operands only). One pass over the logits instead of a
// bf16 gradient and two casts of it. Rounds through bf16 first, as the record's bf16 gradient does.
//
// The SFU bounds the pass about as much as the DRAM does, so it takes two of its operations per logit,
// not three: the soft-cap as a (1 + t) / 2 with t = tanh((x + b) / 2c) on tanh.approx (relative error
// 2^-11, a hundred times finer than e5m2's steps; as the training forward's), then one exp2.
// Everything else is kept out of the inner loop: the row's constants fold into one exponent offset,
// d = 2^(t a log2e / 2 - off) (1 - t^2) with off = lse log2e - log2(grad_scale wsum a / 4c) - a log2e / 2,
// and the targets' -w terms are applied only where a thread's 8 columns hold a target. A CTA takes
// 64 rows and GT tiles of 128 columns; each thread 4 rows x 8 columns, whose 4-row column slices go
// to shared memory as 32-bit words for the transposed store. The next tile's logits are on their way
// (cp.async) while this tile is computed and stored.

constexpr int GR = 64, GC = 128, GT = 4;  // rows, columns per tile; tiles per CTA along the vocabulary
constexpr int GPITCH = GR + 4;            // bytes per column of the transposed tile (word-aligned)
// The logits' tiles come by cp.async into shared memory, GSTAGES of them in flight a CTA (this one and
// the next): each thread copies the 4 x 16 bytes it reads itself, so its own cp.async wait covers
// them. Held in registers instead (80 of them, 3 CTAs an SM) the pass ran 530 us a chunk of 8192
// rows under ncu at 3.1 TB/s; by cp.async 488 with 3 stages (3 CTAs an SM), 467 with 2 (64
// registers, 4 CTAs an SM), 477 / 467 with 8 tiles a CTA.
constexpr int GSTAGES = 2, GSTAGE_BYTES = GR * GC * 2;
constexpr int GRAD_SMEM = GSTAGES * GSTAGE_BYTES + 2 * GC * GPITCH;

// this thread's 4 rows x 8 columns from column col into stage st (zeros past the rows or the vocabulary)
__device__ __forceinline__ void load_logits(const Params& p, int r0, int col, uint32_t st) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const bool ok = r0 + i < p.rows && col < p.vocab;
        tk::cp_async16(st + (i * 256 + threadIdx.x) * 16, ok ? p.logits + (int64_t)(r0 + i) * p.ld + col : p.logits,
                       ok ? 16 : 0);
    }
}

__global__ void __launch_bounds__(256, 4) grad_fp8_kernel(const Params p, uint8_t* g8, int64_t ld8, uint8_t* g8t,
                                                       int64_t ld8t, float inv_grad_s) {
    extern __shared__ __align__(16) uint8_t grad_smem[];
    // the logits' stages, then the transposed tile ([col][row], double-buffered)
    uint8_t(*tile)[GC * GPITCH] = reinterpret_cast<uint8_t(*)[GC * GPITCH]>(grad_smem + GSTAGES * GSTAGE_BYTES);
    const uint32_t stages = tk::smem_u32(grad_smem);
    const int t = threadIdx.x, rg = t / 16, cg = t % 16;
    const int r0 = blockIdx.y * GR + rg * 4;  // this thread's first row
    const float L2E = 1.4426950408889634f;
    // with t = tanh((x + b) / 2c): z = a (1 + t) / 2 and d softcap / dx = z (1 - z/a) / c = (a/4c) (1 - t^2)
    const TanhCap tc(p);
    const float K = p.grad_scale * 0.25f * p.a / p.c, hL = tc.h * L2E;
    float off[4];
    int tgt[4][MAX_PREDICT];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int row = r0 + i;
        float wsum = 0.f;
#pragma unroll
        for (int k = 0; k < MAX_PREDICT; ++k) {
            const bool on = row < p.rows && k < p.n_predict && row + k < p.target_rows;
            tgt[i][k] = on ? p.targets[row + k] : -1;
            if (on) wsum += p.w[k];
        }
        off[i] = row < p.rows && wsum > 0.f ? p.lse[row] * L2E - log2f(K * wsum) - hL : INFINITY;  // 2^-inf = 0
    }
    const int cbase = blockIdx.x * GC * GT;
#pragma unroll
    for (int j = 0; j < GSTAGES - 1; ++j) {
        if (j < GT) load_logits(p, r0, cbase + j * GC + cg * 8, stages + j * GSTAGE_BYTES);
        tk::cp_async_commit();
    }
#pragma unroll 1
    for (int j = 0; j < GT; ++j) {
        const int c0 = cbase + j * GC, col = c0 + cg * 8;
        if (c0 >= p.vocab) break;  // the same for the whole CTA
        // the tile GSTAGES - 1 ahead into the stage this thread read last (an empty group past the CTA's tiles)
        asm volatile("" ::: "memory");
        if (j + GSTAGES - 1 < GT)
            load_logits(p, r0, col + (GSTAGES - 1) * GC, stages + (j + GSTAGES - 1) % GSTAGES * GSTAGE_BYTES);
        tk::cp_async_commit();
        tk::cp_async_wait<GSTAGES - 1>();  // this tile's copies (this thread's) have landed
        uint4 raw[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            raw[i] = *reinterpret_cast<const uint4*>(grad_smem + j % GSTAGES * GSTAGE_BYTES + (i * 256 + t) * 16);
        uint32_t pk[4][4];         // [row][column pair]: two e5m2 values in the low 16 bits
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t w[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
            float g[8], tz[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float x = __uint_as_float(e % 2 ? w[e / 2] & 0xffff0000u : w[e / 2] << 16);
                const float th = tc.t(x);
                tz[e] = fmaf(-th, th, 1.f);                             // 1 - t^2: d softcap (4c/a)
                g[e] = tk::fast_exp2(fmaf(th, hL, -off[i])) * tz[e];   // exp(z - lse) K wsum (1 - t^2)
            }
            bool hit = false;
#pragma unroll
            for (int k = 0; k < MAX_PREDICT; ++k) hit |= (unsigned)(tgt[i][k] - col) < 8u;
            if (hit) {
#pragma unroll
                for (int e = 0; e < 8; ++e)
#pragma unroll
                    for (int k = 0; k < MAX_PREDICT; ++k)
                        if (col + e == tgt[i][k]) g[e] -= K * p.w[k] * tz[e];
            }
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float2 gb = __bfloat1622float2(__floats2bfloat162_rn(g[2 * q], g[2 * q + 1]));
                pk[i][q] = __nv_cvt_float2_to_fp8x2(make_float2(gb.x * inv_grad_s, gb.y * inv_grad_s), __NV_SATFINITE,
                                                    __NV_E5M2);
            }
            if (r0 + i < p.rows && col < p.vocab)
                *reinterpret_cast<uint2*>(g8 + (int64_t)(r0 + i) * ld8 + col) =
                    make_uint2(pk[i][0] | pk[i][1] << 16, pk[i][2] | pk[i][3] << 16);
        }
        // each column's 4 rows as one word: [row0, row1, row2, row3]
        uint8_t* buf = tile[j & 1];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const uint32_t lo01 = __byte_perm(pk[0][q], pk[1][q], 0x5140), lo23 = __byte_perm(pk[2][q], pk[3][q], 0x5140);
            *reinterpret_cast<uint32_t*>(buf + (cg * 8 + 2 * q) * GPITCH + rg * 4) = __byte_perm(lo01, lo23, 0x5410);
            *reinterpret_cast<uint32_t*>(buf + (cg * 8 + 2 * q + 1) * GPITCH + rg * 4) = __byte_perm(lo01, lo23, 0x7632);
        }
        __syncthreads();  // (double buffering: the next tile writes the other buffer)
        // transposed: 128 columns x 4 vectors of 16 rows, two passes of 64 columns
        const int rb = blockIdx.y * GR;
#pragma unroll
        for (int pass = 0; pass < 2; ++pass) {
            const int c = pass * 64 + t / 4, r = (t % 4) * 16;
            if (c0 + c >= p.vocab || rb + r >= p.rows) continue;
            const uint32_t* src = reinterpret_cast<const uint32_t*>(buf + c * GPITCH + r);
            *reinterpret_cast<uint4*>(g8t + (int64_t)(c0 + c) * ld8t + rb + r) = make_uint4(src[0], src[1], src[2], src[3]);
        }
    }
    tk::cp_async_wait<0>();  // (no copy outlives the CTA)
}

}  // namespace ce

// the rows' losses (and lse where p.lse is set)
inline cudaError_t softcapped_cross_entropy(const ce::Params& p, cudaStream_t stream) {
    if (p.vocab % 8 != 0 || p.ld % 8 != 0 || p.n_predict < 1 || p.n_predict > ce::MAX_PREDICT)
        return cudaErrorInvalidValue;
    if (p.fast_softcap) ce::softcapped_ce_kernel<true><<<p.rows, ce::THREADS, 0, stream>>>(p);
    else ce::softcapped_ce_kernel<false><<<p.rows, ce::THREADS, 0, stream>>>(p);
    return cudaGetLastError();
}

// p as for softcapped_cross_entropy, with p.lse from it; rows a multiple of 16, vocab of 8,
// ld8 and ld8t of 16
inline cudaError_t softcapped_ce_grad_fp8(const ce::Params& p, uint8_t* g8, int64_t ld8, uint8_t* g8t, int64_t ld8t,
                                          float grad_s, cudaStream_t stream) {
    if (p.rows % 16 || p.vocab % 8 || p.ld % 8 || ld8 % 16 || ld8t % 16 || !p.lse || p.n_predict < 1 ||
        p.n_predict > ce::MAX_PREDICT)
        return cudaErrorInvalidValue;
    dim3 grid((p.vocab + ce::GC * ce::GT - 1) / (ce::GC * ce::GT), (p.rows + ce::GR - 1) / ce::GR);
    static bool configured = false;
    if (cudaError_t e = tk::allow_smem(ce::grad_fp8_kernel, ce::GRAD_SMEM, configured)) return e;
    ce::grad_fp8_kernel<<<grid, 256, ce::GRAD_SMEM, stream>>>(p, g8, ld8, g8t, ld8t, 1.f / grad_s);
    return cudaGetLastError();
}

// -----------------------------------------------------------------------------
// RMSNorm over rows of `dim` (F.rms_norm without weight): y = x / sqrt(mean(x^2) + eps), in fp32,
// with 1/rms kept per row for the backward: dx = r (dy - x r^2 mean(dy x)). One warp per row;
// dim a multiple of 256 up to 1024 (each lane holds dim/32 values in registers).

namespace rmsnorm {

// a warp's row, this lane's DIM/32 values in f and their sum of squares in ss: y_row = f / rms,
// rstd[row] = 1/rms (rstd may be null)
template <int DIM>
__device__ __forceinline__ void normalize_row(float f[][8], float ss, float eps, float* rstd, int row,
                                              __nv_bfloat16* y_row) {
    const int lane = threadIdx.x & 31;
    ss = tk::warp_sum(ss);
    const float r = rsqrtf(ss / DIM + eps);
    if (rstd && lane == 0) rstd[row] = r;
#pragma unroll
    for (int v = 0; v < DIM / 256; ++v) {
#pragma unroll
        for (int e = 0; e < 8; ++e) f[v][e] *= r;
        tk::store8(y_row + (v * 32 + lane) * 8, f[v]);
    }
}

template <int DIM>
__global__ void fwd_kernel(const __nv_bfloat16* x, int64_t ldx, __nv_bfloat16* y, int64_t ldy, float* rstd, int rows,
                           float eps) {
    constexpr int V = DIM / 256;  // 16-byte vectors per lane
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (row >= rows) return;
    float f[V][8];
    float ss = 0.f;
#pragma unroll
    for (int v = 0; v < V; ++v) {
        tk::load8(x + row * ldx + (v * 32 + lane) * 8, f[v]);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += f[v][e] * f[v][e];
    }
    normalize_row<DIM>(f, ss, eps, rstd, row, y + row * ldy);
}

// a warp's row of x and dy (this lane's DIM/32 values of each) and the row's sum of x dy
template <int DIM>
__device__ __forceinline__ float load_row_dot(const __nv_bfloat16* x, const __nv_bfloat16* dy, float fx[][8],
                                              float fg[][8]) {
    const int lane = threadIdx.x & 31;
    float dot = 0.f;
#pragma unroll
    for (int v = 0; v < DIM / 256; ++v) {
        tk::load8(x + (v * 32 + lane) * 8, fx[v]);
        tk::load8(dy + (v * 32 + lane) * 8, fg[v]);
#pragma unroll
        for (int e = 0; e < 8; ++e) dot += fx[v][e] * fg[v][e];
    }
    dot = tk::warp_sum(dot);
    return dot;
}

template <int DIM, bool ACCUMULATE>
__global__ void bwd_kernel(const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* dy, int64_t lddy,
                           const float* rstd, __nv_bfloat16* dx, int64_t lddx, int rows) {
    constexpr int V = DIM / 256;
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (row >= rows) return;
    float fx[V][8], fg[V][8];
    const float dot = load_row_dot<DIM>(x + row * ldx, dy + row * lddy, fx, fg);
    const float r = rstd[row], c = r * r * dot / DIM;
#pragma unroll
    for (int v = 0; v < V; ++v) {
        float acc[8];
        if (ACCUMULATE) tk::load8(dx + row * lddx + (v * 32 + lane) * 8, acc);
#pragma unroll
        for (int e = 0; e < 8; ++e) fg[v][e] = (ACCUMULATE ? acc[e] : 0.f) + r * (fg[v][e] - fx[v][e] * c);
        tk::store8(dx + row * lddx + (v * 32 + lane) * 8, fg[v]);
    }
}

}  // namespace rmsnorm

// y = rms_norm(x) over rows of dim (768 in the model); rstd may be null (evaluation)
inline cudaError_t rms_norm_forward(const __nv_bfloat16* x, int64_t ldx, __nv_bfloat16* y, int64_t ldy, float* rstd,
                                    int rows, int dim, float eps, cudaStream_t stream) {
    const unsigned blocks = (unsigned)((rows + 7) / 8);
    if (rows <= 0) return cudaSuccess;
    if (dim == 768) rmsnorm::fwd_kernel<768><<<blocks, 256, 0, stream>>>(x, ldx, y, ldy, rstd, rows, eps);
    else if (dim == 256) rmsnorm::fwd_kernel<256><<<blocks, 256, 0, stream>>>(x, ldx, y, ldy, rstd, rows, eps);
    else return cudaErrorInvalidValue;
    return cudaGetLastError();
}

// accumulate: dx += the gradient (the residual stream's gradient takes the norm's branch in the
// same pass, rounding once); else dx = it
inline cudaError_t rms_norm_backward(const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* dy, int64_t lddy,
                                     const float* rstd, __nv_bfloat16* dx, int64_t lddx, int rows, int dim,
                                     cudaStream_t stream, bool accumulate = false) {
    const unsigned blocks = (unsigned)((rows + 7) / 8);
    if (rows <= 0) return cudaSuccess;
#define RMS_BWD(DIM, ACC) rmsnorm::bwd_kernel<DIM, ACC><<<blocks, 256, 0, stream>>>(x, ldx, dy, lddy, rstd, dx, lddx, rows)
    if (dim == 768) accumulate ? RMS_BWD(768, true) : RMS_BWD(768, false);
    else if (dim == 256) accumulate ? RMS_BWD(256, true) : RMS_BWD(256, false);
    else return cudaErrorInvalidValue;
#undef RMS_BWD
    return cudaGetLastError();
}

// -----------------------------------------------------------------------------
// linear_relu_square's GEMMs with their epilogues (record 61's FusedLinearReLUSquareFunction, whose
// Triton kernels fuse the same way): the forward's c_fc GEMM writes pre and post = relu(pre)^2 in
// one pass, the backward's dpost GEMM writes dpre = 2 dpost relu(pre) (dpost never stored): no
// separate passes over the 4 x 768-wide activations. relu(x)^2 (arXiv 2109.08668): suggested by
// @SKYLINEZ007 and @Grad62304977; the record's fused linear_relu_square kernel: @andrewbriand, @jrauvola.
//
// Persistent, one CTA an SM, 128 x 256 output tiles: a producer warp streams the A and B tiles of the
// CTA's output tiles by TMA, in order, through the STAGES buffers; the two consumer warpgroups take 64 rows
// each with m64n256 MMAs, and the producer warpgroup's other three warps run the epilogue. The SM's
// shared memory (128 bytes a cycle) is what bounds the kernel, the epilogue's staging included: these
// tiles read 16 KB of it per 128 x 128 x 16. The consumers leave their accumulators in bf16 in the
// staging tile and go on to the next tile's MMAs; the epilogue warps take the tile from there, a warp a
// row of 256 columns in 16-byte chunks: pre and post, or dpre (which the consumers staged over the
// tile's pre, fetched there by the epilogue warps while the MMAs ran). (Not a fourth warpgroup: at 512
// threads ptxas compiles every instruction within 128 registers, and an m64n256 MMA needs about 154.)
namespace lrs {

constexpr int BM = 128, BN = 256, BK = 64, THREADS = 384, STAGES = 3, EPI_WARPS = 3;
constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int STAGE_ROW = BN * 2 + 16;  // the staging's bf16 rows, padded: the fragments' stores hit 32 banks
constexpr int SMEM = STAGES * STAGE_BYTES + BM * STAGE_ROW + 1024 + 8 * (2 * STAGES + 3);
static_assert(SMEM <= 232448, "shared memory");

using tk::mbar_arrive, tk::mbar_expect_tx, tk::mbar_init, tk::mbar_wait, tk::tma_load_2d;

__device__ __forceinline__ __nv_bfloat162 relu_pair(__nv_bfloat162 x) { return __hmax2(x, __float2bfloat162_rn(0.f)); }

// The backward's dpre = 2 relu(pre) dpost of a bf16 pair of dpost (v), over the pair of pre at pre_at in
// shared memory. In bf16x2 arithmetic, three instructions a pair: 2 dpost is exact and the product of
// two bf16 values is rounded once, as the fp32 product rounded to bf16 is (the same bits)
__device__ __forceinline__ uint32_t dpre_pair(uint32_t v, uint32_t pre_at) {
    uint32_t pu;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(pu) : "r"(pre_at));
    const __nv_bfloat162 g = *reinterpret_cast<const __nv_bfloat162*>(&v);
    const __nv_bfloat162 p = *reinterpret_cast<const __nv_bfloat162*>(&pu);
    const __nv_bfloat162 d = __hmul2(__hadd2(g, g), relu_pair(p));
    return *reinterpret_cast<const uint32_t*>(&d);
}

// The tile order and the stage pipeline. Tiles run along the wider side of C: the CTAs at work at once
// share the narrower operand's few tiles and sweep the wider one's, so that the narrower stays in L2
// (the MLP: all of w).
__device__ __forceinline__ void tile_origin(int t, int MT, int NT, int& m0, int& n0) {
    if (MT <= NT) m0 = t % MT * BM, n0 = t / MT * BN;
    else m0 = t / NT * BM, n0 = t % NT * BN;
}
// The producer (one thread): the A (BM rows) and B (BN rows) boxes of the CTA's tiles k-tile by k-tile
// through the STAGES buffers (full[s] at bars + 8s, empty[s] at bars + 8 (STAGES + s)); a box's rows
// past M or N count toward the bytes too (zeros)
__device__ __forceinline__ void produce(const CUtensorMap* ta, const CUtensorMap* tb, uint32_t base, uint32_t bars,
                                        int tiles, int KT, int MT, int NT) {
    int q = 0;  // position in the CTA's sequence of k-tiles, over all its output tiles
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        int m0, n0;
        tile_origin(t, MT, NT, m0, n0);
        for (int kt = 0; kt < KT; ++kt, ++q) {
            const int s = q % STAGES;
            if (q >= STAGES) mbar_wait(bars + 8 * (STAGES + s), ((q / STAGES) & 1) ^ 1);
            const uint32_t full = bars + 8 * s, sa = base + s * STAGE_BYTES;
            mbar_expect_tx(full, STAGE_BYTES);
            tma_load_2d(sa, ta, kt * BK, m0, full);
            tma_load_2d(sa + A_BYTES, tb, kt * BK, n0, full);
        }
    }
}
// A consumer's k loop over its tile's stages (q0: the CTA's k-tiles before this tile): wait for each
// stage's copies, issue mma(the stage's address, whether to add to acc: not on the tile's first), and
// hand the previous stage back once its MMAs are done; at the end the last one's, with acc complete
template <typename Mma>
__device__ __forceinline__ void consume(float* acc, uint32_t base, uint32_t bars, int q0, int KT, int t128, Mma mma) {
    for (int kt = 0; kt < KT; ++kt) {
        const int q = q0 + kt, s = q % STAGES;
        mbar_wait(bars + 8 * s, (q / STAGES) & 1);
        tk::wgmma_fence();
        mma(base + s * STAGE_BYTES, kt > 0);
        tk::wgmma_commit();
        tk::wgmma_wait1();  // the previous stage's MMAs are done: hand its buffers back
        if (kt > 0 && t128 == 0) mbar_arrive(bars + 8 * (STAGES + (q - 1) % STAGES));
    }
    tk::wgmma_wait_all();
    tk::fence_regs<128>(acc);
    if (t128 == 0) mbar_arrive(bars + 8 * (STAGES + (q0 + KT - 1) % STAGES));
}

// EPI 0: the forward (c0 = pre, c1 = post); EPI 1: the backward (c0 = dpre, over pre)
template <int EPI>
__global__ void __launch_bounds__(THREADS, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb, int M, int N, int K,
                __nv_bfloat16* c0, __nv_bfloat16* c1, const __nv_bfloat16* pre, int64_t ldc) {
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = (tk::smem_u32(smem_raw) + 1023) & ~1023u;
    const uint32_t staging = base + STAGES * STAGE_BYTES;
    // full[s] at bars + 8s, empty[s] at bars + 8 (STAGES + s), staged at bars + 16 STAGES, then freed and
    // (EPI 1) pre_ready
    const uint32_t bars = staging + BM * STAGE_ROW, staged = bars + 16 * STAGES, freed = staged + 8,
                   pre_ready = freed + 8;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t128 = threadIdx.x % 128;
    const int KT = K / BK, NT = (N + BN - 1) / BN, MT = (M + BM - 1) / BM, tiles = MT * NT;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) mbar_init(bars + 8 * s, 1), mbar_init(bars + 8 * (STAGES + s), 2);
        mbar_init(staged, 256), mbar_init(freed, 32 * EPI_WARPS), mbar_init(pre_ready, 32 * EPI_WARPS);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (warp >= 4) {  // the consumers: rows 64 wg .. 64 wg + 63 of each tile
        asm volatile("setmaxnreg.inc.sync.aligned.u32 200;\n");
        const int wg = warp / 4 - 1;
        for (int i = 0;; ++i) {
            const int t = blockIdx.x + i * gridDim.x;
            if (t >= tiles) break;
            float acc[128];  // (the tile's first MMA writes it whole)
            consume(acc, base, bars, i * KT, KT, t128, [&](uint32_t stage, bool accumulate) {
                const uint32_t sa = stage + wg * 64 * 128, sb = stage + A_BYTES;
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk) {
                    const uint64_t da = tk::smem_desc(sa + kk * 32, 16, 1024), db = tk::smem_desc(sb + kk * 32, 16, 1024);
                    tk::wgmma_m64n256k16_ss(acc, da, db, accumulate || kk > 0);
                }
            });
            // the epilogue has read the last tile's staging (EPI 1: and filled it with this tile's pre)
            if (EPI == 1) mbar_wait(pre_ready, i & 1);
            else if (i > 0) mbar_wait(freed, (i - 1) & 1);
            const uint32_t at = staging + (64 * wg + (warp % 4) * 16 + lane / 4) * STAGE_ROW + 4 * (lane % 4);
#pragma unroll
            for (int j = 0; j < 32; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const uint32_t a = at + 8 * h * STAGE_ROW + 16 * j;
                    uint32_t v = tk::pack_bf16(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
                    if (EPI == 1) v = dpre_pair(v, a);
                    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a), "r"(v));
                }
            mbar_arrive(staged);
        }
        return;
    }
    asm volatile("setmaxnreg.dec.sync.aligned.u32 104;\n");
    if (warp == 0) {  // the producer: one thread issues the loads
        if (lane == 0) produce(&ta, &tb, base, bars, tiles, KT, MT, NT);
        return;
    }
    // the epilogue: warp ew takes rows ew, ew + 3, ... of the staged tile, 8 columns a lane, 8 rows at a
    // time (one warp a scheduler: the rows' work is what hides the latencies). The backward's pre comes
    // into the staging itself, a row by cp.async as soon as the last tile's row has been read there, so
    // that its loads run under the MMAs and the consumers stage dpre over it (pre_ready: every row landed)
    constexpr int GROUP = 8, STEP = GROUP * EPI_WARPS;
    const int ew = warp - 1;
    auto fetch_pre = [&](int m0, int n0, int r) {  // row r of the tile's pre, 16 bytes a lane (zeros past M or N)
        const int row = m0 + r, col = n0 + 8 * lane;
        const bool ok = row < M && col < N;
        tk::cp_async16(staging + r * STAGE_ROW + 16 * lane, ok ? pre + (int64_t)row * ldc + col : pre, ok ? 16 : 0);
    };
    if (EPI == 1 && blockIdx.x < tiles) {
        int m0, n0;
        tile_origin(blockIdx.x, MT, NT, m0, n0);
        for (int r = ew; r < BM; r += EPI_WARPS) fetch_pre(m0, n0, r);
        tk::cp_async_arrive(pre_ready);
    }
    for (int i = 0;; ++i) {
        const int t = blockIdx.x + i * gridDim.x, next = t + gridDim.x;
        if (t >= tiles) break;
        int m0, n0, next_m0 = 0, next_n0 = 0;
        tile_origin(t, MT, NT, m0, n0);
        if (next < tiles) tile_origin(next, MT, NT, next_m0, next_n0);
        const int col = n0 + 8 * lane;
        mbar_wait(staged, i & 1);
#pragma unroll 1
        for (int r0 = ew; r0 < BM; r0 += STEP) {
            uint4 v[GROUP];
#pragma unroll
            for (int u = 0; u < GROUP; ++u) v[u] = tk::lds128(staging + min(r0 + EPI_WARPS * u, BM - 1) * STAGE_ROW + 16 * lane);
#pragma unroll
            for (int u = 0; u < GROUP; ++u) {
                const int r = r0 + EPI_WARPS * u, row = m0 + r;
                const bool ok = r < BM && row < M && col < N;
                __nv_bfloat16* out = c0 + (int64_t)row * ldc + col;
                if constexpr (EPI == 0) {  // pre, and post = relu(pre)^2 of the bf16 pre (in bf16x2: the
                                           // exact square rounded once, as in fp32)
                    uint4 o = v[u];
                    __nv_bfloat162* w = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const __nv_bfloat162 r = relu_pair(w[e]);
                        w[e] = __hmul2(r, r);
                    }
                    if (ok) tk::stg128(out, v[u]), tk::stg128(c1 + (int64_t)row * ldc + col, o);
                } else {  // dpre, as the consumers staged it
                    if (ok) tk::stg128(out, v[u]);
                }
            }
            // the next tile's pre over the rows just read (a row stored above has been read: its store
            // took the value; a row not stored was not needed)
            if (EPI == 1 && next < tiles) {
#pragma unroll
                for (int u = 0; u < GROUP; ++u)
                    if (r0 + EPI_WARPS * u < BM) fetch_pre(next_m0, next_n0, r0 + EPI_WARPS * u);
            }
        }
        if (EPI != 1) mbar_arrive(freed);  // this thread's reads of the staging are done
        else if (next < tiles) tk::cp_async_arrive(pre_ready);
    }
}

// k: the operands' width (a multiple of 64); n a multiple of 8 (16-byte rows)
template <int EPI>
inline cudaError_t launch(const __nv_bfloat16* a, const __nv_bfloat16* w, int rows, int n, int k, __nv_bfloat16* c0,
                          __nv_bfloat16* c1, const __nv_bfloat16* pre, cudaStream_t stream) {
    if (n <= 0 || n % 8 || k <= 0 || k % BK || rows < 0) return cudaErrorInvalidValue;
    if (rows == 0) return cudaSuccess;
    CUtensorMap ta, tb;
    if (tk::make_matrix_map(&ta, a, rows, k, k, BM) != CUDA_SUCCESS ||
        tk::make_matrix_map(&tb, w, n, k, k, BN) != CUDA_SUCCESS)
        return cudaErrorInvalidValue;
    static bool smem_set = false;
    cudaError_t e = tk::allow_smem(gemm_kernel<EPI>, SMEM, smem_set);
    if (e != cudaSuccess) return e;
    const int tiles = (rows + BM - 1) / BM * ((n + BN - 1) / BN);
    gemm_kernel<EPI><<<std::min(tiles, tk::num_sms()), THREADS, SMEM, stream>>>(ta, tb, rows, n, k, c0, c1, pre, n);
    return cudaGetLastError();
}
}  // namespace lrs

// pre = x w^T and post = relu(pre)^2 (x: rows x k, w: n x k, pre and post: rows x n; all contiguous and
// 16-byte aligned, n a multiple of 8, k of 64; rows any)
inline cudaError_t linear_relu_square_forward(const __nv_bfloat16* x, const __nv_bfloat16* w, int rows, int n, int k,
                                              __nv_bfloat16* pre, __nv_bfloat16* post, cudaStream_t stream) {
    return lrs::launch<0>(x, w, rows, n, k, pre, post, nullptr, stream);
}
// dpre = 2 relu(pre) (dout w^T) with dout w^T rounded to bf16 first (as a stored dpost would be):
// dout rows x k, w n x k (the c_proj weight, whose rows are the MLP's hidden units), pre and dpre rows x n
inline cudaError_t linear_relu_square_backward(const __nv_bfloat16* dout, const __nv_bfloat16* w, int rows, int n, int k,
                                               const __nv_bfloat16* pre, __nv_bfloat16* dpre, cudaStream_t stream) {
    return lrs::launch<1>(dout, w, rows, n, k, dpre, nullptr, pre, stream);
}

// -----------------------------------------------------------------------------
// fp8 casts of the lm_head (the record's FP8 matmul mm_t_op by @YouJiacheng, with its static
// scales; the lm_head's transposed (in, out) weight layout by @ChrisJMcCormick): dst = fp8(src /
// scale), saturating to the format's largest finite value, e4m3 (activations, weights) or e5m2
// (gradients). cuBLASLt's fp8 GEMMs want both operands contiguous along the contracted dimension, so
// the cast optionally transposes (64 x 64 tiles through shared memory: reads and writes stay coalesced).

namespace fp8cast {

template <bool E5M2>
__device__ __forceinline__ uint8_t to_fp8(float v) {
    return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, E5M2 ? __NV_E5M2 : __NV_E4M3);
}

template <bool E5M2>
__global__ void cast_kernel(const __nv_bfloat16* src, int64_t lds, uint8_t* dst, int64_t ldd, int rows, int cols,
                            float inv_scale) {
    const int c8 = cols / 8;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (int64_t)rows * c8;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int r = (int)(i / c8), c = (int)(i % c8) * 8;
        float f[8];
        tk::load8(src + r * lds + c, f);
        uint2 out;
        uint8_t* o = reinterpret_cast<uint8_t*>(&out);
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = to_fp8<E5M2>(f[e] * inv_scale);
        *reinterpret_cast<uint2*>(dst + r * ldd + c) = out;
    }
}

// dst[c][r] = fp8(src[r][c] / scale), one 64 x 64 tile per CTA of 256 threads
template <bool E5M2>
__global__ void cast_transpose_kernel(const __nv_bfloat16* src, int64_t lds, uint8_t* dst, int64_t ldd, int rows,
                                      int cols, float inv_scale) {
    __shared__ uint8_t tile[64][64 + 4];
    const int r0 = blockIdx.y * 64, c0 = blockIdx.x * 64;
    const int t = threadIdx.x;
    // read: 64 rows x 64 bf16, 8 per thread (16 B), 8 threads a row
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
        const int r = pass * 32 + t / 8, c = (t % 8) * 8;
        if (r0 + r < rows && c0 + c < cols) {
            float f[8];
            tk::load8(src + (int64_t)(r0 + r) * lds + c0 + c, f);
#pragma unroll
            for (int e = 0; e < 8; ++e) tile[c + e][r] = to_fp8<E5M2>(f[e] * inv_scale);
        }
    }
    __syncthreads();
    // write: 64 rows (source columns) x 64 bytes, 16 per thread, 4 threads a row
    const int c = t / 4, r = (t % 4) * 16;
    if (c0 + c < cols && r0 + r < rows) {
        uint4 out;
        uint8_t* o = reinterpret_cast<uint8_t*>(&out);
#pragma unroll
        for (int k = 0; k < 16; ++k) o[k] = tile[c][r + k];
        *reinterpret_cast<uint4*>(dst + (int64_t)(c0 + c) * ldd + r0 + r) = out;
    }
}

}  // namespace fp8cast

// src: rows x cols bf16 (row stride lds); dst: rows x cols fp8 (ldd), or cols x rows when transposed.
// rows and cols multiples of 16; strides multiples of 16 elements.
inline cudaError_t cast_to_fp8(const __nv_bfloat16* src, int64_t lds, void* dst, int64_t ldd, int rows, int cols,
                               float scale, bool e5m2, bool transpose, cudaStream_t stream) {
    if (rows % 16 || cols % 16 || lds % 16 || ldd % 16) return cudaErrorInvalidValue;
    const float inv = 1.f / scale;
    uint8_t* d = static_cast<uint8_t*>(dst);
    if (transpose) {
        dim3 grid((cols + 63) / 64, (rows + 63) / 64);
        if (e5m2) fp8cast::cast_transpose_kernel<true><<<grid, 256, 0, stream>>>(src, lds, d, ldd, rows, cols, inv);
        else fp8cast::cast_transpose_kernel<false><<<grid, 256, 0, stream>>>(src, lds, d, ldd, rows, cols, inv);
    } else {
        const int64_t n = (int64_t)rows * (cols / 8);
        const unsigned blocks = tk::grid_stride_blocks(n, 16);
        if (e5m2) fp8cast::cast_kernel<true><<<blocks, 256, 0, stream>>>(src, lds, d, ldd, rows, cols, inv);
        else fp8cast::cast_kernel<false><<<blocks, 256, 0, stream>>>(src, lds, d, ldd, rows, cols, inv);
    }
    return cudaGetLastError();
}

// -----------------------------------------------------------------------------
// Attention prologue: QK RMSNorm (@Grad62304977), half-truncated rotary (@YouJiacheng, with base
// frequency tuning) with the YaRN-updated frequencies, and the partial key offset of the
// long-window layers (key dims 32-63 and 96-127 take the previous token's values: 1-layer
// induction). Reads q and k from the QKV projection (T x 3*heads*128), writes them contiguous
// (T x heads x 128). Rotation of the pair (2i, 2i+1) by theta = pos * freq[i] with bf16-rounded cos/sin
// as the record's tables; dims 64-127 have frequency zero. pos is the token, or for the paired-head
// layers 2*token + (head & 1): the record rotates head pairs (2j, 2j+1) as one 256-wide row with
// even/odd positions.
// Half a warp per (token, head, q|k); thread j holds dims 8j..8j+7.

namespace qkrope {

struct Params {
    const __nv_bfloat16* qkv;  // q at column h*128, k at heads*128 + h*128
    int64_t ld;
    __nv_bfloat16 *q, *k;      // tokens x heads x 128
    int tokens, heads;
    const __nv_bfloat162* rope;  // (cos, sin) of pair i at position pos: rope[pos * 32 + i] (rope_table)
    float eps;
    bool paired, key_offset;
    // backward: gradients of q and k in, of the QKV projection's q and k columns out
    const __nv_bfloat16 *dq, *dk;
    __nv_bfloat16* dqkv;
    int64_t ld_grad;
};

// The rotary table, rounded to bf16 like the record's cos/sin tables: theta = pos * freq[i] in
// fp32, then accurate cos/sin (the arguments reach 1e5 radians: computed once per frequency change
// rather than in every layer's prologue).
struct Freqs {
    float f[32];  // angular frequency of pair i (dims 2i, 2i+1)
};
__global__ void table_kernel(const Freqs fr, int64_t n, __nv_bfloat162* table) {
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < n; idx += (int64_t)gridDim.x * blockDim.x) {
        const float theta = (float)(idx / 32) * fr.f[idx % 32];
        table[idx] = __floats2bfloat162_rn(cosf(theta), sinf(theta));
    }
}

// 16 threads per row (token, head, q or k), 8 values each; a warp takes the q and k rows of one
// (token, head), which share their rotary position. Lanes 0-7 hold the rotated dims 0-63 (pairs
// 4j..4j+3: one 16-byte table read), lanes 8-15 the unrotated half.

// the key offset's dims (32-63 and 96-127) are lanes 4-7 and 12-15 of a row
__device__ __forceinline__ bool shifted_part(int j) { return j & 4; }

// this half-warp's row; false past the last (whole warps: the row count is even)
struct Row {
    bool is_k;
    int t, h, pos, j;  // pos: the rotary position; j: this thread's 8 values in the row
    int64_t col;       // this thread's first column in the QKV projection
    int64_t out;       // its first element in q or k (tokens x heads x 128)
};
__device__ __forceinline__ bool row_of(const Params& p, Row& r) {
    const int64_t hw = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 16;
    if (hw >= (int64_t)p.tokens * p.heads * 2) return false;
    r.is_k = hw & 1;
    r.t = (int)(hw / 2 / p.heads), r.h = (int)(hw / 2 % p.heads);
    r.pos = p.paired ? 2 * r.t + (r.h & 1) : r.t;
    r.j = threadIdx.x & 15;
    r.col = (r.is_k ? p.heads * 128 : 0) + r.h * 128 + r.j * 8;
    r.out = ((int64_t)r.t * p.heads + r.h) * 128 + r.j * 8;
    return true;
}
// cos, sin of this thread's 4 pairs (1, 0 past dim 64)
__device__ __forceinline__ void rotations(const Params& p, const Row& w, float c[4], float s[4]) {
    if (w.j >= 8) {
#pragma unroll
        for (int q = 0; q < 4; ++q) c[q] = 1.f, s[q] = 0.f;
        return;
    }
    const uint4 raw = *reinterpret_cast<const uint4*>(p.rope + (int64_t)w.pos * 32 + w.j * 4);
    const uint32_t u[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const float2 cs = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u[q]));
        c[q] = cs.x, s[q] = cs.y;
    }
}
// 1 / rms of the 128-vector whose 8 values per thread are x
__device__ __forceinline__ float inv_rms(const Params& p, const float x[8]) {
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) ss += x[e] * x[e];
    return rsqrtf(tk::half_warp_sum(ss) / 128.f + p.eps);
}

__global__ void fwd_kernel(const Params p) {
    Row w;
    if (!row_of(p, w)) return;
    float x[8], c[4], s[4], y[8];
    tk::load8(p.qkv + w.t * p.ld + w.col, x);
    rotations(p, w, c, s);
    const float r = inv_rms(p, x);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const float a = x[2 * q] * r, b = x[2 * q + 1] * r;
        y[2 * q] = c[q] * a + s[q] * b;
        y[2 * q + 1] = c[q] * b - s[q] * a;
    }
    __nv_bfloat16* out = (w.is_k ? p.k : p.q) + w.out;
    if (!(w.is_k && p.key_offset && shifted_part(w.j))) {
        tk::store8(out, y);
    } else {  // shifted dims go to the next token; token 0 keeps its own
        if (w.t + 1 < p.tokens) tk::store8(out + (int64_t)p.heads * 128, y);
        if (w.t == 0) tk::store8(out, y);
    }
}

__global__ void bwd_kernel(const Params p) {
    Row w;
    if (!row_of(p, w)) return;
    const __nv_bfloat16* g = (w.is_k ? p.dk : p.dq) + w.out;
    float dy[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (!(w.is_k && p.key_offset && shifted_part(w.j))) {
        tk::load8(g, dy);
    } else {  // this token's shifted dims reached the next token (and itself, for token 0)
        if (w.t + 1 < p.tokens) tk::load8(g + (int64_t)p.heads * 128, dy);
        if (w.t == 0) {
            float own[8];
            tk::load8(g, own);
#pragma unroll
            for (int e = 0; e < 8; ++e) dy[e] += own[e];
        }
    }
    float x[8], c[4], s[4];
    tk::load8(p.qkv + w.t * p.ld + w.col, x);
    rotations(p, w, c, s);
    // through the rotation (its transpose), then the norm
    float dn[8];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        dn[2 * q] = c[q] * dy[2 * q] - s[q] * dy[2 * q + 1];
        dn[2 * q + 1] = s[q] * dy[2 * q] + c[q] * dy[2 * q + 1];
    }
    const float r = inv_rms(p, x);
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) dot += dn[e] * x[e];
    const float cc = r * r * tk::half_warp_sum(dot) / 128.f;
    float dx[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) dx[e] = r * (dn[e] - x[e] * cc);
    tk::store8(p.dqkv + w.t * p.ld_grad + w.col, dx);
}

}  // namespace qkrope

// table: positions x 32 (cos, sin) pairs
inline cudaError_t rope_table(const qkrope::Freqs& freq, int positions, __nv_bfloat162* table, cudaStream_t stream) {
    const int64_t n = (int64_t)positions * 32;
    qkrope::table_kernel<<<tk::grid_stride_blocks(n, 16), 256, 0, stream>>>(freq, n, table);
    return cudaGetLastError();
}
inline cudaError_t qk_norm_rope_forward(const qkrope::Params& p, cudaStream_t stream) {
    const int64_t warps = (int64_t)p.tokens * p.heads;  // one (token, head) per warp
    qkrope::fwd_kernel<<<(unsigned)((warps + 7) / 8), 256, 0, stream>>>(p);
    return cudaGetLastError();
}
inline cudaError_t qk_norm_rope_backward(const qkrope::Params& p, cudaStream_t stream) {
    const int64_t warps = (int64_t)p.tokens * p.heads;
    qkrope::bwd_kernel<<<(unsigned)((warps + 7) / 8), 256, 0, stream>>>(p);
    return cudaGetLastError();
}

// -----------------------------------------------------------------------------
// Optimizer kernels (record 61's NorMuonAndAdam, compiled there by torch.compile): Polar Express's
// input normalisation (its iterations are cuBLASLt's, in train_gpt.cu), NorMuon's momentum, variance
// reduction (arXiv 2510.05491) and cautious weight decay with mantissa tracking, Adam, and the tied
// embedding's transposes. The record's optimizer contributors include @YouJiacheng,
// @KonstantinWilleke, @alexrgilbert, @adricarda, @tuttyfrutyee, @vdlad, @ryanyang0, @vagrawal,
// @varunneal, @chrisjmccormick.

namespace opt {

// Batched transpose: dst[b][c][r] = src[b][r][c] (or += with ACCUMULATE: the tied embedding's
// gradient added into lm_head's), 64 x 64 tiles through shared memory so reads and writes coalesce.
// (embed is tied to lm_head until 2/3 of training, then untied: @classiclarryd; the two are each
// other's transpose as lm_head is stored (in, out).)
template <typename T, bool ACCUMULATE>
__global__ void transpose_kernel(const T* src, int64_t src_stride, T* dst, int64_t dst_stride, int rows, int cols) {
    __shared__ T tile[64][64 + 2];
    const T* s = src + blockIdx.z * src_stride;
    T* d = dst + blockIdx.z * dst_stride;
    const int r0 = blockIdx.y * 64, c0 = blockIdx.x * 64;
    for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x) {
        const int r = i / 64, c = i % 64;
        if (r0 + r < rows && c0 + c < cols) tile[r][c] = s[(int64_t)(r0 + r) * cols + c0 + c];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x) {
        const int c = i / 64, r = i % 64;
        if (r0 + r < rows && c0 + c < cols) {
            T* out = &d[(int64_t)(c0 + c) * rows + r0 + r];
            if (ACCUMULATE) *out = (T)((float)*out + (float)tile[r][c]);
            else *out = tile[r][c];
        }
    }
}

// Polar Express input: X = bf16(G) / (||bf16(G)||_F * 1.02 + 1e-6), per matrix of a batch (fp32 G).
// Deterministic two-pass norm: per-block partial sums, then every block adds them in order.
constexpr int NORM_BLOCKS = 32;
__global__ void sumsq_kernel(const float* g, int64_t n, float* partial) {
    const float* m = g + blockIdx.y * n;
    float s = 0.f;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float v = tk::round_bf16(m[i]);
        s += v * v;
    }
    __shared__ float red[32];
    const float t = tk::block_sum0(s, red);
    if (threadIdx.x == 0) partial[blockIdx.y * NORM_BLOCKS + blockIdx.x] = t;
}
__global__ void normalize_kernel(const float* g, int64_t n, const float* partial, __nv_bfloat16* x) {
    float s = 0.f;
    for (int i = 0; i < NORM_BLOCKS; ++i) s += partial[blockIdx.y * NORM_BLOCKS + i];
    const float inv = 1.f / (sqrtf(s) * 1.02f + 1e-6f);
    const float* m = g + blockIdx.y * n;
    __nv_bfloat16* o = x + blockIdx.y * n;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        o[i] = __float2bfloat16(tk::round_bf16(m[i]) * inv);
}

// torch.lerp's formula: exact at both ends
__device__ __forceinline__ float lerp(float start, float end, float w) {
    const float diff = end - start;
    return w < 0.5f ? start + w * diff : end - diff * (1.f - w);
}
// Nesterov-style momentum in fp32: buf = lerp(buf, g, 1 - mu); out = lerp(g, buf, mu)
__global__ void momentum_kernel(const __nv_bfloat16* grad, float* buf, float* out, int64_t n, float mu) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float g = __bfloat162float(grad[i]);
        const float b = lerp(buf[i], g, 1.f - mu);
        buf[i] = b;
        out[i] = lerp(g, b, mu);
    }
}

// NorMuon second-moment normalisation (arXiv 2510.05491), rows >= cols (reduced along the
// columns; the record's other orientation does not occur in the banks): v_mean[r] = mean_c v^2,
// buf = lerp(buf, v_mean, 1 - beta2), s[r] = rsqrt(max(buf, 1e-10)), v *= s[r] ||v|| / ||v s||,
// in place on bf16 v. Two kernels so every matrix spreads over many CTAs: rows (a warp each, 32
// a CTA) give their scales and per-CTA partial norms; then every CTA adds the partials in order.
constexpr int VAR_ROWS = 32;
__global__ void __launch_bounds__(1024) variance_rows_kernel(const __nv_bfloat16* v, float* second_moment, int rows,
                                                             int cols, float beta2, float* row_scale, float* partial) {
    __shared__ float red[2][32];
    const int b = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int r = blockIdx.x * VAR_ROWS + warp;
    float norm_sq = 0.f, new_sq = 0.f;
    if (r < rows) {
        const __nv_bfloat16* row = v + ((int64_t)b * rows + r) * cols;
        float s = 0.f;
        for (int c = lane; c < cols; c += 32) {
            float x = __bfloat162float(row[c]);
            s += x * x;
        }
        s = tk::warp_sum(s);
        const float mean = s / cols;
        float* buf = second_moment + (int64_t)b * rows + r;
        const float m = lerp(*buf, mean, 1.f - beta2);
        const float step = rsqrtf(fmaxf(m, 1e-10f));
        __syncwarp();
        if (lane == 0) *buf = m, row_scale[(int64_t)b * rows + r] = step;
        norm_sq = mean * cols, new_sq = mean * cols * step * step;
    }
    if (lane == 0) red[0][warp] = norm_sq, red[1][warp] = new_sq;
    __syncthreads();
    if (threadIdx.x == 0) {
        float a = 0.f, c = 0.f;
        for (int w = 0; w < VAR_ROWS; ++w) a += red[0][w], c += red[1][w];
        const int blocks = gridDim.x;
        partial[((int64_t)b * blocks + blockIdx.x) * 2] = a;
        partial[((int64_t)b * blocks + blockIdx.x) * 2 + 1] = c;
    }
}
__global__ void variance_apply_kernel(__nv_bfloat16* v, int rows, int cols, const float* row_scale, const float* partial,
                                      int row_blocks) {
    const int b = blockIdx.y;
    float a = 0.f, c = 0.f;
    for (int i = 0; i < row_blocks; ++i) a += partial[((int64_t)b * row_blocks + i) * 2], c += partial[((int64_t)b * row_blocks + i) * 2 + 1];
    const float ratio = sqrtf(a) / fmaxf(sqrtf(c), 1e-10f);
    __nv_bfloat16* m = v + (int64_t)b * rows * cols;
    const float* rs = row_scale + (int64_t)b * rows;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (int64_t)rows * cols; i += (int64_t)gridDim.x * blockDim.x) {
        const __nv_bfloat16 scale = __float2bfloat16(rs[i / cols] * ratio);
        m[i] = __float2bfloat16(__bfloat162float(m[i]) * __bfloat162float(scale));
    }
}

// Cautious weight decay and the update of bf16 weights kept exact in fp32 through a uint16
// mantissa buffer (the low 16 bits): p = p - p [v p >= 0] wd lr - v lr, per matrix lr.
__global__ void normuon_apply_kernel(uint16_t* p, uint16_t* mantissa, const __nv_bfloat16* v, int64_t per_matrix,
                                     int count, const float* lr, float wd) {
    const int64_t n = per_matrix * count;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float l = lr[i / per_matrix];
        uint32_t raw = ((uint32_t)p[i] << 16) | mantissa[i];
        const float x = __uint_as_float(raw);
        const float g = __bfloat162float(v[i]);
        const float decay = g * x >= 0.f ? x * wd * l : 0.f;
        raw = __float_as_uint(x - decay - g * l);
        p[i] = (uint16_t)(raw >> 16);
        mantissa[i] = (uint16_t)(raw & 0xffff);
    }
}

// Adam with bias correction folded into step_size, and cautious weight decay:
// m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; u = m / (sqrt(v) + eps) * step_size;
// u += p [u p > 0] eff_wd; p -= u. T is the parameter's type (bf16 or fp32), G the gradient's.
template <typename T, typename G>
__global__ void adam_kernel(T* p, const G* grad, float* exp_avg, float* exp_avg_sq, int64_t n, float beta1,
                            float beta2, float eps, float step_size, float eff_wd) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float g = (float)grad[i];
        const float m = beta1 * exp_avg[i] + (1.f - beta1) * g;
        const float v = beta2 * exp_avg_sq[i] + (1.f - beta2) * g * g;
        exp_avg[i] = m, exp_avg_sq[i] = v;
        const float x = (float)p[i];
        float u = m / (sqrtf(v) + eps) * step_size;
        if (u * x > 0.f) u += x * eff_wd;
        p[i] = (T)(x - u);
    }
}

inline unsigned grid_for(int64_t n) { return tk::grid_stride_blocks(n, 8); }

}  // namespace opt

// dst (batch x cols x rows) = src^T, or += src^T with accumulate
template <typename T>
inline cudaError_t transpose(const T* src, T* dst, int batch, int rows, int cols, bool accumulate, cudaStream_t stream) {
    dim3 grid((cols + 63) / 64, (rows + 63) / 64, batch);
    const int64_t stride = (int64_t)rows * cols;
    if (accumulate) opt::transpose_kernel<T, true><<<grid, 256, 0, stream>>>(src, stride, dst, stride, rows, cols);
    else opt::transpose_kernel<T, false><<<grid, 256, 0, stream>>>(src, stride, dst, stride, rows, cols);
    return cudaGetLastError();
}
inline cudaError_t transpose_bf16(const __nv_bfloat16* src, __nv_bfloat16* dst, int batch, int rows, int cols,
                                  cudaStream_t stream) {
    return transpose(src, dst, batch, rows, cols, false, stream);
}
// partial: batch * opt::NORM_BLOCKS floats of workspace
inline cudaError_t frobenius_normalize(const float* g, __nv_bfloat16* x, int batch, int64_t n, float* partial,
                                       cudaStream_t stream) {
    opt::sumsq_kernel<<<dim3(opt::NORM_BLOCKS, batch), 256, 0, stream>>>(g, n, partial);
    opt::normalize_kernel<<<dim3(opt::NORM_BLOCKS, batch), 256, 0, stream>>>(g, n, partial, x);
    return cudaGetLastError();
}
inline cudaError_t nesterov_momentum(const __nv_bfloat16* grad, float* buf, float* out, int64_t n, float mu,
                                     cudaStream_t stream) {
    opt::momentum_kernel<<<opt::grid_for(n), 256, 0, stream>>>(grad, buf, out, n, mu);
    return cudaGetLastError();
}
// workspace: normuon_variance_workspace(batch, rows) floats
inline size_t normuon_variance_workspace(int batch, int rows) {
    return (size_t)batch * (rows + 2 * ((rows + opt::VAR_ROWS - 1) / opt::VAR_ROWS));
}
inline cudaError_t normuon_variance(__nv_bfloat16* v, float* second_moment, int batch, int rows, int cols, float beta2,
                                    float* workspace, cudaStream_t stream) {
    if (rows < cols) return cudaErrorInvalidValue;
    const int row_blocks = (rows + opt::VAR_ROWS - 1) / opt::VAR_ROWS;
    float* row_scale = workspace;
    float* partial = workspace + (size_t)batch * rows;
    opt::variance_rows_kernel<<<dim3(row_blocks, batch), 32 * opt::VAR_ROWS, 0, stream>>>(v, second_moment, rows, cols,
                                                                                          beta2, row_scale, partial);
    opt::variance_apply_kernel<<<dim3(64, batch), 256, 0, stream>>>(v, rows, cols, row_scale, partial, row_blocks);
    return cudaGetLastError();
}
// lr: count floats (device), the effective lr of each matrix
inline cudaError_t normuon_apply(__nv_bfloat16* p, uint16_t* mantissa, const __nv_bfloat16* v, int64_t per_matrix,
                                 int count, const float* lr, float wd, cudaStream_t stream) {
    opt::normuon_apply_kernel<<<opt::grid_for(per_matrix * count), 256, 0, stream>>>(
        reinterpret_cast<uint16_t*>(p), mantissa, v, per_matrix, count, lr, wd);
    return cudaGetLastError();
}
template <typename T, typename G>
inline cudaError_t adam_update(T* p, const G* grad, float* exp_avg, float* exp_avg_sq, int64_t n, float beta1, float beta2,
                               float eps, float step_size, float eff_wd, cudaStream_t stream) {
    opt::adam_kernel<T, G><<<opt::grid_for(n), 256, 0, stream>>>(p, grad, exp_avg, exp_avg_sq, n, beta1, beta2, eps,
                                                                step_size, eff_wd);
    return cudaGetLastError();
}

// -----------------------------------------------------------------------------
// Embedding lookups (embed and the value embeddings ve0..ve2) and their deterministic backward:
// the positions are sorted by token id once per batch (a stable radix sort), then for every
// distinct id its gradient rows are summed in position order (fp32), all tables in one pass, and
// added to the tables' gradient rows: no atomics, the same bits every run. Rows of 768 bf16. (Value embeddings:
// @KoszarskyB, inspired by @Grad62304977's value residual, arXiv 2410.17897.)

namespace embed {

constexpr int DIM = 768;

__global__ void gather_kernel(const int* ids, int tokens, const __nv_bfloat16* table, __nv_bfloat16* out, int64_t ld_out) {
    const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (t >= tokens) return;
    const uint4* src = reinterpret_cast<const uint4*>(table + (int64_t)ids[t] * DIM);
    uint4* dst = reinterpret_cast<uint4*>(out + t * ld_out);
#pragma unroll
    for (int v = 0; v < DIM / 256; ++v) dst[v * 32 + lane] = src[v * 32 + lane];
}

__global__ void positions_kernel(int* pos, int tokens) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < tokens) pos[i] = i;
}

// Up to MAX_TABLES tables looked up with the same ids, backward in one pass (the embedding and the
// three value embeddings share the sort).
constexpr int MAX_TABLES = 4;
struct Tables {
    const __nv_bfloat16* grad[MAX_TABLES];  // tokens x DIM, row stride ld
    __nv_bfloat16* table_grad[MAX_TABLES];  // vocab x DIM
    int count;
    int64_t ld;
};

// The sorted ids in windows of W rows; one warp per (window, 128-column slice). A warp walks its
// window's runs of equal ids (segments): each lane sums 4 columns of every table over a segment in
// position order, in fp32. A run inside the window goes straight into the tables' gradient rows; the
// piece of a run that crosses the window's edge goes to the window's slot in a workspace (its first
// segment, if the run began before the window, to slot 0; its last, if the run goes on after it,
// to slot 1), and window_sums_kernel adds a crossing run's pieces in window order. Long runs (a
// comma is ~5% of English text, ~2,500 rows of a 49k-token micro-batch) thus spread over many warps
// where one warp walking the whole run was bound by memory latency. ROWS rows of every table are
// loaded before any is added, so ROWS x NT independent loads are in flight; the additions keep the
// order of positions, so the bits depend on neither ROWS, NT nor the slicing (the same sums as one
// table at a time).
constexpr int SLICE = 128, SLICES = DIM / SLICE, W = 64;
// the workspace: per window, 2 slots of MAX_TABLES x DIM floats
__host__ __device__ inline size_t window_slot(int window, int slot, int k) {
    return (((size_t)window * 2 + slot) * MAX_TABLES + k) * DIM;
}

template <int NT>
__device__ __forceinline__ void load_rows(const Tables& t, int id, int col, uint2 (&row)[NT]) {
#pragma unroll
    for (int k = 0; k < NT; ++k) row[k] = *reinterpret_cast<const uint2*>(t.table_grad[k] + (int64_t)id * DIM + col);
}
// rows of the tables' gradient (as load_rows read them) + acc, stored
template <int NT>
__device__ __forceinline__ void add_to_rows(const Tables& t, int id, int col, const uint2 (&row)[NT], const float (&acc)[NT][4]) {
#pragma unroll
    for (int k = 0; k < NT; ++k) {
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&row[k]);
        const float2 lo = __bfloat1622float2(h[0]), hi = __bfloat1622float2(h[1]);
        uint2 u;
        u.x = tk::pack_bf16(lo.x + acc[k][0], lo.y + acc[k][1]);
        u.y = tk::pack_bf16(hi.x + acc[k][2], hi.y + acc[k][3]);
        *reinterpret_cast<uint2*>(t.table_grad[k] + (int64_t)id * DIM + col) = u;
    }
}

// ROWS x NT = 12 loads in flight a lane, at three CTAs an SM: at 64 / NT rows (208 registers) one CTA
// fit an SM, 8 warps, whose one-row segments (most are) waited on memory latency one after another
// (the loop's embedding backward 3.12 -> 1.91 ms per 393k step; two rows at four CTAs an SM: 1.98)
template <int NT>
__global__ void __launch_bounds__(256, 3) scatter_add_kernel(const int* sorted_ids, const int* sorted_pos, int tokens,
                                                             Tables t, float* ws) {
    constexpr int ROWS = 12 / NT;
    const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    const int q = warp / SLICES, col = (warp % SLICES) * SLICE + lane * 4;
    const int i0 = q * W, i1 = min(tokens, i0 + W);
    if (i0 >= tokens) return;
    // the window's ids in two registers a lane, and the segments' first rows as a bit mask
    const int a0 = i0 + lane, a1 = i0 + 32 + lane;
    const int id0 = a0 < i1 ? sorted_ids[a0] : -1, id1 = a1 < i1 ? sorted_ids[a1] : -1;
    // and their positions, so that a segment's row loads wait on nothing
    const int pos0 = a0 < i1 ? sorted_pos[a0] : 0, pos1 = a1 < i1 ? sorted_pos[a1] : 0;
    int up0 = __shfl_up_sync(0xffffffffu, id0, 1), up1 = __shfl_up_sync(0xffffffffu, id1, 1);
    const int last0 = __shfl_sync(0xffffffffu, id0, 31);
    if (lane == 0) up1 = last0;
    const uint64_t firsts = (uint64_t)__ballot_sync(0xffffffffu, a0 < i1 && (lane == 0 || id0 != up0)) |
                            (uint64_t)__ballot_sync(0xffffffffu, a1 < i1 && id1 != up1) << 32;
    const int before = i0 > 0 ? sorted_ids[i0 - 1] : -1, after = i1 < tokens ? sorted_ids[i1] : -1;
    const int n = i1 - i0;
    for (int r = 0; r < n;) {
        const uint64_t later = r + 1 < 64 ? firsts >> (r + 1) : 0;
        const int e = later ? r + 1 + __ffsll((long long)later) - 1 : n;  // the segment is rows [r, e)
        const int id = r < 32 ? __shfl_sync(0xffffffffu, id0, r) : __shfl_sync(0xffffffffu, id1, r - 32);
        // the tables' rows this segment adds to, loaded beside its first rows: a short segment (most
        // are) then waits for one round of loads, not two (no other warp writes them in this kernel)
        uint2 row[NT];
        load_rows<NT>(t, id, col, row);
        float acc[NT][4] = {};
        for (int j0 = i0 + r; j0 < i0 + e; j0 += ROWS) {
            uint2 v[ROWS][NT];
#pragma unroll
            for (int rr = 0; rr < ROWS; ++rr)
                if (j0 + rr < i0 + e) {  // (the same for the whole warp)
                    const int w = j0 + rr - i0;
                    const int pos = w < 32 ? __shfl_sync(0xffffffffu, pos0, w) : __shfl_sync(0xffffffffu, pos1, w - 32);
                    const int64_t off = (int64_t)pos * t.ld + col;
#pragma unroll
                    for (int k = 0; k < NT; ++k) v[rr][k] = *reinterpret_cast<const uint2*>(t.grad[k] + off);
                }
#pragma unroll
            for (int rr = 0; rr < ROWS; ++rr)
                if (j0 + rr < i0 + e) {
#pragma unroll
                    for (int k = 0; k < NT; ++k) {
                        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[rr][k]);
                        const float2 lo = __bfloat1622float2(h[0]), hi = __bfloat1622float2(h[1]);
                        acc[k][0] += lo.x, acc[k][1] += lo.y, acc[k][2] += hi.x, acc[k][3] += hi.y;
                    }
                }
        }
        const bool begun = r == 0 && before == id, goes_on = e == n && after == id;
        if (!begun && !goes_on) {
            add_to_rows<NT>(t, id, col, row, acc);
        } else {  // a piece of a crossing run
#pragma unroll
            for (int k = 0; k < NT; ++k)
                *reinterpret_cast<float4*>(ws + window_slot(q, begun ? 0 : 1, k) + col) =
                    make_float4(acc[k][0], acc[k][1], acc[k][2], acc[k][3]);
        }
        r = e;
    }
}

// A run crossing window edges, from the window where it begins (its piece in slot 1) through every
// window it reaches (their slot 0), added in window order, then into the tables' gradient rows.
// One warp per (window, slice); only warps at a crossing run's first window work.
template <int NT>
__global__ void __launch_bounds__(256) window_sums_kernel(const int* sorted_ids, int tokens, Tables t, const float* ws) {
    const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    const int q = warp / SLICES, col = (warp % SLICES) * SLICE + lane * 4;
    const int i0 = q * W, i1 = i0 + W;
    if (i1 >= tokens) return;  // no run goes on past the last window
    const int id = sorted_ids[i1 - 1];
    if (sorted_ids[i1] != id) return;                      // the window's last run ends in it
    if (sorted_ids[i0] == id && i0 > 0 && sorted_ids[i0 - 1] == id) return;  // it began in an earlier window
    float acc[NT][4];
#pragma unroll
    for (int k = 0; k < NT; ++k) {
        const float4 a = *reinterpret_cast<const float4*>(ws + window_slot(q, 1, k) + col);
        acc[k][0] = a.x, acc[k][1] = a.y, acc[k][2] = a.z, acc[k][3] = a.w;
    }
    for (int w = q + 1;; ++w) {
#pragma unroll
        for (int k = 0; k < NT; ++k) {
            const float4 a = *reinterpret_cast<const float4*>(ws + window_slot(w, 0, k) + col);
            acc[k][0] += a.x, acc[k][1] += a.y, acc[k][2] += a.z, acc[k][3] += a.w;
        }
        const int end = (w + 1) * W;
        if (end >= tokens || sorted_ids[end] != id) break;  // the run ends in window w
    }
    uint2 row[NT];
    load_rows<NT>(t, id, col, row);
    add_to_rows<NT>(t, id, col, row, acc);
}

}  // namespace embed

inline cudaError_t embedding_forward(const int* ids, int tokens, const __nv_bfloat16* table, __nv_bfloat16* out,
                                     int64_t ld_out, cudaStream_t stream) {
    if (tokens <= 0) return cudaSuccess;
    embed::gather_kernel<<<(tokens + 7) / 8, 256, 0, stream>>>(ids, tokens, table, out, ld_out);
    return cudaGetLastError();
}

// Sorts a batch's token ids once (sort()), then adds gradient rows into any number of tables
// looked up with those ids (accumulate()).
class EmbeddingBackward {
   public:
    explicit EmbeddingBackward(int max_tokens) : max_tokens_(max_tokens) {
        size_t bytes = 0;
        cub::DeviceRadixSort::SortPairs(nullptr, bytes, (const int*)nullptr, (int*)nullptr, (const int*)nullptr,
                                        (int*)nullptr, max_tokens, 0, 16);
        temp_bytes_ = (bytes + 255) / 256 * 256;  // the int arrays that follow stay aligned
        cudaError_t e = cudaMalloc(&temp_, temp_bytes_ + 4 * (size_t)max_tokens * sizeof(int));
        if (e != cudaSuccess) temp_ = nullptr;
        pos_ = reinterpret_cast<int*>(static_cast<char*>(temp_) + temp_bytes_);
        sorted_ids_ = pos_ + max_tokens, sorted_pos_ = pos_ + 2 * max_tokens;
        // crossing runs' pieces: 2 slots a window
        if (cudaMalloc(&ws_, embed::window_slot((max_tokens + embed::W - 1) / embed::W, 0, 0) * sizeof(float)) != cudaSuccess)
            ws_ = nullptr;
    }
    ~EmbeddingBackward() { cudaFree(temp_), cudaFree(ws_); }
    EmbeddingBackward(const EmbeddingBackward&) = delete;
    EmbeddingBackward& operator=(const EmbeddingBackward&) = delete;

    // ids < 65536 (the padded vocabulary is 50304)
    cudaError_t sort(const int* ids, int tokens, cudaStream_t stream) {
        if (!temp_ || !ws_) return cudaErrorMemoryAllocation;
        if (tokens > max_tokens_) return cudaErrorInvalidValue;
        tokens_ = tokens;
        embed::positions_kernel<<<(tokens + 255) / 256, 256, 0, stream>>>(pos_, tokens);
        size_t bytes = temp_bytes_;
        return cub::DeviceRadixSort::SortPairs(temp_, bytes, ids, sorted_ids_, pos_, sorted_pos_, tokens, 0, 16, stream);
    }
    // table_grad[id] += sum of grad rows at the positions of id (grad: tokens x 768, row stride ld),
    // for `count` (1 to 4) pairs of gradient and table gradient in one pass
    cudaError_t accumulate(int count, const __nv_bfloat16* const* grads, int64_t ld, __nv_bfloat16* const* table_grads,
                           cudaStream_t stream) {
        if (count < 1 || count > embed::MAX_TABLES || ld % 4) return cudaErrorInvalidValue;
        if (tokens_ <= 0) return cudaSuccess;
        embed::Tables t{};
        for (int k = 0; k < count; ++k) t.grad[k] = grads[k], t.table_grad[k] = table_grads[k];
        t.count = count, t.ld = ld;
        const int windows = (tokens_ + embed::W - 1) / embed::W;
        const unsigned blocks = (unsigned)(((int64_t)windows * embed::SLICES + 7) / 8);
        // one instance per table count: the loads in flight fill a fixed register budget
        switch (count) {
            case 1: launch<1>(blocks, t, stream); break;
            case 2: launch<2>(blocks, t, stream); break;
            case 3: launch<3>(blocks, t, stream); break;
            default: launch<4>(blocks, t, stream); break;
        }
        return cudaGetLastError();
    }
    cudaError_t accumulate(const __nv_bfloat16* grad, int64_t ld, __nv_bfloat16* table_grad, cudaStream_t stream) {
        return accumulate(1, &grad, ld, &table_grad, stream);
    }

   private:
    template <int NT>
    void launch(unsigned blocks, const embed::Tables& t, cudaStream_t stream) {
        embed::scatter_add_kernel<NT><<<blocks, 256, 0, stream>>>(sorted_ids_, sorted_pos_, tokens_, t, ws_);
        embed::window_sums_kernel<NT><<<blocks, 256, 0, stream>>>(sorted_ids_, tokens_, t, ws_);
    }
    int max_tokens_, tokens_ = 0;
    size_t temp_bytes_ = 0;
    void* temp_ = nullptr;
    float* ws_ = nullptr;
    int *pos_ = nullptr, *sorted_ids_ = nullptr, *sorted_pos_ = nullptr;
};

// -----------------------------------------------------------------------------
// The model's small gates, each read off the first 12 channels of a row (z = x[:12] . w, as a bf16
// F.linear output), forward and backward:
//   value-embedding gate (@KoszarskyB, @Grad62304977): v[t,h] += 2 sigmoid(z[t,h]) ve[t,h]
//   attention output gate (@classiclarryd):             y[t,h] *= sigmoid(z[t,h])
//   smear (@classiclarryd):   x[t] += lambda sigmoid(z[t]) x[t-1], t >= 1
//   skip (U-net):             x[t] += sigmoid(lambda) 2 sigmoid(z[t]) skip[t]
// Backward kernels write dz (one float per row and head) and the row gradients; the gate weights'
// and lambdas' gradients are then reduced over the tokens in a fixed order (deterministic).

namespace gate {

constexpr int GW = 12;  // channels a gate reads

struct Params {
    int tokens, heads;           // heads: 6 for the attention gates, 1 for smear and skip
    const __nv_bfloat16* x;      // the rows the gates read (T x ld_x)
    int64_t ld_x;
    const __nv_bfloat16* w;      // heads x 12
    const float* lambda;         // smear / skip lambda (device scalar)
    // ve, out gate: per-head rows of 128; smear, skip: rows of 768
    __nv_bfloat16* a;            // the gated tensor: v (in place), y, x
    int64_t ld_a;
    const __nv_bfloat16* b;      // ve / skip / (smear: x itself)
    int64_t ld_b;
    __nv_bfloat16* out;          // out-of-place result (out gate, smear)
    int64_t ld_out;
    // backward
    const __nv_bfloat16* dout;   // gradient of the result
    int64_t ld_dout;
    __nv_bfloat16* da;           // gradient of a (may alias dout where a passes through)
    __nv_bfloat16* db;           // gradient of b (ve, skip), accumulated (db_first: written)
    bool db_first;               // ve, skip: db gets this gate's term alone (its first in the backward: no zeroing pass)
    int64_t ld_da, ld_db;
    float* dz;                   // tokens x heads
    float* dlam_rows;            // tokens: per-token lambda gradient terms
    float* partial;              // WG_BLOCKS x WG_OUT floats: the weight gradient's partial sums
    // output gate backward, optionally: attention's delta = rowsum(dy * y) per (position, head) of
    // attention's view, heads / delta_split heads over tokens * delta_split positions (the paired
    // layout: 2); delta[head * positions + position]
    float* delta;
    int delta_split;
};

__device__ __forceinline__ float sigmoid(float z) { return 1.f / (1.f + __expf(-z)); }
__device__ __forceinline__ float logit(const Params& p, int t, int h) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < GW; ++j) s += __bfloat162float(p.x[t * p.ld_x + j]) * __bfloat162float(p.w[h * GW + j]);
    return tk::round_bf16(s);
}

enum Kind { VE = 0, OUT = 1 };

// logit() for 8-byte aligned x rows and weights (the head gates): 3 + 3 vector loads, the same sum
__device__ __forceinline__ float logit_vec(const Params& p, int t, int h) {
    const uint2* xv = reinterpret_cast<const uint2*>(p.x + t * p.ld_x);
    const uint2* wv = reinterpret_cast<const uint2*>(p.w + h * GW);
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < GW / 4; ++q) {
        float xf[4], wf[4];
        const uint2 xu = xv[q], wu = wv[q];
        const __nv_bfloat162* xh = reinterpret_cast<const __nv_bfloat162*>(&xu);
        const __nv_bfloat162* wh = reinterpret_cast<const __nv_bfloat162*>(&wu);
        const float2 x0 = __bfloat1622float2(xh[0]), x1 = __bfloat1622float2(xh[1]);
        const float2 w0 = __bfloat1622float2(wh[0]), w1 = __bfloat1622float2(wh[1]);
        xf[0] = x0.x, xf[1] = x0.y, xf[2] = x1.x, xf[3] = x1.y, wf[0] = w0.x, wf[1] = w0.y, wf[2] = w1.x, wf[3] = w1.y;
#pragma unroll
        for (int e = 0; e < 4; ++e) s += xf[e] * wf[e];
    }
    return tk::round_bf16(s);
}
__device__ __forceinline__ float dot8(const float a[8], const float b[8]) {
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) s += a[e] * b[e];
    return tk::half_warp_sum(s);
}

// One warp a token over its HEADS heads x 128 channels: lane l holds channels head_col(v, l) .. + 7 of
// v = 0 .. HEADS / 2 - 1, i.e. head 2v + l / 16 in 16 lanes a head (dot8's half-warp sums); lanes
// 0 .. HEADS - 1 make the gates, the others take theirs by shuffles. Every load of the token is
// issued before the gates' logits: 16 threads a (token, head), each with its own logit before one
// 16-byte load, ran the output gate at 2.7-3.0 TB/s under ncu.
constexpr int HEADS = 6;
__device__ __forceinline__ int head_col(int v, int lane) { return v * 256 + lane * 8; }

template <int K>
__global__ void head_fwd_kernel(const Params p) {
    const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (t >= p.tokens) return;
    float a[HEADS / 2][8], b[HEADS / 2][8];
#pragma unroll
    for (int v = 0; v < HEADS / 2; ++v) {
        tk::load8(p.a + t * p.ld_a + head_col(v, lane), a[v]);
        if (K == VE) tk::load8(p.b + t * p.ld_b + head_col(v, lane), b[v]);
    }
    const float mine = sigmoid(logit_vec(p, t, lane < HEADS ? lane : 0));
#pragma unroll
    for (int v = 0; v < HEADS / 2; ++v) {
        const int c = head_col(v, lane);
        const float s = __shfl_sync(0xffffffffu, mine, 2 * v + (lane >> 4));
        if (K == VE) {
#pragma unroll
            for (int e = 0; e < 8; ++e) a[v][e] += 2.f * s * b[v][e];
            tk::store8(p.a + t * p.ld_a + c, a[v]);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) a[v][e] *= s;
            tk::store8(p.out + t * p.ld_out + c, a[v]);
        }
    }
}

template <int K>
__global__ void head_bwd_kernel(const Params p) {
    const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (t >= p.tokens) return;
    float g[HEADS / 2][8], b[HEADS / 2][8], acc[HEADS / 2][8];
#pragma unroll
    for (int v = 0; v < HEADS / 2; ++v) {
        const int c = head_col(v, lane);
        tk::load8(p.dout + t * p.ld_dout + c, g[v]);
        if (K == VE) {
            tk::load8(p.b + t * p.ld_b + c, b[v]);
            if (!p.db_first) tk::load8(p.db + t * p.ld_db + c, acc[v]);
            else  // db_first: 0 + the term, as on a zeroed db
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[v][e] = 0.f;
        } else {
            tk::load8(p.a + t * p.ld_a + c, b[v]);
        }
    }
    const float mine = sigmoid(logit_vec(p, t, lane < HEADS ? lane : 0));
#pragma unroll
    for (int v = 0; v < HEADS / 2; ++v) {
        const int h = 2 * v + (lane >> 4), c = head_col(v, lane);
        const float s = __shfl_sync(0xffffffffu, mine, h);
        const float d = dot8(g[v], b[v]);
        if (K == VE) {  // v passes through; dve += 2 s dv; dz = (dv . ve) 2 s (1 - s)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[v][e] += 2.f * s * g[v][e];
            tk::store8(p.db + t * p.ld_db + c, acc[v]);
            if ((lane & 15) == 0) p.dz[(int64_t)t * p.heads + h] = d * 2.f * s * (1.f - s);
        } else {  // dy = dout s; dz = (dout . y) s (1 - s)
#pragma unroll
            for (int e = 0; e < 8; ++e) g[v][e] = tk::round_bf16(g[v][e] * s);  // as stored: attention's delta reads dy in bf16
            tk::store8(p.da + t * p.ld_da + c, g[v]);
            float delta = 0.f;
            if (p.delta) delta = dot8(g[v], b[v]);
            if ((lane & 15) == 0) {
                p.dz[(int64_t)t * p.heads + h] = d * s * (1.f - s);
                if (p.delta) {
                    const int heads_a = p.heads / p.delta_split;
                    p.delta[(int64_t)(h % heads_a) * p.tokens * p.delta_split + (int64_t)t * p.delta_split + h / heads_a] = delta;
                }
            }
        }
    }
}

enum RowKind { SMEAR = 0, SKIP = 1 };

// per token warp over rows of 768 (3 x 8 channels per lane)
template <int K>
__global__ void row_fwd_kernel(const Params p) {
    const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (t >= p.tokens) return;
    const float lam = *p.lambda;
    float coef;
    const __nv_bfloat16* other;
    if (K == SMEAR) {
        coef = t > 0 ? lam * sigmoid(logit(p, t, 0)) : 0.f;
        other = p.a + (int64_t)(t > 0 ? t - 1 : 0) * p.ld_a;
    } else {
        coef = sigmoid(lam) * 2.f * sigmoid(logit(p, t, 0));
        other = p.b + t * p.ld_b;
    }
    __nv_bfloat16* dst = K == SMEAR ? p.out + t * p.ld_out : p.a + t * p.ld_a;
#pragma unroll
    for (int v = 0; v < 3; ++v) {
        float x[8], o[8];
        tk::load8(p.a + t * p.ld_a + (v * 32 + lane) * 8, x);
        tk::load8(other + (v * 32 + lane) * 8, o);
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] += coef * o[e];
        tk::store8(dst + (v * 32 + lane) * 8, x);
    }
}

template <int K>
__global__ void row_bwd_kernel(const Params p) {
    const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (t >= p.tokens) return;
    const float lam = *p.lambda;
    float dsum = 0.f;  // dout[t] . (x[t-1] or skip[t])
    float g[3][8];
    if (K == SMEAR) {
        // dx[t] = dout[t] + a_{t+1} dout[t+1]; the gate term of row t uses x[t-1]
        const float s = t > 0 ? sigmoid(logit(p, t, 0)) : 0.f;
        const float a_next = t + 1 < p.tokens ? lam * sigmoid(logit(p, t + 1, 0)) : 0.f;
#pragma unroll
        for (int v = 0; v < 3; ++v) {
            float n[8], prev[8];
            tk::load8(p.dout + t * p.ld_dout + (v * 32 + lane) * 8, g[v]);
            if (t + 1 < p.tokens) tk::load8(p.dout + (int64_t)(t + 1) * p.ld_dout + (v * 32 + lane) * 8, n);
            if (t > 0) {
                tk::load8(p.a + (int64_t)(t - 1) * p.ld_a + (v * 32 + lane) * 8, prev);
#pragma unroll
                for (int e = 0; e < 8; ++e) dsum += g[v][e] * prev[e];
            }
            if (t + 1 < p.tokens)
#pragma unroll
                for (int e = 0; e < 8; ++e) g[v][e] += a_next * n[e];
            tk::store8(p.da + t * p.ld_da + (v * 32 + lane) * 8, g[v]);
        }
        dsum = tk::warp_sum(dsum);
        if (lane == 0) {
            p.dz[t] = t > 0 ? lam * s * (1.f - s) * dsum : 0.f;
            p.dlam_rows[t] = s * dsum;
        }
    } else {
        // x passes through; dskip += c 2 s dx; dz = c 2 s (1 - s) (dx . skip); dlambda: c (1 - c) 2 s (dx . skip)
        const float c = sigmoid(lam), s = sigmoid(logit(p, t, 0));
#pragma unroll
        for (int v = 0; v < 3; ++v) {
            float sk[8], acc[8] = {};  // db_first: 0 + the term, as on a zeroed db
            tk::load8(p.dout + t * p.ld_dout + (v * 32 + lane) * 8, g[v]);
            tk::load8(p.b + t * p.ld_b + (v * 32 + lane) * 8, sk);
            if (!p.db_first) tk::load8(p.db + t * p.ld_db + (v * 32 + lane) * 8, acc);
#pragma unroll
            for (int e = 0; e < 8; ++e) dsum += g[v][e] * sk[e], acc[e] += c * 2.f * s * g[v][e];
            tk::store8(p.db + t * p.ld_db + (v * 32 + lane) * 8, acc);
        }
        dsum = tk::warp_sum(dsum);
        if (lane == 0) {
            p.dz[t] = c * 2.f * s * (1.f - s) * dsum;
            p.dlam_rows[t] = c * (1.f - c) * 2.f * s * dsum;
        }
    }
}

// dx[t][j] += sum_h dz[t,h] w[h][j] for the 12 gate channels (dx may be the gradient of x itself)
__global__ void gate_input_grad_kernel(const Params p, __nv_bfloat16* dx, int64_t ld_dx) {
    const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i >= (int64_t)p.tokens * GW) return;
    const int t = (int)(i / GW), j = (int)(i % GW);
    float s = __bfloat162float(dx[t * ld_dx + j]);
    for (int h = 0; h < p.heads; ++h) s += p.dz[(int64_t)t * p.heads + h] * __bfloat162float(p.w[h * GW + j]);
    dx[t * ld_dx + j] = __float2bfloat16(s);
}

// dw[h][j] += sum_t dz[t,h] x[t][j] (bf16 gradient), and *dlambda += sum_t dlam_rows[t], in a
// fixed order: each of WG_BLOCKS blocks sums a slice of the tokens (each thread its tokens, then
// the block's warps in order) into p.partial, then one thread per output adds the slices in order.
constexpr int WG_BLOCKS = 96, MAX_HEADS = 6, WG_OUT = MAX_HEADS * GW + 1;

// what a gate's weight-gradient sums read: its inputs x, dz (and dlam_rows), and where block b of
// WG_BLOCKS puts its partial sums
struct WeightJob {
    const __nv_bfloat16* x;
    int64_t ld_x;
    const float *dz, *dlam_rows;
    float* partial;
    int tokens, heads;
    bool with_lambda;
};
__device__ __forceinline__ void weight_partial(const WeightJob& p, int block) {
    __shared__ float red[8][WG_OUT];
    const bool with_lambda = p.with_lambda;
    float acc[MAX_HEADS][GW], lam = 0.f;
#pragma unroll
    for (int h = 0; h < MAX_HEADS; ++h)
#pragma unroll
        for (int j = 0; j < GW; ++j) acc[h][j] = 0.f;
    const int per = (p.tokens + WG_BLOCKS - 1) / WG_BLOCKS, t1 = min(p.tokens, (block + 1) * per);
    for (int t = block * per + threadIdx.x; t < t1; t += blockDim.x) {
        float x[GW];
        const __nv_bfloat162* xr = reinterpret_cast<const __nv_bfloat162*>(p.x + t * p.ld_x);
#pragma unroll
        for (int j = 0; j < GW / 2; ++j) {
            const float2 v = __bfloat1622float2(xr[j]);
            x[2 * j] = v.x, x[2 * j + 1] = v.y;
        }
#pragma unroll
        for (int h = 0; h < MAX_HEADS; ++h) {
            if (h >= p.heads) break;
            const float d = p.dz[(int64_t)t * p.heads + h];
#pragma unroll
            for (int j = 0; j < GW; ++j) acc[h][j] += d * x[j];
        }
        if (with_lambda) lam += p.dlam_rows[t];
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, n_out = p.heads * GW + with_lambda;
#pragma unroll
    for (int h = 0; h < MAX_HEADS; ++h) {
        if (h >= p.heads) break;
#pragma unroll
        for (int j = 0; j < GW; ++j) {
            const float v = tk::warp_sum(acc[h][j]);
            if (lane == 0) red[warp][h * GW + j] = v;
        }
    }
    if (with_lambda) {
        const float v = tk::warp_sum(lam);
        if (lane == 0) red[warp][p.heads * GW] = v;
    }
    __syncthreads();
    if (threadIdx.x < n_out) {
        float s = 0.f;
        for (int w = 0; w < 8; ++w) s += red[w][threadIdx.x];
        p.partial[block * WG_OUT + threadIdx.x] = s;
    }
}
__host__ __device__ inline WeightJob weight_job(const Params& p, bool with_lambda) {
    return {p.x, p.ld_x, p.dz, p.dlam_rows, p.partial, p.tokens, p.heads, with_lambda};
}
__global__ void __launch_bounds__(256) gate_weight_partial_kernel(const Params p, bool with_lambda) {
    weight_partial(weight_job(p, with_lambda), blockIdx.x);
}

// (one thread an output: heads x 12, and the lambda's)
__device__ __forceinline__ void weight_finish(const float* partial, int heads, bool with_lambda, __nv_bfloat16* dw,
                                              float* dlambda) {
    const int o = threadIdx.x, n_out = heads * GW + with_lambda;
    if (o >= n_out) return;
    float s = 0.f;
    for (int b = 0; b < WG_BLOCKS; ++b) s += partial[b * WG_OUT + o];
    if (o == heads * GW) *dlambda += s;
    else dw[o] = __float2bfloat16(__bfloat162float(dw[o]) + s);
}
__global__ void gate_weight_finish_kernel(const Params p, bool with_lambda, __nv_bfloat16* dw, float* dlambda) {
    weight_finish(p.partial, p.heads, with_lambda, dw, dlambda);
}

}  // namespace gate

// -----------------------------------------------------------------------------
// The scalar and gate-weight gradients' last step, deferred: combine_backward, norm_mix_backward,
// scale_weight_backward and gate_backward each end with a one-block kernel that adds their
// per-block partial sums into the gradient. Given a DeferredSums, they leave the partial sums in a
// slot of its own (their `partial` workspace, p.partial for the gates, goes unused) and record the
// target instead; finish() then does every recorded addition in one launch, a CTA each, with the
// same arithmetic (the same bits). The gates' partial sums themselves wait too: finish() makes them
// all in one launch before the additions (so a gate's inputs x and dz must last till then). A
// backward pass has about 50 of them, each a launch and a gap between kernels. Every target of one
// finish() is distinct.

namespace scal {
constexpr int DOT_BLOCKS = 264;  // the scalar passes' blocks (below): each sums a fixed slice of the values

// grad[k] += scale_k * sum of partial[k][*], one warp per target in a fixed order (deterministic)
__device__ __forceinline__ void finish_sums(const float* partial, float* g0, float s0, float* g1, float s1) {
    const int k = threadIdx.x / 32, lane = threadIdx.x & 31;
    if (k > 1) return;
    float* g = k == 0 ? g0 : g1;
    if (!g) return;
    float t = 0.f;
    for (int i = lane; i < DOT_BLOCKS; i += 32) t += partial[k * DOT_BLOCKS + i];
    t = tk::warp_sum(t);
    if (lane == 0) *g += t * (k == 0 ? s0 : s1);
}
__global__ void finish_kernel(const float* partial, float* g0, float s0, float* g1, float s1) {
    finish_sums(partial, g0, s0, g1, s1);
}
}  // namespace scal

namespace defer {

constexpr int MAX_SUMS = 64;
constexpr int SCAL_FLOATS = 2 * scal::DOT_BLOCKS, GATE_FLOATS = gate::WG_BLOCKS * gate::WG_OUT;
struct Sum {
    const float* partial;
    float* g0;  // scalar sums: *g0 += s0 * sum(partial[0, DOT_BLOCKS)), *g1 likewise from the next DOT_BLOCKS
    float* g1;
    __nv_bfloat16* dw;  // gate sums (heads > 0): dw (heads x 12) and, with_lambda, *g0 (dlambda)
    float s0, s1;
    int heads;  // 0: a scalar sum
    bool with_lambda;
};
struct Sums {
    Sum s[MAX_SUMS];
    int count;
};

// the gates' weight-gradient partial sums, all in one launch: blockIdx.y a gate, as gate_backward's
// gate_weight_partial_kernel would sum them
constexpr int MAX_GATES = 32;
struct WeightJobs {
    gate::WeightJob j[MAX_GATES];
};
__global__ void __launch_bounds__(256) weight_partials_kernel(const WeightJobs jobs) {
    gate::weight_partial(jobs.j[blockIdx.y], blockIdx.x);
}

// a CTA a sum, as scal::finish_kernel or gate::gate_weight_finish_kernel would add it
__global__ void finish_kernel(const Sums sums) {
    const Sum& d = sums.s[blockIdx.x];
    if (d.heads == 0) scal::finish_sums(d.partial, d.g0, d.s0, d.g1, d.s1);
    else gate::weight_finish(d.partial, d.heads, d.with_lambda, d.dw, d.g0);
}

}  // namespace defer

class DeferredSums {
   public:
    DeferredSums() = default;
    DeferredSums(const DeferredSums&) = delete;
    DeferredSums& operator=(const DeferredSums&) = delete;
    ~DeferredSums() { cudaFree(scal_); }
    // room for `scal_slots` scalar sums and `gate_slots` gate sums between two finish() calls
    cudaError_t allocate(int scal_slots, int gate_slots) {
        if (scal_slots + gate_slots > defer::MAX_SUMS || gate_slots > defer::MAX_GATES) return cudaErrorInvalidValue;
        const size_t floats = (size_t)scal_slots * defer::SCAL_FLOATS + (size_t)gate_slots * defer::GATE_FLOATS;
        if (cudaError_t e = cudaMalloc(&scal_, floats * sizeof(float))) return e;
        gate_ = scal_ + (size_t)scal_slots * defer::SCAL_FLOATS;
        scal_slots_ = scal_slots, gate_slots_ = gate_slots;
        return cudaSuccess;
    }
    // the partial-sum workspace of a scalar sum (*g0 += s0 * .., *g1 += s1 * ..; null: none), or null
    // when the slots are used up
    float* scalar(float* g0, float s0, float* g1, float s1) {
        if (n_scal_ >= scal_slots_ || sums_.count >= defer::MAX_SUMS) return nullptr;
        float* partial = scal_ + (size_t)n_scal_++ * defer::SCAL_FLOATS;
        sums_.s[sums_.count++] = {partial, g0, g1, nullptr, s0, s1, 0, false};
        return partial;
    }
    // the same for a gate's weight (dw: heads x 12) and, with_lambda, its scalar (*dlambda); its
    // partial sums too wait for finish(), which reads p.x, p.dz (and p.dlam_rows) then: false when the
    // slots are used up
    bool gate_weights(const gate::Params& p, bool with_lambda, __nv_bfloat16* dw, float* dlambda) {
        if (n_gate_ >= gate_slots_ || sums_.count >= defer::MAX_SUMS) return false;
        gate::WeightJob job = gate::weight_job(p, with_lambda);
        job.partial = gate_ + (size_t)n_gate_ * defer::GATE_FLOATS;
        jobs_.j[n_gate_++] = job;
        sums_.s[sums_.count++] = {job.partial, dlambda, nullptr, dw, 0.f, 0.f, p.heads, with_lambda};
        return true;
    }
    // every recorded sum (the gates' partial sums first), then the slots are free again
    cudaError_t finish(cudaStream_t stream) {
        if (n_gate_ > 0) defer::weight_partials_kernel<<<dim3(gate::WG_BLOCKS, n_gate_), 256, 0, stream>>>(jobs_);
        if (sums_.count > 0) defer::finish_kernel<<<sums_.count, 128, 0, stream>>>(sums_);
        sums_.count = 0, n_scal_ = n_gate_ = 0;
        return cudaGetLastError();
    }

   private:
    float *scal_ = nullptr, *gate_ = nullptr;
    int scal_slots_ = 0, gate_slots_ = 0, n_scal_ = 0, n_gate_ = 0;
    defer::Sums sums_{};
    defer::WeightJobs jobs_{};  // the first n_gate_ recorded
};

enum class GateKind { ValueEmbedding, Output, Smear, Skip };

// the head gates' vector loads: 16-byte aligned rows of a (b, out), 8-byte aligned gate inputs and
// weights, and gate::HEADS heads (a warp a token's channels)
inline bool head_gate_shapes_ok(const gate::Params& p, bool ve, bool backward) {
    auto al = [](const void* q, int64_t ld, int bytes) { return (uintptr_t)q % bytes == 0 && (ld * 2) % bytes == 0; };
    const bool common = p.heads == gate::HEADS && al(p.x, p.ld_x, 8) && (uintptr_t)p.w % 8 == 0;
    if (ve)  // v (in place) + ve; backward: dv, dve
        return common && al(p.b, p.ld_b, 16) &&
               (backward ? al(p.dout, p.ld_dout, 16) && al(p.db, p.ld_db, 16) : al(p.a, p.ld_a, 16));
    // y -> out; backward: dout, y -> dy
    return common && al(p.a, p.ld_a, 16) &&
           (backward ? al(p.dout, p.ld_dout, 16) && al(p.da, p.ld_da, 16) : al(p.out, p.ld_out, 16));
}

inline cudaError_t gate_forward(GateKind kind, const gate::Params& p, cudaStream_t stream) {
    const bool per_head = kind == GateKind::ValueEmbedding || kind == GateKind::Output;
    if (per_head && !head_gate_shapes_ok(p, kind == GateKind::ValueEmbedding, false)) return cudaErrorInvalidValue;
    const unsigned blocks = (unsigned)((p.tokens + 7) / 8);  // a warp a token
    switch (kind) {
        case GateKind::ValueEmbedding: gate::head_fwd_kernel<gate::VE><<<blocks, 256, 0, stream>>>(p); break;
        case GateKind::Output: gate::head_fwd_kernel<gate::OUT><<<blocks, 256, 0, stream>>>(p); break;
        case GateKind::Smear: gate::row_fwd_kernel<gate::SMEAR><<<blocks, 256, 0, stream>>>(p); break;
        case GateKind::Skip: gate::row_fwd_kernel<gate::SKIP><<<blocks, 256, 0, stream>>>(p); break;
    }
    return cudaGetLastError();
}

// dx[:, :12] (the gate's input, ld_dx) += dz w, from p.dz as gate_backward left it
inline cudaError_t gate_input_grad(const gate::Params& p, __nv_bfloat16* dx, int64_t ld_dx, cudaStream_t stream) {
    gate::gate_input_grad_kernel<<<(unsigned)(((int64_t)p.tokens * gate::GW + 255) / 256), 256, 0, stream>>>(p, dx, ld_dx);
    return cudaGetLastError();
}
// Row gradients, then dx[:, :12] (the gate's input, ld_dx) += dz w (dx null: the caller adds it
// later with gate_input_grad, p.dz kept till then), then dw and dlambda (smear, skip) reduced over
// the tokens. p.dz and p.dlam_rows are workspaces of tokens x heads floats, p.partial one of
// gate::WG_BLOCKS * gate::WG_OUT floats.
inline cudaError_t gate_backward(GateKind kind, gate::Params p, __nv_bfloat16* dx, int64_t ld_dx, __nv_bfloat16* dw,
                                 float* dlambda, cudaStream_t stream, DeferredSums* deferred = nullptr) {
    const bool per_head = kind == GateKind::ValueEmbedding || kind == GateKind::Output;
    if (per_head && !head_gate_shapes_ok(p, kind == GateKind::ValueEmbedding, true)) return cudaErrorInvalidValue;
    if (p.heads > gate::MAX_HEADS) return cudaErrorInvalidValue;
    if (deferred && !deferred->gate_weights(p, !per_head, dw, dlambda)) return cudaErrorInvalidValue;
    const unsigned blocks = (unsigned)((p.tokens + 7) / 8);  // a warp a token
    switch (kind) {
        case GateKind::ValueEmbedding: gate::head_bwd_kernel<gate::VE><<<blocks, 256, 0, stream>>>(p); break;
        case GateKind::Output: gate::head_bwd_kernel<gate::OUT><<<blocks, 256, 0, stream>>>(p); break;
        case GateKind::Smear: gate::row_bwd_kernel<gate::SMEAR><<<blocks, 256, 0, stream>>>(p); break;
        case GateKind::Skip: gate::row_bwd_kernel<gate::SKIP><<<blocks, 256, 0, stream>>>(p); break;
    }
    if (dx)
        if (cudaError_t e = gate_input_grad(p, dx, ld_dx, stream)) return e;
    if (deferred) return cudaGetLastError();  // (its weight sums wait for deferred->finish())
    gate::gate_weight_partial_kernel<<<gate::WG_BLOCKS, 256, 0, stream>>>(p, !per_head);
    gate::gate_weight_finish_kernel<<<1, 128, 0, stream>>>(p, !per_head, dw, dlambda);
    return cudaGetLastError();
}

// -----------------------------------------------------------------------------
// Scalar-weighted sums of the residual stream and their gradients: out = ca x + cb y with each
// coefficient c = (*ptr) * scale + constant read from device memory (the scalars parameter):
//   residual mixing  x = resid_lambda[i] x + x0_lambda[i] x0   (layer 0 too: there x is x0)
//   backout          x = x - backout_lambda x_7
// and the attention weights scaled by their sa lambdas: W' = bf16(lambda W) (sa_lambdas[1]
// pre-multiplied to O: @shenberg).
// Every scalar gradient is a dot product over many values, reduced in a fixed order: each of
// DOT_BLOCKS blocks sums a fixed slice, then one block adds the partials in order.

namespace scal {

struct Coef {
    const float* ptr;  // null: the constant alone
    float scale, constant;
    __device__ float value() const { return (ptr ? *ptr * scale : 0.f) + constant; }
};

// the mixing's value before its bf16 rounding: one rounding of b y, then a fused a x + (b y); the
// forward's combine and combine_norm kernels and the backward's norm_mix_bwd_kernel all make it so
__device__ __forceinline__ float mix(float a, float x, float b, float y) { return __fmaf_rn(a, x, __fmul_rn(b, y)); }

__global__ void combine_kernel(__nv_bfloat16* out, const __nv_bfloat16* x, const __nv_bfloat16* y, int64_t n8, Coef ca,
                               Coef cb, int* flag, int tag) {
    const float a = ca.value(), b = cb.value();
    bool bad = false;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n8; i += (int64_t)gridDim.x * blockDim.x) {
        float fx[8], fy[8];
        tk::load8(x + i * 8, fx);
        tk::load8(y + i * 8, fy);
#pragma unroll
        for (int e = 0; e < 8; ++e) bad |= !isfinite(fx[e]), fx[e] = mix(a, fx[e], b, fy[e]);
        tk::store8(out + i * 8, fx);
    }
    if (flag && __syncthreads_or(bad) && threadIdx.x == 0) atomicCAS(flag, -1, tag);
}

// combine_kernel's out, then rms_norm's fwd_kernel on it, in one pass: one warp per row, the same
// arithmetic in the same order as the two kernels (the same bits), without reading out back
template <int DIM>
__global__ void combine_norm_kernel(__nv_bfloat16* out, const __nv_bfloat16* x, const __nv_bfloat16* y, int rows,
                                    Coef ca, Coef cb, __nv_bfloat16* xn, float* rstd, float eps, int* flag, int tag) {
    constexpr int V = DIM / 256;  // 16-byte vectors per lane
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    bool bad = false;
    if (row < rows) {
        const float a = ca.value(), b = cb.value();
        const int64_t base = (int64_t)row * DIM;
        float f[V][8];
        float ss = 0.f;
#pragma unroll
        for (int v = 0; v < V; ++v) {
            float fy[8];
            const int64_t at = base + (v * 32 + lane) * 8;
            tk::load8(x + at, f[v]);
            tk::load8(y + at, fy);
#pragma unroll
            for (int e = 0; e < 8; ++e) bad |= !isfinite(f[v][e]), f[v][e] = mix(a, f[v][e], b, fy[e]);
            tk::store8(out + at, f[v]);
#pragma unroll
            for (int e = 0; e < 8; ++e) f[v][e] = tk::round_bf16(f[v][e]);  // as stored
#pragma unroll
            for (int e = 0; e < 8; ++e) ss += f[v][e] * f[v][e];
        }
        rmsnorm::normalize_row<DIM>(f, ss, eps, rstd, row, xn + base);
    }
    if (flag && __syncthreads_or(bad) && threadIdx.x == 0) atomicCAS(flag, -1, tag);
}

// dx (+)= ca dout, dy (+)= cb dout; partial[0][block] = sum dout x, partial[1][block] = sum dout y
__global__ void combine_bwd_kernel(const __nv_bfloat16* dout, const __nv_bfloat16* x, const __nv_bfloat16* y,
                                   __nv_bfloat16* dx, bool dx_accumulate, __nv_bfloat16* dy, bool dy_accumulate, int64_t n8,
                                   Coef ca, Coef cb, float* partial) {
    const float a = ca.value(), b = cb.value();
    float sx = 0.f, sy = 0.f;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n8; i += (int64_t)gridDim.x * blockDim.x) {
        float g[8], fx[8], fy[8], ax[8], ay[8];
        tk::load8(dout + i * 8, g);
        tk::load8(x + i * 8, fx);
        tk::load8(y + i * 8, fy);
        if (dx_accumulate) tk::load8(dx + i * 8, ax);
        if (dy_accumulate) tk::load8(dy + i * 8, ay);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            sx += g[e] * fx[e], sy += g[e] * fy[e];
            ax[e] = (dx_accumulate ? ax[e] : 0.f) + a * g[e];
            ay[e] = (dy_accumulate ? ay[e] : 0.f) + b * g[e];
        }
        tk::store8(dx + i * 8, ax);
        tk::store8(dy + i * 8, ay);
    }
    __shared__ float red[2][32];
    const float tx = tk::block_sum0(sx, red[0]), ty = tk::block_sum0(sy, red[1]);
    if (threadIdx.x == 0) partial[blockIdx.x] = tx, partial[DOT_BLOCKS + blockIdx.x] = ty;
}

// The end of a block's backward in one pass (768-wide rows): the norm's gradient joins the residual
// gradient, dm = dx + rms_norm_backward(xm, dxn), which then goes through the mix xm = ca x + cb y:
// dx = ca dm, dy += cb dm (dy_first: dy = cb dm, its first term: no zeroing pass), partial[0][block]
// = sum dm x, partial[1][block] = sum dm y. xm is made again from x and y, as combine_norm_kernel
// made and stored it (the same bits), instead of read. A warp per row, rows strided over DOT_BLOCKS
// CTAs (a fixed order: deterministic). The other gradients of x that the residual stream gathers
// here join in the same pass, each rounded as a combine pass of its own would: dx += add0, then
// dx += add1 (where non-null); into_dy (x is y's own input, as layer 0's is x0): dy += dx, and dx
// is not written.
template <bool DY_FIRST>
__global__ void norm_mix_bwd_kernel(const __nv_bfloat16* dxn, const float* rstd, __nv_bfloat16* dx, const __nv_bfloat16* x,
                                    const __nv_bfloat16* y, __nv_bfloat16* dy, int rows, Coef ca, Coef cb, float* partial,
                                    const __nv_bfloat16* add0, const __nv_bfloat16* add1, bool into_dy) {
    constexpr int DIM = 768, V = DIM / 256;
    const float a = ca.value(), b = cb.value();
    const int lane = threadIdx.x & 31, warps = gridDim.x * (blockDim.x / 32);
    float sx = 0.f, sy = 0.f;
    for (int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < rows; row += warps) {
        float fxi[V][8], fyi[V][8], fx[V][8], fg[V][8];
        float dot = 0.f;  // rmsnorm::load_row_dot's sum, in its order
#pragma unroll
        for (int v = 0; v < V; ++v) {
            const int64_t o = (int64_t)row * DIM + (v * 32 + lane) * 8;
            tk::load8(x + o, fxi[v]);
            tk::load8(y + o, fyi[v]);
            tk::load8(dxn + o, fg[v]);
#pragma unroll
            for (int e = 0; e < 8; ++e) fx[v][e] = tk::round_bf16(mix(a, fxi[v][e], b, fyi[v][e]));
#pragma unroll
            for (int e = 0; e < 8; ++e) dot += fx[v][e] * fg[v][e];
        }
        dot = tk::warp_sum(dot);
        const float r = rstd[row], c = r * r * dot / DIM;
#pragma unroll
        for (int v = 0; v < V; ++v) {
            const int64_t o = (int64_t)row * DIM + (v * 32 + lane) * 8;
            float acc[8], ay[8] = {};  // DY_FIRST: 0 + the term, as on a zeroed dy
            tk::load8(dx + o, acc);
            if (!DY_FIRST) tk::load8(dy + o, ay);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float dm = acc[e] + r * (fg[v][e] - fx[v][e] * c);
                sx += dm * fxi[v][e], sy += dm * fyi[v][e];
                acc[e] = a * dm, ay[e] += b * dm;
            }
            const __nv_bfloat16* adds[2] = {add0, add1};
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                if (!adds[k]) continue;
                float t[8];
                tk::load8(adds[k] + o, t);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[e] = tk::round_bf16(acc[e]) + t[e];
            }
            if (into_dy) {
#pragma unroll
                for (int e = 0; e < 8; ++e) ay[e] = tk::round_bf16(ay[e]) + tk::round_bf16(acc[e]);
            } else {
                tk::store8(dx + o, acc);
            }
            tk::store8(dy + o, ay);
        }
    }
    __shared__ float red[2][32];
    const float tx = tk::block_sum0(sx, red[0]), ty = tk::block_sum0(sy, red[1]);
    if (threadIdx.x == 0) partial[blockIdx.x] = tx, partial[DOT_BLOCKS + blockIdx.x] = ty;
}

__global__ void scale_weight_kernel(__nv_bfloat16* out, const __nv_bfloat16* w, int64_t n8, const float* lambda) {
    const float l = *lambda;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n8; i += (int64_t)gridDim.x * blockDim.x) {
        float f[8];
        tk::load8(w + i * 8, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] *= l;
        tk::store8(out + i * 8, f);
    }
}

// dW += lambda dW' (bf16 gradient); partial[block] = sum dW' W
__global__ void scale_weight_bwd_kernel(const float* dwp, const __nv_bfloat16* w, __nv_bfloat16* dw, int64_t n8,
                                        const float* lambda, float* partial) {
    const float l = *lambda;
    float s = 0.f;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n8; i += (int64_t)gridDim.x * blockDim.x) {
        float f[8], acc[8];
        tk::load8(w + i * 8, f);
        tk::load8(dw + i * 8, acc);
        float g[8];
        tk::load8(dwp + i * 8, g);
#pragma unroll
        for (int e = 0; e < 8; ++e) s += g[e] * f[e], acc[e] += l * g[e];
        tk::store8(dw + i * 8, acc);
    }
    __shared__ float red[32];
    const float t = tk::block_sum0(s, red);
    if (threadIdx.x == 0) partial[blockIdx.x] = t;
}

}  // namespace scal

// out = ca x + cb y over n bf16 values (n a multiple of 8; out may alias x or y); flag: as
// check_finite's, for x. The trainer runs its fused forms (combine_norm, norm_mix_backward's folds);
// the tests take it as their reference of the mix's bits
inline cudaError_t combine(__nv_bfloat16* out, const __nv_bfloat16* x, const __nv_bfloat16* y, int64_t n, scal::Coef ca,
                           scal::Coef cb, cudaStream_t stream, int* flag = nullptr, int tag = 0) {
    if (n % 8) return cudaErrorInvalidValue;
    scal::combine_kernel<<<scal::DOT_BLOCKS, 256, 0, stream>>>(out, x, y, n / 8, ca, cb, flag, tag);
    return cudaGetLastError();
}
// combine, then rms_norm_forward of out into xn (rstd may be null), in one pass: rows x 768 values,
// rows of x, y, out and xn contiguous
inline cudaError_t combine_norm(__nv_bfloat16* out, const __nv_bfloat16* x, const __nv_bfloat16* y, int rows, int dim,
                                scal::Coef ca, scal::Coef cb, __nv_bfloat16* xn, float* rstd, float eps,
                                cudaStream_t stream, int* flag = nullptr, int tag = 0) {
    if (dim != 768) return cudaErrorInvalidValue;
    if (rows <= 0) return cudaSuccess;
    scal::combine_norm_kernel<768><<<(unsigned)((rows + 7) / 8), 256, 0, stream>>>(out, x, y, rows, ca, cb, xn, rstd, eps,
                                                                                  flag, tag);
    return cudaGetLastError();
}
// dx = ca dout (or += with dx_accumulate), dy = cb dout (or += with dy_accumulate), and the
// coefficients' scalar gradients: *ga += ca.scale * sum(dout x), *gb += cb.scale * sum(dout y) (null:
// not needed). partial: 2 x DOT_BLOCKS floats of workspace.
inline cudaError_t combine_backward(const __nv_bfloat16* dout, const __nv_bfloat16* x, const __nv_bfloat16* y,
                                    __nv_bfloat16* dx, bool dx_accumulate, __nv_bfloat16* dy, bool dy_accumulate, int64_t n,
                                    scal::Coef ca, scal::Coef cb, float* ga, float* gb, float* partial, cudaStream_t stream,
                                    DeferredSums* deferred = nullptr) {
    if (n % 8) return cudaErrorInvalidValue;
    if (deferred && !(partial = deferred->scalar(ga, ca.scale, gb, cb.scale))) return cudaErrorInvalidValue;
    scal::combine_bwd_kernel<<<scal::DOT_BLOCKS, 256, 0, stream>>>(dout, x, y, dx, dx_accumulate, dy, dy_accumulate, n / 8, ca,
                                                                   cb, partial);
    if (!deferred) scal::finish_kernel<<<1, 64, 0, stream>>>(partial, ga, ca.scale, gb, cb.scale);
    return cudaGetLastError();
}
// rms_norm_backward(xm, dxn, rstd -> dx, accumulate) then combine_backward(dx, x, y -> dx, dy, ca, cb,
// ga, gb) in one pass, for xm = combine_norm's out of (x, y, ca, cb) (remade, not read): rows x 768,
// contiguous (row stride 768). The mix's dx is written in place; dy_first: dy = cb dm (dy's first
// term), else dy += cb dm. Then, with the bits of combine passes after it: dx += add0, dx += add1
// (those not null), and into_dy: dy += dx instead of writing dx.
struct NormMixFolds {
    const __nv_bfloat16 *add0 = nullptr, *add1 = nullptr;
    bool into_dy = false;
};
inline cudaError_t norm_mix_backward(const __nv_bfloat16* dxn, const float* rstd, __nv_bfloat16* dx, const __nv_bfloat16* x,
                                     const __nv_bfloat16* y, __nv_bfloat16* dy, bool dy_first, int rows, scal::Coef ca,
                                     scal::Coef cb, float* ga, float* gb, float* partial, cudaStream_t stream,
                                     DeferredSums* deferred = nullptr, NormMixFolds f = {}) {
    if (rows <= 0) return cudaSuccess;
    if (deferred && !(partial = deferred->scalar(ga, ca.scale, gb, cb.scale))) return cudaErrorInvalidValue;
    const auto kernel = dy_first ? scal::norm_mix_bwd_kernel<true> : scal::norm_mix_bwd_kernel<false>;
    kernel<<<scal::DOT_BLOCKS, 256, 0, stream>>>(dxn, rstd, dx, x, y, dy, rows, ca, cb, partial, f.add0, f.add1, f.into_dy);
    if (!deferred) scal::finish_kernel<<<1, 64, 0, stream>>>(partial, ga, ca.scale, gb, cb.scale);
    return cudaGetLastError();
}
inline cudaError_t scale_weight(__nv_bfloat16* out, const __nv_bfloat16* w, int64_t n, const float* lambda,
                                cudaStream_t stream) {
    if (n % 8) return cudaErrorInvalidValue;
    scal::scale_weight_kernel<<<scal::DOT_BLOCKS, 256, 0, stream>>>(out, w, n / 8, lambda);
    return cudaGetLastError();
}
// dW += lambda dW' and *glambda += sum(dW' W), given dW' (fp32) of the scaled weight W' = lambda W
inline cudaError_t scale_weight_backward(const float* dwp, const __nv_bfloat16* w, __nv_bfloat16* dw, int64_t n,
                                         const float* lambda, float* glambda, float* partial, cudaStream_t stream,
                                         DeferredSums* deferred = nullptr) {
    if (n % 8) return cudaErrorInvalidValue;
    if (deferred && !(partial = deferred->scalar(glambda, 1.f, nullptr, 0.f))) return cudaErrorInvalidValue;
    scal::scale_weight_bwd_kernel<<<scal::DOT_BLOCKS, 256, 0, stream>>>(dwp, w, dw, n / 8, lambda, partial);
    if (!deferred) scal::finish_kernel<<<1, 32, 0, stream>>>(partial, glambda, 1.f, nullptr, 0.f);
    return cudaGetLastError();
}

// -----------------------------------------------------------------------------
// Reductions and checks around the loss: the loss (record 61's losses.sum() in training, the mean
// cross-entropy in evaluation), lm_head's fp32 gradient from the fp8 GEMM added into its bf16
// gradient (the record's mm_t_backward_op returns grad_w in fp32), and the trainer's own NaN/inf
// check of the layers' outputs (the record has none).

namespace red {

// out = scale * sum(x[0, n)), one block, a fixed order (deterministic)
__global__ void sum_kernel(const float* x, int n, float* out, float scale) {
    __shared__ float s[1024];
    float v = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) v += x[i];
    s[threadIdx.x] = v;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) s[threadIdx.x] += s[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) *out = s[0] * scale;
}

// g (bf16) += a (fp32), n values. VEC: 8 a thread a step (16 bytes of g, 32 of a: with a value a
// thread the loads in flight were too few for the DRAM's rate), for n a multiple of 8 and aligned
// pointers; else one
template <bool VEC>
__global__ void add_kernel(__nv_bfloat16* g, const float* a, int64_t n) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    if (VEC) {
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n / 8; i += stride) {
            float x[8], y[8];
            tk::load8(g + 8 * i, x);
            tk::load8(a + 8 * i, y);
#pragma unroll
            for (int e = 0; e < 8; ++e) x[e] += y[e];
            tk::store8(g + 8 * i, x);
        }
    } else {
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += stride)
            g[i] = __float2bfloat16(__bfloat162float(g[i]) + a[i]);
    }
}

// Sets *flag to `tag` (the first time only) when x holds a NaN or an infinity: the model's forward
// checks every layer's output this way and names the first bad layer once it syncs for the loss.
__global__ void finite_kernel(const __nv_bfloat16* x, int64_t n8, int* flag, int tag) {
    bool bad = false;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n8; i += (int64_t)gridDim.x * blockDim.x) {
        float f[8];
        tk::load8(x + i * 8, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) bad |= !isfinite(f[e]);
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicCAS(flag, -1, tag);
}

}  // namespace red

inline cudaError_t sum_floats(const float* x, int n, float* out, float scale, cudaStream_t stream) {
    red::sum_kernel<<<1, 1024, 0, stream>>>(x, n, out, scale);
    return cudaGetLastError();
}
inline cudaError_t add_to_bf16(__nv_bfloat16* g, const float* a, int64_t n, cudaStream_t stream) {
    if (n % 8 == 0 && reinterpret_cast<uintptr_t>(g) % 16 == 0 && reinterpret_cast<uintptr_t>(a) % 32 == 0)
        red::add_kernel<true><<<tk::grid_stride_blocks(n / 8, 8), 256, 0, stream>>>(g, a, n);
    else red::add_kernel<false><<<tk::grid_stride_blocks(n, 8), 256, 0, stream>>>(g, a, n);
    return cudaGetLastError();
}
// n: a multiple of 8 (a tail would go unchecked). Any grid sets the same flag (every CTA writes only
// `tag`, and only over -1): two CTAs an SM.
inline cudaError_t check_finite(const __nv_bfloat16* x, int64_t n, int* flag, int tag, cudaStream_t stream) {
    red::finite_kernel<<<2 * tk::num_sms(), 256, 0, stream>>>(x, n / 8, flag, tag);
    return cudaGetLastError();
}
