// GPU benchmarks of the optimizer's pieces at the record's shapes (not a test: prints numbers).
//   ./tests/bench_gpu

#define TRAIN_GPT_NO_MAIN
#include "../train_gpt.cu"

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

int main() {
    int ngpu = 0;
    if (cudaGetDeviceCount(&ngpu) != cudaSuccess || ngpu == 0) {
        printf("SKIP: no CUDA GPU here; the GPU benchmarks need one\n");
        return 0;
    }
    Gemms gemms;
    printf("NorMuon on one GPU (world size 1: the whole bank; world size 8: one rank's shard)\n");
    printf("%-6s %-10s %-16s | %9s %9s %9s %9s | %9s\n", "bank", "world", "shard", "momentum", "polar", "variance", "apply",
           "total ms");
    struct Bank { const char* name; int matrices, rows, cols; };
    for (Bank bank : {Bank{"attn", 40, 768, 768}, Bank{"mlp", 24, 3072, 768}})
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
    // the model: forward + backward of one micro-batch at the record's sizes, FineWeb-like documents
    printf("\nModel forward + backward, one micro-batch (random weights)\n");
    {
        Hyperparameters args;
        size_t free0, total;
        CUDA_CHECK(cudaMemGetInfo(&free0, &total));
        ParamStore params(1, 0);
        Model model(params, gemms, args, 49152, 0, 512);
        size_t free1;
        CUDA_CHECK(cudaMemGetInfo(&free1, &total));
        std::mt19937_64 rng(7);
        std::lognormal_distribution<double> len(std::log(450.0), 0.9);
        cudaStream_t s;
        CUDA_CHECK(cudaStreamCreate(&s));
        for (int T : {16384, 32768, 49152}) {
            std::vector<int> tokens(T + 1), cu = {0};
            for (int pos = 0; pos < T;) {
                int L = std::min(T - pos, std::max(1, std::min(2048, (int)len(rng))));
                tokens[pos] = BOS_ID;
                for (int i = 1; i < L; ++i) tokens[pos + i] = (int)(rng() % BOS_ID);
                pos += L;
                cu.push_back(pos);
            }
            tokens[T] = 0;
            const int cu_len = (int)next_multiple_of_n(T / 300, 128);
            while ((int)cu.size() < cu_len) cu.push_back(T);
            int *dt, *dcu;
            CUDA_CHECK(cudaMalloc(&dt, tokens.size() * 4));
            CUDA_CHECK(cudaMalloc(&dcu, cu.size() * 4));
            CUDA_CHECK(cudaMemcpy(dt, tokens.data(), tokens.size() * 4, cudaMemcpyHostToDevice));
            CUDA_CHECK(cudaMemcpy(dcu, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
            ForwardArgs fa;
            fa.mtp_weights = {1.f, 0.5f, 0.25f};
            fa.ws_short = 1, fa.ws_long = 3;
            fa.yarn = yarn_reset(args);
            fa.loss_scale = 0.125f;
            float t_f = time_ms([&] { model.forward(dt, dcu, (int)cu.size(), T, fa, s); }, 10);
            float t_fb = time_ms([&] { model.forward(dt, dcu, (int)cu.size(), T, fa, s); model.backward(s); }, 10);
            // one more pass, timed by parts
            model.profile(true);
            model.forward(dt, dcu, (int)cu.size(), T, fa, s);
            model.backward(s);
            CUDA_CHECK(cudaStreamSynchronize(s));
            Model::Profile pr = model.profile_ms();
            model.profile(false);
            const float rest = t_fb - pr.gemm_ms - pr.attention_ms - pr.head_ms;
            printf("  %6d tokens: forward (with the lm_head's backward) %7.2f ms, forward + backward %7.2f ms: GEMMs %.0f%%, "
                   "attention %.0f%%, lm_head + loss %.0f%%, the rest (elementwise, norms, embeddings) %.0f%%\n", T, t_f,
                   t_fb, 100 * pr.gemm_ms / t_fb, 100 * pr.attention_ms / t_fb, 100 * pr.head_ms / t_fb, 100 * rest / t_fb);
            CUDA_CHECK(cudaFree(dt));
            CUDA_CHECK(cudaFree(dcu));
        }
        CUDA_CHECK(cudaStreamDestroy(s));
        printf("  device memory of the parameters, gradients, activations and workspaces: %.1f GiB\n",
               (free0 - free1) / 1073741824.0);
    }

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
    return 0;
}
