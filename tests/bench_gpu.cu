// GPU benchmarks at the record's shapes (not a test: prints numbers).
//   ./tests/bench_gpu                     NorMuon's pieces, the model, the fused GEMMs alone, Adam, the
//                                         optimizer step
//   mpirun -np 2 ./tests/bench_gpu        the optimizer step at world size 2 (NCCL) against world size 1
//   ./tests/bench_gpu --profile-once T    one forward + backward of T tokens between cudaProfilerStart/Stop
//                                         (for ncu --profile-from-start off)
//   ./tests/bench_gpu --dram-mix          DRAM's streaming rate by read/write mix: the ceiling of a
//                                         memory-bound pass that reads R tensors and writes W

#define TRAIN_GPT_NO_MAIN
#include "../train_gpt.cu"

#include "testing.h"

#include <cuda_profiler_api.h>
#include <random>

// median of `iters` timed runs after 3 warm-ups, in ms
static float time_ms(const std::function<void()>& fn, int iters = 20) {
    cudaEvent_t a, b;
    CUDA_CHECK(cudaEventCreate(&a));
    CUDA_CHECK(cudaEventCreate(&b));
    for (int i = 0; i < 3; ++i) fn();
    std::vector<float> ts;
    for (int i = 0; i < iters; ++i) {
        CUDA_CHECK(cudaEventRecord(a));
        fn();
        CUDA_CHECK(cudaEventRecord(b));
        CUDA_CHECK(cudaEventSynchronize(b));
        float t;
        CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
        ts.push_back(t);
    }
    std::sort(ts.begin(), ts.end());
    CUDA_CHECK(cudaEventDestroy(a));
    CUDA_CHECK(cudaEventDestroy(b));
    return ts[ts.size() / 2];
}

template <typename T>
static T* alloc_fill(int64_t n, float value) {
    T* p;
    CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    std::vector<T> h(std::min<int64_t>(n, 1 << 20), (T)value);
    for (int64_t off = 0; off < n; off += (int64_t)h.size())
        CUDA_CHECK(cudaMemcpy(p + off, h.data(), std::min<int64_t>(h.size(), n - off) * sizeof(T), cudaMemcpyHostToDevice));
    return p;
}

