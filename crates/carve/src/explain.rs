//! `carve explain`: run the offline allocator on one claim against a node's
//! slices and print the allocation, or why it does not fit.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use carve_alloc::{Allocator, Inputs, Object};
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
    /// Explain against an empty simulated node with these GPUs (`model:count,...`).
    #[arg(long, default_value = "h100-80gb:2", value_parser = crate::parse_gpus_flag)]
    pub simulate_gpus: String,
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
    /// The kube-scheduler release the claim will meet (`1.35`, `1.36.1`):
    /// adds what that release's allocator does differently from carve's
    /// (upstream bugs fixed in later releases).
    #[arg(long, value_parser = parse_scheduler_version)]
    pub scheduler_version: Option<SchedulerVersion>,
}

/// A kube-scheduler release, `1.<minor>[.<patch>]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerVersion {
    /// Minor version.
    pub minor: u32,
    /// Patch release, when given.
    pub patch: Option<u32>,
}

impl std::fmt::Display for SchedulerVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.patch {
            Some(p) => write!(f, "1.{}.{p}", self.minor),
            None => write!(f, "1.{}", self.minor),
        }
    }
}

impl SchedulerVersion {
    /// Whether its allocator subtracts the counters of shared
    /// (multi-allocatable) devices already allocated: from 1.36.2
    /// (`k8s.io/dynamic-resource-allocation` `structured`: 1.34.4 through
    /// 1.36.1 skip every device not in `AllocatedDevices`; 1.36.2 and later
    /// ask `internal.IsDeviceAllocated`, which counts shared ones too). A
    /// 1.36 without its patch release is taken to be an early one.
    fn counts_shared_counters(self) -> bool {
        self.minor > 36 || (self.minor == 36 && self.patch.is_some_and(|p| p >= 2))
    }

    /// Whether its allocator enforces `distinctAttribute`: not in 1.34,
    /// whose `distinctAttributeConstraint` compares the attributes'
    /// pointers, never their values (fixed in 1.35).
    fn enforces_distinct_attribute(self) -> bool {
        self.minor >= 35
    }
}

/// `1.35`, `v1.36.1`; a release carve models (1.34 to 1.37).
fn parse_scheduler_version(s: &str) -> Result<SchedulerVersion, String> {
    let bad = || {
        format!(
            "not a kube-scheduler release like 1.35 or 1.36.1 (carve models {})",
            carve_model::slices::KubeVersion::modelled_list()
        )
    };
    let t = s.trim().trim_start_matches('v');
    let parts: Vec<&str> = t.split('.').collect();
    let num = |i: usize| -> Result<Option<u32>, String> {
        parts
            .get(i)
            .map(|p| p.parse().map_err(|_| bad()))
            .transpose()
    };
    if !(2..=3).contains(&parts.len()) {
        return Err(bad());
    }
    let (major, minor, patch) = (num(0)?, num(1)?, num(2)?);
    let (Some(major), Some(minor)) = (major, minor) else {
        return Err(bad());
    };
    if !carve_model::slices::KubeVersion::new(major, minor).is_modelled() {
        return Err(format!(
            "carve models kube-scheduler {} only",
            carve_model::slices::KubeVersion::modelled_list()
        ));
    }
    Ok(SchedulerVersion { minor, patch })
}

/// What the scheduler release `v` does differently from carve's allocator
/// for this claim on this node: one sentence each.
fn scheduler_notes(
    v: SchedulerVersion,
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
    if !v.counts_shared_counters() {
        let shared: std::collections::BTreeSet<(&str, &str)> = inputs
            .slices
            .iter()
            .filter(|s| s.spec.node_name.as_deref() == Some(node))
            .flat_map(|s| {
                s.spec.devices.iter().flatten().filter_map(move |d| {
                    d.allow_multiple_allocations
                        .unwrap_or(false)
                        .then_some((s.spec.pool.name.as_str(), d.name.as_str()))
                })
            })
            .collect();
        let held: std::collections::BTreeSet<&str> = inputs
            .claims_allocated
            .iter()
            .filter_map(|c| c.status.as_ref()?.allocation.as_ref()?.devices.as_ref())
            .flat_map(|d| d.results.iter().flatten())
            .filter(|r| r.driver == carve_model::DRIVER_NAME)
            .filter(|r| shared.contains(&(r.pool.as_str(), r.device.as_str())))
            .map(|r| r.device.as_str())
            .collect();
        if !held.is_empty() {
            notes.push(format!(
                "kube-scheduler {v} does not count the counters of shared devices already allocated ({} on this node): it can place this claim over them, which carve's prepare then refuses (fixed in 1.36.2)",
                held.into_iter().collect::<Vec<_>>().join(", ")
            ));
        }
    }
    notes
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

/// What `explain` adds where the scheduler of Kubernetes 1.36 and earlier
/// would still refuse a claim that fits.
const UPSTREAM_LEAK_NOTE: &str = "  but kube-scheduler 1.36 and earlier (without kubernetes/kubernetes PR #140431) refuses it: its allocator keeps the shared counters of candidates it rejects on a constraint or taint (kubernetes/kubernetes#140436), and this claim's search rejects some; the pod stays pending there until the scheduler has the fix\n";

/// Build the allocator inputs and the claim; returns (text, fits).
pub fn run(args: &ExplainArgs) -> anyhow::Result<(String, bool)> {
    let claim = load_claim(&args.claim)?;
    let mut objects = match &args.slices {
        Some(p) => carve_alloc::load_yaml_documents(p)?,
        None => {
            let sargs = crate::slices::SlicesArgs {
                gpus_flag: "--simulate-gpus",
                ..crate::slices::SlicesArgs::simulated(
                    &args.simulate_gpus,
                    carve_apiserver::KubeVersion::default(),
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
    let notes = args
        .scheduler_version
        .map(|v| scheduler_notes(v, &inputs, &claim, &node))
        .unwrap_or_default();
    let noted = |mut text: String| {
        for n in &notes {
            let _ = writeln!(text, "  note: {n}");
        }
        text
    };
    let upstream_refuses = |fits: bool| -> anyhow::Result<bool> {
        Ok(fits && alloc.refused_by_upstream_counter_leak(&claim, &node)?)
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
            if upstream_refuses(true)? {
                out.push_str(UPSTREAM_LEAK_NOTE);
            }
            Ok((noted(out), true))
        }
        Err(carve_alloc::AllocError::Unsatisfiable(expl)) => {
            let text = if args.json {
                serde_json::to_string_pretty(&expl)? + "\n"
            } else if args.devices {
                format!("{expl:#}")
            } else {
                noted(expl.to_string())
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
            node: None,
            json: false,
            devices: false,
            scheduler_version: None,
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
