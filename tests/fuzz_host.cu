// Fuzz test of the trainer's host parsers: flags, a logged configuration block, a GEMM plan, a
// checkpoint's header and blobs, its state texts, a data position and a shard header. Each target
// starts from a valid input made the way the trainer makes it, then takes seeded random mutations
// (byte flips, inserted and deleted bytes, duplicated, deleted and swapped lines, numbers replaced
// by extreme values). Every call must return or throw TrainerError: any other exception, a crash,
// a hang or a sanitizer report fails. Then fixed hostile flags, each refused naming its flag.
// Built by the Makefile with AddressSanitizer and UBSan where the toolchain has them; never calls CUDA.
//
//   make tests/fuzz_host && ./tests/fuzz_host [seed]     last line "N passed, N failed"
//   (make test runs it with ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 and UBSAN_OPTIONS=halt_on_error=1)

#define TRAIN_GPT_NO_MAIN
#include "../train_gpt.cu"
#include "testing.h"

// present only in a sanitized build: then a crash report also names the input that caused it
extern "C" void __sanitizer_set_death_callback(void (*)(void)) __attribute__((weak));

static std::mt19937_64 g_rng;
static size_t pick(size_t n) { return n ? (size_t)(g_rng() % n) : 0; }

// The input under test, escaped, in a fixed buffer a signal handler or a sanitizer can print.
static char g_current[1024];
static void note_input(const char* target, const std::string& input) {
    std::string s = std::string(target) + ": ";
    for (unsigned char c : input.substr(0, 400))
        s += c == '\n' ? std::string("\\n") : c == '\\' ? std::string("\\\\")
             : (c < 0x20 || c >= 0x7f) ? strprintf("\\x%02x", c) : std::string(1, (char)c);
    if (input.size() > 400) s += strprintf("... (%zu bytes)", input.size());
    snprintf(g_current, sizeof g_current, "%s", s.c_str());
}
static void print_current() {
    const char pre[] = "\nfuzz_host: the input was ";
    if (write(2, pre, sizeof pre - 1) < 0 || write(2, g_current, strlen(g_current)) < 0 || write(2, "\n", 1) < 0) {}
}
static void on_hang(int) {
    const char msg[] = "\nFAIL fuzz_host: no answer within 60 s (a hang)";
    if (write(2, msg, sizeof msg - 1) < 0) {}
    print_current();
    _exit(1);
}

// values that have broken parsers: signs, spaces, other bases, overflow at every width, non-numbers
static const std::vector<std::string> EXTREMES = {
    "-1", "0", "1", "2147483647", "2147483648", "-2147483649", "4294967296", "9223372036854775807",
    "9223372036854775808", "-9223372036854775808", "18446744073709551615", "18446744073709551616", "1099511627777",
    "2305843009213693952", std::string(300, '9'), " 5", "+5", "5 ", "0x10", "nan", "inf", "-inf", "1e999", "1e-999",
    "-0", "0x1p+1024", "", ",", "1,,2", std::string(5000, 'a'), "-", "."};

static std::string joined(const std::vector<std::string>& l) {
    std::string s;
    for (size_t i = 0; i < l.size(); ++i) s += (i ? "\n" : "") + l[i];
    return s;
}

