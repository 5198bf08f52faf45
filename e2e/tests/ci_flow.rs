//! The CI end-to-end flow: the real `carve kubelet-plugin` binary as a child
//! process on the NVML simulator, the API-server stand-in, the offline
//! allocator and a fake kubelet on the real sockets.
//!
//! Every example claim (the ResourceClaimTemplate of `examples/*/pod.yaml`) goes through publish →
//! allocate → `status.allocation` → NodePrepareResources → CDI and GPU-instance
//! checks → NodeUnprepareResources. Then two crash tests: `kill -9` between
//! operations, and an abort inside a prepare (right after the GPU instance was
//! created, injected by the simulator); each restart must converge.
//!
//! Examples that need device types carve does not publish (MPS, time-slicing)
//! are reported as SKIPPED on stderr with the reason; the suite fails if the
//! `carve` binary has no `kubelet-plugin` subcommand.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::PathBuf;

use carve_alloc::{AllocError, Allocator, Inputs, Object, load_yaml_documents};
use carve_apiserver::{ApiServer, Options, Store};
use carve_e2e::{
    Prepared, SimNode, allocated_devices, carve_binary, check_prepared, claim_ref, device_types,
    workspace_root,
};
use carve_plugin::testing::FakeKubelet;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use nvidia_ml_sim::{Fault, FaultAction, GpuEntry};

const NODE: &str = "node-a";
const NS: &str = "default";

/// Writes straight to the process's stderr, which libtest does not capture, so
/// skips are visible in a passing run.
fn report(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

fn examples() -> Vec<(String, ResourceClaim)> {
    let dir = workspace_root().join("examples");
    let mut out = Vec::new();
    for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.unwrap().path().join("pod.yaml");
        if !p.is_file() {
            continue;
        }
        let name = p
            .parent()
            .unwrap()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let objs = load_yaml_documents(&p).unwrap_or_else(|e| panic!("{e}"));
        let claims: Vec<ResourceClaim> = objs
            .into_iter()
            .filter_map(|o| match o {
                Object::Claim(c) => Some(c),
                _ => None,
            })
            .collect();
        assert_eq!(
            claims.len(),
            1,
            "{} must hold exactly one ResourceClaimTemplate",
            p.display()
        );
        out.push((name, claims.into_iter().next().unwrap()));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(!out.is_empty(), "no examples under {}", dir.display());
    out
}

/// Device `type` values a DeviceClass of `examples/deviceclasses.yaml` selects.
fn class_types(class: &str) -> &'static [&'static str] {
    match class {
        "mig.gpu.carve.dev" => &["mig"],
        "mps.gpu.carve.dev" => &["mps"],
        "mig-mps.gpu.carve.dev" => &["mig-mps"],
        "timeslice.gpu.carve.dev" => &["timeslice"],
        _ => &["gpu"],
    }
}

fn claim_classes(c: &ResourceClaim) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for r in c
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.requests.as_ref())
        .into_iter()
        .flatten()
    {
        if let Some(e) = &r.exactly {
            out.insert(e.device_class_name.clone());
        }
        for s in r.first_available.iter().flatten() {
            out.insert(s.device_class_name.clone());
        }
    }
    out
}

/// A stand-in API server with the example DeviceClasses, and a node running
/// the plugin, registered with a fake kubelet, its slices published.
struct Rig {
    api: ApiServer,
    node: SimNode,
    kubelet: FakeKubelet,
}

async fn classes_into(api: &ApiServer) -> Vec<DeviceClass> {
    carve_e2e::create_example_classes(api.client()).await
}

async fn wait_published(node: &mut SimNode, store: &Store) -> Vec<ResourceSlice> {
    carve_e2e::wait_published(node, store)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

async fn start(gpus: Vec<GpuEntry>, faults: Vec<Fault>) -> (Rig, Vec<DeviceClass>) {
    let carve = carve_binary().unwrap_or_else(|e| panic!("{e}"));
    let api = ApiServer::start(Options::default()).await.unwrap();
    let classes = classes_into(&api).await;
    let mut node = SimNode::new(NODE, gpus, carve, &api.url()).unwrap_or_else(|e| panic!("{e}"));
    if !faults.is_empty() {
        let mut sim = node.sim.clone();
        sim.faults = faults;
        node.set_sim_config(sim).unwrap();
    }
    let kubelet = register(&mut node).await;
    (Rig { api, node, kubelet }, classes)
}

async fn register(node: &mut SimNode) -> FakeKubelet {
    let reg = node.start_plugin().await.unwrap_or_else(|e| panic!("{e}"));
    FakeKubelet::register(&reg, carve_model::DRIVER_NAME)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "registering with {}: {e}\nplugin log:\n{}",
                reg.display(),
                node.log()
            )
        })
}

