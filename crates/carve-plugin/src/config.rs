//! Plugin configuration and the opaque per-claim configuration
//! (`gpu.carve.dev/v1alpha1` `GpuConfig` / `MigConfig`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::resource::v1::DeviceAllocationConfiguration;
use serde::{Deserialize, Serialize};

/// How the plugin may change a GPU's MIG layout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuPolicy {
    /// Instances are created on prepare and destroyed on unprepare.
    #[default]
    Dynamic,
    /// Instances are managed by an administrator; prepare hands out the existing
    /// instance at the allocated placement and never creates or destroys one.
    Static,
}

/// Bounded retry with exponential backoff (used for `IN_USE` on destroy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retry {
    /// Attempts in total (at least 1).
    pub attempts: u32,
    /// Delay before the second attempt; doubled each time.
    pub initial: Duration,
    /// Upper bound of one delay.
    pub max: Duration,
}

impl Default for Retry {
    fn default() -> Self {
        Self {
            attempts: 6,
            initial: Duration::from_millis(200),
            max: Duration::from_secs(5),
        }
    }
}

/// Test hook: abort the process just before the rename of the Nth write of a
/// kind of file (counted per process, from 1). For crash tests only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteFault {
    /// The Nth checkpoint write.
    Checkpoint(u64),
    /// The Nth CDI spec write.
    Cdi(u64),
}

impl std::str::FromStr for WriteFault {
    type Err = String;

    /// `checkpoint:N` or `cdi:N`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (k, n) = s
            .split_once(':')
            .ok_or_else(|| format!("write fault {s:?}: expected checkpoint:N or cdi:N"))?;
        let n: u64 = n
            .parse()
            .map_err(|_| format!("write fault {s:?}: {n:?} is not a number"))?;
        match k {
            "checkpoint" => Ok(Self::Checkpoint(n)),
            "cdi" => Ok(Self::Cdi(n)),
            _ => Err(format!("write fault {s:?}: unknown kind {k:?}")),
        }
    }
}

/// Everything the plugin needs to know about its node and its files.
#[derive(Clone, Debug)]
pub struct PluginConfig {
    /// This node's name.
    pub node_name: String,
    /// The DRA driver name (`gpu.carve.dev`).
    pub driver_name: String,
    /// The ResourceSlice pool of this node (the node name unless configured).
    pub pool_name: String,
    /// Directory kubelet watches for registration sockets
    /// (`/var/lib/kubelet/plugins_registry`).
    pub plugins_registry_dir: PathBuf,
    /// This plugin's data directory, holding `dra.sock`
    /// (`/var/lib/kubelet/plugins/gpu.carve.dev`).
    pub plugin_dir: PathBuf,
    /// Directory for transient CDI specs (`/var/run/cdi`).
    pub cdi_dir: PathBuf,
    /// Checkpoint file.
    pub checkpoint_path: PathBuf,
    /// File holding the node boot id (`/proc/sys/kernel/random/boot_id`).
    pub boot_id_path: PathBuf,
    /// Pod UID; when set, socket names carry it so a new pod can take over
    /// without a gap (rolling update).
    pub pod_uid: Option<String>,
    /// Per-GPU policy by GPU index; GPUs not listed use `default_policy`.
    pub gpu_policy: BTreeMap<u32, GpuPolicy>,
    /// Policy of GPUs not listed in `gpu_policy`.
    pub default_policy: GpuPolicy,
    /// How often prepared claims whose ResourceClaim is gone are cleaned up;
    /// `None` disables the sweep.
    pub gc_interval: Option<Duration>,
    /// Retry of `IN_USE` on unprepare.
    pub unprepare_retry: Retry,
    /// How long one API-server call for a claim (the claim GET, the status
    /// PATCH, the GC's GET) may take, the wait for an API permit included;
    /// then the claim fails with an error naming the API server. Well under
    /// the kubelet's 45 s per prepare/unprepare call (default 10 s).
    pub api_timeout: Duration,
    /// Test hook, see [`WriteFault`]. `None` in production.
    pub write_fault: Option<WriteFault>,
    /// Where the driver records prepare/unprepare latencies and failure
    /// reasons, NVML call latencies, GI/CI counts per GPU (label: GPU UUID)
    /// and checkpoint writes. `None`: nothing is recorded.
    pub metrics: Option<std::sync::Arc<carve_metrics::Metrics>>,
    /// MPS sharing: how to run control daemons and what this node enforces
    /// (detected once at start). `None`: MPS devices are refused at prepare.
    pub mps: Option<MpsSetup>,
    /// The NVIDIA driver containers get (driver roots, the hook, the device
    /// files); see [`crate::DriverRootConfig`].
    pub driver: crate::driver_root::DriverRootConfig,
}

