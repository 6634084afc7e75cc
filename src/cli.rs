//! The command line: `run`, `check-config`, `schedule`, `stats`, `reap`, `parked`, `health`,
//! and the operator commands of [`crate::opscli`] (`list`, `cancel`, `reschedule`, `pause`,
//! `resume`, `paused`).
//!
//! Exit codes: 0 success, 1 a runtime failure, 2 a bad configuration or bad arguments (an
//! unknown id, a malformed instant), 3 records under a live lease were left as they are.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use bson::Document;
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::clock::ServerClock;
use crate::config::{Config, LogFormat};
use crate::parking::Requeued;
use crate::record::{TimeoutRecord, display_id};
use crate::redact::{RedactingWriter, redact_text};
use crate::store::{Store, server_time_in};
use crate::{daemon, shutdown};

/// Fires ServiceConnect process-manager timeouts from MongoDB to RabbitMQ.
#[derive(Debug, Parser)]
#[command(name = "timeoutd", version = crate::buildinfo::LONG_VERSION, about)]
pub struct Cli {
    /// Config file [default: config/timeoutd.toml if it exists, else /etc/timeoutd/timeoutd.toml]
    #[arg(long, global = true, value_name = "PATH")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon in the foreground until SIGTERM or SIGINT.
    Run,
    /// Load and validate the configuration, print it with passwords hidden.
    CheckConfig,
    /// Insert one ServiceConnect-shaped timeout record; prints its id.
    Schedule {
        /// Queue the TimeoutMessage is sent to.
        #[arg(long, value_parser = clap::builder::NonEmptyStringValueParser::new())]
        destination: String,
        /// The process manager's id (becomes the message's CorrelationId).
        #[arg(long, value_name = "UUID")]
        correlation_id: Uuid,
        /// How far from now (server clock) it falls due, e.g. 5s, 250ms, 2h.
        #[arg(long = "in", value_name = "DURATION", value_parser = humantime::parse_duration)]
        delay: Duration,
        /// A custom header to forward, repeatable.
        #[arg(long = "header", value_name = "K=V", value_parser = parse_header)]
        headers: Vec<(String, String)>,
    },
    /// Counts of pending, due, leased, expired-lease, stuck and unschedulable records, and
    /// the oldest due age.
    Stats {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Free expired leases once and print how many.
    Reap,
    /// Records timeoutd gave up on (poison, or refused max_attempts times).
    Parked {
        #[command(subcommand)]
        action: ParkedCommand,
    },
    /// Timeouts, soonest first: id, destination, correlation id, due instant, state, and the
    /// owner and lease end of a leased one.
    List(crate::opscli::ListArgs),
    /// Delete timeouts that are not being sent (records under a live lease are left and
    /// reported; exit 3 unless --skip-leased).
    Cancel(crate::opscli::Which),
    /// Move the due instant of timeouts that are not being sent, in each record's own
    /// encoding (records under a live lease are left and reported; exit 3 unless
    /// --skip-leased).
    Reschedule(crate::opscli::RescheduleArgs),
    /// What fired, was parked or was cancelled, newest first ([history] keep turns it on):
    /// when, to which queue, how late, from which instance.
    History(crate::historycli::HistoryArgs),
    /// Stop every instance claiming a destination's timeouts (within one poll interval).
    Pause(crate::controlcli::PauseArgs),
    /// End a destination's pause, optionally ramping its rate up.
    Resume(crate::controlcli::ResumeArgs),
    /// The paused destinations.
    Paused {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Probe a running daemon's /healthz; exit 0 when healthy, 1 when not (for HEALTHCHECK).
    Health {
        /// URL to probe [default: /healthz on [http] listen, via 127.0.0.1 for 0.0.0.0]
        #[arg(long)]
        url: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum ParkedCommand {
    /// List parked records, oldest first.
    List {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Put parked records back into the timeouts collection, free, with their original Time
    /// (a past Time fires at the next poll), and reset their attempt counts.
    Requeue {
        /// The record's id as `parked list` shows it.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        id: Option<String>,
        /// Requeue every parked record.
        #[arg(long)]
        all: bool,
    },
    /// Delete a parked record for good.
    Drop {
        /// The record's id as `parked list` shows it.
        id: String,
    },
}

fn parse_header(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("`{s}` is not KEY=VALUE")),
    }
}

/// Runs a parsed command line and returns the process exit code.
pub fn main(cli: Cli) -> ExitCode {
    // Test builds only: failpoints named in the FAILPOINTS environment variable.
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    let config = match Config::load(cli.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{}", redact_text(&e.to_string()));
            return ExitCode::from(2);
        }
    };
    match &cli.command {
        Command::CheckConfig => {
            print!("{}", config.to_redacted_toml());
            return ExitCode::SUCCESS;
        }
        Command::Health { url } => return probe_health(url.as_deref(), &config),
        _ => {}
    }
    init_logging(&config, matches!(cli.command, Command::Run));
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("timeoutd: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(execute(cli.command, config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let shown = redact_text(&format!("{e:#}"));
            let code = crate::opscli::exit_code(&e);
            if code == 1 {
                tracing::error!("{shown}");
            }
            eprintln!("timeoutd: error: {shown}");
            ExitCode::from(code)
        }
    }
}

/// `timeoutd health`: one GET, no async runtime, no logging.
fn probe_health(url: Option<&str>, config: &Config) -> ExitCode {
    let url = url.map(str::to_string).unwrap_or_else(|| {
        let mut addr = config.http.listen;
        if addr.ip().is_unspecified() {
            addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        format!("http://{addr}/healthz")
    });
    let agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(5)))
        .build()
        .new_agent();
    match agent.get(&url).call() {
        Ok(r) if r.status().is_success() => {
            println!("healthy ({url})");
            ExitCode::SUCCESS
        }
        Ok(r) => {
            println!("unhealthy: {} ({url})", r.status());
            ExitCode::FAILURE
        }
        Err(e) => {
            println!("unhealthy: {e} ({url})");
            ExitCode::FAILURE
        }
    }
}

/// Logging to stderr through [`RedactingWriter`]. `[log] level` applies to the daemon; a
/// one-shot command (stats, schedule, reap, parked) logs warnings and errors only, unless the
/// level is quieter still, so its stderr stays empty when it succeeds. `RUST_LOG` overrides
/// both.
fn init_logging(config: &Config, daemon: bool) {
    // lapin logs every returned message in full at WARN; timeoutd logs the failed send itself.
    let from_env = std::env::var("RUST_LOG")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .and_then(|v| tracing_subscriber::EnvFilter::try_new(v).ok());
    let level = match config.log.level.as_str() {
        quieter @ ("error" | "off") => quieter,
        _ if !daemon => "warn",
        level => level,
    };
    let filter = from_env.unwrap_or_else(|| {
        // Operator actions are logged with who ran them (`timeoutd::audit`), also by the
        // one-shot commands.
        let audit = if level == "error" || level == "off" {
            ""
        } else {
            ",timeoutd::audit=info"
        };
        tracing_subscriber::EnvFilter::new(format!("{level},lapin::returned_messages=error{audit}"))
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(RedactingWriter);
    match config.log.format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

/// How long a one-shot command waits for the MongoDB client to end its sessions.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Connects, checks MongoDB answers, runs `action`, and closes the client before the runtime
/// ends, whatever `action` returned ([`Store::close`]).
async fn with_store<T>(
    config: &Config,
    action: impl AsyncFnOnce(&Store) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let store = Store::connect(&config.mongodb, ServerClock::default())
        .await?
        .with_settings(config);
    let result = match store
        .bounded("read the server clock", store.refresh_clock())
        .await
    {
        Ok(_) => action(&store).await,
        Err(e) => Err(anyhow::Error::new(e).context("cannot reach MongoDB")),
    };
    if !store.close(CLOSE_TIMEOUT).await {
        tracing::debug!("the MongoDB client did not close within {CLOSE_TIMEOUT:?}");
    }
    result
}

async fn execute(command: Command, config: Config) -> anyhow::Result<()> {
    match command {
        Command::CheckConfig | Command::Health { .. } => Ok(()),
        Command::Run => {
            let token = CancellationToken::new();
            let signals = tokio::spawn(shutdown::on_signal(token.clone()));
            let result = daemon::run(config, token.clone()).await;
            token.cancel();
            let _ = signals.await;
            Ok(result?)
        }
        Command::Schedule {
            destination,
            correlation_id,
            delay,
            headers,
        } => {
            with_store(&config, async |store| {
                let mut header_doc = Document::new();
                for (k, v) in headers {
                    header_doc.insert(k, v);
                }
                let record = TimeoutRecord {
                    id: Uuid::new_v4(),
                    destination,
                    process_manager_id: correlation_id,
                    due: server_time_in(store.clock(), delay),
                    headers: header_doc,
                };
                store
                    .bounded("insert", store.insert(&record))
                    .await
                    .context("insert failed")?;
                println!("{}", record.id);
                Ok(())
            })
            .await
        }
        Command::Stats { json } => {
            with_store(&config, async |s| crate::controlcli::stats(s, json).await).await
        }
        Command::Reap => {
            let freed = with_store(&config, async |store| {
                Ok(store.bounded("reap", store.reap()).await?)
            })
            .await?;
            println!("freed {freed} expired leases");
            Ok(())
        }
        Command::Parked { action } => {
            with_store(&config, async |store| parked(action, store).await).await
        }
        Command::List(a) => with_store(&config, async |s| crate::opscli::list(s, a).await).await,
        Command::Cancel(w) => {
            with_store(&config, async |s| crate::opscli::cancel(s, w).await).await
        }
        Command::Reschedule(a) => {
            with_store(&config, async |s| crate::opscli::reschedule(s, a).await).await
        }
        Command::History(a) => {
            with_store(&config, async |s| crate::historycli::history(s, a).await).await
        }
        Command::Pause(a) => {
            with_store(&config, async |s| crate::controlcli::pause(s, a).await).await
        }
        Command::Resume(a) => {
            with_store(&config, async |s| crate::controlcli::resume(s, a).await).await
        }
        Command::Paused { json } => {
            with_store(&config, async |s| crate::controlcli::paused(s, json).await).await
        }
    }
}

/// `timeoutd parked list|requeue|drop`. Every call is bounded by `[mongodb]
/// operation_timeout`.
async fn parked(action: ParkedCommand, store: &Store) -> anyhow::Result<()> {
    let parking = &store.parking();
    let find = |shown: String| async move {
        store
            .bounded("find a parked record", parking.find_id(&shown))
            .await?
            .with_context(|| format!("no parked record has id {shown}"))
    };
    match action {
        ParkedCommand::List { json } => {
            let records = store.bounded("list", parking.list()).await?;
            if json {
                println!("{}", serde_json::to_string(&records)?);
            } else {
                for r in &records {
                    println!(
                        "{}  {}  {}  attempts={}  destination={}  {}",
                        r.id,
                        r.parked_at,
                        r.reason,
                        r.attempts,
                        r.destination.as_deref().unwrap_or("-"),
                        r.error
                    );
                }
                println!("{} parked", records.len());
            }
        }
        ParkedCommand::Requeue { id, all } => {
            let ids = match (id, all) {
                (Some(shown), _) => vec![find(shown).await?],
                (None, _) => store.bounded("list", parking.all_ids()).await?,
            };
            for id in ids {
                let shown = display_id(&id);
                match store.bounded("requeue", parking.requeue(&id)).await? {
                    Some(Requeued::Requeued) => println!("requeued {shown}"),
                    Some(Requeued::AlreadyInTimeouts) => println!(
                        "{shown} is still in the timeouts collection; dropped the parked copy"
                    ),
                    Some(Requeued::ParkedAgain) => println!(
                        "requeued {shown}, but it failed again and was parked again meanwhile"
                    ),
                    None => println!("{shown} is no longer parked"),
                }
            }
        }
        ParkedCommand::Drop { id } => {
            let id = find(id).await?;
            store.bounded("drop", parking.drop(&id)).await?;
            println!("dropped {}", display_id(&id));
        }
    }
    Ok(())
}
