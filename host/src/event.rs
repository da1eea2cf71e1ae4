//! The outbox event as ferry sees it: what applications emit, what the relay claims, and what it
//! records afterwards.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
pub use ferry_outbox::NewEvent;
use serde::{Deserialize, Serialize};

use crate::store::codec::{Count, DbTime, Lenient, MaybeCount, MaybeTime};

/// Where an event is in its life. Stored as the upper-case names below.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Status {
    /// Waiting for delivery: new, deferred, or waiting for a retry.
    Pending,
    /// Claimed by a relay instance, which holds a lease on it.
    Processing,
    /// Delivered; terminal until purged by retention.
    Sent,
    /// Given up on; kept for inspection until resent or purged.
    Failed,
}

impl Status {
    /// Every status, in life-cycle order.
    pub const ALL: [Status; 4] = [Status::Pending, Status::Processing, Status::Sent, Status::Failed];

    /// The name stored in the `status` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "PENDING",
            Status::Processing => "PROCESSING",
            Status::Sent => "SENT",
            Status::Failed => "FAILED",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Status {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Status::ALL
            .into_iter()
            .find(|status| status.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| format!("unknown status {s:?} (expected PENDING, PROCESSING, SENT or FAILED)"))
    }
}

/// Why an event ended up FAILED; stored in `failure_reason` so operators can select by cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureReason {
    /// The transport said the event can never be delivered as it stands.
    Permanent,
    /// Transient failures continued until the event's attempt limit.
    AttemptsExhausted,
    /// No route or no loaded plugin for the event's route; resend once one exists.
    NoTransport,
    /// The plugin misbehaved on this event's last allowed attempt (trap, timeout, wrong answer).
    PluginFault,
    /// The stored row cannot be turned into an event (for example malformed headers).
    InvalidEvent,
    /// An operator ended the event by hand (`ferry event fail`).
    Operator,
}

impl FailureReason {
    /// Every reason.
    pub const ALL: [FailureReason; 6] = [
        FailureReason::Permanent,
        FailureReason::AttemptsExhausted,
        FailureReason::NoTransport,
        FailureReason::PluginFault,
        FailureReason::InvalidEvent,
        FailureReason::Operator,
    ];

    /// The name stored in the `failure_reason` column.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::Permanent => "permanent",
            FailureReason::AttemptsExhausted => "attempts_exhausted",
            FailureReason::NoTransport => "no_transport",
            FailureReason::PluginFault => "plugin_fault",
            FailureReason::InvalidEvent => "invalid_event",
            FailureReason::Operator => "operator",
        }
    }
}

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for FailureReason {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        FailureReason::ALL
            .into_iter()
            .find(|reason| reason.as_str() == s)
            .ok_or_else(|| format!("unknown failure reason {s:?}"))
    }
}

/// What one attempt led to, as the history records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptOutcome {
    /// Delivered: the event became SENT.
    Sent,
    /// A transient failure; the event waits for another attempt.
    Retry,
    /// The event became FAILED.
    Failed,
    /// The plugin said the receiver asked to wait: the event waits without an attempt counted.
    Deferred,
}

impl AttemptOutcome {
    /// The name stored in `ferry_attempts.outcome`.
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptOutcome::Sent => "sent",
            AttemptOutcome::Retry => "retry",
            AttemptOutcome::Failed => "failed",
            AttemptOutcome::Deferred => "deferred",
        }
    }
}

impl fmt::Display for AttemptOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for AttemptOutcome {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [AttemptOutcome::Sent, AttemptOutcome::Retry, AttemptOutcome::Failed, AttemptOutcome::Deferred]
            .into_iter()
            .find(|outcome| outcome.as_str() == s)
            .ok_or_else(|| format!("unknown attempt outcome {s:?}"))
    }
}

/// An event claimed for delivery. `attempt` already counts this delivery.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimedEvent {
    pub id: i64,
    pub route: String,
    pub event_type: String,
    pub ordering_key: Option<String>,
    pub payload: Vec<u8>,
    pub content_type: String,
    pub headers: Vec<(String, String)>,
    /// 1 on the first delivery, 2 on the first retry, and so on.
    pub attempt: u32,
    /// The limit pinned on the row, if any (0 = unlimited).
    pub max_attempts: Option<u32>,
    pub event_time: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    /// Set when the stored row could not be decoded; the relay fails such an event at once
    /// instead of handing a guess to a transport.
    pub defect: Option<String>,
}

