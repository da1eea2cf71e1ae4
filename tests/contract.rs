//! The contracts of the two front-ends: the CLI and the admin API give the same answer to the same
//! input (both call one set of operator operations), and every answer the API gives matches the
//! schema `openapi.json` documents for it.

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::admin::{Api, start};
use crate::common::TestDb;
use crate::e2e::run_ferry;

/// What one front-end answered: success with a JSON document, or an error with its message.
#[derive(Debug, Clone, PartialEq)]
enum Answer {
    Ok(Value),
    /// The message, with the CLI's spelling of inputs (`--route`, `--all`) turned into the API's
    /// (`route`, `"all": true`).
    Refused(String),
}

/// The CLI's answer to `args` (with `--json`), against the API's database and routes.
fn cli(api: &Api, args: &[&str]) -> Answer {
    let config = api.s.db.dir.path().join("cli.toml");
    if !config.exists() {
        let plugins = api.s.db.dir.path().join("plugins");
        let text = format!(
            "[database]\nurl = {:?}\n[plugins]\ndir = {plugins:?}\n[route.s]\nplugin = \"scripted\"\n[route.t]\nplugin = \"scripted\"\n\
             [route.fan.destinations.orders]\nplugin = \"scripted\"\nevent_types = [\"order.*\"]\n\
             [route.fan.destinations.all]\nplugin = \"scripted\"\n",
            api.s.db.url
        );
        std::fs::write(&config, text).unwrap();
    }
    let (code, stdout, stderr) = run_ferry(&config, &[args, &["--json"]].concat());
    match code {
        Some(0) => Answer::Ok(serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{args:?}: {e}: {stdout}"))),
        // With --json the error is a JSON object on standard output, and nothing is on stderr.
        Some(1) => {
            let error: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{args:?}: {e}: {stdout}"));
            assert!(stderr.is_empty(), "{args:?}: {stderr}");
            let message = error["error"]["message"].as_str().unwrap_or_else(|| panic!("{args:?}: {stdout}"));
            Answer::Refused(message.replace("--all", "\"all\": true").replace("--", ""))
        }
        other => panic!("{args:?} exited with {other:?}: {stderr}"),
    }
}

/// The API's answer to `method path` with `body`.
async fn api_answer(api: &Api, method: Method, path: &str, body: Option<Value>) -> Answer {
    let (status, value) = api.call(method, path, body).await;
    if status.is_success() {
        Answer::Ok(value)
    } else {
        assert!(status.is_client_error(), "{path}: {status} {value}");
        Answer::Refused(value["error"]["message"].as_str().expect("an error message").to_string())
    }
}

/// Drops the fields that hold the time of the call itself.
fn timeless(mut answer: Answer) -> Answer {
    if let Answer::Ok(Value::Object(map)) = &mut answer {
        for key in ["updated_at", "opened_at", "at"] {
            map.remove(key);
        }
    }
    answer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_and_the_api_give_the_same_answers() {
    let api = start(TestDb::sqlite().await, false).await;
    let failed = crate::store::failed_fixture(&api.s.db).await;
    let pending = api.enqueue("s", "ok").await;
    let (first, missing, pending) = (failed[0].to_string(), "987654".to_string(), pending.to_string());
    let leak = |path: String| -> &'static str { Box::leak(path.into_boxed_str()) };
    let get = |path: String| api_answer(&api, Method::GET, leak(path), None);
    let post = |path: &'static str, body: Value| api_answer(&api, Method::POST, path, Some(body));

    // (what, CLI arguments, the API's answer to the same input)
    let cases: Vec<(&str, Vec<&str>, Answer)> = vec![
        (
            "emit to an unknown route",
            vec!["emit", "nowhere", "t", "{}"],
            post("/v1/events", json!({"route": "nowhere", "type": "t", "payload": {}})).await,
        ),
        (
            "emit a blank type",
            vec!["emit", "s", " ", "{}"],
            post("/v1/events", json!({"route": "s", "type": " ", "payload": {}})).await,
        ),
        ("show an event", vec!["show", &first], get(format!("/v1/events/{first}")).await),
        ("show a missing event", vec!["show", &missing], get(format!("/v1/events/{missing}")).await),
        (
            "resend a missing event",
            vec!["resend", &missing],
            post_dynamic(&api, &format!("/v1/events/{missing}/resend")).await,
        ),
        (
            "resend a PENDING event",
            vec!["resend", &pending],
            post_dynamic(&api, &format!("/v1/events/{pending}/resend")).await,
        ),
        (
            "reschedule a FAILED event",
            vec!["reschedule", &first, "--delay", "1h"],
            api_answer(
                &api,
                Method::POST,
                leak(format!("/v1/events/{first}/reschedule")),
                Some(json!({"delay": "1h"})),
            )
            .await,
        ),
        (
            "reschedule a missing event",
            vec!["reschedule", &missing, "--at", "2026-12-01T00:00:00Z"],
            api_answer(
                &api,
                Method::POST,
                leak(format!("/v1/events/{missing}/reschedule")),
                Some(json!({"at": "2026-12-01T00:00:00Z"})),
            )
            .await,
        ),
        (
            "list the newest failures with an error",
            vec!["failed", "list", "--newest", "--error", "REJECTED", "--limit", "2"],
            get("/v1/failed?order=newest&error=REJECTED&limit=2".into()).await,
        ),
        (
            "count by route and type",
            vec!["failed", "count", "--route", "a", "--type", "x"],
            get("/v1/failed/count?route=a&type=x".into()).await,
        ),
        (
            "count an empty route",
            vec!["failed", "count", "--route", " "],
            get("/v1/failed/count?route=%20".into()).await,
        ),
        (
            "count a reversed window",
            vec!["failed", "count", "--from", "2026-03-02T00:00:00Z", "--before", "2026-03-01T00:00:00Z"],
            get("/v1/failed/count?from=2026-03-02T00:00:00Z&before=2026-03-01T00:00:00Z".into()).await,
        ),
        (
            "summarize by route",
            vec!["failed", "summary", "--route", "a"],
            get("/v1/failed/summary?route=a".into()).await,
        ),
        (
            "count by reason",
            vec!["failed", "count", "--reason", "permanent"],
            get("/v1/failed/count?reason=permanent".into()).await,
        ),
        (
            "count an unknown reason",
            vec!["failed", "count", "--reason", "lost"],
            get("/v1/failed/count?reason=lost".into()).await,
        ),
        (
            "list a page",
            vec!["failed", "list", "--route", "b", "--limit", "2"],
            get("/v1/failed?route=b&limit=2".into()).await,
        ),
        ("resend everything without saying so", vec!["failed", "resend"], post("/v1/failed/resend", json!({})).await),
        ("purge everything without saying so", vec!["failed", "purge"], post("/v1/failed/purge", json!({})).await),
        (
            "open an unknown route's breaker",
            vec!["breaker", "open", "nowhere"],
            post("/v1/breakers/nowhere/open", json!({})).await,
        ),
        (
            "close an unknown route's breaker",
            vec!["breaker", "close", "nowhere"],
            post("/v1/breakers/nowhere/close", json!({})).await,
        ),
        ("list breakers (none yet)", vec!["breaker", "list"], get("/v1/breakers".into()).await),
    ];
    for (what, args, from_api) in cases {
        assert_eq!(cli(&api, &args), from_api, "{what}: CLI {args:?}");
    }

    // Changes: each made through one front-end is seen the same through the other.
    let opened = cli(&api, &["breaker", "open", "s", "--reason", "maintenance"]);
    let listed = get("/v1/breakers".into()).await;
    let Answer::Ok(Value::Array(rows)) = &listed else { panic!("{listed:?}") };
    assert_eq!(timeless(opened), timeless(Answer::Ok(rows[0].clone())), "open through the CLI, listed by the API");
    assert_eq!(cli(&api, &["breaker", "list"]), listed);
    let closed = post("/v1/breakers/s/close", json!({})).await;
    assert_eq!(timeless(cli(&api, &["breaker", "close", "s"])), timeless(closed), "closing twice answers the same");

    // Routes a and b hold the same FAILED events: x, y, x.
    let purged = post("/v1/failed/purge", json!({"route": "b", "type": "y"})).await;
    assert_eq!(purged, Answer::Ok(json!({"purged": 1})));
    assert_eq!(cli(&api, &["failed", "purge", "--route", "a", "--type", "y"]), purged);
    let resent = post("/v1/failed/resend", json!({"route": "b"})).await;
    assert_eq!(resent, Answer::Ok(json!({"resent": 2})));
    assert_eq!(cli(&api, &["failed", "resend", "--route", "a"]), resent);
    let Answer::Ok(created) = cli(&api, &["emit", "s", "order.paid", "{\"n\":1}"]) else { panic!("emit refused") };
    let shown = get(format!("/v1/events/{}", created["id"])).await;
    // Why it waits depends on the time each front-end's clock says (the API's is a test clock).
    let unhurried = |answer: Answer| match answer {
        Answer::Ok(mut view) => {
            assert!(view["waiting"].as_array().is_some_and(|w| !w.is_empty()), "a PENDING event says why: {view}");
            view.as_object_mut().map(|v| v.remove("waiting"));
            Answer::Ok(view)
        }
        refused => refused,
    };
    assert_eq!(
        unhurried(cli(&api, &["show", &created["id"].to_string()])),
        unhurried(shown),
        "an event emitted by the CLI"
    );

    // Reports: the same figures (the time they were taken aside).
    let figures = |answer: Answer| match answer {
        Answer::Ok(v) => (v["counts"].clone(), v["routes"].clone(), v["stuck"].clone(), v["last_attempt"].clone()),
        other => panic!("{other:?}"),
    };
    assert_eq!(figures(cli(&api, &["stats"])), figures(get("/v1/stats".into()).await), "stats");
    // The plugins: the CLI loads the directory itself, the API lists the running ferry's.
    let plugins = |answer: Answer| match answer {
        Answer::Ok(v) => v["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p["name"].clone(), p["version"].clone(), p["hash"].clone(), p["routes"].clone()))
            .collect::<Vec<_>>(),
        other => panic!("{other:?}"),
    };
    assert_eq!(plugins(cli(&api, &["plugins", "list"])), plugins(get("/v1/plugins".into()).await), "plugins");
}

async fn post_dynamic(api: &Api, path: &str) -> Answer {
    api_answer(api, Method::POST, path, Some(json!({}))).await
}

/// Checks `value` against a JSON Schema of the kind `openapi.json` uses (type, properties,
/// required, additionalProperties, items, enum, const, oneOf, $ref). Objects are closed: a key the
/// schema does not describe is an error, so a field added to a view without documenting it fails.
fn check(doc: &Value, schema: &Value, value: &Value, at: &str) -> Result<(), String> {
    if let Some(reference) = schema["$ref"].as_str() {
        let name = reference.rsplit('/').next().unwrap_or_default();
        return check(doc, &doc["components"]["schemas"][name], value, at);
    }
    if let Some(options) = schema["oneOf"].as_array() {
        let matched = options.iter().filter(|o| check(doc, o, value, at).is_ok()).count();
        return if matched == 1 { Ok(()) } else { Err(format!("{at}: {value} matches {matched} of oneOf")) };
    }
    if let Some(allowed) = schema["enum"].as_array()
        && !allowed.contains(value)
    {
        return Err(format!("{at}: {value} is not one of {allowed:?}"));
    }
    if !schema["const"].is_null() && schema["const"] != *value {
        return Err(format!("{at}: {value} is not {}", schema["const"]));
    }
    let types: Vec<&str> = match &schema["type"] {
        Value::String(t) => vec![t.as_str()],
        Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    let kind = match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    };
    let documented = types.is_empty() || types.contains(&kind) || (kind == "integer" && types.contains(&"number"));
    if !documented {
        return Err(format!("{at}: {value} is {kind}, documented as {types:?}"));
    }
    match value {
        Value::Object(map) => {
            for required in schema["required"].as_array().into_iter().flatten().filter_map(Value::as_str) {
                if !map.contains_key(required) {
                    return Err(format!("{at}: missing required {required}"));
                }
            }
            for (key, item) in map {
                let at = format!("{at}.{key}");
                match (&schema["properties"][key], &schema["additionalProperties"]) {
                    (Value::Null, Value::Null) if schema["properties"].is_object() => {
                        return Err(format!("{at}: not documented"));
                    }
                    (Value::Null, Value::Object(_)) => check(doc, &schema["additionalProperties"], item, &at)?,
                    (Value::Null, _) => {}
                    (property, _) => check(doc, property, item, &at)?,
                }
            }
        }
        Value::Array(items) if schema["items"].is_object() => {
            for (i, item) in items.iter().enumerate() {
                check(doc, &schema["items"], item, &format!("{at}[{i}]"))?;
            }
        }
        _ => {}
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_matches_its_documented_schema() {
    let api = start(TestDb::sqlite().await, true).await;
    crate::store::failed_fixture(&api.s.db).await;
    let id = api.enqueue("s", "ok").await;
    api.enqueue("t", "transient").await;
    api.cycle().await;
    let handed_on = api.enqueue("fan", "order.created").await;
    api.cycle().await;
    let (to_fail, to_cancel) = (api.enqueue("s", "ok").await, api.enqueue("s", "ok").await);
    api.post("/v1/breakers/t/open", json!({"reason": "maintenance"})).await;
    let (_, doc) = api.get("/v1/openapi.json").await;
    let calls: Vec<(Method, String, Option<Value>)> = vec![
        (Method::GET, "/health/live".into(), None),
        (Method::GET, "/health/ready".into(), None),
        (Method::GET, "/v1/stats".into(), None),
        (Method::GET, "/v1/stats?window=soon".into(), None),
        (Method::POST, "/v1/events".into(), Some(json!({"route": "s", "type": "ok", "payload": {"n": 1}, "key": "k"}))),
        (Method::POST, "/v1/events".into(), Some(json!({"route": "nowhere", "type": "ok", "payload": 1}))),
        (Method::GET, format!("/v1/events/{id}"), None),
        (Method::GET, format!("/v1/events/{handed_on}"), None),
        (Method::GET, format!("/v1/events/{}", handed_on + 1), None),
        (Method::GET, "/v1/events/999999".into(), None),
        (Method::POST, format!("/v1/events/{id}/resend"), None),
        (Method::POST, format!("/v1/events/{id}/cancel"), None),
        (Method::POST, format!("/v1/events/{to_fail}/fail"), Some(json!({"reason": "receiver retired"}))),
        (Method::POST, format!("/v1/events/{to_cancel}/cancel"), None),
        (Method::GET, "/v1/failed?limit=2".into(), None),
        (Method::GET, "/v1/failed/count?route=a".into(), None),
        (Method::GET, "/v1/failed/summary".into(), None),
        (Method::GET, "/v1/failed/summary?reason=lost".into(), None),
        (Method::GET, "/v1/activity".into(), None),
        (Method::POST, "/v1/failed/resend".into(), Some(json!({"route": "a"}))),
        (Method::POST, "/v1/failed/purge".into(), Some(json!({"route": "b"}))),
        (Method::GET, "/v1/plugins".into(), None),
        (Method::POST, "/v1/plugins/reload".into(), None),
        (Method::GET, "/v1/routes".into(), None),
        (Method::GET, "/v1/breakers".into(), None),
        (Method::POST, "/v1/breakers/s/open".into(), Some(json!({}))),
        (Method::POST, "/v1/breakers/s/close".into(), None),
        (Method::POST, "/v1/breakers/fan%2Fall/open".into(), Some(json!({}))),
    ];
    let mut checked = 0;
    for (method, path, body) in calls {
        let (status, answer) = api.call_text(method.clone(), &path, body).await;
        let template = doc["paths"]
            .as_object()
            .unwrap()
            .iter()
            .find(|(p, _)| {
                let pattern = p.replace("{id}", "*").replace("{route}", "*");
                let plain = path.split('?').next().unwrap();
                matches_template(&pattern, plain)
            })
            .map(|(p, _)| p.clone())
            .unwrap_or_else(|| panic!("{path} is not documented"));
        let operation = &doc["paths"][&template][method.as_str().to_lowercase()];
        let mut response = operation["responses"][status.as_str()].clone();
        if let Some(reference) = response["$ref"].as_str() {
            response = doc["components"]["responses"][reference.rsplit('/').next().unwrap()].clone();
        }
        let schema = &response["content"]["application/json"]["schema"];
        assert!(schema.is_object(), "{method} {path} answered {status}, which has no documented schema");
        let value: Value = serde_json::from_str(&answer).unwrap();
        check(&doc, schema, &value, &format!("{method} {path} {status}")).unwrap_or_else(|e| panic!("{e}"));
        checked += usize::from(status != StatusCode::OK || !value.is_null());
    }
    assert!(checked >= 22, "every call above was checked");
}

/// Whether `path` matches `pattern`, whose `*` segments stand for any one segment.
fn matches_template(pattern: &str, path: &str) -> bool {
    let (a, b): (Vec<&str>, Vec<&str>) = (pattern.split('/').collect(), path.split('/').collect());
    a.len() == b.len() && a.iter().zip(&b).all(|(p, s)| *p == "*" || p == s)
}
