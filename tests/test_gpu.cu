// GPU tests. Without a GPU they skip with a message and succeed, so `make test-gpu` is safe
// anywhere. Last line: "N passed, N failed".
//
// So far: the data pipeline's pinned host buffers and their async upload to the GPU.

#define TRAIN_GPT_NO_MAIN
#include "../train_gpt.cu"

#include "testing.h"

#include <cuda_fp8.h>

// batches built in pinned memory and copied with cudaMemcpyAsync arrive intact, and the loader
// waits for a buffer's copy before it refills that buffer
static void test_upload(const std::string& dir) {
    std::mt19937_64 rng(5);
    std::string path = dir + "/gpu_shard.bin";
    write_shard(path, make_tokens(rng, 600000, 450, false));

    LoaderOptions o;
    o.pinned = true;
    o.capacity_tokens = 49152;
    DistributedDataGenerator gen(path, {49152 * 8, 2048, 8}, 0, 1, o);
    int32_t *d_tok, *d_cu;
    CUDA_CHECK(cudaMalloc(&d_tok, 2 * 49153 * sizeof(int32_t)));
    CUDA_CHECK(cudaMalloc(&d_cu, 2 * 256 * sizeof(int32_t)));
    CUDA_CHECK(cudaMemset(d_tok, 0xff, 2 * 49153 * sizeof(int32_t)));  // poisoned
    CUDA_CHECK(cudaMemset(d_cu, 0xff, 2 * 256 * sizeof(int32_t)));
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::vector<int32_t> want_tok, want_cu, got_tok(49153), got_cu(256);
    bool ok = true;
    for (int k = 0; k < 10; ++k) {
        HostBatch& b = gen.next();
        cudaPointerAttributes attr;
        CUDA_CHECK(cudaPointerGetAttributes(&attr, b.tokens_buf.ptr));
        ok &= attr.type == cudaMemoryTypeHost;  // page-locked, so the copy is truly async
        want_tok.assign(b.inputs(), b.inputs() + b.num_tokens + 1);
        want_cu.assign(b.cu_seqlens(), b.cu_seqlens() + b.max_num_docs);
        const int slot = k % 2;
        gen.upload(b, d_tok + slot * 49153, d_cu + slot * 256, stream);
        CUDA_CHECK(cudaStreamSynchronize(stream));
        CUDA_CHECK(cudaMemcpy(got_tok.data(), d_tok + slot * 49153, got_tok.size() * 4, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(got_cu.data(), d_cu + slot * 256, b.max_num_docs * 4, cudaMemcpyDeviceToHost));
        ok &= b.num_tokens == 49152 && b.max_num_docs == 256 && got_tok == want_tok &&
              std::equal(want_cu.begin(), want_cu.end(), got_cu.begin());
    }
    CHECK(ok, "pinned batches uploaded to the GPU differ from the host batches");
    CUDA_CHECK(cudaStreamDestroy(stream));
    CUDA_CHECK(cudaFree(d_tok));
    CUDA_CHECK(cudaFree(d_cu));
    unlink(path.c_str());
}

// ---------------------------------------------------------------------------------------------
// attention against an fp32 reference (one warp per row, plain loops, no tiling)

struct RefArgs {
    const float *q, *k, *v, *dout;  // (positions, heads, 128) contiguous, the bf16 inputs widened
    const int *seq_lo, *seq_hi;      // each position's sequence [lo, hi)
    int positions, heads, window;
    float scale;
};

__global__ void ref_attn_fwd(RefArgs a, float* out, float* lse) {
    const int64_t w = (int64_t)blockIdx.x * 4 + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (w >= (int64_t)a.positions * a.heads) return;
    const int i = (int)(w / a.heads), h = (int)(w % a.heads);
    const float* qi = a.q + ((int64_t)i * a.heads + h) * 128;
    float m = -INFINITY, l = 0.f, acc[4] = {0, 0, 0, 0};
    for (int j = max(a.seq_lo[i], i - a.window); j <= i; ++j) {
        const float* kj = a.k + ((int64_t)j * a.heads + h) * 128;
        const float* vj = a.v + ((int64_t)j * a.heads + h) * 128;
        float s = 0.f;
        for (int d = lane; d < 128; d += 32) s += qi[d] * kj[d];
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        s *= a.scale;
        float mn = fmaxf(m, s), corr = expf(m - mn), p = expf(s - mn);
        l = l * corr + p;
        for (int t = 0; t < 4; ++t) acc[t] = acc[t] * corr + p * vj[lane + 32 * t];
        m = mn;
    }
    for (int t = 0; t < 4; ++t) out[((int64_t)i * a.heads + h) * 128 + lane + 32 * t] = acc[t] / l;
    if (lane == 0) lse[(int64_t)h * a.positions + i] = m + logf(l);
}

// dQ by rows (warp per query), dK and dV by columns (warp per key); delta = rowsum(dout * out_ref)
__global__ void ref_attn_bwd(RefArgs a, const float* lse, const float* delta, float* dq, float* dk, float* dv) {
    const int64_t w = (int64_t)blockIdx.x * 4 + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (w >= (int64_t)a.positions * a.heads) return;
    const int x = (int)(w / a.heads), h = (int)(w % a.heads);
    auto row = [&](const float* base, int pos) { return base + ((int64_t)pos * a.heads + h) * 128; };
    auto out_row = [&](float* base, int pos) { return base + ((int64_t)pos * a.heads + h) * 128; };
    auto dot = [&](const float* u, const float* v) {
        float s = 0.f;
        for (int d = lane; d < 128; d += 32) s += u[d] * v[d];
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        return s;
    };
    float g[4] = {0, 0, 0, 0};
    {  // dQ of query x
        const int i = x;
        for (int j = max(a.seq_lo[i], i - a.window); j <= i; ++j) {
            float p = expf(a.scale * dot(row(a.q, i), row(a.k, j)) - lse[(int64_t)h * a.positions + i]);
            float ds = p * (dot(row(a.dout, i), row(a.v, j)) - delta[(int64_t)h * a.positions + i]);
            for (int t = 0; t < 4; ++t) g[t] += ds * row(a.k, j)[lane + 32 * t];
        }
        for (int t = 0; t < 4; ++t) out_row(dq, i)[lane + 32 * t] = g[t] * a.scale;
    }
    float gk[4] = {0, 0, 0, 0}, gv[4] = {0, 0, 0, 0};
    const int j = x;
    const int hi = (int)min((int64_t)a.seq_hi[j] - 1, (int64_t)j + a.window);
    for (int i = j; i <= hi; ++i) {
        float p = expf(a.scale * dot(row(a.q, i), row(a.k, j)) - lse[(int64_t)h * a.positions + i]);
        float ds = p * (dot(row(a.dout, i), row(a.v, j)) - delta[(int64_t)h * a.positions + i]);
        for (int t = 0; t < 4; ++t) {
            gk[t] += ds * row(a.q, i)[lane + 32 * t];
            gv[t] += p * row(a.dout, i)[lane + 32 * t];
        }
    }
    for (int t = 0; t < 4; ++t) {
        out_row(dk, j)[lane + 32 * t] = gk[t] * a.scale;
        out_row(dv, j)[lane + 32 * t] = gv[t];
    }
}

// relative Frobenius error of x against ref (doubles); inf if x holds a non-finite value
static double rel_err(const std::vector<float>& x, const std::vector<float>& ref) {
    double num = 0, den = 0;
    for (size_t i = 0; i < x.size(); ++i) {
        if (!std::isfinite(x[i])) return INFINITY;
        num += ((double)x[i] - ref[i]) * ((double)x[i] - ref[i]);
        den += (double)ref[i] * ref[i];
    }
    return std::sqrt(num / std::max(den, 1e-30));
}

template <typename T>
struct DeviceArray {
    T* ptr = nullptr;
    size_t n = 0;
    explicit DeviceArray(size_t count) : n(count) { CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T))); }
    DeviceArray(const std::vector<T>& h) : DeviceArray(h.size()) { upload(h); }
    ~DeviceArray() { cudaFree(ptr); }
    void upload(const std::vector<T>& h) { CUDA_CHECK(cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice)); }
    std::vector<T> download() const {
        std::vector<T> h(n);
        CUDA_CHECK(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
        return h;
    }
    void poison() { CUDA_CHECK(cudaMemset(ptr, 0xff, n * sizeof(T))); }  // NaN in bf16 and fp32
};

// gathers a (positions, heads, 128) view with a position stride into a contiguous float array;
// shift 1: position i at row i / 2, plus half elements for odd i (attn::Params' v_shift, v_half)
static std::vector<float> gather(const std::vector<uint16_t>& buf, int64_t offset, int64_t stride, int positions, int heads,
                                 int shift = 0, int64_t half = 0) {
    std::vector<float> out((size_t)positions * heads * 128);
    for (int i = 0; i < positions; ++i)
        for (int h = 0; h < heads; ++h)
            for (int d = 0; d < 128; ++d)
                out[((size_t)i * heads + h) * 128 + d] =
                    bf16_to_float(buf[offset + (int64_t)(i >> shift) * stride + (i & shift) * half + h * 128 + d]);
    return out;
}

// One attention case: `lens` are the sequence lengths in tokens (0 allowed), padded with repeated
// final entries to `cu_len` entries. paired: 3 heads over 2T positions (cu_seqlens doubled), q
// and k contiguous, v and dv read and written in place as half rows of (T, 3 * 768) QKV-like
// buffers (as the model has them); else 6 heads over T with q, k, v views of one QKV buffer.
static void attention_case(const char* name, std::vector<int> lens, int cu_len, bool paired, int window, float scale,
                           uint64_t seed) {
    std::vector<int> cu = {0};
    for (int L : lens) cu.push_back(cu.back() + L);
    while ((int)cu.size() < cu_len) cu.push_back(cu.back());
    const int T = cu.back();
    const int mult = paired ? 2 : 1, heads = paired ? 3 : 6, P = T * mult;
    // QKV buffer (T, 3 * 6, 128): q, k, v are views with position stride 3 * 768 (or, paired, q and
    // k contiguous (2T, 3, 128) buffers carved from it, v the half rows of a second (T, 2304) region)
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<uint16_t> qkv((size_t)T * 18 * 128 * (paired ? 2 : 1));
    for (auto& x : qkv) x = float_to_bf16(nd(rng));
    std::vector<uint16_t> dout_h((size_t)P * heads * 128);
    for (auto& x : dout_h) x = float_to_bf16(nd(rng) * 0.1f);
    int64_t off_q, off_k, off_v, stride, v_stride = 2304, v_half = paired ? 384 : 0;
    const int v_shift = paired ? 1 : 0;
    if (paired) off_q = 0, off_k = (int64_t)T * 768, off_v = 3 * (int64_t)T * 768 + 1536, stride = 384;
    else off_q = 0, off_k = 768, off_v = 1536, stride = 2304;

    // reference
    std::vector<int> lo(P), hi(P);
    for (size_t s = 0; s + 1 < cu.size(); ++s)
        for (int i = cu[s] * mult; i < cu[s + 1] * mult; ++i) lo[i] = cu[s] * mult, hi[i] = cu[s + 1] * mult;
    DeviceArray<float> rq(gather(qkv, off_q, stride, P, heads)), rk(gather(qkv, off_k, stride, P, heads)),
        rv(gather(qkv, off_v, v_stride, P, heads, v_shift, v_half)), rdo(gather(dout_h, 0, heads * 128, P, heads));
    DeviceArray<int> dlo(lo), dhi(hi);
    RefArgs ra{rq.ptr, rk.ptr, rv.ptr, rdo.ptr, dlo.ptr, dhi.ptr, P, heads, window, scale};
    const size_t n = (size_t)P * heads * 128;
    DeviceArray<float> ro(n), rlse((size_t)P * heads), rdelta((size_t)P * heads), rdq(n), rdk(n), rdv(n);
    const unsigned ref_blocks = (unsigned)(((int64_t)P * heads + 3) / 4);
    ref_attn_fwd<<<ref_blocks, 128>>>(ra, ro.ptr, rlse.ptr);
    CUDA_CHECK(cudaGetLastError());
    {
        std::vector<float> o = ro.download(), d = rdo.download(), delta((size_t)P * heads);
        for (int i = 0; i < P; ++i)
            for (int h = 0; h < heads; ++h) {
                double s = 0;
                for (int k = 0; k < 128; ++k) s += (double)o[((size_t)i * heads + h) * 128 + k] * d[((size_t)i * heads + h) * 128 + k];
                delta[(size_t)h * P + i] = (float)s;
            }
        rdelta.upload(delta);
    }
    ref_attn_bwd<<<ref_blocks, 128>>>(ra, rlse.ptr, rdelta.ptr, rdq.ptr, rdk.ptr, rdv.ptr);
    CUDA_CHECK(cudaGetLastError());

    // ours
    // dv: in the v columns of a (T, 2304) buffer where paired, else (P, heads, 128)
    DeviceArray<uint16_t> dqkv(qkv), ddo(dout_h), o(n), dq(n), dk(n), dv(paired ? (size_t)T * 2304 : n);
    DeviceArray<float> lse((size_t)P * heads), delta((size_t)P * heads);
    DeviceArray<int> dcu(cu);
    DeviceArray<unsigned char> tiles(attention_tiles_bytes(P, (int)cu.size()));
    DeviceArray<uint16_t> ds(attention_ds_bytes(P, (int)cu.size(), heads, window) / 2);
    attn::Params p{};
    p.tiles = reinterpret_cast<int4*>(tiles.ptr);
    p.ds = reinterpret_cast<__nv_bfloat16*>(ds.ptr);
    auto bf = [](uint16_t* x) { return reinterpret_cast<__nv_bfloat16*>(x); };
    p.q = bf(dqkv.ptr) + off_q, p.k = bf(dqkv.ptr) + off_k, p.v = bf(dqkv.ptr) + off_v;
    p.q_stride = p.k_stride = stride, p.v_stride = v_stride;
    p.v_shift = v_shift, p.v_half = v_half;
    p.o = bf(o.ptr), p.o_stride = heads * 128;
    p.lse = lse.ptr;
    p.cu_seqlens = dcu.ptr, p.cu_len = (int)cu.size(), p.cu_mult = mult;
    p.positions = P, p.heads = heads, p.window = window, p.scale = scale;
    p.dout = bf(ddo.ptr), p.dout_stride = heads * 128;
    p.dq = bf(dq.ptr), p.dk = bf(dk.ptr), p.dv = bf(dv.ptr) + (paired ? 1536 : 0);
    p.dq_stride = p.dk_stride = heads * 128, p.dv_stride = paired ? v_stride : heads * 128;
    p.delta = delta.ptr;
    std::vector<std::vector<uint16_t>> first;
    std::vector<float> first_lse;
    bool same = true;
    for (int run = 0; run < 2; ++run) {
        for (auto* a : {&o, &dq, &dk, &dv, &ds}) a->poison();
        lse.poison();
        CUDA_CHECK(attention_forward(p, 0));
        CUDA_CHECK(attention_backward(p, 0));
        if (run == 1) {  // again on the same schedule, as the trainer's layers run (the dK/dV pass's
                         // item counters must be back at 0)
            for (auto* a : {&dq, &dk, &dv, &ds}) a->poison();
            CUDA_CHECK(attention_backward(p, 0));
        }
        CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<std::vector<uint16_t>> got = {o.download(), dq.download(), dk.download(), dv.download()};
        std::vector<float> got_lse = lse.download();
        if (run == 0) first = got, first_lse = got_lse;
        else same = got == first && memcmp(got_lse.data(), first_lse.data(), got_lse.size() * 4) == 0;
    }
    auto widen = [](const std::vector<uint16_t>& x) {
        std::vector<float> f(x.size());
        for (size_t i = 0; i < x.size(); ++i) f[i] = bf16_to_float(x[i]);
        return f;
    };
    double e_o = rel_err(widen(first[0]), ro.download()), e_lse = rel_err(first_lse, rlse.download()),
           e_dq = rel_err(widen(first[1]), rdq.download()), e_dk = rel_err(widen(first[2]), rdk.download()),
           e_dv = rel_err(paired ? gather(first[3], 1536, v_stride, P, heads, v_shift, v_half) : widen(first[3]),
                          rdv.download());
    printf("  %-34s T=%6d %s w=%-6d  rel err: out %.1e lse %.1e dq %.1e dk %.1e dv %.1e%s\n", name, T,
           paired ? "paired" : "6 head", window, e_o, e_lse, e_dq, e_dk, e_dv, same ? "" : "  NOT DETERMINISTIC");
    CHECK(e_o < 1e-2 && e_lse < 1e-4 && e_dq < 1e-2 && e_dk < 1e-2 && e_dv < 1e-2,
          "%s: attention differs from the fp32 reference (out %.2e lse %.2e dq %.2e dk %.2e dv %.2e)", name, e_o,
          e_lse, e_dq, e_dk, e_dv);
    CHECK(same, "%s: two runs on the same inputs differ", name);
}

