# syntax=docker/dockerfile:1
# The handoff coordinator: `handoff serve` on 50051 (gRPC), 9464 (/metrics) and
# 8081 (plaintext gRPC health only, for the HEALTHCHECK and the kubelet's probes).
#
#   docker build -t handoff:0.2.0 .
#   docker run --rm -p 50051:50051 -p 9464:9464 handoff:0.2.0
#
# Settings come from HANDOFF_* environment variables (or `handoff serve` flags
# appended to `docker run`); see docs/operations.md, "Deploying".

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: the project's wheel, plus a wheel of every dependency ----------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
COPY pyproject.toml README.md ./
COPY deploy/constraints.txt ./deploy/
COPY client ./client
COPY server ./server
RUN pip wheel --no-cache-dir --wheel-dir /wheels --constraint deploy/constraints.txt ".[server,otel]"

# ---- runtime: installs those wheels offline; no compilers, no build tools ---
# The venv gets no pip and no setuptools (--without-pip; the base image's pip
# installs into it), and the base image's own pip, setuptools and wheel are
# removed once used: nothing at run time needs them, and the image's
# setuptools is older than its fixed CVEs.
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
    --mount=type=bind,from=build,source=/src/deploy/constraints.txt,target=/constraints.txt \
    python -m venv --without-pip /opt/handoff \
    && pip install --no-cache-dir --no-index --find-links=/wheels --constraint /constraints.txt \
       --python /opt/handoff/bin/python "kv-handoff[server,otel]" \
    && pip uninstall --yes --no-cache-dir setuptools wheel pip \
    && install --directory --owner=10001 --group=10001 --mode=0700 /var/lib/handoff
WORKDIR /opt/handoff
# Numeric, so Kubernetes' runAsNonRoot can verify it without a passwd lookup.
USER 10001:10001
# The health port, on in the image although `handoff serve` leaves it off: it
# serves only grpc.health.v1, in plaintext and without a token, so the
# HEALTHCHECK below and the kubelet's gRPC probes keep working unchanged when
# HANDOFF_TLS_CERT/KEY turn the gRPC port to TLS only; and it tells nothing but
# SERVING or NOT_SERVING. Change or disable it (-1) with this variable, not
# with --health-port: the HEALTHCHECK reads the variable.
ENV HANDOFF_HEALTH_PORT=8081
# `handoff serve` binds loopback unless told otherwise; a container is reached
# on its own address, so the image binds every interface, explicitly. It warns
# at start while the gRPC port is plaintext without tokens (docs/security.md,
# "Production checklist").
ENV HANDOFF_HOST=0.0.0.0 \
    HANDOFF_METRICS_HOST=0.0.0.0 \
    HANDOFF_HEALTH_HOST=0.0.0.0
# The journal (docs/durability.md): a container restarted after a crash or an
# OOM kill recovers its handoffs from here. Mount a volume on it to keep it
# across containers; HANDOFF_STATE_DIR= (empty) keeps everything in memory.
ENV HANDOFF_STATE_DIR=/var/lib/handoff
EXPOSE 50051 9464 8081
# gRPC health (grpc.health.v1): healthy only while SERVING; a draining server
# reports NOT_SERVING. Through sh to pick the port: HANDOFF_HEALTH_PORT when it
# is > 0, else HANDOFF_PORT (plaintext only: it fails once TLS is on);
# `|| exit 1` keeps a usage error (exit 2, which Docker reserves) from Docker.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
    CMD ["sh", "-c", "port=${HANDOFF_PORT:-50051}; if [ \"${HANDOFF_HEALTH_PORT:-0}\" -gt 0 ] 2>/dev/null; then port=$HANDOFF_HEALTH_PORT; fi; handoff health --target \"127.0.0.1:$port\" --timeout 3 || exit 1"]
# Exec form: `handoff` is PID 1 and gets SIGTERM itself, drains, then exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["handoff", "serve"]
