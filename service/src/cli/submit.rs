//! `kernelkite-service submit`: a kernelbot task directory and a submission file in, the
//! result out. The run config is built as kernelbot's backend builds it, submitted to local
//! mode in this process (or to `--server`), and followed over server-sent events.
//!
//! Exit codes: 0 every run passed; 1 the submission ran and failed a check (or the runner
//! could not evaluate it); 2 the task, the submission or the command line is wrong; 3 no
//! result came back (the service failed, timed out or canceled the submission, or could not be
//! reached).

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use chrono::{DateTime, Utc};
use serde_json::json;

use super::client::Client;
use super::display;
use super::embedded;
use crate::local::LocalArgs;
use crate::task::{self, Mode};

/// `submit`'s settings.
#[derive(Debug, Clone, clap::Args)]
pub struct SubmitArgs {
    /// The task directory, in kernelbot's format (`task.yml` and the files it names).
    #[arg(long, value_name = "DIR")]
    pub task: PathBuf,
    /// The submission; its content goes where `task.yml` says `@SUBMISSION@`.
    #[arg(long, value_name = "FILE")]
    pub submission: PathBuf,
    /// kernelbot's submission mode.
    #[arg(long, value_enum, default_value = "test")]
    pub mode: Mode,
    /// The queue the run goes to (a Buildkite agent queue on a production service).
    #[arg(long, default_value = "local")]
    pub queue: String,
    /// A running kernelkite service to submit to (`https://kite.example.org`). Default: local
    /// mode, started in this process for this submission.
    #[arg(long, env = "KERNELKITE_SERVER", value_name = "URL", value_parser = server_url)]
    pub server: Option<String>,
    /// The service's bearer token (its KERNELKITE_API_TOKEN).
    #[arg(long, env = "KERNELKITE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// The GPU architecture of a CUDA run, as kernelbot's GPU_TO_SM gives it (`90a` for H100,
    /// `80` for A100, `89` for L4). Default: none (nvcc's `-arch=native`).
    #[arg(long)]
    pub arch: Option<String>,
    /// The run id the backend would give (default: the submission id).
    #[arg(long)]
    pub run_id: Option<String>,
    /// Seconds the submission may take before the service gives up on it.
    #[arg(long)]
    pub timeout_s: Option<u64>,
    /// Print the run config that would be submitted, and exit.
    #[arg(long)]
    pub print_config: bool,
    /// Print the final submission as JSON on stdout instead of the table (progress stays on
    /// stderr).
    #[arg(long)]
    pub json: bool,
    /// The local executor (without --server).
    #[command(flatten, next_help_heading = "Local mode (without --server)")]
    pub local: LocalArgs,
}

const INPUT_ERROR: u8 = 2;
const NO_RESULT: u8 = 3;

