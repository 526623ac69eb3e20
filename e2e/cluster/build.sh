#!/bin/bash
# Build Kubernetes v1.20.2 (kube-apiserver, kube-controller-manager, kube-scheduler, and for the real-container
# node kubelet and kube-proxy) from Debian bookworm's `kubernetes` source package (it vendors every Go
# dependency) with Debian's Go 1.19; take etcd and kubectl from Debian binary packages, and the container runtime
# (containerd 1.6, runc, the CNI plugins) unpacked from Debian's packages into node/, with the sandbox ("pause")
# image built from e2e/cluster/pause. Everything lands in one cache folder, reused when present: a cold build
# takes about 12 minutes on 2 cores, a cached one returns at once. Only what is missing is built.
#
# usage: e2e/cluster/build.sh [BIN_DIR]   (default ~/.cache/omnistage/k8s-1.20.2/bin; needs root for apt-get)
set -euo pipefail
BIN=${1:-${OMNISTAGE_K8S_BIN:-$HOME/.cache/omnistage/k8s-1.20.2/bin}}
GO_CMDS=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)
NODE=(node/containerd node/containerd-shim-runc-v2 node/ctr node/runc node/cni/bridge node/cni/host-local
      node/cni/loopback node/pause.tar)
WANT=("${GO_CMDS[@]}" kubectl etcd "${NODE[@]}")
# The sandbox image is rebuilt when its sources change (their hash is kept beside it).
PAUSE_SRC=$(cat "$(dirname "$0")"/pause/pause.go "$(dirname "$0")"/pause/oci_archive.py | sha256sum | cut -c1-16)
have_all() {
  for b in "${WANT[@]}"; do [ -e "$BIN/$b" ] || return 1; done
  [ "$(cat "$BIN/node/pause.src" 2>/dev/null)" = "$PAUSE_SRC" ]
}
if have_all; then echo "[cluster] cached binaries: $BIN"; exit 0; fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/omnistage-k8s-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$BIN"
SRC_VERSION=1.20.5+really1.20.2-1.1+deb12u1   # Debian's version string for upstream v1.20.2
log() { echo "[cluster] $*"; }

log "installing the Go toolchain from Debian (golang-go 1.19)"
# flock: scripts/run_tests.sh runs this beside scripts/build_image.sh, which may run apt-get too.
APT_LOCK=${OMNISTAGE_CACHE:-$HOME/.cache/omnistage}/apt.lock
mkdir -p "$(dirname "$APT_LOCK")"
flock "$APT_LOCK" sh -c 'apt-get update -q >/dev/null &&
  apt-get install -y -q golang-go golang-github-modern-go-reflect2-dev make rsync iptables iproute2 >/dev/null'


if [ ! -x "$BIN/etcd" ] || [ ! -x "$BIN/kubectl" ]; then
  log "unpacking etcd and kubectl 1.20 from Debian packages"
  (cd "$WORK" && apt-get download -q etcd-server kubernetes-client >/dev/null)
  for deb in "$WORK"/etcd-server_*.deb "$WORK"/kubernetes-client_*.deb; do dpkg-deb -x "$deb" "$WORK/pkgroot"; done
  install -m 0755 "$WORK/pkgroot/usr/bin/etcd" "$BIN/etcd"
  install -m 0755 "$WORK/pkgroot/usr/bin/kubectl" "$BIN/kubectl"
fi

node_files_missing() { for f in containerd containerd-shim-runc-v2 ctr runc cni/bridge cni/host-local cni/loopback \
                        cni/portmap; do [ -x "$BIN/node/$f" ] || return 0; done; return 1; }
if node_files_missing; then
  log "unpacking containerd, runc and the CNI plugins from Debian packages"
  (cd "$WORK" && apt-get download -q containerd runc containernetworking-plugins 2>&1 >/dev/null | grep -v "^W:" || true)
  for deb in "$WORK"/containerd_*.deb "$WORK"/runc_*.deb "$WORK"/containernetworking-plugins_*.deb; do
    dpkg-deb -x "$deb" "$WORK/noderoot"
  done
  mkdir -p "$BIN/node/cni"
  for b in containerd containerd-shim-runc-v2 ctr; do install -m 0755 "$WORK/noderoot/usr/bin/$b" "$BIN/node/$b"; done
  install -m 0755 "$WORK/noderoot/usr/sbin/runc" "$BIN/node/runc"
  for b in bridge host-local loopback portmap; do install -m 0755 "$WORK/noderoot/usr/lib/cni/$b" "$BIN/node/cni/$b"; done
