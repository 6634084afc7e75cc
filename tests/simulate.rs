//! The deterministic simulation's runner (issue 25): `cargo test --test simulate -- [options]`
//! or `scripts/simulate.sh [options]`.
//!
//! Runs the regression scenarios kept under `tests/sim/regressions/`, then seeds: each draws a
//! fleet, its records and its faults ([`sim::swarm`]), runs the real daemons on the models
//! under a paused clock ([`sim::fleet`]) and checks the invariants on every step
//! ([`sim::invariants`]). Some seeds run twice and their trace hashes must match (the same
//! seed replays the same trace). A failing seed prints its configuration, the first broken
//! invariant and the trace that led to it, and is shrunk to a small scenario file written
//! under `tests/sim/regressions/`.
//!
//! Options: `--seeds N` (default 64, or `SIMULATE_SEEDS`), `--from S` (first seed, default
//! 0), `--seed S` (one seed, with its whole trace), `--replay FILE` (one scenario file),
//! `--repeat K` (seeds run twice, default 4), `--no-shrink`, `--keep-going` (do not stop at the
//! first failure), `--quiet`, `--allow NAME` (count the violations of invariant NAME instead of
//! failing: to look past a known open defect), `--seed-limit SECS` (wall-clock seconds a run
//! may take before it is named a hang and the runner stops, default 300 or
//! `SIMULATE_SEED_LIMIT`), `--print-scenario S` (seed S's scenario as JSON, as a regression
//! file holds it), `--jobs J` (seeds on J threads at once, default 1 or `SIMULATE_JOBS`).
#![allow(clippy::disallowed_methods)]

mod sim;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant as WallInstant;

use sim::fleet::{Outcome, RunOptions, run};
use sim::swarm::{Scenario, shrink};
use sim::trace::Trace;

/// Seeds of a default run (`cargo test`): a few minutes on a loaded 2-core machine.
const DEFAULT_SEEDS: u64 = 64;

/// Wall-clock seconds one run may take before the runner names it a hang. A seed takes about
/// a second in a debug build (the slowest seen, about 20); a run whose virtual clock stops
/// while its tasks keep running (a busy loop) never ends.
const DEFAULT_SEED_LIMIT_SECS: u64 = 300;

#[derive(Debug)]
struct Args {
    seeds: u64,
    from: u64,
    seed: Option<u64>,
    replay: Option<PathBuf>,
    repeat: u64,
    shrink: bool,
    keep_going: bool,
    quiet: bool,
    allow: Vec<String>,
    seed_limit: std::time::Duration,
    print_scenario: Option<u64>,
    jobs: u64,
}

fn args() -> Args {
    let mut a = Args {
        seeds: std::env::var("SIMULATE_SEEDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(DEFAULT_SEEDS),
        from: 0,
        seed: None,
        replay: None,
        repeat: 4,
        shrink: true,
        keep_going: false,
        quiet: false,
        allow: Vec::new(),
        print_scenario: None,
        jobs: std::env::var("SIMULATE_JOBS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1),
        seed_limit: std::time::Duration::from_secs(
            std::env::var("SIMULATE_SEED_LIMIT")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(DEFAULT_SEED_LIMIT_SECS),
        ),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let num = |it: &mut dyn Iterator<Item = String>| {
            it.next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or_else(|| {
                    eprintln!("simulate: {arg} needs a number");
                    std::process::exit(2)
                })
        };
        match arg.as_str() {
            "--seeds" => a.seeds = num(&mut it),
            "--from" => a.from = num(&mut it),
            "--seed" => a.seed = Some(num(&mut it)),
            "--repeat" => a.repeat = num(&mut it),
            "--replay" => a.replay = it.next().map(PathBuf::from),
            "--no-shrink" => a.shrink = false,
            "--keep-going" => a.keep_going = true,
            "--quiet" => a.quiet = true,
            "--allow" => a.allow.extend(it.next()),
            "--jobs" => a.jobs = num(&mut it),
            "--print-scenario" => a.print_scenario = Some(num(&mut it)),
            "--seed-limit" => a.seed_limit = std::time::Duration::from_secs(num(&mut it)),
            // What cargo's test runner may pass (`--nocapture`, a filter, ...): ignored.
            _ => {}
        }
    }
    a
}

/// Runs one scenario on a thread of its own and waits for it at most `limit` of wall-clock
/// time. A run that does not end by then is a hang: its seed and the last events of its trace
/// are printed and the runner exits with a failure (the stuck thread cannot be stopped, so no
/// further run would be measured fairly).
fn guarded(label: &str, s: &Scenario, opts: &RunOptions, limit: std::time::Duration) -> Outcome {
    let trace = Trace::new(opts.keep_trace);
    let (tx, rx) = std::sync::mpsc::channel();
    let (scenario, options, handle) = (s.clone(), opts.clone(), trace.clone());
    let spawned = std::thread::Builder::new()
        .name(label.to_string())
        .spawn(move || {
            let _ = tx.send(run(&scenario, options, handle));
        });
    if let Err(e) = spawned {
        eprintln!("simulate: cannot start a thread for {label}: {e}");
        std::process::exit(2);
    }
    match rx.recv_timeout(limit) {
        Ok(outcome) => outcome,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            println!(
                "FAILED {label}: hang: the run did not end within {} s of wall clock",
                limit.as_secs()
            );
            println!(
                "  knobs: {}",
                serde_json::to_string(&s.knobs).unwrap_or_default()
            );
            let tail = trace.tail(60);
            println!(
                "  trace (last {} of {} events; the virtual clock stopped advancing or the run looped):",
                tail.len(),
                trace.events()
            );
            for l in tail {
                println!("    {l}");
            }
            println!("simulate: stopped at the hang (1 failed)");
            std::process::exit(1)
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            // The run panicked: its thread printed the panic.
            println!("FAILED {label}: the run panicked");
            std::process::exit(1)
        }
    }
}

/// One seed's run, as a worker hands it to the reporter.
struct Ran {
    seed: u64,
    scenario: Scenario,
    outcome: Outcome,
    took: f64,
    /// Set when the seed ran twice and the traces differed.
    not_deterministic: Option<String>,
}

fn regressions_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sim/regressions")
}

