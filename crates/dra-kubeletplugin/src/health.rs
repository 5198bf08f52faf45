//! The device health stream: `v1alpha1.DRAResourceHealth/NodeWatchResources`
//! on `dra.sock`, served from a driver's [`HealthWatch`].
//!
//! Each stream gets the complete device list at once, then again on every
//! change the driver publishes, and (with
//! [`crate::PluginOptions::health_resend`]) at least that often without one,
//! stamped with the driver's latest check: the kubelet marks a device whose
//! health was not updated within its health timeout Unknown. Streams end when
//! the plugin stops or the driver's watch closes.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use carve_proto::health_v1alpha1 as hv;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

/// A device's health as the kubelet gets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HealthStatus {
    /// Not known (yet).
    Unknown,
    /// Fit for use.
    Healthy,
    /// Not fit for use.
    Unhealthy,
}

/// One device's health.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceHealth {
    /// The device's pool.
    pub pool_name: String,
    /// The device's name in the pool.
    pub device_name: String,
    /// Its health.
    pub status: HealthStatus,
    /// When the status last changed or was confirmed (sent as the later of
    /// this and the watch's [last check](HealthWatch::with_last_check)).
    pub last_updated: SystemTime,
    /// Why (the kubelet shows at most 1024 characters).
    pub message: String,
    /// How long the kubelet may go without an update before it marks the
    /// device Unknown; `None`: the kubelet's default.
    pub check_timeout: Option<Duration>,
}

/// One stream's view of a driver's health: waits for changes, renders the
/// current value.
trait Cursor: Send {
    /// Wait for a change; `false` once the source has closed.
    fn changed(&mut self) -> Pin<Box<dyn Future<Output = bool> + Send + '_>>;
    /// The current devices, marking them seen.
    fn current(&mut self) -> Vec<DeviceHealth>;
}

trait Source: Send + Sync {
    fn cursor(&self) -> Box<dyn Cursor>;
}

type Render<T> = dyn Fn(&T) -> Vec<DeviceHealth> + Send + Sync;

struct WatchCursor<T> {
    rx: watch::Receiver<T>,
    render: Arc<Render<T>>,
}

impl<T: Send + Sync + 'static> Cursor for WatchCursor<T> {
    fn changed(&mut self) -> Pin<Box<dyn Future<Output = bool> + Send + '_>> {
        Box::pin(async move { self.rx.changed().await.is_ok() })
    }

    fn current(&mut self) -> Vec<DeviceHealth> {
        (self.render)(&self.rx.borrow_and_update())
    }
}

struct WatchSource<T> {
    rx: watch::Receiver<T>,
    render: Arc<Render<T>>,
}

impl<T: Send + Sync + 'static> Source for WatchSource<T> {
    fn cursor(&self) -> Box<dyn Cursor> {
        Box::new(WatchCursor {
            rx: self.rx.clone(),
            render: self.render.clone(),
        })
    }
}

/// A driver's device health, as the kit streams it: a `tokio` watch of the
/// driver's own health value and how to render it as devices.
///
/// ```
/// use std::time::SystemTime;
/// use dra_kubeletplugin::{DeviceHealth, HealthStatus, HealthWatch};
///
/// let (tx, rx) = tokio::sync::watch::channel(true);
/// let watch = HealthWatch::new(rx, |ok: &bool| {
///     vec![DeviceHealth {
///         pool_name: "node-a".into(),
///         device_name: "dev-0".into(),
///         status: if *ok { HealthStatus::Healthy } else { HealthStatus::Unhealthy },
///         last_updated: SystemTime::now(),
///         message: String::new(),
///         check_timeout: None,
///     }]
/// });
/// tx.send_replace(false); // every stream sends the new list
/// # drop(watch);
/// ```
#[derive(Clone)]
pub struct HealthWatch {
    source: Arc<dyn Source>,
    last_check: Arc<dyn Fn() -> SystemTime + Send + Sync>,
}

impl std::fmt::Debug for HealthWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HealthWatch")
            .field("last_check", &(self.last_check)())
            .finish_non_exhaustive()
    }
}