static void test_attention() {
    std::mt19937_64 rng(11);
    auto lengths = [&](int total, double median, int cap) {
        std::lognormal_distribution<double> ld(std::log(median), 0.9);
        std::vector<int> v;
        int sum = 0;
        while (sum < total) {
            int L = std::min(cap, std::max(1, (int)ld(rng)));
            L = std::min(L, total - sum);
            v.push_back(L);
            sum += L;
        }
        return v;
    };
    for (bool paired : {false, true}) {
        attention_case("many short documents", lengths(4000, 40, 300), 0, paired, 100000, 0.12f, 1);
        attention_case("FineWeb-like documents", lengths(6000, 450, 2048), 64, paired, 384, 0.1f, 2);
        attention_case("one long document", {5000}, 0, paired, 768, 0.12f, 3);
        attention_case("window 1", {700, 333, 1}, 0, paired, 1, 0.12f, 4);
        attention_case("window larger than the sequence", {1500, 900}, 0, paired, 5000, 0.0884f, 5);
        attention_case("empty sequences, padded cu_seqlens", {0, 65, 0, 0, 127, 64, 1, 0, 200}, 40, paired, 63, 0.12f, 6);
        attention_case("lengths off the tile", {63, 129, 191, 1, 2, 257}, 0, paired, 130, 0.12f, 7);
    }
}

// ---------------------------------------------------------------------------------------------
// soft-capped MTP cross-entropy, RMSNorm, cuBLASLt GEMMs against fp64 CPU references

static std::vector<uint16_t> random_bf16(std::mt19937_64& rng, size_t n, float sd) {
    std::normal_distribution<float> nd(0.f, sd);
    std::vector<uint16_t> v(n);
    for (auto& x : v) x = float_to_bf16(nd(rng));
    return v;
}

static double rel_err_d(const std::vector<double>& x, const std::vector<double>& ref) {
    double num = 0, den = 0;
    for (size_t i = 0; i < x.size(); ++i) {
        if (!std::isfinite(x[i])) return INFINITY;
        num += (x[i] - ref[i]) * (x[i] - ref[i]);
        den += ref[i] * ref[i];
    }
    return std::sqrt(num / std::max(den, 1e-300));
}

static void ce_case(const char* name, int rows, int vocab, std::vector<float> w, bool train, uint64_t seed) {
    std::mt19937_64 rng(seed);
    const int64_t ld = vocab + 8;  // a row stride other than the width
    std::vector<uint16_t> logits = random_bf16(rng, (size_t)rows * ld, 6.f);
    std::vector<int> targets(rows);
    for (auto& t : targets) t = (int)(rng() % vocab);
    const double A = 23, B = 5, C = 7.5, gscale = 0.125;
    // reference
    std::vector<double> loss_ref(rows), grad_ref((size_t)rows * vocab);
    for (int r = 0; r < rows; ++r) {
        std::vector<double> z(vocab);
        double s = 0;
        for (int c = 0; c < vocab; ++c) {
            z[c] = A / (1 + std::exp(-(bf16_to_float(logits[(size_t)r * ld + c]) + B) / C));
            s += std::exp(z[c]);
        }
        const double lse = std::log(s);
        double loss = 0, wsum = 0;
        for (size_t k = 0; k < w.size(); ++k)
            if (r + (int)k < rows) loss += w[k] * (lse - z[targets[r + k]]), wsum += w[k];
        loss_ref[r] = loss;
        for (int c = 0; c < vocab; ++c) {
            double dz = wsum * std::exp(z[c] - lse);
            for (size_t k = 0; k < w.size(); ++k)
                if (r + (int)k < rows && targets[r + k] == c) dz -= w[k];
            grad_ref[(size_t)r * vocab + c] = gscale * dz * z[c] * (1 - z[c] / A) / C;
        }
    }
    // the gradient as the model's fp8 backward takes it: rounded to bf16, / grad_s, e5m2
    const float grad_s = 0.75f / 448, inv_s = 1.f / grad_s;
    const int64_t ld8 = (vocab + 15) / 16 * 16 + 16, ld8t = rows + 16;  // strides other than the widths
    DeviceArray<uint16_t> dl(logits);
    DeviceArray<int> dt(targets);
    DeviceArray<float> dloss(rows), dlse(rows);
    DeviceArray<uint8_t> g8((size_t)rows * ld8), g8t((size_t)vocab * ld8t);
    dloss.poison(), dlse.poison();
    CUDA_CHECK(cudaMemset(g8.ptr, 0x7f, g8.n));  // NaN in e5m2
    CUDA_CHECK(cudaMemset(g8t.ptr, 0x7f, g8t.n));
    ce::Params p{};
    p.logits = reinterpret_cast<const __nv_bfloat16*>(dl.ptr), p.ld = ld, p.targets = dt.ptr;
    p.rows = rows, p.target_rows = rows, p.vocab = vocab, p.n_predict = (int)w.size();
    for (size_t k = 0; k < w.size(); ++k) p.w[k] = w[k];
    p.a = (float)A, p.b = (float)B, p.c = (float)C, p.losses = dloss.ptr;
    p.lse = train ? dlse.ptr : nullptr, p.grad_scale = (float)gscale, p.fast_softcap = train;
    CUDA_CHECK(softcapped_cross_entropy(p, 0));
    if (train) CUDA_CHECK(softcapped_ce_grad_fp8(p, g8.ptr, ld8, g8t.ptr, ld8t, grad_s, 0));
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> lo = dloss.download();
    std::vector<double> loss(lo.begin(), lo.end());
    double e_loss = rel_err_d(loss, loss_ref), e_grad = 0;
    int64_t off_by_one = 0, wrong = 0, not_transposed = 0;
    if (train) {
        std::vector<uint8_t> h8 = g8.download(), h8t = g8t.download();
        std::vector<double> grad((size_t)rows * vocab);
        for (int r = 0; r < rows; ++r)
            for (int c = 0; c < vocab; ++c) {
                const uint8_t got = h8[(size_t)r * ld8 + c];
                const uint8_t want = (uint8_t)__nv_cvt_float_to_fp8(
                    bf16_to_float(float_to_bf16((float)grad_ref[(size_t)r * vocab + c])) * inv_s, __NV_SATFINITE, __NV_E5M2);
                // the fp32 gradient (its soft-cap on tanh.approx) may round to a neighbouring bf16, so to a neighbouring e5m2 value
                if (got != want) ++((got ^ want) == 0x80 || std::abs((int)(got & 0x7f) - (int)(want & 0x7f)) > 1 ? wrong : off_by_one);
                not_transposed += got != h8t[(size_t)c * ld8t + r];
                __half_raw hr = __nv_cvt_fp8_to_halfraw(got, __NV_E5M2);
                grad[(size_t)r * vocab + c] = (double)__half2float(__half(hr)) * grad_s;
            }
        e_grad = rel_err_d(grad, grad_ref);
    }
    printf("  cross-entropy %-28s rows %4d vocab %6d  rel err: loss %.1e fp8 grad %.1e (e5m2 values off by one step: %lld)\n",
           name, rows, vocab, e_loss, e_grad, (long long)off_by_one);
    CHECK(e_loss < 1e-5 && e_grad < 0.1 && wrong == 0 && off_by_one * 1000 <= (int64_t)rows * vocab && not_transposed == 0,
          "%s: cross-entropy differs from the fp64 reference (loss %.2e, fp8 grad %.2e, %lld values wrong, %lld off by "
          "one, %lld not transposed)", name, e_loss, e_grad, (long long)wrong, (long long)off_by_one, (long long)not_transposed);
}

static void rmsnorm_case(int rows, int dim, uint64_t seed) {
    std::mt19937_64 rng(seed);
    const int64_t ld = dim + 64;
    std::vector<uint16_t> x = random_bf16(rng, (size_t)rows * ld, 3.f), dy = random_bf16(rng, (size_t)rows * ld, 1.f);
    const float eps = 1.1920929e-07f;
    std::vector<double> y_ref((size_t)rows * dim), dx_ref((size_t)rows * dim);
    for (int r = 0; r < rows; ++r) {
        double ss = 0, dot = 0;
        for (int c = 0; c < dim; ++c) {
            double v = bf16_to_float(x[(size_t)r * ld + c]);
            ss += v * v;
            dot += v * bf16_to_float(dy[(size_t)r * ld + c]);
        }
        double rs = 1 / std::sqrt(ss / dim + eps);
        for (int c = 0; c < dim; ++c) {
            double v = bf16_to_float(x[(size_t)r * ld + c]), g = bf16_to_float(dy[(size_t)r * ld + c]);
            y_ref[(size_t)r * dim + c] = v * rs;
            dx_ref[(size_t)r * dim + c] = rs * (g - v * rs * rs * dot / dim);
        }
    }
    DeviceArray<uint16_t> dx_in(x), ddy(dy), dyo((size_t)rows * ld), ddx((size_t)rows * ld);
    DeviceArray<float> rstd(rows);
    dyo.poison(), ddx.poison(), rstd.poison();
    auto bf = [](uint16_t* p) { return reinterpret_cast<__nv_bfloat16*>(p); };
    CUDA_CHECK(rms_norm_forward(bf(dx_in.ptr), ld, bf(dyo.ptr), ld, rstd.ptr, rows, dim, eps, 0));
    CUDA_CHECK(rms_norm_backward(bf(dx_in.ptr), ld, bf(ddy.ptr), ld, rstd.ptr, bf(ddx.ptr), ld, rows, dim, 0));
    CUDA_CHECK(cudaDeviceSynchronize());
    auto take = [&](const std::vector<uint16_t>& v) {
        std::vector<double> out((size_t)rows * dim);
        for (int r = 0; r < rows; ++r)
            for (int c = 0; c < dim; ++c) out[(size_t)r * dim + c] = bf16_to_float(v[(size_t)r * ld + c]);
        return out;
    };
    double ey = rel_err_d(take(dyo.download()), y_ref), ed = rel_err_d(take(ddx.download()), dx_ref);
    // accumulating: dx = dy (as the residual stream's gradient) + the norm's gradient
    CUDA_CHECK(cudaMemcpy(ddx.ptr, ddy.ptr, ddy.n * 2, cudaMemcpyDeviceToDevice));
    CUDA_CHECK(rms_norm_backward(bf(dx_in.ptr), ld, bf(ddy.ptr), ld, rstd.ptr, bf(ddx.ptr), ld, rows, dim, 0, true));
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<double> acc_ref = dx_ref;
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < dim; ++c) acc_ref[(size_t)r * dim + c] += bf16_to_float(dy[(size_t)r * ld + c]);
    const double ea = rel_err_d(take(ddx.download()), acc_ref);
    printf("  rms_norm rows %5d dim %4d  rel err: y %.1e dx %.1e dx accumulated %.1e\n", rows, dim, ey, ed, ea);
    CHECK(ey < 1e-2 && ed < 1e-2 && ea < 1e-2, "rms_norm rows %d dim %d differs from the fp64 reference (y %.2e dx %.2e "
          "accumulated %.2e)", rows, dim, ey, ed, ea);
}

static float fp8_to_float(uint8_t v, bool e5m2) {
    if (e5m2) {
        __nv_fp8_e5m2 f;
        f.__x = v;
        return (float)f;
    }
    __nv_fp8_e4m3 f;
    f.__x = v;
    return (float)f;
}

static void gemm_bf16_case(Gemms& gemms, Op opa, Op opb, int m, int n, int k, bool c_f32, float beta, uint64_t seed) {
    std::mt19937_64 rng(seed);
    // stored shapes (row-major) with padded leading dimensions
    const int ar = opa == Op::N ? m : k, ac = opa == Op::N ? k : m, br = opb == Op::N ? k : n, bc = opb == Op::N ? n : k;
    const int64_t lda = ac + 8, ldb = bc + 16, ldc = n + 8;
    std::vector<uint16_t> a = random_bf16(rng, (size_t)ar * lda, 1.f), b = random_bf16(rng, (size_t)br * ldb, 1.f);
    std::vector<float> c0((size_t)m * ldc);
    for (auto& v : c0) v = (float)(rng() % 1000) / 500.f - 1.f;
    std::vector<double> ref((size_t)m * n);
    for (int i = 0; i < m; ++i)
        for (int j = 0; j < n; ++j) {
            double s = 0;
            for (int t = 0; t < k; ++t) {
                double av = bf16_to_float(opa == Op::N ? a[(size_t)i * lda + t] : a[(size_t)t * lda + i]);
                double bv = bf16_to_float(opb == Op::N ? b[(size_t)t * ldb + j] : b[(size_t)j * ldb + t]);
                s += av * bv;
            }
            ref[(size_t)i * n + j] = s + (c_f32 ? beta * c0[(size_t)i * ldc + j] : 0.0);
        }
    DeviceArray<uint16_t> da(a), db(b), dc16((size_t)m * ldc);
    DeviceArray<float> dc32(c0);
    dc16.poison();
    auto bf = [](uint16_t* p) { return reinterpret_cast<const __nv_bfloat16*>(p); };
    gemms.bf16(0, opa, opb, m, n, k, bf(da.ptr), lda, bf(db.ptr), ldb, c_f32 ? (void*)dc32.ptr : (void*)dc16.ptr, ldc,
               c_f32, 1.f, c_f32 ? beta : 0.f);
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<double> got((size_t)m * n);
    std::vector<uint16_t> g16 = dc16.download();
    std::vector<float> g32 = dc32.download();
    for (int i = 0; i < m; ++i)
        for (int j = 0; j < n; ++j)
            got[(size_t)i * n + j] = c_f32 ? g32[(size_t)i * ldc + j] : bf16_to_float(g16[(size_t)i * ldc + j]);
    double e = rel_err_d(got, ref);
    const double tol = c_f32 ? 1e-5 : 1e-2;
    printf("  gemm bf16 %c%c m %4d n %4d k %4d -> %s%s  rel err %.1e\n", op_char(opa), op_char(opb),
           m, n, k, c_f32 ? "fp32" : "bf16", beta != 0.f && c_f32 ? " (+= C)" : "", e);
    CHECK(e < tol, "bf16 gemm m %d n %d k %d differs from the fp64 reference (%.2e)", m, n, k, e);
}

