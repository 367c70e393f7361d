// train_gpt.cu: the NanoGPT speedrun trainer in one self-logging CUDA C++ source.
//
// Algorithm of modded-nanogpt record 61 (2026-01-18, "Unified Optimizers and Transposed LM Head"):
// parameter banks, one NorMuon+Adam optimizer with explicit communication order, fp8 transposed
// lm_head, fused soft-capped multi-token-prediction cross-entropy. Heavy kernels live in
// triton_kernels.cu (named after the record's triton_kernels.py so the two map one to one).
//
// Reads top to bottom like the record: hyperparameters and the layer table, helpers (errors,
// flags), GEMMs and fp8 ops, optimizer, model, data, training manager, logging, main. Both sources are
// embedded in the binary at build time and written at the top of every log, so a log always holds
// the code that ran.

#define OMPI_SKIP_MPICXX 1  // the C API only
#include <cuda_runtime.h>
#include <cublasLt.h>
#include <nccl.h>
#include <mpi.h>
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <csignal>
#include <cstring>
#include <deque>
#include <dlfcn.h>
#include <exception>
#include <fcntl.h>
#include <functional>
#include <glob.h>
#include <map>
#include <tuple>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <spawn.h>
#include <stdexcept>
#include <string>
#include <sys/stat.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include "triton_kernels.cu"

extern char** environ;

// -----------------------------------------------------------------------------
// Hyperparameters: every number of record 61 that a researcher may want to change, with the
// record's value as default, then how to run it, then the few implementation choices. Each is a
// command-line flag of the same name (`--val_tokens 2097152` or `--val_tokens=2097152`); lists are
// comma-separated (`--ws_schedule 3,7,11`). These lists make the struct's members, the flags,
// `--help` and the logged configuration (in these three groups): a new knob is one line.
// Columns: flag type (I64, U64, F64, STR, BOOL, I64_LIST, F64_LIST), name, default, help.

#define RECORD_HYPERPARAMETERS(X)                                                                                   \
    /* batch sizes (tokens per step over all ranks) */                                                              \
    X(I64_LIST, train_bs_schedule, LIST(8 * 2048 * 8, 16 * 2048 * 8, 24 * 2048 * 8),                                \
      "tokens/step, by equal parts of the scheduled steps")                                                         \
    X(I64, train_bs_extension, 24 * 2048 * 8, "tokens/step in the extension steps")                                 \
    X(I64, train_max_seq_len, 128 * 16, "documents are cut at this length")                                         \
    X(I64, val_batch_size, 4 * 64 * 1024 * 8, "validation tokens per step over all ranks")                          \
    X(I64, val_tokens, 10485760, "validation tokens per evaluation (fixed for comparable runs)")                    \
    X(I64, val_loss_every, 250, "validate every N steps (0: only at the end)")                                      \
    /* optimization */                                                                                              \
    X(I64, num_scheduled_iterations, 1725, "steps of the lr/window schedules")                                      \
    X(I64, num_extension_iterations, 40, "steps after the schedules, at the final lr and windows")                  \
    X(F64, cooldown_frac, 0.50, "fraction of scheduled steps in lr cooldown")                                       \
    X(F64, split_embed_frac, 2.0 / 3.0, "embed unties from lm_head at this fraction (on an odd step)")              \
    X(F64_LIST, lr_max_schedule, LIST(1.0, 1.52, 1.73),                                                             \
      "lr multiplier by equal parts of the scheduled steps ((16/8)^0.6, (24/8)^0.5)")                               \
    X(F64, lr_min, 0.1, "lr multiplier at the end of the cooldown")                                                 \
    X(I64, muon_warmup_steps, 300, "NorMuon momentum warmup steps")                                                 \
    X(I64, muon_cooldown_steps, 50, "NorMuon momentum cooldown steps")                                              \
    X(F64, momentum_min, 0.85, "NorMuon momentum at the start and the end")                                         \
    X(F64, momentum_max, 0.95, "NorMuon momentum in between")                                                       \
    X(F64, adam_lr, 0.008, "Adam learning rate")                                                                    \
    X(F64, adam_eps, 1e-10, "Adam epsilon")                                                                         \
    X(F64, adam_weight_decay, 0.005, "Adam (cautious) weight decay")                                                \
    X(F64, normuon_lr, 0.023, "NorMuon learning rate")                                                              \
    X(F64, normuon_beta2, 0.95, "NorMuon second-moment decay")                                                      \
    X(F64, normuon_weight_decay, 1.2, "NorMuon (cautious) weight decay")                                            \
    /* fp8 lm_head static scales (@YouJiacheng) and logit soft-cap a*sigmoid((l+b)/c) (@classiclarryd) */           \
    X(F64, lm_head_x_s, 100.0 / 448, "fp8 lm_head activation scale")                                                \
    X(F64, lm_head_w_s, 1.6 / 448, "fp8 lm_head weight scale")                                                      \
    X(F64, lm_head_grad_s, 0.75 / 448, "fp8 lm_head gradient scale")                                                \
    X(F64, softcap_a, 23.0, "logits soft-cap a*sigmoid((l+b)/c)")                                                   \
    X(F64, softcap_b, 5.0, "logits soft-cap offset b")                                                              \
    X(F64, softcap_c, 7.5, "logits soft-cap divisor c")                                                             \
    /* attention masking (windows in blocks of block_size tokens) */                                                \
    X(I64, block_size, 128, "attention window unit in tokens")                                                      \
    X(I64_LIST, ws_schedule, LIST(3, 7, 11), "long window (blocks) by equal parts of the scheduled steps")          \
    X(I64, ws_final, 13, "long window (blocks) of the extension steps (@classiclarryd)")                            \
    X(I64, ws_validate_post_yarn_ext, 20, "long window (blocks) of the final validation, no new YaRN update")       \
    /* 0.1, inspired by 0.12 from @leloykun and learnable scalars used by @brendanh0gan */                           \
    X(F64, attn_scale_init, 0.1, "attention softmax scale before YaRN updates")                                     \
    X(I64, yarn_alpha, 1, "YaRN interpolation ramp start (rotations)")                                              \
    X(I64, yarn_beta, 32, "YaRN interpolation ramp end (rotations)")

#define RUN_OPTIONS(X)                                                                                              \
    X(STR, train_files, "data/fineweb10B/fineweb_train_*.bin", "train shards (glob, joined to $DATA_PATH)")          \
    X(STR, val_files, "data/fineweb10B/fineweb_val_*.bin", "validation shards (glob, joined to $DATA_PATH)")         \
    X(BOOL, cycle_data, false, "cycle the train files instead of stopping at their end (multi-epoch)")             \
    X(U64, seed, 0, "seed of the model initialisation")                                                             \
    X(STR, run_id, "", "log name logs/<run_id>.txt (default: a fresh uuid4)")                                       \
    X(BOOL, save_checkpoint, false, "write a checkpoint at the end (logs/<run_id>/state_stepNNNNNN.bin)")          \
    X(I64, checkpoint_every, 0, "write a checkpoint every N steps (0: never; SIGINT/SIGTERM always writes one)")  \
    X(I64, profile_steps, 0, "time the parts of every Nth training step, by phase; a table at the end (0: off)")

// Choices of how, not what: each keeps the math, and each is a choice because its best value
// depends on the machine or the purpose of the run.
#define IMPLEMENTATION_OPTIONS(X)                                                                                   \
    X(BOOL, gemm_autotune, true,                                                                                    \
      "time each GEMM shape's cuBLASLt candidates on its first call (false: the heuristic's first choice, the "     \
      "same bits in every process)")                                                                                \
    X(I64, gemm_candidates, 8, "how many of cuBLASLt's heuristic candidates autotune times per GEMM shape (1-64)")  \
    X(I64, logit_chunk_rows, 8192,                                                                                  \
      "rows of logits the lm_head makes and the loss consumes at a time (a multiple of 16; memory against "         \
      "launches)")                                                                                                  \
    X(BOOL, early_reduce, false,                                                                                    \
      "several GPUs: start the reduces inside the last micro-step's backward (backward_reduce_plan in the log; "    \
      "the same bits; its gain needs real GPUs to measure)")

#define HYPERPARAMETERS(X) RECORD_HYPERPARAMETERS(X) RUN_OPTIONS(X) IMPLEMENTATION_OPTIONS(X)

#define LIST(...) {__VA_ARGS__}
enum class OptType { I64, U64, F64, STR, BOOL, I64_LIST, F64_LIST };
using OptCType_I64 = int64_t;
using OptCType_U64 = uint64_t;
using OptCType_F64 = double;
using OptCType_STR = std::string;
using OptCType_BOOL = bool;
using OptCType_I64_LIST = std::vector<int64_t>;
using OptCType_F64_LIST = std::vector<double>;

struct Hyperparameters {
#define DECLARE_HYPERPARAMETER(type, name, value, help) OptCType_##type name = value;
    HYPERPARAMETERS(DECLARE_HYPERPARAMETER)
#undef DECLARE_HYPERPARAMETER
    int64_t num_iterations() const { return num_scheduled_iterations + num_extension_iterations; }
};

// The ranges of the flags the trainer can run (validate_args checks them before anything runs). A
// rank's micro-batch stays within 2^19 tokens (its activations, up to 4 x 768 wide in the MLP, are
// indexed with 32-bit offsets; twice the record's validation micro-batch; memory is checked as it is
// allocated); step counts within 10^6 (about 500x the record's; a log of that many steps is ~70
// MB); windows and blocks so that a window in tokens fits in an int.
constexpr int64_t MAX_RANK_TOKENS = 1 << 19;
constexpr int64_t MAX_STEPS = 1000000;
constexpr int64_t MAX_BLOCK_SIZE = 8192, MAX_WINDOW_BLOCKS = 8192, MAX_WINDOW_TOKENS = 1 << 24;
constexpr int64_t MAX_YARN_ROTATIONS = 1 << 20;
constexpr size_t MAX_LIST = 1024, MAX_TEXT_OPTION = 4096, MAX_RUN_ID = 63;
constexpr int64_t MAX_LOGIT_CHUNK_ROWS = 32768;  // rows x the padded vocabulary stay below 2^31

// -----------------------------------------------------------------------------
// The model's shape. The parameter banks are sized from these and from the layer table below.

constexpr int VOCAB_SIZE = 50257;
constexpr int PADDED_VOCAB_SIZE = 50304;  // next multiple of 128 (@Grad62304977, after Karpathy's experiments)
constexpr int NUM_LAYERS = 11;
constexpr int NUM_HEADS = 6;
constexpr int HEAD_DIM = 128;
constexpr int MODEL_DIM = 768;
constexpr int NUM_VALUE_EMBEDS = 3;  // ve0, ve1, ve2
constexpr int BOS_ID = 50256;
constexpr int SHARD_MAGIC = 20240520;
constexpr int SHARD_VERSION = 1;
constexpr int SHARD_HEADER_INTS = 256;

// The layer layout, one row per layer (the record's skip_in / skip_out / backout_layer,
// paired_head_layers, bm_sizes, key_offset and the ve list, in one place). Every layer has an MLP.
//   attn:  None (no attention: layer 6, @YouJiacheng), Normal, or Paired (paired-head attention)
//   long:  the long window (else the short one), with the partial key offset of long windows
//   ve:    the value embedding added to v (0-2 for ve0-ve2, -1: none); 012 ... 012 structure by
//          @YouJiacheng, improved on @leloykun's U-net, dropping the first layer makes it .12 ... 012
// The attention bank, the attention-gate bank and the value-embedding-gate bank give one slot to
// each layer that uses them, in layer order (attn_slot(), ve_gate_slot() below).
enum class AttnKind { None, Normal, Paired };
struct LayerSpec {
    AttnKind attn;
    bool long_window;
    int ve;
};
constexpr LayerSpec LAYERS[] = {
    //  attn               long   ve
    {AttnKind::Paired, false, 1},   // 0
    {AttnKind::Normal, false, 2},   // 1
    {AttnKind::Paired, false, -1},  // 2
    {AttnKind::Normal, true, -1},   // 3
    {AttnKind::Normal, false, -1},  // 4
    {AttnKind::Paired, false, -1},  // 5
    {AttnKind::None, false, -1},    // 6
    {AttnKind::Normal, false, -1},  // 7
    {AttnKind::Normal, false, 0},   // 8
    {AttnKind::Paired, false, 1},   // 9
    {AttnKind::Normal, true, 2},    // 10
};
constexpr int SKIP_IN = 3;        // skip_in: this layer's output is the U-net skip's source
constexpr int SKIP_OUT = 6;       // skip_out: the skip joins this layer's input, gated by x0
constexpr int BACKOUT_LAYER = 7;  // this layer's output is backed out before the head

constexpr bool has_attention(int layer) { return LAYERS[layer].attn != AttnKind::None; }
constexpr bool paired_head(int layer) { return LAYERS[layer].attn == AttnKind::Paired; }
constexpr bool long_window(int layer) { return LAYERS[layer].long_window; }
constexpr bool has_value_embed(int layer) { return LAYERS[layer].ve >= 0; }
// bank slots: layer i's index into the attention (and attention-gate) bank, the ve-gate bank
constexpr int attn_slot(int layer) {
    int n = 0;
    for (int i = 0; i < layer; ++i) n += has_attention(i);
    return n;
}
constexpr int ve_gate_slot(int layer) {
    int n = 0;
    for (int i = 0; i < layer; ++i) n += has_value_embed(i);
    return n;
}
constexpr int NUM_ATTN_LAYERS = attn_slot(NUM_LAYERS);
constexpr int NUM_VE_LAYERS = ve_gate_slot(NUM_LAYERS);
// Bank sizes. NorMuon shards a bank's matrices evenly over up to 8 ranks: the attention bank holds
// 4 (q, k, v, o) per slot, the MLP bank 2 (c_fc, c_proj) per slot, each padded with unused slots
// where needed (the record pads the MLP bank's 11 layers to 12).
constexpr int ATTN_BANK_SLOTS = (NUM_ATTN_LAYERS + 1) / 2 * 2;
constexpr int MLP_BANK_SLOTS = (NUM_LAYERS + 3) / 4 * 4;
constexpr int ATTN_GATE_BANK_SLOTS = NUM_ATTN_LAYERS;
constexpr int VE_GATE_BANK_SLOTS = NUM_VE_LAYERS;

constexpr bool layer_table_is_valid() {
    for (const LayerSpec& l : LAYERS) {
        if (l.ve < -1 || l.ve >= NUM_VALUE_EMBEDS) return false;                   // a value embedding that exists
        if (l.attn == AttnKind::None && (l.ve >= 0 || l.long_window)) return false;  // v and windows need attention
    }
    return true;
}
static_assert(sizeof(LAYERS) / sizeof(LAYERS[0]) == NUM_LAYERS, "the layer table needs one row per layer");
static_assert(layer_table_is_valid(), "a layer without attention has no window or value embedding; ve is -1 or 0-2");
// the skip and the backout read their sources from the next layer's input buffer, which the skip
// then changes in place: neither source may be the skip target's own input (and the backward adds
// their gradients in the norm_mix_backward of the layer after each source, once the skip's is made)
static_assert(0 <= SKIP_IN && SKIP_IN + 1 < SKIP_OUT && SKIP_OUT < NUM_LAYERS, "the skip goes forward over a layer");
static_assert(0 <= BACKOUT_LAYER && BACKOUT_LAYER < NUM_LAYERS - 1 && BACKOUT_LAYER + 1 != SKIP_OUT,
              "the backout source is the output of a layer before the last, not the skip target's input");
static_assert(ATTN_BANK_SLOTS >= NUM_ATTN_LAYERS && ATTN_GATE_BANK_SLOTS == NUM_ATTN_LAYERS,
              "the attention bank holds a slot per attention layer, the attention-gate bank one each");
static_assert(VE_GATE_BANK_SLOTS == NUM_VE_LAYERS, "the value-embedding gate bank holds one slot per ve layer");
static_assert(MLP_BANK_SLOTS >= NUM_LAYERS, "the MLP bank holds a slot per layer");
static_assert(ATTN_BANK_SLOTS * 4 % 8 == 0 && MLP_BANK_SLOTS * 2 % 8 == 0,
              "NorMuon banks shard their matrices evenly over 8 ranks");

// -----------------------------------------------------------------------------
// Helpers: errors. Library code throws (so tests can check the message); main() turns an
// exception into a message naming the failure and stops every rank.

struct TrainerError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

static std::string strprintf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static std::string strprintf(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    va_list ap2;
    va_copy(ap2, ap);
    int n = vsnprintf(nullptr, 0, fmt, ap);
    va_end(ap);
    std::string s(n > 0 ? n : 0, '\0');
    vsnprintf(s.data(), s.size() + 1, fmt, ap2);
    va_end(ap2);
    return s;
}

[[noreturn]] static void fail(const std::string& msg) { throw TrainerError(msg); }

static int g_rank = 0;
static int g_world_size = 1;
static bool g_mpi_up = false;

// Stops every rank: MPI_Abort takes the whole job down, so no rank waits forever in a collective.
[[noreturn]] static void fatal(const std::string& msg) {
    fflush(stdout);
    fprintf(stderr, "[rank %d] error: %s\n", g_rank, msg.c_str());
    fflush(stderr);
    if (g_mpi_up && g_world_size > 1) MPI_Abort(MPI_COMM_WORLD, 1);
    exit(1);
}

static FILE* g_logfile = nullptr;
static std::string g_log_error;  // the first failed write to the log (a full disk?): the run stops

// rank 0 writes the log; console=true also prints to stdout
static void print0(const std::string& s, bool console = false) {
    if (g_rank != 0) return;
    if (g_logfile && g_log_error.empty() && (fprintf(g_logfile, "%s\n", s.c_str()) < 0 || fflush(g_logfile) != 0))
        g_log_error = strprintf("writing the log failed: %s", strerror(errno));
    if (console) {
        printf("%s\n", s.c_str());
        fflush(stdout);
    }
}

// rank 0: one line for the log, another (more) for the console
static void print0_console(const std::string& log_line, const std::string& console_line) {
    if (g_rank != 0) return;
    print0(log_line);
    printf("%s\n", console_line.c_str());
    fflush(stdout);
}

static std::string format_duration(double seconds) {
    const long long s = (long long)std::max(0.0, seconds + 0.5);
    return s >= 3600 ? strprintf("%lldh%02lldm", s / 3600, s / 60 % 60) : strprintf("%lldm%02llds", s / 60, s % 60);
}

#define CUDA_CHECK(call)                                                                         \
    do {                                                                                         \
        cudaError_t err_ = (call);                                                               \
        if (err_ != cudaSuccess)                                                                 \
            fatal(strprintf("%s:%d: %s failed: %s (%s)", __FILE__, __LINE__, #call,              \
                            cudaGetErrorName(err_), cudaGetErrorString(err_)));                  \
    } while (0)
#define CUBLAS_CHECK(call)                                                                       \
    do {                                                                                         \
        cublasStatus_t st_ = (call);                                                             \
        if (st_ != CUBLAS_STATUS_SUCCESS)                                                        \
            fatal(strprintf("%s:%d: %s failed: %s", __FILE__, __LINE__, #call,                   \
                            cublasLtGetStatusString(st_)));                                      \
    } while (0)
#define NCCL_CHECK(call)                                                                         \
    do {                                                                                         \
        ncclResult_t r_ = (call);                                                                \
        if (r_ != ncclSuccess)                                                                   \
            fatal(strprintf("%s:%d: %s failed: %s", __FILE__, __LINE__, #call,                   \
                            ncclGetErrorString(r_)));                                            \
    } while (0)
