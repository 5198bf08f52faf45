//! GPU health: NVML XID and ECC events folded into per-device health, published
//! as `DeviceTaint`s (for the ResourceSlice builder) and as a complete device
//! health list (for the kubelet `NodeWatchResources` stream).
//!
//! Pure: events, live MIG instances and the clock come in as values. Not here:
//! watching NVML (`carve-nvml`), publishing slices, the gRPC stream (`carve-plugin`).
//!
//! Mapping: an event that names a GPU instance (NVML reports GI/CI ids, or
//! `0xFFFFFFFF` for "whole device") applies to the MIG device of the live
//! instance with that id (and its `-mps` variant) only; an event without one, or
//! naming an instance that is not live, applies to the whole GPU and every
//! device carved from it.
//!
//! Recovery (when a condition clears), by [`Severity`]:
//! - [`Severity::Ignore`]: application-level faults never create a condition.
//! - [`Severity::Warning`]: taint effect `None` (withheld on Kubernetes 1.34,
//!   which has no such effect: [`taints_for_version`]), device stays Healthy;
//!   clears after [`HealthPolicy::warning_quiet`] without a recurrence.
//! - [`Severity::Error`]: `NoSchedule`, Unhealthy; clears after
//!   [`HealthPolicy::error_quiet`] without a recurrence.
//! - [`Severity::Fatal`]: [`HealthPolicy::fatal_effect`] (`NoSchedule` by default),
//!   Unhealthy; clears only when the GPU is observed reset: [`HealthState::gpu_reset`],
//!   or a GPU seen lost that is present again ([`HealthState::observe_gpu`]), or,
//!   if configured, after [`HealthPolicy::fatal_quiet`]. A restarted plugin starts
//!   with no conditions (a node reboot resets the GPUs).
//! - [`Severity::Unmonitored`]: effect `None`, health Unknown; never clears (the
//!   GPU cannot deliver events, resetting it does not change that).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::resource::v1::DeviceTaint;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::{Deserialize, Serialize};

use crate::names::{DeviceName, NameError};

/// Taint key of XID conditions; the value is the XID number.
pub const XID_TAINT_KEY: &str = "gpu.carve.dev/xid";
/// Taint key of ECC event conditions; the value is `sbe` or `dbe`.
pub const ECC_TAINT_KEY: &str = "gpu.carve.dev/ecc";
/// Taint key of GPUs that cannot deliver health events; the value is `true`.
pub const UNMONITORED_TAINT_KEY: &str = "gpu.carve.dev/unmonitored";
/// Taint key of GPUs observed lost (NVML `GPU_IS_LOST`); the value is `true`.
pub const GPU_LOST_TAINT_KEY: &str = "gpu.carve.dev/gpu-lost";
/// Longest health message the kubelet keeps (it truncates to 1021 + `...`).
pub const MESSAGE_MAX: usize = 1024;

/// One health event of a GPU, as the backend delivers it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuEvent {
    /// NVML index of the GPU.
    pub gpu: u32,
    /// What happened.
    pub kind: EventKind,
    /// GPU-instance id, when the event affects one MIG instance only.
    pub gi: Option<u32>,
    /// Compute-instance id, when the event affects one compute instance only.
    pub ci: Option<u32>,
    /// When the backend received it (NVML events carry no time).
    pub at: SystemTime,
}

/// What kind of health event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum EventKind {
    /// `nvmlEventTypeXidCriticalError` with its XID.
    Xid(u64),
    /// `nvmlEventTypeSingleBitEccError` (corrected).
    SingleBitEcc,
    /// `nvmlEventTypeDoubleBitEccError` (uncorrected).
    DoubleBitEcc,
    /// The GPU cannot be watched (reported once, when watching starts).
    Unmonitored {
        /// Why, e.g. `nvmlDeviceRegisterEvents: not supported`.
        reason: String,
    },
    /// Any other NVML event type (carve does not register for others).
    Other {
        /// `nvmlEventType*` bit.
        event_type: u64,
        /// Its `eventData`.
        data: u64,
    },
}

/// How bad a condition is; decides taint effect, health and recovery.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Severity {
    /// Application-level fault, not a device fault: no condition.
    Ignore,
    /// Device still usable: effect `None`, Healthy, clears after a quiet period.
    Warning,
    /// Health unknown (not watched): effect `None`, Unknown, never clears.
    Unmonitored,
    /// Device fault that may pass: `NoSchedule`, Unhealthy, clears after a quiet period.
    Error,
    /// Device fault that needs a GPU reset: `NoSchedule` (configurable), Unhealthy.
    Fatal,
}

/// The effect of a `DeviceTaint` (`PreferNoSchedule` is not valid for devices).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum TaintEffect {
    /// Visible, no scheduling effect.
    None,
    /// No new claims allocate the device.
    NoSchedule,
    /// Also evicts pods whose claims use it.
    NoExecute,
}

impl TaintEffect {
    /// The API string.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "None",
            Self::NoSchedule => "NoSchedule",
            Self::NoExecute => "NoExecute",
        }
    }
}