// One random edit of a text (or of bytes: the edits keep no structure)
static std::string mutate_once(std::string s) {
    static const char CHARS[] = "\n \0=-+.,x0123456789afp()\xff";
    switch (pick(10)) {
        case 0: if (!s.empty()) s[pick(s.size())] ^= (char)(1 << pick(8)); break;
        case 1: if (!s.empty()) s[pick(s.size())] = CHARS[pick(sizeof CHARS - 1)]; break;
        case 2: s.insert(pick(s.size() + 1), pick(2) ? std::string(1 + pick(4), CHARS[pick(sizeof CHARS - 1)])
                                                     : EXTREMES[pick(EXTREMES.size())]); break;
        case 3: if (!s.empty()) { size_t at = pick(s.size()); s.erase(at, 1 + pick(16)); } break;
        case 4: case 5: case 6: {  // duplicate, delete or swap lines
            std::vector<std::string> l = split(s, '\n');
            size_t i = pick(l.size()), j = pick(l.size());
            if (s.empty()) break;
            int op = pick(3);
            if (op == 0) l.insert(l.begin() + i, l[i]);
            else if (op == 1) l.erase(l.begin() + i);
            else std::swap(l[i], l[j]);
            s = joined(l);
            break;
        }
        case 7: case 8: {  // a number (a run of digits, maybe signed) becomes an extreme value
            std::vector<size_t> starts;
            for (size_t i = 0; i < s.size(); ++i)
                if (isdigit((unsigned char)s[i]) && (i == 0 || !isdigit((unsigned char)s[i - 1]))) starts.push_back(i);
            if (starts.empty()) break;
            size_t a = starts[pick(starts.size())], b = a;
            while (b < s.size() && (isalnum((unsigned char)s[b]) || s[b] == '.' || s[b] == '+')) ++b;
            if (a > 0 && s[a - 1] == '-') --a;
            s.replace(a, b - a, EXTREMES[pick(EXTREMES.size())]);
            break;
        }
        default: s.resize(pick(s.size() + 1)); break;  // truncated
    }
    return s;
}
static std::string mutate(const std::string& s) {
    std::string m = s;
    for (size_t n = 1 + pick(3); n > 0; --n) m = mutate_once(m);
    return m;
}

// Counts of one target; attempt() runs one input, which must be accepted or refused with TrainerError.
struct Tally {
    const char* name;
    int tried = 0, accepted = 0, refused = 0, broken = 0;
};
template <class F>
static bool attempt(Tally& t, const std::string& input, F&& fn) {
    note_input(t.name, input);
    ++t.tried;
    try {
        fn();
        ++t.accepted;
        return true;
    } catch (const TrainerError&) {
        ++t.refused;
    } catch (const std::exception& e) {
        ++t.broken;  // counted as one failure of the target by finish()
        printf("FAIL %s: %s (not a TrainerError) on %s\n", t.name, e.what(), g_current);
    } catch (...) {
        ++t.broken;  // counted as one failure of the target by finish()
        printf("FAIL %s: a non-std exception on %s\n", t.name, g_current);
    }
    return false;
}
// the unmutated input is accepted (else the mutations test nothing), then the target's summary
static void finish(Tally& t, bool seed_accepted) {
    CHECK(seed_accepted, "%s: the valid input is accepted", t.name);
    CHECK(t.broken == 0, "%s: %d inputs neither accepted nor refused with TrainerError", t.name, t.broken);
    printf("%-12s %5d inputs: %5d accepted, %5d refused\n", t.name, t.tried, t.accepted, t.refused);
}

static const int WORLD_SIZES[] = {1, 2, 4, 8};

// 1. flags: parse_args, validate_args at every world size, and the configuration of what passes
static void run_flags(Tally& t, const std::vector<std::string>& argv, const std::string& shown) {
    attempt(t, shown, [&] {
        Hyperparameters h;
        parse_args(h, argv);
        for (int ws : WORLD_SIZES) {
            validate_args(h, ws);
            configuration_text(h, ws, ".", "cmd");
        }
    });
}
static void fuzz_flags(int n) {
    Tally t{"flags"};
    Hyperparameters defaults;
    const std::vector<Option> opts = options_of(defaults);
    const std::vector<std::string> good = {"--ws_schedule", "2,4,8", "--val_tokens", "2097152", "--seed", "9", "--run_id", "r1"};
    Hyperparameters h0;
    const bool seed_ok = attempt(t, "good flags", [&] {
        parse_args(h0, good);
        validate_args(h0, 8);
    });
    for (int i = 0; i < n; ++i) {
        std::vector<std::string> argv;
        for (size_t k = 1 + pick(4); k > 0; --k) {
            const Option& o = opts[pick(opts.size())];
            std::string name = std::string("--") + o.name, value = format_option(o);
            switch (pick(6)) {  // the value: kept, edited, extreme, scaled or a list of it
                case 0: break;
                case 1: value = mutate(value); break;
                case 2: value = EXTREMES[pick(EXTREMES.size())]; break;
                case 3: value = std::to_string((int64_t)(strtod(value.c_str(), nullptr) * (double)(1 << pick(8)) / 8)); break;
                case 4: value = std::to_string((int64_t)pick(5000) - 10); break;
                default: for (size_t r = pick(4); r > 0; --r) value += "," + value; break;
            }
            switch (pick(8)) {  // the flag: --name value, --name=value, bare, or a mangled name
                case 0: argv.push_back(name + "=" + value); break;
                case 1: argv.push_back(name); break;
                case 2: argv.push_back(mutate(name)), argv.push_back(value); break;
                default: argv.push_back(name), argv.push_back(value); break;
            }
        }
        std::string shown;
        for (const std::string& a : argv) shown += "'" + a + "' ";
        run_flags(t, argv, shown);
    }
    finish(t, seed_ok);
}

