//! Checks a set of ResourceSlices against the `resource.k8s.io/v1` rules a
//! driver can break (dra-api.md A.1–A.5), for the 1.34 or the 1.35+ layout,
//! and for the rules that change with the Kubernetes minor version
//! ([`KubeVersion`]: taint effects, list-type attributes).
//!
//! Upstream sources of the rules (paraphrased, not copied):
//! `kubernetes/kubernetes` `pkg/apis/resource/validation/validation.go`
//! (commit `009801d930e2`, 1.37 development: `validateResourceSliceSpec`,
//! `validateDevice`, `validateDeviceTaint`, `validateRequestPolicy`,
//! `numEntriesDeviceAttribute`, `haveListAttributes`) and
//! `pkg/apis/core/validation` (`ValidateNodeSelector`,
//! `ValidateNodeSelectorRequirement`, `ValidateNodeFieldSelectorRequirement`);
//! the per-version differences from the `resource.k8s.io/v1` API documentation
//! of each release as k8s-openapi 0.29 carries it (`src/v1_34`, `v1_35`,
//! `v1_36`: `DeviceTaint.effect` is "NoSchedule and NoExecute" in 1.34 and
//! "None, NoSchedule and NoExecute" from 1.35; `DeviceAttribute.bools/ints/
//! strings/versions` exist from 1.36) and dra-api.md A.5.
//!
//! This is not the API server: it checks what carve publishes, plus the
//! cross-slice rules the 1.35+ API server leaves to the scheduler (a counter
//! reference that does not resolve makes the whole pool unallocatable).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement};
use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceAttribute, DeviceTaint, ResourceSlice,
};

use super::quantity::{self, Amount};
use super::{KubeLayout, SliceError};

/// Numeric limits of `resource.k8s.io/v1` (dra-api.md A.5).
pub mod limits {
    /// Devices per slice.
    pub const DEVICES_PER_SLICE: usize = 128;
    /// Devices per slice when any device has taints or consumes counters (1.35+).
    pub const DEVICES_PER_SLICE_ADVANCED: usize = 64;
    /// Counter sets per slice (1.35+).
    pub const COUNTER_SETS_PER_SLICE: usize = 8;
    /// Counters per counter set (1.35+).
    pub const COUNTERS_PER_SET: usize = 32;
    /// Counters in all counter sets of one slice (1.34).
    pub const SHARED_COUNTERS_PER_SLICE_V134: usize = 32;
    /// consumesCounters entries per device (1.35+).
    pub const CONSUMPTIONS_PER_DEVICE: usize = 2;
    /// Counters per consumesCounters entry (1.35+).
    pub const COUNTERS_PER_CONSUMPTION: usize = 32;
    /// Counters over all consumesCounters entries of one device (1.34).
    pub const COUNTERS_PER_DEVICE_V134: usize = 32;
    /// Device counter entries in one slice (1.34).
    pub const DEVICE_COUNTERS_PER_SLICE_V134: usize = 1024;
    /// Attributes plus capacities per device.
    pub const ATTRIBUTES_AND_CAPACITIES: usize = 32;
    /// Bytes of a string or version attribute.
    pub const ATTRIBUTE_STRING_BYTES: usize = 64;
    /// Taints per device in 1.34.
    pub const TAINTS_V134: usize = 4;
    /// Taints per device in 1.35+.
    pub const TAINTS: usize = 16;
    /// Driver name length.
    pub const DRIVER_NAME: usize = 63;
    /// Pool name length.
    pub const POOL_NAME: usize = 253;
    /// DNS label length.
    pub const DNS_LABEL: usize = 63;
    /// DNS subdomain length.
    pub const DNS_SUBDOMAIN: usize = 253;
    /// Length of the C-identifier part of an attribute or capacity name.
    pub const C_IDENTIFIER: usize = 32;
    /// Label value length.
    pub const LABEL_VALUE: usize = 63;
    /// Attribute values per device, each item of a list attribute counted
    /// (1.36+, upstream `ResourceSliceMaxAttributeValuesPerDevice` = 48).
    pub const ATTRIBUTE_VALUES_PER_DEVICE: usize = 48;
}

/// The taint effects the API server of a version accepts: 1.34 knows
/// `NoSchedule` and `NoExecute`; `None` arrives in 1.35 (upstream
/// `validDeviceTaintEffects`; k8s-openapi 0.29 `v1_34` / `v1_35`
/// `DeviceTaint.effect` documentation).
#[must_use]
pub fn taint_effects(version: KubeVersion) -> &'static [&'static str] {
    if version < KubeVersion::V1_35 {
        &["NoExecute", "NoSchedule"]
    } else {
        &["NoExecute", "NoSchedule", "None"]
    }
}

