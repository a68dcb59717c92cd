#!/usr/bin/env bash
# The kilo-rs demo: the mesh of mesh.sh (three nodes in two locations, each a network namespace on
# one machine, with a pod behind a bridge, real WireGuard (wireguard-go), and an "internet" host),
# with `kg` on every node on the file backend. Run by `cargo xtask demo`, which builds the binaries
# and passes their directory.
set -euo pipefail
BIN=${1:?usage: demo.sh BIN_DIR}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
export KRS_DEMO_WORK
KRS_DEMO_WORK=$(mktemp -d /tmp/krs-demo.XXXXXX)
# shellcheck source=mesh.sh
source "$ROOT/xtask/scripts/mesh.sh"
PIDS=()

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

cleanup() {
  set +e
  say "clean-up: SIGTERM every kg (they remove their routes, maps, pins and NAT table), then the namespaces"
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null; done
  mesh_down
  rm -rf "$WORK"
}
trap cleanup EXIT

# udp_probe NS LABEL ADDR: pod1 sends one datagram to ADDR, a listener in NS prints its source
# address. The sender waits until the listener is bound (a slow machine may take a second).
udp_probe() {
  local ready="$WORK/listening-$1"
  rm -f "$ready"
  inns "$1" python3 -c '
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", 7000)); s.settimeout(10)
open(sys.argv[2], "w").close()
data, addr = s.recvfrom(100); print(sys.argv[1], "saw the packet from", addr[0])' "$2" "$ready" &
  local listener=$!
  for _ in $(seq 1 100); do [ -e "$ready" ] && break; sleep 0.1; done
  inns pod1 python3 -c 'import socket, sys; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"hi", (sys.argv[1], 7000))' "$3"
  wait $listener
}

say "building the underlay, the nodes, their pods and the internet host"
mesh_up

# Kernel WireGuard (KRS_WIREGUARD=kernel): kg creates and configures each device itself.
CREATE_INTERFACE=false
HOW="over its UAPI socket (wireguard-go)"
if [ "${KRS_WIREGUARD:-}" = kernel ]; then CREATE_INTERFACE=true; HOW="over generic netlink (kernel WireGuard, created by kg)"; fi

say "starting kg on every node (file backend: $DIR)"
for i in 1 2 3; do
  # Kilo as the CNI: the bridge configuration Kilo's manifests install; kg fills in the ranges.
  cp "$ROOT/manifests/overlays/kubeadm/cni-conf.json" "$WORK/n$i.conflist"
  ip netns exec "$P-n$i" "$BIN/kg" --backend file --backend-dir "$DIR" --hostname "n$i" \
    --cni-path "$WORK/n$i.conflist" \
    --create-interface="$CREATE_INTERFACE" --interface "$WG$i" \
    --private-key "$WORK/n$i.key" --bpffs-dir "/sys/fs/bpf/$P-n$i" \
    --listen "127.0.0.1:1107" --resync-period 10s --log-level info \
    >"$WORK/kg-n$i.log" 2>&1 &
  PIDS+=($!)
done

say "waiting for the mesh to converge"
for _ in $(seq 1 60); do
  if inns n1 wg show "${WG}1" peers 2>/dev/null | grep -q . && inns n3 wg show "${WG}3" peers 2>/dev/null | grep -q . \
     && inns pod1 busybox ping -c1 -W1 10.42.3.2 >/dev/null 2>&1; then break; fi
  sleep 1
done

say "kgctl graph (Graphviz DOT, Kilo's layout)"
"$BIN/kgctl" --backend file --backend-dir "$DIR" graph
say "kgctl showconf node n1 (the leader of east)"
"$BIN/kgctl" --backend file --backend-dir "$DIR" showconf node n1
say "n1's CNI configuration: kg set the bridge's IPAM ranges to n1's pod CIDR"
grep -A4 '"ranges"' "$WORK/n1.conflist"
say "wg show on n1: a real WireGuard device, configured by kg $HOW"
inns n1 wg show "${WG}1"
echo "link type: $(inns n1 ip -d -o link show "${WG}1" | grep -o -w -E 'wireguard|tun' | head -1)"

say "pod1 (east) -> pod3 (west): through the WireGuard tunnel between the two leaders"
inns pod1 busybox ping -c3 -W2 10.42.3.2
say "pod2 (east, not a leader) -> pod3 (west): via its leader n1, in IPIP on east's underlay (Kilo's default --encapsulate=always, done by the eBPF datapath: no ipip module)"
inns pod2 busybox ping -c3 -W2 10.42.3.2
inns n2 ip route show 10.42.3.0/24
say "pod1 -> the internet host: masqueraded (the eBPF program marks, one static nft rule masquerades)"
udp_probe inet "internet host" 192.168.50.100
say "pod1 -> pod3 again, as seen by pod3: the pod's own address (mesh traffic is never masqueraded)"
udp_probe pod3 pod3 10.42.3.2

say "n1's metrics: Kilo's names, plus kernel writes and the datapath's counters (per decision, per map entry) and map occupancy"
inns n1 python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:1107/metrics").read().decode())' \
  | grep -E '^kilo_(nodes|peers|leader|reconciles_total|writes_total|datapath)' || true
say "processes kg started: none (seccomp refuses execve after start-up)"
echo "demo OK"
