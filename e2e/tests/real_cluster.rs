//! carve on a real one-node Kubernetes cluster: the control plane, kubelet
//! and containerd built from their upstream modules (`e2e/cluster/build.sh`,
//! [`carve_e2e::cluster`]), carve installed by its own chart with the real
//! helm, its image built here from the binary this build made, and the NVML
//! simulator in a fake driver root on the host where a GPU node's driver
//! would be.
//!
//! Without the cluster's programs it prints `SKIPPED real-cluster suite` and
//! what is missing, and passes, unless `CARVE_CLUSTER_REQUIRED=1` (CI sets
//! it): then a missing program fails it. Root only.
//!
//! `CARVE_E2E_KEEP=1` leaves the cluster's directory (logs, specs, state)
//! behind; `CARVE_KUBE_VERSION` picks another built Kubernetes release.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use carve_e2e::cluster::{self, Binaries, Cluster, ClusterError, Component};
use carve_e2e::{carve_binary, image_binaries, sim_library, workspace_root};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate, ResourceSlice};
use kube::api::{DeleteParams, ListParams, LogParams, PostParams};
use kube::{Api, Client};

#[path = "real_cluster/grants.rs"]
mod grants;

const NS: &str = "carve-e2e";
const PLUGIN_NS: &str = "carve-system";
/// The GPUs of the simulated node: two H100s and two A100s (MIG off).
const SIM_GPUS: &str =
    r#"[{"model": "h100-80gb", "count": 2}, {"model": "a100-40gb", "count": 2}]"#;
const SIM_GPU_COUNT: u32 = 4;
/// Where shares are published apart (a scheduler that may be older than
/// 1.36.2): GPU 0 stays exclusive (the MIG examples, the whole GPU), GPU 1
/// hosts MIG-MPS on its `2g.20gb` instances, GPU 2 MPS, GPU 3 time-slicing.
const SHARED_GPUS: &str = "1=mig-mps:2g.20gb,2=mps,3=timeslice";
/// The MPS control daemon's double in the fake driver root, and as the
/// plugin's container sees it.
const MPS_CONTROL: &str = "usr/bin/carve-fake-mps-control";
/// The pod with a running MPS share through the faults.
const MPS_HOLDER: &str = "mps-holder";
/// The whole-GPU class's extended resource name in the suite's values.
const EXTENDED_RESOURCE: &str = "gpu.carve.dev/gpu";

type R<T> = Result<T, Box<dyn std::error::Error>>;

fn say(s: &str) {
    eprintln!("[real-cluster {:>7.1}s] {s}", START.elapsed().as_secs_f64());
}

static START: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);

