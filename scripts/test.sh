#!/usr/bin/env bash
# The project's one test command (README "Run the tests"; `.ci/run` calls exactly this).
# It installs what it needs, then runs, in order: formatting, lints, the API docs, the node's
# binaries (scripts/node-binaries.sh: the static kernelkite-isolate, which needs the musl
# target, added with rustup), a private PostgreSQL server for the store's tests
# (scripts/postgres.sh), every crate's tests, the fast tier (a plain `cargo test`, which
# also lints every shell script with shellcheck, the Dockerfiles with hadolint and the units
# with systemd-analyze) then the full tier (the test binaries marked `test = false` and the
# tests marked `#[ignore = "full tier ..."]`), the Python client's ruff and pytest suite (in a
# venv at target/py-venv, against the real service binary), the plugin's bats tests, the
# Docker images' builds, the fast tier again in a fresh clone with
# nothing beside it (under /var/tmp, where the README's main job, ./scripts/demo.sh, runs too;
# in CI, where the checkout is a clean clone already, the whole run happens in such a clone
# instead, once), and each benchmark in its short mode; then how long each section took.
# A failure does not stop it: every suite
# runs (cargo's --no-fail-fast), the failing tests and steps are listed at the end, the closing
# line counts passed, failed and skipped tests, and the exit status is 1 when anything failed.
# A test that could not run here (no root, no GPU, no cgroups, no Docker daemon) is listed with
# its reason and never counted as passed.
#
# Environment:
#   KERNELKITE_SKIP_INSTALL=1  don't touch apt (you installed bats, hwloc, python3, nftables,
#                              the linter and systemd yourself) and don't fetch hadolint
#   KERNELKITE_SKIP_BENCH=1    skip the short benchmark runs
#   KERNELKITE_SKIP_CLONE=1    skip the fresh-clone run (it tests the last commit, not your
#                              uncommitted changes)
#   KERNELKITE_SKIP_DOCKER=1   skip building the Docker images (counted as skipped)
#   KERNELKITE_HADOLINT=PATH   the hadolint binary to lint the Dockerfiles with
set -euo pipefail
cd "$(dirname "$0")/.."

