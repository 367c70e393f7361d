# CUDA 13 + NCCL + OpenMPI image that builds the trainer.
#   docker build -t train_gpt .
#   docker run --gpus all --ipc=host -v $PWD/data:/workspace/data -v $PWD/logs:/workspace/logs train_gpt
# The toolkit the records' logs name: nvcc 13.0, CUDA runtime 13.0 and cuBLASLt 13.1.0, i.e. CUDA 13.0
# Update 2 (13.0.2), on Ubuntu 24.04 (Open MPI 4.1.6). cuBLASLt's version picks the GEMM algorithms,
# so a logged GEMM plan reruns only on the same one. The logs ran NCCL 2.28.3; the image's NCCL is the
# one its CUDA repository gives (the log's versions block says which ran).
FROM nvidia/cuda:13.0.2-devel-ubuntu24.04
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        libopenmpi-dev openmpi-bin python3 make diffutils ca-certificates \
 && (dpkg -s libnccl-dev >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libnccl2 libnccl-dev) \
 && rm -rf /var/lib/apt/lists/*
ENV OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
WORKDIR /workspace
COPY . .
RUN make -j"$(nproc)" && make test
CMD ["./run.sh"]