#define MPI_CHECK(call)                                                                          \
    do {                                                                                         \
        int e_ = (call);                                                                         \
        if (e_ != MPI_SUCCESS) {                                                                 \
            char s_[MPI_MAX_ERROR_STRING];                                                       \
            int n_ = 0;                                                                          \
            MPI_Error_string(e_, s_, &n_);                                                       \
            fatal(strprintf("%s:%d: %s failed: %s", __FILE__, __LINE__, #call, s_));             \
        }                                                                                        \
    } while (0)

// Device buffers that live and die together (the model's and the optimizer's workspaces).
class DeviceArena {
   public:
    DeviceArena() = default;
    ~DeviceArena() {
        for (void* b : buffers_) CUDA_CHECK(cudaFree(b));
    }
    DeviceArena(const DeviceArena&) = delete;
    DeviceArena& operator=(const DeviceArena&) = delete;
    template <typename T>
    T* alloc(int64_t n) {
        void* p;
        CUDA_CHECK(cudaMalloc(&p, std::max<int64_t>(n, 1) * sizeof(T)));
        buffers_.push_back(p);
        return (T*)p;
    }

   private:
    std::vector<void*> buffers_;
};

static __nv_bfloat16* as_bf16(void* p) { return (__nv_bfloat16*)p; }

static int64_t next_multiple_of_n(int64_t v, int64_t n) { return v <= 0 ? n : (v + n - 1) / n * n; }
// cu_seqlens entries of a batch of n tokens on a rank, as the record pads them (median document ~400 tokens)
static int64_t max_num_docs_of(int64_t n) { return next_multiple_of_n(n / 300, 128); }

// Text helpers of the harness (below the line) that the state texts of checkpoints use
static int64_t parse_i64(const std::string& flag, const std::string& v);
static std::vector<std::string> split(const std::string& s, char sep);
static std::vector<std::string> keyed_line(const std::vector<std::string>& lines, size_t i, const char* key,
                                           const char* what);

// -----------------------------------------------------------------------------
// GEMMs and fp8 ops, through cuBLASLt. Matrices are row-major, as in the Python record; each
// shape's algorithm is picked once, on its first call, and cached: the fastest of cuBLASLt's
// heuristic candidates, timed on the call's own operands (the heuristic's first choice is often
// not the fastest for the model's skinny weight-gradient shapes).

// GPU time of marked stretches of a stream (for `make bench`): begin()/end() pairs record events,
// total_ms() adds the spans up once the stream has run them. Off, it records nothing.
class StreamTimer {
   public:
    ~StreamTimer() {
        for (cudaEvent_t e : events_) CUDA_CHECK(cudaEventDestroy(e));
    }
    void begin(cudaStream_t s) { record(s); }
    void end(cudaStream_t s) { record(s); }
    float total_ms() {
        float total = 0.f;
        for (size_t i = 0; i + 1 < used_; i += 2) {
            CUDA_CHECK(cudaEventSynchronize(events_[i + 1]));
            float t;
            CUDA_CHECK(cudaEventElapsedTime(&t, events_[i], events_[i + 1]));
            total += t;
        }
        return total;
    }
    void clear() { used_ = 0; }

   private:
    void record(cudaStream_t s) {
        if (used_ == events_.size()) {
            cudaEvent_t e;
            CUDA_CHECK(cudaEventCreate(&e));
            events_.push_back(e);
        }
        CUDA_CHECK(cudaEventRecord(events_[used_++], s));
    }
    std::vector<cudaEvent_t> events_;
    size_t used_ = 0;
};

// Profiling (--profile_steps; the LoopProfiler is part of the harness, below the line): while a
// step is profiled, the work queued on a stream from a mark on counts as the mark's part.
enum class Part { Host, Gemm, Head, Loss, AttentionFwd, AttentionBwd, Elementwise, EmbedBwd, Optimizer, COUNT };
class LoopProfiler;
static LoopProfiler* g_profiler = nullptr;  // the profiler while a step is profiled (else the marks cost nothing)
static void profile_mark(Part p, cudaStream_t s);  // from here on, the work queued on s counts as part p
static Part profiled_part();                       // the part marked last
// the work queued on s in a scope counts as part p (its GEMM flops as p's), then as the part before;
// a GEMM's label (its shape) gives it a line of its own in the profile's table of GEMMs
class ProfiledPart {
   public:
    ProfiledPart(Part p, cudaStream_t s, double gemm_flops = 0, bool fp8 = false, const char* gemm_label = nullptr);
    ~ProfiledPart();

   private:
    cudaStream_t s_;
    Part outer_ = Part::Host;
};

enum class Op { N, T };  // op(X) = X or X^T
inline char op_char(Op o) { return o == Op::N ? 'N' : 'T'; }
constexpr int GEMM_MAX_CANDIDATES = 64;  // the most heuristic candidates a GEMM shape's tuning may time

class Gemms {
   public:
    // autotune false: the heuristic's first choice, no timing (runs are then reproducible bit for bit
    // across processes; tuned choices may differ between processes when two candidates tie)
    // candidates: how many of the heuristic's algorithms a shape's tuning times
    explicit Gemms(bool autotune = true, int candidates = 8, size_t workspace_bytes = 64ull << 20)
        : autotune_(autotune), candidates_(candidates), workspace_bytes_(workspace_bytes) {
        if (candidates < 1 || candidates > GEMM_MAX_CANDIDATES)
            fatal(strprintf("GEMM candidates: %d is not in 1..%d", candidates, GEMM_MAX_CANDIDATES));
        CUBLAS_CHECK(cublasLtCreate(&lt_));
        CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
    }
    ~Gemms() {
        for (auto& [key, plan] : plans_) release(plan);
        for (auto& [stream, ws] : stream_workspaces_) CUDA_CHECK(cudaFree(ws));
        CUDA_CHECK(cudaFree(workspace_));
        CUBLAS_CHECK(cublasLtDestroy(lt_));
    }
    Gemms(const Gemms&) = delete;
    Gemms& operator=(const Gemms&) = delete;

    // C[m x n] = alpha op(A)[m x k] op(B)[k x n] + beta C_in; A, B bf16; C bf16 or fp32 (c_f32);
    // C_in: C itself unless given (same type and layout), so a residual add needs no copy first.
    void bf16(cudaStream_t stream, Op opa, Op opb, int m, int n, int k, const __nv_bfloat16* A, int64_t lda,
              const __nv_bfloat16* B, int64_t ldb, void* C, int64_t ldc, bool c_f32, float alpha = 1.f,
              float beta = 0.f, const void* C_in = nullptr) {
        if (!C_in) C_in = C;
        Key key{CUDA_R_16BF, CUDA_R_16BF, c_f32 ? CUDA_R_32F : CUDA_R_16BF, opa, opb, m, n, k, lda, ldb, ldc, false,
                align(A), align(B), std::min(align(C), align(C_in))};
        run(stream, key, A, B, C_in, C, alpha, beta, nullptr, nullptr);
    }

    // A batch of bf16 products, matrix i at A + i*stride_a etc.: D = alpha op(A) op(B) + beta C,
    // with C and D separate (bf16, same layout).
    void bf16_batched(cudaStream_t stream, int batch, Op opa, Op opb, int m, int n, int k, const __nv_bfloat16* A,
                      int64_t lda, int64_t stride_a, const __nv_bfloat16* B, int64_t ldb, int64_t stride_b,
                      const __nv_bfloat16* C, __nv_bfloat16* D, int64_t ldc, int64_t stride_c, float alpha, float beta) {
        Key key{CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, opa, opb, m, n, k, lda, ldb, ldc, false,
                align(A), align(B), std::min(align(C), align(D)), batch, stride_a, stride_b, stride_c};
        run(stream, key, A, B, C, D, alpha, beta, nullptr, nullptr);
    }

    // C[m x n] = scale_a scale_b A[m x k] B[n x k]^T with fp8 A and B (each K-contiguous, as Hopper's
    // fp8 tensor cores want them), CUDA_R_8F_E4M3 or CUDA_R_8F_E5M2; scales are device pointers
    // (16-byte aligned); C bf16 or fp32. fast_accum: the tensor cores' faster, less precise accumulation.
    void fp8(cudaStream_t stream, int m, int n, int k, const void* A, cudaDataType ta, int64_t lda, const void* B,
             cudaDataType tb, int64_t ldb, void* C, int64_t ldc, bool c_f32, const float* scale_a,
             const float* scale_b, bool fast_accum, float beta = 0.f) {
        Key key{ta, tb, c_f32 ? CUDA_R_32F : CUDA_R_16BF, Op::N, Op::T, m, n, k, lda, ldb, ldc, fast_accum,
                align(A), align(B), align(C)};
        run(stream, key, A, B, C, C, 1.f, beta, scale_a, scale_b);
    }

    // GEMMs on `stream` get a workspace of their own (two streams' GEMMs may run at once)
    void add_stream(cudaStream_t stream) {
        if (stream_workspaces_.count(stream)) return;
        void* ws = nullptr;
        CUDA_CHECK(cudaMalloc(&ws, workspace_bytes_));
        stream_workspaces_[stream] = ws;
    }

    size_t cached_plans() const { return plans_.size(); }
    // The GEMM plan: each shape called so far and its algorithm, one line each ("gemm SHAPE = ALGO
    // (note)"), for the log; a rerun or a resumed run follows it instead of timing anything.
    std::string plan_text() const;
    // Follow a plan (lines as plan_text writes them; others are refused): no timing from now on.
    void set_plan(const std::string& text);
    // After the warmup: a shape first seen later takes the heuristic's first choice, untimed, so a
    // rerun that follows the logged plan makes the same choice.
    void freeze() { frozen_ = true; }
    // Several ranks: every rank takes rank 0's choices (plan_text lines) for the shapes it has run,
    // so all ranks run the logged plan.
    void adopt_plan(const std::string& text);
    int unplanned_shapes() const { return unplanned_; }

    // what tuning found: shapes timed, how many left the heuristic's first choice, and the time one
    // call of each shape saves, summed
    std::string tuning_report() const;

    // plan_text's lines back: shape text -> algorithm (a malformed or repeated line is refused)
    static std::map<std::string, cublasLtMatmulAlgo_t> parse_plan(const std::string& text);

   private:
    struct Key {
        cudaDataType ta, tb, tc;
        Op opa, opb;
        int m, n, k;
        int64_t lda, ldb, ldc;
        bool fast_accum;
        int align_a, align_b, align_c;
        int batch = 1;
        int64_t stride_a = 0, stride_b = 0, stride_c = 0;
        auto tie() const {
            return std::tie(ta, tb, tc, opa, opb, m, n, k, lda, ldb, ldc, fast_accum, align_a, align_b, align_c, batch,
                            stride_a, stride_b, stride_c);
        }
        bool operator<(const Key& o) const { return tie() < o.tie(); }
    };
    struct Plan {
        cublasLtMatmulDesc_t desc = nullptr;
        cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
        std::vector<cublasLtMatmulAlgo_t> candidates;  // the heuristic's, best first; after tuning, the fastest first
        bool tuned = false;
        float tuned_ms_first = 0, tuned_ms_best = 0;  // the heuristic's first choice and the fastest
    };

    static int align(const void* p) {
        uintptr_t v = (uintptr_t)p;
        int a = 256;
        while (a > 1 && v % a) a >>= 1;
        return a;
    }

    static void release(Plan& p);

    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLASLt's A is our B.
    Plan& plan(const Key& key);

    // a shape as the plan names it (every field of the key: the same text means the same call)
    static const char* type_name(cudaDataType t);  // bf16, f32, e4m3, e5m2
    static std::string key_text(const Key& k);
    static std::string algo_hex(const cublasLtMatmulAlgo_t& a);
    static bool parse_algo_hex(const std::string& h, cublasLtMatmulAlgo_t& a);

    static std::string describe(const Key& key);
    static std::string label_text(const Key& key, float beta);  // the profile's name of a shape

    // bytes from D's first element to its last (batches included)
    static size_t extent_bytes(const Key& key);

    // On a shape's first call: time each candidate on this call's operands (one warm-up run, then the
    // best of three) and put the fastest first. A candidate that does not run here is dropped. Where
    // the call accumulates into D (beta != 0, C == D), D is saved first and restored after.
    void tune(cudaStream_t stream, const Key& key, Plan& p, const void* A, const void* B, const void* C, void* D,
              float alpha, float beta);

    // The chosen algorithm, or (once, on the first call) the next candidate where a choice turns out
    // not to run with these arguments.
    void run(cudaStream_t stream, const Key& key, const void* A, const void* B, const void* C, void* D, float alpha,
             float beta, const float* scale_a, const float* scale_b);

    void* workspace(cudaStream_t stream) const;

    const bool autotune_;
    const int candidates_;
    cublasLtHandle_t lt_ = nullptr;
    void* workspace_ = nullptr;
    std::map<cudaStream_t, void*> stream_workspaces_;  // add_stream's
    size_t workspace_bytes_;
    std::map<Key, Plan> plans_;
    bool fixed_ = false, frozen_ = false;
    std::map<std::string, cublasLtMatmulAlgo_t> fixed_plan_;  // shape text -> algorithm
    int unplanned_ = 0;  // shapes a fixed plan did not name (they take the heuristic's first choice)
};

// -----------------------------------------------------------------------------
// Optimizer (NorMuonAndAdam), the table: one optimizer configured per parameter by a table, no
// parameter groups (record 61). This part is the table, the orders, how each parameter is sharded
// over the ranks and where it lives (ParamStore); the optimizer itself follows the model.
//   Muon (MomentUm Orthogonalized by Newton-Schulz, https://kellerjordan.github.io/posts/muon/)
//   with Polar Express in place of Newton-Schulz, NorMuon's low-rank variance estimator
//   (https://arxiv.org/pdf/2510.05491), cautious weight decay and mantissa tracking, for the
//   projection banks; Adam with bias correction and cautious weight decay for the rest.
//   Contributors include @YouJiacheng, @KonstantinWilleke, @alexrgilbert, @adricarda,
//   @tuttyfrutyee, @vdlad, @ryanyang0, @vagrawal, @varunneal, @chrisjmccormick.

enum class Optim { Adam, NorMuon };
enum class Comms { None, Replicated, Sharded };  // None: world size 1, no communication at all

struct ParamTableEntry {
    const char* label;
    Optim optim;
    Comms comms;   // sharded: reduce-scatter, update a shard, all-gather; replicated: all-reduce
    double beta1;  // Adam's betas (NorMuon's momentum and beta2 are hyperparameters)
    double beta2;
    double lr_mul;  // per-parameter learning rate and weight decay multipliers
    double wd_mul;
};
constexpr ParamTableEntry normuon(const char* label, Comms comms) { return {label, Optim::NorMuon, comms, 0, 0, 1.0, 1.0}; }
constexpr ParamTableEntry adam(const char* label, Comms comms, double beta1, double beta2, double lr_mul = 1.0,
                               double wd_mul = 1.0) {
    return {label, Optim::Adam, comms, beta1, beta2, lr_mul, wd_mul};
}

// Scalars are given higher momentum terms to smooth learning (@ChrisJMcCormick).
static const ParamTableEntry param_table[] = {
    //       label             comms              adam_betas   lr_mul  wd_mul
    normuon("attn",           Comms::Sharded),
    normuon("mlp",            Comms::Sharded),
    adam(   "scalars",        Comms::Replicated, 0.9,  0.99,  5.0,    0.0),
    adam(   "ve0",            Comms::Sharded,    0.75, 0.95,  75.0,   5.0),
    adam(   "ve1",            Comms::Sharded,    0.75, 0.95,  75.0,   5.0),
    adam(   "ve2",            Comms::Sharded,    0.75, 0.95,  75.0,   5.0),
    adam(   "smear_gate",     Comms::Replicated, 0.9,  0.99,  0.01,   0.0),
    adam(   "skip_gate",      Comms::Replicated, 0.9,  0.99,  0.05,   0.0),
    adam(   "attn_gate_bank", Comms::Replicated, 0.9,  0.99),
    adam(   "ve_gate_bank",   Comms::Replicated, 0.9,  0.99),
    adam(   "x0_lambdas",     Comms::Replicated, 0.65, 0.95,  5.0,    0.0),
    adam(   "lm_head",        Comms::Sharded,    0.5,  0.95,  1.0,    150.0),
    adam(   "embed",          Comms::Sharded,    0.5,  0.95,  1.0,    150.0),
};

// Reduces are launched in this order (the record: the table's order).
static const char* const scatter_order[] = {"attn", "mlp", "scalars", "ve0", "ve1", "ve2", "smear_gate", "skip_gate",
                                            "attn_gate_bank", "ve_gate_bank", "x0_lambdas", "lm_head", "embed"};

// Updates run in this order: small parameters while the large reduces finish, lm_head before
// embed (embed is lm_head^T while tied), the banks (Polar Express) last to overlap the most.
static const char* const work_order[] = {"scalars", "smear_gate", "skip_gate", "attn_gate_bank", "ve_gate_bank",
                                         "x0_lambdas", "ve0", "ve1", "ve2", "lm_head", "embed", "attn", "mlp"};

struct ParamShape {
    std::string label;
    std::vector<int64_t> shape;    // as stored, row-major
    std::vector<int64_t> reshape;  // NorMuon: the bank as (matrices, rows, cols)
    bool fp32 = false;             // else bf16
    int64_t numel() const {
        int64_t n = 1;
        for (int64_t d : shape) n *= d;
        return n;
    }
};

// The model's parameters and their initial values, defined with the model (the record's
// GPT.__init__) below.
static std::vector<ParamShape> model_params(int world_size);
struct HostParam {  // one parameter's values on the host: bf16 parameters as raw bits, fp32 as floats
    std::vector<uint16_t> bf16;
    std::vector<float> fp32;
};
static HostParam init_param(const ParamShape& ps, uint64_t seed, const HostParam* lm_head = nullptr);

// One parameter's resolved optimizer configuration on one rank.
struct ParamConfig {
    std::string label;
    Optim optim;
    Comms comms;
    double beta1 = 0, beta2 = 0;        // Adam
    double lr_mul = 1, wd_mul = 1;      // NorMuon: lr_mul includes the shape multiplier
    double initial_lr = 0, weight_decay = 0, eps = 0;
    int64_t chunk_size = 0;             // rows of dim 0 (Adam) or matrices (NorMuon) this rank updates
    std::vector<int64_t> chunk_shape;   // the shard this rank updates
    std::vector<int64_t> second_moment_shape;  // NorMuon: reduced along the longer matrix side
    double momentum = 0, normuon_beta2 = 0;
    std::vector<double> per_matrix_lr_mul;     // NorMuon mlp: 2x on the c_proj matrices (odd indices)
    int64_t chunk_numel() const {
        int64_t n = 1;
        for (int64_t d : chunk_shape) n *= d;
        return n;
    }
};

static const ParamTableEntry& table_entry(const std::string& label) {
    for (const ParamTableEntry& e : param_table)
        if (label == e.label) return e;
    fail("parameter '" + label + "' has no entry in param_table");
}

static std::vector<ParamConfig> build_param_configs(const Hyperparameters& a, const std::vector<ParamShape>& params,
                                                    int world_size, int rank) {
    std::vector<ParamConfig> cfgs;
    for (const ParamShape& ps : params) {
        for (const ParamConfig& c : cfgs)
            if (c.label == ps.label) fail("parameter '" + ps.label + "' appears twice");
        const ParamTableEntry& e = table_entry(ps.label);
        ParamConfig c;
        c.label = ps.label;
        c.optim = e.optim;
        c.comms = world_size == 1 ? Comms::None : e.comms;
        c.lr_mul = e.lr_mul;
        c.wd_mul = e.wd_mul;
        const bool sharded = e.comms == Comms::Sharded;
        if (e.optim == Optim::Adam) {
            c.beta1 = e.beta1, c.beta2 = e.beta2;
            c.initial_lr = a.adam_lr, c.weight_decay = a.adam_weight_decay, c.eps = a.adam_eps;
            if (sharded && ps.shape[0] % world_size != 0)
                fail(strprintf("parameter '%s': %lld rows do not shard over %d ranks", ps.label.c_str(),
                               (long long)ps.shape[0], world_size));
            c.chunk_size = sharded ? ps.shape[0] / world_size : ps.shape[0];
            c.chunk_shape = ps.shape;
            c.chunk_shape[0] = c.chunk_size;
        } else {
            if (ps.reshape.size() != 3) fail("NorMuon parameter '" + ps.label + "' needs a (matrices, rows, cols) reshape");
            if (ps.reshape[0] % world_size != 0)
                fail(strprintf("parameter '%s': %lld matrices do not shard over %d ranks", ps.label.c_str(),
                               (long long)ps.reshape[0], world_size));
            c.chunk_size = ps.reshape[0] / world_size;
            c.chunk_shape = {c.chunk_size, ps.reshape[1], ps.reshape[2]};
            const int64_t rows = ps.reshape[1], cols = ps.reshape[2];
            c.lr_mul *= std::sqrt(std::max(1.0, (double)rows / (double)cols));
            c.second_moment_shape = rows >= cols ? std::vector<int64_t>{c.chunk_size, rows, 1}
                                                 : std::vector<int64_t>{c.chunk_size, 1, cols};
            c.initial_lr = a.normuon_lr, c.weight_decay = a.normuon_weight_decay;
            c.momentum = a.momentum_max, c.normuon_beta2 = a.normuon_beta2;
            if (ps.label == "mlp")
                for (int64_t i = 0; i < c.chunk_size; ++i)
                    c.per_matrix_lr_mul.push_back((rank * c.chunk_size + i) % 2 == 1 ? 2.0 : 1.0);
        }
        cfgs.push_back(c);
    }
    for (const ParamTableEntry& e : param_table)
        if (std::none_of(cfgs.begin(), cfgs.end(), [&](const ParamConfig& c) { return c.label == e.label; }))
            fail(std::string("param_table entry '") + e.label + "' matches no parameter");
    // as the record asserts: each order names every parameter exactly once
    for (auto [name, order, n] : {std::tuple{"scatter_order", scatter_order, std::size(scatter_order)},
                                  std::tuple{"work_order", work_order, std::size(work_order)}}) {
        std::vector<std::string> labels(order, order + n);
        for (const std::string& l : labels) table_entry(l);
        std::sort(labels.begin(), labels.end());
        if (labels.size() != std::size(param_table) || std::unique(labels.begin(), labels.end()) != labels.end())
            fail(std::string(name) + " must name every parameter exactly once");
    }
    return cfgs;
}

// The explicit order of one optimizer step (record 61's NorMuonAndAdam.step), as a list the step
// follows and the log shows. Phase 1, in scatter_order: each parameter's reduce (all-reduce if
// replicated, reduce-scatter if sharded; nothing at world size 1), Adam's only on Adam steps,
// embed's gradient added transposed into lm_head's before lm_head's reduce while tied, embed
// itself skipped while tied. Phase 2, in work_order: each reduced parameter's update, then its
// all-gather if sharded. Phase 3: lm_head's gather awaited first, embed written as lm_head^T while
// tied, then the other gathers.
enum class PlanOp { AddTransposed, AllReduce, ReduceScatter, Update, AllGather, CopyTransposed };
struct PlanStep {
    PlanOp op;
    std::string label;
};

// a parameter's configuration among cfgs (`plan` names the caller in the error)
static const ParamConfig& config_of(const std::vector<ParamConfig>& cfgs, const std::string& label, const char* plan) {
    for (const ParamConfig& c : cfgs)
        if (c.label == label) return c;
    fail(std::string(plan) + ": no parameter '" + label + "'");
}

static std::vector<PlanStep> step_plan(const std::vector<ParamConfig>& cfgs, bool do_adam, bool split) {
    auto cfg = [&](const std::string& label) -> const ParamConfig& { return config_of(cfgs, label, "step plan"); };
    std::vector<PlanStep> plan;
    std::vector<std::string> reduced;
    for (const char* label : scatter_order) {
        const ParamConfig& c = cfg(label);
        if (c.optim == Optim::Adam && !do_adam) continue;
        if (c.label == "lm_head" && !split) plan.push_back({PlanOp::AddTransposed, "embed->lm_head"});
        if (c.label == "embed" && !split) continue;
        if (c.comms == Comms::Replicated) plan.push_back({PlanOp::AllReduce, c.label});
        if (c.comms == Comms::Sharded) plan.push_back({PlanOp::ReduceScatter, c.label});
        reduced.push_back(c.label);
    }
    for (const char* label : work_order) {
        if (std::find(reduced.begin(), reduced.end(), label) == reduced.end()) continue;
        plan.push_back({PlanOp::Update, label});
        if (cfg(label).comms == Comms::Sharded) plan.push_back({PlanOp::AllGather, label});
    }
    if (do_adam && !split) plan.push_back({PlanOp::CopyTransposed, "lm_head->embed"});
    return plan;
}

static std::string plan_text(const std::vector<PlanStep>& plan) {
    static const char* names[] = {"add_transposed", "all_reduce", "reduce_scatter", "update", "all_gather",
                                  "copy_transposed"};
    std::string s;
    for (const PlanStep& p : plan) s += (s.empty() ? "" : " ") + std::string(names[(int)p.op]) + "(" + p.label + ")";
    return s;
}

// Reduces that start inside the last micro-step's backward (--early_reduce; several ranks), as the
// October-31 record showed with hooks and as C++ can say explicitly: after layer i's backward, its
// MLP and attention bank matrices are final and go to the ranks that own them (ncclReduce to the
// owner of each run of matrices: the shards the optimizer updates); the untied lm_head's
// reduce-scatter starts right after the head's backward (inside the forward). The rest keeps
// step_plan's phase 1, after the whole backward. Layers finish from the last to the first.
enum class ReducePoint { AfterHead, AfterLayer };
struct BackwardReduce {
    ReducePoint when;
    int layer;          // AfterLayer: whose backward
    std::string label;  // the parameter
    int64_t first = 0, count = 0;  // NorMuon banks: matrices [first, first + count) of the reshape; 0: all
    int root = -1;                 // the rank that owns those matrices (-1: the whole parameter's collective)
};

static std::vector<BackwardReduce> backward_reduce_plan(const std::vector<ParamConfig>& cfgs, int world_size, bool do_adam,
                                                        bool split) {
    std::vector<BackwardReduce> plan;
    if (world_size == 1) return plan;
    if (do_adam && split) plan.push_back({ReducePoint::AfterHead, -1, "lm_head"});
    // matrices [first, first + n) of a bank, in runs of one owner each
    auto slices = [&](int layer, const char* label, int64_t first, int64_t n) {
        const int64_t chunk = config_of(cfgs, label, "backward reduce plan").chunk_size;
        for (int64_t m = first; m < first + n;) {
            const int64_t owner = m / chunk, end = std::min(first + n, (owner + 1) * chunk);
            plan.push_back({ReducePoint::AfterLayer, layer, label, m, end - m, (int)owner});
            m = end;
        }
    };
    for (int i = NUM_LAYERS - 1; i >= 0; --i) {
        slices(i, "mlp", 2 * i, 2);
        if (has_attention(i)) slices(i, "attn", 4 * attn_slot(i), 4);
    }
    return plan;
}

static std::string backward_reduce_text(const std::vector<BackwardReduce>& plan) {
    std::string s;
    for (size_t i = 0; i < plan.size(); ++i) {
        const BackwardReduce& r = plan[i];
        if (i == 0 || r.when != plan[i - 1].when || r.layer != plan[i - 1].layer)
            s += (s.empty() ? "" : " ") + (r.when == ReducePoint::AfterHead ? std::string("after_head:")
                                                                           : strprintf("after_layer(%d):", r.layer));
        s += r.root < 0 ? " reduce_scatter(" + r.label + ")"
                        : strprintf(" reduce(%s[%lld:%lld]->%d)", r.label.c_str(), (long long)r.first,
                                    (long long)(r.first + r.count), r.root);
    }
    return s.empty() ? "none" : s;
}

// The parameters on the GPU: one allocation per bank, and a gradient of the same type and layout.
struct Param {
    ParamShape shape;
    void* data = nullptr;
    void* grad = nullptr;
    size_t bytes() const { return (size_t)shape.numel() * (shape.fp32 ? 4 : 2); }
};

class ParamStore {
   public:
    ParamStore(int world_size, uint64_t seed) {
        HostParam lm_head_init;
        std::vector<ParamShape> shapes = model_params(world_size);
        // lm_head first: embed starts as its transpose
        std::stable_partition(shapes.begin(), shapes.end(), [](const ParamShape& p) { return p.label == "lm_head"; });
        for (const ParamShape& ps : shapes) {
            Param p;
            p.shape = ps;
            HostParam init = init_param(ps, seed, &lm_head_init);
            CUDA_CHECK(cudaMalloc(&p.data, p.bytes()));
            CUDA_CHECK(cudaMalloc(&p.grad, p.bytes()));
            CUDA_CHECK(cudaMemcpy(p.data, ps.fp32 ? (const void*)init.fp32.data() : (const void*)init.bf16.data(), p.bytes(),
                                  cudaMemcpyHostToDevice));
            CUDA_CHECK(cudaMemset(p.grad, 0, p.bytes()));
            if (ps.label == "lm_head") lm_head_init = std::move(init);
            params_.push_back(p);
        }
    }
    ~ParamStore() {
        for (Param& p : params_) {
            CUDA_CHECK(cudaFree(p.data));
            CUDA_CHECK(cudaFree(p.grad));
        }
        for (void* c : initial_) CUDA_CHECK(cudaFree(c));
    }
    ParamStore(const ParamStore&) = delete;
    ParamStore& operator=(const ParamStore&) = delete;

    std::vector<Param>& all() { return params_; }
    Param& operator[](const std::string& label) {
        for (Param& p : params_)
            if (p.shape.label == label) return p;
        fail("no parameter '" + label + "'");
    }
    int64_t count() const {
        int64_t n = 0;
        for (const Param& p : params_) n += p.shape.numel();
        return n;
    }
    size_t bytes() const {
        size_t n = 0;
        for (const Param& p : params_) n += 2 * p.bytes();
        return n;
    }

    // A copy of every parameter on the GPU, and its restoration with zero gradients: the warmup
    // trains from the initial weights, then training starts again from them.
    void save_initial_state() {
        for (void* c : initial_) CUDA_CHECK(cudaFree(c));
        initial_.clear();
        for (Param& p : params_) {
            void* copy;
            CUDA_CHECK(cudaMalloc(&copy, p.bytes()));
            CUDA_CHECK(cudaMemcpy(copy, p.data, p.bytes(), cudaMemcpyDeviceToDevice));
            initial_.push_back(copy);
        }
    }
    void load_initial_state(cudaStream_t s) {
        if (initial_.size() != params_.size()) fail("load_initial_state: no saved state");
        for (size_t i = 0; i < params_.size(); ++i) {
            CUDA_CHECK(cudaMemcpyAsync(params_[i].data, initial_[i], params_[i].bytes(), cudaMemcpyDeviceToDevice, s));
            CUDA_CHECK(cudaMemsetAsync(params_[i].grad, 0, params_[i].bytes(), s));
        }
    }

   private:
    std::vector<Param> params_;
    std::vector<void*> initial_;
};

// -----------------------------------------------------------------------------
// Model: the parameters (the record's GPT.__init__), then the forward and backward.

// The record-61 parameters, in banks of one allocation each (parameter banks for sharded
// optimization, @chrisjmccormick), sized from the layer table:
//   attn: attn_bank[attn_slot(i)] holds layer i's q, k, v, o rows (768 each): merged QKVO weights,
//     suggested by many, implemented by @fernbear.bsky.social, improved by @YouJiacheng, layout
//     simplified by @chrisjmccormick; NorMuon sees it as 4 x slots matrices of 768 x 768.
//   mlp: mlp_bank[i] holds layer i's c_fc then c_proj (3072 x 768 each), padded to MLP_BANK_SLOTS
//     (all layers have an MLP: at 11 layers the first MLP layer was dropped, @EmelyanenkoK).
//   scalars: resid lambdas, sa lambdas (2 per layer), smear, backout, skip lambdas, padded with ones
//     to a multiple of the world size so it can be reduced evenly.
//   ve0-ve2: value embeddings (@KoszarskyB, after @Grad62304977's value residual,
//     https://arxiv.org/abs/2410.17897; code simplification after @ragulpr).
//   attn_gate_bank, ve_gate_bank: the output gates (sparse gated attention, @classiclarryd) and
//     value-embedding gates, one slot per layer that has them.
//   lm_head: stored transposed (in, out) for a faster gradient accumulation (@ChrisJMcCormick);
//     embed starts as lm_head^T and stays tied to it until the split step.
static std::vector<ParamShape> model_params(int world_size) {
    const int64_t n_scalars = 3 * NUM_LAYERS + 3;
    const int64_t pad = (world_size - n_scalars % world_size) % world_size;
    return {
        {"attn", {ATTN_BANK_SLOTS, 4 * MODEL_DIM, MODEL_DIM}, {ATTN_BANK_SLOTS * 4, MODEL_DIM, MODEL_DIM}},
        {"mlp", {MLP_BANK_SLOTS, 2, 4 * MODEL_DIM, MODEL_DIM}, {MLP_BANK_SLOTS * 2, 4 * MODEL_DIM, MODEL_DIM}},
        {"scalars", {n_scalars + pad}, {}, true},
        {"ve0", {PADDED_VOCAB_SIZE, MODEL_DIM}, {}},
        {"ve1", {PADDED_VOCAB_SIZE, MODEL_DIM}, {}},
        {"ve2", {PADDED_VOCAB_SIZE, MODEL_DIM}, {}},
        {"smear_gate", {1, 12}, {}},
        {"skip_gate", {1, 12}, {}},
        {"attn_gate_bank", {ATTN_GATE_BANK_SLOTS, NUM_HEADS, 12}, {}},
        {"ve_gate_bank", {VE_GATE_BANK_SLOTS, NUM_HEADS, 12}, {}},
        {"x0_lambdas", {NUM_LAYERS}, {}, true},
        {"lm_head", {MODEL_DIM, PADDED_VOCAB_SIZE}, {}},
        {"embed", {PADDED_VOCAB_SIZE, MODEL_DIM}, {}},
    };
}
static_assert(NUM_VALUE_EMBEDS == 3, "model_params and param_table list ve0, ve1, ve2");

// Offsets into scalars: resid lambdas, sa lambdas (2 per layer), smear, backout, skip, padding ones.
constexpr int SCALAR_RESID = 0, SCALAR_SA = NUM_LAYERS, SCALAR_SMEAR = 3 * NUM_LAYERS, SCALAR_BACKOUT = SCALAR_SMEAR + 1,
              SCALAR_SKIP = SCALAR_SMEAR + 2;

static uint16_t bf16_bits(float f) {  // round to nearest even, as .bfloat16()
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return (uint16_t)(u >> 16);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Initial values of one parameter on the host, as record 61 initialises them (@YouJiacheng's
// scales): QKV rows uniform +-sqrt(3)/sqrt(768), O rows zero; c_fc uniform +-sqrt(3)/2/sqrt(768),
// c_proj zero (@Grad62304977); lm_head normal(0, 0.005) and embed = lm_head^T; value embeddings, gates and x0
// lambdas zero; scalars as listed above. Each parameter draws from its own stream of the seed,
// so a run is reproducible from the seed in its log.
static HostParam init_param(const ParamShape& ps, uint64_t seed, const HostParam* lm_head) {
    HostParam hp;
    const int64_t n = ps.numel();
    std::mt19937_64 rng(seed ^ (std::hash<std::string>{}(ps.label) * 0x9E3779B97F4A7C15ull));
    if (ps.fp32) {
        hp.fp32.assign(n, 0.f);
        if (ps.label == "scalars") {
            for (int64_t i = 0; i < n; ++i) hp.fp32[i] = 1.f;  // padding
            for (int i = 0; i < NUM_LAYERS; ++i) {
                hp.fp32[SCALAR_RESID + i] = 1.1f;
                hp.fp32[SCALAR_SA + 2 * i] = 0.5f, hp.fp32[SCALAR_SA + 2 * i + 1] = 1.0f;
            }
            hp.fp32[SCALAR_SMEAR] = 0.f, hp.fp32[SCALAR_BACKOUT] = 0.5f, hp.fp32[SCALAR_SKIP] = -1.5f;
        }
        return hp;
    }
    hp.bf16.assign(n, 0);
    auto uniform = [&](int64_t begin, int64_t count, double bound) {
        std::uniform_real_distribution<float> u((float)-bound, (float)bound);
        for (int64_t i = begin; i < begin + count; ++i) hp.bf16[i] = bf16_bits(u(rng));
    };
    const double attn_bound = std::sqrt(3.0) / std::sqrt((double)MODEL_DIM), mlp_bound = 0.5 * attn_bound;
    const int64_t mat = (int64_t)MODEL_DIM * MODEL_DIM;
    if (ps.label == "attn") {
        for (int64_t l = 0; l < ps.shape[0]; ++l) uniform(l * 4 * mat, 3 * mat, attn_bound);  // o rows stay zero
    } else if (ps.label == "mlp") {
        for (int64_t l = 0; l < ps.shape[0]; ++l) uniform(l * 2 * 4 * mat, 4 * mat, mlp_bound);  // c_proj stays zero
    } else if (ps.label == "lm_head") {
        std::normal_distribution<float> nd(0.f, 0.005f);
        for (int64_t i = 0; i < n; ++i) hp.bf16[i] = bf16_bits(nd(rng));
    } else if (ps.label == "embed") {
        if (!lm_head) fail("embed is initialised as lm_head^T: initialise lm_head first");
        for (int64_t v = 0; v < PADDED_VOCAB_SIZE; ++v)
            for (int64_t d = 0; d < MODEL_DIM; ++d) hp.bf16[v * MODEL_DIM + d] = lm_head->bf16[d * PADDED_VOCAB_SIZE + v];
    }  // value embeddings and gates: zero
    return hp;
}

// YaRN (@YouJiacheng's half-truncated RoPE with base-frequency tuning; YaRN updates on window
// changes). State is the fp32 angular frequency per head dim and the attention scale; the
// cos/sin tables are built from it on the GPU.
struct YarnState {
    std::vector<float> angular_freq;  // HEAD_DIM entries: HEAD_DIM/4 freqs, each twice, then zeros
    double attn_scale;
};

static YarnState yarn_reset(const Hyperparameters& a) {
    YarnState y;
    const int n = HEAD_DIM / 4;
    const float step = 1.0f / (float)(n - 1);
    for (int i = 0; i < n; ++i) {
        // linspace(0, 1, n) in fp32, computed from both ends as PyTorch does
        float t = i < n / 2 ? (float)i * step : 1.0f - (float)(n - 1 - i) * step;
        float f = powf(1.0f / 1024.0f, t);
        y.angular_freq.push_back(f);
        y.angular_freq.push_back(f);
    }
    y.angular_freq.resize(HEAD_DIM, 0.0f);
    y.attn_scale = a.attn_scale_init;
    return y;
}

static void yarn_apply(const Hyperparameters& a, YarnState& y, int64_t old_window, int64_t new_window) {
    // fp32 arithmetic in the record's order (a division by a scalar is a product with its inverse)
    const float inv_two_pi = 1.0f / (float)(2 * M_PI);
    const float inv_ramp = 1.0f / (float)(a.yarn_beta - a.yarn_alpha);
    const double scaling_factor = (double)old_window / (double)new_window;
    for (float& f : y.angular_freq) {
        float rotations = (float)(a.block_size * old_window) * f * inv_two_pi;
        float w = (rotations - (float)a.yarn_alpha) * inv_ramp;
        w = std::min(1.0f, std::max(0.0f, w));
        f *= (float)scaling_factor + w * (float)(1 - scaling_factor);
    }
    y.attn_scale *= 0.2 * std::log((double)new_window / (double)old_window) + 1;
}

constexpr float RMS_NORM_EPS = 1.1920929e-07f;  // F.rms_norm's default for bf16 input (fp32 epsilon)

// What changes between forward passes (the record's ForwardScheduleConfig plus the YaRN state).
struct ForwardArgs {
    bool training = true;               // fp8 lm_head and the MTP loss; else bf16 and the mean loss
    std::vector<float> mtp_weights{1.f};
    int64_t ws_short = 1, ws_long = 3;  // attention windows, in blocks of block_size tokens
    YarnState yarn;
    float loss_scale = 1.f;             // training: 1 / grad_accum_steps (the loss is a sum)
    // training: the step's first micro-step. The weights change only in the optimizer, so the lm_head's
    // fp8 weight casts and the sa-scaled QKV and O weights made on the first serve them all
    bool first_micro = true;
};

// The record-61 model: forward and hand-written backward over one micro-batch. The forward keeps
// what the backward needs, per layer; in training the lm_head's backward runs inside the forward,
// chunk by chunk of logits (the loss's gradient is known: loss_scale per token), so the logits are
// never all in memory at once. Gradients accumulate into the ParamStore's gradient buffers over the
// micro-steps of a step.
class Model {
   public:
    // Training micro-batches of up to max_tokens keep every layer's activations for the backward;
    // evaluation batches of up to max_eval_tokens (forward only) rotate through two layers' worth.
    // Batches have up to max_cu_len cu_seqlens, training ones up to max_train_cu_len (default: as many).
    Model(ParamStore& params, Gemms& gemms, const Hyperparameters& args, int max_tokens, int max_eval_tokens,
          int max_cu_len, int max_train_cu_len = -1)
        : p_(params), gemms_(gemms), args_(args), max_tokens_(max_tokens), max_eval_(max_eval_tokens),
          max_cu_(max_cu_len), max_train_cu_(max_train_cu_len < 0 ? max_cu_len : std::min(max_cu_len, max_train_cu_len)) {
        const int64_t T = max_tokens, TE = std::max(max_tokens, max_eval_tokens), D = MODEL_DIM, V = PADDED_VOCAB_SIZE;
        auto bf = [&](int64_t n) { return alloc<__nv_bfloat16>(n); };
        emb_ = bf(TE * D), xs_ = bf(TE * D), x0_ = bf(TE * D), x_last_ = bf(TE * D), x_back_ = bf(TE * D), xn_ = bf(TE * D);
        rstd0_ = alloc<float>(TE), rstd_f_ = alloc<float>(TE);
        for (auto& v : ve_) v = bf(TE * D);
        // v stays in place in the QKV projection (attention reads the paired layout's half rows there)
        auto make_layer = [&](Layer& l, int64_t n, bool attention, __nv_bfloat16* x_in = nullptr) {
            l.x_in = x_in ? x_in : bf(n * D), l.x_mix = bf(n * D), l.xn_m = bf(n * D);
            l.x_attn = attention ? bf(n * D) : l.x_mix;  // no attention: x_attn is x_mix
            l.pre = bf(n * 4 * D), l.post = bf(n * 4 * D);
            l.rstd_a = alloc<float>(n), l.rstd_m = alloc<float>(n);
            if (!attention) return;
            l.xn_a = bf(n * D), l.qkv = bf(n * 3 * D), l.q = bf(n * D), l.k = bf(n * D);
            l.y = bf(n * D), l.yg = bf(n * D), l.lse = alloc<float>(NUM_HEADS * n);
        };
        // in training layer 0's input is x0 itself (nothing writes a layer's input after the forward made it)
        for (int i = 0; i < NUM_LAYERS; ++i) make_layer(layers_[i], T, has_attention(i), i == 0 ? x0_ : nullptr);
        if (max_eval_tokens > 0) {
            for (Layer& l : eval_) make_layer(l, max_eval_tokens, true);
            eval_skip_ = bf((int64_t)max_eval_tokens * D), eval_back_ = bf((int64_t)max_eval_tokens * D);
        }
        wqkvo_ = bf(NUM_ATTN_LAYERS * 4 * D * D);
        rope_positions_ = 2 * (int)TE;  // the paired-head layers rotate 2 positions per token
        rope_ = alloc<__nv_bfloat162>((int64_t)rope_positions_ * 32);
        for (int4*& t : tiles_) t = (int4*)alloc<unsigned char>(attention_tiles_bytes(2 * (int)TE, max_cu_len));
        // the backward's dS^T tiles, for the longest training window in either head layout
        const int64_t longest = std::max(*std::max_element(args.ws_schedule.begin(), args.ws_schedule.end()), args.ws_final);
        max_window_ = (int)(longest * args.block_size);
        ds_bytes_ = std::max(attention_ds_bytes((int)T, max_train_cu_, NUM_HEADS, max_window_),
                             attention_ds_bytes(2 * (int)T, max_train_cu_, NUM_HEADS / 2, max_window_));
        ds_ = (__nv_bfloat16*)alloc<unsigned char>((int64_t)ds_bytes_);
        xf8_ = alloc<uint8_t>(T * D), xf8t_ = alloc<uint8_t>(T * D);
        wf8t_ = alloc<uint8_t>(V * D), wf8_ = alloc<uint8_t>(V * D);
        logit_rows_ = (int)std::min<int64_t>(args.logit_chunk_rows, (TE + 15) / 16 * 16);
        logits_ = bf((int64_t)logit_rows_ * V);
        gf8_ = alloc<uint8_t>((int64_t)logit_rows_ * V), gf8t_ = alloc<uint8_t>((int64_t)logit_rows_ * V);
        lm_grad_ = alloc<float>(V * D);
        losses_ = alloc<float>(TE), lse_ = alloc<float>(logit_rows_), loss_ = alloc<float>(1), bad_ = alloc<int>(1);
        // backward workspaces
        dx_ = bf(T * D), dx0_ = bf(T * D), dskip_ = bf(T * D), dback_ = bf(T * D), dxn_ = bf(T * D);
        dy_ = bf(T * D), dyg_ = bf(T * D), dq_ = bf(T * D), dk_ = bf(T * D), dqkv_ = bf(T * 3 * D);
        dpre_ = bf(T * 4 * D), dxn_head_ = bf(T * D), demb_ = bf(T * D);
        for (auto& v : dve_) v = bf(T * D);
        dw_ = alloc<float>(3 * D * D), delta_ = alloc<float>(NUM_HEADS * 2 * T);
        // the gates' dz (and dlam_rows), one slot a gate: the deferred sums read them at the backward's end
        dz_ = alloc<float>(NUM_ATTN_LAYERS * NUM_HEADS * T), dz_ve_ = alloc<float>(NUM_VE_LAYERS * NUM_HEADS * T);
        dz_rows_ = alloc<float>(2 * T), dlam_rows_ = alloc<float>(2 * T);
        for (float*& sc : scales_) sc = alloc<float>(1);  // separate allocations: cuBLASLt wants 16-byte alignment
        const float vals[3] = {(float)args.lm_head_x_s, (float)args.lm_head_w_s, (float)args.lm_head_grad_s};
        for (int i = 0; i < 3; ++i) CUDA_CHECK(cudaMemcpy(scales_[i], &vals[i], 4, cudaMemcpyHostToDevice));
        embed_bwd_ = std::make_unique<EmbeddingBackward>(max_tokens);
        // a backward's scalar sums (the backout, each layer's mixing, each attention layer's two sa
        // lambdas) and gate sums (each attention layer's output gate and value-embedding gate, skip, smear)
        CUDA_CHECK(deferred_.allocate(1 + NUM_LAYERS + 2 * NUM_ATTN_LAYERS, NUM_ATTN_LAYERS + NUM_VE_LAYERS + 2));
    }
    ~Model() {
        if (side_) cudaStreamDestroy(side_);
        for (cudaEvent_t e : {ev_fork_, ev_cproj_, ev_cfc_, ev_o_, ev_qkv_, ev_head_, ev_join_})
            if (e) cudaEventDestroy(e);
    }
    Model(const Model&) = delete;
    Model& operator=(const Model&) = delete;

    // Overlap: the weight-gradient GEMMs (the lm_head's, each layer's c_proj, c_fc, O and QKV)
    // on a second stream, beside the data-gradient chain that does not need them, so that one's
    // tails, split-k reductions and the elementwise passes share the SMs with the other's tiles. The
    // same kernels on the same operands: the same bits. The trainer turns it on after the warmup (the
    // GEMM tuning times each shape alone); profiled steps run everything on one stream.
    void set_overlap(bool on) {
        if (on && !side_) {
            CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
            for (cudaEvent_t* e : {&ev_fork_, &ev_cproj_, &ev_cfc_, &ev_o_, &ev_qkv_, &ev_head_, &ev_join_})
                CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
            gemms_.add_stream(side_);
        }
        overlap_ = on;
    }

    // tokens: T + 1 ids (inputs tokens[0, T), targets tokens[1, T]); cu: cu_len cu_seqlens. Returns
    // the loss (training: the MTP loss summed over tokens times loss_scale; evaluation: the mean).
    float forward(const int32_t* tokens, const int32_t* cu, int cu_len, int T, const ForwardArgs& fa, cudaStream_t s) {
        const int max_t = fa.training ? max_tokens_ : max_eval_, max_cu = fa.training ? max_train_cu_ : max_cu_;
        if (T > max_t || cu_len > max_cu)
            fail(strprintf("forward: %d tokens / %d cu_seqlens exceed %d / %d", T, cu_len, max_t, max_cu));
        if (T % 16) fail(strprintf("forward: %d tokens is not a multiple of 16 (fp8 GEMMs)", T));
        T_ = T, tokens_ = tokens, cu_ = cu, cu_len_ = cu_len, fa_ = fa;
        for (bool& m : schedule_made_) m = false;  // a new batch: new tile schedules
        const int64_t D = MODEL_DIM, TD = (int64_t)T * D;
        profile_mark(Part::Elementwise, s);
        if (fa.yarn.angular_freq != rope_freq_) {  // a new YaRN state: the rotary table again
            qkrope::Freqs fr;
            for (int f = 0; f < 32; ++f) fr.f[f] = fa.yarn.angular_freq[2 * f];
            CUDA_CHECK(rope_table(fr, rope_positions_, rope_, s));
            rope_freq_ = fa.yarn.angular_freq;
        }
        CUDA_CHECK(cudaMemsetAsync(bad_, 0xff, sizeof(int), s));  // -1: all finite
        float* scalars = (float*)p_["scalars"].data;
        float* x0_lambdas = (float*)p_["x0_lambdas"].data;

        // the token embedding and the value embeddings ve0..ve2 (LAYERS[i].ve picks one per layer)
        CUDA_CHECK(embedding_forward(tokens, T, bf(p_["embed"].data), emb_, D, s));
        for (int k = 0; k < NUM_VALUE_EMBEDS; ++k)
            CUDA_CHECK(embedding_forward(tokens, T, bf(p_["ve" + std::to_string(k)].data), ve_[k], D, s));
        // smear the token embedding forward one position (@classiclarryd), then x = x0 = norm(x)
        gate::Params sm = row_gate(T, emb_, bf(p_["smear_gate"].data), scalars + SCALAR_SMEAR);
        sm.a = emb_, sm.out = xs_;
        CUDA_CHECK(gate_forward(GateKind::Smear, sm, s));
        CUDA_CHECK(rms_norm_forward(xs_, D, x0_, D, rstd0_, T, D, RMS_NORM_EPS, s));
        const __nv_bfloat16* x = x0_;
        for (int i = 0; i < NUM_LAYERS; ++i) {
            Layer& l = layer(i);
            if (x != l.x_in) CUDA_CHECK(cudaMemcpyAsync(l.x_in, x, TD * 2, cudaMemcpyDeviceToDevice, s));
            // evaluation rotates two layers' activations: keep the skip's and the backout's sources
            if (!fa.training && i == SKIP_IN + 1) CUDA_CHECK(cudaMemcpyAsync(eval_skip_, x, TD * 2, cudaMemcpyDeviceToDevice, s));
            if (!fa.training && i == BACKOUT_LAYER + 1)
                CUDA_CHECK(cudaMemcpyAsync(eval_back_, x, TD * 2, cudaMemcpyDeviceToDevice, s));
            // layer i-1's output is checked where this layer first reads it (before the skip changes it)
            if (i == SKIP_OUT) {  // the U-net skip from layer SKIP_IN's output, gated by x0
                CUDA_CHECK(check_finite(l.x_in, TD, bad_, i - 1, s));
                gate::Params sk = row_gate(T, x0_, bf(p_["skip_gate"].data), scalars + SCALAR_SKIP);
                sk.a = l.x_in, sk.b = skip_source();
                CUDA_CHECK(gate_forward(GateKind::Skip, sk, s));
            }
            // x_mix and its norm (attention's, or without attention the MLP's) in one pass
            const bool attn = has_attention(i);
            CUDA_CHECK(combine_norm(l.x_mix, l.x_in, x0_, T, D, {scalars + SCALAR_RESID + i, 1.f, 0.f},
                                    {x0_lambdas + i, 1.f, 0.f}, attn ? l.xn_a : l.xn_m, attn ? l.rstd_a : l.rstd_m,
                                    RMS_NORM_EPS, s, i > 0 && i != SKIP_OUT ? bad_ : nullptr, i - 1));
            if (attn) attention_forward_block(i, s);  // x_attn = x_mix + attention
            else if (l.x_attn != l.x_mix) CUDA_CHECK(cudaMemcpyAsync(l.x_attn, l.x_mix, TD * 2, cudaMemcpyDeviceToDevice, s));
            // MLP: x += relu(norm(x) c_fc^T)^2 c_proj (ReLU^2: arXiv 2109.08668, suggested by @SKYLINEZ007 and
            // @Grad62304977)
            if (attn) CUDA_CHECK(rms_norm_forward(l.x_attn, D, l.xn_m, D, l.rstd_m, T, D, RMS_NORM_EPS, s));
            {
                ProfiledPart gemm(Part::Gemm, s, 2.0 * T * 4 * D * D, false, "c_fc + ReLU^2 (ours)");
                CUDA_CHECK(linear_relu_square_forward(l.xn_m, c_fc(i), T, 4 * D, D, l.pre, l.post, s));
            }
            __nv_bfloat16* out = i + 1 < NUM_LAYERS ? layer(i + 1).x_in : x_last_;
            gemms_.bf16(s, Op::N, Op::N, T, D, 4 * D, l.post, 4 * D, c_proj(i), D, out, D, false, 1.f, 1.f, l.x_attn);
            x = out;
        }
        // back out the contribution of layers 0..BACKOUT_LAYER (only needed as context), then the final norm
        CUDA_CHECK(combine_norm(x_back_, x_last_, backout_source(), T, D, {nullptr, 0.f, 1.f},
                                {scalars + SCALAR_BACKOUT, -1.f, 0.f}, xn_, rstd_f_, RMS_NORM_EPS, s, bad_, NUM_LAYERS - 1));
        return head_and_loss(s);
    }

    // The backward of the last training forward: adds every parameter's gradient into its buffer.
    void backward(cudaStream_t s) {
        if (!fa_.training) fail("backward: the last forward pass was an evaluation");
        const int T = T_;
        const int64_t D = MODEL_DIM, TD = (int64_t)T * D;
        float* scalars = (float*)p_["scalars"].data;
        float* gscalars = (float*)p_["scalars"].grad;
        float* gx0l = (float*)p_["x0_lambdas"].grad;
        float* x0_lambdas = (float*)p_["x0_lambdas"].data;
        profile_mark(Part::Elementwise, s);
        // dx0, dskip, dback and each dve take their first term by writing it (the last layer's mix, the
        // skip gate, the backout, the last layer of each value embedding), not added to a zeroed buffer
        for (bool& w : dve_written_) w = false;
        // final norm, then the backout: x_back = x_last - lambda x_8in
        CUDA_CHECK(rms_norm_backward(x_back_, D, dxn_head_, D, rstd_f_, dx_, D, T, D, s));
        CUDA_CHECK(combine_backward(dx_, x_last_, backout_source(), dx_, false, dback_, false, TD, {nullptr, 0.f, 1.f},
                                    {scalars + SCALAR_BACKOUT, -1.f, 0.f}, nullptr, gscalars + SCALAR_BACKOUT, nullptr, s, &deferred_));
        for (int i = NUM_LAYERS - 1; i >= 0; --i) {
            Layer& l = layers_[i];
            // dx: the gradient of this layer's output (the backout's and the skip's parts joined it in the
            // layer above's norm_mix_backward)
            // MLP: out = x_attn + post c_proj
            gemms_.bf16(side(s), Op::T, Op::N, 4 * D, D, T, l.post, 4 * D, dx_, D, c_proj_grad(i), D, false, 1.f, 1.f);
            side_mark(ev_cproj_);
            side_wait(ev_cfc_, s);  // dpre: the layer above's c_fc weight gradient has read it
            {
                ProfiledPart gemm(Part::Gemm, s, 2.0 * T * 4 * D * D, false, "c_proj^T + ReLU^2' (ours)");
                CUDA_CHECK(linear_relu_square_backward(dx_, c_proj(i), T, 4 * D, D, l.pre, dpre_, s));
            }
            gemms_.bf16(side(s), Op::T, Op::N, 4 * D, D, T, dpre_, 4 * D, l.xn_m, D, c_fc_grad(i), D, false, 1.f, 1.f);
            side_mark(ev_cfc_);
            gemms_.bf16(s, Op::N, Op::N, T, D, 4 * D, dpre_, 4 * D, c_fc(i), D, dxn_, D, false);
            // the block's first norm (attention's, or without attention the MLP's) and the mixing
            // x_mix = resid x_in + x0_lambda x0 go back in one pass
            const float* rstd = l.rstd_m;
            side_wait(ev_cproj_, s);  // dx is rewritten below: c_proj's weight gradient has read it
            if (has_attention(i)) {
                CUDA_CHECK(rms_norm_backward(l.x_attn, D, dxn_, D, l.rstd_m, dx_, D, T, D, s, true));
                attention_backward_block(i, s);  // dxn_: the gradient of norm(x_mix)
                rstd = l.rstd_a;
                side_wait(ev_o_, s);  // and O's
            }
            // x_in's gradient gathers the other uses of layer i-1's output: the backout's and the skip
            // source's (not below the skip's own layer, whose gate reads dx as it is); layer 0's x_in is x0
            NormMixFolds folds;
            if (i == BACKOUT_LAYER + 1) folds.add0 = dback_;
            if (i == SKIP_IN + 1) folds.add1 = dskip_;
            folds.into_dy = i == 0;
            CUDA_CHECK(norm_mix_backward(dxn_, rstd, dx_, l.x_in, x0_, dx0_, i == NUM_LAYERS - 1, T, {scalars + SCALAR_RESID + i, 1.f, 0.f},
                                         {x0_lambdas + i, 1.f, 0.f}, gscalars + SCALAR_RESID + i, gx0l + i, nullptr, s, &deferred_,
                                         folds));
            if (i == SKIP_OUT) {  // skip: x_in += c 2 sigmoid(z(x0)) skip_source; dx passes through
                gate::Params sk = row_gate(T, x0_, bf(p_["skip_gate"].data), scalars + SCALAR_SKIP);
                sk.b = skip_source(), sk.dout = dx_, sk.ld_dout = D, sk.db = dskip_, sk.ld_db = D, sk.db_first = true;
                sk.dz = dz_rows_, sk.dlam_rows = dlam_rows_;
                CUDA_CHECK(gate_backward(GateKind::Skip, sk, dx0_, D, bf(p_["skip_gate"].grad), gscalars + SCALAR_SKIP, s, &deferred_));
            }
            if (grad_ready_) {  // layer i's bank slices are final
                side_join(s);
                grad_ready_(ReducePoint::AfterLayer, i, s);
            }
        }
        for (int k = 0; k < NUM_VALUE_EMBEDS; ++k)  // (a table no layer reads has a zero gradient)
            if (!dve_written_[k]) CUDA_CHECK(cudaMemsetAsync(dve_[k], 0, TD * 2, s));
        // (layer 0's input is x0: dx0 holds its whole gradient)
        // x0 = norm(smear(emb))
        CUDA_CHECK(rms_norm_backward(xs_, D, dx0_, D, rstd0_, dx_, D, T, D, s));
        gate::Params sm = row_gate(T, emb_, bf(p_["smear_gate"].data), scalars + SCALAR_SMEAR);
        sm.a = emb_, sm.dout = dx_, sm.ld_dout = D, sm.da = demb_, sm.ld_da = D, sm.dz = dz_rows_ + T, sm.dlam_rows = dlam_rows_ + T;
        CUDA_CHECK(gate_backward(GateKind::Smear, sm, demb_, D, bf(p_["smear_gate"].grad), gscalars + SCALAR_SMEAR, s, &deferred_));
        side_join(s);  // every weight gradient (and the side stream's deferred sums) before the sums' finish
        CUDA_CHECK(deferred_.finish(s));  // the scalar and gate-weight gradients of every pass above
        // embeddings: one sort of the token ids serves the four tables
        profile_mark(Part::EmbedBwd, s);
        CUDA_CHECK(embed_bwd_->sort(tokens_, T, s));
        const __nv_bfloat16* grads[1 + NUM_VALUE_EMBEDS] = {demb_};
        __nv_bfloat16* table_grads[1 + NUM_VALUE_EMBEDS] = {bf(p_["embed"].grad)};
        for (int k = 0; k < NUM_VALUE_EMBEDS; ++k)
            grads[1 + k] = dve_[k], table_grads[1 + k] = bf(p_["ve" + std::to_string(k)].grad);
        CUDA_CHECK(embed_bwd_->accumulate(1 + NUM_VALUE_EMBEDS, grads, D, table_grads, s));
    }

    // Called where gradients become final (after the head's backward, after each layer's), while
    // set: the trainer starts their reduces there in a step's last micro-step.
    void set_grad_ready(std::function<void(ReducePoint, int, cudaStream_t)> fn) { grad_ready_ = std::move(fn); }

    // norm(x) before the lm_head, from the last forward (T x 768)
    const __nv_bfloat16* final_hidden() const { return xn_; }

   private:
    int logit_rows_ = 0;  // the logits are made and consumed in chunks of rows (--logit_chunk_rows)

    struct Layer {
        __nv_bfloat16 *x_in, *x_mix, *x_attn, *xn_m, *pre, *post;           // every layer
        __nv_bfloat16 *xn_a = nullptr, *qkv = nullptr, *q = nullptr, *k = nullptr, *y = nullptr,
                      *yg = nullptr;                                        // attention layers
        float *rstd_a = nullptr, *rstd_m = nullptr, *lse = nullptr;
    };

    template <typename T>
    T* alloc(int64_t n) { return arena_.alloc<T>(n); }
    static __nv_bfloat16* bf(void* p) { return as_bf16(p); }
    // layer i's activations in this forward: its own in training, one of two alternating in evaluation
    Layer& layer(int i) { return fa_.training ? layers_[i] : eval_[i & 1]; }
    // layer SKIP_IN's and BACKOUT_LAYER's outputs (the next layers' inputs)
    __nv_bfloat16* skip_source() { return fa_.training ? layers_[SKIP_IN + 1].x_in : eval_skip_; }
    __nv_bfloat16* backout_source() { return fa_.training ? layers_[BACKOUT_LAYER + 1].x_in : eval_back_; }
    // bank slices: layer i's attention weights (q, k, v, o rows) and MLP matrices
    __nv_bfloat16* scaled_qkvo(int i) { return wqkvo_ + (int64_t)attn_slot(i) * 4 * MODEL_DIM * MODEL_DIM; }
    const __nv_bfloat16* attn_w(int i) { return bf(p_["attn"].data) + (int64_t)attn_slot(i) * 4 * MODEL_DIM * MODEL_DIM; }
    __nv_bfloat16* attn_grad(int i) { return bf(p_["attn"].grad) + (int64_t)attn_slot(i) * 4 * MODEL_DIM * MODEL_DIM; }
    const __nv_bfloat16* c_fc(int i) { return bf(p_["mlp"].data) + (int64_t)i * 8 * MODEL_DIM * MODEL_DIM; }
    const __nv_bfloat16* c_proj(int i) { return c_fc(i) + 4 * MODEL_DIM * MODEL_DIM; }
    __nv_bfloat16* c_fc_grad(int i) { return bf(p_["mlp"].grad) + (int64_t)i * 8 * MODEL_DIM * MODEL_DIM; }
    __nv_bfloat16* c_proj_grad(int i) { return c_fc_grad(i) + 4 * MODEL_DIM * MODEL_DIM; }
    // layer i's gate weights: its slot of the attention-gate bank, of the value-embedding gate bank
    const __nv_bfloat16* attn_gate_w(int i) { return bf(p_["attn_gate_bank"].data) + attn_slot(i) * NUM_HEADS * gate::GW; }
    __nv_bfloat16* attn_gate_grad(int i) { return bf(p_["attn_gate_bank"].grad) + attn_slot(i) * NUM_HEADS * gate::GW; }
    const __nv_bfloat16* ve_gate_w(int i) { return bf(p_["ve_gate_bank"].data) + ve_gate_slot(i) * NUM_HEADS * gate::GW; }
    __nv_bfloat16* ve_gate_grad(int i) { return bf(p_["ve_gate_bank"].grad) + ve_gate_slot(i) * NUM_HEADS * gate::GW; }

    // The overlap's streams: side(s) is the stream for work that may run beside s from this point
    // on (s itself when not overlapping); side_mark(e) marks the side stream's work so far as e,
    // side_wait(e, s) makes s wait for it (before s rewrites what that work reads), side_join(s) for all
    bool overlapping() const { return overlap_ && !g_profiler; }
    cudaStream_t side(cudaStream_t s) {
        if (!overlapping()) return s;
        CUDA_CHECK(cudaEventRecord(ev_fork_, s));
        CUDA_CHECK(cudaStreamWaitEvent(side_, ev_fork_, 0));
        return side_;
    }
    void side_mark(cudaEvent_t e) {
        if (overlapping()) CUDA_CHECK(cudaEventRecord(e, side_));
    }
    void side_wait(cudaEvent_t e, cudaStream_t s) {
        if (overlapping()) CUDA_CHECK(cudaStreamWaitEvent(s, e, 0));
    }
    void side_join(cudaStream_t s) { side_mark(ev_join_), side_wait(ev_join_, s); }

    gate::Params row_gate(int T, const __nv_bfloat16* x, const __nv_bfloat16* w, const float* lambda) {
        gate::Params g{};
        g.tokens = T, g.heads = 1, g.x = x, g.ld_x = MODEL_DIM, g.w = w, g.lambda = lambda;
        g.ld_a = g.ld_b = g.ld_out = g.ld_dout = g.ld_da = g.ld_db = MODEL_DIM;
        return g;
    }
    gate::Params head_gate(int i, const __nv_bfloat16* w) {
        gate::Params g{};
        g.tokens = T_, g.heads = NUM_HEADS, g.x = layer(i).xn_a, g.ld_x = MODEL_DIM, g.w = w;
        g.ld_a = g.ld_b = g.ld_out = g.ld_dout = g.ld_da = g.ld_db = MODEL_DIM;
        return g;
    }
    // layer i's v and its gradient, in place in the QKV projection and its gradient (token rows of
    // 3 * 768); the paired layout's 2T positions are their half rows
    static constexpr int64_t VALUE_LD = 3 * MODEL_DIM;
    __nv_bfloat16* value(int i) { return layer(i).qkv + 2 * MODEL_DIM; }
    __nv_bfloat16* value_grad() { return dqkv_ + 2 * MODEL_DIM; }
    attn::Params attn_params(int i) {
        Layer& l = layer(i);
        const bool paired = paired_head(i);
        const int64_t stride = paired ? MODEL_DIM / 2 : MODEL_DIM;
        attn::Params ap{};
        ap.q = l.q, ap.k = l.k, ap.v = value(i), ap.q_stride = ap.k_stride = stride;
        ap.v_stride = VALUE_LD, ap.v_shift = paired ? 1 : 0, ap.v_half = paired ? MODEL_DIM / 2 : 0;
        ap.o = l.y, ap.o_stride = stride, ap.lse = l.lse;
        ap.cu_seqlens = cu_, ap.cu_len = cu_len_, ap.cu_mult = paired ? 2 : 1;
        ap.positions = paired ? 2 * T_ : T_, ap.heads = paired ? NUM_HEADS / 2 : NUM_HEADS;
        ap.window = (int)((long_window(i) ? fa_.ws_long : fa_.ws_short) * args_.block_size);
        ap.scale = (float)fa_.yarn.attn_scale, ap.tiles = tiles_[schedule_slot(i)], ap.ds = ds_;
        ap.dout = dy_, ap.dout_stride = stride, ap.dq = dq_, ap.dk = dk_, ap.dv = value_grad();
        ap.dq_stride = ap.dk_stride = stride, ap.dv_stride = ap.v_stride, ap.delta = delta_;
        return ap;
    }
    qkrope::Params rope_params(int i) {
        Layer& l = layer(i);
        qkrope::Params qr{};
        qr.qkv = l.qkv, qr.ld = 3 * MODEL_DIM, qr.q = l.q, qr.k = l.k, qr.tokens = T_, qr.heads = NUM_HEADS;
        qr.rope = rope_;
        qr.eps = RMS_NORM_EPS, qr.paired = paired_head(i), qr.key_offset = long_window(i);
        qr.dq = dq_, qr.dk = dk_, qr.dqkv = dqkv_, qr.ld_grad = 3 * MODEL_DIM;
        return qr;
    }

    // x_attn = x_mix + O(gate(attention(rope(norm(q)), rope(norm(k)), v + ve gate))) of norm(x_mix): QK norm
    // (@Grad62304977), value embeddings gated into v (@KoszarskyB, @Grad62304977), varlen flash attention
    // (over flex attention, @varunneal; varlen suggested by @YouJiacheng), output gate (@classiclarryd)
    void attention_forward_block(int i, cudaStream_t s) {
        Layer& l = layer(i);
        const int T = T_;
        const int64_t D = MODEL_DIM;
        float* scalars = (float*)p_["scalars"].data;
        // (the caller made xn_a = norm(x_mix) with x_mix)
        // sa lambdas pre-multiply the QKV and O weights (@shenberg); kept for the step's later micro-steps
        // and the backward
        __nv_bfloat16 *wqkv = scaled_qkvo(i), *wo = wqkv + 3 * D * D;
        if (!fa_.training || fa_.first_micro) {
            CUDA_CHECK(scale_weight(wqkv, attn_w(i), 3 * D * D, scalars + SCALAR_SA + 2 * i, s));
            CUDA_CHECK(scale_weight(wo, attn_w(i) + 3 * D * D, D * D, scalars + SCALAR_SA + 2 * i + 1, s));
        }
        gemms_.bf16(s, Op::N, Op::T, T, 3 * D, D, l.xn_a, D, wqkv, D, l.qkv, 3 * D, false);
        CUDA_CHECK(qk_norm_rope_forward(rope_params(i), s));
        __nv_bfloat16* v = value(i);
        if (has_value_embed(i)) {
            gate::Params vg = head_gate(i, ve_gate_w(i));
            vg.a = v, vg.ld_a = VALUE_LD, vg.b = ve_[LAYERS[i].ve];
            CUDA_CHECK(gate_forward(GateKind::ValueEmbedding, vg, s));
        }
        bool& made = schedule_made_[schedule_slot(i)];
        {
            ProfiledPart part(Part::AttentionFwd, s);
            CUDA_CHECK(attention_forward(attn_params(i), s, !made));
        }
        made = true;
        gate::Params og = head_gate(i, attn_gate_w(i));
        og.a = l.y, og.out = l.yg;
        CUDA_CHECK(gate_forward(GateKind::Output, og, s));
        gemms_.bf16(s, Op::N, Op::T, T, D, D, l.yg, D, wo, D, l.x_attn, D, false, 1.f, 1.f, l.x_mix);  // x_mix + y o
    }

    // dx holds d x_attn on entry (and on return); dxn gets the gradient of norm(x_mix) (the caller
    // takes it through the norm, together with the mixing)
    void attention_backward_block(int i, cudaStream_t s) {
        Layer& l = layers_[i];
        const int T = T_;
        const int64_t D = MODEL_DIM;
        float* scalars = (float*)p_["scalars"].data;
        float* gscalars = (float*)p_["scalars"].grad;
        // O projection with W'o = sa1 Wo (the forward's): dyg = dx W'o, dW'o = dx^T yg
        const __nv_bfloat16 *wqkv = scaled_qkvo(i), *wo = wqkv + 3 * D * D;
        gemms_.bf16(s, Op::N, Op::N, T, D, D, dx_, D, wo, D, dyg_, D, false);
        cudaStream_t w = side(s);
        gemms_.bf16(w, Op::T, Op::N, D, D, T, dx_, D, l.yg, D, dw_, D, true);
        CUDA_CHECK(scale_weight_backward(dw_, attn_w(i) + 3 * D * D, attn_grad(i) + 3 * D * D, D * D,
                                         scalars + SCALAR_SA + 2 * i + 1, gscalars + SCALAR_SA + 2 * i + 1, nullptr, w, &deferred_));
        side_mark(ev_o_);
        // output gate: dy (its input gradient joins dxn after the QKV backward: dz kept till then)
        gate::Params og = head_gate(i, attn_gate_w(i));
        og.a = l.y, og.dout = dyg_, og.da = dy_, og.dz = dz_ + (int64_t)attn_slot(i) * NUM_HEADS * T;
        og.delta = delta_, og.delta_split = paired_head(i) ? 2 : 1;  // attention's delta, in the same pass
        CUDA_CHECK(gate_backward(GateKind::Output, og, nullptr, 0, attn_gate_grad(i), nullptr, s, &deferred_));
        // attention (its tile schedule as the forward made it)
        attn::Params ap = attn_params(i);
        if (attention_ds_bytes(ap.positions, ap.cu_len, ap.heads, ap.window) > ds_bytes_)
            fail(strprintf("attention backward: window %d exceeds the %d the dS workspace was sized for", ap.window,
                           max_window_));
        side_wait(ev_qkv_, s);  // attention writes dv into dqkv: the layer above's QKV weight gradient has read it
        {
            ProfiledPart part(Part::AttentionBwd, s);
            CUDA_CHECK(attention_backward(ap, s, true));
        }
        // value-embedding gate: v passes through; dve (its input gradient too joins dxn later)
        const __nv_bfloat16* dv = value_grad();
        gate::Params vg = head_gate(i, ve_gate_w(i));
        if (has_value_embed(i)) {
            const int k = LAYERS[i].ve;
            vg.b = ve_[k], vg.dout = dv, vg.ld_dout = VALUE_LD, vg.db = dve_[k], vg.db_first = !dve_written_[k];
            vg.dz = dz_ve_ + (int64_t)ve_gate_slot(i) * NUM_HEADS * T;
            dve_written_[k] = true;
            CUDA_CHECK(gate_backward(GateKind::ValueEmbedding, vg, nullptr, 0, ve_gate_grad(i), nullptr, s, &deferred_));
        }
        // dqkv: q, k through the rope and the QK norm (attention wrote dv in place)
        CUDA_CHECK(qk_norm_rope_backward(rope_params(i), s));
        // QKV projection with W'qkv = sa0 Wqkv (the forward's)
        // (written, not added to: the gates' input gradients, on 12 of its columns, follow)
        gemms_.bf16(s, Op::N, Op::N, T, D, 3 * D, dqkv_, 3 * D, wqkv, D, dxn_, D, false);
        CUDA_CHECK(gate_input_grad(og, dxn_, D, s));
        if (has_value_embed(i)) CUDA_CHECK(gate_input_grad(vg, dxn_, D, s));
        w = side(s);
        gemms_.bf16(w, Op::T, Op::N, 3 * D, D, T, dqkv_, 3 * D, l.xn_a, D, dw_, D, true);
        CUDA_CHECK(scale_weight_backward(dw_, attn_w(i), attn_grad(i), 3 * D * D, scalars + SCALAR_SA + 2 * i,
                                         gscalars + SCALAR_SA + 2 * i, nullptr, w, &deferred_));
        side_mark(ev_qkv_);
    }

    // lm_head (fp8 in training, @YouJiacheng; transposed weight, @ChrisJMcCormick) on norm(x) in
    // xn_, then the soft-capped cross-entropy (tanh soft-capping after Gemma 2 by @Grad62304977,
    // reduced from 30 to 15 by @KoszarskyB, shifted by +15 by @YouJiacheng, 23 sigmoid((l + 5) / 7.5)
    // by @classiclarryd), chunk by chunk of rows. In training each chunk's
    // backward follows at once: the gradient (e5m2) of the logits gives d norm(x) and the lm_head's
    // gradient, as the record's mm_t backward does.
    float head_and_loss(cudaStream_t s) {
        const int T = T_;
        const int64_t D = MODEL_DIM, V = PADDED_VOCAB_SIZE;
        const __nv_bfloat16* lm_head = bf(p_["lm_head"].data);
        const bool training = fa_.training;
        profile_mark(Part::Head, s);
        if (training) {
            side_wait(ev_head_, s);  // (a training forward with no backward after it: its weight gradient reads x^T)
            CUDA_CHECK(cast_to_fp8(xn_, D, xf8_, D, T, D, (float)args_.lm_head_x_s, false, false, s));
            CUDA_CHECK(cast_to_fp8(xn_, D, xf8t_, T, T, D, (float)args_.lm_head_x_s, false, true, s));
            if (fa_.first_micro) {
                CUDA_CHECK(cast_to_fp8(lm_head, V, wf8t_, D, D, V, (float)args_.lm_head_w_s, false, true, s));
                CUDA_CHECK(cast_to_fp8(lm_head, V, wf8_, V, D, V, (float)args_.lm_head_w_s, false, false, s));
            }
        }
        for (int r0 = 0; r0 < T; r0 += logit_rows_) {
            const int rows = std::min(logit_rows_, T - r0);
            ce::Params cp{};
            cp.logits = logits_, cp.ld = V, cp.targets = tokens_ + 1 + r0, cp.rows = rows, cp.target_rows = T - r0;
            cp.vocab = V;
            const std::vector<float> w = training ? fa_.mtp_weights : std::vector<float>{1.f};
            cp.n_predict = (int)w.size();
            for (size_t k = 0; k < w.size(); ++k) cp.w[k] = w[k];
            cp.a = (float)args_.softcap_a, cp.b = (float)args_.softcap_b, cp.c = (float)args_.softcap_c;
            cp.losses = losses_ + r0;
            cp.lse = training ? lse_ : nullptr, cp.grad_scale = fa_.loss_scale, cp.fast_softcap = training;
            if (training)
                gemms_.fp8(s, rows, V, D, xf8_ + (int64_t)r0 * D, CUDA_R_8F_E4M3, D, wf8t_, CUDA_R_8F_E4M3, D, logits_, V,
                           false, scales_[0], scales_[1], true);
            else
                gemms_.bf16(s, Op::N, Op::N, rows, V, D, xn_ + (int64_t)r0 * D, D, lm_head, V, logits_, V, false);
            profile_mark(Part::Loss, s);
            CUDA_CHECK(softcapped_cross_entropy(cp, s));
            if (training) {  // the gradient of the logits, e5m2, in the two layouts of the GEMMs below
                side_wait(ev_head_, s);  // (the last chunk's weight gradient has read g^T)
                CUDA_CHECK(softcapped_ce_grad_fp8(cp, gf8_, V, gf8t_, rows, (float)args_.lm_head_grad_s, s));
            }
            profile_mark(Part::Head, s);
            if (!training) continue;
            // d norm(x) = g w^T; d lm_head = x^T g (fp32, as the record's grad_w: the first chunk writes it)
            gemms_.fp8(s, rows, D, V, gf8_, CUDA_R_8F_E5M2, V, wf8_, CUDA_R_8F_E4M3, V, dxn_head_ + (int64_t)r0 * D, D,
                       false, scales_[2], scales_[1], false);
            gemms_.fp8(side(s), D, V, rows, xf8t_ + r0, CUDA_R_8F_E4M3, T, gf8t_, CUDA_R_8F_E5M2, rows, lm_grad_, V, true,
                       scales_[0], scales_[2], false, r0 > 0 ? 1.f : 0.f);
            side_mark(ev_head_);
        }
        if (training) {
            CUDA_CHECK(add_to_bf16(bf(p_["lm_head"].grad), lm_grad_, V * D, side(s)));
            side_mark(ev_head_);
        }
        if (training && grad_ready_) {  // lm_head's gradient is final
            side_wait(ev_head_, s);
            grad_ready_(ReducePoint::AfterHead, -1, s);
        }
        profile_mark(Part::Loss, s);
        CUDA_CHECK(sum_floats(losses_, T, loss_, training ? fa_.loss_scale : 1.f / T, s));
        float loss;
        int bad;
        CUDA_CHECK(cudaMemcpyAsync(&loss, loss_, 4, cudaMemcpyDeviceToHost, s));
        CUDA_CHECK(cudaMemcpyAsync(&bad, bad_, 4, cudaMemcpyDeviceToHost, s));
        profile_mark(Part::Host, s);  // the GPU idles from the readback until the host queues more
        CUDA_CHECK(cudaStreamSynchronize(s));
        if (bad >= 0) fail(strprintf("the forward pass produced a NaN or infinity in layer %d's output", bad));
        if (!std::isfinite(loss)) fail("the forward pass produced a non-finite loss (the lm_head or the loss)");
        return loss;
    }

    ParamStore& p_;
    Gemms& gemms_;
    const Hyperparameters& args_;
    int max_tokens_, max_eval_, max_cu_, max_train_cu_;
    // the last forward's batch and schedule, for its backward
    int T_ = 0, cu_len_ = 0;
    const int32_t *tokens_ = nullptr, *cu_ = nullptr;
    ForwardArgs fa_;
    DeviceArena arena_;
    Layer layers_[NUM_LAYERS], eval_[2];
    __nv_bfloat16 *eval_skip_ = nullptr, *eval_back_ = nullptr;
    __nv_bfloat16 *emb_, *xs_, *x0_, *x_last_, *x_back_, *xn_, *ve_[NUM_VALUE_EMBEDS], *wqkvo_, *logits_;
    __nv_bfloat162* rope_ = nullptr;  // the rotary table for rope_freq_
    int rope_positions_ = 0;
    std::vector<float> rope_freq_;
    float *rstd0_, *rstd_f_, *losses_, *lse_, *loss_, *lm_grad_, *scales_[3];  // x_s, w_s, grad_s
    int* bad_;  // the first layer whose output was not finite, or -1
    // attention's tile schedules, one per head layout and window (schedule_slot): the forward makes
    // each where a layer first needs it, the backward reuses them
    static constexpr int SCHEDULES = 4;
    int4* tiles_[SCHEDULES];
    bool schedule_made_[SCHEDULES] = {};
    static int schedule_slot(int i) { return (paired_head(i) ? 2 : 0) + (long_window(i) ? 1 : 0); }
    __nv_bfloat16* ds_;  // attention's dS^T tiles (backward)
    size_t ds_bytes_ = 0;
    int max_window_ = 0;
    uint8_t *xf8_, *xf8t_, *wf8t_, *wf8_, *gf8_, *gf8t_;
    __nv_bfloat16 *dx_, *dx0_, *dskip_, *dback_, *dxn_, *dy_, *dyg_, *dq_, *dk_, *dqkv_, *dpre_,
        *dxn_head_, *demb_, *dve_[NUM_VALUE_EMBEDS];
    float *dw_, *delta_, *dz_, *dz_ve_, *dz_rows_, *dlam_rows_;  // dz_rows_, dlam_rows_: skip's, then smear's
    bool dve_written_[NUM_VALUE_EMBEDS] = {};  // the backward so far wrote dve_[k]
    std::unique_ptr<EmbeddingBackward> embed_bwd_;
    DeferredSums deferred_;  // the backward's scalar and gate-weight sums (their partial sums too), added at its end
    std::function<void(ReducePoint, int, cudaStream_t)> grad_ready_;
    bool overlap_ = false;
    cudaStream_t side_ = nullptr;
    // the side stream's marks: the weight gradients that read the head's g^T, dx (c_proj's, O's),
    // dpre (c_fc's) and dqkv (QKV's)
    cudaEvent_t ev_fork_ = nullptr, ev_cproj_ = nullptr, ev_cfc_ = nullptr, ev_o_ = nullptr, ev_qkv_ = nullptr,
                ev_head_ = nullptr, ev_join_ = nullptr;
};

// -----------------------------------------------------------------------------
// Optimizer, the update: NorMuonAndAdam follows the param_table above (its communication in
// scatter_order, its updates in work_order), with Polar Express for the banks.

// Polar Express (Amsel, Persson, Musco, Gower, arXiv 2505.16932): 5 fixed iterations
// X <- a X + (b A + c A A) X with A = X X^T, in bf16, on the wide orientation of each matrix,
// after Frobenius normalisation (x 1.02 + 1e-6). Coefficients of record 61 (num_iters 5, safety
// factor 2e-2, cushion 2). The record computes A = X X^T and b A + c A A with Triton kernels
// (@byronxu99) that make only the tiles on and above the diagonal; here all three products are
// cuBLASLt's batched GEMMs: whole products (twice the tensor work for the two symmetric ones) took
// 1.06 and 2.11 ms for a step's attention and MLP banks where triangle-only kernels of ours took
// 1.63 and 2.54 (64 x 64 tiles) or 1.19 and 2.00 (128 x 128 TMA tiles: the same step total, other
// bits; records/tried.md), and a 35-step run's parameters and optimizer state kept their bits.
static const float polar_express_coeffs[5][3] = {
    {8.156554524902461f, -22.48329292557795f, 15.878769915207462f},
    {4.042929935166739f, -2.808917465908714f, 0.5000178451051316f},
    {3.8916678022926607f, -2.772484153217685f, 0.5060648178503393f},
    {3.285753657755655f, -2.3681294933425376f, 0.46449024233003106f},
    {2.3465413258596377f, -1.7097828382687081f, 0.42323551169305323f}};

class PolarExpress {
   public:
    // for batches of up to `count` matrices of rows x cols
    PolarExpress(int count, int rows, int cols) : count_(count), rows_(rows), cols_(cols) {
        const int64_t n = (int64_t)count * rows * cols, m = std::min(rows, cols);
        CUDA_CHECK(cudaMalloc(&x_[0], n * sizeof(__nv_bfloat16)));
        CUDA_CHECK(cudaMalloc(&x_[1], n * sizeof(__nv_bfloat16)));
        CUDA_CHECK(cudaMalloc(&a_, (int64_t)count * m * m * sizeof(__nv_bfloat16)));
        CUDA_CHECK(cudaMalloc(&b_, (int64_t)count * m * m * sizeof(__nv_bfloat16)));
        CUDA_CHECK(cudaMalloc(&partial_, (int64_t)count * opt::NORM_BLOCKS * sizeof(float)));
    }
    ~PolarExpress() {
        for (void* p : {(void*)x_[0], (void*)x_[1], (void*)a_, (void*)b_, (void*)partial_}) CUDA_CHECK(cudaFree(p));
    }
    PolarExpress(const PolarExpress&) = delete;
    PolarExpress& operator=(const PolarExpress&) = delete;

    // out (bf16, count x rows x cols) = the orthogonalised g (fp32, same shape)
    void run(Gemms& gemms, const float* g, __nv_bfloat16* out, int count, cudaStream_t stream) {
        if (count > count_) fatal(strprintf("PolarExpress: %d matrices, room for %d", count, count_));
        const bool tall = rows_ > cols_;
        const int m = std::min(rows_, cols_), n = std::max(rows_, cols_);  // X is m x n, wide
        const int64_t mn = (int64_t)m * n, mm = (int64_t)m * m;
        CUDA_CHECK(frobenius_normalize(g, x_[0], count, mn, partial_, stream));
        __nv_bfloat16* x = x_[0];
        __nv_bfloat16* next = x_[1];
        if (tall) {
            CUDA_CHECK(transpose_bf16(x_[0], x_[1], count, rows_, cols_, stream));
            std::swap(x, next);
        } else {
            next = out;  // the 5 iterations end in out
        }
        for (int it = 0; it < 5; ++it) {
            const float a = polar_express_coeffs[it][0], b = polar_express_coeffs[it][1], c = polar_express_coeffs[it][2];
            gemms.bf16_batched(stream, count, Op::N, Op::T, m, m, n, x, n, mn, x, n, mn, a_, a_, m, mm, 1.f, 0.f);  // A = X X^T
            gemms.bf16_batched(stream, count, Op::N, Op::T, m, m, m, a_, m, mm, a_, m, mm, a_, b_, m, mm, c, b);  // B = b A + c A A
            gemms.bf16_batched(stream, count, Op::N, Op::N, m, n, m, b_, m, mm, x, n, mn, x, next, n, mn, 1.f, a);  // a X + B X
            std::swap(x, next);
        }
        if (tall) CUDA_CHECK(transpose_bf16(x, out, count, m, n, stream));
    }

   private:
    int count_, rows_, cols_;
    __nv_bfloat16* x_[2] = {nullptr, nullptr};
    __nv_bfloat16 *a_ = nullptr, *b_ = nullptr;
    float* partial_ = nullptr;
};

// NCCL over the MPI ranks, from rank 0's unique id broadcast over MPI; none at world size 1.
static ncclComm_t nccl_init(int rank, int world_size) {
    if (world_size == 1) return nullptr;
    ncclUniqueId id;
    if (rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    MPI_CHECK(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD));
    ncclComm_t comm = nullptr;
    NCCL_CHECK(ncclCommInitRank(&comm, world_size, id, rank));
    return comm;
}

// The optimizer step of record 61. In work_order, per parameter: Adam (on odd steps; the gradients
// of Adam parameters accumulate over two steps) or NorMuon (every step). While embed is tied to
// lm_head, embed's gradient is added transposed into lm_head's before the update and embed is
// written as lm_head^T after it; at the untie step lm_head's Adam state moves, transposed, to embed.
// On several GPUs the step follows step_plan: NCCL reduces on their own stream in scatter_order,
// each update waits only for its own reduce, each sharded update's all-gather starts as soon as it
// is done, and the compute stream waits for every gather before the next forward pass.
// The optimizer's host state as a checkpoint keeps it (NorMuonAndAdam::host_state()): tied or
// untied, and each Adam parameter's step count, once each, at most the steps done.
struct OptimizerHostState {
    bool split = false;
    std::map<std::string, int64_t> adam_steps;
};
static OptimizerHostState parse_optimizer_state(const std::string& text, const std::vector<ParamConfig>& cfgs,
                                                int64_t steps_done) {
    OptimizerHostState h;
    bool seen_split = false;
    for (const std::string& line : split(text, '\n')) {
        if (line.empty()) continue;
        const std::vector<std::string> w = split(line, ' ');
        if (w.size() == 2 && w[0] == "split" && (w[1] == "0" || w[1] == "1") && !seen_split) {
            h.split = w[1] == "1", seen_split = true;
        } else if (w.size() == 3 && w[0] == "adam_steps") {
            auto c = std::find_if(cfgs.begin(), cfgs.end(), [&](const ParamConfig& c) { return c.label == w[1]; });
            if (c == cfgs.end() || c->optim != Optim::Adam) fail("optimizer state: '" + w[1] + "' is not an Adam parameter");
            const int64_t t = parse_i64("adam_steps", w[2]);
            if (t < 0 || t > steps_done) fail("optimizer state: " + w[1] + " has taken " + w[2] + " steps of " +
                                              std::to_string(steps_done));
            if (!h.adam_steps.emplace(w[1], t).second) fail("optimizer state: '" + w[1] + "' appears twice");
        } else {
            fail("optimizer state: unexpected line '" + line.substr(0, 200) + "'");
        }
    }
    const size_t adam = std::count_if(cfgs.begin(), cfgs.end(), [](const ParamConfig& c) { return c.optim == Optim::Adam; });
    if (!seen_split || h.adam_steps.size() != adam)
        fail(strprintf("optimizer state: %zu Adam step counts for %zu Adam parameters%s", h.adam_steps.size(), adam,
                       seen_split ? "" : ", no 'split' line"));
    return h;
}

class NorMuonAndAdam {
   public:
    // comm: NCCL over the ranks; nullptr at world size 1 (no NCCL calls at all)
    NorMuonAndAdam(ParamStore& params, Gemms& gemms, const Hyperparameters& a, int world_size, int rank,
                   ncclComm_t comm = nullptr)
        : gemms_(gemms), comm_(comm) {
        if ((world_size > 1) != (comm != nullptr))
            fail(strprintf("optimizer: world size %d needs %s NCCL communicator", world_size, comm ? "no" : "an"));
        configs_ = build_param_configs(a, model_params(world_size), world_size, rank);
        world_size_ = world_size;
        for (const ParamConfig& c : configs_) {
            State st;
            st.cfg = c;
            st.p = &params[c.label];
            const int64_t n = c.chunk_numel();
            st.offset = c.comms == Comms::Sharded ? rank * n : 0;
            if (c.optim == Optim::Adam) {
                st.m = alloc<float>(n), st.v = alloc<float>(n);
            } else {
                st.buf = alloc<float>(n), st.mant = alloc<uint16_t>(n);
                st.sm = alloc<float>(c.second_moment_shape[0] * c.second_moment_shape[1] * c.second_moment_shape[2]);
                st.lrs = alloc<float>(c.chunk_size);
                st.var_ws = alloc<float>(normuon_variance_workspace((int)c.chunk_size, (int)c.chunk_shape[1]));
                st.pe = std::make_unique<PolarExpress>((int)c.chunk_size, (int)c.chunk_shape[1], (int)c.chunk_shape[2]);
                scratch_ = std::max(scratch_, n);
            }
            if (comm_)
                for (cudaEvent_t* e : {&st.reduced, &st.updated, &st.gathered})
                    CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
            states_.push_back(std::move(st));
        }
        g32_ = alloc<float>(scratch_), v_ = alloc<__nv_bfloat16>(scratch_);
        if (comm_) {
            CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
            CUDA_CHECK(cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming));
            CUDA_CHECK(cudaEventCreateWithFlags(&comm_done_, cudaEventDisableTiming));
        }
        reset(0);
        CUDA_CHECK(cudaDeviceSynchronize());
    }
    ~NorMuonAndAdam() {
        if (!comm_) return;
        CUDA_CHECK(cudaStreamSynchronize(comm_stream_));
        for (State& st : states_)
            for (cudaEvent_t e : {st.reduced, st.updated, st.gathered}) CUDA_CHECK(cudaEventDestroy(e));
        CUDA_CHECK(cudaEventDestroy(compute_done_));
        CUDA_CHECK(cudaEventDestroy(comm_done_));
        CUDA_CHECK(cudaStreamDestroy(comm_stream_));
    }
    NorMuonAndAdam(const NorMuonAndAdam&) = delete;
    NorMuonAndAdam& operator=(const NorMuonAndAdam&) = delete;

    // lr_mult: get_lr(step); momentum: get_muon_momentum(step); do_adam: is_adam_step(step)
    void step(double lr_mult, double momentum, bool do_adam, cudaStream_t s) {
        State& lm = state("lm_head");
        State& em = state("embed");
        if (comm_) after(s, comm_stream_);  // the gradients are final
        for (const PlanStep& p : step_plan(configs_, do_adam, split_)) {
            const bool reduce = p.op == PlanOp::AllReduce || p.op == PlanOp::ReduceScatter;
            if (reduce && reduced_early_.count(p.label)) continue;  // started inside the backward
            switch (p.op) {
                case PlanOp::AddTransposed:  // tied: embed's gradient joins lm_head's before its reduce
                    timed(transpose_t_, s, [&] {
                        CUDA_CHECK(transpose(bf(em.p->grad), bf(lm.p->grad), 1, PADDED_VOCAB_SIZE, MODEL_DIM, true, s));
                    });
                    if (comm_) after(s, comm_stream_);
                    break;
                case PlanOp::AllReduce: {
                    State& st = state(p.label);
                    timed(comm_t_, comm_stream_, [&] {
                        NCCL_CHECK(ncclAllReduce(st.p->grad, st.p->grad, st.p->shape.numel(), nccl_type(st), ncclAvg,
                                                 comm_, comm_stream_));
                    });
                    CUDA_CHECK(cudaEventRecord(st.reduced, comm_stream_));
                    break;
                }
                case PlanOp::ReduceScatter: {  // in place: this rank's chunk of the gradient holds the average
                    State& st = state(p.label);
                    timed(comm_t_, comm_stream_, [&] {
                        NCCL_CHECK(ncclReduceScatter(st.p->grad, chunk(st, st.p->grad), st.cfg.chunk_numel(),
                                                     nccl_type(st), ncclAvg, comm_, comm_stream_));
                    });
                    CUDA_CHECK(cudaEventRecord(st.reduced, comm_stream_));
                    break;
                }
                case PlanOp::Update: {
                    State& st = state(p.label);
                    if (comm_) timed(wait_t_, s, [&] { CUDA_CHECK(cudaStreamWaitEvent(s, st.reduced)); });
                    if (st.cfg.optim == Optim::Adam) timed(adam_t_, s, [&] { adam(st, lr_mult, s); });
                    else timed(normuon_t_, s, [&] { normuon(st, lr_mult, momentum, s); });
                    break;
                }
                case PlanOp::AllGather: {  // in place: every rank's updated chunk to every rank
                    State& st = state(p.label);
                    CUDA_CHECK(cudaEventRecord(st.updated, s));
                    CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, st.updated));
                    timed(comm_t_, comm_stream_, [&] {
                        NCCL_CHECK(ncclAllGather(chunk(st, st.p->data), st.p->data, st.cfg.chunk_numel(), nccl_type(st),
                                                 comm_, comm_stream_));
                    });
                    CUDA_CHECK(cudaEventRecord(st.gathered, comm_stream_));
                    break;
                }
                case PlanOp::CopyTransposed:  // tied: embed = lm_head^T, once lm_head is whole again
                    if (lm.cfg.comms == Comms::Sharded)
                        timed(wait_t_, s, [&] { CUDA_CHECK(cudaStreamWaitEvent(s, lm.gathered)); });
                    timed(transpose_t_, s, [&] {
                        CUDA_CHECK(transpose(bf(lm.p->data), bf(em.p->data), 1, MODEL_DIM, PADDED_VOCAB_SIZE, false, s));
                    });
                    break;
            }
        }
        if (comm_) timed(wait_t_, s, [&] { after(comm_stream_, s); });  // every gather is in before the next forward
        early_plan_.clear(), reduced_early_.clear();
        // gradients start over: NorMuon's every step, Adam's after the steps that use them
        for (State& st : states_)
            if (st.cfg.optim == Optim::NorMuon || do_adam) CUDA_CHECK(cudaMemsetAsync(st.p->grad, 0, st.p->bytes(), s));
    }

    // The early reduces of this step (backward_reduce_plan; several ranks): begin_backward_reduces
    // before the step's last micro-step, then backward_reduces(point, layer) where the model's last
    // backward reaches each point; step() then skips those reduces and waits for them.
    void begin_backward_reduces(bool do_adam) {
        early_plan_ = comm_ ? backward_reduce_plan(configs_, (int)world_size_, do_adam, split_) : std::vector<BackwardReduce>{};
        reduced_early_.clear();
    }
    void backward_reduces(ReducePoint when, int layer, cudaStream_t s) {
        bool started = false;
        for (const BackwardReduce& r : early_plan_) {
            if (r.when != when || r.layer != layer) continue;
            if (!started) after(s, comm_stream_), started = true;  // this point's gradients are final
            State& st = state(r.label);
            if (r.root < 0) {
                NCCL_CHECK(ncclReduceScatter(st.p->grad, chunk(st, st.p->grad), st.cfg.chunk_numel(), nccl_type(st), ncclAvg,
                                             comm_, comm_stream_));
            } else {  // matrices of one owner: to the owner, in place
                const int64_t per = st.cfg.chunk_numel() / st.cfg.chunk_size;
                void* g = (char*)st.p->grad + r.first * per * (st.p->shape.fp32 ? 4 : 2);
                NCCL_CHECK(ncclReduce(g, g, r.count * per, nccl_type(st), ncclAvg, r.root, comm_, comm_stream_));
            }
            CUDA_CHECK(cudaEventRecord(st.reduced, comm_stream_));  // the last piece's record is the one waited for
            reduced_early_.insert(r.label);
        }
    }

    // the untie at the split step: embed's Adam state is lm_head's, transposed;
    // sharded, lm_head's moments are gathered whole, transposed, and each rank keeps its rows of embed
    void copy_lm_state_to_embed(cudaStream_t s) {
        State& lm = state("lm_head");
        State& em = state("embed");
        const int64_t full = (int64_t)MODEL_DIM * PADDED_VOCAB_SIZE;
        float *whole = nullptr, *whole_t = nullptr;
        if (lm.cfg.comms == Comms::Sharded) {
            CUDA_CHECK(cudaMalloc(&whole, full * sizeof(float)));
            CUDA_CHECK(cudaMalloc(&whole_t, full * sizeof(float)));
        }
        for (auto [src, dst] : {std::pair{lm.m, em.m}, std::pair{lm.v, em.v}}) {
            if (!whole) {
                CUDA_CHECK(transpose(src, dst, 1, MODEL_DIM, PADDED_VOCAB_SIZE, false, s));
                continue;
            }
            after(s, comm_stream_);
            NCCL_CHECK(ncclAllGather(src, whole, lm.cfg.chunk_numel(), ncclFloat32, comm_, comm_stream_));
            after(comm_stream_, s);
            CUDA_CHECK(transpose(whole, whole_t, 1, MODEL_DIM, PADDED_VOCAB_SIZE, false, s));
            CUDA_CHECK(cudaMemcpyAsync(dst, whole_t + em.offset, em.cfg.chunk_numel() * sizeof(float),
                                       cudaMemcpyDeviceToDevice, s));
        }
        if (whole) {
            CUDA_CHECK(cudaStreamSynchronize(s));
            CUDA_CHECK(cudaFree(whole));
            CUDA_CHECK(cudaFree(whole_t));
        }
        em.t = lm.t;
        split_ = true;
    }

    // back to the initial state: zero moments, buffers and step counts, embed tied again
    void reset(cudaStream_t s) {
        for (State& st : states_) {
            const int64_t n = st.cfg.chunk_numel();
            for (float* f : {st.m, st.v, st.buf})
                if (f) CUDA_CHECK(cudaMemsetAsync(f, 0, n * sizeof(float), s));
            if (st.mant) CUDA_CHECK(cudaMemsetAsync(st.mant, 0, n * sizeof(uint16_t), s));
            if (st.sm) {
                const auto& sh = st.cfg.second_moment_shape;
                CUDA_CHECK(cudaMemsetAsync(st.sm, 0, sh[0] * sh[1] * sh[2] * sizeof(float), s));
            }
            st.t = 0;
        }
        split_ = false;
    }

    bool split() const { return split_; }

    // This rank's state, for tests: Adam's moments m and v; NorMuon's momentum buffer, second
    // moment and the low 16 bits of its fp32 weights (mant, uint16).
    struct StateView {
        std::string label, kind;
        void* data;
        int64_t n;
        size_t bytes() const { return (size_t)n * (kind == "mant" ? 2 : 4); }
    };
    std::vector<StateView> state_views() const {
        std::vector<StateView> out;
        for (const State& st : states_) {
            const ParamConfig& c = st.cfg;
            const int64_t n = c.chunk_numel();
            if (c.optim == Optim::Adam) {
                out.push_back({c.label, "m", st.m, n});
                out.push_back({c.label, "v", st.v, n});
            } else {
                const auto& sh = c.second_moment_shape;
                out.push_back({c.label, "buf", st.buf, n});
                out.push_back({c.label, "sm", st.sm, sh[0] * sh[1] * sh[2]});
                out.push_back({c.label, "mant", st.mant, n});
            }
        }
        return out;
    }
    // The rest of the state, as text for a checkpoint: tied or untied, each Adam parameter's steps.
    std::string host_state() const {
        std::string s = strprintf("split %d\n", (int)split_);
        for (const State& st : states_)
            if (st.cfg.optim == Optim::Adam) s += strprintf("adam_steps %s %lld\n", st.cfg.label.c_str(), (long long)st.t);
        return s;
    }
    void set_host_state(const OptimizerHostState& h) {
        split_ = h.split;
        for (State& st : states_)
            if (st.cfg.optim == Optim::Adam) st.t = h.adam_steps.at(st.cfg.label);
    }

    // Where a step's time goes (for `make bench`), from the steps taken while profiling: NorMuon's
    // updates (momentum, Polar Express, variance, apply), Adam's, the tied embedding's transposes,
    // the compute stream's waits for NCCL, and NCCL's own time on its stream.
    struct Profile {
        float normuon_ms, adam_ms, transpose_ms, wait_ms, comm_ms;
    };
    void profile(bool on) { profiling_ = on; }
    Profile profile_ms() {
        Profile p{normuon_t_.total_ms(), adam_t_.total_ms(), transpose_t_.total_ms(), wait_t_.total_ms(),
                  comm_t_.total_ms()};
        for (StreamTimer* t : {&normuon_t_, &adam_t_, &transpose_t_, &wait_t_, &comm_t_}) t->clear();
        return p;
    }

   private:
    struct State {
        ParamConfig cfg;
        Param* p = nullptr;
        float *m = nullptr, *v = nullptr;  // Adam moments
        int64_t t = 0;                     // Adam steps taken
        float *buf = nullptr, *sm = nullptr, *lrs = nullptr;  // NorMuon momentum, second moment, per-matrix lr
        float* var_ws = nullptr;                                // its normalisation's workspace
        uint16_t* mant = nullptr;          // the low 16 bits of the fp32 weights
        std::unique_ptr<PolarExpress> pe;
        int64_t offset = 0;                // elements before this rank's chunk (sharded)
        cudaEvent_t reduced = nullptr, updated = nullptr, gathered = nullptr;
    };

    template <typename T>
    T* alloc(int64_t n) { return arena_.alloc<T>(n); }
    static __nv_bfloat16* bf(void* p) { return as_bf16(p); }
    static ncclDataType_t nccl_type(const State& st) { return st.p->shape.fp32 ? ncclFloat32 : ncclBfloat16; }
    // this rank's chunk of a parameter's data or gradient (all of it when not sharded)
    static void* chunk(const State& st, void* base) {
        return (char*)base + st.offset * (st.p->shape.fp32 ? 4 : 2);
    }
    template <typename Fn>
    void timed(StreamTimer& t, cudaStream_t s, Fn fn) {
        if (profiling_) t.begin(s);
        fn();
        if (profiling_) t.end(s);
    }
    // `later` waits for what `first` has queued so far
    void after(cudaStream_t first, cudaStream_t later) {
        cudaEvent_t e = first == comm_stream_ ? comm_done_ : compute_done_;
        CUDA_CHECK(cudaEventRecord(e, first));
        CUDA_CHECK(cudaStreamWaitEvent(later, e));
    }
    State& state(const std::string& label) {
        for (State& st : states_)
            if (st.cfg.label == label) return st;
        fail("optimizer: no parameter '" + label + "'");
    }

    void adam(State& st, double lr_mult, cudaStream_t s) {
        const ParamConfig& c = st.cfg;
        const double lr = c.initial_lr * lr_mult * c.lr_mul;
        st.t += 1;
        const double bias1 = 1 - std::pow(c.beta1, (double)st.t), bias2 = 1 - std::pow(c.beta2, (double)st.t);
        const float step_size = (float)(lr * std::sqrt(bias2) / bias1);
        const float eff_wd = (float)(lr * lr * c.weight_decay * c.wd_mul);
        const int64_t n = c.chunk_numel();
        void *p = chunk(st, st.p->data), *g = chunk(st, st.p->grad);
        if (st.p->shape.fp32)
            CUDA_CHECK(adam_update((float*)p, (const float*)g, st.m, st.v, n, (float)c.beta1, (float)c.beta2,
                                   (float)c.eps, step_size, eff_wd, s));
        else
            CUDA_CHECK(adam_update(bf(p), (const __nv_bfloat16*)g, st.m, st.v, n, (float)c.beta1, (float)c.beta2,
                                   (float)c.eps, step_size, eff_wd, s));
    }

    void normuon(State& st, double lr_mult, double momentum, cudaStream_t s) {
        const ParamConfig& c = st.cfg;
        const double lr = c.initial_lr * lr_mult;
        const int count = (int)c.chunk_size, rows = (int)c.chunk_shape[1], cols = (int)c.chunk_shape[2];
        const int64_t per = (int64_t)rows * cols, n = per * count;
        std::vector<float> lrs(count);
        for (int i = 0; i < count; ++i)
            lrs[i] = (float)(c.lr_mul * (c.per_matrix_lr_mul.empty() ? 1.0 : c.per_matrix_lr_mul[i]) * lr);
        CUDA_CHECK(cudaMemcpyAsync(st.lrs, lrs.data(), count * sizeof(float), cudaMemcpyHostToDevice, s));
        CUDA_CHECK(nesterov_momentum((const __nv_bfloat16*)chunk(st, st.p->grad), st.buf, g32_, n, (float)momentum, s));
        st.pe->run(gemms_, g32_, v_, count, s);
        CUDA_CHECK(normuon_variance(v_, st.sm, count, rows, cols, (float)c.normuon_beta2, st.var_ws, s));
        CUDA_CHECK(normuon_apply(bf(chunk(st, st.p->data)), st.mant, v_, per, count, st.lrs,
                                 (float)(c.wd_mul * c.weight_decay * lr), s));
    }

    Gemms& gemms_;
    ncclComm_t comm_;
    cudaStream_t comm_stream_ = nullptr;  // NCCL's own stream
    cudaEvent_t compute_done_ = nullptr, comm_done_ = nullptr;
    std::vector<ParamConfig> configs_;
    std::vector<State> states_;
    DeviceArena arena_;
    int64_t scratch_ = 0;
    float* g32_ = nullptr;
    __nv_bfloat16* v_ = nullptr;
    bool split_ = false;
    bool profiling_ = false;
    int64_t world_size_ = 1;
    std::vector<BackwardReduce> early_plan_;  // this step's reduces inside the backward
    std::set<std::string> reduced_early_;     // the parameters they reduce (step() skips their reduce)
    StreamTimer normuon_t_, adam_t_, transpose_t_, wait_t_, comm_t_;
};

// -----------------------------------------------------------------------------
// Distributed data loader. Shards: 256 int32 header words (magic, version, token count), then
// uint16 tokens. Reproduces the record's loader token for token at every world size: BOS-aligned
// training batches (@varunneal, @classiclarryd), unaligned validation batches.

struct Shard {
    std::string path;
    std::vector<uint16_t> tokens;
    std::vector<int64_t> bos_idx;  // positions of BOS, ascending
};

// Opens a regular file for reading. A FIFO, a device or a folder is refused at once: the file is
// opened without blocking and checked before any read (reading one could block or never end).
// Returns the descriptor; the size in *bytes.
static int open_regular_file(const std::string& path, const char* what, uint64_t* bytes) {
    const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) fail(strprintf("cannot open %s %s: %s", what, path.c_str(), strerror(errno)));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        const int err = errno;
        close(fd);
        fail(strprintf("%s %s is not a regular file%s", what, path.c_str(),
                       S_ISDIR(st.st_mode) ? " (a folder)" : S_ISFIFO(st.st_mode) ? " (a FIFO)" :
                       S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? " (a device)" : err ? strerror(err) : ""));
    }
    *bytes = (uint64_t)st.st_size;
    return fd;
}

