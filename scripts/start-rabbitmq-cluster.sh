#!/usr/bin/env bash
# Starts a three-node RabbitMQ cluster for the cluster tests, beside (never joined to) the
# system node on 5672/25672: nodes `<prefix>1..3@localhost` on free ports, each with its own
# data, log and plugin files under DIR, clustered with `rabbitmqctl join_cluster`. Prints one
# line per node: `NODENAME AMQP_PORT`. Stop it with scripts/stop-rabbitmq-cluster.sh DIR.
# Needs root (the nodes run as the rabbitmq user, with the system's Erlang cookie, as the
# Debian wrapper scripts do) and Debian's rabbitmq-server, as on the project's machines.
set -euo pipefail
DIR="${1:?usage: start-rabbitmq-cluster.sh DIR [PREFIX]}"
PREFIX="${2:-tdc$$n}"
if ! command -v rabbitmq-server >/dev/null 2>&1; then
  echo "start-rabbitmq-cluster: rabbitmq-server is not installed (apt-get install rabbitmq-server)" >&2
  exit 1
fi

free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
mkdir -p "$DIR"
echo "[]." > "$DIR/enabled_plugins"
cat > "$DIR/rabbitmq.conf" <<CONF
loopback_users = none
CONF
: > "$DIR/nodes"
used=" "
# AMQP ports below the kernel's ephemeral range: a test stops and starts a node's app, which
# frees and binds its AMQP port again, and a port in that range may meanwhile be given to an
# outgoing connection (CI, 2026-11-28: start_app failed with eaddrinuse on port 34824). The
# distribution port (AMQP + 20000) stays bound while the VM runs.
low=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
top=$(( low < 30000 ? low : 30000 ))
(( top > 11000 )) || top=30000
pick() {
  local p
  for _ in $(seq 1 200); do
    p=$((10000 + RANDOM % (top - 10000)))
    if [[ "$used" != *" $p "* ]] && free "$p" && free $((p + 20000)); then
      used="$used$p "
      echo "$p"
      return 0
    fi
  done
  echo "start-rabbitmq-cluster: no free port" >&2
  return 1
}
for i in 1 2 3; do
  node="$PREFIX$i@localhost"
  port=$(pick)
  echo "$node $port" >> "$DIR/nodes"
  mkdir -p "$DIR/$i"
done
chown -R rabbitmq:rabbitmq "$DIR"
chmod -R a+rX "$DIR"
start() {
  local i=$1 node=$2 port=$3
  RABBITMQ_NODENAME="$node" RABBITMQ_NODE_PORT="$port" RABBITMQ_DIST_PORT=$((port + 20000)) \
    RABBITMQ_CONFIG_FILE="$DIR/rabbitmq" RABBITMQ_ENABLED_PLUGINS_FILE="$DIR/enabled_plugins" \
    RABBITMQ_MNESIA_BASE="$DIR/$i/mnesia" RABBITMQ_LOG_BASE="$DIR/$i/log" \
    RABBITMQ_PID_FILE="$DIR/$i/pid" rabbitmq-server -detached </dev/null >/dev/null 2>&1
}
i=0
while read -r node port; do
  i=$((i + 1))
  start "$i" "$node" "$port"
done < "$DIR/nodes"
first=""
while read -r node port; do
  # await_startup fails at once while the node has not registered with epmd yet.
  for attempt in $(seq 1 60); do
    rabbitmqctl -q -n "$node" await_startup --timeout 60 </dev/null >/dev/null 2>&1 && break
    if [ "$attempt" = 60 ]; then
      echo "start-rabbitmq-cluster: $node did not start; see $DIR/*/log" >&2
      exit 1
    fi
    sleep 1
  done
  if [ -z "$first" ]; then
    first="$node"
    continue
  fi
  rabbitmqctl -q -n "$node" stop_app </dev/null >/dev/null
  rabbitmqctl -q -n "$node" join_cluster "$first" </dev/null >/dev/null
  rabbitmqctl -q -n "$node" start_app </dev/null >/dev/null 2>&1
done < "$DIR/nodes"
cat "$DIR/nodes"