impl ClaimedEvent {
    /// A claimed row that could not be decoded: only its id (and route, when readable) is known,
    /// and `defect` says why.
    pub fn defective(id: i64, route: String, defect: String) -> ClaimedEvent {
        ClaimedEvent {
            id,
            route,
            event_type: String::new(),
            ordering_key: None,
            payload: Vec::new(),
            content_type: String::new(),
            headers: Vec::new(),
            attempt: 0,
            max_attempts: None,
            event_time: DateTime::<Utc>::UNIX_EPOCH,
            created_at: DateTime::<Utc>::UNIX_EPOCH,
            defect: Some(defect),
        }
    }
}

/// How [`EventRecord::headers`] reads in JSON answers: the stored object as a JSON object, so
/// `jq .headers.tenant` works. A stored text that is not a JSON object (ferry never writes one; a
/// hand-written row may hold one) is answered as that text, so nothing is hidden.
pub mod headers_json {
    use serde::{Deserialize as _, Deserializer, Serialize as _, Serializer};

    pub fn serialize<S: Serializer>(text: &str, serializer: S) -> Result<S::Ok, S::Error> {
        match serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(text) {
            Ok(object) => object.serialize(serializer),
            Err(_) => serializer.serialize_str(text),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
        Ok(match serde_json::Value::deserialize(deserializer)? {
            serde_json::Value::String(text) => text,
            other => other.to_string(),
        })
    }
}

/// Parses the stored `headers` JSON object. Non-string values are kept as their JSON text.
pub fn parse_headers(json: &str) -> Result<Vec<(String, String)>, String> {
    // The default, and what most events carry: nothing to parse.
    if json == "{}" {
        return Ok(Vec::new());
    }
    match serde_json::from_str::<serde_json::Value>(json) {
        Ok(serde_json::Value::Object(map)) => Ok(map
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => (k, s),
                other => (k, other.to_string()),
            })
            .collect()),
        Ok(other) => Err(format!("headers must be a JSON object, found {other}")),
        Err(e) => Err(format!("headers are not valid JSON: {e}")),
    }
}

/// What the relay decided for one claimed event.
#[derive(Debug, Clone, PartialEq)]
pub enum Disposition {
    /// Delivered.
    Sent,
    /// Try again at `at`.
    Retry { at: DateTime<Utc>, error: String },
    /// Deliver again at `at`, as the plugin asked, without counting this attempt.
    Deferred { at: DateTime<Utc>, error: String },
    /// Give up.
    Failed { reason: FailureReason, error: String },
}

/// One outcome to record, fenced by the claim that produced it.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub id: i64,
    pub disposition: Disposition,
    /// The attempt limit to pin on the row when it had none yet.
    pub max_attempts: u32,
    /// The attempt that led here, for the event's history.
    pub attempt: AttemptLog,
    /// Where a copy goes when this completion makes the event FAILED (the route's `dead_letter`).
    pub dead_letter: Option<String>,
}

/// How one delivery attempt was made, written to the history with its outcome.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AttemptLog {
    /// The event's attempt number (1 = first delivery).
    pub number: u32,
    /// The plugin call the attempt was part of, shared by the events of that call.
    pub call: std::sync::Arc<CallLog>,
}

/// One plugin call: what every attempt it made has in common.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CallLog {
    /// The route whose transport was called (a call never spans routes).
    pub route: String,
    pub started_at: DateTime<Utc>,
    /// How long the plugin call took (zero when none was made).
    pub duration: std::time::Duration,
    /// The plugin that was called and the SHA-256 of its file; `None` when no plugin ran.
    pub plugin: Option<String>,
    pub plugin_hash: Option<String>,
    /// The ferry instance that made the call.
    pub instance: String,
    /// Why the host deferred the events without calling the plugin: `lease`, `host_resources`
    /// or `endpoint_disabled`, as `ferry_events_held` counts them. `None` for every other call.
    pub held: Option<&'static str>,
}