impl Rig {
    fn claims(&self) -> Api<ResourceClaim> {
        Api::namespaced(self.api.client(), NS)
    }

    /// Allocates `claim` against what the node publishes now (around
    /// `allocated`), creates it and writes `status.allocation`.
    async fn allocate(
        &mut self,
        name: &str,
        claim: &ResourceClaim,
        classes: &[DeviceClass],
        allocated: &[ResourceClaim],
    ) -> Result<ResourceClaim, AllocError> {
        let slices = wait_published(&mut self.node, &self.api.store()).await;
        let inputs = Inputs {
            slices,
            classes: classes.to_vec(),
            claims_allocated: allocated.to_vec(),
        };
        let mut c = claim.clone();
        c.metadata.name = Some(name.into());
        c.metadata.namespace = Some(NS.into());
        let result = Allocator::new(&inputs)?.allocate(&c, NODE)?;
        let created = self
            .claims()
            .create(&PostParams::default(), &c)
            .await
            .unwrap();
        let patch = serde_json::json!({"status": {"allocation": result}});
        let written = self
            .claims()
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap_or_else(|e| panic!("writing status.allocation of {name}: {e}"));
        assert_eq!(
            written.metadata.uid, created.metadata.uid,
            "status write replaced {name}"
        );
        Ok(written)
    }

    async fn prepare(&self, c: &ResourceClaim) -> Prepared {
        let r = claim_ref(c).unwrap();
        let resp = self
            .kubelet
            .prepare(std::slice::from_ref(&r))
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "NodePrepareResources({r}): {e}\nplugin log:\n{}",
                    self.node.log()
                )
            });
        let one = resp
            .claims
            .get(&r.uid)
            .unwrap_or_else(|| panic!("NodePrepareResources answered no entry for {}", r.uid));
        assert!(
            one.error.is_empty(),
            "NodePrepareResources({r}) failed: {}\nplugin log:\n{}",
            one.error,
            self.node.log()
        );
        let mut out = BTreeMap::new();
        for d in &one.devices {
            assert_eq!(
                d.pool_name, NODE,
                "device {} in pool {}",
                d.device_name, d.pool_name
            );
            assert!(
                !d.request_names.is_empty(),
                "device {} names no request",
                d.device_name
            );
            out.insert(d.device_name.clone(), d.cdi_device_ids.clone());
        }
        out
    }

    async fn unprepare(&self, c: &ResourceClaim) {
        let r = claim_ref(c).unwrap();
        let resp = self
            .kubelet
            .unprepare(std::slice::from_ref(&r))
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "NodeUnprepareResources({r}): {e}\nplugin log:\n{}",
                    self.node.log()
                )
            });
        let one = resp
            .claims
            .get(&r.uid)
            .unwrap_or_else(|| panic!("NodeUnprepareResources answered no entry for {}", r.uid));
        assert!(
            one.error.is_empty(),
            "NodeUnprepareResources({r}) failed: {}\nplugin log:\n{}",
            one.error,
            self.node.log()
        );
        let spec = carve_plugin::claim_spec_path(&self.node.cdi_dir, &r.uid);
        assert!(
            !spec.exists(),
            "CDI spec {} left after unprepare",
            spec.display()
        );
    }

    fn check(&self, c: &ResourceClaim, prepared: &Prepared) {
        let alloc = c
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .unwrap();
        check_prepared(
            &self.node,
            c.metadata.uid.as_deref().unwrap(),
            &allocated_devices(alloc),
            prepared,
        )
        .unwrap_or_else(|e| panic!("{e}\nplugin log:\n{}", self.node.log()));
    }

    fn gi_count(&self) -> usize {
        self.node
            .gpu_instance_count()
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn assert_clean(&self) {
        assert_eq!(
            self.gi_count(),
            0,
            "GPU instances leaked: {:?}",
            self.node.sim_state().unwrap()
        );
        let left: Vec<PathBuf> = self.node.cdi_files();
        assert!(left.is_empty(), "CDI specs left: {left:?}");
    }
}

