#!/usr/bin/env bash
# Kilo 0.7.0's own agent as an image, for the e2e's round trip Kilo -> kg -> Kilo:
#   local/kilo:0.7.0   Kilo's kg built from its source with Debian's Go; Debian's iptables (nft),
#                      ipset, the CNI plugins Kilo's init container copies, busybox for its shell
# Kilo 0.7.0 declares Go 1.25, which Debian 12 lacks: its code is built on Kilo 0.6.0's vendored
# modules (go 1.18), where the older client-go's AddEventHandler returns no value (two lines).
# Usage: kilo-image.sh KILO_GIT OUT_DIR   (KILO_GIT: a clone of github.com/squat/kilo with its tags)
# Prints "kilo REF FILE". Needs golang-go, umoci, skopeo.
set -euo pipefail
src=$1
out=$2
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

mkdir -p "$work/0.6.0" "$work/build"
git --git-dir="$src" archive 0.7.0 | tar -x -C "$work/build"
git --git-dir="$src" archive 0.6.0 vendor go.mod go.sum | tar -x -C "$work/0.6.0"
rm -rf "$work/build/vendor"
mv "$work/0.6.0/vendor" "$work/0.6.0/go.mod" "$work/0.6.0/go.sum" "$work/build/"
sed -i 's/_, err := \([np]b\)\.informer\.AddEventHandler(/var err error\n\t\1.informer.AddEventHandler(/' \
  "$work/build/pkg/k8s/backend.go"
(cd "$work/build" && CGO_ENABLED=0 GOFLAGS=-mod=vendor GOPROXY=off \
  go build -ldflags "-X github.com/squat/kilo/pkg/version.Version=0.7.0" -o "$work/kg" ./cmd/kg)

rootfs() {
  local r=$1 deb
  mkdir -p "$work/debs" "$r/opt/bin" "$r/opt/cni/bin" "$r/tmp" "$r/bin"
  chmod 1777 "$r/tmp"
  (cd "$work/debs" && apt-get download libc6 iptables libip4tc2 libip6tc2 libxtables12 \
    libnetfilter-conntrack3 libnfnetlink0 libnftnl11 libmnl0 ipset libipset13 netbase \
    busybox-static containernetworking-plugins >/dev/null 2>&1)
  for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$r"; done
  # What update-alternatives does on install: iptables is the nf_tables variant, as Debian's default.
  local t
  for t in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
    ln -sf xtables-nft-multi "$r/usr/sbin/$t"
  done
  for t in $("$r/bin/busybox" --list); do [ -e "$r/bin/$t" ] || ln -s busybox "$r/bin/$t"; done
  for t in bridge host-local loopback portmap; do cp "$r/usr/lib/cni/$t" "$r/opt/cni/bin/"; done
  cp "$work/kg" "$r/opt/bin/kg"
}

layout="$work/oci" bundle="$work/bundle" file="$out/kilo.tar"
umoci init --layout "$layout"
umoci new --image "$layout:0.7.0"
umoci unpack --image "$layout:0.7.0" "$bundle" >/dev/null
rootfs "$bundle/rootfs"
umoci repack --image "$layout:0.7.0" "$bundle"
umoci config --image "$layout:0.7.0" --os linux --architecture amd64 \
  --config.env PATH=/usr/sbin:/usr/bin:/sbin:/bin --config.entrypoint /opt/bin/kg
rm -f "$file"
skopeo copy -q "oci:$layout:0.7.0" "docker-archive:$file:local/kilo:0.7.0"
echo "kilo local/kilo:0.7.0 $file"
