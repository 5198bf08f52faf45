//! A control-plane upgrade under a running plugin: the real `carve
//! kubelet-plugin` binary on the NVML simulator publishes to the API-server
//! stand-in at Kubernetes 1.34 (counter sets in the device slices); a MIG
//! claim is prepared; the stand-in moves to 1.35. At its next resync the
//! plugin reads the new version and republishes the pool in the 1.35 layout
//! (counter sets in their own slice) as the pool's next generation; the
//! prepared claim keeps its GPU instance and CDI spec, its device is still
//! published, and it unprepares cleanly.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use carve_apiserver::{ApiServer, KubeVersion, Options, Store};
use carve_e2e::{
    SimNode, allocated_devices, carve_binary, check_prepared, claim_ref, device_types,
    published_pool, wait_for,
};
use carve_model::slices::{KubeVersion as Version, validate_slices_for_version};
use carve_plugin::testing::FakeKubelet;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use nvidia_ml_sim::GpuEntry;
use serde_json::json;

const NODE: &str = "node-a";
const NS: &str = "default";

/// The plugin child, killed when dropped.
struct Plugin(Child);

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Spawns the plugin as [`SimNode::start_plugin`] does, with a one-second
/// resync, and waits for its registration socket.
async fn spawn(node: &mut SimNode) -> (Plugin, PathBuf) {
    let log = node.dir.path().join("plugin-upgrade.log");
    let out = std::fs::File::create(&log).unwrap();
    let err = out.try_clone().unwrap();
    let mut args = node.plugin_args();
    args.extend(["--resync-seconds".into(), "1".into()]);
    let child = Command::new(carve_binary().unwrap())
        .args(args)
        .env(nvidia_ml_sim::CONFIG_ENV, &node.sim_config_path)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .unwrap();
    let plugin = Plugin(child);
    let reg = wait_for(node, "the plugin's registration socket", |n| {
        n.registration_sockets().into_iter().next()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", std::fs::read_to_string(&log).unwrap_or_default()));
    (plugin, reg)
}

fn log(node: &SimNode) -> String {
    std::fs::read_to_string(node.dir.path().join("plugin-upgrade.log")).unwrap_or_default()
}

/// The 1.34 layout: some slice holds counter sets beside devices.
fn is_134_layout(pool: &[ResourceSlice]) -> bool {
    pool.iter()
        .any(|s| s.spec.shared_counters.is_some() && s.spec.devices.is_some())
}

/// The 1.35 layout: counter sets only in slices without devices.
fn is_135_layout(pool: &[ResourceSlice]) -> bool {
    pool.iter()
        .any(|s| s.spec.shared_counters.is_some() && s.spec.devices.is_none())
        && !is_134_layout(pool)
}

async fn pool_where(
    node: &mut SimNode,
    store: &Store,
    what: &str,
    ok: fn(&[ResourceSlice]) -> bool,
) -> Vec<ResourceSlice> {
    let s = store.clone();
    wait_for(node, what, move |_| {
        published_pool(&s, NODE).ok().flatten().filter(|p| ok(p))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_from_1_34_to_1_35_republishes_the_pool_and_keeps_the_claim() {
    let carve = carve_binary().unwrap_or_else(|e| panic!("{e}"));
    let api = ApiServer::start(Options {
        version: KubeVersion {
            major: 1,
            minor: 34,
        },
        ..Options::default()
    })
    .await
    .unwrap();
    let mut node = SimNode::new(
        NODE,
        vec![GpuEntry::new("h100-80gb", 1, true)],
        carve,
        &api.url(),
    )
    .unwrap();
    let (_plugin, reg) = spawn(&mut node).await;
    let kubelet = FakeKubelet::register(&reg, carve_model::DRIVER_NAME)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", log(&node)));

    let store = api.store();
    let before = pool_where(
        &mut node,
        &store,
        "the pool in the 1.34 layout",
        is_134_layout,
    )
    .await;
    validate_slices_for_version(&before, Version::V1_34).unwrap();
    let generation = before[0].spec.pool.generation;

    // A claim on one MIG placement, allocated and prepared on 1.34.
    let mig = device_types(&before)
        .into_iter()
        .find(|(_, t)| t == "mig")
        .map(|(n, _)| n)
        .expect("a MIG device");
    let claims: Api<ResourceClaim> = Api::namespaced(api.client(), NS);
    let claim: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c1", "namespace": NS},
        "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "mig.gpu.carve.dev"}}]}}
    }))
    .unwrap();
    claims.create(&PostParams::default(), &claim).await.unwrap();
    let status = json!({"status": {"allocation": {"devices": {"results": [{
        "request": "r", "driver": carve_model::DRIVER_NAME, "pool": NODE, "device": mig
    }]}}}});
    let claim = claims
        .patch_status("c1", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    let r = claim_ref(&claim).unwrap();
    let log_path = node.dir.path().join("plugin-upgrade.log");
    let plugin_log = move || std::fs::read_to_string(&log_path).unwrap_or_default();
    let prepare = || async {
        let resp = kubelet
            .prepare(std::slice::from_ref(&r))
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", plugin_log()));
        let one = resp
            .claims
            .get(&r.uid)
            .expect("an answer for the claim")
            .clone();
        assert!(one.error.is_empty(), "{}\n{}", one.error, plugin_log());
        one.devices
            .iter()
            .map(|d| (d.device_name.clone(), d.cdi_device_ids.clone()))
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let prepared = prepare().await;
    let alloc = claim.status.as_ref().unwrap().allocation.as_ref().unwrap();
    check_prepared(&node, &r.uid, &allocated_devices(alloc), &prepared)
        .unwrap_or_else(|e| panic!("{e}\n{}", log(&node)));

    // The control plane moves to 1.35 under the running plugin.
    api.reset_stats();
    api.set_version(KubeVersion {
        major: 1,
        minor: 35,
    });
    let after = pool_where(
        &mut node,
        &store,
        "the pool in the 1.35 layout",
        is_135_layout,
    )
    .await;
    validate_slices_for_version(&after, Version::V1_35).unwrap();
    assert_eq!(
        after[0].spec.pool.generation,
        generation + 1,
        "republished as the pool's next generation"
    );
    // Only the newest generation is left, and no slice of it is in the 1.34 layout.
    let all: Vec<ResourceSlice> = store
        .list(carve_apiserver::Resource::ResourceSlices)
        .into_iter()
        .map(|v| serde_json::from_value(v).unwrap())
        .collect();
    assert!(!is_134_layout(&all), "1.34-layout slices left");
    // Within one resync: the first slice writes after the switch follow the
    // first `/version` read that saw 1.35, with no other resync in between.
    // (Only ResourceSlice writes count: the claim's status write is sent in
    // the background after prepare answered, and may land after the reset.)
    let reqs = api.request_log();
    let first_write = reqs
        .iter()
        .position(|q| {
            q.path.contains("/resourceslices")
                && q.verb != "get"
                && q.verb != "list"
                && q.verb != "watch"
        })
        .expect("the republish wrote");
    let version_reads = reqs[..first_write]
        .iter()
        .filter(|q| q.path == "/version")
        .count();
    assert_eq!(version_reads, 1, "{reqs:#?}");
    assert!(
        log(&node).contains("the API server's Kubernetes version changed"),
        "{}",
        log(&node)
    );

    // No claim lost: its device is still published, its GPU instance and CDI
    // spec are still there, a repeated prepare answers the same, and it
    // unprepares cleanly.
    assert!(
        device_types(&after).contains_key(&mig),
        "{mig} no longer published"
    );
    check_prepared(&node, &r.uid, &allocated_devices(alloc), &prepared)
        .unwrap_or_else(|e| panic!("{e}\n{}", log(&node)));
    assert_eq!(prepare().await, prepared);
    let resp = kubelet.unprepare(std::slice::from_ref(&r)).await.unwrap();
    assert!(resp.claims[&r.uid].error.is_empty());
    assert!(!carve_plugin::claim_spec_path(&node.cdi_dir, &r.uid).exists());
}