/// A Kubernetes `major.minor`, for the rules that change between releases.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KubeVersion {
    /// Major version (1).
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl KubeVersion {
    /// Kubernetes 1.34, the first with `resource.k8s.io/v1`.
    pub const V1_34: Self = Self::new(1, 34);
    /// Kubernetes 1.35: counter sets in their own slices, taint effect `None`.
    pub const V1_35: Self = Self::new(1, 35);
    /// Kubernetes 1.36: list-type attributes (gate DRAListTypeAttributes).
    pub const V1_36: Self = Self::new(1, 36);
    /// Kubernetes 1.37: the rules of 1.36 (no ResourceSlice rule carve
    /// meets changed; the real-cluster suite's default release, 1.37.2,
    /// accepts every slice carve publishes).
    pub const V1_37: Self = Self::new(1, 37);

    /// The versions whose rules carve models (slice layout, validation,
    /// feature gates): what a `--kube-version` flag may name.
    pub const MODELLED: [Self; 4] = [Self::V1_34, Self::V1_35, Self::V1_36, Self::V1_37];

    /// Whether carve models this version (see [`KubeVersion::MODELLED`]).
    #[must_use]
    pub fn is_modelled(self) -> bool {
        Self::MODELLED.contains(&self)
    }

    /// The modelled versions as `1.34, 1.35, 1.36, 1.37`, for errors.
    #[must_use]
    pub fn modelled_list() -> String {
        Self::MODELLED
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `major.minor`.
    #[must_use]
    pub const fn new(major: u32, minor: u32) -> Self {
        Self { major, minor }
    }

    /// The slice layout of this version.
    ///
    /// # Errors
    /// [`SliceError::UnsupportedVersion`] before 1.34.
    pub fn layout(self) -> Result<KubeLayout, SliceError> {
        KubeLayout::for_version(self.major, self.minor)
    }

    /// The oldest version of a layout: the strictest rules that layout is
    /// published under (1.35 rejects list attributes, which 1.36 accepts).
    #[must_use]
    pub fn oldest_of(layout: KubeLayout) -> Self {
        match layout {
            KubeLayout::V134 => Self::V1_34,
            KubeLayout::V135Plus => Self::V1_35,
        }
    }
}

impl fmt::Display for KubeVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// A rule of the ResourceSlice API; each [`ValidationError`] names one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rule {
    /// `metadata.name` is required and a DNS subdomain.
    SliceName,
    /// `metadata.labels` keys and values have label syntax.
    Label,
    /// `spec.driver` is a DNS subdomain of at most 63 characters.
    DriverName,
    /// `spec.pool.name` is one or more DNS subdomains joined by `/`, at most 253.
    PoolName,
    /// `spec.pool.generation` is at least 0 and the same in every slice of a pool.
    Generation,
    /// `spec.pool.resourceSliceCount` is positive and equals the slices of the pool.
    SliceCount,
    /// Exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection,
    /// each with a valid value (a nodeSelector: exactly one term, each
    /// requirement with a valid key, operator and values).
    NodeSelection,
    /// Too many devices in one slice.
    DevicesPerSlice,
    /// 1.35+: `devices` and `sharedCounters` are not both set.
    DevicesAndCounters,
    /// 1.35+: at most 8 counter sets per slice.
    CounterSetsPerSlice,
    /// A counter set name (or consumesCounters `counterSet`) is a DNS label.
    CounterSetName,
    /// Counter set names are unique in the pool.
    CounterSetUnique,
    /// A counters map is not empty.
    CountersEmpty,
    /// A counter name is a DNS label.
    CounterName,
    /// 1.35+: at most 32 counters per counter set.
    CountersPerSet,
    /// 1.34: at most 32 counters over all counter sets of a slice.
    SharedCountersTotal,
    /// A quantity (capacity, counter) parses.
    Quantity,
    /// A device name is a DNS label.
    DeviceName,
    /// Device names are unique in the pool.
    DeviceNameUnique,
    /// Attribute and capacity names are `[domain/]identifier`.
    AttributeName,
    /// A device attribute holds exactly one value.
    AttributeValue,
    /// String and version attributes are at most 64 bytes.
    StringLength,
    /// Version attributes are semver 2.0.0.
    VersionFormat,
    /// At most 32 attributes plus capacities per device.
    AttributeCount,
    /// A capacity `requestPolicy` needs `allowMultipleAllocations: true` and
    /// must follow the policy rules (default required with validValues or
    /// validRange, not both, values ascending, at most 10, within the
    /// capacity, range bounds and steps consistent).
    RequestPolicy,
    /// Device-level node selection only (and exactly) with perDeviceNodeSelection.
    DeviceNodeSelection,
    /// Too many taints on a device.
    TaintsPerDevice,
    /// A taint key is a label name (`[prefix/]name`), required.
    TaintKey,
    /// A taint value is empty or a label value.
    TaintValue,
    /// A taint effect is required and one the version accepts
    /// (1.34: NoSchedule, NoExecute; 1.35+: also None).
    TaintEffect,
    /// List-type attributes (`bools`, `ints`, `strings`, `versions`) exist
    /// from 1.36 only and must not be empty.
    ListAttribute,
    /// 1.36+: at most 48 attribute values per device, list items counted.
    AttributeValueCount,
    /// 1.35+: at most 2 consumesCounters entries per device, unique by counter set.
    ConsumptionEntries,
    /// 1.35+: at most 32 counters per consumesCounters entry.
    CountersPerConsumption,
    /// 1.34: at most 32 counters over all consumesCounters entries of a device.
    DeviceCountersTotal,
    /// 1.34: at most 1024 device counter entries per slice.
    SliceDeviceCounters,
    /// A consumed counter set exists (1.34: in the same slice; 1.35+: in the pool).
    CounterSetReference,
    /// A consumed counter exists in its counter set.
    CounterReference,
    /// A device consumes no more of a counter than the counter holds.
    CounterOverdraw,
}

impl Rule {
    /// Short kebab-case name of the rule.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SliceName => "slice-name",
            Self::Label => "label",
            Self::DriverName => "driver-name",
            Self::PoolName => "pool-name",
            Self::Generation => "generation",
            Self::SliceCount => "resource-slice-count",
            Self::NodeSelection => "node-selection",
            Self::DevicesPerSlice => "devices-per-slice",
            Self::DevicesAndCounters => "devices-and-shared-counters",
            Self::CounterSetsPerSlice => "counter-sets-per-slice",
            Self::CounterSetName => "counter-set-name",
            Self::CounterSetUnique => "counter-set-unique",
            Self::CountersEmpty => "counters-empty",
            Self::CounterName => "counter-name",
            Self::CountersPerSet => "counters-per-set",
            Self::SharedCountersTotal => "shared-counters-total",
            Self::Quantity => "quantity",
            Self::DeviceName => "device-name",
            Self::DeviceNameUnique => "device-name-unique",
            Self::AttributeName => "attribute-name",
            Self::AttributeValue => "attribute-value",
            Self::StringLength => "string-length",
            Self::VersionFormat => "version-format",
            Self::AttributeCount => "attribute-count",
            Self::RequestPolicy => "request-policy",
            Self::DeviceNodeSelection => "device-node-selection",
            Self::TaintsPerDevice => "taints-per-device",
            Self::TaintKey => "taint-key",
            Self::TaintValue => "taint-value",
            Self::TaintEffect => "taint-effect",
            Self::ListAttribute => "list-attribute",
            Self::AttributeValueCount => "attribute-value-count",
            Self::ConsumptionEntries => "consumes-counters-entries",
            Self::CountersPerConsumption => "counters-per-consumption",
            Self::DeviceCountersTotal => "device-counters-total",
            Self::SliceDeviceCounters => "slice-device-counters",
            Self::CounterSetReference => "counter-set-reference",
            Self::CounterReference => "counter-reference",
            Self::CounterOverdraw => "counter-overdraw",
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A ResourceSlice breaks a rule. Every variant names the slice and the rule.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    /// A slice-level field (or the slice's pool) breaks a rule.
    #[error("ResourceSlice {slice:?}: rule {rule}: {detail}")]
    Slice {
        /// `metadata.name` of the slice.
        slice: String,
        /// The rule.
        rule: Rule,
        /// What is wrong.
        detail: String,
    },
    /// A device breaks a rule.
    #[error("ResourceSlice {slice:?}, device {device:?}: rule {rule}: {detail}")]
    Device {
        /// `metadata.name` of the slice.
        slice: String,
        /// Device name.
        device: String,
        /// The rule.
        rule: Rule,
        /// What is wrong.
        detail: String,
    },
    /// A counter set breaks a rule.
    #[error("ResourceSlice {slice:?}, counter set {counter_set:?}: rule {rule}: {detail}")]
    CounterSet {
        /// `metadata.name` of the slice.
        slice: String,
        /// Counter set name.
        counter_set: String,
        /// The rule.
        rule: Rule,
        /// What is wrong.
        detail: String,
    },
}

