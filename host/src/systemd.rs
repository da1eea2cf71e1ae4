//! systemd's service notifications (`Type=notify`): `READY=1` once `serve` has its routes and
//! admin API up, `WATCHDOG=1` while the relay makes progress (so a wedged ferry is restarted),
//! and `STOPPING=1` when it shuts down. A datagram to the socket systemd names in
//! `NOTIFY_SOCKET`; without that variable (not run by systemd) nothing is sent.

use std::time::Duration;

/// Where notifications go, if anywhere.
#[derive(Debug)]
pub struct Notifier {
    target: Option<Target>,
}

#[derive(Debug)]
enum Target {
    Path(std::path::PathBuf),
    /// A name in Linux's abstract socket namespace (`@name` in `NOTIFY_SOCKET`).
    #[cfg(target_os = "linux")]
    Abstract(Vec<u8>),
}

impl Notifier {
    /// The notifier `NOTIFY_SOCKET` describes.
    pub fn from_env() -> Notifier {
        use std::os::unix::ffi::OsStrExt as _;
        let target = std::env::var_os("NOTIFY_SOCKET").and_then(|socket| {
            let bytes = socket.as_bytes();
            match bytes.split_first() {
                #[cfg(target_os = "linux")]
                Some((b'@', name)) => Some(Target::Abstract(name.to_vec())),
                Some((b'/', _)) => Some(Target::Path(socket.into())),
                _ => None,
            }
        });
        Notifier { target }
    }

    /// Sends `state` (such as `READY=1`); a failure is logged, never fatal: the service runs
    /// whether or not systemd hears it.
    pub fn notify(&self, state: &str) {
        let Some(target) = &self.target else { return };
        if let Err(e) = send(target, state.as_bytes()) {
            tracing::warn!("cannot notify systemd ({state}): {e}");
        }
    }

    /// How often to send `WATCHDOG=1`: half of `WATCHDOG_USEC`, when systemd asks for it (and
    /// `WATCHDOG_PID`, if set, is this process).
    pub fn watchdog_interval(&self) -> Option<Duration> {
        self.target.as_ref()?;
        if let Some(pid) = std::env::var("WATCHDOG_PID").ok().filter(|p| !p.is_empty())
            && pid.parse::<u32>().ok() != Some(std::process::id())
        {
            return None;
        }
        let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok().filter(|u| *u > 0)?;
        Some(Duration::from_micros(usec / 2).max(Duration::from_millis(1)))
    }
}

fn send(target: &Target, message: &[u8]) -> std::io::Result<()> {
    let socket = std::os::unix::net::UnixDatagram::unbound()?;
    // Never wait on systemd: a full queue drops the message (the next watchdog tick follows).
    socket.set_nonblocking(true)?;
    match target {
        Target::Path(path) => socket.send_to(message, path).map(drop),
        #[cfg(target_os = "linux")]
        Target::Abstract(name) => {
            use std::os::linux::net::SocketAddrExt as _;
            let address = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            socket.send_to_addr(message, &address).map(drop)
        }
    }
}