struct FdCloser {
    int fd;
    ~FdCloser() { close(fd); }
};

// Reads exactly n bytes at offset (a file that shrank underneath is an error naming `what`).
static void read_exactly(int fd, void* dst, uint64_t n, uint64_t offset, const std::string& what) {
    char* p = (char*)dst;
    while (n > 0) {
        const ssize_t r = pread(fd, p, (size_t)std::min<uint64_t>(n, 1 << 30), (off_t)offset);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) fail(strprintf("%s: read failed: %s", what.c_str(), r < 0 ? strerror(errno) : "unexpected end of file"));
        p += r, n -= (uint64_t)r, offset += (uint64_t)r;
    }
}

// The whole of a regular file of at most max_bytes.
static std::string read_regular_file(const std::string& path, uint64_t max_bytes, const char* what) {
    uint64_t bytes = 0;
    FdCloser f{open_regular_file(path, what, &bytes)};
    if (bytes > max_bytes)
        fail(strprintf("%s %s is %llu bytes, more than a %s may have (%llu)", what, path.c_str(), (unsigned long long)bytes,
                       what, (unsigned long long)max_bytes));
    std::string text(bytes, '\0');
    read_exactly(f.fd, text.data(), bytes, 0, strprintf("%s %s", what, path.c_str()));
    return text;
}

