// What the test binaries share: pass/fail counting, error expectations, synthetic shards.
// Included after train_gpt.cu (built with TRAIN_GPT_NO_MAIN).
#pragma once
#include <random>

// bf16 bits to and from float (round to nearest even, as the trainer rounds)
static float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint16_t float_to_bf16(float f) { return bf16_bits(f); }

static int g_passed = 0, g_failed = 0;

#define CHECK(cond, ...)                                                                  \
    do {                                                                                  \
        if (cond) ++g_passed;                                                             \
        else {                                                                            \
            ++g_failed;                                                                   \
            printf("FAIL %s:%d: %s: %s\n", __FILE__, __LINE__, #cond, strprintf(__VA_ARGS__).c_str()); \
        }                                                                                 \
    } while (0)

// fn must throw a TrainerError whose message holds every one of the given substrings
static void expect_error(const char* what, const std::function<void()>& fn, std::vector<std::string> needles) {
    try {
        fn();
        ++g_failed;
        printf("FAIL %s: no error raised\n", what);
    } catch (const TrainerError& e) {
        std::string msg = e.what();
        for (const std::string& n : needles)
            if (msg.find(n) == std::string::npos) {
                ++g_failed;
                printf("FAIL %s: message '%s' lacks '%s'\n", what, msg.c_str(), n.c_str());
                return;
            }
        ++g_passed;
    }
}

// ---------------------------------------------------------------------------------------------
// synthetic shards

static void write_shard(const std::string& path, const std::vector<uint16_t>& tokens, int32_t magic = SHARD_MAGIC,
                        int32_t version = SHARD_VERSION, int64_t claimed = -1) {
    int32_t header[SHARD_HEADER_INTS] = {0};
    header[0] = magic;
    header[1] = version;
    header[2] = (int32_t)(claimed >= 0 ? claimed : (int64_t)tokens.size());
    FILE* f = fopen(path.c_str(), "wb");
    fwrite(header, 4, SHARD_HEADER_INTS, f);
    fwrite(tokens.data(), 2, tokens.size(), f);
    fclose(f);
}

// documents with FineWeb-like log-normal lengths (median `median`), each starting with BOS; the
// shard may start inside a document (tokens before the first BOS)
static std::vector<uint16_t> make_tokens(std::mt19937_64& rng, int64_t n, double median, bool lead_in) {
    std::lognormal_distribution<double> len_dist(std::log(median), 0.9);
    std::uniform_int_distribution<int> tok(0, BOS_ID - 1);
    std::vector<uint16_t> t;
    if (lead_in)
        for (int i = 0; i < 37; ++i) t.push_back((uint16_t)tok(rng));
    while ((int64_t)t.size() < n) {
        int64_t len = std::max<int64_t>(1, (int64_t)len_dist(rng));
        t.push_back(BOS_ID);
        for (int64_t i = 1; i < len && (int64_t)t.size() < n; ++i) t.push_back((uint16_t)tok(rng));
    }
    t.resize(n);
    return t;
}

// One micro-batch as the model takes it: T + 1 token ids (documents of lengths from `len`, 2 to
// 2048 tokens, each starting with BOS) and cu_seqlens padded with T to cu_len entries as the
// loader pads them (the last entry before the padding takes what is left of T). The caller owns
// the length distribution, so consecutive batches continue one stream of lengths.
struct DocumentBatch {
    std::vector<int> tokens, cu;
};
static DocumentBatch document_batch(std::mt19937_64& rng, std::lognormal_distribution<double>& len, int T, int cu_len) {
    DocumentBatch b;
    b.tokens.assign(T + 1, 0), b.cu = {0};
    for (int pos = 0; pos < T;) {
        int L = std::min(T - pos, std::max(2, std::min(2048, (int)len(rng))));
        if ((int)b.cu.size() == cu_len - 1) L = T - pos;
        b.tokens[pos] = BOS_ID;
        for (int i = 1; i < L; ++i) b.tokens[pos + i] = (int)(rng() % BOS_ID);
        pos += L;
        b.cu.push_back(pos);
    }
    b.tokens[T] = (int)(rng() % BOS_ID);
    while ((int)b.cu.size() < cu_len) b.cu.push_back(T);
    return b;
}
