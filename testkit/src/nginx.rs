//! Debian's nginx as an HTTP receiver for benchmarks: a fast keep-alive HTTP/1.1 server in its own
//! process, independent of ferry, that answers every request 204 without keeping anything. The
//! test receiver ([`crate::Receiver`]) records what it gets, so it is the one to check deliveries
//! with; this one measures what sending costs when the receiver costs little.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One nginx master with one worker, on a free port of 127.0.0.1, stopped when dropped.
pub struct Nginx {
    pub addr: SocketAddr,
    process: Child,
    _dir: tempfile::TempDir,
}

/// Where Debian installs it; `scripts/bench` installs the package when it is missing.
fn binary() -> &'static str {
    if std::path::Path::new("/usr/sbin/nginx").exists() { "/usr/sbin/nginx" } else { "nginx" }
}

impl Nginx {
    pub fn start() -> Nginx {
        let dir = tempfile::tempdir().expect("nginx directory");
        let port = crate::broker::free_port();
        let prefix = dir.path().display();
        // Bodies are discarded; a connection serves requests until the client closes it, as a
        // webhook receiver behind a load balancer would.
        let config = format!(
            "daemon off;\nworker_processes 1;\npid {prefix}/nginx.pid;\nerror_log {prefix}/error.log warn;\n\
             events {{ worker_connections 1024; }}\n\
             http {{\n  access_log off;\n  keepalive_requests 10000000;\n  keepalive_timeout 300s;\n\
               client_body_buffer_size 64k;\n  client_body_temp_path {prefix}/body;\n\
               proxy_temp_path {prefix}/proxy;\n  fastcgi_temp_path {prefix}/fastcgi;\n\
               uwsgi_temp_path {prefix}/uwsgi;\n  scgi_temp_path {prefix}/scgi;\n\
               server {{\n    listen 127.0.0.1:{port};\n    location / {{ return 204; }}\n  }}\n}}\n"
        );
        let file = dir.path().join("nginx.conf");
        std::fs::write(&file, config).expect("write nginx.conf");
        let process = Command::new(binary())
            .args(["-e", &format!("{prefix}/error.log"), "-p"])
            .arg(dir.path())
            .arg("-c")
            .arg(&file)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nginx runs (Debian: apt-get install nginx; scripts/bench installs it)");
        let log_file = dir.path().join("error.log");
        let log = || std::fs::read_to_string(&log_file).unwrap_or_default();
        // Built before waiting, so a failed start still stops the process when the panic drops it.
        let mut nginx = Nginx { addr: ([127, 0, 0, 1], port).into(), process, _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(nginx.addr).is_err() {
            if let Ok(Some(status)) = nginx.process.try_wait() {
                panic!("nginx exited ({status}) instead of listening on {}; its log: {}", nginx.addr, log());
            }
            assert!(
                Instant::now() < deadline,
                "nginx did not listen on {} within 30 s; its log: {}",
                nginx.addr,
                log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        nginx
    }

    /// The CPU time nginx's worker has used since it started, from Linux's
    /// `/proc/PID/schedstat` (nanoseconds on a CPU, counted by the scheduler). Read before and
    /// after a run, it is what the receiver alone cost: CPU that a sender on the same cores does
    /// not have, whatever the sender.
    pub fn worker_cpu(&self) -> Duration {
        let master = self.process.id();
        let children = std::fs::read_to_string(format!("/proc/{master}/task/{master}/children"))
            .expect("nginx's workers listed in /proc (Linux)");
        let nanos = children
            .split_whitespace()
            .map(|pid| {
                let stat = std::fs::read_to_string(format!("/proc/{pid}/schedstat")).expect("a worker's schedstat");
                stat.split_whitespace().next().and_then(|n| n.parse::<u64>().ok()).expect("schedstat's first field")
            })
            .sum();
        Duration::from_nanos(nanos)
    }

    /// `http://<addr><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // The master stops its worker on SIGTERM ("fast shutdown"); a kill would leave the worker.
        // Only while it runs: once reaped, its pid may be another process's.
        if matches!(self.process.try_wait(), Ok(None)) {
            let _ = Command::new("kill").arg(self.process.id().to_string()).status();
        }
        let _ = self.process.wait();
    }
}
