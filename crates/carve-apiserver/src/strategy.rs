//! What the real API server does to a `resource.k8s.io/v1` object before it
//! stores it, for the rules that change with the Kubernetes version or a
//! feature gate: fields dropped while their gate is off, and the
//! version-dependent ResourceSlice validation (answered with 422 Invalid).
//!
//! Written from the upstream sources, paraphrased:
//!
//! * Gated fields (`pkg/registry/resource/resourceslice/strategy.go` and
//!   `.../resourceclaim/strategy.go`, `dropDisabledFields`): a field of a gate
//!   that is off is cleared on create, and on update unless the stored object
//!   already uses that gate's fields. DRADeviceTaints: every device's
//!   `taints`. DRAPartitionableDevices: `sharedCounters`,
//!   `perDeviceNodeSelection`, and every device's `consumesCounters`,
//!   `nodeName`, `nodeSelector`, `allNodes`. DRAConsumableCapacity: every
//!   device's `allowMultipleAllocations` and its capacities' `requestPolicy`
//!   (both `+featureGate=DRAConsumableCapacity` fields); in a ResourceClaim
//!   the requests' `capacity` and constraints' `distinctAttribute` (spec) and
//!   the allocation results' `shareID` and `consumedCapacity` and
//!   `status.devices[].shareID` (status).
//! * Unknown fields: a JSON field the version does not define is dropped on
//!   decoding (the default `fieldValidation=Warn`). List-type attributes
//!   (`bools`, `ints`, `strings`, `versions`) exist from 1.36 only
//!   (k8s-openapi 0.29 `v1_35` vs `v1_36` `DeviceAttribute`), so on 1.34 and
//!   1.35 an attribute that holds only a list is left with no value and fails
//!   "exactly one value must be specified".
//! * Validation (`pkg/apis/resource/validation/validation.go`,
//!   `validateResourceSliceSpec`, `validateDevice`, `validateDeviceTaint`,
//!   `validateSingleAllocatableDeviceCapacity`): taints per device at most 4
//!   on 1.34 and 16 from 1.35 (`DeviceTaintsMaxLength`); a taint key is a
//!   label name, its value empty or a label value, its effect required and
//!   one of `NoSchedule`, `NoExecute` (1.34) or also `None` (1.35+,
//!   `validDeviceTaintEffects`; k8s-openapi 0.29 `v1_34`/`v1_35`
//!   `DeviceTaint.effect`); a device's taints equal to its stored taints are
//!   not validated again (ratcheting, as upstream `validateDevice`);
//!   1.35+: `sharedCounters` and `devices` not both set; 1.34: a device's
//!   `consumesCounters[].counterSet` names a counter set of the same slice
//!   (KEP-4815 alpha revision 1, dra-api.md A.4); at most 128 devices per
//!   slice, 64 from 1.35 when a device has taints or consumes counters (1.36:
//!   or a list attribute, `ResourceSliceMaxDevicesWithAdvancedFeatures`);
//!   1.36+: at most 48 attribute values per device, list items counted
//!   (`ResourceSliceMaxAttributeValuesPerDevice`), a list not empty; a
//!   capacity `requestPolicy` only with `allowMultipleAllocations: true`.
//!
//! * Granular status authorization (DRAResourceClaimGranularStatusAuthorization,
//!   1.36+; `pkg/registry/resource/resourceclaim/strategy.go`
//!   `resourceclaimStatusStrategy.ValidateUpdate` and
//!   `pkg/registry/resource/utils.go`): see [`authorize_claim_status`]; only
//!   for requests of a registered identity (crate `authz` module).
//!
//! Nothing else of a ResourceSlice or ResourceClaim is validated here (in
//! particular not the admin-access namespace label, and stale
//! `status.devices` entries are not dropped on deallocation).

use std::collections::BTreeSet;

use serde_json::{Map, Value};

use crate::KubeVersion;
use crate::authz::{Attributes, Identity, forbidden_message};
use crate::resource::Resource;
use crate::store::{ApiError, Part};

