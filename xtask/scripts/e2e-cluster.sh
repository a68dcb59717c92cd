#!/usr/bin/env bash
# The e2e cluster on one machine (`cargo xtask e2e`): a control plane and kubelet nodes, each in
# network namespaces of its own, nothing in the machine's own network namespace.
#
#   public side 203.0.113.0/24 (bridge `pub` in ns krs-e2e-under; a documentation range, so kg
#     sees a public address and uses it as the node's endpoint)
#     cp  .254  etcd (loopback), kube-apiserver, kube-controller-manager, kube-scheduler
#     nI  .I    node I: its default route is on this side
#     ext .100  a host outside the cluster (a WireGuard Peer in the checks)
#   (and, for the allowed-location-ips check, a host at .200 of one location's LAN)
#   one LAN per location 172.20.L.0/24 (bridge `lan-LOCATION`): node I at 172.20.L.I, the
#     private address kg finds (same-location traffic, IPIP)
#
# Each node: ns krs-e2e-nI and its own mount namespace (a file under $WORK/mnt) in which
# /var/lib/kubelet, /var/log/pods, /var/log/containers, /etc/cni/net.d, /etc/kubernetes
# (the kubelet's kubeconfig at kubeadm's path, which kg's manifests read), /var/lib/kilo,
# /var/lib/containerd, /run/containerd, /run/netns and /run/wireguard are its own directories and
# /sys/fs/bpf its own bpffs, running containerd, kubelet and kube-proxy (iptables mode). The pods'
# cgroups are under /krs-e2e/nI of every cgroup v1 hierarchy.
#
# Usage:
#   e2e-cluster.sh up WORK KUBE_BIN_DIR IMAGE_TAR... -- NODE:LOCATION...
#   e2e-cluster.sh add-node WORK NODE:LOCATION     (after `up`; same binaries and images)
#   e2e-cluster.sh down WORK
#   e2e-cluster.sh node-exec WORK NODE CMD...      (in the node's network and mount namespaces)
#   e2e-cluster.sh pod-routes WORK                 (cp reaches each node's pod CIDR through it)
#   e2e-cluster.sh stop-node WORK NODE             (its containers, kubelet, kube-proxy, containerd)
#   e2e-cluster.sh ext-wireguard WORK IFACE        (a wireguard-go device on the host `ext`)
#   e2e-cluster.sh lan-host WORK NAME LOCATION     (a host on the location's LAN at .200; prints
#                                                   its address)
# `up` starts everything in the background (PIDs in WORK/pids) and waits until every node is
# registered (NotReady until a CNI configuration appears: kg's DaemonSet installs it). `down`
# ends every process it started (by PID), the pods' containers, cgroups, mounts and namespaces.
set -euo pipefail
P=krs-e2e
CP_IP=203.0.113.254
POD_CIDR=10.42.0.0/16
SERVICE_CIDR=10.96.0.0/12
TOKEN=krs-e2e-admin-token
CGROUP_ROOT=/sys/fs/cgroup
# The node-local paths that are each node's own (bind mounts in its mount namespace).
NODE_DIRS="var/lib/kubelet var/log/pods var/log/containers etc/cni/net.d etc/kubernetes var/lib/kilo var/lib/containerd run/containerd run/netns run/wireguard"

log() { printf '[e2e-cluster] %s\n' "$*" >&2; }

# spawn NAME CMD...: starts CMD (a program, not a shell function: its PID is the process's own;
# nsenter execs what it runs) in the background, its output in WORK/logs/NAME.log, its PID in
# WORK/pids (one "PID NAME" line each).
spawn() {
  local name=$1
  shift
  "$@" </dev/null >"$WORK/logs/$name.log" 2>&1 &
  echo "$! $name" >>"$WORK/pids"
}

in_ns() { local ns=$1; shift; nsenter --net="/run/netns/$P-$ns" "$@"; }

# in_node NODE CMD...: in the node's network and mount namespaces.
in_node() {
  local node=$1
  shift
  nsenter --net="/run/netns/$P-$node" --mount="$WORK/mnt/$node" "$@"
}

kubectl_cp() { in_ns cp "$BIN/kubectl" --kubeconfig "$WORK/admin.kubeconfig" "$@"; }

veth() { # veth NS IFNAME PEER_NS PEER_IFNAME
  local a="ke$$a" b="ke$$b"
  ip link add "$a" type veth peer name "$b"
  ip link set "$a" netns "$P-$1"
  ip link set "$b" netns "$P-$3"
  in_ns "$1" ip link set "$a" name "$2"
  in_ns "$1" ip link set "$2" up
  in_ns "$3" ip link set "$b" name "$4"
  in_ns "$3" ip link set "$4" up
}

