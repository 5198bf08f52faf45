//! Hard MPS memory limits through the real `Driver`: the NVML simulator,
//! the fake `nvidia-cuda-mps-control`, and the `nvidia-smi memory-limits`
//! double (`carve_mps::fake_smi`) on a cgroup v2 fixture with the dmem
//! controller. GPU 0 is in `dmem.capacity` (hard), GPU 1 is not (client).
//!
//! Covered: a share's limit set on its pod's cgroup through the tool and
//! read back, cleared (soft 0, hard max) at unprepare; two shares of a GPU
//! in one pod summed, another claim's share in the same pod refused; a
//! claim reserved for several pods stays client (or fails where it demands
//! hard); a refusing, dying or lying tool fails the claim alone, leaving no
//! limit, no namespace and no daemon; recovery clears the limit of a claim
//! that did not complete, and an intent whose tool call never ran.

mod common;

use std::path::{Path, PathBuf};

use carve_apiserver::ApiServer;
use carve_mps::fake_smi::{self, Config, FakeGpu, fixture};
use carve_mps::memlimit::{MIB, dmem_value};
use carve_mps::{MpsConfig, ProtocolChoice};
use carve_plugin::{ClaimRef, Driver, MpsSetup};
use common::*;
use nvidia_ml_sim::GpuEntry;

const FAKE: &str = env!("CARGO_BIN_EXE_carve-plugin-fake-mps-control");
const POD_A: &str = "0000000a-0000-0000-0000-00000000000a";
const POD_B: &str = "0000000b-0000-0000-0000-00000000000b";

struct Hard {
    node: Node,
    root: PathBuf,
    bin: PathBuf,
    key0: String,
    key1: String,
    smi: Config,
}

fn hard_node() -> Hard {
    let mut node = Node::new(vec![GpuEntry::new("h100-80gb", 2, false)]);
    let d = node.dir.path().to_path_buf();
    let gpus = node.backend().gpus().unwrap();
    let root = d.join("cgroup");
    let key0 = fake_smi::dmem_key(&gpus[0].pci_bus_id);
    let key1 = fake_smi::dmem_key(&gpus[1].pci_bus_id);
    // Only GPU 0's memory is accounted through dmem.
    fixture::root(&root, &[(key0.clone(), 80 * 1024 * MIB)], true).unwrap();
    fixture::cgroup(&root, Path::new("kubepods/besteffort"), true).unwrap();
    let smi = Config {
        cgroup_root: root.clone(),
        gpus: gpus
            .iter()
            .map(|g| FakeGpu {
                index: g.index,
                uuid: g.uuid.clone(),
                pci: g.pci_bus_id.clone(),
                mig: false,
            })
            .collect(),
        fail: None,
        as_uid: 0,
    };
    let bin = d.join("smi");
    let link = fake_smi::install(&bin, Path::new(FAKE), &smi).unwrap();
    let mut config = MpsConfig::new(d.join("state"));
    config.control_binary = PathBuf::from(FAKE);
    config.cgroup_root = root.clone();
    config.protocol = ProtocolChoice::Auto;
    config.timeout = std::time::Duration::from_secs(10);
    config.nvidia_smi = Some(link);
    let support = carve_mps::detect(&config).unwrap();
    assert_eq!(support.dmem_regions, std::slice::from_ref(&key0));
    node.config.mps = Some(MpsSetup { config, support });
    Hard {
        node,
        root,
        bin,
        key0,
        key1,
        smi,
    }
}

impl Hard {
    fn pod(&self, pod: &str) -> PathBuf {
        let rel = PathBuf::from(format!("kubepods/besteffort/pod{pod}"));
        fixture::cgroup(&self.root, &rel, false).unwrap();
        rel
    }

    fn dmem(&self, rel: &Path, file: &str, key: &str) -> String {
        let t = std::fs::read_to_string(self.root.join(rel).join(file)).unwrap();
        dmem_value(&t, key).unwrap().to_string()
    }

    /// The pod cgroup has no limit and left no reservation above it.
    fn assert_clear(&self, rel: &Path) {
        assert_eq!(self.dmem(rel, "dmem.max", &self.key0), "max");
        assert_eq!(self.dmem(rel, "dmem.min", &self.key0), "0");
        assert_eq!(
            self.dmem(Path::new("kubepods/besteffort"), "dmem.min", &self.key0),
            "0"
        );
        assert_eq!(
            self.dmem(Path::new("kubepods"), "dmem.min", &self.key0),
            "0"
        );
    }

