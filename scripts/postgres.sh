#!/usr/bin/env bash
# A private PostgreSQL server for the tests (Debian's package, `postgresql`): a cluster of its
# own in DIR, on 127.0.0.1 and a free port, trusting local connections, without fsync (a test
# server: what is tested is kernelkite's use of it; `durable` keeps PostgreSQL's defaults, for
# benchmarks). Prints its URL, which the tests read from KERNELKITE_TEST_DATABASE_URL; each
# test makes a schema of its own there.
# As root it runs as the `postgres` user (PostgreSQL refuses root), which the package creates.
# `restart` stops the server (fast: sessions are ended) and starts it again on the same port.
# Usage: scripts/postgres.sh start DIR [durable] | restart DIR | stop DIR
set -euo pipefail

cmd=${1:-}
dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ] || [ "$cmd" = -h ] || [ "$cmd" = --help ]; then
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  [ -n "$dir" ]
  exit
fi
bin=$(find /usr/lib/postgresql -maxdepth 3 -name pg_ctl -path '*/bin/*' 2>/dev/null | sort -V | tail -n1 | xargs -r dirname)
if [ -z "$bin" ]; then
  echo "error: PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/pg_ctl): apt-get install postgresql" >&2
  exit 3
fi
as=()
if [ "$(id -u)" -eq 0 ]; then
  if ! id postgres >/dev/null 2>&1; then
    echo "error: running as root, and there is no postgres user to run PostgreSQL as (the postgresql package creates it)" >&2
    exit 3
  fi
  as=(runuser -u postgres --)
fi

# Everything goes into a new directory of the server's own (the server's user may not be able
# to enter DIR, nor should DIR change owner): the cluster, its sockets, its password and its
# logs. DIR/postgres-home says where, for `stop`.
dir=$(realpath -m "$dir")
case "$cmd" in
start)
  if [ -e "$dir/postgres-home" ]; then
    echo "error: $dir has a server already (scripts/postgres.sh stop $dir first)" >&2
    exit 1
  fi
  mkdir -p "$dir"
  home=$(mktemp -d "${TMPDIR:-/tmp}/kernelkite-postgres.XXXXXX")
  echo "$home" >"$dir/postgres-home"
  [ ${#as[@]} -eq 0 ] || chown postgres: "$home"
  # The server's user may not enter the caller's directory (a clone under a 0700 one).
  cd "$home"
  fast="-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
  [ "${3:-}" != durable ] || fast=""
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  # A password of its own (no other user of this machine may connect, as anyone can to a
  # server that trusts loopback), and sockets only in its 0700 directory.
  password=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
  (umask 077 && printf '%s\n' "$password" >"$home/password")
  [ ${#as[@]} -eq 0 ] || chown postgres: "$home/password"
  "${as[@]}" "$bin/initdb" -D "$home/data" -U postgres --auth=scram-sha-256 --pwfile="$home/password" \
    -E UTF8 --no-sync >"$home/initdb.log" 2>&1 || { cat "$home/initdb.log" >&2; exit 1; }
  "${as[@]}" "$bin/pg_ctl" -D "$home/data" -l "$home/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $port -c unix_socket_directories='$home' $fast -c max_connections=200" \
    start >/dev/null || { cat "$home/server.log" >&2; exit 1; }
  echo "postgres://postgres:$password@127.0.0.1:$port/postgres"
  ;;
restart)
  if [ ! -f "$dir/postgres-home" ]; then
    echo "error: $dir has no server (scripts/postgres.sh start $dir first)" >&2
    exit 1
  fi
  home=$(cat "$dir/postgres-home")
  cd "$home"
  "${as[@]}" "$bin/pg_ctl" -D "$home/data" -l "$home/server.log" -m fast -w -t 60 restart >/dev/null \
    || { cat "$home/server.log" >&2; exit 1; }
  ;;
stop)
  [ -f "$dir/postgres-home" ] || exit 0
  home=$(cat "$dir/postgres-home")
  if [ -d "$home/data" ]; then
    cd "$home"
    "${as[@]}" "$bin/pg_ctl" -D "$home/data" -m immediate -w stop >/dev/null 2>&1 || true
    cd /
  fi
  case "$home" in
  */kernelkite-postgres.*) rm -rf "$home" ;;
  esac
  rm -f "$dir/postgres-home"
  ;;
*)
  echo "error: unknown command $cmd (start, restart or stop)" >&2
  exit 1
  ;;
esac
