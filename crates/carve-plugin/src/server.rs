//! carve's plugin served by the [`dra_kubeletplugin`] kit: registration, the
//! DRA services (v1 and v1beta1) and, with a monitor attached, the device
//! health stream, all on the kit's sockets (see `kit.rs` for how carve's
//! driver meets the kit's trait).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use carve_gpu::GpuBackend;
use tokio::sync::watch;

pub use dra_kubeletplugin::{Registration, Serving, SocketPaths};

use crate::config::PluginConfig;
use crate::driver::Driver;
use crate::error::PluginError;
use crate::health::HealthHandle;
use crate::kit::CarveDriver;

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
/// At shutdown the GC loop ends and pending claim-status writes settle before
/// the sockets are removed.
///
/// # Errors
/// Socket setup.
pub async fn serve_with(
    driver: Arc<Driver>,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Serving, PluginError> {
    let mut kit_options = dra_kubeletplugin::PluginOptions::from(driver.config());
    kit_options.health_resend = options.health_resend;
    let (stop_tx, stop_rx) = watch::channel(false);
    let carve = Arc::new(CarveDriver::new(driver, options.health, stop_rx));
    let shutdown = async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    };
    match dra_kubeletplugin::serve(carve.clone(), kit_options, shutdown).await {
        Ok(s) => Ok(s),
        Err(e) => {
            carve.abort_gc();
            Err(e.into())
        }
    }
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
    // Recovery logs its own summary.
    driver.recover().await?;
    Ok(serve(driver, shutdown).await?.wait().await?)
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

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
            assert!(
                s.as_os_str().len() <= dra_kubeletplugin::MAX_SOCKET_PATH,
                "{}",
                s.display()
            );
        }
        assert!(p.registration.to_string_lossy().ends_with("-reg.sock"));
        c.plugin_dir = PathBuf::from("/").join("p".repeat(120));
        assert!(matches!(
            SocketPaths::new(&c),
            Err(dra_kubeletplugin::Error::SocketPathTooLong { .. })
        ));
    }
}