static void gemm_fp8_case(Gemms& gemms, int m, int n, int k, bool a_e5m2, bool b_e5m2, bool c_f32, bool fast, uint64_t seed) {
    std::mt19937_64 rng(seed);
    const int64_t lda = k + 16, ldb = k + 32, ldc = n + 8;
    std::vector<uint8_t> a((size_t)m * lda), b((size_t)n * ldb);
    // random finite fp8 values (avoid NaN/inf encodings)
    auto fill = [&](std::vector<uint8_t>& v, bool e5m2) {
        for (auto& x : v) {
            do x = (uint8_t)(rng() & 0xff);
            while (!std::isfinite(fp8_to_float(x, e5m2)) || std::fabs(fp8_to_float(x, e5m2)) > 64.f);
        }
    };
    fill(a, a_e5m2), fill(b, b_e5m2);
    const float sa = 0.25f, sb = 0.0078125f;
    std::vector<double> ref((size_t)m * n);
    for (int i = 0; i < m; ++i)
        for (int j = 0; j < n; ++j) {
            double s = 0;
            for (int t = 0; t < k; ++t)
                s += (double)fp8_to_float(a[(size_t)i * lda + t], a_e5m2) * fp8_to_float(b[(size_t)j * ldb + t], b_e5m2);
            ref[(size_t)i * n + j] = s * sa * sb;
        }
    DeviceArray<uint8_t> da(a), db(b), dc16((size_t)m * ldc * 2);
    DeviceArray<float> dc32((size_t)m * ldc), scale_a(std::vector<float>{sa}), scale_b(std::vector<float>{sb});
    dc16.poison(), dc32.poison();
    gemms.fp8(0, m, n, k, da.ptr, a_e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3, lda, db.ptr,
              b_e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3, ldb, c_f32 ? (void*)dc32.ptr : (void*)dc16.ptr, ldc, c_f32,
              scale_a.ptr, scale_b.ptr, fast);
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<double> got((size_t)m * n);
    std::vector<uint8_t> g8 = dc16.download();
    std::vector<float> g32 = dc32.download();
    for (int i = 0; i < m; ++i)
        for (int j = 0; j < n; ++j) {
            uint16_t h;
            memcpy(&h, &g8[((size_t)i * ldc + j) * 2], 2);
            got[(size_t)i * n + j] = c_f32 ? g32[(size_t)i * ldc + j] : bf16_to_float(h);
        }
    double e = rel_err_d(got, ref);
    // Hopper's fp8 tensor cores sum each k-block with a reduced-precision accumulator (cuBLASLt
    // promotes to fp32 between blocks unless fast_accum): ~1e-4 relative even with fp32 output
    const double tol = c_f32 && !fast ? 1e-3 : 1e-2;
    printf("  gemm fp8 %s x %s m %4d n %4d k %4d -> %s%s  rel err %.1e\n", a_e5m2 ? "e5m2" : "e4m3",
           b_e5m2 ? "e5m2" : "e4m3", m, n, k, c_f32 ? "fp32" : "bf16", fast ? " fast accum" : "", e);
    CHECK(e < tol, "fp8 gemm m %d n %d k %d differs from the fp64 reference (%.2e)", m, n, k, e);
}

// the MLP's fused GEMMs (linear_relu_square_forward / _backward) against the CPU: pre = x w^T against
// fp64 (bf16 rounding), post = relu(pre)^2 in fp32 from the kernel's own pre to the bit, and dpre =
// 2 relu(pre) g with g = dout w^T rounded to bf16 first: off by at most g's fp32 sum error (|g| 2^-7 +
// sum |terms| 2^-16, generous) and two bf16 roundings. The outputs start poisoned (NaN): every element
// written, and nothing past the last row (the buffers run on to the 128-row tile's end and 2 rows more)
static void linear_relu_square_case(int rows, int n, int k, uint64_t seed, int row_step = 1) {
    std::mt19937_64 rng(seed);
    const float ws = 1.f / std::sqrt((float)k);
    std::vector<uint16_t> x = random_bf16(rng, (size_t)rows * k, 1.f), w = random_bf16(rng, (size_t)n * k, ws);
    std::vector<uint16_t> dout = random_bf16(rng, (size_t)rows * k, 1.f), w2 = random_bf16(rng, (size_t)n * k, ws);
    const size_t out = (size_t)rows * n, out_alloc = (size_t)((rows + 127) / 128 * 128 + 2) * n;
    DeviceArray<uint16_t> dx(x), dw(w), ddout(dout), dw2(w2), pre(out_alloc), post(out_alloc), dpre(out_alloc);
    pre.poison(), post.poison(), dpre.poison();
    auto bf = [](uint16_t* p) { return reinterpret_cast<__nv_bfloat16*>(p); };
    CUDA_CHECK(linear_relu_square_forward(bf(dx.ptr), bf(dw.ptr), rows, n, k, bf(pre.ptr), bf(post.ptr), 0));
    CUDA_CHECK(linear_relu_square_backward(bf(ddout.ptr), bf(dw2.ptr), rows, n, k, bf(pre.ptr), bf(dpre.ptr), 0));
    CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> hp = pre.download(), hq = post.download(), hd = dpre.download();
    std::vector<double> got, ref, dgot, dref;
    int64_t post_bad = 0, pre_far = 0, dpre_far = 0;
    int64_t unwritten = 0, past = 0;  // every element: written (the poison is NaN), and post = relu(pre)^2 to the bit
    for (size_t at = 0; at < out; ++at) {
        const float p = bf16_to_float(hp[at]), rp = std::max(p, 0.f);
        unwritten += !std::isfinite(p) || !std::isfinite(bf16_to_float(hd[at]));
        post_bad += hq[at] != float_to_bf16(rp * rp);
    }
    for (size_t at = out; at < out_alloc; ++at) past += hp[at] != 0xffff || hq[at] != 0xffff || hd[at] != 0xffff;
    std::vector<int> checked;  // every row_step-th row, and the last
    for (int r = 0; r < rows; r += row_step) checked.push_back(r);
    if (checked.back() != rows - 1) checked.push_back(rows - 1);
    for (int r : checked)
        for (int c = 0; c < n; ++c) {
            double a = 0, a_abs = 0, g = 0, g_abs = 0;
            for (int i = 0; i < k; ++i) {
                const double ta = (double)bf16_to_float(x[(size_t)r * k + i]) * bf16_to_float(w[(size_t)c * k + i]);
                a += ta, a_abs += std::fabs(ta);
                const double term = (double)bf16_to_float(dout[(size_t)r * k + i]) * bf16_to_float(w2[(size_t)c * k + i]);
                g += term, g_abs += std::fabs(term);
            }
            const size_t at = (size_t)r * n + c;
            const float p = bf16_to_float(hp[at]), rp = std::max(p, 0.f);
            got.push_back(p), ref.push_back(a);
            pre_far += std::fabs(p - a) > std::fabs(a) / 256 + a_abs / 65536;  // a bf16 rounding and the fp32 sum's error
            const double d = bf16_to_float(hd[at]), want = 2 * g * rp;
            dgot.push_back(d), dref.push_back(want);
            dpre_far += std::fabs(d - want) > 2 * rp * (std::fabs(g) / 128 + g_abs / 65536) + std::fabs(want) / 128;
        }
    const double e = rel_err_d(got, ref), ed = rel_err_d(dgot, dref);
    printf("  linear + relu^2 rows %5d n %4d k %4d (every %d) rel err: pre %.1e dpre %.1e; unwritten %lld, written past "
           "the rows %lld, off by more than a step: pre %lld dpre %lld, post off: %lld\n",
           rows, n, k, row_step, e, ed, (long long)unwritten, (long long)past, (long long)pre_far, (long long)dpre_far,
           (long long)post_bad);
    CHECK(e < 1e-2 && ed < 1e-2 && unwritten == 0 && past == 0 && pre_far == 0 && post_bad == 0 && dpre_far == 0,
          "linear + relu^2 rows %d n %d: pre %.2e dpre %.2e, %lld unwritten, %lld written past the rows, %lld pre, "
          "%lld post, %lld dpre values off",
          rows, n, e, ed, (long long)unwritten, (long long)past, (long long)pre_far, (long long)post_bad,
          (long long)dpre_far);
}

static void fp8_cast_case(int rows, int cols, bool e5m2, bool transpose, float scale, uint64_t seed) {
    std::mt19937_64 rng(seed);
    const int64_t lds = cols + 16, ldd = (transpose ? rows : cols) + 32;
    std::vector<uint16_t> src = random_bf16(rng, (size_t)rows * lds, 60.f * scale);
    src[lds + 3] = float_to_bf16(1e6f);  // saturates
    DeviceArray<uint16_t> dsrc(src);
    DeviceArray<uint8_t> dst((size_t)(transpose ? cols : rows) * ldd);
    dst.poison();
    CUDA_CHECK(cast_to_fp8(reinterpret_cast<const __nv_bfloat16*>(dsrc.ptr), lds, dst.ptr, ldd, rows, cols, scale, e5m2,
                           transpose, 0));
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint8_t> got = dst.download();
    const float inv = 1.f / scale;
    int64_t bad = 0;
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) {
            uint8_t want = (uint8_t)__nv_cvt_float_to_fp8(bf16_to_float(src[(size_t)r * lds + c]) * inv, __NV_SATFINITE,
                                                          e5m2 ? __NV_E5M2 : __NV_E4M3);
            bad += got[transpose ? (size_t)c * ldd + r : (size_t)r * ldd + c] != want;
        }
    printf("  fp8 cast %s %4d x %4d%s: %lld mismatches\n", e5m2 ? "e5m2" : "e4m3", rows, cols, transpose ? " transposed" : "",
           (long long)bad);
    CHECK(bad == 0, "fp8 cast %d x %d: %lld mismatches", rows, cols, (long long)bad);
}

// fp64 reference of QK norm + rotary + key offset, forward and backward
static void qkrope_case(int T, bool paired, bool key_offset, uint64_t seed) {
    const int H = 6, ld = 3 * H * 128;
    std::mt19937_64 rng(seed);
    std::vector<uint16_t> qkv = random_bf16(rng, (size_t)T * ld, 1.5f);
    std::vector<uint16_t> dq = random_bf16(rng, (size_t)T * H * 128, 1.f), dk = random_bf16(rng, (size_t)T * H * 128, 1.f);
    qkrope::Params p{};
    qkrope::Freqs freq;
    for (int i = 0; i < 32; ++i) freq.f[i] = (float)std::pow(1.0 / 1024, i / 31.0) * (i < 12 ? 0.43f : 1.f);
    p.eps = 1.1920929e-07f, p.paired = paired, p.key_offset = key_offset, p.tokens = T, p.heads = H, p.ld = ld;
    p.ld_grad = ld;
    // reference
    std::vector<double> q_ref((size_t)T * H * 128), k_ref((size_t)T * H * 128), dqkv_ref((size_t)T * ld, 0.0);
    auto cs = [&](int pos, int i, double& c, double& s) {
        if (i >= 32) { c = 1, s = 0; return; }
        float th = (float)pos * freq.f[i];
        c = bf16_to_float(float_to_bf16((float)std::cos((double)th)));
        s = bf16_to_float(float_to_bf16((float)std::sin((double)th)));
    };
    std::vector<double> rot((size_t)T * H * 128 * 2);  // rotated q, k before the key offset
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h)
            for (int qk = 0; qk < 2; ++qk) {
                const uint16_t* x = &qkv[(size_t)t * ld + qk * H * 128 + h * 128];
                double ss = 0;
                for (int d = 0; d < 128; ++d) ss += (double)bf16_to_float(x[d]) * bf16_to_float(x[d]);
                double r = 1 / std::sqrt(ss / 128 + p.eps);
                int pos = paired ? 2 * t + (h & 1) : t;
                double* y = &rot[(((size_t)t * H + h) * 2 + qk) * 128];
                for (int i = 0; i < 64; ++i) {
                    double c, s, a = bf16_to_float(x[2 * i]) * r, b = bf16_to_float(x[2 * i + 1]) * r;
                    cs(pos, i, c, s);
                    y[2 * i] = c * a + s * b, y[2 * i + 1] = c * b - s * a;
                }
            }
    auto shifted = [](int d) { return (d >= 32 && d < 64) || d >= 96; };
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h)
            for (int d = 0; d < 128; ++d) {
                q_ref[((size_t)t * H + h) * 128 + d] = rot[(((size_t)t * H + h) * 2 + 0) * 128 + d];
                int src = key_offset && shifted(d) && t > 0 ? t - 1 : t;
                k_ref[((size_t)t * H + h) * 128 + d] = rot[(((size_t)src * H + h) * 2 + 1) * 128 + d];
            }
    // backward: scatter dk back through the offset, then the rotation and the norm
    std::vector<double> drot((size_t)T * H * 128 * 2, 0.0);
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h)
            for (int d = 0; d < 128; ++d) {
                drot[(((size_t)t * H + h) * 2 + 0) * 128 + d] += bf16_to_float(dq[((size_t)t * H + h) * 128 + d]);
                int src = key_offset && shifted(d) && t > 0 ? t - 1 : t;
                drot[(((size_t)src * H + h) * 2 + 1) * 128 + d] += bf16_to_float(dk[((size_t)t * H + h) * 128 + d]);
            }
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h)
            for (int qk = 0; qk < 2; ++qk) {
                const uint16_t* x = &qkv[(size_t)t * ld + qk * H * 128 + h * 128];
                const double* gy = &drot[(((size_t)t * H + h) * 2 + qk) * 128];
                int pos = paired ? 2 * t + (h & 1) : t;
                double dn[128], ss = 0, dot = 0;
                for (int i = 0; i < 64; ++i) {
                    double c, s;
                    cs(pos, i, c, s);
                    dn[2 * i] = c * gy[2 * i] - s * gy[2 * i + 1];
                    dn[2 * i + 1] = s * gy[2 * i] + c * gy[2 * i + 1];
                }
                for (int d = 0; d < 128; ++d) {
                    double v = bf16_to_float(x[d]);
                    ss += v * v, dot += dn[d] * v;
                }
                double r = 1 / std::sqrt(ss / 128 + p.eps);
                for (int d = 0; d < 128; ++d)
                    dqkv_ref[(size_t)t * ld + qk * H * 128 + h * 128 + d] = r * (dn[d] - bf16_to_float(x[d]) * r * r * dot / 128);
            }
    DeviceArray<uint16_t> dqkv_in(qkv), dq_out((size_t)T * H * 128), dk_out((size_t)T * H * 128), ddq(dq), ddk(dk),
        dqkv((size_t)T * ld);
    dq_out.poison(), dk_out.poison(), dqkv.poison();
    auto bf = [](uint16_t* x) { return reinterpret_cast<__nv_bfloat16*>(x); };
    p.qkv = bf(dqkv_in.ptr), p.q = bf(dq_out.ptr), p.k = bf(dk_out.ptr), p.dq = bf(ddq.ptr), p.dk = bf(ddk.ptr);
    p.dqkv = bf(dqkv.ptr);
    DeviceArray<__nv_bfloat162> table((size_t)2 * T * 32);
    CUDA_CHECK(rope_table(freq, 2 * T, table.ptr, 0));
    p.rope = table.ptr;
    CUDA_CHECK(qk_norm_rope_forward(p, 0));
    CUDA_CHECK(qk_norm_rope_backward(p, 0));
    CUDA_CHECK(cudaDeviceSynchronize());
    auto widen = [](const std::vector<uint16_t>& v) {
        std::vector<double> o(v.size());
        for (size_t i = 0; i < v.size(); ++i) o[i] = bf16_to_float(v[i]);
        return o;
    };
    std::vector<double> g = widen(dqkv.download()), gsel, rsel;
    for (int t = 0; t < T; ++t)  // the q and k columns (v's are not written)
        for (int c = 0; c < 2 * H * 128; ++c) gsel.push_back(g[(size_t)t * ld + c]), rsel.push_back(dqkv_ref[(size_t)t * ld + c]);
    double eq = rel_err_d(widen(dq_out.download()), q_ref), ek = rel_err_d(widen(dk_out.download()), k_ref),
           eg = rel_err_d(gsel, rsel);
    printf("  qk norm + rotary T %4d %s%s  rel err: q %.1e k %.1e dqk %.1e\n", T, paired ? "paired" : "6 head",
           key_offset ? " key offset" : "", eq, ek, eg);
    CHECK(eq < 1e-2 && ek < 1e-2 && eg < 1e-2, "qk norm + rotary differs from the fp64 reference (%.2e %.2e %.2e)", eq, ek, eg);
}

// ---------------------------------------------------------------------------------------------
// optimizer kernels against double-precision CPU emulations of the record's formulas

static double rb(double v) { return bf16_to_float(float_to_bf16((float)v)); }  // round to bf16