impl Disposition {
    /// What the history records for it.
    pub fn outcome(&self) -> AttemptOutcome {
        match self {
            Disposition::Sent => AttemptOutcome::Sent,
            Disposition::Retry { .. } => AttemptOutcome::Retry,
            Disposition::Failed { .. } => AttemptOutcome::Failed,
            Disposition::Deferred { .. } => AttemptOutcome::Deferred,
        }
    }

    /// The failure reason, for `failed`.
    pub fn reason(&self) -> Option<FailureReason> {
        match self {
            Disposition::Failed { reason, .. } => Some(*reason),
            _ => None,
        }
    }

    /// The error text, for `retry`, `failed` and `deferred`.
    pub fn error(&self) -> Option<&str> {
        match self {
            Disposition::Sent => None,
            Disposition::Retry { error, .. }
            | Disposition::Failed { error, .. }
            | Disposition::Deferred { error, .. } => Some(error),
        }
    }
}

/// One row of an event's delivery history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, sqlx::FromRow)]
pub struct AttemptRecord {
    #[sqlx(try_from = "Count")]
    pub attempt: u32,
    #[sqlx(try_from = "DbTime")]
    pub started_at: DateTime<Utc>,
    #[sqlx(try_from = "i64")]
    pub duration_ms: u64,
    pub outcome: AttemptOutcome,
    pub reason: Option<FailureReason>,
    pub error: Option<String>,
    pub plugin: Option<String>,
    pub plugin_hash: Option<String>,
    pub instance: Option<String>,
}

/// A full stored row, for inspection (`ferry show`, tests).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, sqlx::FromRow)]
pub struct EventRecord {
    pub id: i64,
    pub route: String,
    pub event_type: String,
    pub ordering_key: Option<String>,
    #[serde(skip)]
    pub payload: Vec<u8>,
    pub content_type: String,
    /// The stored JSON object's text; a JSON object in answers (see [`headers_json`]).
    #[serde(with = "headers_json")]
    pub headers: String,
    pub status: Status,
    #[sqlx(try_from = "Count")]
    pub attempts: u32,
    #[sqlx(try_from = "MaybeCount")]
    pub max_attempts: Option<u32>,
    #[sqlx(try_from = "DbTime")]
    pub event_time: DateTime<Utc>,
    #[sqlx(try_from = "DbTime")]
    pub created_at: DateTime<Utc>,
    #[sqlx(try_from = "DbTime")]
    pub last_status_at: DateTime<Utc>,
    #[sqlx(try_from = "DbTime")]
    pub next_attempt_at: DateTime<Utc>,
    #[sqlx(try_from = "MaybeTime")]
    pub processed_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    pub failure_reason: Option<FailureReason>,
    pub claimed_by: Option<String>,
    pub claim_token: Option<String>,
    #[sqlx(try_from = "MaybeTime")]
    pub lease_until: Option<DateTime<Utc>>,
    /// For a delivery to one destination of a route, the event it was handed on from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_id: Option<i64>,
    /// Set when a column holds what ferry cannot represent: which, and why. The others are shown
    /// as stored; an unreadable one as its zero value.
    #[sqlx(skip)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub defect: Option<String>,
}

/// A stored row read for inspection: every column leniently, so an unreadable one is reported
/// instead of failing the read (and, in a list, the whole page).
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct StoredRow {
    id: i64,
    route: Lenient<String>,
    event_type: Lenient<String>,
    ordering_key: Lenient<Option<String>>,
    payload: Lenient<Vec<u8>>,
    content_type: Lenient<String>,
    headers: Lenient<String>,
    status: Lenient<Status>,
    attempts: Lenient<Count>,
    max_attempts: Lenient<MaybeCount>,
    event_time: Lenient<DbTime>,
    created_at: Lenient<DbTime>,
    last_status_at: Lenient<DbTime>,
    next_attempt_at: Lenient<DbTime>,
    processed_at: Lenient<MaybeTime>,
    last_error: Lenient<Option<String>>,
    failure_reason: Lenient<Option<FailureReason>>,
    claimed_by: Lenient<Option<String>>,
    claim_token: Lenient<Option<String>>,
    lease_until: Lenient<MaybeTime>,
    parent_id: Lenient<Option<i64>>,
}