fi

if [ ! -f "$BIN/node/pause.tar" ] || [ "$(cat "$BIN/node/pause.src" 2>/dev/null)" != "$PAUSE_SRC" ]; then
  log "building the sandbox image localhost/omnistage/pause:3.6 from e2e/cluster/pause"
  (cd "$(dirname "$0")/pause" && env GOPATH="$WORK/gopath" GO111MODULE=off CGO_ENABLED=0 HOME="$WORK" \
     GOCACHE="$WORK/gocache" go build -ldflags=-s -o "$WORK/pause" pause.go)
  mkdir -p "$BIN/node"
  python3 "$(dirname "$0")/pause/oci_archive.py" "$WORK/pause" "$BIN/node/pause.tar"
  echo "$PAUSE_SRC" > "$BIN/node/pause.src"
fi

missing=()
for b in "${GO_CMDS[@]}"; do [ -x "$BIN/$b" ] || missing+=("cmd/$b"); done
if [ ${#missing[@]} -gt 0 ]; then
  log "fetching the kubernetes $SRC_VERSION source package"
  mkdir -p "$WORK/apt/parts" "$WORK/apt/lists/partial" "$WORK/apt/cache/archives/partial" "$WORK/gopath/src/k8s.io"
  # A deb-src twin of the machine's own main Debian entry, kept in a private apt state folder.
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    awk 'BEGIN{RS="";ORS="\n\n"} NR==1' /etc/apt/sources.list.d/debian.sources \
      | sed -e 's/^Types: deb$/Types: deb-src/' -e 's/^Suites: .*/Suites: bookworm/' > "$WORK/apt/parts/src.sources"
  else
    printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: bookworm\nComponents: main\n' > "$WORK/apt/parts/src.sources"
  fi
  APTO=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$WORK/apt/parts"
        -o "Dir::State::Lists=$WORK/apt/lists" -o "Dir::Cache=$WORK/apt/cache")
  apt-get "${APTO[@]}" update -q >/dev/null
  (cd "$WORK" && apt-get "${APTO[@]}" source --download-only "kubernetes=$SRC_VERSION" 2>&1 | grep -v '^W:' || true)
  tar xzf "$WORK"/kubernetes_1.20.5+really1.20.2.orig.tar.gz -C "$WORK"
  # The vendored modern-go/reflect2 v1.0.1 does not build with Go >= 1.18: use Debian's 1.0.2.
  rm -rf "$WORK/kubernetes-1.20.2/vendor/github.com/modern-go/reflect2"
  cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 "$WORK/kubernetes-1.20.2/vendor/github.com/modern-go/reflect2"
  ln -sfn "$WORK/kubernetes-1.20.2" "$WORK/gopath/src/k8s.io/kubernetes"
  printf "KUBE_GIT_COMMIT='faecb196815e248d3ecfb03c680a4507229c2a56'\nKUBE_GIT_TREE_STATE='clean'\nKUBE_GIT_VERSION='v1.20.2'\nKUBE_GIT_MAJOR='1'\nKUBE_GIT_MINOR='20'\n" > "$WORK/version.env"
  log "compiling ${missing[*]} (about 12 minutes on 2 cores for all five)"
  (cd "$WORK/gopath/src/k8s.io/kubernetes" && env GOPATH="$WORK/gopath" GO111MODULE=off CGO_ENABLED=0 HOME="$WORK" \
     GOCACHE="$WORK/gocache" KUBE_GIT_VERSION_FILE="$WORK/version.env" \
     make WHAT="${missing[*]}" >"$WORK/make.log" 2>&1) \
    || { tail -30 "$WORK/make.log"; exit 1; }
  for b in "${missing[@]}"; do
    install -m 0755 "$WORK/kubernetes-1.20.2/_output/bin/${b#cmd/}" "$BIN/${b#cmd/}"
  done
fi
have_all
log "built into $BIN: $("$BIN/kube-apiserver" --version)"
