//! The simulated node of a run: its files, its NVML backend, its claims.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use carve_apiserver::{Resource, Store};
use carve_gpu::GpuBackend;
use carve_model::{DeviceName, GpuModel, Placement};
use carve_nvml::{NvmlBackend, NvmlOptions};
use carve_plugin::{ClaimRef, PluginConfig, Retry, SocketPaths};
use nvidia_ml_sim::{GpuEntry, SimConfig, SimState};

use super::{Options, POD_UID, sim_parent};
use crate::BenchError;

/// One simulated node on disk: plugin directories under a temp dir (the
/// node's ordinary file system), CDI specs and simulator state on tmpfs, a
/// private copy of the simulator library with its side-car configuration.
#[derive(Debug)]
pub(super) struct BenchNode {
    pub(super) dir: tempfile::TempDir,
    _sim_dir: tempfile::TempDir,
    _cdi_dir: tempfile::TempDir,
    pub(super) lib: PathBuf,
    pub(super) sidecar: PathBuf,
    pub(super) sim: SimConfig,
    pub(super) config: PluginConfig,
}

pub(super) const NODE: &str = "bench-node";

impl BenchNode {
    /// The node the arguments `a` describe: `a.gpus` GPUs of `model`, plugin
    /// files under `a.files_dir`, CDI specs under `a.cdi_dir()`, a pod UID
    /// unless `a.without_pod_uid`.
    pub(super) fn new(a: &Options, model: &GpuModel, lib_src: &Path) -> Result<Self, BenchError> {
        let (model, gpus, files_dir, cdi_dir) = (model.key, a.gpus, &a.files_dir, &a.cdi_dir());
        let pod_uid = !a.without_pod_uid;
        // Short base path: socket paths must fit in sockaddr_un (108 bytes).
        let dir = tempfile::Builder::new()
            .prefix("cbp")
            .tempdir_in(files_dir)
            .map_err(|e| {
                BenchError::io(
                    format!("--files-dir {}: creating a temp dir", files_dir.display()),
                    e,
                )
            })?;
        let sim_parent = sim_parent();
        let sim_dir = tempfile::Builder::new()
            .prefix("carve-bench-sim")
            .tempdir_in(&sim_parent)
            .map_err(|e| {
                BenchError::io(
                    format!("creating a temp dir in {}", sim_parent.display()),
                    e,
                )
            })?;
        let cdi = tempfile::Builder::new()
            .prefix("carve-bench-cdi")
            .tempdir_in(cdi_dir)
            .map_err(|e| {
                BenchError::io(
                    format!("--cdi-dir {}: creating a temp dir", cdi_dir.display()),
                    e,
                )
            })?;
        let d = dir.path();
        let lib = d.join("libnvidia_ml_sim.so");
        std::fs::copy(lib_src, &lib).map_err(|e| {
            BenchError::io(
                format!("copying {} to {}", lib_src.display(), lib.display()),
                e,
            )
        })?;
        let sim = SimConfig::new(NODE, vec![GpuEntry::new(model, gpus, true)], sim_dir.path());
        let mut side = lib.as_os_str().to_owned();
        side.push(nvidia_ml_sim::SIDECAR_SUFFIX);
        let sidecar = PathBuf::from(side);
        sim.to_file(&sidecar)
            .map_err(|e| BenchError::setup("writing the simulator's configuration", e))?;
        std::fs::write(d.join("boot_id"), "bench-boot\n")
            .map_err(|e| BenchError::io("writing boot id", e))?;
        // The driver files the CDI specs name (a fake driver root).
        let driver = nvidia_ml_sim::driver_root::write_fake_driver(
            d,
            &sim.driver_version,
            &(0..gpus).collect::<Vec<_>>(),
        )
        .map_err(|e| BenchError::setup("writing the fake NVIDIA driver root", e))?;
        let mut c = PluginConfig::new(NODE);
        c.driver.container_root.clone_from(&driver.root);
        c.driver.host_root = driver.root;
        c.driver.proc_devices = driver.devices_file;
        c.driver.proc_driver_nvidia.clone_from(&sim.proc_root);
        c.plugins_registry_dir = d.join("registry");
        c.plugin_dir = d.join("plugins");
        c.cdi_dir = cdi.path().to_path_buf();
        c.checkpoint_path = d.join("state").join("checkpoint.json");
        c.boot_id_path = d.join("boot_id");
        c.gc_interval = None;
        c.pod_uid = pod_uid.then(|| POD_UID.to_string());
        // The chart serves metrics: GI/CI gauges are read on every call.
        c.metrics = Some(Arc::new(carve_metrics::Metrics::new()));
        c.unprepare_retry = Retry {
            attempts: 3,
            initial: Duration::from_millis(1),
            max: Duration::from_millis(4),
        };
        for p in [
            &c.plugins_registry_dir,
            &c.plugin_dir,
            &c.cdi_dir,
            &d.join("state"),
        ] {
            std::fs::create_dir_all(p)
                .map_err(|e| BenchError::io(format!("creating {}", p.display()), e))?;
        }
        Ok(Self {
            dir,
            _sim_dir: sim_dir,
            _cdi_dir: cdi,
            lib,
            sidecar,
            sim,
            config: c,
        })
    }