impl StoredRow {
    pub(crate) fn into_record(self) -> EventRecord {
        let mut d = Vec::new();
        let zero = DbTime(DateTime::<Utc>::UNIX_EPOCH);
        let record = EventRecord {
            id: self.id,
            route: self.route.or("route", String::new(), &mut d),
            event_type: self.event_type.or("event_type", String::new(), &mut d),
            ordering_key: self.ordering_key.or("ordering_key", None, &mut d),
            payload: self.payload.or("payload", Vec::new(), &mut d),
            content_type: self.content_type.or("content_type", String::new(), &mut d),
            headers: self.headers.or("headers", "{}".into(), &mut d),
            status: self.status.or("status", Status::Failed, &mut d),
            attempts: self.attempts.or("attempts", Count(0), &mut d).0,
            max_attempts: self.max_attempts.or("max_attempts", MaybeCount(None), &mut d).0,
            event_time: self.event_time.or("event_time", zero, &mut d).0,
            created_at: self.created_at.or("created_at", zero, &mut d).0,
            last_status_at: self.last_status_at.or("last_status_at", zero, &mut d).0,
            next_attempt_at: self.next_attempt_at.or("next_attempt_at", zero, &mut d).0,
            processed_at: self.processed_at.or("processed_at", MaybeTime(None), &mut d).0,
            last_error: self.last_error.or("last_error", None, &mut d),
            failure_reason: self.failure_reason.or("failure_reason", None, &mut d),
            claimed_by: self.claimed_by.or("claimed_by", None, &mut d),
            claim_token: self.claim_token.or("claim_token", None, &mut d),
            lease_until: self.lease_until.or("lease_until", MaybeTime(None), &mut d).0,
            parent_id: self.parent_id.or("parent_id", None, &mut d),
            defect: None,
        };
        let defect = (!d.is_empty()).then(|| crate::untrusted::clean(&d.join("; "), crate::untrusted::MAX_REASON));
        EventRecord { defect, ..record }
    }
}

/// The columns of a claimed row, as the claim statements return them, in [`CLAIMED_COLUMNS`]'s
/// order.
#[derive(Debug)]
pub(crate) struct ClaimedRow {
    id: i64,
    /// NULL when longer than [`MAX_CLAIMED_NAME`] (a route is never NULL in the table): it is not
    /// loaded. So for the event type and the content type.
    route: Option<String>,
    event_type: Option<String>,
    /// NULL when the event has none, or when it is longer than [`MAX_CLAIMED_NAME`]
    /// (`key_oversized` tells which).
    ordering_key: Option<String>,
    /// NULL when the payload is larger than the claim's `max_payload`: it is not loaded.
    payload: Option<Vec<u8>>,
    payload_size: i64,
    content_type: Option<String>,
    /// NULL when the headers print in more than [`MAX_CLAIMED_HEADERS`] bytes.
    headers: Option<String>,
    attempts: u32,
    max_attempts: Option<u32>,
    event_time: DateTime<Utc>,
    created_at: DateTime<Utc>,
    pub(crate) next_attempt_at: DateTime<Utc>,
    /// True when the ordering key is longer than [`MAX_CLAIMED_NAME`], NULL when there is none.
    key_oversized: Option<bool>,
}

/// The longest route, event type, ordering key or content type a claim loads, in bytes (bound
/// into the claim statements): what `emit` accepts.
pub(crate) const MAX_CLAIMED_NAME: i64 = ferry_outbox::MAX_NAME as i64;

/// The most bytes of headers a claim loads, as the database writes them out. Twice what `emit`
/// accepts as compact JSON: PostgreSQL prints a jsonb object with a space after each `:` and `,`,
/// which lengthens the smallest header (`"a":""`) by a third.
pub(crate) const MAX_CLAIMED_HEADERS: i64 = 2 * ferry_outbox::MAX_HEADERS as i64;

/// The columns both claim statements return, in order. A claimed row is read by position: by
/// name, each column cost a hashed lookup of the name, about a quarter of decoding the row (of
/// 13 columns then). The claim checks the first row's names against these before any row is read.
pub(crate) const CLAIMED_COLUMNS: [&str; 14] = [
    "id",
    "route",
    "event_type",
    "ordering_key",
    "payload",
    "payload_size",
    "content_type",
    "headers",
    "attempts",
    "max_attempts",
    "event_time",
    "created_at",
    "next_attempt_at",
    "key_oversized",
];

