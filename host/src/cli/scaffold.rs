//! `ferry plugins new`: writes a transport project that builds where it is written, outside any
//! ferry checkout. The sources are the repository's own templates (`plugins/template`,
//! `plugins/template-js`, `plugins/template-py`), compiled into the binary with the WIT package
//! and, for Rust, the SDK, which the project gets a copy of.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};

/// The languages a project can be written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Lang {
    Rust,
    #[value(alias = "js")]
    Javascript,
    #[value(alias = "py")]
    Python,
}

impl Lang {
    /// The language's name as people write it.
    pub fn label(self) -> &'static str {
        match self {
            Lang::Rust => "Rust",
            Lang::Javascript => "JavaScript",
            Lang::Python => "Python",
        }
    }
}

/// What was written, and what to run next.
#[derive(Debug, serde::Serialize)]
pub struct Scaffold {
    pub name: String,
    pub lang: Lang,
    pub dir: PathBuf,
    /// Paths relative to `dir`.
    pub files: Vec<String>,
    /// Run in `dir` to build the component.
    pub build: String,
    /// The component the build writes, relative to `dir`.
    pub component: String,
    /// Run in `dir` to deliver the sample events through it.
    pub try_command: String,
}

const WIT: &str = include_str!("../../../wit/transport.wit");
const RUST_LIB: &str = include_str!("../../../plugins/template/src/lib.rs");
const SDK_FILES: [(&str, &str); 5] = [
    ("Cargo.toml", include_str!("../../../plugins/sdk/Cargo.toml")),
    ("src/lib.rs", include_str!("../../../plugins/sdk/src/lib.rs")),
    ("src/config.rs", include_str!("../../../plugins/sdk/src/config.rs")),
    ("src/cloudevents.rs", include_str!("../../../plugins/sdk/src/cloudevents.rs")),
    ("src/time.rs", include_str!("../../../plugins/sdk/src/time.rs")),
];
const JS_SOURCE: &str = include_str!("../../../plugins/template-js/src/transport.js");
/// The JavaScript transport that ships with ferry, whose componentize-js version the new project
/// pins: the version the test suite builds with.
const JS_SHIPPED_PACKAGE: &str = include_str!("../../../plugins/webhook-js/package.json");
const PY_SOURCE: &str = include_str!("../../../plugins/template-py/app.py");
/// The componentize-py version the shipped Python transport (and the test suite) builds with.
const PY_REQUIREMENTS: &str = include_str!("../../../plugins/spool-py/requirements.txt");

/// Sample events for `ferry plugins try`: a text payload the template delivers, and bytes that are
/// not UTF-8, which it refuses.
const SAMPLE_EVENTS: &str = r#"{"type": "order.created", "key": "order-1", "payload": {"order": 1, "total": 12.5}}
{"type": "note", "payload": "hello from ferry plugins try", "content_type": "text/plain"}
{"type": "blob", "payload_base64": "//79", "content_type": "application/octet-stream"}
"#;

/// Checks a plugin name as the plugin registry does, plus a leading letter (a crate, package and
/// identifier can be made from it).
pub fn check_name(name: &str) -> anyhow::Result<()> {
    let valid = name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.ends_with('-')
        && name.len() <= 64;
    if !valid {
        bail!(
            "{name:?} cannot name a plugin: use lowercase letters, digits and '-', starting with a letter \
             (at most 64), e.g. audit-log"
        );
    }
    Ok(())
}

/// Names a Rust package cannot have: keywords, the standard crates, and the SDK it depends on.
const RUST_TAKEN: &[&str] = &[
    "abstract",
    "alloc",
    "as",
    "async",
    "await",
    "become",
    "box",
    "break",
    "const",
    "continue",
    "core",
    "crate",
    "do",
    "dyn",
    "else",
    "enum",
    "extern",
    "false",
    "ferry-plugin-sdk",
    "final",
    "fn",
    "for",
    "gen",
    "if",
    "impl",
    "in",
    "let",
    "loop",
    "macro",
    "match",
    "mod",
    "move",
    "mut",
    "override",
    "priv",
    "proc-macro",
    "pub",
    "ref",
    "return",
    "self",
    "static",
    "std",
    "struct",
    "super",
    "test",
    "trait",
    "true",
    "try",
    "type",
    "typeof",
    "unsafe",
    "unsized",
    "use",
    "virtual",
    "where",
    "while",
    "yield",
];

/// Checks that `name` can also name a Rust package.
fn check_rust_name(name: &str) -> anyhow::Result<()> {
    if RUST_TAKEN.contains(&name) {
        bail!(
            "{name:?} cannot name a Rust package (a Rust keyword, a standard crate, or the SDK): choose another name"
        );
    }
    Ok(())
}

