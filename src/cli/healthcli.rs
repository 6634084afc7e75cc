//! `timeoutd health`: asks a running daemon's `/healthz`, with no async runtime and no
//! logging, for a container's or a unit's health check.

use std::process::ExitCode;
use std::time::Duration;

use crate::config::Config;

/// `timeoutd health`: one GET under a 5 s deadline, no async runtime, no logging. The verdict
/// goes to stderr (stdout stays clean for `--json`, which prints it as an object); exit 0
/// when healthy, 1 when not.
pub fn probe_health(url: Option<&str>, config: &Config, json: bool) -> ExitCode {
    let url = url.map(str::to_string).unwrap_or_else(|| {
        let mut addr = config.http.listen;
        if addr.ip().is_unspecified() {
            addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        format!("http://{addr}/healthz")
    });
    let agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(5)))
        .http_status_as_error(false)
        .build()
        .new_agent();
    let (healthy, status, problem) = match agent.get(&url).call() {
        Ok(r) if r.status().is_success() => (true, Some(r.status().as_u16()), None),
        Ok(r) => (
            false,
            Some(r.status().as_u16()),
            Some(r.status().to_string()),
        ),
        Err(e) => (false, None, Some(e.to_string())),
    };
    if json {
        let shown = serde_json::json!({
            "healthy": healthy, "url": url, "status": status, "error": problem,
        });
        say!("{shown}");
    }
    match problem {
        None => {
            eprintln!("healthy ({url})");
            ExitCode::SUCCESS
        }
        Some(problem) => {
            eprintln!("unhealthy: {problem} ({url})");
            ExitCode::FAILURE
        }
    }
}