# Each section says how much room the build directory has left: a full disk fails a run in
# whichever build comes next (CI's once did, in the benchmarks' release build).
# Each section's start is kept, for the times printed at the end.
section_names=()
section_starts=()
section() {
  section_names+=("$*")
  section_starts+=("$SECONDS")
  printf '\n--- %s (%s free)\n' "$*" "$(df -h --output=avail . 2>/dev/null | tail -n1 | tr -d ' ')"
}
# How long each section took, longest first, and the whole run.
section_times() {
  local i n=${#section_names[@]} end
  echo "time by section (longest first; the whole run ${SECONDS} s):"
  for ((i = 0; i < n; i++)); do
    end=${section_starts[i + 1]:-$SECONDS}
    printf '%6d s  %s\n' "$((end - section_starts[i]))" "${section_names[i]}"
  done | sort -rn
}

# CI builds once from a clean checkout: incremental caches (gigabytes) would never be read.
[ "${CI:-}" != true ] || export CARGO_INCREMENTAL=0

install_deps() {
  # Linters: the shell scripts are checked with shellcheck, the units with systemd-analyze.
  # Debian's prometheus gives promtool (the alert rules' and the scrape config's checks);
  # chromium and chromium-driver, the dashboard's browser test.
  local want=(bats hwloc python3 python3-venv python3-yaml iproute2 nftables util-linux procps shellcheck systemd postgresql haproxy prometheus chromium chromium-driver)
  local missing=()
  for p in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    section "installing ${missing[*]} (apt)"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  if ! command -v cargo >/dev/null; then
    echo "error: cargo is not installed. Install Rust with rustup (https://rustup.rs), then re-run." >&2
    exit 1
  fi
  for comp in clippy rustfmt; do
    if ! cargo "${comp/rustfmt/fmt}" --version >/dev/null 2>&1; then
      section "installing rustup component $comp"
      rustup component add "$comp"
    fi
  done
}

# hadolint is not packaged by Debian: its pinned static release, checked against its
# SHA-256, when github.com is reachable. Without it the hadolint test skips, saying why.
HADOLINT_VERSION=2.12.0
HADOLINT_SHA256=56de6d5e5ec427e17b74fa48d51271c7fc0d61244bf5c90e828aab8362d55010
fetch_hadolint() {
  [ -z "${KERNELKITE_HADOLINT:-}" ] || return 0
  command -v hadolint >/dev/null && return 0
  local bin="target/tools/hadolint-$HADOLINT_VERSION"
  if [ ! -x "$bin" ]; then
    if [ "$(uname -m)" != x86_64 ] || ! command -v curl >/dev/null; then
      echo "note: hadolint is not fetched here (needs x86_64 and curl); its test skips"
      return 0
    fi
    mkdir -p target/tools
    if ! curl -fsSL --max-time 60 -o "$bin.tmp" \
      "https://github.com/hadolint/hadolint/releases/download/v$HADOLINT_VERSION/hadolint-Linux-x86_64" 2>/dev/null; then
      rm -f "$bin.tmp"
      echo "note: github.com is not reachable, so hadolint is not fetched; its test skips"
      return 0
    fi
    if ! echo "$HADOLINT_SHA256  $bin.tmp" | sha256sum --check --quiet -; then
      rm -f "$bin.tmp"
      echo "error: the downloaded hadolint does not have the pinned SHA-256" >&2
      exit 1
    fi
    chmod +x "$bin.tmp" && mv "$bin.tmp" "$bin"
  fi
  export KERNELKITE_HADOLINT="$PWD/$bin"
}

if [ "${KERNELKITE_SKIP_INSTALL:-}" != 1 ]; then
  install_deps
  fetch_hadolint
fi

# In CI the checkout is a clean clone already: the whole run moves into a clone of it under
# /var/tmp with nothing beside it (the sandbox replaces /var/tmp in every job, so a checkout
# there must work too), which proves the repository stands alone without building and running
# the suite a second time. Its build directory stays where CI's would be (outside /var/tmp,
# where the tests' fake device trees must stay visible to their jobs). A developer's tree,
# changes and all, is tested in place, and a fresh clone of its last commit runs the tests
# again afterwards.
if [ "${CI:-}" = true ] && [ -z "${KERNELKITE_IN_CLONE:-}" ] && [ "${KERNELKITE_SKIP_CLONE:-}" != 1 ] &&
  git rev-parse --git-dir >/dev/null 2>&1; then
  clone_parent=$(mktemp -d -p /var/tmp kernelkite-clone.XXXXXX)
  git clone --quiet --no-hardlinks "$PWD" "$clone_parent/kernelkite"
  printf '\n--- the run moves into a fresh clone of %s: %s/kernelkite\n' \
    "$(git rev-parse --short HEAD)" "$clone_parent"
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}" KERNELKITE_IN_CLONE=1 KERNELKITE_SKIP_INSTALL=1
  rc=0
  (cd "$clone_parent/kernelkite" && ./scripts/test.sh) || rc=$?
  rm -rf "$clone_parent"
  exit "$rc"
fi

# What failed, in the order it ran: "<step>\t<failed tests it counted>" (a step that failed
# without a failing test, such as clippy or a build, counts as one failed check).
failures=$(mktemp)
failed_step() { printf '%s\t%s\n' "$1" "${2:-0}" >>"$failures"; echo "FAILED: $1" >&2; }
# Runs a step; on failure records it and goes on.
step() {
  local name=$1
  shift
  "$@" || failed_step "$name"
}

section "cargo fmt --check"
step "cargo fmt --check" cargo fmt --all --check

section "cargo clippy (warnings are errors)"
step "cargo clippy" cargo clippy --workspace --all-targets --locked -- -D warnings
# `--all-targets` leaves out the test targets marked `test = false` (the full tier), and takes
# precedence over `--test` beside it: a second run with `--test '*'` checks them.
step "cargo clippy (the full tier's tests)" cargo clippy --workspace --test '*' --locked -- -D warnings

section "cargo doc (warnings are errors)"
step "cargo doc" env RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked --quiet

log=$(mktemp)
# Checks of this script itself (the Docker builds): "<name>\t<pass|skip>\t<reason>" lines.
checks=$(mktemp)
# Tests that skip themselves append "<test>\t<reason>" here (kernelkite_testkit::skip).
export KERNELKITE_SKIP_LOG
KERNELKITE_SKIP_LOG=$(mktemp)
clone_dir=""
py_junit=""
pg_dir=""
# The demo's background build stops with the script, however it ends.
demo_build_pid=""
cleanup() {
  [ -z "$demo_build_pid" ] || kill "$demo_build_pid" 2>/dev/null || true
  [ -z "$pg_dir" ] || { ./scripts/postgres.sh stop "$pg_dir" || true; rm -rf "$pg_dir"; }
  rm -rf "$log" "$checks" "$failures" "$KERNELKITE_SKIP_LOG" ${clone_dir:+"$clone_dir"} ${py_junit:+"$py_junit"}
}
trap cleanup EXIT

