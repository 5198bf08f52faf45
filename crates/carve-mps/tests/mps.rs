//! `MpsControl` against the fake `nvidia-cuda-mps-control` (real child
//! processes, real sockets and files) and a fake cgroup tree in a temp dir.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use carve_model::PhysicalGpu;
use carve_model::sharing::{ComputeLimit, MemoryLimit, MpsDeviceSpec, SharingError, translate};
use carve_model::slices::simulated_node;
use carve_mps::{
    ClientSpec, Ensure, MpsConfig, MpsControl, MpsError, MpsTarget, PID_FILE, Protocol,
    ProtocolChoice, Support, detect,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

const FAKE: &str = env!("CARGO_BIN_EXE_carve-fake-mps-control");
const GPU_UUID: &str = "GPU-11111111-2222-3333-4444-555555555555";
const MIG_UUID: &str = "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";
const PCI: &str = "00000000:3B:00.0";

/// A temp dir with a state root, a fake cgroup tree with two pod cgroups, and
/// a control binary (the fake, or a wrapper script setting its environment).
/// Kills every fake daemon serving a pipe dir under it when dropped.
struct Node {
    tmp: tempfile::TempDir,
    cfg: MpsConfig,
}

impl Node {
    fn new(fake_env: &[(&str, &str)]) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let cg = tmp.path().join("cgroup");
        for pod in ["pod-a", "pod-b", "pod-c"] {
            std::fs::create_dir_all(cg.join("kubepods").join(pod)).unwrap();
        }
        std::fs::write(
            cg.join("cgroup.controllers"),
            "cpuset cpu io memory dmem pids\n",
        )
        .unwrap();
        std::fs::write(
            cg.join("dmem.capacity"),
            "nvidia/0000:3b:00.0/vidmem 85899345920\n",
        )
        .unwrap();
        let binary = if fake_env.is_empty() {
            PathBuf::from(FAKE)
        } else {
            let script = tmp.path().join("nvidia-cuda-mps-control");
            let mut s = String::from("#!/bin/sh\n");
            for (k, v) in fake_env {
                s.push_str(&format!("export {k}='{v}'\n"));
            }
            s.push_str(&format!("exec '{FAKE}' \"$@\"\n"));
            std::fs::write(&script, s).unwrap();
            std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
            script
        };
        let mut cfg = MpsConfig::new(tmp.path().join("state"));
        cfg.control_binary = binary;
        cfg.cgroup_root = cg;
        Self { tmp, cfg }
    }

    fn v2_only() -> Self {
        Self::new(&[("FAKE_MPS_MAX_PROTOCOL", "2")])
    }

    fn cgroup(&self, pod: &str) -> PathBuf {
        self.cfg.cgroup_root.join("kubepods").join(pod)
    }

    /// Pids of fake daemons whose pipe directory lies under this node.
    fn daemons(&self) -> Vec<u32> {
        let needle = self.tmp.path().to_string_lossy().into_owned();
        let mut out = vec![];
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let env = std::fs::read(e.path().join("environ")).unwrap_or_default();
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            let env = String::from_utf8_lossy(&env);
            let cmd = String::from_utf8_lossy(&cmd);
            if env.contains(&format!("CUDA_MPS_PIPE_DIRECTORY={needle}"))
                && cmd.contains("carve-fake-mps-control")
                && cmd.contains("-f")
            {
                out.push(pid);
            }
        }
        out
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        for pid in self.daemons() {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    }
}

fn h100() -> PhysicalGpu {
    let mut g = simulated_node("h100-80gb", 1).unwrap().remove(0);
    g.uuid = GPU_UUID.into();
    g.pci_bus_id = Some(PCI.into());
    g
}

fn whole_target() -> MpsTarget {
    MpsTarget {
        unit: "gpu-0-mps".into(),
        uuid: GPU_UUID.into(),
        pci_bus_id: Some(PCI.into()),
        mig: false,
    }
}

fn cc(mem: &str, sm: &str) -> BTreeMap<String, Quantity> {
    BTreeMap::from([
        ("memory".to_string(), Quantity(mem.into())),
        ("multiprocessors".to_string(), Quantity(sm.into())),
    ])
}

fn pipe(c: &MpsControl) -> PathBuf {
    c.dir().join("pipe")
}

