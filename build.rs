//! Build identity: the git commit and the build date, for `timeoutd --version`,
//! `timeoutd_build_info` and the start-up log line (see `src/service/buildinfo.rs`).
//!
//! The commit is `TIMEOUTD_GIT_REVISION` when set (a Docker build, whose context has no
//! `.git`), else `git rev-parse HEAD`, else `unknown`: a build outside git, or without git
//! installed, never fails. The date is `SOURCE_DATE_EPOCH` when set (reproducible builds),
//! else the time this script ran, as `YYYY-MM-DD` (UTC). The script runs again when HEAD
//! moves (`.git/HEAD` and the branch's ref), not on every build.

use std::path::PathBuf;
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

/// A revision as it may appear in a label: hex digits only, else `unknown`.
fn clean(rev: &str) -> String {
    let rev = rev.trim();
    if !rev.is_empty() && rev.len() <= 64 && rev.chars().all(|c| c.is_ascii_hexdigit()) {
        rev.to_ascii_lowercase()
    } else {
        "unknown".into()
    }
}

/// Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

// The build date is this host's clock by design (SOURCE_DATE_EPOCH overrides it).
#[allow(clippy::disallowed_methods)]
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=TIMEOUTD_GIT_REVISION");
    println!("cargo:rerun-if-env-changed=SOURCE_DATE_EPOCH");

    let from_env = std::env::var("TIMEOUTD_GIT_REVISION")
        .ok()
        .filter(|r| !r.trim().is_empty());
    let revision = match from_env {
        Some(r) => clean(&r),
        None => {
            // Watch HEAD and the ref it points to (a worktree's HEAD and the common refs
            // included), so that a new commit re-runs this script.
            for path in ["HEAD", "packed-refs"] {
                watch(git(&["rev-parse", "--git-path", path]));
            }
            if let Some(reference) = git(&["symbolic-ref", "-q", "HEAD"]) {
                watch(git(&["rev-parse", "--git-path", &reference]));
            }
            git(&["rev-parse", "HEAD"]).map_or_else(|| "unknown".into(), |r| clean(&r))
        }
    };
    let epoch = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64)
        });
    let (y, m, d) = civil(epoch.div_euclid(86_400));
    println!("cargo:rustc-env=TIMEOUTD_GIT_REVISION={revision}");
    println!("cargo:rustc-env=TIMEOUTD_BUILD_DATE={y:04}-{m:02}-{d:02}");
}

/// Re-run when this file changes, if it exists (a missing file would re-run every build).
fn watch(path: Option<String>) {
    if let Some(p) = path.map(PathBuf::from).filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", p.display());
    }
}