section "the node's binaries: the static kernelkite-isolate (scripts/node-binaries.sh --static-only target/node)"
# The hooks' static build, which its own tests (plugin/tests/node/static_build.rs) and the job
# overhead benchmark run. Without the musl target (rustup offline) those tests skip, saying so.
# The dynamic release builds a node installs beside it are left out: only the benchmarks would
# run them, and their short runs here take the tests' build instead (a minute and a half less).
node_rc=0
./scripts/node-binaries.sh --static-only target/node || node_rc=$?
if [ "$node_rc" = 0 ]; then
  export KERNELKITE_STATIC_ISOLATE="$PWD/target/node/kernelkite-isolate"
elif [ "$node_rc" = 3 ]; then
  echo "note: no static build here (the musl target cannot be added); its tests skip"
else
  failed_step "scripts/node-binaries.sh (exit $node_rc)"
fi

section "the real Buildkite agent (scripts/buildkite-agent.sh: tests/buildkite-agent/go.mod)"
# Built once into target/; the real-agent tests (tests/tests/real_agent.rs) run it and fail,
# never skip, when this script says it is there.
if KERNELKITE_BUILDKITE_AGENT=$(./scripts/buildkite-agent.sh); then
  export KERNELKITE_BUILDKITE_AGENT
else
  failed_step "scripts/buildkite-agent.sh"
fi

# cargo's failing tests in a log: their count (from the per-binary result lines).
cargo_failed() { grep -hoE '[0-9]+ failed;' "$1" | awk '{s+=$1} END {print s+0}'; }

if [ -n "${KERNELKITE_IN_CLONE:-}" ]; then
  # The README's main job builds from nothing in its own build directory under /var/tmp (a
  # clone there must work with its binaries there too). That build runs now, in the
  # background at the lowest priority: the tests below mostly wait (on processes, sockets,
  # agents), and the build takes only the CPU they leave. The demo runs after them.
  demo_build_log=$(mktemp)
  env -u CARGO_TARGET_DIR KERNELKITE_DEMO_BUILD_ONLY=1 nice -n 19 ./scripts/demo.sh >"$demo_build_log" 2>&1 &
  demo_build_pid=$!
fi

section "PostgreSQL for the tests (scripts/postgres.sh: a private server, stopped at the end)"
# The store's suite runs against it (service/tests/store.rs); without it those tests skip,
# saying so. A cluster of its own: a few seconds, and nothing of the machine's is touched.
pg_dir=$(mktemp -d)
if KERNELKITE_TEST_DATABASE_URL=$(./scripts/postgres.sh start "$pg_dir"); then
  export KERNELKITE_TEST_DATABASE_URL
  echo "PostgreSQL at ${KERNELKITE_TEST_DATABASE_URL##*@} (scripts/postgres.sh; its password in the URL the tests get)"
else
  unset KERNELKITE_TEST_DATABASE_URL
  if [ "${CI:-}" = true ]; then
    # CI installs PostgreSQL: a server that cannot start there is a failure, not a skip.
    failed_step "scripts/postgres.sh (PostgreSQL for the tests did not start)"
  else
    echo "note: no PostgreSQL server for the tests (scripts/postgres.sh failed above); the PostgreSQL store's tests skip"
  fi
fi

section "cargo test (the fast tier)"
# --no-fail-fast: one failing test binary no longer hides the others' results.
if ! cargo test --workspace --locked --no-fail-fast 2>&1 | tee "$log"; then
  failed_step "cargo test" "$(cargo_failed "$log")"
fi