/// The feature gates the stand-in models: three whose fields it drops
/// while they are off, and one that adds authorization checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FeatureGate {
    /// `DRAPartitionableDevices`.
    PartitionableDevices,
    /// `DRADeviceTaints`.
    DeviceTaints,
    /// `DRAConsumableCapacity`.
    ConsumableCapacity,
    /// `DRAResourceClaimGranularStatusAuthorization`: beta and on by default
    /// from 1.36, absent before (`pkg/features/kube_features.go`; it depends
    /// on DRAResourceClaimDeviceStatus, beta on from 1.33 and GA in 1.37,
    /// which the stand-in treats as always on). While on, a ResourceClaim
    /// status write by a registered identity ([`crate::ApiServer::set_identity`])
    /// needs `resourceclaims/binding` to change the allocation or
    /// reservedFor and `resourceclaims/driver` per driver to change
    /// `status.devices` (the crate's `strategy` module has the details).
    ResourceClaimGranularStatusAuthorization,
}

impl FeatureGate {
    /// Every gate.
    pub const ALL: [FeatureGate; 4] = [
        FeatureGate::PartitionableDevices,
        FeatureGate::DeviceTaints,
        FeatureGate::ConsumableCapacity,
        FeatureGate::ResourceClaimGranularStatusAuthorization,
    ];

    /// The gate's name.
    pub fn name(self) -> &'static str {
        match self {
            FeatureGate::PartitionableDevices => "DRAPartitionableDevices",
            FeatureGate::DeviceTaints => "DRADeviceTaints",
            FeatureGate::ConsumableCapacity => "DRAConsumableCapacity",
            FeatureGate::ResourceClaimGranularStatusAuthorization => {
                "DRAResourceClaimGranularStatusAuthorization"
            }
        }
    }

    /// The first version that has the gate (`None`: every version served).
    pub fn since(self) -> Option<KubeVersion> {
        match self {
            FeatureGate::ResourceClaimGranularStatusAuthorization => Some(V1_36),
            _ => None,
        }
    }
}

/// Which gates are set on. A gate a version does not have is off whatever
/// is set here, see [`Gates::effective`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Gates {
    pub partitionable_devices: bool,
    pub device_taints: bool,
    pub consumable_capacity: bool,
    pub granular_status_authorization: bool,
}

impl Default for Gates {
    /// All on (the stand-in's default; the real 1.34 and 1.35 default of
    /// the first three is off; the fourth is on by default where it exists).
    fn default() -> Self {
        Gates {
            partitionable_devices: true,
            device_taints: true,
            consumable_capacity: true,
            granular_status_authorization: true,
        }
    }
}

impl Gates {
    pub fn get(&self, g: FeatureGate) -> bool {
        match g {
            FeatureGate::PartitionableDevices => self.partitionable_devices,
            FeatureGate::DeviceTaints => self.device_taints,
            FeatureGate::ConsumableCapacity => self.consumable_capacity,
            FeatureGate::ResourceClaimGranularStatusAuthorization => {
                self.granular_status_authorization
            }
        }
    }

    pub fn set(&mut self, g: FeatureGate, on: bool) {
        match g {
            FeatureGate::PartitionableDevices => self.partitionable_devices = on,
            FeatureGate::DeviceTaints => self.device_taints = on,
            FeatureGate::ConsumableCapacity => self.consumable_capacity = on,
            FeatureGate::ResourceClaimGranularStatusAuthorization => {
                self.granular_status_authorization = on;
            }
        }
    }

    /// The gates in force at `version`: those it does not have are off.
    pub fn effective(mut self, version: KubeVersion) -> Gates {
        for g in FeatureGate::ALL {
            if g.since().is_some_and(|v| version < v) {
                self.set(g, false);
            }
        }
        self
    }
}

const V1_35: KubeVersion = KubeVersion {
    major: 1,
    minor: 35,
};
const V1_36: KubeVersion = KubeVersion {
    major: 1,
    minor: 36,
};

