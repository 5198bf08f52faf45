//! Shared support for the plugin's integration tests: the NVML simulator
//! library behind the real `NvmlBackend`, the API-server stand-in, claims.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use carve_apiserver::{ApiServer, Options, Resource};
use carve_gpu::{GpuBackend, GpuInstanceInfo};
use carve_nvml::{NvmlBackend, NvmlOptions};
use carve_plugin::{ClaimError, ClaimRef, Driver, PluginConfig, PreparedDevice, Retry};
use nvidia_ml_sim::{GpuEntry, SimConfig, SimState};

pub const NODE: &str = "node-a";

/// The simulator cdylib built next to this test binary.
pub fn sim_library() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("deps dir");
    for c in [
        deps.join("libnvidia_ml_sim.so"),
        deps.join("../libnvidia_ml_sim.so"),
    ] {
        if c.exists() {
            return c;
        }
    }
    panic!("libnvidia_ml_sim.so not found next to {}", exe.display());
}

/// One simulated node: its own copy of the simulator library (with a side-car
/// configuration, so tests in one process do not share state), plugin paths
/// under a temp dir.
pub struct Node {
    pub dir: tempfile::TempDir,
    pub sim: SimConfig,
    pub lib: PathBuf,
    pub config: PluginConfig,
}

impl Node {
    pub fn new(gpus: Vec<GpuEntry>) -> Self {
        // Short base dir: socket paths must stay under 108 bytes.
        let dir = tempfile::Builder::new()
            .prefix("cp")
            .tempdir_in("/tmp")
            .unwrap();
        let d = dir.path().to_path_buf();
        let d = d.as_path();
        let sim = SimConfig::new(NODE, gpus, &d.join("sim"));
        std::fs::create_dir_all(d.join("sim")).unwrap();
        let lib = d.join("libnvidia_ml_sim.so");
        std::fs::copy(sim_library(), &lib).unwrap();
        // The fake driver root and /proc/devices that `plugin_config` names.
        let minors: u32 = sim.gpus.iter().map(|g| g.count).sum();
        let fake = nvidia_ml_sim::driver_root::write_fake_driver(
            d,
            &sim.driver_version,
            &(0..minors).collect::<Vec<_>>(),
        )
        .unwrap();
        let config = plugin_config(d);
        assert_eq!(config.driver.container_root, fake.root);
        assert_eq!(config.driver.proc_driver_nvidia, sim.proc_root);
        let node = Self {
            config,
            dir,
            sim,
            lib,
        };
        node.write_sim_config();
        std::fs::write(d.join("boot_id"), "boot-1\n").unwrap();
        node
    }

    pub fn write_sim_config(&self) {
        let mut side = self.lib.as_os_str().to_owned();
        side.push(nvidia_ml_sim::SIDECAR_SUFFIX);
        self.sim.to_file(Path::new(&side)).unwrap();
    }

    pub fn backend(&self) -> Arc<dyn GpuBackend> {
        Arc::new(
            NvmlBackend::open(NvmlOptions {
                lib_path: Some(self.lib.clone()),
                proc_root: self.sim.proc_root.clone(),
            })
            .expect("open NVML simulator"),
        )
    }

    /// Simulator state as persisted (readable while no process holds it).
    pub fn sim_state(&self) -> SimState {
        SimState::load(&self.sim.state_file)
            .unwrap()
            .expect("sim state exists")
    }

    /// (gpu, start, size, profile id) of every GPU instance, from the state file.
    pub fn instances(&self) -> Vec<(u32, u32, u32, u32)> {
        let s = self.sim_state();
        let mut v = Vec::new();
        for (g, gpu) in s.gpus.iter().enumerate() {
            for gi in &gpu.gpu_instances {
                v.push((
                    g as u32,
                    gi.start as u32,
                    gi.compute_instances.len() as u32,
                    gi.profile_id,
                ));
            }
        }
        v
    }

    pub fn cdi_files(&self) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(&self.config.cdi_dir)
            .map(|rd| rd.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        v.sort();
        v
    }
}

pub fn plugin_config(d: &Path) -> PluginConfig {
    let mut c = PluginConfig::new(NODE);
    c.plugins_registry_dir = d.join("reg");
    c.plugin_dir = d.join("plugins").join("gpu.carve.dev");
    c.cdi_dir = d.join("cdi");
    c.checkpoint_path = d
        .join("plugins")
        .join("gpu.carve.dev")
        .join("checkpoint.json");
    c.boot_id_path = d.join("boot_id");
    // Written by `Node::new` (nvidia_ml_sim::driver_root).
    c.driver.container_root = d.join("driver");
    // The plugin runs on the host here: the host sees the root at the same path.
    c.driver.host_root = d.join("driver");
    c.driver.proc_devices = d.join("devices");
    c.driver.proc_driver_nvidia = d.join("sim").join("proc");
    c.gc_interval = None;
    c.unprepare_retry = Retry {
        attempts: 3,
        initial: std::time::Duration::from_millis(1),
        max: std::time::Duration::from_millis(4),
    };
    c
}

