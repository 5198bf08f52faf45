//! An in-process stand-in for the Kubernetes API server, speaking the real
//! REST/JSON/watch protocol for the few `resource.k8s.io/v1` resources carve
//! uses (`resourceslices`, `resourceclaims` with its `status` subresource,
//! `deviceclasses`), plus `/version` and minimal discovery, so the real `kube`
//! client can be tested against it. It adds fault injection, request counters
//! and direct store access for tests.
//!
//! Authentication and authorization are opt-in. With no identity registered
//! (the default) every request is allowed, unchecked. Once
//! [`ApiServer::set_identity`] has registered a bearer token with an
//! [`Identity`] (user name, the node-name extra of a pod-bound ServiceAccount
//! token, and RBAC-style [`PolicyRule`]s), every request needs a registered
//! token (401 Unauthorized otherwise), `/version`, `/api`, `/apis`, the
//! discovery paths and the health paths are open to every identity for
//! `get`, and every resource request needs a rule that allows its verb,
//! resource or `resource/subresource` and name (403 Forbidden otherwise, in
//! the real server's words); [`Identity::admin`] is allowed everything.
//! While the version has DRAResourceClaimGranularStatusAuthorization on
//! (1.36 and later, [`FeatureGate::ResourceClaimGranularStatusAuthorization`]),
//! a ResourceClaim status write by an identity also needs the synthetic
//! `resourceclaims/binding` permission to change `status.allocation` or
//! `status.reservedFor`, and per driver `associated-node:<verb>` (for a
//! ServiceAccount on the claim's node) or `arbitrary-node:<verb>` on
//! `resourceclaims/driver` to change that driver's `status.devices` entries
//! (422 Invalid otherwise). The `authz` and `strategy` modules cite the
//! upstream sources. Not modelled: anonymous requests, client certificates,
//! groups and `system:masters` (an identity's own rules are all it has),
//! namespaced RoleBindings (every rule applies in every namespace), rules for
//! non-resource URLs, impersonation, the Node authorizer and
//! SubjectAccessReviews; paths the stand-in does not serve answer 404 to any
//! identity without being authorized.
//!
//! It is not a Kubernetes API server: no admission, no schema validation of
//! `spec` (only kind, apiVersion, name and namespace are checked, plus the
//! ResourceSlice rules that change with the Kubernetes version it reports,
//! the fields dropped while a feature gate is off and the status
//! authorization above: [`ApiServer::set_version`],
//! [`ApiServer::set_feature_gate`]; the `strategy` module lists them with
//! their upstream sources), server-side apply only of a ResourceClaim's
//! `status.devices` (the `apply` module says what of it), no protobuf, no pagination
//! (`limit`/`continue` return everything in one page), and strategic merge
//! patch is applied as a JSON merge patch (lists are replaced, `$` directives
//! are rejected). State lives in memory only.
//!
//! ```no_run
//! # async fn demo() -> Result<(), carve_apiserver::Error> {
//! use carve_apiserver::{ApiServer, Options};
//! let server = ApiServer::start(Options::default()).await?;
//! let client = server.client(); // a real kube::Client pointed at it
//! # let _ = client;
//! server.shutdown().await;
//! # Ok(()) }
//! ```

mod apply;
mod authz;
mod http_api;
mod patch;
mod resource;
mod selector;
mod server;
mod store;
mod strategy;

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};

pub use authz::{Attributes, Identity, PolicyRule};
pub use patch::PatchError;
pub use resource::{API_VERSION, GROUP, Resource, UnknownResource, VERSION};
pub use selector::{FieldSelector, LabelSelector, SelectorError, Selectors};
pub use server::ApiServer;
pub use store::Store;
pub use strategy::FeatureGate;

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The listening socket could not be bound. The message names the OS
    /// error; it is not also the error's `source`, or a printed chain would
    /// say it twice.
    #[error("cannot listen on {addr}: {error}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS error.
        error: std::io::Error,
    },
    /// An object handed to [`Store::insert`] is not acceptable.
    #[error("invalid {resource} object: {reason}")]
    InvalidObject {
        /// The resource it was meant for.
        resource: Resource,
        /// What is wrong with it.
        reason: String,
    },
    /// A kube client for the server could not be built.
    #[error("cannot build a kube client for {url}: {source}")]
    Client {
        /// The server URL.
        url: String,
        /// kube's error.
        #[source]
        source: Box<kube::Error>,
    },
}