    pub(super) fn backend(&self) -> Result<Arc<dyn GpuBackend>, BenchError> {
        let b = NvmlBackend::open(NvmlOptions {
            lib_path: Some(self.lib.clone()),
            proc_root: self.sim.proc_root.clone(),
        })
        .map_err(|e| {
            BenchError::setup(
                format!("opening the NVML simulator {}", self.lib.display()),
                e,
            )
        })?;
        Ok(Arc::new(b))
    }

    /// GPU instances alive per the simulator's persisted state.
    pub(super) fn live_instances(&self) -> Result<usize, BenchError> {
        let s = SimState::load(&self.sim.state_file)
            .map_err(|e| BenchError::setup("reading the simulator's state", e))?;
        Ok(s.map_or(0, |s| s.gpus.iter().map(|g| g.gpu_instances.len()).sum()))
    }

    pub(super) fn cdi_files(&self) -> usize {
        std::fs::read_dir(&self.config.cdi_dir)
            .map(|rd| rd.flatten().count())
            .unwrap_or(0)
    }
}

impl BenchNode {
    pub(super) fn registration_socket(&self) -> Result<PathBuf, BenchError> {
        let paths = SocketPaths::new(&self.config)
            .map_err(|e| BenchError::setup("the plugin's socket paths", e))?;
        Ok(paths.registration)
    }
}

/// Store an allocated ResourceClaim naming one device of this node's pool,
/// as the API server returns it once the scheduler allocated it for a pod:
/// made from the pod's claim template (owner reference, annotation,
/// finalizer), reserved for the pod, allocated on the node, and with the
/// `managedFields` that the resource-claim controller's create and the
/// scheduler's status update leave on it. The driver reads and parses all of
/// this on every prepare, so the benchmark's claims carry it too.
pub(super) fn put_claim(
    store: &Store,
    name: &str,
    uid: &str,
    device: &str,
) -> Result<ClaimRef, BenchError> {
    let pod_uid = format!("pod-{uid}");
    let time = "2026-11-29T10:00:00Z";
    let obj = serde_json::json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {
            "name": name, "namespace": "default", "uid": uid,
            "generateName": format!("{name}-gpu-"),
            "creationTimestamp": time,
            "annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"},
            "finalizers": ["resource.kubernetes.io/delete-protection"],
            "ownerReferences": [{
                "apiVersion": "v1", "kind": "Pod", "name": name, "uid": pod_uid,
                "controller": true, "blockOwnerDeletion": true
            }],
            "managedFields": [
                {
                    "manager": "kube-controller-manager", "operation": "Update",
                    "apiVersion": "resource.k8s.io/v1", "time": time, "fieldsType": "FieldsV1",
                    "fieldsV1": {
                        "f:metadata": {
                            "f:annotations": {".": {}, "f:resource.kubernetes.io/pod-claim-name": {}},
                            "f:generateName": {},
                            "f:ownerReferences": {".": {}, format!("k:{{\"uid\":\"{pod_uid}\"}}"): {}}
                        },
                        "f:spec": {"f:devices": {"f:requests": {}}}
                    }
                },
                {
                    "manager": "kube-scheduler", "operation": "Update",
                    "apiVersion": "resource.k8s.io/v1", "time": time, "fieldsType": "FieldsV1",
                    "subresource": "status",
                    "fieldsV1": {
                        "f:status": {
                            "f:allocation": {".": {}, "f:allocationTimestamp": {}, "f:devices": {".": {}, "f:results": {}}, "f:nodeSelector": {}},
                            "f:reservedFor": {
                                ".": {},
                                format!("k:{{\"resource\":\"pods\",\"uid\":\"{pod_uid}\"}}"): {
                                    ".": {}, "f:name": {}, "f:resource": {}, "f:uid": {}
                                }
                            }
                        }
                    }
                }
            ]
        },
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "mig.gpu.carve.dev", "allocationMode": "ExactCount", "count": 1
        }}]}},
        "status": {
            "allocation": {
                "allocationTimestamp": time,
                "devices": {"results": [
                    {"request": "gpu", "driver": carve_model::DRIVER_NAME, "pool": NODE, "device": device}
                ], "config": []},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [NODE]}
                ]}]}
            },
            "reservedFor": [{"resource": "pods", "name": name, "uid": pod_uid}]
        }
    });
    store
        .insert(Resource::ResourceClaims, obj)
        .map_err(|e| BenchError::setup(format!("storing ResourceClaim {name}"), e))?;
    Ok(ClaimRef {
        namespace: "default".into(),
        name: name.into(),
        uid: uid.into(),
    })
}

