// The attention kernels of triton_kernels.cu behind a C ABI, so the benchmark can run them and
// PyTorch's varlen_attn side by side on the same tensors (tests/bench_attention.py, via ctypes).
#include "../triton_kernels.cu"

static attn::Params make_params(const void* q, const void* k, const void* v, long long qkv_stride, void* o,
                                long long o_stride, float* lse, const int* cu, int cu_len, int cu_mult, int positions,
                                int heads, int window, float scale, void* tiles) {
    attn::Params p{};
    p.tiles = (int4*)tiles;
    p.q = (const __nv_bfloat16*)q, p.k = (const __nv_bfloat16*)k, p.v = (const __nv_bfloat16*)v;
    p.q_stride = p.k_stride = p.v_stride = qkv_stride;
    p.o = (__nv_bfloat16*)o, p.o_stride = o_stride, p.lse = lse;
    p.cu_seqlens = cu, p.cu_len = cu_len, p.cu_mult = cu_mult;
    p.positions = positions, p.heads = heads, p.window = window, p.scale = scale;
    return p;
}

extern "C" int attn_forward(const void* q, const void* k, const void* v, long long qkv_stride, void* o,
                            long long o_stride, float* lse, const int* cu, int cu_len, int cu_mult, int positions,
                            int heads, int window, float scale, void* tiles, void* stream) {
    attn::Params p = make_params(q, k, v, qkv_stride, o, o_stride, lse, cu, cu_len, cu_mult, positions, heads, window, scale, tiles);
    return (int)attention_forward(p, (cudaStream_t)stream);
}

extern "C" int attn_backward(const void* q, const void* k, const void* v, long long qkv_stride, void* o,
                             long long o_stride, float* lse, const int* cu, int cu_len, int cu_mult, int positions,
                             int heads, int window, float scale, const void* dout, void* dq, void* dk, void* dv,
                             float* delta, void* tiles, void* stream) {
    attn::Params p = make_params(q, k, v, qkv_stride, o, o_stride, lse, cu, cu_len, cu_mult, positions, heads, window, scale, tiles);
    p.dout = (const __nv_bfloat16*)dout, p.dout_stride = o_stride;
    p.dq = (__nv_bfloat16*)dq, p.dk = (__nv_bfloat16*)dk, p.dv = (__nv_bfloat16*)dv;
    p.dq_stride = p.dk_stride = p.dv_stride = o_stride;
    p.delta = delta;
    // the dS^T workspace: kept between calls, grown as the shapes need
    static void* ds = nullptr;
    static size_t ds_bytes = 0;
    const size_t need = attention_ds_bytes(positions, cu_len, heads, window);
    if (need > ds_bytes) {
        if (ds && cudaFree(ds) != cudaSuccess) return 1;
        ds = nullptr, ds_bytes = 0;
        if (cudaError_t e = cudaMalloc(&ds, need)) return (int)e;
        ds_bytes = need;
    }
    p.ds = (__nv_bfloat16*)ds;
    return (int)attention_backward(p, (cudaStream_t)stream);
}

extern "C" long long attn_tiles_bytes(int positions, int cu_len) { return (long long)attention_tiles_bytes(positions, cu_len); }
