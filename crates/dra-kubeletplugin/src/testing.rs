//! Test support (feature `testing`): clients that dial the plugin's sockets
//! the way the kubelet does.
//!
//! - [`registration_channel`]: a tonic channel whose requests carry the
//!   registration socket's path, percent-encoded, as `:authority`, as the
//!   kubelet's plugin watcher (grpc-go, bare socket path as target) sends it;
//! - [`uds_channel`]: as the kubelet dials `dra.sock` (`unix:<path>`, so
//!   `:authority` is `localhost`);
//! - [`grpcio_calls`]: unary calls through the real gRPC C-core (Python
//!   `grpcio`) with any `:authority`, for tests that must not depend on a
//!   client written alongside the server.
//!
//! The facts: the kubelet's `pluginmanager/operationexecutor/operation_generator.go`
//! (dial without `WithAuthority`) and grpc-go's `encodeAuthority`
//! (`clientconn.go`).

use std::path::{Path, PathBuf};
use std::process::Stdio;

use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt as _;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::authority::ClientConn;

/// A socket did not take a connection.
#[derive(Debug, thiserror::Error)]
#[error("connecting to {}: {source}", path.display())]
pub struct ConnectError {
    /// The socket.
    pub path: PathBuf,
    /// The error.
    #[source]
    pub source: tonic::transport::Error,
}

/// The `:authority` grpc-go sends for a target that is a bare socket path, as
/// the kubelet's plugin watcher dials `<name>-reg.sock`: the path
/// percent-encoded by grpc-go's `encodeAuthority` (`clientconn.go`: RFC 3986
/// §3.2 unreserved characters, sub-delims and `:[]@` kept, every other byte
/// `%XX`), e.g. `%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.carve.dev-reg.sock`.
#[must_use]
pub fn grpc_go_authority(path: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    path.as_os_str()
        .as_bytes()
        .iter()
        .map(|&b| {
            if b.is_ascii_alphanumeric() || b"-_.~!$&'()*+,;=:[]@".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// The two `:authority` values grpc-go sends when dialed with a bare path:
/// percent-encoded (current grpc-go) and raw (older grpc-go).
#[must_use]
pub fn kubelet_registration_authorities(socket: &Path) -> [String; 2] {
    [
        grpc_go_authority(socket),
        socket.to_string_lossy().into_owned(),
    ]
}

trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> Io for T {}

async fn connect(path: &Path, authority: Option<String>) -> Result<Channel, ConnectError> {
    let p = path.to_path_buf();
    let err = |source| ConnectError {
        path: path.to_path_buf(),
        source,
    };
    // grpc-go's `unix:` targets send `localhost`; tonic sends the origin's.
    Endpoint::try_from("http://localhost")
        .map_err(err)?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = p.clone();
            let authority = authority.clone();
            async move {
                let s = tokio::net::UnixStream::connect(p).await?;
                let io: Box<dyn Io> = match authority {
                    Some(a) => Box::new(ClientConn::new(s, &a)),
                    None => Box::new(s),
                };
                Ok::<_, std::io::Error>(TokioIo::new(io))
            }
        }))
        .await
        .map_err(err)
}

/// Connect a tonic channel to a Unix socket as the kubelet dials `dra.sock`
/// (`unix:<path>`, so `:authority` is `localhost`).
///
/// # Errors
/// The socket does not accept connections.
pub async fn uds_channel(path: &Path) -> Result<Channel, ConnectError> {
    connect(path, None).await
}

/// Connect a tonic channel to a registration socket as the kubelet's plugin
/// watcher dials it: every request carries [`grpc_go_authority`] of the path
/// as `:authority` (written into the HTTP/2 HEADERS by a connection wrapper,
/// since tonic only sends authorities that `http::Uri` parses). A server that
/// h2 alone serves rejects these requests, as it rejects the kubelet's.
///
/// # Errors
/// The socket does not accept connections.
pub async fn registration_channel(path: &Path) -> Result<Channel, ConnectError> {
    connect(path, Some(grpc_go_authority(path))).await
}

/// The Python side of [`grpcio_calls`].
const GRPCIO_DIAL: &str = include_str!("kubelet_dial.py");

/// Whether `python3 -c 'import grpc'` works. Under `CI=true` a missing
/// grpcio is a failure (this panics); elsewhere it prints why the caller's
/// test skips.
///
/// # Panics
/// Under `CI=true` when grpcio is missing.
#[must_use]
pub fn have_grpcio() -> bool {
    let ok = std::process::Command::new("python3")
        .args(["-c", "import grpc"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true but python3 cannot import grpc: `pip install grpcio`"
        );
        eprintln!("SKIP: python3 with grpcio not found (pip install grpcio)");
    }
    ok
}

/// One call's outcome through grpcio.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GrpcioReply {
    /// The serialized response.
    Ok(Vec<u8>),
    /// A gRPC error: the status code's name (`INTERNAL`, ...) and details.
    Failed {
        /// Status code name.
        code: String,
        /// Details.
        details: String,
    },
}

