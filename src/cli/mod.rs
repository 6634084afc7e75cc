//! The command line: `run`, `check-config`, `schedule`, `stats`, `reap`, `parked`, `health`,
//! the operator commands of [`crate::cli::opscli`] and [`crate::cli::controlcli`] (`list`, `cancel`,
//! `reschedule`, `pause`, `resume`, `paused`), and `completions` and `man`.
//!
//! One behaviour everywhere: every command that prints takes `--json`; an error is printed
//! once, on stderr (`timeoutd: error: ...`; the daemon logs it instead); every command that
//! moves or deletes records takes `--dry-run` and `--reason` and records the action.
//!
//! Exit codes: 0 success, 1 a runtime failure, 2 a bad configuration or bad arguments (an
//! unknown id, a malformed instant), 3 records under a live lease were left as they are.

/// `println!` through [`out`]: a reader that went away ends the output, not the command.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::cli::out(format_args!("{}\n", format_args!($($arg)*)))
    };
}

pub mod checkcli;
pub mod controlcli;
pub mod daemon;
pub mod environment;
pub mod healthcli;
pub mod historycli;
pub mod opscli;
pub mod parkedcli;
pub mod statscli;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::cli::parkedcli::ParkedCommand;
use crate::config::Config;
use crate::record::TimeoutRecord;
use crate::redact::redact_text;
use crate::service::shutdown;
use crate::store::clock::ServerClock;
use crate::store::{Store, server_time_in};