    fn knob(&self, fail: Option<&str>) {
        let c = Config {
            fail: fail.map(str::to_string),
            ..self.smi.clone()
        };
        fake_smi::write_config(&self.bin, &c).unwrap();
    }

    fn calls(&self) -> Vec<String> {
        fake_smi::calls(&self.bin)
    }

    fn mps_log(&self, unit: &str) -> String {
        let dir = self.node.config.mps.as_ref().unwrap().config.mps_root();
        std::fs::read_to_string(dir.join(unit).join("pipe").join(carve_mps::fake::LOG))
            .unwrap_or_default()
    }

    fn daemon_pid(&self, unit: &str) -> Option<u32> {
        let dir = self.node.config.mps.as_ref().unwrap().config.mps_root();
        std::fs::read_to_string(dir.join(unit).join("pipe").join(carve_mps::PID_FILE))
            .ok()
            .and_then(|s| s.trim().parse().ok())
    }
}

/// A claim with `shares` (device, shareID, memory), reserved for `pods`,
/// optionally demanding `memoryLimit: hard`.
fn put(
    api: &ApiServer,
    name: &str,
    uid: &str,
    shares: &[(&str, &str, &str)],
    pods: &[&str],
    demand: bool,
) -> ClaimRef {
    let results: Vec<serde_json::Value> = shares
        .iter()
        .map(|(dev, share, mem)| {
            serde_json::json!({"request": "r", "driver": "gpu.carve.dev", "pool": NODE,
                "device": dev, "shareID": share,
                "consumedCapacity": {"memory": mem, "multiprocessors": "10"}})
        })
        .collect();
    let config = demand.then(|| {
        serde_json::json!([{
            "source": "FromClaim", "requests": ["r"], "opaque": {
                "driver": "gpu.carve.dev",
                "parameters": {"apiVersion": "gpu.carve.dev/v1alpha1", "kind": "MpsConfig", "memoryLimit": "hard"}}}])
    });
    put_results_config(api, name, uid, results, config, pods)
}

fn ok(
    out: &[(
        ClaimRef,
        Result<Vec<carve_plugin::PreparedDevice>, carve_plugin::ClaimError>,
    )],
    uid: &str,
) {
    if let Err(e) = &out.iter().find(|(c, _)| c.uid == uid).unwrap().1 {
        panic!("claim {uid}: {e}");
    }
}

