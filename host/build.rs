//! Records the commit ferry is built from, for `ferry --version`: `git rev-parse` when the source is
//! a git checkout, `unknown` otherwise (a source archive, or no git installed). The build script
//! re-runs when HEAD moves, not on every change to the index, so `git status` never rebuilds ferry;
//! and when a migration is added or changed, so the embedded migrations are never stale.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(output.stdout).ok()?;
    (output.status.success() && !text.trim().is_empty()).then(|| text.trim().to_string())
}

fn main() {
    // Only ferry's own repository: a source tree unpacked inside some other repository (a home
    // directory kept in git) must not report that repository's commit.
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default();
    let own = git(&["rev-parse", "--show-toplevel"])
        .and_then(|top| std::fs::canonicalize(top).ok())
        .zip(std::fs::canonicalize(&manifest).ok())
        .is_some_and(|(top, manifest)| manifest.starts_with(&top) && top.join("wit").is_dir());
    let commit = own.then(|| git(&["rev-parse", "--short=12", "HEAD"])).flatten().unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=BUILT_FROM_COMMIT={commit}");
    // HEAD, and the branch refs it may point to: loose (a directory, which cargo scans) or packed.
    // In a worktree the refs live in the common directory.
    let dirs =
        [git(&["rev-parse", "--absolute-git-dir"]), git(&["rev-parse", "--path-format=absolute", "--git-common-dir"])];
    for dir in dirs.into_iter().flatten() {
        let dir = std::path::Path::new(&dir);
        // Only what exists: cargo re-runs a build script on every build for a missing path.
        for watched in [dir.join("HEAD"), dir.join("packed-refs"), dir.join("refs").join("heads")] {
            if watched.exists() {
                println!("cargo:rerun-if-changed={}", watched.display());
            }
        }
    }
    // The migrations `sqlx::migrate!` embeds: a new file must rebuild ferry (stable Rust does not
    // let the macro tell cargo itself). Cargo watches a directory's files, recursively.
    println!("cargo:rerun-if-changed=../migrations");
    println!("cargo:rerun-if-changed=build.rs");
}