fn one_h100_mig() -> Vec<GpuEntry> {
    vec![GpuEntry::new("h100-80gb", 1, true)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_example_is_published_allocated_prepared_and_unprepared() {
    // GPU 0 in MIG mode (placements), GPU 1 not (whole GPU).
    let (mut rig, classes) = start(
        vec![
            GpuEntry::new("h100-80gb", 1, true),
            GpuEntry::new("h100-80gb", 1, false),
        ],
        Vec::new(),
    )
    .await;
    let published = device_types(&wait_published(&mut rig.node, &rig.api.store()).await);
    let published_types: BTreeSet<&str> = published.values().map(String::as_str).collect();
    assert!(
        published_types.contains("mig"),
        "no MIG devices published: {published:?}"
    );
    assert!(
        published_types.contains("gpu"),
        "no whole GPUs published: {published:?}"
    );

    let mut ran = Vec::new();
    let mut skipped = Vec::new();
    for (dir, claim) in examples() {
        let missing: Vec<String> = claim_classes(&claim)
            .into_iter()
            .filter(|c| !class_types(c).iter().any(|t| published_types.contains(t)))
            .collect();
        let c = match rig.allocate(&dir, &claim, &classes, &[]).await {
            Ok(c) => c,
            Err(e) if !missing.is_empty() => {
                let first = e.to_string().lines().next().unwrap_or_default().to_string();
                let why = format!(
                    "SKIPPED example {dir}: needs device class(es) {missing:?} but carve publishes no such devices yet (published types {published_types:?}); allocator: {first}"
                );
                report(&why);
                skipped.push(dir);
                continue;
            }
            Err(e) => panic!("example {dir} does not allocate on the published devices: {e}"),
        };
        let before = rig.gi_count();
        let prepared = rig.prepare(&c).await;
        rig.check(&c, &prepared);
        // kubelet retries prepare after timeouts: the answer must be the same
        // and nothing new created.
        assert_eq!(
            rig.prepare(&c).await,
            prepared,
            "{dir}: second prepare differs"
        );
        let after = rig.gi_count();
        let mig = prepared.keys().filter(|d| d.contains("-mig-")).count();
        assert_eq!(
            after,
            before + mig,
            "{dir}: GPU instances {before} → {after} for {mig} MIG devices"
        );
        rig.unprepare(&c).await;
        assert_eq!(
            rig.gi_count(),
            before,
            "{dir}: GPU instances not destroyed on unprepare"
        );
        // Unprepare is idempotent.
        rig.unprepare(&c).await;
        rig.claims()
            .delete(&dir, &DeleteParams::default())
            .await
            .unwrap();
        report(&format!(
            "ran example {dir}: prepared {:?}",
            prepared.keys().collect::<Vec<_>>()
        ));
        ran.push(dir);
    }
    rig.assert_clean();
    report(&format!("examples ran: {ran:?}; skipped: {skipped:?}"));
    for must in [
        "mig-1g",
        "mig-by-memory",
        "mig-same-parent",
        "mig-first-available",
        "whole-gpu",
    ] {
        assert!(
            ran.iter().any(|r| r == must),
            "example {must} did not run (ran {ran:?}, skipped {skipped:?})"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_between_operations_converges_after_restart() {
    let (mut rig, classes) = start(one_h100_mig(), Vec::new()).await;
    let ex: BTreeMap<String, ResourceClaim> = examples().into_iter().collect();
    let a = rig
        .allocate("crash-a", &ex["mig-1g"], &classes, &[])
        .await
        .unwrap();
    let pa = rig.prepare(&a).await;
    rig.check(&a, &pa);
    let state_before = rig.node.sim_state().unwrap();

    let status = rig.node.kill9().unwrap();
    assert!(
        !status.success(),
        "kill -9 must not look like a clean exit: {status}"
    );
    // NVML truth and the CDI spec outlive the process.
    rig.check(&a, &pa);

    rig.kubelet = register(&mut rig.node).await;
    // The kubelet retries the prepare it may not have seen answered.
    let again = rig.prepare(&a).await;
    assert_eq!(again, pa, "prepare after restart returned other devices");
    rig.check(&a, &again);
    assert_eq!(
        rig.node.sim_state().unwrap().gpus,
        state_before.gpus,
        "restart changed the GPU instances of a prepared claim"
    );

    // The restarted plugin serves new claims around the old one.
    let b = rig
        .allocate(
            "crash-b",
            &ex["mig-by-memory"],
            &classes,
            std::slice::from_ref(&a),
        )
        .await
        .unwrap();
    let pb = rig.prepare(&b).await;
    rig.check(&b, &pb);
    assert_eq!(rig.gi_count(), 2);
    rig.unprepare(&a).await;
    rig.unprepare(&b).await;
    rig.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_inside_prepare_converges_after_restart() {
    // The plugin process aborts right after its first GPU instance is created
    // and persisted, before compute instance, CDI spec or checkpoint.
    let fault = Fault {
        function: "nvmlDeviceCreateGpuInstanceWithPlacement".into(),
        nth: 1,
        action: FaultAction::AbortAfter,
    };
    let (mut rig, classes) = start(one_h100_mig(), vec![fault]).await;
    let ex: BTreeMap<String, ResourceClaim> = examples().into_iter().collect();
    let a = rig
        .allocate("abort-a", &ex["mig-1g"], &classes, &[])
        .await
        .unwrap();
    let r = claim_ref(&a).unwrap();
    let res = rig.kubelet.prepare(std::slice::from_ref(&r)).await;
    let status = rig
        .node
        .wait_exit("the plugin to abort inside prepare")
        .await
        .unwrap_or_else(|e| {
            panic!("plugin did not abort at the injected fault: {e} (prepare answered {res:?})")
        });
    assert!(
        !status.success(),
        "abort must not look like a clean exit: {status}"
    );
    assert!(
        res.as_ref().map_or(true, |r| r
            .claims
            .get(&r_uid(&a))
            .is_none_or(|c| !c.error.is_empty())),
        "prepare reported success although the plugin aborted: {res:?}"
    );
    assert_eq!(
        rig.gi_count(),
        1,
        "the fault must leave the half-made GPU instance behind"
    );

    let mut sim = rig.node.sim.clone();
    sim.faults.clear();
    rig.node.set_sim_config(sim).unwrap();
    rig.kubelet = register(&mut rig.node).await;
    let pa = rig.prepare(&a).await;
    rig.check(&a, &pa);
    assert_eq!(
        rig.gi_count(),
        1,
        "the half-made GPU instance leaked next to the new one"
    );
    rig.unprepare(&a).await;
    rig.assert_clean();
}

fn r_uid(c: &ResourceClaim) -> String {
    c.metadata.uid.clone().unwrap_or_default()
}

/// An Ampere GPU in MIG mode runs CUDA work only inside MIG instances and
/// cannot leave MIG mode without a reset: its placements are published, its
/// whole device is not. With MIG off it is published whole only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ampere_in_mig_mode_publishes_no_whole_gpu() {
    let (mut rig, _classes) = start(
        vec![
            GpuEntry::new("a100-40gb", 1, true),
            GpuEntry::new("a100-40gb", 1, false),
        ],
        Vec::new(),
    )
    .await;
    let store = rig.api.store();
    let slices = wait_published(&mut rig.node, &store).await;
    let names: BTreeSet<String> = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .map(|d| d.name.clone())
        .collect();
    assert!(!names.contains("gpu-0"), "{names:?}");
    assert!(names.contains("gpu-0-mig-3g20gb-0"), "{names:?}");
    assert!(names.contains("gpu-1"), "{names:?}");
    assert!(
        !names.iter().any(|n| n.starts_with("gpu-1-mig-")),
        "{names:?}"
    );
    // MIG off on Ampere is a configuration, reported at info, not error; the
    // log (a file here, as under a container runtime) has no ANSI colour.
    let log = rig.node.log();
    let line = log
        .lines()
        .find(|l| l.contains("publishing only the whole GPU") && l.contains("gpu.index=1"))
        .unwrap_or_else(|| panic!("no whole-GPU line for gpu 1 in:\n{log}"));
    assert!(line.contains(" INFO "), "{line}");
    assert!(!log.contains(" ERROR "), "{log}");
    assert!(
        !log.contains('\x1b'),
        "ANSI escape in a log that is not a terminal:\n{log}"
    );
}
