//! The listening side: accept loop, connection handling, and the running-server handle.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::task::{JoinHandle, JoinSet};

use crate::authz::Identity;
use crate::store::Store;
use crate::strategy::{FeatureGate, Gates};
use crate::{Error, Fault, KubeVersion, Options, RequestRecord, Stats};

/// A pending `FailNext` or `DelayNext` fault.
#[derive(Debug)]
pub(crate) struct PendingFault {
    pub remaining: u32,
    pub action: FaultAction,
    pub writes_only: bool,
    pub resource: Option<String>,
}

/// What a pending fault does to the request that consumes it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum FaultAction {
    /// Answer with this HTTP status, store untouched.
    Fail(u16),
    /// Handle the request after this long.
    Delay(std::time::Duration),
}

/// Who sent a request.
#[derive(Debug)]
pub(crate) enum Caller {
    /// No identity is registered: everything is allowed, unchecked.
    Anyone,
    /// A registered token's identity.
    Known(Identity),
    /// Identities are registered but the request has none of their tokens.
    Unknown,
}

/// State shared by every connection of one server.
#[derive(Debug)]
pub(crate) struct ServerState {
    pub store: Store,
    pub addr: SocketAddr,
    version: Mutex<KubeVersion>,
    stats: Mutex<(Stats, Vec<RequestRecord>)>,
    faults: Mutex<Vec<PendingFault>>,
    down: AtomicBool,
    /// Connections accepted since start.
    connections: AtomicU64,
    /// The feature gates whose fields writes lose while they are off
    /// (see [`crate::strategy`]).
    gates: Mutex<Gates>,
    /// Registered bearer tokens; empty: no authentication or authorization.
    identities: Mutex<BTreeMap<String, Identity>>,
    /// Bumped when the server goes down or stops: open watches end.
    pub epoch: watch::Sender<u64>,
    /// Bumped by [`ApiServer::send_bookmarks`].
    pub bookmarks: watch::Sender<u64>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ServerState {
    fn new(store: Store, addr: SocketAddr, version: KubeVersion) -> Self {
        ServerState {
            store,
            addr,
            version: Mutex::new(version),
            stats: Mutex::new((Stats::default(), Vec::new())),
            faults: Mutex::new(Vec::new()),
            down: AtomicBool::new(false),
            connections: AtomicU64::new(0),
            gates: Mutex::new(Gates::default()),
            identities: Mutex::new(BTreeMap::new()),
            epoch: watch::Sender::new(0),
            bookmarks: watch::Sender::new(0),
        }
    }

    pub fn version(&self) -> KubeVersion {
        *lock(&self.version)
    }

    /// The gates in force at the current version.
    pub fn gates(&self) -> Gates {
        lock(&self.gates).effective(self.version())
    }

    /// Who sends `token`.
    pub fn authenticate(&self, token: Option<&str>) -> Caller {
        let ids = lock(&self.identities);
        if ids.is_empty() {
            return Caller::Anyone;
        }
        match token.and_then(|t| ids.get(t)) {
            Some(id) => Caller::Known(id.clone()),
            None => Caller::Unknown,
        }
    }

    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::SeqCst)
    }

    pub fn record(&self, rec: RequestRecord, write: bool) {
        let mut guard = lock(&self.stats);
        let (stats, log) = &mut *guard;
        stats.requests += 1;
        if write {
            stats.writes += 1;
        }
        *stats
            .by_verb_resource
            .entry((rec.verb.clone(), rec.resource.clone()))
            .or_insert(0) += 1;
        log.push(rec);
    }

    /// Consumes one count of the first fault matching this request; returns what it does.
    pub fn take_fault(&self, write: bool, resource: Option<&str>) -> Option<FaultAction> {
        let mut faults = lock(&self.faults);
        let i = faults.iter().position(|f| {
            f.remaining > 0
                && (!f.writes_only || write)
                && f.resource.as_deref().is_none_or(|r| Some(r) == resource)
        })?;
        let action = faults[i].action;
        faults[i].remaining -= 1;
        if faults[i].remaining == 0 {
            faults.remove(i);
        }
        Some(action)
    }
}

