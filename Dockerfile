# syntax=docker/dockerfile:1
# kvd daemon image: `docker build -t kvd:0.1.0 .`
#
# CPU image by default: torch CPU (NIXL's Python package requires torch; the
# CPU build keeps the image small) + NIXL (its wheels bundle UCX) + kvd.
# CUDA image (GPU nodes, VRAM registration): pick the matching torch index,
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t kvd:0.1.0-cu128 .
# and run it with the NVIDIA container runtime (--gpus all, or the
# nvidia.com/gpu resource), which mounts the driver; NIXL picks its CUDA 12
# or 13 build from the driver at run time. See docs/OPERATIONS.md, "Docker".
#
# Offline build (no registry, no PyTorch index; the wheels in deploy/wheels/,
# a locally made base image; podman keeps HEALTHCHECK only in docker format):
#   podman --runtime runc build --format docker --network none --build-arg PIP_NO_INDEX=1 \
#     --build-arg PYTHON_IMAGE=localhost/debian-python:bookworm \
#     --build-arg BUILD_IMAGE=localhost/debian-python-cc:bookworm \
#     --ulimit nofile=20000:20000 --ulimit nproc=4096:4096 -t kvd:0.1.0 .
# (runc and the ulimits: what machines like this project's CI need; docs/OPERATIONS.md,
# "Building without a registry"). deploy/wheels/README.md says how to fill the
# folder and make the base image.
#
# Runs `kvd serve` as uid 10001 (user kvd). Engines that share their KV
# cache with it through /dev/shm must run with the same uid.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# The build stage's image (PYTHON_IMAGE unless told otherwise; the same Python
# at the same path, as the venv is copied). It compiles kvd's native row copy
# (setup.py, kvd/core/_rowcopy.c) where it has a C compiler and Python's
# headers: an online build installs gcc below, an offline one needs an image
# that has it (tests/test_container.py). Without one the install goes on and
# same-node copies run one memmove a row (`kvd version` says which).
ARG BUILD_IMAGE=${PYTHON_IMAGE}

FROM ${BUILD_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
# 1: install only from the wheels in deploy/wheels/ (an offline build); 0 (the
# default): from the indexes, wheels found in deploy/wheels/ included.
ARG PIP_NO_INDEX=0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_FIND_LINKS=/wheels
# Unpinned (hadolint DL3008): bookworm's current gcc, in the build stage only;
# what reaches the image is the one compiled file.
# hadolint ignore=DL3008
RUN if ! command -v cc >/dev/null 2>&1 && [ "${PIP_NO_INDEX}" != 1 ] && command -v apt-get >/dev/null 2>&1; then \
      apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*; \
    fi
RUN python -m venv /opt/kvd
ENV PATH=/opt/kvd/bin:$PATH
COPY deploy/wheels/ /wheels/
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
# The dependencies in a layer of their own (pyproject.toml without kvd/
# builds an empty kvd, uninstalled at once), so that a change to kvd/
# rebuilds only the small layer below.
COPY pyproject.toml setup.py README.md ./
RUN pip install . && pip uninstall --yes kvd
COPY kvd ./kvd
RUN pip install --no-deps . \
    && find /opt/kvd -name '__pycache__' -type d -prune -exec rm -rf {} + \
    && kvd version

FROM ${PYTHON_IMAGE}
ARG KVD_VERSION=0.1.0
LABEL org.opencontainers.image.title="kvd" \
      org.opencontainers.image.description="Per-node KV-cache transfer daemon for disaggregated prefill/decode LLM serving (NIXL over gRPC)" \
      org.opencontainers.image.version="${KVD_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.documentation="docs/OPERATIONS.md"
RUN groupadd --system --gid 10001 kvd \
    && useradd --system --uid 10001 --gid kvd --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kvd \
    && install -d -o kvd -g kvd -m 0770 /run/kvd
COPY --from=build /opt/kvd /opt/kvd
COPY deploy/kvd.toml /etc/kvd/kvd.toml
ENV PATH=/opt/kvd/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /run/kvd
# 7700: PeerService + gRPC health (TCP); 9400: Prometheus /metrics.
EXPOSE 7700 9400
STOPSIGNAL SIGTERM
# kvd health exits 0 serving, 1 not serving (draining), 2 unreachable, 64 on
# a usage error; Docker documents 0 (healthy) and 1 (unhealthy) and reserves
# 2, so every failure is reported as 1. --config names the file CMD serves
# with, so a mounted kvd.toml that moves engine_socket is followed.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["/bin/sh", "-c", "kvd health --quiet --timeout 3 --config /etc/kvd/kvd.toml || exit 1"]
ENTRYPOINT ["kvd"]
CMD ["serve", "--config", "/etc/kvd/kvd.toml"]