/// The Kubernetes version `/version` reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KubeVersion {
    /// Major version (1).
    pub major: u32,
    /// Minor version (e.g. 35).
    pub minor: u32,
}

impl Default for KubeVersion {
    /// Kubernetes 1.35.
    fn default() -> Self {
        KubeVersion {
            major: 1,
            minor: 35,
        }
    }
}

impl fmt::Display for KubeVersion {
    /// `v1.35.0`, the `gitVersion` form.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}.{}.0", self.major, self.minor)
    }
}

/// How to start a server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// Where to listen; port 0 picks a free port. Default `127.0.0.1:0`.
    pub addr: SocketAddr,
    /// The version `/version` reports at start.
    pub version: KubeVersion,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            addr: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            version: KubeVersion::default(),
        }
    }
}

/// A fault to inject with [`ApiServer::inject`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Answer the next `count` matching requests with HTTP `status` (a code
    /// outside 400..=599 is answered as 500) and a `Status` body, without
    /// touching the store. Faults queue up: each request consumes one count
    /// of the first matching fault.
    FailNext {
        /// How many requests to fail.
        count: u32,
        /// HTTP status code, e.g. 500, 503, 409.
        status: u16,
        /// Only fail writes (create, update, patch, delete, deletecollection).
        writes_only: bool,
        /// Only fail requests for this resource's plural name (e.g.
        /// `resourceclaims`, which also covers `resourceclaims/status`);
        /// `None` fails any request, including `/version` and discovery.
        resource: Option<String>,
    },
    /// Answer the next `count` matching requests only after `delay`, then
    /// as usual (a slow API server). Queues with [`Fault::FailNext`]: each
    /// request consumes one count of the first matching fault of either kind.
    DelayNext {
        /// How many requests to delay.
        count: u32,
        /// How long each waits before it is handled.
        delay: std::time::Duration,
        /// Only delay writes (create, update, patch, delete, deletecollection).
        writes_only: bool,
        /// Only delay requests for this resource's plural name, as in
        /// [`Fault::FailNext`].
        resource: Option<String>,
    },
    /// Go down: from now on every new connection is closed at once and
    /// every request on an open connection gets its connection closed
    /// without an answer; open watches end. Clients see transport errors.
    Down,
    /// Come back up after [`Fault::Down`] (pending `FailNext` faults stay).
    Up,
}

/// Request counters, see [`ApiServer::stats`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Every request received (including ones failed by faults or refused while down).
    pub requests: u64,
    /// Requests with a write verb: create, update, patch, delete, deletecollection.
    pub writes: u64,
    /// Requests per (verb, resource). Verbs are Kubernetes audit verbs (`get`,
    /// `list`, `watch`, `create`, `update`, `patch`, `delete`,
    /// `deletecollection`); resource is the plural name, `resourceclaims/status`
    /// for the subresource, or the path for non-resource URLs (`/version`).
    pub by_verb_resource: BTreeMap<(String, String), u64>,
}

impl Stats {
    /// Count for one (verb, resource) pair, 0 if none.
    pub fn count(&self, verb: &str, resource: &str) -> u64 {
        self.by_verb_resource
            .get(&(verb.to_string(), resource.to_string()))
            .copied()
            .unwrap_or(0)
    }
}

/// One received request, see [`ApiServer::request_log`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestRecord {
    /// HTTP method.
    pub method: String,
    /// URL path.
    pub path: String,
    /// Raw query string (empty if none).
    pub query: String,
    /// Kubernetes verb (see [`Stats::by_verb_resource`]).
    pub verb: String,
    /// Resource (see [`Stats::by_verb_resource`]).
    pub resource: String,
    /// HTTP status answered (200 for a watch that started; 0 when the
    /// connection was closed because the server was down).
    pub status: u16,
}

/// Runs a server on `opts.addr` until `shutdown` completes, for a
/// long-running process. The bound address is logged (`tracing` info) as
/// `listening`; use [`ApiServer::start`] to learn it programmatically.
pub async fn serve(opts: Options, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
    server::serve(opts, Store::new(), shutdown).await
}
