# syntax=docker/dockerfile:1
# specdec images: one per hardware target, the same `specdec` entrypoint in both.
#
#   docker build --target cpu  -t specdec:cpu  .    # python slim + torch (CPU)
#   docker build --target cuda -t specdec:cuda .    # official PyTorch CUDA runtime image
#
# Configuration is by environment (SPECDEC_MODEL, SPECDEC_DTYPE, SPECDEC_DEVICE, SPECDEC_PORT,
# SPECDEC_METRICS_PORT, SPECDEC_TLS_*, SPECDEC_AUTH_TOKEN_FILE, ...: every `specdec drafter|verifier`
# flag --some-flag reads SPECDEC_SOME_FLAG; `specdec gateway` reads SPECDEC_GATEWAY_SOME_FLAG only, so its
# host is set apart); see docker-compose.yml and README "Deployment and operations".
# The embedded model is fetched and converted on first start into $SPECDEC_CACHE (/models): mount a
# volume there so it happens once.

ARG PYTHON_VERSION=3.12
# Any pytorch/pytorch:<torch>-cuda<x.y>-cudnn<n>-runtime tag with torch >= 2.6 works (transformers 5 needs it); pick the CUDA
# version your driver supports.
ARG CUDA_BASE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime

# ---- CPU ------------------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim AS cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPECDEC_CACHE=/models SPECDEC_HOST=0.0.0.0 SPECDEC_GATEWAY_HOST=0.0.0.0 SPECDEC_DEVICE=cpu
# torch before the project, so that its `torch>=2.6` is already met. Where it is reachable, build
# with --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu: the CPU-only wheel is
# ~200 MB, the default PyPI wheel for Linux x86_64 bundles CUDA (several GB) it will never use here.
ARG TORCH_INDEX_URL=""
RUN pip install torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
WORKDIR /app
# Dependencies in their own layer: source edits do not reinstall them.
COPY pyproject.toml README.md ./
RUN mkdir -p specdec drafter_service verifier_service client specdec_rpc bench cli gateway \
    && pip install . && pip uninstall -y specdec
COPY . .
# Editable: the package data (bench/data) is used in place.
RUN pip install --no-deps -e . && useradd --create-home --uid 10001 specdec \
    && mkdir -p /models && chown specdec /models
USER specdec
VOLUME ["/models"]
EXPOSE 50051 50052 8000 9100
ENTRYPOINT ["specdec"]
CMD ["verifier"]

# ---- CUDA -----------------------------------------------------------------------------------
FROM ${CUDA_BASE} AS cuda
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPECDEC_CACHE=/models SPECDEC_HOST=0.0.0.0 SPECDEC_GATEWAY_HOST=0.0.0.0 SPECDEC_DEVICE=cuda
WORKDIR /app
COPY pyproject.toml README.md ./
# The base image's torch (CUDA build) satisfies torch>=2.6, so pip keeps it.
RUN mkdir -p specdec drafter_service verifier_service client specdec_rpc bench cli gateway \
    && pip install . && pip uninstall -y specdec
COPY . .
RUN pip install --no-deps -e . && useradd --create-home --uid 10001 specdec \
    && mkdir -p /models && chown specdec /models
USER specdec
VOLUME ["/models"]
EXPOSE 50051 50052 8000 9100
ENTRYPOINT ["specdec"]
CMD ["verifier"]
