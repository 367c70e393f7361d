// Does a memory-bound pass cost less energy on fewer SMs? Each kernel streams 1 GiB of random bf16
// (normal values; CONST=1: a constant byte pattern) back to back for a few seconds; blocks on an SM
// numbered k or more leave at once, the others claim 32 KB pieces from a counter. copy: read + write;
// sum: reads; norm: an RMSNorm of 768-wide rows, a warp a row. sm_count.sh runs it beside nvidia-smi.
//
//     ./sm_count KERNEL K SECONDS [BLOCKS_PER_SM]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <cuda_bf16.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)
__device__ __forceinline__ unsigned smid() { unsigned s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s)); return s; }
constexpr int U = 8;
// The work of a launch in pieces of `piece` units claimed from a counter, by the blocks on SMs below k
// only: f(first unit of the piece) for each piece a block claims
template <typename F>
__device__ __forceinline__ void pieces(unsigned k, unsigned* counter, size_t piece, size_t n, F f) {
  if (smid() >= k) return;
  __shared__ size_t base;
  for (;;) {
    if (threadIdx.x == 0) base = (size_t)atomicAdd(counter, 1u) * piece;
    __syncthreads(); size_t b = base; __syncthreads();
    if (b >= n) return;
    f(b);
  }
}
__global__ void __launch_bounds__(256) copy_k(const uint4* __restrict__ in, uint4* __restrict__ out, size_t n16, unsigned k, unsigned* counter) {
  pieces(k, counter, 256 * U, n16, [&](size_t b) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) r[u] = __ldcs(in + b + u * 256 + threadIdx.x);
#pragma unroll
    for (int u = 0; u < U; ++u) __stcs(out + b + u * 256 + threadIdx.x, r[u]);
  });
}
__global__ void __launch_bounds__(256) sum_k(const uint4* __restrict__ in, float* out, size_t n16, unsigned k, unsigned* counter) {
  float acc = 0.f;
  pieces(k, counter, 256 * U, n16, [&](size_t b) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) r[u] = __ldcs(in + b + u * 256 + threadIdx.x);
#pragma unroll
    for (int u = 0; u < U; ++u) { const __nv_bfloat162* h = (const __nv_bfloat162*)&r[u];
      for (int j = 0; j < 4; ++j) { float2 f = __bfloat1622float2(h[j]); acc += f.x + f.y; } }
  });
  if (acc == 12345.f) out[0] = acc;  // (keeps the sum)
}
// rmsnorm of 768-wide bf16 rows, a warp a row, 8 rows a warp per claim
__global__ void __launch_bounds__(256) norm_k(const uint4* __restrict__ in, uint4* __restrict__ out, size_t rows, unsigned k, unsigned* counter) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  pieces(k, counter, 64, rows, [&](size_t b) {
    for (int i = 0; i < 8; ++i) {
      size_t row = b + warp * 8 + i;
      uint4 r[3]; float ss = 0.f;
      for (int j = 0; j < 3; ++j) { r[j] = __ldcs(in + row * 96 + j * 32 + lane);
        const __nv_bfloat162* h = (const __nv_bfloat162*)&r[j];
        for (int q = 0; q < 4; ++q) { float2 f = __bfloat1622float2(h[q]); ss += f.x * f.x + f.y * f.y; } }
      for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(~0u, ss, o);
      float s = rsqrtf(ss / 768.f + 1e-6f);
      for (int j = 0; j < 3; ++j) { __nv_bfloat162* h = (__nv_bfloat162*)&r[j];
        for (int q = 0; q < 4; ++q) { float2 f = __bfloat1622float2(h[q]); h[q] = __floats2bfloat162_rn(f.x * s, f.y * s); }
        __stcs(out + row * 96 + j * 32 + lane, r[j]); }
    }
  });
}
__global__ void fill_k(__nv_bfloat16* p, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned long long h = i * 0x9E3779B97F4A7C15ull; h ^= h >> 31; h *= 0xBF58476D1CE4E5B9ull; h ^= h >> 29;
    float u1 = ((h & 0xffffff) + 1) / 16777217.f, u2 = ((h >> 24) & 0xffffff) / 16777216.f;
    p[i] = __float2bfloat16(sqrtf(-2.f * logf(u1)) * cosf(6.2831853f * u2));
  }
}
int main(int argc, char** argv) {
  if (argc < 4 || (strcmp(argv[1], "copy") && strcmp(argv[1], "sum") && strcmp(argv[1], "norm"))) {
    printf("usage: %s copy|sum|norm K SECONDS [BLOCKS_PER_SM]\n", argv[0]);
    return 1;
  }
  const char* kern = argv[1]; unsigned k = atoi(argv[2]); double secs = atof(argv[3]); int bps = argc > 4 ? atoi(argv[4]) : 8;
  size_t bytes = 1ull << 30, n16 = bytes / 16, rows = bytes / 1536;
  uint4 *a, *b; unsigned* cnt; float* o;
  CK(cudaMalloc(&a, bytes)); CK(cudaMalloc(&b, bytes)); CK(cudaMalloc(&cnt, 4 * 4096)); CK(cudaMalloc(&o, 4));
  if (getenv("CONST")) CK(cudaMemset(a, 0x3c, bytes));
  else {
    fill_k<<<1024, 256>>>((__nv_bfloat16*)a, bytes / 2);
    CK(cudaGetLastError());
  }
  CK(cudaMemset(cnt, 0, 4 * 4096));
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int grid = sms * bps;  // every SM's blocks; those on SMs k and up leave at once
  size_t traffic = !strcmp(kern, "sum") ? bytes : 2 * bytes;
  auto launch = [&](int i) {
    unsigned* c = cnt + (i % 4096);
    if (i % 4096 == 0) CK(cudaMemsetAsync(cnt, 0, 4 * 4096));
    if (!strcmp(kern, "copy")) copy_k<<<grid, 256>>>(a, b, n16, k, c);
    else if (!strcmp(kern, "sum")) sum_k<<<grid, 256>>>(a, o, n16, k, c);
    else norm_k<<<grid, 256>>>(a, b, rows - rows % 64, k, c);
    CK(cudaGetLastError());
  };
  for (int i = 0; i < 20; ++i) launch(i);
  CK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  auto t0 = std::chrono::steady_clock::now(); int n = 0;
  CK(cudaEventRecord(e0));
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < secs) {
    for (int i = 0; i < 50; ++i) launch(20 + n++);
    CK(cudaDeviceSynchronize());
  }
  CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
  float ms;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  double s = ms / 1e3 / n;
  printf("RESULT %s k=%u bps=%d %.1f us/launch %.2f TB/s traffic %.3f GB\n", kern, k, bps, s * 1e6, traffic / s / 1e12, traffic / 1e9);
  return 0;
}