impl ValidationError {
    /// The broken rule.
    #[must_use]
    pub fn rule(&self) -> Rule {
        match self {
            Self::Slice { rule, .. }
            | Self::Device { rule, .. }
            | Self::CounterSet { rule, .. } => *rule,
        }
    }

    /// The slice it is about.
    #[must_use]
    pub fn slice(&self) -> &str {
        match self {
            Self::Slice { slice, .. }
            | Self::Device { slice, .. }
            | Self::CounterSet { slice, .. } => slice,
        }
    }
}

// === name syntax ===

fn is_alnum_lower(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit()
}

/// RFC 1123 label: `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63.
pub(crate) fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= limits::DNS_LABEL
        && is_alnum_lower(b[0])
        && is_alnum_lower(b[b.len() - 1])
        && b.iter().all(|&c| is_alnum_lower(c) || c == b'-')
}

/// RFC 1123 subdomain as Kubernetes checks it: labels joined by `.`, at most 253
/// in all (Kubernetes does not check per-label length here).
pub(crate) fn is_dns_subdomain(s: &str) -> bool {
    let b = s.as_bytes();
    if b.is_empty() || b.len() > limits::DNS_SUBDOMAIN {
        return false;
    }
    // One pass: every label non-empty, of [-a-z0-9], starting and ending alphanumeric.
    let mut label_start = true;
    let mut prev = b'.';
    for &c in b {
        if c == b'.' {
            if label_start || !is_alnum_lower(prev) {
                return false;
            }
            label_start = true;
        } else {
            if !(is_alnum_lower(c) || (c == b'-' && !label_start)) {
                return false;
            }
            label_start = false;
        }
        prev = c;
    }
    !label_start && is_alnum_lower(prev)
}

/// Label value: empty, or `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`, at most 63.
pub(crate) fn is_label_value(s: &str) -> bool {
    let b = s.as_bytes();
    b.is_empty()
        || (b.len() <= limits::LABEL_VALUE
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric()
            && b.iter()
                .all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.')))
}

fn is_label_key(s: &str) -> bool {
    let (prefix, name) = match s.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    prefix.is_none_or(is_dns_subdomain) && !name.is_empty() && is_label_value(name)
}

/// C identifier `[A-Za-z_][A-Za-z0-9_]*`, at most 32.
fn is_c_identifier(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= limits::C_IDENTIFIER
        && (b[0].is_ascii_alphabetic() || b[0] == b'_')
        && b.iter().all(|&c| c.is_ascii_alphanumeric() || c == b'_')
}

/// Why a qualified attribute/capacity name is invalid, if it is.
fn qualified_name_problem(s: &str) -> Option<String> {
    let (domain, id) = match s.bytes().position(|b| b == b'/') {
        None => (None, s),
        Some(i) if !s.as_bytes()[i + 1..].contains(&b'/') => (Some(&s[..i]), &s[i + 1..]),
        Some(_) => return Some("more than one '/'".into()),
    };
    if let Some(d) = domain
        && (d.len() > limits::DRIVER_NAME || !is_dns_subdomain(d))
    {
        return Some(format!(
            "domain {d:?} is not a DNS subdomain of at most {} characters",
            limits::DRIVER_NAME
        ));
    }
    if !is_c_identifier(id) {
        return Some(format!(
            "{id:?} is not a C identifier of at most {} characters",
            limits::C_IDENTIFIER
        ));
    }
    None
}

fn semver_ident_ok(id: &str, numeric_no_leading_zero: bool) -> bool {
    !id.is_empty()
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        && !(numeric_no_leading_zero
            && id.bytes().all(|b| b.is_ascii_digit())
            && id.len() > 1
            && id.starts_with('0'))
}

/// Semantic version 2.0.0: `MAJOR.MINOR.PATCH[-pre][+build]`, no leading zeros.
pub(crate) fn is_semver(s: &str) -> bool {
    let (rest, build) = match s.split_once('+') {
        Some((r, b)) => (r, Some(b)),
        None => (s, None),
    };
    let (core, pre) = match rest.split_once('-') {
        Some((c, p)) => (c, Some(p)),
        None => (rest, None),
    };
    core.split('.').count() == 3
        && core.split('.').all(|n| {
            !n.is_empty()
                && n.bytes().all(|b| b.is_ascii_digit())
                && !(n.len() > 1 && n.starts_with('0'))
        })
        && pre.is_none_or(|p| p.split('.').all(|i| semver_ident_ok(i, true)))
        && build.is_none_or(|b| b.split('.').all(|i| semver_ident_ok(i, false)))
}

// === validation ===

/// One slice's context for error construction.
struct Ctx<'a> {
    slice: &'a str,
}

