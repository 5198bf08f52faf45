//! ResourceSlices parsed once: quantities, counters, capacities, pools per node.

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::core::v1::NodeSelector;
use k8s_openapi::api::resource::v1::{CapacityRequestPolicy, Device, ResourceSlice};

use crate::error::AllocError;
use crate::quantity::Qty;

/// A capacity of a device.
#[derive(Debug, Clone)]
pub(crate) struct Cap {
    /// The name as the device publishes it.
    pub published: String,
    /// `domain/id`.
    pub fq: String,
    pub value: Qty,
    pub policy: Option<Policy>,
}

/// A parsed requestPolicy.
#[derive(Debug, Clone, Default)]
pub(crate) struct Policy {
    pub default: Option<Qty>,
    pub valid_values: Option<Vec<Qty>>,
    /// (min, max, step)
    pub range: Option<(Qty, Option<Qty>, Option<Qty>)>,
}

/// A device with its numbers parsed.
#[derive(Debug, Clone)]
pub(crate) struct DevInfo {
    pub consumes: Vec<(String, Vec<(String, Qty)>)>,
    pub caps: Vec<Cap>,
    pub multi: bool,
}

/// A slice with its numbers parsed.
#[derive(Debug, Clone)]
pub(crate) struct SliceInfo {
    pub counter_sets: Vec<(String, Vec<(String, Qty)>)>,
    pub devices: Vec<DevInfo>,
}

fn qty(
    slice: &str,
    field: String,
    q: &k8s_openapi::apimachinery::pkg::api::resource::Quantity,
) -> Result<Qty, AllocError> {
    Qty::from_quantity(q).map_err(|e| AllocError::InvalidSlice {
        slice: slice.to_string(),
        field,
        msg: e.to_string(),
    })
}

fn parse_policy(slice: &str, field: &str, p: &CapacityRequestPolicy) -> Result<Policy, AllocError> {
    let default = p
        .default
        .as_ref()
        .map(|q| qty(slice, format!("{field}.default"), q))
        .transpose()?;
    let valid_values = p
        .valid_values
        .as_ref()
        .map(|vs| {
            vs.iter()
                .enumerate()
                .map(|(i, q)| qty(slice, format!("{field}.validValues[{i}]"), q))
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?;
    let range = p
        .valid_range
        .as_ref()
        .map(|r| -> Result<_, AllocError> {
            let min = qty(slice, format!("{field}.validRange.min"), &r.min)?;
            let max = r
                .max
                .as_ref()
                .map(|q| qty(slice, format!("{field}.validRange.max"), q))
                .transpose()?;
            let step = r
                .step
                .as_ref()
                .map(|q| qty(slice, format!("{field}.validRange.step"), q))
                .transpose()?;
            Ok((min, max, step))
        })
        .transpose()?;
    Ok(Policy {
        default,
        valid_values,
        range,
    })
}

fn parse_device(slice: &str, driver: &str, di: usize, d: &Device) -> Result<DevInfo, AllocError> {
    let base = format!("spec.devices[{di}]");
    let mut consumes = Vec::new();
    for (ci, c) in d.consumes_counters.iter().flatten().enumerate() {
        let mut counters = Vec::new();
        for (name, counter) in &c.counters {
            counters.push((
                name.clone(),
                qty(
                    slice,
                    format!("{base}.consumesCounters[{ci}].counters.{name}"),
                    &counter.value,
                )?,
            ));
        }
        consumes.push((c.counter_set.clone(), counters));
    }
    let mut caps = Vec::new();
    for (name, c) in d.capacity.iter().flatten() {
        let field = format!("{base}.capacity.{name}");
        let value = qty(slice, format!("{field}.value"), &c.value)?;
        let policy = c
            .request_policy
            .as_ref()
            .map(|p| parse_policy(slice, &format!("{field}.requestPolicy"), p))
            .transpose()?;
        caps.push(Cap {
            published: name.clone(),
            fq: qualify(name, driver),
            value,
            policy,
        });
    }
    Ok(DevInfo {
        consumes,
        caps,
        multi: d.allow_multiple_allocations == Some(true),
    })
}

/// `domain/id` for a bare or qualified name.
pub(crate) fn qualify(name: &str, driver: &str) -> String {
    if name.contains('/') {
        name.to_string()
    } else {
        format!("{driver}/{name}")
    }
}

pub(crate) fn parse_slice(s: &ResourceSlice) -> Result<SliceInfo, AllocError> {
    let name = s.metadata.name.clone().unwrap_or_default();
    let mut counter_sets = Vec::new();
    for (i, cs) in s.spec.shared_counters.iter().flatten().enumerate() {
        let mut counters = Vec::new();
        for (cn, c) in &cs.counters {
            counters.push((
                cn.clone(),
                qty(
                    &name,
                    format!("spec.sharedCounters[{i}].counters.{cn}.value"),
                    &c.value,
                )?,
            ));
        }
        counter_sets.push((cs.name.clone(), counters));
    }
    let devices = s
        .spec
        .devices
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, d)| parse_device(&name, &s.spec.driver, i, d))
        .collect::<Result<_, _>>()?;
    Ok(SliceInfo {
        counter_sets,
        devices,
    })
}

/// Whether a node selector selects the node, knowing only its name: terms are
/// ORed; a term matches when all its `matchFields` on `metadata.name` hold and it
/// has no `matchExpressions` (node labels are not part of the inputs).
pub(crate) fn selector_matches(sel: &NodeSelector, node: &str) -> bool {
    sel.node_selector_terms.iter().any(|t| {
        if t.match_expressions.as_ref().is_some_and(|e| !e.is_empty()) {
            return false;
        }
        let fields = t.match_fields.as_deref().unwrap_or(&[]);
        !fields.is_empty()
            && fields.iter().all(|r| {
                let values = r.values.as_deref().unwrap_or(&[]);
                r.key == "metadata.name"
                    && match r.operator.as_str() {
                        "In" => values.iter().any(|v| v == node),
                        "NotIn" => !values.iter().any(|v| v == node),
                        _ => false,
                    }
            })
    })
}

