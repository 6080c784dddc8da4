//! The Prometheus scrape endpoint (`metrics.listen`): `GET /metrics` over plain HTTP/1.x, the
//! the service's values refreshed at each scrape.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::service::Service;

/// Why the metrics endpoint could not start.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("metrics.listen {addr}: {source}{hint}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
        hint: &'static str,
    },
}

/// Binds the scrape endpoint. Under the shipped unit (RestrictAddressFamilies=AF_UNIX) TCP is
/// refused; the error then names the drop-in that allows it.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, MetricsError> {
    TcpListener::bind(addr).await.map_err(|source| {
        let hint = if source.raw_os_error() == Some(libc::EAFNOSUPPORT) {
            " (the systemd unit allows only AF_UNIX: install configs/systemd/tierd.service.d/metrics.conf)"
        } else {
            ""
        };
        MetricsError::Bind { addr, source, hint }
    })
}

/// Largest request head read from a scraper.
const MAX_REQUEST: usize = 8 << 10;
/// A scraper that sends nothing for this long is dropped.
const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Histogram buckets are drained this often between scrapes, so memory stays bounded.
const UPKEEP: Duration = Duration::from_secs(5);

/// Serves `GET /metrics` (HTTP/1.x, one request per connection) until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    service: Arc<Service>,
    shutdown: impl Future<Output = ()>,
) {
    let Some(handle) = service.metrics().handle() else {
        return;
    };
    tokio::pin!(shutdown);
    let mut upkeep = tokio::time::interval(UPKEEP);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = upkeep.tick() => handle.run_upkeep(),
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let service = service.clone();
                    tokio::spawn(async move {
                        if let Err(e) = scrape(stream, &service).await {
                            tracing::debug!(error = %e, "metrics request failed");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "metrics accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
        }
    }
}

async fn scrape(mut stream: TcpStream, service: &Service) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        if buf.len() >= MAX_REQUEST {
            return respond(&mut stream, "431 Request Header Fields Too Large", "").await;
        }
        let mut chunk = [0u8; 1024];
        let n = tokio::time::timeout(READ_TIMEOUT, stream.read(&mut chunk))
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]);
    let mut parts = head.lines().next().unwrap_or("").split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET", "/metrics") => respond(&mut stream, "200 OK", &service.render_metrics()).await,
        ("GET", _) => respond(&mut stream, "404 Not Found", "try /metrics\n").await,
        _ => respond(&mut stream, "405 Method Not Allowed", "").await,
    }
}

async fn respond(stream: &mut TcpStream, status: &str, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}
