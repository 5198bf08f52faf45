//! The real kube-scheduler's cost on carve's ResourceSlices: a control plane
//! built by `e2e/cluster/build.sh` (etcd, kube-apiserver, kube-scheduler; no
//! kubelet), `--nodes` Node objects made by hand, each with the slices
//! carve publishes for `--gpus`, and `--pods` pods each with a claim of its
//! own, made while the scheduler is stopped. The scheduler is then started
//! and timed until every pod is bound; its CPU time is read from
//! `/proc/<pid>/stat` over the same span.
//!
//! Scenarios, each on a fresh cluster: carve's partitionable layout (every
//! MIG placement a device consuming counters, MPS shares with consumable
//! capacity, the whole GPU) with MIG, MPS and whole-GPU claims; and one
//! device per whole GPU (no partitions) with whole-GPU claims, the baseline.
//!
//! Root only (the harness's network and mounts). Prints a Markdown table;
//! `docs/benchmarks.md` quotes it with the command that made it. Not a test:
//! nothing is asserted about time.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use carve_e2e::cluster::{self, Binaries, Cluster, Component};
use carve_e2e::workspace_root;
use carve_model::sharing::{ComputeLimit, MemoryLimit, MpsCapabilities};
use carve_model::slices::{
    GpuPolicy, KubeLayout, NodeGpu, SharingOptions, SliceOptions, build_slices, simulated_node,
};
use k8s_openapi::api::core::v1::{Node, Pod, ServiceAccount};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};

type R<T> = Result<T, Box<dyn std::error::Error>>;

const NS: &str = "default";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// What carve publishes: MIG placements, MPS shares, the whole GPU.
    Partitionable,
    /// One device per whole GPU.
    WholeOnly,
}

#[derive(Debug, Clone, Copy)]
enum Claim {
    Mig1g,
    Mps,
    Whole,
}

impl Claim {
    fn describe(self) -> &'static str {
        match self {
            Claim::Mig1g => "MIG 1g.10gb",
            Claim::Mps => "MPS share (10Gi, 33 SMs)",
            Claim::Whole => "whole GPU",
        }
    }

    fn request(self) -> serde_json::Value {
        let sel = |e: &str| serde_json::json!([{"cel": {"expression": e}}]);
        match self {
            Claim::Mig1g => serde_json::json!({
                "deviceClassName": "mig.gpu.carve.dev",
                "selectors": sel("device.attributes[\"gpu.carve.dev\"].profile == \"1g.10gb\""),
            }),
            Claim::Mps => serde_json::json!({
                "deviceClassName": "mps.gpu.carve.dev",
                "selectors": sel("device.attributes[\"gpu.carve.dev\"].type == \"mps\""),
                "capacity": {"requests": {"memory": "10Gi", "multiprocessors": "33"}},
            }),
            Claim::Whole => serde_json::json!({"deviceClassName": "gpu.carve.dev"}),
        }
    }
}

struct Args {
    nodes: usize,
    model: String,
    gpus: u32,
    pods: usize,
}

fn parse_args() -> R<Args> {
    let mut a = Args {
        nodes: 100,
        model: "h100-80gb".into(),
        gpus: 8,
        pods: 500,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--nodes" => a.nodes = value()?.parse()?,
            "--pods" => a.pods = value()?.parse()?,
            "--gpus" => {
                let v = value()?;
                let (m, n) = v
                    .split_once(':')
                    .ok_or_else(|| format!("--gpus {v}: want MODEL:COUNT"))?;
                a.model = m.into();
                a.gpus = n.parse()?;
            }
            other => {
                return Err(format!(
                    "unknown argument {other} (--nodes N --gpus MODEL:COUNT --pods N)"
                )
                .into());
            }
        }
    }
    Ok(a)
}

struct Measured {
    layout: Layout,
    claim: Claim,
    devices_per_node: usize,
    slices_per_node: usize,
    seconds: f64,
    cpu_seconds: f64,
}

