//! The pure part of publishing: what counts as "the same slice", and which
//! writes turn the slices that exist into the desired ones.
//!
//! No I/O here; [`crate::SlicePublisher`] lists, calls [`plan`] and executes the
//! steps in the order given.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};

use carve_model::slices::parse_quantity;
use k8s_openapi::api::resource::v1::{Counter, Device, ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::Value;
use sha2::{Digest as _, Sha256};

use crate::error::PublishError;

/// The content of a slice that the publisher owns and compares: `metadata.name`,
/// `labels`, `annotations`, `ownerReferences` and the whole `spec` except
/// `spec.pool.generation`.
///
/// Server-set metadata (`resourceVersion`, `uid`, `creationTimestamp`,
/// `generation`, `managedFields`, ...) is ignored. Nulls, empty lists and empty
/// maps are dropped, because the API server omits them on the way back
/// (`omitempty`), so `Some(vec![])` and `None` compare equal. Quantities
/// (capacities, counters, request policies) compare by value, because the API
/// server rewrites them in canonical form (`40960Mi` comes back as `40Gi`).
pub fn content(slice: &ResourceSlice) -> Value {
    let mut v = header(slice);
    let devices: Vec<Value> = devices_of(slice).iter().map(device_content).collect();
    if !devices.is_empty() {
        // A header object always has `spec` (it holds `driver` and `pool`).
        if let Some(spec) = v.get_mut("spec").and_then(Value::as_object_mut) {
            spec.insert("devices".into(), Value::Array(devices));
        }
    }
    v
}

fn devices_of(slice: &ResourceSlice) -> &[Device] {
    slice.spec.devices.as_deref().unwrap_or_default()
}

/// [`content`] without `spec.devices`.
fn header(slice: &ResourceSlice) -> Value {
    // Every field by name (no `..`): a field added to the spec by a newer
    // API version must be decided on here, not silently left out.
    let ResourceSliceSpec {
        all_nodes,
        devices: _,
        driver,
        node_name,
        node_selector,
        per_device_node_selection,
        pool,
        shared_counters,
    } = &slice.spec;
    let mut shared_counters = shared_counters.clone();
    for set in shared_counters.iter_mut().flatten() {
        canonical_counters(&mut set.counters);
    }
    let mut pool = serde_json::to_value(pool).unwrap_or(Value::Null);
    if let Some(pool) = pool.as_object_mut() {
        pool.remove("generation");
    }
    let m = &slice.metadata;
    let mut v = serde_json::json!({
        "name": m.name,
        "labels": m.labels,
        "annotations": m.annotations,
        "ownerReferences": m.owner_references,
        "spec": {
            "allNodes": all_nodes,
            "driver": driver,
            "nodeName": node_name,
            "nodeSelector": node_selector,
            "perDeviceNodeSelection": per_device_node_selection,
            "pool": pool,
            "sharedCounters": shared_counters,
        },
    });
    normalize(&mut v);
    v
}

/// One device of [`content`]: quantities canonical, empties dropped.
fn device_content(device: &Device) -> Value {
    let mut device = device.clone();
    canonical_device(&mut device);
    let mut v = serde_json::to_value(&device).unwrap_or(Value::Null);
    normalize(&mut v);
    v
}

/// Rewrites a quantity that parses as its exact value in milli-units
/// (`"40Gi"` and `"40960Mi"` both become `"42949672960000m"`); an unparsable
/// one stays as it is (and then compares as text).
fn canon(q: &mut Quantity) {
    if let Ok(amount) = parse_quantity(&q.0) {
        q.0 = format!("{}m", amount.milli());
    }
}

fn canonical_counters(map: &mut BTreeMap<String, Counter>) {
    map.values_mut().for_each(|c| canon(&mut c.value));
}

/// Every quantity of a device (counters it consumes, capacities and their
/// request policies) in canonical form, see [`canon`].
fn canonical_device(device: &mut Device) {
    for consumption in device.consumes_counters.iter_mut().flatten() {
        canonical_counters(&mut consumption.counters);
    }
    for capacity in device.capacity.iter_mut().flat_map(|m| m.values_mut()) {
        canon(&mut capacity.value);
        if let Some(policy) = capacity.request_policy.as_mut() {
            policy.default.iter_mut().for_each(canon);
            policy.valid_values.iter_mut().flatten().for_each(canon);
            if let Some(range) = policy.valid_range.as_mut() {
                canon(&mut range.min);
                range.max.iter_mut().for_each(canon);
                range.step.iter_mut().for_each(canon);
            }
        }
    }
}

/// Drops nulls, empty arrays and empty objects from object members, recursively.
/// Array elements keep their order (device order is meaningful to the scheduler).
fn normalize(v: &mut Value) {
    match v {
        Value::Object(map) => {
            for child in map.values_mut() {
                normalize(child);
            }
            map.retain(|_, child| !is_empty(child));
        }
        Value::Array(items) => items.iter_mut().for_each(normalize),
        _ => {}
    }
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}

fn name_of(s: &ResourceSlice) -> &str {
    s.metadata.name.as_deref().unwrap_or("")
}

/// Checks that `desired` can be published by the publisher of `driver` on
/// `node`: every slice is named, names are unique, `spec.driver` and
/// `spec.nodeName` are ours, and every pool's `resourceSliceCount` equals the
/// number of its slices (otherwise consumers would wait forever for a slice
/// that never comes, or see a pool as complete that is not).
pub fn validate_desired(
    desired: &[ResourceSlice],
    node: &str,
    driver: &str,
) -> Result<(), PublishError> {
    let invalid = |slice: &str, reason: String| PublishError::InvalidDesired {
        slice: slice.to_owned(),
        reason,
    };
    let mut names = BTreeSet::new();
    let mut pools: BTreeMap<&str, (usize, i64)> = BTreeMap::new();
    for s in desired {
        let name = name_of(s);
        if name.is_empty() {
            return Err(invalid(name, "metadata.name is empty".into()));
        }
        if !names.insert(name) {
            return Err(invalid(
                name,
                "metadata.name appears twice in the desired set".into(),
            ));
        }
        if s.spec.driver != driver {
            return Err(invalid(
                name,
                format!(
                    "spec.driver is {:?}, this publisher owns {driver:?}",
                    s.spec.driver
                ),
            ));
        }
        if s.spec.node_name.as_deref() != Some(node) {
            return Err(invalid(
                name,
                format!(
                    "spec.nodeName is {:?}, this publisher owns node {node:?}",
                    s.spec.node_name
                ),
            ));
        }
        let pool = &s.spec.pool;
        if pool.name.is_empty() {
            return Err(invalid(name, "spec.pool.name is empty".into()));
        }
        let entry = pools
            .entry(pool.name.as_str())
            .or_insert((0, pool.resource_slice_count));
        if entry.1 != pool.resource_slice_count {
            return Err(invalid(
                name,
                format!(
                    "spec.pool.resourceSliceCount is {}, another slice of pool {:?} says {}",
                    pool.resource_slice_count, pool.name, entry.1
                ),
            ));
        }
        entry.0 += 1;
    }
    for (pool, (count, declared)) in pools {
        if i64::try_from(count).ok() != Some(declared) {
            let first = desired
                .iter()
                .find(|s| s.spec.pool.name == pool)
                .map(name_of)
                .unwrap_or("");
            return Err(invalid(
                first,
                format!(
                    "pool {pool:?} has {count} slice(s) but spec.pool.resourceSliceCount is {declared}"
                ),
            ));
        }
    }
    Ok(())
}

/// One write of a [`Plan`], in execution order.
#[derive(Debug, Clone, PartialEq)]
pub enum Step<'d> {
    /// POST this slice (its name is free).
    Create(Write<'d>),
    /// PUT this slice, with the observed `metadata.resourceVersion`.
    Update(Write<'d>),
    /// DELETE the slice of this name.
    Delete(String),
}

/// A desired slice to send, by reference: the plan holds no copy of the
/// desired set (the plugin keeps its slices; a plan of copies doubled its
/// heap at the first publish). [`Write::to_slice`] makes the object to send.
#[derive(Debug, Clone, PartialEq)]
pub struct Write<'d> {
    /// The desired slice.
    pub desired: &'d ResourceSlice,
    /// The pool generation to send it with.
    pub generation: i64,
    /// The observed `metadata.resourceVersion` (updates only).
    pub resource_version: Option<String>,
}

impl Write<'_> {
    /// The slice's name.
    pub fn name(&self) -> &str {
        name_of(self.desired)
    }

    /// The object to send: the desired slice with only the metadata the
    /// publisher owns, this generation and the observed resource version.
    pub fn to_slice(&self) -> ResourceSlice {
        let mut slice = clean(self.desired);
        slice.spec.pool.generation = self.generation;
        slice.metadata.resource_version = self.resource_version.clone();
        slice
    }
}