// Opens a data shard and checks its header against the file: a regular file, the magic number, the
// version, the token count and the file's size. Returns the descriptor; the tokens in *num_tokens.
static int open_data_shard(const std::string& path, int64_t* num_tokens) {
    uint64_t bytes = 0;
    const int fd = open_regular_file(path, "data shard", &bytes);
    const uint64_t header_bytes = SHARD_HEADER_INTS * 4;
    try {
        if (bytes < header_bytes)
            fail(strprintf("data shard %s: %llu bytes is shorter than its %llu-byte header", path.c_str(),
                           (unsigned long long)bytes, (unsigned long long)header_bytes));
        int32_t header[SHARD_HEADER_INTS];
        read_exactly(fd, header, header_bytes, 0, "data shard " + path);
        if (header[0] != SHARD_MAGIC)
            fail(strprintf("data shard %s: magic number %d, expected %d (not a FineWeb .bin shard?)", path.c_str(),
                           header[0], SHARD_MAGIC));
        if (header[1] != SHARD_VERSION)
            fail(strprintf("data shard %s: unsupported version %d, expected %d", path.c_str(), header[1], SHARD_VERSION));
        *num_tokens = header[2];
        if (*num_tokens < 0 || bytes - header_bytes != 2 * (uint64_t)*num_tokens)
            fail(strprintf("data shard %s: header says %lld tokens (%lld bytes) but the file holds %llu bytes after the "
                           "header", path.c_str(), (long long)*num_tokens, (long long)(2 * *num_tokens),
                           (unsigned long long)(bytes - header_bytes)));
    } catch (...) {
        close(fd);
        throw;
    }
    return fd;
}

static std::shared_ptr<Shard> load_data_shard(const std::string& path) {
    auto shard = std::make_shared<Shard>();
    shard->path = path;
    int64_t num_tokens = 0;
    FdCloser f{open_data_shard(path, &num_tokens)};
    shard->tokens.resize(num_tokens);
    read_exactly(f.fd, shard->tokens.data(), 2 * (uint64_t)num_tokens, SHARD_HEADER_INTS * 4, "data shard " + path);
    const uint16_t* t = shard->tokens.data();
    uint16_t max_tok = 0;
    for (int64_t i = 0; i < num_tokens; ++i) max_tok = std::max(max_tok, t[i]);  // vectorises
    if (max_tok >= PADDED_VOCAB_SIZE) {
        int64_t i = 0;
        while (t[i] < PADDED_VOCAB_SIZE) ++i;
        fail(strprintf("data shard %s: token id %d at position %lld is not below the vocabulary size %d",
                       path.c_str(), t[i], (long long)i, PADDED_VOCAB_SIZE));
    }
    for (int64_t i = 0; i < num_tokens; ++i)
        if (t[i] == BOS_ID) shard->bos_idx.push_back(i);
    return shard;
}

// sorted matches of a glob pattern (sorted by bytes, as Python's sorted(glob.glob(...)))
static std::vector<std::string> list_files(const std::string& pattern) {
    glob_t g;
    int rc = glob(pattern.c_str(), GLOB_NOSORT, nullptr, &g);
    std::vector<std::string> files;
    if (rc == 0)
        for (size_t i = 0; i < g.gl_pathc; ++i) files.push_back(g.gl_pathv[i]);
    globfree(&g);
    if (rc != 0 && rc != GLOB_NOMATCH) fail(strprintf("cannot list files of pattern %s (glob error %d)", pattern.c_str(), rc));
    if (files.empty()) fail(strprintf("no files found for pattern: %s", pattern.c_str()));
    std::sort(files.begin(), files.end());
    return files;
}

static std::string join_data_path(const std::string& data_path, const std::string& pattern) {
    if (data_path.empty() || pattern.empty() || pattern[0] == '/') return pattern;
    return data_path.back() == '/' ? data_path + pattern : data_path + "/" + pattern;
}

// Finds each rank's documents in one shard. Every rank walks the same BOS index for all ranks and
// keeps its own, so the stream is the same at any world size.
struct BOSFinder {
    std::shared_ptr<Shard> shard;
    int64_t i = 0;           // next BOS to use
    int64_t batch_iter = 0;  // batches taken so far
    // The record's first shard sees only the BOS in its first quickload_tokens tokens for its
    // first quickload_batches batches (it indexes the rest on a thread meanwhile). Kept for
    // identical streams: it decides where a document crossing that point ends.
    int64_t n_quick = -1;  // BOS visible while batch_iter < quickload_batches; -1: no quickload
    int64_t quickload_batches = 0;

    BOSFinder(std::shared_ptr<Shard> s, int64_t quickload_tokens = -1, int64_t quickload_batches_ = 5)
        : shard(std::move(s)), quickload_batches(quickload_batches_) {
        if (quickload_tokens >= 0)
            n_quick = std::lower_bound(shard->bos_idx.begin(), shard->bos_idx.end(), quickload_tokens) -
                      shard->bos_idx.begin();
    }

    // Fills starts/ends[r] for every rank r; false (and nothing changed) if the shard runs out.
    bool next_batch(int64_t num_tokens_local, int64_t max_seq_len, int world_size,
                    std::vector<std::vector<int64_t>>& starts, std::vector<std::vector<int64_t>>& ends) {
        const std::vector<int64_t>& bos = shard->bos_idx;
        const int64_t n = (n_quick >= 0 && batch_iter < quickload_batches) ? n_quick : (int64_t)bos.size();
        const int64_t size = (int64_t)shard->tokens.size();
        starts.assign(world_size, {});
        ends.assign(world_size, {});
        int64_t idx = i;
        for (int r = 0; r < world_size; ++r) {
            int64_t cur_len = 0;
            while (cur_len <= num_tokens_local) {
                if (idx >= n) return false;
                int64_t cur = bos[idx];
                int64_t end = std::min({idx + 1 < n ? bos[idx + 1] : size, cur + max_seq_len,
                                        cur + num_tokens_local - cur_len + 1});
                starts[r].push_back(cur);
                ends[r].push_back(end);
                cur_len += end - cur;
                ++idx;
            }
        }
        i = idx;
        ++batch_iter;
        return true;
    }
};

// Loads and indexes the next shards on background threads, two ahead, so that neither a shard
// change nor a shard too short for a batch (which the loader skips) stalls the training loop.
class DataPreloader {
   public:
    static constexpr size_t DEPTH = 2;
    DataPreloader(std::vector<std::string> files, size_t next, bool cycle)
        : files_(std::move(files)), next_(next), cycle_(cycle) {
        fill(nullptr);
    }
    ~DataPreloader() {
        for (auto& slot : queue_) slot->thread.join();
    }

    // The next file's shard, or null once the files have ended; starts loading another.
    // `retire` is the shard just finished: it is freed on a thread too, as unmapping a
    // 200 MB shard takes milliseconds.
    std::shared_ptr<Shard> get(std::shared_ptr<Shard> retire) {
        if (queue_.empty()) return nullptr;
        std::unique_ptr<Slot> slot = std::move(queue_.front());
        queue_.pop_front();
        slot->thread.join();
        if (slot->error) std::rethrow_exception(slot->error);
        fill(std::move(retire));
        return slot->result;
    }

   private:
    struct Slot {
        std::thread thread;
        std::shared_ptr<Shard> result;
        std::exception_ptr error;
    };
    void fill(std::shared_ptr<Shard> retire) {
        while (queue_.size() < DEPTH) {
            if (next_ >= files_.size()) {
                if (!cycle_) return;
                next_ = 0;
            }
            auto slot = std::make_unique<Slot>();
            Slot* s = slot.get();
            std::string path = files_[next_++];
            s->thread = std::thread([s, path, retire = std::move(retire)]() mutable {
                retire.reset();
                try {
                    s->result = load_data_shard(path);
                } catch (...) {
                    s->error = std::current_exception();
                }
            });
            retire = nullptr;
            queue_.push_back(std::move(slot));
        }
    }
    std::vector<std::string> files_;
    size_t next_;
    bool cycle_;
    std::deque<std::unique_ptr<Slot>> queue_;
};

// Host memory for batches: pinned (page-locked, so cudaMemcpyAsync overlaps compute) in the
// trainer, pageable in the host tests that run without a GPU.
struct HostBuffer {
    int32_t* ptr = nullptr;
    size_t count = 0;
    bool pinned = false;
    HostBuffer() = default;
    HostBuffer(const HostBuffer&) = delete;
    HostBuffer& operator=(const HostBuffer&) = delete;
    ~HostBuffer() { release(); }
    void reserve(size_t n, bool pin) {
        if (n <= count && pin == pinned) return;
        release();
        if (pin) CUDA_CHECK(cudaHostAlloc((void**)&ptr, n * sizeof(int32_t), cudaHostAllocDefault));
        else {
            ptr = (int32_t*)malloc(n * sizeof(int32_t));
            if (!ptr) fail("out of host memory for a batch buffer");
        }
        count = n;
        pinned = pin;
    }
    void release() {
        if (!ptr) return;
        if (pinned) CUDA_CHECK(cudaFreeHost(ptr));
        else free(ptr);
        ptr = nullptr;
        count = 0;
    }
};

// One micro-batch of one rank. tokens holds num_tokens + 1 ids: inputs are tokens[0, N), targets
// tokens[1, N], so one copy moves both. cu_seqlens has max_num_docs entries: 0, the cumulative
// document lengths, then num_tokens as padding (fixed size, so shapes never change).
struct HostBatch {
    HostBuffer tokens_buf, cu_seqlens_buf;
    int64_t num_tokens = 0;    // per rank per micro-step
    int64_t max_num_docs = 0;  // length of cu_seqlens
    int64_t num_docs = 0;      // sequences in this batch (entries of cu_seqlens past the leading 0)
    cudaEvent_t copied = nullptr;  // recorded after the async upload; the buffer is reused after it
    const int32_t* inputs() const { return tokens_buf.ptr; }
    const int32_t* targets() const { return tokens_buf.ptr + 1; }
    const int32_t* cu_seqlens() const { return cu_seqlens_buf.ptr; }
};

struct BatchSize {
    int64_t num_tokens;  // per step over all ranks
    int64_t max_seq_len;
    int64_t grad_accum_steps;
};

struct LoaderOptions {
    bool align_to_bos = true;
    bool cycle = false;               // wrap around the file list
    bool pinned = true;               // page-locked batch buffers
    int64_t quickload_tokens = 4000000;  // the record's first-shard quick BOS scan
    int64_t quickload_batches = 5;
    int64_t capacity_tokens = 0;      // per-rank tokens to size the buffers for up front
};

// Where a rank is in the training stream between two micro-batches (DistributedDataGenerator's
// position(), kept in a checkpoint): the shard (index in the file list and path), the BOS finder's
// place in it, the batch it builds (tokens per micro-step over all ranks, the sequence cut).
struct DataPosition {
    int64_t file = 0;
    std::string path;
    int64_t bos = 0, batch_iter = 0, n_quick = -1, quickload_batches = 0, num_tokens = 0, max_seq_len = 0;
};

static DataPosition parse_data_position(const std::string& text) {
    const std::vector<std::string> l = split(text, '\n');
    if (l.size() != 6 || !l[5].empty()) fail("data position: not 5 lines");
    auto field = [&](size_t i, const char* key, size_t n) {
        std::vector<std::string> w = keyed_line(l, i, key, "data position");
        if (w.size() != n + 1) fail(strprintf("data position: line %zu is not '%s' and %zu values", i + 1, key, n));
        return w;
    };
    const std::vector<std::string> f = field(0, "file", 2), b = field(1, "bos", 1), it = field(2, "batch_iter", 1),
                                   q = field(3, "quick", 2), bs = field(4, "batch", 2);
    DataPosition p;
    p.file = parse_i64("file", f[1]), p.path = f[2];
    p.bos = parse_i64("bos", b[1]), p.batch_iter = parse_i64("batch_iter", it[1]);
    p.n_quick = parse_i64("quick", q[1]), p.quickload_batches = parse_i64("quick", q[2]);
    p.num_tokens = parse_i64("batch", bs[1]), p.max_seq_len = parse_i64("batch", bs[2]);
    if (p.file < 0 || p.bos < 0 || p.batch_iter < 0 || p.n_quick < -1 || p.quickload_batches < 0 || p.num_tokens <= 0 ||
        p.max_seq_len <= 0)
        fail("data position: a negative value");
    return p;
}

// A position against a file list, the shard's count of BOS (n_bos < 0: not known yet), the world
// size and the per-rank tokens the device buffers hold (capacity; 0: not bounded here).
static void check_data_position(const DataPosition& p, const std::vector<std::string>& files, int64_t n_bos,
                                int world_size, int64_t capacity) {
    if (p.file >= (int64_t)files.size() || files[p.file] != p.path)
        fail(strprintf("data position: file %lld (%s) is not in this run's file list (%zu files)", (long long)p.file,
                       p.path.c_str(), files.size()));
    if (p.num_tokens % world_size != 0 || (capacity > 0 && p.num_tokens / world_size > capacity))
        fail(strprintf("data position: a batch of %lld tokens over %d ranks is not one this run's buffers hold (%lld "
                       "tokens a rank)", (long long)p.num_tokens, world_size, (long long)capacity));
    if (n_bos >= 0 && (p.bos > n_bos || p.n_quick > n_bos))
        fail(strprintf("data position: BOS %lld (quick %lld) is out of range for %s (%lld documents)", (long long)p.bos,
                       (long long)p.n_quick, p.path.c_str(), (long long)n_bos));
}

// The record's distributed_data_generator: each call of next() is one micro-step of one rank.
class DistributedDataGenerator {
   public:
    DistributedDataGenerator(const std::string& pattern, BatchSize bs, int rank, int world_size,
                             LoaderOptions opt = {})
        : rank_(rank), world_size_(world_size), opt_(opt) {
        files_ = list_files(pattern);
        set_batch_size(bs);
        shard_ = load_data_shard(files_[0]);
        next_file_ = 1;
        if (opt_.align_to_bos) {
            finder_ = std::make_unique<BOSFinder>(shard_, opt_.quickload_tokens, opt_.quickload_batches);
            preloader_ = std::make_unique<DataPreloader>(files_, next_file_, opt_.cycle);
        }
        if (opt_.capacity_tokens > 0)
            for (HostBatch& b : slots_) reserve(b, opt_.capacity_tokens);
    }
    ~DistributedDataGenerator() {
        for (HostBatch& b : slots_)
            if (b.copied) CUDA_CHECK(cudaEventDestroy(b.copied));
    }

    // New (num_tokens, max_seq_len, grad_accum_steps), used from the next batch on (the record's .send()).
    void set_batch_size(BatchSize bs) {
        if (bs.grad_accum_steps <= 0 || bs.num_tokens <= 0 || bs.num_tokens % (world_size_ * bs.grad_accum_steps) != 0)
            fail(strprintf("batch of %lld tokens does not split over %d ranks x %lld accumulation steps",
                           (long long)bs.num_tokens, world_size_, (long long)bs.grad_accum_steps));
        num_tokens_ = bs.num_tokens / bs.grad_accum_steps;
        max_seq_len_ = bs.max_seq_len;
    }

