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

use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection};
use tokio::sync::{Semaphore, SemaphorePermit};

use super::{CHECK_AFTER_IDLE, StoreError};

/// How long opening a lane's connection may take, as long as the pool lets an acquire wait.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The relay's connections, opened when first needed and kept while they work.
#[derive(Debug)]
pub(super) struct Lanes {
    options: PgConnectOptions,
    /// One per lane that may be taken: `database.relay_connections`.
    permits: Semaphore,
    /// Connections given back, with when: the most recent is taken first, and one idle for
    /// [`CHECK_AFTER_IDLE`] is checked before it is used (the server may have closed it).
    idle: std::sync::Mutex<Vec<(PgConnection, Instant)>>,
}

/// A connection taken for one statement or transaction. [`Lane::done`] gives it back; dropped
/// without that (an error returned with `?`, a cancelled task), it is closed, since what it was
/// in the middle of is unknown, and the next lane taken opens a new one.
pub(super) struct Lane<'a> {
    lanes: &'a Lanes,
    conn: Option<PgConnection>,
    _permit: SemaphorePermit<'a>,
}

impl Lanes {
    /// Lanes connecting with `options`, at most `count` of them taken at once.
    pub(super) fn new(options: PgConnectOptions, count: u32) -> Self {
        Self { options, permits: Semaphore::new(count as usize), idle: std::sync::Mutex::default() }
    }

    /// Waits for a lane: an idle connection, checked when it has been idle a while, or a new one.
    pub(super) async fn take(&self) -> Result<Lane<'_>, StoreError> {
        let permit = self.permits.acquire().await.map_err(|_| sqlx::Error::PoolClosed)?;
        loop {
            let idle = self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop();
            let Some((mut conn, since)) = idle else { break };
            if since.elapsed() < CHECK_AFTER_IDLE || conn.ping().await.is_ok() {
                return Ok(Lane { lanes: self, conn: Some(conn), _permit: permit });
            }
        }
        let conn = tokio::time::timeout(CONNECT_TIMEOUT, self.options.connect()).await.map_err(|_| {
            let why = format!("opening a connection for the relay's statements took over {CONNECT_TIMEOUT:?}");
            sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, why))
        })??;
        Ok(Lane { lanes: self, conn: Some(conn), _permit: permit })
    }
}

impl Lane<'_> {
    /// The statement or transaction ended as it should (committed, or its result read whole): the
    /// connection goes back for the next.
    pub(super) fn done(mut self) {
        if let Some(conn) = self.conn.take() {
            let mut idle = self.lanes.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            idle.push((conn, Instant::now()));
        }
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