/// MPS on this node.
#[derive(Clone, Debug)]
pub struct MpsSetup {
    /// Control binary, state root, cgroup root, protocol choice, timeouts.
    pub config: carve_mps::MpsConfig,
    /// What [`carve_mps::detect`] found.
    pub support: carve_mps::Support,
}

impl PluginConfig {
    /// Defaults for a node: kubelet's standard paths, driver `gpu.carve.dev`,
    /// pool = node name, every GPU dynamic, GC every 10 minutes.
    #[must_use]
    pub fn new(node_name: impl Into<String>) -> Self {
        let node_name = node_name.into();
        let driver = carve_model::DRIVER_NAME.to_string();
        Self {
            pool_name: node_name.clone(),
            node_name,
            plugins_registry_dir: "/var/lib/kubelet/plugins_registry".into(),
            plugin_dir: PathBuf::from("/var/lib/kubelet/plugins").join(&driver),
            cdi_dir: "/var/run/cdi".into(),
            checkpoint_path: PathBuf::from("/var/lib/kubelet/plugins")
                .join(&driver)
                .join("checkpoint.json"),
            boot_id_path: "/proc/sys/kernel/random/boot_id".into(),
            driver_name: driver,
            pod_uid: None,
            gpu_policy: BTreeMap::new(),
            default_policy: GpuPolicy::Dynamic,
            gc_interval: Some(Duration::from_secs(600)),
            unprepare_retry: Retry::default(),
            api_timeout: Duration::from_secs(10),
            write_fault: None,
            metrics: None,
            mps: None,
            driver: crate::driver_root::DriverRootConfig::default(),
        }
    }

    /// The policy of GPU `index`.
    #[must_use]
    pub fn policy(&self, index: u32) -> GpuPolicy {
        self.gpu_policy
            .get(&index)
            .copied()
            .unwrap_or(self.default_policy)
    }
}

/// `apiVersion` of carve's opaque configuration.
pub const OPAQUE_API_VERSION: &str = "gpu.carve.dev/v1alpha1";

/// An NVIDIA driver capability a container gets (`NVIDIA_DRIVER_CAPABILITIES`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DriverCapability {
    /// CUDA and OpenCL.
    Compute,
    /// nvidia-smi and NVML.
    Utility,
    /// OpenGL and Vulkan.
    Graphics,
    /// Video codec SDK.
    Video,
    /// X11 display.
    Display,
    /// 32-bit libraries.
    Compat32,
    /// Everything.
    All,
}

impl DriverCapability {
    fn as_str(self) -> &'static str {
        match self {
            Self::Compute => "compute",
            Self::Utility => "utility",
            Self::Graphics => "graphics",
            Self::Video => "video",
            Self::Display => "display",
            Self::Compat32 => "compat32",
            Self::All => "all",
        }
    }
}

/// Configuration of whole-GPU devices (`kind: GpuConfig`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuConfig {
    /// Driver capabilities exposed to the container; unset = the runtime default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_capabilities: Option<Vec<DriverCapability>>,
}

/// Configuration of MIG devices (`kind: MigConfig`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MigConfig {
    /// Driver capabilities exposed to the container; unset = the runtime default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_capabilities: Option<Vec<DriverCapability>>,
}

