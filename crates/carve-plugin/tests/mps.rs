//! MPS shares through the real `Driver`: the NVML simulator library, the
//! API-server stand-in, and the fake `nvidia-cuda-mps-control` (written from
//! NVIDIA's documentation, rejecting what the real daemon rejects) as a real
//! child process.
//!
//! Covered: several claims on one GPU (one daemon, one v3 namespace per share
//! whose directory alone the container gets, a client through it landing in
//! the namespace with its limits, compute mode), claims on one MIG instance (created by the first share,
//! destroyed after the last), v3 and v2 (a v2 unit serves one claim; a claim
//! with an MPS share and another device is refused), a daemon that dies and is restarted
//! with its limits, a plugin restart with running claims (daemon adopted
//! untouched), last-claim teardown, a crash between attaching and completing,
//! and bad allocations (each a per-claim error that leaves no daemon and
//! does not touch other claims).

mod common;

use std::path::{Path, PathBuf};

use carve_apiserver::{ApiServer, Resource};
use carve_gpu::{ComputeMode, ComputeTarget};
use carve_mps::{MpsConfig, ProtocolChoice};
use carve_plugin::{CdiSpec, ClaimRef, Driver, MpsSetup, PluginConfig, claim_spec_path};
use common::*;
use nvidia_ml_sim::GpuEntry;

const FAKE: &str = env!("CARGO_BIN_EXE_carve-plugin-fake-mps-control");

/// A node with MPS configured: `protocol` decides v2 or v3 (v3 needs the
/// fake cgroup root, which this creates).
fn mps_node(gpus: Vec<GpuEntry>, protocol: ProtocolChoice) -> Node {
    let mut node = Node::new(gpus);
    let d = node.dir.path().to_path_buf();
    let cg = d.join("cgroup");
    std::fs::create_dir_all(&cg).unwrap();
    std::fs::write(cg.join("cgroup.controllers"), "cpu memory pids\n").unwrap();
    let mut config = MpsConfig::new(d.join("state"));
    config.control_binary = PathBuf::from(FAKE);
    config.cgroup_root = cg;
    config.protocol = protocol;
    config.timeout = std::time::Duration::from_secs(10);
    let support = carve_mps::detect(&config).unwrap();
    node.config.mps = Some(MpsSetup { config, support });
    node
}

fn setup(c: &PluginConfig) -> &MpsSetup {
    c.mps.as_ref().unwrap()
}

/// A pod cgroup (cgroupfs layout, besteffort) for `pod`.
fn make_pod_cgroup(node: &Node, pod: &str) -> PathBuf {
    let rel = PathBuf::from(format!("kubepods/besteffort/pod{pod}"));
    std::fs::create_dir_all(setup(&node.config).config.cgroup_root.join(&rel)).unwrap();
    rel
}

/// One MPS share of an allocation: device, shareID, and `consumedCapacity`
/// (memory, SMs) if any.
type Share<'a> = (&'a str, &'a str, Option<(&'a str, &'a str)>);

/// An allocated claim with MPS shares, reserved for `pod`.
fn put_mps(
    api: &ApiServer,
    name: &str,
    uid: &str,
    shares: &[Share<'_>],
    pod: Option<&str>,
) -> ClaimRef {
    let results: Vec<serde_json::Value> = shares
        .iter()
        .map(|(dev, share, cap)| {
            let mut r = serde_json::json!({"request": "r", "driver": "gpu.carve.dev", "pool": NODE,
                "device": dev, "shareID": share});
            if let Some((m, sm)) = cap {
                r["consumedCapacity"] = serde_json::json!({"memory": m, "multiprocessors": sm});
            }
            r
        })
        .collect();
    put_results(api, name, uid, results, pod.as_slice())
}

async fn start(node: &Node, api: &ApiServer) -> Driver {
    started(node, node.config.clone(), api).await
}

fn unit_dir(node: &Node, unit: &str) -> PathBuf {
    setup(&node.config).config.mps_root().join(unit)
}

/// What the fake daemon of `unit` recorded.
fn fake_log(node: &Node, unit: &str) -> String {
    std::fs::read_to_string(unit_dir(node, unit).join("pipe").join(carve_mps::fake::LOG))
        .unwrap_or_default()
}

fn daemon_pid(node: &Node, unit: &str) -> Option<u32> {
    std::fs::read_to_string(unit_dir(node, unit).join("pipe").join(carve_mps::PID_FILE))
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

fn alive(pid: u32) -> bool {
    // A zombie (killed, not yet reaped) counts as gone.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit(')')
            .next()
            .is_some_and(|r| !r.trim_start().starts_with('Z'))
    })
}

