//! Sockets, kubelet registration and the gRPC services (DRA plugin v1 and
//! v1beta1, and the DRA resource health stream when a monitor is attached).

use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use carve_gpu::GpuBackend;
use carve_model::health::HealthStatus;
use carve_proto::{dra_v1, dra_v1beta1, health_v1alpha1 as hv, registration as reg};
use sha2::{Digest, Sha256};
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

use crate::authority::ServerConn;
use crate::claim::ClaimRef;
use crate::config::PluginConfig;
use crate::driver::Driver;
use crate::error::PluginError;
use crate::health::{HealthHandle, HealthSnapshot};

/// Longest path `sockaddr_un` takes (108 bytes including the NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Where the plugin's two sockets live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SocketPaths {
    /// Registration socket (in the plugins registry dir).
    pub registration: PathBuf,
    /// DRA service socket (`PluginInfo.endpoint`).
    pub dra: PathBuf,
}

fn short_hash(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn fit(dir: &Path, full: String, hashed: impl FnOnce() -> String) -> Result<PathBuf, PluginError> {
    let p = dir.join(full);
    if p.as_os_str().len() <= MAX_SOCKET_PATH {
        return Ok(p);
    }
    let h = dir.join(hashed());
    if h.as_os_str().len() <= MAX_SOCKET_PATH {
        return Ok(h);
    }
    Err(PluginError::SocketPathTooLong {
        len: h.as_os_str().len(),
        path: h,
    })
}

impl SocketPaths {
    /// Socket paths for a configuration: `<driver>-reg.sock` and `dra.sock`,
    /// or with a pod UID `<driver>-<uid>-reg.sock` and `dra-<uid>.sock`
    /// (the UID replaced by a hash of it when the path would be too long).
    ///
    /// # Errors
    /// A path that does not fit even hashed.
    pub fn new(c: &PluginConfig) -> Result<Self, PluginError> {
        let d = &c.driver_name;
        match &c.pod_uid {
            None => Ok(Self {
                registration: fit(&c.plugins_registry_dir, format!("{d}-reg.sock"), || {
                    format!("{}-reg.sock", short_hash(d))
                })?,
                dra: fit(&c.plugin_dir, "dra.sock".into(), || "dra.sock".into())?,
            }),
            Some(uid) => Ok(Self {
                registration: fit(
                    &c.plugins_registry_dir,
                    format!("{d}-{uid}-reg.sock"),
                    || format!("{d}-{}-reg.sock", short_hash(uid)),
                )
                .or_else(|_| {
                    let h = short_hash(&format!("{d}-{uid}"));
                    fit(&c.plugins_registry_dir, format!("{h}-reg.sock"), || {
                        format!("{h}-reg.sock")
                    })
                })?,
                dra: fit(&c.plugin_dir, format!("dra-{uid}.sock"), || {
                    format!("dra-{}.sock", short_hash(uid))
                })?,
            }),
        }
    }
}

/// The registration status kubelet reported.
#[derive(Clone, Debug)]
pub struct Registration {
    rx: watch::Receiver<Option<Result<(), String>>>,
}

impl Registration {
    /// `None` until kubelet calls `NotifyRegistrationStatus`; then whether it
    /// accepted the plugin (or its error).
    #[must_use]
    pub fn status(&self) -> Option<Result<(), String>> {
        self.rx.borrow().clone()
    }

    /// Wait until kubelet reported a status.
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

#[derive(Debug, Clone)]
struct DraService {
    driver: Arc<Driver>,
}

/// The claims of a request: valid ones go to the driver, invalid ones get
/// their error right away. Every claim appears in the response.
fn split<C>(claims: Vec<C>, uid: impl Fn(&C) -> String) -> (Vec<ClaimRef>, Vec<(String, String)>)
where
    ClaimRef: TryFrom<C, Error = crate::claim::InvalidClaim>,
{
    let mut ok = Vec::new();
    let mut bad = Vec::new();
    for c in claims {
        let u = uid(&c);
        match ClaimRef::try_from(c) {
            Ok(c) => ok.push(c),
            Err(e) => bad.push((u, e.to_string())),
        }
    }
    (ok, bad)
}

fn claim_error(c: &ClaimRef, e: &dyn std::fmt::Display) -> String {
    format!("claim {c}: {e}")
}

/// The DRA service of one API version: v1 and v1beta1 differ only in their
/// generated types (v1beta1 has no `share_id`, which the `From<PreparedDevice>`
/// conversions handle), so one body serves both.
macro_rules! dra_service {
    ($v:ident) => {
        #[tonic::async_trait]
        impl $v::dra_plugin_server::DraPlugin for DraService {
            async fn node_prepare_resources(
                &self,
                r: Request<$v::NodePrepareResourcesRequest>,
            ) -> Result<Response<$v::NodePrepareResourcesResponse>, Status> {
                let (ok, bad) = split(r.into_inner().claims, |c| c.uid.clone());
                let mut out = $v::NodePrepareResourcesResponse::default();
                for (uid, error) in bad {
                    out.claims.insert(
                        uid,
                        $v::NodePrepareResourceResponse {
                            devices: vec![],
                            error,
                        },
                    );
                }
                for (c, res) in self.driver.prepare(ok).await {
                    let resp = match res {
                        Ok(devs) => $v::NodePrepareResourceResponse {
                            devices: devs.into_iter().map(Into::into).collect(),
                            error: String::new(),
                        },
                        Err(e) => $v::NodePrepareResourceResponse {
                            devices: vec![],
                            error: claim_error(&c, &e),
                        },
                    };
                    out.claims.insert(c.uid, resp);
                }
                Ok(Response::new(out))
            }

            async fn node_unprepare_resources(
                &self,
                r: Request<$v::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$v::NodeUnprepareResourcesResponse>, Status> {
                let (ok, bad) = split(r.into_inner().claims, |c| c.uid.clone());
                let mut out = $v::NodeUnprepareResourcesResponse::default();
                for (uid, error) in bad {
                    out.claims
                        .insert(uid, $v::NodeUnprepareResourceResponse { error });
                }
                for (c, res) in self.driver.unprepare(ok).await {
                    let error = res.err().map(|e| claim_error(&c, &e)).unwrap_or_default();
                    out.claims
                        .insert(c.uid, $v::NodeUnprepareResourceResponse { error });
                }
                Ok(Response::new(out))
            }
        }
    };
}

dra_service!(dra_v1);
dra_service!(dra_v1beta1);

/// Options of [`serve_with`].
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// Serve `v1alpha1.DRAResourceHealth` on `dra.sock` from this monitor and
    /// advertise it in `GetInfo`; `None`: neither.
    pub health: Option<HealthHandle>,
    /// Resend the complete health list at least this often even without a
    /// change, with `last_updated_time` = the monitor's latest check (kubelet
    /// marks devices not updated within its health timeout Unknown). `None`:
    /// send on changes only. Default 10 s.
    pub health_resend: Option<Duration>,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            health: None,
            health_resend: Some(Duration::from_secs(10)),
        }
    }
}

