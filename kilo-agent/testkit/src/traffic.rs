//! Traffic that runs for the length of a fault: a continuous ping (busybox, one echo every
//! 100 ms) and a TCP echo stream, both between namespaces, each reporting what it lost.
use std::{
    io::{Read as _, Write as _},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use super::netns::run_in;

/// The ping's interval.
pub const PING_INTERVAL: Duration = Duration::from_millis(100);

/// `busybox ping -i 0.1` from one namespace to an address, until [`Ping::stop`].
pub struct Ping {
    child: Child,
    out: PathBuf,
    _dir: tempfile::TempDir,
}

/// What a [`Ping`] saw: echoes sent, the sequence numbers answered.
#[derive(Debug, Clone)]
pub struct PingResult {
    pub sent: u64,
    pub replies: Vec<u64>,
}

impl PingResult {
    pub fn lost(&self) -> u64 {
        self.sent.saturating_sub(self.replies.len() as u64)
    }

    /// The longest run of unanswered echoes, as time (runs × the interval): the outage.
    pub fn longest_gap(&self) -> Duration {
        let mut answered = vec![false; self.sent as usize];
        for &s in &self.replies {
            if let Some(a) = answered.get_mut(s as usize) {
                *a = true;
            }
        }
        let (mut run, mut longest) = (0u32, 0u32);
        for a in answered {
            run = if a { 0 } else { run + 1 };
            longest = longest.max(run);
        }
        PING_INTERVAL * longest
    }

    /// The longest run of unanswered echoes that began between `from` and `to` after the start
    /// (echo `n` is sent `n` intervals after it), as time.
    pub fn longest_gap_within(&self, from: Duration, to: Duration) -> Duration {
        let answered: std::collections::BTreeSet<u64> = self.replies.iter().copied().collect();
        let (mut longest, mut run, mut began) = (0u32, 0u32, 0u64);
        for seq in 0..self.sent {
            if answered.contains(&seq) {
                run = 0;
                continue;
            }
            if run == 0 {
                began = seq;
            }
            run += 1;
            let at = PING_INTERVAL * began as u32;
            if at >= from && at < to {
                longest = longest.max(run);
            }
        }
        PING_INTERVAL * longest
    }

    /// `lost/sent`, as the reliability table shows it.
    pub fn summary(&self) -> String {
        format!("{}/{}", self.lost(), self.sent)
    }

    /// Parses busybox ping's output. The last echo, unanswered, was in flight at SIGINT and
    /// is not counted; a run of unanswered echoes at the end is.
    pub fn parse(text: &str) -> Option<PingResult> {
        let sent: u64 = text
            .lines()
            .find_map(|l| l.split(" packets transmitted").next()?.parse().ok())?;
        let replies: Vec<u64> = text
            .lines()
            .filter_map(|l| l.split("seq=").nth(1)?.split(' ').next()?.parse().ok())
            .collect();
        let answered = replies.iter().max().map_or(0, |&s| s + 1);
        let sent = if sent == answered + 1 { answered } else { sent };
        Some(PingResult { sent, replies })
    }
}

impl Ping {
    /// Starts pinging `to` from namespace `ns` (a full name).
    pub fn start(ns: &str, to: &str) -> Ping {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("ping.out");
        let child = Command::new("ip")
            .args([
                "netns", "exec", ns, "busybox", "ping", "-i", "0.1", "-W", "1",
            ])
            .arg(to)
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(Stdio::null())
            .spawn()
            .expect("start busybox ping");
        Ping {
            child,
            out,
            _dir: dir,
        }
    }

    /// SIGINT (ping prints its summary), then what it saw.
    pub fn stop(mut self) -> PingResult {
        // SAFETY: a signal to our own child (`ip netns exec` execs busybox).
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let _ = self.child.wait();
        let text = std::fs::read_to_string(&self.out).unwrap();
        PingResult::parse(&text).unwrap_or_else(|| panic!("no summary from ping:\n{text}"))
    }
}

impl Drop for Ping {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP connection from one namespace to an echo server in another, carrying a numbered
/// 64-byte message every 10 ms and checking every echo, until [`Stream::stop`].
pub struct Stream {
    stop: Arc<AtomicBool>,
    echoed: Arc<AtomicU64>,
    client: JoinHandle<Result<u64, String>>,
    server: JoinHandle<()>,
}

const MESSAGE: usize = 64;

impl Stream {
    /// An echo server on `server_ns` at `addr`, and a client in `client_ns` connected to it.
    pub fn start(server_ns: &str, client_ns: &str, addr: SocketAddr) -> Stream {
        let listener = run_in(server_ns, || {
            TcpListener::bind(addr).expect("bind the echo")
        });
        let server = std::thread::spawn(move || {
            let Ok((mut c, _)) = listener.accept() else {
                return;
            };
            let mut buf = [0u8; 4096];
            while let Ok(n) = c.read(&mut buf) {
                if n == 0 || c.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        });
        let conn = run_in(client_ns, || {
            TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        })
        .expect("connect to the echo");
        let stop = Arc::new(AtomicBool::new(false));
        let echoed = Arc::new(AtomicU64::new(0));
        let client = {
            let (stop, echoed) = (stop.clone(), echoed.clone());
            std::thread::spawn(move || run_client(conn, stop, &echoed))
        };
        Stream {
            stop,
            echoed,
            client,
            server,
        }
    }

    /// Messages echoed so far.
    pub fn echoed(&self) -> u64 {
        self.echoed.load(Ordering::Relaxed)
    }

    /// Stops sending, waits for the last echoes: the messages echoed, or what broke.
    pub fn stop(self) -> Result<u64, String> {
        self.stop.store(true, Ordering::Relaxed);
        let r = self.client.join().expect("stream client panicked");
        let _ = self.server.join();
        r
    }
}

fn run_client(conn: TcpStream, stop: Arc<AtomicBool>, echoed: &AtomicU64) -> Result<u64, String> {
    // A stall longer than this is a broken stream (TCP retransmits well within it).
    conn.set_read_timeout(Some(Duration::from_secs(20)))
        .map_err(|e| e.to_string())?;
    let mut reader = conn.try_clone().map_err(|e| e.to_string())?;
    let writer = std::thread::spawn({
        let mut conn = conn;
        move || -> Result<u64, String> {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let mut m = [0u8; MESSAGE];
                m[..8].copy_from_slice(&n.to_be_bytes());
                conn.write_all(&m).map_err(|e| format!("write #{n}: {e}"))?;
                n += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            conn.shutdown(Shutdown::Write).map_err(|e| e.to_string())?;
            Ok(n)
        }
    });
    let mut next = 0u64;
    let mut m = [0u8; MESSAGE];
    let read = loop {
        match reader.read_exact(&mut m) {
            Ok(()) => {
                let got = u64::from_be_bytes(m[..8].try_into().unwrap());
                if got != next {
                    break Err(format!("echo #{got} where #{next} was due"));
                }
                next += 1;
                echoed.store(next, Ordering::Relaxed);
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break Ok(next),
            Err(e) => break Err(format!("read after #{next}: {e}")),
        }
    };
    let sent = writer.join().expect("stream writer panicked")?;
    let read = read?;
    if read != sent {
        return Err(format!("{sent} sent, {read} echoed"));
    }
    Ok(read)
}

#[cfg(test)]
mod tests {
    use super::PingResult;

    fn output(answered: &[u64], sent: u64) -> String {
        let mut text = String::from("PING 10.2.2.2 (10.2.2.2): 56 data bytes\n");
        for s in answered {
            text += &format!("64 bytes from 10.2.2.2: seq={s} ttl=62 time=0.512 ms\n");
        }
        text + &format!(
            "\n--- 10.2.2.2 ping statistics ---\n{sent} packets transmitted, {} packets received, 0% packet loss\n",
            answered.len()
        )
    }

    #[test]
    fn the_echo_in_flight_at_the_end_is_not_a_loss() {
        let r = PingResult::parse(&output(&[0, 1, 2], 4)).unwrap();
        assert_eq!((r.sent, r.lost()), (3, 0));
        // Two unanswered at the end, or one in the middle: losses.
        let r = PingResult::parse(&output(&[0, 1], 4)).unwrap();
        assert_eq!((r.sent, r.lost()), (4, 2));
        let r = PingResult::parse(&output(&[0, 2, 3], 4)).unwrap();
        assert_eq!((r.sent, r.lost()), (4, 1));
        assert!(PingResult::parse("ping: sendto: Network unreachable").is_none());
    }
}