# The full tier: the test binaries a plain `cargo test` leaves out (`test = false` in their
# crate's Cargo.toml: root, real cgroups, the real agent, SIGKILL), found in the manifests so
# the list has one home, and the few tests of the fast tier's binaries marked
# `#[ignore = "full tier ..."]` (they wait out timeouts of seconds); the same dev build, so
# nothing is compiled twice. Every ignored test runs here, so an ignore cannot hide a test.
full_tier_args() {
  cargo metadata --format-version 1 --no-deps --locked | python3 -c '
import json, sys
for p in json.load(sys.stdin)["packages"]:
    for t in p["targets"]:
        if t["kind"] == ["test"] and not t["test"]:
            print("-p", p["name"], "--test", t["name"])'
}
section "cargo test (the full tier: root, real cgroups, the real agent, SIGKILL)"
full_log=$(mktemp)
full_args=$(full_tier_args) || full_args=""
if [ -z "$full_args" ]; then
  # Without the list, a bare `cargo test` would run the fast tier again instead.
  failed_step "cargo test (the full tier): its test binaries could not be listed (cargo metadata, python3)"
else
  # shellcheck disable=SC2086 # one word per argument, from full_tier_args
  if ! cargo test --locked --no-fail-fast $full_args 2>&1 | tee "$full_log"; then
    failed_step "cargo test (the full tier)" "$(cargo_failed "$full_log")"
  fi
  cat "$full_log" >>"$log"
  if ! cargo test --workspace --tests --locked --no-fail-fast -- --ignored 2>&1 | tee "$full_log"; then
    failed_step "cargo test (the full tier: the fast tier's ignored tests)" "$(cargo_failed "$full_log")"
  fi
  cat "$full_log" >>"$log"
fi
rm -f "$full_log"
section "python client (clients/python): ruff, pytest against the real service"
# Pinned tools in a venv of their own; the suite starts kernelkite-service and fake-buildkite
# as processes, as cargo test built them (target/debug; no build of their own, whose features,
# without the tests' dev-dependencies, would compile them again). Run beside the full tier, it
# took longer than after it (CI, 2 cores): it computes more than it waits.
py_venv=target/py-venv
py_passed=0 py_failed=0 py_skipped=0 py_counts=""
py_ready=true
[ -x "$py_venv/bin/python" ] || python3 -m venv "$py_venv" || py_ready=false
$py_ready && "$py_venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  -r clients/python/requirements-test.txt || py_ready=false
$py_ready || failed_step "the Python test venv (target/py-venv)"
# The checkout mode (kernelbot's own code with the launcher) runs where KERNELBOT_SRC names a
# kernelbot checkout; its interpreter is made here unless KERNELBOT_PYTHON names one.
if [ -n "${KERNELBOT_SRC:-}" ] && [ -z "${KERNELBOT_PYTHON:-}" ]; then
  KERNELBOT_PYTHON=$(./scripts/kernelbot-venv.sh | tail -n1)
  export KERNELBOT_PYTHON="$PWD/$KERNELBOT_PYTHON"
fi
if $py_ready; then
  (cd clients/python && ../../$py_venv/bin/ruff check . && ../../$py_venv/bin/ruff format --check .) ||
    failed_step "ruff (clients/python)"
  py_junit=$(mktemp)
  # -rs prints each skip with its reason, -rf each failure; the counts come from the JUnit XML.
  (cd clients/python && ../../$py_venv/bin/python -m pytest -rfs -p no:cacheprovider \
    --junitxml="$py_junit") || true
  if py_counts=$("$py_venv/bin/python" scripts/pytest_counts.py "$py_junit"); then
    read -r py_passed py_failed py_skipped <<<"$(head -n1 <<<"$py_counts")"
    ((py_failed == 0)) || failed_step "pytest (clients/python)" "$py_failed"
  else
    failed_step "pytest (clients/python): no JUnit report"
  fi
fi

section "bats (the plugin's hook files)"
bats_log=$(mktemp)
if ! bats plugin/tests/bats 2>&1 | tee "$bats_log"; then
  failed_step "bats" "$(grep -cE '^not ok [0-9]+' "$bats_log" || true)"
fi
cat "$bats_log" >>"$log" && rm -f "$bats_log"

section "docker images (deployment/*/Dockerfile*)"
if [ "${KERNELKITE_SKIP_DOCKER:-}" = 1 ]; then
  printf 'docker images\tskip\tKERNELKITE_SKIP_DOCKER=1\n' >>"$checks"
elif ! command -v docker >/dev/null; then
  printf 'docker images\tskip\tdocker is not installed\n' >>"$checks"
elif ! docker info >/dev/null 2>&1; then
  printf 'docker images\tskip\tno Docker daemon answers here (docker info fails)\n' >>"$checks"
