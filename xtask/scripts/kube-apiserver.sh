#!/usr/bin/env bash
# Builds Kubernetes binaries from Debian bookworm's `kubernetes` source package (the only ones
# this kind of machine can get: no registry ships them) into OUT_DIR, one Go build for all of
# them, and puts the same release's kubectl (Debian's kubernetes-client, unpacked, not
# installed: the machine may have another kubectl at /usr/bin) beside them.
# Usage: kube-apiserver.sh DEBIAN_SOURCE_VERSION OUT_DIR [CMD...]   (CMD default: kube-apiserver;
# e.g. kube-apiserver kubelet kube-controller-manager kube-scheduler kube-proxy)
# Needs: golang-go, golang-github-modern-go-reflect2-dev, dpkg-dev, rsync and a deb-src line
# (xtask setup provides them). The comment above each step says why it is needed.
set -euo pipefail
version=$1
out=$2
shift 2
cmds=("${@:-kube-apiserver}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
apt-get source --download-only "kubernetes=$version" >/dev/null 2>&1
upstream=${version%-*}
mkdir src
tar -xzf "kubernetes_${upstream}.orig.tar.gz" -C src --strip-components=1
tar -xJf "kubernetes_${version}.debian.tar.xz" -C src
cd src
# Debian's patches, in order (quilt's series file).
while read -r p; do
  case "$p" in ''|\#*) continue ;; esac
  patch -p1 -s < "debian/patches/$p"
done < debian/patches/series
# The vendored reflect2 1.0.1 crashes (SIGSEGV) under Go >= 1.18 on the first request that
# touches a custom resource: use Debian's 1.0.2.
rm -rf vendor/github.com/modern-go/reflect2
rsync -a --exclude '*_test.go' /usr/share/gocode/src/github.com/modern-go/reflect2/ vendor/github.com/modern-go/reflect2/
mkdir -p "$work/gopath/src/k8s.io"
ln -s "$work/src" "$work/gopath/src/k8s.io/kubernetes"
cd "$work/gopath/src/k8s.io/kubernetes"
what=$(printf 'cmd/%s ' "${cmds[@]}")
# Lowest priority: the machine's cores are shared.
GOPATH="$work/gopath" GOPROXY=off GOFLAGS=-mod=vendor CGO_ENABLED=0 GO111MODULE=on \
  KUBE_GIT_VERSION=v1.20.2 KUBE_GIT_TREE_STATE=archive \
  nice -n 19 make WHAT="${what% }" >/dev/null
mkdir -p "$out.partial"
for c in "${cmds[@]}"; do cp "_output/local/bin/linux/amd64/$c" "$out.partial/"; done
cd "$work"
apt-get download "kubernetes-client=$version" >/dev/null 2>&1
dpkg-deb -x kubernetes-client_*.deb client
cp client/usr/bin/kubectl "$out.partial/"
rm -rf "$out"
mv "$out.partial" "$out"
