#!/bin/bash
# Start a real Kubernetes node beside up.sh's control plane: containerd 1.6 (CRI, runc, CNI bridge), a kubelet
# and kube-proxy (iptables), all built or unpacked by build.sh. Runs only inside a private network namespace
# (e2e/cluster/in-netns.sh): the pod bridge cni0 (10.88.0.0/16, the node at 10.88.0.1), the Service routes and
# kube-proxy's iptables rules live there, and nothing reaches out of it. Images are imported from OCI archives
# into containerd's store, kept under CACHE/containerd so an image is unpacked once (an unchanged archive is
# not imported again). Writes into RUN: containerd/, kubelet/, node.yaml, *.pid, log/{containerd,kubelet,
# kube-proxy}.log. node-down.sh undoes it.
# usage: e2e/cluster/node-up.sh BIN_DIR RUN_DIR [IMAGE_ARCHIVE...]
#   env NODE_REIMPORT=1: remove the archives' images from the store first and import them again (to time it)
set -euo pipefail
BIN=${1:?BIN_DIR}; RUN=${2:?RUN_DIR}; shift 2
CACHE=${OMNISTAGE_CACHE:-$HOME/.cache/omnistage}
NODE_NAME=${NODE_NAME:-e2e-real}
NODE_IP=10.88.0.1
POD_CIDR=10.88.0.0/16
SERVICE_CIDR=10.96.0.0/16          # up.sh's --service-cluster-ip-range
CGROUP_ROOT=omnistage-e2e          # the kubelet's cgroups go under this parent in each controller
CTD=$RUN/containerd
SOCK=$CTD/containerd.sock
log() { echo "[node] $*"; }
# Only loopback, the pod bridge and pods' veths may exist here: anything else is a way out of the machine.
# (/sys/class/net shows the namespace sysfs was mounted in: ask the kernel through ip instead.)
for dev in $(ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1); do
  case "$dev" in lo|cni0|veth*) ;; *)
    echo "node-up.sh: interface $dev is here: run inside a private network namespace" \
         "(e2e/cluster/in-netns.sh), not the machine's own" >&2
    exit 2 ;;
  esac
done
mkdir -p "$CTD/net.d" "$RUN/log" "$RUN/kubelet" "$CACHE/containerd"
. "$(dirname "$0")/lib.sh"

# The pod bridge before any pod: kube-proxy needs the node address and the Service range routed to it
# (no default route exists in this namespace), and the CNI bridge plugin adopts it.
ip link set lo up
ip link show cni0 >/dev/null 2>&1 || ip link add cni0 type bridge
ip addr replace "$NODE_IP/16" dev cni0
ip link set cni0 up
ip route replace "$SERVICE_CIDR" dev cni0
# Bridged pod-to-Service traffic must pass iptables (kube-proxy's DNAT), hairpin included: the kernel's
# br_netfilter (these settings are this namespace's own).
[ -e /proc/sys/net/bridge/bridge-nf-call-iptables ] || {
  echo "node-up.sh: the kernel has no br_netfilter (/proc/sys/net/bridge): load it (modprobe br_netfilter)" >&2; exit 2; }
sysctl -qw net.bridge.bridge-nf-call-iptables=1
sysctl -qw net.ipv4.ip_forward=1
# The kubelet sets these machine-wide kernel settings at start (not per namespace): node-down.sh puts them back.
KERNEL_SETTINGS="vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys kernel.keys.root_maxbytes"
[ -f "$RUN/kernel-settings" ] || for k in $KERNEL_SETTINGS; do echo "$k=$(sysctl -n "$k")"; done > "$RUN/kernel-settings"

