//! Crash injection: the plugin runs in a child process (this test binary
//! re-executed as `plugin_child`), the NVML simulator aborts it at a chosen
//! NVML call (before or after the call takes effect) or the plugin aborts
//! itself at a chosen checkpoint/CDI write; then a fresh child recovers and the
//! kubelet's retry must succeed with no leaked GI/CI, no stray CDI spec, and no
//! two claims on one placement.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;

use carve_apiserver::ApiServer;
use carve_nvml::{NvmlBackend, NvmlOptions};
use carve_plugin::testing::FakeKubelet;
use carve_plugin::{Checkpoint, ClaimRef, ClaimState, Driver, serve};
use common::*;
use nvidia_ml_sim::{Fault, FaultAction, GpuEntry};
use tokio::io::{AsyncBufReadExt, BufReader};

const CHILD_DIR: &str = "CARVE_PLUGIN_CHILD_DIR";
const CHILD_API: &str = "CARVE_PLUGIN_CHILD_API";
const CHILD_FAULT: &str = "CARVE_PLUGIN_WRITE_FAULT";

/// Child-process entry point: runs the plugin for the node in `$CARVE_PLUGIN_CHILD_DIR`
/// until stdin closes. Prints `READY` once both sockets accept connections.
#[test]
#[ignore = "entry point of the child process the crash tests start"]
fn plugin_child() {
    let (Ok(dir), Ok(url)) = (std::env::var(CHILD_DIR), std::env::var(CHILD_API)) else {
        panic!("plugin_child runs only as a child of the crash tests");
    };
    let dir = PathBuf::from(dir);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let mut config = plugin_config(&dir);
        config.write_fault = std::env::var(CHILD_FAULT).ok().map(|f| f.parse().unwrap());
        let backend = Arc::new(
            NvmlBackend::open(NvmlOptions {
                lib_path: Some(dir.join("libnvidia_ml_sim.so")),
                proc_root: dir.join("sim").join("proc"),
            })
            .unwrap(),
        );
        let mut kc = kube::Config::new(url.parse().unwrap());
        kc.default_retry = false;
        let client = kube::Client::try_from(kc).unwrap();
        let driver = Arc::new(Driver::new(config, backend, client).await.unwrap());
        driver.recover().await.unwrap();
        let serving = serve(driver, async {
            let _ = tokio::task::spawn_blocking(|| {
                let mut sink = Vec::new();
                std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink)
            })
            .await;
        })
        .await
        .unwrap();
        use std::io::Write;
        let mut out = std::io::stdout();
        out.write_all(b"READY\n").unwrap();
        out.flush().unwrap();
        serving.wait().await.unwrap();
    });
}

struct Child {
    log: PathBuf,
    proc: tokio::process::Child,
    kubelet: FakeKubelet,
}

async fn start_child(node: &Node, api: &ApiServer, fault: Option<&str>, log: &str) -> Child {
    let mut cmd = tokio::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "plugin_child",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_DIR, node.dir.path())
    .env(CHILD_API, api.url())
    .env_remove(CHILD_FAULT)
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(std::fs::File::create(node.dir.path().join(log)).unwrap())
    .kill_on_drop(true);
    if let Some(f) = fault {
        cmd.env(CHILD_FAULT, f);
    }
    let mut proc = cmd.spawn().unwrap();
    let mut lines = BufReader::new(proc.stdout.take().unwrap()).lines();
    loop {
        match lines.next_line().await.unwrap() {
            Some(l) if l.ends_with("READY") => break,
            Some(_) => {}
            None => panic!(
                "child exited before READY; see {log}: {}",
                std::fs::read_to_string(node.dir.path().join(log)).unwrap_or_default()
            ),
        }
    }
    // Keep draining the child's stdout so its last writes do not hit a closed pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let reg = node
        .config
        .plugins_registry_dir
        .join("gpu.carve.dev-reg.sock");
    let kubelet = FakeKubelet::register(&reg, "gpu.carve.dev").await.unwrap();
    Child {
        log: node.dir.path().join(log),
        proc,
        kubelet,
    }
}

