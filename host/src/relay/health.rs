//! Whether the relay's workers make progress, for `/health/ready`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Whether the relay's workers make progress, for readiness: each notes when it began the cycle
/// it is in, so one stuck longer than a cycle can take (a database that stopped answering) shows.
#[derive(Debug)]
pub struct RelayHealth {
    epoch: Instant,
    /// Per worker: milliseconds since `epoch` when its current cycle began, 0 while it waits.
    busy_since: Vec<AtomicU64>,
    /// Longest a cycle may take: the lease, past which its claims are recovered anyway.
    limit: Duration,
}

impl RelayHealth {
    pub(super) fn new(workers: u32, limit: Duration) -> RelayHealth {
        let busy_since = (0..workers).map(|_| AtomicU64::new(0)).collect();
        RelayHealth { epoch: Instant::now(), busy_since, limit }
    }

    pub(super) fn busy(&self, worker: u32, busy: bool) {
        let since = if busy { self.epoch.elapsed().as_millis() as u64 + 1 } else { 0 };
        if let Some(slot) = self.busy_since.get(worker as usize) {
            slot.store(since, Ordering::Relaxed);
        }
    }

    /// Why the relay is not healthy, if a worker has been in one cycle for longer than the lease.
    pub fn wedged(&self) -> Option<String> {
        let now = self.epoch.elapsed().as_millis() as u64 + 1;
        self.busy_since.iter().enumerate().find_map(|(worker, since)| {
            let since = since.load(Ordering::Relaxed);
            let stuck = Duration::from_millis(now.saturating_sub(since));
            (since > 0 && stuck > self.limit).then(|| {
                format!(
                    "relay worker {worker} has been in one cycle for {:?}, longer than relay.lease ({:?}); \
                     is the database answering?",
                    Duration::from_secs(stuck.as_secs()),
                    self.limit
                )
            })
        })
    }
}
