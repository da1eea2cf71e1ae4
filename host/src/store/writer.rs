//! SQLite: the one connection the relay writes through, and the checkpoints of the write-ahead
//! log, which run beside its writes rather than in them.
//!
//! SQLite lets one connection write at a time, and a connection that finds the file locked sleeps
//! in steps of milliseconds before trying again; the relay's writes queue here instead and start
//! the moment the previous one ends. Writing through one connection also keeps its page cache,
//! which SQLite empties on a connection whenever another one has written to the file, and its
//! prepared statements; and it is not checked on its way back as a pooled one is (a round trip to
//! its thread after every write). Other processes still wait on the busy timeout.
//!
//! **Checkpoints.** In WAL mode a commit appends the pages it changed to the log, and by default
//! the connection that commits past 1 000 pages of log then copies them into the database file
//! and syncs both files before its write returns: about a sixth of the writer's time under load
//! (BENCHMARKS.md). Here a connection of its own does that, on a thread of its own, a moment after
//! writes were made: a passive checkpoint, which neither waits for nor stops the writer. The log
//! starts again from its beginning only when a write begins with every page of it copied, which
//! under a steady stream of writes a passive checkpoint alone never leaves it; so once the log is
//! past [`RESTART_AFTER`] pages, the checkpointer holds the writing connection for a second,
//! short checkpoint of what was written during the first, and the next write starts the log
//! again. The writing connection keeps SQLite's own checkpoint at [`BACKSTOP`] pages, for a
//! checkpointer that cannot keep up.

use std::sync::{Arc, Weak};
use std::time::Duration;

use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{Connection, SqliteConnection};
use tokio::sync::{Mutex, MutexGuard, Notify};
use tokio_util::sync::CancellationToken;

use super::StoreError;

/// How long the checkpointer lets writes gather after it is told of one, so that each checkpoint
/// copies (and syncs) the pages of several.
const GATHER: Duration = Duration::from_millis(20);

/// Pages of log (4 KiB each) past which a checkpoint finishes the log under the writing
/// connection, so that the next write starts it again: SQLite's own checkpoint size, so the log
/// stays about the size SQLite's default keeps it at. It is past that size for a moment in each
/// turn (until the checkpointer's next run), as it is past it beside a default writer until that
/// writer's commit ends; a commit through another connection (an emit, an application's) in that
/// moment runs SQLite's own checkpoint, as it would beside a default writer.
pub(super) const RESTART_AFTER: i64 = 1000;

/// The writing connection's own checkpoint size (`wal_autocheckpoint`), in pages: reached only
/// when the checkpointer cannot keep up (it failed, or a reader holds an old snapshot open).
pub(super) const BACKSTOP: u32 = 16_384;

/// The relay's writing connection.
#[derive(Debug)]
pub(super) struct Writer {
    /// How the writing connection is opened (again, after a failed write).
    options: SqliteConnectOptions,
    slot: Mutex<WriterSlot>,
    checkpoints: Option<Checkpoints>,
}

#[derive(Debug)]
struct WriterSlot {
    conn: SqliteConnection,
    /// The last write through `conn` failed or was abandoned half-way: check the connection
    /// before the next one (see [`Writer::writing`]).
    suspect: bool,
}

/// The checkpointer's side of the writer: it is told of writes, and stops with the writer.
#[derive(Debug)]
struct Checkpoints {
    written: Arc<Notify>,
    stop: CancellationToken,
    /// Started with the first write, so commands that only read never open its connection.
    task: std::sync::OnceLock<tokio::task::JoinHandle<()>>,
    options: SqliteConnectOptions,
}