/// Configuration of MPS shares (`kind: MpsConfig`): the enforcement a share
/// needs. A node that enforces less refuses the share at prepare, so a claim
/// that must not run with client-side limits never does, even if its
/// selectors did not ask for the `mpsMemoryLimit`/`mpsComputeLimit` attributes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MpsConfig {
    /// Required memory enforcement: `hard` or `client`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_limit: Option<carve_model::sharing::MemoryLimit>,
    /// Required compute enforcement: `partition`, `percentage` or `client`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_limit: Option<carve_model::sharing::ComputeLimit>,
}

/// One parsed opaque configuration object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OpaqueConfig {
    /// For whole GPUs.
    Gpu(GpuConfig),
    /// For MIG devices.
    Mig(MigConfig),
    /// For MPS shares.
    Mps(MpsConfig),
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct TypeMeta {
    api_version: Option<String>,
    kind: Option<String>,
}

/// Invalid opaque configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The parameters are not a JSON object with `apiVersion` and `kind`.
    #[error("opaque config #{index} ({source_kind}): {reason}")]
    Malformed {
        /// Position in `status.allocation.devices.config`.
        index: usize,
        /// `FromClass` or `FromClaim`.
        source_kind: String,
        /// What is wrong.
        reason: String,
    },
    /// `apiVersion` is not one carve knows.
    #[error(
        "opaque config #{index} ({source_kind}): unknown apiVersion {api_version:?} (expected {OPAQUE_API_VERSION})"
    )]
    UnknownVersion {
        /// Position.
        index: usize,
        /// `FromClass` or `FromClaim`.
        source_kind: String,
        /// The apiVersion given.
        api_version: String,
    },
    /// `kind` is not one carve knows.
    #[error(
        "opaque config #{index} ({source_kind}): unknown kind {kind:?} (expected GpuConfig, MigConfig or MpsConfig)"
    )]
    UnknownKind {
        /// Position.
        index: usize,
        /// `FromClass` or `FromClaim`.
        source_kind: String,
        /// The kind given.
        kind: String,
    },
    /// The fields do not match the kind (unknown field, wrong type, bad value).
    #[error("opaque config #{index} ({source_kind}) {kind}: {reason}")]
    Invalid {
        /// Position.
        index: usize,
        /// `FromClass` or `FromClaim`.
        source_kind: String,
        /// The kind.
        kind: String,
        /// serde's message, naming the field.
        reason: String,
    },
    /// A config of one kind applies to a device of the other kind.
    #[error(
        "opaque config #{index} ({source_kind}) of kind {kind} applies to request {request:?} whose device {device} is {device_kind}"
    )]
    WrongDeviceKind {
        /// Position.
        index: usize,
        /// `FromClass` or `FromClaim`.
        source_kind: String,
        /// The kind.
        kind: &'static str,
        /// The request.
        request: String,
        /// The device.
        device: String,
        /// `a whole GPU` or `a MIG device`.
        device_kind: &'static str,
    },
}

/// A parsed config entry with the requests it applies to.
#[derive(Clone, Debug)]
pub(crate) struct Applicable {
    pub index: usize,
    pub source_kind: String,
    pub from_claim: bool,
    pub requests: Vec<String>,
    pub config: OpaqueConfig,
}

/// Parse the configs of this driver in `status.allocation.devices.config`
/// (others are ignored), class configs first then claim configs, each group in
/// list order: later entries win.
pub(crate) fn parse_configs(
    driver: &str,
    configs: &[DeviceAllocationConfiguration],
) -> Result<Vec<Applicable>, ConfigError> {
    let mut out = Vec::new();
    for (index, c) in configs.iter().enumerate() {
        let Some(opaque) = &c.opaque else { continue };
        if opaque.driver != driver {
            continue;
        }
        let config = parse_opaque(index, &c.source, &opaque.parameters.0)?;
        out.push(Applicable {
            index,
            from_claim: c.source == "FromClaim",
            source_kind: c.source.clone(),
            requests: c.requests.clone().unwrap_or_default(),
            config,
        });
    }
    // Stable: class before claim, list order within each.
    out.sort_by_key(|a| a.from_claim);
    Ok(out)
}

