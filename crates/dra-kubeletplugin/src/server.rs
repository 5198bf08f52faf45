//! Sockets, kubelet registration, the DRA services (v1 and v1beta1) and the
//! health stream, serialization, readiness and shutdown.

use std::collections::HashMap;
use std::future::Future;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use carve_proto::{dra_v1, dra_v1beta1, health_v1alpha1 as hv, registration as reg};
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

use crate::authority::ServerConn;
use crate::driver::{Claim, DraDriver};
use crate::health::HealthService;
use crate::{Error, PluginOptions, SocketPaths};

/// The name of the lock file that serializes calls across the pods of a
/// rolling update, in the plugin data directory (Go's name).
pub const SERIALIZE_LOCK: &str = "serialize.lock";

/// The registration status the kubelet reported.
#[derive(Clone, Debug)]
pub struct Registration {
    rx: watch::Receiver<Option<Result<(), String>>>,
}

impl Registration {
    /// `None` until the kubelet calls `NotifyRegistrationStatus`; then
    /// whether it accepted the plugin (or its error).
    #[must_use]
    pub fn status(&self) -> Option<Result<(), String>> {
        self.rx.borrow().clone()
    }

    /// Wait until the kubelet reported a status.
    ///
    /// # Errors
    /// The kubelet's rejection, or `plugin stopped`.
    pub async fn wait(&mut self) -> Result<(), String> {
        loop {
            if let Some(s) = self.rx.borrow_and_update().clone() {
                return s;
            }
            if self.rx.changed().await.is_err() {
                return Err("plugin stopped".into());
            }
        }
    }
}

/// Why a plugin is not ready.
#[derive(Debug, thiserror::Error)]
pub enum NotReady {
    /// The kubelet has not reported a registration status yet.
    #[error("not registered with the kubelet yet")]
    NotRegistered,
    /// The kubelet rejected the registration.
    #[error("the kubelet rejected the registration: {0}")]
    Rejected(String),
    /// The DRA socket does not accept connections.
    #[error("DRA socket {}: {source}", path.display())]
    Socket {
        /// The socket.
        path: PathBuf,
        /// The connect error.
        #[source]
        source: std::io::Error,
    },
}

/// A readiness probe of a running plugin: registered with the kubelet, and
/// the DRA socket accepts connections.
#[derive(Clone, Debug)]
pub struct Readiness {
    registration: Registration,
    dra: PathBuf,
}

impl Readiness {
    /// Check now.
    ///
    /// # Errors
    /// What is not ready.
    pub async fn check(&self) -> Result<(), NotReady> {
        match self.registration.status() {
            None => return Err(NotReady::NotRegistered),
            Some(Err(e)) => return Err(NotReady::Rejected(e)),
            Some(Ok(())) => {}
        }
        tokio::net::UnixStream::connect(&self.dra)
            .await
            .map(drop)
            .map_err(|source| NotReady::Socket {
                path: self.dra.clone(),
                source,
            })
    }
}

#[derive(Debug)]
struct RegistrationService {
    info: reg::PluginInfo,
    tx: watch::Sender<Option<Result<(), String>>>,
}

