#!/usr/bin/env bash
# The demo's mesh, on one machine: three nodes in two locations (network namespaces) joined by an
# underlay bridge, a pod behind a `kube-bridge` on each, a wireguard-go device per node and an
# "internet" host; the Node objects as YAML in $WORK/objects. Sourced by demo.sh (which adds kg on
# the file backend); the Kubernetes mesh test runs it as `mesh.sh up|down` and starts kg itself.
#
#   underlay 192.168.50.0/24 (bridge in ns $P-under)
#     n1 .1  location east  pods 10.42.1.0/24   (leader of east)
#     n2 .2  location east  pods 10.42.2.0/24
#     n3 .3  location west  pods 10.42.3.0/24   (leader of west)
#     inet .100             a host outside the mesh
#
# Environment: KRS_DEMO_PREFIX (namespace prefix), KRS_DEMO_WG (WireGuard interface prefix),
# KRS_DEMO_WORK (a directory for the objects and wireguard-go's PIDs), KRS_WIREGUARD=kernel (no
# wireguard-go: kg creates each node's kernel WireGuard device, as Kilo's default
# --create-interface=true does; the kernel needs the wireguard module).
P=${KRS_DEMO_PREFIX:-krs-demo}
WG=${KRS_DEMO_WG:-kilo} # WireGuard interfaces $WG1..3 (their UAPI sockets share /var/run/wireguard)
WORK=${KRS_DEMO_WORK:?set KRS_DEMO_WORK to a directory for the mesh files}
DIR=$WORK/objects
NAMESPACES="n1 n2 n3 pod1 pod2 pod3 inet under"

inns() { local ns=$1; shift; ip netns exec "$P-$ns" "$@"; }

link() { # link NS IFNAME PEER_NS PEER_IFNAME
  local a="kd$$a" b="kd$$b" # interface names are at most 15 bytes
  ip link add "$a" type veth peer name "$b"
  ip link set "$a" netns "$P-$1"; ip link set "$b" netns "$P-$3"
  inns "$1" ip link set "$a" name "$2"; inns "$1" ip link set "$2" up
  inns "$3" ip link set "$b" name "$4"; inns "$3" ip link set "$4" up
}

mesh_up() {
  mkdir -p "$DIR"
  for ns in $NAMESPACES; do
    ip netns del "$P-$ns" 2>/dev/null || true
    ip netns add "$P-$ns"
    inns "$ns" ip link set lo up
  done
  inns under ip link add br0 type bridge
  inns under ip link set br0 up
  link inet eth0 under inet
  inns under ip link set inet master br0
  inns inet ip addr add 192.168.50.100/24 dev eth0
  for i in 1 2 3; do
    link "n$i" eth0 under "n$i"
    inns under ip link set "n$i" master br0
    inns "n$i" ip addr add "192.168.50.$i/24" dev eth0
    inns "n$i" ip route add default via 192.168.50.100
    inns "n$i" sysctl -qw net.ipv4.ip_forward=1
    # The pod network as Kilo's CNI builds it: a bridge holding the first address of the pod CIDR.
    inns "n$i" ip link add kube-bridge type bridge
    inns "n$i" ip addr add "10.42.$i.1/24" dev kube-bridge
    inns "n$i" ip link set kube-bridge up
    link "pod$i" eth0 "n$i" "veth-pod$i"
    inns "n$i" ip link set "veth-pod$i" master kube-bridge
    inns "pod$i" ip addr add "10.42.$i.2/24" dev eth0
    inns "pod$i" ip route add default via "10.42.$i.1"
    # The userspace WireGuard device, as Kilo's userspace manifests run it (its UAPI socket
    # lives in the shared /var/run/wireguard, so each node gets its own interface name).
    if [ "${KRS_WIREGUARD:-}" != kernel ]; then
      ip netns exec "$P-n$i" env WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD=1 \
        wireguard-go --foreground "$WG$i" </dev/null >/dev/null 2>&1 &
      echo $! >>"$WORK/wireguard-go.pids"
    fi
    loc=east; [ "$i" = 3 ] && loc=west
    cat > "$DIR/node-n$i.yaml" <<YAML
apiVersion: v1
kind: Node
metadata:
  name: n$i
  annotations:
    kilo.squat.ai/location: $loc
spec:
  podCIDR: 10.42.$i.0/24
YAML
  done
  for i in 1 2 3; do # wireguard-go creates its device and socket in the background
    [ "${KRS_WIREGUARD:-}" = kernel ] && break
    for _ in $(seq 1 50); do [ -S "/var/run/wireguard/$WG$i.sock" ] && break; sleep 0.1; done
  done
}

# Ends the wireguard-go processes mesh_up started (by PID) and removes the namespaces.
mesh_down() {
  local pid
  if [ -f "$WORK/wireguard-go.pids" ]; then
    while read -r pid; do kill -TERM "$pid" 2>/dev/null; done <"$WORK/wireguard-go.pids"
    rm -f "$WORK/wireguard-go.pids"
  fi
  for ns in $NAMESPACES; do ip netns del "$P-$ns" 2>/dev/null; done
  # A wireguard-go killed with SIGKILL (the fault tests) leaves its socket behind.
  for i in 1 2 3; do rm -f "/var/run/wireguard/$WG$i.sock"; done
  return 0
}

case "${1:-}" in
  up) set -euo pipefail; mesh_up ;;
  down) mesh_down ;;
esac