impl ClaimedRow {
    /// Checks that the columns of `row` are declared with types compatible with those each is
    /// read as, naming the first that is not. Where every row of a result has its columns'
    /// declared types (PostgreSQL's), this checks them all, and [`ClaimedRow::decode`] need not
    /// check each value.
    pub(crate) fn check_declared_types<R>(row: &R) -> Result<(), String>
    where
        R: sqlx::Row,
        i64: sqlx::Type<R::Database>,
        String: sqlx::Type<R::Database>,
        Vec<u8>: sqlx::Type<R::Database>,
        Count: sqlx::Type<R::Database>,
        MaybeCount: sqlx::Type<R::Database>,
        DbTime: sqlx::Type<R::Database>,
        bool: sqlx::Type<R::Database>,
    {
        use sqlx::{Column, TypeInfo};
        type Check<DB> = fn(&<DB as sqlx::Database>::TypeInfo) -> bool;
        fn check<DB: sqlx::Database, T: sqlx::Type<DB>>(ty: &DB::TypeInfo) -> bool {
            T::compatible(ty)
        }
        let checks: [Check<R::Database>; 14] = [
            check::<_, i64>,
            check::<_, String>,
            check::<_, String>,
            check::<_, String>,
            check::<_, Vec<u8>>,
            check::<_, i64>,
            check::<_, String>,
            check::<_, String>,
            check::<_, Count>,
            check::<_, MaybeCount>,
            check::<_, DbTime>,
            check::<_, DbTime>,
            check::<_, DbTime>,
            check::<_, bool>,
        ];
        // The names are checked first (`claimed_events`): these are the claim's columns, in order.
        for ((column, check), name) in row.columns().iter().zip(checks).zip(CLAIMED_COLUMNS) {
            if !check(column.type_info()) {
                return Err(format!("returned its column {name} as {}", column.type_info().name()));
            }
        }
        Ok(())
    }

    /// Decodes a claimed row, by position. With `check_types`, each value's type is checked
    /// against what it is read as before it is decoded, as `FromRow` does. Without, it is not: for
    /// a row whose values have the types their columns declare (PostgreSQL's), once
    /// [`ClaimedRow::check_declared_types`] passed. SQLite's values carry types of their own, so
    /// its rows are checked value by value.
    pub(crate) fn decode<'r, R>(row: &'r R, check_types: bool) -> Result<Self, sqlx::Error>
    where
        R: sqlx::Row,
        usize: sqlx::ColumnIndex<R>,
        i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        Count: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        MaybeCount: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        DbTime: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        bool: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    {
        let column = |i: usize| ClaimedColumn { row, i, check_types };
        Ok(Self {
            id: column(0).get()?,
            route: column(1).get()?,
            event_type: column(2).get()?,
            ordering_key: column(3).get()?,
            payload: column(4).get()?,
            payload_size: column(5).get()?,
            content_type: column(6).get()?,
            headers: column(7).get()?,
            attempts: column(8).get::<Count>()?.into(),
            max_attempts: column(9).get::<MaybeCount>()?.into(),
            event_time: column(10).get::<DbTime>()?.into(),
            created_at: column(11).get::<DbTime>()?.into(),
            next_attempt_at: column(12).get::<DbTime>()?.into(),
            key_oversized: column(13).get()?,
        })
    }
}

/// Column `i` of a claimed row, read as [`ClaimedRow::decode`] says.
struct ClaimedColumn<'r, R> {
    row: &'r R,
    i: usize,
    check_types: bool,
}

impl<'r, R> ClaimedColumn<'r, R>
where
    R: sqlx::Row,
    usize: sqlx::ColumnIndex<R>,
{
    /// The value, or an error naming the column as a decode by name would.
    fn get<T>(&self) -> Result<T, sqlx::Error>
    where
        T: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    {
        let value = if self.check_types { self.row.try_get(self.i) } else { self.row.try_get_unchecked(self.i) };
        value.map_err(|e| match e {
            sqlx::Error::ColumnDecode { source, .. } => {
                let name = CLAIMED_COLUMNS.get(self.i).copied().unwrap_or("?");
                sqlx::Error::ColumnDecode { index: format!("{name:?}"), source }
            }
            other => other,
        })
    }
}

