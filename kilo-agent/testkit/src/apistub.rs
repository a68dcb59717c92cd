//! A stand-in for the Kubernetes API server's front door, over plain HTTP or TLS with a
//! self-signed certificate: it records every request line with its `Authorization` header and
//! answers lists of Nodes and Peers with empty lists, watches by holding the stream open, and
//! anything else with 404. It exists to test how the real binaries connect (TLS, credentials,
//! error messages); the backend's behaviour is tested elsewhere.
use super::netns::NetNs;
use std::{
    io::{BufRead as _, BufReader, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    os::unix::process::CommandExt as _,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

/// A self-signed certificate (for 127.0.0.1 unless told), and its key (PEM).
pub struct Cert {
    pub pem: String,
    key: String,
}

impl Default for Cert {
    fn default() -> Self {
        Self::new()
    }
}

impl Cert {
    /// A self-signed certificate for 127.0.0.1 and localhost.
    pub fn new() -> Self {
        Self::for_hosts(&["127.0.0.1", "localhost"])
    }

    /// A self-signed certificate for `hosts` (IP addresses or names).
    pub fn for_hosts(hosts: &[&str]) -> Self {
        let hosts = hosts.iter().map(|h| h.to_string()).collect::<Vec<_>>();
        let c = rcgen::generate_simple_self_signed(hosts).expect("self-signed certificate");
        Cert {
            pem: c.cert.pem(),
            key: c.signing_key.serialize_pem(),
        }
    }

    pub fn key_pem(&self) -> &str {
        &self.key
    }
}

/// How the stub answers.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// One node, no peers, held watches, 404 for the rest.
    Lists,
    /// 401 Unauthorized to everything.
    Unauthorized,
}

/// A running stub. Requests are served until the process ends; the TLS front (socat, so that
/// the test build's own TLS stack plays no part on the server side) stops on drop.
pub struct ApiStub {
    pub addr: SocketAddr,
    /// `"METHOD PATH"` and the bearer token (if any) of each request, in arrival order.
    pub requests: Arc<Log>,
    tls: Option<(Child, tempfile::TempDir)>,
}

impl Drop for ApiStub {
    fn drop(&mut self) {
        if let Some((front, _)) = &mut self.tls {
            // SAFETY: signals our own child's process group (socat and its forks).
            unsafe { libc::kill(-(front.id() as i32), libc::SIGTERM) };
            let _ = front.wait();
        }
    }
}

impl ApiStub {
    /// Serves plain HTTP on `listener` (bound by the caller, e.g. inside a network namespace)
    /// and, with `cert`, TLS in front of it on another port of 127.0.0.1, started in network
    /// namespace `netns` (`None`: this one).
    pub fn serve(
        listener: TcpListener,
        cert: Option<&Cert>,
        answer: Answer,
        netns: Option<&NetNs>,
    ) -> Self {
        let plain = listener.local_addr().unwrap();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let log = requests.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let log = log.clone();
                std::thread::spawn(move || handle(conn, &log, answer));
            }
        });
        let Some(cert) = cert else {
            return ApiStub {
                addr: plain,
                requests,
                tls: None,
            };
        };
        let dir = tempfile::tempdir().unwrap();
        let (pem, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        std::fs::write(&pem, &cert.pem).unwrap();
        std::fs::write(&key, &cert.key).unwrap();
        // A free port: the plain listener's port + 1 is not guaranteed free, so ask the kernel
        // through a listener in the same namespace as the front.
        let port = free_port(netns);
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &ns.name, "socat"]);
                c
            }
            None => Command::new("socat"),
        };
        let front = cmd
            .arg(format!(
                "OPENSSL-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork,verify=0,cert={},key={}",
                pem.display(),
                key.display()
            ))
            .arg(format!("TCP:{plain}"))
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("socat (cargo xtask setup installs it)");
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let stub = ApiStub {
            addr,
            requests,
            tls: Some((front, dir)),
        };
        stub.wait_listening(netns);
        stub
    }

    /// Binds 127.0.0.1 on a free port in this network namespace.
    pub fn start(cert: Option<&Cert>, answer: Answer) -> Self {
        Self::serve(
            TcpListener::bind("127.0.0.1:0").unwrap(),
            cert,
            answer,
            None,
        )
    }

    fn wait_listening(&self, netns: Option<&NetNs>) {
        let start = Instant::now();
        let probe = format!("ss -Hltn 'sport = :{}'", self.addr.port());
        let cmd = match netns {
            Some(ns) => format!("ip netns exec {} {probe}", ns.name),
            None => probe,
        };
        while super::netns::try_sh(&cmd).stdout.is_empty() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the TLS front never listened"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// The request lines seen so far.
    pub fn seen(&self) -> Vec<String> {
        self.requests
            .lock()
            .unwrap()
            .iter()
            .map(|(r, _)| r.clone())
            .collect()
    }

    /// A kubeconfig for this server with a bearer token, trusting `ca` (PEM) for TLS.
    pub fn kubeconfig(&self, ca: Option<&Cert>, token: &str) -> String {
        use base64::Engine as _;
        let ca = ca
            .map(|c| {
                format!(
                    "\n    certificate-authority-data: {}",
                    base64::engine::general_purpose::STANDARD.encode(&c.pem)
                )
            })
            .unwrap_or_default();
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: stub\n  cluster:\n    server: {}{ca}\n\
             users:\n- name: stub\n  user:\n    token: {token}\ncontexts:\n- name: stub\n  context:\n    \
             cluster: stub\n    user: stub\ncurrent-context: stub\n",
            self.url()
        )
    }
}