new_ns() {
  ip netns add "$P-$1"
  in_ns "$1" ip link set lo up
}

certs() {
  local d=$WORK/pki
  mkdir -p "$d"
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=krs-e2e-ca \
    -keyout "$d/ca.key" -out "$d/ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj /CN=kube-apiserver \
    -keyout "$d/apiserver.key" -out "$d/apiserver.csr" 2>/dev/null
  printf 'subjectAltName=IP:%s,IP:10.96.0.1,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n' \
    "$CP_IP" >"$d/san.ext"
  openssl x509 -req -in "$d/apiserver.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
    -days 2 -extfile "$d/san.ext" -out "$d/apiserver.crt" 2>/dev/null
  # The Peer webhook's serving certificate (docs/deploying.md, without cert-manager).
  openssl req -newkey rsa:2048 -nodes -subj /CN=kilo-peer-validation.kube-system.svc \
    -keyout "$d/webhook.key" -out "$d/webhook.csr" 2>/dev/null
  echo 'subjectAltName=DNS:kilo-peer-validation.kube-system.svc' >"$d/webhook.ext"
  openssl x509 -req -in "$d/webhook.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
    -days 2 -extfile "$d/webhook.ext" -out "$d/webhook.crt" 2>/dev/null
  openssl genrsa -out "$d/sa.key" 2048 2>/dev/null
  openssl rsa -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
  # Every component (and the kubelets) as one administrator: this cluster tests kg, not RBAC
  # of the control plane; kg's own pods use their ServiceAccount's token.
  echo "$TOKEN,admin,admin,\"system:masters\"" >"$d/tokens.csv"
  cat >"$WORK/admin.kubeconfig" <<YAML
apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster: {server: "https://$CP_IP:6443", certificate-authority: "$d/ca.crt"}
users:
- name: admin
  user: {token: "$TOKEN"}
contexts:
- name: e2e
  context: {cluster: e2e, user: admin}
current-context: e2e
YAML
}

control_plane() {
  local d=$WORK/pki
  spawn etcd nsenter --net="/run/netns/$P-cp" /usr/bin/etcd --data-dir="$WORK/etcd" --name=default \
    --listen-client-urls=http://127.0.0.1:2379 --advertise-client-urls=http://127.0.0.1:2379 \
    --listen-peer-urls=http://127.0.0.1:2380 --initial-advertise-peer-urls=http://127.0.0.1:2380 \
    --initial-cluster=default=http://127.0.0.1:2380
  # ServiceAccount admission on (the default): kg's pods get their token as on any cluster.
  cat >"$WORK/audit.yaml" <<YAML
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  resources: [{group: kilo.squat.ai, resources: [peers]}]
- level: Metadata
  verbs: [create]
  resources: [{group: "", resources: [nodes]}]
- level: None
YAML
  spawn kube-apiserver nsenter --net="/run/netns/$P-cp" "$BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
    --bind-address="$CP_IP" --advertise-address="$CP_IP" --secure-port=6443 --insecure-port=0 \
    --cert-dir="$WORK/apiserver-certs" --tls-cert-file="$d/apiserver.crt" \
    --tls-private-key-file="$d/apiserver.key" --client-ca-file="$d/ca.crt" \
    --service-account-issuer=https://kubernetes.default.svc \
    --service-account-key-file="$d/sa.pub" --service-account-signing-key-file="$d/sa.key" \
    --token-auth-file="$d/tokens.csv" --authorization-mode=Node,RBAC \
    --service-cluster-ip-range="$SERVICE_CIDR" --kubelet-preferred-address-types=InternalIP \
    --audit-policy-file="$WORK/audit.yaml" --audit-log-path="$WORK/logs/audit.log" \
    --allow-privileged=true `# as kubeadm sets it: Kilo's own manifest runs privileged` \
    --enable-aggregator-routing=true # webhooks called at the pod's address: see pod-routes
  local i
  for i in $(seq 1 120); do
    kubectl_cp get --raw /readyz >/dev/null 2>&1 && break
    [ "$i" = 120 ] && { log "kube-apiserver not ready after 60 s (logs: $WORK/logs)"; return 1; }
    sleep 0.5
  done
  spawn kube-controller-manager nsenter --net="/run/netns/$P-cp" "$BIN/kube-controller-manager" \
    --kubeconfig="$WORK/admin.kubeconfig" --leader-elect=false --port=0 \
    --allocate-node-cidrs --cluster-cidr="$POD_CIDR" --node-cidr-mask-size=24 \
    --service-cluster-ip-range="$SERVICE_CIDR" --configure-cloud-routes=false \
    --service-account-private-key-file="$d/sa.key" --root-ca-file="$d/ca.crt" \
    --use-service-account-credentials=false --controllers='*'
  spawn kube-scheduler nsenter --net="/run/netns/$P-cp" "$BIN/kube-scheduler" --kubeconfig="$WORK/admin.kubeconfig" \
    --leader-elect=false --port=0
}