fn unix_secs(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// The wire form of a snapshot: every device, in the monitor's order.
fn health_response(
    pool: &str,
    snap: &HealthSnapshot,
    checked: SystemTime,
) -> hv::NodeWatchResourcesResponse {
    hv::NodeWatchResourcesResponse {
        devices: snap
            .devices
            .iter()
            .map(|d| hv::DeviceHealth {
                device: Some(hv::DeviceIdentifier {
                    pool_name: pool.to_string(),
                    device_name: d.device.to_string(),
                }),
                health: match d.status {
                    HealthStatus::Unknown => hv::HealthStatus::Unknown,
                    HealthStatus::Healthy => hv::HealthStatus::Healthy,
                    HealthStatus::Unhealthy => hv::HealthStatus::Unhealthy,
                } as i32,
                last_updated_time: unix_secs(d.last_updated.max(checked)),
                health_check_timeout_seconds: 0,
                message: d.message.clone(),
            })
            .collect(),
    }
}

#[derive(Debug, Clone)]
struct HealthService {
    health: HealthHandle,
    pool: String,
    resend: Option<Duration>,
    stop: watch::Receiver<bool>,
}

struct WatchState {
    health: HealthHandle,
    rx: watch::Receiver<HealthSnapshot>,
    stop: watch::Receiver<bool>,
    tick: Option<tokio::time::Interval>,
    pool: String,
    first: bool,
}

type HealthStream =
    Pin<Box<dyn futures::Stream<Item = Result<hv::NodeWatchResourcesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl hv::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = HealthStream;

    async fn node_watch_resources(
        &self,
        _: Request<hv::NodeWatchResourcesRequest>,
    ) -> Result<Response<HealthStream>, Status> {
        let tick = self.resend.map(|d| {
            let mut t = tokio::time::interval_at(tokio::time::Instant::now() + d, d);
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t
        });
        let st = WatchState {
            health: self.health.clone(),
            rx: self.health.subscribe(),
            stop: self.stop.clone(),
            tick,
            pool: self.pool.clone(),
            first: true,
        };
        tracing::info!("kubelet watches device health");
        let s = futures::stream::unfold(st, |mut st| async move {
            if st.first {
                st.first = false;
            } else {
                let tick = st.tick.as_mut();
                let resend = async move {
                    match tick {
                        Some(t) => {
                            t.tick().await;
                        }
                        None => std::future::pending::<()>().await,
                    }
                };
                tokio::select! {
                    r = st.rx.changed() => if r.is_err() { return None },
                    _ = st.stop.wait_for(|s| *s) => return None,
                    () = resend => {}
                }
            }
            if *st.stop.borrow() {
                return None;
            }
            let msg = health_response(&st.pool, &st.rx.borrow_and_update(), st.health.last_check());
            Some((Ok(msg), st))
        });
        Ok(Response::new(Box::pin(s)))
    }
}