fn devices(obj: &Value) -> &[Value] {
    obj.pointer("/spec/devices")
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

fn devices_mut(obj: &mut Value) -> Vec<&mut Map<String, Value>> {
    obj.pointer_mut("/spec/devices")
        .and_then(Value::as_array_mut)
        .map(|a| a.iter_mut().filter_map(Value::as_object_mut).collect())
        .unwrap_or_default()
}

fn non_empty(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(_) => true,
    }
}

fn any_device(obj: Option<&Value>, f: impl Fn(&Value) -> bool) -> bool {
    obj.is_some_and(|o| devices(o).iter().any(f))
}

fn has_policy(d: &Value) -> bool {
    d.get("capacity")
        .and_then(Value::as_object)
        .is_some_and(|c| c.values().any(|c| non_empty(c.get("requestPolicy"))))
}

/// Whether a ResourceSlice uses the fields of DRAPartitionableDevices.
pub(crate) fn uses_partitionable_fields(obj: &Value) -> bool {
    non_empty(obj.pointer("/spec/sharedCounters"))
        || obj.pointer("/spec/perDeviceNodeSelection").is_some()
        || devices(obj).iter().any(|d| {
            non_empty(d.get("consumesCounters"))
                || d.get("nodeName").is_some()
                || d.get("nodeSelector").is_some()
                || d.get("allNodes").is_some()
        })
}

/// Drops the fields of the gates that are off, as the registry strategy
/// does (`old`: the stored object on update).
fn drop_disabled_slice_fields(obj: &mut Value, old: Option<&Value>, gates: Gates) {
    if !gates.device_taints && !any_device(old, |d| non_empty(d.get("taints"))) {
        for d in devices_mut(obj) {
            d.remove("taints");
        }
    }
    if !gates.partitionable_devices && !old.is_some_and(uses_partitionable_fields) {
        if let Some(spec) = obj.get_mut("spec").and_then(Value::as_object_mut) {
            spec.remove("sharedCounters");
            spec.remove("perDeviceNodeSelection");
        }
        for d in devices_mut(obj) {
            for f in ["consumesCounters", "nodeName", "nodeSelector", "allNodes"] {
                d.remove(f);
            }
        }
    }
    if !gates.consumable_capacity
        && !any_device(old, |d| {
            d.get("allowMultipleAllocations").is_some() || has_policy(d)
        })
    {
        for d in devices_mut(obj) {
            d.remove("allowMultipleAllocations");
            if let Some(caps) = d.get_mut("capacity").and_then(Value::as_object_mut) {
                for c in caps.values_mut().filter_map(Value::as_object_mut) {
                    c.remove("requestPolicy");
                }
            }
        }
    }
}

const LIST_FIELDS: [&str; 4] = ["bools", "ints", "strings", "versions"];

/// Before 1.36 the list fields of an attribute are unknown and dropped.
fn drop_unknown_fields(obj: &mut Value, version: KubeVersion) {
    if version >= V1_36 {
        return;
    }
    for d in devices_mut(obj) {
        if let Some(attrs) = d.get_mut("attributes").and_then(Value::as_object_mut) {
            for a in attrs.values_mut().filter_map(Value::as_object_mut) {
                for f in LIST_FIELDS {
                    a.remove(f);
                }
            }
        }
    }
}

/// Label value: empty, or at most 63 of `[A-Za-z0-9._-]` starting and ending alphanumeric.
fn is_label_value(s: &str) -> bool {
    let b = s.as_bytes();
    b.is_empty()
        || (b.len() <= 63
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric()
            && b.iter()
                .all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.')))
}

/// DNS-1123 subdomain, at most 253.
fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253
        && !s.is_empty()
        && s.split('.').all(|l| {
            let b = l.as_bytes();
            !b.is_empty()
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter()
                    .all(|&c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
        })
}

/// Label name (`metav1validation.ValidateLabelName`): `[prefix/]name`, the
/// prefix a DNS subdomain, the name non-empty and a label value.
fn is_label_name(s: &str) -> bool {
    let (prefix, name) = match s.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    prefix.is_none_or(is_dns_subdomain) && !name.is_empty() && is_label_value(name)
}

fn taint_effects(version: KubeVersion) -> &'static [&'static str] {
    if version < V1_35 {
        &["NoExecute", "NoSchedule"]
    } else {
        &["NoExecute", "NoSchedule", "None"]
    }
}

