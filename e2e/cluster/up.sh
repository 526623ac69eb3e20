#!/bin/bash
# Start a Kubernetes v1.20.2 control plane on 127.0.0.1: etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler (no kubelet: e2e/node_agent.py stands in for one). Writes into RUN:
#   pki/                   a CA and certificates (made once per RUN folder)
#   admin.kubeconfig       cluster admin
#   operator.kubeconfig    user "omnistage-operator" (no groups: the e2e binds it to the chart's ClusterRole)
#   pki/webhook.{crt,key}  serving certificate for a webhook on 127.0.0.1 (SAN IP:127.0.0.1)
#   log/audit.log          every write request (JSON lines), to count the operator's writes
#   *.pid, log/*.log       one per process; down.sh stops them by PID
# usage: e2e/cluster/up.sh BIN_DIR RUN_DIR      env: APISERVER_PORT (6443), ETCD_PORT (2379; +1, +2 used too),
#   KUBELET_ADDRESS_TYPES (how the apiserver reaches a kubelet for logs and exec: Hostname,InternalIP),
#   APISERVER_BIND, APISERVER_ADVERTISE (127.0.0.1: a real node's pods reach the API at the node's address)
set -euo pipefail
BIN=${1:?BIN_DIR}; RUN=${2:?RUN_DIR}
PORT=${APISERVER_PORT:-6443}; EPORT=${ETCD_PORT:-2379}
mkdir -p "$RUN/pki" "$RUN/log"
P=$RUN/pki
cert() { # file CN [O] [extfile]: a client or server certificate signed by the CA
  local f=$1 cn=$2 o=${3:-} ext=${4:-} subj="/CN=$2"
  [ -n "$o" ] && subj="/O=$o/CN=$cn"
  openssl req -newkey rsa:2048 -nodes -keyout "$P/$f.key" -out "$P/$f.csr" -subj "$subj" 2>/dev/null
  if [ -n "$ext" ]; then
    openssl x509 -req -in "$P/$f.csr" -CA "$P/ca.crt" -CAkey "$P/ca.key" -CAcreateserial -out "$P/$f.crt" \
      -days 3650 -extfile "$ext" -extensions ext 2>/dev/null
  else
    openssl x509 -req -in "$P/$f.csr" -CA "$P/ca.crt" -CAkey "$P/ca.key" -CAcreateserial -out "$P/$f.crt" -days 3650 2>/dev/null
  fi
}
if [ ! -f "$P/ca.crt" ]; then
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$P/ca.key" -out "$P/ca.crt" -days 3650 -subj "/CN=omnistage-e2e-ca" 2>/dev/null
  openssl genrsa -out "$P/sa.key" 2048 2>/dev/null; openssl rsa -in "$P/sa.key" -pubout -out "$P/sa.pub" 2>/dev/null
  printf '[req]\ndistinguished_name=dn\n[dn]\n[ext]\nsubjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' \
    "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:10.96.0.1" > "$P/apiserver.cnf"
  # The Go 1.19 apiserver checks only the SAN of a webhook's certificate, never its CN.
  printf '[req]\ndistinguished_name=dn\n[dn]\n[ext]\nsubjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' > "$P/webhook.cnf"
  cert apiserver kube-apiserver "" "$P/apiserver.cnf"
  cert webhook omnistage-webhook "" "$P/webhook.cnf"
  cert admin admin system:masters
  cert kubelet-client kubelet-client system:masters
  cert controller-manager system:kube-controller-manager
  cert scheduler system:kube-scheduler
  cert operator omnistage-operator
  cat "$P/webhook.crt" "$P/ca.crt" > "$P/webhook-chain.crt"
