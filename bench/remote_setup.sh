#!/usr/bin/env bash
# The network half of the benchmarks' slow remote: a network namespace with its own sshd,
# reached from the host over a veth pair, optionally rate limited with tbf.
#
#   bench/remote_setup.sh up   NAME STATE_DIR [RATE]   # RATE like 400mbit; none = unshaped
#   bench/remote_setup.sh down NAME STATE_DIR          # idempotent; fine after a failed up
#   bench/remote_setup.sh status NAME STATE_DIR
#
# Host side NAME-h = 10.233.0.1/30, namespace side NAME-n = 10.233.0.2/30. The sshd runs
# inside namespace NAME with its own config, host key and authorized key (all in
# STATE_DIR), listens on 10.233.0.2:22, takes root by key only, and serves sftp with
# internal-sftp. The client key is STATE_DIR/id_ed25519. Traffic goes only between these
# two addresses. Only one remote at a time can hold the addresses (up refuses otherwise).
#
# bench/remote.py calls this and mounts sshfs on top; use that (`python -m bench.remote
# up|down`) rather than this script directly. Needs root, iproute2, openssh-server.
set -euo pipefail

HOST_IP=10.233.0.1
NS_IP=10.233.0.2
PREFIX=30

die() { echo "remote_setup: $*" >&2; exit 1; }
log() { echo "remote_setup: $*" >&2; }