impl Ctx<'_> {
    fn slice(&self, rule: Rule, detail: impl Into<String>) -> ValidationError {
        ValidationError::Slice {
            slice: self.slice.to_string(),
            rule,
            detail: detail.into(),
        }
    }
    fn device(&self, device: &str, rule: Rule, detail: impl Into<String>) -> ValidationError {
        ValidationError::Device {
            slice: self.slice.to_string(),
            device: device.to_string(),
            rule,
            detail: detail.into(),
        }
    }
    fn set(&self, set: &str, rule: Rule, detail: impl Into<String>) -> ValidationError {
        ValidationError::CounterSet {
            slice: self.slice.to_string(),
            counter_set: set.to_string(),
            rule,
            detail: detail.into(),
        }
    }
}

fn slice_name(s: &ResourceSlice) -> &str {
    s.metadata.name.as_deref().unwrap_or("")
}

/// Validate slices as the API server of `layout` would, plus the cross-slice
/// references within each pool (pools are keyed by driver and pool name; every
/// slice of a pool must be given). The version-dependent rules are those of
/// the oldest version of the layout ([`KubeVersion::oldest_of`]: 1.34 or 1.35),
/// the strictest it is published under; [`validate_slices_for_version`] checks
/// one version.
///
/// # Errors
/// The first broken rule, naming the slice, the device or counter set, and the rule.
pub fn validate_slices(
    slices: &[ResourceSlice],
    layout: KubeLayout,
) -> Result<(), ValidationError> {
    validate_slices_for_version(slices, KubeVersion::oldest_of(layout))
}

/// The layout rules a version follows (before 1.34 there is no
/// `resource.k8s.io/v1`; such a version is checked as 1.34).
fn layout_of(version: KubeVersion) -> KubeLayout {
    if version < KubeVersion::V1_35 {
        KubeLayout::V134
    } else {
        KubeLayout::V135Plus
    }
}

/// [`validate_slices`] for the API server of one Kubernetes version: its
/// layout, taint effects (`None` from 1.35) and list-attribute rules (1.36+).
///
/// # Errors
/// The first broken rule, naming the slice, the device or counter set, and the rule.
pub fn validate_slices_for_version(
    slices: &[ResourceSlice],
    version: KubeVersion,
) -> Result<(), ValidationError> {
    let layout = layout_of(version);
    // Every consumed quantity, parsed once by the per-slice checks (in the
    // order slices, devices, consumesCounters entries, counters) and read
    // back in that order by the pool checks; `starts[i]` is where slice `i`'s
    // begin.
    // Sized up front (one counting pass) instead of regrown about ten
    // times per validation: 1 % of its instructions (callgrind).
    let entries = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .flat_map(|d| d.consumes_counters.iter().flatten())
        .map(|cc| cc.counters.len())
        .sum();
    let mut consumed = Vec::with_capacity(entries);
    let mut starts = Vec::with_capacity(slices.len());
    for s in slices {
        starts.push(consumed.len());
        validate_slice(s, version, &mut consumed)?;
    }
    validate_pools(slices, layout, &starts, &consumed)
}

fn validate_slice(
    s: &ResourceSlice,
    version: KubeVersion,
    consumed: &mut Vec<Amount>,
) -> Result<(), ValidationError> {
    let layout = layout_of(version);
    let name = slice_name(s);
    let c = Ctx { slice: name };
    if !is_dns_subdomain(name) {
        return Err(c.slice(
            Rule::SliceName,
            format!("metadata.name {name:?} is not a DNS subdomain (at most 253 characters)"),
        ));
    }
    for (k, v) in s.metadata.labels.iter().flatten() {
        if !is_label_key(k) {
            return Err(c.slice(Rule::Label, format!("label key {k:?} is invalid")));
        }
        if !is_label_value(v) {
            return Err(c.slice(
                Rule::Label,
                format!("label {k:?} value {v:?} is not a label value (at most 63 characters)"),
            ));
        }
    }
    let spec = &s.spec;
    let driver = spec.driver.to_ascii_lowercase();
    if driver.len() > limits::DRIVER_NAME || !is_dns_subdomain(&driver) {
        return Err(c.slice(
            Rule::DriverName,
            format!(
                "driver {:?} is not a DNS subdomain of at most {} characters",
                spec.driver,
                limits::DRIVER_NAME
            ),
        ));
    }
    let pool = &spec.pool.name;
    if pool.is_empty() || pool.len() > limits::POOL_NAME || !pool.split('/').all(is_dns_subdomain) {
        return Err(c.slice(
            Rule::PoolName,
            format!(
                "pool name {pool:?} is not DNS subdomains joined by '/' (at most {} characters)",
                limits::POOL_NAME
            ),
        ));
    }
    if spec.pool.generation < 0 {
        return Err(c.slice(
            Rule::Generation,
            format!("generation {} is negative", spec.pool.generation),
        ));
    }
    if spec.pool.resource_slice_count <= 0 {
        return Err(c.slice(
            Rule::SliceCount,
            format!(
                "resourceSliceCount {} is not positive",
                spec.pool.resource_slice_count
            ),
        ));
    }
    validate_node_selection(s, &c)?;

    let devices = spec.devices.as_deref().unwrap_or(&[]);
    let sets = spec.shared_counters.as_deref().unwrap_or(&[]);
    // Upstream `haveDeviceTaints || haveConsumesCounters || haveListAttributes`
    // (the last from 1.36; before, list attributes are refused per device).
    let advanced = devices.iter().any(|d| {
        d.consumes_counters.is_some()
            || d.taints.as_ref().is_some_and(|t| !t.is_empty())
            || d.attributes
                .iter()
                .flatten()
                .any(|(_, a)| is_list_attribute(a))
    });
    let max_devices = match layout {
        KubeLayout::V135Plus if advanced => limits::DEVICES_PER_SLICE_ADVANCED,
        _ => limits::DEVICES_PER_SLICE,
    };
    if devices.len() > max_devices {
        return Err(c.slice(
            Rule::DevicesPerSlice,
            format!("{} devices, at most {max_devices} allowed", devices.len()),
        ));
    }
    if layout == KubeLayout::V135Plus && spec.devices.is_some() && spec.shared_counters.is_some() {
        return Err(c.slice(
            Rule::DevicesAndCounters,
            "devices and sharedCounters are both set (1.35+ puts counter sets in their own slices; use devices: None, not an empty list)",
        ));
    }
    if layout == KubeLayout::V135Plus && sets.len() > limits::COUNTER_SETS_PER_SLICE {
        return Err(c.slice(
            Rule::CounterSetsPerSlice,
            format!(
                "{} counter sets, at most {} allowed",
                sets.len(),
                limits::COUNTER_SETS_PER_SLICE
            ),
        ));
    }
    let mut set_names = BTreeSet::new();
    let mut total_counters = 0usize;
    for set in sets {
        validate_counter_set(set, layout, &c)?;
        if !set_names.insert(set.name.as_str()) {
            return Err(c.set(
                &set.name,
                Rule::CounterSetUnique,
                "duplicate counter set name",
            ));
        }
        total_counters += set.counters.len();
    }
    if layout == KubeLayout::V134 && total_counters > limits::SHARED_COUNTERS_PER_SLICE_V134 {
        return Err(c.slice(
            Rule::SharedCountersTotal,
            format!(
                "{total_counters} counters over all counter sets, at most {} allowed in 1.34",
                limits::SHARED_COUNTERS_PER_SLICE_V134
            ),
        ));
    }
    let per_device = spec.per_device_node_selection == Some(true);
    let mut device_counters = 0usize;
    // The attributes of the last device that passed (see `validate_device`).
    let mut known_attributes = None;
    for d in devices {
        device_counters += validate_device(
            d,
            version,
            per_device,
            &set_names,
            &c,
            consumed,
            known_attributes,
        )?;
        known_attributes = d.attributes.as_ref();
    }
    if layout == KubeLayout::V134 && device_counters > limits::DEVICE_COUNTERS_PER_SLICE_V134 {
        return Err(c.slice(
            Rule::SliceDeviceCounters,
            format!(
                "{device_counters} device counter entries, at most {} allowed in 1.34",
                limits::DEVICE_COUNTERS_PER_SLICE_V134
            ),
        ));
    }
    Ok(())
}