/// Fires ServiceConnect process-manager timeouts from MongoDB to RabbitMQ.
#[derive(Debug, Parser)]
#[command(name = "timeoutd", version = crate::service::buildinfo::LONG_VERSION, about)]
pub struct Cli {
    /// Config file [default: config/timeoutd.toml if it exists, else /etc/timeoutd/timeoutd.toml]
    #[arg(long, global = true, value_name = "PATH", env = environment::CONFIG_ENV)]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon in the foreground until SIGTERM or SIGINT.
    Run,
    /// Load and validate the configuration, print it with passwords hidden, naming the file
    /// read and the environment variables applied.
    CheckConfig {
        /// Also check that MongoDB and RabbitMQ answer (under the configured deadlines) and
        /// show their versions and the clock offset; exit 1 if either does not.
        #[arg(long)]
        connect: bool,
        /// Print JSON instead of TOML.
        #[arg(long)]
        json: bool,
    },
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
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Counts of pending, due, leased, expired-lease, stuck, unschedulable and odd-`Locked`
    /// records, and the oldest due age.
    Stats(JsonOnly),
    /// Free expired leases once and print how many.
    Reap(JsonOnly),
    /// Records timeoutd gave up on (poison, or refused max_attempts times).
    Parked {
        #[command(subcommand)]
        action: ParkedCommand,
    },
    /// Timeouts, soonest first: id, destination, correlation id, due instant, state, and the
    /// owner and lease end of a leased one.
    List(crate::cli::opscli::ListArgs),
    /// Delete timeouts that are not being sent (records under a live lease are left and
    /// reported; exit 3 unless --skip-leased).
    Cancel(crate::cli::opscli::Which),
    /// Move the due instant of timeouts that are not being sent, in each record's own
    /// encoding (records under a live lease are left and reported; exit 3 unless
    /// --skip-leased).
    Reschedule(crate::cli::opscli::RescheduleArgs),
    /// What fired, was parked or was cancelled, newest first ([history] keep turns it on):
    /// when, to which queue, how late, from which instance.
    History(crate::cli::historycli::HistoryArgs),
    /// Stop every instance claiming a destination's timeouts (within one poll interval).
    Pause(crate::cli::controlcli::PauseArgs),
    /// End a destination's pause, optionally ramping its rate up.
    Resume(crate::cli::controlcli::ResumeArgs),
    /// The paused destinations.
    Paused(JsonOnly),
    /// Probe a running daemon's /healthz; exit 0 when healthy, 1 when not (for HEALTHCHECK).
    /// The verdict goes to stderr.
    Health {
        /// URL to probe [default: /healthz on [http] listen, via 127.0.0.1 for 0.0.0.0]
        #[arg(long)]
        url: Option<String>,
        /// Print the verdict as JSON on stdout as well.
        #[arg(long)]
        json: bool,
    },
    /// Print a shell completion script, e.g. `timeoutd completions bash >
    /// /etc/bash_completion.d/timeoutd`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff), e.g. `timeoutd man | man -l -`; with --dir, write
    /// timeoutd.1 and one timeoutd-COMMAND.1 per command there.
    Man {
        /// Write the pages into this directory instead.
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
}

/// The one option of a command that takes nothing else.
#[derive(Debug, clap::Args)]
pub struct JsonOnly {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
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
    match &cli.command {
        Command::Completions { shell } => {
            let mut command = Cli::command();
            let mut script = Vec::new();
            clap_complete::generate(*shell, &mut command, "timeoutd", &mut script);
            out(format_args!("{}", String::from_utf8_lossy(&script)));
            return ExitCode::SUCCESS;
        }
        Command::Man { dir } => return man(Cli::command(), dir.as_deref()),
        _ => {}
    }
    let daemon = matches!(cli.command, Command::Run);
    let warnings = environment::environment_warnings(std::env::vars_os());
    if !daemon {
        for w in &warnings {
            eprintln!("timeoutd: warning: {w}");
        }
    }
    let config = match Config::load(cli.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{}", redact_text(&e.to_string()));
            return ExitCode::from(2);
        }
    };
    if let Command::Health { url, json } = &cli.command {
        return healthcli::probe_health(url.as_deref(), &config, *json);
    }
    environment::init_logging(&config, daemon);
    if daemon {
        for w in &warnings {
            tracing::warn!("{w}");
        }
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("timeoutd: error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let source = crate::cli::checkcli::Source::of(cli.config.as_deref());
    match shutdown::run_to_end(runtime, execute(cli.command, config, source)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let shown = redact_text(&format!("{e:#}"));
            // Once: the daemon's error goes to its log (JSON under systemd and Kubernetes),
            // a one-shot command's to stderr, as one line.
            if daemon {
                tracing::error!(error = %shown, "timeoutd stopped");
            } else {
                eprintln!("timeoutd: error: {shown}");
            }
            ExitCode::from(crate::cli::opscli::exit_code(&e))
        }
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
    let result = match store.refresh_clock().await {
        Ok(_) => action(&store).await,
        Err(e) => Err(anyhow::Error::new(e).context("cannot reach MongoDB")),
    };
    if !store.close(CLOSE_TIMEOUT).await {
        tracing::debug!("the MongoDB client did not close within {CLOSE_TIMEOUT:?}");
    }
    result
}

async fn execute(
    command: Command,
    config: Config,
    source: crate::cli::checkcli::Source,
) -> anyhow::Result<()> {
    match command {
        Command::Health { .. } | Command::Completions { .. } | Command::Man { .. } => Ok(()),
        Command::CheckConfig { connect, json } => {
            crate::cli::checkcli::check_config(&config, source, connect, json).await
        }
        Command::Run => {
            let token = CancellationToken::new();
            let signals = crate::host::spawn(shutdown::on_signal(token.clone()));
            let result = daemon::run(config, token.clone()).await;
            token.cancel();
            let _ = signals.await;
            Ok(result?)
        }
        command => with_store(&config, async |s| on_store(s, command).await).await,
    }
}

/// The commands that work on the collections.
async fn on_store(store: &Store, command: Command) -> anyhow::Result<()> {
    use crate::cli::{controlcli, historycli, opscli};
    match command {
        Command::Schedule {
            destination,
            correlation_id,
            delay,
            headers,
            json,
        } => {
            let due = server_time_in(store.clock(), delay);
            if due.timestamp_millis() > crate::record::due::MAX_DATE_MS {
                let at = humantime::format_duration(delay);
                return Err(crate::store::edit::OpsError::BadInput(format!(
                    "--in {at} is outside .NET's range (years 1 to 9999); nothing was written"
                ))
                .into());
            }
            let record = TimeoutRecord {
                id: crate::host::uuid(),
                destination,
                process_manager_id: correlation_id,
                due,
                headers: headers.into_iter().map(|(k, v)| (k, v.into())).collect(),
            };
            store
                .bounded("insert", store.insert(&record))
                .await
                .context("insert failed")?;
            if json {
                say!("{}", serde_json::json!({ "id": record.id.to_string() }));
            } else {
                say!("{}", record.id);
            }
            Ok(())
        }
        Command::Stats(JsonOnly { json }) => crate::cli::statscli::stats(store, json).await,
        Command::Reap(JsonOnly { json }) => {
            let freed = store.bounded("reap", store.reap()).await?;
            if json {
                say!("{}", serde_json::json!({ "freed": freed }));
            } else {
                say!("freed {freed} expired leases");
            }
            Ok(())
        }
        Command::Parked { action } => crate::cli::parkedcli::parked(action, store).await,
        Command::List(a) => opscli::list(store, a).await,
        Command::Cancel(w) => opscli::cancel(store, w).await,
        Command::Reschedule(a) => opscli::reschedule(store, a).await,
        Command::History(a) => historycli::history(store, a).await,
        Command::Pause(a) => controlcli::pause(store, a).await,
        Command::Resume(a) => controlcli::resume(store, a).await,
        Command::Paused(JsonOnly { json }) => controlcli::paused(store, json).await,
        // Run by `execute` or `main`, without a store.
        Command::Run
        | Command::CheckConfig { .. }
        | Command::Health { .. }
        | Command::Completions { .. }
        | Command::Man { .. } => Ok(()),
    }
}

/// `timeoutd man`: the man page on stdout; with `dir`, `timeoutd.1` and one
/// `timeoutd-COMMAND.1` per command written there.
/// Writes to standard output. A reader that went away (`timeoutd list | head -1`) ends the
/// output, not the command: what follows it (the audit of a change) still runs, and the exit
/// code is the command's. Before (found in review), `println!` panicked there (exit 101),
/// after the records had changed and before the audit was written.
pub fn out(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};
    static CLOSED: AtomicBool = AtomicBool::new(false);
    if CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout.write_fmt(args).and_then(|()| stdout.flush()) {
        CLOSED.store(true, Ordering::Relaxed);
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            eprintln!("timeoutd: warning: cannot write to standard output: {e}");
        }
    }
}

pub fn man(command: clap::Command, dir: Option<&std::path::Path>) -> ExitCode {
    let written = match dir {
        None => {
            let mut page = Vec::new();
            let rendered = clap_mangen::Man::new(command).render(&mut page);
            out(format_args!("{}", String::from_utf8_lossy(&page)));
            rendered
        }
        Some(dir) => clap_mangen::generate_to(command, dir),
    };
    match written {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("timeoutd: error: cannot write the man page: {e}");
            ExitCode::FAILURE
        }
    }
}