# underlay: the namespace holding the public bridge (and the locations' LAN bridges), and cp.
underlay() {
  new_ns under
  in_ns under ip link add pub type bridge
  in_ns under ip link set pub up
  new_ns cp
  veth cp eth0 under cp
  in_ns under ip link set cp master pub
  in_ns cp ip addr add "$CP_IP/24" dev eth0
  new_ns ext
  veth ext eth0 under ext
  in_ns under ip link set ext master pub
  in_ns ext ip addr add 203.0.113.100/24 dev eth0
}

# location_index LOCATION: a stable small number per location (its LAN is 172.20.N.0/24).
location_index() {
  local f=$WORK/locations n
  touch "$f"
  n=$(grep -n "^$1\$" "$f" | cut -d: -f1)
  if [ -z "$n" ]; then
    echo "$1" >>"$f"
    n=$(wc -l <"$f")
    in_ns under ip link add "lan-$1" type bridge
    in_ns under ip link set "lan-$1" up
  fi
  echo "$n"
}

containerd_config() { # containerd_config NODE
  cat <<TOML
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "local/pause:1"
  # Root here lacks CAP_SYS_RESOURCE: runc cannot lower a sandbox's oom_score_adj.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
TOML
}

node_up() { # node_up NODE LOCATION
  local node=$1 loc=$2 idx li nd=$WORK/nodes/$1
  idx=${node//[!0-9]/}
  li=$(location_index "$loc")
  log "node $node in $loc: public 203.0.113.$idx, LAN 172.20.$li.$idx"
  new_ns "$node"
  veth "$node" eth0 under "$node"
  in_ns under ip link set "$node" master pub
  in_ns "$node" ip addr add "203.0.113.$idx/24" dev eth0
  in_ns "$node" ip route add default via "$CP_IP"
  veth "$node" eth1 under "l-$node"
  in_ns under ip link set "l-$node" master "lan-$loc"
  in_ns "$node" ip addr add "172.20.$li.$idx/24" dev eth1
  in_ns "$node" sysctl -qw net.ipv4.ip_forward=1
  # The mount namespace, kept by a bind mount of its file (WORK/mnt is a private mount).
  touch "$WORK/mnt/$node"
  unshare --mount="$WORK/mnt/$node" --propagation private true
  local d top
  for d in $NODE_DIRS; do
    mkdir -p "$nd/$d"
    if [ ! -e "/$d" ]; then
      # The highest directory this creates, removed (when empty) by `down`.
      top=/$d
      while [ ! -e "$(dirname "$top")" ]; do top=$(dirname "$top"); done
      mkdir -p "/$d"
      echo "$top" >>"$WORK/created-dirs"
    fi
    in_node "$node" mount --bind "$nd/$d" "/$d"
  done
  in_node "$node" mount -t bpf bpf /sys/fs/bpf
  # As on a systemd host: mounts shared, so kubelet's HostToContainer propagation works.
  in_node "$node" mount --make-rshared /
  # The kubelet's kubeconfig where kubeadm puts it (kg's init container reads its server).
  cat >"$nd/etc/kubernetes/kubelet.conf" <<YAML
apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster:
    server: https://$CP_IP:6443
    certificate-authority: $WORK/pki/ca.crt
users:
- name: kubelet
  user:
    token: $TOKEN
contexts:
- name: e2e
  context:
    cluster: e2e
    user: kubelet
current-context: e2e
YAML
  containerd_config "$node" >"$nd/containerd.toml"
  local c
  for c in $(cgroup_controllers); do mkdir -p "$CGROUP_ROOT/$c/$P/$node"; done
  local NODE_NS=(nsenter --net="/run/netns/$P-$node" --mount="$WORK/mnt/$node")
  spawn "containerd-$node" "${NODE_NS[@]}" containerd --config "$nd/containerd.toml"
  local i
  for i in $(seq 1 100); do
    in_node "$node" ctr version >/dev/null 2>&1 && break
    [ "$i" = 100 ] && { log "$node: containerd did not start (log: $WORK/logs/containerd-$node.log)"; return 1; }
    sleep 0.2
  done
  local tar
  for tar in "${IMAGES[@]}"; do
    in_node "$node" ctr -n k8s.io images import "$tar" >/dev/null
  done
  # No disk-pressure eviction nor image garbage collection past the defaults' 85-90 %: this
  # machine's disk is shared with builds, and the images cannot be pulled again.
  spawn "kubelet-$node" "${NODE_NS[@]}" "$BIN/kubelet" --kubeconfig=/etc/kubernetes/kubelet.conf \
    --container-runtime=remote \
    --container-runtime-endpoint=unix:///run/containerd/containerd.sock \
    --cert-dir="$nd/pki" --cgroup-driver=cgroupfs --cgroups-per-qos=false \
    --cgroup-root="/$P/$node" --enforce-node-allocatable= --fail-swap-on=false \
    --hostname-override="$node" --node-ip="203.0.113.$idx" \
    --node-labels="topology.kubernetes.io/region=$loc" \
    --pod-infra-container-image=local/pause:1 --read-only-port=0 \
    --resolv-conf=/etc/resolv.conf \
    --eviction-hard=memory.available\<100Mi,nodefs.available\<1%,imagefs.available\<1% \
    --image-gc-high-threshold=100 --image-gc-low-threshold=99
  spawn "kube-proxy-$node" "${NODE_NS[@]}" "$BIN/kube-proxy" --kubeconfig="$WORK/admin.kubeconfig" \
    --hostname-override="$node" --proxy-mode=iptables --cluster-cidr="$POD_CIDR" \
    --conntrack-max-per-core=0 --conntrack-tcp-timeout-established=0 \
    --conntrack-tcp-timeout-close-wait=0 --metrics-bind-address=127.0.0.1:10249 \
    --healthz-bind-address=127.0.0.1:10256
  echo "$node" >>"$WORK/nodes.list"
}

cgroup_controllers() {
  local c
  for c in "$CGROUP_ROOT"/*; do
    [ "$(stat -f -c %T "$c" 2>/dev/null)" = cgroupfs ] && basename "$c"
  done
  return 0
}

wait_registered() { # wait_registered NODE...
  local node i
  for node in "$@"; do
    for i in $(seq 1 120); do
      kubectl_cp get node "$node" >/dev/null 2>&1 && break
      [ "$i" = 120 ] && { log "$node did not register (log: $WORK/logs/kubelet-$node.log)"; return 1; }
      sleep 0.5
    done
  done
}

up() {
  if [ -e "$WORK/pids" ]; then down; fi
  # Memory, not the machine's disk, which builds share: etcd's fsyncs stay fast and kubelet
  # sees no disk pressure.
  mkdir -p "$WORK"
  mount -t tmpfs -o size=8g,mode=0755 krs-e2e "$WORK"
  mkdir -p "$WORK/logs" "$WORK/nodes" "$WORK/mnt"
  # A private mount, so that the mount namespaces' files can be bind mounts.
  mount --bind "$WORK/mnt" "$WORK/mnt"
  mount --make-private "$WORK/mnt"
  touch "$WORK/pids"
  printf '%s\n' "${IMAGES[@]}" >"$WORK/images"
  printf '#!/bin/sh\nexec nsenter --net=/run/netns/%s-cp %s/kubectl --kubeconfig %s/admin.kubeconfig "$@"\n' \
    "$P" "$BIN" "$WORK" >"$WORK/kubectl"
  chmod +x "$WORK/kubectl"
  echo "$BIN" >"$WORK/bin"
  certs
  underlay
  control_plane
  local spec nodes=()
  for spec in "$@"; do
    node_up "${spec%%:*}" "${spec#*:}"
    nodes+=("${spec%%:*}")
  done
  wait_registered "${nodes[@]}"
  log "up: ${nodes[*]} registered; kubectl: $WORK/kubectl"
}

# node_down NODE: its pods' containers (through its containerd), then its processes.
node_down() {
  local node=$1 id pid
  if in_node "$node" ctr version >/dev/null 2>&1; then
    # kubelet first, or it starts them again.
    stop_pids "kubelet-$node"
    for id in $(in_node "$node" ctr -n k8s.io tasks ls -q 2>/dev/null); do
      in_node "$node" ctr -n k8s.io tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true
    done
    for id in $(in_node "$node" ctr -n k8s.io tasks ls -q 2>/dev/null); do
      for _ in 1 2 3 4 5 6 7 8 9 10; do
        in_node "$node" ctr -n k8s.io tasks delete "$id" >/dev/null 2>&1 && break
        sleep 0.3
      done
    done
  fi
  # Shims the containerd of this node started (their PIDs are in its state directory).
  for pid in $(cat "$WORK/nodes/$node"/run/containerd/io.containerd.runtime.v2.task/*/*/shim.pid 2>/dev/null); do
    kill -KILL "$pid" 2>/dev/null || true
  done
  stop_pids "kube-proxy-$node" "containerd-$node"
}