fn bind(path: &Path) -> Result<UnixListener, PluginError> {
    let io = |what| {
        move |source| PluginError::Io {
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
/// which h2 alone rejects: see `authority.rs`).
fn incoming(
    l: UnixListener,
) -> impl futures::Stream<Item = std::io::Result<ServerConn<tokio::net::UnixStream>>> {
    use futures::TryStreamExt;
    UnixListenerStream::new(l).map_ok(ServerConn::new)
}

/// A running plugin server.
#[derive(Debug)]
pub struct Serving {
    /// The sockets it serves.
    pub paths: SocketPaths,
    registration: Registration,
    task: tokio::task::JoinHandle<Result<(), PluginError>>,
}

impl Serving {
    /// Registration status as kubelet reports it.
    #[must_use]
    pub fn registration(&self) -> Registration {
        self.registration.clone()
    }

    /// Wait until the server stops (after shutdown) and its sockets are gone.
    ///
    /// # Errors
    /// Server failures.
    pub async fn wait(self) -> Result<(), PluginError> {
        self.task.await.map_err(|e| PluginError::Task {
            what: "gRPC server",
            reason: e.to_string(),
        })?
    }
}

/// Bind both sockets (DRA service first, then registration, so kubelet never
/// sees an endpoint that is not listening), serve until `shutdown` completes,
/// then remove the sockets. Also runs the periodic claim GC if configured.
/// When this returns, the sockets accept connections. No health service: see
/// [`serve_with`].
///
/// # Errors
/// Socket setup.
pub async fn serve(
    driver: Arc<Driver>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Serving, PluginError> {
    serve_with(driver, ServeOptions::default(), shutdown).await
}

/// As [`serve`], and with [`ServeOptions::health`] set also serve
/// `v1alpha1.DRAResourceHealth/NodeWatchResources` on `dra.sock` (advertised in
/// `GetInfo.supported_versions` after the DRA plugin versions): the complete
/// device list at stream start and on every change. Streams end at shutdown.
///
/// # Errors
/// Socket setup.
pub async fn serve_with(
    driver: Arc<Driver>,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Serving, PluginError> {
    let config = driver.config().clone();
    let paths = SocketPaths::new(&config)?;
    let dra_listener = bind(&paths.dra)?;
    let (tx, rx) = watch::channel(None);
    let reg_service = RegistrationService {
        info: reg::PluginInfo {
            r#type: reg::DRA_PLUGIN_TYPE.into(),
            name: config.driver_name.clone(),
            endpoint: std::path::absolute(&paths.dra)
                .unwrap_or_else(|_| paths.dra.clone())
                .to_string_lossy()
                .into_owned(),
            supported_versions: [dra_v1::VERSION, dra_v1beta1::VERSION]
                .into_iter()
                .chain(options.health.as_ref().map(|_| hv::VERSION))
                .map(String::from)
                .collect(),
        },
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
    };
    let health = options.health.map(|health| {
        hv::dra_resource_health_server::DraResourceHealthServer::new(HealthService {
            health,
            pool: config.pool_name.clone(),
            resend: options.health_resend,
            stop: stop_rx.clone(),
        })
    });
    let dra = tonic::transport::Server::builder()
        .add_service(dra_v1::dra_plugin_server::DraPluginServer::new(svc.clone()))
        .add_service(dra_v1beta1::dra_plugin_server::DraPluginServer::new(svc))
        .add_optional_service(health)
        .serve_with_incoming_shutdown(incoming(dra_listener), stopped(stop_rx.clone()));
    let regs = tonic::transport::Server::builder()
        .add_service(reg::registration_server::RegistrationServer::new(
            reg_service,
        ))
        .serve_with_incoming_shutdown(incoming(reg_listener), stopped(stop_rx.clone()));
    let gc = {
        let driver = driver.clone();
        let stop = stopped(stop_rx.clone());
        async move {
            let Some(every) = driver.config().gc_interval else {
                return;
            };
            let mut t = tokio::time::interval(every);
            t.tick().await;
            tokio::pin!(stop);
            loop {
                tokio::select! {
                    _ = t.tick() => { driver.gc_once().await; }
                    () = &mut stop => return,
                }
            }
        }
    };
    let p = paths.clone();
    let task = tokio::spawn(async move {
        let sd = async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        };
        let (r1, r2, (), ()) = tokio::join!(dra, regs, gc, sd);
        driver.settle_status_writes().await;
        // Own sockets only: registration first so kubelet stops using us.
        let _ = std::fs::remove_file(&p.registration);
        let _ = std::fs::remove_file(&p.dra);
        r1.map_err(|source| PluginError::Serve {
            socket: p.dra.clone(),
            source,
        })?;
        r2.map_err(|source| PluginError::Serve {
            socket: p.registration.clone(),
            source,
        })?;
        tracing::info!("plugin stopped");
        Ok(())
    });
    Ok(Serving {
        paths,
        registration: Registration { rx },
        task,
    })
}

/// Recover, register, serve until `shutdown`, and stop cleanly.
///
/// # Errors
/// Inventory, recovery or socket failures.
pub async fn run(
    config: PluginConfig,
    backend: Arc<dyn GpuBackend>,
    client: kube::Client,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), PluginError> {
    let driver = Arc::new(Driver::new(config, backend, client).await?);
    let report = driver.recover().await?;
    tracing::info!(?report, "recovered");
    serve(driver, shutdown).await?.wait().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_names() {
        let mut c = PluginConfig::new("n");
        c.plugins_registry_dir = "/r".into();
        c.plugin_dir = "/p/gpu.carve.dev".into();
        let p = SocketPaths::new(&c).unwrap();
        assert_eq!(p.registration, Path::new("/r/gpu.carve.dev-reg.sock"));
        assert_eq!(p.dra, Path::new("/p/gpu.carve.dev/dra.sock"));
        c.pod_uid = Some("6a1c".into());
        let p = SocketPaths::new(&c).unwrap();
        assert_eq!(p.registration, Path::new("/r/gpu.carve.dev-6a1c-reg.sock"));
        assert_eq!(p.dra, Path::new("/p/gpu.carve.dev/dra-6a1c.sock"));
    }

    #[test]
    fn long_paths_fall_back_to_a_hash() {
        let mut c = PluginConfig::new("n");
        c.plugins_registry_dir = PathBuf::from("/").join("r".repeat(40));
        c.plugin_dir = PathBuf::from("/").join("p".repeat(40));
        c.pod_uid = Some("0123456789abcdef-0123-4567-89ab-cdef01234567".repeat(2));
        let p = SocketPaths::new(&c).unwrap();
        for s in [&p.registration, &p.dra] {
            assert!(s.as_os_str().len() <= MAX_SOCKET_PATH, "{}", s.display());
        }
        assert!(p.registration.to_string_lossy().ends_with("-reg.sock"));
        c.plugin_dir = PathBuf::from("/").join("p".repeat(120));
        assert!(matches!(
            SocketPaths::new(&c),
            Err(PluginError::SocketPathTooLong { .. })
        ));
    }
}