fn report(label: &str, s: &Scenario, o: &Outcome, full: bool) {
    let Some(v) = &o.violation else { return };
    println!("FAILED {label}");
    println!("  invariant: {} at {} ms", v.invariant, v.at_ms);
    println!("  detail: {}", v.detail);
    println!(
        "  knobs: {}",
        serde_json::to_string(&s.knobs).unwrap_or_default()
    );
    println!(
        "  instances: {}, records: {}, faults: {}, faults end at {} ms",
        s.instances.len(),
        s.records.len(),
        s.faults.len(),
        s.faults_end_ms
    );
    for f in &s.faults {
        println!("    fault at {} ms: {:?}", f.at_ms, f.kind);
    }
    let lines = match (&o.all, full) {
        (Some(all), true) => all.clone(),
        _ => o.tail.clone(),
    };
    println!("  trace (last {} of {} events):", lines.len(), o.events);
    for l in lines {
        println!("    {l}");
    }
}

/// Shrinks a failing scenario and writes it under `tests/sim/regressions/`.
fn keep(
    s: &Scenario,
    invariant: &str,
    opts: &RunOptions,
    limit: std::time::Duration,
) -> Option<PathBuf> {
    let (small, runs) = shrink(s, invariant, 60, |c| {
        guarded("a shrink candidate", c, opts, limit)
            .violation
            .map(|v| v.invariant.to_string())
    });
    let dir = regressions_dir();
    std::fs::create_dir_all(&dir).ok()?;
    let path = dir.join(format!("seed-{}-{}.json", s.seed, invariant));
    let text = serde_json::to_string_pretty(&small).ok()?;
    std::fs::write(&path, text).ok()?;
    println!(
        "  shrunk in {runs} runs to {} instance(s), {} record(s), {} fault(s): {}",
        small.instances.len(),
        small.records.len(),
        small.faults.len(),
        path.display()
    );
    Some(path)
}

