//! The one HTTP/1.1 server (hyper) behind kg's `/metrics`, `/health`, `/ready` and `/graph`
//! ([`crate::telemetry`]) and behind `kg webhook` ([`crate::webhook`]): binding ([`bind`]), an
//! accept loop that waits while accepting fails ([`serve`]) and one hyper connection per client.
use std::{convert::Infallible, net::SocketAddr, time::Duration};

use backon::BackoffBuilder as _;
use http_body_util::Full;
use hyper::{
    Request, Response, StatusCode,
    body::{Bytes, Incoming},
    service::service_fn,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::{TcpListener, TcpStream},
};

/// A response body: the whole text at once.
pub type Body = Full<Bytes>;

/// How long a client may take to send a request's head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
#[error("listening on {addr}: {source}")]
pub struct ServeError {
    addr: SocketAddr,
    source: std::io::Error,
}

/// A listening socket on `addr`. The unspecified IPv6 address (`[::]`, Go's `:PORT`) is made
/// dual-stack explicitly, so IPv4 clients reach it whatever `net.ipv6.bindv6only` says, and falls
/// back to `0.0.0.0` only where the kernel has no IPv6: any other error (the port in use) is
/// reported, not hidden behind an IPv4-only socket. Call within a Tokio runtime.
pub fn bind(addr: SocketAddr) -> Result<TcpListener, ServeError> {
    listen(addr).map_err(|source| ServeError { addr, source })
}

fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let dual = addr.is_ipv6() && addr.ip().is_unspecified();
    let socket = match Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP)) {
        Err(e) if dual && e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {
            return listen(SocketAddr::from(([0, 0, 0, 0], addr.port())));
        }
        s => s?,
    };
    if dual {
        socket.set_only_v6(false)?;
    }
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    socket.set_nonblocking(true)?;
    TcpListener::from_std(socket.into())
}

/// A response of `status` with a `Content-Type`.
pub fn response(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(hyper::header::CONTENT_TYPE, content_type)
        .body(Full::new(body.into()))
        .expect("a valid response")
}

/// A connection as accepted: plain HTTP (for [`serve`]'s `wrap`).
pub async fn plain(stream: TcpStream) -> std::io::Result<TcpStream> {
    Ok(stream)
}

/// Serves HTTP/1.1 on `listener` until the task is dropped: each connection goes through `wrap`
/// (a TLS handshake, or [`plain`]), then each of its requests to `handle`. Headers are written
/// in title case (`Content-Type`), as Go's server writes them.
pub async fn serve<W, WF, S, H, HF>(listener: TcpListener, wrap: W, handle: H)
where
    W: Fn(TcpStream) -> WF + Clone + Send + 'static,
    WF: Future<Output = std::io::Result<S>> + Send,
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<Incoming>) -> HF + Clone + Send + Sync + 'static,
    HF: Future<Output = Response<Body>> + Send + 'static,
{
    let connection = |stream, from: SocketAddr| {
        let (wrap, handle) = (wrap.clone(), handle.clone());
        tokio::spawn(async move {
            let stream = match wrap(stream).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(%from, error = %e, "connection set-up failed");
                    return;
                }
            };
            let service = service_fn(move |req| {
                let answer = handle(req);
                async move { Ok::<_, Infallible>(answer.await) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .title_case_headers(true)
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%from, error = %e, "connection ended");
            }
        });
    };
    accept_loop(|| listener.accept(), connection).await;
}

/// The pauses after failed accepts in a row: 5 ms, doubling to 1 s (as Go's `net/http` waits).
fn accept_pauses() -> impl Iterator<Item = Duration> {
    backon::ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(5))
        .with_max_delay(Duration::from_secs(1))
        .without_max_times()
        .build()
}

/// Accepts connections for ever, handing each to `connection`. While accepting fails (out of
/// file descriptors, say: the pending connection stays queued, so an immediate retry fails
/// again) it waits [`accept_pauses`] instead of spinning, and logs the first failure of each
/// run and the recovery.
async fn accept_loop<S, F>(mut accept: impl FnMut() -> F, mut connection: impl FnMut(S, SocketAddr))
where
    F: Future<Output = std::io::Result<(S, SocketAddr)>>,
{
    let mut pauses = None;
    loop {
        match accept().await {
            Ok((stream, from)) => {
                if pauses.take().is_some() {
                    tracing::info!("accepting connections again");
                }
                connection(stream, from);
            }
            Err(e) => {
                let pause = pauses
                    .get_or_insert_with(|| {
                        tracing::warn!(error = %e, "accepting a connection failed; retrying");
                        accept_pauses()
                    })
                    .next()
                    .unwrap_or(Duration::from_secs(1));
                tokio::time::sleep(pause).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    #[tokio::test]
    async fn a_failing_accept_waits_instead_of_spinning() {
        let calls = Cell::new(0u32);
        let accept = || {
            calls.set(calls.get() + 1);
            async {
                // An accept that fails at once, as at the file descriptor limit.
                tokio::task::yield_now().await;
                Err::<((), SocketAddr), _>(std::io::Error::from_raw_os_error(libc::EMFILE))
            }
        };
        let run = accept_loop(accept, |(), _| unreachable!("no connection"));
        assert!(
            tokio::time::timeout(Duration::from_millis(300), run)
                .await
                .is_err()
        );
        // 5 + 10 + 20 + 40 + 80 ms, then 160: at most 7 attempts in 300 ms.
        assert!((2..=7).contains(&calls.get()), "{} accepts", calls.get());
    }

    #[test]
    fn pauses_double_up_to_a_second_and_never_stop() {
        let pauses: Vec<u64> = accept_pauses()
            .take(10)
            .map(|d| (d.as_secs_f64() * 1000.0).round() as u64)
            .collect();
        assert_eq!(pauses, [5, 10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
    }
}