/// One row of the XID table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct XidClass {
    /// The XID.
    pub xid: u64,
    /// Short description.
    pub name: &'static str,
    /// carve's severity for it.
    pub severity: Severity,
    /// Where the classification comes from.
    pub source: &'static str,
    /// Whether the description was checked against the source; `false` rows
    /// follow NVIDIA's XID catalogue as commonly cited but were not verified.
    pub verified: bool,
}

const DEVICE_PLUGIN: &str = "NVIDIA k8s-device-plugin health.go applicationErrorXids (application errors: GPU stays healthy)";
const PAGE_RETIREMENT: &str = "NVIDIA docs, Dynamic Page Retirement: Visibility (XID 48, 63, 64)";
const CATALOGUE: &str = "NVIDIA Xid catalogue (docs.nvidia.com/deploy/xid-errors)";

/// XIDs carve classifies, sorted by XID. Any other XID gets
/// [`HealthPolicy::unknown_xid`]. Severities are carve's choice: `Fatal` where
/// NVIDIA's recovery is a GPU reset, `Warning` where the GPU keeps working.
pub const XID_TABLE: &[XidClass] = &[
    XidClass {
        xid: 13,
        name: "graphics engine exception",
        severity: Severity::Ignore,
        source: DEVICE_PLUGIN,
        verified: true,
    },
    XidClass {
        xid: 31,
        name: "GPU memory page fault",
        severity: Severity::Ignore,
        source: DEVICE_PLUGIN,
        verified: true,
    },
    XidClass {
        xid: 43,
        name: "GPU stopped processing",
        severity: Severity::Ignore,
        source: DEVICE_PLUGIN,
        verified: true,
    },
    XidClass {
        xid: 45,
        name: "preemptive cleanup, due to previous errors",
        severity: Severity::Ignore,
        source: DEVICE_PLUGIN,
        verified: true,
    },
    XidClass {
        xid: 48,
        name: "double-bit ECC error",
        severity: Severity::Fatal,
        source: PAGE_RETIREMENT,
        verified: true,
    },
    XidClass {
        xid: 63,
        name: "ECC page retirement or row remapping recorded, reset to activate",
        severity: Severity::Warning,
        source: PAGE_RETIREMENT,
        verified: true,
    },
    XidClass {
        xid: 64,
        name: "ECC page retirement or row remapping failed",
        severity: Severity::Fatal,
        source: PAGE_RETIREMENT,
        verified: true,
    },
    XidClass {
        xid: 68,
        name: "video processor exception",
        severity: Severity::Ignore,
        source: DEVICE_PLUGIN,
        verified: true,
    },
    XidClass {
        xid: 74,
        name: "NVLink error",
        severity: Severity::Fatal,
        source: CATALOGUE,
        verified: false,
    },
    XidClass {
        xid: 79,
        name: "GPU has fallen off the bus",
        severity: Severity::Fatal,
        source: "NVIDIA driver log text `NVRM: Xid (PCI:...): 79, GPU has fallen off the bus`",
        verified: true,
    },
    XidClass {
        xid: 92,
        name: "high single-bit ECC error rate",
        severity: Severity::Warning,
        source: CATALOGUE,
        verified: false,
    },
    XidClass {
        xid: 94,
        name: "contained ECC error",
        severity: Severity::Warning,
        source: CATALOGUE,
        verified: false,
    },
    XidClass {
        xid: 95,
        name: "uncontained ECC error",
        severity: Severity::Fatal,
        source: CATALOGUE,
        verified: false,
    },
    XidClass {
        xid: 119,
        name: "GSP RPC timeout",
        severity: Severity::Fatal,
        source: CATALOGUE,
        verified: false,
    },
    XidClass {
        xid: 120,
        name: "GSP error",
        severity: Severity::Fatal,
        source: CATALOGUE,
        verified: false,
    },
];

/// The table row of an XID.
#[must_use]
pub fn xid_class(xid: u64) -> Option<&'static XidClass> {
    XID_TABLE
        .binary_search_by_key(&xid, |c| c.xid)
        .ok()
        .map(|i| &XID_TABLE[i])
}

/// Tunables of [`HealthState`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthPolicy {
    /// A [`Severity::Warning`] condition clears after this long without a recurrence.
    pub warning_quiet: Duration,
    /// A [`Severity::Error`] condition clears after this long without a recurrence.
    pub error_quiet: Duration,
    /// If set, a [`Severity::Fatal`] condition also clears after this long
    /// without a recurrence; by default only a GPU reset clears it.
    pub fatal_quiet: Option<Duration>,
    /// Taint effect of fatal conditions (`NoExecute` evicts running pods).
    pub fatal_effect: TaintEffect,
    /// Severity of XIDs not in [`XID_TABLE`].
    pub unknown_xid: Severity,
    /// More XIDs to treat as application-level (ignored).
    pub ignored_xids: Vec<u64>,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        Self {
            warning_quiet: Duration::from_secs(600),
            error_quiet: Duration::from_secs(3600),
            fatal_quiet: None,
            fatal_effect: TaintEffect::NoSchedule,
            unknown_xid: Severity::Error,
            ignored_xids: Vec::new(),
        }
    }
}

