#!/bin/bash
# Stop what up.sh (and the harness) started in RUN, by recorded PID, newest first: the node agent
# first so it stops its pods, then the control plane. Safe to run twice.
RUN=${1:?RUN_DIR}
. "$(dirname "$0")/lib.sh"
stop operator node-agent kube-scheduler kube-controller-manager kube-apiserver etcd
true
