//! ARCHITECTURE.md stays true to `src/`: every top-level module is named in its layer table,
//! and every module uses only modules of lower layers (so no two top-level modules use each
//! other, and the store imports nothing above it).
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::repo;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// The top-level modules on disk: `src/x.rs` and `src/x/mod.rs`, but not `lib.rs`/`main.rs`.
fn top_level_modules() -> Vec<String> {
    let mut modules = Vec::new();
    for entry in std::fs::read_dir(repo("src")).expect("src/") {
        let path = entry.expect("entry").path();
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("name")
            .to_string();
        let folder = path.is_dir() && path.join("mod.rs").exists();
        let file = path.extension().is_some_and(|e| e == "rs") && name != "lib" && name != "main";
        if folder || file {
            modules.push(name);
        }
    }
    modules.sort();
    modules
}

/// The layer table of ARCHITECTURE.md: `| 3 | `record/` | ... |` rows, module -> layer.
fn layers() -> BTreeMap<String, u32> {
    let text = std::fs::read_to_string(repo("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let mut layers = BTreeMap::new();
    for line in text.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let (Some(layer), Some(names)) = (cells.get(1), cells.get(2)) else {
            continue;
        };
        let Ok(layer) = layer.parse::<u32>() else {
            continue;
        };
        for name in names.split('`').skip(1).step_by(2) {
            layers.insert(name.trim_end_matches('/').to_string(), layer);
        }
    }
    layers
}

/// The top-level modules a source file names as `crate::x` or in `use crate::{x, ...}`,
/// comments left out.
fn used_modules(text: &str) -> Vec<String> {
    let code: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut used = Vec::new();
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        used.push(std::mem::take(&mut item));
                        continue;
                    }
                    _ => {}
                }
                item.push(c);
            }
            used.push(item);
        } else {
            used.push(rest.chars().take(64).collect());
        }
    }
    used.iter()
        .map(|u| {
            u.trim_start()
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect::<String>()
        })
        .filter(|u| !u.is_empty())
        .collect()
}

fn files_of(module: &str) -> Vec<PathBuf> {
    let file = repo(&format!("src/{module}.rs"));
    if file.exists() {
        return vec![file];
    }
    let mut files = Vec::new();
    let mut dirs = vec![repo(&format!("src/{module}"))];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("dir") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files
}

#[test]
fn every_top_level_module_is_named_in_the_layer_table() {
    let layers = layers();
    let modules = top_level_modules();
    assert!(modules.len() >= 5, "found {modules:?}");
    for module in &modules {
        assert!(
            layers.contains_key(module),
            "ARCHITECTURE.md's code map does not name src/{module}"
        );
    }
    for named in layers.keys() {
        assert!(
            modules.contains(named),
            "ARCHITECTURE.md names `{named}`, which is no top-level module of src/"
        );
    }
}

#[test]
fn each_module_uses_only_lower_layers() {
    let layers = layers();
    let mut checked = 0;
    for module in top_level_modules() {
        let Some(&own) = layers.get(&module) else {
            continue; // the test above names it
        };
        for file in files_of(&module) {
            let text = std::fs::read_to_string(&file).expect("read");
            for used in used_modules(&text) {
                checked += 1;
                if used == module {
                    continue;
                }
                let theirs = layers
                    .get(&used)
                    .unwrap_or_else(|| panic!("{}: crate::{used} is in no layer", file.display()));
                assert!(
                    *theirs < own,
                    "{} (layer {own}) uses crate::{used} (layer {theirs}): a module may use only lower layers",
                    file.display()
                );
            }
        }
    }
    assert!(checked > 100, "only {checked} paths found");
}

/// Whether a line of code opens an `impl` of `Store` (`impl Store`, `impl<T> crate::store::Store`,
/// `impl Trait for Store`, ...).
fn implements_store(line: &str) -> bool {
    let code = line.split("//").next().unwrap_or("");
    let Some(rest) = code.trim_start().strip_prefix("impl") else {
        return false;
    };
    let mut rest = rest.trim_start();
    if let Some(generic) = rest.strip_prefix('<') {
        rest = generic.split_once('>').map_or("", |(_, r)| r).trim_start();
    }
    let ty = rest.rsplit(" for ").next().unwrap_or(rest);
    let ty = ty.split(['{', '<', ' ']).next().unwrap_or("");
    ty.rsplit("::").next() == Some("Store")
}