impl HealthWatch {
    /// Stream `rx`: every value it holds, rendered by `render`, is the
    /// complete device list (the order is kept). The streams end when the
    /// sender is dropped.
    pub fn new<T: Send + Sync + 'static>(
        rx: watch::Receiver<T>,
        render: impl Fn(&T) -> Vec<DeviceHealth> + Send + Sync + 'static,
    ) -> Self {
        Self {
            source: Arc::new(WatchSource {
                rx,
                render: Arc::new(render),
            }),
            last_check: Arc::new(|| UNIX_EPOCH),
        }
    }

    /// When the driver last looked at its devices, even if nothing changed:
    /// each message stamps every device with the later of this and its
    /// [`DeviceHealth::last_updated`]. Without it, resends repeat the
    /// devices' own times.
    #[must_use]
    pub fn with_last_check(mut self, f: impl Fn() -> SystemTime + Send + Sync + 'static) -> Self {
        self.last_check = Arc::new(f);
        self
    }
}

fn unix_secs(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// The wire form of a device list.
fn response(devices: Vec<DeviceHealth>, checked: SystemTime) -> hv::NodeWatchResourcesResponse {
    hv::NodeWatchResourcesResponse {
        devices: devices
            .into_iter()
            .map(|d| hv::DeviceHealth {
                device: Some(hv::DeviceIdentifier {
                    pool_name: d.pool_name,
                    device_name: d.device_name,
                }),
                health: match d.status {
                    HealthStatus::Unknown => hv::HealthStatus::Unknown,
                    HealthStatus::Healthy => hv::HealthStatus::Healthy,
                    HealthStatus::Unhealthy => hv::HealthStatus::Unhealthy,
                } as i32,
                last_updated_time: unix_secs(d.last_updated.max(checked)),
                health_check_timeout_seconds: d
                    .check_timeout
                    .map_or(0, |t| i64::try_from(t.as_secs()).unwrap_or(i64::MAX)),
                message: d.message,
            })
            .collect(),
    }
}

#[derive(Clone)]
pub(crate) struct HealthService {
    pub(crate) watch: HealthWatch,
    pub(crate) resend: Option<Duration>,
    pub(crate) stop: watch::Receiver<bool>,
}

struct StreamState {
    cursor: Box<dyn Cursor>,
    last_check: Arc<dyn Fn() -> SystemTime + Send + Sync>,
    stop: watch::Receiver<bool>,
    tick: Option<tokio::time::Interval>,
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
        let st = StreamState {
            cursor: self.watch.source.cursor(),
            last_check: self.watch.last_check.clone(),
            stop: self.stop.clone(),
            tick,
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
                    open = st.cursor.changed() => if !open { return None },
                    _ = st.stop.wait_for(|s| *s) => return None,
                    () = resend => {}
                }
            }
            if *st.stop.borrow() {
                return None;
            }
            let msg = response(st.cursor.current(), (st.last_check)());
            Some((Ok(msg), st))
        });
        Ok(Response::new(Box::pin(s)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_form_takes_the_later_time_and_the_timeout_in_seconds() {
        let at = |s| UNIX_EPOCH + Duration::from_secs(s);
        let d = DeviceHealth {
            pool_name: "p".into(),
            device_name: "d".into(),
            status: HealthStatus::Unhealthy,
            last_updated: at(2_000_000_000),
            message: "m".into(),
            check_timeout: Some(Duration::from_millis(30_500)),
        };
        let r = response(vec![d.clone()], at(1_900_000_000));
        let w = &r.devices[0];
        assert_eq!(w.last_updated_time, 2_000_000_000);
        assert_eq!(w.health, hv::HealthStatus::Unhealthy as i32);
        assert_eq!(w.health_check_timeout_seconds, 30);
        let r = response(
            vec![DeviceHealth {
                check_timeout: None,
                ..d
            }],
            at(2_100_000_000),
        );
        assert_eq!(r.devices[0].last_updated_time, 2_100_000_000);
        assert_eq!(r.devices[0].health_check_timeout_seconds, 0);
    }
}
