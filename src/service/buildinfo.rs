//! Which build this is: the crate version, the git commit and the build date, set by
//! `build.rs` (`unknown` for a build outside git), and the name of this instance.

/// The crate version (`Cargo.toml`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The git commit the binary was built from (full hex), or `unknown`.
pub const REVISION: &str = env!("TIMEOUTD_GIT_REVISION");

/// The build date, `YYYY-MM-DD` (UTC; `SOURCE_DATE_EPOCH` when the build set it).
pub const BUILD_DATE: &str = env!("TIMEOUTD_BUILD_DATE");

/// What `timeoutd --version` prints after the name.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("TIMEOUTD_GIT_REVISION"),
    ", built ",
    env!("TIMEOUTD_BUILD_DATE"),
    ")"
);

/// The environment variables that name this instance, first set wins: `POD_NAME` (set it
/// from the Kubernetes downward API, `metadata.name`), then `HOSTNAME` (the pod name in
/// Kubernetes, the container id under Docker).
pub const INSTANCE_VARS: &[&str] = &["POD_NAME", "HOSTNAME"];

/// This instance's name, as history rows and the claim log lines carry it: the first of
/// [`INSTANCE_VARS`] that is set, else the kernel's host name, else `unknown`. Read once.
pub fn instance() -> &'static str {
    static NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        INSTANCE_VARS
            .iter()
            .find_map(|k| {
                std::env::var(k)
                    .ok()
                    .map(|v| v.trim().to_string())
                    .filter(|v| !v.is_empty())
            })
            .or_else(|| {
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .ok()
                    .map(|h| h.trim().to_string())
                    .filter(|h| !h.is_empty())
            })
            .unwrap_or_else(|| "unknown".into())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_long_version_names_version_commit_and_date() {
        assert!(LONG_VERSION.starts_with(VERSION));
        assert!(LONG_VERSION.contains(&format!("commit {REVISION}")));
        assert!(LONG_VERSION.contains(&format!("built {BUILD_DATE}")));
        assert_eq!(BUILD_DATE.len(), 10, "{BUILD_DATE}");
        assert!(REVISION == "unknown" || REVISION.chars().all(|c| c.is_ascii_hexdigit()));
    }
}
