// GPU tests. Without a GPU they skip with a message and succeed, so `make test-gpu` is safe
// anywhere. Last line: "N passed, N failed".
//
// So far: the data pipeline's pinned host buffers and their async upload to the GPU.

#define TRAIN_GPT_NO_MAIN
#include "../train_gpt.cu"

#include "testing.h"

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

int main() {
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
    try {
        test_upload(tmpl);
    } catch (const std::exception& ex) {
        ++g_failed;
        printf("FAIL: uncaught error: %s\n", ex.what());
    }
    rmdir(tmpl);
    printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed == 0 ? 0 : 1;
}