# cgroup v1 (this kind of VM): the kubelet requires its --cgroup-root to exist in every controller.
for c in /sys/fs/cgroup/*/; do
  [ -d "$c" ] && [ "$(basename "$c")" != unified ] || continue
  mkdir -p "$c$CGROUP_ROOT"
  [ -f "$c/cpuset.cpus" ] && cat "$c/cpuset.cpus" > "$c$CGROUP_ROOT/cpuset.cpus" && cat "$c/cpuset.mems" > "$c$CGROUP_ROOT/cpuset.mems"
done

cat > "$CTD/net.d/10-e2e.conflist" <<J
{"cniVersion": "0.4.0", "name": "e2e", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$NODE_IP"}]],
            "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "$CTD/cni-ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
J
# restrict_oom_score_adj: CRI asks a sandbox for oom_score_adj -998, which needs CAP_SYS_RESOURCE; without it
# (containers in a VM, CI runners) runc fails every sandbox. Kept within what the process may set instead.
cat > "$CTD/config.toml" <<T
version = 2
root = "$CACHE/containerd"
state = "$CTD/state"
[grpc]
  address = "$SOCK"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/omnistage/pause:3.6"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$BIN/node/cni"
    conf_dir = "$CTD/net.d"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "$BIN/node/runc"
T
t0=$(date +%s.%N)
PATH=$BIN/node:$PATH start containerd "$BIN/node/containerd" --config "$CTD/config.toml"
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
CTR=("$BIN/node/ctr" --address "$SOCK" -n k8s.io)
"${CTR[@]}" version >/dev/null || { tail -20 "$RUN/log/containerd.log" >&2; exit 1; }
# Records of an earlier run that could not tear down (the store is cached): none of them runs any more.
for id in $("${CTR[@]}" containers ls -q); do "${CTR[@]}" containers rm "$id" >/dev/null 2>&1 || true; done

# Images: import an archive only when its manifest is not in the store yet (a 4 GB image takes a minute).
for archive in "$BIN/node/pause.tar" "$@"; do
  read -r ref digest < <(python3 - "$archive" <<'P'
import json, sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    m = json.load(t.extractfile("index.json"))["manifests"][0]
print(m["annotations"]["org.opencontainers.image.ref.name"], m["digest"])
P
)
  if [ "${NODE_REIMPORT:-0}" = 1 ] && [ "$archive" != "$BIN/node/pause.tar" ]; then
    # every name of it (CRI adds its own, sha256:ID), so that its content and snapshots go too
    "${CTR[@]}" images ls | awk -v d="$digest" '$3 == d {print $1}' | xargs -r "${CTR[@]}" images rm --sync >/dev/null
  fi
  if "${CTR[@]}" images ls -q "name==$ref" | grep -qx "$ref" &&
     [ "$("${CTR[@]}" images ls "name==$ref" | awk 'NR==2 {print $3}')" = "$digest" ]; then
    log "image $ref ($digest) already in containerd"
  else
    ti=$(date +%s.%N)
    "${CTR[@]}" images import "$archive" >/dev/null
    log "imported $ref from $archive in $(awk -v a="$ti" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')s"
  fi
done

P=$RUN/pki
cat > "$RUN/kubelet.yaml" <<K
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
cgroupRoot: /$CGROUP_ROOT
address: 0.0.0.0
port: 10250
readOnlyPort: 0
healthzPort: 0
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $P/ca.crt}
authorization: {mode: AlwaysAllow}
tlsCertFile: $P/apiserver.crt
tlsPrivateKeyFile: $P/apiserver.key
failSwapOn: false
# A shared build machine: never evict for disk or memory pressure, never collect the (large) project image.
evictionHard: {memory.available: "1Mi", nodefs.available: "1%", imagefs.available: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
syncFrequency: 10s
clusterDomain: cluster.local
K
start kubelet "$BIN/kubelet" --config "$RUN/kubelet.yaml" --kubeconfig "$RUN/admin.kubeconfig" \
  --container-runtime=remote --container-runtime-endpoint="unix://$SOCK" --runtime-request-timeout=5m \
  --root-dir="$RUN/kubelet" --hostname-override="$NODE_NAME" --node-ip="$NODE_IP" \
  --pod-infra-container-image=localhost/omnistage/pause:3.6
# conntrack settings left alone: /proc/sys/net/netfilter is read-only here.
start kube-proxy "$BIN/kube-proxy" --kubeconfig "$RUN/admin.kubeconfig" --hostname-override="$NODE_NAME" \
  --proxy-mode=iptables --cluster-cidr="$POD_CIDR" --conntrack-max-per-core=0 \
  --conntrack-tcp-timeout-established=0 --conntrack-tcp-timeout-close-wait=0 \
  --metrics-bind-address=127.0.0.1:10249 --healthz-bind-address=127.0.0.1:10256
log "containerd, kubelet and kube-proxy started for node $NODE_NAME ($NODE_IP) in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')s"