/// The writes that make the existing slices equal to the desired ones.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Plan<'d> {
    /// Writes in execution order: every create/update of the new generations
    /// first, deletes of stale slices last (see [`plan`] for why).
    pub steps: Vec<Step<'d>>,
    /// Desired slices that already exist with the same content and need no write.
    pub unchanged: usize,
    /// The generation of every desired pool once the plan has run.
    pub generations: BTreeMap<String, i64>,
}

/// A listed ResourceSlice reduced, as it is read, to what [`plan`] needs: its
/// name, resource version, driver, node, pool and generation, and a digest of
/// its [`content`]. The publisher lists the node's slices on every resync; as
/// full objects they were a second copy of every published slice (megabytes
/// of heap that glibc keeps once freed).
#[derive(Debug, Clone, PartialEq)]
pub struct Listed {
    /// `name` and `resourceVersion` only.
    metadata: ObjectMeta,
    /// `spec.driver`.
    pub driver: String,
    /// `spec.nodeName`.
    pub node_name: Option<String>,
    /// `spec.pool.name`.
    pub pool: String,
    /// `spec.pool.generation`.
    pub generation: i64,
    /// [`digest`] of the slice.
    pub digest: [u8; 32],
}

impl Listed {
    /// `slice` reduced.
    pub fn of(slice: &ResourceSlice) -> Self {
        Listed {
            metadata: ObjectMeta {
                name: slice.metadata.name.clone(),
                resource_version: slice.metadata.resource_version.clone(),
                ..Default::default()
            },
            driver: slice.spec.driver.clone(),
            node_name: slice.spec.node_name.clone(),
            pool: slice.spec.pool.name.clone(),
            generation: slice.spec.pool.generation,
            digest: digest(slice),
        }
    }