fn validate_node_selection(s: &ResourceSlice, c: &Ctx<'_>) -> Result<(), ValidationError> {
    let spec = &s.spec;
    let set = [
        spec.node_name.is_some(),
        spec.node_selector.is_some(),
        spec.all_nodes.is_some(),
        spec.per_device_node_selection.is_some(),
    ]
    .iter()
    .filter(|&&b| b)
    .count();
    if set != 1 {
        return Err(c.slice(
            Rule::NodeSelection,
            format!(
                "{set} of nodeName, nodeSelector, allNodes, perDeviceNodeSelection are set, exactly one must be"
            ),
        ));
    }
    if let Some(n) = &spec.node_name
        && !is_dns_subdomain(n)
    {
        return Err(c.slice(
            Rule::NodeSelection,
            format!("nodeName {n:?} is not a valid node name"),
        ));
    }
    if let Some(sel) = &spec.node_selector
        && sel.node_selector_terms.len() != 1
    {
        return Err(c.slice(
            Rule::NodeSelection,
            format!(
                "nodeSelector has {} terms, exactly one is required",
                sel.node_selector_terms.len()
            ),
        ));
    }
    if let Some(sel) = &spec.node_selector
        && let Some(p) = node_selector_problem(sel)
    {
        return Err(c.slice(Rule::NodeSelection, format!("nodeSelector: {p}")));
    }
    if spec.all_nodes == Some(false) || spec.per_device_node_selection == Some(false) {
        return Err(c.slice(
            Rule::NodeSelection,
            "allNodes / perDeviceNodeSelection must be true when set",
        ));
    }
    Ok(())
}

/// Checks a counters map; pushes each parsed value to `parsed`.
fn validate_counters_map<'a>(
    counters: impl ExactSizeIterator<Item = (&'a String, &'a Counter)>,
    err: impl Fn(Rule, String) -> ValidationError,
    parsed: &mut Vec<Amount>,
) -> Result<(), ValidationError> {
    if counters.len() == 0 {
        return Err(err(Rule::CountersEmpty, "counters map is empty".into()));
    }
    for (k, v) in counters {
        if !is_dns_label(k) {
            return Err(err(
                Rule::CounterName,
                format!("counter name {k:?} is not a DNS label"),
            ));
        }
        parsed.push(
            quantity::parse(&v.value)
                .map_err(|e| err(Rule::Quantity, format!("counter {k:?}: {e}")))?,
        );
    }
    Ok(())
}

fn validate_counter_set(
    set: &CounterSet,
    layout: KubeLayout,
    c: &Ctx<'_>,
) -> Result<(), ValidationError> {
    if !is_dns_label(&set.name) {
        return Err(c.set(
            &set.name,
            Rule::CounterSetName,
            "counter set name is not a DNS label",
        ));
    }
    validate_counters_map(
        set.counters.iter(),
        |r, d| c.set(&set.name, r, d),
        &mut Vec::new(),
    )?;
    if layout == KubeLayout::V135Plus && set.counters.len() > limits::COUNTERS_PER_SET {
        return Err(c.set(
            &set.name,
            Rule::CountersPerSet,
            format!(
                "{} counters, at most {} allowed",
                set.counters.len(),
                limits::COUNTERS_PER_SET
            ),
        ));
    }
    Ok(())
}

/// Whether an attribute holds a list value (1.36+).
fn is_list_attribute(a: &DeviceAttribute) -> bool {
    a.bools.is_some() || a.ints.is_some() || a.strings.is_some() || a.versions.is_some()
}

/// Items of an attribute's list values.
fn list_len(a: &DeviceAttribute) -> usize {
    a.bools.as_ref().map_or(0, Vec::len)
        + a.ints.as_ref().map_or(0, Vec::len)
        + a.strings.as_ref().map_or(0, Vec::len)
        + a.versions.as_ref().map_or(0, Vec::len)
}