static void polar_express_case(int count, int rows, int cols, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    const int64_t n = (int64_t)rows * cols;
    std::vector<float> g((size_t)count * n);
    for (auto& v : g) v = nd(rng) * 0.01f;
    const int m = std::min(rows, cols), w = std::max(rows, cols);
    const bool tall = rows > cols;
    std::vector<double> ref((size_t)count * n);
    for (int b = 0; b < count; ++b) {
        std::vector<double> X((size_t)m * w), A((size_t)m * m), B((size_t)m * m), N((size_t)m * w);
        double ss = 0;
        for (int64_t i = 0; i < n; ++i) ss += rb(g[b * n + i]) * rb(g[b * n + i]);
        const double denom = std::sqrt(ss) * 1.02 + 1e-6;
        for (int r = 0; r < rows; ++r)
            for (int c = 0; c < cols; ++c) {
                double v = rb(rb(g[b * n + (int64_t)r * cols + c]) / denom);
                if (tall) X[(size_t)c * w + r] = v;
                else X[(size_t)r * w + c] = v;
            }
        for (int it = 0; it < 5; ++it) {
            const double a = polar_express_coeffs[it][0], bb = polar_express_coeffs[it][1], cc = polar_express_coeffs[it][2];
            for (int i = 0; i < m; ++i)
                for (int j = 0; j < m; ++j) {
                    double s = 0;
                    for (int k = 0; k < w; ++k) s += X[(size_t)i * w + k] * X[(size_t)j * w + k];
                    A[(size_t)i * m + j] = rb(s);
                }
            for (int i = 0; i < m; ++i)
                for (int j = 0; j < m; ++j) {
                    double s = 0;
                    for (int k = 0; k < m; ++k) s += A[(size_t)i * m + k] * A[(size_t)k * m + j];
                    B[(size_t)i * m + j] = rb(bb * A[(size_t)i * m + j] + cc * s);
                }
            for (int i = 0; i < m; ++i)
                for (int j = 0; j < w; ++j) {
                    double s = 0;
                    for (int k = 0; k < m; ++k) s += B[(size_t)i * m + k] * X[(size_t)k * w + j];
                    N[(size_t)i * w + j] = rb(a * X[(size_t)i * w + j] + s);
                }
            X.swap(N);
        }
        for (int r = 0; r < rows; ++r)
            for (int c = 0; c < cols; ++c) ref[b * n + (int64_t)r * cols + c] = tall ? X[(size_t)c * w + r] : X[(size_t)r * w + c];
    }
    Gemms gemms;
    PolarExpress pe(count, rows, cols);
    DeviceArray<float> dg(g);
    DeviceArray<uint16_t> out((size_t)count * n);
    out.poison();
    pe.run(gemms, dg.ptr, reinterpret_cast<__nv_bfloat16*>(out.ptr), count, 0);
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint16_t> o = out.download();
    std::vector<double> got(o.size());
    for (size_t i = 0; i < o.size(); ++i) got[i] = bf16_to_float(o[i]);
    double e = rel_err_d(got, ref);
    printf("  polar express %d x %4d x %4d%s  rel err %.1e\n", count, rows, cols, tall ? " (tall)" : "", e);
    CHECK(e < 1e-2, "polar express %d x %d x %d differs from the bf16 CPU emulation (%.2e)", count, rows, cols, e);
}

static void normuon_step_case(int count, int rows, int cols, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    const int64_t per = (int64_t)rows * cols, n = per * count;
    std::vector<uint16_t> grad = random_bf16(rng, n, 0.02f), v = random_bf16(rng, n, 0.05f), p = random_bf16(rng, n, 0.03f);
    std::vector<uint16_t> mant(n);
    for (auto& x : mant) x = (uint16_t)rng();
    std::vector<float> buf(n), sm((size_t)count * rows), lr(count);
    for (auto& x : buf) x = nd(rng) * 0.01f;
    for (auto& x : sm) x = std::fabs(nd(rng)) * 1e-3f;
    for (int i = 0; i < count; ++i) lr[i] = 0.023f * (i % 2 ? 2.f : 1.f);
    const float mu = 0.93f, beta2 = 0.95f, wd = 1.2f * 0.023f;
    // reference
    std::vector<double> buf_ref(n), out_ref(n), v_ref(n), sm_ref(sm.size());
    for (int64_t i = 0; i < n; ++i) {
        double gg = bf16_to_float(grad[i]);
        buf_ref[i] = buf[i] + (1 - mu) * (gg - buf[i]);
        out_ref[i] = gg + mu * (buf_ref[i] - gg);
    }
    for (int b = 0; b < count; ++b) {
        double norm_sq = 0, new_sq = 0;
        std::vector<double> step(rows);
        for (int r = 0; r < rows; ++r) {
            double s = 0;
            for (int c = 0; c < cols; ++c) s += std::pow(bf16_to_float(v[b * per + (int64_t)r * cols + c]), 2);
            double mean = s / cols, bb = sm[(size_t)b * rows + r] + (1 - beta2) * (mean - sm[(size_t)b * rows + r]);
            sm_ref[(size_t)b * rows + r] = bb;
            step[r] = 1 / std::sqrt(std::max(bb, 1e-10));
            norm_sq += mean * cols, new_sq += mean * cols * step[r] * step[r];
        }
        double ratio = std::sqrt(norm_sq) / std::max(std::sqrt(new_sq), 1e-10);
        for (int r = 0; r < rows; ++r)
            for (int c = 0; c < cols; ++c) {
                int64_t i = b * per + (int64_t)r * cols + c;
                v_ref[i] = rb(bf16_to_float(v[i]) * rb(step[r] * ratio));
            }
    }
    // the update, from the GPU's normalised v (checked above) so rounding flips in v do not spread
    DeviceArray<uint16_t> dgrad(grad), dv(v), dp(p), dm(mant);
    DeviceArray<float> dbuf(buf), dout(n), dsm(sm), dlr(lr);
    dout.poison();
    auto bf = [](uint16_t* x) { return reinterpret_cast<__nv_bfloat16*>(x); };
    CUDA_CHECK(nesterov_momentum(bf(dgrad.ptr), dbuf.ptr, dout.ptr, n, mu, 0));
    DeviceArray<float> var_ws(normuon_variance_workspace(count, rows));
    CUDA_CHECK(normuon_variance(bf(dv.ptr), dsm.ptr, count, rows, cols, beta2, var_ws.ptr, 0));
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint16_t> vg = dv.download();
    CUDA_CHECK(normuon_apply(bf(dp.ptr), dm.ptr, bf(dv.ptr), per, count, dlr.ptr, wd, 0));
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<double> p_ref(n), p_got(n);
    std::vector<uint16_t> pg = dp.download(), mg = dm.download();
    for (int64_t i = 0; i < n; ++i) {
        uint32_t raw = ((uint32_t)p[i] << 16) | mant[i];
        float x;
        memcpy(&x, &raw, 4);
        double gv = bf16_to_float(vg[i]), l = lr[i / per];
        p_ref[i] = x - (gv * x >= 0 ? x * wd * l : 0.0) - gv * l;
        uint32_t got = ((uint32_t)pg[i] << 16) | mg[i];
        float gf;
        memcpy(&gf, &got, 4);
        p_got[i] = gf;
    }
    auto to_d = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
    std::vector<double> vgd(n);
    for (int64_t i = 0; i < n; ++i) vgd[i] = bf16_to_float(vg[i]);
    double e_buf = rel_err_d(to_d(dbuf.download()), buf_ref), e_out = rel_err_d(to_d(dout.download()), out_ref),
           e_sm = rel_err_d(to_d(dsm.download()), sm_ref), e_v = rel_err_d(vgd, v_ref);
    // the weights move by ~lr * |v|: compare the change, kept exact in fp32 through the mantissa
    std::vector<double> d_ref(n), d_got(n);
    for (int64_t i = 0; i < n; ++i) {
        uint32_t raw = ((uint32_t)p[i] << 16) | mant[i];
        float x;
        memcpy(&x, &raw, 4);
        d_ref[i] = p_ref[i] - x, d_got[i] = p_got[i] - x;
    }
    double e_p = rel_err_d(d_got, d_ref);
    printf("  normuon %d x %d x %d  rel err: momentum %.1e nesterov %.1e second moment %.1e v %.1e update %.1e\n", count,
           rows, cols, e_buf, e_out, e_sm, e_v, e_p);
    CHECK(e_buf < 1e-6 && e_out < 1e-6 && e_sm < 1e-5 && e_v < 1e-2 && e_p < 1e-5,
          "NorMuon step differs from the reference (%.2e %.2e %.2e %.2e %.2e)", e_buf, e_out, e_sm, e_v, e_p);
}

template <typename T>
static void adam_case(const char* name, int64_t n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<T> p(n);
    std::vector<uint16_t> grad = random_bf16(rng, n, 0.1f);
    std::vector<float> m(n), v(n);
    for (int64_t i = 0; i < n; ++i) {
        p[i] = (T)(nd(rng) * 0.05f);
        m[i] = nd(rng) * 0.01f, v[i] = std::fabs(nd(rng)) * 1e-4f;
    }
    const float b1 = 0.75f, b2 = 0.95f, eps = 1e-10f, lr = 0.008f * 75.f;
    const int t = 3;
    const float step_size = (float)(lr * std::sqrt(1 - std::pow(b2, t)) / (1 - std::pow(b1, t)));
    const float eff_wd = lr * lr * 0.005f * 5.f;
    std::vector<double> p_ref(n), m_ref(n), v_ref(n);
    for (int64_t i = 0; i < n; ++i) {
        double g = bf16_to_float(grad[i]), x = (double)(float)p[i];
        m_ref[i] = b1 * m[i] + (1 - b1) * g, v_ref[i] = b2 * v[i] + (1 - b2) * g * g;
        double u = m_ref[i] / (std::sqrt(v_ref[i]) + eps) * step_size;
        if (u * x > 0) u += x * eff_wd;
        p_ref[i] = x - u;
    }
    DeviceArray<T> dp(p);
    DeviceArray<uint16_t> dg(grad);
    DeviceArray<float> dm(m), dv(v);
    CUDA_CHECK(adam_update(dp.ptr, reinterpret_cast<const __nv_bfloat16*>(dg.ptr), dm.ptr, dv.ptr, n, b1, b2, eps,
                           step_size, eff_wd, 0));
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<T> pg = dp.download();
    std::vector<double> got(n), dref(n), dgot(n);
    for (int64_t i = 0; i < n; ++i) {
        double x = (double)(float)p[i];
        got[i] = (double)(float)pg[i];
        dref[i] = p_ref[i] - x, dgot[i] = got[i] - x;
    }
    auto to_d = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
    double e_m = rel_err_d(to_d(dm.download()), m_ref), e_v = rel_err_d(to_d(dv.download()), v_ref), e_p = rel_err_d(got, p_ref);
    const bool bf16 = sizeof(T) == 2;
    // fp32 weights: the step itself must match; bf16 weights: within the weight's own rounding
    double e_step = rel_err_d(dgot, dref);
    printf("  adam %-5s n %6lld  rel err: m %.1e v %.1e p %.1e step %.1e\n", name, (long long)n, e_m, e_v, e_p, e_step);
    CHECK(e_m < 1e-6 && e_v < 1e-6 && e_p < (bf16 ? 1e-2 : 1e-6) && (bf16 || e_step < 1e-4),
          "Adam (%s) differs from the reference (%.2e %.2e %.2e %.2e)", name, e_m, e_v, e_p, e_step);
}

static void embedding_case(int tokens, int vocab_used, uint64_t seed) {
    std::mt19937_64 rng(seed);
    const int V = 50304, D = 768;
    std::vector<int> ids(tokens);
    for (auto& x : ids) x = rng() % 3 == 0 ? (int)(rng() % 4) : (int)(rng() % vocab_used);  // some ids very frequent
    ids[0] = V - 1;
    std::vector<uint16_t> table = random_bf16(rng, (size_t)V * D, 1.f), grad = random_bf16(rng, (size_t)tokens * D, 1.f);
    std::vector<uint16_t> g0 = random_bf16(rng, (size_t)V * D, 0.1f);
    std::vector<double> sums((size_t)V * D, 0.0);
    std::vector<bool> touched(V, false);
    for (int t = 0; t < tokens; ++t) {
        touched[ids[t]] = true;
        for (int d = 0; d < D; ++d) sums[(size_t)ids[t] * D + d] += bf16_to_float(grad[(size_t)t * D + d]);
    }
    DeviceArray<int> did(ids);
    DeviceArray<uint16_t> dtab(table), dgrad(grad), out((size_t)tokens * D), gt(g0);
    out.poison();
    auto bf = [](uint16_t* x) { return reinterpret_cast<__nv_bfloat16*>(x); };
    CUDA_CHECK(embedding_forward(did.ptr, tokens, bf(dtab.ptr), bf(out.ptr), D, 0));
    EmbeddingBackward eb(tokens + 5);
    CUDA_CHECK(eb.sort(did.ptr, tokens, 0));
    CUDA_CHECK(eb.accumulate(bf(dgrad.ptr), D, bf(gt.ptr), 0));
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint16_t> o = out.download(), first = gt.download();
    bool gather_ok = true;
    for (int t = 0; t < tokens; ++t) gather_ok &= memcmp(&o[(size_t)t * D], &table[(size_t)ids[t] * D], D * 2) == 0;
    std::vector<double> got, ref;
    bool untouched_ok = true;
    for (int v = 0; v < V; ++v)
        for (int d = 0; d < D; ++d) {
            size_t i = (size_t)v * D + d;
            if (!touched[v]) {
                untouched_ok &= first[i] == g0[i];
                continue;
            }
            got.push_back(bf16_to_float(first[i]));
            ref.push_back(bf16_to_float(g0[i]) + sums[i]);
        }
    gt.upload(g0);
    CUDA_CHECK(eb.accumulate(bf(dgrad.ptr), D, bf(gt.ptr), 0));
    CUDA_CHECK(cudaDeviceSynchronize());
    const bool same = gt.download() == first;
    double e = rel_err_d(got, ref);
    printf("  embedding %5d tokens: gather %s, scatter-add rel err %.1e%s\n", tokens, gather_ok ? "exact" : "WRONG", e,
           same ? ", bit-identical twice" : ", NOT DETERMINISTIC");
    CHECK(gather_ok && untouched_ok && e < 1e-2 && same, "embedding gather/scatter-add (gather %d untouched %d err %.2e same %d)",
          (int)gather_ok, (int)untouched_ok, e, (int)same);
    // several tables in one pass (gradients with a row stride of their own) give each table the
    // same bits as a pass of its own
    const int LD = D + 4;
    for (int count : {2, 3, 4}) {
        std::vector<std::unique_ptr<DeviceArray<uint16_t>>> g, tg;
        std::vector<std::vector<uint16_t>> g0s;
        for (int k = 0; k < count; ++k) {
            g.push_back(std::make_unique<DeviceArray<uint16_t>>(random_bf16(rng, (size_t)tokens * LD, 1.f)));
            g0s.push_back(random_bf16(rng, (size_t)V * D, 0.1f));
            tg.push_back(std::make_unique<DeviceArray<uint16_t>>(g0s.back()));
        }
        std::vector<const __nv_bfloat16*> gp;
        std::vector<__nv_bfloat16*> tp;
        for (int k = 0; k < count; ++k) gp.push_back(bf(g[k]->ptr)), tp.push_back(bf(tg[k]->ptr));
        CUDA_CHECK(eb.accumulate(count, gp.data(), LD, tp.data(), 0));
        CUDA_CHECK(cudaDeviceSynchronize());
        bool alone_ok = true;
        for (int k = 0; k < count; ++k) {
            std::vector<uint16_t> together = tg[k]->download();
            tg[k]->upload(g0s[k]);
            CUDA_CHECK(eb.accumulate(gp[k], LD, tp[k], 0));
            CUDA_CHECK(cudaDeviceSynchronize());
            alone_ok &= tg[k]->download() == together;
        }
        CHECK(alone_ok, "embedding backward of %d tables at once differs from one at a time", count);
    }
    printf("  embedding %5d tokens: 2, 3 and 4 tables at once, row stride %d: same bits as one at a time\n", tokens, LD);
}