    /// `metadata.name`.
    pub fn name(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or("")
    }

    /// `metadata.resourceVersion`.
    pub fn resource_version(&self) -> Option<&str> {
        self.metadata.resource_version.as_deref()
    }
}

impl<'de> serde::Deserialize<'de> for Listed {
    /// One item of a list answer: read whole, reduced at once.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        ResourceSlice::deserialize(d).map(|s| Listed::of(&s))
    }
}

impl kube::Resource for Listed {
    type DynamicType = ();
    type Scope = <ResourceSlice as kube::Resource>::Scope;

    fn kind(dt: &()) -> Cow<'_, str> {
        <ResourceSlice as kube::Resource>::kind(dt)
    }
    fn group(dt: &()) -> Cow<'_, str> {
        <ResourceSlice as kube::Resource>::group(dt)
    }
    fn version(dt: &()) -> Cow<'_, str> {
        <ResourceSlice as kube::Resource>::version(dt)
    }
    fn plural(dt: &()) -> Cow<'_, str> {
        <ResourceSlice as kube::Resource>::plural(dt)
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// SHA-256 of a slice's [`content`], computed a device at a time (the whole
/// content of a 64-device slice is megabytes of JSON values): equal digests
/// mean equal contents (the tests check that they agree).
pub fn digest(slice: &ResourceSlice) -> [u8; 32] {
    struct Hashing(Sha256);
    impl std::io::Write for Hashing {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.update(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut h = Hashing(Sha256::new());
    // Compact JSON has no raw newline: it separates the parts unambiguously.
    let _ = serde_json::to_writer(&mut h, &header(slice));
    for d in devices_of(slice) {
        h.0.update(b"\n");
        let _ = serde_json::to_writer(&mut h, &device_content(d));
    }
    h.0.finalize().into()
}

/// Computes the writes that turn `existing` (the slices of this driver on this
/// node, as listed) into `desired` (already checked by [`validate_desired`]).
///
/// A pool is up to date when its existing slices have exactly the desired names,
/// the same [`content`] and one common generation; it then costs no write at all,
/// whatever generation it is at (so a restarted publisher writes nothing).
///
/// Any other pool gets generation `g + 1`, where `g` is the highest generation
/// among its existing slices, or generation 0 when none exists (a first
/// publish: there is no older generation to supersede, and the API allows 0),
/// and every one of its desired slices is written with it.
///
/// Order: creates and updates first, then deletes. Consumers (the scheduler)
/// use only a pool's highest generation and treat it as incomplete until they
/// see `resourceSliceCount` slices of it. While the new generation is being
/// written it is incomplete, so nobody allocates from a mix of old and new
/// slices; once it is complete, the old-generation leftovers are ignored, so
/// deleting them afterwards changes nothing consumers see. Deleting first
/// would instead withdraw devices that are still valid for no reason. The one
/// exception is a name that moves to another pool (`spec.pool.name` is
/// immutable): that slice is deleted and re-created, after all other writes of
/// the new generations.
pub fn plan<'d>(existing: &[Listed], desired: &'d [ResourceSlice]) -> Plan<'d> {
    let by_name: HashMap<&str, &Listed> = existing.iter().map(|s| (s.name(), s)).collect();
    let desired_names: BTreeSet<&str> = desired.iter().map(name_of).collect();

    // Desired slices grouped by pool, in first-seen order.
    let mut pool_order: Vec<&str> = Vec::new();
    let mut by_pool: HashMap<&str, Vec<&ResourceSlice>> = HashMap::new();
    for s in desired {
        let pool = s.spec.pool.name.as_str();
        by_pool
            .entry(pool)
            .or_insert_with(|| {
                pool_order.push(pool);
                Vec::new()
            })
            .push(s);
    }

    let mut out = Plan::default();
    let mut recreate: Vec<(String, Write<'d>)> = Vec::new();
    for pool in pool_order {
        let wanted = &by_pool[pool];
        let present: Vec<&Listed> = existing.iter().filter(|s| s.pool == pool).collect();
        let generations: BTreeSet<i64> = present.iter().map(|s| s.generation).collect();
        let up_to_date = present.len() == wanted.len()
            && generations.len() == 1
            && wanted.iter().all(|w| {
                by_name
                    .get(name_of(w))
                    .is_some_and(|e| e.pool == pool && e.digest == digest(w))
            });
        if up_to_date {
            out.unchanged += wanted.len();
            out.generations
                .insert(pool.to_owned(), generations.first().copied().unwrap_or(0));
            continue;
        }
        let generation = generations.last().map_or(0, |g| g.saturating_add(1));
        out.generations.insert(pool.to_owned(), generation);
        for w in wanted {
            let mut write = Write {
                desired: w,
                generation,
                resource_version: None,
            };
            match by_name.get(name_of(w)) {
                Some(e) if e.pool == pool => {
                    write.resource_version = e.resource_version().map(str::to_owned);
                    out.steps.push(Step::Update(write));
                }
                Some(_) => recreate.push((name_of(w).to_owned(), write)),
                None => out.steps.push(Step::Create(write)),
            }
        }
    }
    for (name, write) in recreate {
        out.steps.push(Step::Delete(name));
        out.steps.push(Step::Create(write));
    }
    for e in existing {
        if !desired_names.contains(e.name()) {
            out.steps.push(Step::Delete(e.name().to_owned()));
        }
    }
    out
}

/// The desired slice with only the metadata the publisher owns.
fn clean(s: &ResourceSlice) -> ResourceSlice {
    let m = &s.metadata;
    ResourceSlice {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: m.name.clone(),
            labels: m.labels.clone(),
            annotations: m.annotations.clone(),
            owner_references: m.owner_references.clone(),
            ..Default::default()
        },
        spec: s.spec.clone(),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::resource::v1::{
        Device, DeviceAttribute, ResourcePool, ResourceSliceSpec,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, ObjectMeta, Time};

    use super::*;

    const NODE: &str = "node-a";
    const DRIVER: &str = "gpu.carve.dev";

    fn device(name: &str, product: &str) -> Device {
        Device {
            name: name.into(),
            attributes: Some(BTreeMap::from([(
                "productName".to_owned(),
                DeviceAttribute {
                    string: Some(product.into()),
                    ..Default::default()
                },
            )])),
            ..Default::default()
        }
    }

    fn slice(name: &str, pool: &str, count: i64, devices: &[&str]) -> ResourceSlice {
        ResourceSlice {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(BTreeMap::from([(
                    "app.kubernetes.io/managed-by".to_owned(),
                    "carve".to_owned(),
                )])),
                ..Default::default()
            },
            spec: ResourceSliceSpec {
                driver: DRIVER.into(),
                node_name: Some(NODE.into()),
                pool: ResourcePool {
                    name: pool.into(),
                    generation: 0,
                    resource_slice_count: count,
                },
                devices: Some(devices.iter().map(|d| device(d, "H200")).collect()),
                ..Default::default()
            },
        }
    }

    /// What the server hands back: the desired slice plus server-set metadata.
    fn stored(s: &ResourceSlice, generation: i64, rv: &str) -> ResourceSlice {
        let mut s = s.clone();
        s.spec.pool.generation = generation;
        s.metadata.resource_version = Some(rv.into());
        s.metadata.uid = Some(format!("uid-{rv}"));
        s.metadata.generation = Some(3);
        s.metadata.creation_timestamp = Some(Time(Default::default()));
        s.metadata.managed_fields = Some(vec![ManagedFieldsEntry {
            manager: Some("carve".into()),
            ..Default::default()
        }]);
        s
    }

    fn names(steps: &[Step]) -> Vec<String> {
        steps
            .iter()
            .map(|s| match s {
                Step::Create(x) => format!("create {}", x.name()),
                Step::Update(x) => format!("update {}", x.name()),
                Step::Delete(n) => format!("delete {n}"),
            })
            .collect()
    }

    /// Whether `a` and `b` have equal [`digest`]s (what [`plan`] compares),
    /// checked against comparing whole [`content`] values.
    fn agree(a: &ResourceSlice, b: &ResourceSlice) -> bool {
        let same = digest(a) == digest(b);
        assert_eq!(
            same,
            content(a) == content(b),
            "digest and content disagree"
        );
        same
    }

    /// Slices as the publisher lists them.
    fn listed(slices: &[ResourceSlice]) -> Vec<Listed> {
        slices.iter().map(Listed::of).collect()
    }

    #[test]
    fn a_listed_slice_is_read_reduced() {
        let a = stored(&slice("s0", NODE, 1, &["gpu-0"]), 3, "42");
        let json = serde_json::to_string(&a).unwrap();
        let l: Listed = serde_json::from_str(&json).unwrap();
        assert_eq!(l, Listed::of(&a));
        assert_eq!(
            (
                l.name(),
                l.resource_version(),
                l.pool.as_str(),
                l.generation
            ),
            ("s0", Some("42"), NODE, 3)
        );
        assert_eq!(l.digest, digest(&slice("s0", NODE, 1, &["gpu-0"])));
        assert_ne!(l.digest, digest(&slice("s0", NODE, 1, &["gpu-1"])));
    }

    #[test]
    fn content_ignores_server_metadata_and_generation() {
        let a = slice("s0", NODE, 1, &["gpu-0"]);
        assert!(agree(&a, &stored(&a, 9, "123")));
        assert_eq!(content(&a), content(&stored(&a, 0, "1")));
    }

    #[test]
    fn content_treats_empty_as_absent() {
        let mut a = slice("s0", NODE, 1, &["gpu-0"]);
        let mut b = a.clone();
        a.spec.shared_counters = Some(vec![]);
        a.metadata.annotations = Some(BTreeMap::new());
        b.spec.devices.as_mut().unwrap()[0].capacity = Some(BTreeMap::new());
        assert!(agree(&a, &b));
        let mut none = slice("s1", NODE, 1, &[]);
        none.spec.devices = None;
        let mut empty = none.clone();
        empty.spec.devices = Some(vec![]);
        assert!(agree(&none, &empty));
        assert!(
            !agree(&none, &slice("s1", NODE, 1, &["gpu-0"])),
            "a device more"
        );
    }

    #[test]
    // `..Default::default()` keeps the literal compiling with k8s-openapi v1_37,
    // which adds `DeviceCounterConsumption::compatibility_groups`.
    #[allow(clippy::needless_update)]
    fn content_compares_quantities_by_value() {
        use k8s_openapi::api::resource::v1::{
            CapacityRequestPolicy, CapacityRequestPolicyRange, CounterSet, DeviceCapacity,
            DeviceCounterConsumption,
        };
        let q = |s: &str| Quantity(s.into());
        let with = |mem: &str, step: &str, counter: &str| {
            let mut s = slice("s0", NODE, 1, &["gpu-0"]);
            let d = &mut s.spec.devices.as_mut().unwrap()[0];
            d.capacity = Some(BTreeMap::from([(
                "memory".to_owned(),
                DeviceCapacity {
                    value: q(mem),
                    request_policy: Some(CapacityRequestPolicy {
                        default: Some(q(step)),
                        valid_values: None,
                        valid_range: Some(CapacityRequestPolicyRange {
                            min: q(step),
                            max: Some(q(mem)),
                            step: Some(q(step)),
                        }),
                    }),
                },
            )]));
            d.consumes_counters = Some(vec![DeviceCounterConsumption {
                counter_set: "gpu-0-counters".into(),
                counters: BTreeMap::from([("memory".to_owned(), Counter { value: q(counter) })]),
                ..Default::default()
            }]);
            s.spec.shared_counters = Some(vec![CounterSet {
                name: "gpu-0-counters".into(),
                counters: BTreeMap::from([("memory".to_owned(), Counter { value: q(counter) })]),
            }]);
            s
        };
        let a = with("40960Mi", "1024Mi", "1000m");
        assert!(
            agree(&a, &with("40Gi", "1Gi", "1")),
            "canonical forms are equal"
        );
        assert!(
            !agree(&a, &with("40961Mi", "1024Mi", "1")),
            "a different value is not"
        );
        assert!(
            !agree(&a, &with("40Gi", "2Gi", "1")),
            "a different step is not"
        );
        assert!(
            !agree(&a, &with("40Gi", "1Gi", "2")),
            "a different counter is not"
        );
    }

    #[test]
    fn content_sees_devices_labels_pool_and_order() {
        let a = slice("s0", NODE, 1, &["gpu-0", "gpu-1"]);
        let mut attr = a.clone();
        attr.spec.devices.as_mut().unwrap()[1] = device("gpu-1", "H100");
        assert!(!agree(&a, &attr), "attribute change");
        let mut label = a.clone();
        label
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("x".into(), "y".into());
        assert!(!agree(&a, &label), "label change");
        let mut count = a.clone();
        count.spec.pool.resource_slice_count = 2;
        assert!(!agree(&a, &count), "resourceSliceCount change");
        assert!(
            !agree(&a, &slice("s0", NODE, 1, &["gpu-1", "gpu-0"])),
            "order"
        );
        assert!(
            !agree(&a, &slice("s1", NODE, 1, &["gpu-0", "gpu-1"])),
            "name"
        );
    }

    #[test]
    fn validate_accepts_a_consistent_set() {
        let d = [
            slice("s0", NODE, 2, &["gpu-0"]),
            slice("s1", NODE, 2, &["gpu-1"]),
        ];
        validate_desired(&d, NODE, DRIVER).unwrap();
        validate_desired(&[], NODE, DRIVER).unwrap();
    }

    #[test]
    fn validate_names_slice_and_field() {
        let ok = slice("s0", NODE, 1, &["gpu-0"]);
        let cases: Vec<(Vec<ResourceSlice>, &str, &str)> = vec![
            (
                {
                    let mut s = ok.clone();
                    s.spec.driver = "other.dev".into();
                    vec![s]
                },
                "s0",
                "spec.driver",
            ),
            (
                {
                    let mut s = ok.clone();
                    s.spec.node_name = Some("node-b".into());
                    vec![s]
                },
                "s0",
                "spec.nodeName",
            ),
            (
                {
                    let mut s = ok.clone();
                    s.spec.node_name = None;
                    vec![s]
                },
                "s0",
                "spec.nodeName",
            ),
            (
                {
                    let mut s = ok.clone();
                    s.metadata.name = None;
                    vec![s]
                },
                "\"\"",
                "metadata.name",
            ),
            (
                vec![slice("s0", NODE, 2, &["a"]), slice("s0", NODE, 2, &["b"])],
                "s0",
                "twice",
            ),
            (
                vec![slice("s0", NODE, 2, &["a"])],
                "s0",
                "resourceSliceCount is 2",
            ),
            (
                vec![slice("s0", NODE, 2, &["a"]), slice("s1", NODE, 3, &["b"])],
                "s1",
                "resourceSliceCount",
            ),
            (
                {
                    let mut s = ok.clone();
                    s.spec.pool.name = String::new();
                    vec![s]
                },
                "s0",
                "spec.pool.name",
            ),
        ];
        for (desired, slice_name, field) in cases {
            let e = validate_desired(&desired, NODE, DRIVER).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, PublishError::InvalidDesired { .. }), "{msg}");
            assert!(msg.contains(slice_name), "{msg} should name {slice_name}");
            assert!(msg.contains(field), "{msg} should mention {field}");
        }
    }

    #[test]
    fn first_publish_creates_everything_at_generation_zero() {
        let d = [
            slice("s0", NODE, 2, &["gpu-0"]),
            slice("s1", NODE, 2, &["gpu-1"]),
        ];
        let p = plan(&[], &d);
        assert_eq!(names(&p.steps), ["create s0", "create s1"]);
        assert_eq!(p.generations, BTreeMap::from([(NODE.to_owned(), 0)]));
        assert_eq!(p.unchanged, 0);
        for s in &p.steps {
            let Step::Create(w) = s else { unreachable!() };
            let s = w.to_slice();
            assert_eq!(s.spec.pool.generation, 0);
            assert_eq!(s.metadata.resource_version, None);
        }
    }

    #[test]
    fn unchanged_set_needs_no_write_at_any_generation() {
        let d = [
            slice("s0", NODE, 2, &["gpu-0"]),
            slice("s1", NODE, 2, &["gpu-1"]),
        ];
        let existing = [stored(&d[1], 7, "11"), stored(&d[0], 7, "10")];
        let p = plan(&listed(&existing), &d);
        assert!(p.steps.is_empty(), "{:?}", names(&p.steps));
        assert_eq!(p.unchanged, 2);
        assert_eq!(p.generations[NODE], 7);
    }

    #[test]
    fn changed_device_bumps_every_slice_and_deletes_stale_last() {
        let old = [
            stored(&slice("s0", NODE, 3, &["gpu-0"]), 4, "10"),
            stored(&slice("s1", NODE, 3, &["gpu-1"]), 4, "11"),
            stored(&slice("s2", NODE, 3, &["gpu-2"]), 4, "12"),
        ];
        let d = [
            slice("s0", NODE, 2, &["gpu-0"]),
            slice("s1", NODE, 2, &["gpu-1-mig"]),
        ];
        let p = plan(&listed(&old), &d);
        assert_eq!(names(&p.steps), ["update s0", "update s1", "delete s2"]);
        assert_eq!(p.generations[NODE], 5);
        let rvs: Vec<_> = p
            .steps
            .iter()
            .filter_map(|s| match s {
                Step::Update(w) => {
                    let s = w.to_slice();
                    assert_eq!(s.spec.pool.generation, 5);
                    assert_eq!(s.metadata.uid, None, "server metadata is not sent back");
                    s.metadata.resource_version.clone()
                }
                _ => None,
            })
            .collect();
        assert_eq!(rvs, ["10", "11"]);
    }

    #[test]
    fn mixed_generations_are_rewritten_above_the_highest() {
        // A sync that died half-way left s0 at 3 and s1 at 2 with the same content.
        let d = [
            slice("s0", NODE, 2, &["gpu-0"]),
            slice("s1", NODE, 2, &["gpu-1"]),
        ];
        let existing = [stored(&d[0], 3, "10"), stored(&d[1], 2, "11")];
        let p = plan(&listed(&existing), &d);
        assert_eq!(names(&p.steps), ["update s0", "update s1"]);
        assert_eq!(p.generations[NODE], 4);
    }

    #[test]
    fn missing_slice_is_created_and_pool_bumped() {
        let d = [
            slice("s0", NODE, 2, &["gpu-0"]),
            slice("s1", NODE, 2, &["gpu-1"]),
        ];
        let existing = [stored(&d[0], 1, "10")];
        let p = plan(&listed(&existing), &d);
        assert_eq!(names(&p.steps), ["update s0", "create s1"]);
        assert_eq!(p.generations[NODE], 2);
    }

    #[test]
    fn pools_are_independent_and_other_pools_of_the_node_are_deleted() {
        let a = slice("a0", "pool-a", 1, &["gpu-0"]);
        let b = slice("b0", "pool-b", 1, &["gpu-1"]);
        let existing = [
            stored(&a, 2, "1"),
            stored(&slice("b0", "pool-b", 1, &["gpu-9"]), 6, "2"),
            stored(&slice("old0", "pool-old", 1, &["gpu-3"]), 1, "3"),
        ];
        let d = [a, b];
        let p = plan(&listed(&existing), &d);
        assert_eq!(names(&p.steps), ["update b0", "delete old0"]);
        assert_eq!(p.unchanged, 1);
        assert_eq!(
            p.generations,
            BTreeMap::from([("pool-a".to_owned(), 2), ("pool-b".to_owned(), 7)])
        );
    }

    #[test]
    fn name_moving_to_another_pool_is_recreated_after_other_writes() {
        let existing = [
            stored(&slice("s0", "old-pool", 2, &["gpu-0"]), 3, "1"),
            stored(&slice("s1", "old-pool", 2, &["gpu-1"]), 3, "2"),
        ];
        let d = [
            slice("s0", NODE, 2, &["gpu-0"]),
            slice("n1", NODE, 2, &["gpu-1"]),
        ];
        let p = plan(&listed(&existing), &d);
        assert_eq!(
            names(&p.steps),
            ["create n1", "delete s0", "create s0", "delete s1"]
        );
        assert_eq!(p.generations[NODE], 0, "a new pool starts at 0");
    }

    #[test]
    fn empty_desired_deletes_everything() {
        let existing = [stored(&slice("s0", NODE, 1, &["gpu-0"]), 1, "1")];
        let p = plan(&listed(&existing), &[]);
        assert_eq!(names(&p.steps), ["delete s0"]);
        assert!(p.generations.is_empty());
    }
}
