#!/usr/bin/env bash
# `make image`: the project's image without a Docker daemon. A Debian base made with debootstrap (Python 3.11
# in /usr/local, the shape of python:3.11-slim), then buildah runs the Dockerfile on it unchanged (`--from` takes
# the place of its FROM). Out: the image in buildah's store under ~/.cache/omnistage/buildah, tagged
# localhost/omnistage/omnistage:VERSION, and an OCI archive ~/.cache/omnistage/image/omnistage-VERSION-VARIANT.tar
# (`ctr images import`, `skopeo copy oci-archive:... docker://REGISTRY/...`, `podman load`).
# The archive is written only when the image changed (its ID is kept in omnistage-VERSION-VARIANT.tar.id).
#   VARIANT=cpu|cuda      the Dockerfile's variant (cpu)
#   CPU_TORCH_INDEX=URL   torch's CPU index for the build (the Dockerfile's default: PyTorch's; where that cannot be
#                         reached, the host pip's own index, whose find-links give the CPU build as setup.sh does;
#                         the choice is kept in ~/.cache/omnistage/image/torch-index: delete it to choose again)
#   DEBIAN_MIRROR=URL     the Debian archive debootstrap reads (deb.debian.org)
# The host's pip settings go into the build read-only (its config files, the local folders and file:// indexes
# they name, its CA bundle), so a machine that installs from a mirror builds from the same mirror.
# Needs root (debootstrap, buildah's overlay storage); buildah and debootstrap come from the distribution.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${OMNISTAGE_CACHE:-$HOME/.cache/omnistage}
VARIANT=${VARIANT:-cpu}
RELEASE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
B=(buildah --root "$CACHE/buildah/root" --runroot "$CACHE/buildah/run" --storage-driver overlay)
BASE=localhost/omnistage/base:$RELEASE
VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
TAG=localhost/omnistage/omnistage:$VERSION
OUT=$CACHE/image/omnistage-$VERSION-$VARIANT.tar
step() { printf '\033[1m[image]\033[0m %s\n' "$*"; }
t0=$(date +%s)

for tool in buildah debootstrap; do
  command -v $tool >/dev/null && continue
  [ "$(id -u)" = 0 ] || { echo "make image: needs $tool (apt-get install $tool)" >&2; exit 2; }
  step "installing $tool from the distribution"
  # flock: scripts/run_tests.sh runs this beside e2e/cluster/build.sh, which may run apt-get too
  mkdir -p "$CACHE" && flock "$CACHE/apt.lock" sh -c "apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $tool >/dev/null"
done
mkdir -p "$CACHE/image"

if ! "${B[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then
  step "base: Debian $RELEASE with Python 3.11 (debootstrap, once)"
  rootfs=$CACHE/image/base-$RELEASE
  rm -rf "$rootfs"
  debootstrap --variant=minbase --include=python3.11,ca-certificates "$RELEASE" "$rootfs" "$MIRROR" \
    > "$CACHE/image/debootstrap.log"
  # /usr/local as a venv: python, python3 and pip on PATH as in python:3.11-slim, and pip may install there
  # (python3.11-venv after the base: in debootstrap's own list it fails to configure)
  chroot "$rootfs" sh -c 'apt-get update -qq && apt-get install -y -qq --no-install-recommends python3.11-venv &&
    python3.11 -m venv /usr/local && ln -sf python3.11 /usr/local/bin/python3 &&
    apt-get clean && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin' >> "$CACHE/image/debootstrap.log"
  c=$("${B[@]}" from scratch)
  m=$("${B[@]}" mount "$c")
  tar -C "$rootfs" --exclude='./proc/*' --exclude='./sys/*' --exclude='./dev/*' -cf - . | tar -C "$m" -xf -
  "${B[@]}" umount "$c" >/dev/null
  "${B[@]}" config --env PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --cmd python3 "$c"
  "${B[@]}" commit -q "$c" "$BASE" >/dev/null
  "${B[@]}" rm "$c" >/dev/null
  rm -rf "$rootfs"
fi