fn main() {
    // A test runner asking for the test list (cargo-nextest's `--list --format terse`): this
    // runner is one test, its default run, and has no ignored ones.
    let argv: Vec<String> = std::env::args().collect();
    if argv.iter().any(|a| a == "--list") {
        if !argv.iter().any(|a| a == "--ignored") {
            println!("default_run: test");
        }
        return;
    }
    let a = args();
    let opts = RunOptions {
        keep_trace: false,
        allow: a.allow.clone(),
    };
    let started = WallInstant::now();
    let (mut passed, mut failed) = (0u64, 0u64);

    // A seed's scenario as a file would hold it (to keep a hang, which does not shrink).
    if let Some(seed) = a.print_scenario {
        let text = serde_json::to_string_pretty(&Scenario::draw(seed)).unwrap_or_default();
        println!("{text}");
        std::process::exit(0);
    }

    // One scenario file, or one seed with its whole trace.
    if let Some(path) = &a.replay {
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| {
            eprintln!("simulate: cannot read {}: {e}", path.display());
            std::process::exit(2)
        });
        let s: Scenario = serde_json::from_str(&text).unwrap_or_else(|e| {
            eprintln!("simulate: {} is not a scenario: {e}", path.display());
            std::process::exit(2)
        });
        let label = path.display().to_string();
        let full = RunOptions {
            keep_trace: true,
            ..opts.clone()
        };
        let o = guarded(&label, &s, &full, a.seed_limit);
        report(&label, &s, &o, true);
        finish(
            u64::from(o.violation.is_none()),
            u64::from(o.violation.is_some()),
            started,
        );
    }
    if let Some(seed) = a.seed {
        let s = Scenario::draw(seed);
        let full = RunOptions {
            keep_trace: true,
            ..opts.clone()
        };
        let o = guarded(&format!("seed {seed}"), &s, &full, a.seed_limit);
        if o.violation.is_none() && !a.quiet {
            for l in o.all.iter().flatten() {
                println!("    {l}");
            }
        }
        report(&format!("seed {seed}"), &s, &o, true);
        println!(
            "seed {seed}: trace hash {:016x}, {} events, {} virtual ms, {:?}",
            o.trace_hash, o.events, o.virtual_ms, o.stats
        );
        finish(
            u64::from(o.violation.is_none()),
            u64::from(o.violation.is_some()),
            started,
        );
    }

    // The regression scenarios.
    let mut files: Vec<PathBuf> = std::fs::read_dir(regressions_dir())
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.retain(|p| p.extension().is_some_and(|x| x == "json"));
    files.sort();
    for path in &files {
        let Ok(text) = std::fs::read_to_string(path) else {
            continue;
        };
        let s: Scenario = match serde_json::from_str(&text) {
            Ok(s) => s,
            Err(e) => {
                println!("FAILED {}: not a scenario: {e}", path.display());
                failed += 1;
                continue;
            }
        };
        let o = guarded(&path.display().to_string(), &s, &opts, a.seed_limit);
        if o.violation.is_some() {
            report(&path.display().to_string(), &s, &o, false);
            failed += 1;
        } else {
            passed += 1;
        }
    }

    // The seeds, on `--jobs` threads (each seed's run on a runtime of its own), reported
    // here as they end.
    let seeds_started = WallInstant::now();
    let cpu_started = cpu_seconds();
    let mut ran = 0u64;
    let end = a.from.saturating_add(a.seeds);
    let next = Arc::new(AtomicU64::new(a.from));
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel::<Ran>();
    let workers: Vec<_> = (0..a.jobs.max(1))
        .map(|_| {
            let (next, stop, tx, opts) = (next.clone(), stop.clone(), tx.clone(), opts.clone());
            let (from, repeat, limit) = (a.from, a.repeat, a.seed_limit);
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if seed >= end {
                        break;
                    }
                    let s = Scenario::draw(seed);
                    let one = WallInstant::now();
                    let o = guarded(&format!("seed {seed}"), &s, &opts, limit);
                    let took = one.elapsed().as_secs_f64();
                    let mut not_deterministic = None;
                    if o.violation.is_none() && seed - from < repeat {
                        let again = guarded(&format!("seed {seed} (again)"), &s, &opts, limit);
                        if again.trace_hash != o.trace_hash || again.events != o.events {
                            not_deterministic = Some(format!(
                                "trace hash {:016x} ({} events), then {:016x} ({} events)",
                                o.trace_hash, o.events, again.trace_hash, again.events
                            ));
                        }
                    }
                    let ran = Ran {
                        seed,
                        scenario: s,
                        outcome: o,
                        took,
                        not_deterministic,
                    };
                    if tx.send(ran).is_err() {
                        break;
                    }
                }
            })
        })
        .collect();
    drop(tx);
    for r in rx {
        let (seed, s, o) = (r.seed, &r.scenario, &r.outcome);
        ran += 1;
        if r.took > 10.0 && !a.quiet {
            println!(
                "simulate: seed {seed} took {:.1} s ({} events, {} virtual ms)",
                r.took, o.events, o.virtual_ms
            );
        }
        if let Some(why) = &r.not_deterministic {
            println!("FAILED seed {seed}: not deterministic: {why}");
        }
        if o.violation.is_none() && r.not_deterministic.is_none() {
            passed += 1;
            if !a.quiet && ran.is_multiple_of(50) {
                let secs = seeds_started.elapsed().as_secs_f64();
                println!(
                    "simulate: {ran} seeds in {secs:.1} s ({:.2} seeds/s)",
                    ran as f64 / secs
                );
            }
            continue;
        }
        failed += 1;
        if !a.keep_going {
            stop.store(true, Ordering::Relaxed);
        }
        report(&format!("seed {seed}"), s, o, false);
        if let Some(v) = &o.violation {
            println!("  replay: scripts/simulate.sh --seed {seed}");
            if a.shrink && (a.keep_going || failed == 1) {
                keep(s, v.invariant, &opts, a.seed_limit);
            }
        }
    }
    for w in workers {
        let _ = w.join();
    }
    let secs = seeds_started.elapsed().as_secs_f64().max(1e-9);
    let cpu = (cpu_seconds() - cpu_started).max(1e-9);
    println!(
        "simulate: {ran} seeds run in {secs:.1} s, {:.2} seeds/s ({:.0} seeds/min; {:.0} per CPU-minute); {} regression scenario(s)",
        ran as f64 / secs,
        ran as f64 / secs * 60.0,
        ran as f64 / cpu * 60.0,
        files.len()
    );
    finish(passed, failed, started);
}

/// CPU seconds this process has used (user and system): seeds per CPU second do not depend
/// on how loaded the machine is.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes into the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0.0;
    }
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

fn finish(passed: u64, failed: u64, started: WallInstant) -> ! {
    println!(
        "simulate: {passed} passed, {failed} failed ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
    std::process::exit(if failed == 0 { 0 } else { 1 })
}