[ $# -ge 3 ] || die "usage: $0 up|down|status NAME STATE_DIR [RATE]"
CMD=$1 NAME=$2 STATE=$3 RATE=${4:-none}

# interface names are limited to 15 bytes: NAME plus "-h"/"-n"
[[ $NAME =~ ^[a-z][a-z0-9]{0,11}$ ]] || die "NAME must be 1-12 of [a-z0-9], starting with a letter: $NAME"
[[ $STATE = /* ]] || die "STATE_DIR must be absolute: $STATE"
HOST_IF=$NAME-h
NS_IF=$NAME-n
SSHD=/usr/sbin/sshd

# the namespace's address must be reached through our own veth and nothing else: never
# send a packet to 10.233.0.2 while it would leave by the default route
route_ok() { ip route get "$NS_IP" 2>/dev/null | grep -q "dev $HOST_IF "; }

netns_exists() { ip netns list | awk '{print $1}' | grep -qx -- "$NAME"; }
link_exists() { ip link show dev "$1" >/dev/null 2>&1; }

# pid is alive and not a zombie
alive() { [ -r "/proc/$1/stat" ] && ! awk '{ if ($3 == "Z" || $3 == "X") exit 0; exit 1 }' "/proc/$1/stat" 2>/dev/null; }

# end one pid: TERM, up to 5 s, then KILL
end_pid() {
    local pid=$1 i
    alive "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null || return 0
    for i in $(seq 50); do alive "$pid" || return 0; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    for i in $(seq 20); do alive "$pid" || return 0; sleep 0.1; done
    log "pid $pid did not exit"
}

do_down() {
    # 1. the sshd this script started (its pid file; checked against its command line)
    local pid
    if [ -f "$STATE/sshd.pid" ]; then
        pid=$(cat "$STATE/sshd.pid" 2>/dev/null || true)
        if [[ $pid =~ ^[0-9]+$ ]] && grep -qF -- "$STATE/sshd_config" "/proc/$pid/cmdline" 2>/dev/null; then
            end_pid "$pid"
        fi
    fi
    # 2. anything else still inside our own namespace (sshd's per-connection children):
    #    only this script ever puts processes there
    if netns_exists; then
        for pid in $(ip netns pids "$NAME" 2>/dev/null || true); do
            end_pid "$pid"
        done
    fi
    # 3. the veth pair (deleting one end deletes both; the qdiscs go with it) and the netns
    if link_exists "$HOST_IF"; then ip link del dev "$HOST_IF" || log "could not delete $HOST_IF"; fi
    if netns_exists; then ip netns del "$NAME" || log "could not delete netns $NAME"; fi
    # deleting a netns is asynchronous: wait for its end of the pair to go too
    for _ in $(seq 50); do link_exists "$HOST_IF" || break; sleep 0.1; done
    if link_exists "$HOST_IF"; then ip link del dev "$HOST_IF" 2>/dev/null || true; fi
    ! link_exists "$HOST_IF" || die "veth $HOST_IF is still there"
    ! netns_exists || die "netns $NAME is still there"
    rm -f "$STATE/sshd.pid"
}

shape() {  # shape DEV [ip -n NS]: tbf at RATE on DEV's egress
    local dev=$1; shift
    # burst 256 KiB: room for a few GSO packets (up to 64 KiB each) at once; latency: how
    # long a packet may wait in the queue before tbf drops it
    "$@" tc qdisc replace dev "$dev" root tbf rate "$RATE" burst 256kb latency 50ms
}

precheck() {  # refuses without touching anything (another remote may be up)
    command -v ip >/dev/null || die "ip not found (apt-get install -y iproute2)"
    [ -x "$SSHD" ] || die "$SSHD not found (apt-get install -y openssh-server)"
    command -v ssh-keygen >/dev/null || die "ssh-keygen not found (apt-get install -y openssh-client)"
    ! netns_exists || die "netns $NAME exists already: run 'python -m bench.remote down --name $NAME' first"
    ! link_exists "$HOST_IF" || die "link $HOST_IF exists already: run down first"
    if ip -o addr show | grep -qw "inet $HOST_IP"; then
        die "$HOST_IP is already assigned to an interface (another remote is up?)"
    fi
    if [ "$RATE" != none ]; then
        [[ $RATE =~ ^[0-9]+(\.[0-9]+)?[kmgt]?(bit|bps)$ ]] || die "bad rate: $RATE (e.g. 400mbit)"
    fi
}

do_up() {
    mkdir -p "$STATE"
    chmod 700 "$STATE"
    rm -f "$STATE"/ssh_host_ed25519_key* "$STATE"/id_ed25519* "$STATE/sshd.pid"
    ssh-keygen -q -t ed25519 -N '' -C "dlcbench-host-$NAME" -f "$STATE/ssh_host_ed25519_key"
    ssh-keygen -q -t ed25519 -N '' -C "dlcbench-client-$NAME" -f "$STATE/id_ed25519"
    cp "$STATE/id_ed25519.pub" "$STATE/authorized_keys"
    chmod 600 "$STATE/authorized_keys"
    cat >"$STATE/sshd_config" <<EOF
# generated by bench/remote_setup.sh for the benchmarks' slow remote '$NAME'
ListenAddress $NS_IP:22
HostKey $STATE/ssh_host_ed25519_key
PidFile $STATE/sshd.pid
AuthorizedKeysFile $STATE/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
X11Forwarding no
AllowTcpForwarding no
AllowAgentForwarding no
PermitTunnel no
PrintMotd no
MaxStartups 64:30:128
MaxSessions 64
Subsystem sftp internal-sftp
EOF
    mkdir -p /run/sshd                            # sshd's privilege separation directory
    chmod 755 /run/sshd
    "$SSHD" -t -f "$STATE/sshd_config" || die "sshd rejects its config"

    ip netns add "$NAME"
    ip link add "$HOST_IF" type veth peer name "$NS_IF"
    ip link set "$NS_IF" netns "$NAME"
    ip addr add "$HOST_IP/$PREFIX" dev "$HOST_IF"
    ip link set "$HOST_IF" up
    ip -n "$NAME" link set lo up
    ip -n "$NAME" addr add "$NS_IP/$PREFIX" dev "$NS_IF"
    ip -n "$NAME" link set "$NS_IF" up
    if [ "$RATE" != none ]; then
        shape "$HOST_IF"                         # host -> remote (requests)
        shape "$NS_IF" ip netns exec "$NAME"     # remote -> host (the data)
    fi

    ip netns exec "$NAME" "$SSHD" -f "$STATE/sshd_config" -E "$STATE/sshd.log"

    # ready when a key login works (sshd writes its pid file before it listens)
    route_ok || die "10.233.0.2 is not routed through $HOST_IF; not connecting"
    local i
    for i in $(seq 100); do
        if ssh -q -o BatchMode=yes -o IdentitiesOnly=yes -o IdentityFile="$STATE/id_ed25519" \
               -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR \
               -o ConnectTimeout=2 "root@$NS_IP" true </dev/null 2>/dev/null; then
            log "up: netns $NAME, $HOST_IF=$HOST_IP <-> $NS_IF=$NS_IP, rate $RATE, sshd pid $(cat "$STATE/sshd.pid")"
            return 0
        fi
        sleep 0.1
    done
    die "sshd in netns $NAME does not accept our key (see $STATE/sshd.log)"
}

do_status() {
    if netns_exists; then echo "netns $NAME: present"; else echo "netns $NAME: absent"; fi
    if link_exists "$HOST_IF"; then ip -br addr show dev "$HOST_IF"; tc qdisc show dev "$HOST_IF"; fi
    if netns_exists; then tc -n "$NAME" qdisc show dev "$NS_IF" 2>/dev/null || true; fi
    if route_ok; then echo "route to $NS_IP: via $HOST_IF"; else echo "route to $NS_IP: NOT via $HOST_IF"; fi
    if [ -f "$STATE/sshd.pid" ]; then echo "sshd pid $(cat "$STATE/sshd.pid")"; fi
}

case $CMD in
    up)
        precheck
        # a failed up leaves nothing behind (not "if ! do_up": errexit is off in conditions)
        set +e
        ( set -e; do_up )
        rc=$?
        set -e
        if [ "$rc" -ne 0 ]; then do_down || true; exit 1; fi ;;
    down) do_down ;;
    status) do_status ;;
    *) die "unknown command: $CMD" ;;
esac