// a micro-batch of FineWeb-like documents on the device
struct DeviceBatch {
    int *tokens = nullptr, *cu = nullptr;
    int cu_len = 0;
    DeviceBatch(int T, std::mt19937_64& rng) {
        std::lognormal_distribution<double> len(std::log(450.0), 0.9);
        cu_len = (int)max_num_docs_of(T);
        const DocumentBatch b = document_batch(rng, len, T, cu_len);
        CUDA_CHECK(cudaMalloc(&tokens, b.tokens.size() * 4));
        CUDA_CHECK(cudaMalloc(&cu, b.cu.size() * 4));
        CUDA_CHECK(cudaMemcpy(tokens, b.tokens.data(), b.tokens.size() * 4, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemcpy(cu, b.cu.data(), b.cu.size() * 4, cudaMemcpyHostToDevice));
    }
    ~DeviceBatch() {
        CUDA_CHECK(cudaFree(tokens));
        CUDA_CHECK(cudaFree(cu));
    }
};

static ForwardArgs bench_forward_args(const Hyperparameters& args) {
    ForwardArgs fa;
    fa.mtp_weights = {1.f, 0.5f, 0.25f};
    fa.ws_short = 1, fa.ws_long = 3;
    fa.yarn = yarn_reset(args);
    fa.loss_scale = 0.125f;
    fa.training = true;
    return fa;
}

// The MLP's fused GEMMs alone (linear_relu_square_forward / _backward), at a 393k micro-batch's shapes,
// random operands (the clocks run as under real data only roughly; the loop's own timing is make
// bench-loop), against cuBLASLt's plain GEMM of the same product (no epilogue: one output, not two)
static void bench_fused_gemms(Gemms& gemms) {
    printf("\nFused GEMMs alone (random operands), us and TFLOP/s\n");
    std::mt19937_64 rng(3);
    std::normal_distribution<float> nd(0.f, 1.f);
    auto bf = [](uint16_t* q) { return reinterpret_cast<__nv_bfloat16*>(q); };
    auto upload = [](const auto& h) {
        using T = typename std::decay_t<decltype(h)>::value_type;
        T* d;
        CUDA_CHECK(cudaMalloc(&d, h.size() * sizeof(T)));
        CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
        return d;
    };
    const int T = 49152, H = 3072, D = 768;
    std::vector<uint16_t> hx((size_t)T * D), hw((size_t)H * D);
    for (auto& v : hx) v = bf16_bits(nd(rng));
    for (auto& v : hw) v = bf16_bits(0.03f * nd(rng));
    uint16_t *x = upload(hx), *w = upload(hw), *pre, *post, *dpre;
    for (uint16_t** q : {&pre, &post, &dpre}) CUDA_CHECK(cudaMalloc(q, (size_t)T * H * 2));
    const double flop = 2.0 * T * H * D;
    const float f = time_ms([&] { CUDA_CHECK(linear_relu_square_forward(bf(x), bf(w), T, H, D, bf(pre), bf(post), 0)); });
    const float b = time_ms([&] { CUDA_CHECK(linear_relu_square_backward(bf(x), bf(w), T, H, D, bf(pre), bf(dpre), 0)); });
    const float c = time_ms([&] { gemms.bf16(0, Op::N, Op::T, T, H, D, bf(x), D, bf(w), D, pre, H, false); });
    printf("  MLP %d x %d x %d: forward %6.1f us (%4.0f), backward %6.1f us (%4.0f); cuBLASLt's GEMM alone %6.1f us (%4.0f)\n",
           T, H, D, f * 1e3, flop / f / 1e9, b * 1e3, flop / b / 1e9, c * 1e3, flop / c / 1e9);
    for (uint16_t* q : {x, w, pre, post, dpre}) CUDA_CHECK(cudaFree(q));
}

// the model: forward + backward of one micro-batch at the record's sizes
static void bench_model(Gemms& gemms, const char* gemm_choice) {
    printf("\nModel forward + backward, one micro-batch (random weights; GEMM algorithms: %s)\n", gemm_choice);
    Hyperparameters args;
    size_t free0, total;
    CUDA_CHECK(cudaMemGetInfo(&free0, &total));
    ParamStore params(1, 0);
    Model model(params, gemms, args, 49152, 0, 512);
    size_t free1;
    CUDA_CHECK(cudaMemGetInfo(&free1, &total));
    std::mt19937_64 rng(7);
    cudaStream_t s;
    CUDA_CHECK(cudaStreamCreate(&s));
    const ForwardArgs fa = bench_forward_args(args);
    for (int T : {16384, 32768, 49152}) {
        DeviceBatch b(T, rng);
        float t_f = time_ms([&] { model.forward(b.tokens, b.cu, b.cu_len, T, fa, s); }, 10);
        float t_fb = time_ms([&] { model.forward(b.tokens, b.cu, b.cu_len, T, fa, s); model.backward(s); }, 10);
        // one more pass, timed by parts (the trainer's --profile_steps profiler)
        LoopProfiler prof;
        g_profiler = &prof;
        prof.begin_step(s);
        model.forward(b.tokens, b.cu, b.cu_len, T, fa, s);
        model.backward(s);
        prof.end_step(s, "bench");
        g_profiler = nullptr;
        auto share = [&](Part p) { return 100 * prof.part_ms("bench", p) / t_fb; };
        printf("  %6d tokens: forward (with the lm_head's backward) %7.2f ms, forward + backward %7.2f ms: GEMMs %.0f%%, "
               "attention %.0f%%, lm_head %.0f%%, loss %.0f%%, embedding backward %.0f%%, the rest (elementwise, norms) "
               "%.0f%%\n", T, t_f, t_fb, share(Part::Gemm), share(Part::AttentionFwd) + share(Part::AttentionBwd),
               share(Part::Head), share(Part::Loss), share(Part::EmbedBwd), share(Part::Elementwise));
    }
    CUDA_CHECK(cudaStreamDestroy(s));
    printf("  device memory of the parameters, gradients, activations and workspaces: %.1f GiB\n",
           (free0 - free1) / 1073741824.0);
}

static void profile_once(int T, int ws_short, int ws_long) {
    Hyperparameters args;
    Gemms gemms;
    ParamStore params(1, 0);
    Model model(params, gemms, args, T, 0, 512);
    std::mt19937_64 rng(7);
    DeviceBatch b(T, rng);
    ForwardArgs fa = bench_forward_args(args);
    fa.ws_short = ws_short, fa.ws_long = ws_long;
    // the first pass tunes the GEMMs; the second is timed (the kernels' sum under ncu against this
    // tells the time between kernels); the third alone is profiled
    for (int i = 0; i < 3; ++i) {
        if (i == 2) CUDA_CHECK(cudaProfilerStart());
        const auto t0 = std::chrono::steady_clock::now();
        model.forward(b.tokens, b.cu, b.cu_len, T, fa, 0);
        model.backward(0);
        CUDA_CHECK(cudaDeviceSynchronize());
        if (i == 1)
            printf("forward + backward of %d tokens (windows %d / %d blocks): %.3f ms\n", T, ws_short, ws_long,
                   std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    CUDA_CHECK(cudaProfilerStop());
}

// A memory-bound pass's ceiling depends on its mix of reads and writes (the DRAM turns its bus around
// between them): R tensors of n bytes read and W written, 16-byte vectors, streaming (evict-first)
// loads and stores, at the loop's tensor size (49,152 x 768 bf16) and at 1 GiB (no L2 effects),
// launches back to back.
template <int R, int W>
__global__ void dram_mix_kernel(const uint4* __restrict__ a, uint4* __restrict__ b, size_t n16) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16; i += (size_t)gridDim.x * blockDim.x) {
        uint4 s = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const uint4 v = __ldcs(a + r * n16 + i);
            s.x ^= v.x, s.y ^= v.y, s.z ^= v.z, s.w ^= v.w;
        }
#pragma unroll
        for (int w = 0; w < W; ++w) __stcs(b + w * n16 + i, make_uint4(s.x + w, s.y, s.z, s.w));
        if (W == 0 && s.x == 0x12345678u && s.y == 1u) b[0] = s;  // (keeps the loads)
    }
}

// one row of the table: the rate at the loop's tensor size, then at 1 GiB
template <int R, int W>
static void dram_mix_row(const uint4* a, uint4* b, size_t loop, size_t big) {
    printf("read %d, write %d  ", R, W);
    for (size_t n : {loop, big}) {
        const int reps = n == big ? 2 : 20;  // back to back, as the loop's passes run
        const float ms = time_ms([&] {
            for (int i = 0; i < reps; ++i) dram_mix_kernel<R, W><<<8 * tk::num_sms(), 256>>>(a, b, n / 16);
        }) / reps;
        CUDA_CHECK(cudaGetLastError());
        printf(" %12.2f", (R + W) * (double)n / (ms * 1e-3) / 1e12);
    }
    printf("\n");
}

static void bench_dram_mix() {
    const size_t big = 1ull << 30, loop = (size_t)49152 * MODEL_DIM * 2;
    uint4 *a, *b;  // room for two tensors read and two written
    CUDA_CHECK(cudaMalloc(&a, 2 * big));
    CUDA_CHECK(cudaMalloc(&b, 2 * big));
    CUDA_CHECK(cudaMemset(a, 1, 2 * big));
    CUDA_CHECK(cudaMemset(b, 0, 2 * big));
    printf("DRAM by read/write mix (16-byte streaming loads and stores, 8 CTAs of 256 an SM), TB/s\n");
    printf("%-18s %12s %12s\n", "tensors", "75.5 MB each", "1 GiB each");
    dram_mix_row<1, 0>(a, b, loop, big);
    dram_mix_row<2, 0>(a, b, loop, big);
    dram_mix_row<0, 1>(a, b, loop, big);
    dram_mix_row<1, 1>(a, b, loop, big);
    dram_mix_row<2, 1>(a, b, loop, big);
    dram_mix_row<1, 2>(a, b, loop, big);
    dram_mix_row<2, 2>(a, b, loop, big);
    CUDA_CHECK(cudaFree(a));
    CUDA_CHECK(cudaFree(b));
}

