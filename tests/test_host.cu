// Host tests of the trainer: configuration, schedules, data loader, self-logging. Built from the
// trainer's own source (train_gpt.cu with its main() left out), run without a GPU.
//
//   ./tests/test_host --binary ./train_gpt --python python3     all tests; last line "N passed, N failed"
//   ./tests/test_host --bench-data 'data/textmix/textmix_train_*.bin'   batch-building benchmark

#define TRAIN_GPT_NO_MAIN
#include "../train_gpt.cu"
#include "testing.h"

#include <chrono>
#include <unordered_set>
#include <sstream>

static std::string g_tmp, g_python = "python3", g_binary;
static const std::string g_src_dir = TRAIN_GPT_SRC_DIR;

static std::string read_file(const std::string& path) {
    try {
        return read_regular_file(path, 1 << 30, "file");
    } catch (const TrainerError&) {
        return "<missing " + path + ">";
    }
}

static int run_shell(const std::string& cmd, std::string* out = nullptr) {
    std::string s;
    const int rc = run_capture(cmd, s);
    if (out) *out = s;
    return rc;
}

static std::string make_dir(const std::string& name) {
    std::string d = g_tmp + "/" + name;
    mkdir(d.c_str(), 0755);
    return d;
}

// ---------------------------------------------------------------------------------------------
// loader vs the Python reference

struct Scenario {
    std::string name, pattern;
    int world = 1;
    int64_t accum = 8;
    int64_t max_seq_len = 256;
    bool aligned = true, cycle = false;
    int64_t quickload_tokens = 4000000;
    std::vector<int64_t> steps;  // tokens per step, all ranks
};

static void dump_batch(std::string& out, const HostBatch& b) {
    int32_t hdr[2] = {(int32_t)b.num_tokens, (int32_t)b.max_num_docs};
    out.append((const char*)hdr, 8);
    out.append((const char*)b.inputs(), b.num_tokens * 4);
    out.append((const char*)b.targets(), b.num_tokens * 4);
    out.append((const char*)b.cu_seqlens(), b.max_num_docs * 4);
}

static LoaderOptions host_options(const Scenario& s) {
    LoaderOptions o;
    o.align_to_bos = s.aligned;
    o.cycle = s.cycle;
    o.pinned = false;
    o.quickload_tokens = s.quickload_tokens;
    return o;
}

// runs one rank of a scenario through the C++ loader, as the training loop drives it
static std::string run_cpp(const Scenario& s, int rank) {
    DistributedDataGenerator gen(s.pattern, {s.steps[0], s.max_seq_len, s.accum}, rank, s.world, host_options(s));
    std::string out;
    int64_t bs = s.steps[0];
    for (int64_t step_bs : s.steps) {
        if (step_bs != bs) gen.set_batch_size({step_bs, s.max_seq_len, s.accum});
        bs = step_bs;
        for (int64_t m = 0; m < s.accum; ++m) dump_batch(out, gen.next());
    }
    return out;
}

