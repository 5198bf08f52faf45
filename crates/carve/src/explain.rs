//! `carve explain`: run the offline allocator on one claim against a node's
//! slices and print the allocation, or why it does not fit.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use carve_alloc::{Allocator, Inputs, Object};
use carve_model::scheduler::SchedulerVersion;
use k8s_openapi::api::resource::v1::ResourceClaim;

/// The DeviceClasses carve ships (the same file the Helm chart's classes are checked against).
pub const DEVICE_CLASSES: &str = include_str!("../../../examples/deviceclasses.yaml");

#[derive(Debug, clap::Args)]
pub struct ExplainArgs {
    /// The ResourceClaim (YAML; the first ResourceClaim in the file is explained).
    pub claim: PathBuf,
    /// Multi-document YAML with the ResourceSlices, DeviceClasses and already-allocated
    /// ResourceClaims to explain against.
    #[arg(long, conflicts_with = "simulate_gpus")]
    pub slices: Option<PathBuf>,
    /// Explain against an empty simulated node with these GPUs (`model:count,...`):
    /// by default the node `carve simulate` and `carve slices` run. The same
    /// flag as theirs (`--simulate-gpus`, its former name, still works).
    #[arg(
        long = "gpus",
        alias = "simulate-gpus",
        value_name = "GPUS",
        default_value = crate::slices::DEFAULT_GPUS,
        value_parser = crate::parse_gpus_flag
    )]
    pub simulate_gpus: String,
    /// Shared devices the simulated node publishes besides MIG partitions and
    /// whole GPUs, as `carve simulate --sharing`: `mps`, `mig-mps`,
    /// `timeslice`, or `none`.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_values = crate::slices::DEFAULT_SHARING,
        conflicts_with = "slices"
    )]
    pub sharing: Vec<crate::simulate::SimSharing>,
    /// Kubernetes version of the simulated node's API server (its slice
    /// layout), as `carve simulate --kube-version`.
    #[arg(
        long,
        default_value = crate::slices::DEFAULT_KUBE_VERSION,
        value_parser = crate::parse_kube_version,
        conflicts_with = "slices"
    )]
    pub kube_version: carve_apiserver::KubeVersion,
    /// Node name (defaults to the node of the first slice).
    #[arg(long)]
    pub node: Option<String>,
    /// Print the result as JSON (the allocation when the claim fits, the
    /// explanation when it does not).
    #[arg(long)]
    pub json: bool,
    /// List every rejected device with its reason, instead of one line per
    /// reason with device counts per GPU.
    #[arg(long)]
    pub devices: bool,
    /// The kube-scheduler the claim will meet, and the GPUs of the
    /// simulated node that host shares: as `carve slices`. With
    /// `--scheduler-version` (or, on a simulated node, the oldest scheduler
    /// the skew policy allows beside `--kube-version`), notes where that
    /// release's allocator does otherwise than carve's.
    #[command(flatten)]
    pub shares: crate::shares::ShareArgs,
}

/// What the scheduler release `v` does differently from carve's allocator
/// for this claim on this node: one sentence each.
fn scheduler_notes(
    v: SchedulerVersion,
    assumed: bool,
    inputs: &Inputs,
    claim: &ResourceClaim,
    node: &str,
) -> Vec<String> {
    let mut notes = Vec::new();
    let distinct = claim
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.constraints.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|c| c.distinct_attribute.clone())
        .collect::<Vec<_>>();
    if !distinct.is_empty() && !v.enforces_distinct_attribute() {
        notes.push(format!(
            "kube-scheduler {v} does not enforce distinctAttribute ({}): its allocator compares the attributes' pointers, not their values (fixed in 1.35), so the claim can get devices that share the attribute",
            distinct.join(", ")
        ));
    }
    if !v.checks_chosen_device_capacity() && asks_for_several_devices(claim) {
        notes.push(format!(
            "kube-scheduler {v} with DRAConsumableCapacity on checks the k-th device of a request on the k-th device of the chosen device's slice, and panics where that slice has fewer devices, which crashes kube-scheduler (fixed in 1.35): keep that gate off on a 1.34 scheduler (carve publishes no share for one)"
        ));
    }
    if !v.counts_shared_counters() {
        let held = held_shares_overlapped(inputs, node);
        if !held.is_empty() {
            notes.push(format!(
                "kube-scheduler {v} does not count the counters of shared devices already allocated ({} on this node, which other published devices overlap): it can place this claim over them, which carve's prepare then refuses (fixed in 1.36.2; carve publishes shares apart for such a scheduler, see --shared-gpus)",
                held.join(", ")
            ));
        }
    }
    if assumed && !notes.is_empty() {
        notes.push(format!(
            "kube-scheduler {v} is assumed: the oldest the version-skew policy allows beside this API server; give yours with --scheduler-version"
        ));
    }
    notes
}