fn device_on_node(d: &Device, node: &str) -> bool {
    if let Some(n) = &d.node_name {
        return n == node;
    }
    if d.all_nodes == Some(true) {
        return true;
    }
    d.node_selector
        .as_ref()
        .is_some_and(|s| selector_matches(s, node))
}

/// Whether a slice's devices are reachable from the node (per-device selection
/// is resolved per device).
fn slice_on_node(s: &ResourceSlice, node: &str) -> bool {
    let spec = &s.spec;
    if let Some(n) = &spec.node_name {
        return n == node;
    }
    if spec.all_nodes == Some(true) {
        return true;
    }
    if let Some(sel) = &spec.node_selector {
        return selector_matches(sel, node);
    }
    if spec.per_device_node_selection == Some(true) {
        return spec
            .devices
            .iter()
            .flatten()
            .any(|d| device_on_node(d, node));
    }
    false
}

/// A pool as seen from a node.
#[derive(Debug, Clone)]
pub(crate) struct Pool {
    pub driver: String,
    pub name: String,
    /// `Err(reason)` when the pool cannot be allocated from.
    pub usable: Result<(), String>,
    /// Slices with devices for the node, in input order.
    pub device_slices: Vec<usize>,
    /// All slices of the pool's current generation.
    pub all_slices: Vec<usize>,
    /// Counter set → counter → total.
    pub counters: BTreeMap<String, BTreeMap<String, Qty>>,
}

impl Pool {
    pub(crate) fn id(&self) -> String {
        format!("{}/{}", self.driver, self.name)
    }
}

/// The pools that have devices for `node`, sorted by driver then pool name.
///
/// Only the highest generation of a pool counts. A pool is unusable when it has
/// fewer slices of that generation than `resourceSliceCount`, a duplicate device
/// or counter-set name, or a `consumesCounters` reference to a counter set or
/// counter that none of its slices define. Counter sets are taken from every
/// slice of the generation, whether it also lists devices (1.34 layout) or not
/// (1.35+ layout).
pub(crate) fn gather_pools(
    slices: &[ResourceSlice],
    parsed: &[SliceInfo],
    node: &str,
) -> Vec<Pool> {
    let mut by_pool: BTreeMap<(String, String), Vec<usize>> = BTreeMap::new();
    for (i, s) in slices.iter().enumerate() {
        by_pool
            .entry((s.spec.driver.clone(), s.spec.pool.name.clone()))
            .or_default()
            .push(i);
    }
    let mut pools = Vec::new();
    for ((driver, name), idx) in by_pool {
        let generation = idx
            .iter()
            .map(|&i| slices[i].spec.pool.generation)
            .max()
            .unwrap_or_default();
        let all: Vec<usize> = idx
            .into_iter()
            .filter(|&i| slices[i].spec.pool.generation == generation)
            .collect();
        let device_slices: Vec<usize> = all
            .iter()
            .copied()
            .filter(|&i| {
                slices[i]
                    .spec
                    .devices
                    .as_ref()
                    .is_some_and(|d| !d.is_empty())
                    && slice_on_node(&slices[i], node)
            })
            .collect();
        if device_slices.is_empty() {
            continue;
        }
        let mut pool = Pool {
            driver,
            name,
            usable: Ok(()),
            device_slices,
            all_slices: all.clone(),
            counters: BTreeMap::new(),
        };
        pool.usable = validate_pool(&mut pool, slices, parsed, generation);
        pools.push(pool);
    }
    pools
}

fn validate_pool(
    pool: &mut Pool,
    slices: &[ResourceSlice],
    parsed: &[SliceInfo],
    generation: i64,
) -> Result<(), String> {
    let want = slices[pool.all_slices[0]].spec.pool.resource_slice_count;
    let have = pool.all_slices.len() as i64;
    if have < want {
        return Err(format!(
            "incomplete: {have} of {want} slices of generation {generation} present"
        ));
    }
    let mut names: HashMap<&str, usize> = HashMap::new();
    for &i in &pool.all_slices {
        for d in slices[i].spec.devices.iter().flatten() {
            if names.insert(d.name.as_str(), i).is_some() {
                return Err(format!("duplicate device name {}", d.name));
            }
        }
        for (set, counters) in &parsed[i].counter_sets {
            if pool.counters.contains_key(set) {
                return Err(format!("duplicate counter set name {set}"));
            }
            pool.counters
                .insert(set.clone(), counters.iter().cloned().collect());
        }
    }
    for &i in &pool.all_slices {
        for (d, info) in slices[i]
            .spec
            .devices
            .iter()
            .flatten()
            .zip(&parsed[i].devices)
        {
            for (set, counters) in &info.consumes {
                let Some(defined) = pool.counters.get(set) else {
                    return Err(format!(
                        "device {} consumes from counter set {set}, which no slice of the pool defines",
                        d.name
                    ));
                };
                for (c, _) in counters {
                    if !defined.contains_key(c) {
                        return Err(format!(
                            "device {} consumes counter {c}, which counter set {set} does not define",
                            d.name
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// Whether the device of a per-device-selection slice is reachable from the node.
pub(crate) fn device_visible(s: &ResourceSlice, d: &Device, node: &str) -> bool {
    if s.spec.per_device_node_selection == Some(true) {
        device_on_node(d, node)
    } else {
        true
    }
}