/// The fake's request log: `cmd …` (v2) and `verb …` (v3) lines, and the
/// environment lines, of the daemon that started last.
fn requests(pipe: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(pipe.join("fake-mps-control.log")).unwrap_or_default();
    let last_start = last_start(&text);
    text.lines()
        .skip(last_start)
        .filter(|l| l.starts_with("cmd ") || l.starts_with("verb "))
        .map(str::to_string)
        .collect()
}

fn last_start(text: &str) -> usize {
    let lines: Vec<&str> = text.lines().collect();
    lines
        .iter()
        .rposition(|l| l.starts_with("start "))
        .unwrap_or(0)
}

fn started_env(pipe: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(pipe.join("fake-mps-control.log")).unwrap();
    let last_start = last_start(&text);
    text.lines()
        .skip(last_start)
        .filter_map(|l| l.strip_prefix("env "))
        .map(str::to_string)
        .collect()
}

fn starts(pipe: &Path) -> usize {
    std::fs::read_to_string(pipe.join("fake-mps-control.log"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("start "))
        .count()
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        let state = s[s.rfind(')').unwrap() + 1..]
            .split_whitespace()
            .next()
            .unwrap()
            .to_string();
        state != "Z" && state != "X"
    })
}

fn wait_dead(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(pid) {
        assert!(Instant::now() < deadline, "pid {pid} still alive");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Send v2 stdin text to the daemon of `pipe` through the fake client.
fn send(pipe: &Path, text: &str) -> std::process::Output {
    use std::io::Write;
    let mut c = Command::new(FAKE)
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    c.wait_with_output().unwrap()
}

fn verb(pipe: &Path, args: &[&str]) -> String {
    let o = Command::new(FAKE)
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .args(args)
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

#[test]
fn v3_several_claims_on_one_gpu_get_namespaces_bound_to_their_cgroups() {
    let node = Node::new(&[]);
    let support = detect(&node.cfg).unwrap();
    assert_eq!(support.protocol, Protocol::V3);
    let caps = support.capabilities();
    assert_eq!(caps.memory_limit, MemoryLimit::Hard);
    assert_eq!(caps.compute_limit, ComputeLimit::Percentage);
    assert!(node.daemons().is_empty(), "probe daemon left behind");

    let gpu = h100();
    let dev = MpsDeviceSpec::whole(&gpu, caps).unwrap();
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    let a = c
        .prepare(
            &dev,
            &cc("2Gi", "8"),
            "claim-a",
            "s1",
            Some("kubepods/pod-a".into()),
        )
        .unwrap();
    let b = c
        .prepare(
            &dev,
            &cc("3000Mi", "17"),
            "claim-b",
            "s1",
            Some("/kubepods/pod-b".into()),
        )
        .unwrap();
    let (la, lb) = (
        translate(&cc("2Gi", "8"), &dev).unwrap(),
        translate(&cc("3000Mi", "17"), &dev).unwrap(),
    );
    assert_eq!(lb.memory_limit_mib, 3072);
    let p = pipe(&c);
    let cg = |pod: &str| node.cgroup(pod).display().to_string();
    assert_eq!(
        requests(&p),
        [
            format!("verb server create --name=carve --allowed-devices={GPU_UUID}"),
            format!(
                "verb namespace create --server=carve --name=claim-a.s1 --cgroup={} --pinned-memory-limit={GPU_UUID}=2048M --active-thread-percentage={}",
                cg("pod-a"),
                la.active_thread_percentage
            ),
            format!(
                "verb namespace create --server=carve --name=claim-b.s1 --cgroup={} --pinned-memory-limit={GPU_UUID}=3072M --active-thread-percentage={}",
                cg("pod-b"),
                lb.active_thread_percentage
            ),
        ]
    );
    let env = started_env(&p);
    assert!(
        env.contains(&format!("CUDA_VISIBLE_DEVICES={GPU_UUID}")),
        "{env:?}"
    );
    assert!(env.contains(&format!("CUDA_MPS_PIPE_DIRECTORY={}", p.display())));
    assert!(env.contains(&format!(
        "CUDA_MPS_LOG_DIRECTORY={}",
        c.dir().join("log").display()
    )));
    for d in [c.dir().to_path_buf(), p.clone(), c.dir().join("log")] {
        assert_eq!(mode(&d), 0o700, "{}", d.display());
    }
    // Kernel cap through dmem on top of the namespace limit.
    assert_eq!(
        std::fs::read_to_string(node.cgroup("pod-a").join("dmem.max")).unwrap(),
        format!("nvidia/0000:3b:00.0/vidmem {}\n", 2048u64 << 20)
    );
    // Hard limits: no client variables; distinct CDI devices per share.
    assert_eq!(a.env, ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]);
    assert_eq!(a.mounts[0].host_path, p);
    assert_ne!(a.cdi_name, b.cdi_name);
    let pid = c.identity().unwrap().pid;
    assert_eq!(node.daemons(), [pid]);

    // Unprepare one: its namespace goes, the daemon stays for the other.
    assert!(c.remove_client("claim-a", "s1").unwrap());
    assert!(!c.remove_client("claim-a", "s1").unwrap());
    assert!(!c.stop_if_idle().unwrap());
    assert_eq!(
        requests(&p).last().unwrap(),
        "verb namespace delete --server=carve --name=claim-a.s1"
    );
    assert_eq!(
        std::fs::read_to_string(node.cgroup("pod-a").join("dmem.max")).unwrap(),
        "nvidia/0000:3b:00.0/vidmem max\n"
    );
    assert_eq!(verb(&p, &["namespace", "list"]).trim(), "claim-b.s1");

    // Last claim: quit, process gone, pid file gone.
    assert!(c.remove_client("claim-b", "s1").unwrap());
    assert!(c.stop_if_idle().unwrap());
    assert!(requests(&p).ends_with(&["verb -q".to_string()]));
    wait_dead(pid);
    assert!(!p.join(PID_FILE).exists());
    assert!(c.identity().is_none());
    assert!(node.daemons().is_empty());
    assert_eq!(c.ensure_running().unwrap(), Ensure::Idle);
}

#[test]
fn v2_claims_get_daemon_ceilings_and_client_variables() {
    let node = Node::v2_only();
    let support = detect(&node.cfg).unwrap();
    assert_eq!(support.protocol, Protocol::V2);
    let caps = support.capabilities();
    assert_eq!(caps.memory_limit, MemoryLimit::Client);
    let dev = MpsDeviceSpec::whole(&h100(), caps).unwrap();
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    let a = c
        .prepare(&dev, &cc("2Gi", "8"), "claim-a", "s1", None)
        .unwrap();
    let la = translate(&cc("2Gi", "8"), &dev).unwrap();
    let lb = translate(&cc("8Gi", "32"), &dev).unwrap();
    assert!(a.env.contains(&format!(
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={GPU_UUID}=2048M"
    )));
    assert!(a.env.contains(&format!(
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={}",
        la.active_thread_percentage
    )));
    c.prepare(&dev, &cc("8Gi", "32"), "claim-b", "s1", None)
        .unwrap();
    c.remove_client("claim-b", "s1").unwrap();
    let p = pipe(&c);
    let pct = |l: &carve_model::sharing::MpsLimits| {
        format!(
            "cmd set_default_active_thread_percentage {}",
            l.active_thread_percentage
        )
    };
    let mem = |mib: u64| format!("cmd set_default_device_pinned_mem_limit {GPU_UUID} {mib}M");
    assert_eq!(
        requests(&p),
        [
            mem(2048),
            pct(&la),
            mem(8192),
            pct(&lb),
            mem(2048),
            pct(&la)
        ]
    );
    let pid = c.identity().unwrap().pid;
    c.remove_client("claim-a", "s1").unwrap();
    assert!(c.stop_if_idle().unwrap());
    assert_eq!(requests(&p).last().unwrap(), "cmd quit");
    wait_dead(pid);
}

#[test]
fn claims_on_a_mig_instance_share_its_daemon_with_the_instance_totals() {
    let node = Node::new(&[]);
    let support = detect(&node.cfg).unwrap();
    let gpu = h100();
    let dev = MpsDeviceSpec::mig(&gpu, "1g.10gb", 3, support.capabilities()).unwrap();
    let target = MpsTarget::of(&dev, MIG_UUID, gpu.pci_bus_id.clone());
    assert!(target.mig);
    let mut c = MpsControl::open(&node.cfg, &support, target).unwrap();
    assert!(c.dir().ends_with("gpu-0-mig-1g10gb-3-mps"));
    c.prepare(
        &dev,
        &cc("2Gi", "4"),
        "claim-a",
        "s1",
        Some("kubepods/pod-a".into()),
    )
    .unwrap();
    c.prepare(
        &dev,
        &cc("4Gi", "8"),
        "claim-b",
        "s2",
        Some("kubepods/pod-b".into()),
    )
    .unwrap();
    let sms = gpu.spec.profile("1g.10gb").unwrap().multiprocessors;
    let p = pipe(&c);
    let r = requests(&p);
    assert_eq!(
        r[0],
        format!("verb server create --name=carve --allowed-devices={MIG_UUID}")
    );
    assert!(
        r[2].contains(&format!("--pinned-memory-limit={MIG_UUID}=4096M")),
        "{r:?}"
    );
    assert!(r[2].ends_with(&format!(
        "--active-thread-percentage={}",
        (800u32).div_ceil(sms)
    )));
    assert!(started_env(&p).contains(&format!("CUDA_VISIBLE_DEVICES={MIG_UUID}")));
    // dmem partitions no MIG instance.
    assert!(!node.cgroup("pod-a").join("dmem.max").exists());
    // Beyond the instance: refused, the other claims untouched.
    let e = c
        .prepare(
            &dev,
            &cc("16Gi", "4"),
            "claim-c",
            "s1",
            Some("kubepods/pod-c".into()),
        )
        .unwrap_err();
    assert!(
        matches!(&e, MpsError::Translate { source, .. } if matches!(**source, SharingError::BeyondDevice { .. })),
        "{e}"
    );
    assert_eq!(requests(&p).len(), 3);
    assert_eq!(c.clients().count(), 2);
    for (cl, s) in [("claim-a", "s1"), ("claim-b", "s2")] {
        c.remove_client(cl, s).unwrap();
    }
    assert!(c.is_idle());
    assert!(c.stop_if_idle().unwrap());
    assert!(node.daemons().is_empty());
}

#[test]
fn a_crashed_daemon_is_restarted_with_every_claims_limits() {
    let node = Node::new(&[]);
    let support = detect(&node.cfg).unwrap();
    let dev = MpsDeviceSpec::whole(&h100(), support.capabilities()).unwrap();
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    c.prepare(
        &dev,
        &cc("2Gi", "8"),
        "claim-a",
        "s1",
        Some("kubepods/pod-a".into()),
    )
    .unwrap();
    c.prepare(
        &dev,
        &cc("4Gi", "8"),
        "claim-b",
        "s1",
        Some("kubepods/pod-b".into()),
    )
    .unwrap();
    let p = pipe(&c);
    let before = requests(&p);
    let old = c.identity().unwrap().pid;
    assert_eq!(c.ensure_running().unwrap(), Ensure::Running);

    send(&p, "crash\n");
    wait_dead(old);
    assert_eq!(c.ensure_running().unwrap(), Ensure::Restarted);
    let new = c.identity().unwrap().pid;
    assert_ne!(new, old);
    assert!(alive(new));
    assert_eq!(starts(&p), 2);
    assert_eq!(requests(&p), before);
    assert_eq!(
        verb(&p, &["namespace", "list"]).trim(),
        "claim-a.s1\nclaim-b.s1"
    );
    c.remove_client("claim-a", "s1").unwrap();
    c.remove_client("claim-b", "s1").unwrap();
    c.stop_if_idle().unwrap();
    wait_dead(new);
}

#[test]
fn v2_crash_mid_command_keeps_the_other_claim_and_restarts_it_alone() {
    // The fake dies when it sees claim B's share percentage.
    let node = Node::new(&[
        ("FAKE_MPS_MAX_PROTOCOL", "2"),
        (
            "FAKE_MPS_CRASH_ON",
            "set_default_active_thread_percentage 50",
        ),
    ]);
    let support = detect(&node.cfg).unwrap();
    let gpu = h100();
    let dev = MpsDeviceSpec::whole(&gpu, support.capabilities()).unwrap();
    let half = (gpu.spec.multiprocessors / 2).to_string();
    let lb = translate(&cc("4Gi", &half), &dev).unwrap();
    assert_eq!(lb.active_thread_percentage, 50);
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    c.prepare(&dev, &cc("2Gi", "8"), "claim-a", "s1", None)
        .unwrap();
    let old = c.identity().unwrap().pid;
    let e = c
        .prepare(&dev, &cc("4Gi", &half), "claim-b", "s1", None)
        .unwrap_err();
    assert!(matches!(e, MpsError::Command { .. }), "{e}");
    assert_eq!(c.clients().count(), 1);
    wait_dead(old);
    assert_eq!(c.ensure_running().unwrap(), Ensure::Restarted);
    let p = pipe(&c);
    assert_eq!(
        requests(&p),
        [
            format!("cmd set_default_device_pinned_mem_limit {GPU_UUID} 2048M"),
            "cmd set_default_active_thread_percentage 7".to_string(),
        ]
    );
    c.remove_client("claim-a", "s1").unwrap();
    assert!(c.stop_if_idle().unwrap());
    assert!(node.daemons().is_empty());
}

#[test]
fn a_restarted_plugin_adopts_the_running_daemon_without_touching_it() {
    let node = Node::new(&[]);
    let support = detect(&node.cfg).unwrap();
    let dev = MpsDeviceSpec::whole(&h100(), support.capabilities()).unwrap();
    let (pid, p, before) = {
        let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
        c.prepare(
            &dev,
            &cc("2Gi", "8"),
            "claim-a",
            "s1",
            Some("kubepods/pod-a".into()),
        )
        .unwrap();
        (c.identity().unwrap().pid, pipe(&c), requests(&pipe(&c)))
    };
    // The plugin is gone; the daemon keeps serving.
    assert!(alive(pid));
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    assert_eq!(c.identity().unwrap().pid, pid);
    assert_eq!(c.ensure_running().unwrap(), Ensure::Adopted);
    assert_eq!(c.ensure_running().unwrap(), Ensure::Running);
    assert_eq!(requests(&p), before);
    assert_eq!(starts(&p), 1);
    // The same share again (kubelet retries prepare): no change.
    c.prepare(
        &dev,
        &cc("2Gi", "8"),
        "claim-a",
        "s1",
        Some("kubepods/pod-a".into()),
    )
    .unwrap();
    assert_eq!(requests(&p), before);
    // ... but not with other limits.
    assert!(matches!(
        c.prepare(
            &dev,
            &cc("4Gi", "8"),
            "claim-a",
            "s1",
            Some("kubepods/pod-a".into())
        ),
        Err(MpsError::ShareConflict { .. })
    ));
    c.prepare(
        &dev,
        &cc("2Gi", "8"),
        "claim-b",
        "s1",
        Some("kubepods/pod-b".into()),
    )
    .unwrap();
    assert_eq!(requests(&p).len(), before.len() + 1);
    c.remove_client("claim-a", "s1").unwrap();
    c.remove_client("claim-b", "s1").unwrap();
    assert!(c.stop_if_idle().unwrap());
    wait_dead(pid);
}

#[test]
fn bad_allocations_start_nothing_and_leave_other_claims_alone() {
    let node = Node::new(&[]);
    let support = detect(&node.cfg).unwrap();
    let dev = MpsDeviceSpec::whole(&h100(), support.capabilities()).unwrap();
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    let p = pipe(&c);
    let e = c
        .prepare(
            &dev,
            &BTreeMap::new(),
            "claim-a",
            "s1",
            Some("kubepods/pod-a".into()),
        )
        .unwrap_err();
    assert!(
        matches!(&e, MpsError::Translate { claim, source, .. } if claim == "claim-a" && matches!(**source, SharingError::MissingCapacity { .. })),
        "{e}"
    );
    assert!(e.to_string().contains("claim-a"));
    let e = c
        .prepare(&dev, &cc("2Gi", "8"), "claim-a", "s1", None)
        .unwrap_err();
    assert!(matches!(e, MpsError::MissingCgroup { .. }), "{e}");
    let e = c
        .prepare(
            &dev,
            &cc("2Gi", "8"),
            "claim-a",
            "s1",
            Some("kubepods/pod-x".into()),
        )
        .unwrap_err();
    assert!(matches!(&e, MpsError::CgroupNotFound { path, .. } if path.ends_with("pod-x")));
    let e = c
        .prepare(
            &dev,
            &cc("2Gi", "8"),
            "../x",
            "s1",
            Some("kubepods/pod-a".into()),
        )
        .unwrap_err();
    assert!(matches!(e, MpsError::BadId { what: "claim", .. }));
    assert!(c.identity().is_none());
    assert!(!p.join(PID_FILE).exists());
    assert_eq!(starts(&p), 0);
    assert!(node.daemons().is_empty());

    // With a claim running, a bad one changes nothing for it.
    c.prepare(
        &dev,
        &cc("2Gi", "8"),
        "claim-a",
        "s1",
        Some("kubepods/pod-a".into()),
    )
    .unwrap();
    let pid = c.identity().unwrap().pid;
    let before = requests(&p);
    let e = c
        .prepare(
            &dev,
            &cc("100Gi", "8"),
            "claim-b",
            "s1",
            Some("kubepods/pod-b".into()),
        )
        .unwrap_err();
    assert!(e.to_string().contains("claim-b"), "{e}");
    assert_eq!(requests(&p), before);
    assert_eq!(c.identity().unwrap().pid, pid);
    assert_eq!(verb(&p, &["namespace", "list"]).trim(), "claim-a.s1");
    c.remove_client("claim-a", "s1").unwrap();
    assert!(c.stop_if_idle().unwrap());
    wait_dead(pid);
}

#[test]
fn a_first_claim_the_daemon_rejects_leaves_no_daemon() {
    let node = Node::new(&[("FAKE_MPS_CRASH_ON", "--name=claim-a.s1")]);
    let support = detect(&node.cfg).unwrap();
    let dev = MpsDeviceSpec::whole(&h100(), support.capabilities()).unwrap();
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    let e = c
        .prepare(
            &dev,
            &cc("2Gi", "8"),
            "claim-a",
            "s1",
            Some("kubepods/pod-a".into()),
        )
        .unwrap_err();
    assert!(matches!(e, MpsError::Command { .. }), "{e}");
    assert!(c.identity().is_none());
    assert!(c.is_idle());
    assert!(node.daemons().is_empty());
    // A state file written on the way says so too.
    let reopened = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    assert!(reopened.identity().is_none() && reopened.is_idle());

    // A daemon that stays up but refuses the first claim is quit.
    let node = Node::new(&[("FAKE_MPS_REJECT", "--name=claim-a.s1")]);
    let support = detect(&node.cfg).unwrap();
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    let e = c
        .prepare(
            &dev,
            &cc("2Gi", "8"),
            "claim-a",
            "s1",
            Some("kubepods/pod-a".into()),
        )
        .unwrap_err();
    assert!(e.to_string().contains("rejected on request"), "{e}");
    assert!(requests(&pipe(&c)).ends_with(&["verb -q".to_string()]));
    assert!(c.identity().is_none());
    assert!(node.daemons().is_empty());
    // Claim B is accepted by a fresh daemon afterwards.
    c.prepare(
        &dev,
        &cc("2Gi", "8"),
        "claim-b",
        "s1",
        Some("kubepods/pod-b".into()),
    )
    .unwrap();
    assert_eq!(node.daemons().len(), 1);
    c.remove_client("claim-b", "s1").unwrap();
    assert!(c.stop_if_idle().unwrap());
    assert!(node.daemons().is_empty());
}

#[test]
fn mps_not_installed_and_unsupported_strategies_are_named() {
    let node = Node::new(&[]);
    let mut cfg = node.cfg.clone();
    cfg.control_binary = node.tmp.path().join("no-such-mps-control");
    let e = detect(&cfg).unwrap_err();
    assert!(matches!(&e, MpsError::NotInstalled { path, .. } if *path == cfg.control_binary));
    assert!(e.to_string().contains("no-such-mps-control"));

    let v2 = Node::v2_only();
    let mut cfg = v2.cfg.clone();
    cfg.protocol = ProtocolChoice::V3;
    let e = detect(&cfg).unwrap_err();
    assert!(matches!(e, MpsError::StrategyUnsupported { .. }), "{e}");
    assert!(v2.daemons().is_empty());

    // v3 driver, but no cgroup v2: v3 cannot be required, Auto falls back to v2.
    let node = Node::new(&[]);
    std::fs::remove_file(node.cfg.cgroup_root.join("cgroup.controllers")).unwrap();
    let mut cfg = node.cfg.clone();
    cfg.protocol = ProtocolChoice::V3;
    assert!(matches!(
        detect(&cfg),
        Err(MpsError::StrategyUnsupported { .. })
    ));
    let s: Support = detect(&node.cfg).unwrap();
    assert_eq!(s.protocol, Protocol::V2);
    assert_eq!(s.capabilities().memory_limit, MemoryLimit::Client);
    assert!(node.daemons().is_empty());

    // An explicit client spec with a bad share id is refused before anything runs.
    let node = Node::new(&[]);
    let support = detect(&node.cfg).unwrap();
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    let l = translate(
        &cc("1Gi", "2"),
        &MpsDeviceSpec::whole(&h100(), support.capabilities()).unwrap(),
    )
    .unwrap();
    let e = c
        .add_client(ClientSpec {
            claim_uid: "claim-a".into(),
            share_id: "a/b".into(),
            limits: l,
            cgroup: Some("kubepods/pod-a".into()),
        })
        .unwrap_err();
    assert!(matches!(e, MpsError::BadId { what: "share", .. }));
    assert!(node.daemons().is_empty());
}