// the four gates, forward and backward, against fp64 (z rounded to bf16 as the kernels do)
// db_first (value embedding, skip): db is written, not added to; deferred: the input gradient by
// gate_input_grad after gate_backward without it, as the trainer's attention backward does
static void gate_case(GateKind kind, int T, uint64_t seed, bool db_first = false, bool deferred = false) {
    std::mt19937_64 rng(seed);
    const bool per_head = kind == GateKind::ValueEmbedding || kind == GateKind::Output;
    const int H = per_head ? 6 : 1, D = 768;
    std::vector<uint16_t> x = random_bf16(rng, (size_t)T * D, 1.f), w = random_bf16(rng, (size_t)H * 12, 0.5f);
    std::vector<uint16_t> a = random_bf16(rng, (size_t)T * D, 1.f), b = random_bf16(rng, (size_t)T * D, 1.f);
    std::vector<uint16_t> dout = random_bf16(rng, (size_t)T * D, 1.f), db0 = random_bf16(rng, (size_t)T * D, 0.1f);
    std::vector<uint16_t> dx0 = random_bf16(rng, (size_t)T * D, 0.1f), dw0 = random_bf16(rng, (size_t)H * 12, 0.1f);
    const float lam = kind == GateKind::Smear ? 0.3f : -1.5f;
    if (kind == GateKind::Smear) x = a;  // smear's gate reads the rows it smears
    auto sig = [](double z) { return 1 / (1 + std::exp(-z)); };
    auto zf = [&](int t, int h) {
        double s = 0;
        for (int j = 0; j < 12; ++j) s += (double)bf16_to_float(x[(size_t)t * D + j]) * bf16_to_float(w[h * 12 + j]);
        return (double)rb(s);
    };
    auto F = [&](const std::vector<uint16_t>& v, int t, int c) { return (double)bf16_to_float(v[(size_t)t * D + c]); };
    std::vector<double> fwd((size_t)T * D), da((size_t)T * D), db((size_t)T * D), dz((size_t)T * H, 0.0), dlam_rows(T, 0.0);
    for (int t = 0; t < T; ++t)
        for (int c = 0; c < D; ++c) {
            const int h = per_head ? c / 128 : 0;
            const double s = sig(zf(t, h));
            switch (kind) {
                case GateKind::ValueEmbedding: fwd[(size_t)t * D + c] = F(a, t, c) + 2 * s * F(b, t, c); break;
                case GateKind::Output: fwd[(size_t)t * D + c] = F(a, t, c) * s; break;
                case GateKind::Smear: fwd[(size_t)t * D + c] = F(a, t, c) + (t ? lam * s * F(a, t - 1, c) : 0); break;
                case GateKind::Skip: fwd[(size_t)t * D + c] = F(a, t, c) + sig(lam) * 2 * s * F(b, t, c); break;
            }
        }
    // the output gate's backward also gives attention's delta = rowsum(dy * y), here in the paired
    // layout's index order (3 heads over 2T positions)
    std::vector<double> delta_ref((size_t)T * H);
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h) {
            const double s = sig(zf(t, h));
            double d = 0, dd = 0;
            const int c0 = per_head ? h * 128 : 0, c1 = per_head ? c0 + 128 : D;
            for (int c = c0; c < c1; ++c) {
                const double g = F(dout, t, c);
                switch (kind) {
                    case GateKind::ValueEmbedding:
                        d += g * F(b, t, c), db[(size_t)t * D + c] = (db_first ? 0.0 : F(db0, t, c)) + 2 * s * g;
                        break;
                    case GateKind::Output: d += g * F(a, t, c), dd += g * s * F(a, t, c), da[(size_t)t * D + c] = g * s; break;
                    case GateKind::Smear:
                        if (t) d += g * F(a, t - 1, c);
                        da[(size_t)t * D + c] = g + (t + 1 < T ? lam * sig(zf(t + 1, 0)) * F(dout, t + 1, c) : 0);
                        break;
                    case GateKind::Skip:
                        d += g * F(b, t, c), db[(size_t)t * D + c] = (db_first ? 0.0 : F(db0, t, c)) + sig(lam) * 2 * s * g;
                        break;
                }
            }
            switch (kind) {
                case GateKind::ValueEmbedding: dz[(size_t)t * H + h] = d * 2 * s * (1 - s); break;
                case GateKind::Output:
                    dz[(size_t)t * H + h] = d * s * (1 - s);
                    delta_ref[(size_t)(h % (H / 2)) * 2 * T + 2 * t + h / (H / 2)] = dd;
                    break;
                case GateKind::Smear: dz[t] = t ? lam * s * (1 - s) * d : 0, dlam_rows[t] = t ? s * d : 0; break;
                case GateKind::Skip:
                    dz[t] = sig(lam) * 2 * s * (1 - s) * d, dlam_rows[t] = sig(lam) * (1 - sig(lam)) * 2 * s * d;
                    break;
            }
        }
    // the gate input's gradient: smear adds into da (the gradient of x); the others into dx0
    std::vector<double> dx_ref((size_t)T * 12), dw_ref(H * 12), dlam_ref(1, 0.0);
    for (int t = 0; t < T; ++t)
        for (int j = 0; j < 12; ++j) {
            double s = kind == GateKind::Smear ? da[(size_t)t * D + j] : F(dx0, t, j);
            for (int h = 0; h < H; ++h) s += dz[(size_t)t * H + h] * bf16_to_float(w[h * 12 + j]);
            dx_ref[(size_t)t * 12 + j] = s;
        }
    for (int h = 0; h < H; ++h)
        for (int j = 0; j < 12; ++j) {
            double s = bf16_to_float(dw0[h * 12 + j]);
            for (int t = 0; t < T; ++t) s += dz[(size_t)t * H + h] * F(x, t, j);
            dw_ref[h * 12 + j] = s;
        }
    for (int t = 0; t < T; ++t) dlam_ref[0] += dlam_rows[t];

    DeviceArray<uint16_t> dxg(x), dwg(w), dag(a), dbg(b), doutg(dout), outg((size_t)T * D), dag2((size_t)T * D), dbg2(db0),
        dx0g(dx0), dwgr(dw0);
    DeviceArray<float> lamg(std::vector<float>{lam}), dzg((size_t)T * H), dlr(T), dlam(std::vector<float>{0.f});
    outg.poison(), dag2.poison();
    if (db_first) dbg2.poison();
    auto bf = [](uint16_t* p) { return reinterpret_cast<__nv_bfloat16*>(p); };
    gate::Params p{};
    p.db_first = db_first;
    p.tokens = T, p.heads = H, p.x = bf(dxg.ptr), p.ld_x = D, p.w = bf(dwg.ptr), p.lambda = lamg.ptr;
    p.a = bf(dag.ptr), p.ld_a = D, p.b = bf(dbg.ptr), p.ld_b = D, p.out = bf(outg.ptr), p.ld_out = D;
    p.dout = bf(doutg.ptr), p.ld_dout = D, p.da = bf(dag2.ptr), p.db = bf(dbg2.ptr), p.ld_da = D, p.ld_db = D;
    DeviceArray<float> partial((size_t)gate::WG_BLOCKS * gate::WG_OUT);
    p.dz = dzg.ptr, p.dlam_rows = dlr.ptr, p.partial = partial.ptr;
    DeviceArray<float> deltag((size_t)T * H);
    deltag.poison();
    if (kind == GateKind::Output) p.delta = deltag.ptr, p.delta_split = 2;
    if (kind == GateKind::Smear) p.x = p.a;
    __nv_bfloat16* dx_in = kind == GateKind::Smear ? p.da : bf(dx0g.ptr);
    CUDA_CHECK(gate_backward(kind, p, deferred ? nullptr : dx_in, D, bf(dwgr.ptr), dlam.ptr, 0));
    if (deferred) CUDA_CHECK(gate_input_grad(p, dx_in, D, 0));
    // the same backward with its weight sums deferred (DeferredSums: the partial sums of every gate
    // in one launch at finish(), as the model's backward does): the same dw and dlambda bits; its
    // other outputs go to buffers of their own
    DeviceArray<uint16_t> dwgr2(dw0), db_d(db0), da_d((size_t)T * D);
    DeviceArray<float> dz_d((size_t)T * H), dlr_d(T), dlam_d(std::vector<float>{0.f}), delta_d((size_t)T * H);
    {
        gate::Params pd = p;
        pd.db = bf(db_d.ptr), pd.da = bf(da_d.ptr), pd.dz = dz_d.ptr, pd.dlam_rows = dlr_d.ptr, pd.partial = nullptr;
        if (p.delta) pd.delta = delta_d.ptr;
        DeferredSums ds;
        CUDA_CHECK(ds.allocate(0, 1));
        CUDA_CHECK(gate_backward(kind, pd, nullptr, 0, bf(dwgr2.ptr), dlam_d.ptr, 0, &ds));
        CHECK(gate_backward(kind, pd, nullptr, 0, bf(dwgr2.ptr), dlam_d.ptr, 0, &ds) == cudaErrorInvalidValue,
              "deferred gate sums: a second gate found a slot of one");
        CHECK(dwgr2.download() == dw0, "deferred gate sums: dw changed before finish()");
        CUDA_CHECK(ds.finish(0));
    }
    CUDA_CHECK(gate_forward(kind, p, 0));  // after the backward: v and x are updated in place
    CUDA_CHECK(cudaDeviceSynchronize());
    auto widen = [&](const std::vector<uint16_t>& v, int cols, int take) {
        std::vector<double> o;
        for (int t = 0; t < T; ++t)
            for (int c = 0; c < take; ++c) o.push_back(bf16_to_float(v[(size_t)t * cols + c]));
        return o;
    };
    const bool in_place = kind == GateKind::ValueEmbedding || kind == GateKind::Skip;
    double e_f = rel_err_d(widen(in_place ? dag.download() : outg.download(), D, D), fwd);
    double e_a = 0, e_b = 0;
    if (kind == GateKind::Output || kind == GateKind::Smear) {
        std::vector<double> got = widen(dag2.download(), D, D), ref = da;
        if (kind == GateKind::Smear)  // its first 12 channels also hold the gate input's gradient (checked below)
            for (int t = 0; t < T; ++t)
                for (int j = 0; j < 12; ++j) got[(size_t)t * D + j] = ref[(size_t)t * D + j] = 0;
        e_a = rel_err_d(got, ref);
    }
    if (kind == GateKind::ValueEmbedding || kind == GateKind::Skip) e_b = rel_err_d(widen(dbg2.download(), D, D), db);
    double e_x = rel_err_d(widen(kind == GateKind::Smear ? dag2.download() : dx0g.download(), D, 12), dx_ref);
    std::vector<uint16_t> dwgot = dwgr.download();
    std::vector<double> dwd(dwgot.size());
    for (size_t i = 0; i < dwd.size(); ++i) dwd[i] = bf16_to_float(dwgot[i]);
    double e_w = rel_err_d(dwd, dw_ref);
    CHECK(dwgr2.download() == dwgot && dlam_d.download()[0] == dlam.download()[0],
          "gate kind %d T %d: the deferred weight sums differ from gate_backward's own", (int)kind, T);
    double e_l = per_head ? 0 : std::fabs(dlam.download()[0] - dlam_ref[0]) / std::max(1e-12, std::fabs(dlam_ref[0]));
    double e_d = 0;
    if (kind == GateKind::Output) {
        std::vector<float> got = deltag.download();
        e_d = rel_err_d(std::vector<double>(got.begin(), got.end()), delta_ref);
    }
    const char* names[] = {"value-embedding gate", "output gate", "smear", "skip"};
    printf("  %-22s T %5d%s%s  rel err: out %.1e da %.1e db %.1e dx[:12] %.1e dw %.1e dlambda %.1e delta %.1e\n",
           names[(int)kind], T, db_first ? " (db first)" : "", deferred ? " (input grad deferred)" : "", e_f, e_a, e_b, e_x,
           e_w, e_l, e_d);
    CHECK(e_f < 1e-2 && e_a < 1e-2 && e_b < 1e-2 && e_x < 1e-2 && e_w < 1e-2 && e_l < 1e-3 && e_d < 1e-2,
          "%s differs from the fp64 reference", names[(int)kind]);
}

// a block's first norm and the mixing in one backward pass (norm_mix_backward), which remakes the
// mix xm = bf16(ca x + cb y) as combine_norm stored it; dy_first: dy = cb dm instead of dy += cb dm;
// folds: nadd gradients added into dx (0-2), into_dy: dy += dx (dx not written), with the bits of
// the combine passes they replace
static void norm_mix_case(int rows, bool dy_first, uint64_t seed, int nadd = 0, bool into_dy = false) {
    const int D = 768;
    const size_t n = (size_t)rows * D;
    const float ca = 1.1f, cb = 0.25f;
    std::mt19937_64 rng(seed);
    std::vector<uint16_t> dxn = random_bf16(rng, n, 1.f), dx = random_bf16(rng, n, 1.f);
    std::vector<uint16_t> x = random_bf16(rng, n, 1.f), y = random_bf16(rng, n, 2.f), dy = random_bf16(rng, n, 0.5f);
    std::vector<uint16_t> add[2] = {random_bf16(rng, n, 1.f), random_bf16(rng, n, 0.7f)};
    std::vector<uint16_t> xm(n);
    for (size_t i = 0; i < n; ++i)  // the kernels' mix: fma(ca, x, bf16-free cb * y), rounded once to bf16
        xm[i] = float_to_bf16(std::fma(ca, bf16_to_float(x[i]), cb * bf16_to_float(y[i])));
    std::vector<float> rstd(rows);
    std::vector<double> dx_ref(n), dy_ref(n);
    double sx = 0, sy = 0, mx = 0, my = 0;  // the sums and their terms' root sum of squares
    for (int r = 0; r < rows; ++r) {
        double ss = 0, dot = 0;
        for (int c = 0; c < D; ++c) {
            const double v = bf16_to_float(xm[(size_t)r * D + c]);
            ss += v * v, dot += v * bf16_to_float(dxn[(size_t)r * D + c]);
        }
        rstd[r] = (float)(1 / std::sqrt(ss / D + 1.1920929e-07));
        const double rs = rstd[r];
        for (int c = 0; c < D; ++c) {
            const size_t i = (size_t)r * D + c;
            const double dm = bf16_to_float(dx[i]) +
                              rs * (bf16_to_float(dxn[i]) - bf16_to_float(xm[i]) * rs * rs * dot / D);
            dx_ref[i] = (double)ca * dm, dy_ref[i] = (dy_first ? 0.0 : bf16_to_float(dy[i])) + (double)cb * dm;
            for (int k = 0; k < nadd; ++k) dx_ref[i] += bf16_to_float(add[k][i]);
            if (into_dy) dy_ref[i] += dx_ref[i];
            const double tx = dm * bf16_to_float(x[i]), ty = dm * bf16_to_float(y[i]);
            sx += tx, sy += ty, mx += tx * tx, my += ty * ty;
        }
    }
    {  // the forward's combine_norm stores the same xm bits
        DeviceArray<uint16_t> dxx(x), dyy(y), out(n), xn(n);
        DeviceArray<float> co(std::vector<float>{ca, cb}), rs(rows);
        out.poison();
        auto bfp = [](uint16_t* p) { return reinterpret_cast<__nv_bfloat16*>(p); };
        CUDA_CHECK(combine_norm(bfp(out.ptr), bfp(dxx.ptr), bfp(dyy.ptr), rows, D, {co.ptr, 1.f, 0.f}, {co.ptr + 1, 1.f, 0.f},
                                bfp(xn.ptr), rs.ptr, 1.1920929e-07f, 0));
        CUDA_CHECK(cudaDeviceSynchronize());
        CHECK(out.download() == xm, "norm + mix backward rows %d: combine_norm's stored mix differs from the remade one", rows);
    }
    std::vector<uint16_t> dy_in = dy;
    if (dy_first)
        for (auto& v : dy_in) v = 0x7fc0;  // poisoned: dy_first must not read it
    DeviceArray<uint16_t> ddxn(dxn), ddx(dx), dxx(x), dyy(y), ddy(dy_in), dadd0(add[0]), dadd1(add[1]);
    DeviceArray<float> drstd(rstd), sc(std::vector<float>{ca, cb, 0.02f, -0.3f}), partial(2 * scal::DOT_BLOCKS);
    auto bf = [](uint16_t* p) { return reinterpret_cast<__nv_bfloat16*>(p); };
    NormMixFolds folds;
    if (nadd > 0) folds.add0 = bf(dadd0.ptr);
    if (nadd > 1) folds.add1 = bf(dadd1.ptr);
    folds.into_dy = into_dy;
    CUDA_CHECK(norm_mix_backward(bf(ddxn.ptr), drstd.ptr, bf(ddx.ptr), bf(dxx.ptr), bf(dyy.ptr), bf(ddy.ptr), dy_first,
                                 rows, {sc.ptr + 0, 1.f, 0.f}, {sc.ptr + 1, 1.f, 0.f}, sc.ptr + 2, sc.ptr + 3, partial.ptr, 0,
                                 nullptr, folds));
    CUDA_CHECK(cudaDeviceSynchronize());
    if (nadd > 0 || into_dy) {  // the same bits as the unfolded pass, then a combine pass per fold
        DeviceArray<uint16_t> ddx2(dx), ddy2(dy_in);
        DeviceArray<float> sc2(std::vector<float>{ca, cb, 0.02f, -0.3f});
        CUDA_CHECK(norm_mix_backward(bf(ddxn.ptr), drstd.ptr, bf(ddx2.ptr), bf(dxx.ptr), bf(dyy.ptr), bf(ddy2.ptr), dy_first,
                                     rows, {sc2.ptr + 0, 1.f, 0.f}, {sc2.ptr + 1, 1.f, 0.f}, sc2.ptr + 2, sc2.ptr + 3,
                                     partial.ptr, 0));
        const scal::Coef one{nullptr, 0.f, 1.f};
        for (int k = 0; k < nadd; ++k)
            CUDA_CHECK(combine(bf(ddx2.ptr), bf(ddx2.ptr), bf(k ? dadd1.ptr : dadd0.ptr), (int64_t)n, one, one, 0));
        if (into_dy) CUDA_CHECK(combine(bf(ddy2.ptr), bf(ddy2.ptr), bf(ddx2.ptr), (int64_t)n, one, one, 0));
        CUDA_CHECK(cudaDeviceSynchronize());
        CHECK(ddy.download() == ddy2.download() && (into_dy || ddx.download() == ddx2.download()),
              "norm + mix backward rows %d, %d adds%s: other bits than the unfolded pass and its combines", rows, nadd,
              into_dy ? ", into dy" : "");
        CHECK(!into_dy || ddx.download() == dx, "norm + mix backward rows %d: into_dy wrote dx", rows);
    }
    auto widen = [](const std::vector<uint16_t>& v) {
        std::vector<double> o(v.size());
        for (size_t i = 0; i < v.size(); ++i) o[i] = bf16_to_float(v[i]);
        return o;
    };
    const std::vector<float> g = sc.download();
    const double e_x = into_dy ? 0 : rel_err_d(widen(ddx.download()), dx_ref), e_y = rel_err_d(widen(ddy.download()), dy_ref);
    const double e_ga = std::fabs(g[2] - (0.02 + sx)) / std::sqrt(mx), e_gb = std::fabs(g[3] - (-0.3 + sy)) / std::sqrt(my);
    printf("  norm + mix backward rows %5d%s%s%s  rel err: dx %.1e dy %.1e; scalar grads %.1e %.1e (of their terms' rms)\n",
           rows, dy_first ? " (dy first)" : "", nadd ? (nadd == 1 ? " (+1 add)" : " (+2 adds)") : "", into_dy ? " (into dy)" : "",
           e_x, e_y, e_ga, e_gb);
    CHECK(e_x < 1e-2 && e_y < 1e-2 && e_ga < 1e-3 && e_gb < 1e-3,
          "norm + mix backward rows %d differs from the fp64 reference (dx %.2e dy %.2e ga %.2e gb %.2e)", rows, e_x, e_y,
          e_ga, e_gb);
}

