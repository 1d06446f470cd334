# One image for every gpusched service: `docker run IMAGE service <name>`,
# `docker run IMAGE migrate`, or any other `gpusched` subcommand.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# /metrics is unauthenticated, so the image does not choose the interface: it stays on
# the settings default (127.0.0.1) unless the deployment sets GPUSCHED_METRICS_HOST
# (compose: the container's network; Kubernetes: the pod IP, behind a NetworkPolicy).
ENV GPUSCHED_METRICS_PORT=9100

# Writable state (the agent's job dirs and checkpoints) lives outside the code tree,
# so the code stays owned by root and read-only for the service user.
ENV GPUSCHED_DATA_DIR=/var/lib/gpusched \
    GPUSCHED_AGENT__WORKDIR=/var/lib/gpusched/agent

RUN groupadd --system --gid 10001 gpusched \
    && useradd --system --uid 10001 --gid gpusched --home-dir /var/lib/gpusched \
       --create-home --shell /usr/sbin/nologin gpusched

WORKDIR /app

# The wheel build (hatchling) needs pyproject.toml, README.md and both package roots;
# copying only these first keeps the dependency layer cached across deploy/ edits.
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
# Extras of the package: `kubernetes` runs the Kubernetes agent (deploy/k8s/agent-
# kubernetes); `docker build --build-arg EXTRAS=[kubernetes,s3] .` also lets the
# checkpoint service verify s3:// claims (docs/kubernetes.md, "Checkpoint storage").
ARG EXTRAS="[kubernetes]"
RUN pip install --no-cache-dir ".${EXTRAS}"

# Relative paths in the settings (deploy/inventory/demo.yaml, deploy/prices.yaml)
# resolve against WORKDIR; Kubernetes mounts its ConfigMap over these files.
COPY deploy ./deploy
# Scripts the simulated cluster may launch; a workload's argv is relative to /app.
COPY examples ./examples

USER 10001:10001
EXPOSE 9100

ENTRYPOINT ["gpusched"]
CMD ["service", "admission"]