/// The scheduler's user and system CPU time so far, in seconds.
fn cpu_seconds(pid: u32) -> R<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command's closing parenthesis; utime and stime are
    // the 14th and 15th fields of the whole line.
    let rest = stat
        .rsplit_once(')')
        .ok_or("unreadable /proc/<pid>/stat")?
        .1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 =
        f.get(11).ok_or("utime")?.parse::<u64>()? + f.get(12).ok_or("stime")?.parse::<u64>()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)?.unwrap_or(100);
    Ok(ticks as f64 / hz as f64)
}

fn node_slices(a: &Args, node: &str, layout: Layout, kube: KubeLayout) -> R<Vec<ResourceSlice>> {
    let policy = match layout {
        Layout::Partitionable => GpuPolicy::Dynamic,
        Layout::WholeOnly => GpuPolicy::Static {
            instances: Vec::new(),
        },
    };
    let gpus: Vec<NodeGpu> = simulated_node(&a.model, a.gpus)?
        .into_iter()
        .map(|g| NodeGpu::new(g, policy.clone()))
        .collect();
    let mut opts = SliceOptions::new(node, kube);
    if layout == Layout::Partitionable {
        opts.sharing = SharingOptions {
            mps_caps: Some(MpsCapabilities {
                memory_limit: MemoryLimit::Client,
                compute_limit: ComputeLimit::Percentage,
            }),
            mps: true,
            timeslice: false,
            mig_mps: true,
        };
    }
    Ok(build_slices(&gpus, &opts)?)
}

/// carve's DeviceClasses as its chart renders them.
fn device_classes(c: &Cluster) -> R<Vec<DeviceClass>> {
    let chart = workspace_root().join("deploy/helm/carve");
    let out = c.helm(&[
        "template",
        "carve",
        &chart.display().to_string(),
        "--show-only",
        "templates/deviceclasses.yaml",
    ])?;
    let mut classes = Vec::new();
    for doc in serde_norway::Deserializer::from_str(&out) {
        let v: serde_json::Value = serde::Deserialize::deserialize(doc)?;
        if v["kind"] == "DeviceClass" {
            classes.push(serde_json::from_value(v)?);
        }
    }
    if classes.is_empty() {
        return Err("the chart rendered no DeviceClass".into());
    }
    Ok(classes)
}

async fn make_nodes(
    client: &Client,
    a: &Args,
    layout: Layout,
    kube: KubeLayout,
) -> R<(usize, usize)> {
    let nodes: Api<Node> = Api::all(client.clone());
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let pp = PostParams::default();
    let mut per_node = (0, 0);
    for i in 0..a.nodes {
        let name = format!("bench-node-{i:03}");
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        }))?;
        nodes.create(&pp, &node).await?;
        // The API server's TaintNodesByCondition admission taints a new
        // Node not-ready until its kubelet reports; there is none here.
        nodes
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"spec": {"taints": null}})),
            )
            .await?;
        nodes
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"status": {
                    "capacity": {"cpu": "64", "memory": "512Gi", "pods": "110"},
                    "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110"},
                    "conditions": [{"type": "Ready", "status": "True", "reason": "Bench", "message": "no kubelet: a benchmark's Node object"}],
                }})),
            )
            .await?;
        let s = node_slices(a, &name, layout, kube)?;
        per_node = (
            s.iter()
                .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
                .sum(),
            s.len(),
        );
        for slice in &s {
            slices.create(&pp, slice).await?;
        }
    }
    Ok(per_node)
}

async fn make_pods(client: &Client, a: &Args, claim: Claim) -> R<()> {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let pp = PostParams::default();
    // No controller manager makes it here; the admission of pods needs it.
    let sa: Api<ServiceAccount> = Api::namespaced(client.clone(), NS);
    let default: ServiceAccount =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "default"}}))?;
    sa.create(&pp, &default).await?;
    for i in 0..a.pods {
        let name = format!("bench-{i:04}");
        let rc: ResourceClaim = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": NS},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": claim.request()}]}},
        }))?;
        claims.create(&pp, &rc).await?;
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "automountServiceAccountToken": false,
                "containers": [{
                    "name": "app",
                    "image": "registry.local/never-pulled:bench",
                    "resources": {"claims": [{"name": "gpu"}]},
                }],
                "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
            },
        }))?;
        pods.create(&pp, &pod).await?;
    }
    Ok(())
}

