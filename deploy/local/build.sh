#!/usr/bin/env bash
# Build the compose stack's images with podman on a machine that reaches package registries but
# no image registry: jetserve-control:latest (admission, priority, batcher) and jetserve:latest
# (the executor) from the repository's Dockerfile on BASE (a local Debian
# bookworm, made by setup-podman.sh), torch's CPU wheel from TORCH_FIND_LINKS when that folder
# exists (else from torch's CPU index), then the stand-ins for nats, jaeger and prometheus.
# Prints each image's build time and size. Run from anywhere; safe to run again (layers cached).
set -euo pipefail
BASE=${BASE:-localhost/debian:bookworm}
TORCH_FIND_LINKS=$(realpath -m "${TORCH_FIND_LINKS:-/opt/wheels}")
CA=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
# With a local wheel folder, PyPI serves torch's dependencies (and the folder its CPU build);
# without one, torch's own CPU index (PyPI's torch is the multi-GB CUDA build).
if [ -d "$TORCH_FIND_LINKS" ]; then
    TORCH_INDEX=${TORCH_INDEX:-https://pypi.org/simple}
else
    TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
fi

# Host network and the host's CA bundle: RUN steps reach the registries the way the host does.
common=(--network host --build-arg "BASE=$BASE")
[ -f "$CA" ] && common+=(-v "$CA:/etc/ssl/certs/ca-certificates.crt:ro")
torch=(--build-arg "TORCH_INDEX=$TORCH_INDEX")
cd "$(dirname "$0")/../.."
if [ -d "$TORCH_FIND_LINKS" ]; then
    torch+=(-v "$TORCH_FIND_LINKS:/wheels:ro" --build-arg "TORCH_FIND_LINKS=/wheels")
fi

build() {  # tag, then podman build arguments
    local tag=$1 start=$SECONDS
    shift
    podman build -q "${common[@]}" -t "$tag" "$@" . >/dev/null
    printf '%-44s built in %4d s, %s\n' "$tag" $((SECONDS - start)) \
        "$(podman image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1 / 1e6}')"
}

build jetserve-control:latest --target control-plane
build jetserve:latest "${torch[@]}"
for target in nats jaeger prometheus; do
    build "localhost/jetserve-standin-$target:local" -f deploy/local/standins.Dockerfile \
        --target "$target"
done