/// Whether a request of `claim` (or a subrequest) asks for more than one
/// device: `count` above 1 or `allocationMode: All`.
fn asks_for_several_devices(claim: &ResourceClaim) -> bool {
    let several = |mode: Option<&String>, count: Option<i64>| {
        mode.is_some_and(|m| m == "All") || count.is_some_and(|c| c > 1)
    };
    claim
        .spec
        .devices
        .iter()
        .flat_map(|d| d.requests.iter().flatten())
        .any(|r| {
            r.exactly
                .as_ref()
                .is_some_and(|e| several(e.allocation_mode.as_ref(), e.count))
                || r.first_available
                    .iter()
                    .flatten()
                    .any(|s| several(s.allocation_mode.as_ref(), s.count))
        })
}

/// The shared devices of `node` that claims already hold and that some
/// other published device overlaps: both consume one counter of one set
/// beyond its capacity together (the layout a scheduler that leaves shares'
/// counters out can overcommit). Sorted.
fn held_shares_overlapped(inputs: &Inputs, node: &str) -> Vec<String> {
    use carve_model::slices::quantity::parse;
    let on_node = || {
        inputs
            .slices
            .iter()
            .filter(move |s| s.spec.node_name.as_deref() == Some(node))
    };
    let mut capacity: BTreeMap<(&str, &str), i128> = BTreeMap::new();
    for set in on_node().flat_map(|s| s.spec.shared_counters.iter().flatten()) {
        for (k, c) in &set.counters {
            if let Ok(q) = parse(&c.value) {
                capacity.insert((set.name.as_str(), k.as_str()), q.milli());
            }
        }
    }
    // (counter set, counter) and an amount in milli-units.
    type Use<'a> = ((&'a str, &'a str), i128);
    // (pool, device) -> whether it is shared, its consumption.
    let mut uses: BTreeMap<(&str, &str), (bool, Vec<Use<'_>>)> = BTreeMap::new();
    for s in on_node() {
        for d in s.spec.devices.iter().flatten() {
            let mut u = Vec::new();
            for cc in d.consumes_counters.iter().flatten() {
                for (k, c) in &cc.counters {
                    if let Ok(q) = parse(&c.value) {
                        u.push(((cc.counter_set.as_str(), k.as_str()), q.milli()));
                    }
                }
            }
            let shared = d.allow_multiple_allocations.unwrap_or(false);
            uses.insert((s.spec.pool.name.as_str(), d.name.as_str()), (shared, u));
        }
    }
    let overlapped = |key: (&str, &str), mine: &[Use<'_>]| {
        uses.iter().any(|(other, (_, theirs))| {
            *other != key
                && other.0 == key.0
                && mine.iter().any(|(counter, a)| {
                    theirs.iter().any(|(c, b)| {
                        c == counter && capacity.get(counter).is_some_and(|cap| a + b > *cap)
                    })
                })
        })
    };
    let held: std::collections::BTreeSet<String> = inputs
        .claims_allocated
        .iter()
        .filter_map(|c| c.status.as_ref()?.allocation.as_ref()?.devices.as_ref())
        .flat_map(|d| d.results.iter().flatten())
        .filter(|r| r.driver == carve_model::DRIVER_NAME)
        .filter(|r| {
            let key = (r.pool.as_str(), r.device.as_str());
            uses.get(&key)
                .is_some_and(|(shared, mine)| *shared && overlapped(key, mine))
        })
        .map(|r| r.device.clone())
        .collect();
    held.into_iter().collect()
}

fn embedded_classes() -> anyhow::Result<Vec<Object>> {
    Ok(carve_alloc::parse_yaml_documents(
        Path::new("<built-in deviceclasses.yaml>"),
        DEVICE_CLASSES,
    )?)
}

fn load_claim(path: &Path) -> anyhow::Result<ResourceClaim> {
    carve_alloc::load_yaml_documents(path)?
        .into_iter()
        .find_map(|o| match o {
            Object::Claim(c) => Some(c),
            _ => None,
        })
        .with_context(|| format!("{}: no ResourceClaim in the file", path.display()))
}

#[derive(Debug, clap::Args)]
pub struct DefragArgs {
    /// Multi-document YAML: the ResourceSlices, DeviceClasses (the built-in ones if
    /// none) and allocated ResourceClaims of the cluster state.
    #[arg(long)]
    pub state: PathBuf,
    /// The ResourceClaim that should fit.
    #[arg(long)]
    pub request: PathBuf,
    /// Node to make room on (defaults to the first node of the state).
    #[arg(long)]
    pub node: Option<String>,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `carve defrag`: the plan as text or JSON.
pub fn defrag(args: &DefragArgs) -> anyhow::Result<String> {
    let claim = load_claim(&args.request)?;
    let mut objects = carve_alloc::load_yaml_documents(&args.state)?;
    if !objects.iter().any(|o| matches!(o, Object::Class(_))) {
        objects.extend(embedded_classes()?);
    }
    let (inputs, _) = Inputs::from_objects(objects);
    let node = match &args.node {
        Some(n) => n.clone(),
        None => Allocator::new(&inputs)?
            .node_names()
            .into_iter()
            .next()
            .with_context(|| format!("{}: no node in the state", args.state.display()))?,
    };
    let plan = match carve_alloc::plan_defrag(&inputs, &claim, &node) {
        // Nothing to move is a good answer, not a failure.
        Err(carve_alloc::AllocError::AlreadyFits {
            claim,
            node,
            devices,
        }) if args.json => {
            let json = serde_json::json!({
                "claim": claim,
                "node": node,
                "alreadyFits": true,
                "devices": devices,
            });
            return Ok(serde_json::to_string_pretty(&json)? + "\n");
        }
        Err(e @ carve_alloc::AllocError::AlreadyFits { .. }) => return Ok(format!("{e}\n")),
        other => other?,
    };
    Ok(if args.json {
        serde_json::to_string_pretty(&plan)? + "\n"
    } else {
        format!("{plan}\n")
    })
}

/// What to say about a claim that does not fit, made true against the
/// allocator: its explanation keeps only the "would fit if" suggestions
/// after which the claim does fit (the allocator re-run with the named
/// claims released), and where the claim does not fit even with every
/// device free, that is said with why (as `carve defrag` says it).
#[derive(Debug)]
pub struct NoFit {
    /// The explanation on the node as it is, with the true suggestions only.
    pub explanation: carve_alloc::Explanation,
    /// Why the claim does not fit with every device free, when it does not.
    pub on_empty: Option<carve_alloc::Explanation>,
    /// What the node offers (one line per kind of device), when some request
    /// finds no device even on the empty node.
    pub offers: Vec<String>,
}

impl NoFit {
    /// Check `explanation` of `claim` on `node` against `inputs`.
    pub fn check(
        inputs: &Inputs,
        claim: &ResourceClaim,
        node: &str,
        mut explanation: carve_alloc::Explanation,
    ) -> Result<NoFit, carve_alloc::AllocError> {
        let mut kept = Vec::new();
        for s in std::mem::take(&mut explanation.suggestions) {
            let mut alloc = Allocator::new(inputs)?;
            for r in &s.release {
                alloc.release(&r.claim);
            }
            if alloc.allocate(claim, node).is_ok() {
                kept.push(s);
            }
        }
        explanation.suggestions = kept;
        let empty_inputs = Inputs {
            slices: inputs.slices.clone(),
            classes: inputs.classes.clone(),
            claims_allocated: Vec::new(),
        };
        let empty = Allocator::new(&empty_inputs)?;
        let on_empty = match empty.allocate(claim, node) {
            Ok(_) => None,
            Err(carve_alloc::AllocError::Unsatisfiable(e)) => Some(*e),
            Err(e) => return Err(e),
        };
        if on_empty.is_some() {
            explanation.suggestions.clear();
        }
        let offers = if on_empty
            .as_ref()
            .is_some_and(|e| e.requests.iter().any(|r| r.candidates.is_empty()))
        {
            node_offers(inputs, node)
        } else {
            Vec::new()
        };
        Ok(NoFit {
            explanation,
            on_empty,
            offers,
        })
    }

    /// The text: the reasons (every rejected device with `devices`), and
    /// what to try.
    pub fn text(&self, devices: bool) -> String {
        let mut out = String::new();
        let e = &self.explanation;
        match &self.on_empty {
            Some(empty) => {
                let _ = writeln!(
                    out,
                    "claim {} does not fit on node {} even with every device free, so no release of other claims can make it fit:",
                    e.claim, e.node
                );
                let why = if devices {
                    format!("{empty:#}")
                } else {
                    empty.to_string()
                };
                for l in why.lines().skip(1) {
                    let _ = writeln!(out, "{l}");
                }
                if !self.offers.is_empty() {
                    let _ = writeln!(out, "  node {} offers:", e.node);
                    for o in &self.offers {
                        let _ = writeln!(out, "    {o}");
                    }
                }
            }
            None => {
                out.push_str(&if devices {
                    format!("{e:#}")
                } else {
                    e.to_string()
                });
                if e.suggestions.is_empty() {
                    let _ = writeln!(
                        out,
                        "  it would fit with every device free, but freeing any one device it could use is not enough: it needs several claims released (`carve defrag` looks for claims to move elsewhere)"
                    );
                }
            }
        }
        out
    }

    /// The JSON: the explanation, and `fitsOnEmptyNode`, `onEmptyNode`
    /// (why not, when it does not) and `nodeOffers`.
    pub fn json(&self) -> serde_json::Result<serde_json::Value> {
        let mut v = serde_json::to_value(&self.explanation)?;
        if let Some(o) = v.as_object_mut() {
            o.insert(
                "fitsOnEmptyNode".into(),
                serde_json::Value::Bool(self.on_empty.is_none()),
            );
            if let Some(e) = &self.on_empty {
                o.insert("onEmptyNode".into(), serde_json::to_value(e)?);
            }
            if !self.offers.is_empty() {
                o.insert("nodeOffers".into(), serde_json::to_value(&self.offers)?);
            }
        }
        Ok(v)
    }
}

/// The kinds of device `node` publishes, one line each: the class that
/// selects them and their MIG profiles (for MIG partitions and their MPS
/// shares) or GPU products.
pub fn node_offers(inputs: &Inputs, node: &str) -> Vec<String> {
    use std::collections::{BTreeMap, BTreeSet};
    let mut kinds: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for slice in inputs
        .slices
        .iter()
        .filter(|s| s.spec.node_name.as_deref() == Some(node))
        .filter(|s| s.spec.driver == carve_model::DRIVER_NAME)
    {
        for d in slice.spec.devices.iter().flatten() {
            let attr = |k: &str| {
                d.attributes
                    .as_ref()
                    .and_then(|a| a.get(k))
                    .and_then(|a| a.string.clone())
            };
            let Some(kind) = attr("type") else { continue };
            let what = attr("profile")
                .or_else(|| attr("productName"))
                .unwrap_or_else(|| d.name.clone());
            kinds.entry(kind).or_default().insert(what);
        }
    }
    kinds
        .into_iter()
        .map(|(kind, what)| {
            let class = if kind == "gpu" {
                carve_model::DRIVER_NAME.to_string()
            } else {
                format!("{kind}.{}", carve_model::DRIVER_NAME)
            };
            let label = match kind.as_str() {
                "gpu" => "whole GPUs",
                "mig" => "MIG partitions",
                "mps" => "MPS shares of whole GPUs",
                "mig-mps" => "MPS shares of MIG partitions",
                "timeslice" => "time-sliced whole GPUs",
                _ => "devices",
            };
            format!(
                "{label} (class {class}): {}",
                what.into_iter().collect::<Vec<_>>().join(", ")
            )
        })
        .collect()
}

/// The claim's allocation when it already has one: its own
/// `status.allocation`, or that of the allocated claim of the same
/// namespace/name in the state.
fn existing_allocation(
    inputs: &Inputs,
    claim: &ResourceClaim,
) -> Option<k8s_openapi::api::resource::v1::AllocationResult> {
    if let Some(a) = claim.status.as_ref().and_then(|s| s.allocation.clone()) {
        return Some(a);
    }
    let who = |c: &ResourceClaim| {
        (
            c.metadata
                .namespace
                .clone()
                .unwrap_or_else(|| "default".into()),
            c.metadata.name.clone().unwrap_or_default(),
        )
    };
    inputs
        .claims_allocated
        .iter()
        .find(|c| who(c) == who(claim))
        .and_then(|c| c.status.as_ref()?.allocation.clone())
}

/// `request -> device (pool)` lines of an allocation.
fn result_lines(result: &k8s_openapi::api::resource::v1::AllocationResult) -> String {
    let mut out = String::new();
    for r in result
        .devices
        .iter()
        .flat_map(|d| d.results.iter().flatten())
    {
        let _ = write!(
            out,
            "  request {:<12} -> {} (pool {})",
            r.request, r.device, r.pool
        );
        if let Some(c) = &r.consumed_capacity {
            let caps: Vec<String> = c.iter().map(|(k, v)| format!("{k}={}", v.0)).collect();
            let _ = write!(out, "  consumes {}", caps.join(" "));
        }
        out.push('\n');
    }
    out
}

/// What `explain` adds where the scheduler of Kubernetes 1.36.2 and
/// earlier would still refuse a claim that fits.
const UPSTREAM_LEAK_NOTE: &str = "  but kube-scheduler 1.36.2 and earlier refuses it: its allocator keeps the shared counters of candidates it rejects on a constraint or taint (kubernetes/kubernetes#140436; fixed in 1.36.3), and this claim's search rejects some; the pod stays pending there until the scheduler has the fix\n";

/// Build the allocator inputs and the claim; returns (text, fits).
pub fn run(args: &ExplainArgs) -> anyhow::Result<(String, bool)> {
    let claim = load_claim(&args.claim)?;
    let mut objects = match &args.slices {
        Some(p) => carve_alloc::load_yaml_documents(p)?,
        None => {
            let sargs = crate::slices::SlicesArgs {
                gpus_flag: "--gpus",
                sharing: Some(args.sharing.clone()),
                shares: args.shares.clone(),
                ..crate::slices::SlicesArgs::simulated(
                    &args.simulate_gpus,
                    args.kube_version,
                    args.node.as_deref().unwrap_or("sim-node"),
                )
            };
            crate::slices::build(&sargs)?
                .into_iter()
                .map(Object::Slice)
                .collect()
        }
    };
    if !objects.iter().any(|o| matches!(o, Object::Class(_))) {
        objects.extend(embedded_classes()?);
    }
    let (inputs, _unallocated) = Inputs::from_objects(objects);
    let node = match &args.node {
        Some(n) => n.clone(),
        None => inputs
            .slices
            .iter()
            .find_map(|s| s.spec.node_name.clone())
            .context("no slice names a node: pass --node")?,
    };
    if inputs.slices.is_empty() {
        bail!("no ResourceSlices to explain against");
    }
    let alloc = Allocator::new(&inputs)?;
    let name = claim.metadata.name.clone().unwrap_or_default();
    // The scheduler the notes are for: the one given, else on a simulated
    // node the oldest the skew policy allows beside its API server.
    let scheduler = match (args.shares.scheduler_version, &args.slices) {
        (Some(v), _) => Some((v, false)),
        (None, None) => Some((
            carve_model::scheduler::SchedulerVersion::oldest_for(args.kube_version.minor),
            true,
        )),
        (None, Some(_)) => None,
    };
    let notes = scheduler
        .map(|(v, assumed)| scheduler_notes(v, assumed, &inputs, &claim, &node))
        .unwrap_or_default();
    let noted = |mut text: String| {
        for n in &notes {
            let _ = writeln!(text, "  note: {n}");
        }
        text
    };
    if let Some(existing) = existing_allocation(&inputs, &claim) {
        let results: Vec<_> = existing
            .devices
            .iter()
            .flat_map(|d| d.results.iter().flatten())
            .collect();
        if args.json {
            let json = serde_json::json!({
                "claim": name,
                "node": node,
                "fits": true,
                "alreadyAllocated": true,
                "results": results,
            });
            return Ok((serde_json::to_string_pretty(&json)? + "\n", true));
        }
        let out = format!(
            "claim {name} is already allocated (its status.allocation); it holds:\n{}  (explain a claim without status.allocation to see where it would go now)\n",
            result_lines(&existing)
        );
        return Ok((out, true));
    }
    // Only for a scheduler with the leak, or one not known.
    let leaks = scheduler.is_none_or(|(v, _)| v.leaks_rejected_counters());
    let upstream_refuses = |fits: bool| -> anyhow::Result<bool> {
        Ok(fits && leaks && alloc.refused_by_upstream_counter_leak(&claim, &node)?)
    };
    match alloc.allocate(&claim, &node) {
        Ok(result) if args.json => {
            let results: Vec<_> = result
                .devices
                .iter()
                .flat_map(|d| d.results.iter().flatten())
                .collect();
            let json = serde_json::json!({
                "claim": name,
                "node": node,
                "fits": true,
                "results": results,
                "refusedByUnfixedScheduler": upstream_refuses(true)?,
                "schedulerNotes": notes,
            });
            Ok((serde_json::to_string_pretty(&json)? + "\n", true))
        }
        Ok(result) => {
            let mut out = format!("claim {name} fits on node {node}:\n");
            out.push_str(&result_lines(&result));
            if upstream_refuses(true)? {
                out.push_str(UPSTREAM_LEAK_NOTE);
            }
            Ok((noted(out), true))
        }
        Err(carve_alloc::AllocError::Unsatisfiable(expl)) => {
            let no_fit = NoFit::check(&inputs, &claim, &node, *expl)?;
            let text = if args.json {
                serde_json::to_string_pretty(&no_fit.json()?)? + "\n"
            } else if args.devices {
                no_fit.text(true)
            } else {
                noted(no_fit.text(false))
            };
            Ok((text, false))
        }
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    fn args(claim: PathBuf, gpus: &str) -> ExplainArgs {
        ExplainArgs {
            claim,
            slices: None,
            simulate_gpus: gpus.into(),
            sharing: Vec::new(),
            kube_version: carve_apiserver::KubeVersion::default(),
            node: None,
            json: false,
            devices: false,
            shares: crate::shares::ShareArgs::default(),
        }
    }

    const CLAIM_7G: &str = "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: big\n  namespace: default\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n        deviceClassName: mig.gpu.carve.dev\n        count: 3\n        selectors:\n        - cel:\n            expression: device.attributes[\"gpu.carve.dev\"].profile == \"7g.80gb\"\n";

    #[test]
    fn example_claim_fits_on_the_simulated_node() {
        let claim = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/mig-1g/pod.yaml");
        let (text, fits) = run(&args(claim, "h100-80gb:1")).unwrap();
        assert!(fits, "{text}");
        assert!(text.contains("gpu-0-mig-1g10gb-"), "{text}");
    }

    #[test]
    fn too_many_full_gpus_do_not_fit_and_say_why() {
        let dir = tempfile::tempdir().unwrap();
        let claim = write(dir.path(), "c.yaml", CLAIM_7G);
        let (text, fits) = run(&args(claim, "h100-80gb:2")).unwrap();
        assert!(!fits);
        assert!(text.contains("does not fit"), "{text}");
    }

    #[test]
    fn a_file_without_a_claim_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(
            dir.path(),
            "x.yaml",
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n",
        );
        let e = run(&args(p.clone(), "h100-80gb:1")).unwrap_err();
        assert!(format!("{e:#}").contains("x.yaml"), "{e:#}");
    }
}