/// The parameters `value` of config `index` (from `source_kind`): a JSON
/// object of this driver's `apiVersion` and one of its kinds.
fn parse_opaque(
    index: usize,
    source_kind: &str,
    value: &serde_json::Value,
) -> Result<OpaqueConfig, ConfigError> {
    let source_kind = source_kind.to_string();
    let malformed = |reason: String| ConfigError::Malformed {
        index,
        source_kind: source_kind.clone(),
        reason,
    };
    if !value.is_object() {
        return Err(malformed("parameters are not a JSON object".into()));
    }
    let meta: TypeMeta = serde_json::from_value(value.clone())
        .map_err(|e| malformed(format!("apiVersion/kind: {e}")))?;
    let api_version = meta
        .api_version
        .ok_or_else(|| malformed("apiVersion is missing".into()))?;
    let kind = meta
        .kind
        .ok_or_else(|| malformed("kind is missing".into()))?;
    if api_version != OPAQUE_API_VERSION {
        return Err(ConfigError::UnknownVersion {
            index,
            source_kind,
            api_version,
        });
    }
    let mut fields = value.clone();
    if let Some(m) = fields.as_object_mut() {
        m.remove("apiVersion");
        m.remove("kind");
    }
    let invalid = |e: serde_json::Error| ConfigError::Invalid {
        index,
        source_kind: source_kind.clone(),
        kind: kind.clone(),
        reason: e.to_string(),
    };
    let config = match kind.as_str() {
        "GpuConfig" => OpaqueConfig::Gpu(serde_json::from_value(fields).map_err(invalid)?),
        "MigConfig" => OpaqueConfig::Mig(serde_json::from_value(fields).map_err(invalid)?),
        "MpsConfig" => OpaqueConfig::Mps(serde_json::from_value(fields).map_err(invalid)?),
        _ => {
            return Err(ConfigError::UnknownKind {
                index,
                source_kind,
                kind,
            });
        }
    };
    Ok(config)
}

/// The effective driver capabilities of one device, or a config that does not
/// fit the device kind. `request` is the full request name (`req` or `req/sub`).
pub(crate) fn effective_capabilities(
    configs: &[Applicable],
    request: &str,
    device: &str,
    is_mig: bool,
) -> Result<Option<Vec<DriverCapability>>, ConfigError> {
    let parent = request.split('/').next().unwrap_or(request);
    let mut caps = None;
    for a in configs {
        let applies =
            a.requests.is_empty() || a.requests.iter().any(|r| r == request || r == parent);
        if !applies {
            continue;
        }
        let (kind, c) = match &a.config {
            OpaqueConfig::Gpu(g) => ("GpuConfig", &g.driver_capabilities),
            OpaqueConfig::Mig(m) => ("MigConfig", &m.driver_capabilities),
            // Checked by `effective_mps`; says nothing about capabilities.
            OpaqueConfig::Mps(_) => continue,
        };
        let fits = (kind == "MigConfig") == is_mig;
        if !fits {
            // A config for all requests (no `requests`) of the other kind is
            // simply not for this device; naming the request makes it an error.
            if a.requests.is_empty() {
                continue;
            }
            return Err(ConfigError::WrongDeviceKind {
                index: a.index,
                source_kind: a.source_kind.clone(),
                kind,
                request: request.to_string(),
                device: device.to_string(),
                device_kind: if is_mig {
                    "a MIG device"
                } else {
                    "a whole GPU"
                },
            });
        }
        if c.is_some() {
            caps.clone_from(c);
        }
    }
    Ok(caps)
}

