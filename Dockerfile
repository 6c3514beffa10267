# rolloutd on the official vLLM image: CUDA, PyTorch and vLLM come version-matched from upstream,
# rolloutd adds its own dependencies without moving any package the image already pins.
#
#   docker build -t rolloutd:0.1.0 .
#   docker run --gpus all --shm-size 8g -p 50051:50051 -p 8080:8080 \
#     -e ROLLOUTD_AUTH__TOKEN="$(openssl rand -hex 32)" rolloutd:0.1.0
#
# The configuration binds every interface, which rolloutd refuses without a bearer token
# (docs/security.md); trainers pass the same token.
FROM vllm/vllm-openai:v0.32.0

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/rolloutd

WORKDIR /opt/rolloutd
COPY pyproject.toml README.md ./
COPY service ./service

# The constraints file freezes every package of the base image (vllm, torch, protobuf, grpcio,
# pydantic, ...) at its shipped version: if rolloutd's requirements disagree with vLLM's, the build
# fails here instead of producing an image whose vLLM was silently up- or downgraded.
RUN python3 -m pip list --format=freeze > /tmp/image-constraints.txt \
    && python3 -m pip install --no-cache-dir --constraint /tmp/image-constraints.txt ".[s3]" \
    && rm -rf /tmp/image-constraints.txt /opt/rolloutd/service \
    && rolloutd --help > /dev/null

# A fixed, high UID outside the base image's range; fsGroup in the pod spec matches it so the
# checkpoint volume is writable.
RUN useradd --no-log-init --uid 10001 --user-group --create-home --home-dir /home/rolloutd \
        --shell /usr/sbin/nologin rolloutd \
    && mkdir -p /etc/rolloutd /var/lib/rolloutd/checkpoints /var/cache/rolloutd \
    && chown -R rolloutd:rolloutd /var/lib/rolloutd /var/cache/rolloutd

COPY k8s/base/config/rolloutd.yaml /etc/rolloutd/rolloutd.yaml

USER 10001:10001
WORKDIR /home/rolloutd

# 50051: gRPC (rolloutd.v1.RolloutService, grpc.health.v1.Health, reflection)
# 8080: admin HTTP (/healthz, /readyz, /metrics, /v1/status, /v1/checkpoints)
EXPOSE 50051 8080

# /healthz answers as soon as the admin app is up (liveness, not readiness); the start period covers
# model load and restore. Kubernetes ignores HEALTHCHECK and uses the gRPC probes of the manifests.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]

# Exec form: rolloutd is PID 1 and receives SIGTERM itself, drains and takes its final checkpoint.
ENTRYPOINT ["rolloutd"]
CMD ["serve", "--config", "/etc/rolloutd/rolloutd.yaml"]