else
  # The runner's CUDA and ROCm images (deployment/runner/Dockerfile, Dockerfile.rocm) and the
  # service's.
  docker_ok=true
  for image in runner/Dockerfile:runner runner/Dockerfile.rocm:runner-rocm service/Dockerfile:service; do
    docker build --quiet -f "deployment/${image%%:*}" -t "kernelkite-${image#*:}:test" . ||
      { docker_ok=false; failed_step "docker build deployment/${image%%:*}"; }
  done
  ! $docker_ok || printf 'docker images\tpass\t\n' >>"$checks"
fi
cut -f1,3 "$checks" | awk -F'\t' '{print ($2 == "" ? "built: " $1 : "skipped: " $1 ": " $2)}'

if [ -n "${KERNELKITE_IN_CLONE:-}" ]; then
  # This run is the fresh clone's (CI, above): the README's main job runs here too, in its
  # own build directory under /var/tmp.
  section "./scripts/demo.sh in this fresh clone (its own target directory, under /var/tmp; built since the tests began)"
  demo_log=$(mktemp)
  demo_build_rc=0
  wait "$demo_build_pid" || demo_build_rc=$?
  demo_build_pid=""
  if [ "$demo_build_rc" != 0 ]; then
    cat "$demo_build_log"
    failed_step "./scripts/demo.sh in a fresh clone under /var/tmp: its build (exit $demo_build_rc)"
  elif env -u CARGO_TARGET_DIR ./scripts/demo.sh >"$demo_log" 2>&1; then
    grep -E '^sandbox|^demo passed' "$demo_log"
  else
    cat "$demo_log"
    failed_step "./scripts/demo.sh in a fresh clone under /var/tmp"
  fi
  rm -f "$demo_log" "$demo_build_log"
elif [ "${KERNELKITE_SKIP_CLONE:-}" != 1 ] && git rev-parse --git-dir >/dev/null 2>&1; then
  # The repository must stand alone: clone it into an empty directory under /var/tmp (a
  # common place for a scratch checkout, which the job sandbox replaces with a private one),
  # with nothing beside it, and run the tests and the README's main job there.
  clone_dir=$(mktemp -d -p /var/tmp kernelkite-clone.XXXXXX)
  section "cargo test in a fresh clone ($(git rev-parse --short HEAD), in $clone_dir/kernelkite)"
  [ -z "$(git status --porcelain)" ] ||
    echo "note: the working tree has uncommitted changes; the clone tests the last commit"
  git clone --quiet --no-hardlinks "$PWD" "$clone_dir/kernelkite"
  # Its own target directory: sharing ours would swap the binaries our tests run. Its counts
  # are not added to the closing line (the same tests ran above); its failures are.
  root=$PWD
  if (cd "$clone_dir/kernelkite" &&
    KERNELKITE_SKIP_LOG=/dev/null CARGO_TARGET_DIR="$root/target/fresh-clone" \
      cargo test --workspace --locked --no-fail-fast >"$clone_dir/log" 2>&1); then
    grep -hoE '^test result: .* ([0-9]+) passed' "$clone_dir/log" | grep -oE '[0-9]+ passed' |
      awk '{s+=$1} END {print "fresh clone: " s+0 " passed, 0 failed"}'
  else
    # Each failing test's own output (its panic), then cargo's errors.
    sed -n '/^failures:$/,/^test result:/p' "$clone_dir/log" | grep -v '^ *[0-9]*: \|^ *at ' || true
    grep -E '^test .* \.\.\. FAILED$|^error' "$clone_dir/log" || tail -n 40 "$clone_dir/log"
    echo "error: the tests fail in a fresh clone but not here: something they need lives outside the repository (or is not committed)" >&2
    failed_step "cargo test in a fresh clone" "$(cargo_failed "$clone_dir/log")"
    grep -E '^test .* \.\.\. FAILED$' "$clone_dir/log" | sed 's/^/fresh clone: /' >>"$log" || true
  fi
  # CI never runs the clone again: its build directory goes before the next build.
  [ "${CI:-}" != true ] || rm -rf "$root/target/fresh-clone"
  section "./scripts/demo.sh in the fresh clone (its own target directory, under /var/tmp)"
  if (cd "$clone_dir/kernelkite" && env -u CARGO_TARGET_DIR ./scripts/demo.sh >"$clone_dir/demo.log" 2>&1); then
    grep -E '^sandbox|^demo passed' "$clone_dir/demo.log"
  else
    cat "$clone_dir/demo.log"
    failed_step "./scripts/demo.sh in a fresh clone under /var/tmp"
  fi
  rm -rf "$clone_dir/kernelkite/target"