impl Writer {
    /// Opens the writing connection with `options`. With `checkpoint_beside` (a database in a
    /// file, in WAL mode), its log is checkpointed by a connection of its own from the first
    /// write on.
    pub(super) async fn open(
        options: &SqliteConnectOptions,
        checkpoint_beside: bool,
    ) -> Result<Arc<Self>, sqlx::Error> {
        let writing = match checkpoint_beside {
            true => options.clone().pragma("wal_autocheckpoint", BACKSTOP.to_string()),
            false => options.clone(),
        };
        let conn = SqliteConnection::connect_with(&writing).await?;
        let checkpoints = checkpoint_beside.then(|| Checkpoints {
            written: Arc::default(),
            stop: CancellationToken::new(),
            task: std::sync::OnceLock::new(),
            options: options.clone(),
        });
        let slot = Mutex::new(WriterSlot { conn, suspect: false });
        Ok(Arc::new(Self { options: writing, slot, checkpoints }))
    }

    /// Waits for the writing connection. After a write that failed or was abandoned half-way, the
    /// connection is checked first, and opened again if it is not fit for the next.
    pub(super) async fn writing(self: &Arc<Self>) -> Result<Writing<'_>, StoreError> {
        if let Some(checkpoints) = &self.checkpoints {
            checkpoints.task.get_or_init(|| {
                let (written, stop) = (checkpoints.written.clone(), checkpoints.stop.clone());
                tokio::spawn(checkpoint_beside(Arc::downgrade(self), checkpoints.options.clone(), written, stop))
            });
        }
        let mut slot = self.slot.lock().await;
        if slot.suspect || slot.conn.is_in_transaction() {
            // The round trip waits for what the last write left queued on the connection's thread
            // (sqlx's rollback of a transaction dropped unfinished) and finds a thread that is gone.
            // A transaction still counted open after it means SQLite had already ended it (a full
            // disk, a trigger's `RAISE(ROLLBACK)`), so sqlx's rollback failed and still counts one:
            // on that connection the next transaction would be a savepoint, whose rollback leaves
            // every later write uncommitted and the file locked.
            let unfit = match slot.conn.ping().await {
                Err(e) => Some(e.to_string()),
                Ok(()) if slot.conn.is_in_transaction() => Some("a transaction is still counted open".into()),
                Ok(()) => None,
            };
            if let Some(why) = unfit {
                tracing::warn!(why, "the SQLite writing connection is not fit for the next write; opening a new one");
                slot.conn = SqliteConnection::connect_with(&self.options).await?;
            }
            slot.suspect = false;
        }
        Ok(Writing { writer: self, slot, finished: false })
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        if let Some(checkpoints) = &self.checkpoints {
            checkpoints.stop.cancel();
        }
    }
}

/// The writing connection, held for one write ([`Writer::writing`]). Dropped before
/// [`Writing::finish`] (an error returned with `?`, a cancelled task), it leaves the connection
/// suspect.
pub(super) struct Writing<'a> {
    writer: &'a Writer,
    slot: MutexGuard<'a, WriterSlot>,
    finished: bool,
}

impl Writing<'_> {
    /// The write ran to its end (committed, or rolled back on purpose): the next one needs no
    /// check. The worker waiting for the connection runs before this one goes on (see
    /// [`handed_on`](super::handed_on)).
    pub(super) async fn finish(mut self) {
        self.finished = true;
        drop(self);
        super::handed_on().await;
    }
}

impl std::ops::Deref for Writing<'_> {
    type Target = SqliteConnection;
    fn deref(&self) -> &SqliteConnection {
        &self.slot.conn
    }
}

impl std::ops::DerefMut for Writing<'_> {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        &mut self.slot.conn
    }
}

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.slot.suspect = true;
        }
        if let Some(checkpoints) = &self.writer.checkpoints {
            checkpoints.written.notify_one();
        }
    }
}

