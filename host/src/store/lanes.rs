//! The PostgreSQL connections the relay's claims, hand-ons and outcome writes run on: a few,
//! kept apart from the pool, each running one statement after another.
//!
//! Why not the pool: sqlx checks every connection with a round trip when it comes back to its
//! pool, which doubled the round trips of the relay's statements; and with one pooled connection
//! per worker, four workers kept four statements running at once on a database with two cores,
//! where the backends then spent about a twentieth more per event contending (BENCHMARKS.md). A
//! lane is taken for one statement (or one transaction) and given back without a check; at most
//! `database.relay_connections` are taken at once, so the workers' statements queue for them while
//! the other workers decode, deliver and record in the meantime, and the database has as many
//! statements running as it was given connections for.
//!
//! With so few connections, one statement stuck behind a lock would hold up a good part of the
//! relay: a lane's statement waits at most [`LOCK_TIMEOUT`] for a lock (another transaction holding
//! a claimed row, a migration holding the table), then fails as a failure that may pass, which the
//! relay tries again.

use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection};
use tokio::sync::{Semaphore, SemaphorePermit};

use super::{CHECK_AFTER_IDLE, StoreError};

/// How long opening a lane's connection, or checking an idle one, may take: as long as the pool
/// lets an acquire wait. A check past it (a server gone without closing the connection) closes
/// the connection, and a new one is opened.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a lane's statement waits for a lock before it fails (`lock_timeout`): far longer than
/// a claim or a write of outcomes takes, which wait for no one in the common case.
const LOCK_TIMEOUT: &str = "10s";

/// How long a lane's connection is used before it is closed and another opened in its place, as
/// the pool does (sqlx's default): after a switchover behind a proxy, the relay reaches the new
/// server within this, even while the old connections keep working.
const MAX_LIFETIME: Duration = Duration::from_secs(30 * 60);

/// The relay's connections, opened when first needed and kept while they work.
#[derive(Debug)]
pub(super) struct Lanes {
    options: PgConnectOptions,
    /// One per lane that may be taken: `database.relay_connections`.
    permits: Semaphore,
    /// Connections given back: the most recent is taken first, one idle for [`CHECK_AFTER_IDLE`]
    /// is checked before it is used (the server may have closed it), and one older than
    /// [`MAX_LIFETIME`] is closed.
    idle: std::sync::Mutex<Vec<Idle>>,
}

/// A connection given back, with when it was opened and when it was given back.
#[derive(Debug)]
struct Idle {
    conn: PgConnection,
    opened: Instant,
    since: Instant,
}

/// A connection taken for one statement or transaction. [`Lane::done`] gives it back; dropped
/// without that (an error returned with `?`, a cancelled task), it is closed, since what it was
/// in the middle of is unknown, and the next lane taken opens a new one.
pub(super) struct Lane<'a> {
    lanes: &'a Lanes,
    conn: Option<PgConnection>,
    opened: Instant,
    _permit: SemaphorePermit<'a>,
}

impl Lanes {
    /// Lanes connecting with `options`, at most `count` of them taken at once.
    pub(super) fn new(options: PgConnectOptions, count: u32) -> Self {
        let options = options.options([("lock_timeout", LOCK_TIMEOUT)]);
        Self { options, permits: Semaphore::new(count as usize), idle: std::sync::Mutex::default() }
    }

    /// Waits for a lane: an idle connection, checked when it has been idle a while, or a new one.
    pub(super) async fn take(&self) -> Result<Lane<'_>, StoreError> {
        let permit = self.permits.acquire().await.map_err(|_| sqlx::Error::PoolClosed)?;
        loop {
            let idle = self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop();
            let Some(Idle { mut conn, opened, since }) = idle else { break };
            if opened.elapsed() >= MAX_LIFETIME {
                let _ = tokio::time::timeout(CONNECT_TIMEOUT, conn.close()).await;
                continue;
            }
            let fit = since.elapsed() < CHECK_AFTER_IDLE
                || matches!(tokio::time::timeout(CONNECT_TIMEOUT, conn.ping()).await, Ok(Ok(())));
            if fit {
                return Ok(Lane { lanes: self, conn: Some(conn), opened, _permit: permit });
            }
        }
        let conn = tokio::time::timeout(CONNECT_TIMEOUT, self.options.connect()).await.map_err(|_| {
            let why = format!("opening a connection for the relay's statements took over {CONNECT_TIMEOUT:?}");
            sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, why))
        })??;
        Ok(Lane { lanes: self, conn: Some(conn), opened: Instant::now(), _permit: permit })
    }
}

impl Lane<'_> {
    /// The statement or transaction ended as it should (committed, or its result read whole): the
    /// connection goes back for the next, and the worker waiting for it runs before this one goes
    /// on (see [`handed_on`](super::handed_on)).
    pub(super) async fn done(mut self) {
        if let Some(conn) = self.conn.take() {
            let mut idle = self.lanes.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            idle.push(Idle { conn, opened: self.opened, since: Instant::now() });
        }
        drop(self);
        super::handed_on().await;
    }
}

impl std::ops::Deref for Lane<'_> {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        self.conn.as_ref().expect("a lane holds its connection until it is done")
    }
}

impl std::ops::DerefMut for Lane<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.conn.as_mut().expect("a lane holds its connection until it is done")
    }
}