/// One claim per device of `devices`, named `<prefix>-<j>` (UID
/// `uid-<prefix>-<j>`) for the `j`th: a batch prepared at once.
pub(super) fn put_claims(
    store: &Store,
    prefix: &str,
    devices: &[String],
) -> Result<Vec<ClaimRef>, BenchError> {
    devices
        .iter()
        .enumerate()
        .map(|(j, d)| {
            put_claim(
                store,
                &format!("{prefix}-{j}"),
                &format!("uid-{prefix}-{j}"),
                d,
            )
        })
        .collect()
}

/// Every (profile, placement) of the model, for the one-at-a-time run.
pub(super) fn all_placements(model: &GpuModel) -> Vec<(String, u8)> {
    let spec = model.spec();
    spec.profiles
        .iter()
        .flat_map(|p| p.placements.iter().map(|pl| (p.name.clone(), pl.start)))
        .collect()
}

/// `concurrency` devices that can be live at once: the smallest profile's
/// placements, spread round-robin over the GPUs.
pub(super) fn concurrent_devices(
    model: &GpuModel,
    gpus: u32,
    concurrency: u32,
) -> Result<Vec<String>, BenchError> {
    let spec = model.spec();
    let smallest = spec
        .profiles
        .iter()
        .filter(|p| !p.placements.is_empty())
        .min_by_key(|p| (p.memory_slices, p.compute_slices))
        .ok_or_else(|| BenchError::Options(format!("model {} has no MIG profiles", model.key)))?;
    // Placements that do not overlap each other (greedy by start).
    let mut starts: Vec<Placement> = Vec::new();
    for pl in &smallest.placements {
        if starts.iter().all(|s| !s.overlaps(*pl)) {
            starts.push(*pl);
        }
    }
    let capacity = u64::from(gpus) * starts.len() as u64;
    if u64::from(concurrency) > capacity || concurrency == 0 {
        return Err(BenchError::Options(format!(
            "--concurrency {concurrency}: must be 1..={capacity} ({gpus} GPUs x {} placements of {} on {})",
            starts.len(),
            smallest.name,
            model.key
        )));
    }
    (0..concurrency)
        .map(|j| {
            let gpu = j % gpus;
            let slot = (j / gpus) as usize;
            mig_device(gpu, &smallest.name, starts[slot].start)
        })
        .collect()
}

/// The name of the MIG device of `profile` at `start` on GPU `gpu`.
pub(super) fn mig_device(gpu: u32, profile: &str, start: u8) -> Result<String, BenchError> {
    DeviceName::mig(gpu, profile, start)
        .map(|d| d.to_string())
        .map_err(|e| BenchError::setup(format!("naming {profile} at {start} on GPU {gpu}"), e))
}