#[tonic::async_trait]
impl reg::registration_server::Registration for RegistrationService {
    async fn get_info(
        &self,
        _: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        Ok(Response::new(self.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        r: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let r = r.into_inner();
        if r.plugin_registered {
            tracing::info!("registered with kubelet");
            self.tx.send_replace(Some(Ok(())));
        } else {
            tracing::error!(error = %r.error, "kubelet rejected the registration");
            self.tx.send_replace(Some(Err(r.error)));
        }
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

/// Runs calls one at a time: an in-process lock, and across processes an
/// exclusive `flock(2)` on a lock file.
#[derive(Debug)]
struct Serializer {
    local: tokio::sync::Mutex<()>,
    file: Option<PathBuf>,
}

/// Held while a serialized call runs.
#[derive(Debug)]
struct Turn<'a> {
    _local: tokio::sync::MutexGuard<'a, ()>,
    _file: Option<nix::fcntl::Flock<std::fs::File>>,
}

impl Serializer {
    async fn turn(&self) -> Result<Turn<'_>, Status> {
        let local = self.local.lock().await;
        let Some(path) = self.file.clone() else {
            return Ok(Turn {
                _local: local,
                _file: None,
            });
        };
        let shown = path.display().to_string();
        let file = tokio::task::spawn_blocking(move || {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(&path)?;
            nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
                .map_err(|(_, e)| std::io::Error::from(e))
        })
        .await
        .map_err(|e| Status::internal(format!("locking {shown}: {e}")))?
        .map_err(|e| Status::internal(format!("locking {shown}: {e}")))?;
        Ok(Turn {
            _local: local,
            _file: Some(file),
        })
    }
}

struct DraService<D> {
    driver: Arc<D>,
    serial: Option<Arc<Serializer>>,
}

impl<D> Clone for DraService<D> {
    fn clone(&self) -> Self {
        Self {
            driver: self.driver.clone(),
            serial: self.serial.clone(),
        }
    }
}

impl<D> DraService<D> {
    async fn turn(&self) -> Result<Option<Turn<'_>>, Status> {
        match &self.serial {
            Some(s) => s.turn().await.map(Some),
            None => Ok(None),
        }
    }
}

/// The claims of a request as log lines name them: `ns/name (uid)`, `, `-joined.
fn claim_list(claims: &[Claim]) -> String {
    claims
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Every claim of the request gets exactly one answer: the driver's result
/// for its UID (the first claim of a UID takes it), or an error saying the
/// driver gave none. Results for UIDs not asked about are dropped.
fn answer<R, W>(
    claims: &[Claim],
    mut results: HashMap<String, R>,
    what: &str,
    wire: impl Fn(R) -> W,
    missing: impl Fn(String) -> W,
) -> HashMap<String, W> {
    let mut out = HashMap::with_capacity(claims.len());
    for c in claims {
        if out.contains_key(&c.uid) {
            continue;
        }
        let w = match results.remove(&c.uid) {
            Some(r) => wire(r),
            None => missing(format!(
                "the driver returned no {what} result for claim {c}"
            )),
        };
        out.insert(c.uid.clone(), w);
    }
    if !results.is_empty() {
        let extra: Vec<_> = results.into_keys().collect();
        tracing::warn!(
            ?extra,
            "the driver returned results for claims not asked about"
        );
    }
    out
}

/// The DRA service of one API version: v1 and v1beta1 differ only in their
/// generated types, so one body serves both.
macro_rules! dra_service {
    ($v:ident) => {
        #[tonic::async_trait]
        impl<D: DraDriver> $v::dra_plugin_server::DraPlugin for DraService<D> {
            async fn node_prepare_resources(
                &self,
                r: Request<$v::NodePrepareResourcesRequest>,
            ) -> Result<Response<$v::NodePrepareResourcesResponse>, Status> {
                let claims: Vec<Claim> =
                    r.into_inner().claims.into_iter().map(Claim::from).collect();
                tracing::debug!(claims = %claim_list(&claims), "NodePrepareResources");
                let turn = self.turn().await?;
                let results = self.driver.prepare(claims.clone()).await;
                drop(turn);
                let claims = answer(
                    &claims,
                    results,
                    "prepare",
                    |r| match r {
                        Ok(devs) => $v::NodePrepareResourceResponse {
                            devices: devs.into_iter().map(Into::into).collect(),
                            error: String::new(),
                        },
                        Err(e) => $v::NodePrepareResourceResponse {
                            devices: vec![],
                            error: e.to_string(),
                        },
                    },
                    |error| $v::NodePrepareResourceResponse {
                        devices: vec![],
                        error,
                    },
                );
                Ok(Response::new($v::NodePrepareResourcesResponse { claims }))
            }

            async fn node_unprepare_resources(
                &self,
                r: Request<$v::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$v::NodeUnprepareResourcesResponse>, Status> {
                let claims: Vec<Claim> =
                    r.into_inner().claims.into_iter().map(Claim::from).collect();
                tracing::debug!(claims = %claim_list(&claims), "NodeUnprepareResources");
                let turn = self.turn().await?;
                let results = self.driver.unprepare(claims.clone()).await;
                drop(turn);
                let claims = answer(
                    &claims,
                    results,
                    "unprepare",
                    |r| $v::NodeUnprepareResourceResponse {
                        error: r.err().map(|e| e.to_string()).unwrap_or_default(),
                    },
                    |error| $v::NodeUnprepareResourceResponse { error },
                );
                Ok(Response::new($v::NodeUnprepareResourcesResponse { claims }))
            }
        }
    };
}

dra_service!(dra_v1);
dra_service!(dra_v1beta1);

fn bind(path: &Path) -> Result<UnixListener, Error> {
    let io = |what| {
        move |source| Error::Io {
            what,
            path: path.to_path_buf(),
            source,
        }
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io("creating socket directory"))?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => tracing::info!(path = %path.display(), "removed stale socket"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("removing stale socket")(e)),
    }
    let l = UnixListener::bind(path).map_err(io("binding socket"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(io("setting socket mode"))?;
    Ok(l)
}

/// The connections of a socket, each through [`ServerConn`] so that h2
/// accepts any `:authority` (the kubelet sends the registration socket's path,
/// which h2 alone rejects: see [`crate::authority`]).
fn incoming(
    l: UnixListener,
) -> impl futures::Stream<Item = std::io::Result<ServerConn<tokio::net::UnixStream>>> {
    use futures::TryStreamExt;
    UnixListenerStream::new(l).map_ok(ServerConn::new)
}

/// A running plugin.
#[derive(Debug)]
pub struct Serving {
    /// The sockets it serves.
    pub paths: SocketPaths,
    registration: Registration,
    task: tokio::task::JoinHandle<Result<(), Error>>,
}

impl Serving {
    /// Registration status as the kubelet reports it.
    #[must_use]
    pub fn registration(&self) -> Registration {
        self.registration.clone()
    }

    /// A readiness probe (for a `/readyz` endpoint).
    #[must_use]
    pub fn readiness(&self) -> Readiness {
        Readiness {
            registration: self.registration.clone(),
            dra: self.paths.dra.clone(),
        }
    }

    /// Wait until the plugin has stopped (after the shutdown future
    /// completed): servers stopped, [`DraDriver::stopped`] returned, sockets
    /// removed.
    ///
    /// # Errors
    /// Server failures.
    pub async fn wait(self) -> Result<(), Error> {
        self.task.await.map_err(|e| Error::Task {
            what: "gRPC server",
            reason: e.to_string(),
        })?
    }
}

/// Serve `driver` to the kubelet until `shutdown` completes.
///
/// Binds the DRA socket first, then the registration socket (so the kubelet
/// never sees an endpoint that is not listening), each replacing a stale
/// socket of the same path and made mode 0600. `GetInfo` answers `DRAPlugin`,
/// the driver name, the DRA socket's absolute path and the versions served:
/// `v1.DRAPlugin`, `v1beta1.DRAPlugin` (unless turned off), and
/// `v1alpha1.DRAResourceHealth` when [`DraDriver::health`] gives a watch.
/// When this returns, both sockets accept connections.
///
/// At shutdown the servers stop (health streams end), [`DraDriver::stopped`]
/// runs, and the plugin removes its own two sockets, registration first so
/// the kubelet stops using it.
///
/// # Errors
/// Invalid options or socket setup; nothing is left bound.
pub async fn serve<D: DraDriver>(
    driver: Arc<D>,
    options: PluginOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Serving, Error> {
    let paths = SocketPaths::new(&options)?;
    let serial = serializer(&options);
    let health = driver.health();
    let dra_listener = bind(&paths.dra)?;
    let (tx, rx) = watch::channel(None);
    let reg_service = RegistrationService {
        info: plugin_info(&options, &paths, health.is_some()),
        tx,
    };
    let reg_listener = match bind(&paths.registration) {
        Ok(l) => l,
        Err(e) => {
            let _ = std::fs::remove_file(&paths.dra);
            return Err(e);
        }
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = move |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let svc = DraService {
        driver: driver.clone(),
        serial,
    };
    let health = health.map(|watch| {
        hv::dra_resource_health_server::DraResourceHealthServer::new(HealthService {
            watch,
            resend: options.health_resend,
            stop: stop_rx.clone(),
        })
    });
    let v1beta1 = options
        .v1beta1
        .then(|| dra_v1beta1::dra_plugin_server::DraPluginServer::new(svc.clone()));
    let dra = tonic::transport::Server::builder()
        .add_service(dra_v1::dra_plugin_server::DraPluginServer::new(svc))
        .add_optional_service(v1beta1)
        .add_optional_service(health)
        .serve_with_incoming_shutdown(incoming(dra_listener), stopped(stop_rx.clone()));
    let regs = tonic::transport::Server::builder()
        .add_service(reg::registration_server::RegistrationServer::new(
            reg_service,
        ))
        .serve_with_incoming_shutdown(incoming(reg_listener), stopped(stop_rx));
    let sd = async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    };
    let task = tokio::spawn(serve_until_stopped(driver, paths.clone(), dra, regs, sd));
    Ok(Serving {
        paths,
        registration: Registration { rx },
        task,
    })
}

/// Prepare and unprepare calls one at a time where
/// [`PluginOptions::serialize`] asks for it: an in-process lock, and with a
/// rolling-update UID also a lock file the two pods take turns on.
fn serializer(options: &PluginOptions) -> Option<Arc<Serializer>> {
    options.serialize.then(|| {
        Arc::new(Serializer {
            local: tokio::sync::Mutex::new(()),
            file: options
                .rolling_update_uid
                .as_ref()
                .map(|_| options.plugin_data_dir.join(SERIALIZE_LOCK)),
        })
    })
}

/// What the registration service tells the kubelet: a DRA plugin of this
/// driver at the DRA socket, with the API versions served (the health
/// service's where `health`).
fn plugin_info(options: &PluginOptions, paths: &SocketPaths, health: bool) -> reg::PluginInfo {
    reg::PluginInfo {
        r#type: reg::DRA_PLUGIN_TYPE.into(),
        name: options.driver_name.clone(),
        endpoint: std::path::absolute(&paths.dra)
            .unwrap_or_else(|_| paths.dra.clone())
            .to_string_lossy()
            .into_owned(),
        supported_versions: std::iter::once(dra_v1::VERSION)
            .chain(options.v1beta1.then_some(dra_v1beta1::VERSION))
            .chain(health.then_some(hv::VERSION))
            .map(String::from)
            .collect(),
    }
}

/// The two servers until `shutdown` (which stops them) completes and they
/// end; then the driver's [`DraDriver::stopped`], and the plugin's own
/// sockets removed, registration first so the kubelet stops using it.
async fn serve_until_stopped<D: DraDriver>(
    driver: Arc<D>,
    p: SocketPaths,
    dra: impl Future<Output = Result<(), tonic::transport::Error>>,
    regs: impl Future<Output = Result<(), tonic::transport::Error>>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    let (r1, r2, ()) = tokio::join!(dra, regs, shutdown);
    driver.stopped().await;
    // Own sockets only: registration first so the kubelet stops using us.
    let _ = std::fs::remove_file(&p.registration);
    let _ = std::fs::remove_file(&p.dra);
    r1.map_err(|source| Error::Serve {
        socket: p.dra.clone(),
        source,
    })?;
    r2.map_err(|source| Error::Serve {
        socket: p.registration.clone(),
        source,
    })?;
    tracing::info!("plugin stopped");
    Ok(())
}