# stop_pids NAME...: SIGTERM to the processes spawn recorded under those names, SIGKILL after 10 s.
stop_pids() {
  local name pid n rest
  for name in "$@"; do
    while read -r pid n rest; do
      [ "$n" = "$name" ] || continue
      kill -TERM "$pid" 2>/dev/null || continue
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
      kill -KILL "$pid" 2>/dev/null || true
    done <"$WORK/pids"
  done
}

down() {
  set +e
  [ -f "$WORK/bin" ] && BIN=$(cat "$WORK/bin")
  local node pid name rest d c
  if [ -f "$WORK/nodes.list" ]; then
    for node in $(cat "$WORK/nodes.list"); do node_down "$node"; done
  fi
  if [ -f "$WORK/pids" ]; then
    while read -r pid name rest; do kill -TERM "$pid" 2>/dev/null; done <"$WORK/pids"
    sleep 1
    while read -r pid name rest; do kill -KILL "$pid" 2>/dev/null; done <"$WORK/pids"
  fi
  # Mount namespaces: their files unmounted, the namespaces go with their last process.
  for f in "$WORK"/mnt/*; do [ -e "$f" ] && umount "$f" 2>/dev/null; done
  mountpoint -q "$WORK/mnt" && umount "$WORK/mnt"
  for ns in $(ip netns list | awk '{print $1}' | grep "^$P-"); do ip netns del "$ns"; done
  # The pods' cgroups, deepest first (runc removes a container's when it is deleted).
  for c in $(cgroup_controllers); do
    [ -d "$CGROUP_ROOT/$c/$P" ] && find "$CGROUP_ROOT/$c/$P" -depth -type d -exec rmdir {} + 2>/dev/null
  done
  if [ -f "$WORK/created-dirs" ]; then
    while read -r d; do [ -d "$d" ] && find "$d" -depth -type d -empty -delete; done <"$WORK/created-dirs"
  fi
  [ -f "$WORK/ext-wireguard" ] && rm -f "/run/wireguard/$(cat "$WORK/ext-wireguard").sock"
  local logs
  logs=$(dirname "$WORK")/krs-e2e-logs
  rm -rf "$logs"
  cp -a "$WORK/logs" "$logs" 2>/dev/null && log "the components' logs: $logs"
  mountpoint -q "$WORK" && umount "$WORK"
  rm -rf "$WORK"
  log "down: processes, containers, cgroups, mounts and namespaces removed"
  return 0
}

cmd=${1:?usage: e2e-cluster.sh up|add-node|down|node-exec WORK ...}
WORK=${2:?WORK directory}
shift 2
case "$cmd" in
  up)
    BIN=$1
    shift
    IMAGES=()
    while [ "$1" != -- ]; do IMAGES+=("$1"); shift; done
    shift
    up "$@"
    ;;
  add-node)
    BIN=$(cat "$WORK/bin")
    mapfile -t IMAGES <"$WORK/images"
    node_up "${1%%:*}" "${1#*:}"
    wait_registered "${1%%:*}"
    ;;
  pod-routes)
    # The control plane is no node (no kg there): it reaches each node's pods through that
    # node, as on a flat network (through one node, WireGuard would drop a source that is
    # no peer's).
    BIN=$(cat "$WORK/bin")
    kubectl_cp get nodes -o jsonpath='{range .items[*]}{.spec.podCIDR} {.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}' |
      while read -r cidr ip; do in_ns cp ip route replace "$cidr" via "$ip"; done
    ;;
  stop-node) node_down "$1" ;;
  ext-wireguard)
    spawn "wireguard-go-ext" nsenter --net="/run/netns/$P-ext" \
      env WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD=1 wireguard-go --foreground "$1"
    echo "$1" >"$WORK/ext-wireguard"
    for _ in $(seq 1 50); do [ -S "/run/wireguard/$1.sock" ] && break; sleep 0.1; done
    ;;
  lan-host)
    li=$(location_index "$2")
    new_ns "$1"
    veth "$1" eth0 under "$1"
    in_ns under ip link set "$1" master "lan-$2"
    in_ns "$1" ip addr add "172.20.$li.200/24" dev eth0
    echo "172.20.$li.200"
    ;;
  node-exec)
    node=$1
    shift
    in_node "$node" "$@"
    ;;
  down) down ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac
