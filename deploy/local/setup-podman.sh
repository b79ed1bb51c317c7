#!/usr/bin/env bash
# Make podman usable for the compose stack on a Debian machine without a Docker engine or an image
# registry (as root): the podman, runc and debootstrap packages; runc and cgroupfs (a sandbox whose
# cgroups crun refuses), ulimits within the sandbox's (this replaces
# /etc/containers/containers.conf); podman-compose from PyPI into its own
# virtualenv, linked into /usr/local/bin; and a Debian bookworm base image made with debootstrap
# from the machine's own apt mirror, tagged localhost/debian:bookworm. Safe to run again.
set -euo pipefail
need=()
for tool in podman runc debootstrap iptables; do command -v "$tool" >/dev/null || need+=("$tool"); done
if [ ${#need[@]} -gt 0 ] || [ ! -x /usr/lib/podman/aardvark-dns ]; then
    apt-get update -qq
    # netavark and aardvark-dns: compose's service names resolve inside the project's network;
    # netavark sets up that network with iptables (without it: "netavark: No such file").
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap netavark \
        aardvark-dns iptables python3-venv >/dev/null
fi
mkdir -p /etc/containers
cat > /etc/containers/containers.conf <<'CONF'
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
CONF
if ! command -v podman-compose >/dev/null; then
    python3 -m venv /opt/podman-compose
    # Pinned: docs/operations.md and the test describe this version's `down`.
    /opt/podman-compose/bin/pip install -q podman-compose==1.6.0
    ln -sf /opt/podman-compose/bin/podman-compose /usr/local/bin/podman-compose
fi
if ! podman image exists localhost/debian:bookworm; then
    mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    [ -n "$mirror" ] || mirror=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
    case "$mirror" in http://* | https://*) ;; *) mirror=http://deb.debian.org/debian ;; esac
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
    debootstrap --variant=minbase --include=ca-certificates bookworm "$root" "$mirror" >/dev/null
    tar -C "$root" -c . | podman import - localhost/debian:bookworm >/dev/null
fi
podman run --rm localhost/debian:bookworm true
echo "podman $(podman --version | awk '{print $3}') ready, $(podman-compose --version 2>/dev/null | tail -1); base image localhost/debian:bookworm"