impl HealthPolicy {
    /// The severity of an event kind under this policy.
    #[must_use]
    pub fn severity(&self, kind: &EventKind) -> Severity {
        match kind {
            EventKind::Xid(x) if self.ignored_xids.contains(x) => Severity::Ignore,
            EventKind::Xid(x) => xid_class(*x).map_or(self.unknown_xid, |c| c.severity),
            EventKind::SingleBitEcc => Severity::Warning,
            EventKind::DoubleBitEcc => Severity::Fatal,
            EventKind::Unmonitored { .. } => Severity::Unmonitored,
            EventKind::Other { .. } => Severity::Ignore,
        }
    }

    /// The taint effect of a severity; `None` (no taint) for [`Severity::Ignore`].
    #[must_use]
    pub fn effect(&self, severity: Severity) -> Option<TaintEffect> {
        match severity {
            Severity::Ignore => None,
            Severity::Warning | Severity::Unmonitored => Some(TaintEffect::None),
            Severity::Error => Some(TaintEffect::NoSchedule),
            Severity::Fatal => Some(self.fatal_effect),
        }
    }

    fn quiet(&self, severity: Severity) -> Option<Duration> {
        match severity {
            Severity::Warning => Some(self.warning_quiet),
            Severity::Error => Some(self.error_quiet),
            Severity::Fatal => self.fatal_quiet,
            Severity::Ignore | Severity::Unmonitored => None,
        }
    }
}

/// A live GPU instance and the MIG device (placement) it occupies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveInstance {
    /// GPU index.
    pub gpu: u32,
    /// GPU-instance id.
    pub gi: u32,
    /// Its device, a [`DeviceName::Mig`].
    pub device: DeviceName,
}

impl LiveInstance {
    /// The instance `gi` of profile `profile` (e.g. `1g.10gb`) at placement `start`.
    ///
    /// # Errors
    /// [`NameError`] naming the profile when it has no device-name form.
    pub fn new(gpu: u32, gi: u32, profile: &str, start: u8) -> Result<Self, NameError> {
        Ok(Self {
            gpu,
            gi,
            device: DeviceName::mig(gpu, profile, start)?,
        })
    }
}

/// What a condition applies to.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    /// The whole GPU and every device on it.
    Gpu(u32),
    /// One MIG placement (a [`DeviceName::Mig`]) and its MPS variant.
    Mig(DeviceName),
}

impl Scope {
    /// The GPU it is on.
    #[must_use]
    pub fn gpu(&self) -> u32 {
        match self {
            Self::Gpu(g) => *g,
            Self::Mig(d) => d.gpu(),
        }
    }

    /// Whether the condition applies to `device`.
    #[must_use]
    pub fn covers(&self, device: &DeviceName) -> bool {
        match (self, device) {
            (Self::Gpu(g), d) => d.gpu() == *g,
            (
                Self::Mig(DeviceName::Mig {
                    gpu,
                    profile,
                    start,
                }),
                DeviceName::Mig {
                    gpu: g2,
                    profile: p2,
                    start: s2,
                }
                | DeviceName::MigMps {
                    gpu: g2,
                    profile: p2,
                    start: s2,
                },
            ) => gpu == g2 && profile == p2 && start == s2,
            _ => false,
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Gpu(g) => write!(f, "GPU {g}"),
            Self::Mig(d) => write!(f, "MIG device {d}"),
        }
    }
}

/// One active condition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Condition {
    /// What it applies to.
    pub scope: Scope,
    /// Taint key.
    pub key: &'static str,
    /// Taint value (a label value).
    pub value: String,
    /// Severity.
    pub severity: Severity,
    /// Human description, e.g. `XID 79 (GPU has fallen off the bus)`.
    pub what: String,
    /// First occurrence.
    pub first_seen: SystemTime,
    /// Latest occurrence.
    pub last_seen: SystemTime,
    /// Occurrences.
    pub count: u64,
}

/// Health of a device for the kubelet health API (`HealthStatus` numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HealthStatus {
    /// `UNKNOWN` = 0.
    Unknown = 0,
    /// `HEALTHY` = 1.
    Healthy = 1,
    /// `UNHEALTHY` = 2.
    Unhealthy = 2,
}

/// One entry of the complete device health list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceHealth {
    /// The device.
    pub device: DeviceName,
    /// Its health.
    pub status: HealthStatus,
    /// Why (empty when healthy without warnings); at most [`MESSAGE_MAX`] characters.
    pub message: String,
    /// When this was computed (`last_updated_time`).
    pub last_updated: SystemTime,
}

