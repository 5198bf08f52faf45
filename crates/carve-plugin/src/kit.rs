//! carve's [`Driver`] as a [`dra_kubeletplugin::DraDriver`]: the claims the
//! kubelet sends are checked ([`ClaimRef`]) and handed to
//! [`Driver::prepare`] / [`Driver::unprepare`], a claim's failure becomes
//! `claim <ns>/<name> (<uid>): <error>`, the [`HealthHandle`]'s snapshots are
//! the health stream, and at shutdown the claim GC loop ends and the
//! claim-status writes settle before the sockets go.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use carve_proto::dra_v1;
use dra_kubeletplugin as kit;
use tokio::sync::watch;

use crate::claim::{ClaimRef, PreparedDevice};
use crate::config::PluginConfig;
use crate::driver::Driver;
use crate::error::PluginError;
use crate::health::{HealthHandle, HealthSnapshot};

/// The kit's options for a carve configuration. Calls are not serialized by
/// the kit: the driver runs claims concurrently and takes its own locks
/// (with a pod UID, `<checkpoint>.lock` across the pods of a rolling update).
impl From<&PluginConfig> for kit::PluginOptions {
    fn from(c: &PluginConfig) -> Self {
        let mut o = Self::new(c.driver_name.clone());
        o.registrar_dir = c.plugins_registry_dir.clone();
        o.plugin_data_dir = c.plugin_dir.clone();
        o.rolling_update_uid = c.pod_uid.clone();
        o.serialize = false;
        o
    }
}

impl From<kit::Error> for PluginError {
    fn from(e: kit::Error) -> Self {
        Self::Kit(Box::new(e))
    }
}

/// What the kit serves.
#[derive(Debug)]
pub(crate) struct CarveDriver {
    driver: Arc<Driver>,
    health: Option<HealthHandle>,
    gc: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// Every `every`, collect the claims the API server no longer has, until
/// `stop` turns true (or its sender goes).
async fn gc_loop(driver: Arc<Driver>, every: Duration, mut stop: watch::Receiver<bool>) {
    let mut t = tokio::time::interval(every);
    t.tick().await;
    let stopped = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    tokio::pin!(stopped);
    loop {
        tokio::select! {
            _ = t.tick() => { driver.gc_once().await; }
            () = &mut stopped => return,
        }
    }
}

impl CarveDriver {
    /// Serve `driver` (and `health`); with `gc_interval` configured the claim
    /// GC loop starts now and runs until `stop`.
    pub(crate) fn new(
        driver: Arc<Driver>,
        health: Option<HealthHandle>,
        stop: watch::Receiver<bool>,
    ) -> Self {
        let gc = driver
            .config()
            .gc_interval
            .map(|every| tokio::spawn(gc_loop(driver.clone(), every, stop)));
        Self {
            driver,
            health,
            gc: Mutex::new(gc),
        }
    }

    fn take_gc(&self) -> Option<tokio::task::JoinHandle<()>> {
        self.gc
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    /// End the GC loop at once (serving never started).
    pub(crate) fn abort_gc(&self) {
        if let Some(gc) = self.take_gc() {
            gc.abort();
        }
    }
}

/// The claims of a request: valid ones go to the driver, invalid ones get
/// their error right away.
fn split(claims: Vec<kit::Claim>) -> (Vec<ClaimRef>, HashMap<String, kit::BoxError>) {
    let mut ok = Vec::new();
    let mut bad = HashMap::new();
    for c in claims {
        let uid = c.uid.clone();
        let wire = dra_v1::Claim {
            namespace: c.namespace,
            uid: c.uid,
            name: c.name,
        };
        match ClaimRef::try_from(wire) {
            Ok(c) => ok.push(c),
            Err(e) => {
                bad.insert(uid, e.into());
            }
        }
    }
    (ok, bad)
}

fn claim_error(c: &ClaimRef, e: &dyn std::fmt::Display) -> kit::BoxError {
    format!("claim {c}: {e}").into()
}

fn device(d: PreparedDevice) -> kit::Device {
    kit::Device {
        request_names: d.request_names,
        pool_name: d.pool_name,
        device_name: d.device_name,
        cdi_device_ids: d.cdi_device_ids,
        share_id: d.share_id,
    }
}

fn health_rows(pool: &str, snap: &HealthSnapshot) -> Vec<kit::DeviceHealth> {
    use carve_model::health::HealthStatus;
    snap.devices
        .iter()
        .map(|d| kit::DeviceHealth {
            pool_name: pool.to_string(),
            device_name: d.device.to_string(),
            status: match d.status {
                HealthStatus::Unknown => kit::HealthStatus::Unknown,
                HealthStatus::Healthy => kit::HealthStatus::Healthy,
                HealthStatus::Unhealthy => kit::HealthStatus::Unhealthy,
            },
            last_updated: d.last_updated,
            message: d.message.clone(),
            check_timeout: None,
        })
        .collect()
}

impl kit::DraDriver for CarveDriver {
    async fn prepare(&self, claims: Vec<kit::Claim>) -> HashMap<String, kit::PrepareResult> {
        let (ok, bad) = split(claims);
        let mut out: HashMap<_, _> = bad.into_iter().map(|(u, e)| (u, Err(e))).collect();
        for (c, r) in self.driver.prepare(ok).await {
            let r = match r {
                Ok(devs) => Ok(devs.into_iter().map(device).collect()),
                Err(e) => Err(claim_error(&c, &e)),
            };
            out.insert(c.uid, r);
        }
        out
    }

    async fn unprepare(&self, claims: Vec<kit::Claim>) -> HashMap<String, kit::UnprepareResult> {
        let (ok, bad) = split(claims);
        let mut out: HashMap<_, _> = bad.into_iter().map(|(u, e)| (u, Err(e))).collect();
        for (c, r) in self.driver.unprepare(ok).await {
            let r = r.map_err(|e| claim_error(&c, &e));
            out.insert(c.uid, r);
        }
        out
    }

    fn health(&self) -> Option<kit::HealthWatch> {
        let h = self.health.clone()?;
        let pool = self.driver.config().pool_name.clone();
        let rx = h.subscribe();
        Some(
            kit::HealthWatch::new(rx, move |s| health_rows(&pool, s))
                .with_last_check(move || h.last_check()),
        )
    }

    async fn stopped(&self) {
        if let Some(gc) = self.take_gc()
            && let Err(e) = gc.await
        {
            tracing::error!(error = %e, "claim GC loop");
        }
        self.driver.settle_status_writes().await;
    }
}
