#!/usr/bin/env bash
# Starts a second, TLS-only RabbitMQ node for the TLS tests: a self-signed CA, a server
# certificate for localhost, a client certificate, and a node listening on 127.0.0.1:5671
# that requires client certificates. Idempotent: reuses a node that is already up.
# Prints the directory holding ca.pem, client.pem and client.key. Needs root (the node runs as
# the rabbitmq user) and Debian's rabbitmq-server, as on the project's machines.
# Callers may run at once (nextest runs each test in a process of its own): a lock makes the
# second wait for the first's node instead of writing new certificates under it.
set -euo pipefail
DIR="${1:-/tmp/timeoutd-tls-rabbitmq}"
PORT="${TIMEOUTD_TLS_RABBITMQ_PORT:-5671}"
NODE="timeoutd-tls@localhost"
exec 9>"$DIR.lock"
flock 9

up() { (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; }

if up && [ -f "$DIR/client.pem" ]; then
  echo "$DIR"
  exit 0
fi
rm -rf "$DIR"
mkdir -p "$DIR"
cd "$DIR"
quiet() { "$@" >/dev/null 2>&1; }
quiet openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=timeoutd test CA" \
  -keyout ca.key -out ca.pem
for who in server client; do
  cn=localhost; [ "$who" = client ] && cn=timeoutd
  quiet openssl req -newkey rsa:2048 -nodes -subj "/CN=$cn" -keyout "$who.rsa.key" -out "$who.csr"
  printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' > "$who.ext"
  quiet openssl x509 -req -in "$who.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 30 \
    -extfile "$who.ext" -out "$who.pem"
  # PKCS#8, as rustls reads it.
  quiet openssl pkcs8 -topk8 -nocrypt -in "$who.rsa.key" -out "$who.key"
done
cat > rabbitmq.conf <<CONF
listeners.tcp = none
listeners.ssl.default = $PORT
ssl_options.cacertfile = $DIR/ca.pem
ssl_options.certfile = $DIR/server.pem
ssl_options.keyfile = $DIR/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = true
loopback_users = none
CONF
echo "[]." > enabled_plugins
chown -R rabbitmq:rabbitmq "$DIR"
chmod -R a+rX "$DIR"
RABBITMQ_NODENAME="$NODE" RABBITMQ_DIST_PORT=25673 RABBITMQ_CONFIG_FILE="$DIR/rabbitmq" \
  RABBITMQ_ENABLED_PLUGINS_FILE="$DIR/enabled_plugins" RABBITMQ_MNESIA_BASE="$DIR/mnesia" \
  RABBITMQ_LOG_BASE="$DIR/log" RABBITMQ_PID_FILE="$DIR/pid" \
  rabbitmq-server -detached >/dev/null 2>&1 9>&- # the node must not hold the lock
for _ in $(seq 1 120); do
  if up; then
    echo "$DIR"
    exit 0
  fi
  sleep 0.5
done
echo "start-tls-rabbitmq: node $NODE did not listen on $PORT; see $DIR/log" >&2
exit 1