type CondKey = (Scope, &'static str, String);

/// Per-device health folded from events, with recovery. See the module docs.
#[derive(Clone, Debug, Default)]
pub struct HealthState {
    policy: HealthPolicy,
    conditions: BTreeMap<CondKey, Condition>,
    lost: BTreeSet<u32>,
}

impl HealthState {
    /// No conditions yet.
    #[must_use]
    pub fn new(policy: HealthPolicy) -> Self {
        Self {
            policy,
            conditions: BTreeMap::new(),
            lost: BTreeSet::new(),
        }
    }

    /// The policy.
    #[must_use]
    pub fn policy(&self) -> &HealthPolicy {
        &self.policy
    }

    /// Active conditions, ordered by scope and key.
    pub fn conditions(&self) -> impl Iterator<Item = &Condition> {
        self.conditions.values()
    }

    /// Fold events in. `live` lists the live GPU instances, to map an event's GI
    /// to its MIG device. Returns whether taints or health may have changed.
    pub fn apply(&mut self, events: &[GpuEvent], live: &[LiveInstance]) -> bool {
        let mut changed = false;
        for ev in events {
            let severity = self.policy.severity(&ev.kind);
            let (key, value, what) = match &ev.kind {
                _ if severity == Severity::Ignore => continue,
                EventKind::Xid(x) => (
                    XID_TAINT_KEY,
                    x.to_string(),
                    match xid_class(*x) {
                        Some(c) => format!("XID {x} ({})", c.name),
                        None => format!("XID {x}"),
                    },
                ),
                EventKind::SingleBitEcc => {
                    (ECC_TAINT_KEY, "sbe".into(), "single-bit ECC error".into())
                }
                EventKind::DoubleBitEcc => {
                    (ECC_TAINT_KEY, "dbe".into(), "double-bit ECC error".into())
                }
                EventKind::Unmonitored { reason } => (
                    UNMONITORED_TAINT_KEY,
                    "true".into(),
                    format!("not monitored: {reason}"),
                ),
                EventKind::Other { .. } => continue,
            };
            let scope = match ev.gi {
                Some(gi) => live
                    .iter()
                    .find(|l| l.gpu == ev.gpu && l.gi == gi)
                    .map_or(Scope::Gpu(ev.gpu), |l| Scope::Mig(l.device.clone())),
                None => Scope::Gpu(ev.gpu),
            };
            self.raise(scope, key, value, severity, what, ev.at);
            changed = true;
        }
        changed
    }

    fn raise(
        &mut self,
        scope: Scope,
        key: &'static str,
        value: String,
        severity: Severity,
        what: String,
        at: SystemTime,
    ) {
        let c = self
            .conditions
            .entry((scope.clone(), key, value.clone()))
            .or_insert_with(|| Condition {
                scope,
                key,
                value,
                severity,
                what,
                first_seen: at,
                last_seen: at,
                count: 0,
            });
        c.count += 1;
        c.severity = c.severity.max(severity);
        c.first_seen = c.first_seen.min(at);
        c.last_seen = c.last_seen.max(at);
    }

    /// Record whether GPU `gpu` answers NVML (`present`) or is lost
    /// (`GPU_IS_LOST`, missing). A lost GPU gets a fatal `gpu-lost` condition; a
    /// lost GPU seen present again has been reset, which clears its conditions
    /// as [`HealthState::gpu_reset`] does. Returns whether anything changed.
    pub fn observe_gpu(&mut self, gpu: u32, present: bool, now: SystemTime) -> bool {
        if present {
            return self.lost.contains(&gpu) && self.gpu_reset(gpu);
        }
        self.lost.insert(gpu);
        self.raise(
            Scope::Gpu(gpu),
            GPU_LOST_TAINT_KEY,
            "true".into(),
            Severity::Fatal,
            "GPU lost (not answering NVML)".into(),
            now,
        );
        true
    }

    /// GPU `gpu` was reset (observed by the caller, e.g. after `nvidia-smi -r`
    /// or a MIG mode change with reset): clear every condition on it except
    /// [`Severity::Unmonitored`]. Returns whether anything was cleared.
    pub fn gpu_reset(&mut self, gpu: u32) -> bool {
        let was_lost = self.lost.remove(&gpu);
        let before = self.conditions.len();
        self.conditions
            .retain(|(s, _, _), c| s.gpu() != gpu || c.severity == Severity::Unmonitored);
        was_lost || self.conditions.len() != before
    }

    /// Clear conditions whose quiet period has passed at `now`. Returns whether
    /// anything was cleared.
    pub fn expire(&mut self, now: SystemTime) -> bool {
        let before = self.conditions.len();
        let policy = &self.policy;
        self.conditions.retain(|_, c| {
            let quiet = policy.quiet(c.severity);
            let since = now.duration_since(c.last_seen).unwrap_or(Duration::ZERO);
            // A lost GPU stays lost until seen present again.
            c.key == GPU_LOST_TAINT_KEY || quiet.is_none_or(|q| since < q)
        });
        self.conditions.len() != before
    }

    fn covering<'a>(&'a self, device: &'a DeviceName) -> impl Iterator<Item = &'a Condition> {
        self.conditions
            .values()
            .filter(move |c| c.scope.covers(device))
    }

    /// The taints of `device`: one per key, with the strongest effect among its
    /// conditions (ties: the latest), `timeAdded` = that condition's first
    /// occurrence. Sorted by key; at most 4 (fits 1.34's limit).
    #[must_use]
    pub fn taints(&self, device: &DeviceName) -> Vec<DeviceTaint> {
        let mut best: BTreeMap<&str, (TaintEffect, &Condition)> = BTreeMap::new();
        for c in self.covering(device) {
            let Some(effect) = self.policy.effect(c.severity) else {
                continue;
            };
            let better = best
                .get(c.key)
                .is_none_or(|(e, b)| (effect, c.last_seen) > (*e, b.last_seen));
            if better {
                best.insert(c.key, (effect, c));
            }
        }
        best.into_iter()
            .map(|(key, (effect, c))| DeviceTaint {
                key: key.to_string(),
                value: Some(c.value.clone()),
                effect: effect.as_str().to_string(),
                time_added: k8s_time(c.first_seen),
            })
            .collect()
    }

    /// The health of one device at `now`.
    #[must_use]
    pub fn device_health(&self, device: &DeviceName, now: SystemTime) -> DeviceHealth {
        let mut conds: Vec<&Condition> = self.covering(device).collect();
        conds.sort_by(|a, b| {
            (b.severity, b.last_seen)
                .cmp(&(a.severity, a.last_seen))
                .then_with(|| a.key.cmp(b.key))
        });
        let status = match conds.first().map(|c| c.severity) {
            Some(Severity::Error | Severity::Fatal) => HealthStatus::Unhealthy,
            Some(Severity::Unmonitored) => HealthStatus::Unknown,
            _ => HealthStatus::Healthy,
        };
        let text = conds
            .iter()
            .map(|c| {
                let clears = match (c.severity, self.policy.quiet(c.severity)) {
                    (Severity::Unmonitored, _) => "does not clear".to_string(),
                    (_, Some(q)) => format!("clears after {}s quiet", q.as_secs()),
                    (_, None) => "clears on GPU reset".to_string(),
                };
                format!("{} on {}, {} time(s), {}", c.what, c.scope, c.count, clears)
            })
            .collect::<Vec<_>>()
            .join("; ");
        DeviceHealth {
            device: device.clone(),
            status,
            message: truncate(text),
            last_updated: now,
        }
    }

    /// The complete health list for `devices` (every device the driver
    /// publishes), in the order given: what one `NodeWatchResources` response carries.
    #[must_use]
    pub fn health(&self, devices: &[DeviceName], now: SystemTime) -> Vec<DeviceHealth> {
        devices.iter().map(|d| self.device_health(d, now)).collect()
    }
}

/// The taints of one device split by what the API server of a version
/// accepts (see [`taints_for_version`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct VersionedTaints {
    /// Taints to publish.
    pub published: Vec<DeviceTaint>,
    /// Taints withheld because the version does not know their effect.
    pub withheld: Vec<DeviceTaint>,
}

