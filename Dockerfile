# CUDA 13 + NCCL + OpenMPI image that builds the trainer.
#   docker build -t train_gpt .
#   docker run --gpus all --ipc=host -v $PWD/data:/workspace/data -v $PWD/logs:/workspace/logs train_gpt
FROM nvidia/cuda:13.0.0-devel-ubuntu24.04
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
