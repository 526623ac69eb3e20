#!/bin/bash
# Undo node-up.sh in RUN: stop the kubelet and kube-proxy, remove every pod sandbox and container left in
# containerd (their network namespaces and mounts with them), stop containerd, unmount the kubelet's volumes
# and remove the node's cgroups. Safe to run twice. Run it before down.sh (which stops the control plane).
# usage: e2e/cluster/node-down.sh BIN_DIR RUN_DIR
BIN=${1:?BIN_DIR}; RUN=${2:?RUN_DIR}
CGROUP_ROOT=omnistage-e2e
SOCK=$RUN/containerd/containerd.sock
. "$(dirname "$0")/lib.sh"
stop kubelet kube-proxy
# The containers' logs (the kubelet keeps them in /var/log/pods, whatever its root) into RUN/log/pods, to read
# after a failed run; then out of the machine's folders (this node's namespaces are all omnistage-*).
if compgen -G "/var/log/pods/omnistage-*" >/dev/null; then
  mkdir -p "$RUN/log/pods" && cp -rL /var/log/pods/omnistage-* "$RUN/log/pods/" 2>/dev/null
  rm -rf /var/log/pods/omnistage-*
  find /var/log/containers -xtype l -delete 2>/dev/null
fi
if [ -S "$SOCK" ] && [ -f "$RUN/containerd.pid" ]; then
  CTR=("$BIN/node/ctr" --address "$SOCK" -n k8s.io)
  for id in $("${CTR[@]}" containers ls -q 2>/dev/null); do
    netns=$("${CTR[@]}" containers info "$id" 2>/dev/null | python3 -c '
import json, sys
spec = json.load(sys.stdin).get("Spec") or {}
print(next((n.get("path", "") for n in spec.get("linux", {}).get("namespaces", []) if n.get("type") == "network"), ""))')
    "${CTR[@]}" tasks kill -s SIGKILL "$id" >/dev/null 2>&1
    for _ in $(seq 50); do "${CTR[@]}" tasks delete "$id" >/dev/null 2>&1 && break; "${CTR[@]}" tasks ls -q | grep -qx "$id" || break; sleep 0.1; done
    "${CTR[@]}" containers rm "$id" >/dev/null 2>&1
    case "$netns" in /var/run/netns/cni-*|/run/netns/cni-*) umount "$netns" 2>/dev/null; rm -f "$netns" ;; esac
  done
fi
stop containerd
# Whatever still runs in the node's cgroups (a run killed before it could tear down: containerd gone, shims and
# containers left), then the shims of this node's containerd.
find /sys/fs/cgroup/pids/"$CGROUP_ROOT" -name cgroup.procs -exec cat {} + 2>/dev/null | xargs -r kill -9 2>/dev/null
pkill -9 -f "containerd-shim-runc-v2 .*-address $SOCK" 2>/dev/null
for _ in $(seq 30); do
  [ -z "$(find /sys/fs/cgroup/pids/"$CGROUP_ROOT" -name cgroup.procs -exec cat {} + 2>/dev/null)" ] && break; sleep 0.1
done
# The machine-wide kernel settings the kubelet changed, as they were before node-up.sh.
if [ -f "$RUN/kernel-settings" ]; then
  while IFS='=' read -r k v; do sysctl -qw "$k=$v" 2>/dev/null; done < "$RUN/kernel-settings"
  rm -f "$RUN/kernel-settings"
fi
# The kubelet's volume mounts (tmpfs Secrets and memory emptyDirs) and containerd's leftover rootfs mounts.
grep -oE " $RUN/[^ ]+" /proc/mounts | sort -r | while read -r m; do umount -l "$m" 2>/dev/null; done
rm -f /var/lib/cni/results/e2e-*   # the CNI plugins' cache of this node's pods (network "e2e")
for c in /sys/fs/cgroup/*/"$CGROUP_ROOT"; do
  [ -d "$c" ] && find "$c" -depth -type d -exec rmdir {} \; 2>/dev/null
done
true