/// The grpcio helper could not run or answered nonsense.
#[derive(Debug, thiserror::Error)]
pub enum GrpcioError {
    /// `python3` could not be run or fed.
    #[error("running python3: {0}")]
    Spawn(#[from] std::io::Error),
    /// The helper failed.
    #[error("the grpcio helper failed: {stderr}")]
    Failed {
        /// Its stderr.
        stderr: String,
    },
    /// Its output is not what it writes.
    #[error("the grpcio helper's output: {0}")]
    Output(String),
}

fn unhex(h: &str) -> Result<Vec<u8>, GrpcioError> {
    if !h.len().is_multiple_of(2) {
        return Err(GrpcioError::Output(format!("odd hex length {}", h.len())));
    }
    (0..h.len())
        .step_by(2)
        .map(|i| {
            h.get(i..i + 2)
                .and_then(|b| u8::from_str_radix(b, 16).ok())
                .ok_or_else(|| GrpcioError::Output(format!("bad hex at {i}")))
        })
        .collect()
}

/// Dial `socket` once with Python `grpcio` (gRPC C-core), sending `authority`
/// as `:authority` (`grpc.default_authority`), and make `calls` (method path,
/// serialized request) in order on that one connection, as the kubelet makes
/// its calls on one connection. Each call has a 20 s timeout.
///
/// # Errors
/// The helper did not run (see [`have_grpcio`]) or failed.
pub async fn grpcio_calls(
    socket: &Path,
    authority: &str,
    calls: &[(&str, Vec<u8>)],
) -> Result<Vec<GrpcioReply>, GrpcioError> {
    let job = serde_json::json!({
        "socket": socket,
        "authority": authority,
        "calls": calls.iter().map(|(m, r)| serde_json::json!({
            "method": m,
            "request": r.iter().map(|b| format!("{b:02x}")).collect::<String>(),
            // The kubelet's GetInfo timeout is 1 s; a loaded CI machine gets more.
            "timeout": 20,
        })).collect::<Vec<_>>(),
    });
    let mut child = tokio::process::Command::new("python3")
        .args(["-c", GRPCIO_DIAL])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut stdin = child
        .stdin
        .take()
        .ok_or_else(|| GrpcioError::Output("no stdin".into()))?;
    stdin.write_all(job.to_string().as_bytes()).await?;
    drop(stdin);
    let out = child.wait_with_output().await?;
    if !out.status.success() {
        return Err(GrpcioError::Failed {
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    let v: Vec<serde_json::Value> =
        serde_json::from_slice(&out.stdout).map_err(|e| GrpcioError::Output(e.to_string()))?;
    v.into_iter()
        .map(|r| {
            if let Some(h) = r.get("ok").and_then(serde_json::Value::as_str) {
                return unhex(h).map(GrpcioReply::Ok);
            }
            let field = |k: &str| {
                r.get(k)
                    .and_then(serde_json::Value::as_str)
                    .map(String::from)
                    .ok_or_else(|| GrpcioError::Output(format!("{r}: no {k:?}")))
            };
            Ok(GrpcioReply::Failed {
                code: field("code")?,
                details: field("details")?,
            })
        })
        .collect()
}

/// A plain tonic server on a Unix socket (`<dir>/plain-reg.sock`) serving a
/// registration service without the kit's `:authority` adapter: the control
/// that shows a client really sends what h2 rejects (a plain tonic server
/// resets the kubelet's registration dial). Dropping or sending on the
/// returned sender stops it.
///
/// # Panics
/// The socket cannot be bound.
pub async fn plain_tonic_registration(dir: &Path) -> (PathBuf, tokio::sync::oneshot::Sender<()>) {
    use carve_proto::registration as reg;
    use reg::registration_server::{Registration, RegistrationServer};
    #[derive(Debug)]
    struct Svc;
    #[tonic::async_trait]
    impl Registration for Svc {
        async fn get_info(
            &self,
            _: tonic::Request<reg::InfoRequest>,
        ) -> Result<tonic::Response<reg::PluginInfo>, tonic::Status> {
            Ok(tonic::Response::new(reg::PluginInfo {
                r#type: "DRAPlugin".into(),
                name: "gpu.carve.dev".into(),
                endpoint: "/nonexistent/dra.sock".into(),
                supported_versions: vec!["v1.DRAPlugin".into()],
            }))
        }
        async fn notify_registration_status(
            &self,
            _: tonic::Request<reg::RegistrationStatus>,
        ) -> Result<tonic::Response<reg::RegistrationStatusResponse>, tonic::Status> {
            Ok(tonic::Response::new(reg::RegistrationStatusResponse {}))
        }
    }
    let path = dir.join("plain-reg.sock");
    let l = tokio::net::UnixListener::bind(&path).unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(Svc))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::UnixListenerStream::new(l),
                async move {
                    let _ = rx.await;
                },
            ),
    );
    (path, tx)
}