fn free_port(netns: Option<&NetNs>) -> u16 {
    let bind = || {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    match netns {
        Some(ns) => ns.run(bind),
        None => bind(),
    }
}

/// `"METHOD PATH"` and the bearer token of each request.
type Log = Mutex<Vec<(String, Option<String>)>>;

fn handle(stream: TcpStream, log: &Log, answer: Answer) {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    let request: Vec<&str> = line.split_whitespace().collect();
    let (method, target) = (request[0].to_string(), request[1].to_string());
    let (mut length, mut token) = (0usize, None);
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).unwrap_or(0) == 0 || header.trim().is_empty() {
            break;
        }
        let (name, value) = header.split_once(':').unwrap_or((&header, ""));
        match name.to_ascii_lowercase().as_str() {
            "content-length" => length = value.trim().parse().unwrap_or(0),
            "authorization" => token = value.trim().strip_prefix("Bearer ").map(str::to_owned),
            _ => {}
        }
    }
    let mut body = vec![0; length];
    let _ = reader.read_exact(&mut body);
    log.lock()
        .unwrap()
        .push((format!("{method} {target}"), token));
    let path = target.split('?').next().unwrap_or_default();
    let watch = target.contains("watch=true") || target.contains("watch=1");
    let list = |kind: &str, api: &str, items: &str| {
        format!(
            r#"{{"kind":"{kind}","apiVersion":"{api}","metadata":{{"resourceVersion":"1"}},"items":[{items}]}}"#
        )
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let node = format!(
        r#"{{"metadata":{{"name":"a","annotations":{{"kilo.squat.ai/endpoint":"10.1.0.1:51820",
        "kilo.squat.ai/internal-ip":"192.168.0.1/32","kilo.squat.ai/location":"1",
        "kilo.squat.ai/granularity":"location",
        "kilo.squat.ai/key":"a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
        "kilo.squat.ai/last-seen":"{now}"}}}},"spec":{{"podCIDR":"10.2.1.0/24"}}}}"#
    );
    let (status, body) = match answer {
        Answer::Unauthorized => (
            "401 Unauthorized",
            r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"Unauthorized","reason":"Unauthorized","code":401}"#.to_string(),
        ),
        Answer::Lists if method == "GET" && watch => {
            // A watch with nothing to say: headers, then the stream stays open until the
            // client goes away.
            let stream = reader.get_mut();
            let _ = stream.write_all(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
            );
            let _ = stream.flush();
            let mut sink = [0u8; 256];
            while matches!(stream.read(&mut sink), Ok(n) if n > 0) {}
            return;
        }
        Answer::Lists if method == "GET" && path == "/api/v1/nodes" => {
            ("200 OK", list("NodeList", "v1", &node))
        }
        Answer::Lists if method == "GET" && path == "/apis/kilo.squat.ai/v1alpha1/peers" => {
            ("200 OK", list("PeerList", "kilo.squat.ai/v1alpha1", ""))
        }
        Answer::Lists => (
            "404 Not Found",
            r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"not found","reason":"NotFound","code":404}"#.to_string(),
        ),
    };
    let stream = reader.get_mut();
    let _ = write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.flush();
}