    // The next micro-batch of this rank, in one of two alternating host buffers: the previous one
    // may still be uploading while this one is filled.
    HostBatch& next() {
        HostBatch& b = slots_[slot_];
        slot_ ^= 1;
        if (b.copied) CUDA_CHECK(cudaEventSynchronize(b.copied));  // its last upload is done
        const int64_t ntl = num_tokens_ / world_size_;
        const int64_t max_num_docs = max_num_docs_of(ntl);
        reserve(b, ntl);
        b.num_tokens = ntl;
        b.max_num_docs = max_num_docs;
        int32_t* tok = b.tokens_buf.ptr;
        int32_t* cu = b.cu_seqlens_buf.ptr;
        if (opt_.align_to_bos) {
            while (!finder_->next_batch(ntl, max_seq_len_, world_size_, starts_, ends_)) {
                // this shard is exhausted: switch to the preloaded next one
                const std::string finished = shard_->path;
                finder_.reset();
                std::shared_ptr<Shard> s = preloader_->get(std::move(shard_));
                if (!s)
                    fail(strprintf("train data exhausted: %s has too few documents left for a batch of %lld tokens "
                                   "and it is the last file (%zu files; --cycle_data to wrap around)",
                                   finished.c_str(), (long long)num_tokens_, files_.size()));
                shard_ = s;
                finder_ = std::make_unique<BOSFinder>(shard_);
            }
            const std::vector<int64_t>& st = starts_[rank_];
            const std::vector<int64_t>& en = ends_[rank_];
            const int64_t ndocs = (int64_t)st.size();
            if (ndocs + 1 > max_num_docs)
                fail(strprintf("batch of %lld tokens from %s holds %lld documents, more than max_num_docs - 1 = %lld",
                               (long long)ntl, shard_->path.c_str(), (long long)ndocs, (long long)max_num_docs - 1));
            const uint16_t* src = shard_->tokens.data();
            int64_t pos = 0;
            cu[0] = 0;
            for (int64_t d = 0; d < ndocs; ++d) {
                for (int64_t j = st[d]; j < en[d]; ++j) tok[pos++] = src[j];
                // the last document is one shorter: its final token is only a target
                cu[d + 1] = (int32_t)(d + 1 < ndocs ? pos : pos - 1);
            }
            b.num_docs = ndocs;
            for (int64_t d = ndocs + 1; d < max_num_docs; ++d) cu[d] = (int32_t)ntl;
        } else {
            if (pos_ + num_tokens_ + 1 >= (int64_t)shard_->tokens.size()) {  // as the record: move on
                if (next_file_ >= files_.size())
                    fail(strprintf("validation data exhausted: %s has no room for another batch of %lld tokens and "
                                   "it is the last file (%zu files; lower --val_tokens)",
                                   shard_->path.c_str(), (long long)num_tokens_, files_.size()));
                shard_ = load_data_shard(files_[next_file_++]);
                pos_ = 0;
                if (num_tokens_ + 1 > (int64_t)shard_->tokens.size())
                    fail(strprintf("validation shard %s holds %zu tokens, too few for a batch of %lld tokens",
                                   shard_->path.c_str(), shard_->tokens.size(), (long long)num_tokens_ + 1));
            }
            const uint16_t* src = shard_->tokens.data() + pos_ + rank_ * ntl;
            int64_t ndocs = 0;
            cu[0] = 0;
            for (int64_t j = 0; j <= ntl; ++j) tok[j] = src[j];
            for (int64_t j = 0; j < ntl; ++j) {
                if (src[j] != BOS_ID) continue;
                if (ndocs + 2 > max_num_docs)
                    fail(strprintf("validation batch of %lld tokens from %s holds more than max_num_docs - 1 = %lld "
                                   "documents", (long long)ntl, shard_->path.c_str(), (long long)max_num_docs - 1));
                cu[++ndocs] = (int32_t)j;
            }
            b.num_docs = ndocs;
            for (int64_t d = ndocs + 1; d < max_num_docs; ++d) cu[d] = (int32_t)ntl;
            pos_ += num_tokens_;
        }
        return b;
    }

    // Starts the async copy of a batch to device buffers (tokens: num_tokens+1, cu_seqlens:
    // max_num_docs ints) on a stream; the host buffer is reused only after the copy is done.
    void upload(HostBatch& b, int32_t* d_tokens, int32_t* d_cu_seqlens, cudaStream_t stream) {
        if (!b.copied) CUDA_CHECK(cudaEventCreateWithFlags(&b.copied, cudaEventDisableTiming));
        CUDA_CHECK(cudaMemcpyAsync(d_tokens, b.tokens_buf.ptr, (b.num_tokens + 1) * sizeof(int32_t),
                                   cudaMemcpyHostToDevice, stream));
        CUDA_CHECK(cudaMemcpyAsync(d_cu_seqlens, b.cu_seqlens_buf.ptr, b.max_num_docs * sizeof(int32_t),
                                   cudaMemcpyHostToDevice, stream));
        CUDA_CHECK(cudaEventRecord(b.copied, stream));
    }

    const std::string& current_file() const { return shard_->path; }

    // Where this rank is in the training stream between two micro-batches, as text (for a
    // checkpoint): the shard, the BOS finder's place in it, the batch size. Every rank walks one BOS
    // index for all ranks, so all ranks hold the same position.
    std::string position() const {
        if (!opt_.align_to_bos) fail("position: only the BOS-aligned training stream has one");
        const size_t file = std::find(files_.begin(), files_.end(), shard_->path) - files_.begin();
        return strprintf("file %zu %s\nbos %lld\nbatch_iter %lld\nquick %lld %lld\nbatch %lld %lld\n", file,
                         shard_->path.c_str(), (long long)finder_->i, (long long)finder_->batch_iter,
                         (long long)finder_->n_quick, (long long)finder_->quickload_batches, (long long)num_tokens_,
                         (long long)max_seq_len_);
    }
    // Continues from a position() of the same file list (parsed and checked by parse_data_position).
    void seek(const DataPosition& p) {
        if (!opt_.align_to_bos) fail("seek: only the BOS-aligned training stream has a position");
        check_data_position(p, files_, -1, world_size_, opt_.capacity_tokens);
        std::shared_ptr<Shard> shard = load_data_shard(files_[p.file]);
        check_data_position(p, files_, (int64_t)shard->bos_idx.size(), world_size_, opt_.capacity_tokens);
        preloader_.reset();
        finder_.reset();
        shard_ = std::move(shard);
        finder_ = std::make_unique<BOSFinder>(shard_);
        finder_->i = p.bos, finder_->batch_iter = p.batch_iter;
        finder_->n_quick = p.n_quick, finder_->quickload_batches = p.quickload_batches;
        num_tokens_ = p.num_tokens, max_seq_len_ = p.max_seq_len;
        preloader_ = std::make_unique<DataPreloader>(files_, (size_t)p.file + 1, opt_.cycle);
    }

   private:
    void reserve(HostBatch& b, int64_t ntl) {
        b.tokens_buf.reserve(ntl + 1, opt_.pinned);
        b.cu_seqlens_buf.reserve(max_num_docs_of(ntl), opt_.pinned);
    }

    int rank_, world_size_;
    LoaderOptions opt_;
    std::vector<std::string> files_;
    size_t next_file_ = 0;
    int64_t num_tokens_ = 0, max_seq_len_ = 0;  // per micro-step over all ranks
    std::shared_ptr<Shard> shard_;
    std::unique_ptr<BOSFinder> finder_;
    std::unique_ptr<DataPreloader> preloader_;
    int64_t pos_ = 0;  // unaligned reading position
    std::vector<std::vector<int64_t>> starts_, ends_;
    HostBatch slots_[2];
    int slot_ = 0;
};

// -----------------------------------------------------------------------------
// Training Management: the schedules of record 61, as pure functions of the step, and the
// TrainingManager that follows them.

// batch size schedule by equal parts of the scheduled steps, then the extension batch
static int64_t get_bs(const Hyperparameters& a, int64_t step) {
    if (step >= a.num_scheduled_iterations) return a.train_bs_extension;
    double x = (double)step / (double)a.num_scheduled_iterations;
    size_t idx = (size_t)((double)a.train_bs_schedule.size() * x);
    return a.train_bs_schedule[idx];
}

struct Windows {
    int64_t short_ws, long_ws;  // in blocks; the short window is half the long one
    bool operator==(const Windows& o) const { return short_ws == o.short_ws && long_ws == o.long_ws; }
};

static Windows get_ws(const Hyperparameters& a, int64_t step) {
    if (step >= a.num_scheduled_iterations) return {a.ws_final / 2, a.ws_final};
    double x = (double)step / (double)a.num_scheduled_iterations;
    size_t idx = (size_t)((double)a.ws_schedule.size() * x);
    int64_t ws = a.ws_schedule[idx];
    return {ws / 2, ws};
}

// lr multiplier: tied to the batch size schedule, with a linear cooldown at the end
static double get_lr(const Hyperparameters& a, int64_t step) {
    if (step > a.num_scheduled_iterations) return a.lr_min;
    double x = (double)step / (double)a.num_scheduled_iterations;
    double lr_max = a.lr_max_schedule[0];
    const size_t n = a.lr_max_schedule.size();
    for (size_t i = 1; i < n; ++i)
        if (x > (double)i / (double)n) lr_max = a.lr_max_schedule[i];
    if (x >= 1 - a.cooldown_frac) {
        double w = (1 - x) / a.cooldown_frac;
        return lr_max * w + (1 - w) * a.lr_min;
    }
    return lr_max;
}

// NorMuon momentum: linear warmup from min to max, linear cooldown back over the last steps
static double get_muon_momentum(const Hyperparameters& a, int64_t step) {
    int64_t cd_start = a.num_iterations() - a.muon_cooldown_steps;
    if (step < a.muon_warmup_steps) {
        double frac = (double)step / (double)a.muon_warmup_steps;
        return a.momentum_min + frac * (a.momentum_max - a.momentum_min);
    }
    if (step > cd_start) {
        double frac = (double)(step - cd_start) / (double)a.muon_cooldown_steps;
        return a.momentum_max - frac * (a.momentum_max - a.momentum_min);
    }
    return a.momentum_max;
}

// Multi-token prediction weights (@varunneal): [1, .5, .25->0] -> [1, .5->0] -> [1], as fp32
static std::vector<float> get_mtp_weights(const Hyperparameters& a, int64_t step) {
    double x = (double)step / (double)a.num_scheduled_iterations;
    if (x < 1.0 / 3) return {1.0f, 0.5f, (float)(0.25 * (1 - 3 * x))};
    if (x < 2.0 / 3) return {1.0f, (float)(0.5 * (1 - (3 * x - 1)))};
    return {1.0f};
}

// Adam parameters step only on odd steps; their gradients accumulate over two steps (@classiclarryd)
static bool is_adam_step(int64_t step) { return step % 2 == 1; }

// embed unties from lm_head at 2/3 of training, on an odd step so Adam updates (@classiclarryd)
static int64_t get_split_step(const Hyperparameters& a) {
    return (int64_t)std::ceil(a.split_embed_frac * (double)a.num_scheduled_iterations) | 1;
}

// steps at which the long window changes (each needs a YaRN update). get_ws changes only where its
// schedule index does (near k/len of the scheduled steps) and where the extension starts: only the
// steps around those are looked at, so a long run costs no more than a short one.
static std::vector<int64_t> get_transition_steps(const Hyperparameters& a) {
    const int64_t n = a.num_scheduled_iterations, len = (int64_t)a.ws_schedule.size();
    std::set<int64_t> near = {n};
    for (int64_t k = 1; k < len; ++k)
        for (int64_t d = -2; d <= 2; ++d) near.insert(k * n / len + d);
    std::vector<int64_t> steps;
    for (int64_t step : near)
        if (step >= 1 && step < a.num_iterations() && get_ws(a, step).long_ws != get_ws(a, step - 1).long_ws)
            steps.push_back(step);
    return steps;
}

// untimed warmup: the first steps and each transition +-1, then an exact reset of the state
static std::vector<int64_t> get_warmup_steps(const Hyperparameters& a) {
    std::vector<int64_t> steps = {0, 1, 2};
    for (int64_t s : get_transition_steps(a))
        for (int64_t off : {-1, 0, 1})
            if (s + off >= 0) steps.push_back(s + off);
    std::sort(steps.begin(), steps.end());
    steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
    return steps;
}

// the largest training micro-batch of a rank, which its device buffers hold (8 = ranks x accumulation steps)
static int64_t rank_capacity(const Hyperparameters& a) {
    int64_t bs = a.train_bs_extension;
    for (int64_t b : a.train_bs_schedule) bs = std::max(bs, b);
    return bs / 8;
}

// The schedule's state between two steps as a checkpoint keeps it (TrainingManager::state()),
// parsed and checked against the configuration: windows in range, a batch size of the schedule,
// a positive attention scale, finite frequencies, one to three MTP weights.
struct ScheduleState {
    int64_t ws_short = 0, ws_long = 0, batch_size = 0;
    YarnState yarn;
    std::vector<float> mtp_weights;
};
static ScheduleState parse_schedule_state(const std::string& text, const Hyperparameters& a) {
    const std::vector<std::string> l = split(text, '\n');
    if (l.size() != 6 || !l[5].empty()) fail("schedule state: not 5 lines");
    auto words = [&](size_t i, const char* key) { return keyed_line(l, i, key, "schedule state"); };
    auto number = [](const std::string& v) {  // as state() writes them: %a
        char* end = nullptr;
        const bool plain = !v.empty() && v.size() <= 64 && v.find_first_not_of("0123456789abcdefABCDEFxXpP.+-") == std::string::npos;
        const double x = plain ? strtod(v.c_str(), &end) : 0;
        if (!plain || *end || !std::isfinite(x)) fail("schedule state: '" + v + "' is not a finite number");
        return x;
    };
    const std::vector<std::string> w = words(0, "windows"), b = words(1, "batch_size"), at = words(2, "attn_scale"),
                                   y = words(3, "yarn"), m = words(4, "mtp");
    if (w.size() != 3 || b.size() != 2 || at.size() != 2 || y.size() != HEAD_DIM + 1 || m.size() < 2 || m.size() > 4)
        fail("schedule state: wrong number of values");
    ScheduleState st;
    st.ws_short = parse_i64("windows", w[1]), st.ws_long = parse_i64("windows", w[2]);
    if (st.ws_short < 0 || st.ws_short > MAX_WINDOW_BLOCKS || st.ws_long < 1 || st.ws_long > MAX_WINDOW_BLOCKS)
        fail(strprintf("schedule state: windows %s %s are not in 0..%lld and 1..%lld", w[1].c_str(), w[2].c_str(),
                       (long long)MAX_WINDOW_BLOCKS, (long long)MAX_WINDOW_BLOCKS));
    st.batch_size = parse_i64("batch_size", b[1]);
    if (st.batch_size != a.train_bs_extension &&
        std::find(a.train_bs_schedule.begin(), a.train_bs_schedule.end(), st.batch_size) == a.train_bs_schedule.end())
        fail("schedule state: batch size " + b[1] + " is not one of this configuration's");
    st.yarn.attn_scale = number(at[1]);
    if (!(st.yarn.attn_scale > 0)) fail("schedule state: the attention scale is not positive");
    for (int i = 0; i < HEAD_DIM; ++i) st.yarn.angular_freq.push_back((float)number(y[1 + i]));
    for (size_t i = 1; i < m.size(); ++i) st.mtp_weights.push_back((float)number(m[i]));
    return st;
}

// The record's TrainingManager. Manages the NorMuonAndAdam for all parameters with explicit ordering:
//   1. Scalars are given higher momentum terms to smooth learning (param_table, @ChrisJMcCormick)
//   2. Adam parameters step only on odd steps (@classiclarryd)
//   3. Explicit scatter_order and work_order for communication scheduling (no backward hooks)
//   4. NorMuon has a linear momentum warmup and cooldown schedule
//   5. Learning rates follow a linear decay schedule
//   6. embed is tied to lm_head until the split step (2/3 of training), then untied (@classiclarryd)
// and the model architecture, data and targets that change during training:
//   1. Multi-token prediction weights [1, 0.5, 0.25->0] -> [1, 0.5->0] -> [1] (@varunneal)
//   2. Sliding attention windows [1,3] -> [3,7] -> [5,11] -> [6,13] (short, long; blocks of 128)
//   3. YaRN updates to RoPE on window changes
//   4. embed and lm_head split at 2/3 of training (lm_head's optimizer state copied to embed)
//   5. Batch size schedule 8 -> 16 -> 24 x 2048 x 8 tokens per step
//   6. The final validation extends the long windows from 13 to 20 (no new YaRN update)
class TrainingManager {
   public:
    TrainingManager(const Hyperparameters& args, Model& model, NorMuonAndAdam& optimizer, int grad_accum_steps,
                    int64_t max_local_tokens, int max_cu, cudaStream_t stream)
        : args_(args), model_(model), optimizer_(optimizer), grad_accum_steps_(grad_accum_steps), stream_(stream),
          split_step(get_split_step(args)), warmup_steps(get_warmup_steps(args)) {
        d_tokens_ = arena_.alloc<int32_t>(max_local_tokens + 1);  // inputs and the shifted targets
        d_cu_ = arena_.alloc<int32_t>(max_cu);
        reset_schedule();
    }

    // the step that unties embed from lm_head, and the steps the warmup samples: the first few
    // steps and each window transition +-1 (every shape and schedule the run will see)
    const int64_t split_step;
    const std::vector<int64_t> warmup_steps;

    // back to step 0: the optimizer's state, the windows with YaRN, the batch size
    void reset() {
        optimizer_.reset(stream_);
        reset_schedule();
    }

    // the schedules at `step`; a new batch size goes to the train loader for its next batch
    void advance_schedule(int64_t step, DistributedDataGenerator& train_loader) {
        const Windows w = get_ws(args_, step);
        if (w.long_ws != fa_.ws_long) yarn_apply(args_, fa_.yarn, fa_.ws_long, w.long_ws);
        fa_.ws_short = w.short_ws, fa_.ws_long = w.long_ws;
        const int64_t bs = get_bs(args_, step);
        if (bs != batch_size_) train_loader.set_batch_size({bs, args_.train_max_seq_len, grad_accum_steps_});
        batch_size_ = bs;
        fa_.mtp_weights = get_mtp_weights(args_, step);
    }

    // the final validation's longer window, without a YaRN update
    void apply_final_ws_ext() { fa_.ws_long = args_.ws_validate_post_yarn_ext; }

    // the current phase of the schedule, as the profile's tables name it
    std::string phase() const {
        return strprintf("%lld tokens/step, windows %lld/%lld", (long long)batch_size_, (long long)fa_.ws_short,
                         (long long)fa_.ws_long);
    }

    // The next batch of a loader through the model: training (fp8 head, MTP loss, the backward's
    // state kept) or evaluation. Returns the loss. The first batch of each kind goes to the log.
    float forward_batch(DistributedDataGenerator& loader, bool training) {
        profile_mark(Part::Host, stream_);
        HostBatch& b = loader.next();
        loader.upload(b, d_tokens_, d_cu_, stream_);
        if (!shown_[training]) {
            shown_[training] = true;
            print0(strprintf("first %s batch of rank 0: inputs:(%lld,) targets:(%lld,) cu_seqlens:(%lld,) documents:%lld "
                             "from %s", training ? "training" : "validation", (long long)b.num_tokens,
                             (long long)b.num_tokens, (long long)b.max_num_docs, (long long)b.num_docs,
                             loader.current_file().c_str()), true);
        }
        fa_.training = training;
        fa_.loss_scale = 1.f / grad_accum_steps_;
        return model_.forward(d_tokens_, d_cu_, (int)b.max_num_docs, (int)b.num_tokens, fa_, stream_);
    }

    // One training step: the micro-steps' forward and backward (gradients accumulate), then the
    // optimizers.
    void train_step(int64_t step, DistributedDataGenerator& train_loader) {
        for (int micro = 0; micro < grad_accum_steps_; ++micro) {
            const bool last = micro + 1 == grad_accum_steps_;
            if (last && args_.early_reduce) {  // the reduces start where the gradients become final
                optimizer_.begin_backward_reduces(is_adam_step(step));
                model_.set_grad_ready([this](ReducePoint p, int layer, cudaStream_t s) { optimizer_.backward_reduces(p, layer, s); });
            }
            fa_.first_micro = micro == 0;
            forward_batch(train_loader, true);
            model_.backward(stream_);
            model_.set_grad_ready(nullptr);
        }
        step_optimizers(step);
    }

    void step_optimizers(int64_t step) {
        profile_mark(Part::Optimizer, stream_);
        optimizer_.step(get_lr(args_, step), get_muon_momentum(args_, step), is_adam_step(step), stream_);
        if (step == split_step) optimizer_.copy_lm_state_to_embed(stream_);
    }

    // The schedule's state between two steps, as text (for a checkpoint; floats as their bits):
    // the windows with the YaRN state, the batch size, the MTP weights.
    std::string state() const {
        std::string s = strprintf("windows %lld %lld\nbatch_size %lld\nattn_scale %a\nyarn", (long long)fa_.ws_short,
                                  (long long)fa_.ws_long, (long long)batch_size_, fa_.yarn.attn_scale);
        for (float f : fa_.yarn.angular_freq) s += strprintf(" %a", (double)f);
        s += "\nmtp";
        for (float w : fa_.mtp_weights) s += strprintf(" %a", (double)w);
        return s + "\n";
    }
    void set_state(const ScheduleState& st) {
        fa_.ws_short = st.ws_short, fa_.ws_long = st.ws_long;
        batch_size_ = st.batch_size;
        fa_.yarn = st.yarn;
        fa_.mtp_weights = st.mtp_weights;
    }

   private:
    void reset_schedule() {
        const Windows w = get_ws(args_, 0);
        fa_.ws_short = w.short_ws, fa_.ws_long = w.long_ws;
        fa_.yarn = yarn_reset(args_);
        batch_size_ = get_bs(args_, 0);
    }

    const Hyperparameters& args_;
    Model& model_;
    NorMuonAndAdam& optimizer_;
    const int grad_accum_steps_;
    cudaStream_t stream_;
    ForwardArgs fa_;            // windows, YaRN and MTP weights of the current step
    int64_t batch_size_ = 0;    // tokens per step over all ranks
    bool shown_[2] = {false, false};
    DeviceArena arena_;
    int32_t *d_tokens_ = nullptr, *d_cu_ = nullptr;  // the current micro-batch on the GPU
};

// -----------------------------------------------------------------------------
// main: the record's script. What it calls from the harness is declared here, defined below the line.

// where a run stands, as a checkpoint keeps it
struct RunState {
    std::string configuration, gemm_plan;
    int64_t steps_done = 0;
    double training_time_ms = 0;
};

struct ResumeState;
// A run's resolved inputs, every one checked: the configuration, where the data is, and what a
// --rerun log or a --resume checkpoint brings (the GEMM plan to follow; the state to continue from)
struct RunSetup {
    Hyperparameters args;
    int world_size = 0;
    std::string data_path, gemm_plan;
    std::shared_ptr<ResumeState> resume;  // --resume: the checkpoint, read and checked through
};

#ifndef TRAIN_GPT_NO_MAIN
// The processes of a run: MPI ranks, one GPU each (by rank within the node), NCCL over them.
struct Distributed {
    int rank = 0, world_size = 1;
    MPI_Comm node_comm = MPI_COMM_NULL;
    ncclComm_t comm = nullptr;  // none at world size 1
};


class LoopProfiler;
class RunHarness {  // the training loop's clock, step lines, profiler, checkpoints and --resume
   public:
    RunHarness(const Hyperparameters& args, RunSetup& setup, const std::string& configuration,
               const std::string& gemm_plan, ParamStore& params, NorMuonAndAdam& opt, TrainingManager& tm,
               DistributedDataGenerator& loader, const Distributed& dist, cudaStream_t stream);
    ~RunHarness();
    int64_t first_step() const { return first_step_; }
    bool stopped() const { return stopped_; }                  // by SIGINT/SIGTERM, after a checkpoint
    void stop_clock();                                         // for validation
    void log_validation(int64_t step, double val_loss);        // and the clock again
    void checkpoint(int64_t steps_done);                       // off the clock; a failure is said, and the run goes on
    void timed_step(int64_t step, const std::function<void()>& train_step);
    int finish();                                              // the exit status

   private:
    double elapsed_ms() const;
    void start_clock();
    const Hyperparameters& args_;
    ParamStore& params_;
    NorMuonAndAdam& opt_;
    TrainingManager& tm_;
    DistributedDataGenerator& loader_;
    const Distributed& dist_;
    cudaStream_t stream_;
    std::unique_ptr<LoopProfiler> profiler_;
    RunState rs_;
    std::string last_checkpoint_;
    double training_time_ms_ = 0, clock_at_start_ = 0;
    int64_t first_step_ = 0;
    bool stopped_ = false;
    std::string failure_;  // a failed final checkpoint or log write: the run exits 1
    std::chrono::steady_clock::time_point t0_;
};

static int run_tool(const std::vector<std::string>& cli);
static Distributed init_distributed(int& argc, char**& argv);
static RunSetup resolve_configuration(const std::vector<std::string>& cli, const Distributed& dist);
static void init_devices(Distributed& d);
static bool sharing_gpus();
static std::string open_log(Hyperparameters& args, const Distributed& d, const std::string& data_path, int argc,
                            char** argv);
static void use_given_plan(Gemms& gemms, const std::string& given_plan);
static std::string settle_gemm_plan(Gemms& gemms, const std::string& given_plan, int world_size);
static double peak_mib();
static void finalize_distributed(Distributed& d);

// The record's script: set up, warm up and reset, then train and validate. What it calls from the
// harness (configuration, log, GEMM plan, clock, checkpoints; below the line) leaves the math alone.
static int trainer_main(int argc, char** argv) {
    const std::vector<std::string> cli(argv + 1, argv + argc);
    const int tool_rc = run_tool(cli);  // --help, --print-source, --diff-logs, --check
    if (tool_rc >= 0) return tool_rc;
    Distributed dist = init_distributed(argc, argv);
    const int world_size = dist.world_size, grad_accum_steps = 8 / world_size;
    RunSetup setup = resolve_configuration(cli, dist);  // every input checked before any GPU work
    const Hyperparameters& args = setup.args;
    init_devices(dist);
    const std::string configuration = open_log(setup.args, dist, setup.data_path, argc, argv);
    if (sharing_gpus()) print0("note: ranks share GPUs (TRAIN_GPT_SHARE_GPUS=1): a test of the multi-rank paths; "
                               "its times mean nothing", true);

    // The model's parameters from the seed, the model, the optimizer, the training manager
    ParamStore params(world_size, args.seed);
    print0(strprintf("parameters: %lld in %zu banks, %.1f MiB with gradients", (long long)params.count(),
                     model_params(world_size).size(), params.bytes() / 1048576.0), true);
    const int64_t capacity = rank_capacity(args);  // the largest training micro-batch of a rank
    const int64_t eval_local = args.val_batch_size / 8, max_local = std::max(capacity, eval_local);
    const int max_cu = (int)max_num_docs_of(max_local);
    Gemms gemms(args.gemm_autotune, (int)args.gemm_candidates);
    use_given_plan(gemms, setup.gemm_plan);
    Model model(params, gemms, args, (int)capacity, (int)eval_local, max_cu, (int)max_num_docs_of(capacity));
    NorMuonAndAdam optimizer(params, gemms, args, world_size, dist.rank, dist.comm);
    params.save_initial_state();  // restored after the warmup
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    TrainingManager training_manager(args, model, optimizer, grad_accum_steps, max_local, max_cu, stream);
    peak_mib();
    LoaderOptions train_opt, val_opt;
    train_opt.cycle = args.cycle_data, train_opt.capacity_tokens = capacity;
    val_opt.align_to_bos = false, val_opt.capacity_tokens = eval_local;
    auto train_loader = [&] {
        return std::make_unique<DistributedDataGenerator>(join_data_path(setup.data_path, args.train_files),
                                                          BatchSize{get_bs(args, 0), args.train_max_seq_len, grad_accum_steps},
                                                          dist.rank, world_size, train_opt);
    };
    auto val_loader = [&] {
        return std::make_unique<DistributedDataGenerator>(join_data_path(setup.data_path, args.val_files),
                                                          BatchSize{args.val_batch_size, -1, grad_accum_steps}, dist.rank,
                                                          world_size, val_opt);
    };

    // Warmup: the sampled steps, untimed, then back to the initial state (the record warms up its
    // compiled kernels this way; here it also proves every shape runs and tunes the GEMMs)
    {
        auto warmup_loader = train_loader();
        std::string list;
        for (int64_t st : training_manager.warmup_steps) list += (list.empty() ? "" : ",") + std::to_string(st);
        print0("warmup steps " + list, true);
        for (int64_t step : training_manager.warmup_steps) {
            try {
                training_manager.advance_schedule(step, *warmup_loader);
                training_manager.forward_batch(*val_loader(), false);  // the first validation batch suffices
                training_manager.train_step(step, *warmup_loader);
            } catch (const TrainerError& e) {
                throw TrainerError(strprintf("%s (in the warmup, at its step %lld)", e.what(), (long long)step));
            }
        }
    }
    const std::string gemm_plan = settle_gemm_plan(gemms, setup.gemm_plan, world_size);
    print0("resetting the model", true);
    model.set_overlap(true);  // after the GEMM tuning, which times each shape alone
    params.load_initial_state(stream);
    training_manager.reset();
    CUDA_CHECK(cudaStreamSynchronize(stream));

    // Training and validation (the record's loop; the clock stops for validation and checkpoints)
    auto loader = train_loader();
    const int64_t train_steps = args.num_iterations();
    RunHarness run(args, setup, configuration, gemm_plan, params, optimizer, training_manager, *loader, dist, stream);
    for (int64_t step = run.first_step(); step <= train_steps; ++step) {
        const bool last_step = step == train_steps;
        training_manager.advance_schedule(step, *loader);
        if (last_step || (args.val_loss_every > 0 && step % args.val_loss_every == 0)) {
            if (last_step) training_manager.apply_final_ws_ext();
            run.stop_clock();
            const int64_t val_steps = grad_accum_steps * args.val_tokens / args.val_batch_size;
            auto val = val_loader();
            double val_loss = 0;
            for (int64_t v = 0; v < val_steps; ++v) val_loss += training_manager.forward_batch(*val, false);
            val_loss /= val_steps;
            MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &val_loss, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
            run.log_validation(step, val_loss / world_size);  // the mean over the ranks' tokens; the clock again
        }
        if (last_step) {
            if (args.save_checkpoint) run.checkpoint(step);
            break;  // the last step only validates
        }
        run.timed_step(step, [&] { training_manager.train_step(step, *loader); });
        if (run.stopped()) break;  // SIGINT/SIGTERM: after a checkpoint
    }
    const int rc = run.finish();

    CUDA_CHECK(cudaStreamDestroy(stream));
    if (g_logfile) fclose(g_logfile);
    finalize_distributed(dist);
    return rc;
}

int main(int argc, char** argv) {
    try {
        return trainer_main(argc, argv);
    } catch (const std::exception& e) {
        fatal(e.what());
    }
}
#endif  // TRAIN_GPT_NO_MAIN

// =============================================================================================
// THE HARNESS. Below this line: what a record never edits. The flags' machinery, the loop
// profiler, cuBLASLt's GEMM plan and autotune, logs and --diff-logs, checkpoints, and main's
// setup (--rerun, --resume), clock and step lines.
// =============================================================================================

// -----------------------------------------------------------------------------
// GEMMs: cuBLASLt's descriptors, the per-shape plan and its autotuning (the Gemms class is declared
// above the line, with the calls the model and the optimizer make).

std::string Gemms::plan_text() const {
    std::string s;
    for (const auto& [key, p] : plans_) {
        const double tflop = 2e-12 * key.m * key.n * key.k * key.batch;  // per call, for the rate
        std::string note = fixed_ ? "given"
                           : p.tuned_ms_first > 0
                               ? strprintf("tuned: %.4f ms, %.0f TFLOP/s; first choice %.4f ms", p.tuned_ms_best,
                                           tflop / (p.tuned_ms_best * 1e-3), p.tuned_ms_first)
                               : "first choice";
        s += "gemm " + key_text(key) + " = " + algo_hex(p.candidates.front()) + " (" + note + ")\n";
    }
    return s;
}

void Gemms::set_plan(const std::string& text) {
    std::map<std::string, cublasLtMatmulAlgo_t> plan = parse_plan(text);
    if (!plans_.empty()) fail("set_plan: GEMMs have already run");
    fixed_plan_ = std::move(plan);
    fixed_ = true;
}

void Gemms::adopt_plan(const std::string& text) {
    const std::map<std::string, cublasLtMatmulAlgo_t> plan = parse_plan(text);
    for (auto& [key, p] : plans_) {
        auto it = plan.find(key_text(key));
        if (it != plan.end()) p.candidates = {it->second};
    }
}

std::string Gemms::tuning_report() const {
    int tuned = 0, changed = 0;
    double saved = 0;
    for (const auto& [key, p] : plans_) {
        tuned += p.tuned_ms_first > 0;
        changed += p.tuned_ms_first > p.tuned_ms_best;
        saved += p.tuned_ms_first - p.tuned_ms_best;
    }
    return strprintf("%d GEMM shapes tuned, %d faster than cuBLASLt's first choice (%.3f ms per call of each, summed)",
                     tuned, changed, saved);
}

void Gemms::release(Plan& p) {
    if (p.desc) CUBLAS_CHECK(cublasLtMatmulDescDestroy(p.desc));
    for (cublasLtMatrixLayout_t l : {p.a, p.b, p.c})
        if (l) CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(l));
}

Gemms::Plan& Gemms::plan(const Key& key) {
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
    Plan p;
    const bool fp8 = key.ta != CUDA_R_16BF;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = key.opb == Op::T ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t tb = key.opa == Op::T ? CUBLAS_OP_T : CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    if (fp8) {
        int8_t fast = key.fast_accum ? 1 : 0;
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
    }
    // stored shapes, column-major: our B is n x k (op T) or k x n (op N) in row-major terms
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, key.tb, key.opb == Op::N ? key.n : key.k,
                                            key.opb == Op::N ? key.k : key.n, key.ldb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, key.ta, key.opa == Op::N ? key.k : key.m,
                                            key.opa == Op::N ? key.m : key.k, key.lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, key.tc, key.n, key.m, key.ldc));
    if (key.batch > 1) {
        const std::pair<cublasLtMatrixLayout_t, int64_t> layouts[] = {{p.a, key.stride_b}, {p.b, key.stride_a}, {p.c, key.stride_c}};
        for (auto [layout, stride] : layouts) {
            CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &key.batch, sizeof key.batch));
            CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
        }
    }
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &workspace_bytes_, sizeof workspace_bytes_));
    uint32_t aa = key.align_b, ab = key.align_a, ac = key.align_c;  // cuBLASLt's A is our B
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof aa));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof ab));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof ac));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac, sizeof ac));
    if (fp8) {  // the heuristic must see scaling; the real scale pointers are set per call
        const void* any = workspace_;
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &any, sizeof any));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &any, sizeof any));
    }
    cublasLtMatmulHeuristicResult_t results[GEMM_MAX_CANDIDATES];
    int found = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt_, p.desc, p.a, p.b, p.c, p.c, pref, candidates_, results, &found));
    CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    for (int i = 0; i < found; ++i) p.candidates.push_back(results[i].algo);
    if (found == 0) fatal("cuBLASLt has no algorithm for a " + describe(key));
    if (fixed_ || frozen_) {  // no timing: the given plan's algorithm, else the heuristic's first choice
        p.tuned = true;
        auto it = fixed_plan_.find(key_text(key));
        if (it != fixed_plan_.end()) p.candidates = {it->second};
        else unplanned_ += fixed_;
    }
    return plans_.emplace(key, p).first->second;
}

const char* Gemms::type_name(cudaDataType t) {
    return t == CUDA_R_16BF ? "bf16" : t == CUDA_R_32F ? "f32" : t == CUDA_R_8F_E4M3 ? "e4m3" : "e5m2";
}

std::string Gemms::key_text(const Key& k) {
    return strprintf("%s,%s,%s %c%c m=%d n=%d k=%d ld=%lld,%lld,%lld fast=%d align=%d,%d,%d batch=%d stride=%lld,%lld,%lld",
                     type_name(k.ta), type_name(k.tb), type_name(k.tc), op_char(k.opa), op_char(k.opb), k.m, k.n, k.k,
                     (long long)k.lda, (long long)k.ldb, (long long)k.ldc, (int)k.fast_accum, k.align_a, k.align_b,
                     k.align_c, k.batch, (long long)k.stride_a, (long long)k.stride_b, (long long)k.stride_c);
}

std::map<std::string, cublasLtMatmulAlgo_t> Gemms::parse_plan(const std::string& text) {
    std::map<std::string, cublasLtMatmulAlgo_t> plan;
    int line_no = 0;
    for (const std::string& line : split(text, '\n')) {
        ++line_no;
        if (line.empty()) continue;
        const size_t eq = line.find(" = "), paren = line.find(" (", eq == std::string::npos ? 0 : eq);
        cublasLtMatmulAlgo_t algo;
        if (line.rfind("gemm ", 0) != 0 || eq == std::string::npos || paren == std::string::npos || line.back() != ')' ||
            !parse_algo_hex(line.substr(eq + 3, paren - eq - 3), algo))
            fail(strprintf("GEMM plan line %d is not 'gemm SHAPE = ALGORITHM (note)': %s", line_no, line.c_str()));
        if (!plan.emplace(line.substr(5, eq - 5), algo).second)
            fail(strprintf("GEMM plan line %d names a shape twice: %s", line_no, line.c_str()));
    }
    return plan;
}