elif [ "${KERNELKITE_SKIP_CLONE:-}" != 1 ]; then
  echo "note: not a git checkout; the fresh-clone run is skipped"
fi

if [ "${KERNELKITE_SKIP_BENCH:-}" != 1 ]; then
  section "benchmarks (short mode, from the tests' build)"
  # Only the bench targets (each prints its figures beside the baseline it names); the
  # unit tests already ran above. The short runs show that every benchmark runs; they are
  # built with the tests' profile (dev: one build for tests and benchmarks, seconds instead of
  # an optimised build's 7 minutes on 2 cores), so their figures are unoptimised and only the
  # static hooks (target/node) are as a node has them. The figures in docs/BENCHMARKS.md are
  # full runs of `cargo bench` (the bench profile) after `scripts/node-binaries.sh target/node`.
  echo "note: short runs of an unoptimised build; for figures run cargo bench (docs/BENCHMARKS.md)"
  KERNELKITE_BENCH_SHORT=1 step "benchmarks" cargo bench --workspace --locked --no-fail-fast --profile dev --bench '*'
fi

# One closing line over every runner above (cargo's per-binary lines, then bats' ok/not ok,
# `# skip` lines being bats' skips, then pytest's JUnit counts), plus each failed step that
# counted no failing test. A Rust test that skipped itself reported `ok` to cargo, so it is
# moved from passed to skipped.
passed=$(grep -hoE '^test result: .* ([0-9]+) passed' "$log" | grep -oE '[0-9]+ passed' | awk '{s+=$1} END {print s+0}')
failed=$(cargo_failed "$log")
bats_ok=$(grep -E '^ok [0-9]+' "$log" | grep -cv ' # skip' || true)
bats_skip=$(grep -E '^ok [0-9]+' "$log" | grep -c ' # skip' || true)
bats_bad=$(grep -cE '^not ok [0-9]+' "$log" || true)
rust_skip=$(cut -f1 "$KERNELKITE_SKIP_LOG" | sort -u | wc -l)
script_ok=$(awk -F'\t' '$2 == "pass"' "$checks" | wc -l)
script_skip=$(awk -F'\t' '$2 == "skip"' "$checks" | wc -l)
steps_failed=$(awk -F'\t' '$2 == 0' "$failures" | wc -l)
clone_failed=$(awk -F'\t' '$1 ~ /fresh clone/ {s+=$2} END {print s+0}' "$failures")
skipped=$((rust_skip + bats_skip + py_skipped + script_skip))
if [ -s "$failures" ]; then
  section "FAILED"
  echo "failed steps:"
  cut -f1 "$failures" | sed 's/^/  /'
  echo "failing tests:"
  { grep -E '^(fresh clone: )?test .* \.\.\. FAILED$' "$log" || true; } |
    sed -E 's/^(fresh clone: )?test (.*) \.\.\. FAILED$/  cargo: \1\2/'
  { grep -E '^not ok [0-9]+' "$log" || true; } | sed -E 's/^not ok [0-9]+ /  bats: /'
  { tail -n +2 <<<"$py_counts" || true; } | awk -F'\t' '$1 == "fail" {printf "  pytest: %s\n", $2}'
else
  section "all checks passed"
fi
if ((skipped)); then
  echo "skipped (not counted as passed):"
  sort -u -t$'\t' -k1,1 "$KERNELKITE_SKIP_LOG" | awk -F'\t' '{printf "  %s: %s\n", $1, $2}'
  { grep -E '^ok [0-9]+.* # skip' "$log" || true; } | sed -E 's/^ok [0-9]+ /  bats: /'
  { tail -n +2 <<<"$py_counts" || true; } | awk -F'\t' '$1 == "skip" {printf "  pytest: %s: %s\n", $2, $3}'
  awk -F'\t' '$2 == "skip" {printf "  scripts/test.sh: %s: %s\n", $1, $3}' "$checks"
fi
section_times
echo "tests: $((passed - rust_skip + bats_ok + py_passed + script_ok)) passed, $((failed + bats_bad + py_failed + clone_failed + steps_failed)) failed, $skipped skipped"
[ ! -s "$failures" ]
