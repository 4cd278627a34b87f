//! Picking up unfinished submissions after a restart: the executor says what became of each
//! one's build ([`Executor::recover`](crate::executor::Executor::recover)), and the core acts on
//! the answer as it would on the executor's events.

use std::sync::Arc;

use crate::app::App;
use crate::executor::{BuildEvent, BuildEventKind, Recovered};
use crate::report::report;
use crate::submission::{Outcome, State, Submission};

/// Recovers `sub` (a submission that had not ended when the service stopped, already back in
/// the store): its build is collected if it finished meanwhile, left to run (or run again) if
/// the executor has it, and failed with the executor's reason if it is lost. A submission
/// without a build, or one that ended, is left alone. Safe to call twice.
pub async fn recover_submission(app: &Arc<App>, sub: &Submission) -> Option<Recovered> {
    if sub.state.is_terminal() {
        return None;
    }
    let build = sub.build.as_ref()?;
    let recovered = match app.executor.recover(build).await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(id = %sub.id, build = build.number, error = %report(&*e), "could not recover the build; its events or its timeout will end the submission");
            return None;
        }
    };
    match &recovered {
        Recovered::Running | Recovered::Unknown => {}
        Recovered::Lost(why) => {
            app.finish_durably(&sub.id, Outcome::Failed(why.clone()))
                .await;
        }
        Recovered::Finished(status) if sub.state == State::Fetching => {
            // The collection was under way when the service stopped; the event that starts
            // one will not move a fetching submission again, so collect here.
            app.spawn_collect(&sub.id, sub, status, std::time::Instant::now());
        }
        Recovered::Finished(status) => app.on_event(BuildEvent {
            kind: BuildEventKind::Finished,
            build: status.clone(),
        }),
    }
    Some(recovered)
}
