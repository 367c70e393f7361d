# make            build ./train_gpt (Hopper, sm_90a)
# make test       host tests (no GPU needed)
# make test-gpu   GPU tests (skip with a message where there is no GPU); its parts: make test-gpu-kernels,
#                 test-gpu-runs, test-gpu-ranks
# make bench      benchmarks (data pipeline on $(BENCH_DATA); GPU benchmarks come with the kernels)

NVCC       ?= nvcc
CUDA_HOME  ?= /usr/local/cuda
ARCH       ?= -gencode arch=compute_90a,code=sm_90a
MPICXX     ?= mpicxx
PYTHON     ?= python3

MPI_CFLAGS := $(shell $(MPICXX) --showme:compile 2>/dev/null)
MPI_LIBS   := $(shell $(MPICXX) --showme:link 2>/dev/null)
ifeq ($(strip $(MPI_LIBS)),)
$(error OpenMPI not found ($(MPICXX) --showme:link failed): install libopenmpi-dev openmpi-bin)
endif
# nvcc takes -I/-L/-l itself; anything else (e.g. -pthread) goes to the host compiler
nvcc_flags = $(filter -I% -L% -l%,$(1)) $(foreach f,$(filter-out -I% -L% -l%,$(1)),-Xcompiler $(f))

# -ffp-contract=off: the schedules must round exactly as the record's Python does
NVCCFLAGS ?= -O3 -std=c++17 $(ARCH) -lineinfo
NVCCFLAGS += -Xcompiler -Wall,-Wextra,-ffp-contract=off -DTRAIN_GPT_SRC_DIR=\"$(CURDIR)\" \
             $(call nvcc_flags,$(MPI_CFLAGS))
LDLIBS     = -L$(CUDA_HOME)/lib64 -lcublasLt -lnccl $(call nvcc_flags,$(MPI_LIBS)) -lpthread

SOURCES = train_gpt.cu triton_kernels.cu

.PHONY: all test test-gpu test-gpu-kernels test-gpu-runs test-gpu-ranks bench bench-loop clean
all: train_gpt

# ptxas reports (C7519) that it puts a warpgroup.arrive before an attention MMA whose A operand comes
# from registers: that fence is what the PTX ISA asks for there and the MMAs stay pipelined (no
# "serialized" note follows), so the build hides that one line; any other ptxas output shows.
SHELL := bash
.SHELLFLAGS := -o pipefail -c
QUIET_C7519 = 2>&1 | { grep -v '(C7519) warpgroup.arrive is injected' || true; }

train_gpt: $(SOURCES)
	$(NVCC) $(NVCCFLAGS) -o $@ train_gpt.cu $(LDLIBS) $(QUIET_C7519)

tests/test_host: tests/test_host.cu tests/testing.h $(SOURCES)
	$(NVCC) $(NVCCFLAGS) -o $@ tests/test_host.cu $(LDLIBS) $(QUIET_C7519)