/// What the probe container prints: its GPU-related environment, the
/// device nodes and driver libraries it was given, and for MPS its control
/// socket and the daemon's `/dev/shm` files. One fact a line, parsed by
/// [`Probe::parse`].
const PROBE_SCRIPT: &str = r#"
env | grep -E '^(NVIDIA|CUDA)_' | sort | sed 's/^/env /'
for d in /dev/nvidia* /dev/nvidia-caps/*; do
  [ -c "$d" ] && echo "dev $d $(stat -c '%t:%T' "$d")"
done
for l in /usr/lib/x86_64-linux-gnu/libcuda.so* /usr/lib/x86_64-linux-gnu/libnvidia-ml.so*; do
  [ -e "$l" ] && echo "lib $l"
done
if [ -n "$CUDA_MPS_PIPE_DIRECTORY" ]; then
  [ -S "$CUDA_MPS_PIPE_DIRECTORY/control" ] && echo "mps control-socket"
  for f in /dev/shm/cuda.shm.*; do [ -e "$f" ] && echo "mps shm $f"; done
fi
echo probe-done
"#;

#[derive(Debug, Default)]
struct Probe {
    env: BTreeMap<String, String>,
    devs: Vec<String>,
    libs: Vec<String>,
    mps: Vec<String>,
    done: bool,
}

impl Probe {
    fn parse(log: &str) -> Self {
        let mut p = Probe::default();
        for line in log.lines() {
            if let Some(kv) = line.strip_prefix("env ") {
                if let Some((k, v)) = kv.split_once('=') {
                    p.env.insert(k.into(), v.into());
                }
            } else if let Some(d) = line.strip_prefix("dev ") {
                p.devs.push(d.split(' ').next().unwrap_or(d).into());
            } else if let Some(l) = line.strip_prefix("lib ") {
                p.libs.push(l.into());
            } else if let Some(m) = line.strip_prefix("mps ") {
                p.mps.push(m.into());
            } else if line == "probe-done" {
                p.done = true;
            }
        }
        p
    }
}

fn required() -> bool {
    std::env::var("CARVE_CLUSTER_REQUIRED").is_ok_and(|v| v == "1")
}

/// The host side of a GPU node: the NVIDIA driver's files under a driver
/// root, where the simulator library stands in for `libnvidia-ml.so.<ver>`
/// (as the real one is on a GPU node), and the simulator's configuration
/// and fake `/proc/devices` in the plugin's state directory.
struct GpuHost {
    driver_root: PathBuf,
    state_dir: PathBuf,
    sim_config: serde_json::Value,
}

fn gpu_host(root: &Path, sim_lib: &Path) -> R<GpuHost> {
    let version = "580.65.06";
    let minors: Vec<u32> = (0..SIM_GPU_COUNT).collect();
    let fake =
        nvidia_ml_sim::driver_root::write_fake_driver(&root.join("gpu-host"), version, &minors)?;
    let nvml = fake
        .root
        .join(nvidia_ml_sim::driver_root::LIB_DIR)
        .join(format!("libnvidia-ml.so.{version}"));
    std::fs::copy(sim_lib, &nvml)?;
    // Where a GPU node's driver has nvidia-cuda-mps-control: carve's double
    // of it (the carve binary under the double's name), which the plugin
    // runs from the driver root.
    std::fs::copy(carve_binary()?, fake.root.join(MPS_CONTROL))?;
    let state_dir = root.join("carve-state");
    let sim_dir = state_dir.join("nvml-sim");
    std::fs::create_dir_all(&sim_dir)?;
    std::fs::copy(&fake.devices_file, sim_dir.join("devices"))?;
    let sim_config = serde_json::json!({
        "nodeName": cluster::NODE,
        "gpus": serde_json::from_str::<serde_json::Value>(SIM_GPUS)?,
        "stateFile": "/var/lib/carve/nvml-sim/state.json",
        "procRoot": "/var/lib/carve/nvml-sim/proc",
        "driverVersion": version,
    });
    Ok(GpuHost {
        driver_root: fake.root,
        state_dir,
        sim_config,
    })
}

/// The chart's values for this node: the defaults of a GPU node (privileged
/// plugin, NVML from the driver root) but for the image built here, the
/// kubelet's and containerd's directories of this cluster, and the simulator.
fn values(c: &Cluster, host: &GpuHost) -> R<PathBuf> {
    let v = serde_json::json!({
        "image": {"repository": cluster::CARVE_REPOSITORY, "tag": cluster::CARVE_TAG, "pullPolicy": "Never"},
        "logLevel": "info,carve=debug",
        "driverRoot": host.driver_root,
        "kubeletPlugin": {
            "kubeletRootDir": c.layout.kubelet_root,
            "cdiDir": c.layout.cdi,
            "stateDir": host.state_dir,
            "procDriverNvidia": "/var/lib/carve/nvml-sim/proc",
            "procDevices": "/var/lib/carve/nvml-sim/devices",
        },
        "nvml": {"simulator": {"enabled": true, "config": host.sim_config}},
        "timeslice": {"enabled": true},
        // The chart's default (no scheduler.version: the oldest scheduler
        // the skew policy allows) on 1.34, where no share is published, and
        // on 1.37 (a 1.36.0 assumed: shares apart). On 1.35 the suite states
        // the cluster's own scheduler, else a 1.34 would be assumed and no
        // share published; on 1.36 it states its 1.36.2 or later, so that
        // shares beside exclusive devices run too.
        "scheduler": {"version": stated_scheduler(c.release(Component::Scheduler))},
        "sharedGpus": SHARED_GPUS,
        "mps": {
            "enabled": true,
            "controlBinary": format!("/driver-root/{MPS_CONTROL}"),
            "hostRoot": c.layout.root.join("mps"),
            "daemonCgroup": cluster::MPS_DAEMON_CGROUP,
        },
        "deviceClasses": {"gpuExtendedResourceName": EXTENDED_RESOURCE},
    });
    let path = c.layout.root.join("values.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&v)?)?;
    Ok(path)
}

/// The `scheduler.version` the suite gives the chart for a cluster whose
/// kube-scheduler is `release`: that release on 1.35 and 1.36, else none.
fn stated_scheduler(release: &str) -> &str {
    if matches!(cluster::minor(release), 35 | 36) {
        release
    } else {
        ""
    }
}

async fn wait<T, F, Fut>(what: &str, within: Duration, mut f: F) -> R<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return Ok(v);
        }
        if start.elapsed() > within {
            return Err(format!("timed out after {within:?} waiting for {what}").into());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn plugin_pods(client: &Client) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), PLUGIN_NS);
    pods.list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
}

/// Every plugin pod's status and log, for a failure message.
async fn plugin_report(client: &Client) -> String {
    let pods: Api<Pod> = Api::namespaced(client.clone(), PLUGIN_NS);
    let mut s = String::new();
    for p in plugin_pods(client).await {
        let name = p.metadata.name.clone().unwrap_or_default();
        s.push_str(&format!(
            "\n--- plugin pod {name}: {}\n",
            serde_json::to_string(&p.status).unwrap_or_default()
        ));
        for previous in [true, false] {
            let lp = LogParams {
                previous,
                tail_lines: Some(60),
                ..Default::default()
            };
            if let Ok(log) = pods.logs(&name, &lp).await {
                s.push_str(&format!("--- log (previous: {previous}):\n{log}\n"));
            }
        }
    }
    s
}

async fn slices(client: &Client) -> Vec<ResourceSlice> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let lp = ListParams::default().fields(&format!("spec.nodeName={}", cluster::NODE));
    api.list(&lp)
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|s| s.spec.driver == carve_model::DRIVER_NAME)
        .collect()
}

fn device_count(slices: &[ResourceSlice]) -> usize {
    slices
        .iter()
        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        .sum()
}

/// A Pod of the probe image that uses `claims` (name → claim or template).
fn probe_pod(name: &str, claims: &[(String, bool)], script: &str) -> R<Pod> {
    let refs: Vec<serde_json::Value> = claims
        .iter()
        .map(|(c, template)| {
            if *template {
                serde_json::json!({"name": c, "resourceClaimTemplateName": c})
            } else {
                serde_json::json!({"name": c, "resourceClaimName": c})
            }
        })
        .collect();
    let uses: Vec<serde_json::Value> = claims
        .iter()
        .map(|(c, _)| serde_json::json!({"name": c}))
        .collect();
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "probe",
                "image": cluster::PROBE_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", script],
                "resources": {"claims": uses},
            }],
            "resourceClaims": refs,
        },
    }))?)
}

/// An example's objects: its claims (made directly) or templates, and the
/// pod that uses them, rewritten to run the probe image (no registry here).
struct Example {
    name: String,
    claims: Vec<ResourceClaim>,
    templates: Vec<ResourceClaimTemplate>,
    pod: Pod,
}

fn load_example(dir: &Path, script: &str) -> R<Example> {
    let name = dir
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or("example dir name")?
        .to_string();
    let mut claims = Vec::new();
    let mut templates = Vec::new();
    let mut users_pod = None;
    for f in ["claim.yaml", "pod.yaml"] {
        let p = dir.join(f);
        let Ok(text) = std::fs::read_to_string(&p) else {
            continue;
        };
        for doc in serde_norway::Deserializer::from_str(&text) {
            let v: serde_json::Value = serde::Deserialize::deserialize(doc)?;
            match v["kind"].as_str() {
                Some("ResourceClaim") => claims.push(serde_json::from_value(v)?),
                Some("ResourceClaimTemplate") => templates.push(serde_json::from_value(v)?),
                Some("Pod") => users_pod = Some(v),
                other => return Err(format!("{}: unexpected kind {other:?}", p.display()).into()),
            }
        }
    }
    let mut uses: Vec<(String, bool)> = claims
        .iter()
        .map(|c: &ResourceClaim| (c.metadata.name.clone().unwrap_or_default(), false))
        .collect();
    if let Some(pod) = &users_pod {
        // The pod's own claim references, kept as the user wrote them.
        for rc in pod["spec"]["resourceClaims"]
            .as_array()
            .into_iter()
            .flatten()
        {
            if let Some(t) = rc["resourceClaimTemplateName"].as_str() {
                uses.push((t.to_string(), true));
            } else if let Some(c) = rc["resourceClaimName"].as_str() {
                uses.push((c.to_string(), false));
            }
        }
    }
    let pod = probe_pod(&format!("probe-{name}"), &uses, script)?;
    Ok(Example {
        name,
        claims,
        templates,
        pod,
    })
}

async fn apply_example(client: &Client, ex: &Example) -> R<()> {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NS);
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let pp = PostParams::default();
    for c in &ex.claims {
        claims.create(&pp, c).await?;
    }
    for t in &ex.templates {
        templates.create(&pp, t).await?;
    }
    pods.create(&pp, &ex.pod).await?;
    Ok(())
}

async fn delete_example(client: &Client, ex: &Example) -> R<()> {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NS);
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let dp = DeleteParams::default();
    let pod = ex.pod.metadata.name.clone().unwrap_or_default();
    pods.delete(&pod, &dp).await?;
    wait(&format!("pod {pod} gone"), Duration::from_secs(60), || {
        let pods = pods.clone();
        let pod = pod.clone();
        async move { matches!(pods.get_opt(&pod).await, Ok(None)).then_some(()) }
    })
    .await?;
    for c in &ex.claims {
        claims
            .delete(c.metadata.name.as_deref().unwrap_or_default(), &dp)
            .await?;
    }
    for t in &ex.templates {
        templates
            .delete(t.metadata.name.as_deref().unwrap_or_default(), &dp)
            .await?;
    }
    Ok(())
}

/// Waits for the pod to end; its phase and log.
async fn pod_result(client: &Client, name: &str, within: Duration) -> R<(String, String)> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let phase = wait(&format!("pod {name} to end"), within, || {
        let pods = pods.clone();
        async move {
            let p = pods.get_opt(name).await.ok().flatten()?;
            let phase = p.status?.phase?;
            matches!(phase.as_str(), "Succeeded" | "Failed").then_some(phase)
        }
    })
    .await?;
    let log = pods.logs(name, &LogParams::default()).await?;
    Ok((phase, log))
}

/// Waits until the pod's probe has printed everything (it then sleeps).
async fn probed(client: &Client, name: &str, within: Duration) -> R<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    wait(&format!("pod {name} to run its probe"), within, || {
        let pods = pods.clone();
        async move {
            let log = pods.logs(name, &LogParams::default()).await.ok()?;
            log.lines().any(|l| l == "probe-done").then_some(())
        }
    })
    .await
}

/// Why the scheduler left the pod pending (its PodScheduled condition).
async fn unschedulable_reason(client: &Client, name: &str, within: Duration) -> R<String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    wait(&format!("pod {name} unschedulable"), within, || {
        let pods = pods.clone();
        async move {
            let p = pods.get_opt(name).await.ok().flatten()?;
            p.status?
                .conditions?
                .into_iter()
                .find(|c| c.type_ == "PodScheduled" && c.status == "False")
                .and_then(|c| c.message)
        }
    })
    .await
}

/// What carve wrote into the `status.devices` of the pod's claims (the
/// device's identity: the MIG or GPU UUID), as the API server kept it.
async fn device_status(client: &Client, pod: &str) -> R<String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NS);
    let p = pods.get(pod).await?;
    let names: Vec<String> = p
        .status
        .and_then(|s| s.resource_claim_statuses)
        .into_iter()
        .flatten()
        .filter_map(|s| s.resource_claim_name)
        .chain(
            p.spec
                .into_iter()
                .flat_map(|s| s.resource_claims.unwrap_or_default())
                .filter_map(|c| c.resource_claim_name),
        )
        .collect();
    let mut seen = Vec::new();
    for n in names {
        let c = claims.get(&n).await?;
        let devices = c.status.and_then(|s| s.devices).unwrap_or_default();
        let ours: Vec<_> = devices
            .iter()
            .filter(|d| d.driver == carve_model::DRIVER_NAME)
            .collect();
        if ours.is_empty() {
            return Err(format!(
                "claim {n}: no status.devices entry of {} (the plugin's status write was refused or never made)",
                carve_model::DRIVER_NAME
            )
            .into());
        }
        for d in ours {
            seen.push(format!(
                "{} {}",
                d.device,
                d.data.as_ref().map(|v| v.0.to_string()).unwrap_or_default()
            ));
        }
    }
    Ok(seen.join("; "))
}

/// GPU instances alive in the simulator (its state file on the host).
fn gpu_instances(host: &GpuHost) -> R<usize> {
    let st = nvidia_ml_sim::SimState::load(&host.state_dir.join("nvml-sim/state.json"))?;
    Ok(st.map_or(0, |s| s.gpus.iter().map(|g| g.gpu_instances.len()).sum()))
}

fn claim_specs(c: &Cluster) -> Vec<String> {
    std::fs::read_dir(&c.layout.cdi)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains("claim"))
                .collect()
        })
        .unwrap_or_default()
}

/// Which examples this node can give a device under kube-scheduler
/// `release`, and what its probe must show. carve publishes no share for a
/// 1.34 scheduler (carve_model::scheduler: its allocator checks a share's
/// capacity on another device), so the shared examples stay pending there.
fn expect_for(example: &str, release: &str) -> Expect {
    let shared = matches!(example, "mps-share" | "timeslice" | "mig-mps");
    if shared && cluster::minor(release) <= 34 {
        return Expect::Pending;
    }
    match example {
        e if e.starts_with("mig") && e != "mig-mps" => Expect::Mig,
        "whole-gpu" | "timeslice" => Expect::Gpu,
        "mps-share" => Expect::Mps,
        "mig-mps" => Expect::MigMps,
        // A hard MPS memory limit needs NVIDIA's memory partitioning
        // (`nvidia-smi memory-limits`), which this node has not.
        _ => Expect::Pending,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Mig,
    Gpu,
    Mps,
    MigMps,
    Pending,
}

fn check_probe(example: &str, expect: Expect, log: &str) -> R<()> {
    let p = Probe::parse(log);
    let fail = |why: &str| -> Box<dyn std::error::Error> {
        format!("example {example}: {why}; the container printed:\n{log}").into()
    };
    if !p.done {
        return Err(fail("the probe did not finish"));
    }
    // The devices come through CDI alone: `void` keeps a legacy NVIDIA
    // runtime hook, where one is installed, from adding any of its own.
    let visible = p
        .env
        .get("NVIDIA_VISIBLE_DEVICES")
        .cloned()
        .unwrap_or_default();
    if visible != "void" {
        return Err(fail(&format!(
            "NVIDIA_VISIBLE_DEVICES={visible:?}, wanted void"
        )));
    }
    if !p.devs.iter().any(|d| d == "/dev/nvidiactl") {
        return Err(fail("no /dev/nvidiactl"));
    }
    if !p.devs.iter().any(|d| {
        d.strip_prefix("/dev/nvidia")
            .is_some_and(|m| m.parse::<u32>().is_ok())
    }) {
        return Err(fail("no /dev/nvidia<N> GPU node"));
    }
    let caps = p
        .devs
        .iter()
        .filter(|d| d.starts_with("/dev/nvidia-caps/"))
        .count();
    let mig = matches!(expect, Expect::Mig | Expect::MigMps);
    if mig && caps < 2 {
        return Err(fail(
            "a MIG device needs its GPU and compute instance capability nodes",
        ));
    }
    if !mig && caps > 0 {
        return Err(fail("a whole GPU got MIG capability nodes"));
    }
    let mps = matches!(expect, Expect::Mps | Expect::MigMps);
    if mps {
        // Where its client finds the daemon. The share's limits are on its
        // namespace (protocol v3, which the double speaks), not in the
        // environment.
        if !p.env.contains_key("CUDA_MPS_PIPE_DIRECTORY") {
            return Err(fail("an MPS share without CUDA_MPS_PIPE_DIRECTORY"));
        }
        if !p.mps.iter().any(|m| m == "control-socket") {
            return Err(fail(
                "no MPS control socket in $CUDA_MPS_PIPE_DIRECTORY (the daemon's pipe directory is not mounted)",
            ));
        }
        if !p
            .mps
            .iter()
            .any(|m| m.starts_with("shm /dev/shm/cuda.shm."))
        {
            return Err(fail(
                "no cuda.shm file of the MPS server in /dev/shm (the daemon's /dev/shm is not shared)",
            ));
        }
    } else if p.env.keys().any(|k| k.starts_with("CUDA_MPS_")) {
        return Err(fail("a device without MPS got CUDA_MPS_ variables"));
    }
    if !p.libs.iter().any(|l| l.ends_with("libcuda.so.1")) {
        return Err(fail("libcuda.so.1 from the driver root is not mounted"));
    }
    Ok(())
}

async fn ensure_namespace(client: &Client, name: &str) -> R<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?;
    match api.create(&PostParams::default(), &ns).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

async fn plugin_ready(client: &Client, within: Duration) -> R<()> {
    let ds: Api<DaemonSet> = Api::namespaced(client.clone(), PLUGIN_NS);
    wait("the plugin DaemonSet ready", within, || {
        let ds = ds.clone();
        async move {
            let list = ds.list(&ListParams::default()).await.ok()?;
            let d = list.items.first()?;
            let s = d.status.as_ref()?;
            (s.number_ready == 1
                && s.desired_number_scheduled == 1
                && s.updated_number_scheduled == Some(1)
                && s.number_available == Some(1))
            .then_some(())
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn carve_on_a_real_one_node_cluster() {
    let _one = ONE_CLUSTER.lock().await;
    let bins = match Binaries::locate(&cluster::kube_version()) {
        Ok(b) => b,
        Err(e) if !required() => {
            eprintln!("SKIPPED real-cluster suite: {e}");
            return;
        }
        Err(e) => panic!("CARVE_CLUSTER_REQUIRED=1: {e}"),
    };
    // The image is built from what ships: `--profile dist` (fat LTO,
    // panic = "abort"), as deploy/Dockerfile builds it.
    let (carve, sim) = image_binaries().expect("carve's image binaries");
    // Short: the kubelet's plugin sockets live under it (sockaddr_un).
    let root = PathBuf::from(format!("/tmp/carve-cl-{}", std::process::id()));
    say(&format!(
        "starting Kubernetes {} under {}",
        bins.kube_version,
        root.display()
    ));
    let mut c = match Cluster::start(bins, &root, &carve, &sim).await {
        Ok(c) => c,
        Err(e) => panic!("the cluster did not start: {e}"),
    };
    say("cluster up, node Ready");
    let client = c.client().await.expect("admin client");
    if let Err(e) = suite(&mut c, &client).await {
        panic!(
            "{e}\n=== plugin ===\n{}\n=== components ===\n{}",
            plugin_report(&client).await,
            c.logs(30)
        );
    }
}

/// The GPU host's files, then carve installed by its chart with helm
/// (`extra`: more `helm install` arguments), until its DaemonSet is ready.
async fn install_carve(c: &Cluster, client: &Client, extra: &[&str]) -> R<GpuHost> {
    let sim = sim_library()?;
    let host = gpu_host(&c.layout.root, &sim)?;
    let values = values(c, &host)?.display().to_string();
    let chart = workspace_root()
        .join("deploy/helm/carve")
        .display()
        .to_string();
    let mut args = vec![
        "install",
        "carve",
        &chart,
        "--namespace",
        PLUGIN_NS,
        "--create-namespace",
        "-f",
        &values,
    ];
    args.extend_from_slice(extra);
    c.helm(&args)
        .map_err(|e: ClusterError| format!("helm install: {e}"))?;
    say("chart installed by helm");
    plugin_ready(client, Duration::from_secs(120)).await?;
    Ok(host)
}

async fn suite(c: &mut Cluster, client: &Client) -> R<()> {
    let host = install_carve(c, client, &[]).await?;
    let published = wait(
        "carve's ResourceSlices",
        Duration::from_secs(60),
        || async {
            let s = slices(client).await;
            (device_count(&s) > 0).then_some(s)
        },
    )
    .await?;
    say(&format!(
        "the kubelet registered the plugin; {} slices with {} devices accepted by the API server",
        published.len(),
        device_count(&published)
    ));

    ensure_namespace(client, NS).await?;
    examples(&*c, client, &host).await?;
    extended_resource(&*c, client, &host).await?;
    faults(c, client, &host).await?;
    grants::grants(c, client).await?;
    Ok(())
}

/// Every example: allocated by the scheduler, prepared by the plugin,
/// injected by containerd; the container sees its devices; deleting the
/// pod unprepares it.
async fn examples(c: &Cluster, client: &Client, host: &GpuHost) -> R<()> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(workspace_root().join("examples"))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    for dir in dirs {
        // Long enough for the suite to read the claim's device status while
        // the pod runs (the kubelet unprepares it when the pod ends).
        let ex = load_example(&dir, &format!("{PROBE_SCRIPT}\nsleep 8"))?;
        let expect = expect_for(&ex.name, c.release(Component::Scheduler));
        apply_example(client, &ex).await?;
        let pod = ex.pod.metadata.name.clone().unwrap_or_default();
        if expect == Expect::Pending {
            let why = unschedulable_reason(client, &pod, Duration::from_secs(60)).await?;
            say(&format!(
                "example {}: pending, as it must be here: {why}",
                ex.name
            ));
        } else {
            probed(client, &pod, Duration::from_secs(120)).await?;
            let status = device_status(client, &pod).await?;
            let (phase, log) = pod_result(client, &pod, Duration::from_secs(60)).await?;
            if phase != "Succeeded" {
                return Err(format!("example {}: pod {phase}; its log:\n{log}", ex.name).into());
            }
            check_probe(&ex.name, expect, &log)?;
            say(&format!(
                "example {}: ran; the container saw its devices; claim status: {status}",
                ex.name
            ));
        }
        delete_example(client, &ex).await?;
        wait(
            &format!(
                "example {}: unprepared (no CDI spec, no GPU instance)",
                ex.name
            ),
            Duration::from_secs(60),
            || async {
                (claim_specs(c).is_empty()
                    && gpu_instances(host).ok() == Some(0)
                    && mps_daemons().is_empty())
                .then_some(())
            },
        )
        .await?;
    }
    Ok(())
}

/// The MPS control daemons running on the host (the double's processes;
/// the plugin runs them in the host's PID namespace): the control binary
/// run as a daemon (`-d`, or `-f` once the double re-executed itself in
/// the foreground). The same binary run as a client (the plugin's commands
/// to a daemon, no flag) lives for a moment and is not a daemon.
fn mps_daemons() -> Vec<i32> {
    let name = Path::new(MPS_CONTROL)
        .file_name()
        .map(|n| n.as_encoded_bytes().to_vec())
        .unwrap_or_default();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let mut args = cmdline.split(|b| *b == 0);
            let arg0 = args.next()?;
            let daemon = args.any(|a| a == b"-d" || a == b"-f");
            (arg0.ends_with(&name) && daemon).then_some(pid)
        })
        .collect()
}

/// A claim of one request `exactly` and a pod using it that prints what
/// the probe prints, then runs for `seconds` (0: ends at once).
fn workload(name: &str, seconds: u32, exactly: serde_json::Value) -> R<(ResourceClaim, Pod)> {
    let claim: ResourceClaim = serde_json::from_value(serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }))?;
    let script = format!("{PROBE_SCRIPT}\nexec sleep {seconds}");
    let pod = probe_pod(name, &[(name.to_string(), false)], &script)?;
    Ok((claim, pod))
}

/// A MIG claim (as `examples/mig-1g`) on GPU 0. The fault test's MPS share
/// is on GPU 1 ([`mps_workload`]): kube-scheduler 1.35.4 placed a MIG
/// partition over a MIG-MPS share's placement (it did not count the
/// share's counters), which carve's prepare refused; apart, the faults test
/// faults, not that.
fn mig_workload(name: &str, seconds: u32) -> R<(ResourceClaim, Pod)> {
    workload(
        name,
        seconds,
        serde_json::json!({
            "deviceClassName": "mig.gpu.carve.dev",
            "selectors": [{"cel": {"expression": "device.attributes[\"gpu.carve.dev\"].profile == \"1g.10gb\" && device.attributes[\"gpu.carve.dev\"].index == 0"}}],
        }),
    )
}

/// An MPS share of a MIG partition (as `examples/mig-mps`) on GPU 1, which
/// hosts MIG-MPS shares (see [`SHARED_GPUS`]).
fn mps_workload(name: &str, seconds: u32) -> R<(ResourceClaim, Pod)> {
    workload(
        name,
        seconds,
        serde_json::json!({
            "deviceClassName": "mig-mps.gpu.carve.dev",
            "selectors": [{"cel": {"expression": "device.attributes[\"gpu.carve.dev\"].profile == \"2g.20gb\" && device.attributes[\"gpu.carve.dev\"].index == 1"}}],
            "capacity": {"requests": {"memory": "8Gi", "multiprocessors": "16"}},
        }),
    )
}

async fn run_workload(client: &Client, name: &str, seconds: u32) -> R<()> {
    create_workload(client, mig_workload(name, seconds)?).await
}

async fn create_workload(client: &Client, (claim, pod): (ResourceClaim, Pod)) -> R<()> {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    claims.create(&PostParams::default(), &claim).await?;
    pods.create(&PostParams::default(), &pod).await?;
    Ok(())
}

async fn remove_workload(client: &Client, name: &str) -> R<()> {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.delete(name, &DeleteParams::default()).await?;
    wait(&format!("pod {name} gone"), Duration::from_secs(90), || {
        let pods = pods.clone();
        async move { matches!(pods.get_opt(name).await, Ok(None)).then_some(()) }
    })
    .await?;
    claims.delete(name, &DeleteParams::default()).await?;
    Ok(())
}

async fn pod_running(client: &Client, name: &str) -> bool {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.get_opt(name)
        .await
        .ok()
        .flatten()
        .and_then(|p| p.status?.phase)
        .is_some_and(|ph| ph == "Running")
}

/// The plugin container's restart count (the one plugin pod's).
async fn plugin_restarts(client: &Client) -> R<i32> {
    let pods = plugin_pods(client).await;
    let [pod] = pods.as_slice() else {
        return Err(format!("{} plugin pods, wanted one", pods.len()).into());
    };
    Ok(pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.first())
        .map_or(0, |c| c.restart_count))
}

/// After a fault: the running pod kept its device, the plugin is back (one
/// pod, ready), and a new pod is admitted, runs and is unprepared again.
async fn still_serving(
    c: &Cluster,
    client: &Client,
    host: &GpuHost,
    fault: &str,
    holder: &str,
    mps_daemon: &[i32],
) -> R<()> {
    plugin_ready(client, Duration::from_secs(120))
        .await
        .map_err(|e| format!("after {fault}: {e}"))?;
    if !pod_running(client, holder).await {
        return Err(format!("after {fault}: the running pod {holder} is no longer running").into());
    }
    if gpu_instances(host)? != 2 {
        return Err(format!(
            "after {fault}: {} GPU instances, wanted the running MIG pod's and MPS share's two",
            gpu_instances(host)?
        )
        .into());
    }
    if !pod_running(client, MPS_HOLDER).await {
        return Err(format!(
            "after {fault}: the running MPS share {MPS_HOLDER} is no longer running"
        )
        .into());
    }
    if mps_daemons() != mps_daemon {
        return Err(format!(
            "after {fault}: MPS daemons {:?}, wanted the running share's one, {mps_daemon:?}, untouched",
            mps_daemons()
        )
        .into());
    }
    let probe = format!("after-{}", fault.to_lowercase().replace(' ', "-"));
    fresh_mig_pod(client, &probe, fault).await?;
    wait(
        &format!("after {fault}: the new pod's claim unprepared"),
        Duration::from_secs(60),
        || async {
            // The running MIG pod's and MPS share's specs.
            (gpu_instances(host).ok() == Some(2) && claim_specs(c).len() == 2).then_some(())
        },
    )
    .await?;
    say(&format!(
        "{fault}: the running pod kept its MIG instance, the MPS share its daemon; a new pod was admitted and unprepared"
    ));
    Ok(())
}

/// A new MIG pod after `what`: admitted, run to completion with its
/// devices, then deleted (the caller waits for its unprepare).
async fn fresh_mig_pod(client: &Client, name: &str, what: &str) -> R<()> {
    run_workload(client, name, 0).await?;
    let (phase, log) = pod_result(client, name, Duration::from_secs(120)).await?;
    if phase != "Succeeded" {
        return Err(format!("after {what}: a new pod {phase}; its log:\n{log}").into());
    }
    check_probe(name, Expect::Mig, &log)?;
    remove_workload(client, name).await
}

/// The carve process of the plugin's container, seen from the host.
fn plugin_process() -> Option<i32> {
    std::fs::read_dir("/proc")
        .ok()?
        .filter_map(Result::ok)
        .find_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            (args.first() == Some(&&b"/usr/local/bin/carve"[..])
                && args.get(1) == Some(&&b"kubelet-plugin"[..]))
            .then_some(pid)
        })
}

/// Faults with a prepared claim under a running pod: the plugin pod
/// deleted, the kubelet restarted, containerd restarted, a rolling update
/// of the DaemonSet, and the plugin's process killed while the API server is
/// down. After each, nothing is lost, no instance leaks, new pods are
/// admitted.
async fn faults(c: &mut Cluster, client: &Client, host: &GpuHost) -> R<()> {
    let holder = "holder";
    run_workload(client, holder, 3600).await?;
    // carve publishes no share for a 1.34 scheduler: there a second MIG
    // pod stands in for the MPS share, and no daemon runs.
    let shares = cluster::minor(c.release(Component::Scheduler)) >= 35;
    if shares {
        create_workload(client, mps_workload(MPS_HOLDER, 3600)?).await?;
    } else {
        create_workload(client, mig_workload(MPS_HOLDER, 3600)?).await?;
    }
    for p in [holder, MPS_HOLDER] {
        wait("the running pods", Duration::from_secs(120), || async {
            pod_running(client, p).await.then_some(())
        })
        .await?;
    }
    let daemon = mps_daemons();
    if daemon.len() != usize::from(shares) {
        return Err(format!("shares: {shares}, but MPS daemons {daemon:?}").into());
    }
    let d = &daemon;

    let pods: Api<Pod> = Api::namespaced(client.clone(), PLUGIN_NS);
    let old = plugin_pods(client).await;
    for p in &old {
        pods.delete(
            p.metadata.name.as_deref().unwrap_or_default(),
            &DeleteParams::default(),
        )
        .await?;
    }
    let old_uids: Vec<Option<String>> = old.iter().map(|p| p.metadata.uid.clone()).collect();
    wait("a new plugin pod", Duration::from_secs(90), || async {
        let now = plugin_pods(client).await;
        (now.len() == 1 && !old_uids.contains(&now[0].metadata.uid)).then_some(())
    })
    .await?;
    still_serving(c, client, host, "plugin pod deleted", holder, d).await?;

    c.stop_component(Component::Kubelet);
    c.start_component(Component::Kubelet).await?;
    c.wait_node_ready(Duration::from_secs(120)).await?;
    still_serving(c, client, host, "kubelet restarted", holder, d).await?;

    c.stop_component(Component::Containerd);
    c.start_component(Component::Containerd).await?;
    still_serving(c, client, host, "containerd restarted", holder, d).await?;

    // Listed before the upgrade: the surge pod appears at once.
    let old_uids: Vec<Option<String>> = plugin_pods(client)
        .await
        .iter()
        .map(|p| p.metadata.uid.clone())
        .collect();
    // A rolling update: the pod template changes, maxSurge 1 starts the new
    // pod beside the old one.
    let chart = workspace_root().join("deploy/helm/carve");
    let values = c.layout.root.join("values.json");
    c.helm(&[
        "upgrade",
        "carve",
        &chart.display().to_string(),
        "--namespace",
        PLUGIN_NS,
        "-f",
        &values.display().to_string(),
        "--set-string",
        "kubeletPlugin.podAnnotations.carve-e2e/rollout=2",
    ])
    .map_err(|e| format!("helm upgrade: {e}"))?;
    wait("the rolling update", Duration::from_secs(120), || async {
        let now = plugin_pods(client).await;
        (now.len() == 1
            && !old_uids.contains(&now[0].metadata.uid)
            && now[0].metadata.deletion_timestamp.is_none())
        .then_some(())
    })
    .await?;
    still_serving(c, client, host, "rolling update", holder, d).await?;

    // The API server down while the plugin restarts: the kubelet restarts
    // the killed container from the pod it knows; the plugin must register
    // and serve from its checkpoint, not exit until the server is back.
    let before = plugin_restarts(client).await?;
    c.stop_component(Component::ApiServer);
    let pid = plugin_process().ok_or("no carve kubelet-plugin process on the host")?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    wait(
        "the kubelet to restart the plugin container",
        Duration::from_secs(60),
        || async { plugin_process().filter(|p| *p != pid).map(|_| ()) },
    )
    .await?;
    // Longer than the plugin's API timeout, so that a plugin that exits
    // without the server would have done so by now.
    tokio::time::sleep(Duration::from_secs(30)).await;
    c.start_component(Component::ApiServer).await?;
    // The kubelet reports the restarts once the server is back.
    wait(
        "the kubelet to report the plugin's restart",
        Duration::from_secs(60),
        || async {
            plugin_restarts(client)
                .await
                .ok()
                .filter(|n| *n > before)
                .map(|_| ())
        },
    )
    .await?;
    plugin_ready(client, Duration::from_secs(120)).await?;
    // A plugin that exits without the server would have restarted again
    // by now (the kubelet's back-off starts at 10 s).
    tokio::time::sleep(Duration::from_secs(10)).await;
    let after = plugin_restarts(client).await?;
    if after != before + 1 {
        return Err(format!(
            "the plugin container restarted {} times while the API server was down, wanted once (the kill): it exited without the server",
            after - before
        )
        .into());
    }
    still_serving(
        c,
        client,
        host,
        "API server down during a plugin restart",
        holder,
        d,
    )
    .await?;

    remove_workload(client, MPS_HOLDER).await?;
    wait(
        "the MPS share's claim unprepared, its daemon stopped",
        Duration::from_secs(60),
        || async {
            (gpu_instances(host).ok() == Some(1) && mps_daemons().is_empty()).then_some(())
        },
    )
    .await?;
    corrupt_checkpoint(c, client, host, holder).await?;
    remove_workload(client, holder).await?;
    wait(
        "the running pods' claims unprepared, the MPS daemon stopped",
        Duration::from_secs(60),
        || async {
            (gpu_instances(host).ok() == Some(0)
                && claim_specs(c).is_empty()
                && mps_daemons().is_empty())
            .then_some(())
        },
    )
    .await?;
    say("faults: nothing lost, no instance or MPS daemon leaked");
    Ok(())
}

/// The plugin killed right after its checkpoint was torn (a node that lost
/// power mid-write, a full disk): it must rebuild from NVML and the API
/// server (`list resourceclaims`), adopt the running pod's claim with its
/// instance, and later unprepare it like any other.
async fn corrupt_checkpoint(c: &Cluster, client: &Client, host: &GpuHost, holder: &str) -> R<()> {
    let path = host.state_dir.join("checkpoint.json");
    if !path.is_file() {
        return Err(format!("no checkpoint at {}", path.display()).into());
    }
    let pid = plugin_process().ok_or("no carve kubelet-plugin process on the host")?;
    let before = plugin_restarts(client).await?;
    // SIGKILL right after: no chance for the plugin to write it again.
    std::fs::write(&path, b"{\"version\": 1, \"claims\": {\"")?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    wait(
        "the kubelet to restart the plugin container",
        Duration::from_secs(60),
        || async {
            let n = plugin_restarts(client).await.ok()?;
            (n > before).then_some(())
        },
    )
    .await?;
    plugin_ready(client, Duration::from_secs(120)).await?;
    let log = plugin_log(client).await;
    let adopted_one = log.contains("adopted=1") || log.contains("\"adopted\":1");
    if !log.contains("unusable checkpoint moved aside") || !adopted_one {
        return Err(format!(
            "after a torn checkpoint the plugin did not say it rebuilt and adopted the running claim; its log:\n{log}"
        )
        .into());
    }
    if !pod_running(client, holder).await || gpu_instances(host)? != 1 {
        return Err(format!(
            "after a torn checkpoint: pod {holder} running {}, {} GPU instances (wanted its one)",
            pod_running(client, holder).await,
            gpu_instances(host)?
        )
        .into());
    }
    fresh_mig_pod(client, "after-torn-checkpoint", "a torn checkpoint").await?;
    wait(
        "after a torn checkpoint: the new pod's claim unprepared",
        Duration::from_secs(60),
        || async {
            (gpu_instances(host).ok() == Some(1) && claim_specs(c).len() == 1).then_some(())
        },
    )
    .await?;
    say(
        "torn checkpoint: the plugin rebuilt from NVML and the API server and adopted the running pod's claim; a new pod was admitted and unprepared",
    );
    Ok(())
}

/// A Pod that asks for the whole-GPU class's extended resource, with no
/// claim of its own: the scheduler makes the claim (DRAExtendedResource), the
/// plugin prepares a whole GPU, and the claim goes with the pod.
async fn extended_resource(c: &Cluster, client: &Client, host: &GpuHost) -> R<()> {
    let name = "probe-extended-resource";
    let mut pod = probe_pod(name, &[], PROBE_SCRIPT)?;
    let container = pod
        .spec
        .as_mut()
        .and_then(|s| s.containers.first_mut())
        .ok_or("probe pod without a container")?;
    container.resources = Some(serde_json::from_value(serde_json::json!({
        "limits": {EXTENDED_RESOURCE: "1"},
    }))?);
    if let Some(spec) = pod.spec.as_mut() {
        spec.resource_claims = None;
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.create(&PostParams::default(), &pod).await?;
    let (phase, log) = pod_result(client, name, Duration::from_secs(120)).await?;
    if phase != "Succeeded" {
        return Err(format!("extended resource: pod {phase}; its log:\n{log}").into());
    }
    check_probe("extended resource", Expect::Gpu, &log)?;
    pods.delete(name, &DeleteParams::default()).await?;
    wait(
        "the extended resource's claim unprepared",
        Duration::from_secs(60),
        || async {
            (claim_specs(c).is_empty() && gpu_instances(host).ok() == Some(0)).then_some(())
        },
    )
    .await?;
    say(&format!(
        "extended resource: a Pod asking for {EXTENDED_RESOURCE} (no claim) got a whole GPU"
    ));
    Ok(())
}

/// One cluster at a time: both tests use the same bridge, addresses and ports.
static ONE_CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The releases of the upgrade test, oldest first:
/// `CARVE_CLUSTER_UPGRADE=1.34.4,1.35.4,1.36.3,1.37.2` (each built with
/// `e2e/cluster/build.sh`); unset, the test is skipped.
fn upgrade_path() -> Option<Vec<String>> {
    let v = std::env::var("CARVE_CLUSTER_UPGRADE").ok()?;
    let path: Vec<String> = v
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    (!path.is_empty()).then_some(path)
}

/// The layout of the pool's newest generation, if it is complete: `1.34`
/// (counter sets inside the device slices) or `1.35` (in a slice of their
/// own), with the generation.
fn published_layout(slices: &[ResourceSlice]) -> Option<(&'static str, i64)> {
    let newest = slices.iter().map(|s| s.spec.pool.generation).max()?;
    let current: Vec<&ResourceSlice> = slices
        .iter()
        .filter(|s| s.spec.pool.generation == newest)
        .collect();
    let want = usize::try_from(current.first()?.spec.pool.resource_slice_count).ok()?;
    if current.len() != want {
        return None;
    }
    let has_counters = |s: &&&ResourceSlice| {
        s.spec
            .shared_counters
            .as_ref()
            .is_some_and(|c| !c.is_empty())
    };
    let has_devices = |s: &&&ResourceSlice| s.spec.devices.as_ref().is_some_and(|d| !d.is_empty());
    let mixed = current.iter().any(|s| has_counters(&s) && has_devices(&s));
    let apart = current.iter().any(|s| has_counters(&s) && !has_devices(&s));
    match (mixed, apart) {
        (true, false) => Some(("1.34", newest)),
        (false, true) => Some(("1.35", newest)),
        _ => None,
    }
}

/// The layout carve must publish for an API server of `release`.
fn layout_for(release: &str) -> &'static str {
    if cluster::minor(release) <= 34 {
        "1.34"
    } else {
        "1.35"
    }
}

/// No counter of any GPU is consumed beyond its capacity by the devices
/// allocated to all claims together (no two MIG partitions overlap), by
/// the newest generation's counter sets and the devices' consumption.
async fn no_overlap(client: &Client) -> R<usize> {
    use carve_model::slices::quantity::parse;
    let s = slices(client).await;
    let newest = s.iter().map(|s| s.spec.pool.generation).max().unwrap_or(0);
    // (counter set, counter) → milli-units.
    type Counter = (String, String);
    let mut capacity: BTreeMap<Counter, i128> = BTreeMap::new();
    let mut consumes: BTreeMap<String, Vec<(Counter, i128)>> = BTreeMap::new();
    for slice in s.iter().filter(|s| s.spec.pool.generation == newest) {
        for set in slice.spec.shared_counters.iter().flatten() {
            for (name, c) in &set.counters {
                capacity.insert((set.name.clone(), name.clone()), parse(&c.value)?.milli());
            }
        }
        for d in slice.spec.devices.iter().flatten() {
            let mut uses = Vec::new();
            for cc in d.consumes_counters.iter().flatten() {
                for (name, c) in &cc.counters {
                    uses.push((
                        (cc.counter_set.clone(), name.clone()),
                        parse(&c.value)?.milli(),
                    ));
                }
            }
            consumes.insert(d.name.clone(), uses);
        }
    }
    let claims: Api<ResourceClaim> = Api::all(client.clone());
    let mut used: BTreeMap<Counter, i128> = BTreeMap::new();
    let mut devices = 0;
    for claim in claims.list(&ListParams::default()).await?.items {
        let results = claim
            .status
            .and_then(|s| s.allocation)
            .and_then(|a| a.devices)
            .and_then(|d| d.results)
            .unwrap_or_default();
        for r in results
            .iter()
            .filter(|r| r.driver == carve_model::DRIVER_NAME)
        {
            devices += 1;
            let uses = consumes
                .get(&r.device)
                .ok_or_else(|| format!("allocated device {} is not published", r.device))?;
            for (k, v) in uses {
                *used.entry(k.clone()).or_default() += v;
            }
        }
    }
    for (k, v) in &used {
        let cap = capacity.get(k).copied().unwrap_or(0);
        if *v > cap {
            return Err(format!(
                "counter {}/{} is consumed {v} milli-units by the allocated devices, capacity {cap}: partitions overlap",
                k.0, k.1
            )
            .into());
        }
    }
    Ok(devices)
}

async fn cordon(client: &Client, on: bool) -> R<()> {
    use k8s_openapi::api::core::v1::Node;
    use kube::api::{Patch, PatchParams};
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .patch(
            cluster::NODE,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"unschedulable": on}})),
        )
        .await?;
    Ok(())
}

/// The plugin's log since it started (its current container).
async fn plugin_log(client: &Client) -> String {
    let pods: Api<Pod> = Api::namespaced(client.clone(), PLUGIN_NS);
    let mut s = String::new();
    for p in plugin_pods(client).await {
        let name = p.metadata.name.unwrap_or_default();
        if let Ok(log) = pods.logs(&name, &LogParams::default()).await {
            s.push_str(&log);
        }
    }
    s
}

/// The control plane upgraded one minor version at a time on one etcd, in
/// the order the README prescribes (cordon; kube-apiserver; carve
/// republishes in the new layout; kube-scheduler and
/// kube-controller-manager; uncordon), with a running pod and a claim left
/// pending across each step; on the step to 1.35 the API server first
/// comes up without DRAPartitionableDevices, and the plugin must name the
/// gate; the kubelet is upgraded last. Skipped unless
/// `CARVE_CLUSTER_UPGRADE` lists the releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_plane_upgrade_on_a_real_cluster() {
    let Some(path) = upgrade_path() else {
        eprintln!(
            "SKIPPED real-cluster upgrade: set CARVE_CLUSTER_UPGRADE=1.34.4,1.35.4,1.36.3,1.37.2 (each built by e2e/cluster/build.sh)"
        );
        return;
    };
    let _one = ONE_CLUSTER.lock().await;
    let bins = Binaries::locate(&path[0]).unwrap_or_else(|e| panic!("CARVE_CLUSTER_UPGRADE: {e}"));
    for r in &path[1..] {
        let b = cluster::kube_binary(r);
        assert!(
            b.is_file(),
            "CARVE_CLUSTER_UPGRADE: no {} (e2e/cluster/build.sh {r})",
            b.display()
        );
    }
    // The image is built from what ships: `--profile dist` (fat LTO,
    // panic = "abort"), as deploy/Dockerfile builds it.
    let (carve, sim) = image_binaries().expect("carve's image binaries");
    let root = PathBuf::from(format!("/tmp/carve-cl-up-{}", std::process::id()));
    say(&format!(
        "upgrade: starting Kubernetes {} under {}",
        path[0],
        root.display()
    ));
    let mut c = match Cluster::start(bins, &root, &carve, &sim).await {
        Ok(c) => c,
        Err(e) => panic!("the cluster did not start: {e}"),
    };
    let client = c.client().await.expect("admin client");
    if let Err(e) = upgrade(&mut c, &client, &path).await {
        panic!(
            "{e}\n=== plugin ===\n{}\n=== components ===\n{}",
            plugin_report(&client).await,
            c.logs(30)
        );
    }
}

async fn upgrade(c: &mut Cluster, client: &Client, path: &[String]) -> R<()> {
    // Each step waits for one resync.
    let host = install_carve(c, client, &["--set", "kubeletPlugin.resyncSeconds=3"]).await?;
    let (layout, mut generation) = wait(
        "carve's ResourceSlices",
        Duration::from_secs(60),
        || async { published_layout(&slices(client).await) },
    )
    .await?;
    if layout != layout_for(&path[0]) {
        return Err(format!("on {}: carve published the {layout} layout", path[0]).into());
    }
    say(&format!(
        "upgrade: on {} carve published the {layout} layout (generation {generation})",
        path[0]
    ));
    ensure_namespace(client, NS).await?;
    let holder = "holder";
    run_workload(client, holder, 3600).await?;
    wait("the running pod", Duration::from_secs(120), || async {
        pod_running(client, holder).await.then_some(())
    })
    .await?;
    let mut running = vec![holder.to_string()];

    for pair in path.windows(2) {
        let (from, to) = (&pair[0], &pair[1]);
        // 1. Cordon; a claim made now stays pending through the step.
        cordon(client, true).await?;
        let pending = format!("pending-{}", cluster::minor(to));
        run_workload(client, &pending, 3600).await?;
        let why = unschedulable_reason(client, &pending, Duration::from_secs(60)).await?;
        say(&format!(
            "upgrade {from} -> {to}: cordoned; {pending} pending: {why}"
        ));

        // 2. kube-apiserver. On the step to a release whose DRA gates are
        // off by default, first without DRAPartitionableDevices.
        if !cluster::feature_gates(to).is_empty() {
            c.set_feature_gate(Component::ApiServer, "DRAPartitionableDevices", Some(false));
            c.run_release(Component::ApiServer, to).await?;
            let named = wait(
                "the plugin to name the DRAPartitionableDevices gate",
                Duration::from_secs(60),
                || async {
                    plugin_log(client)
                        .await
                        .lines()
                        .find(|l| {
                            l.contains("dropped the counter fields")
                                && l.contains("DRAPartitionableDevices")
                        })
                        .map(String::from)
                },
            )
            .await?;
            say(&format!(
                "upgrade {from} -> {to}: API server without DRAPartitionableDevices; the plugin: {named}"
            ));
            // Nothing it published in that state is a complete pool the
            // scheduler could allocate from without counters.
            if let Some((l, g)) = published_layout(&slices(client).await)
                && g > generation
            {
                return Err(format!(
                    "with the gate off, generation {g} ({l} layout) was published complete"
                )
                .into());
            }
            c.set_feature_gate(Component::ApiServer, "DRAPartitionableDevices", None);
        }
        c.run_release(Component::ApiServer, to).await?;
        let want = layout_for(to);
        let (layout, g) = wait(
            &format!("carve to republish for {to} in the {want} layout"),
            Duration::from_secs(90),
            || async {
                published_layout(&slices(client).await)
                    .filter(|(l, g)| *l == want && (*g > generation || want == layout_for(from)))
            },
        )
        .await?;
        say(&format!(
            "upgrade {from} -> {to}: API server on {to}; carve published the {layout} layout (generation {g}, was {generation})"
        ));
        generation = g;

        // 3. kube-scheduler and kube-controller-manager.
        c.run_release(Component::Scheduler, to).await?;
        c.run_release(Component::ControllerManager, to).await?;

        // 4. Uncordon: the pending claim is allocated and its pod runs.
        cordon(client, false).await?;
        // A 1.34 kubelet under a 1.36 or 1.37 API server saw newly bound
        // pods 40 to 100 s late here.
        wait(
            &format!("{pending} to run on {to}"),
            Duration::from_secs(240),
            || async { pod_running(client, &pending).await.then_some(()) },
        )
        .await?;
        running.push(pending);
        for p in &running {
            if !pod_running(client, p).await {
                return Err(
                    format!("after the upgrade to {to}: pod {p} is no longer running").into(),
                );
            }
        }
        let n = gpu_instances(&host)?;
        if n != running.len() {
            return Err(format!(
                "after the upgrade to {to}: {n} GPU instances for {} running pods",
                running.len()
            )
            .into());
        }
        let devices = no_overlap(client).await?;
        say(&format!(
            "upgrade {from} -> {to}: uncordoned; {} pods run on {devices} allocated devices, no counter over capacity",
            running.len()
        ));
    }

    // The kubelet last (it may be older than the API server).
    let last = path.last().ok_or("empty upgrade path")?;
    c.run_release(Component::Kubelet, last).await?;
    c.wait_node_ready(Duration::from_secs(120)).await?;
    plugin_ready(client, Duration::from_secs(120)).await?;
    for p in &running {
        if !pod_running(client, p).await {
            return Err(format!(
                "after the kubelet's upgrade to {last}: pod {p} is no longer running"
            )
            .into());
        }
    }
    let fresh = "after-upgrade";
    run_workload(client, fresh, 0).await?;
    let (phase, log) = pod_result(client, fresh, Duration::from_secs(120)).await?;
    if phase != "Succeeded" {
        return Err(format!("after the upgrade: a new pod {phase}; its log:\n{log}").into());
    }
    check_probe(fresh, Expect::Mig, &log)?;
    no_overlap(client).await?;
    remove_workload(client, fresh).await?;
    for p in &running {
        remove_workload(client, p).await?;
    }
    wait(
        "every claim unprepared",
        Duration::from_secs(90),
        || async {
            (gpu_instances(&host).ok() == Some(0) && claim_specs(c).is_empty()).then_some(())
        },
    )
    .await?;
    say(&format!(
        "upgrade: kubelet on {last}; nothing lost, no instance leaked"
    ));
    Ok(())
}