/// What is wrong with a taint for the API server of `version` (upstream
/// `validateDeviceTaint`): the key a label name, the value empty or a label
/// value, the effect required and one of [`taint_effects`].
#[must_use]
pub fn taint_problem(t: &DeviceTaint, version: KubeVersion) -> Option<(Rule, String)> {
    if !is_label_key(&t.key) {
        return Some((
            Rule::TaintKey,
            format!(
                "taint key {:?} is not a label name ([DNS subdomain/]name, name at most 63 characters)",
                t.key
            ),
        ));
    }
    if let Some(v) = &t.value
        && !is_label_value(v)
    {
        return Some((
            Rule::TaintValue,
            format!("taint {:?} value {v:?} is not a label value", t.key),
        ));
    }
    let effects = taint_effects(version);
    if t.effect.is_empty() {
        return Some((
            Rule::TaintEffect,
            format!(
                "taint {:?} has no effect; one of {effects:?} is required",
                t.key
            ),
        ));
    }
    if !effects.contains(&t.effect.as_str()) {
        return Some((
            Rule::TaintEffect,
            format!(
                "taint {:?} effect {:?} is not supported by Kubernetes {version}, which accepts {effects:?}",
                t.key, t.effect
            ),
        ));
    }
    None
}

/// What is wrong with a node selector's terms (upstream `ValidateNodeSelector`
/// with invalid label values not allowed, as the ResourceSlice validation
/// calls it): at least one term; in `matchExpressions` a label-name key,
/// `In`/`NotIn` with values, `Exists`/`DoesNotExist` without, `Gt`/`Lt` with
/// exactly one, every value a label value; in `matchFields` only
/// `metadata.name` with `In`/`NotIn` and exactly one node name.
fn node_selector_problem(sel: &NodeSelector) -> Option<String> {
    if sel.node_selector_terms.is_empty() {
        return Some("must have at least one node selector term".into());
    }
    let expression = |r: &NodeSelectorRequirement| -> Option<String> {
        let values = r.values.as_deref().unwrap_or(&[]);
        let ok = match r.operator.as_str() {
            "In" | "NotIn" => !values.is_empty(),
            "Exists" | "DoesNotExist" => values.is_empty(),
            "Gt" | "Lt" => values.len() == 1,
            other => return Some(format!("{other:?} is not a valid selector operator")),
        };
        if !ok {
            return Some(format!(
                "operator {} with {} values (In/NotIn need some, Exists/DoesNotExist none, Gt/Lt one)",
                r.operator,
                values.len()
            ));
        }
        if !is_label_key(&r.key) {
            return Some(format!("key {:?} is not a label name", r.key));
        }
        values
            .iter()
            .find(|v| !is_label_value(v))
            .map(|v| format!("value {v:?} of key {:?} is not a label value", r.key))
    };
    let field = |r: &NodeSelectorRequirement| -> Option<String> {
        let values = r.values.as_deref().unwrap_or(&[]);
        if !matches!(r.operator.as_str(), "In" | "NotIn") {
            return Some(format!(
                "matchFields operator {:?} is not a valid selector operator",
                r.operator
            ));
        }
        if values.len() != 1 {
            return Some(format!(
                "matchFields {} needs exactly one value, has {}",
                r.key,
                values.len()
            ));
        }
        if r.key != "metadata.name" {
            return Some(format!("{:?} is not a valid field selector key", r.key));
        }
        values
            .iter()
            .find(|v| !is_dns_subdomain(v))
            .map(|v| format!("matchFields value {v:?} is not a node name"))
    };
    sel.node_selector_terms.iter().find_map(|t| {
        t.match_expressions
            .iter()
            .flatten()
            .find_map(expression)
            .or_else(|| t.match_fields.iter().flatten().find_map(field))
    })
}

fn attribute_values(a: &DeviceAttribute) -> usize {
    [
        a.bool.is_some(),
        a.int.is_some(),
        a.string.is_some(),
        a.version.is_some(),
        a.bools.is_some(),
        a.ints.is_some(),
        a.strings.is_some(),
        a.versions.is_some(),
    ]
    .iter()
    .filter(|&&b| b)
    .count()
}