fn is_list(a: &Value) -> bool {
    LIST_FIELDS.iter().any(|f| a.get(*f).is_some())
}

/// The version-dependent validation of one ResourceSlice; every error as
/// `field: message`.
fn validate_slice(obj: &Value, old: Option<&Value>, version: KubeVersion) -> Vec<String> {
    let mut errs = Vec::new();
    let devs = devices(obj);
    if version >= V1_35
        && obj.pointer("/spec/sharedCounters").is_some()
        && obj.pointer("/spec/devices").is_some()
    {
        errs.push(
            "spec: Invalid value: \"\": only one of `sharedCounters` or `devices` is allowed"
                .to_string(),
        );
    }
    let advanced = version >= V1_35
        && devs.iter().any(|d| {
            non_empty(d.get("taints"))
                || non_empty(d.get("consumesCounters"))
                || (version >= V1_36
                    && d.get("attributes")
                        .and_then(Value::as_object)
                        .is_some_and(|a| a.values().any(is_list)))
        });
    let max_devices = if advanced { 64 } else { 128 };
    if devs.len() > max_devices {
        errs.push(format!(
            "spec.devices: Too many: {}: must have at most {max_devices} items",
            devs.len()
        ));
    }
    let sets: BTreeSet<&str> = obj
        .pointer("/spec/sharedCounters")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|s| s.get("name").and_then(Value::as_str))
        .collect();
    let max_taints = if version < V1_35 { 4 } else { 16 };
    let effects = taint_effects(version);
    for (i, d) in devs.iter().enumerate() {
        let path = format!("spec.devices[{i}]");
        let name = d.get("name").and_then(Value::as_str).unwrap_or("");
        let old_device = old.and_then(|o| {
            devices(o)
                .iter()
                .find(|od| od.get("name").and_then(Value::as_str) == Some(name))
        });
        let taints = d
            .get("taints")
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice);
        let unchanged = old_device.is_some_and(|od| od.get("taints") == d.get("taints"));
        if !unchanged {
            if taints.len() > max_taints {
                errs.push(format!(
                    "{path}.taints: Too many: {}: must have at most {max_taints} items",
                    taints.len()
                ));
            }
            for (k, t) in taints.iter().enumerate() {
                let tp = format!("{path}.taints[{k}]");
                let key = t.get("key").and_then(Value::as_str).unwrap_or("");
                if !is_label_name(key) {
                    errs.push(format!(
                        "{tp}.key: Invalid value: {key:?}: must be a label name"
                    ));
                }
                if let Some(v) = t.get("value").and_then(Value::as_str)
                    && !is_label_value(v)
                {
                    errs.push(format!(
                        "{tp}.value: Invalid value: {v:?}: must be a label value"
                    ));
                }
                match t.get("effect").and_then(Value::as_str).unwrap_or("") {
                    "" => errs.push(format!("{tp}.effect: Required value")),
                    e if !effects.contains(&e) => errs.push(format!(
                        "{tp}.effect: Unsupported value: {e:?}: supported values: {}",
                        effects
                            .iter()
                            .map(|e| format!("{e:?}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    )),
                    _ => {}
                }
            }
        }
        if version < V1_35 {
            for (k, cc) in d
                .get("consumesCounters")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .enumerate()
            {
                let set = cc.get("counterSet").and_then(Value::as_str).unwrap_or("");
                if !sets.contains(set) {
                    errs.push(format!(
                        "{path}.consumesCounters[{k}].counterSet: Invalid value: {set:?}: must reference a counter set defined in the ResourceSlice sharedCounters"
                    ));
                }
            }
        }
        let mut values = 0usize;
        for (an, a) in d
            .get("attributes")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
        {
            let set = ["bool", "int", "string", "version"]
                .iter()
                .chain(LIST_FIELDS.iter())
                .filter(|f| a.get(**f).is_some())
                .count();
            if set != 1 {
                errs.push(format!(
                    "{path}.attributes[{an}]: Invalid value: exactly one value must be specified"
                ));
            }
            let items: usize = LIST_FIELDS
                .iter()
                .filter_map(|f| a.get(*f).and_then(Value::as_array))
                .map(Vec::len)
                .sum();
            for f in LIST_FIELDS {
                if a.get(f)
                    .and_then(Value::as_array)
                    .is_some_and(Vec::is_empty)
                {
                    errs.push(format!(
                        "{path}.attributes[{an}].{f}: Invalid value: must not be empty if specified"
                    ));
                }
            }
            values += if is_list(a) { items } else { 1 };
        }
        if version >= V1_36 && values > 48 {
            errs.push(format!(
                "{path}: Invalid value: {values}: the total number of attribute values must not exceed 48"
            ));
        }
        if d.get("allowMultipleAllocations") != Some(&Value::Bool(true)) {
            for (cn, c) in d
                .get("capacity")
                .and_then(Value::as_object)
                .into_iter()
                .flatten()
            {
                if non_empty(c.get("requestPolicy")) {
                    errs.push(format!(
                        "{path}.capacity[{cn}].requestPolicy: Forbidden: allowMultipleAllocations must be true"
                    ));
                }
            }
        }
    }
    errs
}

/// Whether a ResourceClaim uses the fields of DRAConsumableCapacity
/// (upstream `draConsumableCapacityFeatureInUse`).
fn claim_uses_consumable_capacity(c: &Value) -> bool {
    let spec_uses = c
        .pointer("/spec/devices/requests")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .any(|r| {
            r.pointer("/exactly/capacity").is_some()
                || r.get("firstAvailable")
                    .and_then(Value::as_array)
                    .is_some_and(|s| s.iter().any(|s| s.get("capacity").is_some()))
        })
        || c.pointer("/spec/devices/constraints")
            .and_then(Value::as_array)
            .is_some_and(|cs| cs.iter().any(|c| c.get("distinctAttribute").is_some()));
    let results = c
        .pointer("/status/allocation/devices/results")
        .and_then(Value::as_array)
        .is_some_and(|rs| {
            rs.iter()
                .any(|r| r.get("shareID").is_some() || r.get("consumedCapacity").is_some())
        });
    let devices = c
        .pointer("/status/devices")
        .and_then(Value::as_array)
        .is_some_and(|ds| ds.iter().any(|d| d.get("shareID").is_some()));
    spec_uses || results || devices
}

fn drop_disabled_claim_fields(obj: &mut Value, old: Option<&Value>, part: Part, gates: Gates) {
    if gates.consumable_capacity || old.is_some_and(claim_uses_consumable_capacity) {
        return;
    }
    match part {
        Part::Main => {
            if let Some(reqs) = obj
                .pointer_mut("/spec/devices/requests")
                .and_then(Value::as_array_mut)
            {
                for r in reqs {
                    if let Some(e) = r.get_mut("exactly").and_then(Value::as_object_mut) {
                        e.remove("capacity");
                    }
                    for s in r
                        .get_mut("firstAvailable")
                        .and_then(Value::as_array_mut)
                        .into_iter()
                        .flatten()
                        .filter_map(Value::as_object_mut)
                    {
                        s.remove("capacity");
                    }
                }
            }
            for c in obj
                .pointer_mut("/spec/devices/constraints")
                .and_then(Value::as_array_mut)
                .into_iter()
                .flatten()
                .filter_map(Value::as_object_mut)
            {
                c.remove("distinctAttribute");
            }
        }
        Part::Status => {
            for r in obj
                .pointer_mut("/status/allocation/devices/results")
                .and_then(Value::as_array_mut)
                .into_iter()
                .flatten()
                .filter_map(Value::as_object_mut)
            {
                r.remove("shareID");
                r.remove("consumedCapacity");
            }
            for d in obj
                .pointer_mut("/status/devices")
                .and_then(Value::as_array_mut)
                .into_iter()
                .flatten()
                .filter_map(Value::as_object_mut)
            {
                d.remove("shareID");
            }
        }
    }
}

/// Prepares `obj` for storing, as the real API server of `version` with
/// `gates` would: drops disabled and unknown fields, then validates.
/// `old` is the stored object on update and patch.
///
/// # Errors
/// 422 Invalid listing every broken rule.
pub(crate) fn prepare(
    res: Resource,
    part: Part,
    obj: &mut Value,
    old: Option<&Value>,
    version: KubeVersion,
    gates: Gates,
) -> Result<(), ApiError> {
    match res {
        Resource::ResourceSlices if part == Part::Main => {
            drop_disabled_slice_fields(obj, old, gates);
            drop_unknown_fields(obj, version);
            let errs = validate_slice(obj, old, version);
            if errs.is_empty() {
                Ok(())
            } else {
                let name = obj
                    .pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                Err(ApiError::invalid(res, name, &errs.join(", ")))
            }
        }
        Resource::ResourceClaims => {
            drop_disabled_claim_fields(obj, old, part, gates);
            Ok(())
        }
        _ => Ok(()),
    }
}

/// `v` with every `null`, empty list and empty object removed (recursively),
/// `Null` if nothing is left: Go's semantic equality treats a nil and an
/// empty slice or map, and an absent and a null pointer, alike.
fn normalized(v: Option<&Value>) -> Value {
    fn norm(v: &Value) -> Option<Value> {
        match v {
            Value::Null => None,
            Value::Array(a) => {
                let items: Vec<Value> = a.iter().map(|x| norm(x).unwrap_or(Value::Null)).collect();
                (!items.is_empty()).then_some(Value::Array(items))
            }
            Value::Object(o) => {
                let m: Map<String, Value> = o
                    .iter()
                    .filter_map(|(k, x)| norm(x).map(|x| (k.clone(), x)))
                    .collect();
                (!m.is_empty()).then_some(Value::Object(m))
            }
            other => Some(other.clone()),
        }
    }
    v.and_then(norm).unwrap_or(Value::Null)
}

fn status_devices(claim: &Value) -> &[Value] {
    claim
        .pointer("/status/devices")
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

/// The drivers whose `status.devices` entries were added, removed or changed,
/// an entry being identified by driver, pool, device and shareID
/// (`pkg/registry/resource/utils.go` `getModifiedDrivers`), sorted.
fn modified_drivers(new: &Value, old: &Value) -> BTreeSet<String> {
    let s = |d: &Value, f: &str| d.get(f).and_then(Value::as_str).unwrap_or("").to_string();
    let key = |d: &Value| {
        (
            s(d, "driver"),
            s(d, "pool"),
            s(d, "device"),
            s(d, "shareID"),
        )
    };
    let mut old_entries: std::collections::BTreeMap<_, &Value> =
        status_devices(old).iter().map(|d| (key(d), d)).collect();
    let mut drivers = BTreeSet::new();
    for d in status_devices(new) {
        let k = key(d);
        match old_entries.remove(&k) {
            Some(o) if normalized(Some(o)) == normalized(Some(d)) => {}
            _ => {
                drivers.insert(k.0);
            }
        }
    }
    drivers.extend(old_entries.into_keys().map(|k| k.0));
    drivers
}

/// The node an allocation is limited to, if its node selector is exactly one
/// term with exactly one `matchFields` entry `metadata.name In [<node>]` and
/// no `matchExpressions` (`pkg/registry/resource/utils.go`
/// `nodeNameFromAllocation`); `None` otherwise.
fn node_of_allocation(claim: &Value) -> Option<&str> {
    let terms = claim
        .pointer("/status/allocation/nodeSelector/nodeSelectorTerms")?
        .as_array()?;
    let [term] = terms.as_slice() else {
        return None;
    };
    let len = |f: &str| term.get(f).and_then(Value::as_array).map_or(0, Vec::len);
    if len("matchExpressions") != 0 || len("matchFields") != 1 {
        return None;
    }
    let f = term.pointer("/matchFields/0")?;
    let values = f.get("values").and_then(Value::as_array)?;
    let ok = f.get("key").and_then(Value::as_str) == Some("metadata.name")
        && f.get("operator").and_then(Value::as_str) == Some("In")
        && values.len() == 1;
    ok.then(|| values[0].as_str())
        .flatten()
        .filter(|n| !n.is_empty())
}

/// Whether `who` is a ServiceAccount whose token is bound to the node the
/// claim is allocated on (`pkg/registry/resource/utils.go`
/// `saAssociatedWithAllocatedNode`: a ServiceAccount user name, one
/// node-name extra that is a valid node name, equal to the allocation's node).
fn associated_with_allocated_node(who: &Identity, claim: &Value) -> bool {
    let Some(node) = node_of_allocation(claim) else {
        return false;
    };
    who.service_account_name().is_some()
        && who
            .node_name
            .as_deref()
            .is_some_and(|n| is_dns_subdomain(n) && n == node)
}

/// The per-field authorization of a ResourceClaim status write by `who`
/// with `verb` (`update` or `patch`), while
/// DRAResourceClaimGranularStatusAuthorization is on
/// (`pkg/registry/resource/resourceclaim/strategy.go`
/// `resourceclaimStatusStrategy.ValidateUpdate`, the checks in
/// `pkg/registry/resource/utils.go`):
///
/// * `AuthorizedForBinding`: a write that changes `status.allocation` or
///   `status.reservedFor` needs `<verb>` on `resourceclaims/binding`,
///   cluster-wide and for all names.
/// * `AuthorizedForDeviceStatus`, only when the new status has an
///   allocation: for every driver whose `status.devices` entries were added,
///   removed or changed, `<verb>` with the prefix `associated-node:` (only
///   for a ServiceAccount whose token is bound to the allocation's node) or
///   else `arbitrary-node:` on `resourceclaims/driver` named by the driver,
///   in the claim's namespace.
///
/// A refusal is a `field.Forbidden` on `status.allocation` or
/// `status.devices` (one per driver), answered as 422 Invalid, e.g.
/// `ResourceClaim.resource.k8s.io "c" is invalid: status.devices: Forbidden:
/// changing status.devices requires resource="resourceclaims/driver",
/// verb="[associated-node:patch arbitrary-node:patch]" permission:
/// resourceclaims.resource.k8s.io "gpu.carve.dev" is forbidden: User …`.
/// Equality is JSON equality after dropping nulls and empty lists and
/// objects; quantities are compared as written, not numerically.
pub(crate) fn authorize_claim_status(
    who: &Identity,
    verb: &str,
    (namespace, name): (&str, &str),
    new: &Value,
    old: &Value,
    gates: Gates,
) -> Result<(), ApiError> {
    if !gates.granular_status_authorization {
        return Ok(());
    }
    let mut errs: Vec<(String, String)> = Vec::new();
    let changed = |p: &str| normalized(new.pointer(p)) != normalized(old.pointer(p));
    if changed("/status/allocation") || changed("/status/reservedFor") {
        let attrs = Attributes::new(verb, "resourceclaims", "binding", "", "");
        if !who.allows(&attrs) {
            errs.push((
                "status.allocation".to_string(),
                format!(
                    "changing status.allocation or status.reservedFor requires resource=\"resourceclaims/binding\", verb=\"{verb}\" permission: {}",
                    forbidden_message(&who.username, &attrs)
                ),
            ));
        }
    }
    if !normalized(new.pointer("/status/allocation")).is_null() {
        let mut verbs = Vec::new();
        if associated_with_allocated_node(who, new) {
            verbs.push(format!("associated-node:{verb}"));
        }
        verbs.push(format!("arbitrary-node:{verb}"));
        for driver in modified_drivers(new, old) {
            let tried: Vec<Attributes> = verbs
                .iter()
                .map(|v| Attributes::new(v, "resourceclaims", "driver", namespace, &driver))
                .collect();
            if !tried.iter().any(|a| who.allows(a)) {
                errs.push((
                    "status.devices".to_string(),
                    format!(
                        "changing status.devices requires resource=\"resourceclaims/driver\", verb=\"[{}]\" permission: {}",
                        verbs.join(" "),
                        forbidden_message(&who.username, &tried[0])
                    ),
                ));
            }
        }
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid_forbidden(
            Resource::ResourceClaims,
            name,
            &errs,
        ))
    }
}
