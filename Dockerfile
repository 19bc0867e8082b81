# syntax=docker/dockerfile:1
# The handoff coordinator: `handoff serve` on 50051 (gRPC) and 9464 (/metrics).
#
#   docker build -t handoff:0.1.0 .
#   docker run --rm -p 50051:50051 -p 9464:9464 handoff:0.1.0
#
# Settings come from HANDOFF_* environment variables (or `handoff serve` flags
# appended to `docker run`); see README.md, "Deploying".

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: the project's wheel, plus a wheel of every dependency ----------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
COPY pyproject.toml README.md ./
COPY client ./client
COPY server ./server
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# ---- runtime: installs those wheels offline; no compilers, no build tools ---
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="handoff" \
      org.opencontainers.image.description="gRPC coordinator for prefill-to-decode KV-cache handoffs" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/handoff/bin:$PATH
RUN groupadd --system --gid 10001 handoff \
    && useradd --system --no-log-init --uid 10001 --gid 10001 \
       --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin handoff
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m venv /opt/handoff \
    && /opt/handoff/bin/pip install --no-cache-dir --no-index --find-links=/wheels /wheels/handoff-*.whl
WORKDIR /opt/handoff
# Numeric, so Kubernetes' runAsNonRoot can verify it without a passwd lookup.
USER 10001:10001
EXPOSE 50051 9464
# gRPC health (grpc.health.v1): healthy only while SERVING; a draining server
# reports NOT_SERVING. Through sh for HANDOFF_PORT; `|| exit 1` keeps a usage
# error (exit 2, which Docker reserves) from reaching Docker.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
    CMD ["sh", "-c", "handoff health --target \"127.0.0.1:${HANDOFF_PORT:-50051}\" --timeout 3 || exit 1"]
# Exec form: `handoff` is PID 1 and gets SIGTERM itself, drains, then exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["handoff", "serve"]
