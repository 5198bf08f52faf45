//! A kit for the node part of a Kubernetes DRA (Dynamic Resource Allocation)
//! driver, the kubelet plugin: the Rust counterpart of Go's
//! `k8s.io/dynamic-resource-allocation/kubeletplugin`. It knows nothing of
//! any device: a driver implements [`DraDriver`] (prepare claims, unprepare
//! claims, and optionally device health) and [`serve`] does the rest:
//!
//! - **Registration** with the kubelet's plugin watcher on
//!   `<registrar dir>/<driver>-reg.sock`, answering the kubelet's dial as it
//!   really dials: grpc-go sends the socket's path, percent-encoded, as the
//!   HTTP/2 `:authority`, which h2 (under tonic) rejects on its own; the kit
//!   serves every connection through [`authority::ServerConn`], which makes
//!   such an authority acceptable. [`Serving::registration`] reports what the
//!   kubelet said.
//! - **The DRA services** `v1.DRAPlugin` and `v1beta1.DRAPlugin`
//!   (`NodePrepareResources`, `NodeUnprepareResources`) on
//!   `<plugin data dir>/dra.sock`; every claim of a request gets one answer.
//! - **The health stream** `v1alpha1.DRAResourceHealth/NodeWatchResources`,
//!   served and advertised when [`DraDriver::health`] gives a
//!   [`HealthWatch`].
//! - **Serialization** of prepare and unprepare calls (on by default, as in
//!   Go), across the two pods of a rolling update through a lock file.
//! - **Readiness** ([`Serving::readiness`]), **graceful stop** (servers stop
//!   when the shutdown future completes, then [`DraDriver::stopped`], then the
//!   sockets are removed) and **seamless-upgrade sockets**
//!   ([`PluginOptions::rolling_update_uid`]: both pods of a DaemonSet rolling
//!   update serve at once under their own socket names).
//!
//! Not here: **ResourceSlice publishing**. Go's helper publishes slices
//! through `PublishResources`; this kit leaves publishing to the caller, who
//! runs its own publisher next to [`serve`] (carve runs `carve-kube`'s), so
//! the kit needs no API-server client. Nor does the kit read ResourceClaims:
//! the driver gets each claim's namespace, name and UID as the kubelet sent
//! them and reads what it needs.
//!
//! # Example
//!
//! A driver that hands out one fake device per claim:
//!
//! ```no_run
//! use std::collections::HashMap;
//! use std::sync::Arc;
//! use dra_kubeletplugin::{Claim, Device, DraDriver, PluginOptions, PrepareResult, UnprepareResult};
//!
//! struct Fake;
//!
//! impl DraDriver for Fake {
//!     async fn prepare(&self, claims: Vec<Claim>) -> HashMap<String, PrepareResult> {
//!         claims
//!             .into_iter()
//!             .map(|c| {
//!                 let dev = Device {
//!                     pool_name: "node-a".into(),
//!                     device_name: "dev-0".into(),
//!                     cdi_device_ids: vec![format!("example.com/dev={}", c.uid)],
//!                     ..Device::default()
//!                 };
//!                 (c.uid, Ok(vec![dev]))
//!             })
//!             .collect()
//!     }
//!
//!     async fn unprepare(&self, claims: Vec<Claim>) -> HashMap<String, UnprepareResult> {
//!         claims.into_iter().map(|c| (c.uid, Ok(()))).collect()
//!     }
//! }
//!
//! # async fn run() -> Result<(), dra_kubeletplugin::Error> {
//! let options = PluginOptions::new("dra.example.com");
//! let serving = dra_kubeletplugin::serve(Arc::new(Fake), options, async {
//!     let _ = tokio::signal::ctrl_c().await;
//! })
//! .await?;
//! serving.wait().await
//! # }
//! ```
//!
//! With feature `testing`, [`testing`] has clients that dial the sockets as
//! the kubelet does, including the real gRPC C-core through Python `grpcio`.

pub mod authority;
mod driver;
mod error;
pub mod health;
mod options;
mod server;
#[cfg(feature = "testing")]
pub mod testing;

pub use driver::{BoxError, Claim, Device, DraDriver, PrepareResult, UnprepareResult};
pub use error::Error;
pub use health::{DeviceHealth, HealthStatus, HealthWatch};
pub use options::{
    KUBELET_PLUGINS_DIR, KUBELET_REGISTRY_DIR, MAX_SOCKET_PATH, PluginOptions, SocketPaths,
};
pub use server::{NotReady, Readiness, Registration, SERIALIZE_LOCK, Serving, serve};