/// The taints of a device that the API server of `version` can store.
///
/// Kubernetes 1.34 accepts only the effects `NoSchedule` and `NoExecute`
/// ([`crate::slices::taint_effects`]); with DRADeviceTaints on, a slice
/// carrying an effect `None` taint is rejected whole (422). A `None` taint
/// (warning-level events: XID 63, 92, 94, single-bit ECC; GPUs that cannot
/// deliver events) has no scheduling effect by definition, so on 1.34 it is
/// withheld rather than raised to `NoSchedule`, which would take a usable
/// device out of service for a warning. The condition stays visible where it
/// does not depend on the version: the device's health message in the
/// kubelet health stream ([`HealthState::device_health`]) and the plugin log.
/// A taint with any other effect the version does not accept is withheld too.
#[must_use]
pub fn taints_for_version(
    taints: Vec<DeviceTaint>,
    version: crate::slices::KubeVersion,
) -> VersionedTaints {
    let accepted = crate::slices::taint_effects(version);
    let (published, withheld) = taints
        .into_iter()
        .partition(|t| accepted.contains(&t.effect.as_str()));
    VersionedTaints {
        published,
        withheld,
    }
}

/// A `metav1.Time` for `t`; `None` before 1970 or out of range (the API
/// server then sets the time itself).
#[must_use]
pub fn k8s_time(t: SystemTime) -> Option<Time> {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).ok()?;
    let secs = i64::try_from(d.as_secs()).ok()?;
    let nanos = i32::try_from(d.subsec_nanos()).ok()?;
    k8s_openapi::jiff::Timestamp::new(secs, nanos)
        .ok()
        .map(Time)
}