/// The MPS requirements that apply to one device (later configs win per
/// field), or an `MpsConfig` naming a request whose device is not an MPS share.
pub(crate) fn effective_mps(
    configs: &[Applicable],
    request: &str,
    device: &str,
    is_share: bool,
) -> Result<MpsConfig, ConfigError> {
    let parent = request.split('/').next().unwrap_or(request);
    let mut out = MpsConfig::default();
    for a in configs {
        let OpaqueConfig::Mps(m) = &a.config else {
            continue;
        };
        let applies =
            a.requests.is_empty() || a.requests.iter().any(|r| r == request || r == parent);
        if !applies {
            continue;
        }
        if !is_share {
            if a.requests.is_empty() {
                continue;
            }
            return Err(ConfigError::WrongDeviceKind {
                index: a.index,
                source_kind: a.source_kind.clone(),
                kind: "MpsConfig",
                request: request.to_string(),
                device: device.to_string(),
                device_kind: "not an MPS share",
            });
        }
        if m.memory_limit.is_some() {
            out.memory_limit = m.memory_limit;
        }
        if m.compute_limit.is_some() {
            out.compute_limit = m.compute_limit;
        }
    }
    Ok(out)
}

/// `NVIDIA_DRIVER_CAPABILITIES` value.
pub(crate) fn capabilities_env(caps: &[DriverCapability]) -> String {
    let mut v: Vec<&str> = caps.iter().map(|c| c.as_str()).collect();
    v.sort_unstable();
    v.dedup();
    format!("NVIDIA_DRIVER_CAPABILITIES={}", v.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::OpaqueDeviceConfiguration;
    use k8s_openapi::apimachinery::pkg::runtime::RawExtension;

    fn cfg(
        source: &str,
        driver: &str,
        requests: &[&str],
        v: serde_json::Value,
    ) -> DeviceAllocationConfiguration {
        DeviceAllocationConfiguration {
            source: source.into(),
            requests: (!requests.is_empty())
                .then(|| requests.iter().map(|s| s.to_string()).collect()),
            opaque: Some(OpaqueDeviceConfiguration {
                driver: driver.into(),
                parameters: RawExtension(v),
            }),
        }
    }

    #[test]
    fn mps_config_applies_to_shares_only() {
        let a = parse_configs(
            "gpu.carve.dev",
            &[
                cfg("FromClass", "gpu.carve.dev", &[], serde_json::json!({"apiVersion": OPAQUE_API_VERSION, "kind": "MpsConfig", "computeLimit": "client"})),
                cfg("FromClaim", "gpu.carve.dev", &["s"], serde_json::json!({"apiVersion": OPAQUE_API_VERSION, "kind": "MpsConfig", "memoryLimit": "hard"})),
            ],
        )
        .unwrap();
        let m = effective_mps(&a, "s", "gpu-0-mps", true).unwrap();
        assert_eq!(
            m.memory_limit,
            Some(carve_model::sharing::MemoryLimit::Hard)
        );
        assert_eq!(
            m.compute_limit,
            Some(carve_model::sharing::ComputeLimit::Client)
        );
        // The class-wide one is simply not for an exclusive device; the named one is an error.
        assert_eq!(
            effective_mps(&a, "x", "gpu-0", false).unwrap(),
            MpsConfig::default()
        );
        let e = effective_mps(&a, "s", "gpu-0", false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("MpsConfig") && e.contains("not an MPS share"),
            "{e}"
        );
        // Capabilities ignore it.
        assert_eq!(
            effective_capabilities(&a, "s", "gpu-0-mps", false).unwrap(),
            None
        );
        let bad = parse_configs(
            "gpu.carve.dev",
            &[cfg("FromClaim", "gpu.carve.dev", &[], serde_json::json!({"apiVersion": OPAQUE_API_VERSION, "kind": "MpsConfig", "memoryLimit": "strict"}))],
        )
        .unwrap_err()
        .to_string();
        assert!(bad.contains("MpsConfig") && bad.contains("strict"), "{bad}");
    }

    fn mig(caps: &[&str]) -> serde_json::Value {
        serde_json::json!({"apiVersion": OPAQUE_API_VERSION, "kind": "MigConfig", "driverCapabilities": caps})
    }

    #[test]
    fn claim_wins_over_class_regardless_of_order() {
        let cs = vec![
            cfg("FromClaim", "gpu.carve.dev", &[], mig(&["compute"])),
            cfg("FromClass", "gpu.carve.dev", &[], mig(&["all"])),
            cfg("FromClass", "other.dev", &[], serde_json::json!({"x": 1})),
        ];
        let a = parse_configs("gpu.carve.dev", &cs).unwrap();
        assert_eq!(a.len(), 2);
        let caps = effective_capabilities(&a, "r", "gpu-0-mig-1g10gb-0", true).unwrap();
        assert_eq!(caps, Some(vec![DriverCapability::Compute]));
    }

    #[test]
    fn later_claim_config_wins_and_request_scoping_uses_parent() {
        let cs = vec![
            cfg("FromClaim", "gpu.carve.dev", &[], mig(&["compute"])),
            cfg("FromClaim", "gpu.carve.dev", &["a"], mig(&["utility"])),
        ];
        let a = parse_configs("gpu.carve.dev", &cs).unwrap();
        assert_eq!(
            effective_capabilities(&a, "a/sub", "d", true).unwrap(),
            Some(vec![DriverCapability::Utility])
        );
        assert_eq!(
            effective_capabilities(&a, "b", "d", true).unwrap(),
            Some(vec![DriverCapability::Compute])
        );
        assert_eq!(
            capabilities_env(&[DriverCapability::Utility, DriverCapability::Compute]),
            "NVIDIA_DRIVER_CAPABILITIES=compute,utility"
        );
    }

    #[test]
    fn bad_configs_name_what_is_wrong() {
        let cases = [
            (serde_json::json!([1]), "not a JSON object"),
            (
                serde_json::json!({"kind": "MigConfig"}),
                "apiVersion is missing",
            ),
            (
                serde_json::json!({"apiVersion": "gpu.carve.dev/v9", "kind": "MigConfig"}),
                "unknown apiVersion \"gpu.carve.dev/v9\"",
            ),
            (
                serde_json::json!({"apiVersion": OPAQUE_API_VERSION, "kind": "Nope"}),
                "unknown kind \"Nope\"",
            ),
            (
                serde_json::json!({"apiVersion": OPAQUE_API_VERSION, "kind": "MigConfig", "sharing": "mps"}),
                "unknown field `sharing`",
            ),
            (
                serde_json::json!({"apiVersion": OPAQUE_API_VERSION, "kind": "GpuConfig", "driverCapabilities": ["warp"]}),
                "unknown variant `warp`",
            ),
        ];
        for (v, want) in cases {
            let cs = vec![
                cfg(
                    "FromClass",
                    "gpu.carve.dev",
                    &[],
                    serde_json::json!({"apiVersion": OPAQUE_API_VERSION, "kind": "MigConfig"}),
                ),
                cfg("FromClaim", "gpu.carve.dev", &[], v),
            ];
            let e = parse_configs("gpu.carve.dev", &cs).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
            assert!(e.starts_with("opaque config #1 (FromClaim)"), "{e}");
        }
    }

    #[test]
    fn wrong_kind_for_named_request_is_an_error() {
        let cs = vec![cfg(
            "FromClaim",
            "gpu.carve.dev",
            &["whole"],
            serde_json::json!({"apiVersion": OPAQUE_API_VERSION, "kind": "MigConfig"}),
        )];
        let a = parse_configs("gpu.carve.dev", &cs).unwrap();
        let e = effective_capabilities(&a, "whole", "gpu-1", false).unwrap_err();
        assert!(e.to_string().contains("device gpu-1 is a whole GPU"), "{e}");
    }

    #[test]
    fn write_fault_parses() {
        assert_eq!("cdi:3".parse::<WriteFault>().unwrap(), WriteFault::Cdi(3));
        assert_eq!(
            "checkpoint:1".parse::<WriteFault>().unwrap(),
            WriteFault::Checkpoint(1)
        );
        assert!("disk:1".parse::<WriteFault>().is_err());
    }
}
