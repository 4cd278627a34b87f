//! The `kernelkite-service` command line: `serve` (the default: today's environment-driven
//! service), `local` (`serve --executor local`), `demo`, `submit` and `backup`.
//!
//! - [`serve`]: the HTTP API with the Buildkite or the local executor, until SIGINT/SIGTERM.
//! - [`embedded`]: local mode in this process on a loopback port, for `demo` and `submit`.
//! - [`client`]: the HTTP client `demo` and `submit` use: submit, then follow over SSE.
//! - [`display`]: result tables and timings for people.
//! - [`demo`], [`submit`]: the two client commands.

pub mod client;
pub mod demo;
pub mod display;
pub mod embedded;
pub mod serve;
pub mod submit;

use std::process::ExitCode;

use clap::Parser;

use crate::config::Config;
use crate::local::LocalArgs;

/// kernelkite-service: accepts kernelbot submissions and runs them as Buildkite builds
/// (signed webhooks wake the waiting client), or on this machine (`local`). Without a
/// subcommand it serves, configured by the flags below and their environment variables.
#[derive(Debug, Parser)]
#[command(
    name = "kernelkite-service",
    version,
    args_conflicts_with_subcommands = true,
    after_help = "Try it on this machine: `kernelkite-service demo`. Submit your own kernelbot task: `kernelkite-service submit --help`."
)]
pub struct Cli {
    /// What to do (default: serve).
    #[command(subcommand)]
    pub command: Option<Command>,
    /// `serve`'s settings, when no subcommand is given.
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// The subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Serve the HTTP API (what runs without a subcommand). `--executor local` runs the jobs
    /// on this machine instead of Buildkite.
    Serve(ServeArgs),
    /// Serve the HTTP API with the local executor: every submission runs on this machine,
    /// through the plugin's job hooks and the runner, one worker per slice of the node's plan.
    /// No Buildkite account, no webhook token. Same as `serve --executor local`.
    Local(ServeArgs),
    /// Start local mode on a loopback port, run the bundled example task in test, benchmark
    /// and leaderboard mode (and a wrong submission, which must fail), and print each state
    /// change, the results and where the time went.
    Demo(demo::DemoArgs),
    /// Submit a kernelbot task directory's run for a submission file and follow it to its
    /// result: against local mode in this process by default, or any kernelkite service
    /// with --server.
    Submit(submit::SubmitArgs),
    /// Copy the store of a data directory into a new file, consistently, while the service
    /// runs (SQLite's `VACUUM INTO`, checked). To restore: stop the service, move the data
    /// directory's kernelkite.db, -wal and -shm aside, put the copy there as kernelkite.db
    /// (mode 0600, the service's user), start the service.
    Backup(BackupArgs),
}

/// `backup`'s settings.
#[derive(Debug, Clone, clap::Args)]
pub struct BackupArgs {
    /// The service's data directory.
    #[arg(long, env = "KERNELKITE_DATA_DIR")]
    pub data_dir: std::path::PathBuf,
    /// The new file to write (never an existing one), e.g. kernelkite-2026-11-26.db.
    #[arg(long)]
    pub to: std::path::PathBuf,
}

/// `serve`'s settings: the service's and the local executor's.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// The service.
    #[command(flatten)]
    pub config: Config,
    /// The local executor (with `--executor local`).
    #[command(flatten, next_help_heading = "Local executor (--executor local)")]
    pub local: LocalArgs,
}

/// The binary's entry: parses the command line, runs the command on a tokio runtime, and
/// maps the outcome to an exit code (1: it failed, with the reason on stderr; 2: usage).
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kernelkite-service: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            None => {
                init_logs("info");
                serve::run(cli.serve, false)
                    .await
                    .map(|()| ExitCode::SUCCESS)
            }
            Some(Command::Serve(args)) => {
                init_logs("info");
                serve::run(args, false).await.map(|()| ExitCode::SUCCESS)
            }
            Some(Command::Local(args)) => {
                init_logs("info");
                serve::run(args, true).await.map(|()| ExitCode::SUCCESS)
            }
            Some(Command::Demo(args)) => {
                init_logs("warn");
                demo::run(args).await
            }
            Some(Command::Submit(args)) => {
                init_logs("warn");
                submit::run(args).await
            }
            Some(Command::Backup(args)) => {
                init_logs("warn");
                let b = crate::store::backup::backup(&args.data_dir, &args.to).await?;
                println!(
                    "backed up {} submission(s) ({} bytes) to {}",
                    b.submissions,
                    b.bytes,
                    b.path.display()
                );
                Ok(ExitCode::SUCCESS)
            }
        }
    });
    // Jobs' child processes are waited for by their tasks; do not wait for idle ones.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kernelkite-service: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Logs to stderr at `RUST_LOG`, else `default`.
fn init_logs(default: &str) {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, never in a journal or a file.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ExecutorKind;

    #[test]
    fn no_subcommand_is_serve_and_local_is_an_alias() {
        <Cli as clap::CommandFactory>::command().debug_assert();
        let cli = Cli::try_parse_from(["kernelkite-service", "--listen", "127.0.0.1:9"]).unwrap();
        assert!(cli.command.is_none());
        assert_eq!(cli.serve.config.edge.listen.port(), 9);
        let cli = Cli::try_parse_from([
            "kernelkite-service",
            "serve",
            "--executor",
            "local",
            "--runner-bin",
            "/x/runner",
        ])
        .unwrap();
        let Some(Command::Serve(s)) = cli.command else {
            panic!("serve expected")
        };
        assert_eq!(s.config.executor, ExecutorKind::Local);
        assert_eq!(
            s.local.runner_bin.as_deref(),
            Some(std::path::Path::new("/x/runner"))
        );
        let cli = Cli::try_parse_from(["kernelkite-service", "local", "--enforce"]).unwrap();
        assert!(matches!(cli.command, Some(Command::Local(ref s)) if s.local.enforce));
        assert!(
            Cli::try_parse_from(["kernelkite-service", "--listen", "127.0.0.1:9", "demo"]).is_err()
        );
    }
}