// the mixing and the norm after it in one pass: the same bits as combine then rms_norm_forward, and
// the fp64 reference's values; the finite check of x as combine's
static void combine_norm_case(int rows, uint64_t seed) {
    std::mt19937_64 rng(seed);
    const int D = 768;
    const int64_t n = (int64_t)rows * D;
    std::vector<uint16_t> x = random_bf16(rng, n, 1.f), y = random_bf16(rng, n, 2.f);
    x[(size_t)(rng() % n)] = 0x7f80;  // +inf: the flag takes the tag, the other rows stay exact
    DeviceArray<float> sc(std::vector<float>{0.9f, -0.35f});
    DeviceArray<uint16_t> dx(x), dy(y), out1(n), out2(n), xn1(n), xn2(n);
    DeviceArray<float> r1(rows), r2(rows);
    DeviceArray<int> f1(std::vector<int>{-1}), f2(std::vector<int>{-1});
    for (auto* a : {&out1, &out2, &xn1, &xn2}) a->poison();
    r1.poison(), r2.poison();
    auto bf = [](uint16_t* p) { return reinterpret_cast<__nv_bfloat16*>(p); };
    scal::Coef ca{sc.ptr, 1.f, 0.f}, cb{sc.ptr + 1, 2.f, 0.125f};
    const float eps = 1.1920929e-07f;
    CUDA_CHECK(combine_norm(bf(out1.ptr), bf(dx.ptr), bf(dy.ptr), rows, D, ca, cb, bf(xn1.ptr), r1.ptr, eps, 0, f1.ptr, 5));
    CUDA_CHECK(combine(bf(out2.ptr), bf(dx.ptr), bf(dy.ptr), n, ca, cb, 0, f2.ptr, 5));
    CUDA_CHECK(rms_norm_forward(bf(out2.ptr), D, bf(xn2.ptr), D, r2.ptr, rows, D, eps, 0));
    CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> o1 = out1.download(), o2 = out2.download(), n1 = xn1.download(), n2 = xn2.download();
    const std::vector<float> s1 = r1.download(), s2 = r2.download();
    int64_t differ = 0, bad_rows = 0;
    for (int64_t i = 0; i < n; ++i) differ += o1[i] != o2[i] || (n1[i] != n2[i] && !(std::isnan(bf16_to_float(n1[i])) && std::isnan(bf16_to_float(n2[i]))));
    std::vector<double> got, ref;
    for (int r = 0; r < rows; ++r) {
        differ += std::memcmp(&s1[r], &s2[r], 4) != 0 && !(std::isnan(s1[r]) && std::isnan(s2[r]));
        double ss = 0;
        std::vector<double> m(D);
        bool finite = true;
        for (int c = 0; c < D; ++c) {
            const double xv = bf16_to_float(x[(size_t)r * D + c]), yv = bf16_to_float(y[(size_t)r * D + c]);
            finite &= std::isfinite(xv);
            m[c] = 0.9 * xv + (2 * -0.35 + 0.125) * yv;
            ss += m[c] * m[c];
        }
        if (!finite) { ++bad_rows; continue; }
        const double rs = 1 / std::sqrt(ss / D + eps);
        for (int c = 0; c < D; ++c) ref.push_back(m[c] * rs), got.push_back(bf16_to_float(n1[(size_t)r * D + c]));
    }
    const double e = rel_err_d(got, ref);
    const int flag = f1.download()[0];
    printf("  mixing + norm rows %5d  rel err %.1e; values differing from combine + rms_norm_forward: %lld; flag %d\n", rows,
           e, (long long)differ, flag);
    CHECK(differ == 0 && e < 1e-2 && flag == 5 && f2.download()[0] == 5 && bad_rows == 1,
          "mixing + norm rows %d: %lld values differ from the two passes', rel err %.2e, flag %d (want 5)", rows,
          (long long)differ, e, flag);
}

// residual mixing, backout and the sa-lambda weight scaling, with their scalar gradients
static void scalar_ops_case(int64_t n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<uint16_t> x = random_bf16(rng, n, 1.f), y = random_bf16(rng, n, 1.f), dout = random_bf16(rng, n, 1.f);
    std::vector<uint16_t> dx0 = random_bf16(rng, n, 0.1f), dy0 = random_bf16(rng, n, 0.1f);
    std::vector<float> scalars = {1.1f, 0.25f, 0.5f, 0.02f, -0.3f, 0.7f};  // resid, x0, backout; grads 0.02, -0.3, 0.7
    DeviceArray<float> sc(scalars), partial(2 * scal::DOT_BLOCKS);
    DeviceArray<uint16_t> dx(x), dy(y), ddout(dout), out(n), gdx(dx0), gdy(dy0);
    out.poison();
    auto bf = [](uint16_t* p) { return reinterpret_cast<__nv_bfloat16*>(p); };
    // mixing: out = 1.1 x + 0.25 y; backward with dx accumulated
    scal::Coef ca{sc.ptr + 0, 1.f, 0.f}, cb{sc.ptr + 1, 1.f, 0.f};
    CUDA_CHECK(combine(bf(out.ptr), bf(dx.ptr), bf(dy.ptr), n, ca, cb, 0));
    CUDA_CHECK(combine_backward(bf(ddout.ptr), bf(dx.ptr), bf(dy.ptr), bf(gdx.ptr), true, bf(gdy.ptr), true, n, ca, cb,
                                sc.ptr + 3, sc.ptr + 4, partial.ptr, 0));
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<double> o_ref(n), dx_ref(n), dy_ref(n), o, gx, gy;
    double sx = 0, sy = 0;
    for (int64_t i = 0; i < n; ++i) {
        double xv = bf16_to_float(x[i]), yv = bf16_to_float(y[i]), g = bf16_to_float(dout[i]);
        o_ref[i] = 1.1 * xv + 0.25 * yv;
        dx_ref[i] = bf16_to_float(dx0[i]) + 1.1 * g, dy_ref[i] = bf16_to_float(dy0[i]) + 0.25 * g;
        sx += g * xv, sy += g * yv;
    }
    for (uint16_t v : out.download()) o.push_back(bf16_to_float(v));
    for (uint16_t v : gdx.download()) gx.push_back(bf16_to_float(v));
    for (uint16_t v : gdy.download()) gy.push_back(bf16_to_float(v));
    std::vector<float> s = sc.download();
    double e_o = rel_err_d(o, o_ref), e_x = rel_err_d(gx, dx_ref), e_y = rel_err_d(gy, dy_ref);
    double e_la = std::fabs(s[3] - (0.02 + sx)) / std::fabs(0.02 + sx), e_lb = std::fabs(s[4] - (-0.3 + sy)) / std::fabs(-0.3 + sy);
    // backout: out = x - 0.5 y, the lambda's gradient is -sum(dout y); dx and dy written, not added
    // to (as the trainer's backout: poisoned first)
    scal::Coef one{nullptr, 0.f, 1.f}, minus{sc.ptr + 2, -1.f, 0.f};
    CUDA_CHECK(combine(bf(out.ptr), bf(dx.ptr), bf(dy.ptr), n, one, minus, 0));
    gdx.poison(), gdy.poison();
    CUDA_CHECK(combine_backward(bf(ddout.ptr), bf(dx.ptr), bf(dy.ptr), bf(gdx.ptr), false, bf(gdy.ptr), false, n, one, minus,
                                nullptr, sc.ptr + 5, partial.ptr, 0));
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<double> o2, o2_ref(n), bx, by, bx_ref(n), by_ref(n);
    for (int64_t i = 0; i < n; ++i) {
        o2_ref[i] = bf16_to_float(x[i]) - 0.5 * bf16_to_float(y[i]);
        bx_ref[i] = bf16_to_float(dout[i]), by_ref[i] = -0.5 * bf16_to_float(dout[i]);
    }
    for (uint16_t v : out.download()) o2.push_back(bf16_to_float(v));
    for (uint16_t v : gdx.download()) bx.push_back(bf16_to_float(v));
    for (uint16_t v : gdy.download()) by.push_back(bf16_to_float(v));
    double e_o2 = rel_err_d(o2, o2_ref), e_bx = rel_err_d(bx, bx_ref), e_by = rel_err_d(by, by_ref);
    s = sc.download();
    double e_lc = std::fabs(s[5] - (0.7 - sy)) / std::fabs(0.7 - sy);
    // the finite check of x: the flag stays -1 on finite values and takes the tag at an infinity
    std::vector<uint16_t> x_inf = x;
    x_inf[n / 3] = 0x7f80;
    DeviceArray<uint16_t> dx_inf(x_inf);
    DeviceArray<int> flag_ok(std::vector<int>{-1}), flag_inf(std::vector<int>{-1});
    CUDA_CHECK(combine(bf(out.ptr), bf(dx.ptr), bf(dy.ptr), n, one, minus, 0, flag_ok.ptr, 7));
    CUDA_CHECK(combine(bf(out.ptr), bf(dx_inf.ptr), bf(dy.ptr), n, one, minus, 0, flag_inf.ptr, 7));
    CHECK(flag_ok.download()[0] == -1 && flag_inf.download()[0] == 7,
          "combine's finite check: flag %d on finite x (want -1), %d with an infinity (want 7)", flag_ok.download()[0],
          flag_inf.download()[0]);
    // weight scaling: W' = 1.1 W; dW += 1.1 dW', dlambda += sum dW' W
    std::vector<float> dwp(n);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& v : dwp) v = nd(rng);
    DeviceArray<float> ddwp(dwp), glam(std::vector<float>{0.f});
    DeviceArray<uint16_t> wp(n), dw(dx0);
    wp.poison();
    CUDA_CHECK(scale_weight(bf(wp.ptr), bf(dx.ptr), n, sc.ptr, 0));
    CUDA_CHECK(scale_weight_backward(ddwp.ptr, bf(dx.ptr), bf(dw.ptr), n, sc.ptr, glam.ptr, partial.ptr, 0));
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<double> w_got, w_ref(n), dw_got, dw_ref(n);
    double sl = 0;
    for (int64_t i = 0; i < n; ++i) {
        w_ref[i] = 1.1 * bf16_to_float(x[i]);
        dw_ref[i] = bf16_to_float(dx0[i]) + 1.1 * dwp[i];
        sl += (double)dwp[i] * bf16_to_float(x[i]);
    }
    for (uint16_t v : wp.download()) w_got.push_back(bf16_to_float(v));
    for (uint16_t v : dw.download()) dw_got.push_back(bf16_to_float(v));
    double e_w = rel_err_d(w_got, w_ref), e_dw = rel_err_d(dw_got, dw_ref), e_gl = std::fabs(glam.download()[0] - sl) / std::fabs(sl);
    printf("  mixing/backout/scaling n %lld  rel err: out %.1e dx %.1e dy %.1e dlambdas %.1e %.1e %.1e backout %.1e (dx %.1e dy "
           "%.1e) W' %.1e dW %.1e dlambda %.1e\n", (long long)n, e_o, e_x, e_y, e_la, e_lb, e_lc, e_o2, e_bx, e_by, e_w, e_dw, e_gl);
    CHECK(e_o < 1e-2 && e_x < 1e-2 && e_y < 1e-2 && e_la < 1e-4 && e_lb < 1e-4 && e_lc < 1e-4 && e_o2 < 1e-2 && e_bx < 1e-2 &&
              e_by < 1e-2 && e_w < 1e-2 && e_dw < 1e-2 && e_gl < 1e-4,
          "scalar-weighted ops differ from the fp64 reference");
    // the same three backward passes with their sums deferred (DeferredSums: one launch adds them all
    // at the end, as the model's backward does): the same bits; a fourth sum finds no slot
    DeviceArray<float> sc2(scalars), glam2(std::vector<float>{0.f});
    DeviceArray<uint16_t> gdx2(dx0), gdy2(dy0), dw2(dx0);
    DeferredSums deferred;
    CUDA_CHECK(deferred.allocate(3, 0));
    const scal::Coef ca2{sc2.ptr + 0, 1.f, 0.f}, cb2{sc2.ptr + 1, 1.f, 0.f}, minus2{sc2.ptr + 2, -1.f, 0.f};
    CUDA_CHECK(combine_backward(bf(ddout.ptr), bf(dx.ptr), bf(dy.ptr), bf(gdx2.ptr), true, bf(gdy2.ptr), true, n, ca2, cb2,
                                sc2.ptr + 3, sc2.ptr + 4, nullptr, 0, &deferred));
    CUDA_CHECK(combine_backward(bf(ddout.ptr), bf(dx.ptr), bf(dy.ptr), bf(gdx2.ptr), false, bf(gdy2.ptr), false, n, one,
                                minus2, nullptr, sc2.ptr + 5, nullptr, 0, &deferred));
    CUDA_CHECK(scale_weight_backward(ddwp.ptr, bf(dx.ptr), bf(dw2.ptr), n, sc2.ptr, glam2.ptr, nullptr, 0, &deferred));
    const cudaError_t full = scale_weight_backward(ddwp.ptr, bf(dx.ptr), bf(dw2.ptr), n, sc2.ptr, glam2.ptr, nullptr, 0, &deferred);
    const std::vector<float> before = sc2.download();  // nothing added before finish()
    CUDA_CHECK(deferred.finish(0));
    CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> after = sc2.download();
    const float gl = glam.download()[0], gl2 = glam2.download()[0];
    const bool same = after[3] == s[3] && after[4] == s[4] && after[5] == s[5] && gl2 == gl;
    printf("  mixing/backout/scaling sums deferred: %s\n", same ? "the same bits" : "DIFFERENT");
    CHECK(same && full == cudaErrorInvalidValue && before[3] == scalars[3] && before[5] == scalars[5],
          "deferred sums: %.9g %.9g %.9g %.9g, immediate %.9g %.9g %.9g %.9g; a sum past the slots: %s", after[3], after[4],
          after[5], gl2, s[3], s[4], s[5], gl, cudaGetErrorString(full));
}