std::string Gemms::algo_hex(const cublasLtMatmulAlgo_t& a) {
    std::string s;
    for (uint64_t w : a.data) s += strprintf("%016llx", (unsigned long long)w);
    return s;
}

bool Gemms::parse_algo_hex(const std::string& h, cublasLtMatmulAlgo_t& a) {
    if (h.size() != 16 * std::size(a.data)) return false;
    for (size_t i = 0; i < std::size(a.data); ++i) {
        uint64_t w = 0;
        for (char c : h.substr(16 * i, 16)) {
            const int d = isdigit((unsigned char)c) ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
            if (d < 0) return false;
            w = w * 16 + d;
        }
        a.data[i] = w;
    }
    return true;
}

std::string Gemms::describe(const Key& key) {
    return strprintf("%s GEMM of m=%d n=%d k=%d (lda %lld ldb %lld ldc %lld)", key.ta == CUDA_R_16BF ? "bf16" : "fp8",
                     key.m, key.n, key.k, (long long)key.lda, (long long)key.ldb, (long long)key.ldc);
}

std::string Gemms::label_text(const Key& k, float beta) {
    std::string s = strprintf("%s %c%c %dx%dx%d", type_name(k.ta), op_char(k.opa), op_char(k.opb), k.m, k.n, k.k);
    if (k.batch > 1) s += strprintf(" (x%d)", k.batch);
    if (k.tc == CUDA_R_32F) s += " -> f32";
    if (beta != 0.f) s += " + C";
    return s;
}

size_t Gemms::extent_bytes(const Key& key) {
    const size_t elem = key.tc == CUDA_R_32F ? 4 : 2;
    return elem * ((size_t)(key.batch - 1) * key.stride_c + (size_t)(key.m - 1) * key.ldc + key.n);
}

void Gemms::tune(cudaStream_t stream, const Key& key, Plan& p, const void* A, const void* B, const void* C, void* D,
          float alpha, float beta) {
    p.tuned = true;
    if (!autotune_ || p.candidates.size() < 2) return;
    void* saved = nullptr;
    const size_t bytes = extent_bytes(key);
    if (beta != 0.f && C == D) {
        CUDA_CHECK(cudaMalloc(&saved, bytes));
        CUDA_CHECK(cudaMemcpyAsync(saved, D, bytes, cudaMemcpyDeviceToDevice, stream));
    }
    cudaEvent_t ev[2];
    for (cudaEvent_t& e : ev) CUDA_CHECK(cudaEventCreate(&e));
    std::vector<std::pair<float, cublasLtMatmulAlgo_t>> timed;
    for (size_t i = 0; i < p.candidates.size(); ++i) {
        const cublasLtMatmulAlgo_t& algo = p.candidates[i];
        auto call = [&] {
            return cublasLtMatmul(lt_, p.desc, &alpha, B, p.a, A, p.b, &beta, C, p.c, D, p.c, &algo,
                                  workspace(stream), workspace_bytes_, stream);
        };
        cublasStatus_t st = call();
        if (st == CUBLAS_STATUS_NOT_SUPPORTED) continue;
        if (st != CUBLAS_STATUS_SUCCESS)
            fatal(strprintf("cublasLtMatmul failed for a %s: %s", describe(key).c_str(), cublasLtGetStatusString(st)));
        float best = 1e30f;
        for (int rep = 0; rep < 3; ++rep) {
            CUDA_CHECK(cudaEventRecord(ev[0], stream));
            CUBLAS_CHECK(call());
            CUDA_CHECK(cudaEventRecord(ev[1], stream));
            CUDA_CHECK(cudaEventSynchronize(ev[1]));
            float ms;
            CUDA_CHECK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
            best = std::min(best, ms);
        }
        if (i == 0) p.tuned_ms_first = best;
        timed.push_back({best, algo});
    }
    for (cudaEvent_t e : ev) CUDA_CHECK(cudaEventDestroy(e));
    if (saved) {
        CUDA_CHECK(cudaMemcpyAsync(D, saved, bytes, cudaMemcpyDeviceToDevice, stream));
        CUDA_CHECK(cudaStreamSynchronize(stream));
        CUDA_CHECK(cudaFree(saved));
    }
    if (timed.empty()) fatal("no cuBLASLt algorithm runs a " + describe(key));
    std::stable_sort(timed.begin(), timed.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
    if (p.tuned_ms_first == 0) p.tuned_ms_first = timed.front().first;  // the first choice did not run
    p.tuned_ms_best = timed.front().first;
    p.candidates.clear();
    for (auto& [ms, algo] : timed) p.candidates.push_back(algo);
}

void Gemms::run(cudaStream_t stream, const Key& key, const void* A, const void* B, const void* C, void* D, float alpha,
         float beta, const float* scale_a, const float* scale_b) {
    Plan& p = plan(key);
    if (scale_a) {  // cuBLASLt's A is our B
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_b, sizeof scale_b));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_a, sizeof scale_a));
    }
    if (!p.tuned) tune(stream, key, p, A, B, C, D, alpha, beta);
    // profiled: the model's GEMMs are a part of their own; the head's and the optimizer's count
    // as those parts
    const Part outer = profiled_part();
    const std::string label = g_profiler ? label_text(key, beta) : std::string();  // (only while profiling)
    ProfiledPart part(outer == Part::Head || outer == Part::Optimizer ? outer : Part::Gemm, stream,
                      2.0 * key.m * key.n * key.k * key.batch, key.ta != CUDA_R_16BF, label.c_str());
    while (true) {
        cublasStatus_t st = cublasLtMatmul(lt_, p.desc, &alpha, B, p.a, A, p.b, &beta, C, p.c, D, p.c,
                                           &p.candidates.front(), workspace(stream), workspace_bytes_, stream);
        if (st == CUBLAS_STATUS_SUCCESS) return;
        if (st != CUBLAS_STATUS_NOT_SUPPORTED || p.candidates.size() == 1)
            fatal(strprintf("cublasLtMatmul failed for a %s: %s", describe(key).c_str(), cublasLtGetStatusString(st)));
        p.candidates.erase(p.candidates.begin());
    }
}

void* Gemms::workspace(cudaStream_t stream) const {
    auto it = stream_workspaces_.find(stream);
    return it == stream_workspaces_.end() ? workspace_ : it->second;
}

// -----------------------------------------------------------------------------
// Where a training step's time goes, measured in the real loop (--profile_steps N; `make bench`
// uses it on real data): the compute stream's timeline is cut by marks, each saying "from here on
// the GPU works on part p", and every stretch between two marks is added to its part. Stretches
// where the GPU waits for the host (data, launches, the loss's readback) count as the part whose
// mark opened them: marks at the host's waits put those under `host`. Each mark also opens an NVTX
// range of the part's name, so Nsight Systems shows the same parts on the host's timeline.
static const char* const part_names[] = {"host, data and uploads", "bf16 GEMMs (model)", "fp8 lm_head (casts, GEMMs)",
                                         "cross-entropy (loss, grad)", "attention forward", "attention backward",
                                         "norms, gates, rope, elementwise", "embedding backward",
                                         "optimizer (and NCCL waits)"};
static const char* const part_short[] = {"host", "gemm", "head", "loss", "attention_fwd", "attention_bwd", "elementwise",
                                         "embed_bwd", "optimizer"};

// The GPU's SM clock and power while training steps run, sampled every 10 ms by a thread of its own
// (NVML, loaded at run time: without the driver's library there is nothing to print). An H200 runs
// this loop at its power limit, 700 W, at about 1.5 GHz rather than its 1.98 GHz boost: in the loop a
// GEMM costs what its energy costs, so the table gives the GEMM parts' energy per FLOP (their time at
// the phase's mean power) rather than a floor at some peak rate, which the loop never reaches.
class GpuSampler {
   public:
    struct Totals {
        double mhz = 0, watts = 0;
        int64_t samples = 0, capped = 0;  // capped: the clock held back by the power limit (NVML's SW power cap)
    };
    GpuSampler() {
        lib_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!lib_) return;
        auto fn = [&](auto& f, const char* name) { f = reinterpret_cast<std::decay_t<decltype(f)>>(dlsym(lib_, name)); };
        int (*init)() = nullptr;
        int (*by_bus)(const char*, void**) = nullptr;
        int (*max_clock)(void*, int, unsigned*) = nullptr;
        int (*limit)(void*, unsigned*) = nullptr;
        fn(init, "nvmlInit_v2"), fn(shutdown_, "nvmlShutdown"), fn(by_bus, "nvmlDeviceGetHandleByPciBusId_v2");
        fn(clock_, "nvmlDeviceGetClockInfo"), fn(power_, "nvmlDeviceGetPowerUsage"), fn(max_clock, "nvmlDeviceGetMaxClockInfo");
        fn(limit, "nvmlDeviceGetEnforcedPowerLimit"), fn(reasons_, "nvmlDeviceGetCurrentClocksEventReasons");
        if (!reasons_) fn(reasons_, "nvmlDeviceGetCurrentClocksThrottleReasons");
        int dev = 0;
        char bus[32];
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, dev));
        if (!init || !shutdown_ || !by_bus || !clock_ || !power_ || !max_clock || !limit || !reasons_ || init() != 0) return;
        up_ = true;
        if (by_bus(bus, &dev_) != 0 || max_clock(dev_, NVML_CLOCK_SM, &max_mhz_) != 0 || limit(dev_, &limit_mw_) != 0) return;
        thread_ = std::thread([this] { run(); });
    }
    ~GpuSampler() {
        if (thread_.joinable()) quit_ = true, thread_.join();
        if (up_) shutdown_();
        if (lib_) dlclose(lib_);
    }
    unsigned max_mhz() const { return max_mhz_; }
    double limit_watts() const { return limit_mw_ / 1e3; }
    void on(bool v) { on_ = v; }
    Totals take() {  // the samples since the last take (a sample is kept only if on() held throughout)
        std::lock_guard<std::mutex> g(mu_);
        Totals t = pending_;
        pending_ = {};
        return t;
    }

   private:
    static constexpr int NVML_CLOCK_SM = 1;
    static constexpr unsigned long long SW_POWER_CAP = 0x4;
    void run() {
        while (!quit_) {
            unsigned mhz = 0, mw = 0;
            unsigned long long why = 0;
            if (on_ && clock_(dev_, NVML_CLOCK_SM, &mhz) == 0 && power_(dev_, &mw) == 0 && reasons_(dev_, &why) == 0) {
                std::lock_guard<std::mutex> g(mu_);
                if (on_)  // (not turned off while it read: else the sample belongs to no step)
                    pending_.mhz += mhz, pending_.watts += mw / 1e3, pending_.samples += 1,
                        pending_.capped += (why & SW_POWER_CAP) != 0;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
    }
    void* lib_ = nullptr;
    void* dev_ = nullptr;
    bool up_ = false;
    int (*shutdown_)() = nullptr;
    int (*clock_)(void*, int, unsigned*) = nullptr;
    int (*power_)(void*, unsigned*) = nullptr;
    int (*reasons_)(void*, unsigned long long*) = nullptr;
    unsigned max_mhz_ = 0, limit_mw_ = 0;
    std::atomic<bool> on_{false}, quit_{false};
    std::mutex mu_;
    Totals pending_;
    std::thread thread_;
};

class LoopProfiler {
   public:
    // sample_gpu: the GPU's clock and power too (a thread of its own, started here, off the training clock)
    explicit LoopProfiler(bool sample_gpu = false) : sampler_(sample_gpu ? std::make_unique<GpuSampler>() : nullptr) {}
    ~LoopProfiler() {
        if (open_) nvtxRangePop();
        for (cudaEvent_t e : pool_) CUDA_CHECK(cudaEventDestroy(e));
    }
    Part current() const { return current_; }
    // from here on, the work queued on s counts as part p (a GEMM's line of its own: label, flops)
    void mark(Part p, cudaStream_t s, const char* label = nullptr, double flops = 0) {
        if (used_ == pool_.size()) {
            cudaEvent_t e;
            CUDA_CHECK(cudaEventCreate(&e));
            pool_.push_back(e);
        }
        CUDA_CHECK(cudaEventRecord(pool_[used_], s));
        parts_.push_back(p);
        labels_.push_back(label ? Label{label, flops} : Label{});
        ++used_;
        current_ = p;
        if (open_) nvtxRangePop();
        nvtxRangePushA(part_short[(int)p]);
        open_ = true;
    }
    // floating-point work of the GEMMs queued since the step began (for their energy per FLOP)
    void add_flops(Part p, double flops, bool fp8) { (fp8 ? fp8_flops_ : bf16_flops_)[(int)p] += flops; }
    void begin_step(cudaStream_t s) {
        used_ = 0;
        parts_.clear(), labels_.clear();
        wall0_ = std::chrono::steady_clock::now();
        mark(Part::Host, s);
    }
    // ends the step that began last: waits for it and adds its parts to the phase's totals
    void end_step(cudaStream_t s, const std::string& phase) {
        mark(Part::Host, s);
        CUDA_CHECK(cudaEventSynchronize(pool_[used_ - 1]));
        const double wall = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - wall0_).count();
        Totals& t = phases_[phase];
        if (t.steps == 0) order_.push_back(phase);
        for (size_t i = 0; i + 1 < used_; ++i) {
            float ms;
            CUDA_CHECK(cudaEventElapsedTime(&ms, pool_[i], pool_[i + 1]));
            t.ms[(int)parts_[i]] += ms;
            if (!labels_[i].text.empty()) {
                Shape& g = t.shapes[{(int)parts_[i], labels_[i].text}];
                g.ms += ms, g.flops += labels_[i].flops, g.calls += 1;
            }
        }
        for (int p = 0; p < (int)Part::COUNT; ++p) t.bf16_flops[p] += bf16_flops_[p], t.fp8_flops[p] += fp8_flops_[p];
        bf16_flops_.fill(0), fp8_flops_.fill(0);
        t.wall_ms += wall;
        t.steps += 1;
        if (open_) nvtxRangePop();
        open_ = false;
    }
    // the host clock of a step that was not profiled, from an idle GPU to an idle GPU (the profiled
    // ones should take as long: their events cost little)
    void add_unprofiled(const std::string& phase, double ms) {
        Unprofiled& u = unprofiled_[phase];
        u.ms += ms, u.steps += 1;
    }
    // the GPU's clock and power from here to the next samples_of
    void sample() {
        if (sampler_) sampler_->on(true);
    }
    void samples_of(const std::string& phase) {
        if (!sampler_) return;
        sampler_->on(false);
        const GpuSampler::Totals t = sampler_->take();
        GpuSampler::Totals& g = gpu_[phase];
        g.mhz += t.mhz, g.watts += t.watts, g.samples += t.samples, g.capped += t.capped;
    }
    // ms per step of a part over the phase's steps
    double part_ms(const std::string& phase, Part p) const {
        auto it = phases_.find(phase);
        return it == phases_.end() || it->second.steps == 0 ? 0 : it->second.ms[(int)p] / it->second.steps;
    }
    // One table per phase: each part's ms per step and share, the GEMM parts beside their energy per
    // FLOP at the phase's mean power (where NVML answered). cuBLASLt's bf16 GEMM alone at the H200's
    // limit takes 1.06-1.10 pJ/FLOP (records/2026-12-04_H200_energy_costs): a GEMM part near that is
    // at what its FLOPs cost, however far its rate is from a peak.
    std::string table() const {
        std::string s;
        for (const std::string& phase : order_) {
            const Totals& t = phases_.at(phase);
            double total = 0;
            for (double ms : t.ms) total += ms;
            s += strprintf("profile %s: %lld steps, %.2f ms per step (host clock %.2f", phase.c_str(),
                           (long long)t.steps, total / t.steps, t.wall_ms / t.steps);
            auto u = unprofiled_.find(phase);
            if (u != unprofiled_.end() && u->second.steps > 0)
                s += strprintf("; %lld steps not profiled: %.2f", (long long)u->second.steps, u->second.ms / u->second.steps);
            s += ")\n";
            auto g = gpu_.find(phase);
            const bool sampled = g != gpu_.end() && g->second.samples > 0;  // (samples only where NVML answered)
            const double watts = sampled ? g->second.watts / g->second.samples : 0;
            s += strprintf("  %-34s %9s %6s %10s\n", "part", "ms/step", "share", "pJ/FLOP");
            for (int p = 0; p < (int)Part::COUNT; ++p) {
                const double ms = t.ms[p] / t.steps, flops = (t.bf16_flops[p] + t.fp8_flops[p]) / t.steps;
                s += strprintf("  %-34s %9.2f %5.1f%% %10s\n", part_names[p], ms, 100 * ms / (total / t.steps),
                               sampled && flops > 0 ? strprintf("%.3f", ms * watts / flops * 1e9).c_str() : "-");
            }
            // the model's and the head's GEMMs by shape (m x n x k of C = op(A) op(B)), slowest first:
            // which ones run below the ceilings in the loop
            std::vector<std::pair<double, std::string>> rows;
            for (const auto& [key, g] : t.shapes) {
                if (key.first != (int)Part::Gemm && key.first != (int)Part::Head) continue;
                rows.push_back({g.ms / t.steps, strprintf("    %-40s %9.2f ms %6.0f TFLOP/s %4.0f calls a step\n",
                                                          key.second.c_str(), g.ms / t.steps, g.flops / g.ms / 1e9,
                                                          (double)g.calls / t.steps)});
            }
            std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
            if (!rows.empty()) s += "  the GEMMs by shape (m x n x k), in the loop:\n";
            for (const auto& r : rows) s += r.second;
            if (sampled) {
                const GpuSampler::Totals& q = g->second;
                // at the limit a step's time is its energy over the limit: the figure a change lowers. The
                // samples span every step of the phase, profiled or not: their mean host-clock time
                const Unprofiled un = u != unprofiled_.end() ? u->second : Unprofiled{};
                const double step_ms = (t.wall_ms + un.ms) / (t.steps + un.steps);
                s += strprintf("  GPU over these steps: SM clock %.0f MHz on average (its highest %u), %.0f W (limit %.0f W), "
                               "%.0f J a step; held back by the power limit in %.0f%% of %lld samples\n",
                               q.mhz / q.samples, sampler_->max_mhz(), watts, sampler_->limit_watts(),
                               watts * step_ms / 1e3, 100.0 * q.capped / q.samples, (long long)q.samples);
            }
        }
        return s;
    }

   private:
    struct Shape {
        double ms = 0, flops = 0;
        int64_t calls = 0;
    };
    struct Totals {
        std::array<double, (size_t)Part::COUNT> ms{}, bf16_flops{}, fp8_flops{};
        std::map<std::pair<int, std::string>, Shape> shapes;  // (part, GEMM label)
        double wall_ms = 0;
        int64_t steps = 0;
    };
    struct Label {
        std::string text;
        double flops = 0;
    };
    std::vector<cudaEvent_t> pool_;
    std::vector<Part> parts_;
    std::vector<Label> labels_;
    size_t used_ = 0;
    Part current_ = Part::Host;
    bool open_ = false;
    std::array<double, (size_t)Part::COUNT> bf16_flops_{}, fp8_flops_{};
    std::chrono::steady_clock::time_point wall0_;
    struct Unprofiled {
        double ms = 0;
        int64_t steps = 0;
    };
    std::map<std::string, Totals> phases_;
    std::map<std::string, Unprofiled> unprofiled_;
    std::vector<std::string> order_;
    std::unique_ptr<GpuSampler> sampler_;
    std::map<std::string, GpuSampler::Totals> gpu_;
};

static void profile_mark(Part p, cudaStream_t s) {
    if (g_profiler) g_profiler->mark(p, s);
}

static Part profiled_part() { return g_profiler ? g_profiler->current() : Part::Host; }

ProfiledPart::ProfiledPart(Part p, cudaStream_t s, double gemm_flops, bool fp8, const char* gemm_label) : s_(s) {
    if (!g_profiler) return;
    outer_ = g_profiler->current();
    if (gemm_flops > 0) g_profiler->add_flops(p, gemm_flops, fp8);
    g_profiler->mark(p, s, gemm_label, gemm_flops);
}
ProfiledPart::~ProfiledPart() {
    if (g_profiler) g_profiler->mark(outer_, s_);
}


// -----------------------------------------------------------------------------
// Configuration: the flags, their parsing and the resolved configuration that goes in the log.

struct Option {
    const char* name;
    OptType type;
    void* ptr;
    const char* help;
    const char* group;  // the record's hyperparameters, running, implementation
};

// the flags of a Hyperparameters, in the list's order (the order of --help and of the log)
static std::vector<Option> options_of(Hyperparameters& a) {
#define OPTION_OF_HYPERPARAMETER(type, name, value, help) {#name, OptType::type, &a.name, help, group},
    std::vector<Option> opts;
    const char* group = "the record's hyperparameters";
    opts.insert(opts.end(), {RECORD_HYPERPARAMETERS(OPTION_OF_HYPERPARAMETER)});
    group = "running";
    opts.insert(opts.end(), {RUN_OPTIONS(OPTION_OF_HYPERPARAMETER)});
    group = "implementation";
    opts.insert(opts.end(), {IMPLEMENTATION_OPTIONS(OPTION_OF_HYPERPARAMETER)});
    return opts;
#undef OPTION_OF_HYPERPARAMETER
}

static std::string format_double(double v) {
    // shortest text that reads back to the same double, like Python's repr
    for (int prec = 1; prec <= 17; ++prec) {
        std::string s = strprintf("%.*g", prec, v);
        if (strtod(s.c_str(), nullptr) == v) return s;
    }
    return strprintf("%.17g", v);
}

static std::string format_option(const Option& o) {
    switch (o.type) {
        case OptType::I64: return std::to_string(*(int64_t*)o.ptr);
        case OptType::U64: return std::to_string(*(uint64_t*)o.ptr);
        case OptType::F64: return format_double(*(double*)o.ptr);
        case OptType::STR: return *(std::string*)o.ptr;
        case OptType::BOOL: return *(bool*)o.ptr ? "true" : "false";
        case OptType::I64_LIST: {
            std::string s;
            for (int64_t v : *(std::vector<int64_t>*)o.ptr) s += (s.empty() ? "" : ",") + std::to_string(v);
            return s;
        }
        case OptType::F64_LIST: {
            std::string s;
            for (double v : *(std::vector<double>*)o.ptr) s += (s.empty() ? "" : ",") + format_double(v);
            return s;
        }
    }
    return "";
}

// Integers are read strictly: decimal digits, a '-' only before them; no space, '+' or hex (strtoll
// alone takes " 5", "+5" and "0x5", and a negative unsigned wraps around).
static bool plain_integer(const std::string& v, bool allow_minus) {
    const size_t first = allow_minus && !v.empty() && v[0] == '-' ? 1 : 0;
    if (v.size() == first || v.size() > first + 20) return false;
    return std::all_of(v.begin() + first, v.end(), [](char c) { return c >= '0' && c <= '9'; });
}

static int64_t parse_i64(const std::string& flag, const std::string& v) {
    errno = 0;
    char* end = nullptr;
    const long long x = plain_integer(v, true) ? strtoll(v.c_str(), &end, 10) : 0;
    if (!plain_integer(v, true) || *end != '\0' || errno == ERANGE)
        fail(strprintf("--%s: '%s' is not an integer (decimal digits, a leading '-' at most)", flag.c_str(), v.c_str()));
    return x;
}

static uint64_t parse_u64(const std::string& flag, const std::string& v) {
    errno = 0;
    char* end = nullptr;
    const unsigned long long x = plain_integer(v, false) ? strtoull(v.c_str(), &end, 10) : 0;
    if (!plain_integer(v, false) || *end != '\0' || errno == ERANGE)
        fail(strprintf("--%s: '%s' is not an unsigned integer (decimal digits only)", flag.c_str(), v.c_str()));
    return x;
}

static double parse_f64(const std::string& flag, const std::string& v) {
    errno = 0;
    char* end = nullptr;
    // decimal notation only (strtod alone also takes a leading space or '+', hex, inf and nan)
    const bool plain = !v.empty() && v.size() <= 64 && (isdigit((unsigned char)v[0]) || v[0] == '-' || v[0] == '.') &&
                       v.find_first_not_of("0123456789.eE+-") == std::string::npos;
    const double x = plain ? strtod(v.c_str(), &end) : 0;
    if (!plain || *end != '\0' || errno == ERANGE || !std::isfinite(x))
        fail(strprintf("--%s: '%s' is not a finite number", flag.c_str(), v.c_str()));
    return x;
}

static std::vector<std::string> split(const std::string& s, char sep) {
    std::vector<std::string> out;
    size_t start = 0;
    while (true) {
        size_t p = s.find(sep, start);
        out.push_back(s.substr(start, p == std::string::npos ? std::string::npos : p - start));
        if (p == std::string::npos) return out;
        start = p + 1;
    }
}

// The words of line i of a state text written as "key value ...": refused (naming `what`) unless
// the line is there and starts with key.
static std::vector<std::string> keyed_line(const std::vector<std::string>& lines, size_t i, const char* key,
                                           const char* what) {
    std::vector<std::string> w = i < lines.size() ? split(lines[i], ' ') : std::vector<std::string>{};
    if (w.empty() || w[0] != key) fail(strprintf("%s: line %zu is not '%s ...'", what, i + 1, key));
    return w;
}

static void set_option(const Option& o, const std::string& v) {
    const std::string flag = o.name;
    switch (o.type) {
        case OptType::I64: *(int64_t*)o.ptr = parse_i64(flag, v); break;
        case OptType::U64: *(uint64_t*)o.ptr = parse_u64(flag, v); break;
        case OptType::F64: *(double*)o.ptr = parse_f64(flag, v); break;
        case OptType::STR: *(std::string*)o.ptr = v; break;
        case OptType::BOOL:
            if (v == "1" || v == "true") *(bool*)o.ptr = true;
            else if (v == "0" || v == "false") *(bool*)o.ptr = false;
            else fail(strprintf("--%s: '%s' is not a boolean (true/false/1/0)", o.name, v.c_str()));
            break;
        case OptType::I64_LIST: {
            std::vector<int64_t> xs;
            for (const std::string& p : split(v, ',')) xs.push_back(parse_i64(flag, p));
            *(std::vector<int64_t>*)o.ptr = xs;
            break;
        }
        case OptType::F64_LIST: {
            std::vector<double> xs;
            for (const std::string& p : split(v, ',')) xs.push_back(parse_f64(flag, p));
            *(std::vector<double>*)o.ptr = xs;
            break;
        }
    }
}

// Parses `--name value`, `--name=value` and a bare `--bool_flag`. Throws on unknown flags.
static void parse_args(Hyperparameters& args, const std::vector<std::string>& argv) {
    std::vector<Option> opts = options_of(args);
    for (size_t i = 0; i < argv.size(); ++i) {
        const std::string& a = argv[i];
        if (a.rfind("--", 0) != 0) fail(strprintf("unexpected argument '%s' (flags look like --name value)", a.c_str()));
        std::string name = a.substr(2), value;
        bool has_value = false;
        size_t eq = name.find('=');
        if (eq != std::string::npos) {
            value = name.substr(eq + 1);
            name = name.substr(0, eq);
            has_value = true;
        }
        auto it = std::find_if(opts.begin(), opts.end(), [&](const Option& o) { return name == o.name; });
        if (it == opts.end()) fail(strprintf("unknown flag --%s (./train_gpt --help lists the flags)", name.c_str()));
        if (!has_value) {
            bool next_is_value = i + 1 < argv.size() && argv[i + 1].rfind("--", 0) != 0;
            if (it->type == OptType::BOOL && !next_is_value) value = "true";
            else if (!next_is_value) fail(strprintf("--%s needs a value", name.c_str()));
            else value = argv[++i];
        }
        set_option(*it, value);
    }
}

// the rules of a run id: it names logs/<run_id>.txt and the folder logs/<run_id>/
static void check_run_id(const std::string& id, const char* what) {
    if (id.size() > MAX_RUN_ID)
        fail(strprintf("%s '%.20s...' is %zu characters: at most %zu", what, id.c_str(), id.size(), MAX_RUN_ID));
    for (char c : id)
        if (!(isalnum((unsigned char)c) || c == '-' || c == '_' || c == '.'))
            fail(strprintf("%s '%s' may hold only letters, digits, '-', '_' and '.'", what, id.c_str()));
    if (!id.empty() && id[0] == '.') fail(strprintf("%s '%s' must not start with '.'", what, id.c_str()));
}

// Checks that the configuration can run at this world size; every message names the flag and its
// range. Sizes are checked before any product of them is formed, so nothing overflows.
static void validate_args(const Hyperparameters& a, int world_size) {
    if (world_size < 1 || 8 % world_size != 0)
        fail(strprintf("world size %d does not divide 8 (run on 1, 2, 4 or 8 GPUs)", world_size));
    auto range = [](const char* flag, int64_t v, int64_t lo, int64_t hi) {
        if (v < lo || v > hi)
            fail(strprintf("--%s must be in %lld..%lld, got %lld", flag, (long long)lo, (long long)hi, (long long)v));
    };
    auto positive = [&](const char* flag, int64_t v, int64_t hi) {
        if (v <= 0) fail(strprintf("--%s must be positive, got %lld", flag, (long long)v));
        range(flag, v, 1, hi);
    };
    auto non_negative = [&](const char* flag, int64_t v, int64_t hi) {
        if (v < 0) fail(strprintf("--%s must not be negative, got %lld", flag, (long long)v));
        range(flag, v, 0, hi);
    };
    auto list_size = [](const char* flag, size_t n) {
        if (n == 0) fail(strprintf("--%s must hold at least one value", flag));
        if (n > MAX_LIST) fail(strprintf("--%s holds %zu values, at most %zu", flag, n, MAX_LIST));
    };
    for (auto [flag, v] : {std::pair<const char*, const std::string*>{"train_files", &a.train_files},
                           {"val_files", &a.val_files}, {"run_id", &a.run_id}}) {
        if (v->empty() && std::string(flag) != "run_id") fail(strprintf("--%s must not be empty", flag));
        if (v->size() > MAX_TEXT_OPTION) fail(strprintf("--%s is %zu characters, at most %zu", flag, v->size(), MAX_TEXT_OPTION));
        for (char c : *v)
            if ((unsigned char)c < 0x20 || c == 0x7f) fail(strprintf("--%s must not hold control characters", flag));
    }
    check_run_id(a.run_id, "--run_id");
    positive("train_max_seq_len", a.train_max_seq_len, MAX_RANK_TOKENS);
    positive("block_size", a.block_size, MAX_BLOCK_SIZE);
    range("gemm_candidates", a.gemm_candidates, 1, GEMM_MAX_CANDIDATES);
    // 8 = world size x accumulation steps: every micro-batch holds whole max-length sequences
    const int64_t unit = 8 * a.train_max_seq_len;
    auto batch = [&](const char* flag, int64_t v) {
        positive(flag, v, 8 * MAX_RANK_TOKENS);
        if (v % unit != 0)
            fail(strprintf("--%s: %lld is not divisible by 8 x train_max_seq_len = %lld", flag, (long long)v,
                           (long long)unit));
    };
    list_size("train_bs_schedule", a.train_bs_schedule.size());
    for (int64_t bs : a.train_bs_schedule) batch("train_bs_schedule", bs);
    batch("train_bs_extension", a.train_bs_extension);
    batch("val_batch_size", a.val_batch_size);
    positive("val_tokens", a.val_tokens, int64_t(1) << 40);
    if (a.val_tokens % a.val_batch_size != 0)
        fail(strprintf("--val_tokens: %lld is not a multiple of --val_batch_size %lld", (long long)a.val_tokens,
                       (long long)a.val_batch_size));
    positive("num_scheduled_iterations", a.num_scheduled_iterations, MAX_STEPS);
    non_negative("num_extension_iterations", a.num_extension_iterations, MAX_STEPS);
    if (!(a.cooldown_frac > 0 && a.cooldown_frac <= 1))
        fail(strprintf("--cooldown_frac must be in (0, 1], got %s", format_double(a.cooldown_frac).c_str()));
    if (!(a.split_embed_frac > 0 && a.split_embed_frac <= 1))
        fail(strprintf("--split_embed_frac must be in (0, 1], got %s", format_double(a.split_embed_frac).c_str()));
    list_size("lr_max_schedule", a.lr_max_schedule.size());
    for (double v : a.lr_max_schedule)
        if (v <= 0) fail(strprintf("--lr_max_schedule values must be positive, got %s", format_double(v).c_str()));
    if (a.lr_min < 0) fail("--lr_min must not be negative");
    positive("muon_warmup_steps", a.muon_warmup_steps, MAX_STEPS);
    positive("muon_cooldown_steps", a.muon_cooldown_steps, MAX_STEPS);
    if (!(a.momentum_min >= 0 && a.momentum_min < 1)) fail("--momentum_min must be in [0, 1)");
    if (!(a.momentum_max >= 0 && a.momentum_max < 1)) fail("--momentum_max must be in [0, 1)");
    for (auto [flag, v] : {std::pair<const char*, double>{"adam_lr", a.adam_lr}, {"adam_eps", a.adam_eps},
                           {"normuon_lr", a.normuon_lr}, {"lm_head_x_s", a.lm_head_x_s},
                           {"lm_head_w_s", a.lm_head_w_s}, {"lm_head_grad_s", a.lm_head_grad_s},
                           {"softcap_a", a.softcap_a}, {"softcap_c", a.softcap_c},
                           {"attn_scale_init", a.attn_scale_init}})
        if (!(v > 0)) fail(strprintf("--%s must be positive, got %s", flag, format_double(v).c_str()));
    if (a.adam_weight_decay < 0) fail("--adam_weight_decay must not be negative");
    if (a.normuon_weight_decay < 0) fail("--normuon_weight_decay must not be negative");
    if (!(a.normuon_beta2 >= 0 && a.normuon_beta2 < 1)) fail("--normuon_beta2 must be in [0, 1)");
    non_negative("val_loss_every", a.val_loss_every, MAX_STEPS);
    non_negative("checkpoint_every", a.checkpoint_every, MAX_STEPS);
    non_negative("profile_steps", a.profile_steps, MAX_STEPS);
    positive("logit_chunk_rows", a.logit_chunk_rows, MAX_LOGIT_CHUNK_ROWS);
    if (a.logit_chunk_rows % 16) fail(strprintf("--logit_chunk_rows must be a multiple of 16 (fp8 GEMMs), got %lld", (long long)a.logit_chunk_rows));
    list_size("ws_schedule", a.ws_schedule.size());
    auto window = [&](const char* flag, int64_t w) {
        positive(flag, w, MAX_WINDOW_BLOCKS);
        if (w * a.block_size > MAX_WINDOW_TOKENS)
            fail(strprintf("--%s: %lld blocks of --block_size %lld tokens is more than %lld tokens", flag, (long long)w,
                           (long long)a.block_size, (long long)MAX_WINDOW_TOKENS));
    };
    for (int64_t w : a.ws_schedule) window("ws_schedule", w);
    window("ws_final", a.ws_final);
    window("ws_validate_post_yarn_ext", a.ws_validate_post_yarn_ext);
    range("yarn_alpha", a.yarn_alpha, 0, MAX_YARN_ROTATIONS);
    range("yarn_beta", a.yarn_beta, 0, MAX_YARN_ROTATIONS);
    if (a.yarn_beta <= a.yarn_alpha) fail("--yarn_beta must be larger than --yarn_alpha");
    // YaRN multiplies the attention scale by 1 + 0.2 ln(new/old) at each window change: a window
    // that shrinks more than e^5-fold would make it negative
    YarnState y = yarn_reset(a);
    int64_t ws_long = get_ws(a, 0).long_ws;
    for (int64_t step : get_transition_steps(a)) {
        const int64_t w = get_ws(a, step).long_ws;
        yarn_apply(a, y, ws_long, w);
        if (!(y.attn_scale > 0 && std::isfinite(y.attn_scale)))
            fail(strprintf("--ws_schedule/--ws_final: the long window going from %lld to %lld blocks at step %lld makes "
                           "YaRN's attention scale %s (a window may shrink at most e^5-fold)", (long long)ws_long,
                           (long long)w, (long long)step, format_double(y.attn_scale).c_str()));
        ws_long = w;
    }
}

// -----------------------------------------------------------------------------
// Self-logging. The two sources are embedded at build time (TRAIN_GPT_SRC_DIR is set by the
// Makefile), so a log always holds the code that actually ran.

#ifndef TRAIN_GPT_SRC_DIR
#error "build with the Makefile: it sets -DTRAIN_GPT_SRC_DIR to the folder of train_gpt.cu"
#endif
#if !defined(__CUDA_ARCH__)
asm(".pushsection .rodata\n"
    ".global train_gpt_cu_src\n"
    "train_gpt_cu_src:\n"
    ".incbin \"" TRAIN_GPT_SRC_DIR "/train_gpt.cu\"\n"
    ".global train_gpt_cu_src_end\n"
    "train_gpt_cu_src_end:\n"
    ".global triton_kernels_cu_src\n"
    "triton_kernels_cu_src:\n"
    ".incbin \"" TRAIN_GPT_SRC_DIR "/triton_kernels.cu\"\n"
    ".global triton_kernels_cu_src_end\n"
    "triton_kernels_cu_src_end:\n"
    ".popsection\n");
