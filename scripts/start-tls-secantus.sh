#!/usr/bin/env bash
# Starts SecantusDB's Python server with TLS only, requiring client certificates, for the
# MongoDB TLS test: a self-signed CA, a server certificate for localhost and 127.0.0.1, and a
# client certificate, all made here with openssl. Prints two lines: the server's URI
# (mongodb://localhost:PORT/) and DIR, which holds ca.pem, client-combined.pem (the client
# certificate and its PKCS#8 key in one file, as the MongoDB driver reads it) and pid.
# Usage: scripts/start-tls-secantus.sh DIR
set -euo pipefail
cd "$(dirname "$0")/.."
scripts="$PWD/scripts"
dir="${1:?usage: start-tls-secantus.sh DIR}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"

(
  cd "$dir"
  quiet() { "$@" >/dev/null 2>&1 || { echo "start-tls-secantus: $* failed" >&2; exit 1; }; }
  quiet openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=timeoutd test CA" \
    -keyout ca.key -out ca.pem
  for who in server client; do
    cn=localhost; [ "$who" = client ] && cn=timeoutd
    quiet openssl req -newkey rsa:2048 -nodes -subj "/CN=$cn" -keyout "$who.rsa.key" -out "$who.csr"
    printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' >"$who.ext"
    quiet openssl x509 -req -in "$who.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 30 \
      -extfile "$who.ext" -out "$who.pem"
    quiet openssl pkcs8 -topk8 -nocrypt -in "$who.rsa.key" -out "$who.key"
  done
  cat client.pem client.key >client-combined.pem
)

uri=$("$scripts/start-secantus-py.sh" "$dir/server" \
  --tls-cert-file "$dir/server.pem" --tls-key-file "$dir/server.key" \
  --tls-ca-file "$dir/ca.pem" --tls-require-client-cert)
cp "$dir/server/pid" "$dir/pid"
echo "${uri/127.0.0.1/localhost}"
echo "$dir"