// Runs a tests/ oracle script on a folder; returns its exit status, with what it printed in out.
static int run_oracle(const char* script, const std::string& dir, std::string& out) {
    return run_capture("python3 '" + std::string(TRAIN_GPT_SRC_DIR) + "/tests/" + script + "' '" + dir + "' 2>&1", out);
}
// An oracle's "<key> <label> <ours> <record>" line: the relative errors of the trainer (ours) and of
// the record's bf16 PyTorch arithmetic (record) against an fp32 reference of the same math.
struct OracleLine {
    std::string label;
    double ours, record;
    bool slice() const { return label.find('[') != std::string::npos; }  // a bank's slice ("attn[3]")
};
static std::vector<OracleLine> oracle_lines(const std::string& out, const std::string& key) {
    std::vector<OracleLine> lines;
    for (size_t at = out.find(key + " "); at != std::string::npos; at = out.find(key + " ", at + 1)) {
        if (at > 0 && out[at - 1] != '\n') continue;
        char label[64];
        double ours = NAN, record = NAN;
        if (sscanf(out.c_str() + at + key.size(), " %63s %lf %lf", label, &ours, &record) == 3)
            lines.push_back({label, ours, record});
    }
    return lines;
}
// The trainer passes where its error against the fp32 reference is at most NOISE_FACTOR times the
// record's own error plus NOISE_MARGIN. A fixed threshold cannot tell rounding from a bug (the fp8
// head's e5m2 gradient and bf16 Polar Express make a few % of noise); the record's error is the
// noise floor of this arithmetic. The factor allows rounding as coarse as the record's that falls
// elsewhere (other kernels, accumulation orders); the margin covers errors the record does not
// have (Adam parameters: its two runs compute them identically). A wrong block shows as O(1).
constexpr double NOISE_FACTOR = 1.5, NOISE_MARGIN = 2e-3;
static bool within_noise(const OracleLine& l, double floor = 0) {
    return l.ours <= NOISE_FACTOR * std::max(l.record, floor) + NOISE_MARGIN;
}
// prints the lines as a table, three to a row, and checks each. One draw of the record's error
// understates the noise of a gradient that is a sum with heavy cancellation (x0_lambdas' record
// error was 3.4e-2 in one run and 6.7e-3 in the next, from e5m2 roundings that fall elsewhere), so
// each tensor's floor is at least the median of the record's errors over the whole parameters.
// A tensor of a few such sums (the 12 x0_lambdas, the gates' 12 weights) is one draw from a wide
// distribution: x0_lambdas' record error was 6.7e-3, 1.4e-2, 2.9e-2 and 3.4e-2 in four runs,
// ours 3.2e-2 to 5.8e-2. Those (numel(label) < 100 where numel is given) take the largest record
// error over the whole parameters as their floor; a missing or wrong term still shows as O(1).
static void check_oracle_lines(const char* what, const std::vector<OracleLine>& lines,
                               const std::function<int64_t(const std::string&)>& numel = nullptr) {
    std::vector<double> whole;
    for (const OracleLine& l : lines)
        if (!l.slice()) whole.push_back(l.record);
    std::sort(whole.begin(), whole.end());
    const double median = whole.empty() ? 0 : whole[whole.size() / 2], largest = whole.empty() ? 0 : whole.back();
    auto floor = [&](const OracleLine& l) { return numel && !l.slice() && numel(l.label) < 100 ? largest : median; };
    printf("    %s, relative error vs the fp32 reference: ours / record (bf16 PyTorch); floor %.1e (tensors of < 100 "
           "values: %.1e)\n", what, median, largest);
    for (size_t i = 0; i < lines.size(); ++i)
        printf("%s%-17s %.1e / %.1e %-4s%s", i % 3 == 0 ? "      " : "  ", lines[i].label.c_str(), lines[i].ours,
               lines[i].record, within_noise(lines[i], floor(lines[i])) ? "ok" : "FAIL",
               i % 3 == 2 || i + 1 == lines.size() ? "\n" : "");
    for (const OracleLine& l : lines)
        CHECK(within_noise(l, floor(l)), "%s %s: %.2e from the fp32 reference, above %.1f x max(the record's %.2e, %.2e) + %.0e",
              what, l.label.c_str(), l.ours, NOISE_FACTOR, l.record, floor(l), NOISE_MARGIN);
}
// the number of whole-parameter lines and of bank-slice lines
static std::pair<size_t, size_t> count_lines(const std::vector<OracleLine>& lines) {
    size_t slices = 0;
    for (const OracleLine& l : lines) slices += l.slice();
    return {lines.size() - slices, slices};
}

// The model's forward pass against tests/model_oracle.py (plain PyTorch) on random weights and a
// batch of documents: the training loss (fp8 head, MTP) and the evaluation loss.
static void test_model_forward(const std::string& dir) {
    if (system("python3 -c 'import torch, numpy' >/dev/null 2>&1") != 0) {
        printf("  SKIP model forward: python3 with torch and numpy is needed for the oracle\n");
        return;
    }
    Hyperparameters args;
    const int T = 4000;
    std::mt19937_64 rng(60);
    std::normal_distribution<float> nd(0.f, 1.f);
    ParamStore params(1, 0);
    FILE* meta = fopen((dir + "/params.txt").c_str(), "w");
    for (Param& p : params.all()) {
        const int64_t n = p.shape.numel();
        // every path live: nonzero O and c_proj, value embeddings, gates, lambdas
        // weights large enough that every block moves the residual stream: a wrong block would
        // show in the final hidden state as an O(1) error, bf16 rounding as ~1e-2
        float sd = 0.06f;
        const std::string& l = p.shape.label;
        if (l == "lm_head") sd = 0.02f;
        if (l == "embed") sd = 1.f;
        if (l == "ve0" || l == "ve1" || l == "ve2") sd = 0.3f;
        if (l == "smear_gate" || l == "skip_gate" || l == "attn_gate_bank" || l == "ve_gate_bank") sd = 0.3f;
        std::vector<uint16_t> hb;
        std::vector<float> hf;
        if (p.shape.fp32) {
            hf.resize(n);
            CUDA_CHECK(cudaMemcpy(hf.data(), p.data, n * 4, cudaMemcpyDeviceToHost));
            for (auto& v : hf) v += 0.1f * nd(rng);  // around the record's initial scalars
            CUDA_CHECK(cudaMemcpy(p.data, hf.data(), n * 4, cudaMemcpyHostToDevice));
        } else {
            hb.resize(n);
            for (auto& v : hb) v = float_to_bf16(sd * nd(rng));
            CUDA_CHECK(cudaMemcpy(p.data, hb.data(), n * 2, cudaMemcpyHostToDevice));
        }
        fprintf(meta, "%s %s", l.c_str(), p.shape.fp32 ? "fp32" : "bf16");
        for (int64_t d : p.shape.shape) fprintf(meta, " %lld", (long long)d);
        fprintf(meta, "\n");
        FILE* f = fopen((dir + "/" + l + ".bin").c_str(), "wb");
        fwrite(p.shape.fp32 ? (const void*)hf.data() : (const void*)hb.data(), p.shape.fp32 ? 4 : 2, n, f);
        fclose(f);
    }
    fclose(meta);
    // documents of FineWeb-like lengths, each starting with BOS; cu_seqlens padded as the loader pads them
    std::lognormal_distribution<double> len(std::log(300.0), 0.9);
    const DocumentBatch batch = document_batch(rng, len, T, 128);
    const std::vector<int>&tokens = batch.tokens, &cu = batch.cu;
    ForwardArgs fa;
    fa.mtp_weights = {1.f, 0.5f, 0.25f};
    fa.ws_short = 3, fa.ws_long = 7;
    fa.yarn = yarn_reset(args);
    yarn_apply(args, fa.yarn, 3, 7);  // past a window change: YaRN-updated frequencies and scale
    fa.loss_scale = 0.125f;
    Gemms gemms;
    Model model(params, gemms, args, T, T, (int)cu.size());
    DeviceArray<int> dt(tokens), dcu(cu);
    cudaStream_t s;
    CUDA_CHECK(cudaStreamCreate(&s));
    fa.training = true;
    const float train2 = model.forward(dt.ptr, dcu.ptr, (int)cu.size(), T, fa, s);
    for (Param& p : params.all()) CUDA_CHECK(cudaMemset(p.grad, 0, p.bytes()));  // the forward adds lm_head's
    const float train = model.forward(dt.ptr, dcu.ptr, (int)cu.size(), T, fa, s);
    model.backward(s);
    CUDA_CHECK(cudaStreamSynchronize(s));
    for (Param& p : params.all()) {
        std::vector<char> h(p.bytes());
        CUDA_CHECK(cudaMemcpy(h.data(), p.grad, p.bytes(), cudaMemcpyDeviceToHost));
        FILE* f = fopen((dir + "/grad_" + p.shape.label + ".bin").c_str(), "wb");
        fwrite(h.data(), 1, h.size(), f);
        fclose(f);
    }
    {  // the weight gradients on a second stream (set_overlap) give the one-stream backward's bits,
       // here with the logits in chunks of 1008 rows (--logit_chunk_rows: the head's weight gradient
       // of one chunk runs beside the next chunk's loss), each way twice (the second after the first's
       // side-stream work)
        Hyperparameters chunked = args;
        chunked.logit_chunk_rows = 1008;
        Model m2(params, gemms, chunked, T, 0, (int)cu.size());
        std::vector<std::vector<char>> one_stream;
        int differ = 0;
        for (int overlap = 0; overlap < 2; ++overlap) {
            m2.set_overlap(overlap == 1);
            for (int call = 0; call < 2; ++call) {
                for (Param& p : params.all()) CUDA_CHECK(cudaMemsetAsync(p.grad, 0, p.bytes(), s));
                m2.forward(dt.ptr, dcu.ptr, (int)cu.size(), T, fa, s);
                m2.backward(s);
            }
            CUDA_CHECK(cudaStreamSynchronize(s));
            size_t k = 0;
            for (Param& p : params.all()) {
                std::vector<char> h(p.bytes());
                CUDA_CHECK(cudaMemcpy(h.data(), p.grad, p.bytes(), cudaMemcpyDeviceToHost));
                if (overlap == 0) one_stream.push_back(std::move(h));
                else differ += h != one_stream[k++];
            }
        }
        printf("  backward with the weight gradients on a second stream, logits in chunks of 1008 rows: %s\n",
               differ ? "DIFFERENT" : "the one-stream bits");
        CHECK(differ == 0, "second stream: %d parameters' gradients differ from the one-stream backward's", differ);
    }
    fa.training = false;
    const float eval = model.forward(dt.ptr, dcu.ptr, (int)cu.size(), T, fa, s);
    CUDA_CHECK(cudaStreamDestroy(s));
    {
        std::vector<uint16_t> hidden((size_t)T * MODEL_DIM);
        CUDA_CHECK(cudaMemcpy(hidden.data(), model.final_hidden(), hidden.size() * 2, cudaMemcpyDeviceToHost));
        FILE* f = fopen((dir + "/hidden.bin").c_str(), "wb");
        fwrite(hidden.data(), 2, hidden.size(), f);
        fclose(f);
    }
    {
        FILE* f = fopen((dir + "/tokens.bin").c_str(), "wb");
        fwrite(tokens.data(), 4, tokens.size(), f);
        fclose(f);
        f = fopen((dir + "/cu.bin").c_str(), "wb");
        fwrite(cu.data(), 4, cu.size(), f);
        fclose(f);
        f = fopen((dir + "/args.txt").c_str(), "w");
        fprintf(f, "T %d\nblock_size %lld\nws_short 3\nws_long 7\nattn_scale %.9g\nloss_scale 0.125\nmtp 1 0.5 0.25\n", T,
                (long long)args.block_size, fa.yarn.attn_scale);
        fprintf(f, "softcap %.9g %.9g %.9g\nfp8_scales %.9g %.9g %.9g\nfreq", args.softcap_a, args.softcap_b, args.softcap_c,
                (float)args.lm_head_x_s, (float)args.lm_head_w_s, (float)args.lm_head_grad_s);
        for (float v : fa.yarn.angular_freq) fprintf(f, " %.9g", v);
        fprintf(f, "\n");
        // the layer table, which the oracle builds its model from: per layer attn (0 none, 1
        // attention, 2 paired-head attention), long (the long window and its key offset), ve (the
        // value embedding's index or -1); the skip's source and target layers; the backout layer
        std::string attn = "attn", longw = "long", ve = "ve";
        for (const LayerSpec& l : LAYERS) {
            attn += l.attn == AttnKind::None ? " 0" : l.attn == AttnKind::Normal ? " 1" : " 2";
            longw += l.long_window ? " 1" : " 0";
            ve += " " + std::to_string(l.ve);
        }
        fprintf(f, "layers %d\n%s\n%s\n%s\nskip %d %d\nbackout %d\n", NUM_LAYERS, attn.c_str(), longw.c_str(), ve.c_str(),
                SKIP_IN, SKIP_OUT, BACKOUT_LAYER);
        fclose(f);
    }
    std::string out;
    const int rc = run_oracle("model_oracle.py", dir, out);
    double o_train = NAN, o_eval = NAN;
    size_t a = out.find("train_loss "), b = out.find("eval_loss ");
    if (a != std::string::npos) o_train = atof(out.c_str() + a + 11);
    if (b != std::string::npos) o_eval = atof(out.c_str() + b + 10);
    double moved = NAN;
    size_t m = out.find("hidden_vs_embedding ");
    if (m != std::string::npos) moved = atof(out.c_str() + m + 20);
    const auto hidden = oracle_lines(out, "hidden");
    const OracleLine h = hidden.size() == 1 ? hidden[0] : OracleLine{"final", NAN, NAN};
    const double e_t = std::fabs(train - o_train) / std::fabs(o_train), e_e = std::fabs(eval - o_eval) / std::fabs(o_eval);
    printf("  model forward T %d: train loss %.6f (oracle %.6f, rel %.1e), eval loss %.6f (oracle %.6f, rel %.1e), final "
           "hidden state rel err vs fp32 %.1e (record %.1e; %.2f from the embeddings alone)%s\n", T, train, o_train, e_t, eval,
           o_eval, e_e, h.ours, h.record, moved, train == train2 ? ", bit-identical twice" : ", NOT DETERMINISTIC");
    CHECK(rc == 0 && e_t < 5e-3 && e_e < 5e-3 && train == train2, "model forward differs from the PyTorch oracle: %s",
          out.c_str());
    // the losses sit near log(vocab) for random weights: the hidden state is the sensitive check
    CHECK(hidden.size() == 1 && within_noise(h), "final hidden state: %.2e from the fp32 reference (record %.2e): %s", h.ours,
          h.record, out.c_str());
    // every parameter's gradient from one training micro-step, and each bank slice's: attn[a] and
    // attn_gate_bank[a] for each attention layer's slot a, mlp[i].{fc,proj} for each layer i (the
    // padding slots are left out), ve_gate_bank[g] for each value-embedding layer's slot g
    const auto grads = oracle_lines(out, "grad");
    check_oracle_lines("grad", grads, [&](const std::string& label) { return params[label].shape.numel(); });
    const auto [whole, slices] = count_lines(grads);
    const size_t n_params = params.all().size(), n_slices = 2 * NUM_ATTN_LAYERS + 2 * NUM_LAYERS + NUM_VE_LAYERS;
    CHECK(whole == n_params && slices == n_slices, "the oracle compared %zu of %zu gradients and %zu of %zu slices: %s",
          whole, n_params, slices, n_slices, out.c_str());
    // a NaN in a middle layer's MLP stops the forward pass with the layer's name
    {
        const int bad = NUM_LAYERS / 2;
        Param& mlp = params["mlp"];
        const uint16_t nan = 0x7fc0;
        CUDA_CHECK(cudaMemcpy((uint16_t*)mlp.data + (int64_t)bad * 8 * 768 * 768 + 4 * 768 * 768 + 123, &nan, 2,
                              cudaMemcpyHostToDevice));
        cudaStream_t s2;
        CUDA_CHECK(cudaStreamCreate(&s2));
        fa.training = true;
        const std::string name = strprintf("layer %d", bad);
        expect_error(("NaN in " + name).c_str(), [&] { model.forward(dt.ptr, dcu.ptr, (int)cu.size(), T, fa, s2); }, {name});
        CUDA_CHECK(cudaStreamDestroy(s2));
    }
}