/// The checkpointer of `writer`'s log, on a connection of its own opened with `options`: told of
/// writes through `written`, it checkpoints [`GATHER`] after one, until `stop`.
async fn checkpoint_beside(
    writer: Weak<Writer>,
    options: SqliteConnectOptions,
    written: Arc<Notify>,
    stop: CancellationToken,
) {
    let mut conn: Option<SqliteConnection> = None;
    let mut failing = false;
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = written.notified() => {}
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(GATHER) => {}
        }
        let outcome = match conn.as_mut() {
            Some(conn) => checkpoint(conn, &writer).await,
            None => match SqliteConnection::connect_with(&options).await {
                Ok(opened) => checkpoint(conn.insert(opened), &writer).await,
                Err(e) => Err(e),
            },
        };
        match outcome {
            Ok(()) => failing = false,
            Err(e) => {
                // Said once until it works again: the writing connection's own checkpoint
                // (BACKSTOP) keeps the log bounded meanwhile.
                if !failing {
                    tracing::warn!(
                        "checkpointing the SQLite log beside the relay's writes failed; trying again after the next \
                         write (the writing connection checkpoints itself past {BACKSTOP} pages): {e}"
                    );
                }
                failing = true;
                conn = None;
            }
        }
    }
    if let Some(conn) = conn {
        let _ = conn.close().await;
    }
}

/// One passive checkpoint on `conn`; and when the log is past [`RESTART_AFTER`] pages, a second
/// one while holding `writer`'s connection, which copies what was written during the first and so
/// leaves the whole log copied for the next write to start it again.
async fn checkpoint(conn: &mut SqliteConnection, writer: &Weak<Writer>) -> Result<(), sqlx::Error> {
    let log = passive(conn).await?;
    if log > RESTART_AFTER
        && let Some(writer) = writer.upgrade()
    {
        let _held = writer.slot.lock().await;
        passive(conn).await?;
    }
    Ok(())
}

/// A passive checkpoint: copies what it can of the log without waiting for readers or writers.
/// Returns the pages in the log (-1 when another connection was checkpointing, so none were
/// copied).
async fn passive(conn: &mut SqliteConnection) -> Result<i64, sqlx::Error> {
    let (_busy, log, _copied): (i64, i64, i64) =
        sqlx::query_as("PRAGMA wal_checkpoint(PASSIVE)").fetch_one(conn).await?;
    Ok(log)
}

#[cfg(test)]
mod tests {
    use sqlx::sqlite::SqliteJournalMode;

    use super::*;

    /// The writing connection leaves its log to the checkpointer: it checkpoints itself only past
    /// the backstop, and the database file, which only a checkpoint writes to, takes the pages a
    /// moment after they were written, without any write through another connection.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_log_is_copied_beside_the_writes() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("w.db");
        let options =
            SqliteConnectOptions::new().filename(&file).create_if_missing(true).journal_mode(SqliteJournalMode::Wal);
        let writer = Writer::open(&options, true).await.unwrap();
        let mut writing = writer.writing().await.unwrap();
        let own: i64 = sqlx::query_scalar("PRAGMA wal_autocheckpoint").fetch_one(&mut *writing).await.unwrap();
        assert_eq!(own, i64::from(BACKSTOP));
        let before = std::fs::metadata(&file).unwrap().len();
        sqlx::query(
            "CREATE TABLE t (v BLOB);
             WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2000)
             INSERT INTO t SELECT randomblob(500) FROM n",
        )
        .execute(&mut *writing)
        .await
        .unwrap();
        writing.finish().await;
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::fs::metadata(&file).unwrap().len() <= before + 500 * 2000 {
            assert!(std::time::Instant::now() < deadline, "the log was not copied into the database file");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Dropping the writer ends its checkpointer's task, which closes its connection on the way.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_checkpointer_stops_with_the_writer() {
        let dir = tempfile::tempdir().unwrap();
        let options = SqliteConnectOptions::new()
            .filename(dir.path().join("w.db"))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal);
        let writer = Writer::open(&options, true).await.unwrap();
        let writing = writer.writing().await.unwrap();
        writing.finish().await;
        let task = writer.checkpoints.as_ref().unwrap().task.get().expect("started by the write").abort_handle();
        tokio::time::sleep(GATHER * 3).await;
        assert!(!task.is_finished(), "the checkpointer waits for the next write");
        drop(writer);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !task.is_finished() {
            assert!(std::time::Instant::now() < deadline, "the checkpointer outlived its writer");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