// Over 80 lines: the command's steps in order (load, check, reach the service, submit, follow,
// print), each with its own exit code.
/// Runs `submit`.
pub async fn run(args: SubmitArgs) -> anyhow::Result<ExitCode> {
    let task = match task::load(&args.task) {
        Ok(t) => t,
        Err(e) => return Ok(input_error(&e)),
    };
    let text = match task::read_submission(&args.submission) {
        Ok(t) => t,
        Err(e) => return Ok(input_error(&e)),
    };
    let config = task::build_config(&task, &text, args.arch.as_deref(), args.mode);
    if args.print_config {
        println!("{}", serde_json::to_string_pretty(&config)?);
        return Ok(ExitCode::SUCCESS);
    }
    // The runner's own checks, before anything is sent: the same reason the service's 422
    // would give, without a round trip.
    if let Err(e) = kernelkite_kernelbot::config::RunConfig::from_json(config.clone()) {
        eprintln!(
            "kernelkite-service: the run config built from {} would be refused: {}",
            args.task.display(),
            crate::report::report(&e)
        );
        return Ok(ExitCode::from(INPUT_ERROR));
    }

    // Local mode lives as long as this command.
    let (_embedded, base, token) = match &args.server {
        Some(url) => (None, url.clone(), args.token.clone()),
        None => {
            let e = embedded::start(&args.local).await?;
            let n = e.local.slices().len();
            eprintln!(
                "local mode: {n} slice{} on this machine, {}",
                if n == 1 { "" } else { "s" },
                e.base
            );
            let base = e.base.clone();
            (Some(e), base, None)
        }
    };
    let client = Client::new(&base, token);
    let mut body = json!({"config": config, "queue": args.queue});
    if let Some(r) = &args.run_id {
        body["run_id"] = json!(r);
    }
    if let Some(t) = args.timeout_s {
        body["timeout_s"] = json!(t);
    }
    let id = match client.submit(&body).await {
        Ok(id) => id,
        Err(e) => {
            eprintln!("kernelkite-service: {}", crate::report::report(&e));
            return Ok(ExitCode::from(NO_RESULT));
        }
    };
    eprintln!(
        "submitted {} in {} mode to {base}: submission {id}",
        args.submission.display(),
        args.mode.as_str()
    );
    let mut first: Option<DateTime<Utc>> = None;
    let followed = client
        .follow(&id, |ev| {
            let at = ev.at.unwrap_or(ev.received);
            let t0 = *first.get_or_insert(at);
            let s = (at - t0).num_milliseconds() as f64 / 1000.0;
            eprintln!("  [{s:7.3} s] {}", ev.state);
            let _ = std::io::stderr().flush();
        })
        .await;
    let submission = match followed {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kernelkite-service: {}", crate::report::report(&e));
            return Ok(ExitCode::from(NO_RESULT));
        }
    };
    if args.json {
        println!("{submission}");
    }
    let state = submission["state"].as_str().unwrap_or("?");
    if state != "succeeded" {
        eprintln!(
            "no result: the submission ended {state}: {}",
            submission["error"].as_str().unwrap_or("(no reason given)")
        );
        return Ok(ExitCode::from(NO_RESULT));
    }
    let result = &submission["result"];
    if !args.json {
        print!("{}", display::result_table(result));
        if args.mode == Mode::Leaderboard {
            let rank = task.task["ranking_by"].as_str().unwrap_or("last");
            if let Some(s) = display::score(result, rank) {
                println!("  score ({rank}): {}", display::seconds(s));
            }
        }
    }
    Ok(if display::all_passed(result) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn input_error(e: &(dyn std::error::Error + 'static)) -> ExitCode {
    eprintln!("kernelkite-service: {}", crate::report::report(e));
    ExitCode::from(INPUT_ERROR)
}

/// `--server`: an `http` or `https` URL; a bare host is refused, saying what to write.
fn server_url(s: &str) -> Result<String, String> {
    match reqwest::Url::parse(s) {
        Ok(u) if matches!(u.scheme(), "http" | "https") && u.has_host() => Ok(s.to_string()),
        Ok(u) if u.has_host() || u.cannot_be_a_base() => Err(format!(
            "{s:?} is not an http(s) URL: write http://{s} (or https://, where the service has TLS)"
        )),
        Ok(u) => Err(format!("{s:?} names no host ({} URL)", u.scheme())),
        Err(_) => Err(format!(
            "{s:?} is not a URL: write it with its scheme, http://{s} (or https://, where the service has TLS)"
        )),
    }
}

#[cfg(test)]
mod server_url_tests {
    use super::server_url;

    #[test]
    fn a_server_needs_its_scheme() {
        assert!(server_url("http://127.0.0.1:8080").is_ok());
        assert!(server_url("https://kite.example.org/").is_ok());
        for bad in [
            "127.0.0.1:8080",
            "kite.example.org",
            "localhost:8080",
            "ftp://x",
            "",
        ] {
            let e = server_url(bad).unwrap_err();
            assert!(e.contains("http"), "{bad}: {e}");
        }
        assert!(server_url("kite.example.org")
            .unwrap_err()
            .contains("http://kite.example.org"));
    }
}
