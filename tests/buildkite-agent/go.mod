// The real Buildkite agent the tests run (scripts/buildkite-agent.sh builds it from this
// module into target/buildkite-agent/). Pinned to v3.137.0: the first version with all of
// polyglot hooks (promoted in 3.85), plugins in a repository subdirectory (3.108) and the Job
// API's environment changes from polyglot hooks (fixed in 3.105), which the plugin relies on.
module kernelkite.test/buildkite-agent

go 1.26.5

require github.com/buildkite/agent/v3 v3.137.0

// The agent imports its glob library by a vanity path that the Go module proxy refuses
// (403 for drjosh.dev/zzglob); the same module at the same version is served under its
// repository's path, whose go.mod declares the vanity path.
replace drjosh.dev/zzglob => github.com/DrJosh9000/zzglob v0.4.3