static std::string join(const std::vector<int64_t>& v) {
    std::string s;
    for (int64_t x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
    return s;
}

// index of the first differing micro-batch, for a readable failure
static std::string first_difference(const std::string& a, const std::string& b) {
    size_t i = 0;
    while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
    return strprintf("sizes %zu vs %zu, first difference at byte %zu", a.size(), b.size(), i);
}

static void compare_with_reference(const Scenario& s) {
    std::string out = g_tmp + "/ref_" + s.name;
    std::string cmd = g_python + " '" + g_src_dir + "/tests/loader_ref.py' --pattern '" + s.pattern + "' --world " +
                      std::to_string(s.world) + " --accum " + std::to_string(s.accum) + " --max-seq-len " +
                      std::to_string(s.max_seq_len) + " --quickload-tokens " + std::to_string(s.quickload_tokens) +
                      " --steps " + join(s.steps) + " --out '" + out + "'" + (s.aligned ? "" : " --unaligned") +
                      (s.cycle ? " --cycle" : "") + " 2>&1";
    std::string log;
    int rc = run_shell(cmd, &log);
    CHECK(rc == 0, "%s: python reference failed: %s", s.name.c_str(), log.c_str());
    if (rc != 0) return;
    for (int r = 0; r < s.world; ++r) {
        std::string cpp = run_cpp(s, r), py = read_file(out + ".r" + std::to_string(r));
        CHECK(!cpp.empty() && cpp == py, "%s rank %d: C++ loader differs from the Python reference (%s)", s.name.c_str(),
              r, first_difference(cpp, py).c_str());
    }
}

static void test_loader() {
    std::mt19937_64 rng(1234);
    // train: five shards, the first starting inside a document, the fourth too short to fill a batch
    std::string train = make_dir("train");
    const int64_t sizes[] = {90000, 120000, 70000, 900, 110000};
    for (int i = 0; i < 5; ++i)
        write_shard(strprintf("%s/syn_train_%06d.bin", train.c_str(), i + 1),
                    make_tokens(rng, sizes[i], 70, i == 0));
    const std::string pattern = train + "/syn_train_*.bin";

    // the trainer's batch schedule (get_bs), shrunk: 8/16/24 x 1024 x 8 tokens by thirds
    Hyperparameters h;
    h.train_bs_schedule = {8 * 1024, 16 * 1024, 24 * 1024};
    h.train_bs_extension = 24 * 1024;
    h.num_scheduled_iterations = 12;
    h.num_extension_iterations = 3;
    std::vector<int64_t> steps;
    for (int64_t s = 0; s < h.num_iterations(); ++s) steps.push_back(get_bs(h, s));

    for (int world : {1, 2, 4, 8}) {
        Scenario s;
        s.name = "aligned_w" + std::to_string(world);
        s.pattern = pattern;
        s.world = world;
        s.accum = 8 / world;
        s.steps = steps;
        compare_with_reference(s);
    }
    {  // the first shard's quick BOS scan decides where documents crossing its end stop
        Scenario s;
        s.name = "quickload";
        s.pattern = pattern;
        s.world = 2;
        s.accum = 4;
        s.quickload_tokens = 6000;  // the third call runs out of the quick index: the record skips the shard
        s.cycle = true;
        s.steps = steps;
        compare_with_reference(s);
    }
    {  // long documents cut at max_seq_len, larger batches
        Scenario s;
        s.name = "long_docs";
        std::string d = make_dir("long");
        for (int i = 0; i < 3; ++i)
            write_shard(strprintf("%s/long_%d.bin", d.c_str(), i), make_tokens(rng, 250000, 900, false));
        s.pattern = d + "/long_*.bin";
        s.world = 4;
        s.accum = 2;
        s.max_seq_len = 2048;
        s.steps = {65536, 65536, 131072, 131072};
        compare_with_reference(s);
    }
    {  // cycling the files: runs past the end of the data and wraps around
        Scenario s;
        s.name = "cycle";
        s.pattern = pattern;
        s.world = 8;
        s.accum = 1;
        s.cycle = true;
        s.steps = std::vector<int64_t>(24, 24 * 1024);
        compare_with_reference(s);
    }

    // One rank with 8 accumulation steps takes the same documents in the same order as 8 ranks
    // with one: the 8 micro-batches of a step are the 8 ranks' batches. (Within a shard: at a
    // shard's end the record drops the documents of a partial finder call, which spans all ranks,
    // so what is dropped there depends on the world size; the tests above pin that behaviour.)
    {
        std::string one_dir = make_dir("one_shard");
        write_shard(one_dir + "/big.bin", make_tokens(rng, 700000, 70, true));
        Scenario one, eight;
        one.pattern = eight.pattern = one_dir + "/big.bin";
        one.steps = eight.steps = steps;
        one.world = 1, one.accum = 8;
        eight.world = 8, eight.accum = 1;
        std::string a = run_cpp(one, 0);
        std::vector<std::string> ranks;
        for (int r = 0; r < 8; ++r) ranks.push_back(run_cpp(eight, r));
        // re-interleave: rank r's k-th batch is step k's r-th micro-batch
        std::string b;
        std::vector<size_t> off(8, 0);
        for (size_t k = 0; k < steps.size(); ++k)
            for (int r = 0; r < 8; ++r) {
                const int32_t* hdr = (const int32_t*)(ranks[r].data() + off[r]);
                size_t len = 8 + 4 * (2 * (size_t)hdr[0] + (size_t)hdr[1]);
                b.append(ranks[r], off[r], len);
                off[r] += len;
            }
        CHECK(a == b, "1 rank x 8 accumulation steps differs from 8 ranks x 1 (%s)", first_difference(a, b).c_str());
        // and so do 2 ranks x 4 (rank-major within a step)
        Scenario two = one;
        two.world = 2, two.accum = 4;
        std::string r0 = run_cpp(two, 0), r1 = run_cpp(two, 1), c;
        size_t o0 = 0, o1 = 0;
        auto take = [](const std::string& src, size_t& off, std::string& dst) {
            const int32_t* hdr = (const int32_t*)(src.data() + off);
            size_t len = 8 + 4 * (2 * (size_t)hdr[0] + (size_t)hdr[1]);
            dst.append(src, off, len);
            off += len;
        };
        // with 2 ranks, each call of the BOS finder serves rank 0 then rank 1: micro-steps of a step
        // alternate ranks, so step k's micro-batch m of 1x8 is call 4k+m/2 of rank m%2
        for (size_t k = 0; k < steps.size(); ++k)
            for (int m = 0; m < 8; ++m) take(m % 2 == 0 ? r0 : r1, m % 2 == 0 ? o0 : o1, c);
        CHECK(a == c, "1 rank x 8 differs from 2 ranks x 4 (%s)", first_difference(a, c).c_str());
    }

    // Batch contents: inputs/targets shifted by one, cu_seqlens ascending and padded, docs start with BOS.
    {
        Scenario s;
        s.pattern = pattern;
        s.world = 1, s.accum = 1;
        DistributedDataGenerator gen(pattern, {8192, 256, 1}, 0, 1, host_options(s));
        bool ok = true;
        for (int k = 0; k < 20 && ok; ++k) {
            HostBatch& b = gen.next();
            const int32_t* cu = b.cu_seqlens();
            ok &= b.num_tokens == 8192 && b.max_num_docs == 128 && cu[0] == 0;
            for (int64_t d = 0; d < b.num_docs && ok; ++d) {
                ok &= cu[d + 1] >= cu[d] && cu[d + 1] - cu[d] <= 256 && b.inputs()[cu[d]] == BOS_ID;
            }
            for (int64_t d = b.num_docs + 1; d < b.max_num_docs; ++d) ok &= cu[d] == 8192;
            ok &= cu[b.num_docs] == 8192;
        }
        CHECK(ok, "batch invariants (BOS at each document start, cu_seqlens ascending, padding) broken");
    }

    // validation: contiguous unaligned batches, cu_seqlens at the BOS positions, across two files
    std::string val = make_dir("val");
    write_shard(val + "/syn_val_000000.bin", make_tokens(rng, 40000, 70, true));
    write_shard(val + "/syn_val_000001.bin", make_tokens(rng, 33000, 70, false));
    for (int world : {1, 2, 4, 8}) {
        Scenario s;
        s.name = "val_w" + std::to_string(world);
        s.pattern = val + "/syn_val_*.bin";
        s.world = world;
        s.accum = 8 / world;
        s.aligned = false;
        s.max_seq_len = -1;
        s.steps = std::vector<int64_t>(4, 16384);  // 65536 tokens: moves on to the second file
        compare_with_reference(s);
    }
}

// ---------------------------------------------------------------------------------------------
// bad input

static void test_bad_input() {
    std::mt19937_64 rng(99);
    std::string d = make_dir("bad");
    LoaderOptions o;
    o.pinned = false;
    auto loader = [&](const std::string& pattern, int64_t bs = 8192, int world = 1) {
        DistributedDataGenerator gen(pattern, {bs, 256, 1}, 0, world, o);
        for (int i = 0; i < 1000; ++i) gen.next();
    };
    std::vector<uint16_t> good = make_tokens(rng, 20000, 70, false);

    expect_error("missing files", [&] { loader(d + "/nothing_*.bin"); }, {"no files found", "nothing_*.bin"});

    write_shard(d + "/magic.bin", good, 1234);
    expect_error("wrong magic", [&] { loader(d + "/magic.bin"); }, {d + "/magic.bin", "magic number 1234"});

    write_shard(d + "/version.bin", good, SHARD_MAGIC, 7);
    expect_error("wrong version", [&] { loader(d + "/version.bin"); }, {d + "/version.bin", "unsupported version 7"});

    write_shard(d + "/count.bin", good, SHARD_MAGIC, SHARD_VERSION, 20001);
    expect_error("count vs size", [&] { loader(d + "/count.bin"); }, {d + "/count.bin", "20001 tokens"});

    {
        FILE* f = fopen((d + "/tiny.bin").c_str(), "wb");
        fwrite("abc", 1, 3, f);
        fclose(f);
    }
    expect_error("shorter than header", [&] { loader(d + "/tiny.bin"); }, {d + "/tiny.bin", "shorter than its 1024-byte header"});

    std::vector<uint16_t> bad = good;
    bad[12345] = PADDED_VOCAB_SIZE;
    write_shard(d + "/vocab.bin", bad);
    expect_error("token id >= vocab", [&] { loader(d + "/vocab.bin"); }, {d + "/vocab.bin", "token id 50304 at position 12345"});
    bad[12345] = 65535;
    write_shard(d + "/vocab2.bin", bad);
    expect_error("token id 65535", [&] { loader(d + "/vocab2.bin"); }, {"token id 65535"});

    // a bad shard later in the list: read on the preloading thread, reported when reached
    std::string d2 = make_dir("bad_later");
    write_shard(d2 + "/a_1.bin", good);
    write_shard(d2 + "/a_2.bin", good, 77);
    expect_error("bad second shard", [&] { loader(d2 + "/a_*.bin"); }, {d2 + "/a_2.bin", "magic number 77"});

    // the data ends: the last shard cannot fill a batch
    std::string d3 = make_dir("short_end");
    write_shard(d3 + "/b_1.bin", good);
    write_shard(d3 + "/b_2.bin", make_tokens(rng, 5000, 70, false));
    expect_error("data exhausted", [&] { loader(d3 + "/b_*.bin"); }, {"train data exhausted", d3 + "/b_2.bin", "--cycle_data"});
    // one short shard alone
    expect_error("single short shard", [&] { loader(d3 + "/b_2.bin"); }, {"train data exhausted", d3 + "/b_2.bin"});

    // documents too short for the fixed cu_seqlens length
    std::vector<uint16_t> many(20000);
    for (size_t i = 0; i < many.size(); ++i) many[i] = i % 4 == 0 ? BOS_ID : 17;
    write_shard(d + "/many_docs.bin", many);
    expect_error("too many documents", [&] { loader(d + "/many_docs.bin"); }, {"max_num_docs", d + "/many_docs.bin"});

    // validation that runs past its files
    LoaderOptions vo = o;
    vo.align_to_bos = false;
    write_shard(d + "/val_a.bin", good);
    expect_error("validation exhausted",
                 [&] {
                     DistributedDataGenerator gen(d + "/val_a.bin", {8192, -1, 1}, 0, 1, vo);
                     for (int i = 0; i < 10; ++i) gen.next();
                 },
                 {"validation data exhausted", d + "/val_a.bin", "--val_tokens"});

    // a batch size that does not split over ranks and accumulation steps
    expect_error("indivisible batch", [&] { DistributedDataGenerator gen(d3 + "/b_1.bin", {1000, 256, 3}, 0, 1, o); },
                 {"1000 tokens", "3 accumulation steps"});
}

// ---------------------------------------------------------------------------------------------
// configuration

static void parse(Hyperparameters& h, std::vector<std::string> argv) { parse_args(h, argv); }

static void test_config() {
    {
        Hyperparameters h;
        parse(h, {"--val_tokens", "2097152", "--train_bs_schedule=16384,32768", "--cooldown_frac", "0.25",
                  "--cycle_data", "--run_id", "abc-1", "--seed=7"});
        CHECK(h.val_tokens == 2097152, "val_tokens %lld", (long long)h.val_tokens);
        CHECK(h.train_bs_schedule == std::vector<int64_t>({16384, 32768}), "train_bs_schedule");
        CHECK(h.cooldown_frac == 0.25 && h.cycle_data && h.run_id == "abc-1" && h.seed == 7, "parsed values");
        Hyperparameters b;
        parse(b, {"--save_checkpoint", "false", "--cycle_data", "--val_tokens", "4194304"});
        CHECK(!b.save_checkpoint && b.cycle_data && b.val_tokens == 4194304, "bare boolean then a flag");
        Hyperparameters c;
        CHECK(c.gemm_autotune, "GEMM tuning is on by default");
        parse(c, {"--gemm_autotune", "false"});
        CHECK(!c.gemm_autotune, "--gemm_autotune false");
        CHECK(c.gemm_candidates == 8, "eight GEMM candidates by default");
    }
    Hyperparameters base;
    expect_error("unknown flag", [&] { Hyperparameters h; parse(h, {"--learning_rate", "3"}); }, {"unknown flag --learning_rate"});
    expect_error("not an integer", [&] { Hyperparameters h; parse(h, {"--val_tokens", "lots"}); }, {"--val_tokens", "'lots'"});
    expect_error("not a number", [&] { Hyperparameters h; parse(h, {"--adam_lr=fast"}); }, {"--adam_lr", "'fast'"});
    expect_error("missing value", [&] { Hyperparameters h; parse(h, {"--val_tokens"}); }, {"--val_tokens needs a value"});
    expect_error("bad list", [&] { Hyperparameters h; parse(h, {"--ws_schedule", "3,x,11"}); }, {"--ws_schedule", "'x'"});
    expect_error("bad bool", [&] { Hyperparameters h; parse(h, {"--cycle_data", "maybe"}); }, {"--cycle_data", "'maybe'"});
    expect_error("negative seed", [&] { Hyperparameters h; parse(h, {"--seed", "-1"}); }, {"--seed"});
    expect_error("stray argument", [&] { Hyperparameters h; parse(h, {"train.bin"}); }, {"unexpected argument 'train.bin'"});

    for (int w : {1, 2, 4, 8}) {
        bool ok = true;
        try {
            validate_args(base, w);
        } catch (const TrainerError&) {
            ok = false;
        }
        CHECK(ok, "record defaults rejected at world size %d", w);
    }
    for (int w : {3, 5, 6, 16})
        expect_error("world size", [&] { validate_args(base, w); }, {strprintf("world size %d does not divide 8", w)});
    auto bad = [&](const char* what, std::vector<std::string> argv, std::vector<std::string> needles) {
        expect_error(what, [&] { Hyperparameters h; parse(h, argv); validate_args(h, 8); }, needles);
    };
    bad("negative size", {"--train_max_seq_len", "-2048"}, {"--train_max_seq_len must be positive"});
    bad("zero val tokens", {"--val_tokens", "0"}, {"--val_tokens must be positive"});
    bad("batch not divisible", {"--train_bs_schedule", "131072,100000"}, {"--train_bs_schedule", "100000", "16384"});
    bad("extension not divisible", {"--train_bs_extension", "8192"}, {"--train_bs_extension", "8192"});
    bad("val batch not divisible", {"--val_batch_size", "1000000"}, {"--val_batch_size"});
    bad("val tokens vs batch", {"--val_tokens", "3000000"}, {"--val_tokens", "--val_batch_size"});
    bad("negative steps", {"--num_scheduled_iterations", "-5"}, {"--num_scheduled_iterations must be positive"});
    bad("negative extension", {"--num_extension_iterations", "-1"}, {"--num_extension_iterations must not be negative"});
    bad("cooldown", {"--cooldown_frac", "1.5"}, {"--cooldown_frac"});
    bad("window", {"--ws_schedule", "3,0,11"}, {"--ws_schedule must be positive"});
    bad("empty schedule", {"--train_bs_schedule", ""}, {"--train_bs_schedule"});
    bad("lr", {"--adam_lr", "0"}, {"--adam_lr must be positive"});
    bad("no GEMM candidates", {"--gemm_candidates", "0"}, {"--gemm_candidates must be in 1..64, got 0"});
    bad("too many GEMM candidates", {"--gemm_candidates", "65"}, {"--gemm_candidates must be in 1..64, got 65"});
    bad("momentum", {"--momentum_max", "1.0"}, {"--momentum_max"});
    bad("run id", {"--run_id", "../etc"}, {"--run_id"});
    bad("checkpoint interval", {"--checkpoint_every", "-1"}, {"--checkpoint_every must not be negative"});
    bad("profile interval", {"--profile_steps", "-2"}, {"--profile_steps must not be negative"});

    // the logged configuration reads back to the same configuration
    Hyperparameters h;
    parse(h, {"--val_tokens", "2097152", "--split_embed_frac", "0.7", "--ws_schedule", "2,4,8,12", "--cycle_data"});
    std::string cfg = configuration_text(h, 8, "/data", "./train_gpt --val_tokens 2097152");
    std::vector<std::string> argv;
    std::istringstream in(cfg);
    std::string line;
    std::vector<Option> opts = options_of(h);
    while (std::getline(in, line)) {
        size_t eq = line.find(" = ");
        if (eq == std::string::npos) continue;
        std::string name = line.substr(0, eq);
        if (std::any_of(opts.begin(), opts.end(), [&](const Option& o) { return name == o.name; }))
            argv.push_back("--" + name + "=" + line.substr(eq + 3));
    }
    Hyperparameters back;
    parse(back, argv);
    CHECK(configuration_text(back, 8, "/data", "./train_gpt --val_tokens 2097152") == cfg,
          "configuration does not read back to itself");
    CHECK(cfg.find("split_embed_frac = 0.7\n") != std::string::npos && cfg.find("world_size = 8\n") != std::string::npos,
          "configuration text: %s", cfg.c_str());
    Hyperparameters rec;
    std::string rc = configuration_text(rec, 8, ".", "");
    CHECK(rc.find("split_embed_frac = 0.6666666666666666\n") != std::string::npos, "2/3 logged exactly");
    CHECK(rc.find("split_step = 1151\n") != std::string::npos, "split step in the configuration");
    CHECK(rc.find("warmup_steps = 0,1,2,574,575,576,1149,1150,1151,1724,1725,1726\n") != std::string::npos,
          "warmup steps in the configuration");
}

// ---------------------------------------------------------------------------------------------
// schedules

static void test_schedules() {
    Hyperparameters a;  // record 61
    // batch size by thirds of 1725 steps, then the extension
    const std::pair<int64_t, int64_t> bs[] = {{0, 131072},   {574, 131072},  {575, 262144},  {1149, 262144},
                                              {1150, 393216}, {1724, 393216}, {1725, 393216}, {1764, 393216}};
    for (auto [s, v] : bs) CHECK(get_bs(a, s) == v, "get_bs(%lld) = %lld, want %lld", (long long)s, (long long)get_bs(a, s), (long long)v);
    const std::tuple<int64_t, int64_t, int64_t> ws[] = {{0, 1, 3},    {574, 1, 3},   {575, 3, 7},   {1149, 3, 7},
                                                        {1150, 5, 11}, {1724, 5, 11}, {1725, 6, 13}, {1765, 6, 13}};
    for (auto [s, lo, hi] : ws) {
        Windows w = get_ws(a, s);
        CHECK(w.short_ws == lo && w.long_ws == hi, "get_ws(%lld) = (%lld,%lld)", (long long)s, (long long)w.short_ws, (long long)w.long_ws);
    }
    // lr: 1.0 through step 575 (x = 1/3 is not > 1/3), 1.52 after, cooldown from x >= 0.5 (step 863)
    auto near = [](double x, double y) { return std::fabs(x - y) <= 1e-12 * std::max(1.0, std::fabs(y)); };
    const std::pair<int64_t, double> lr[] = {
        {0, 1.0},
        {575, 1.0},
        {576, 1.52},
        {862, 1.52},
        {863, 1.52 * (862.0 / 862.5) + (1 - 862.0 / 862.5) * 0.1},
        {1150, 1.52 * (2.0 / 3) + (1.0 / 3) * 0.1},  // x = 2/3 is not > 2/3
        {1151, 1.73 * (574.0 / 862.5) + (1 - 574.0 / 862.5) * 0.1},
        {1725, 0.1},
        {1726, 0.1},
        {1765, 0.1}};
    for (auto [s, v] : lr) CHECK(near(get_lr(a, s), v), "get_lr(%lld) = %.17g, want %.17g", (long long)s, get_lr(a, s), v);
    const std::pair<int64_t, double> mom[] = {{0, 0.85}, {150, 0.90}, {299, 0.85 + 299.0 / 300 * 0.1}, {300, 0.95},
                                              {1715, 0.95}, {1716, 0.95 - 0.1 / 50}, {1765, 0.85}};
    for (auto [s, v] : mom) CHECK(near(get_muon_momentum(a, s), v), "momentum(%lld) = %.17g", (long long)s, get_muon_momentum(a, s));
    // MTP weights: 3 weights before x = 1/3, 2 before 2/3, then 1
    CHECK(get_mtp_weights(a, 0) == std::vector<float>({1.0f, 0.5f, 0.25f}), "mtp(0)");
    CHECK(get_mtp_weights(a, 574).size() == 3 && get_mtp_weights(a, 574)[2] == (float)(0.25 * (1 - 3 * (574.0 / 1725))), "mtp(574)");
    CHECK(get_mtp_weights(a, 575) == std::vector<float>({1.0f, 0.5f}), "mtp(575): x = 1/3 starts the second phase");
    CHECK(get_mtp_weights(a, 1149).size() == 2 && get_mtp_weights(a, 1149)[1] == (float)(0.5 * (1 - (3 * (1149.0 / 1725) - 1))), "mtp(1149)");
    CHECK(get_mtp_weights(a, 1150) == std::vector<float>({1.0f}), "mtp(1150)");
    CHECK(get_mtp_weights(a, 1765) == std::vector<float>({1.0f}), "mtp(1765)");
    CHECK(!is_adam_step(0) && is_adam_step(1) && !is_adam_step(1150) && is_adam_step(1151), "Adam on odd steps");
    CHECK(get_split_step(a) == 1151, "split step %lld", (long long)get_split_step(a));
    CHECK(get_transition_steps(a) == std::vector<int64_t>({575, 1150, 1725}), "transition steps");
    CHECK(get_warmup_steps(a) == std::vector<int64_t>({0, 1, 2, 574, 575, 576, 1149, 1150, 1151, 1724, 1725, 1726}), "warmup steps");

    // YaRN: initial frequencies, and the attention scale after each window change
    YarnState y = yarn_reset(a);
    CHECK(y.angular_freq.size() == 128 && y.angular_freq[0] == 1.0f && y.angular_freq[1] == 1.0f &&
              std::fabs(y.angular_freq[62] - 1.0f / 1024) < 1e-9f && y.angular_freq[64] == 0.0f && y.attn_scale == 0.1,
          "yarn reset");
    double scale = 0.1;
    for (auto [o, n] : {std::pair<int, int>{3, 7}, {7, 11}, {11, 13}}) {
        yarn_apply(a, y, o, n);
        scale *= 0.2 * std::log((double)n / o) + 1;
        CHECK(near(y.attn_scale, scale), "attn_scale after %d->%d", o, n);
    }

    // every step against the Python reference of the record's formulas
    std::string text;
    int rc = run_shell(g_python + " '" + g_src_dir + "/tests/loader_ref.py' --schedules 2>&1", &text);
    CHECK(rc == 0, "schedule reference failed: %s", text.c_str());
    if (rc != 0) return;
    std::istringstream in(text);
    std::string line;
    int64_t mismatches = 0, rows = 0;
    YarnState yy = yarn_reset(a);
    int64_t ws_long = get_ws(a, 0).long_ws;
    std::vector<int64_t> trans = get_transition_steps(a);
    size_t yarn_row = 0;
    while (std::getline(in, line)) {
        std::istringstream ls(line);
        std::string head;
        ls >> head;
        if (head == "split") {
            int64_t v;
            ls >> v;
            CHECK(v == get_split_step(a), "split step vs reference %lld", (long long)v);
        } else if (head == "transitions" || head == "warmup") {
            std::vector<int64_t> v;
            int64_t x;
            while (ls >> x) v.push_back(x);
            CHECK(v == (head == "transitions" ? get_transition_steps(a) : get_warmup_steps(a)), "%s vs reference", head.c_str());
        } else if (head == "yarn") {
            if (yarn_row > 0) {
                int64_t w = get_ws(a, trans[yarn_row - 1]).long_ws;
                yarn_apply(a, yy, ws_long, w);
                ws_long = w;
            }
            double sc;
            ls >> sc;
            bool ok = near(yy.attn_scale, sc);
            for (int k = 0; k < 128; ++k) {
                double f;
                ls >> f;
                ok &= std::fabs(yy.angular_freq[k] - f) <= 2e-6 * std::fabs(f) + 1e-12;
            }
            CHECK(ok, "yarn state after %zu window changes differs from the reference", yarn_row);
            ++yarn_row;
        } else {
            int64_t s = std::stoll(head), b, lo, hi, adam;
            double lrv, mv;
            ls >> b >> lo >> hi >> lrv >> mv >> adam;
            std::vector<float> mtp;
            double w;
            while (ls >> w) mtp.push_back((float)w);
            Windows ww = get_ws(a, s);
            bool ok = b == get_bs(a, s) && lo == ww.short_ws && hi == ww.long_ws && lrv == get_lr(a, s) &&
                      mv == get_muon_momentum(a, s) && (adam == 1) == is_adam_step(s) && mtp == get_mtp_weights(a, s);
            if (!ok && mismatches++ < 5) printf("FAIL schedule of step %lld differs from the reference: %s\n", (long long)s, line.c_str());
            ++rows;
        }
    }
    CHECK(rows == a.num_iterations() + 1 && mismatches == 0, "%lld of %lld steps differ from the reference",
          (long long)mismatches, (long long)rows);
    CHECK(yarn_row == trans.size() + 1, "yarn rows %zu", yarn_row);
}

// ---------------------------------------------------------------------------------------------
// the optimizer's parameter table and sharding

// What the layer table implies, counted here from LAYERS' rows (not from the trainer's derived
// constants, which the tests check against it): the layers with attention and with a value
// embedding, and the bank slots, each padded only as far as sharding its matrices (4 a slot in the
// attention bank, 2 in the MLP bank) evenly over 8 ranks needs
struct TableCounts {
    int attn = 0, ve = 0;
    int64_t attn_slots = 0, mlp_slots = 0;
};
static TableCounts table_counts() {
    TableCounts c;
    for (const LayerSpec& l : LAYERS) c.attn += l.attn != AttnKind::None, c.ve += l.ve >= 0;
    auto padded = [](int64_t n, int64_t per_slot) {
        while (n * per_slot % 8) ++n;
        return n;
    };
    c.attn_slots = padded(c.attn, 4), c.mlp_slots = padded(NUM_LAYERS, 2);
    return c;
}
// the scalars: 3 per layer (resid, sa x 2), smear, backout, skip, padded with ones to a multiple of the world size
static int64_t scalar_count(int world) { return (3 * NUM_LAYERS + 3 + world - 1) / world * world; }

static void test_sharding() {
    Hyperparameters a;
    const TableCounts tc = table_counts();
    const int64_t attn_mats = 4 * tc.attn_slots, mlp_mats = 2 * tc.mlp_slots;
    for (int world : {1, 2, 4, 8}) {
        std::vector<ParamShape> params = model_params(world);
        const ParamShape& sc = params[2];
        const int64_t want_scalars = scalar_count(world);
        CHECK(sc.label == "scalars" && sc.fp32 && sc.shape == std::vector<int64_t>{want_scalars},
              "scalars at world %d: %lld", world, (long long)sc.shape[0]);
        int64_t total = 0;
        for (const ParamShape& p : params) total += p.numel();
        // the banks, ve0-ve2 + lm_head + embed, scalars, smear and skip gates, the gate banks, x0 lambdas (exact count)
        const int64_t expect = attn_mats * 768 * 768 + mlp_mats * 3072 * 768 + 5LL * 50304 * 768 + want_scalars + 12 + 12 +
                               tc.attn * 6 * 12 + tc.ve * 6 * 12 + NUM_LAYERS;
        CHECK(total == expect, "parameter count at world %d: %lld, want %lld", world, (long long)total, (long long)expect);
        for (int rank = 0; rank < world; ++rank) {
            std::vector<ParamConfig> cfgs = build_param_configs(a, params, world, rank);
            auto cfg = [&](const std::string& label) -> const ParamConfig& { return config_of(cfgs, label, "test_sharding"); };
            CHECK(cfgs.size() == 13, "13 parameters");
            for (const ParamConfig& c : cfgs) {
                const ParamShape& ps = *std::find_if(params.begin(), params.end(), [&](const ParamShape& p) { return p.label == c.label; });
                const bool sharded = table_entry(c.label).comms == Comms::Sharded;
                CHECK(c.comms == (world == 1 ? Comms::None : table_entry(c.label).comms), "%s comms at world %d", c.label.c_str(), world);
                // the shards of all ranks tile the parameter exactly
                CHECK(c.chunk_numel() * (sharded ? world : 1) == ps.numel(), "%s: %lld x %d ranks != %lld", c.label.c_str(),
                      (long long)c.chunk_numel(), world, (long long)ps.numel());
            }
            const ParamConfig& attn = cfg("attn");
            const ParamConfig& mlp = cfg("mlp");
            CHECK(attn.chunk_shape == (std::vector<int64_t>{attn_mats / world, 768, 768}) && attn.lr_mul == 1.0 &&
                      attn.second_moment_shape == (std::vector<int64_t>{attn_mats / world, 768, 1}) &&
                      attn.per_matrix_lr_mul.empty(),
                  "attn shard at world %d", world);
            CHECK(mlp.chunk_shape == (std::vector<int64_t>{mlp_mats / world, 3072, 768}) && mlp.lr_mul == 2.0 &&
                      mlp.second_moment_shape == (std::vector<int64_t>{mlp_mats / world, 3072, 1}),
                  "mlp shard at world %d: shape multiplier sqrt(3072/768) = 2", world);
            bool cproj = (int64_t)mlp.per_matrix_lr_mul.size() == mlp_mats / world;
            for (int64_t i = 0; i < (int64_t)mlp.per_matrix_lr_mul.size(); ++i)
                cproj &= mlp.per_matrix_lr_mul[i] == ((rank * (mlp_mats / world) + i) % 2 ? 2.0 : 1.0);
            CHECK(cproj, "mlp per-matrix lr (2x on c_proj = odd global index) at world %d rank %d", world, rank);
            CHECK(cfg("ve1").chunk_shape == (std::vector<int64_t>{50304 / world, 768}), "ve shard");
            CHECK(cfg("lm_head").chunk_shape == (std::vector<int64_t>{768 / world, 50304}), "lm_head shard");
            CHECK(cfg("embed").chunk_shape == (std::vector<int64_t>{50304 / world, 768}), "embed shard");
            CHECK(cfg("scalars").chunk_shape == (std::vector<int64_t>{want_scalars}), "scalars replicated");
            const ParamConfig& ve = cfg("ve0");
            CHECK(ve.beta1 == 0.75 && ve.beta2 == 0.95 && ve.lr_mul == 75.0 && ve.wd_mul == 5.0 && ve.initial_lr == 0.008 &&
                      ve.eps == 1e-10 && ve.weight_decay == 0.005,
                  "ve0 Adam settings");
            CHECK(attn.initial_lr == 0.023 && attn.weight_decay == 1.2 && attn.momentum == 0.95 && attn.normuon_beta2 == 0.95,
                  "NorMuon settings");
        }
    }
    // a world size the attention bank (the first parameter) cannot be sharded over
    int bad_world = 3;
    while (attn_mats % bad_world == 0) ++bad_world;
    expect_error("unshardable world size", [&] { build_param_configs(a, model_params(bad_world), bad_world, 0); },
                 {"'attn'", strprintf("%d ranks", bad_world)});
    std::vector<ParamShape> extra = model_params(2);
    extra.push_back({"mystery", {4}, {}, true});
    expect_error("unknown parameter", [&] { build_param_configs(a, extra, 2, 0); }, {"'mystery' has no entry in param_table"});
    std::vector<ParamShape> missing = model_params(2);
    missing.pop_back();
    expect_error("parameter without table entry", [&] { build_param_configs(a, missing, 2, 0); }, {"'embed' matches no parameter"});
    // scatter order is the table's (as the record's list(param_table.keys())); work order names each
    // label once, lm_head before embed, banks last
    std::vector<std::string> wo(std::begin(work_order), std::end(work_order));
    std::vector<std::string> so(std::begin(scatter_order), std::end(scatter_order)), table;
    for (const ParamTableEntry& e : param_table) table.push_back(e.label);
    CHECK(so == table, "scatter_order is param_table's order");
    for (const ParamTableEntry& e : param_table)
        CHECK(e.optim == Optim::Adam || (e.beta1 == 0 && e.beta2 == 0 && e.lr_mul == 1 && e.wd_mul == 1),
              "NorMuon row %s", e.label);
    std::vector<std::string> a1 = wo, a2 = so;
    std::sort(a1.begin(), a1.end()), std::sort(a2.begin(), a2.end());
    CHECK(a1 == a2 && std::unique(a1.begin(), a1.end()) == a1.end(), "work_order and scatter_order hold the same labels once");
    auto at = [&](const char* l) { return std::find(wo.begin(), wo.end(), l) - wo.begin(); };
    CHECK(at("lm_head") < at("embed") && at("attn") >= 11 && at("mlp") >= 11, "work order: lm_head before embed, banks last");
}

// the optimizer step's explicit order (record 61's three phases)
static void test_step_plan() {
    Hyperparameters a;
    const std::vector<ParamConfig> w8 = build_param_configs(a, model_params(8), 8, 0), w1 = build_param_configs(a, model_params(1), 1, 0);
    const std::string small = "update(scalars) update(smear_gate) update(skip_gate) update(attn_gate_bank) "
                              "update(ve_gate_bank) update(x0_lambdas)";
    const std::string ve = "update(ve0) all_gather(ve0) update(ve1) all_gather(ve1) update(ve2) all_gather(ve2)";
    const std::string reduces = "reduce_scatter(attn) reduce_scatter(mlp) all_reduce(scalars) reduce_scatter(ve0) "
                                "reduce_scatter(ve1) reduce_scatter(ve2) all_reduce(smear_gate) all_reduce(skip_gate) "
                                "all_reduce(attn_gate_bank) all_reduce(ve_gate_bank) all_reduce(x0_lambdas)";
    const std::string banks = "update(attn) all_gather(attn) update(mlp) all_gather(mlp)";
    const std::pair<std::string, std::string> cases[] = {
        {plan_text(step_plan(w8, true, false)),
         reduces + " add_transposed(embed->lm_head) reduce_scatter(lm_head) " + small + " " + ve +
             " update(lm_head) all_gather(lm_head) " + banks + " copy_transposed(lm_head->embed)"},
        {plan_text(step_plan(w8, true, true)),
         reduces + " reduce_scatter(lm_head) reduce_scatter(embed) " + small + " " + ve +
             " update(lm_head) all_gather(lm_head) update(embed) all_gather(embed) " + banks},
        {plan_text(step_plan(w8, false, false)), "reduce_scatter(attn) reduce_scatter(mlp) " + banks},
        {plan_text(step_plan(w8, false, true)), "reduce_scatter(attn) reduce_scatter(mlp) " + banks},
        {plan_text(step_plan(w1, true, false)),
         "add_transposed(embed->lm_head) " + small + " update(ve0) update(ve1) update(ve2) update(lm_head) update(attn) "
         "update(mlp) copy_transposed(lm_head->embed)"},
        {plan_text(step_plan(w1, false, true)), "update(attn) update(mlp)"},
    };
    for (const auto& [got, want] : cases) CHECK(got == want, "step plan:\n  got  %s\n  want %s", got.c_str(), want.c_str());
    std::string cfg = configuration_text(a, 8, ".", "");
    CHECK(cfg.find("step_plan[adam,tied] = reduce_scatter(attn)") != std::string::npos, "step plans in the log");
}

// ---------------------------------------------------------------------------------------------
// attention's tile bookkeeping (host-callable, the kernels' own functions): the backward's dK/dV
// pass stores each (key tile, query tile) pair's dS^T where the dQ pass reads it

// tk::poly_exp2 (the cross-entropy loss's exponentials on the FMA pipe) against exp2 over its range,
// at random points and at the integers and half-integers where its rounding to j changes
static void test_poly_exp2() {
    std::mt19937_64 rng(31);
    std::uniform_real_distribution<float> u(-125.f, 125.f);
    double worst = 0;
    float at = 0;
    auto check = [&](float x) {
        const double e = std::fabs((double)tk::poly_exp2(x) / std::exp2((double)x) - 1);
        if (!(e <= worst)) worst = e, at = x;
    };
    for (int i = 0; i < 1000000; ++i) check(u(rng));
    for (int j = -125; j <= 125; ++j)
        for (float d : {-0.5f, 0.f, 0.5f}) {
            const float x = j + d;
            check(x), check(std::nextafter(x, -INFINITY)), check(std::nextafter(x, INFINITY));
        }
    CHECK(worst < 3e-6, "poly_exp2: relative error %.2e at x = %.9g (its polynomial's bound is 2.7e-6)", worst, at);
}

static void test_attention_tiles() {
    std::mt19937_64 rng(23);
    const int windows[] = {1, 63, 64, 65, 130, 384, 1408, 1664, 100000};
    const int lens[] = {0, 1, 2, 63, 64, 65, 127, 128, 129, 300, 450, 900, 2048};
    for (int trial = 0; trial < 36; ++trial) {
        const int mult = trial % 2 ? 2 : 1, window = windows[trial % 9];
        std::vector<int> cu = {0};
        const int total = 1000 + (int)(rng() % 4000);
        while (cu.back() < total) cu.push_back(cu.back() + lens[rng() % 13]);
        for (int pad = (int)(rng() % 4); pad > 0; --pad) cu.push_back(cu.back());  // padded as the loader pads
        attn::Params p{};
        p.positions = cu.back() * mult, p.cu_len = (int)cu.size(), p.cu_mult = mult, p.window = window;
        p.ds_slots = attn::ds_slots(p.positions, window);
        const int mt = attn::max_tiles(p.positions, p.cu_len);
        auto key = [](int64_t a, int64_t b) { return a * 4000000 + b; };
        std::unordered_set<int64_t> written, dkdv_pairs, dq_pairs;
        bool bounds = true, unique = true, read_written = true, covered = true;
        for (int s = 0; s + 1 < p.cu_len; ++s) {  // the dK/dV pass: key tiles, the query tiles that see them
            const int a = cu[s] * mult, e = cu[s + 1] * mult;
            for (int k0 = a; k0 < e; k0 += attn::BLOCK)
                for (int nb = 0; nb < attn::query_blocks(p, e, k0); ++nb) {
                    bounds &= nb < p.ds_slots && k0 / attn::BLOCK + s < mt;
                    unique &= written.insert(attn::ds_index(p, 0, k0, s, nb)).second;
                    dkdv_pairs.insert(key(k0, k0 + nb * attn::BLOCK));
                }
        }
        bounds &= attn::ds_index(p, 1, 0, 0, 0) >= (int64_t)mt * p.ds_slots;  // heads do not overlap
        for (int s = 0; s + 1 < p.cu_len; ++s) {  // the dQ pass: query tiles, the key tiles they see
            const int a = cu[s] * mult, e = cu[s + 1] * mult;
            for (int q0 = a; q0 < e; q0 += attn::BLOCK) {
                int kb, n;
                attn::key_blocks(p, a, e, q0, kb, n);
                for (int nb = 0; nb < n; ++nb) {
                    const int k0 = kb + nb * attn::BLOCK;
                    read_written &= (q0 - k0) % attn::BLOCK == 0 && q0 >= k0 &&
                                    written.count(attn::ds_index(p, 0, k0, s, (q0 - k0) / attn::BLOCK));
                    dq_pairs.insert(key(k0, q0));
                }
            }
            for (int i = a; i < e; ++i) {  // every visible (query, key) lies in a pair both passes visit
                const int q0 = a + (i - a) / attn::BLOCK * attn::BLOCK, j_lo = std::max(a, i - window);
                for (int k0 = a + (j_lo - a) / attn::BLOCK * attn::BLOCK; k0 <= i; k0 += attn::BLOCK)
                    covered &= dkdv_pairs.count(key(k0, q0)) && dq_pairs.count(key(k0, q0));
            }
        }
        const std::string what = strprintf("%d positions, %d sequences, window %d", p.positions, p.cu_len - 1, window);
        CHECK(bounds, "%s: a slot past ds_slots, an id past max_tiles, or heads overlapping", what.c_str());
        CHECK(unique, "%s: two tile pairs share a dS^T tile", what.c_str());
        CHECK(read_written, "%s: the dQ pass reads a dS^T tile the dK/dV pass did not write", what.c_str());
        CHECK(covered, "%s: a visible (query, key) pair outside the tiles a pass visits", what.c_str());
    }
}

// ---------------------------------------------------------------------------------------------
// the layer table: whatever layout LAYERS, SKIP_IN, SKIP_OUT and BACKOUT_LAYER hold, the bank
// slots, the banks and the log's layer map follow from it

static void test_layer_table() {
    const TableCounts tc = table_counts();
    // bank slots count the layers before that use the bank (the record's layer_to_attn_idx and its
    // ve-gate list), and the derived counts are the table's
    bool slots = true;
    for (int i = 0, a = 0, v = 0; i < NUM_LAYERS; ++i) {
        if (LAYERS[i].attn != AttnKind::None) slots &= has_attention(i) && attn_slot(i) == a++;
        else slots &= !has_attention(i) && !paired_head(i);
        if (LAYERS[i].ve >= 0) slots &= has_value_embed(i) && ve_gate_slot(i) == v++;
        else slots &= !has_value_embed(i);
    }
    CHECK(slots, "bank slots count the layers before that use the bank");
    CHECK(NUM_ATTN_LAYERS == tc.attn && NUM_VE_LAYERS == tc.ve, "%d attention layers (table: %d), %d ve layers (table: %d)",
          NUM_ATTN_LAYERS, tc.attn, NUM_VE_LAYERS, tc.ve);
    // the banks hold a slot for each layer that uses them, padded only as far as sharding needs
    for (int world : {1, 2, 4, 8}) {
        std::vector<ParamShape> params = model_params(world);
        auto param = [&](const char* l) {
            return *std::find_if(params.begin(), params.end(), [&](const ParamShape& p) { return p.label == l; });
        };
        CHECK(param("attn").shape == (std::vector<int64_t>{tc.attn_slots, 4 * 768, 768}) &&
                  param("attn").reshape == (std::vector<int64_t>{4 * tc.attn_slots, 768, 768}),
              "attention bank at world %d: %lld slots for %d layers", world, (long long)param("attn").shape[0], tc.attn);
        CHECK(param("attn_gate_bank").shape == (std::vector<int64_t>{tc.attn, 6, 12}), "attention-gate bank at world %d",
              world);
        CHECK(param("ve_gate_bank").shape == (std::vector<int64_t>{tc.ve, 6, 12}),
              "ve-gate bank at world %d: %lld slots for %d layers", world, (long long)param("ve_gate_bank").shape[0], tc.ve);
        CHECK(param("mlp").shape == (std::vector<int64_t>{tc.mlp_slots, 2, 4 * 768, 768}) &&
                  param("mlp").reshape == (std::vector<int64_t>{2 * tc.mlp_slots, 4 * 768, 768}),
              "MLP bank at world %d: %lld slots for %d layers", world, (long long)param("mlp").shape[0], NUM_LAYERS);
        CHECK(param("x0_lambdas").shape == (std::vector<int64_t>{NUM_LAYERS}), "x0 lambdas: one per layer");
        CHECK(param("scalars").shape == (std::vector<int64_t>{scalar_count(world)}), "scalars at world %d", world);
    }
    // the log's layer map, skip and backout, spelled out from the table's rows
    std::string layers;
    for (int i = 0, a = 0, v = 0; i < NUM_LAYERS; ++i) {
        const LayerSpec& l = LAYERS[i];
        layers += strprintf("%s%d:", i ? " " : "", i);
        if (l.attn == AttnKind::None) layers += "no-attn";
        else
            layers += strprintf("%sattn[bank %d%s]", l.attn == AttnKind::Paired ? "paired-" : "", a++,
                                l.long_window ? ",long,key-offset" : "");
        if (l.ve >= 0) layers += strprintf("+ve%d[gate %d]", l.ve, v++);
        layers += "+mlp";
    }
    const std::string map =
        "layers = " + layers + strprintf("\nskip = %d->%d\nbackout_layer = %d\n", SKIP_IN, SKIP_OUT, BACKOUT_LAYER);
    Hyperparameters a;
    const std::string cfg = configuration_text(a, 1, ".", "");
    CHECK(cfg.find(map) != std::string::npos, "layer map in the configuration:\n%s\nwant:\n%s", cfg.c_str(), map.c_str());
    // what the configuration block says of the schedule, the warmup and the step plan, for the
    // shortened textmix schedule (150 + 10 steps) at world size 2
    Hyperparameters s;
    parse_args(s, {"--num_scheduled_iterations", "150", "--num_extension_iterations", "10"});
    const std::string sc = configuration_text(s, 2, ".", "");
    for (const char* line :
         {"num_iterations = 160\nsplit_step = 101\ntransition_steps = 50,100,150\n"
          "warmup_steps = 0,1,2,49,50,51,99,100,101,149,150,151\n"
          "yarn_attn_scales = 0.1,0.11694595720774409,0.12751752379570258,0.1317779884389435\n",
          "step_plan[no-adam,tied] = reduce_scatter(attn) reduce_scatter(mlp) update(attn) all_gather(attn) update(mlp) "
          "all_gather(mlp)\n",
          "step_plan[adam,untied] = reduce_scatter(attn) reduce_scatter(mlp) all_reduce(scalars) reduce_scatter(ve0) "
          "reduce_scatter(ve1) reduce_scatter(ve2) all_reduce(smear_gate) all_reduce(skip_gate) all_reduce(attn_gate_bank) "
          "all_reduce(ve_gate_bank) all_reduce(x0_lambdas) reduce_scatter(lm_head) reduce_scatter(embed) update(scalars) "
          "update(smear_gate) update(skip_gate) update(attn_gate_bank) update(ve_gate_bank) update(x0_lambdas) update(ve0) "
          "all_gather(ve0) update(ve1) all_gather(ve1) update(ve2) all_gather(ve2) update(lm_head) all_gather(lm_head) "
          "update(embed) all_gather(embed) update(attn) all_gather(attn) update(mlp) all_gather(mlp)\n"})
        CHECK(sc.find(line) != std::string::npos, "configuration lacks:\n%s\nin:\n%s", line, sc.c_str());
}

// the reduces that start inside the backward: every bank matrix of every layer once, to its owner,
// layers from the last to the first, the untied lm_head after the head on Adam steps
static void test_backward_reduce_plan() {
    Hyperparameters a;
    const TableCounts tc = table_counts();
    const int64_t attn_mats = 4 * tc.attn_slots, mlp_mats = 2 * tc.mlp_slots;
    CHECK(backward_reduce_plan(build_param_configs(a, model_params(1), 1, 0), 1, true, true).empty(),
          "world size 1: no reduces (no NCCL at all)");
    for (int world : {2, 4, 8})
        for (bool adam : {false, true})
            for (bool split : {false, true}) {
                const std::vector<ParamConfig> cfgs = build_param_configs(a, model_params(world), world, 0);
                const std::vector<BackwardReduce> plan = backward_reduce_plan(cfgs, world, adam, split);
                std::map<std::string, std::vector<int>> seen = {{"attn", std::vector<int>(attn_mats, 0)},
                                                                {"mlp", std::vector<int>(mlp_mats, 0)}};
                bool owners = true, order = true, head = false;
                int last_layer = NUM_LAYERS;
                for (size_t i = 0; i < plan.size(); ++i) {
                    const BackwardReduce& r = plan[i];
                    if (r.when == ReducePoint::AfterHead) {
                        head = r.label == "lm_head" && r.root < 0 && i == 0;
                        continue;
                    }
                    order &= r.layer <= last_layer;
                    last_layer = r.layer;
                    const int64_t chunk = (r.label == "attn" ? attn_mats : mlp_mats) / world;
                    for (int64_t m = r.first; m < r.first + r.count; ++m) {
                        seen[r.label][m] += 1;
                        owners &= m / chunk == r.root;
                    }
                    // the layer's own matrices
                    owners &= r.label == "mlp" ? r.first >= 2 * r.layer && r.first + r.count <= 2 * r.layer + 2
                                               : r.first >= 4 * attn_slot(r.layer) && r.first + r.count <= 4 * attn_slot(r.layer) + 4;
                }
                bool once = true;
                // not the padding slots
                for (int m = 0; m < attn_mats; ++m) once &= seen["attn"][m] == (m < 4 * tc.attn ? 1 : 0);
                for (int m = 0; m < mlp_mats; ++m) once &= seen["mlp"][m] == (m < 2 * NUM_LAYERS ? 1 : 0);
                CHECK(once && owners && order && head == (adam && split),
                      "world %d %s %s: once %d owners %d order %d head %d", world, adam ? "adam" : "no-adam",
                      split ? "untied" : "tied", (int)once, (int)owners, (int)order, (int)head);
            }
    // the last layer's reduces as the log shows them (for the record at world size 8:
    // "after_layer(10): reduce(mlp[20:21]->6) reduce(mlp[21:22]->7) reduce(attn[36:40]->7)"), one
    // reduce per owner of the layer's matrices
    auto last_layer = [&](int world) {
        auto runs = [&](const char* label, int64_t first, int64_t n, int64_t chunk) {
            std::string s;
            for (int64_t m = first; m < first + n; m = (m / chunk + 1) * chunk)
                s += strprintf(" reduce(%s[%lld:%lld]->%lld)", label, (long long)m,
                               (long long)std::min(first + n, (m / chunk + 1) * chunk), (long long)(m / chunk));
            return s;
        };
        const int L = NUM_LAYERS - 1;
        return strprintf("after_layer(%d):", L) + runs("mlp", 2 * L, 2, mlp_mats / world) +
               (LAYERS[L].attn != AttnKind::None ? runs("attn", 4 * (tc.attn - 1), 4, attn_mats / world) : "");
    };
    const std::vector<ParamConfig> w8 = build_param_configs(a, model_params(8), 8, 0);
    const std::string text = backward_reduce_text(backward_reduce_plan(w8, 8, true, true));
    const std::string want8 =
        "after_head: reduce_scatter(lm_head) " + last_layer(8) + strprintf(" after_layer(%d):", NUM_LAYERS - 2);
    CHECK(text.rfind(want8, 0) == 0, "the plan as the log shows it: %s\nwant it to start: %s", text.c_str(), want8.c_str());
    a.early_reduce = true;
    const std::string cfg = configuration_text(a, 2, ".", "");
    CHECK(cfg.find("backward_reduce_plan[no-adam,tied] = " + last_layer(2)) != std::string::npos,
          "the plans in the configuration block: %s", last_layer(2).c_str());
    a.early_reduce = false;
    CHECK(configuration_text(a, 2, ".", "").find("backward_reduce_plan[adam,untied] = off\n") != std::string::npos,
          "off unless --early_reduce");
}

// ---------------------------------------------------------------------------------------------
// parameter initialisation

static void test_init() {
    std::vector<ParamShape> shapes = model_params(8);
    auto shape_of = [&](const std::string& l) {
        return *std::find_if(shapes.begin(), shapes.end(), [&](const ParamShape& p) { return p.label == l; });
    };
    HostParam sc = init_param(shape_of("scalars"), 1);
    std::vector<float> want;
    for (int i = 0; i < NUM_LAYERS; ++i) want.push_back(1.1f);
    for (int i = 0; i < NUM_LAYERS; ++i) want.push_back(0.5f), want.push_back(1.0f);
    for (float v : {0.f, 0.5f, -1.5f}) want.push_back(v);
    want.resize(scalar_count(8), 1.f);
    CHECK(sc.fp32 == want, "scalars: resid 1.1, sa (0.5, 1), smear 0, backout 0.5, skip -1.5, padding ones");
    CHECK(init_param(shape_of("x0_lambdas"), 1).fp32 == std::vector<float>(NUM_LAYERS, 0.f), "x0 lambdas zero");
    for (const char* zero : {"ve0", "ve1", "ve2", "smear_gate", "skip_gate", "attn_gate_bank", "ve_gate_bank"}) {
        HostParam z = init_param(shape_of(zero), 1);
        CHECK(std::all_of(z.bf16.begin(), z.bf16.end(), [](uint16_t b) { return b == 0; }), "%s starts at zero", zero);
    }
    // a weight region: within the bound, mean ~0, variance ~bound^2/3; or all zero
    auto region = [](const HostParam& hp, int64_t begin, int64_t count, double bound) {
        double s = 0, ss = 0, mx = 0;
        for (int64_t i = begin; i < begin + count; ++i) {
            double v = bf16_to_float(hp.bf16[i]);
            s += v, ss += v * v, mx = std::max(mx, std::fabs(v));
        }
        const double mean = s / count, var = ss / count - mean * mean;
        if (bound == 0) return mx == 0;
        return mx <= bound * (1 + 1.0 / 128) && std::fabs(mean) < 0.01 * bound && std::fabs(var / (bound * bound / 3) - 1) < 0.01;
    };
    const int64_t mat = 768LL * 768;
    const double b = std::sqrt(3.0) / std::sqrt(768.0);
    HostParam attn = init_param(shape_of("attn"), 1);
    bool ok = true;
    const TableCounts tc = table_counts();
    for (int l = 0; l < tc.attn_slots; ++l)
        ok &= region(attn, l * 4 * mat, 3 * mat, b) && region(attn, l * 4 * mat + 3 * mat, mat, 0);
    CHECK(ok, "attn bank: QKV rows uniform +-sqrt(3/768), O rows zero");
    HostParam mlp = init_param(shape_of("mlp"), 1);
    ok = true;
    for (int l = 0; l < tc.mlp_slots; ++l)
        ok &= region(mlp, l * 8 * mat, 4 * mat, b / 2) && region(mlp, l * 8 * mat + 4 * mat, 4 * mat, 0);
    CHECK(ok, "mlp bank: c_fc uniform +-sqrt(3/768)/2, c_proj zero (the padding slot too)");
    HostParam lm = init_param(shape_of("lm_head"), 1);
    double ss = 0;
    for (uint16_t v : lm.bf16) ss += (double)bf16_to_float(v) * bf16_to_float(v);
    const double sd = std::sqrt(ss / lm.bf16.size());
    CHECK(std::fabs(sd / 0.005 - 1) < 0.01, "lm_head std %.6f, want 0.005", sd);
    HostParam em = init_param(shape_of("embed"), 1, &lm);
    ok = true;
    for (int64_t v = 0; v < 50304; v += 97)
        for (int64_t d = 0; d < 768; ++d) ok &= em.bf16[v * 768 + d] == lm.bf16[d * 50304 + v];
    CHECK(ok, "embed starts as lm_head^T");
    expect_error("embed before lm_head", [&] { init_param(shape_of("embed"), 1); }, {"lm_head"});
    CHECK(init_param(shape_of("lm_head"), 1).bf16 == lm.bf16, "the same seed gives the same weights");
    CHECK(init_param(shape_of("lm_head"), 2).bf16 != lm.bf16, "another seed gives other weights");
    CHECK(init_param(shape_of("ve_gate_bank"), 2).bf16 == init_param(shape_of("ve_gate_bank"), 1).bf16, "zeros whatever the seed");
}

// ---------------------------------------------------------------------------------------------
// checkpoints, reruns: the file format and its refusals, the logged configuration read back, the
// data stream's position

static void test_checkpoint_format() {
    const std::string dir = make_dir("ckpt"), path = dir + "/c.bin";
    std::mt19937_64 rng(5);
    std::string big(1 << 20, '\0');
    for (char& c : big) c = (char)(rng() & 0xff);
    const std::vector<std::pair<std::string, std::string>> blobs = {
        {"config", "a = 1\nb = 2\n"}, {"param/x", big}, {"rank0/data", "file 0 x\n"}, {"odd", std::string(13, 'z')}};
    write_checkpoint_file(path, 2, 70, "00000000000cafe0", "0000000000beef00", blobs);
    CHECK(access((path + ".tmp").c_str(), F_OK) != 0, "the temporary file is renamed away");
    const CheckpointHeader h = read_checkpoint_header(path);
    CHECK(h.world_size == 2 && h.step == 70 && h.config_hash == "00000000000cafe0" && h.source_hash == "0000000000beef00" &&
              h.blobs.size() == 4,
          "header read back");
    std::map<std::string, BlobSpec> expected = {
        {"config", {100, true}}, {"param/x", {big.size(), false}}, {"rank0/data", {100, true}}, {"odd", {13, false}}};
    std::map<std::string, std::string> got = read_checkpoint_blobs(path, h, expected, {}, true);
    bool same = got.size() == 4;
    for (const auto& [name, bytes] : blobs) same = same && got[name] == bytes;
    CHECK(same, "blobs read back byte for byte");
    CHECK(read_checkpoint_blobs(path, h, expected, {"odd"}, true).size() == 1, "only the wanted blobs are kept");
    const std::string good = read_file(path);
    auto with = [&](const std::string& text) {
        write_file(path, text);
        return path;
    };
    // refusals: each names what is wrong, before any blob is used
    expect_error("truncated", [&] { read_checkpoint_header(with(good.substr(0, good.size() - 100))); }, {"truncated"});
    expect_error("not a checkpoint", [&] { read_checkpoint_header(with("hello\n" + good)); }, {"not a train_gpt checkpoint"});
    std::string v3 = good;
    v3.replace(v3.find("checkpoint 2"), 12, "checkpoint 3");
    expect_error("other version", [&] { read_checkpoint_header(with(v3)); }, {"format version 3", "reads version 2"});
    std::string flipped = good;
    flipped[good.size() - 500] ^= 1;
    expect_error("corrupt", [&] {
        with(flipped);
        read_checkpoint_blobs(path, read_checkpoint_header(path), expected, {}, true);
    }, {"checksum"});
    with(good);
    auto expect_refused = [&](const char* what, std::map<std::string, BlobSpec> e, std::vector<std::string> needles) {
        expect_error(what, [&] { read_checkpoint_blobs(path, h, e, {}, true); }, needles);
    };
    std::map<std::string, BlobSpec> other = expected;
    other["param/x"].bytes += 2;
    expect_refused("other shape", other, {"'param/x' holds 1048576 bytes", "other model shape"});
    other = expected;
    other.erase("odd");
    expect_refused("unknown blob", other, {"'odd'", "does not have"});
    other = expected;
    other["rank1/data"] = {100, true};
    expect_refused("missing blob (other world size)", other, {"lacks 'rank1/data'"});
    other = expected;
    other["config"].bytes = 4;
    expect_refused("text too large", other, {"'config' holds", "at most 4"});
    // a hostile header: sizes far past the file are refused by the size check, never allocated
    std::string hostile = good;
    hostile.replace(hostile.find("blob param/x 1048576"), 20, "blob param/x 9999999999");
    expect_error("hostile size", [&] { read_checkpoint_header(with(hostile)); }, {"the header says"});
    std::string huge = good;
    huge.replace(huge.find("blob param/x 1048576"), 20, "blob param/x 99999999999");
    expect_error("size beyond the limit", [&] { read_checkpoint_header(with(huge)); }, {"not a size up to"});
    std::string junk = good;
    junk.replace(junk.find("step 70"), 7, "stop 70");
    expect_error("unknown header line", [&] { read_checkpoint_header(with(junk)); }, {"header line 3 is unknown"});
    expect_error("unwritable", [&] { write_checkpoint_file(dir + "/no/such/dir/c.bin", 1, 1, "000000000000000a", "000000000000000b", blobs); },
                 {"cannot write", "c.bin.tmp"});
    CHECK(access((dir + "/no/such/dir/c.bin.tmp").c_str(), F_OK) != 0, "no temporary file left behind");
}

static void test_logged_configuration() {
    Hyperparameters h;
    parse_args(h, {"--val_tokens", "2097152", "--ws_schedule", "2,4,8", "--cycle_data", "--run_id", "r1", "--seed", "9"});
    const std::string text = configuration_text(h, 2, "/data", "./train_gpt --seed 9");
    const std::string block = text.substr(16, text.size() - 16 - 20);  // without the marker lines
    LoggedRun run = parse_logged_configuration(block, "L", 10);
    CHECK(run.world_size == 2 && run.data_path == "/data" && run.args.seed == 9 && run.args.cycle_data &&
              run.args.ws_schedule == std::vector<int64_t>({2, 4, 8}) && run.args.run_id.empty(),
          "a logged configuration reads back (not its run id)");
    check_logged_configuration(block, "L", 10, run);  // as logged: accepted
    ++g_passed;
    auto edited = [&](const std::string& from, const std::string& to) {
        std::string b = block;
        b.replace(b.find(from), from.size(), to);
        return b;
    };
    expect_error("edited derived line", [&] {
        std::string b = edited("split_step = ", "split_step = 1");
        LoggedRun r = parse_logged_configuration(b, "L", 10);
        check_logged_configuration(b, "L", 10, r);
    }, {"L line", "split_step = 1", "edited log"});
    const int seed_line = 10 + (int)std::count(block.begin(), block.begin() + block.find("seed = "), '\n');
    expect_error("bad value", [&] { parse_logged_configuration(edited("seed = 9", "seed = nine"), "L", 10); },
                 {strprintf("L line %d", seed_line), "--seed"});
    expect_error("not key = value", [&] { parse_logged_configuration(edited("seed = 9", "seed: 9"), "L", 10); },
                 {strprintf("L line %d is not 'key = value'", seed_line)});
    expect_error("missing flag", [&] { parse_logged_configuration(edited("seed = 9\n", ""), "L", 10); }, {"no 'seed'"});
    expect_error("twice", [&] { parse_logged_configuration(block + "seed = 3\n", "L", 10); }, {"'seed' appears twice"});
}

static void test_data_position() {
    std::mt19937_64 rng(77);
    const std::string d = make_dir("position");
    for (int i = 0; i < 3; ++i)
        write_shard(strprintf("%s/p_%d.bin", d.c_str(), i), make_tokens(rng, 60000 + 10000 * i, 70, i == 0));
    const std::string pattern = d + "/p_*.bin";
    LoaderOptions o;
    o.pinned = false, o.cycle = true, o.quickload_tokens = 20000;
    for (int world : {1, 4}) {
        for (int cut : {2, 9, 40}) {  // inside the first shard's quick scan, after it, after a shard change and a cycle
            DistributedDataGenerator a(pattern, {8192, 512, 8 / world}, world - 1, world, o);
            for (int i = 0; i < cut; ++i) a.next();
            const std::string pos = a.position();
            std::string rest_a, rest_b;
            for (int i = 0; i < 30; ++i) dump_batch(rest_a, a.next());
            DistributedDataGenerator b(pattern, {4096, 512, 8 / world}, world - 1, world, o);
            b.seek(parse_data_position(pos));
            for (int i = 0; i < 30; ++i) dump_batch(rest_b, b.next());
            CHECK(rest_a == rest_b, "world %d: the stream after seek(position()) at micro-batch %d continues exactly", world, cut);
        }
    }
    DistributedDataGenerator g(pattern, {8192, 512, 8}, 0, 1, o);
    const std::string pos = g.position();
    expect_error("position from another file list", [&] {
        std::string p = pos;
        p.replace(p.find("p_0.bin"), 7, "q_0.bin");
        g.seek(parse_data_position(p));
    }, {"not in this run's file list"});
    expect_error("position out of range", [&] {
        std::string p = pos;
        p.replace(p.find("bos 0"), 5, "bos 99999999");
        g.seek(parse_data_position(p));
    }, {"out of range"});
}

// ---------------------------------------------------------------------------------------------
// self-logging

static void test_logging() {
    const std::string src = read_file(g_src_dir + "/train_gpt.cu"), kern = read_file(g_src_dir + "/triton_kernels.cu");
    CHECK(embedded_train_gpt() == src, "embedded train_gpt.cu differs from the file (%zu vs %zu bytes)",
          embedded_train_gpt().size(), src.size());
    CHECK(embedded_triton_kernels() == kern, "embedded triton_kernels.cu differs from the file");
    if (!g_binary.empty()) {
        std::string out;
        int rc = run_shell("'" + g_binary + "' --print-source", &out);
        const std::string want = src + "\n\n" + std::string(40, '-') + "\n# triton_kernels.cu\n" + std::string(40, '-') + "\n\n" + kern + "\n";
        CHECK(rc == 0 && out == want, "%s --print-source does not print the sources it was built from", g_binary.c_str());
    }

    // a log in the records' layout splits back into its sources and configuration
    Hyperparameters h;
    auto make_log = [&](const std::string& path, const std::string& train_src, const Hyperparameters& cfg) {
        std::string text = train_src + "\n\n" + SOURCE_RULE + "\n# triton_kernels.cu\n" + SOURCE_RULE + "\n\n" + kern + "\n" +
                           LOG_RULE + "\nRunning CUDA runtime 13.0\n" + configuration_text(const_cast<Hyperparameters&>(cfg), 8, ".", "cmd") +
                           "nvidia-smi output\n" + LOG_RULE + "\nstep:0/1765 val_loss:10.8258 train_time:0ms step_avg:0.03ms\n";
        write_file(path, text);
    };
    std::string la = g_tmp + "/a.txt", lb = g_tmp + "/b.txt", lc = g_tmp + "/c.txt";
    make_log(la, src, h);
    LogParts p = split_log(la);
    CHECK(p.train_gpt == src && p.triton_kernels == kern, "split_log sources");
    CHECK(p.configuration.find("val_tokens = 10485760\n") != std::string::npos, "split_log configuration");
    std::string changed = src;
    size_t at = changed.find("X(F64, adam_lr, 0.008,");
    CHECK(at != std::string::npos, "adam_lr default line");
    if (at != std::string::npos) changed.replace(at, 22, "X(F64, adam_lr, 0.009,");
    Hyperparameters h2;
    h2.val_tokens = 2097152;
    make_log(lb, changed, h2);
    make_log(lc, src, h);
    expect_error("not a log", [&] { split_log(g_src_dir + "/Makefile"); }, {"is not a train_gpt log"});
    if (!g_binary.empty()) {
        std::string out;
        int rc = run_shell("'" + g_binary + "' --diff-logs '" + la + "' '" + lb + "'", &out);
        CHECK(rc == 1 && out.find("-    X(F64, adam_lr, 0.008,") != std::string::npos &&
                  out.find("+    X(F64, adam_lr, 0.009,") != std::string::npos &&
                  out.find("-val_tokens = 10485760") != std::string::npos && out.find("+val_tokens = 2097152") != std::string::npos,
              "--diff-logs of two different runs (exit %d):\n%s", rc, out.c_str());
        rc = run_shell("'" + g_binary + "' --diff-logs '" + la + "' '" + lc + "'", &out);
        CHECK(rc == 0 && out.find("code: same sources\nconfiguration: same") == 0 &&
                  out.size() >= 31 && out.substr(out.size() - 31) == "same sources and configuration\n",
              "--diff-logs of two equal runs (exit %d): %s", rc, out.c_str());
        rc = run_shell("'" + g_binary + "' --diff-logs '" + la + "' /nonexistent.txt 2>&1", &out);
        CHECK(rc == 2 && out.find("cannot open log /nonexistent.txt") != std::string::npos, "--diff-logs of a missing log: %s", out.c_str());
        rc = run_shell("'" + g_binary + "' --diff-logs '" + la + "' '" + g_src_dir + "/Makefile' 2>&1", &out);
        CHECK(rc == 2 && out.find("is not a train_gpt log") != std::string::npos, "--diff-logs of a file that is not a log: %s", out.c_str());
        // two runs of the same code and configuration but their run ids: the same
        Hyperparameters h3 = h;
        h3.run_id = "another-run";
        const std::string ld = g_tmp + "/d.txt";
        make_log(ld, src, h3);
        rc = run_shell("'" + g_binary + "' --diff-logs '" + la + "' '" + ld + "'", &out);
        CHECK(rc == 0 && out.find("run_id") == std::string::npos, "--diff-logs ignores the run id (exit %d): %s", rc, out.c_str());
        rc = run_shell("'" + g_binary + "' --diff-logs '" + la + "' '" + lb + "'", &out);
        CHECK(out.find("code: differs (train_gpt.cu)") != std::string::npos &&
                  out.find("configuration: 1 keys differ\n  val_tokens: 10485760 -> 2097152") != std::string::npos &&
                  out.find("0            10.8258        10.8258") != std::string::npos,
              "--diff-logs summary: %s", out.c_str());
        rc = run_shell("'" + g_binary + "' --val_tokens 2>&1 </dev/null", &out);
        CHECK(rc != 0 && out.find("--val_tokens needs a value") != std::string::npos, "trainer rejects a bad flag: %s", out.c_str());
    }
    CHECK(make_uuid4().size() == 36 && make_uuid4()[14] == '4' && make_uuid4() != make_uuid4(), "uuid4");
    // a write to the log that fails (a full disk) is kept, for the run to stop on
    g_logfile = fopen("/dev/full", "w");
    print0("a step line");
    CHECK(g_log_error.find("No space left on device") != std::string::npos, "a failed log write: '%s'", g_log_error.c_str());
    fclose(g_logfile), g_logfile = nullptr, g_log_error.clear();
    if (!g_binary.empty()) {  // --diff-logs removes its temporary files when diff cannot run
        std::string before, after, out;
        run_shell("ls -d /tmp/train_gpt_diff_* 2>/dev/null", &before);
        const int rc = run_shell("PATH=/nonexistent '" + g_binary + "' --diff-logs '" + la + "' '" + lb + "' 2>&1", &out);
        run_shell("ls -d /tmp/train_gpt_diff_* 2>/dev/null", &after);
        CHECK(rc == 2 && out.find("cannot run diff") != std::string::npos && before == after,
              "--diff-logs without diff: exit %d, %s, temporary folders before '%s' after '%s'", rc, out.c_str(),
              before.c_str(), after.c_str());
    }
}

// ---------------------------------------------------------------------------------------------
// hostile inputs: each refused by the trainer itself before any GPU work, in one line naming the
// input and the rule, with exit status 1 (2 for --diff-logs), promptly (a FIFO, /dev/zero), and
// without a log written. The same through --check, which needs no GPU. Checkpoints here are small
// (the header, the configuration and the trainer state): what they break is refused before the
// blobs' sizes are compared with the model's; tests/test_resume.sh breaks real ones on a GPU.

static void test_hostile_inputs() {
    if (g_binary.empty()) return;
    const std::string dir = make_dir("hostile"), data = make_dir("hostile_data");
    std::mt19937_64 rng(11);
    write_shard(data + "/h_train_000001.bin", make_tokens(rng, 300000, 70, true));
    write_shard(data + "/h_val_000000.bin", make_tokens(rng, 300000, 70, false));
    Hyperparameters h;
    h.train_files = data + "/h_train_*.bin", h.val_files = data + "/h_val_*.bin";
    const std::string files = " --train_files '" + h.train_files + "' --val_files '" + h.val_files + "'";
    auto logs_written = [&] { return access((dir + "/logs").c_str(), F_OK) == 0; };
    // runs the binary in `dir`: the exit status and one "error: ..." line holding every needle
    auto refused = [&](const std::string& what, const std::string& args, std::vector<std::string> needles, int want = 1,
                       const std::string& env = "") {
        for (const char* mode : {"", "--check "}) {
            if (want == 2 && *mode) continue;  // --diff-logs is a command of its own
            std::string out;
            const auto t0 = std::chrono::steady_clock::now();
            const int rc = run_shell("cd '" + dir + "' && " + env + " timeout 30 '" + g_binary + "' " + mode + args +
                                     " 2>&1 </dev/null", &out);
            const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            bool ok = rc == want && std::count(out.begin(), out.end(), '\n') == 1 && out.rfind("error: ", 0) == 0;
            for (const std::string& n : needles) ok = ok && out.find(n) != std::string::npos;
            CHECK(ok && !logs_written() && s < 20, "%s%s: exit %d after %.1f s (want %d, one line with %s; logs/ %s): %s",
                  mode, what.c_str(), rc, s, want, needles.empty() ? "-" : needles[0].c_str(),
                  logs_written() ? "written" : "absent", out.c_str());
        }
    };
    // flags: ranges checked before any product of them is formed, integers read strictly
    refused("huge sequence length", "--train_max_seq_len 2305843009213693952" + files, {"--train_max_seq_len must be in 1..524288"});
    refused("huge step count", "--num_scheduled_iterations 9223372036854775807" + files, {"--num_scheduled_iterations must be in"});
    refused("huge extension", "--num_extension_iterations 1099511627777" + files, {"--num_extension_iterations must be in"});
    refused("huge block size", "--block_size 4611686018427387904" + files, {"--block_size must be in"});
    refused("huge YaRN alpha", "--yarn_alpha 9223372036854775806" + files, {"--yarn_alpha must be in"});
    refused("huge window", "--ws_schedule 999999999999" + files, {"--ws_schedule must be in 1..8192"});
    refused("shrinking window", "--ws_schedule 4000 --ws_final 3" + files, {"attention scale", "e^5"});
    refused("negative seed", "--seed ' -1'" + files, {"--seed: ' -1' is not an unsigned integer"});
    refused("plus sign", "--seed +5" + files, {"--seed: '+5'"});
    refused("leading space", "--val_tokens ' 2097152'" + files, {"--val_tokens: ' 2097152' is not an integer"});
    refused("hex", "--val_tokens 0x200000" + files, {"--val_tokens: '0x200000'"});
    refused("nan", "--adam_lr nan" + files, {"--adam_lr: 'nan' is not a finite number"});
    for (const char* id : {"..", ".", "...", ".hidden"}) refused(strprintf("run id %s", id), strprintf("--run_id %s", id) + files, {"must not start with '.'"});
    refused("long run id", "--run_id " + std::string(200, 'a') + files, {"--run_id", "200 characters: at most 63"});
    refused("run id with a slash", "--run_id a/b" + files, {"--run_id 'a/b' may hold only"});
    refused("DATA_PATH with a newline", files, {"DATA_PATH"}, 1, "DATA_PATH=\"$(printf 'a\\nb')\"");
    // data shards: every header before the GPU
    write_shard(data + "/bad_magic_val.bin", make_tokens(rng, 1000, 70, false), 1234);
    refused("shard magic", "--train_files '" + h.train_files + "' --val_files '" + data + "/bad_magic_val.bin'", {"magic number 1234"});
    write_file(data + "/short_val.bin", "abc");
    refused("short shard", "--train_files '" + h.train_files + "' --val_files '" + data + "/short_val.bin'", {"shorter than its 1024-byte header"});
    mkfifo((data + "/fifo_val.bin").c_str(), 0644);
    refused("FIFO shard", "--train_files '" + h.train_files + "' --val_files '" + data + "/fifo_val.bin'", {"not a regular file (a FIFO)"});

    // logs: regular files under a size and a line cap, their configuration checked before it is used
    const std::string src = read_file(g_src_dir + "/train_gpt.cu"), kern = read_file(g_src_dir + "/triton_kernels.cu");
    auto block_of = [](const std::string& cfg) { return cfg.substr(16, cfg.size() - 16 - 20); };
    const std::string plan = "gemm_plan_for = some GPU\ngemm 1x2x3 = " + std::string(128, '0') + " (note)\n";
    auto log_with = [&](const std::string& name, const std::string& block, const std::string& gemm_plan) {
        const std::string path = dir + "/" + name;
        write_file(path, src + "\n\n" + SOURCE_RULE + "\n# triton_kernels.cu\n" + SOURCE_RULE + "\n\n" + kern + "\n" + LOG_RULE +
                             "\nversions\n# configuration\n" + block + "# end configuration\nnvidia-smi\n" + LOG_RULE +
                             "\n# gemm plan\n" + gemm_plan + "# end gemm plan\n");
        return path;
    };
    const std::string good_block = block_of(configuration_text(h, 1, ".", "./train_gpt"));
    auto edited = [](std::string b, const std::string& from, const std::string& to) {
        const size_t at = b.find(from);
        CHECK(at != std::string::npos, "'%s' in the configuration", from.c_str());
        if (at != std::string::npos) b.replace(at, from.size(), to);
        return b;
    };
    const std::string good_log = log_with("good.txt", good_block, plan);
    {
        std::string out;
        const int rc = run_shell("cd '" + dir + "' && '" + g_binary + "' --check --rerun good.txt 2>&1", &out);
        CHECK(rc == 0 && out.find("# configuration\n") != std::string::npos && out.find("step_plan[adam,tied] = ") != std::string::npos &&
                  out.find("check: ") != std::string::npos && !logs_written(),
              "--check --rerun of a good log (exit %d): %s", rc, out.substr(0, 2000).c_str());
        const int rc2 = run_shell("cd '" + dir + "' && TRAIN_GPT_WORLD_SIZE=4 '" + g_binary + "' --check" + files + " 2>&1", &out);
        CHECK(rc2 == 0 && out.find("world_size = 4\n") != std::string::npos && out.find("a run on 4 ranks") != std::string::npos,
              "--check with flags at world size 4 (exit %d): %s", rc2, out.substr(0, 2000).c_str());
    }
    refused("rerun of a huge sequence length",
            "--rerun " + log_with("seq.txt", edited(good_block, "train_max_seq_len = 2048", "train_max_seq_len = 2305843009213693952"), plan),
            {"seq.txt", "--train_max_seq_len must be in"});
    refused("rerun of a huge extension",
            "--rerun " + log_with("ext.txt", edited(good_block, "num_extension_iterations = 40", "num_extension_iterations = 1099511627777"), plan),
            {"ext.txt", "--num_extension_iterations must be in"});
    refused("rerun of a cut world size",
            "--rerun " + log_with("ws.txt", edited(good_block, "world_size = 1\n", "world_size = 4294967297\n"), plan),
            {"ws.txt", "world_size 4294967297 is not 1, 2, 4 or 8"});
    refused("rerun of an edited split step",
            "--rerun " + log_with("split.txt", edited(good_block, "split_step = 1151", "split_step = 7"), plan),
            {"split.txt", "split_step = 7", "edited log"});
    refused("rerun of a bad GEMM plan", "--rerun " + log_with("plan.txt", good_block, "gemm_plan_for = x\ngemm 1x2 = zz (a)\n"),
            {"plan.txt", "GEMM plan line 1"});
    refused("rerun of /dev/zero", "--rerun /dev/zero", {"log /dev/zero is not a regular file (a device)"});
    refused("rerun of a FIFO", "--rerun '" + data + "/fifo_val.bin'", {"is not a regular file (a FIFO)"});
    refused("rerun of a folder", "--rerun '" + data + "'", {"is not a regular file (a folder)"});
    write_file(dir + "/long_line.txt", std::string(2 << 20, 'x') + "\n");
    refused("a 2 MiB line", "--rerun long_line.txt", {"long_line.txt: line 1 is longer than"});
    write_file(dir + "/huge.txt", "");
    CHECK(truncate((dir + "/huge.txt").c_str(), 300ll << 20) == 0, "a sparse 300 MB file");
    refused("a 300 MB log", "--rerun huge.txt", {"huge.txt is 314572800 bytes, more than a log may have"});
    refused("diff-logs of /dev/zero", "--diff-logs '" + good_log + "' /dev/zero", {"/dev/zero is not a regular file"}, 2);
    refused("diff-logs of a FIFO", "--diff-logs '" + data + "/fifo_val.bin' '" + good_log + "'", {"(a FIFO)"}, 2);
    refused("diff-logs of one log", "--diff-logs '" + good_log + "'", {"usage: ./train_gpt --diff-logs"}, 2);
    // an existing log is never overwritten
    mkdir((dir + "/logs").c_str(), 0755);
    write_file(dir + "/logs/taken.txt", "an earlier run's log\n");
    {
        std::string out;
        const int rc = run_shell("cd '" + dir + "' && '" + g_binary + "' --run_id taken" + files + " 2>&1 </dev/null", &out);
        CHECK(rc == 1 && out.find("logs/taken.txt exists: a run never overwrites a log") != std::string::npos &&
                  read_file(dir + "/logs/taken.txt") == "an earlier run's log\n",
              "a run id whose log exists (exit %d): %s", rc, out.c_str());
    }
    run_shell("rm -rf '" + dir + "/logs'");

    // checkpoints: the header, then the configuration (its hash, the checks a log's gets), all before the GPU
    auto checkpoint = [&](const std::string& name, const std::string& block, const std::string& header_edit_from = "",
                          const std::string& header_edit_to = "", const std::string& hash = "") {
        const std::string path = dir + "/" + name;
        write_checkpoint_file(path, 1, 12, hash.empty() ? hash_text(block) : hash, hash_text(source_block()),
                              {{"config", block}, {"gemm_plan", plan}, {"trainer", "steps_done 12\ntraining_time_ms 0x1p+10\n"}});
        if (!header_edit_from.empty()) {
            std::string text = read_file(path);
            const size_t at = text.find(header_edit_from);
            CHECK(at != std::string::npos && at < 1000, "'%s' in the header", header_edit_from.c_str());
            if (at != std::string::npos) write_file(path, text.replace(at, header_edit_from.size(), header_edit_to));
        }
        return path;
    };
    refused("checkpoint /dev/zero", "--resume /dev/zero", {"checkpoint /dev/zero is not a regular file (a device)"});
    refused("checkpoint world size 0", "--resume " + checkpoint("ws0.bin", good_block, "world_size 1\n", "world_size 0\n"),
            {"ws0.bin", "world size 0 (a run has 1, 2, 4 or 8 ranks)"});
    refused("checkpoint world size 2^32+1", "--resume " + checkpoint("ws32.bin", good_block, "world_size 1\n", "world_size 4294967297\n"),
            {"ws32.bin", "'4294967297' is not a size up to 8"});
    refused("checkpoint field twice", "--resume " + checkpoint("twice.bin", good_block, "step 12\n", "step 12\nstep 12\n"),
            {"twice.bin", "'step' appears twice"});
    refused("checkpoint config hash", "--resume " + checkpoint("hash.bin", good_block, "", "", "0123456789abcdef"),
            {"hash.bin", "config_hash"});
    refused("checkpoint edited split step", "--resume " + checkpoint("split.bin", edited(good_block, "split_step = 1151", "split_step = 7")),
            {"split.bin", "split_step = 7", "edited log"});
    refused("checkpoint cut world size",
            "--resume " + checkpoint("cut.bin", edited(good_block, "world_size = 1\n", "world_size = 4294967297\n")),
            {"cut.bin", "world_size 4294967297 is not 1, 2, 4 or 8"});
    refused("checkpoint of a huge sequence length",
            "--resume " + checkpoint("seq.bin", edited(good_block, "train_max_seq_len = 2048", "train_max_seq_len = 2305843009213693952")),
            {"seq.bin", "--train_max_seq_len must be in"});
    refused("checkpoint of another model", "--resume " + checkpoint("small.bin", good_block), {"small.bin", "lacks 'optimizer' (other model, world size or format?)"});
    write_file(dir + "/big.bin", "");
    CHECK(truncate((dir + "/big.bin").c_str(), 70ll << 30) == 0, "a sparse 70 GiB file");
    refused("a 70 GiB checkpoint", "--resume big.bin", {"more than a checkpoint may have"});
}

// the state texts of a checkpoint, bounded by what the configuration allocates
static void test_checkpoint_states() {
    Hyperparameters a;
    const std::string trainer = "steps_done 12\ntraining_time_ms 0x1.8p+3\n";
    CHECK(parse_trainer_state(trainer, "T").steps_done == 12 && parse_trainer_state(trainer, "T").training_time_ms == 12.0,
          "trainer state read back");
    expect_error("trainer: negative clock", [&] { parse_trainer_state("steps_done 12\ntraining_time_ms -0x1p+3\n", "T"); }, {"T: the trainer blob"});
    expect_error("trainer: junk", [&] { parse_trainer_state("steps_done 12 13\ntraining_time_ms 0\n", "T"); }, {"T: the trainer blob"});
    std::string sched = "windows 1 3\nbatch_size 131072\nattn_scale 0x1.999999999999ap-4\nyarn";
    for (int i = 0; i < HEAD_DIM; ++i) sched += " 0x1p-1";
    sched += "\nmtp 0x1p+0 0x1p-1\n";
    const ScheduleState st = parse_schedule_state(sched, a);
    CHECK(st.ws_long == 3 && st.batch_size == 131072 && st.mtp_weights.size() == 2 && st.yarn.angular_freq.size() == HEAD_DIM,
          "schedule state read back");
    auto sched_with = [&](const std::string& from, const std::string& to) {
        std::string t = sched;
        return t.replace(t.find(from), from.size(), to);
    };
    expect_error("schedule: batch size of no phase", [&] { parse_schedule_state(sched_with("131072", "1048576"), a); },
                 {"batch size 1048576 is not one of this configuration's"});
    expect_error("schedule: huge window", [&] { parse_schedule_state(sched_with("windows 1 3", "windows 1 99999999999"), a); }, {"windows"});
    expect_error("schedule: negative scale", [&] { parse_schedule_state(sched_with("attn_scale 0x1", "attn_scale -0x1"), a); }, {"not positive"});
    expect_error("schedule: nan", [&] { parse_schedule_state(sched_with("mtp 0x1p+0", "mtp nan"), a); }, {"not a finite number"});
    const std::vector<ParamConfig> cfgs = build_param_configs(a, model_params(2), 2, 0);
    std::string opt = "split 1\n";
    for (const ParamConfig& c : cfgs)
        if (c.optim == Optim::Adam) opt += "adam_steps " + c.label + " 6\n";
    CHECK(parse_optimizer_state(opt, cfgs, 12).split && parse_optimizer_state(opt, cfgs, 12).adam_steps.at("embed") == 6,
          "optimizer state read back");
    expect_error("optimizer: more steps than done", [&] { parse_optimizer_state(opt, cfgs, 5); }, {"has taken 6 steps of 5"});
    expect_error("optimizer: twice", [&] { parse_optimizer_state(opt + "adam_steps embed 6\n", cfgs, 12); }, {"'embed' appears twice"});
    expect_error("optimizer: a NorMuon bank", [&] { parse_optimizer_state(opt + "adam_steps mlp 6\n", cfgs, 12); }, {"'mlp' is not an Adam parameter"});
    expect_error("optimizer: missing", [&] { parse_optimizer_state("split 0\n", cfgs, 12); }, {"Adam step counts"});
    const std::vector<std::string> files = {"d/a.bin", "d/b.bin"};
    const DataPosition p = parse_data_position("file 1 d/b.bin\nbos 10\nbatch_iter 3\nquick -1 5\nbatch 16384 2048\n");
    check_data_position(p, files, 100, 2, 8192);
    ++g_passed;
    expect_error("position: batch past the buffers", [&] {
        check_data_position(parse_data_position("file 1 d/b.bin\nbos 10\nbatch_iter 3\nquick -1 5\nbatch 1048576 2048\n"), files, 100, 1, 49152);
    }, {"a batch of 1048576 tokens over 1 ranks is not one this run's buffers hold"});
    expect_error("position: BOS past the shard", [&] { check_data_position(p, files, 9, 2, 8192); }, {"BOS 10", "out of range"});
    expect_error("position: other file", [&] { check_data_position(p, {"d/a.bin"}, 100, 2, 8192); }, {"not in this run's file list"});
    expect_error("position: extra line", [&] { parse_data_position("file 1 d/b.bin\nbos 10\nbatch_iter 3\nquick -1 5\nbatch 16384 2048\nx\n"); }, {"not 5 lines"});
    expect_error("position: negative", [&] { parse_data_position("file 1 d/b.bin\nbos -10\nbatch_iter 3\nquick -1 5\nbatch 16384 2048\n"); }, {"negative"});
}

// ---------------------------------------------------------------------------------------------
// benchmark: time to build one batch (not a test: prints numbers only)

// "synthetic": three FineWeb-size shards (100M tokens each) written to a temporary folder
static int bench_data(std::string pattern) {
    if (pattern == "synthetic") {
        std::mt19937_64 rng(3);
        std::string d = make_dir("bench");
        for (int i = 0; i < 3; ++i)
            write_shard(strprintf("%s/fineweb_train_%06d.bin", d.c_str(), i + 1), make_tokens(rng, 100000000, 450, false));
        pattern = d + "/fineweb_train_*.bin";
    }
    int ngpu = 0;
    const bool pinned = cudaGetDeviceCount(&ngpu) == cudaSuccess && ngpu > 0;
    cudaGetLastError();  // clear the no-device error where there is no GPU
    for (int gap_ms : {0, 20}) {
        LoaderOptions o;
        o.pinned = pinned;
        o.cycle = true;
        o.capacity_tokens = 393216;
        // one rank building a whole 393,216-token step as one micro-batch: the most per call
        DistributedDataGenerator gen(pattern, {393216, 2048, 1}, 0, 1, o);
        std::vector<double> ms;
        std::string file = gen.current_file();
        std::vector<double> switch_ms;
        const int batches = pattern.find("fineweb") != std::string::npos ? 1000 : 120;
        for (int i = 0; i < batches; ++i) {
            if (gap_ms) std::this_thread::sleep_for(std::chrono::milliseconds(gap_ms));  // the GPU's step
            auto t0 = std::chrono::steady_clock::now();
            gen.next();
            double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
            if (i == 0) continue;  // first touch of the buffers
            if (gen.current_file() != file) {
                switch_ms.push_back(t);
                file = gen.current_file();
            } else ms.push_back(t);
        }
        std::sort(ms.begin(), ms.end());
        std::sort(switch_ms.begin(), switch_ms.end());
        double mean = 0;
        for (double t : ms) mean += t / ms.size();
        printf("batch of 393216 tokens (%s host buffers, %2d ms between batches): median %.3f ms, mean %.3f ms, p99 %.3f ms, "
               "max %.3f ms; at the %zu shard changes: median %.3f ms, max %.3f ms\n",
               pinned ? "pinned" : "pageable", gap_ms, ms[ms.size() / 2], mean, ms[ms.size() * 99 / 100], ms.back(),
               switch_ms.size(), switch_ms.empty() ? 0.0 : switch_ms[switch_ms.size() / 2],
               switch_ms.empty() ? 0.0 : switch_ms.back());
    }
    return 0;
}

// `--dump-loader PATTERN WORLD STEPS OUT [unaligned]`: every rank's micro-batches for the given
// tokens-per-step list, in loader_ref.py's format (OUT.r<rank>), for comparisons with other loaders
static int dump_loader(const std::vector<std::string>& a) {
    Scenario s;
    s.pattern = a[0];
    s.world = std::stoi(a[1]);
    s.accum = 8 / s.world;
    for (const std::string& x : split(a[2], ',')) s.steps.push_back(std::stoll(x));
    s.aligned = !(a.size() > 4 && a[4] == "unaligned");
    s.max_seq_len = s.aligned ? 2048 : -1;
    for (int r = 0; r < s.world; ++r) write_file(a[3] + ".r" + std::to_string(r), run_cpp(s, r));
    return 0;
}

// `--rewrite-checkpoint IN OUT NAME TEXT`: IN with blob NAME's bytes replaced by TEXT and a checksum
// that matches (anyone can recompute it), for tests/test_resume.sh's crafted checkpoints
static int rewrite_checkpoint(const std::vector<std::string>& a) {
    const CheckpointHeader h = read_checkpoint_header(a[0]);
    std::map<std::string, BlobSpec> any;
    for (const auto& [name, bytes] : h.blobs) any[name] = {bytes, false};
    std::map<std::string, std::string> blobs = read_checkpoint_blobs(a[0], h, any, {}, true);
    if (!blobs.count(a[2])) fail(a[0] + " has no blob " + a[2]);
    blobs[a[2]] = a[3];
    std::vector<std::pair<std::string, std::string>> ordered;
    for (const auto& [name, bytes] : h.blobs) ordered.push_back({name, std::move(blobs[name])});
    write_checkpoint_file(a[1], h.world_size, h.step, h.config_hash, h.source_hash, ordered);
    return 0;
}

int main(int argc, char** argv) {
    std::vector<std::string> cli(argv + 1, argv + argc);
    if (cli.size() >= 5 && cli[0] == "--dump-loader") return dump_loader(std::vector<std::string>(cli.begin() + 1, cli.end()));
    if (cli.size() == 5 && cli[0] == "--rewrite-checkpoint") {
        try {
            return rewrite_checkpoint(std::vector<std::string>(cli.begin() + 1, cli.end()));
        } catch (const TrainerError& e) {
            fprintf(stderr, "error: %s\n", e.what());
            return 1;
        }
    }
    for (size_t i = 0; i + 1 < cli.size(); ++i) {
        if (cli[i] == "--bench-data") {
            char tmpl[] = "/tmp/train_gpt_bench_XXXXXX";
            if (!mkdtemp(tmpl)) return 1;
            g_tmp = tmpl;
            int rc = bench_data(cli[i + 1]);
            run_shell("rm -rf '" + g_tmp + "'");
            return rc;
        }
        if (cli[i] == "--binary") {  // absolute: some tests run it from other folders
            char* real = realpath(cli[i + 1].c_str(), nullptr);
            g_binary = real ? real : cli[i + 1];
            free(real);
        }
        if (cli[i] == "--python") g_python = cli[i + 1];
    }
    char tmpl[] = "/tmp/train_gpt_test_XXXXXX";
    if (!mkdtemp(tmpl)) {
        printf("cannot make a temporary folder\n");
        return 1;
    }
    g_tmp = tmpl;
    const std::pair<const char*, void (*)()> groups[] = {{"config", test_config},
                                                         {"schedules", test_schedules},
                                                         {"loader", test_loader},
                                                         {"bad input", test_bad_input},
                                                         {"sharding", test_sharding},
                                                         {"step plan", test_step_plan},
                                                         {"early plan", test_backward_reduce_plan},
                                                         {"layers", test_layer_table},
                                                         {"attn tiles", test_attention_tiles},
                                                         {"poly exp2", test_poly_exp2},
                                                         {"init", test_init},
                                                         {"checkpoint", test_checkpoint_format},
                                                         {"rerun", test_logged_configuration},
                                                         {"position", test_data_position},
                                                         {"states", test_checkpoint_states},
                                                         {"hostile", test_hostile_inputs},
                                                         {"logging", test_logging}};
    for (auto [name, fn] : groups) {
        int p = g_passed, f = g_failed;
        try {
            fn();
        } catch (const std::exception& e) {
            ++g_failed;
            printf("FAIL %s: uncaught error: %s\n", name, e.what());
        }
        printf("%-10s %d passed, %d failed\n", name, g_passed - p, g_failed - f);
    }
    run_shell("rm -rf '" + g_tmp + "'");
    printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed == 0 ? 0 : 1;
}
