#!/usr/bin/env bash
# The e2e cluster's images besides kilo-rs', assembled here with umoci and skopeo (no image
# registry is reachable), each a docker-archive for `ctr images import`:
#   local/pause:1               a static C program that waits for SIGTERM (the pod sandbox)
#   local/busybox:debian        Debian's busybox-static (test pods, the CNI install step)
#   local/wireguard-go:debian   Debian's wireguard-go with the two libraries it links
# Usage: e2e-images.sh OUT_DIR; prints "NAME REF FILE" per image. Needs gcc, umoci, skopeo.
set -euo pipefail
out=$1
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# image NAME TAG ROOTFS_SETUP_FUNCTION [umoci config args...]
image() {
  local name=$1 tag=$2 setup=$3
  shift 3
  local layout="$work/$name-oci" bundle="$work/$name-bundle" file="$out/$name.tar"
  umoci init --layout "$layout"
  umoci new --image "$layout:$tag"
  umoci unpack --image "$layout:$tag" "$bundle" >/dev/null
  "$setup" "$bundle/rootfs"
  umoci repack --image "$layout:$tag" "$bundle"
  umoci config --image "$layout:$tag" --os linux --architecture amd64 \
    --config.env PATH=/usr/bin:/bin "$@"
  rm -f "$file"
  skopeo copy -q "oci:$layout:$tag" "docker-archive:$file:local/$name:$tag"
  echo "$name local/$name:$tag $file"
}


pause_rootfs() {
  cat >"$work/pause.c" <<'C'
#include <signal.h>
#include <unistd.h>
static void stop(int sig) { (void)sig; _exit(0); }
int main(void) {
  signal(SIGTERM, stop);
  signal(SIGINT, stop);
  for (;;) pause();
}
C
  gcc -static -Os -s -o "$1/pause" "$work/pause.c"
}
image pause 1 pause_rootfs --config.entrypoint /pause

# busybox-static conflicts with the busybox package the tests install: unpack it, do not install it.
busybox_rootfs() {
  (cd "$work" && apt-get download busybox-static >/dev/null 2>&1 && dpkg-deb -x busybox-static_*.deb bb)
  mkdir -p "$1/bin" "$1/tmp"
  chmod 1777 "$1/tmp"
  cp "$work/bb/bin/busybox" "$1/bin/busybox"
  local a
  for a in $("$1/bin/busybox" --list); do [ "$a" = busybox ] || ln -s busybox "$1/bin/$a"; done
}
image busybox debian busybox_rootfs --config.cmd sh

wireguard_rootfs() {
  mkdir -p "$1/usr/bin"
  cp /usr/bin/wireguard-go "$1/usr/bin/"
  local lib
  for lib in $(ldd /usr/bin/wireguard-go | grep -o '/[^ ]*'); do
    mkdir -p "$1$(dirname "$lib")"
    cp -L "$lib" "$1$lib"
  done
}
image wireguard-go debian wireguard_rootfs