fn mib(n: u64) -> String {
    (n * MIB).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_on_a_dmem_gpu_gets_its_pods_limit_through_the_tool_and_loses_it_at_unprepare() {
    let h = hard_node();
    let api = api().await;
    let driver = started(&h.node, h.node.config.clone(), &api).await;
    let cg = h.pod(POD_A);
    let cg_b = h.pod(POD_B);
    let a = put(
        &api,
        "a",
        "u-a",
        &[("gpu-0-mps", "s-a", "20Gi")],
        &[POD_A],
        true,
    );
    let b = put(
        &api,
        "b",
        "u-b",
        &[("gpu-1-mps", "s-b", "8Gi")],
        &[POD_B],
        false,
    );
    let out = driver.prepare(vec![a, b]).await;
    ok(&out, "u-a");
    ok(&out, "u-b");

    // Soft = hard = the share, on the pod cgroup, for GPU 0's key only.
    assert_eq!(h.dmem(&cg, "dmem.max", &h.key0), mib(20480));
    assert_eq!(h.dmem(&cg, "dmem.min", &h.key0), mib(20480));
    assert_eq!(
        h.dmem(Path::new("kubepods"), "dmem.min", &h.key0),
        mib(20480)
    );
    // GPU 1 is not in dmem.capacity: no call for it, its pod untouched.
    assert!(!cg_b.join("dmem.max").exists() || h.dmem(&cg_b, "dmem.max", &h.key0) == "max");
    let calls = h.calls();
    let uuid0 = h.smi.gpus[0].uuid.clone();
    assert_eq!(
        calls,
        [format!(
            "memory-limits --set --namespace {} --soft-limit 20480 --hard-limit 20480 -i {uuid0}",
            h.root.join(&cg).display()
        )]
    );
    let snap = driver.snapshot().await;
    assert_eq!(snap.memory_limits_set_by_plugin.len(), 1);
    let share_a = snap.claims["u-a"].devices[0].kind.mps().unwrap().clone();
    assert_eq!(share_a.cgroup.as_deref(), Some(cg.as_path()));
    let share_b = snap.claims["u-b"].devices[0].kind.mps().unwrap().clone();
    assert_eq!(share_b.hard_memory, None);
    assert!(
        share_b
            .memory_client_why
            .as_deref()
            .is_some_and(|w| w.contains("dmem.capacity lists no")),
        "{share_b:?}"
    );
    let _ = &h.key1;
    // The claim status says per share what the pod gets and why.
    let st = claim_with_status(&api, "a").await;
    let m = &st["status"]["devices"][0]["data"]["mps"];
    assert_eq!(m["memoryLimit"], "hard", "{st}");
    assert_eq!(m["memoryLimitMiB"], 20480, "{st}");
    let st = claim_with_status(&api, "b").await;
    let m = &st["status"]["devices"][0]["data"]["mps"];
    assert_eq!(m["memoryLimit"], "client", "{st}");
    assert!(
        m["memoryLimitWhy"]
            .as_str()
            .is_some_and(|w| w.contains("dmem.capacity lists no")),
        "{st}"
    );

    driver.unprepare_one("u-a").await.unwrap();
    h.assert_clear(&cg);
    let calls = h.calls();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(
        calls[1].ends_with(&format!("--soft-limit 0 --hard-limit max -i {uuid0}")),
        "{calls:?}"
    );
    assert!(
        driver
            .snapshot()
            .await
            .memory_limits_set_by_plugin
            .is_empty()
    );
    driver.unprepare_one("u-b").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_shares_in_one_claim_are_refused_and_another_claims_share_in_a_limited_pod_too() {
    let h = hard_node();
    let api = api().await;
    let driver = started(&h.node, h.node.config.clone(), &api).await;
    let cg = h.pod(POD_A);
    // Two shares (two namespaces, two pipe directories) for one container
    // cannot both reach MPS: refused before any limit is set.
    let two = put(
        &api,
        "two",
        "u-two",
        &[("gpu-0-mps", "s-1", "4Gi"), ("gpu-0-mps", "s-2", "6Gi")],
        &[POD_A],
        false,
    );
    let out = driver.prepare(vec![two]).await;
    let e = claim_error(&out, "u-two");
    assert!(
        e.contains("gpu-0-mps") && e.contains("one MPS daemon"),
        "{e}"
    );
    assert!(h.calls().is_empty());
    let a = put(
        &api,
        "a",
        "u-a",
        &[("gpu-0-mps", "s-1", "10Gi")],
        &[POD_A],
        false,
    );
    ok(&driver.prepare(vec![a]).await, "u-a");
    assert_eq!(h.dmem(&cg, "dmem.max", &h.key0), mib(10240));
    let c = put(
        &api,
        "c",
        "u-c",
        &[("gpu-0-mps", "s-c", "2Gi")],
        &[POD_A],
        false,
    );
    let out = driver.prepare(vec![c]).await;
    let e = claim_error(&out, "u-c");
    assert!(
        e.contains("gpu-0-mps")
            && e.contains("already has a hard memory limit")
            && e.contains("u-a"),
        "{e}"
    );
    // The first claim's limit is untouched; the refused one reached no daemon.
    assert_eq!(h.dmem(&cg, "dmem.max", &h.key0), mib(10240));
    assert!(!h.mps_log("gpu-0-mps").contains("u_c"), "namespace of u-c");
    assert_eq!(h.calls().len(), 1);
    driver.unprepare_one("u-a").await.unwrap();
    h.assert_clear(&cg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_of_several_pods_stays_client_or_fails_where_it_demands_hard() {
    let h = hard_node();
    let api = api().await;
    let driver = started(&h.node, h.node.config.clone(), &api).await;
    let (ca, cb) = (h.pod(POD_A), h.pod(POD_B));
    let shared = put(
        &api,
        "s",
        "u-s",
        &[("gpu-0-mps", "s-s", "4Gi")],
        &[POD_A, POD_B],
        false,
    );
    let demand = put(
        &api,
        "d",
        "u-d",
        &[("gpu-0-mps", "s-d", "4Gi")],
        &[POD_A, POD_B],
        true,
    );
    let out = driver.prepare(vec![shared, demand]).await;
    ok(&out, "u-s");
    let e = claim_error(&out, "u-d");
    assert!(
        e.contains("gpu-0-mps") && e.contains("requires memoryLimit hard") && e.contains("2 pods"),
        "{e}"
    );
    assert!(h.calls().is_empty(), "{:?}", h.calls());
    h.assert_clear(&ca);
    h.assert_clear(&cb);
    let snap = driver.snapshot().await;
    let s = snap.claims["u-s"].devices[0].kind.mps().unwrap().clone();
    assert_eq!(s.hard_memory, None);
    assert!(s.memory_client_why.unwrap().contains("2 pods"));
    driver.unprepare_one("u-s").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demanding_hard_on_a_gpu_without_dmem_or_without_a_pod_cgroup_fails_with_the_reason() {
    let h = hard_node();
    let api = api().await;
    let driver = started(&h.node, h.node.config.clone(), &api).await;
    h.pod(POD_A);
    let g1 = put(
        &api,
        "g1",
        "u-g1",
        &[("gpu-1-mps", "s-1", "4Gi")],
        &[POD_A],
        true,
    );
    // POD_B's cgroup does not exist.
    let nocg = put(
        &api,
        "n",
        "u-n",
        &[("gpu-0-mps", "s-n", "4Gi")],
        &[POD_B],
        false,
    );
    let out = driver.prepare(vec![g1, nocg]).await;
    let e = claim_error(&out, "u-g1");
    assert!(
        e.contains("gpu-1-mps")
            && e.contains("enforces client")
            && e.contains("dmem.capacity lists no"),
        "{e}"
    );
    let e = claim_error(&out, "u-n");
    assert!(e.contains("gpu-0-mps") && e.contains(POD_B), "{e}");
    assert!(h.calls().is_empty());
    assert_eq!(h.daemon_pid("gpu-0-mps"), None);
    assert_eq!(h.daemon_pid("gpu-1-mps"), None);
    assert!(driver.snapshot().await.claims.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_dying_or_lying_tool_fails_the_claim_alone_and_leaves_nothing() {
    let h = hard_node();
    let api = api().await;
    let driver = started(&h.node, h.node.config.clone(), &api).await;
    let (ca, cb) = (h.pod(POD_A), h.pod(POD_B));
    let a = put(
        &api,
        "a",
        "u-a",
        &[("gpu-0-mps", "s-a", "8Gi")],
        &[POD_A],
        false,
    );
    ok(&driver.prepare(vec![a]).await, "u-a");
    let pid = h.daemon_pid("gpu-0-mps").unwrap();
    for (i, (knob, want)) in [
        ("refuse", "knob refuse"),
        ("die", "signal"),
        ("lie", "dmem.max has"),
    ]
    .into_iter()
    .enumerate()
    {
        h.knob(Some(knob));
        let uid = format!("u-b{i}");
        let b = put(
            &api,
            &format!("b{i}"),
            &uid,
            &[("gpu-0-mps", "s-b", "4Gi")],
            &[POD_B],
            false,
        );
        let out = driver.prepare(vec![b]).await;
        let e = claim_error(&out, &uid);
        assert!(e.contains("gpu-0-mps") && e.contains(want), "{knob}: {e}");
        assert!(
            e.contains(&h.root.join(&cb).display().to_string()),
            "{knob}: {e}"
        );
        h.knob(None);
        // Nothing of it is left: no limit, no record, no namespace.
        assert_eq!(h.dmem(&cb, "dmem.max", &h.key0), "max", "{knob}");
        assert_eq!(h.dmem(&cb, "dmem.min", &h.key0), "0", "{knob}");
        let snap = driver.snapshot().await;
        assert!(!snap.claims.contains_key(&uid), "{knob}");
        assert!(
            snap.memory_limits_set_by_plugin
                .iter()
                .all(|m| m.claim_uid == "u-a"),
            "{knob}: {:?}",
            snap.memory_limits_set_by_plugin
        );
        assert!(
            !h.mps_log("gpu-0-mps")
                .contains(&carve_mps::control::v3::namespace_name(&uid, "s-b")),
            "{knob}"
        );
        // The other claim is untouched: its limit, its daemon.
        assert_eq!(h.dmem(&ca, "dmem.max", &h.key0), mib(8192), "{knob}");
        assert_eq!(h.daemon_pid("gpu-0-mps"), Some(pid), "{knob}");
    }
    assert_eq!(
        h.dmem(Path::new("kubepods"), "dmem.min", &h.key0),
        mib(8192),
        "only u-a's reservation"
    );
    driver.unprepare_one("u-a").await.unwrap();
    h.assert_clear(&ca);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_claim_whose_tool_fails_leaves_no_daemon() {
    let h = hard_node();
    let api = api().await;
    let driver = started(&h.node, h.node.config.clone(), &api).await;
    let ca = h.pod(POD_A);
    h.knob(Some("refuse"));
    let a = put(
        &api,
        "a",
        "u-a",
        &[("gpu-0-mps", "s-a", "8Gi")],
        &[POD_A],
        true,
    );
    let e = claim_error(&driver.prepare(vec![a]).await, "u-a");
    assert!(e.contains("gpu-0-mps"), "{e}");
    assert_eq!(h.daemon_pid("gpu-0-mps"), None);
    h.assert_clear(&ca);
    let snap = driver.snapshot().await;
    assert!(snap.claims.is_empty() && snap.memory_limits_set_by_plugin.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_clears_the_limits_of_claims_that_did_not_complete() {
    let h = hard_node();
    let api = api().await;
    let driver = started(&h.node, h.node.config.clone(), &api).await;
    let (ca, cb) = (h.pod(POD_A), h.pod(POD_B));
    let a = put(
        &api,
        "a",
        "u-a",
        &[("gpu-0-mps", "s-a", "8Gi")],
        &[POD_A],
        false,
    );
    ok(&driver.prepare(vec![a]).await, "u-a");
    assert_eq!(h.dmem(&ca, "dmem.max", &h.key0), mib(8192));
    drop(driver);
    // A crash after the limit was set, before PrepareCompleted; and a crash
    // between another claim's recorded intent and its tool call (the
    // intent is in the checkpoint, the claim only PrepareStarted in memory).
    let path = &h.node.config.checkpoint_path;
    let mut cp = carve_plugin::Checkpoint::load(path).unwrap().unwrap();
    cp.body.claims.get_mut("u-a").unwrap().state = carve_plugin::ClaimState::PrepareStarted;
    let mut intent = cp.body.memory_limits_set_by_plugin.first().unwrap().clone();
    intent.claim_uid = "u-crashed".into();
    intent.cgroup = cb.clone();
    cp.body.memory_limits_set_by_plugin.insert(intent);
    carve_plugin::Checkpoint::store(&cp.body, path, None).unwrap();
    let before = h.calls().len();

    let driver = Driver::new(h.node.config.clone(), h.node.backend(), api.client())
        .await
        .unwrap();
    let report = driver.recover().await.unwrap();
    assert_eq!(report.rolled_back, ["u-a"]);
    assert_eq!(report.memory_limits_cleared.len(), 2, "{report:?}");
    h.assert_clear(&ca);
    h.assert_clear(&cb);
    let calls = &h.calls()[before..];
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(
        calls
            .iter()
            .all(|c| c.contains("--soft-limit 0 --hard-limit max"))
    );
    assert!(
        driver
            .snapshot()
            .await
            .memory_limits_set_by_plugin
            .is_empty()
    );
}

/// A torn checkpoint (current boot) loses the limit records with it: the
/// claim adopted from the API server and the daemon's state gets its
/// record back from its share, so its unprepare still clears the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_adopted_after_a_torn_checkpoint_still_has_its_limit_cleared_at_unprepare() {
    let h = hard_node();
    let api = api().await;
    let driver = started(&h.node, h.node.config.clone(), &api).await;
    let ca = h.pod(POD_A);
    let a = put(
        &api,
        "a",
        "u-a",
        &[("gpu-0-mps", "s-a", "8Gi")],
        &[POD_A],
        false,
    );
    ok(&driver.prepare(vec![a.clone()]).await, "u-a");
    assert_eq!(h.dmem(&ca, "dmem.max", &h.key0), mib(8192));
    let recorded = driver.snapshot().await.memory_limits_set_by_plugin;
    drop(driver);
    std::fs::write(&h.node.config.checkpoint_path, b"").unwrap();

    let driver = Driver::new(h.node.config.clone(), h.node.backend(), api.client())
        .await
        .unwrap();
    let report = driver.recover().await.unwrap();
    assert_eq!(report.adopted, ["u-a"], "{report:?}");
    assert_eq!(
        driver.snapshot().await.memory_limits_set_by_plugin,
        recorded,
        "the adopted claim's limit record"
    );
    assert_eq!(
        h.dmem(&ca, "dmem.max", &h.key0),
        mib(8192),
        "kept while prepared"
    );
    let out = driver.unprepare(vec![a]).await;
    assert!(out.iter().all(|(_, r)| r.is_ok()), "{out:?}");
    h.assert_clear(&ca);
}