impl ClaimedRow {
    /// The event to deliver; headers that do not parse, an empty route or event type, a name or
    /// headers too long to load, a payload over the size limit (`max` bytes), or an id below 1,
    /// become the event's defect.
    pub(crate) fn into_event(self, max_payload: u64) -> ClaimedEvent {
        let id = self.id;
        // Each later finding replaces an earlier one: a value not loaded says more than one that
        // is wrong, and the payload's size, which the operator can change a limit for, most.
        let (headers, mut defect) = match self.headers.as_deref().map(parse_headers) {
            Some(Ok(headers)) => (headers, None),
            Some(Err(e)) => (Vec::new(), Some(format!("event {id}: {e}"))),
            None => (Vec::new(), None),
        };
        let not_loaded = [
            ("route", self.route.is_none()),
            ("event_type", self.event_type.is_none()),
            ("ordering_key", self.key_oversized == Some(true)),
            ("content_type", self.content_type.is_none()),
            ("headers", self.headers.is_none()),
        ];
        let (route, event_type) = (self.route.unwrap_or_default(), self.event_type.unwrap_or_default());
        // The schema refuses these at INSERT; a row written past its checks (a logical replica,
        // a restore without triggers, an UPDATE by hand) can still hold them.
        for (column, value) in [("route", &route), ("event_type", &event_type)] {
            if value.is_empty() {
                defect = Some(format!("event {id}: {column} is empty; set it and resend the event"));
            }
        }
        if let Some((column, _)) = not_loaded.into_iter().find(|(_, missing)| *missing) {
            defect = Some(if column == "headers" {
                format!(
                    "event {id}: its headers print in more than the {MAX_CLAIMED_HEADERS} bytes ferry loads, so they \
                     were not loaded; emit the event again with smaller headers, or purge it"
                )
            } else {
                format!(
                    "event {id}: its {column} is longer than the {MAX_CLAIMED_NAME} bytes ferry loads, so it was not \
                     loaded; emit the event again with a shorter {column}, or purge it"
                )
            });
        }
        if self.payload.is_none() {
            defect = Some(format!(
                "event {id}: the payload is {} bytes, more than relay.max_payload ({max_payload} bytes); \
                 raise the limit and resend it, or purge it",
                self.payload_size
            ));
        }
        // Last, as neither a resend nor a limit fixes it: plugins get the id as an unsigned number and
        // use it as an idempotency key, so an id below 1 (which the outbox never assigns, but a
        // hand-written INSERT can) would reach them as a duplicate 0.
        if id < 1 {
            defect = Some(format!(
                "event {id}: its id is not positive, and ferry hands plugins ids from 1; emit the event again \
                 (it gets a new id) and delete this row"
            ));
        }
        let content_type = self.content_type.unwrap_or_default();
        ClaimedEvent {
            id,
            route,
            event_type,
            ordering_key: self.ordering_key,
            payload: self.payload.unwrap_or_default(),
            content_type,
            headers,
            attempt: self.attempts,
            max_attempts: self.max_attempts,
            event_time: self.event_time,
            created_at: self.created_at,
            defect,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_names_round_trip() {
        for status in Status::ALL {
            assert_eq!(status.as_str().parse::<Status>(), Ok(status));
        }
        assert!("sent".parse::<Status>().is_ok());
        assert!("DONE".parse::<Status>().unwrap_err().contains("DONE"));
    }

    #[test]
    fn headers_parse_objects_only() {
        assert_eq!(
            parse_headers(r#"{"a":"1","n":2}"#).unwrap(),
            vec![("a".into(), "1".into()), ("n".into(), "2".into())]
        );
        assert!(parse_headers("[1]").unwrap_err().contains("JSON object"));
        assert!(parse_headers("{").unwrap_err().contains("not valid JSON"));
    }

    #[test]
    fn emitted_headers_parse_back() {
        let e = NewEvent::new("r", "t", "x").with_header("k", "v\"q");
        assert_eq!(parse_headers(&e.headers_json()).unwrap(), e.headers);
    }

    #[test]
    fn reasons_and_outcomes_round_trip() {
        for reason in FailureReason::ALL {
            assert_eq!(reason.as_str().parse::<FailureReason>(), Ok(reason));
        }
        assert!("gone".parse::<FailureReason>().is_err());
        assert_eq!("retry".parse::<AttemptOutcome>(), Ok(AttemptOutcome::Retry));
    }
}