impl Child {
    async fn stop(mut self) {
        drop(self.proc.stdin.take());
        let s = self.proc.wait().await.unwrap();
        assert!(
            s.success(),
            "child exit {s:?}: {}",
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
    }

    async fn expect_abort(mut self) {
        let s = self.proc.wait().await.unwrap();
        assert_eq!(s.signal(), Some(6), "child should have aborted: {s:?}");
    }
}

#[derive(Clone, Debug)]
enum Point {
    Nvml(&'static str, FaultAction),
    Write(&'static str),
}

fn set_faults(node: &mut Node, p: Option<&Point>) -> Option<&'static str> {
    node.sim.faults.clear();
    let mut write = None;
    match p {
        Some(Point::Nvml(f, a)) => node.sim.faults.push(Fault {
            function: (*f).into(),
            nth: 1,
            action: *a,
        }),
        Some(Point::Write(w)) => write = Some(*w),
        None => {}
    }
    node.write_sim_config();
    write
}

fn claims(api: &ApiServer) -> (ClaimRef, ClaimRef) {
    let a = put_claim(
        api,
        "a",
        "u-a",
        &[("r", "gpu-0-mig-3g40gb-4")],
        serde_json::json!([]),
    );
    let b = put_claim(
        api,
        "b",
        "u-b",
        &[("r", "gpu-1-mig-2g20gb-0")],
        serde_json::json!([]),
    );
    (a, b)
}

fn checkpoint_claims(node: &Node) -> Vec<(String, ClaimState)> {
    Checkpoint::load(&node.config.checkpoint_path)
        .unwrap()
        .map(|c| {
            c.body
                .claims
                .into_iter()
                .map(|(k, v)| (k, v.state))
                .collect()
        })
        .unwrap_or_default()
}

fn spec_files(node: &Node) -> Vec<String> {
    node.cdi_files()
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect()
}

/// Claim b on GPU 1 is prepared and must survive every crash and recovery.
fn assert_b_intact(node: &Node) {
    let inst = node.instances();
    assert_eq!(inst.iter().filter(|i| i.0 == 1).count(), 1, "{inst:?}");
    assert!(inst.contains(&(1, 0, 1, inst.iter().find(|i| i.0 == 1).unwrap().3)));
}

async fn prepare_ok(k: &FakeKubelet, c: &ClaimRef) {
    let r = k.prepare(std::slice::from_ref(c)).await.unwrap();
    assert_eq!(r.claims[&c.uid].error, "");
}

async fn unprepare_ok(k: &FakeKubelet, c: &ClaimRef) {
    let r = k.unprepare(std::slice::from_ref(c)).await.unwrap();
    assert_eq!(r.claims[&c.uid].error, "");
}

async fn prepare_crash(p: &Point, mig_on: bool) {
    let mut node = Node::new(vec![GpuEntry::new("h100-80gb", 2, mig_on)]);
    let api = api().await;
    let (a, b) = claims(&api);
    set_faults(&mut node, None);
    let c = start_child(&node, &api, None, "child0.log").await;
    prepare_ok(&c.kubelet, &b).await;
    c.stop().await;

    let wf = set_faults(&mut node, Some(p));
    let c = start_child(&node, &api, wf, "child1.log").await;
    assert!(
        c.kubelet.prepare(std::slice::from_ref(&a)).await.is_err(),
        "{p:?}: call must fail with the crash"
    );
    c.expect_abort().await;

    set_faults(&mut node, None);
    let c = start_child(&node, &api, None, "child2.log").await;
    // Recovery rolled the half-prepared claim back.
    assert!(
        !checkpoint_claims(&node).iter().any(|(u, _)| u == "u-a"),
        "{p:?}"
    );
    assert_eq!(
        node.instances().iter().filter(|i| i.0 == 0).count(),
        0,
        "{p:?}: GI leak on GPU 0"
    );
    assert_b_intact(&node);
    // The kubelet's retry succeeds.
    prepare_ok(&c.kubelet, &a).await;
    let inst = node.instances();
    let on0: Vec<_> = inst.iter().filter(|i| i.0 == 0).collect();
    assert_eq!(on0.len(), 1, "{p:?}: {inst:?}");
    assert_eq!(
        (on0[0].1, on0[0].2),
        (4, 1),
        "{p:?}: GI at the placement with one CI"
    );
    assert_eq!(
        spec_files(&node),
        [
            "k8s.gpu.carve.dev-claim_u-a.json",
            "k8s.gpu.carve.dev-claim_u-b.json"
        ],
        "{p:?}"
    );
    // Nobody else gets that placement.
    let x = put_claim(
        &api,
        "x",
        "u-x",
        &[("r", "gpu-0-mig-7g80gb-0")],
        serde_json::json!([]),
    );
    let r = c.kubelet.prepare(std::slice::from_ref(&x)).await.unwrap();
    assert!(
        r.claims["u-x"]
            .error
            .contains("occupied by claim default/a"),
        "{p:?}: {}",
        r.claims["u-x"].error
    );
    unprepare_ok(&c.kubelet, &a).await;
    unprepare_ok(&c.kubelet, &b).await;
    assert!(node.instances().is_empty());
    assert!(spec_files(&node).is_empty());
    c.stop().await;
    assert!(
        node.sim_state()
            .gpus
            .iter()
            .all(|g| g.mig_current == mig_on),
        "{p:?}: MIG mode returned to what it was"
    );
}

async fn unprepare_crash(p: &Point) {
    let mut node = Node::new(vec![GpuEntry::new("h100-80gb", 2, false)]);
    let api = api().await;
    let (a, b) = claims(&api);
    set_faults(&mut node, None);
    let c = start_child(&node, &api, None, "child0.log").await;
    prepare_ok(&c.kubelet, &a).await;
    prepare_ok(&c.kubelet, &b).await;
    c.stop().await;

    let wf = set_faults(&mut node, Some(p));
    let c = start_child(&node, &api, wf, "child1.log").await;
    assert!(
        c.kubelet.unprepare(std::slice::from_ref(&a)).await.is_err(),
        "{p:?}: call must fail with the crash"
    );
    c.expect_abort().await;

    set_faults(&mut node, None);
    let c = start_child(&node, &api, None, "child2.log").await;
    unprepare_ok(&c.kubelet, &a).await;
    assert_eq!(
        node.instances().iter().filter(|i| i.0 == 0).count(),
        0,
        "{p:?}: GI/CI leak"
    );
    assert_b_intact(&node);
    assert_eq!(
        checkpoint_claims(&node),
        [("u-b".to_string(), ClaimState::PrepareCompleted)],
        "{p:?}"
    );
    assert_eq!(
        spec_files(&node),
        ["k8s.gpu.carve.dev-claim_u-b.json"],
        "{p:?}"
    );
    assert!(
        !node.sim_state().gpus[0].mig_current,
        "{p:?}: MIG mode of GPU 0 returned"
    );
    // The placement is free again for another claim.
    let x = put_claim(
        &api,
        "x",
        "u-x",
        &[("r", "gpu-0-mig-7g80gb-0")],
        serde_json::json!([]),
    );
    prepare_ok(&c.kubelet, &x).await;
    unprepare_ok(&c.kubelet, &x).await;
    unprepare_ok(&c.kubelet, &b).await;
    c.stop().await;
    assert!(node.instances().is_empty());
}

fn nvml_points(functions: &[&'static str]) -> Vec<Point> {
    functions
        .iter()
        .flat_map(|f| {
            [
                Point::Nvml(f, FaultAction::AbortBefore),
                Point::Nvml(f, FaultAction::AbortAfter),
            ]
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_at_every_prepare_step() {
    let mut points = nvml_points(&[
        "nvmlDeviceSetMigMode",
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        "nvmlGpuInstanceCreateComputeInstance",
    ]);
    // Write 1 of a process is recovery's checkpoint; then PrepareStarted (2),
    // the CDI spec (cdi 1) and PrepareCompleted (3).
    points.extend([
        Point::Write("checkpoint:2"),
        Point::Write("cdi:1"),
        Point::Write("checkpoint:3"),
    ]);
    for p in &points {
        prepare_crash(p, false).await;
    }
    eprintln!("prepare crash points covered: {}", points.len());
    assert_eq!(points.len(), 9);
}

/// MIG mode already on (the steady state): prepare persists only
/// PrepareCompleted, so a crash before it leaves an instance that no
/// checkpointed claim names; recovery's sweep must remove it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_at_every_prepare_step_with_mig_mode_already_on() {
    let mut points = nvml_points(&[
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        "nvmlGpuInstanceCreateComputeInstance",
    ]);
    // Write 1 of a process is recovery's checkpoint; then the CDI spec (cdi
    // 1) and PrepareCompleted (checkpoint 2).
    points.extend([Point::Write("cdi:1"), Point::Write("checkpoint:2")]);
    for p in &points {
        prepare_crash(p, true).await;
    }
    eprintln!("prepare crash points covered: {}", points.len());
    assert_eq!(points.len(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_at_every_unprepare_step() {
    let mut points = nvml_points(&[
        "nvmlComputeInstanceDestroy",
        "nvmlGpuInstanceDestroy",
        "nvmlDeviceSetMigMode",
    ]);
    // Recovery writes checkpoint 1; UnprepareStarted is 2, claim removed 3,
    // MIG mode returned 4.
    points.extend([
        Point::Write("checkpoint:2"),
        Point::Write("checkpoint:3"),
        Point::Write("checkpoint:4"),
    ]);
    for p in &points {
        unprepare_crash(p).await;
    }
    eprintln!("unprepare crash points covered: {}", points.len());
    assert_eq!(points.len(), 9);
}