fn wait_gone(pid: u32) {
    for _ in 0..500 {
        if !alive(pid) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("pid {pid} still runs");
}

fn ok(
    out: &[(
        ClaimRef,
        Result<Vec<carve_plugin::PreparedDevice>, carve_plugin::ClaimError>,
    )],
    uid: &str,
) -> Vec<carve_plugin::PreparedDevice> {
    match &out.iter().find(|(c, _)| c.uid == uid).unwrap().1 {
        Ok(d) => d.clone(),
        Err(e) => panic!("claim {uid}: {e}"),
    }
}

fn ns(claim: &str, share: &str) -> String {
    carve_mps::control::v3::namespace_name(claim, share)
}

fn env_of(node: &Node, uid: &str) -> Vec<String> {
    let spec = CdiSpec::read(&claim_spec_path(&node.config.cdi_dir, uid)).unwrap();
    spec.devices[0].container_edits.env.clone()
}

const POD_A: &str = "0000000a-0000-0000-0000-00000000000a";
const POD_B: &str = "0000000b-0000-0000-0000-00000000000b";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v3_claims_share_a_gpu_through_a_namespace_each() {
    let node = mps_node(
        vec![GpuEntry::new("h100-80gb", 2, false)],
        ProtocolChoice::Auto,
    );
    assert_eq!(
        setup(&node.config).support.protocol,
        carve_mps::Protocol::V3
    );
    let api = api().await;
    let driver = start(&node, &api).await;
    let b = node.backend();
    let uuid0 = b.gpus().unwrap()[0].uuid.clone();
    let cg_a = make_pod_cgroup(&node, POD_A);
    let cg_b = make_pod_cgroup(&node, POD_B);

    let a = put_mps(
        &api,
        "a",
        "u-a",
        &[("gpu-0-mps", "s-a", Some(("20Gi", "30")))],
        Some(POD_A),
    );
    let c = put_mps(
        &api,
        "c",
        "u-c",
        &[("gpu-0-mps", "s-c", Some(("10000Mi", "17")))],
        Some(POD_B),
    );
    let out = driver.prepare(vec![a.clone(), c.clone()]).await;
    let da = ok(&out, "u-a");
    let dc = ok(&out, "u-c");
    assert_ne!(da[0].cdi_device_ids, dc[0].cdi_device_ids);
    assert!(
        da[0].cdi_device_ids[0].ends_with("u-a-gpu-0-mps-s-a"),
        "{da:?}"
    );

    // One daemon, v3 multiuser, on GPU 0 only; one namespace per share,
    // created then given its limits (memory rounded up to the 256 MiB step,
    // SMs to the step of 2, as a percentage of the H100's 132 SMs).
    let log = fake_log(&node, "gpu-0-mps");
    assert_eq!(log.matches("start pid=").count(), 1, "{log}");
    assert!(log.contains("protocol=3 multiuser=true"), "{log}");
    assert!(
        log.contains(&format!("env CUDA_VISIBLE_DEVICES={uuid0}")),
        "{log}"
    );
    let (na, nc) = (ns("u-a", "s-a"), ns("u-c", "s-c"));
    for line in [
        format!("verb server create carve --allowed-devices={uuid0}"),
        "verb server get carve status".to_string(),
        format!("verb namespace create {na} --server=carve"),
        format!(
            "verb namespace set {na} --server=carve --pinned-memory-limit=20480M --active-thread-percentage=23"
        ),
        format!("verb namespace get {na} carve pipe-directory"),
        format!(
            "verb namespace set {nc} --server=carve --pinned-memory-limit=10240M --active-thread-percentage=14"
        ),
    ] {
        assert!(log.lines().any(|l| l == line), "{line} not in {log}");
    }
    // No cgroup binding (615 has none), no dmem file written.
    assert!(!log.contains("cgroup"), "{log}");
    assert!(
        !setup(&node.config)
            .config
            .cgroup_root
            .join(&cg_a)
            .join("dmem.max")
            .exists()
    );
    let _ = &cg_b;
    // The container gets only its namespace's directory, no limit variables.
    let env = env_of(&node, "u-a");
    // Issue 16: no per-device visible-device variables.
    assert!(
        !env.iter().any(|e| e.contains("VISIBLE_DEVICES")),
        "{env:?} ({uuid0})"
    );
    let ns_dir = unit_dir(&node, "gpu-0-mps")
        .join("pipe")
        .join("carve")
        .join(&na);
    assert!(
        env.contains(&format!("CUDA_MPS_PIPE_DIRECTORY={}", ns_dir.display())),
        "{env:?}"
    );
    assert!(
        !env.iter()
            .any(|e| e.starts_with("CUDA_MPS_PINNED") || e.starts_with("CUDA_MPS_ACTIVE")),
        "{env:?}"
    );
    let spec = CdiSpec::read(&claim_spec_path(&node.config.cdi_dir, "u-a")).unwrap();
    let m = &spec.devices[0].container_edits.mounts;
    assert_eq!(m.len(), 1);
    assert_eq!(Path::new(&m[0].host_path), ns_dir);
    assert_eq!(m[0].container_path, ns_dir.display().to_string());
    // A pod's CUDA client with that environment, through that mount (same
    // path), lands in the share's namespace with its limits.
    let o = std::process::Command::new(FAKE)
        .env("CUDA_MPS_PIPE_DIRECTORY", &m[0].host_path)
        .env_remove("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
        .env_remove("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        // This process's UID: the daemon runs as it (other UIDs need a root
        // daemon, which carve-mps's tests of the fake cover).
        .args([carve_mps::fake::CUDA_CLIENT])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        format!("server=carve namespace={na} pinned=20480M atp=23"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // Compute mode and status.
    assert_eq!(
        b.compute_mode(ComputeTarget::Gpu(0)).unwrap(),
        ComputeMode::ExclusiveProcess
    );
    assert_eq!(
        b.compute_mode(ComputeTarget::Gpu(1)).unwrap(),
        ComputeMode::Default
    );
    let rc = claim_with_status(&api, "a").await;
    let data = &rc["status"]["devices"][0]["data"];
    assert_eq!(data["sharing"], "mps", "{rc}");
    assert_eq!(data["mps"]["memoryLimitMiB"], 20480);
    // The namespace's pinned limit can be escaped by the tenant [DYN]:
    // published as `client`; compute as the namespace percentage.
    assert_eq!(data["mps"]["memoryLimit"], "client");
    assert_eq!(data["mps"]["computeLimit"], "percentage");

    // The whole GPU and its MIG devices are refused while shared; GPU 1 is fine.
    let whole = put_claim(
        &api,
        "whole",
        "u-whole",
        &[("r", "gpu-0")],
        serde_json::json!([]),
    );
    let mig = put_claim(
        &api,
        "mig",
        "u-mig",
        &[("r", "gpu-0-mig-1g10gb-0")],
        serde_json::json!([]),
    );
    let other = put_claim(
        &api,
        "other",
        "u-other",
        &[("r", "gpu-1")],
        serde_json::json!([]),
    );
    let out = driver.prepare(vec![whole, mig, other]).await;
    assert!(
        claim_error(&out, "u-whole").contains("through MPS"),
        "{}",
        claim_error(&out, "u-whole")
    );
    assert!(claim_error(&out, "u-mig").contains("through MPS"));
    ok(&out, "u-other");

    // First unprepare: namespace gone, daemon stays; last: daemon quits,
    // compute mode back to DEFAULT, nothing left.
    let pid = daemon_pid(&node, "gpu-0-mps").unwrap();
    driver.unprepare_one("u-a").await.unwrap();
    assert!(
        fake_log(&node, "gpu-0-mps")
            .contains(&format!("namespace delete {na} --server=carve --force"))
    );
    assert!(alive(pid));
    driver.unprepare_one("u-c").await.unwrap();
    wait_gone(pid);
    assert!(fake_log(&node, "gpu-0-mps").contains("quit"));
    assert_eq!(
        b.compute_mode(ComputeTarget::Gpu(0)).unwrap(),
        ComputeMode::Default
    );
    let snap = driver.snapshot().await;
    assert!(snap.compute_mode_set_by_plugin.is_empty());
    assert!(!snap.claims.contains_key("u-a") && !snap.claims.contains_key("u-c"));
    assert!(!claim_spec_path(&node.config.cdi_dir, "u-c").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_mps_instance_lives_from_first_share_to_last() {
    let node = mps_node(
        vec![GpuEntry::new("h100-80gb", 1, false)],
        ProtocolChoice::V3,
    );
    let api = api().await;
    let driver = start(&node, &api).await;
    let b = node.backend();
    let unit = "gpu-0-mig-1g10gb-3-mps";
    let a = put_mps(&api, "a", "u-a", &[(unit, "s-a", Some(("4Gi", "8")))], None);
    let c = put_mps(&api, "c", "u-c", &[(unit, "s-c", Some(("2Gi", "4")))], None);
    ok(&driver.prepare(vec![a.clone()]).await, "u-a");
    ok(&driver.prepare(vec![c.clone()]).await, "u-c");
    // One GI at slice 3, shared; both claims name the same MIG UUID.
    let gis = live(&*b, 0);
    assert_eq!(gis.len(), 1, "{gis:?}");
    assert_eq!(gis[0].placement.start, 3);
    let mig_uuid = gis[0].compute_instances[0].mig_uuid.clone().unwrap();
    for uid in ["u-a", "u-c"] {
        let env = env_of(&node, uid);
        // Issue 16: no per-device visible-device variables.
        assert!(
            !env.iter().any(|e| e.contains("VISIBLE_DEVICES")),
            "{env:?}"
        );
        // v3 (several claims on one unit): each claim's namespace directory.
        assert!(
            env.iter().any(|e| e.starts_with("CUDA_MPS_PIPE_DIRECTORY=")
                && e.contains(&ns(uid, if uid == "u-a" { "s-a" } else { "s-c" }))),
            "{env:?}"
        );
    }
    let log = fake_log(&node, unit);
    assert!(log.contains("protocol=3"), "{log}");
    assert!(
        log.contains(&format!("env CUDA_VISIBLE_DEVICES={mig_uuid}")),
        "{log}"
    );
    // The server is allowed on the instance; A's namespace gets its 4 GiB.
    assert!(
        log.contains(&format!(
            "verb server create carve --allowed-devices={mig_uuid}"
        )) && log.contains(&format!(
            "namespace set {} --server=carve --pinned-memory-limit=4096M",
            ns("u-a", "s-a")
        )),
        "{log}"
    );
    assert_eq!(
        b.compute_mode(ComputeTarget::Mig {
            gpu: 0,
            gi: gis[0].id,
            ci: gis[0].compute_instances[0].id
        })
        .unwrap(),
        ComputeMode::ExclusiveProcess
    );
    // An exclusive MIG device overlapping the shared instance is refused.
    let x = put_claim(
        &api,
        "x",
        "u-x",
        &[("r", "gpu-0-mig-2g20gb-2")],
        serde_json::json!([]),
    );
    let out = driver.prepare(vec![x]).await;
    assert!(
        claim_error(&out, "u-x").contains("occupied by claim default/a")
            || claim_error(&out, "u-x").contains("occupied by claim default/c"),
        "{}",
        claim_error(&out, "u-x")
    );

    let pid = daemon_pid(&node, unit).unwrap();
    driver.unprepare_one("u-a").await.unwrap();
    assert_eq!(
        live(&*b, 0).len(),
        1,
        "the instance stays for the other share"
    );
    assert!(alive(pid));
    driver.unprepare_one("u-c").await.unwrap();
    wait_gone(pid);
    assert!(
        live(&*b, 0).is_empty(),
        "the last share's unprepare destroys the instance"
    );
    assert!(
        !b.mig_mode(0).unwrap().current,
        "MIG mode back off (the plugin enabled it)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_daemon_is_restarted_with_its_limits_and_a_restart_adopts_a_live_one() {
    let node = mps_node(
        vec![GpuEntry::new("h100-80gb", 1, false)],
        ProtocolChoice::Auto,
    );
    let api = api().await;
    make_pod_cgroup(&node, POD_A);
    let a = put_mps(
        &api,
        "a",
        "u-a",
        &[("gpu-0-mps", "s-a", Some(("8Gi", "10")))],
        Some(POD_A),
    );
    let pid = {
        let driver = start(&node, &api).await;
        ok(&driver.prepare(vec![a.clone()]).await, "u-a");
        let pid = daemon_pid(&node, "gpu-0-mps").unwrap();
        // Supervision with a live daemon sends it nothing.
        assert!(driver.supervise_mps().await.is_empty());
        pid
    };
    // The plugin restarts: the running daemon is adopted untouched.
    let before = fake_log(&node, "gpu-0-mps");
    let driver = Driver::new(node.config.clone(), node.backend(), api.client())
        .await
        .unwrap();
    let report = driver.recover().await.unwrap();
    assert_eq!(report.mps_units.len(), 1, "{report:?}");
    assert_eq!(report.mps_units[0].1, carve_mps::Ensure::Adopted);
    assert_eq!(daemon_pid(&node, "gpu-0-mps"), Some(pid));
    assert!(alive(pid));
    assert_eq!(
        fake_log(&node, "gpu-0-mps"),
        before,
        "adoption sends nothing"
    );

    // The daemon dies: supervision restarts it and re-applies the share's namespace.
    nix_kill(pid);
    wait_gone(pid);
    let out = driver.supervise_mps().await;
    assert_eq!(out.len(), 1);
    assert!(
        matches!(out[0].1, Ok(carve_mps::Ensure::Restarted)),
        "{out:?}"
    );
    let new_pid = daemon_pid(&node, "gpu-0-mps").unwrap();
    assert_ne!(new_pid, pid);
    let log = fake_log(&node, "gpu-0-mps");
    let set = format!("verb namespace set {} --server=carve", ns("u-a", "s-a"));
    assert_eq!(log.matches(&set).count(), 2, "{log}");
    driver.unprepare_one("u-a").await.unwrap();
    wait_gone(new_pid);
}

fn nix_kill(pid: u32) {
    let st = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    carve_mps::fake::remove_shm_of(pid);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_mps_allocations_fail_alone_and_leave_no_daemon() {
    let node = mps_node(
        vec![GpuEntry::new("h100-80gb", 2, false)],
        ProtocolChoice::Auto,
    );
    let api = api().await;
    let driver = start(&node, &api).await;
    make_pod_cgroup(&node, POD_A);
    let no_cap = put_mps(
        &api,
        "nocap",
        "u-nocap",
        &[("gpu-0-mps", "s1", None)],
        Some(POD_A),
    );
    let beyond = put_mps(
        &api,
        "beyond",
        "u-beyond",
        &[("gpu-0-mps", "s2", Some(("200Gi", "10")))],
        Some(POD_A),
    );
    let no_share = {
        let obj = serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "noshare", "namespace": "default", "uid": "u-noshare"},
            "spec": {"devices": {"requests": []}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "r", "driver": "gpu.carve.dev", "pool": NODE, "device": "gpu-0-mps",
                 "consumedCapacity": {"memory": "1Gi", "multiprocessors": "2"}}]}}}
        });
        api.store().insert(Resource::ResourceClaims, obj).unwrap();
        ClaimRef {
            namespace: "default".into(),
            name: "noshare".into(),
            uid: "u-noshare".into(),
        }
    };
    let neg_mem = put_mps(
        &api,
        "negmem",
        "u-negmem",
        &[("gpu-0-mps", "s5", Some(("-10Gi", "4")))],
        Some(POD_A),
    );
    let neg_sm = put_mps(
        &api,
        "negsm",
        "u-negsm",
        &[("gpu-0-mps", "s6", Some(("4Gi", "-5")))],
        Some(POD_A),
    );
    let good = put_mps(
        &api,
        "good",
        "u-good",
        &[("gpu-1-mps", "s4", Some(("1Gi", "2")))],
        Some(POD_A),
    );
    let out = driver
        .prepare(vec![no_cap, beyond, no_share, neg_mem, neg_sm, good])
        .await;
    // A negative consumed quantity is the claim's error, naming it and its value.
    let e = claim_error(&out, "u-negmem");
    assert!(
        e.contains("gpu-0-mps") && e.contains("consumedCapacity \"memory\" = -10Gi is negative"),
        "{e}"
    );
    let e = claim_error(&out, "u-negsm");
    assert!(
        e.contains("consumedCapacity \"multiprocessors\" = -5 is negative"),
        "{e}"
    );
    assert!(
        claim_error(&out, "u-nocap").contains("no consumedCapacity"),
        "{}",
        claim_error(&out, "u-nocap")
    );
    let e = claim_error(&out, "u-beyond");
    assert!(e.contains("gpu-0-mps") && e.contains("memory"), "{e}");
    assert!(claim_error(&out, "u-noshare").contains("no shareID"));
    ok(&out, "u-good");
    // No daemon on GPU 0 (every claim for it failed before starting one); GPU
    // 1's daemon serves only the good claim, and its compute mode was set only there.
    assert!(daemon_pid(&node, "gpu-0-mps").is_none());
    let b = node.backend();
    assert_eq!(
        b.compute_mode(ComputeTarget::Gpu(0)).unwrap(),
        ComputeMode::Default
    );
    let log = fake_log(&node, "gpu-1-mps");
    assert!(log.contains(&ns("u-good", "s4")), "{log}");
    assert!(!log.contains(&ns("u-beyond", "s2")), "{log}");
    assert!(
        !log.contains("u-negmem") && !log.contains("u-negsm"),
        "{log}"
    );
    let snap = driver.snapshot().await;
    assert_eq!(snap.claims.keys().collect::<Vec<_>>(), ["u-good"]);

    // The plugin without MPS: a clear per-claim error.
    let mut plain = node.config.clone();
    plain.mps = None;
    plain.checkpoint_path = node.dir.path().join("other-checkpoint.json");
    let d2 = Driver::new(plain, node.backend(), api.client())
        .await
        .unwrap();
    let x = put_mps(
        &api,
        "x",
        "u-x",
        &[("gpu-0-mps", "s5", Some(("1Gi", "2")))],
        Some(POD_A),
    );
    let out = d2.prepare(vec![x]).await;
    assert!(claim_error(&out, "u-x").contains("MPS is not enabled on this node"));
    driver.unprepare_one("u-good").await.unwrap();
}

/// One H100 with MPS v3 and claim `u-a` holding one 8 GiB / 10 SM share of
/// `gpu-0-mps`, prepared: the node, the API server, the driver, the daemon's pid.
async fn one_share_prepared() -> (Node, ApiServer, Driver, u32) {
    let node = mps_node(
        vec![GpuEntry::new("h100-80gb", 1, false)],
        ProtocolChoice::Auto,
    );
    let api = api().await;
    make_pod_cgroup(&node, POD_A);
    let a = put_mps(
        &api,
        "a",
        "u-a",
        &[("gpu-0-mps", "s-a", Some(("8Gi", "10")))],
        Some(POD_A),
    );
    let driver = start(&node, &api).await;
    ok(&driver.prepare(vec![a]).await, "u-a");
    let pid = daemon_pid(&node, "gpu-0-mps").unwrap();
    (node, api, driver, pid)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_drops_a_share_whose_prepare_never_completed() {
    let (node, api, driver, pid) = one_share_prepared().await;
    drop(driver);
    // Simulate a crash after the daemon took the share but before
    // PrepareCompleted: mark the claim PrepareStarted in the checkpoint.
    let path = &node.config.checkpoint_path;
    let mut cp = carve_plugin::Checkpoint::load(path).unwrap().unwrap();
    cp.body.claims.get_mut("u-a").unwrap().state = carve_plugin::ClaimState::PrepareStarted;
    carve_plugin::Checkpoint::store(&cp.body, path, None).unwrap();

    let driver = Driver::new(node.config.clone(), node.backend(), api.client())
        .await
        .unwrap();
    let report = driver.recover().await.unwrap();
    assert_eq!(report.rolled_back, ["u-a"]);
    assert_eq!(report.mps_stopped, ["gpu-0-mps"], "{report:?}");
    assert_eq!(report.compute_mode_restored.len(), 1, "{report:?}");
    wait_gone(pid);
    let log = fake_log(&node, "gpu-0-mps");
    assert!(
        log.contains(&format!(
            "namespace delete {} --server=carve --force",
            ns("u-a", "s-a")
        )),
        "{log}"
    );
    assert_eq!(
        node.backend().compute_mode(ComputeTarget::Gpu(0)).unwrap(),
        ComputeMode::Default
    );
    assert!(
        driver
            .snapshot()
            .await
            .compute_mode_set_by_plugin
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_checkpoint_is_rebuilt_with_the_daemons_shares() {
    let (node, api, driver, pid) = one_share_prepared().await;
    let cdi = claim_spec_path(&node.config.cdi_dir, "u-a");
    let spec_before = CdiSpec::read(&cdi).unwrap();
    drop(driver);
    std::fs::write(&node.config.checkpoint_path, b"{ not json").unwrap();

    let driver = Driver::new(node.config.clone(), node.backend(), api.client())
        .await
        .unwrap();
    let report = driver.recover().await.unwrap();
    assert_eq!(report.adopted, ["u-a"], "{report:?}");
    assert_eq!(report.mps_units[0].1, carve_mps::Ensure::Adopted);
    assert_eq!(daemon_pid(&node, "gpu-0-mps"), Some(pid));
    // The share's container edits (its namespace directory) come back from
    // the daemon's state; no cgroup is bound (615 has no cgroup binding).
    let snap = driver.snapshot().await;
    let share = snap.claims["u-a"].devices[0].kind.mps().unwrap().clone();
    assert_eq!(share.cgroup, None);
    let e = share.edits.unwrap();
    assert!(e.mounts[0].host_path.ends_with(ns("u-a", "s-a")), "{e:?}");
    assert_eq!(CdiSpec::read(&cdi).unwrap(), spec_before);
    driver.unprepare_one("u-a").await.unwrap();
    wait_gone(pid);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_demanding_hard_limits_is_refused_where_only_client_limits_exist() {
    // v2, and v3 too: no MPS device enforces memory hard today.
    for protocol in [ProtocolChoice::V2, ProtocolChoice::V3] {
        demand_hard(protocol).await;
    }
}

async fn demand_hard(protocol: ProtocolChoice) {
    let node = mps_node(vec![GpuEntry::new("h100-80gb", 1, false)], protocol);
    let api = api().await;
    let driver = start(&node, &api).await;
    let claim = |name: &str, uid: &str, need: &str| {
        let obj = serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default", "uid": uid},
            "spec": {"devices": {"requests": []}},
            "status": {"allocation": {"devices": {
                "results": [{"request": "r", "driver": "gpu.carve.dev", "pool": NODE,
                    "device": "gpu-0-mps", "shareID": format!("s-{uid}"),
                    "consumedCapacity": {"memory": "1Gi", "multiprocessors": "2"}}],
                "config": [{"source": "FromClaim", "requests": ["r"], "opaque": {
                    "driver": "gpu.carve.dev",
                    "parameters": {"apiVersion": "gpu.carve.dev/v1alpha1", "kind": "MpsConfig", "memoryLimit": need}}}]
            }}}
        });
        api.store().insert(Resource::ResourceClaims, obj).unwrap();
        ClaimRef {
            namespace: "default".into(),
            name: name.into(),
            uid: uid.into(),
        }
    };
    let hard = claim("hard", "u-hard", "hard");
    let client = claim("client", "u-client", "client");
    let out = driver.prepare(vec![hard, client]).await;
    let e = claim_error(&out, "u-hard");
    assert!(
        e.contains("requires memoryLimit hard") && e.contains("enforces client"),
        "{e}"
    );
    // The reason is the true one: escapable client limits, no partitioning.
    assert!(
        e.contains("can escape it") && e.contains("memory partitioning"),
        "{e}"
    );
    assert!(e.contains("gpu-0-mps"), "{e}");
    ok(&out, "u-client");
    let log = fake_log(&node, "gpu-0-mps");
    assert!(!log.contains("u-hard"), "{log}");
    assert!(!log.contains(&ns("u-hard", "s-u-hard")), "{log}");
    driver.unprepare_one("u-client").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unit_that_cannot_be_restored_does_not_stop_the_plugin() {
    use std::os::unix::fs::PermissionsExt;
    let (node, api, driver, pid) = one_share_prepared().await;
    drop(driver);
    nix_kill(pid);
    wait_gone(pid);
    // The daemon is dead and the control binary now refuses to set it up.
    let script = node.dir.path().join("refusing-mps-control");
    std::fs::write(
        &script,
        format!("#!/bin/sh\nexport FAKE_MPS_REJECT='--allowed-devices='\nexec '{FAKE}' \"$@\"\n"),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cfg = node.config.clone();
    cfg.mps.as_mut().unwrap().config.control_binary = script;
    let d = Driver::new(cfg, node.backend(), api.client())
        .await
        .unwrap();
    let report = d
        .recover()
        .await
        .expect("recovery goes on without the unit");
    assert_eq!(report.mps_failed.len(), 1, "{report:?}");
    assert_eq!(report.mps_failed[0].0, "gpu-0-mps");
    assert_eq!(report.kept, ["u-a"]);
    let out = d.supervise_mps().await;
    assert!(out[0].1.is_err(), "{out:?}");
    drop(d);
    // With a working binary again, supervision brings the unit back.
    let d = Driver::new(node.config.clone(), node.backend(), api.client())
        .await
        .unwrap();
    let report = d.recover().await.unwrap();
    assert!(report.mps_failed.is_empty(), "{report:?}");
    // (The failed attempt already forgot the dead daemon: "started".)
    assert!(
        matches!(
            report.mps_units[0].1,
            carve_mps::Ensure::Started | carve_mps::Ensure::Restarted
        ),
        "{report:?}"
    );
    let new_pid = daemon_pid(&node, "gpu-0-mps").unwrap();
    assert!(alive(new_pid));
    let log = fake_log(&node, "gpu-0-mps");
    assert!(
        log.rsplit("start pid=").next().unwrap().contains(&format!(
            "namespace set {} --server=carve",
            ns("u-a", "s-a")
        )),
        "the share's namespace is applied to the new daemon: {log}"
    );
    d.unprepare_one("u-a").await.unwrap();
    wait_gone(new_pid);
}

/// The CDI spec file of a prepared claim, as text.
fn spec_text(node: &Node, uid: &str) -> String {
    std::fs::read_to_string(claim_spec_path(&node.config.cdi_dir, uid)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v2_a_unit_serves_one_claim_and_a_claim_reaching_two_daemons_is_refused() {
    let node = mps_node(
        vec![GpuEntry::new("h100-80gb", 3, false)],
        ProtocolChoice::V2,
    );
    assert_eq!(
        setup(&node.config).support.protocol,
        carve_mps::Protocol::V2
    );
    let api = api().await;
    let driver = start(&node, &api).await;
    let a = put_mps(
        &api,
        "a",
        "u-a",
        &[("gpu-0-mps", "s-a", Some(("4Gi", "8")))],
        None,
    );
    ok(&driver.prepare(vec![a]).await, "u-a");
    let pid_a = daemon_pid(&node, "gpu-0-mps").unwrap();
    // No workload gets the MPS control client; the other utilities it does.
    let text = spec_text(&node, "u-a");
    assert!(text.contains("nvidia-smi"), "{text}");
    assert!(!text.contains("nvidia-cuda-mps-control"), "{text}");
    let log_a = fake_log(&node, "gpu-0-mps");

    // A second claim on the v2 unit: refused, naming the holder; A untouched.
    let b = put_mps(
        &api,
        "b",
        "u-b",
        &[("gpu-0-mps", "s-b", Some(("4Gi", "8")))],
        None,
    );
    let out = driver.prepare(vec![b]).await;
    let e = claim_error(&out, "u-b");
    assert!(
        e.contains("gpu-0-mps") && e.contains("protocol v2") && e.contains("default/a"),
        "{e}"
    );
    assert_eq!(fake_log(&node, "gpu-0-mps"), log_a);
    assert!(!claim_spec_path(&node.config.cdi_dir, "u-b").exists());

    // Shares on two units in one claim, and a share beside a whole GPU:
    // refused before anything is made, naming the devices.
    let two = put_mps(
        &api,
        "two",
        "u-two",
        &[
            ("gpu-1-mps", "s-1", Some(("4Gi", "8"))),
            ("gpu-2-mps", "s-2", Some(("4Gi", "8"))),
        ],
        None,
    );
    let mixed = put_results(
        &api,
        "mixed",
        "u-mixed",
        vec![
            serde_json::json!({"request": "r", "driver": "gpu.carve.dev", "pool": NODE,
                "device": "gpu-1-mps", "shareID": "s-3",
                "consumedCapacity": {"memory": "4Gi", "multiprocessors": "8"}}),
            serde_json::json!({"request": "w", "driver": "gpu.carve.dev", "pool": NODE,
                "device": "gpu-2"}),
        ],
        &[],
    );
    let out = driver.prepare(vec![two, mixed]).await;
    let e = claim_error(&out, "u-two");
    assert!(
        e.contains("gpu-1-mps") && e.contains("gpu-2-mps") && e.contains("CUDA_MPS_PIPE_DIRECTORY"),
        "{e}"
    );
    let e = claim_error(&out, "u-mixed");
    assert!(
        e.contains("gpu-1-mps") && e.contains("gpu-2") && e.contains("one MPS daemon"),
        "{e}"
    );
    for unit in ["gpu-1-mps", "gpu-2-mps"] {
        assert!(
            daemon_pid(&node, unit).is_none(),
            "{unit}: a daemon started"
        );
        assert!(fake_log(&node, unit).is_empty(), "{unit}");
    }
    for uid in ["u-two", "u-mixed"] {
        assert!(!claim_spec_path(&node.config.cdi_dir, uid).exists());
    }
    let snap = driver.snapshot().await;
    assert!(!snap.claims.contains_key("u-two") && !snap.claims.contains_key("u-mixed"));
    // The node is fine for claims of one share each.
    let c = put_mps(
        &api,
        "c",
        "u-c",
        &[("gpu-1-mps", "s-c", Some(("4Gi", "8")))],
        None,
    );
    ok(&driver.prepare(vec![c]).await, "u-c");
    assert!(alive(pid_a));
    driver.unprepare_one("u-c").await.unwrap();
    driver.unprepare_one("u-a").await.unwrap();
    wait_gone(pid_a);
}