/// Only `src/store/` names a collection or builds a query: `Store` is extended there and
/// nowhere else (its fields are private to `store/`, which the compiler enforces).
#[test]
fn only_the_store_extends_store() {
    assert!(implements_store("impl Store {"));
    assert!(implements_store("    impl<'a> crate::store::Store {"));
    assert!(!implements_store("impl StoreError {"));
    assert!(!implements_store("// impl Store {"));
    let mut outside = Vec::new();
    let mut files = 0;
    let mut dirs = vec![repo("src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("dir") {
            let path = entry.expect("entry").path();
            if path == repo("src/store") {
                continue;
            }
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files += 1;
                let text = std::fs::read_to_string(&path).expect("read");
                if text.lines().any(implements_store) {
                    outside.push(path.display().to_string());
                }
            }
        }
    }
    assert!(files > 20, "only {files} files outside src/store/");
    outside.sort();
    assert!(
        outside.is_empty(),
        "`impl Store` outside src/store/ (only store/ names a collection or builds a query): {outside:?}"
    );
}

/// The code of a file without comments and without its `#[cfg(test)]` module (the file's
/// tail from that attribute on, as every file here places its tests last).
fn code_outside_tests(text: &str) -> String {
    let body = text.split("#[cfg(test)]\nmod tests").next().unwrap_or(text);
    let body = body
        .split("#[cfg(test)]\npub(crate) mod tests")
        .next()
        .unwrap_or(body);
    body.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Whether `code` has `token` where no identifier character continues it on either side
/// (`Store` is not `StoreError`, `.await` is not `.awaits_answer`).
fn has_token(code: &str, token: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    code.match_indices(token).any(|(i, _)| {
        let before = code[..i].chars().next_back();
        let after = code[i + token.len()..].chars().next();
        let starts = !token.starts_with(ident) || !before.is_some_and(ident);
        let ends = !token.ends_with(ident) || !after.is_some_and(ident);
        starts && ends
    })
}

/// The dispatch core does no I/O: `dispatch/machine.rs` and its claim schedule
/// (`dispatch/claims.rs`) read no clock, await nothing, spawn nothing and hold no handle on
/// MongoDB or RabbitMQ. The driver does all of that.
#[test]
fn the_dispatch_machine_does_no_io() {
    let code = ["src/dispatch/machine.rs", "src/dispatch/claims.rs"]
        .map(|f| code_outside_tests(&std::fs::read_to_string(repo(f)).expect(f)))
        .join("\n");
    assert!(code.contains("pub fn handle") && code.contains("pub fn poll_command"));
    let forbidden = [
        ".await",
        "async ",
        "spawn",
        "::now(",
        "clock()",
        "Store",
        "Publisher",
        "Notify",
        "CancellationToken",
        "tokio::sync",
        "tokio::task",
        "std::fs",
        "std::net",
    ];
    let found: Vec<&str> = forbidden
        .into_iter()
        .filter(|f| has_token(&code, f))
        .collect();
    assert!(found.is_empty(), "the dispatch machine does I/O: {found:?}");
    // The check itself: the driver does every one of the main ones.
    let driver = std::fs::read_to_string(repo("src/dispatch/driver.rs")).expect("driver.rs");
    for f in [".await", "spawn", "::now(", "Store", "Publisher"] {
        assert!(
            has_token(&driver, f),
            "the check looks for {f}, which the driver has not"
        );
    }
}

/// The sibling modules a file names, as `super::x` or `crate::<folder path>::x` (one
/// name or a `{..}` group).
fn siblings_used(code: &str, folder: &str, siblings: &[String]) -> Vec<String> {
    let mut used = Vec::new();
    for prefix in ["super::".to_string(), format!("crate::{folder}::")] {
        for (i, _) in code.match_indices(&prefix) {
            let rest = &code[i + prefix.len()..];
            let names: Vec<String> = match rest.strip_prefix('{') {
                Some(group) => group
                    .split('}')
                    .next()
                    .unwrap_or("")
                    .split(',')
                    .map(|n| n.trim().split("::").next().unwrap_or("").to_string())
                    .collect(),
                None => vec![
                    rest.chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect(),
                ],
            };
            used.extend(names.into_iter().filter(|n| siblings.contains(n)));
        }
    }
    used.sort();
    used.dedup();
    used
}

/// No two files of one folder use each other (a folder's `mod.rs`, its index, aside): a
/// reader can read a folder's files in an order where each needs only those before it.
#[test]
fn no_two_files_of_one_folder_use_each_other() {
    let mut circles = Vec::new();
    let mut folders = 0;
    let mut dirs = vec![repo("src")];
    while let Some(dir) = dirs.pop() {
        let mut files = BTreeMap::new();
        let mut siblings = Vec::new();
        for entry in std::fs::read_dir(&dir).expect("dir") {
            let path = entry.expect("entry").path();
            let stem = path
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("")
                .to_string();
            if path.is_dir() {
                dirs.push(path);
                siblings.push(stem);
            } else if path.extension().is_some_and(|e| e == "rs") && stem != "mod" {
                let text = std::fs::read_to_string(&path).expect("read");
                siblings.push(stem.clone());
                files.insert(stem, text);
            }
        }
        if dir == repo("src") {
            continue;
        }
        folders += 1;
        let rel = dir.strip_prefix(repo("src")).expect("under src");
        let folder = rel.to_string_lossy().replace('/', "::");
        let uses: BTreeMap<&String, Vec<String>> = files
            .iter()
            .map(|(stem, text)| {
                let code = code_outside_tests(text);
                let mut used = siblings_used(&code, &folder, &siblings);
                used.retain(|u| u != stem);
                (stem, used)
            })
            .collect();
        for (a, used) in &uses {
            for b in used {
                if a.as_str() < b.as_str() && uses.get(b).is_some_and(|u| u.contains(a)) {
                    circles.push(format!("src/{}: {a} <-> {b}", rel.display()));
                }
            }
        }
    }
    assert!(folders >= 8, "only {folders} folders");
    assert!(
        circles.is_empty(),
        "files of one folder that use each other: {circles:?}"
    );
}

/// Every background service has one shape: a file of its own in `maintenance/`, named for its
/// role, with one `pub async fn run(.., shutdown: CancellationToken)` that returns nothing; and
/// every task `timeoutd run` starts is some service's `run`, spawned under the supervisor.
#[test]
fn every_background_service_has_one_shape() {
    let mut services = 0;
    for file in files_of("maintenance") {
        if file.ends_with("mod.rs") {
            continue;
        }
        services += 1;
        let text = std::fs::read_to_string(&file).expect("service file");
        let code = code_outside_tests(&text);
        let runs: Vec<_> = code.match_indices("pub async fn run(").collect();
        assert_eq!(
            runs.len(),
            1,
            "{}: one `pub async fn run(` per service",
            file.display()
        );
        let signature = &code[runs[0].0..];
        let signature = &signature[..signature.find('{').expect("a body")];
        let params: String = signature.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            params.ends_with("shutdown: CancellationToken, )")
                || params.ends_with("shutdown: CancellationToken)"),
            "{}: `run` takes the shutdown token last and returns nothing: {params}",
            file.display()
        );
    }
    assert!(services >= 4, "the check found the services: {services}");
    let daemon = std::fs::read_to_string(repo("src/cli/daemon.rs")).expect("daemon.rs");
    let code = code_outside_tests(&daemon);
    let spawns: Vec<&str> = code
        .match_indices("tasks.spawn(")
        .map(|(i, _)| {
            let rest = &code[i..];
            &rest[..rest.find(";\n").expect("a statement")]
        })
        .collect();
    assert!(spawns.len() >= 6, "the check found the tasks: {spawns:?}");
    for spawn in spawns {
        assert!(
            spawn.contains("run("),
            "every task timeoutd run starts is a service's `run`: {spawn}"
        );
    }
}

/// Standard output is written through `cli::out` (`say!`) only: `println!` panics when the
/// reader has gone (`timeoutd cancel ... | head`), after the records changed and before the
/// audit was written.
#[test]
fn standard_output_is_written_through_one_function() {
    let mut found = Vec::new();
    let mut files = 0;
    for module in top_level_modules() {
        for file in files_of(&module) {
            files += 1;
            let text = std::fs::read_to_string(&file).expect("source");
            let code = code_outside_tests(&text);
            if has_token(&code, "println!") || has_token(&code, "print!") {
                found.push(file.display().to_string());
            }
        }
    }
    assert!(files > 20, "only {files} files");
    // The check itself: `out` writes standard output, and `say!` reaches it.
    let cli = std::fs::read_to_string(repo("src/cli/mod.rs")).expect("cli/mod.rs");
    assert!(cli.contains("pub fn out(") && has_token(&cli, "say!"));
    assert!(
        found.is_empty(),
        "print!/println! outside cli::out: {found:?}"
    );
}