// 2. a logged configuration block, read back as --rerun and --resume read it
static void fuzz_logged_configuration(int n) {
    Tally t{"config"};
    std::vector<std::string> blocks;
    for (int ws : {2, 8}) {
        Hyperparameters h;
        parse_args(h, {"--val_tokens", "2097152", "--ws_schedule", "2,4,8", "--cycle_data", "--run_id", "r1"});
        const std::string text = configuration_text(h, ws, "/data", "./train_gpt --seed 9");
        blocks.push_back(text.substr(16, text.size() - 16 - 20));  // without "# configuration" and "# end configuration"
    }
    // as the trainer takes it: flags in range before anything is derived from them (check_logged_run)
    auto read = [](const std::string& block) {
        LoggedRun run = parse_logged_configuration(block, "L", 1);
        validate_args(run.args, run.world_size);
        check_logged_configuration(block, "L", 1, run);
    };
    bool seed_ok = true;
    for (const std::string& b : blocks) seed_ok = attempt(t, b, [&] { read(b); }) && seed_ok;
    for (int i = 0; i < n; ++i) {
        const std::string b = mutate(blocks[pick(blocks.size())]);
        attempt(t, b, [&] { read(b); });
    }
    finish(t, seed_ok);
}

// 3. a GEMM plan as a log or a checkpoint holds it
static void fuzz_gemm_plan(int n) {
    Tally t{"gemm plan"};
    std::string plan = "gemm_plan_for = NVIDIA H100 80GB HBM3, 132 SMs, compute capability 9.0, cuBLASLt 13.0.0, CUDA runtime 13.0\n";
    for (int i = 0; i < 3; ++i) {
        std::string hex;
        for (int w = 0; w < 8; ++w) hex += hex64(g_rng());
        plan += strprintf("gemm bf16,bf16,bf16 NT m=%d n=768 k=3072 ld=768,768,768 fast=0 align=16,16,16 batch=1 "
                          "stride=0,0,0 = %s (%s)\n", 1024 << i, hex.c_str(), i ? "first choice" : "tuned: 0.0123 ms, 500 TFLOP/s");
    }
    const bool seed_ok = attempt(t, plan, [&] { check_gemm_plan(plan, "P"); });
    for (int i = 0; i < n; ++i) {
        const std::string p = mutate(plan);
        attempt(t, p, [&] { check_gemm_plan(p, "P"); });
    }
    finish(t, seed_ok);
}