/// Returns the device's number of counter entries.
fn validate_device(
    d: &Device,
    version: KubeVersion,
    per_device_selection: bool,
    slice_sets: &BTreeSet<&str>,
    c: &Ctx<'_>,
    consumed: &mut Vec<Amount>,
    known_attributes: Option<&BTreeMap<String, DeviceAttribute>>,
) -> Result<usize, ValidationError> {
    let layout = layout_of(version);
    let name = d.name.as_str();
    let err = |rule, detail: String| c.device(name, rule, detail);
    if !is_dns_label(name) {
        return Err(err(
            Rule::DeviceName,
            "device name is not a DNS label".into(),
        ));
    }
    let attrs = d.attributes.as_ref();
    let caps = d.capacity.as_ref();
    // Both maps are sorted: walk the known attributes along with these. A
    // name equal to a known one is valid, and so is an attribute equal to a
    // known one, name and value (devices of one GPU share most of them).
    let mut known = known_attributes.into_iter().flatten().peekable();
    for (k, a) in attrs.into_iter().flatten() {
        while known.next_if(|(n, _)| *n < k).is_some() {}
        let same_name = known.peek().filter(|(n, _)| *n == k);
        if same_name.is_some_and(|(_, v)| *v == a) {
            continue;
        }
        if same_name.is_none()
            && let Some(p) = qualified_name_problem(k)
        {
            return Err(err(Rule::AttributeName, format!("attribute {k:?}: {p}")));
        }
        let n = attribute_values(a);
        if n != 1 {
            return Err(err(
                Rule::AttributeValue,
                format!("attribute {k:?} has {n} values, exactly one is required"),
            ));
        }
        if is_list_attribute(a) {
            if version < KubeVersion::V1_36 {
                return Err(err(
                    Rule::ListAttribute,
                    format!(
                        "attribute {k:?} is a list (bools/ints/strings/versions), which Kubernetes {version} does not know (1.36+ with DRAListTypeAttributes)"
                    ),
                ));
            }
            if list_len(a) == 0 {
                return Err(err(
                    Rule::ListAttribute,
                    format!("attribute {k:?} is an empty list; a list must not be empty if set"),
                ));
            }
        }
        let length = |s: &String| {
            if s.len() > limits::ATTRIBUTE_STRING_BYTES {
                return Err(err(
                    Rule::StringLength,
                    format!(
                        "attribute {k:?} value is {} bytes, at most {} allowed",
                        s.len(),
                        limits::ATTRIBUTE_STRING_BYTES
                    ),
                ));
            }
            Ok(())
        };
        let semver = |v: &String| {
            if !is_semver(v) {
                return Err(err(
                    Rule::VersionFormat,
                    format!("attribute {k:?} version {v:?} is not semver 2.0.0"),
                ));
            }
            Ok(())
        };
        // Lengths of all strings first, then version syntax.
        a.string.iter().try_for_each(length)?;
        a.version.iter().try_for_each(length)?;
        a.strings.iter().flatten().try_for_each(length)?;
        a.versions.iter().flatten().try_for_each(length)?;
        a.version.iter().try_for_each(semver)?;
        a.versions.iter().flatten().try_for_each(semver)?;
    }
    // Upstream `numEntriesDeviceAttribute`: a scalar counts 1, a list its items.
    let values: usize = attrs
        .into_iter()
        .flatten()
        .map(|(_, a)| {
            if is_list_attribute(a) {
                list_len(a).max(1)
            } else {
                1
            }
        })
        .sum();
    if values > limits::ATTRIBUTE_VALUES_PER_DEVICE {
        return Err(err(
            Rule::AttributeValueCount,
            format!(
                "{values} attribute values (list items counted), at most {} allowed",
                limits::ATTRIBUTE_VALUES_PER_DEVICE
            ),
        ));
    }
    let multi = d.allow_multiple_allocations == Some(true);
    for (k, cap) in caps.into_iter().flatten() {
        if let Some(p) = qualified_name_problem(k) {
            return Err(err(Rule::AttributeName, format!("capacity {k:?}: {p}")));
        }
        quantity::parse(&cap.value)
            .map_err(|e| err(Rule::Quantity, format!("capacity {k:?}: {e}")))?;
        if cap.request_policy.is_some() && !multi {
            return Err(err(
                Rule::RequestPolicy,
                format!(
                    "capacity {k:?} has a requestPolicy but allowMultipleAllocations is not true"
                ),
            ));
        }
        // The content rules (upstream `validateRequestPolicy`); carve's
        // checker is the one the sharing devices are built with.
        crate::sharing::check_request_policy(k, cap)
            .map_err(|e| err(Rule::RequestPolicy, e.to_string()))?;
    }
    let n = attrs.map_or(0, |a| a.len()) + caps.map_or(0, |c| c.len());
    if n > limits::ATTRIBUTES_AND_CAPACITIES {
        return Err(err(
            Rule::AttributeCount,
            format!(
                "{n} attributes and capacities, at most {} allowed",
                limits::ATTRIBUTES_AND_CAPACITIES
            ),
        ));
    }
    let own = [
        d.node_name.is_some(),
        d.node_selector.is_some(),
        d.all_nodes.is_some(),
    ]
    .iter()
    .filter(|&&b| b)
    .count();
    if let Some(sel) = &d.node_selector
        && let Some(p) = node_selector_problem(sel)
    {
        return Err(err(Rule::DeviceNodeSelection, format!("nodeSelector: {p}")));
    }
    if per_device_selection && own != 1 {
        return Err(err(
            Rule::DeviceNodeSelection,
            format!(
                "perDeviceNodeSelection is set, so exactly one of nodeName, nodeSelector, allNodes must be; {own} are"
            ),
        ));
    }
    if !per_device_selection && own != 0 {
        return Err(err(
            Rule::DeviceNodeSelection,
            "device sets node selection but the slice does not set perDeviceNodeSelection".into(),
        ));
    }
    let taints = d.taints.as_ref().map_or(0, Vec::len);
    let max_taints = match layout {
        KubeLayout::V134 => limits::TAINTS_V134,
        KubeLayout::V135Plus => limits::TAINTS,
    };
    if taints > max_taints {
        return Err(err(
            Rule::TaintsPerDevice,
            format!("{taints} taints, at most {max_taints} allowed"),
        ));
    }
    for t in d.taints.iter().flatten() {
        if let Some((rule, detail)) = taint_problem(t, version) {
            return Err(err(rule, detail));
        }
    }
    let consumes = d.consumes_counters.as_deref().unwrap_or(&[]);
    if layout == KubeLayout::V135Plus && consumes.len() > limits::CONSUMPTIONS_PER_DEVICE {
        return Err(err(
            Rule::ConsumptionEntries,
            format!(
                "{} consumesCounters entries, at most {} allowed",
                consumes.len(),
                limits::CONSUMPTIONS_PER_DEVICE
            ),
        ));
    }
    let mut total = 0usize;
    for (i, cc) in consumes.iter().enumerate() {
        if !is_dns_label(&cc.counter_set) {
            return Err(err(
                Rule::CounterSetName,
                format!(
                    "consumed counter set {:?} is not a DNS label",
                    cc.counter_set
                ),
            ));
        }
        if consumes[..i]
            .iter()
            .any(|o| o.counter_set == cc.counter_set)
        {
            return Err(err(
                Rule::ConsumptionEntries,
                format!(
                    "counter set {:?} is consumed by two entries",
                    cc.counter_set
                ),
            ));
        }
        validate_counters_map(
            cc.counters.iter(),
            |r, detail| err(r, format!("consumes from {:?}: {detail}", cc.counter_set)),
            consumed,
        )?;
        if layout == KubeLayout::V135Plus && cc.counters.len() > limits::COUNTERS_PER_CONSUMPTION {
            return Err(err(
                Rule::CountersPerConsumption,
                format!(
                    "{} counters consumed from {:?}, at most {} allowed",
                    cc.counters.len(),
                    cc.counter_set,
                    limits::COUNTERS_PER_CONSUMPTION
                ),
            ));
        }
        if layout == KubeLayout::V134 && !slice_sets.contains(cc.counter_set.as_str()) {
            return Err(err(
                Rule::CounterSetReference,
                format!(
                    "consumes counter set {:?}, which is not in this slice (1.34 requires it there)",
                    cc.counter_set
                ),
            ));
        }
        total += cc.counters.len();
    }
    if layout == KubeLayout::V134 && total > limits::COUNTERS_PER_DEVICE_V134 {
        return Err(err(
            Rule::DeviceCountersTotal,
            format!(
                "{total} consumed counters, at most {} allowed in 1.34",
                limits::COUNTERS_PER_DEVICE_V134
            ),
        ));
    }
    Ok(total)
}

