#!/bin/bash
# Run COMMAND in a new, private network namespace: only a loopback interface at first (node-up.sh adds the pod
# bridge), no route out of it, so nothing the command starts can reach or be reached from another address.
# Mounts, processes and files are the machine's own. The namespace ends with the last process in it.
# The machine's own network namespace stays open on file descriptor $OMNISTAGE_OUTER_NETNS_FD, for the one
# step that needs the network (building the image: `nsenter --net=/proc/self/fd/FD`).
# usage: e2e/cluster/in-netns.sh COMMAND [ARG...]
set -euo pipefail
exec 9</proc/self/ns/net
export OMNISTAGE_OUTER_NETNS_FD=9
exec unshare --net --propagation unchanged -- sh -c 'ip link set lo up && exec "$@"' in-netns "$@"
