#!/usr/bin/env bash
# A private PostgreSQL server for the tests (Debian's package, `postgresql`): a cluster of its
# own in DIR, on 127.0.0.1 and a free port, trusting local connections, without fsync (a test
# server: what is tested is kernelkite's use of it; `durable` keeps PostgreSQL's defaults, for
# benchmarks). Prints its URL, which the tests read from KERNELKITE_TEST_DATABASE_URL; each
# test makes a schema of its own there.
# As root it runs as the `postgres` user (PostgreSQL refuses root), which the package creates.
# Usage: scripts/postgres.sh start DIR [durable] | scripts/postgres.sh stop DIR
set -euo pipefail

cmd=${1:-}
dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ] || [ "$cmd" = -h ] || [ "$cmd" = --help ]; then
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
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

dir=$(realpath -m "$dir")
case "$cmd" in
start)
  mkdir -p "$dir"
  [ ${#as[@]} -eq 0 ] || chown postgres: "$dir"
  # The server's user may not enter the caller's directory (a clone under a 0700 one).
  cd "$dir"
  fast="-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
  [ "${3:-}" != durable ] || fast=""
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "${as[@]}" "$bin/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 --no-sync >"$dir/initdb.log" 2>&1 ||
    { cat "$dir/initdb.log" >&2; exit 1; }
  "${as[@]}" "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $port -k $dir $fast -c max_connections=200" \
    start >/dev/null || { cat "$dir/server.log" >&2; exit 1; }
  echo "postgres://postgres@127.0.0.1:$port/postgres"
  ;;
stop)
  [ -d "$dir/data" ] || exit 0
  cd "$dir"
  "${as[@]}" "$bin/pg_ctl" -D "$dir/data" -m immediate -w stop >/dev/null 2>&1 || true
  ;;
*)
  echo "error: unknown command $cmd (start or stop)" >&2
  exit 1
  ;;
esac