/// Cut a message to [`MESSAGE_MAX`] characters, ending in `...` when cut.
fn truncate(s: String) -> String {
    if s.chars().count() <= MESSAGE_MAX {
        return s;
    }
    let mut out: String = s.chars().take(MESSAGE_MAX - 3).collect();
    out.push_str("...");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + secs)
    }

    fn ev(gpu: u32, kind: EventKind, gi: Option<u32>, at: u64) -> GpuEvent {
        GpuEvent {
            gpu,
            kind,
            gi,
            ci: gi.map(|_| 0),
            at: t(at),
        }
    }

    fn d(name: &str) -> DeviceName {
        name.parse().unwrap()
    }

    /// Every device of a 2-GPU node, as a slice builder would list them.
    fn devices() -> Vec<DeviceName> {
        [
            "gpu-0",
            "gpu-0-mps",
            "gpu-0-ts",
            "gpu-0-mig-1g10gb-3",
            "gpu-0-mig-1g10gb-3-mps",
            "gpu-0-mig-1g10gb-4",
            "gpu-0-mig-2g20gb-2",
            "gpu-0-mig-7g80gb-0",
            "gpu-1",
            "gpu-1-mps",
            "gpu-1-mig-1g10gb-3",
        ]
        .iter()
        .map(|n| d(n))
        .collect()
    }

    fn live() -> Vec<LiveInstance> {
        vec![
            LiveInstance::new(0, 1, "1g.10gb", 4).unwrap(),
            LiveInstance::new(0, 2, "1g.10gb", 3).unwrap(),
            LiveInstance::new(1, 2, "1g.10gb", 3).unwrap(),
        ]
    }

    fn taint_summary(s: &HealthState, dev: &str) -> Vec<(String, String, String)> {
        s.taints(&d(dev))
            .into_iter()
            .map(|t| (t.key, t.value.unwrap_or_default(), t.effect))
            .collect()
    }

    #[test]
    fn table_is_sorted_unique_and_every_row_is_found() {
        for w in XID_TABLE.windows(2) {
            assert!(w[0].xid < w[1].xid, "{} before {}", w[0].xid, w[1].xid);
        }
        for c in XID_TABLE {
            assert_eq!(xid_class(c.xid), Some(c));
            assert!(!c.source.is_empty() && !c.name.is_empty());
        }
        assert_eq!(xid_class(1000), None);
    }

    #[test]
    fn event_kind_to_severity_to_effect() {
        let p = HealthPolicy::default();
        let rows: &[(EventKind, Severity, Option<TaintEffect>)] = &[
            (EventKind::Xid(13), Severity::Ignore, None),
            (EventKind::Xid(31), Severity::Ignore, None),
            (EventKind::Xid(43), Severity::Ignore, None),
            (EventKind::Xid(45), Severity::Ignore, None),
            (EventKind::Xid(68), Severity::Ignore, None),
            (
                EventKind::Xid(48),
                Severity::Fatal,
                Some(TaintEffect::NoSchedule),
            ),
            (
                EventKind::Xid(63),
                Severity::Warning,
                Some(TaintEffect::None),
            ),
            (
                EventKind::Xid(64),
                Severity::Fatal,
                Some(TaintEffect::NoSchedule),
            ),
            (
                EventKind::Xid(74),
                Severity::Fatal,
                Some(TaintEffect::NoSchedule),
            ),
            (
                EventKind::Xid(79),
                Severity::Fatal,
                Some(TaintEffect::NoSchedule),
            ),
            (
                EventKind::Xid(92),
                Severity::Warning,
                Some(TaintEffect::None),
            ),
            (
                EventKind::Xid(94),
                Severity::Warning,
                Some(TaintEffect::None),
            ),
            (
                EventKind::Xid(95),
                Severity::Fatal,
                Some(TaintEffect::NoSchedule),
            ),
            (
                EventKind::Xid(119),
                Severity::Fatal,
                Some(TaintEffect::NoSchedule),
            ),
            (
                EventKind::Xid(9999),
                Severity::Error,
                Some(TaintEffect::NoSchedule),
            ),
            (
                EventKind::SingleBitEcc,
                Severity::Warning,
                Some(TaintEffect::None),
            ),
            (
                EventKind::DoubleBitEcc,
                Severity::Fatal,
                Some(TaintEffect::NoSchedule),
            ),
            (
                EventKind::Unmonitored { reason: "x".into() },
                Severity::Unmonitored,
                Some(TaintEffect::None),
            ),
            (
                EventKind::Other {
                    event_type: 4,
                    data: 0,
                },
                Severity::Ignore,
                None,
            ),
        ];
        for (kind, sev, effect) in rows {
            assert_eq!(p.severity(kind), *sev, "{kind:?}");
            assert_eq!(p.effect(*sev), *effect, "{kind:?}");
        }
        let p = HealthPolicy {
            fatal_effect: TaintEffect::NoExecute,
            ignored_xids: vec![79],
            unknown_xid: Severity::Warning,
            ..HealthPolicy::default()
        };
        assert_eq!(p.severity(&EventKind::Xid(79)), Severity::Ignore);
        assert_eq!(p.severity(&EventKind::Xid(9999)), Severity::Warning);
        assert_eq!(p.effect(Severity::Fatal), Some(TaintEffect::NoExecute));
    }

    #[test]
    fn instance_event_taints_only_that_mig_device() {
        let mut s = HealthState::default();
        // XID 94 on GPU 0, GI 2 (1g.10gb at start 3).
        assert!(s.apply(&[ev(0, EventKind::Xid(94), Some(2), 10)], &live()));
        let tainted: Vec<String> = devices()
            .iter()
            .filter(|x| !s.taints(x).is_empty())
            .map(ToString::to_string)
            .collect();
        assert_eq!(tainted, ["gpu-0-mig-1g10gb-3", "gpu-0-mig-1g10gb-3-mps"]);
        assert_eq!(
            taint_summary(&s, "gpu-0-mig-1g10gb-3"),
            [(XID_TAINT_KEY.into(), "94".into(), "None".into())]
        );
        // A fatal instance-level XID makes that device unhealthy, not the GPU.
        s.apply(&[ev(0, EventKind::Xid(95), Some(2), 11)], &live());
        let h = s.health(&devices(), t(12));
        let unhealthy: Vec<String> = h
            .iter()
            .filter(|x| x.status == HealthStatus::Unhealthy)
            .map(|x| x.device.to_string())
            .collect();
        assert_eq!(unhealthy, ["gpu-0-mig-1g10gb-3", "gpu-0-mig-1g10gb-3-mps"]);
        assert_eq!(
            taint_summary(&s, "gpu-0-mig-1g10gb-3"),
            [(XID_TAINT_KEY.into(), "95".into(), "NoSchedule".into())],
            "one taint per key, the strongest effect"
        );
    }

    #[test]
    fn warning_taints_are_withheld_on_1_34_and_published_from_1_35() {
        use crate::slices::{KubeVersion, taint_problem};
        let mut s = HealthState::default();
        // XID 94 (warning, effect None) and a single-bit ECC error on GPU 0,
        // XID 79 (fatal, NoSchedule) on GPU 1.
        s.apply(
            &[
                ev(0, EventKind::Xid(94), None, 10),
                ev(0, EventKind::SingleBitEcc, None, 10),
                ev(1, EventKind::Xid(79), None, 10),
            ],
            &live(),
        );
        let warn = s.taints(&d("gpu-0"));
        assert_eq!(warn.len(), 2);
        assert!(warn.iter().all(|t| t.effect == "None"));
        let fatal = s.taints(&d("gpu-1"));
        assert_eq!(fatal[0].effect, "NoSchedule");

        let on134 = taints_for_version(warn.clone(), KubeVersion::V1_34);
        assert!(on134.published.is_empty(), "1.34 has no effect None");
        assert_eq!(on134.withheld, warn);
        // What is published passes the 1.34 taint rules; what is withheld would not.
        assert!(
            warn.iter()
                .all(|t| taint_problem(t, KubeVersion::V1_34).is_some())
        );
        let fatal134 = taints_for_version(fatal.clone(), KubeVersion::V1_34);
        assert_eq!(fatal134.published, fatal, "NoSchedule is published on 1.34");
        for v in [KubeVersion::V1_35, KubeVersion::V1_36] {
            let on = taints_for_version(warn.clone(), v);
            assert_eq!(on.published, warn, "{v}");
            assert!(on.withheld.is_empty());
            assert!(warn.iter().all(|t| taint_problem(t, v).is_none()));
        }
        // The warning stays visible in the health message on every version.
        let h = s.device_health(&d("gpu-0"), t(11));
        assert_eq!(h.status, HealthStatus::Healthy);
        assert!(h.message.contains("XID 94"), "{}", h.message);
    }

    #[test]
    fn whole_gpu_event_taints_the_gpu_and_every_partition() {
        let mut s = HealthState::default();
        s.apply(&[ev(1, EventKind::Xid(79), None, 5)], &live());
        for dev in devices() {
            let taints = s.taints(&dev);
            if dev.gpu() == 1 {
                assert_eq!(taints.len(), 1, "{dev}");
                assert_eq!(taints[0].key, XID_TAINT_KEY);
                assert_eq!(taints[0].value.as_deref(), Some("79"));
                assert_eq!(taints[0].effect, "NoSchedule");
                assert_eq!(
                    taints[0].time_added,
                    Some(Time(
                        k8s_openapi::jiff::Timestamp::from_second(1_800_000_005).unwrap()
                    ))
                );
            } else {
                assert!(taints.is_empty(), "{dev}");
            }
        }
        // An event naming a GI that is not live cannot be narrowed: whole GPU.
        let mut s = HealthState::default();
        s.apply(&[ev(0, EventKind::DoubleBitEcc, Some(9), 5)], &live());
        assert_eq!(
            taint_summary(&s, "gpu-0"),
            [(ECC_TAINT_KEY.into(), "dbe".into(), "NoSchedule".into())]
        );
        assert_eq!(s.taints(&d("gpu-0-mig-7g80gb-0")).len(), 1);
    }

    #[test]
    fn application_xids_and_unregistered_kinds_change_nothing() {
        let mut s = HealthState::default();
        let evs = [
            ev(0, EventKind::Xid(31), Some(2), 1),
            ev(0, EventKind::Xid(13), None, 1),
            ev(
                1,
                EventKind::Other {
                    event_type: 4,
                    data: 1,
                },
                None,
                1,
            ),
        ];
        assert!(!s.apply(&evs, &live()));
        assert!(
            s.health(&devices(), t(2))
                .iter()
                .all(|h| h.status == HealthStatus::Healthy && h.message.is_empty())
        );
        assert!(devices().iter().all(|x| s.taints(x).is_empty()));
    }

    #[test]
    fn recovery_by_severity() {
        let p = HealthPolicy::default();
        let mut s = HealthState::new(p.clone());
        s.apply(
            &[
                ev(0, EventKind::SingleBitEcc, None, 0),
                ev(0, EventKind::Xid(500), None, 0),
                ev(1, EventKind::Xid(48), None, 0),
                ev(
                    1,
                    EventKind::Unmonitored {
                        reason: "not supported".into(),
                    },
                    None,
                    0,
                ),
            ],
            &live(),
        );
        let keys = |s: &HealthState| -> Vec<(u32, String)> {
            s.conditions()
                .map(|c| (c.scope.gpu(), c.value.clone()))
                .collect()
        };
        assert_eq!(keys(&s).len(), 4);
        // Not yet quiet.
        assert!(!s.expire(t(p.warning_quiet.as_secs() - 1)));
        // A recurrence restarts the warning's quiet period.
        s.apply(&[ev(0, EventKind::SingleBitEcc, None, 100)], &live());
        assert!(!s.expire(t(p.warning_quiet.as_secs() + 1)));
        assert!(s.expire(t(p.warning_quiet.as_secs() + 100)));
        assert!(!keys(&s).contains(&(0, "sbe".into())));
        // The unknown XID (Error) clears after the error quiet period.
        assert!(s.expire(t(p.error_quiet.as_secs())));
        assert_eq!(keys(&s), [(1, "true".into()), (1, "48".into())]);
        // Fatal and unmonitored do not clear with time.
        assert!(!s.expire(t(10 * p.error_quiet.as_secs())));
        // A reset clears the fatal one; unmonitored stays.
        assert!(s.gpu_reset(1));
        assert_eq!(keys(&s), [(1, "true".into())]);
        let h = s.device_health(&d("gpu-1"), t(0));
        assert_eq!(h.status, HealthStatus::Unknown);
        assert!(h.message.contains("not supported"), "{}", h.message);
        assert_eq!(
            taint_summary(&s, "gpu-1"),
            [(UNMONITORED_TAINT_KEY.into(), "true".into(), "None".into())]
        );
        assert!(!s.gpu_reset(1), "nothing left to clear");

        // A configured fatal quiet period clears fatal ones too.
        let mut s = HealthState::new(HealthPolicy {
            fatal_quiet: Some(Duration::from_secs(60)),
            ..HealthPolicy::default()
        });
        s.apply(&[ev(0, EventKind::Xid(79), None, 0)], &live());
        assert!(s.expire(t(60)));
        assert_eq!(s.conditions().count(), 0);
    }

    #[test]
    fn lost_gpu_that_reappears_has_been_reset() {
        let mut s = HealthState::default();
        s.apply(&[ev(1, EventKind::Xid(79), None, 0)], &live());
        assert!(!s.observe_gpu(1, true, t(1)), "never lost: nothing clears");
        assert!(s.observe_gpu(1, false, t(2)));
        let taints = taint_summary(&s, "gpu-1-mps");
        assert_eq!(
            taints,
            [
                (
                    GPU_LOST_TAINT_KEY.into(),
                    "true".into(),
                    "NoSchedule".into()
                ),
                (XID_TAINT_KEY.into(), "79".into(), "NoSchedule".into()),
            ]
        );
        assert!(!s.expire(t(1_000_000)), "lost stays lost");
        assert!(s.observe_gpu(1, true, t(3)));
        assert!(devices().iter().all(|x| s.taints(x).is_empty()));
        assert!(
            s.health(&devices(), t(4))
                .iter()
                .all(|h| h.status == HealthStatus::Healthy)
        );
    }

    #[test]
    fn health_list_is_complete_ordered_and_messages_fit() {
        let mut s = HealthState::default();
        let many: Vec<GpuEvent> = (1000..1100)
            .map(|x| ev(0, EventKind::Xid(x), None, x))
            .collect();
        s.apply(&many, &live());
        s.apply(&[ev(1, EventKind::SingleBitEcc, None, 1)], &live());
        let list = s.health(&devices(), t(5000));
        assert_eq!(
            list.iter().map(|h| h.device.clone()).collect::<Vec<_>>(),
            devices()
        );
        for h in &list {
            assert!(h.message.chars().count() <= MESSAGE_MAX, "{}", h.device);
            assert_eq!(h.last_updated, t(5000));
        }
        let g0 = &list[0];
        assert_eq!(g0.status, HealthStatus::Unhealthy);
        assert!(g0.message.ends_with("..."));
        assert!(
            g0.message.starts_with("XID 1099"),
            "latest first: {}",
            g0.message
        );
        let g1 = list.iter().find(|h| h.device == d("gpu-1")).unwrap();
        assert_eq!(g1.status, HealthStatus::Healthy);
        assert!(
            g1.message
                .starts_with("single-bit ECC error on GPU 1, 1 time(s)")
        );
        // Many XIDs still make one taint per key (the API allows 4 in 1.34).
        assert_eq!(s.taints(&d("gpu-0")).len(), 1);
    }

    #[test]
    fn taint_values_are_label_values() {
        let mut s = HealthState::default();
        s.apply(
            &[
                ev(0, EventKind::Xid(u64::MAX), None, 0),
                ev(0, EventKind::DoubleBitEcc, None, 0),
                ev(
                    0,
                    EventKind::Unmonitored {
                        reason: "a long reason with spaces: not a label".into(),
                    },
                    None,
                    0,
                ),
            ],
            &live(),
        );
        s.observe_gpu(0, false, t(1));
        let taints = s.taints(&d("gpu-0"));
        assert_eq!(taints.len(), 4);
        for tn in taints {
            let v = tn.value.unwrap();
            assert!(
                v.len() <= 63 && v.bytes().all(|b| b.is_ascii_alphanumeric()),
                "{v}"
            );
            assert!(tn.key.starts_with("gpu.carve.dev/"));
        }
    }

    #[test]
    fn live_instance_with_unnamed_profile_is_an_error_naming_it() {
        let e = LiveInstance::new(0, 1, "mystery", 0).unwrap_err();
        assert!(e.to_string().contains("mystery"), "{e}");
    }
}