pub async fn api() -> ApiServer {
    ApiServer::start(Options::default()).await.unwrap()
}

/// A driver for `node` with `config`, after its startup recovery.
pub async fn started(node: &Node, config: PluginConfig, api: &ApiServer) -> Driver {
    let d = Driver::new(config, node.backend(), api.client())
        .await
        .unwrap();
    d.recover().await.unwrap();
    d
}

/// The error of claim `uid` in a prepare's result; panics if it prepared.
pub fn claim_error(
    out: &[(ClaimRef, Result<Vec<PreparedDevice>, ClaimError>)],
    uid: &str,
) -> String {
    match &out.iter().find(|(c, _)| c.uid == uid).unwrap().1 {
        Ok(_) => panic!("claim {uid} prepared but should not"),
        Err(e) => e.to_string(),
    }
}

/// Store an allocated ResourceClaim; `results` are (request, device) on this
/// node's pool.
pub fn put_claim(
    api: &ApiServer,
    name: &str,
    uid: &str,
    results: &[(&str, &str)],
    config: serde_json::Value,
) -> ClaimRef {
    put_claim_pool(api, name, uid, results, NODE, config)
}

/// Store an allocated ResourceClaim of one request `r` for `device` on this
/// node's pool, without config.
pub fn put_device_claim(api: &ApiServer, name: &str, uid: &str, device: &str) -> ClaimRef {
    put_claim(api, name, uid, &[("r", device)], serde_json::json!([]))
}

pub fn put_claim_pool(
    api: &ApiServer,
    name: &str,
    uid: &str,
    results: &[(&str, &str)],
    pool: &str,
    config: serde_json::Value,
) -> ClaimRef {
    let results: Vec<serde_json::Value> = results
        .iter()
        .map(|(r, d)| serde_json::json!({"request": r, "driver": "gpu.carve.dev", "pool": pool, "device": d}))
        .collect();
    let obj = serde_json::json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default", "uid": uid},
        "spec": {"devices": {"requests": []}},
        "status": {"allocation": {"devices": {"results": results, "config": config}}}
    });
    api.store().insert(Resource::ResourceClaims, obj).unwrap();
    ClaimRef {
        namespace: "default".into(),
        name: name.into(),
        uid: uid.into(),
    }
}

/// Store a ResourceClaim allocated with these raw `results`; `reserved_for`:
/// pod UIDs for `status.reservedFor`.
pub fn put_results(
    api: &ApiServer,
    name: &str,
    uid: &str,
    results: Vec<serde_json::Value>,
    reserved_for: &[&str],
) -> ClaimRef {
    put_results_config(api, name, uid, results, None, reserved_for)
}

/// [`put_results`] with the allocation's opaque `config` entries.
pub fn put_results_config(
    api: &ApiServer,
    name: &str,
    uid: &str,
    results: Vec<serde_json::Value>,
    config: Option<serde_json::Value>,
    reserved_for: &[&str],
) -> ClaimRef {
    let mut status = serde_json::json!({"allocation": {"devices": {"results": results}}});
    if let Some(c) = config {
        status["allocation"]["devices"]["config"] = c;
    }
    if !reserved_for.is_empty() {
        status["reservedFor"] = reserved_for
            .iter()
            .enumerate()
            .map(|(i, p)| serde_json::json!({"resource": "pods", "name": format!("pod-{name}-{i}"), "uid": p}))
            .collect();
    }
    let obj = serde_json::json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default", "uid": uid},
        "spec": {"devices": {"requests": []}},
        "status": status,
    });
    api.store().insert(Resource::ResourceClaims, obj).unwrap();
    ClaimRef {
        namespace: "default".into(),
        name: name.into(),
        uid: uid.into(),
    }
}

pub fn put_unallocated(api: &ApiServer, name: &str, uid: &str) -> ClaimRef {
    let obj = serde_json::json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default", "uid": uid},
        "spec": {"devices": {"requests": []}}
    });
    api.store().insert(Resource::ResourceClaims, obj).unwrap();
    ClaimRef {
        namespace: "default".into(),
        name: name.into(),
        uid: uid.into(),
    }
}

pub fn live(b: &dyn GpuBackend, gpu: u32) -> Vec<GpuInstanceInfo> {
    b.gpu_instances(gpu).unwrap()
}

/// Poll the stand-in every 5 ms until `done` holds (10 s at most; then
/// panic naming `what`). The plugin writes `status.devices` after its
/// prepare returned, so a test that reads it waits for it here.
pub async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "after 10 s still waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// The stored claim `default/<name>` once its `status.devices` is written.
pub async fn claim_with_status(api: &ApiServer, name: &str) -> serde_json::Value {
    let get = || {
        api.store()
            .get(Resource::ResourceClaims, Some("default"), name)
            .expect("claim stored")
    };
    eventually(&format!("status.devices of claim {name}"), || {
        get()["status"].get("devices").is_some()
    })
    .await;
    get()
}