async fn accept_loop(
    listener: TcpListener,
    state: Arc<ServerState>,
    stop: impl Future<Output = ()>,
) {
    let mut conns = JoinSet::new();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            () = &mut stop => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => {
                    state.connections.fetch_add(1, Ordering::SeqCst);
                    if state.is_down() {
                        drop(stream);
                        continue;
                    }
                    let st = state.clone();
                    conns.spawn(async move {
                        let svc = service_fn(move |req| crate::http_api::handle(st.clone(), req));
                        if let Err(error) = http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), svc)
                            .await
                        {
                            tracing::debug!(%error, "connection ended with an error");
                        }
                    });
                }
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    // Back off briefly so that e.g. EMFILE does not spin.
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    drop(listener);
    state.epoch.send_modify(|e| *e += 1);
    conns.shutdown().await;
}

async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), Error> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|error| Error::Bind { addr, error })?;
    let local = listener
        .local_addr()
        .map_err(|error| Error::Bind { addr, error })?;
    Ok((listener, local))
}

pub(crate) async fn serve(
    opts: Options,
    store: Store,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    let (listener, addr) = bind(opts.addr).await?;
    tracing::info!(%addr, version = %opts.version, "listening");
    let state = Arc::new(ServerState::new(store, addr, opts.version));
    accept_loop(listener, state, shutdown).await;
    Ok(())
}