// A whole optimizer step over the record-61 parameters: a NorMuon-only step and an Adam step, at
// world size 1 and, under mpirun, at this world size over NCCL (each rank updates its shards),
// with the parts of one more step. The gradients are zero: the kernels do the same work on any
// values. "Hidden": the share of NCCL's busy time the compute stream did not wait for.
static void bench_optimizer(int world, int rank, ncclComm_t comm) {
    Hyperparameters args;
    Gemms gemms;
    auto run = [&](int w, int r, ncclComm_t c) {
        ParamStore params(w, 0);
        NorMuonAndAdam opt(params, gemms, args, w, r, c);
        for (int adam = 0; adam < 2; ++adam) {
            const float t = time_ms([&] {
                opt.step(1.0, 0.95, adam == 1, 0);
                if (w > 1) CUDA_CHECK(cudaStreamSynchronize(0));
            }, 10);
            // one more step, timed by parts
            opt.profile(true);
            opt.step(1.0, 0.95, adam == 1, 0);
            CUDA_CHECK(cudaDeviceSynchronize());
            const NorMuonAndAdam::Profile p = opt.profile_ms();
            opt.profile(false);
            if (rank == 0)
                printf("  world size %d, %-19s %6.2f ms: NorMuon %5.2f, Adam %5.2f, transposes %5.2f, waits for NCCL "
                       "%5.2f; NCCL busy %5.2f ms (%.0f%% of it hidden)\n", w, adam ? "Adam + NorMuon step" : "NorMuon-only step",
                       t, p.normuon_ms, p.adam_ms, p.transpose_ms, p.wait_ms, p.comm_ms,
                       p.comm_ms > 0 ? 100.0 * std::max(0.f, 1.f - p.wait_ms / p.comm_ms) : 0.0);
        }
    };
    if (rank == 0) printf("\nOptimizer step (all parameters; each rank updates 1/world of the sharded ones)\n");
    run(1, 0, nullptr);
    if (world > 1) run(world, rank, comm);
}