async fn bound(client: &Client) -> R<(usize, usize)> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let list = pods.list(&ListParams::default()).await?;
    let total = list.items.len();
    let bound = list
        .items
        .iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
        .count();
    Ok((bound, total))
}

/// Why one unbound pod is pending (its PodScheduled condition).
async fn pending_reason(client: &Client) -> String {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let Ok(list) = pods.list(&ListParams::default()).await else {
        return "(pods unreadable)".into();
    };
    list.items
        .into_iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_none())
        .find_map(|p| {
            p.status?
                .conditions?
                .into_iter()
                .find(|c| c.type_ == "PodScheduled")
                .and_then(|c| c.message)
        })
        .unwrap_or_else(|| "(no reason yet)".into())
}

async fn scenario(a: &Args, layout: Layout, claim: Claim) -> R<Measured> {
    let bins = Binaries::locate(&cluster::kube_version())?;
    let kube = KubeLayout::for_version(1, cluster::minor(&bins.kube_version))?;
    let root = PathBuf::from(format!("/tmp/carve-cl-bench-{}", std::process::id()));
    let mut c = Cluster::start_control_plane(bins, &root).await?;
    let client = c.client().await?;
    c.stop_component(Component::Scheduler);
    let classes: Api<DeviceClass> = Api::all(client.clone());
    for dc in device_classes(&c)? {
        classes.create(&PostParams::default(), &dc).await?;
    }
    let (devices_per_node, slices_per_node) = make_nodes(&client, a, layout, kube).await?;
    make_pods(&client, a, claim).await?;
    c.start_component(Component::Scheduler).await?;
    let pid = c.pid(Component::Scheduler).ok_or("no scheduler")?;
    let cpu0 = cpu_seconds(pid)?;
    let t0 = Instant::now();
    let limit = Duration::from_secs(300);
    loop {
        let (b, total) = bound(&client).await?;
        if b == total {
            break;
        }
        if t0.elapsed() > limit {
            return Err(format!(
                "{b} of {total} pods bound after {limit:?}; a pending one: {}\n{}",
                pending_reason(&client).await,
                c.log(Component::Scheduler, 30)
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seconds = t0.elapsed().as_secs_f64();
    let cpu_seconds = cpu_seconds(pid)? - cpu0;
    Ok(Measured {
        layout,
        claim,
        devices_per_node,
        slices_per_node,
        seconds,
        cpu_seconds,
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("scheduler-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> R<()> {
    let a = parse_args()?;
    let mut rows = Vec::new();
    for (layout, claim) in [
        (Layout::Partitionable, Claim::Mig1g),
        (Layout::Partitionable, Claim::Mps),
        (Layout::Partitionable, Claim::Whole),
        (Layout::WholeOnly, Claim::Whole),
    ] {
        eprintln!(
            "scheduler-bench: {layout:?} layout, {} claims ...",
            claim.describe()
        );
        let m = scenario(&a, layout, claim).await?;
        eprintln!(
            "scheduler-bench: {} pods bound in {:.1} s, scheduler CPU {:.1} s",
            a.pods, m.seconds, m.cpu_seconds
        );
        rows.push(m);
    }
    println!(
        "Kubernetes {}, {} nodes of {}x {}, {} pods each with its own claim, made before the scheduler starts",
        cluster::kube_version(),
        a.nodes,
        a.gpus,
        a.model,
        a.pods
    );
    println!();
    println!(
        "| layout | claim | devices / slices per node | pods bound per s | scheduler CPU s | CPU ms per pod |"
    );
    println!("|---|---|---|---|---|---|");
    for m in rows {
        let layout = match m.layout {
            Layout::Partitionable => "carve (partitionable)",
            Layout::WholeOnly => "one device per GPU",
        };
        println!(
            "| {layout} | {} | {} / {} | {:.1} | {:.1} | {:.1} |",
            m.claim.describe(),
            m.devices_per_node,
            m.slices_per_node,
            a.pods as f64 / m.seconds,
            m.cpu_seconds,
            m.cpu_seconds * 1000.0 / a.pods as f64
        );
    }
    Ok(())
}