# The parsers' fuzz test, with AddressSanitizer and UBSan where the toolchain has them (else built
# plain, saying so). It runs no device code, so its kernels are compiled to PTX only (no ptxas).
FUZZ_SANITIZE = $(call nvcc_flags,-fsanitize=address -fsanitize=undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
tests/fuzz_host: ARCH = -gencode arch=compute_90a,code=compute_90a
tests/fuzz_host: tests/fuzz_host.cu tests/testing.h $(SOURCES)
	$(NVCC) $(NVCCFLAGS) $(FUZZ_SANITIZE) -o $@ tests/fuzz_host.cu $(LDLIBS) $(QUIET_C7519) || { \
	  echo "tests/fuzz_host: no sanitizer build here; building it without sanitizers"; \
	  $(NVCC) $(NVCCFLAGS) -o $@ tests/fuzz_host.cu $(LDLIBS) $(QUIET_C7519); }

tests/test_gpu: tests/test_gpu.cu tests/testing.h $(SOURCES)
	$(NVCC) $(NVCCFLAGS) -o $@ tests/test_gpu.cu $(LDLIBS) $(QUIET_C7519)

test: train_gpt tests/test_host tests/fuzz_host
	./tests/test_host --binary ./train_gpt --python $(PYTHON)
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ./tests/fuzz_host
	$(PYTHON) records/test_records.py
	bash tests/test_run_sh.sh

tests/test_distributed: tests/test_distributed.cu tests/testing.h $(SOURCES)
	$(NVCC) $(NVCCFLAGS) -o $@ tests/test_distributed.cu $(LDLIBS) $(QUIET_C7519)

# make test-gpu runs three parts, each also a target of its own: the kernels and the model against
# their references (test-gpu-kernels); the trainer's runs repeated, stopped and resumed at world sizes
# 1 and 2 (test-gpu-runs); the multi-rank paths (test-gpu-ranks). The multi-rank tests run their
# ranks on a GPU each where there are enough GPUs, else sharing the GPUs (TRAIN_GPT_SHARE_GPUS=1,
# NCCL over sockets: slow, a correctness test; tests/ranks.sh). Each test says how long it took.
test-gpu: test-gpu-kernels test-gpu-runs test-gpu-ranks
test-gpu-kernels test-gpu-runs test-gpu-ranks: export TIMEFORMAT = (%0R s)
test-gpu-kernels: tests/test_gpu
	time ./tests/test_gpu
test-gpu-runs: tests/test_host train_gpt
	time bash tests/test_resume.sh
	time RANKS=2 bash tests/test_resume.sh
test-gpu-ranks: tests/test_distributed train_gpt
	time bash tests/test_ranks.sh
	ranks=2 && source tests/ranks.sh && time mpirun --quiet -np 2 --bind-to none \
	    $${TRAIN_GPT_SHARE_GPUS:+-x TRAIN_GPT_SHARE_GPUS --oversubscribe} ./tests/test_distributed

tests/bench_gpu: tests/bench_gpu.cu $(SOURCES)
	$(NVCC) $(NVCCFLAGS) -o $@ tests/bench_gpu.cu $(LDLIBS) $(QUIET_C7519)

tests/libattention.so: tests/attention_lib.cu triton_kernels.cu
	$(NVCC) -O3 -std=c++17 $(ARCH) -Xcompiler -fPIC -shared -o $@ tests/attention_lib.cu

# The data of the GPU tests, make bench and make bench-loop: a folder of *_train_*.bin and *_val_*.bin
# shards. FineWeb's first shards where present (python3 data/cached_fineweb10B.py 1), else textmix
# (any shards of the same format); the tests skip, saying what is missing, without them.
TEST_DATA ?= $(if $(wildcard data/fineweb10B/fineweb_train_*.bin),data/fineweb10B,data/textmix)
export TEST_DATA
BENCH_DATA ?= $(TEST_DATA)/*_train_*.bin
BENCH_VAL ?= $(TEST_DATA)/*_val_*.bin
bench: tests/test_host tests/libattention.so tests/bench_gpu bench-loop
	./tests/test_host --bench-data '$(BENCH_DATA)'
	./tests/bench_gpu
	if [ "$$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then mpirun -np 2 --bind-to none ./tests/bench_gpu; fi
	$(PYTHON) tests/bench_attention.py

# The real training loop on real data (the shortened schedule of record 61: 150 + 10 steps, all
# three phases and the extension), every other step timed by parts: ms per step and where it goes.
# BENCH_FLAGS: more trainer flags (make bench-loop BENCH_FLAGS='--logit_chunk_rows 4096')
bench-loop: train_gpt
	@if ls $(BENCH_DATA) >/dev/null 2>&1 && ls $(BENCH_VAL) >/dev/null 2>&1; then \
	  ./train_gpt --train_files '$(BENCH_DATA)' --val_files '$(BENCH_VAL)' --num_scheduled_iterations 150 \
	    --num_extension_iterations 10 --val_loss_every 0 --val_tokens 2097152 --cycle_data --profile_steps 2 \
	    --run_id bench_loop_$$(date +%Y%m%d_%H%M%S) $(BENCH_FLAGS) | grep -v '^step:'; \
	else echo "bench-loop: no data at $(BENCH_DATA) / $(BENCH_VAL): skipped"; fi

clean:
	rm -f train_gpt tests/test_host tests/fuzz_host tests/test_gpu tests/test_distributed tests/bench_gpu tests/libattention.so