// Four optimizer steps (Adam and NorMuon, NorMuon alone, the untie, a step after it) on the real
// parameters against tests/optimizer_oracle.py (plain PyTorch); compares the weight changes.
static void test_optimizer_step(const std::string& dir) {
    if (system("python3 -c 'import torch, numpy' >/dev/null 2>&1") != 0) {
        printf("  SKIP optimizer step: python3 with torch and numpy is needed for the oracle\n");
        return;
    }
    Hyperparameters args;
    ParamStore params(1, 5);
    Gemms gemms;
    NorMuonAndAdam opt(params, gemms, args, 1, 0);
    auto dump = [&](const std::string& prefix, bool grads) {
        for (Param& p : params.all()) {
            std::vector<char> h(p.bytes());
            CUDA_CHECK(cudaMemcpy(h.data(), grads ? p.grad : p.data, p.bytes(), cudaMemcpyDeviceToHost));
            FILE* f = fopen((dir + "/" + prefix + p.shape.label + ".bin").c_str(), "wb");
            fwrite(h.data(), 1, h.size(), f);
            fclose(f);
        }
    };
    FILE* meta = fopen((dir + "/params.txt").c_str(), "w");
    for (Param& p : params.all()) {
        fprintf(meta, "%s %s", p.shape.label.c_str(), p.shape.fp32 ? "fp32" : "bf16");
        for (int64_t d : p.shape.shape) fprintf(meta, " %lld", (long long)d);
        fprintf(meta, "\n");
    }
    fclose(meta);
    dump("init_", false);
    struct Step { int step; double lr, momentum; bool untie; };
    const Step steps[] = {{1, 1.0, 0.9, false}, {2, 0.8, 0.92, false}, {3, 0.6, 0.95, true}, {5, 0.5, 0.95, false}};
    FILE* sf = fopen((dir + "/steps.txt").c_str(), "w");
    std::mt19937_64 rng(70);
    std::normal_distribution<float> nd(0.f, 0.01f);
    for (size_t k = 0; k < std::size(steps); ++k) {
        fprintf(sf, "%d %.17g %.17g %d\n", steps[k].step, steps[k].lr, steps[k].momentum, (int)steps[k].untie);
        for (Param& p : params.all()) {  // this step's gradient, added to what the optimizer kept
            const int64_t n = p.shape.numel();
            std::vector<uint16_t> inc16, cur16;
            std::vector<float> inc32, cur32;
            if (p.shape.fp32) {
                inc32.resize(n), cur32.resize(n);
                for (auto& v : inc32) v = nd(rng);
                CUDA_CHECK(cudaMemcpy(cur32.data(), p.grad, n * 4, cudaMemcpyDeviceToHost));
                for (int64_t i = 0; i < n; ++i) cur32[i] += inc32[i];
                CUDA_CHECK(cudaMemcpy(p.grad, cur32.data(), n * 4, cudaMemcpyHostToDevice));
            } else {
                inc16.resize(n), cur16.resize(n);
                for (auto& v : inc16) v = float_to_bf16(nd(rng));
                CUDA_CHECK(cudaMemcpy(cur16.data(), p.grad, n * 2, cudaMemcpyDeviceToHost));
                for (int64_t i = 0; i < n; ++i) cur16[i] = float_to_bf16(bf16_to_float(cur16[i]) + bf16_to_float(inc16[i]));
                CUDA_CHECK(cudaMemcpy(p.grad, cur16.data(), n * 2, cudaMemcpyHostToDevice));
            }
            FILE* f = fopen((dir + "/grad" + std::to_string(k) + "_" + p.shape.label + ".bin").c_str(), "wb");
            if (p.shape.fp32) fwrite(inc32.data(), 4, n, f);
            else fwrite(inc16.data(), 2, n, f);
            fclose(f);
        }
        opt.step(steps[k].lr, steps[k].momentum, steps[k].step % 2 == 1, 0);
        if (steps[k].untie) opt.copy_lm_state_to_embed(0);
        CUDA_CHECK(cudaDeviceSynchronize());
    }
    fclose(sf);
    dump("final_", false);
    // the state: Adam's moments, NorMuon's momentum and second moment as they are, and its fp32
    // weights (the bf16 weights' bits above the 16 kept in mant) as "shadow"
    FILE* stf = fopen((dir + "/state.txt").c_str(), "w");
    for (const auto& sv : opt.state_views()) {
        std::vector<float> h(sv.n);
        if (sv.kind == "mant") {
            std::vector<uint16_t> hi(sv.n), lo(sv.n);
            CUDA_CHECK(cudaMemcpy(hi.data(), params[sv.label].data, sv.n * 2, cudaMemcpyDeviceToHost));
            CUDA_CHECK(cudaMemcpy(lo.data(), sv.data, sv.n * 2, cudaMemcpyDeviceToHost));
            for (int64_t i = 0; i < sv.n; ++i) {
                const uint32_t bits = (uint32_t)hi[i] << 16 | lo[i];
                memcpy(&h[i], &bits, 4);
            }
        } else {
            CUDA_CHECK(cudaMemcpy(h.data(), sv.data, sv.n * 4, cudaMemcpyDeviceToHost));
        }
        const std::string kind = sv.kind == "mant" ? "shadow" : sv.kind;
        FILE* f = fopen((dir + "/state_" + sv.label + "_" + kind + ".bin").c_str(), "wb");
        fwrite(h.data(), 4, h.size(), f);
        fclose(f);
        fprintf(stf, "%s %s\n", sv.label.c_str(), kind.c_str());
    }
    fclose(stf);
    std::string out;
    const int rc = run_oracle("optimizer_oracle.py", dir, out);
    // the weight changes of every parameter and of each bank slot's matrices: attn[a], mlp[i].{fc,proj}
    // (the padding slots too: here they have gradients)
    const auto changes = oracle_lines(out, "param");
    printf("  optimizer 4 steps: weight changes\n");
    check_oracle_lines("param", changes);
    const auto [whole, slices] = count_lines(changes);
    const size_t n_params = params.all().size(), n_slices = params["attn"].shape.shape[0] + 2 * params["mlp"].shape.shape[0];
    CHECK(rc == 0 && whole == n_params && slices == n_slices,
          "the optimizer oracle compared %zu of %zu parameters and %zu of %zu slices: %s", whole, n_params, slices, n_slices,
          out.c_str());
    // and the state each step leaves: Adam parameters x (m, v), NorMuon banks x (buf, sm, shadow)
    size_t n_state = 0;
    for (const ParamTableEntry& e : param_table) n_state += e.optim == Optim::Adam ? 2 : 3;
    const auto state = oracle_lines(out, "state");
    check_oracle_lines("state", state);
    CHECK(state.size() == n_state, "the optimizer oracle compared %zu of %zu state tensors: %s", state.size(), n_state,
          out.c_str());
}

// add_to_bf16 (the lm_head's fp32 chunk gradient into its bf16 gradient): each value one fp32 add and
// one rounding, on the vector path (n a multiple of 8, aligned) and the scalar one (else); the
// values around the range (random, as sentinels) untouched
static void add_to_bf16_case(int64_t n, int off, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    const int64_t total = n + off + 24;
    std::vector<uint16_t> g = random_bf16(rng, total, 0.1f);
    std::vector<float> a(total);
    for (auto& x : a) x = nd(rng) * 0.01f;
    DeviceArray<uint16_t> dg(g);
    DeviceArray<float> da(a);
    CUDA_CHECK(add_to_bf16(reinterpret_cast<__nv_bfloat16*>(dg.ptr) + off, da.ptr + off, n, 0));
    CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> got = dg.download();
    int64_t bad = 0;
    for (int64_t i = 0; i < total; ++i) {
        const bool in = i >= off && i < off + n;
        bad += got[i] != (in ? float_to_bf16(bf16_to_float(g[i]) + a[i]) : g[i]);
    }
    printf("  add_to_bf16 n %lld at offset %d: %lld of %lld values differ\n", (long long)n, off, (long long)bad,
           (long long)total);
    CHECK(bad == 0, "add_to_bf16 n %lld offset %d: %lld values differ", (long long)n, off, (long long)bad);
}

static void test_optimizer_kernels() {
    polar_express_case(3, 128, 256, 30);
    polar_express_case(2, 384, 128, 31);
    polar_express_case(1, 256, 256, 32);
    normuon_step_case(3, 384, 128, 33);
    normuon_step_case(2, 256, 256, 34);
    adam_case<__nv_bfloat16>("bf16", 50304 + 17, 35);
    adam_case<float>("fp32", 37, 36);
    add_to_bf16_case(50304 * 64, 0, 37);  // vector path
    add_to_bf16_case(8 * 1001, 8, 38);     // vector path, from an offset
    add_to_bf16_case(8 * 1001, 1, 39);     // misaligned: scalar path
    add_to_bf16_case(1001, 0, 40);         // not a multiple of 8: scalar path
}

static void test_model_kernels() {
    embedding_case(1001, 700, 37);
    embedding_case(49152, 50304, 38);
    for (GateKind k : {GateKind::ValueEmbedding, GateKind::Output, GateKind::Smear, GateKind::Skip}) gate_case(k, 333, 40 + (int)k);
    gate_case(GateKind::ValueEmbedding, 205, 46, true, true);
    gate_case(GateKind::Skip, 205, 48, true, false);
    gate_case(GateKind::Output, 205, 47, false, true);
    scalar_ops_case(768 * 1001, 50);
    scalar_ops_case(2304 * 768, 51);
    combine_norm_case(1001, 54);
    combine_norm_case(3, 55);
    norm_mix_case(1001, false, 52);
    norm_mix_case(3, false, 53);
    norm_mix_case(517, true, 54);
    norm_mix_case(333, false, 55, 1);
    norm_mix_case(77, false, 56, 2);
    norm_mix_case(1029, false, 57, 0, true);
    norm_mix_case(5, true, 58, 2, true);
    // the MLP's fused GEMMs (128 x 256 tiles)
    linear_relu_square_case(300, 384, 192, 21);  // rows off the 128-row tile, a half-wide last column tile
    linear_relu_square_case(16, 200, 64, 19);  // fewer rows than a consumer's 64, n a multiple of 8 only
    linear_relu_square_case(256, 3072, 768, 22);  // the model's widths
    linear_relu_square_case(4000, 3072, 768, 20, 37);  // a micro-batch off the 128-row tile, every 37th row
    // more tiles than SMs (the stages and the staging reused across a CTA's tiles), every 7th row
    linear_relu_square_case(12837, 1024, 64, 23, 7);  // ~3 tiles a CTA, one k-tile each
    linear_relu_square_case(8237, 768, 320, 24, 7);  // ~1.5 tiles a CTA, 5 k-tiles over the 3 stages
    fp8_cast_case(48, 80, false, false, 100.f / 448, 21);
    fp8_cast_case(96, 160, false, true, 1.6f / 448, 22);
    fp8_cast_case(80, 4112, true, true, 0.75f / 448, 23);
    fp8_cast_case(16, 768, true, false, 0.75f / 448, 24);
    qkrope_case(77, false, false, 25);
    qkrope_case(64, false, true, 26);
    qkrope_case(33, true, false, 27);
    ce_case("train, 3 MTP weights", 48, 1000, {1.f, 0.5f, 0.125f}, true, 1);  // tiles cut in rows and columns
    ce_case("train, 2 MTP weights", 80, 50304, {1.f, 0.25f}, true, 2);
    ce_case("train, 1 weight", 16, 4104, {1.f}, true, 3);
    ce_case("evaluation", 33, 50304, {1.f}, false, 4);
    rmsnorm_case(37, 768, 5);
    rmsnorm_case(1001, 768, 6);
    rmsnorm_case(5, 256, 7);
    Gemms gemms;
    gemm_bf16_case(gemms, Op::N, Op::T, 37, 130, 72, false, 0.f, 8);
    gemm_bf16_case(gemms, Op::N, Op::N, 64, 200, 96, false, 0.f, 9);
    gemm_bf16_case(gemms, Op::T, Op::N, 96, 72, 129, true, 1.f, 10);
    gemm_bf16_case(gemms, Op::N, Op::T, 256, 768, 768, true, 0.f, 11);
    gemm_fp8_case(gemms, 48, 80, 96, false, false, false, true, 12);  // forward: e4m3 x e4m3, fast accumulation
    gemm_fp8_case(gemms, 64, 96, 128, true, false, false, false, 13);  // grad_x: e5m2 x e4m3
    gemm_fp8_case(gemms, 32, 144, 64, false, true, true, false, 14);  // grad_w: e4m3 x e5m2 -> fp32
    size_t before = gemms.cached_plans();
    gemm_bf16_case(gemms, Op::N, Op::T, 37, 130, 72, false, 0.f, 15);
    CHECK(gemms.cached_plans() == before, "a repeated GEMM shape chose its algorithm again");
}

int main(int argc, char** argv) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        printf("SKIP: no CUDA GPU here (%s); the GPU tests need one\n", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        printf("0 passed, 0 failed\n");
        return 0;
    }
    CUDA_CHECK(cudaSetDevice(0));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("GPU: %s (compute capability %d.%d)\n", prop.name, prop.major, prop.minor);
    char tmpl[] = "/tmp/train_gpt_gpu_XXXXXX";
    if (!mkdtemp(tmpl)) fatal("cannot make a temporary folder");
    // --only NAME: one group (upload, attention, kernels, optimizer, model, step)
    const std::string only = argc > 2 && std::string(argv[1]) == "--only" ? argv[2] : "";
    auto want = [&](const char* name) { return only.empty() || only == name; };
    try {
        if (want("upload")) test_upload(tmpl);
        if (want("attention")) test_attention();
        if (want("kernels")) test_model_kernels();
        if (want("optimizer")) test_optimizer_kernels();
        if (want("model")) test_model_forward(tmpl);
        if (want("step")) test_optimizer_step(tmpl);
    } catch (const std::exception& ex) {
        ++g_failed;
        printf("FAIL: uncaught error: %s\n", ex.what());
    }
    if (system((std::string("rm -rf '") + tmpl + "'").c_str()) != 0) printf("note: could not remove %s\n", tmpl);
    printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed == 0 ? 0 : 1;
}