# The host's pip settings: all of them (its files' and its PIP_* environment's) as the build's /etc/pip.conf,
# and the files and folders they name read-only at the same paths.
mounts=()
add_mount() { [ -e "$1" ] && mounts+=(-v "$1:$1:ro") || true; }
add_mount /etc/ssl/certs/ca-certificates.crt
if python3 -m pip --version >/dev/null 2>&1; then
  { echo "[global]"; python3 -m pip config list 2>/dev/null | sed -n "s/^[^.]*\.\([a-z-]*\)='\(.*\)'$/\1 = \2/p" |
    awk -F' = ' '!seen[$1]++'; } \
    > "$CACHE/image/pip.conf"
  mounts+=(-v "$CACHE/image/pip.conf:/etc/pip.conf:ro")
  while read -r value; do
    for v in $value; do
      case "$v" in file:///*/simple) v=${v#file://}; v=${v%/simple} ;; file://*) v=${v#file://} ;; esac
      case "$v" in /*) add_mount "$v" ;; esac   # a local index: its folder, whose files its pages name
    done
  done < <(python3 -m pip config list 2>/dev/null | sed -n "s/^[^=]*\.\(find-links\|index-url\|extra-index-url\|constraint\|cert\)='\(.*\)'$/\2/p")
fi
args=(--build-arg "VARIANT=$VARIANT")
# Decided once per machine and kept (a network blip must not change a build argument: the cache would miss).
if [ -z "${CPU_TORCH_INDEX:-}" ] && [ "$VARIANT" = cpu ] && [ -s "$CACHE/image/torch-index" ]; then
  CPU_TORCH_INDEX=$(cat "$CACHE/image/torch-index")
elif [ -z "${CPU_TORCH_INDEX:-}" ] && [ "$VARIANT" = cpu ]; then
  pytorch=$(sed -n 's/^ARG CPU_TORCH_INDEX=//p' Dockerfile)
  if curl -sf -m 10 -o /dev/null "$pytorch/torch/"; then
    echo "$pytorch" > "$CACHE/image/torch-index"
  else
    # The same choice on every run, so the build's cache keeps hitting (a build argument is part of its key).
    CPU_TORCH_INDEX=$(python3 -m pip config list 2>/dev/null | sed -n "s/^[^.]*\.\(index-url\|extra-index-url\)='\([^ ']*\).*$/\1 \2/p" |
                      sort -r | head -1 | cut -d' ' -f2)
    [ -n "$CPU_TORCH_INDEX" ] || { echo "make image: $pytorch cannot be reached and pip names no other index: set CPU_TORCH_INDEX" >&2; exit 2; }
    step "$pytorch cannot be reached: torch's CPU build from this machine's pip index, $CPU_TORCH_INDEX"
    echo "$CPU_TORCH_INDEX" > "$CACHE/image/torch-index"
  fi
fi
[ -n "${CPU_TORCH_INDEX:-}" ] && args+=(--build-arg "CPU_TORCH_INDEX=$CPU_TORCH_INDEX")

step "building $TAG ($VARIANT) from the Dockerfile on $BASE"
"${B[@]}" bud --isolation chroot --layers --from "$BASE" "${args[@]}" "${mounts[@]}" -f Dockerfile -t "$TAG" .
# The archive's image ID and size beside it (written once the archive is whole): a build that changed nothing
# (every layer cached) gives the same ID, and the archive already holds it; writing it again takes minutes.
id=$("${B[@]}" inspect --type image --format '{{.FromImageID}}' "$TAG")
if [ -f "$OUT" ] && [ "$(cat "$OUT.id" 2>/dev/null)" = "$id $(stat -c %s "$OUT")" ]; then
  step "reusing $OUT: it holds this image already (${id:0:12})"
else
  step "writing $OUT"
  rm -f "$OUT" "$OUT.id"
  "${B[@]}" push -q "$TAG" "oci-archive:$OUT:$TAG"
  echo "$id $(stat -c %s "$OUT")" > "$OUT.id"
fi
step "done in $(( $(date +%s) - t0 ))s: $TAG (${id:0:12}), $(du -h "$OUT" | cut -f1) archive"