fi
kubeconfig() { # name cert
  cat > "$RUN/$1.kubeconfig" <<K
apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster: {server: "https://127.0.0.1:$PORT", certificate-authority: "$P/ca.crt"}
users:
- name: $1
  user: {client-certificate: "$P/$2.crt", client-key: "$P/$2.key"}
contexts:
- name: e2e
  context: {cluster: e2e, user: $1}
current-context: e2e
K
}
kubeconfig admin admin; kubeconfig controller-manager controller-manager; kubeconfig scheduler scheduler
kubeconfig operator operator
cat > "$RUN/audit-policy.yaml" <<'A'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  verbs: [create, update, patch, delete, deletecollection]
- level: None
A
. "$(dirname "$0")/lib.sh"
t0=$(date +%s.%N)
start etcd "$BIN/etcd" --name e2e --data-dir "$RUN/etcd" \
  --listen-client-urls "http://127.0.0.1:$EPORT" --advertise-client-urls "http://127.0.0.1:$EPORT" \
  --listen-peer-urls "http://127.0.0.1:$((EPORT + 1))" --initial-advertise-peer-urls "http://127.0.0.1:$((EPORT + 1))" \
  --initial-cluster "e2e=http://127.0.0.1:$((EPORT + 1))" --listen-metrics-urls "http://127.0.0.1:$((EPORT + 2))" \
  --unsafe-no-fsync
# --enable-aggregator-routing: webhooks behind a Service are called on its endpoint (pod) IPs, since
# nothing here routes Service virtual IPs (no kube-proxy).
start kube-apiserver "$BIN/kube-apiserver" --advertise-address="${APISERVER_ADVERTISE:-127.0.0.1}" \
  --bind-address="${APISERVER_BIND:-127.0.0.1}" \
  --secure-port="$PORT" --insecure-port=0 --etcd-servers="http://127.0.0.1:$EPORT" \
  --client-ca-file="$P/ca.crt" --tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" \
  --kubelet-client-certificate="$P/kubelet-client.crt" --kubelet-client-key="$P/kubelet-client.key" \
  --service-account-key-file="$P/sa.pub" --service-account-signing-key-file="$P/sa.key" \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --api-audiences=https://kubernetes.default.svc.cluster.local \
  --service-cluster-ip-range=10.96.0.0/16 --authorization-mode=Node,RBAC --allow-privileged=false \
  --enable-aggregator-routing=true --kubelet-preferred-address-types="${KUBELET_ADDRESS_TYPES:-Hostname,InternalIP}" --profiling=false \
  --audit-policy-file="$RUN/audit-policy.yaml" --audit-log-path="$RUN/log/audit.log" --audit-log-format=json \
  --audit-log-maxsize=200 --audit-log-maxbackup=1
A=(--cacert "$P/ca.crt" --cert "$P/admin.crt" --key "$P/admin.key")
ok=
for _ in $(seq 1 300); do
  if curl -sf "${A[@]}" "https://127.0.0.1:$PORT/readyz" >/dev/null 2>&1; then ok=1; break; fi
  kill -0 "$(cat "$RUN/kube-apiserver.pid")" 2>/dev/null || break
  sleep 0.2
done
[ -n "$ok" ] || { echo "[cluster] kube-apiserver did not become ready; last log lines:" >&2; tail -20 "$RUN/log/kube-apiserver.log" >&2; exit 1; }
t1=$(date +%s.%N)
# Client rate limits raised from 20/30 QPS: with hundreds of pods (bench/operator_reconcile.py) the
# defaults, not the machine, would set the pace of ReplicaSets, pods and EndpointSlices.
start kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig="$RUN/controller-manager.kubeconfig" \
  --kube-api-qps=200 --kube-api-burst=400 \
  --authentication-kubeconfig="$RUN/controller-manager.kubeconfig" --authorization-kubeconfig="$RUN/controller-manager.kubeconfig" \
  --bind-address=127.0.0.1 --port=0 --secure-port=0 --leader-elect=false \
  --service-account-private-key-file="$P/sa.key" --root-ca-file="$P/ca.crt" --use-service-account-credentials=true \
  --cluster-signing-cert-file="$P/ca.crt" --cluster-signing-key-file="$P/ca.key" \
  --controllers='*,bootstrapsigner,tokencleaner'
start kube-scheduler "$BIN/kube-scheduler" --kubeconfig="$RUN/scheduler.kubeconfig" --kube-api-qps=200 --kube-api-burst=400 \
  --authentication-kubeconfig="$RUN/scheduler.kubeconfig" --authorization-kubeconfig="$RUN/scheduler.kubeconfig" \
  --bind-address=127.0.0.1 --port=0 --secure-port=0 --leader-elect=false
awk -v a="$t0" -v b="$t1" -v p="$PORT" 'BEGIN{printf "[cluster] control plane up on https://127.0.0.1:%s (apiserver ready in %.1fs)\n", p, b - a}'