/// A counter set's counters, sorted by name, with their parsed values.
type SetValues<'a> = Vec<(&'a str, Amount)>;

/// The cross-slice checks of every pool; `consumed` holds the parsed consumed
/// quantities of [`validate_slices`], slice `i`'s from `starts[i]`.
fn validate_pools(
    slices: &[ResourceSlice],
    _layout: KubeLayout,
    starts: &[usize],
    consumed: &[Amount],
) -> Result<(), ValidationError> {
    let mut pools: BTreeMap<(&str, &str), Vec<usize>> = BTreeMap::new();
    for (i, s) in slices.iter().enumerate() {
        pools
            .entry((s.spec.driver.as_str(), s.spec.pool.name.as_str()))
            .or_default()
            .push(i);
    }
    for ((_, pool), members) in pools {
        let first = &slices[members[0]];
        for &i in &members {
            let s = &slices[i];
            let c = Ctx {
                slice: slice_name(s),
            };
            if s.spec.pool.generation != first.spec.pool.generation {
                return Err(c.slice(
                    Rule::Generation,
                    format!(
                        "pool {pool:?}: generation {} differs from {} in slice {:?}",
                        s.spec.pool.generation,
                        first.spec.pool.generation,
                        slice_name(first)
                    ),
                ));
            }
            if s.spec.pool.resource_slice_count != members.len() as i64 {
                return Err(c.slice(
                    Rule::SliceCount,
                    format!(
                        "pool {pool:?}: resourceSliceCount {} but {} slices given",
                        s.spec.pool.resource_slice_count,
                        members.len()
                    ),
                ));
            }
        }
        // Counter sets of the pool: (slice, counters sorted by name).
        let mut sets: BTreeMap<&str, (&str, SetValues<'_>)> = BTreeMap::new();
        for &i in &members {
            let s = &slices[i];
            for set in s.spec.shared_counters.iter().flatten() {
                let c = Ctx {
                    slice: slice_name(s),
                };
                let mut values = Vec::with_capacity(set.counters.len());
                for (k, v) in &set.counters {
                    let a = quantity::parse(&v.value).map_err(|e| {
                        c.set(&set.name, Rule::Quantity, format!("counter {k:?}: {e}"))
                    })?;
                    values.push((k.as_str(), a));
                }
                if let Some((other, _)) = sets.insert(set.name.as_str(), (slice_name(s), values)) {
                    return Err(c.set(
                        &set.name,
                        Rule::CounterSetUnique,
                        format!("pool {pool:?}: counter set also defined in slice {other:?}"),
                    ));
                }
            }
        }
        let mut devices: HashMap<&str, &str> = HashMap::with_capacity(
            members
                .iter()
                .map(|&i| slices[i].spec.devices.as_ref().map_or(0, Vec::len))
                .sum(),
        );
        for &i in &members {
            let s = &slices[i];
            let c = Ctx {
                slice: slice_name(s),
            };
            let mut next = starts[i];
            for d in s.spec.devices.iter().flatten() {
                if let Some(other) = devices.insert(d.name.as_str(), slice_name(s)) {
                    return Err(c.device(
                        &d.name,
                        Rule::DeviceNameUnique,
                        format!("pool {pool:?}: device name also used in slice {other:?}"),
                    ));
                }
                for cc in d.consumes_counters.iter().flatten() {
                    let Some((_, values)) = sets.get(cc.counter_set.as_str()) else {
                        return Err(c.device(
                            &d.name,
                            Rule::CounterSetReference,
                            format!("pool {pool:?}: consumes counter set {:?}, which no slice of the pool defines", cc.counter_set),
                        ));
                    };
                    // Both sorted by name: walk them together.
                    let mut have = values.iter().peekable();
                    for (k, v) in &cc.counters {
                        let want = consumed[next];
                        next += 1;
                        while have.next_if(|(n, _)| *n < k.as_str()).is_some() {}
                        let Some(&&(_, have)) = have.peek().filter(|(n, _)| *n == k.as_str())
                        else {
                            return Err(c.device(
                                &d.name,
                                Rule::CounterReference,
                                format!("consumes counter {k:?}, which counter set {:?} does not define", cc.counter_set),
                            ));
                        };
                        if want > have {
                            return Err(c.device(
                                &d.name,
                                Rule::CounterOverdraw,
                                format!(
                                    "consumes {} of counter {k:?} in set {:?}, which holds {have}",
                                    v.value.0, cc.counter_set,
                                ),
                            ));
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn name_syntax() {
        assert!(is_dns_label("gpu-0-mig-1g10gb-3"));
        assert!(!is_dns_label("gpu_0"));
        assert!(!is_dns_label("-gpu"));
        assert!(!is_dns_label(&"a".repeat(64)));
        assert!(is_dns_subdomain("node-1.example.com"));
        assert!(!is_dns_subdomain("node..x"));
        assert!(!is_dns_subdomain("Node"));
        assert!(is_label_value(""));
        assert!(is_label_value("Node_1.x"));
        assert!(!is_label_value("-x"));
        assert!(is_label_key("app.kubernetes.io/managed-by"));
        assert!(!is_label_key("a/b/c"));
        assert_eq!(qualified_name_problem("productName"), None);
        assert_eq!(
            qualified_name_problem("resource.kubernetes.io/pciBusID"),
            None
        );
        assert!(qualified_name_problem("a/b/c").is_some());
        assert!(qualified_name_problem("1abc").is_some());
        assert!(qualified_name_problem(&"a".repeat(33)).is_some());
        assert!(qualified_name_problem("Bad_Domain/x").is_some());
    }

    #[test]
    fn semver_syntax() {
        for ok in [
            "580.65.6",
            "9.0.0",
            "1.2.3-rc.1+build.7",
            "0.0.0",
            "1.0.0-0a",
        ] {
            assert!(is_semver(ok), "{ok}");
        }
        for bad in [
            "580.65.06",
            "9.0",
            "1.2.3.4",
            "01.2.3",
            "1.2.3-01",
            "1.2.3+",
            "1.2.3-",
            "v1.2.3",
        ] {
            assert!(!is_semver(bad), "{bad}");
        }
    }
}