#endif
extern "C" const char train_gpt_cu_src[], train_gpt_cu_src_end[];
extern "C" const char triton_kernels_cu_src[], triton_kernels_cu_src_end[];

static std::string embedded_train_gpt() { return std::string(train_gpt_cu_src, train_gpt_cu_src_end); }
static std::string embedded_triton_kernels() { return std::string(triton_kernels_cu_src, triton_kernels_cu_src_end); }

static const std::string LOG_RULE(100, '=');
static const std::string SOURCE_RULE(40, '-');

// the log's source block, in the records' layout
static std::string source_block() {
    return embedded_train_gpt() + "\n\n" + SOURCE_RULE + "\n# triton_kernels.cu\n" + SOURCE_RULE + "\n\n" +
           embedded_triton_kernels() + "\n";
}

// The parts of a log that say what ran: each source and the configuration block.
struct LogParts {
    std::string train_gpt, triton_kernels, configuration;
    int configuration_line = 0;  // the log's line number of the configuration's first line
    std::string versions;        // the lines between the sources and the configuration
    std::string gemm_plan;       // the GEMM plan block's lines (empty if the log has none)
    std::vector<std::string> step_lines;  // the step lines with a val_loss, in order
    std::string last_step_line, memory_line;
};

// Runs a shell command; its standard output in out, its exit status returned (-1: it did not run).
static int run_capture(const std::string& cmd, std::string& out) {
    FILE* p = popen(cmd.c_str(), "r");
    if (!p) return -1;
    out.clear();
    char buf[1 << 16];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    const int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

constexpr uint64_t MAX_LOG_BYTES = 256ull << 20;  // a log of 10^6 steps with its sources is ~70 MB
constexpr size_t MAX_LOG_LINE = 1 << 20;

static LogParts split_log(const std::string& path) {
    const std::string text = read_regular_file(path, MAX_LOG_BYTES, "log");
    size_t line_start = 0;
    for (size_t nl; (nl = text.find('\n', line_start)) != std::string::npos || line_start < text.size(); line_start = nl + 1) {
        if (nl == std::string::npos) nl = text.size();
        if (nl - line_start > MAX_LOG_LINE)
            fail(strprintf("log %s: line %lld is longer than %zu bytes (not a train_gpt log)", path.c_str(),
                           (long long)std::count(text.begin(), text.begin() + line_start, '\n') + 1, MAX_LOG_LINE));
    }
    const std::string sep = "\n\n" + SOURCE_RULE + "\n# triton_kernels.cu\n" + SOURCE_RULE + "\n\n";
    const std::string rule = "\n" + LOG_RULE + "\n";
    size_t a = text.find(sep);
    if (a == std::string::npos) fail(strprintf("%s is not a train_gpt log: no '# triton_kernels.cu' section", path.c_str()));
    size_t b = text.find(rule, a + sep.size());
    if (b == std::string::npos) fail(strprintf("%s is not a train_gpt log: no '=' rule after the sources", path.c_str()));
    LogParts p;
    p.train_gpt = text.substr(0, a);
    p.triton_kernels = text.substr(a + sep.size(), b - (a + sep.size()));
    const std::string cfg_begin = "# configuration\n", cfg_end = "# end configuration\n";
    size_t c = text.find(cfg_begin, b);
    size_t d = c == std::string::npos ? c : text.find(cfg_end, c);
    if (d == std::string::npos) fail(strprintf("%s is not a train_gpt log: no configuration block", path.c_str()));
    p.configuration = text.substr(c + cfg_begin.size(), d - (c + cfg_begin.size()));
    p.configuration_line = (int)std::count(text.begin(), text.begin() + c, '\n') + 2;
    p.versions = text.substr(b + rule.size(), c - (b + rule.size()));
    const std::string plan_begin = "# gemm plan\n", plan_end = "# end gemm plan\n";
    size_t e = text.find(plan_begin, d);
    size_t g = e == std::string::npos ? e : text.find(plan_end, e);
    if (e != std::string::npos && g == std::string::npos)
        fail(strprintf("%s: the GEMM plan block has no end (a truncated log?)", path.c_str()));
    if (e != std::string::npos) p.gemm_plan = text.substr(e + plan_begin.size(), g - (e + plan_begin.size()));
    // the results: only whole step lines after the configuration count (the sources hold such text too)
    size_t pos = d;
    while (pos < text.size()) {
        size_t nl = text.find('\n', pos);
        const std::string line = text.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
        pos = nl == std::string::npos ? text.size() : nl + 1;
        if (line.rfind("step:", 0) == 0 && line.find(" train_time:") != std::string::npos) {
            p.last_step_line = line;
            if (line.find(" val_loss:") != std::string::npos) p.step_lines.push_back(line);
        }
        if (line.rfind("peak memory", 0) == 0) p.memory_line = line;
    }
    return p;
}

static void write_file(const std::string& path, const std::string& text) {
    FILE* f = fopen(path.c_str(), "wb");
    bool ok = f && fwrite(text.data(), 1, text.size(), f) == text.size();
    const int err = errno;
    ok = f && fclose(f) == 0 && ok;
    if (!ok) fail(strprintf("cannot write %s: %s", path.c_str(), strerror(err ? err : errno)));
}

// `key = value` lines of a configuration block, in order (lines without " = " are left out)
static std::vector<std::pair<std::string, std::string>> config_entries(const std::string& block) {
    std::vector<std::pair<std::string, std::string>> out;
    for (const std::string& line : split(block, '\n')) {
        const size_t eq = line.find(" = ");
        if (eq != std::string::npos) out.push_back({line.substr(0, eq), line.substr(eq + 3)});
    }
    return out;
}
// what says which run a log is, not how it ran
static bool run_identity_key(const std::string& key) { return key == "run_id" || key == "command_line"; }

// `--diff-logs A B`: a summary (same code or not, the configuration keys that differ, the versions
// and GPUs that differ, the results side by side), then a unified diff (diff -u) of the sources
// and of the configuration without the run id. Returns 0 for the same code and configuration, 1
// when they differ; an error (not a log, unreadable) throws, and main() makes it exit 2.
static int diff_logs(const std::string& log_a, const std::string& log_b) {
    LogParts pa = split_log(log_a), pb = split_log(log_b);
    const bool same_train = pa.train_gpt == pb.train_gpt, same_kernels = pa.triton_kernels == pb.triton_kernels;
    printf("code: %s\n", same_train && same_kernels ? "same sources"
                       : strprintf("differs (%s%s%s)", same_train ? "" : "train_gpt.cu",
                                   !same_train && !same_kernels ? ", " : "", same_kernels ? "" : "triton_kernels.cu").c_str());
    // the configuration, key by key
    auto entries = [](const std::string& block) {
        std::map<std::string, std::string> m;
        for (auto& [k, v] : config_entries(block))
            if (!run_identity_key(k)) m[k] = v;
        return m;
    };
    const std::map<std::string, std::string> ca = entries(pa.configuration), cb = entries(pb.configuration);
    std::vector<std::string> differ;
    for (const auto& [k, v] : ca)
        if (!cb.count(k) || cb.at(k) != v) differ.push_back(k);
    for (const auto& [k, v] : cb)
        if (!ca.count(k)) differ.push_back(k);
    if (differ.empty()) printf("configuration: same (run ids aside)\n");
    else {
        printf("configuration: %zu keys differ\n", differ.size());
        for (const std::string& k : differ)
            printf("  %s: %s -> %s\n", k.c_str(), ca.count(k) ? ca.at(k).c_str() : "(absent)",
                   cb.count(k) ? cb.at(k).c_str() : "(absent)");
    }
    // versions and GPU (the nvidia-smi snapshot left out: clocks and temperatures always differ)
    const std::vector<std::string> va = split(pa.versions, '\n'), vb = split(pb.versions, '\n');
    std::vector<std::string> vdiff;
    for (size_t i = 0; i < std::max(va.size(), vb.size()); ++i) {
        const std::string x = i < va.size() ? va[i] : "", y = i < vb.size() ? vb[i] : "";
        if (x != y) vdiff.push_back("  " + x + "  |  " + y);
    }
    printf("versions and GPU: %s\n", vdiff.empty() ? "same" : "differ");
    for (const std::string& d : vdiff) printf("%s\n", d.c_str());
    printf("gemm plan: %s\n", pa.gemm_plan == pb.gemm_plan ? "same" : "differs");
    // the results side by side
    auto val_losses = [](const LogParts& p) {
        std::map<long long, std::string> m;
        for (const std::string& line : p.step_lines) {
            long long step = 0, total = 0;
            char loss[32] = {0};
            if (sscanf(line.c_str(), "step:%lld/%lld val_loss:%31s", &step, &total, loss) == 3) m[step] = loss;
        }
        return m;
    };
    const std::map<long long, std::string> la = val_losses(pa), lb = val_losses(pb);
    std::set<long long> steps;
    for (auto& [k, v] : la) steps.insert(k);
    for (auto& [k, v] : lb) steps.insert(k);
    printf("results:\n  %-12s %-14s %-14s\n", "step", "A val_loss", "B val_loss");
    for (long long st : steps)
        printf("  %-12lld %-14s %-14s%s\n", st, la.count(st) ? la.at(st).c_str() : "-", lb.count(st) ? lb.at(st).c_str() : "-",
               la.count(st) && lb.count(st) && la.at(st) != lb.at(st) ? "  *" : "");
    auto train_time = [](const LogParts& p) {
        const size_t at = p.last_step_line.find("train_time:");
        return at == std::string::npos ? std::string("-") : p.last_step_line.substr(at + 11, p.last_step_line.find(' ', at) - at - 11);
    };
    printf("  %-12s %-14s %-14s\n", "train_time", train_time(pa).c_str(), train_time(pb).c_str());
    printf("  memory: A %s\n          B %s\n", pa.memory_line.empty() ? "-" : pa.memory_line.c_str(),
           pb.memory_line.empty() ? "-" : pb.memory_line.c_str());
    // the unified diffs
    auto without_identity = [](const std::string& block) {
        std::string out;
        for (const std::string& line : split(block, '\n')) {
            const size_t eq = line.find(" = ");
            if (eq == std::string::npos || !run_identity_key(line.substr(0, eq))) out += line + "\n";
        }
        return out;
    };
    pa.configuration = without_identity(pa.configuration), pb.configuration = without_identity(pb.configuration);
    char tmpl[] = "/tmp/train_gpt_diff_XXXXXX";
    if (!mkdtemp(tmpl)) fail(strprintf("cannot make a temporary folder: %s", strerror(errno)));
    const std::string dir = tmpl;
    struct Cleanup {  // the temporary files go on every path, an error's too
        std::string dir;
        std::vector<std::string> files;
        ~Cleanup() {
            for (const std::string& f : files) unlink(f.c_str());
            rmdir(dir.c_str());
        }
    } cleanup{dir, {}};
    int status_all = 0;
    const std::pair<const char*, std::string LogParts::*> parts[] = {
        {"train_gpt.cu", &LogParts::train_gpt},
        {"triton_kernels.cu", &LogParts::triton_kernels},
        {"configuration", &LogParts::configuration}};
    for (auto& [name, member] : parts) {
        std::string fa = dir + "/a_" + name, fb = dir + "/b_" + name;
        cleanup.files.push_back(fa), cleanup.files.push_back(fb);
        write_file(fa, pa.*member);
        write_file(fb, pb.*member);
        std::string la_ = log_a + ":" + name, lb_ = log_b + ":" + name;
        const char* argv[] = {"diff", "-u", "--label", la_.c_str(), "--label", lb_.c_str(), fa.c_str(), fb.c_str(), nullptr};
        fflush(stdout);
        pid_t pid;
        int rc = posix_spawnp(&pid, "diff", nullptr, nullptr, (char* const*)argv, environ);
        if (rc != 0) fail(strprintf("cannot run diff: %s", strerror(rc)));
        int status = 0;
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
        int code = WIFEXITED(status) ? WEXITSTATUS(status) : 2;
        if (code > 1) fail(strprintf("diff failed on %s (exit %d)", name, code));
        status_all |= code;
    }
    if (status_all == 0) printf("same sources and configuration\n");
    return status_all;
}

static std::string make_uuid4() {
    unsigned char b[16];
    FILE* f = fopen("/dev/urandom", "rb");
    if (!f || fread(b, 1, 16, f) != 16) fail("cannot read /dev/urandom for the run id");
    fclose(f);
    b[6] = (b[6] & 0x0f) | 0x40;  // version 4
    b[8] = (b[8] & 0x3f) | 0x80;  // variant 1
    return strprintf("%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2], b[3],
                     b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

static std::string run_command(const char* cmd) {
    std::string out;
    const int rc = run_capture(cmd, out);
    if (rc < 0 && out.empty()) return strprintf("(%s: could not run)\n", cmd);
    if (rc != 0 && out.empty()) out = strprintf("(%s: not available)\n", cmd);
    return out;
}

// What a GEMM plan holds for: the GPU and the library (another picks its algorithms differently).
static std::string gemm_plan_device() {
    cudaDeviceProp prop;
    int dev = 0, rt = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    CUDA_CHECK(cudaRuntimeGetVersion(&rt));
    const size_t lt = cublasLtGetVersion();
    return strprintf("gemm_plan_for = %s, %d SMs, compute capability %d.%d, cuBLASLt %zu.%zu.%zu, CUDA runtime %d.%d",
                     prop.name, prop.multiProcessorCount, prop.major, prop.minor, lt / 10000, lt % 10000 / 100, lt % 100,
                     rt / 1000, rt % 1000 / 10);
}

static std::string versions_text() {
    int rt = 0, drv = 0, nccl = 0;
    CUDA_CHECK(cudaRuntimeGetVersion(&rt));
    CUDA_CHECK(cudaDriverGetVersion(&drv));
    NCCL_CHECK(ncclGetVersion(&nccl));
    size_t lt = cublasLtGetVersion();
    char mpi[MPI_MAX_LIBRARY_VERSION_STRING];
    int mpi_len = 0;
    MPI_CHECK(MPI_Get_library_version(mpi, &mpi_len));
    std::string mpi_line = std::string(mpi, mpi_len);
    mpi_line = mpi_line.substr(0, mpi_line.find_first_of("\n,"));
    cudaDeviceProp prop;
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    std::string s;
    s += strprintf("Compiled with nvcc %d.%d for sm_90a\n", __CUDACC_VER_MAJOR__, __CUDACC_VER_MINOR__);
    s += strprintf("Running CUDA runtime %d.%d, driver %d.%d\n", rt / 1000, rt % 1000 / 10, drv / 1000, drv % 1000 / 10);
    s += strprintf("Running cuBLASLt %zu.%zu.%zu\n", lt / 10000, lt % 10000 / 100, lt % 100);
    s += strprintf("Running NCCL %d.%d.%d\n", nccl / 10000, nccl % 10000 / 100, nccl % 100);
    s += "Running MPI " + mpi_line + "\n";
    s += strprintf("GPU: %s, %d SMs, %.1f GiB, compute capability %d.%d\n", prop.name, prop.multiProcessorCount,
                   prop.totalGlobalMem / 1073741824.0, prop.major, prop.minor);
    return s;
}

// The resolved configuration: every flag, then what follows from it. Between two marker lines so
// --diff-logs can find it.
static std::string configuration_text(Hyperparameters& a, int world_size, const std::string& data_path,
                                      const std::string& command_line) {
    std::string s = "# configuration\n";
    s += "command_line = " + command_line + "\n";
    s += "DATA_PATH = " + data_path + "\n";
    const char* group = nullptr;
    for (const Option& o : options_of(a)) {
        if (o.group != group) s += std::string("# ") + (group = o.group) + "\n";
        s += std::string(o.name) + " = " + format_option(o) + "\n";
    }
    auto list = [](const std::vector<int64_t>& v) {
        std::string r;
        for (int64_t x : v) r += (r.empty() ? "" : ",") + std::to_string(x);
        return r;
    };
    s += strprintf("model = vocab %d (padded to %d), %d layers, %d heads x %d, dim %d\n", VOCAB_SIZE,
                   PADDED_VOCAB_SIZE, NUM_LAYERS, NUM_HEADS, HEAD_DIM, MODEL_DIM);
    s += strprintf("world_size = %d\ngrad_accum_steps = %d\n", world_size, 8 / world_size);
    s += strprintf("num_iterations = %lld\n", (long long)a.num_iterations());
    s += strprintf("split_step = %lld\n", (long long)get_split_step(a));
    s += "transition_steps = " + list(get_transition_steps(a)) + "\n";
    s += "warmup_steps = " + list(get_warmup_steps(a)) + "\n";
    // YaRN attention scale after each window change (and for the final validation, no update)
    YarnState y = yarn_reset(a);
    std::string scales = format_double(y.attn_scale);
    int64_t ws_long = get_ws(a, 0).long_ws;
    for (int64_t step : get_transition_steps(a)) {
        int64_t w = get_ws(a, step).long_ws;
        yarn_apply(a, y, ws_long, w);
        ws_long = w;
        scales += "," + format_double(y.attn_scale);
    }
    s += "yarn_attn_scales = " + scales + "\n";
    std::string layers;
    for (int i = 0; i < NUM_LAYERS; ++i) {
        std::string l = has_attention(i) ? (paired_head(i) ? "paired-attn" : "attn") : "no-attn";
        if (has_attention(i)) l += strprintf("[bank %d%s]", attn_slot(i), long_window(i) ? ",long,key-offset" : "");
        if (has_value_embed(i)) l += strprintf("+ve%d[gate %d]", LAYERS[i].ve, ve_gate_slot(i));
        layers += strprintf("%s%d:%s+mlp", i ? " " : "", i, l.c_str());
    }
    s += "layers = " + layers + "\n";
    s += strprintf("skip = %d->%d\nbackout_layer = %d\n", SKIP_IN, SKIP_OUT, BACKOUT_LAYER);
    // the optimizer's explicit order on each kind of step
    const std::vector<ParamShape> params = model_params(world_size);
    const std::vector<ParamConfig> cfgs = build_param_configs(a, params, world_size, 0);
    {
        for (bool adam : {true, false})
            for (bool split : {false, true})
                s += strprintf("step_plan[%s,%s] = ", adam ? "adam" : "no-adam", split ? "untied" : "tied") +
                     plan_text(step_plan(cfgs, adam, split)) + "\n";
    }
    // the reduces that start inside the backward (several ranks, --early_reduce)
    for (bool adam : {true, false})
        for (bool split : {false, true})
            s += strprintf("backward_reduce_plan[%s,%s] = ", adam ? "adam" : "no-adam", split ? "untied" : "tied") +
                 (a.early_reduce ? backward_reduce_text(backward_reduce_plan(cfgs, world_size, adam, split)) : std::string("off")) +
                 "\n";
    // the optimizer's view of every parameter (rank 0's shard)
    auto dims = [](const std::vector<int64_t>& v) {
        std::string r;
        for (int64_t x : v) r += (r.empty() ? "" : "x") + std::to_string(x);
        return r;
    };
    const char* comms_names[] = {"none", "replicated", "sharded"};
    for (const ParamConfig& c : cfgs) {
        const ParamShape& ps = *std::find_if(params.begin(), params.end(), [&](const ParamShape& p) { return p.label == c.label; });
        s += strprintf("param %s = %s %s, %s %s, shard %s, lr_mul %s, wd_mul %s", c.label.c_str(), ps.fp32 ? "fp32" : "bf16",
                       dims(ps.shape).c_str(), c.optim == Optim::Adam ? "adam" : "normuon", comms_names[(int)c.comms],
                       dims(c.chunk_shape).c_str(), format_double(c.lr_mul).c_str(), format_double(c.wd_mul).c_str());
        if (c.optim == Optim::Adam) s += strprintf(", betas %s,%s", format_double(c.beta1).c_str(), format_double(c.beta2).c_str());
        s += "\n";
    }
    s += "# end configuration\n";
    return s;
}

// -----------------------------------------------------------------------------
// Checkpoints: everything a continuation needs, in one file that rank 0 writes (the record's
// save_checkpoint, which saves the model and the optimizer's state). Format (version 2):
//   a text header of lines, then the blobs' raw bytes, in the header's order:
//     train_gpt checkpoint 2
//     world_size N / step S (steps done) / config_hash H / source_hash H
//     blob NAME BYTES          (one line per blob)
//     checksum H               (64-bit hash of every blob's bytes, in order)
//     end
//   Blobs: config (the log's configuration block), gemm_plan (the log's GEMM plan), trainer (the
//   step, the clock, the schedule's state, the optimizer's step counts and tie), param/LABEL (every
//   parameter's values; bf16 or fp32 little-endian, row-major as model_params gives the shape),
//   rankR/grad/LABEL (rank R's accumulated gradient of each Adam parameter: Adam steps every other
//   step), rankR/state/LABEL/KIND (rank R's shard of the optimizer's state: Adam m, v; NorMuon buf,
//   sm and mant, the low 16 bits of the fp32 weights), rankR/data (rank R's place in the data).
// Written to a temporary name, synced, then renamed: a crash leaves the old file or the new one.
// Read back, every name and size is checked against this model before any byte is read, the file's
// size against the header, and the checksum before anything is used.

constexpr int CHECKPOINT_VERSION = 2;
constexpr size_t CHECKPOINT_MAX_HEADER = 1 << 20;
constexpr uint64_t CHECKPOINT_MAX_TEXT = 64 << 20;  // the largest text blob a reader accepts

// 64-bit hash of bytes (FNV-1a over 8-byte words, then the tail): fast enough for gigabytes
constexpr uint64_t HASH_SEED = 0xcbf29ce484222325ull;
static uint64_t hash_bytes(const void* data, size_t n, uint64_t h = HASH_SEED) {
    const unsigned char* p = (const unsigned char*)data;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0x100000001b3ull;
        h ^= h >> 29;
    }
    for (; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}
static std::string hex64(uint64_t v) { return strprintf("%016llx", (unsigned long long)v); }
static std::string hash_text(const std::string& s) { return hex64(hash_bytes(s.data(), s.size())); }

struct CheckpointHeader {
    int world_size = 0;
    int64_t step = 0;
    std::string config_hash, source_hash, checksum;
    std::vector<std::pair<std::string, uint64_t>> blobs;  // in file order
    size_t header_bytes = 0;
};

// Writes path atomically (PATH.tmp, fsync, rename).
static void write_checkpoint_file(const std::string& path, int world_size, int64_t step, const std::string& config_hash,
                                  const std::string& source_hash,
                                  const std::vector<std::pair<std::string, std::string>>& blobs) {
    uint64_t h = HASH_SEED;
    std::string header = strprintf("train_gpt checkpoint %d\nworld_size %d\nstep %lld\nconfig_hash %s\nsource_hash %s\n",
                                   CHECKPOINT_VERSION, world_size, (long long)step, config_hash.c_str(), source_hash.c_str());
    for (const auto& [name, bytes] : blobs) {
        if (name.empty() || name.find_first_of(" \n") != std::string::npos) fail("checkpoint blob name '" + name + "'");
        header += strprintf("blob %s %zu\n", name.c_str(), bytes.size());
        h = hash_bytes(bytes.data(), bytes.size(), h);
    }
    header += "checksum " + hex64(h) + "\nend\n";
    const std::string tmp = path + ".tmp";
    FILE* f = fopen(tmp.c_str(), "wb");
    if (!f) fail(strprintf("cannot write %s: %s", tmp.c_str(), strerror(errno)));
    bool ok = fwrite(header.data(), 1, header.size(), f) == header.size();
    for (const auto& [name, bytes] : blobs) ok = ok && fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
    ok = ok && fflush(f) == 0 && fsync(fileno(f)) == 0;
    ok = (fclose(f) == 0) && ok;
    if (!ok || rename(tmp.c_str(), path.c_str()) != 0) {
        const std::string err = strerror(errno);
        unlink(tmp.c_str());
        fail(strprintf("writing checkpoint %s failed: %s", path.c_str(), err.c_str()));
    }
    // the rename lasts only once the folder that holds the name is on disk too
    const size_t slash = path.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
    const int dfd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0 || fsync(dfd) != 0) {
        const std::string err = strerror(errno);
        if (dfd >= 0) close(dfd);
        fail(strprintf("syncing the folder of checkpoint %s failed: %s", path.c_str(), err.c_str()));
    }
    close(dfd);
}

constexpr uint64_t MAX_CHECKPOINT_BYTES = 64ull << 30;

// The header, checked for form and against the file's size; no blob is read. A regular file of at
// most 64 GiB; each field once; a world size of 1, 2, 4 or 8; every size bounded before it is added.
static CheckpointHeader read_checkpoint_header(const std::string& path) {
    uint64_t file_bytes = 0;
    FdCloser f{open_regular_file(path, "checkpoint", &file_bytes)};
    auto bad = [&](const std::string& why) { fail("checkpoint " + path + ": " + why); };
    if (file_bytes > MAX_CHECKPOINT_BYTES)
        bad(strprintf("%llu bytes, more than a checkpoint may have (%llu)", (unsigned long long)file_bytes,
                      (unsigned long long)MAX_CHECKPOINT_BYTES));
    std::string text(std::min<uint64_t>(file_bytes, CHECKPOINT_MAX_HEADER), '\0');
    read_exactly(f.fd, text.data(), text.size(), 0, "checkpoint " + path);
    const size_t end = text.find("\nend\n");
    if (text.rfind("train_gpt checkpoint ", 0) != 0) bad("not a train_gpt checkpoint");
    CheckpointHeader h;
    if (end == std::string::npos) bad("no end of header in its first 1 MiB (truncated or not a checkpoint)");
    h.header_bytes = end + 5;
    const std::vector<std::string> lines = split(text.substr(0, end), '\n');
    const std::string version = lines[0].substr(21);
    if (version != std::to_string(CHECKPOINT_VERSION))
        bad(strprintf("format version %.20s; this trainer reads version %d", version.c_str(), CHECKPOINT_VERSION));
    uint64_t total = 0;
    std::set<std::string> fields, blob_names;
    for (size_t i = 1; i < lines.size(); ++i) {
        const std::vector<std::string> w = split(lines[i], ' ');
        const std::string shown = lines[i].substr(0, 200);
        auto want = [&](size_t n) {
            if (w.size() != n) bad(strprintf("header line %zu is malformed: '%s'", i + 1, shown.c_str()));
        };
        auto count = [&](const std::string& v, uint64_t max) {
            errno = 0;
            char* e = nullptr;
            const unsigned long long x = plain_integer(v, false) ? strtoull(v.c_str(), &e, 10) : 0;
            if (!plain_integer(v, false) || *e || errno || x > max)
                bad(strprintf("header line %zu: '%.40s' is not a size up to %llu", i + 1, v.c_str(), (unsigned long long)max));
            return (uint64_t)x;
        };
        auto hash = [&](const std::string& v) {
            if (v.size() != 16 || v.find_first_not_of("0123456789abcdef") != std::string::npos)
                bad(strprintf("header line %zu: '%.40s' is not a hash (16 hex digits)", i + 1, v.c_str()));
            return v;
        };
        if (w.empty() || w[0].empty()) bad(strprintf("header line %zu is empty", i + 1));
        if (w[0] != "blob" && !fields.insert(w[0]).second)
            bad(strprintf("header line %zu: '%.40s' appears twice", i + 1, w[0].c_str()));
        if (w[0] == "world_size") {
            want(2), h.world_size = (int)count(w[1], 8);
            if (h.world_size < 1 || 8 % h.world_size != 0)
                bad(strprintf("world size %d (a run has 1, 2, 4 or 8 ranks)", h.world_size));
        } else if (w[0] == "step") want(2), h.step = (int64_t)count(w[1], 2 * MAX_STEPS);
        else if (w[0] == "config_hash") want(2), h.config_hash = hash(w[1]);
        else if (w[0] == "source_hash") want(2), h.source_hash = hash(w[1]);
        else if (w[0] == "checksum") want(2), h.checksum = hash(w[1]);
        else if (w[0] == "blob") {
            want(3);
            if (h.blobs.size() >= 100000) bad("more than 100000 blobs");
            if (!blob_names.insert(w[1]).second) bad(strprintf("header line %zu: blob '%.100s' appears twice", i + 1, w[1].c_str()));
            h.blobs.push_back({w[1], count(w[2], MAX_CHECKPOINT_BYTES)});
            total += h.blobs.back().second;  // at most 10^5 sizes of at most 2^36 each: no overflow
        } else bad(strprintf("header line %zu is unknown: '%s'", i + 1, shown.c_str()));
    }
    if (fields.size() != 5) bad("header lacks world_size, step, config_hash, source_hash or checksum");
    if (file_bytes != h.header_bytes + total)
        bad(strprintf("%llu bytes, the header says %llu (truncated or corrupt)", (unsigned long long)file_bytes,
                      (unsigned long long)(h.header_bytes + total)));
    return h;
}

// What a reader expects of each blob: its exact size, or (text) its largest.
struct BlobSpec {
    uint64_t bytes;
    bool text;
};

// Reads the blobs named in `want` (names of `expected`; empty: all), after checking every name and
// size of the file against `expected`; with verify, reads every blob and checks the checksum.
static std::map<std::string, std::string> read_checkpoint_blobs(const std::string& path, const CheckpointHeader& h,
                                                                const std::map<std::string, BlobSpec>& expected,
                                                                const std::set<std::string>& want, bool verify) {
    auto bad = [&](const std::string& why) { fail("checkpoint " + path + ": " + why); };
    std::set<std::string> seen;
    for (const auto& [name, bytes] : h.blobs) {
        auto it = expected.find(name);
        if (it == expected.end()) bad("holds '" + name + "', which this model does not have (other model or world size?)");
        if (!seen.insert(name).second) bad("holds '" + name + "' twice");
        if (it->second.text ? bytes > it->second.bytes : bytes != it->second.bytes)
            bad(strprintf("'%s' holds %llu bytes, this model's takes %s%llu (other model shape?)", name.c_str(),
                          (unsigned long long)bytes, it->second.text ? "at most " : "", (unsigned long long)it->second.bytes));
    }
    for (const auto& [name, spec] : expected)
        if (!seen.count(name)) bad("lacks '" + name + "' (other model, world size or format?)");
    uint64_t file_bytes = 0;
    FdCloser f{open_regular_file(path, "checkpoint", &file_bytes)};
    std::map<std::string, std::string> out;
    uint64_t hash = HASH_SEED, offset = h.header_bytes;
    for (const auto& [name, bytes] : h.blobs) {
        const bool keep = want.empty() || want.count(name);
        if (keep || verify) {
            std::string data(bytes, '\0');
            read_exactly(f.fd, data.data(), bytes, offset, "checkpoint " + path + " ('" + name + "', truncated?)");
            hash = hash_bytes(data.data(), data.size(), hash);
            if (keep) out[name] = std::move(data);
        }
        offset += bytes;
    }
    if (verify && hex64(hash) != h.checksum) bad("checksum mismatch: the file is corrupt");
    return out;
}

// A logged configuration block read back (by --rerun from a log, by --resume from a checkpoint):
// every flag of this trainer must be there once, with a value this trainer parses; the run id is
// not taken (a rerun is a run of its own). `where` and `first_line` name the lines in messages.
struct LoggedRun {
    Hyperparameters args;
    std::string data_path;
    int world_size = 0;
};
static LoggedRun parse_logged_configuration(const std::string& block, const std::string& where, int first_line) {
    LoggedRun run;
    std::vector<Option> opts = options_of(run.args);
    std::set<std::string> seen;
    const std::vector<std::string> lines = split(block, '\n');
    for (size_t i = 0; i < lines.size(); ++i) {
        const std::string& line = lines[i];
        const int no = first_line + (int)i;
        if (line.empty() || line.rfind("# ", 0) == 0) continue;  // a group's heading
        const size_t eq = line.find(" = ");
        if (eq == std::string::npos) fail(strprintf("%s line %d is not 'key = value': '%s'", where.c_str(), no, line.c_str()));
        const std::string key = line.substr(0, eq), value = line.substr(eq + 3);
        if (!seen.insert(key).second) fail(strprintf("%s line %d: '%s' appears twice", where.c_str(), no, key.c_str()));
        auto it = std::find_if(opts.begin(), opts.end(), [&](const Option& o) { return key == o.name; });
        try {
            if (key == "DATA_PATH") run.data_path = value;
            else if (key == "world_size") {
                const int64_t ws = parse_i64("world_size", value);
                if (ws < 1 || ws > 8 || 8 % ws != 0) fail("world_size " + value + " is not 1, 2, 4 or 8");
                run.world_size = (int)ws;
            }
            else if (it != opts.end() && key != "run_id") set_option(*it, value);
        } catch (const TrainerError& e) {
            fail(strprintf("%s line %d: %s", where.c_str(), no, e.what()));
        }
    }
    for (const Option& o : opts)
        if (!seen.count(o.name))
            fail(strprintf("%s: the configuration has no '%s' (a log of other code, or edited?)", where.c_str(), o.name));
    if (!seen.count("DATA_PATH") || run.world_size <= 0)
        fail(strprintf("%s: the configuration has no DATA_PATH or world_size", where.c_str()));
    return run;
}

// Refuses a logged configuration block that is not what this trainer writes for the flags it
// holds (an edited log: derived lines such as the step plan must follow from the flags).
static void check_logged_configuration(const std::string& block, const std::string& where, int first_line,
                                       LoggedRun& run) {
    const std::string ours = configuration_text(run.args, run.world_size, run.data_path, "");
    const std::vector<std::string> a = split(block, '\n');
    std::vector<std::string> b = split(ours, '\n');
    b.erase(b.begin());  // "# configuration"
    for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
        const std::string x = i < a.size() ? a[i] : "", y = i < b.size() ? b[i] : "";
        if (y == "# end configuration" && x.empty()) break;
        const size_t eq = x.find(" = ");
        if (eq != std::string::npos && run_identity_key(x.substr(0, eq))) continue;
        if (x != y)
            fail(strprintf("%s line %d: '%s' is not what this trainer logs for this configuration ('%s'): an edited log?",
                           where.c_str(), first_line + (int)i, x.c_str(), y.c_str()));
    }
}

// The blobs of a checkpoint of this configuration at this world size, with their sizes: the model's
// and every rank's optimizer shards follow from the configuration alone, so a checkpoint is checked
// through before any GPU work. Rank R's blobs: its gradients of the Adam parameters, its optimizer
// state (Adam m, v; NorMuon buf, sm, mant) and its data position.
static std::map<std::string, BlobSpec> checkpoint_layout(const Hyperparameters& a, int world_size) {
    std::map<std::string, BlobSpec> m;
    for (const char* text : {"config", "gemm_plan", "trainer", "schedule", "optimizer"}) m[text] = {CHECKPOINT_MAX_TEXT, true};
    const std::vector<ParamShape> params = model_params(world_size);
    auto bytes = [](const ParamShape& ps) { return (uint64_t)ps.numel() * (ps.fp32 ? 4 : 2); };
    for (const ParamShape& ps : params) m["param/" + ps.label] = {bytes(ps), false};
    for (int r = 0; r < world_size; ++r) {
        const std::string prefix = strprintf("rank%d/", r);
        for (const ParamShape& ps : params)
            if (table_entry(ps.label).optim == Optim::Adam) m[prefix + "grad/" + ps.label] = {bytes(ps), false};
        for (const ParamConfig& c : build_param_configs(a, params, world_size, r)) {
            const uint64_t n = (uint64_t)c.chunk_numel();
            const std::string st = prefix + "state/" + c.label + "/";
            if (c.optim == Optim::Adam) {
                m[st + "m"] = {4 * n, false}, m[st + "v"] = {4 * n, false};
            } else {
                const auto& sh = c.second_moment_shape;
                m[st + "buf"] = {4 * n, false}, m[st + "mant"] = {2 * n, false};
                m[st + "sm"] = {4 * (uint64_t)(sh[0] * sh[1] * sh[2]), false};
            }
        }
        m[prefix + "data"] = {CHECKPOINT_MAX_TEXT, true};
    }
    return m;
}

// Rank `rank`'s blobs on the GPU (names and sizes as checkpoint_layout gives them; every rank's
// have this rank's sizes: the shards are even).
struct DeviceBlob {
    std::string name;
    void* data;
    size_t bytes;
};
static std::vector<DeviceBlob> rank_device_blobs(ParamStore& params, const NorMuonAndAdam& opt, int rank) {
    std::vector<DeviceBlob> out;
    const std::string prefix = strprintf("rank%d/", rank);
    for (Param& p : params.all())
        if (table_entry(p.shape.label).optim == Optim::Adam) out.push_back({prefix + "grad/" + p.shape.label, p.grad, p.bytes()});
    for (const auto& sv : opt.state_views()) out.push_back({prefix + "state/" + sv.label + "/" + sv.kind, sv.data, sv.bytes()});
    return out;
}

static std::string download(const void* dev, size_t bytes) {
    std::string h(bytes, '\0');
    CUDA_CHECK(cudaMemcpy(h.data(), dev, bytes, cudaMemcpyDeviceToHost));
    return h;
}

// What a checkpoint holds besides the model, as the trainer passes it in.

// Writes logs/<run_id>/state_stepNNNNNN.bin (NNNNNN: steps done) at a step boundary: every rank
// sends its own blobs (its gradients, optimizer shards and data position) to rank 0, which writes
// the file. Returns the path, or throws (on every rank) if rank 0 could not write it; a file that
// was there is left as it was.
static std::string save_checkpoint(const Hyperparameters& args, ParamStore& params, const NorMuonAndAdam& opt,
                                   const TrainingManager& tm, const DistributedDataGenerator& loader, const RunState& rs,
                                   int rank, int world_size) {
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<std::pair<std::string, std::string>> mine;
    for (const DeviceBlob& b : rank_device_blobs(params, opt, rank)) mine.push_back({b.name, download(b.data, b.bytes)});
    mine.push_back({strprintf("rank%d/data", rank), loader.position()});
    const std::string dir = "logs/" + args.run_id;
    const std::string path = dir + strprintf("/state_step%06lld.bin", (long long)rs.steps_done);
    if (rank != 0) {  // to rank 0: the count, then each name and bytes
        uint64_t n = mine.size();
        MPI_CHECK(MPI_Send(&n, 1, MPI_UINT64_T, 0, 7, MPI_COMM_WORLD));
        for (const auto& [name, bytes] : mine)
            for (const std::string* part : {&name, &bytes}) {
                uint64_t len = part->size();
                if (len > (uint64_t)INT32_MAX) fail("checkpoint: a blob over 2 GiB");
                MPI_CHECK(MPI_Send(&len, 1, MPI_UINT64_T, 0, 7, MPI_COMM_WORLD));
                MPI_CHECK(MPI_Send(part->data(), (int)len, MPI_BYTE, 0, 7, MPI_COMM_WORLD));
            }
        MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
        int failed = 0;
        MPI_CHECK(MPI_Bcast(&failed, 1, MPI_INT, 0, MPI_COMM_WORLD));
        if (failed) fail("rank 0 could not write checkpoint " + path);
        return path;
    }
    std::vector<std::pair<std::string, std::string>> blobs = {
        {"config", rs.configuration},
        {"gemm_plan", rs.gemm_plan},
        {"trainer", strprintf("steps_done %lld\ntraining_time_ms %a\n", (long long)rs.steps_done, rs.training_time_ms)},
        {"schedule", tm.state()},
        {"optimizer", opt.host_state()}};
    for (Param& p : params.all()) blobs.push_back({"param/" + p.shape.label, download(p.data, p.bytes())});
    for (auto& b : mine) blobs.push_back(std::move(b));
    for (int r = 1; r < world_size; ++r) {
        uint64_t n = 0;
        MPI_CHECK(MPI_Recv(&n, 1, MPI_UINT64_T, r, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
        for (uint64_t i = 0; i < n; ++i) {
            std::string parts[2];
            for (std::string& part : parts) {
                uint64_t len = 0;
                MPI_CHECK(MPI_Recv(&len, 1, MPI_UINT64_T, r, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
                part.resize(len);
                MPI_CHECK(MPI_Recv(part.data(), (int)len, MPI_BYTE, r, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
            }
            blobs.push_back({parts[0], parts[1]});
        }
    }
    std::string error;
    try {
        mkdir("logs", 0755);
        mkdir(dir.c_str(), 0755);
        write_checkpoint_file(path, world_size, rs.steps_done, hash_text(rs.configuration), hash_text(source_block()), blobs);
    } catch (const TrainerError& e) {
        error = e.what();
    }
    MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
    int failed = !error.empty();
    MPI_CHECK(MPI_Bcast(&failed, 1, MPI_INT, 0, MPI_COMM_WORLD));
    if (failed) fail(error);
    return path;
}

// The checkpoint's text blobs that say what it continues (its configuration, GEMM plan and trainer
// state), read before the configuration is known; the rest is checked by read_resume_state.
static std::map<std::string, std::string> read_checkpoint_texts(const std::string& path, const CheckpointHeader& h) {
    std::map<std::string, BlobSpec> any;
    for (const auto& [name, bytes] : h.blobs) any[name] = {bytes, false};
    for (const char* name : {"config", "gemm_plan", "trainer"}) {
        auto it = any.find(name);
        if (it == any.end()) fail(strprintf("checkpoint %s: lacks '%s'", path.c_str(), name));
        if (it->second.bytes > CHECKPOINT_MAX_TEXT) fail(strprintf("checkpoint %s: '%s' is too large", path.c_str(), name));
    }
    return read_checkpoint_blobs(path, h, any, {"config", "gemm_plan", "trainer"}, false);
}

// A --resume checkpoint read and checked through before any GPU work: every blob's name and size
// against this configuration's layout, the checksum over every byte, then the state texts parsed
// and bounded by what this configuration allocates (the step, the schedule, the optimizer's step
// counts, each checked rank's data position against the data and the device buffers).
struct ResumeState {
    std::string path;
    CheckpointHeader header;
    RunState run;  // the steps done and the clock
    ScheduleState schedule;
    std::map<int, OptimizerHostState> optimizer;  // by rank
    std::map<int, DataPosition> position;         // by rank
    std::map<std::string, std::string> blobs;     // the parameters and the checked ranks' device blobs
};

static RunState parse_trainer_state(const std::string& text, const std::string& where) {
    const std::vector<std::string> l = split(text, '\n');
    auto bad = [&] { fail(where + ": the trainer blob is not 'steps_done N' and 'training_time_ms T'"); };
    if (l.size() != 3 || !l[2].empty()) bad();
    const std::vector<std::string> s = keyed_line(l, 0, "steps_done", where.c_str()),
                                   t = keyed_line(l, 1, "training_time_ms", where.c_str());
    if (s.size() != 2 || t.size() != 2 || t[1].size() > 40 || t[1].find_first_not_of("0123456789abcdefx.p+-") != std::string::npos)
        bad();
    RunState rs;
    rs.steps_done = parse_i64("steps_done", s[1]);
    char* end = nullptr;
    rs.training_time_ms = strtod(t[1].c_str(), &end);
    if (*end || !std::isfinite(rs.training_time_ms) || rs.training_time_ms < 0) bad();
    return rs;
}

static ResumeState read_resume_state(const std::string& path, const CheckpointHeader& h, const Hyperparameters& a,
                                     int world_size, const std::vector<int>& ranks, const std::string& data_path) {
    ResumeState r;
    r.path = path, r.header = h;
    const std::map<std::string, BlobSpec> layout = checkpoint_layout(a, world_size);
    std::set<std::string> want;
    for (const auto& [name, spec] : layout) {
        bool mine = name.rfind("rank", 0) != 0;
        for (int rank : ranks) mine = mine || name.rfind(strprintf("rank%d/", rank), 0) == 0;
        if (mine) want.insert(name);
    }
    r.blobs = read_checkpoint_blobs(path, h, layout, want, true);
    const std::string where = "checkpoint " + path;
    r.run = parse_trainer_state(r.blobs.at("trainer"), where);
    if (r.run.steps_done != h.step) fail(where + ": the trainer blob does not match the header's step");
    if (h.step < 1 || h.step > a.num_iterations())
        fail(strprintf("%s: %lld steps done is not within this schedule's 1..%lld", where.c_str(), (long long)h.step,
                       (long long)a.num_iterations()));
    try {
        r.schedule = parse_schedule_state(r.blobs.at("schedule"), a);
        const std::vector<std::string> files = list_files(join_data_path(data_path, a.train_files));
        std::map<std::string, int64_t> bos_counts;
        for (int rank : ranks) {
            r.optimizer[rank] = parse_optimizer_state(r.blobs.at("optimizer"),
                                                      build_param_configs(a, model_params(world_size), world_size, rank), h.step);
            const DataPosition p = parse_data_position(r.blobs.at(strprintf("rank%d/data", rank)));
            check_data_position(p, files, -1, world_size, rank_capacity(a));
            if (p.max_seq_len != a.train_max_seq_len)
                fail(strprintf("data position: sequences cut at %lld, this configuration at %lld", (long long)p.max_seq_len,
                               (long long)a.train_max_seq_len));
            if (!bos_counts.count(p.path)) bos_counts[p.path] = (int64_t)load_data_shard(p.path)->bos_idx.size();
            check_data_position(p, files, bos_counts[p.path], world_size, rank_capacity(a));
            r.position[rank] = p;
        }
    } catch (const TrainerError& e) {
        fail(where + ": " + e.what());
    }
    r.blobs.erase("config"), r.blobs.erase("gemm_plan"), r.blobs.erase("trainer"), r.blobs.erase("schedule"),
        r.blobs.erase("optimizer");
    return r;
}

// Loads a checked checkpoint (read_resume_state) into the model, the optimizer, the schedule and
// this rank's data stream; its blobs are freed as they go up.
static void load_checkpoint(ResumeState& r, ParamStore& params, NorMuonAndAdam& opt, TrainingManager& tm,
                            DistributedDataGenerator& loader, int rank) {
    auto up = [&](const std::string& name, void* dev, size_t bytes) {
        std::string& h = r.blobs.at(name);
        if (h.size() != bytes) fail(strprintf("checkpoint: '%s' holds %zu bytes, the model's %zu", name.c_str(), h.size(), bytes));
        CUDA_CHECK(cudaMemcpy(dev, h.data(), bytes, cudaMemcpyHostToDevice));
        std::string().swap(h);
    };
    for (Param& p : params.all()) {
        up("param/" + p.shape.label, p.data, p.bytes());
        CUDA_CHECK(cudaMemset(p.grad, 0, p.bytes()));
    }
    for (const DeviceBlob& d : rank_device_blobs(params, opt, rank)) up(d.name, d.data, d.bytes);
    opt.set_host_state(r.optimizer.at(rank));
    tm.set_state(r.schedule);
    loader.seek(r.position.at(rank));
    r.blobs.clear();
    CUDA_CHECK(cudaDeviceSynchronize());
}

// SIGINT / SIGTERM: the first asks every rank to stop after the current step (rank 0 writes a
// checkpoint); a second stops at once.
static volatile sig_atomic_t g_stop_signal = 0;
static void on_stop_signal(int sig) {
    if (g_stop_signal) _exit(128 + sig);
    g_stop_signal = sig;
}

static void print_help() {
    Hyperparameters defaults;
    printf("usage: mpirun -np N ./train_gpt [--flag value ...]   (N = 1, 2, 4 or 8; one GPU per rank)\n"
           "       mpirun -np N ./train_gpt --rerun LOG [flags]  a logged run again (its flags and GEMM plan)\n"
           "       mpirun -np N ./train_gpt --resume CKPT [flags] continue from a checkpoint\n"
           "       ./train_gpt --print-source                  print the embedded sources\n"
           "       ./train_gpt --diff-logs A.txt B.txt          compare two logs: summary, then diffs (exit 0/1/2)\n"
           "       ./train_gpt --check [flags | --rerun LOG | --resume CKPT]  check every input as a run would, print\n"
           "                                                   its configuration; no GPU (world size: the log's, else\n"
           "                                                   $TRAIN_GPT_WORLD_SIZE, else 8)\n"
           "Data files are found at $DATA_PATH/<train_files|val_files> (DATA_PATH defaults to '.').\n");
    const char* group = nullptr;
    for (const Option& o : options_of(defaults)) {
        if (o.group != group) printf("\n%s (default):\n", group = o.group);
        printf("  --%-28s %s (%s)\n", o.name, o.help, format_option(o).c_str());
    }
}

// -----------------------------------------------------------------------------
// Ranks and GPUs. A rank takes the GPU of its rank within the node. With TRAIN_GPT_SHARE_GPUS=1
// (run.sh's SHARE_GPUS=1) ranks may outnumber the GPUs: rank r takes GPU r % count, and each rank
// gives NCCL a host id of its own, so that NCCL, which refuses two ranks on one GPU of one host,
// connects them over its socket transport on loopback. Real NCCL and real collectives, to test
// every multi-rank path on one GPU: a correctness mode, slow, never for timing.

static bool sharing_gpus() {
    const char* v = getenv("TRAIN_GPT_SHARE_GPUS");
    return v && std::string(v) == "1";
}

// sets this process's GPU (and, sharing, NCCL's settings for it); before any NCCL call
static void select_device(int local_rank, int rank) {
    int num_gpus = 0;
    CUDA_CHECK(cudaGetDeviceCount(&num_gpus));
    if (!sharing_gpus()) {
        if (local_rank >= num_gpus)
            fail(strprintf("local rank %d has no GPU: this node has %d (TRAIN_GPT_SHARE_GPUS=1 lets ranks share "
                           "GPUs, to test the multi-rank paths; not for timing)", local_rank, num_gpus));
        CUDA_CHECK(cudaSetDevice(local_rank));
        return;
    }
    const std::string host_id = strprintf("train_gpt_shared_rank_%d", rank);
    setenv("NCCL_HOSTID", host_id.c_str(), 1);
    setenv("NCCL_SOCKET_IFNAME", "lo", 0);  // loopback, unless the caller chose an interface
    setenv("NCCL_IB_DISABLE", "1", 0);
    // Ranks on one GPU run in time slices, and a collective waits on every rank's slice in turn: the
    // fewer chunks it moves in, the fewer waits. Measured at 8 ranks on one H200 (small batches):
    // 2.25 s a step with NCCL's 4 MiB buffers, 0.94 with 16 MiB, 0.87 with 64 MiB.
    setenv("NCCL_BUFFSIZE", "67108864", 0);
    CUDA_CHECK(cudaSetDevice(local_rank % num_gpus));
}

// -----------------------------------------------------------------------------
// The inputs of a run, all checked before any GPU work; --check

// logs/<run_id>.txt, and what a run says when it is there already (a log is never overwritten)
static std::string log_path(const std::string& run_id) { return "logs/" + run_id + ".txt"; }
static std::string log_exists(const std::string& run_id) {
    return log_path(run_id) + " exists: a run never overwrites a log (choose another --run_id, or none for a fresh uuid)";
}

// a plan's lines after its first, which names the machine it was made for
static std::string plan_body(const std::string& plan) {
    const size_t nl = plan.find('\n');
    return nl == std::string::npos ? std::string() : plan.substr(nl + 1);
}

// A logged configuration as a run would take it: its flags within their ranges (before anything is
// computed from them), then every derived line what this trainer writes for them.
static void check_logged_run(const std::string& block, const std::string& where, int first_line, LoggedRun& run) {
    try {
        validate_args(run.args, run.world_size);
    } catch (const TrainerError& e) {
        fail(where + ": " + e.what());
    }
    check_logged_configuration(block, where, first_line, run);
}

// A GEMM plan from a log or a checkpoint: its first line names the machine, every other line is
// 'gemm SHAPE = ALGORITHM (note)' (whether the machine is this one is checked on the GPU)
static void check_gemm_plan(const std::string& plan, const std::string& where) {
    if (plan.rfind("gemm_plan_for = ", 0) != 0) fail(where + ": the GEMM plan does not start with 'gemm_plan_for = '");
    try {
        Gemms::parse_plan(plan_body(plan));
    } catch (const TrainerError& e) {
        fail(where + ": " + e.what());
    }
}

// Everything a run takes in, checked before any GPU work and before a log exists: the flags; a
// --rerun log (its sources, configuration and GEMM plan) or a --resume checkpoint (its header,
// configuration and hash, then every blob: read_resume_state); every data shard's header; the
// log's name. Throws at the first bad input, naming it. world_size 0 (--check): the log's or the
// checkpoint's, else 8. ranks: whose checkpoint state is checked (a run: its own; empty: all).
static RunSetup check_run(const std::vector<std::string>& cli, int world_size, std::vector<int> ranks) {
    RunSetup r;
    std::vector<std::string> flags = cli;
    const char* dp = getenv("DATA_PATH");
    r.data_path = dp ? dp : ".";
    if (r.data_path.size() > MAX_TEXT_OPTION ||
        std::any_of(r.data_path.begin(), r.data_path.end(), [](char c) { return (unsigned char)c < 0x20 || c == 0x7f; }))
        fail(strprintf("DATA_PATH must be at most %zu characters, without control characters", MAX_TEXT_OPTION));
    std::shared_ptr<CheckpointHeader> header;
    if (!cli.empty() && (cli[0] == "--rerun" || cli[0] == "--resume")) {
        if (cli.size() < 2) fail("usage: ./train_gpt " + cli[0] + (cli[0] == "--rerun" ? " LOG" : " CHECKPOINT") + " [flags]");
        const std::string& from = cli[1];
        LoggedRun run;
        if (cli[0] == "--rerun") {
            const LogParts lp = split_log(from);
            run = parse_logged_configuration(lp.configuration, from, lp.configuration_line);
            if (lp.train_gpt != embedded_train_gpt() || lp.triton_kernels != embedded_triton_kernels())
                fail(from + " ran other sources than this binary's (./train_gpt --diff-logs shows which): build its "
                     "code to rerun it");
            check_logged_run(lp.configuration, from, lp.configuration_line, run);
            if (lp.gemm_plan.empty()) fail(from + " has no GEMM plan (the run ended before its warmup did)");
            check_gemm_plan(lp.gemm_plan, from);
            r.gemm_plan = lp.gemm_plan;
        } else {
            header = std::make_shared<CheckpointHeader>(read_checkpoint_header(from));
            const std::map<std::string, std::string> texts = read_checkpoint_texts(from, *header);
            const std::string where = from + " (its configuration)";
            run = parse_logged_configuration(texts.at("config"), where, 1);
            check_logged_run(texts.at("config"), where, 1, run);
            if (hash_text(texts.at("config")) != header->config_hash)
                fail("checkpoint " + from + ": its configuration does not hash to the header's config_hash (edited?)");
            if (header->world_size != run.world_size)
                fail(strprintf("checkpoint %s: the header says world size %d, its configuration %d", from.c_str(),
                               header->world_size, run.world_size));
            check_gemm_plan(texts.at("gemm_plan"), "checkpoint " + from);
            r.gemm_plan = texts.at("gemm_plan");
        }
        if (world_size == 0) world_size = run.world_size;
        if (run.world_size != world_size)
            fail(strprintf("%s ran at world size %d; run it on %d ranks (this run has %d)", from.c_str(), run.world_size,
                           run.world_size, world_size));
        r.args = run.args;
        if (!dp) r.data_path = run.data_path;
        flags.erase(flags.begin(), flags.begin() + 2);
    }
    r.world_size = world_size = world_size ? world_size : 8;
    parse_args(r.args, flags);
    validate_args(r.args, world_size);
    for (const std::string& files : {r.args.train_files, r.args.val_files}) {
        std::vector<std::string> paths;
        try {
            paths = list_files(join_data_path(r.data_path, files));
        } catch (const TrainerError& e) {
            fail(std::string(e.what()) + " (DATA_PATH=" + r.data_path + "; the FineWeb shards: python3 "
                 "data/cached_fineweb10B.py 8; or point --train_files / --val_files / DATA_PATH at your shards)");
        }
        for (const std::string& path : paths) {
            int64_t tokens = 0;
            close(open_data_shard(path, &tokens));
        }
    }
    if (!r.args.run_id.empty() && access(log_path(r.args.run_id).c_str(), F_OK) == 0) fail(log_exists(r.args.run_id));
    if (header) {
        if (ranks.empty())
            for (int rank = 0; rank < world_size; ++rank) ranks.push_back(rank);
        r.resume = std::make_shared<ResumeState>(read_resume_state(cli[1], *header, r.args, world_size, ranks, r.data_path));
    }
    return r;
}

// `./train_gpt --check [flags | --rerun LOG | --resume CHECKPOINT]`: every check a run makes before
// its GPU work (every rank's checkpoint state included), then the configuration as the log would
// hold it. Needs no GPU and no MPI. The world size: the log's or checkpoint's, else
// $TRAIN_GPT_WORLD_SIZE, else 8.
static int check_only(const std::vector<std::string>& cli) {
    int world_size = 0;
    if (const char* ws = getenv("TRAIN_GPT_WORLD_SIZE")) {
        world_size = (int)parse_i64("TRAIN_GPT_WORLD_SIZE", ws);
        if (world_size < 1 || 8 % world_size != 0) fail("TRAIN_GPT_WORLD_SIZE must be 1, 2, 4 or 8");
    }
    RunSetup r = check_run(cli, cli.empty() || (cli[0] != "--rerun" && cli[0] != "--resume") ? world_size : 0, {});
    if (world_size && r.world_size != world_size)
        fail(strprintf("TRAIN_GPT_WORLD_SIZE=%d, but the run it continues had %d ranks", world_size, r.world_size));
    std::string command_line = "./train_gpt";
    for (const std::string& a : cli) command_line += " " + a;
    fputs(configuration_text(r.args, r.world_size, r.data_path, command_line).c_str(), stdout);
    printf("check: the configuration, the data's %s and %s shards%s are fine; a run on %d rank%s writes %s\n",
           r.args.train_files.c_str(), r.args.val_files.c_str(),
           r.resume ? strprintf(" and checkpoint %s (%lld steps done)", r.resume->path.c_str(),
                                (long long)r.resume->run.steps_done).c_str()
           : !r.gemm_plan.empty() ? " and the log's GEMM plan" : "",
           r.world_size, r.world_size > 1 ? "s" : "",
           r.args.run_id.empty() ? "logs/<a fresh uuid>.txt" : log_path(r.args.run_id).c_str());
    return 0;
}

// -----------------------------------------------------------------------------
// main's harness: the processes, the log, the configuration, the GEMM plan, the loop's clock

#ifndef TRAIN_GPT_NO_MAIN

static Distributed init_distributed(int& argc, char**& argv) {
    Distributed d;
    MPI_CHECK(MPI_Init(&argc, &argv));
    g_mpi_up = true;
    MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
    MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &g_rank));
    MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &g_world_size));
    d.rank = g_rank, d.world_size = g_world_size;
    return d;
}

static void init_devices(Distributed& d) {
    int local_rank = 0;
    MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, d.rank, MPI_INFO_NULL, &d.node_comm));
    MPI_CHECK(MPI_Comm_rank(d.node_comm, &local_rank));
    select_device(local_rank, d.rank);
    d.comm = nccl_init(d.rank, d.world_size);
}

static void finalize_distributed(Distributed& d) {
    CUDA_CHECK(cudaDeviceSynchronize());  // nothing of the optimizer's NCCL stream is in flight
    if (d.comm) NCCL_CHECK(ncclCommDestroy(d.comm));
    MPI_CHECK(MPI_Comm_free(&d.node_comm));
    MPI_CHECK(MPI_Finalize());
}

// Rank 0 opens logs/<run_id>.txt (the run id of rank 0 names it) and writes its header: the
// sources, the versions, the resolved configuration, nvidia-smi.
static std::string open_log(Hyperparameters& args, const Distributed& d, const std::string& data_path, int argc,
                            char** argv) {
    char run_id[64] = {0};
    if (d.rank == 0) snprintf(run_id, sizeof run_id, "%s", args.run_id.empty() ? make_uuid4().c_str() : args.run_id.c_str());
    MPI_CHECK(MPI_Bcast(run_id, sizeof run_id, MPI_CHAR, 0, MPI_COMM_WORLD));
    args.run_id = run_id;
    std::string command_line;
    for (int i = 0; i < argc; ++i) command_line += (i ? " " : "") + std::string(argv[i]);
    if (d.rank == 0) {
        if (mkdir("logs", 0755) != 0 && errno != EEXIST) fail(strprintf("cannot make logs/: %s", strerror(errno)));
        const std::string logfile = log_path(args.run_id);
        const int fd = open(logfile.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);  // never over a log
        if (fd < 0 && errno == EEXIST) fail(log_exists(args.run_id));
        if (fd < 0 || !(g_logfile = fdopen(fd, "w"))) fail(strprintf("cannot write %s: %s", logfile.c_str(), strerror(errno)));
        printf("%s\n", logfile.c_str());
    }
    print0(source_block() + LOG_RULE);
    print0(versions_text());
    const std::string configuration = configuration_text(args, d.world_size, data_path, command_line);
    print0(configuration);
    print0(run_command("nvidia-smi 2>&1"));
    print0(LOG_RULE);
    if (!g_log_error.empty()) fail(g_log_error);
    // the block's lines, as a checkpoint keeps them
    const std::string begin = "# configuration\n", end = "# end configuration\n";
    return configuration.substr(begin.size(), configuration.size() - begin.size() - end.size());
}

// The device memory in use (total - free, so the CUDA context and NCCL's buffers count too), at
// its highest so far: every buffer is allocated up front, so a few samples see the peak.
static double peak_mib() {
    static double peak = 0;
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    peak = std::max(peak, (total_b - free_b) / 1048576.0);
    return peak;
}

// the process's start, for the log's "launch to the first training step" (static: set before main)
static const auto g_launch_time = std::chrono::steady_clock::now();

// The trainer's own commands, which need no MPI, GPU or data: --help, --print-source, --diff-logs.
// Returns the exit status, or -1 for a training run.
static int run_tool(const std::vector<std::string>& cli) {
    // under mpirun, the commands that only print run on rank 0 alone
    const char* launcher_rank = getenv("OMPI_COMM_WORLD_RANK");
    const bool print_rank = !launcher_rank || std::string(launcher_rank) == "0";
    if (!cli.empty() && (cli[0] == "--help" || cli[0] == "-h")) {
        if (print_rank) print_help();
        return 0;
    }
    if (!cli.empty() && cli[0] == "--print-source") {
        if (print_rank) fputs(source_block().c_str(), stdout);
        return 0;
    }
    if (!cli.empty() && cli[0] == "--diff-logs") {
        try {
            if (cli.size() != 3) fail("usage: ./train_gpt --diff-logs A.txt B.txt");
            return diff_logs(cli[1], cli[2]);
        } catch (const TrainerError& e) {
            fprintf(stderr, "error: %s\n", e.what());
            return 2;
        }
    }
    if (!cli.empty() && cli[0] == "--check") {
        if (!print_rank) return 0;
        try {
            return check_only(std::vector<std::string>(cli.begin() + 1, cli.end()));
        } catch (const TrainerError& e) {
            fprintf(stderr, "error: %s\n", e.what());
            return 1;
        }
    }
    return -1;
}

// The configuration, checked on every rank before any GPU work (check_run); on an error rank 0
// alone says why and all ranks stop with exit status 1. Then: is there a GPU?
static RunSetup resolve_configuration(const std::vector<std::string>& cli, const Distributed& dist) {
    const int world_size = dist.world_size;
    RunSetup r;
    std::string setup_error;
    try {
        r = check_run(cli, world_size, {dist.rank});
        if (r.resume && r.resume->header.source_hash != hash_text(source_block()) && dist.rank == 0)
            printf("note: %s was written by other sources than this binary's\n", r.resume->path.c_str());
        int gpus = 0;
        const cudaError_t e = cudaGetDeviceCount(&gpus);
        if (e != cudaSuccess || gpus == 0)
            fail(strprintf("no usable NVIDIA GPU: %s (the trainer needs a Hopper GPU and its driver)",
                           e == cudaErrorInsufficientDriver ? "no NVIDIA driver, or one older than this CUDA runtime"
                           : e == cudaErrorNoDevice || e == cudaSuccess ? "none found"
                                                                        : cudaGetErrorString(e)));
    } catch (const TrainerError& e) {
        setup_error = e.what();
    }
    int failed = !setup_error.empty(), any_failed = 0, first_failed = world_size;
    MPI_CHECK(MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
    int me = failed ? dist.rank : world_size;
    MPI_CHECK(MPI_Allreduce(&me, &first_failed, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
    if (any_failed) {
        if (dist.rank == first_failed) fprintf(stderr, "error: %s\n", setup_error.c_str());
        MPI_CHECK(MPI_Finalize());
        exit(1);
    }
    return r;
}

// A --rerun log's or a checkpoint's GEMM plan, on the machine it was made for (none given: tune)
static void use_given_plan(Gemms& gemms, const std::string& given_plan) {
    if (given_plan.empty()) return;
    const std::string first = given_plan.substr(0, given_plan.find('\n')), plan_for = gemm_plan_device();
    if (first != plan_for)
        fail("the GEMM plan was made for another GPU or library: '" + first + "'; this machine: '" + plan_for +
             "' (run with flags instead of --rerun/--resume to tune again)");
    gemms.set_plan(plan_body(given_plan));
}

// After the warmup: the GEMM plan from here on, in the log (a rerun or a resumed run follows it);
// several ranks all take rank 0's.
static std::string settle_gemm_plan(Gemms& gemms, const std::string& given_plan, int world_size) {
    gemms.freeze();
    std::string gemm_plan = given_plan.empty() ? gemm_plan_device() + "\n" + gemms.plan_text() : given_plan;
    if (world_size > 1) {
        uint64_t n = gemm_plan.size();
        MPI_CHECK(MPI_Bcast(&n, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD));
        gemm_plan.resize(n);
        MPI_CHECK(MPI_Bcast(gemm_plan.data(), (int)n, MPI_CHAR, 0, MPI_COMM_WORLD));
        gemms.adopt_plan(plan_body(gemm_plan));
    }
    print0(given_plan.empty() ? gemms.tuning_report() : "GEMM plan given: no tuning", true);
    if (gemms.unplanned_shapes() > 0)
        print0(strprintf("note: %d GEMM shapes are not in the given plan (other flags?): the heuristic's first choice",
                         gemms.unplanned_shapes()), true);
    print0("# gemm plan\n" + gemm_plan + "# end gemm plan");
    peak_mib();
    return gemm_plan;
}

// The training loop's harness: the clock (stopped for validation and checkpoints), the step lines,
// the profiler, checkpoints (every N steps, at the end, on SIGINT/SIGTERM) and --resume.
RunHarness::RunHarness(const Hyperparameters& args, RunSetup& setup, const std::string& configuration,
                       const std::string& gemm_plan, ParamStore& params, NorMuonAndAdam& opt, TrainingManager& tm,
                       DistributedDataGenerator& loader, const Distributed& dist, cudaStream_t stream)
    : args_(args), params_(params), opt_(opt), tm_(tm), loader_(loader), dist_(dist), stream_(stream),
      profiler_(std::make_unique<LoopProfiler>(args.profile_steps > 0)) {
    rs_.configuration = configuration, rs_.gemm_plan = gemm_plan;
    if (setup.resume) {  // read and checked before any GPU work
        load_checkpoint(*setup.resume, params, opt, tm, loader, dist.rank);
        rs_.steps_done = setup.resume->run.steps_done, rs_.training_time_ms = setup.resume->run.training_time_ms;
        last_checkpoint_ = setup.resume->path;
        print0(strprintf("resumed from %s: %lld steps done", last_checkpoint_.c_str(), (long long)rs_.steps_done), true);
        setup.resume.reset();
    }
    signal(SIGINT, on_stop_signal);
    signal(SIGTERM, on_stop_signal);
    training_time_ms_ = clock_at_start_ = rs_.training_time_ms;
    first_step_ = rs_.steps_done;
    CUDA_CHECK(cudaDeviceSynchronize());
    t0_ = std::chrono::steady_clock::now();
    print0(strprintf("launch to the first training step: %.1f s (CUDA, NCCL, data, warmup with its GEMM tuning)",
                     std::chrono::duration<double>(t0_ - g_launch_time).count()), true);
}

RunHarness::~RunHarness() = default;

double RunHarness::elapsed_ms() const {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_).count();
}

void RunHarness::stop_clock() {
    CUDA_CHECK(cudaDeviceSynchronize());
    training_time_ms_ += elapsed_ms();
}

void RunHarness::start_clock() {
    CUDA_CHECK(cudaDeviceSynchronize());
    t0_ = std::chrono::steady_clock::now();
}

void RunHarness::log_validation(int64_t step, double val_loss) {
    print0(strprintf("step:%lld/%lld val_loss:%.4f train_time:%.0fms step_avg:%.2fms", (long long)step,
                     (long long)args_.num_iterations(), val_loss, training_time_ms_,
                     training_time_ms_ / std::max<int64_t>(step, 1)), true);
    peak_mib();
    start_clock();
}

void RunHarness::checkpoint(int64_t steps_done) {
    stop_clock();
    rs_.steps_done = steps_done, rs_.training_time_ms = training_time_ms_;
    try {
        last_checkpoint_ = save_checkpoint(args_, params_, opt_, tm_, loader_, rs_, dist_.rank, dist_.world_size);
        print0("checkpoint " + last_checkpoint_, true);
    } catch (const TrainerError& e) {  // a full disk, say: the last good checkpoint stays what it was
        const std::string msg = strprintf("checkpoint after step %lld failed: %s; %s", (long long)steps_done, e.what(),
                                          last_checkpoint_.empty() ? "there is no earlier one"
                                                                   : ("the last good one: " + last_checkpoint_).c_str());
        print0(msg + (steps_done < args_.num_iterations() ? "; the run goes on" : ""), true);
        if (steps_done == args_.num_iterations()) failure_ = msg;
    }
    t0_ = std::chrono::steady_clock::now();
}

void RunHarness::timed_step(int64_t step, const std::function<void()>& train_step) {
    const int64_t train_steps = args_.num_iterations();
    const bool profiled = args_.profile_steps > 0 && step % args_.profile_steps == 0;
    // a profiled run times whole steps: no step's tail may run on into the next one's clock
    if (args_.profile_steps > 0) CUDA_CHECK(cudaDeviceSynchronize());
    const double step_start = elapsed_ms();
    if (args_.profile_steps > 0) profiler_->sample();
    if (profiled) g_profiler = profiler_.get(), profiler_->begin_step(stream_);
    try {
        train_step();
    } catch (const TrainerError& e) {  // a NaN stops the run: say where, and what can resume it
        throw TrainerError(strprintf("%s (training step %lld; last checkpoint: %s)", e.what(), (long long)step + 1,
                                     last_checkpoint_.empty() ? "none" : last_checkpoint_.c_str()));
    }
    const bool unprofiled = args_.profile_steps > 0 && !profiled;
    if (profiled) profiler_->end_step(stream_, tm_.phase()), g_profiler = nullptr;
    if (unprofiled) CUDA_CHECK(cudaDeviceSynchronize());
    const double step_ms = elapsed_ms() - step_start;
    if (unprofiled) profiler_->add_unprofiled(tm_.phase(), step_ms);
    if (args_.profile_steps > 0) profiler_->samples_of(tm_.phase());
    const double approx = training_time_ms_ + elapsed_ms();
    const std::string line = strprintf("step:%lld/%lld train_time:%.0fms step_avg:%.2fms", (long long)step + 1,
                                       (long long)train_steps, approx, approx / (step + 1));
    const double per_step = (approx - clock_at_start_) / (step + 1 - first_step_);
    print0_console(line, strprintf("%s  %.2fM tok/s, ETA %s", line.c_str(),
                                   get_bs(args_, step) / std::max(step_ms, 1e-3) / 1e3,
                                   format_duration(per_step * (train_steps - step - 1) / 1e3).c_str()));
    // every rank finishes this step; then a signal on any rank, or a failed write to the log, stops
    // all, after a checkpoint
    constexpr int LOG_FAILED = 1 << 16;  // above every signal number
    int stop = g_log_error.empty() ? (int)g_stop_signal : LOG_FAILED, any_stop = 0;
    MPI_CHECK(MPI_Allreduce(&stop, &any_stop, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
    if (any_stop || (args_.checkpoint_every > 0 && (step + 1) % args_.checkpoint_every == 0 && step + 1 < train_steps))
        checkpoint(step + 1);
    if (any_stop) {
        const std::string how = last_checkpoint_.empty() ? std::string("there is no checkpoint to continue from")
                                                         : "continue with: ./train_gpt --resume " + last_checkpoint_;
        if (any_stop == LOG_FAILED) {
            failure_ = strprintf("logs/%s.txt: %s; stopped after step %lld; %s", args_.run_id.c_str(),
                                 g_log_error.empty() ? "rank 0's log write failed" : g_log_error.c_str(),
                                 (long long)step + 1, how.c_str());
        } else {
            print0(strprintf("stopped by %s after step %lld; %s", strsignal(any_stop), (long long)step + 1, how.c_str()), true);
        }
        stopped_ = true;
    }
}

int RunHarness::finish() {
    if (args_.profile_steps > 0) print0(profiler_->table(), true);
    print0(strprintf("peak memory in use: %.0f MiB (device total - free at its highest: CUDA context, NCCL and every "
                     "buffer; sampled after set-up, warmup, each validation and the end)", peak_mib()), true);
    if (failure_.empty() && !g_log_error.empty())
        failure_ = strprintf("logs/%s.txt: %s", args_.run_id.c_str(), g_log_error.c_str());
    if (!failure_.empty() && dist_.rank == 0) fprintf(stderr, "error: %s\n", failure_.c_str());
    int failed = !failure_.empty(), any_failed = 0;
    MPI_CHECK(MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
    return any_failed ? 1 : 0;
}

#endif  // TRAIN_GPT_NO_MAIN
