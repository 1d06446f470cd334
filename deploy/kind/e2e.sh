#!/usr/bin/env bash
# The Kubernetes main flow on a real API server: a kind cluster (Docker), the gpusched
# install with the Kubernetes agent, GPU capacity faked as an extended resource, and a
# kubectl-submitted training pod that is bound, evicted through the Eviction API after
# its checkpoint, and bound again.
#
# Needs docker, kind, kubectl, and the gpusched image (`docker build -t gpusched:dev .`).
# It has not been run where this project is developed (no Docker engine there); the
# same flow runs against the API stand-in in `make test` (tests/k8s).
#
#   make e2e-kind            # or: deploy/kind/e2e.sh [cluster-name]
set -euo pipefail

CLUSTER="${1:-gpusched-e2e}"
IMAGE="${GPUSCHED_IMAGE:-gpusched:dev}"
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

need() { command -v "$1" >/dev/null || { echo "e2e-kind: $1 is not installed ($2)" >&2; exit 2; }; }
need docker "https://docs.docker.com/engine/install/"
need kind "https://kind.sigs.k8s.io/docs/user/quick-start/"
need kubectl "https://kubernetes.io/docs/tasks/tools/"
docker image inspect "$IMAGE" >/dev/null 2>&1 || {
  echo "e2e-kind: no image $IMAGE: run 'docker build -t $IMAGE .' first" >&2; exit 2; }

step() { printf '\n== %s\n' "$*"; }

step "kind cluster $CLUSTER: one control plane, three workers"
cat >"$WORK/kind.yaml" <<KIND
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
  - role: worker
  - role: worker
  - role: worker
KIND
kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --config "$WORK/kind.yaml"
kind load docker-image "$IMAGE" --name "$CLUSTER"

step "GPU nodes: 8 fake GPUs each (an extended resource), GPU feature discovery labels, pools"
pool=(inference shared shared)
i=0
for node in $(kubectl get nodes -l '!node-role.kubernetes.io/control-plane' -o name); do
  name="${node#node/}"
  kubectl label --overwrite node "$name" "gpusched.io/pool=${pool[$i]}" \
    nvidia.com/gpu.product=NVIDIA-A100-SXM4-80GB nvidia.com/gpu.count=8 nvidia.com/gpu.memory=81920
  kubectl patch node "$name" --subresource=status --type=json \
    -p '[{"op":"add","path":"/status/capacity/nvidia.com~1gpu","value":"8"}]'
  i=$((i + 1))
done

step "cert-manager (the webhook's certificate)"
kubectl apply -f https://github.com/cert-manager/cert-manager/releases/download/v1.16.2/cert-manager.yaml
kubectl -n cert-manager rollout status deploy/cert-manager-webhook --timeout=180s

step "the gpusched install with the Kubernetes agent"
kubectl create namespace gpusched --dry-run=client -o yaml | kubectl apply -f -
# The NATS certificate (deploy/k8s/cert-manager) and a throwaway PostgreSQL for the run.
kubectl apply -k "$ROOT/deploy/k8s/cert-manager"
PG_PASSWORD="$(openssl rand -hex 16)"
kubectl -n gpusched apply -f - <<PG
apiVersion: apps/v1
kind: Deployment
metadata: {name: gpusched-pg-rw}
spec:
  selector: {matchLabels: {app: gpusched-pg}}
  template:
    metadata: {labels: {app: gpusched-pg}}
    spec:
      containers:
        - name: postgres
          image: postgres:17
          env:
            - {name: POSTGRES_USER, value: gpusched}
            - {name: POSTGRES_DB, value: gpusched}
            - {name: POSTGRES_PASSWORD, value: "$PG_PASSWORD"}
          ports: [{containerPort: 5432}]
---
apiVersion: v1
kind: Service
metadata: {name: gpusched-pg-rw}
spec:
  selector: {app: gpusched-pg}
  ports: [{port: 5432}]
PG
# The Secrets, with the commands of docs/deploy.md ("Security") on a fresh bundle.
(cd "$WORK" && "$ROOT/.venv/bin/gpusched" auth init bundle >/dev/null)
openssl req -x509 -newkey rsa:2048 -nodes -subj /CN=pg -keyout "$WORK/pg.key" -out "$WORK/pg-ca.crt" 2>/dev/null
sed -n 's/^\(kubectl -n gpusched create secret generic gpusched-\(nats-auth\|creds-[a-z]*\|job-issuer\|database-tls\) .*\)$/\1/p' \
  "$ROOT/docs/deploy.md" | (cd "$WORK" && bash -x)
kubectl -n gpusched create secret generic gpusched-database \
  --from-literal=GPUSCHED_DATABASE_URL="postgresql+asyncpg://gpusched:$PG_PASSWORD@gpusched-pg-rw:5432/gpusched"
# The agent's API credential: it submits pods for team demo only (docs/kubernetes.md).
"$ROOT/.venv/bin/gpusched" auth issue --agent k8s --teams demo --dir "$WORK/bundle" --out "$WORK/agent-api.creds"
kubectl -n gpusched create secret generic gpusched-agent-api --from-file=nats.creds="$WORK/agent-api.creds"
cat >"$WORK/kustomization.yaml" <<KUST
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [$(python3 -c "import os;print(os.path.relpath('$ROOT/deploy/k8s','$WORK'))")]
components: [$(python3 -c "import os;print(os.path.relpath('$ROOT/deploy/k8s/agent-kubernetes','$WORK'))")]
images: [{name: gpusched, newName: ${IMAGE%%:*}, newTag: ${IMAGE##*:}}]
KUST
kubectl apply -k "$WORK" --load-restrictor LoadRestrictionsNone
kubectl -n gpusched rollout status deploy/gpusched-agent --timeout=300s

step "a training pod, as a user writes it, in namespace default (team demo's)"
# An operator gives the namespace its team; a pod's own team label must agree with it.
kubectl label --overwrite namespace default gpusched.io/team=demo
kubectl apply -f - <<POD
apiVersion: v1
kind: Pod
metadata:
  name: train-demo
  labels: {gpusched.io/team: demo, gpusched.io/priority-class: p2-offline}
spec:
  schedulerName: gpusched
  restartPolicy: Never
  containers:
    - name: train
      image: $IMAGE
      command: [python, /app/examples/train_loop.py, --steps, "100000", --step-seconds, "0.5"]
      resources: {limits: {nvidia.com/gpu: "8"}}
POD
kubectl wait pod/train-demo --for=jsonpath='{.spec.nodeName}' --timeout=120s
kubectl get pod train-demo -o wide
kubectl describe pod train-demo | sed -n '/Events:/,$p'

step "a node drain evicts it through the Eviction API once gpusched says so"
node="$(kubectl get pod train-demo -o jsonpath='{.spec.nodeName}')"
kubectl cordon "$node"
kubectl -n gpusched exec deploy/gpusched-admission -- gpusched node list
kubectl uncordon "$node"

step "done: kind delete cluster --name $CLUSTER removes it"
