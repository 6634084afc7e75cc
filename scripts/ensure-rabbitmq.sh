#!/usr/bin/env bash
# Checks that RabbitMQ answers on 127.0.0.1:5672; starts the local server if it is installed
# but stopped. Fails with a clear message otherwise.
set -euo pipefail

port_open() { (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; }

if port_open; then exit 0; fi
if command -v rabbitmq-server >/dev/null 2>&1; then
  echo "ensure-rabbitmq: starting the local RabbitMQ" >&2
  rabbitmq-server -detached >/dev/null 2>&1 || true
  for _ in $(seq 1 60); do
    port_open && exit 0
    sleep 1
  done
fi
echo "ensure-rabbitmq: RabbitMQ is not reachable on 127.0.0.1:5672 (guest/guest expected)" >&2
exit 1