/// Writes the project for plugin `name` in `lang` into `dir`, which must not exist or be empty.
pub fn write(name: &str, lang: Lang, dir: &Path) -> anyhow::Result<Scaffold> {
    check_name(name)?;
    if lang == Lang::Rust {
        check_rust_name(name)?;
    }
    if dir.exists() {
        let mut entries = std::fs::read_dir(dir).with_context(|| format!("{} is not a directory", dir.display()))?;
        if entries.next().is_some() {
            bail!("{} already exists and is not empty: choose another directory, or remove it", dir.display());
        }
    }
    let (files, build, component) = match lang {
        Lang::Rust => rust(name),
        Lang::Javascript => javascript(name)?,
        Lang::Python => python(name),
    };
    let try_command = format!("ferry plugins try {component} --events events.jsonl");
    let mut all = files;
    all.push(("events.jsonl".into(), SAMPLE_EVENTS.into()));
    all.push(("README.md".into(), readme(name, lang, &build, &component, &try_command)));
    for (path, text) in &all {
        let path = dir.join(path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(Scaffold {
        name: name.to_string(),
        lang,
        dir: dir.to_path_buf(),
        files: all.into_iter().map(|(path, _)| path).collect(),
        build,
        component,
        try_command,
    })
}

type Files = Vec<(String, String)>;

/// Where `ferry plugins try` keeps compiled code when run in the project (`plugins.cache_dir`'s
/// default, relative to where ferry runs).
const CACHE_IGNORE: &str = "/plugin-cache/\n";

fn rust(name: &str) -> (Files, String, String) {
    let manifest = format!(
        r#"[package]
name = "{name}"
version = "0.1.0"
edition = "2024"

[lib]
crate-type = ["cdylib"]

[dependencies]
# ferry's plugin SDK, copied into this project by `ferry plugins new`: the bindings of the
# ferry:transport contract (its own copy of the WIT package) and a few helpers. To follow a
# ferry checkout instead: ferry-plugin-sdk = {{ path = "../ferry/plugins/sdk" }}
ferry-plugin-sdk = {{ path = "ferry-plugin-sdk" }}

[profile.release]
opt-level = "s"
lto = true
strip = true

# A project of its own, also when created inside another Cargo workspace.
[workspace]
"#
    );
    let lib = RUST_LIB.replace("\"template\"", &format!("{name:?}"));
    let mut files: Files = vec![
        ("Cargo.toml".into(), manifest),
        // `cargo build` builds the component without being told the target.
        (".cargo/config.toml".into(), "[build]\ntarget = \"wasm32-wasip2\"\n".into()),
        ("src/lib.rs".into(), lib),
        (".gitignore".into(), format!("/target/\n{CACHE_IGNORE}")),
        ("ferry-plugin-sdk/wit/transport.wit".into(), WIT.into()),
    ];
    files.extend(SDK_FILES.iter().map(|(path, text)| (format!("ferry-plugin-sdk/{path}"), text.to_string())));
    let component = format!("target/wasm32-wasip2/release/{}.wasm", name.replace('-', "_"));
    (files, "cargo build --release".into(), component)
}

fn javascript(name: &str) -> anyhow::Result<(Files, String, String)> {
    const COMPONENTIZE: &str = "@bytecodealliance/componentize-js";
    let shipped: serde_json::Value =
        serde_json::from_str(JS_SHIPPED_PACKAGE).context("plugins/webhook-js/package.json")?;
    let version = shipped["devDependencies"][COMPONENTIZE].as_str().context("componentize-js version")?;
    let component = format!("{name}.wasm");
    let mut dev_dependencies = serde_json::Map::new();
    dev_dependencies.insert(COMPONENTIZE.into(), version.into());
    let package = serde_json::json!({
        "name": name,
        "version": "0.1.0",
        "private": true,
        "description": "A ferry transport written in JavaScript",
        "type": "module",
        "scripts": {
            "build": format!("componentize-js --wit wit --world-name transport-plugin --out {component} src/transport.js"),
        },
        "devDependencies": dev_dependencies,
    });
    let files = vec![
        ("package.json".into(), format!("{}\n", serde_json::to_string_pretty(&package)?)),
        ("src/transport.js".into(), JS_SOURCE.replace("\"template-js\"", &format!("{name:?}"))),
        ("wit/transport.wit".into(), WIT.into()),
        (".gitignore".into(), format!("/node_modules/\n/{component}\n{CACHE_IGNORE}")),
    ];
    Ok((files, "npm install && npm run build".into(), component))
}

fn python(name: &str) -> (Files, String, String) {
    let component = format!("{name}.wasm");
    let files = vec![
        ("app.py".into(), PY_SOURCE.replace("\"template-py\"", &format!("{name:?}"))),
        ("requirements.txt".into(), PY_REQUIREMENTS.into()),
        ("wit/transport.wit".into(), WIT.into()),
        (".gitignore".into(), format!("/.venv/\n__pycache__/\n/{component}\n{CACHE_IGNORE}")),
    ];
    let build = format!(
        "python3 -m venv .venv && .venv/bin/pip install -r requirements.txt && \
         .venv/bin/componentize-py -d wit -w transport-plugin componentize app -o {component}"
    );
    (files, build, component)
}

fn readme(name: &str, lang: Lang, build: &str, component: &str, try_command: &str) -> String {
    let language = lang.label();
    let (source, needs) = match lang {
        Lang::Rust => (
            "src/lib.rs",
            "Rust with the wasm32-wasip2 target (`rustup target add wasm32-wasip2`). \
             `ferry-plugin-sdk/` is a copy of ferry's plugin SDK; `.cargo/config.toml` makes \
             `cargo build` build for wasm32-wasip2.",
        ),
        Lang::Javascript => (
            "src/transport.js",
            "Node.js 18 or newer; `npm install` fetches componentize-js, which builds the component \
             from src/transport.js and the WIT package in wit/.",
        ),
        Lang::Python => (
            "app.py",
            "Python 3.10 or newer; the build installs componentize-py (requirements.txt) into .venv and \
             builds the component from app.py and the WIT package in wit/.",
        ),
    };
    format!(
        r#"# {name}

A ferry transport written in {language}, made by `ferry plugins new`. As written it logs each
event's id, type and text payload through ferry, after an optional `prefix` from the route's
config, and refuses payloads that are not UTF-8 text (a permanent failure). Replace the delivery
in `{source}` with yours.

## Build

{needs}

    {build}

The component is `{component}`.

## Try it

`ferry plugins try` runs the component the way `ferry serve` does (same runtime, sandbox and
limits) on events from a file of JSON lines, with no database, and prints each outcome, what the
plugin logged, the time per call and anything the sandbox refused:

    {try_command}
    {try_command} --set prefix=audit:

Each line of `events.jsonl` is one event: `type`, `payload` (text or any JSON value) or
`payload_base64`, and optionally `id`, `key`, `content_type`, `headers`, `attempt`, `time`. The
exit code is 0 when every event succeeded. As written, the transport refuses the third sample
event (its payload is not UTF-8 text), so the first try ends with
`error: 1 of 3 events did not succeed` and exit code 1: that is the permanent failure at work.

## Sandbox grants

A plugin can use nothing it is not granted. This one needs no grant: it only logs through
ferry. When your delivery needs more, grant it under `[sandbox.{name}]` in ferry.toml (and put the
same keys in a file for `ferry plugins try --sandbox-toml FILE`):

| to | grant |
| --- | --- |
| send HTTP requests (`fetch`, wasi:http) | `http = ["https://api.example.com"]` |
| open TCP connections | `tcp = ["broker.example.com:9092"]`, and `dns = true` to resolve names itself |
| read and write files | `dirs = {{ "/spool" = "/var/spool/{name}" }}` |
| read environment variables | `env = {{ API_KEY = "…" }}` |

Requests outside the grants are refused and logged; `ferry plugins try` lists them.

## Install

Copy the component into ferry's plugins directory under the plugin's name, and give a route to it:

    cp {component} /path/to/plugins/{name}.wasm

```toml
[route.audit]
plugin = "{name}"
config = {{ prefix = "audit: " }}
```

`ferry plugins check {component}` says whether a file is a transport ferry can load. A running
ferry picks up a new or changed file by itself.
"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_and_turned_into_identifiers() {
        for good in ["a", "audit-log", "s3-sink2"] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for bad in ["", "Audit", "2fast", "audit_log", "audit-", "naïve", &"a".repeat(65)] {
            let err = check_name(bad).unwrap_err().to_string();
            assert!(err.contains("lowercase letters, digits and '-'"), "{bad}: {err}");
        }
        for taken in ["test", "core", "self", "fn", "ferry-plugin-sdk"] {
            assert!(check_rust_name(taken).unwrap_err().to_string().contains("Rust"), "{taken}");
        }
        assert!(check_rust_name("audit-log").is_ok());
    }

    #[test]
    fn a_project_is_not_written_over_another() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("keep.txt"), "mine").unwrap();
        let err = write("audit", Lang::Rust, dir.path()).unwrap_err().to_string();
        assert!(err.contains("already exists and is not empty"), "{err}");
        assert_eq!(std::fs::read_to_string(dir.path().join("keep.txt")).unwrap(), "mine");
    }

    #[test]
    fn every_language_gets_the_wit_package_and_names_the_plugin() {
        let dir = tempfile::tempdir().unwrap();
        for lang in [Lang::Rust, Lang::Javascript, Lang::Python] {
            let project = dir.path().join(format!("{lang:?}"));
            let scaffold = write("audit-log", lang, &project).unwrap();
            let wit = scaffold.files.iter().find(|f| f.ends_with("wit/transport.wit")).unwrap();
            assert_eq!(std::fs::read_to_string(project.join(wit)).unwrap(), WIT);
            let source =
                ["src/lib.rs", "src/transport.js", "app.py"].iter().find(|f| project.join(f).exists()).unwrap();
            let text = std::fs::read_to_string(project.join(source)).unwrap();
            assert!(text.contains("\"audit-log\"") && !text.contains("\"template"), "{lang:?}: {text}");
            let readme = std::fs::read_to_string(project.join("README.md")).unwrap();
            assert!(readme.contains(&scaffold.build) && readme.contains("[sandbox.audit-log]"), "{readme}");
        }
    }
}