// 4. a checkpoint file: mostly its header edited, sometimes any byte, sometimes its length
static void fuzz_checkpoint(const std::string& dir, int n) {
    Tally t{"checkpoint"};
    const std::string path = dir + "/c.bin";
    std::string param(64, '\0');
    for (char& c : param) c = (char)g_rng();
    const std::vector<std::pair<std::string, std::string>> blobs = {
        {"config", "a = 1\nb = 2\n"}, {"param/x", param}, {"rank0/data", "file 0 x\n"}, {"odd", std::string(13, 'z')}};
    const std::map<std::string, BlobSpec> expected = {
        {"config", {100, true}}, {"param/x", {param.size(), false}}, {"rank0/data", {100, true}}, {"odd", {13, false}}};
    write_checkpoint_file(path, 2, 70, "00000000000cafe0", "0000000000beef00", blobs);
    const std::string good = read_regular_file(path, 1 << 20, "checkpoint");
    const size_t header = good.find("\nend\n") + 5;
    auto read = [&](const std::string& bytes) {
        FILE* f = fopen(path.c_str(), "wb");
        if (!f || fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size() || fclose(f) != 0) throw std::runtime_error("cannot write " + path);
        const CheckpointHeader h = read_checkpoint_header(path);
        read_checkpoint_blobs(path, h, expected, {}, true);
        read_checkpoint_blobs(path, h, expected, {"odd"}, false);
    };
    const bool seed_ok = attempt(t, good.substr(0, header), [&] { read(good); });
    for (int i = 0; i < n; ++i) {
        std::string bytes;
        switch (pick(4)) {
            case 0: bytes = mutate(good); break;
            case 1: bytes = good + std::string(1 + pick(100), 'q'); break;
            default: bytes = mutate(good.substr(0, header)) + good.substr(header); break;
        }
        attempt(t, bytes.substr(0, std::min(bytes.size(), header + 40)), [&] { read(bytes); });
    }
    unlink(path.c_str());
    finish(t, seed_ok);
}

// 5. a checkpoint's state texts: the trainer's, the schedule's and the optimizer's
static void fuzz_state_texts(int n) {
    Tally t{"states"};
    const Hyperparameters a;
    const YarnState y = yarn_reset(a);
    std::string schedule = strprintf("windows 1 3\nbatch_size 131072\nattn_scale %a\nyarn", y.attn_scale);
    for (float f : y.angular_freq) schedule += strprintf(" %a", (double)f);
    schedule += "\nmtp 0x1p+0 0x1p-1 0x1p-2\n";
    std::vector<std::vector<ParamConfig>> cfgs;
    for (int ws : WORLD_SIZES) cfgs.push_back(build_param_configs(a, model_params(ws), ws, 0));
    std::string optimizer = "split 0\n";
    for (const ParamConfig& c : cfgs[0])
        if (c.optim == Optim::Adam) optimizer += "adam_steps " + c.label + " 6\n";
    const std::string trainer = "steps_done 12\ntraining_time_ms 0x1.8p+3\n";
    auto run = [&](int which, const std::string& text) {
        if (which == 0) parse_trainer_state(text, "T");
        else if (which == 1) parse_schedule_state(text, a);
        else parse_optimizer_state(text, cfgs[pick(cfgs.size())], 12);
    };
    const std::string seeds[] = {trainer, schedule, optimizer};
    bool seed_ok = true;
    for (int w = 0; w < 3; ++w) seed_ok = attempt(t, seeds[w], [&] { run(w, seeds[w]); }) && seed_ok;
    for (int i = 0; i < n; ++i) {
        const int w = (int)pick(3);
        const std::string text = mutate(seeds[w]);
        attempt(t, text, [&] { run(w, text); });
    }
    finish(t, seed_ok);
}

// 6. a rank's data position, against a file list, a BOS count, a world size and the buffers
static void fuzz_data_position(int n) {
    Tally t{"position"};
    const std::string good = "file 0 path/x.bin\nbos 10\nbatch_iter 3\nquick -1 5\nbatch 16384 2048\n";
    const std::vector<std::string> files = {"path/x.bin", "path/y.bin"};
    auto run = [&](const std::string& text) {
        const DataPosition p = parse_data_position(text);
        check_data_position(p, files, -1, WORLD_SIZES[pick(4)], 0);
        check_data_position(p, files, pick(2) ? 100 : (int64_t)pick(20), WORLD_SIZES[pick(4)], 16384);
    };
    const bool seed_ok = attempt(t, good, [&] {
        const DataPosition p = parse_data_position(good);
        check_data_position(p, files, 100, 1, 16384);
    });
    for (int i = 0; i < n; ++i) {
        const std::string text = mutate(good);
        attempt(t, text, [&] { run(text); });
    }
    finish(t, seed_ok);
}

