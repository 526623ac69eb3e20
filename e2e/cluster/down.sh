#!/bin/bash
# Stop what up.sh (and the harness) started in RUN, by recorded PID, newest first: the node agent
# first so it stops its pods, then the control plane. Safe to run twice.
RUN=${1:?RUN_DIR}
stop() {
  for name in "$@"; do
    f="$RUN/$name.pid"; [ -f "$f" ] || continue
    pid=$(cat "$f")
    if kill "$pid" 2>/dev/null; then
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null && echo "[cluster] $name ($pid) needed SIGKILL"
    fi
    rm -f "$f"
  done
}
stop operator node-agent kube-scheduler kube-controller-manager kube-apiserver etcd
true