int main(int argc, char** argv) {
    int ngpu = 0;
    if (cudaGetDeviceCount(&ngpu) != cudaSuccess || ngpu == 0) {
        printf("SKIP: no CUDA GPU here; the GPU benchmarks need one\n");
        return 0;
    }
    if ((argc == 3 || argc == 5) && std::string(argv[1]) == "--profile-once") {  // T [ws_short ws_long]
        profile_once(atoi(argv[2]), argc == 5 ? atoi(argv[3]) : 1, argc == 5 ? atoi(argv[4]) : 3);
        return 0;
    }
    if (argc == 2 && std::string(argv[1]) == "--dram-mix") {
        bench_dram_mix();
        return 0;
    }
    if (argc == 2 && std::string(argv[1]) == "--fused-gemms") {  // that section alone
        Gemms gemms;
        bench_fused_gemms(gemms);
        return 0;
    }
    MPI_CHECK(MPI_Init(&argc, &argv));
    g_mpi_up = true;
    MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &g_rank));
    MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &g_world_size));
    if (g_world_size > 1) {
        if (g_world_size > ngpu) fatal(strprintf("%d ranks, %d GPUs: one GPU per rank", g_world_size, ngpu));
        CUDA_CHECK(cudaSetDevice(g_rank));
        ncclComm_t comm = nccl_init(g_rank, g_world_size);
        bench_optimizer(g_world_size, g_rank, comm);
        NCCL_CHECK(ncclCommDestroy(comm));
        MPI_CHECK(MPI_Finalize());
        return 0;
    }
    Gemms gemms;
    printf("NorMuon on one GPU (world size 1: the whole bank; world size 8: one rank's shard)\n");
    printf("%-6s %-10s %-16s | %9s %9s %9s %9s | %9s\n", "bank", "world", "shard", "momentum", "polar", "variance", "apply",
           "total ms");
    struct Bank { const char* name; int matrices, rows, cols; };
    for (Bank bank : {Bank{"attn", ATTN_BANK_SLOTS * 4, MODEL_DIM, MODEL_DIM}, Bank{"mlp", MLP_BANK_SLOTS * 2, 4 * MODEL_DIM, MODEL_DIM}})
        for (int world : {1, 8}) {
            const int count = bank.matrices / world;
            const int64_t per = (int64_t)bank.rows * bank.cols, n = per * count;
            __nv_bfloat16* grad = alloc_fill<__nv_bfloat16>(n, 0.01f);
            __nv_bfloat16* v = alloc_fill<__nv_bfloat16>(n, 0.f);
            __nv_bfloat16* p = alloc_fill<__nv_bfloat16>(n, 0.02f);
            float* buf = alloc_fill<float>(n, 0.f);
            float* g = alloc_fill<float>(n, 0.f);
            float* sm = alloc_fill<float>((int64_t)count * bank.rows, 0.f);
            float* lr = alloc_fill<float>(count, 0.023f);
            uint16_t* mant = alloc_fill<uint16_t>(n, 0);
            // random-ish gradients so Polar Express sees full-rank matrices
            std::vector<__nv_bfloat16> h(n);
            std::mt19937 rng(1);
            std::normal_distribution<float> nd(0.f, 0.01f);
            for (auto& x : h) x = __float2bfloat16(nd(rng));
            CUDA_CHECK(cudaMemcpy(grad, h.data(), n * 2, cudaMemcpyHostToDevice));
            PolarExpress pe(count, bank.rows, bank.cols);
            float t_m = time_ms([&] { CUDA_CHECK(nesterov_momentum(grad, buf, g, n, 0.95f, 0)); });
            float t_p = time_ms([&] { pe.run(gemms, g, v, count, 0); });
            float* var_ws = alloc_fill<float>(normuon_variance_workspace(count, bank.rows), 0.f);
            float t_v = time_ms([&] { CUDA_CHECK(normuon_variance(v, sm, count, bank.rows, bank.cols, 0.95f, var_ws, 0)); });
            float t_a = time_ms([&] { CUDA_CHECK(normuon_apply(p, mant, v, per, count, lr, 0.03f, 0)); });
            printf("%-6s %-10d %3dx%4dx%4d   | %9.3f %9.3f %9.3f %9.3f | %9.3f\n", bank.name, world, count, bank.rows,
                   bank.cols, t_m, t_p, t_v, t_a, t_m + t_p + t_v + t_a);
            for (void* q : {(void*)grad, (void*)v, (void*)p, (void*)buf, (void*)g, (void*)sm, (void*)lr, (void*)mant, (void*)var_ws})
                CUDA_CHECK(cudaFree(q));
        }
    {
        Gemms first_choice(false);
        bench_model(first_choice, "cuBLASLt's heuristic's first choice");
    }
    bench_model(gemms, "tuned on the first call");
    bench_fused_gemms(gemms);
    printf("  %s\n", gemms.tuning_report().c_str());
    printf("\nAdam on one GPU\n");
    struct AdamParam { const char* name; int64_t n; };
    for (AdamParam ap : {AdamParam{"embed (50304x768)", 50304LL * 768}, AdamParam{"ve0..2 (3x50304x768)", 3LL * 50304 * 768},
                         AdamParam{"embed shard (1/8)", 6288LL * 768}}) {
        __nv_bfloat16* p = alloc_fill<__nv_bfloat16>(ap.n, 0.01f);
        __nv_bfloat16* g = alloc_fill<__nv_bfloat16>(ap.n, 0.001f);
        float* m = alloc_fill<float>(ap.n, 0.f);
        float* v = alloc_fill<float>(ap.n, 0.f);
        float t = time_ms([&] { CUDA_CHECK(adam_update(p, g, m, v, ap.n, 0.9f, 0.95f, 1e-10f, 0.008f, 1e-7f, 0)); });
        const double bytes = ap.n * (2.0 + 2.0 + 8.0 + 8.0 + 2.0);  // p r/w, g, m r/w, v r/w
        printf("  %-24s %8.3f ms  %6.0f GB/s\n", ap.name, t, bytes / t / 1e6);
        for (void* q : {(void*)p, (void*)g, (void*)m, (void*)v}) CUDA_CHECK(cudaFree(q));
    }
    bench_optimizer(1, 0, nullptr);
    printf("\n");
    bench_dram_mix();
    MPI_CHECK(MPI_Finalize());
    return 0;
}