// 7. a data shard: its header ints, its bytes and its length
static void fuzz_shard(const std::string& dir, int n) {
    Tally t{"shard"};
    const std::string path = dir + "/s.bin";
    std::mt19937_64 token_rng(7);
    write_shard(path, make_tokens(token_rng, 1000, 50, true));
    const std::string good = read_regular_file(path, 1 << 20, "shard");
    auto read = [&](const std::string& bytes) {
        FILE* f = fopen(path.c_str(), "wb");
        if (!f || fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size() || fclose(f) != 0) throw std::runtime_error("cannot write " + path);
        int64_t num_tokens = 0;
        close(open_data_shard(path, &num_tokens));
        load_data_shard(path);
    };
    const bool seed_ok = attempt(t, good.substr(0, 12), [&] { read(good); });
    const size_t header = SHARD_HEADER_INTS * 4;
    for (int i = 0; i < n; ++i) {
        std::string bytes = good;
        switch (pick(5)) {
            case 0: {  // a header int: magic, version or token count
                const uint32_t v = (uint32_t)((uint64_t)strtoll(EXTREMES[pick(16)].c_str(), nullptr, 10) + pick(3) - 1);
                memcpy(&bytes[4 * pick(3)], &v, 4);
                break;
            }
            case 1: bytes[pick(header)] ^= (char)(1 << pick(8)); break;
            case 2: bytes.resize(pick(2) ? pick(bytes.size()) : bytes.size() - 1 - pick(4)); break;
            case 3: bytes += std::string(1 + pick(8), '\xff'); break;  // more bytes than the header says
            default: bytes[header + pick(bytes.size() - header)] = '\xff'; break;  // a token id past the vocabulary
        }
        attempt(t, bytes.substr(0, 12), [&] { read(bytes); });
    }
    unlink(path.c_str());
    finish(t, seed_ok);
}

// Hostile flags seen in the wild: each refused, the message naming the flag
static void hostile_flags() {
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"train_max_seq_len", "2305843009213693952"}, {"num_scheduled_iterations", "9223372036854775807"},
        {"num_extension_iterations", "1099511627777"}, {"block_size", "9223372036854775807"},
        {"yarn_alpha", "-9223372036854775808"}, {"yarn_beta", "9223372036854775807"}, {"ws_schedule", "999999999999"},
        {"seed", " -1"}, {"seed", "+5"}, {"val_tokens", " 2097152"}, {"run_id", ".."}, {"run_id", "."},
        {"run_id", "..."}, {"run_id", std::string(200, 'r')}};
    for (const auto& c : cases) {
        const std::string &flag = c.first, &value = c.second;
        expect_error(("--" + flag + " '" + value.substr(0, 24) + "'").c_str(), [&] {
            Hyperparameters h;
            parse_args(h, {"--" + flag, value});
            validate_args(h, 8);
        }, {flag});
    }
}

int main(int argc, char** argv) {
    const uint64_t seed = argc > 1 ? strtoull(argv[1], nullptr, 10) : 20240520;
    g_rng.seed(seed);
    printf("seed %llu\n", (unsigned long long)seed);
    if (__sanitizer_set_death_callback) __sanitizer_set_death_callback(print_current);
    signal(SIGALRM, on_hang);
    char tmpl[] = "/tmp/fuzz_host_XXXXXX";
    if (!mkdtemp(tmpl)) {
        printf("cannot make a temporary folder\n");
        return 1;
    }
    const std::string dir = tmpl;
    const std::pair<const char*, std::function<void()>> targets[] = {
        {"flags", [] { fuzz_flags(1500); }},
        {"config", [] { fuzz_logged_configuration(600); }},
        {"gemm plan", [] { fuzz_gemm_plan(800); }},
        {"checkpoint", [&] { fuzz_checkpoint(dir, 800); }},
        {"states", [] { fuzz_state_texts(1200); }},
        {"position", [] { fuzz_data_position(800); }},
        {"shard", [&] { fuzz_shard(dir, 600); }},
        {"hostile", hostile_flags}};
    for (const auto& [name, fn] : targets) {
        alarm(60);
        try {
            fn();
        } catch (const std::exception& e) {  // the targets' own set-up failed
            ++g_failed;
            printf("FAIL %s: %s\n", name, e.what());
        }
    }
    alarm(0);
    rmdir(dir.c_str());
    printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed == 0 ? 0 : 1;
}