/// A running server. Dropping it stops it too (without waiting);
/// [`ApiServer::shutdown`] stops it and waits until the port is closed.
#[derive(Debug)]
pub struct ApiServer {
    state: Arc<ServerState>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl ApiServer {
    /// Binds `opts.addr` and serves an empty store in a background task.
    pub async fn start(opts: Options) -> Result<ApiServer, Error> {
        ApiServer::start_with_store(opts, Store::new()).await
    }

    /// Like [`ApiServer::start`] but serving an existing store, e.g. to
    /// restart on the same port (`Options { addr: old.addr(), .. }`) after
    /// [`ApiServer::shutdown`] with all objects and resourceVersions kept.
    pub async fn start_with_store(opts: Options, store: Store) -> Result<ApiServer, Error> {
        let (listener, addr) = bind(opts.addr).await?;
        let state = Arc::new(ServerState::new(store, addr, opts.version));
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(accept_loop(listener, state.clone(), async move {
            let _ = stopped.await;
        }));
        Ok(ApiServer {
            state,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// `http://IP:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.state.addr)
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.state.addr
    }

    /// A kube config for this server: `kube::Config::new(url)` with default
    /// namespace `default` and kube's defaults otherwise, including
    /// `default_retry = true` (429/503/504 are retried up to 15 times with
    /// exponential backoff).
    pub fn config(&self) -> kube::Config {
        let url = self.url();
        kube::Config::new(url.parse().expect("http://<socket address> is a valid URI"))
    }

    /// A real kube client for this server, built from [`ApiServer::config`]
    /// but with `default_retry = false`, so every injected fault reaches
    /// the caller exactly once. Must be called inside a tokio runtime.
    pub fn try_client(&self) -> Result<kube::Client, Error> {
        let mut config = self.config();
        config.default_retry = false;
        kube::Client::try_from(config).map_err(|source| Error::Client {
            url: self.url(),
            source: Box::new(source),
        })
    }

    /// [`ApiServer::try_client`], panicking if kube cannot build a client
    /// for a plain-HTTP localhost URL (it can: kube needs no TLS material for it).
    ///
    /// # Panics
    /// If kube fails to build the client or there is no tokio runtime.
    pub fn client(&self) -> kube::Client {
        match self.try_client() {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        }
    }

    /// Turns the DRAPartitionableDevices feature gate on (the default here) or
    /// off. Off, the server drops `spec.sharedCounters`,
    /// `perDeviceNodeSelection` and every device's `consumesCounters` and
    /// node selection from ResourceSlices it creates, and from updates of
    /// slices that do not use them yet, as the real API server does.
    pub fn set_partitionable_devices(&self, on: bool) {
        self.set_feature_gate(FeatureGate::PartitionableDevices, on);
    }

    /// Turns a feature gate on (every gate's default here, unlike the real
    /// 1.34 and 1.35 defaults, where all three are off) or off. Off, the
    /// server drops that gate's fields from writes as the real API server
    /// does (see the crate's `strategy` module): DRADeviceTaints the devices'
    /// `taints`; DRAConsumableCapacity the devices' `allowMultipleAllocations`
    /// and capacities' `requestPolicy`, and in ResourceClaims the requests'
    /// `capacity`, constraints' `distinctAttribute`, results' `shareID` and
    /// `consumedCapacity` and `status.devices[].shareID`.
    pub fn set_feature_gate(&self, gate: FeatureGate, on: bool) {
        lock(&self.state.gates).set(gate, on);
    }

    /// Whether a feature gate is in force: set on (the default) and, for
    /// a gate that not every version has, present at the current version
    /// (DRAResourceClaimGranularStatusAuthorization from 1.36). Setting such
    /// a gate while the version lacks it takes effect once
    /// [`ApiServer::set_version`] reaches a version that has it.
    pub fn feature_gate(&self, gate: FeatureGate) -> bool {
        self.state.gates().get(gate)
    }

    /// Registers (or replaces) a bearer token and the identity it stands
    /// for. From the first registration on, every request needs a
    /// registered token (401 Unauthorized otherwise) and every resource
    /// request needs a rule of its identity that allows it (403 Forbidden
    /// otherwise); `/version` and discovery stay open to every identity.
    /// Register [`Identity::admin`] for a client that may do everything.
    /// Takes effect for the next request; see the crate's `authz` module.
    pub fn set_identity(&self, token: impl Into<String>, identity: Identity) {
        lock(&self.state.identities).insert(token.into(), identity);
    }

    /// Unregisters a token; returns its identity. Once none is left, every
    /// request is allowed again.
    pub fn remove_identity(&self, token: &str) -> Option<Identity> {
        lock(&self.state.identities).remove(token)
    }

    /// [`ApiServer::try_client`] sending `Authorization: Bearer <token>`
    /// (`kube::Config::auth_info.token`).
    pub fn try_client_with_token(&self, token: &str) -> Result<kube::Client, Error> {
        let mut config = self.config();
        config.default_retry = false;
        config.auth_info.token = Some(token.to_string().into());
        kube::Client::try_from(config).map_err(|source| Error::Client {
            url: self.url(),
            source: Box::new(source),
        })
    }

    /// [`ApiServer::try_client_with_token`], panicking where
    /// [`ApiServer::client`] would.
    ///
    /// # Panics
    /// If kube fails to build the client or there is no tokio runtime.
    pub fn client_with_token(&self, token: &str) -> kube::Client {
        match self.try_client_with_token(token) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        }
    }

    /// Changes what `/version` reports from now on.
    pub fn set_version(&self, v: KubeVersion) {
        *lock(&self.state.version) = v;
    }

    /// TCP connections accepted since start (refused ones while down included).
    pub fn connections(&self) -> u64 {
        self.state.connections.load(Ordering::SeqCst)
    }

    /// Request counters since start or the last [`ApiServer::reset_stats`].
    pub fn stats(&self) -> Stats {
        lock(&self.state.stats).0.clone()
    }

    /// Every request since start or the last [`ApiServer::reset_stats`], in order.
    pub fn request_log(&self) -> Vec<RequestRecord> {
        lock(&self.state.stats).1.clone()
    }

    /// Zeroes the counters and empties the request log.
    pub fn reset_stats(&self) {
        *lock(&self.state.stats) = (Stats::default(), Vec::new());
    }

    /// Injects a fault (see [`Fault`]); takes effect for the next request.
    pub fn inject(&self, f: Fault) {
        let (count, action, writes_only, resource) = match f {
            Fault::FailNext {
                count,
                status,
                writes_only,
                resource,
            } => (count, FaultAction::Fail(status), writes_only, resource),
            Fault::DelayNext {
                count,
                delay,
                writes_only,
                resource,
            } => (count, FaultAction::Delay(delay), writes_only, resource),
            Fault::Down => {
                self.state.down.store(true, Ordering::SeqCst);
                self.state.epoch.send_modify(|e| *e += 1);
                return;
            }
            Fault::Up => {
                self.state.down.store(false, Ordering::SeqCst);
                return;
            }
        };
        if count > 0 {
            lock(&self.state.faults).push(PendingFault {
                remaining: count,
                action,
                writes_only,
                resource,
            });
        }
    }

    /// Drops every pending `FailNext` and `DelayNext` fault.
    pub fn clear_faults(&self) {
        lock(&self.state.faults).clear();
    }

    /// Sends a BOOKMARK event now on every open watch that allowed bookmarks
    /// (they are also sent every 60 s).
    pub fn send_bookmarks(&self) {
        self.state.bookmarks.send_modify(|b| *b += 1);
    }

    /// The object store (a cheap clone handle).
    pub fn store(&self) -> Store {
        self.state.store.clone()
    }

    /// Stops listening, ends open watches and closes every connection; the
    /// port is closed when this returns.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take()
            && let Err(error) = task.await
        {
            tracing::warn!(%error, "accept loop ended abnormally");
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}
