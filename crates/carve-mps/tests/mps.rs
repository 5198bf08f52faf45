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
        // The daemon runs as root, as the plugin does (the fake's rule 7).
        let binary = {
            let script = tmp.path().join("nvidia-cuda-mps-control");
            let mut s = String::from("#!/bin/sh\nexport FAKE_MPS_AS_UID=0\n");
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
            sigkill(pid);
            carve_mps::fake::remove_shm_of(pid);
        }
        // A test that failed midway may leave a unit's tmpfs mounted.
        if let Ok(rd) = std::fs::read_dir(self.cfg.mps_root()) {
            for e in rd.flatten() {
                let shm = e.path().join("shm");
                if carve_mps::shm::mounted_fs(&shm).is_some() {
                    let _ = Command::new("umount").arg("-l").arg(&shm).status();
                }
            }
        }
    }
}

/// SIGKILL through `kill(2)`: these tests also run with no `kill` on `PATH`.
fn sigkill(pid: u32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
        nix::sys::signal::Signal::SIGKILL,
    );
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

/// The namespaces of server `carve`, without `default`.
fn namespaces(pipe: &Path) -> Vec<String> {
    verb(
        pipe,
        &[
            "namespace",
            "list",
            "--server=carve",
            "--format=csv,noheader",
        ],
    )
    .lines()
    .filter_map(|l| l.split(',').next())
    .filter(|n| !n.is_empty() && *n != "default")
    .map(str::to_string)
    .collect()
}

fn ns(claim: &str, share: &str) -> String {
    carve_mps::control::v3::namespace_name(claim, share)
}

/// A CUDA client started with the share's environment, its pipe directory
/// reached at the mount's host path (the container path is the same path),
/// its `/dev/shm` the host path of the share's `/dev/shm` mount if it has
/// one: where it landed (`server=… namespace=… pinned=… atp=…`).
fn client_of(e: &carve_mps::ShareEdits, uid: u32) -> String {
    let o = client_cmd(e, uid, None).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

/// The client of [`client_of`]; `dev_shm` overrides its `/dev/shm`.
fn client_cmd(e: &carve_mps::ShareEdits, uid: u32, dev_shm: Option<&Path>) -> Command {
    let mut c = Command::new(FAKE);
    c.env_remove("CUDA_MPS_PIPE_DIRECTORY")
        .env_remove("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
        .env_remove("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        .env_remove("CUDA_VISIBLE_DEVICES");
    for kv in &e.env {
        let (k, v) = kv.split_once('=').unwrap();
        let v = e
            .mounts
            .iter()
            .find(|m| m.container_path == v)
            .map_or_else(|| v.to_string(), |m| m.host_path.display().to_string());
        c.env(k, v);
    }
    let shm = dev_shm.map(Path::to_path_buf).or_else(|| {
        e.mounts
            .iter()
            .find(|m| m.container_path == "/dev/shm")
            .map(|m| m.host_path.clone())
    });
    c.args([carve_mps::fake::CUDA_CLIENT, &format!("--uid={uid}")]);
    if let Some(d) = shm {
        c.arg(format!("--dev-shm={}", d.display()));
    }
    c
}

/// Whether this process may mount (root; the tmpfs tests need it).
fn root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|r| r.split_whitespace().nth(1))
            == Some("0")
    })
}

#[test]
fn the_daemon_and_the_pods_share_the_units_tmpfs_as_dev_shm() {
    if !root() {
        eprintln!("skipped: mounting the unit's tmpfs needs root");
        return;
    }
    let mut node = Node::new(&[]);
    // The fake binary is a launcher too, as the carve binary is in the plugin.
    node.cfg.shm_launcher = Some(PathBuf::from(FAKE));
    let support = detect(&node.cfg).unwrap();
    let dev = MpsDeviceSpec::whole(&h100(), support.capabilities()).unwrap();
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    let a = c
        .prepare(&dev, &cc("2Gi", "8"), "claim-a", "s1", None)
        .unwrap();
    let b = c
        .prepare(&dev, &cc("2Gi", "8"), "claim-b", "s1", None)
        .unwrap();
    let shm = c.dir().join("shm");
    assert_eq!(
        carve_mps::shm::mounted_fs(&shm).as_deref(),
        Some("tmpfs"),
        "the unit's tmpfs is mounted"
    );
    for e in [&a, &b] {
        let m = e.mounts.iter().find(|m| m.container_path == "/dev/shm");
        let m = m.expect("a /dev/shm mount");
        assert_eq!(m.host_path, shm);
        assert_eq!(m.options, ["rw", "nosuid", "nodev", "bind"]);
    }
    // Through the share's mounts (pipe directory and /dev/shm), the client
    // reaches its namespace: the server's shared memory is in the tmpfs.
    assert!(
        client_of(&a, 1000)
            .starts_with(&format!("server=carve namespace={} ", ns("claim-a", "s1")))
    );
    // A client whose /dev/shm is the plugin's own, not the unit's tmpfs,
    // does not find it: the daemon really had the tmpfs as its /dev/shm.
    let plugin_shm = client_cmd(&a, 1000, Some(Path::new("/dev/shm")))
        .output()
        .unwrap();
    assert!(!plugin_shm.status.success());
    assert!(
        String::from_utf8_lossy(&plugin_shm.stderr).contains("is not in /dev/shm"),
        "{}",
        String::from_utf8_lossy(&plugin_shm.stderr)
    );
    // The plugin's own mount namespace is untouched by the daemon's.
    assert_ne!(carve_mps::shm::mounted_fs(Path::new("/dev/shm")), None);
    let in_tmpfs = std::fs::read_dir(&shm).unwrap().count();
    assert!(in_tmpfs >= 1, "the server's cuda.shm file is in the tmpfs");

    // One share goes: the tmpfs stays for the other.
    assert!(c.remove_client("claim-a", "s1").unwrap());
    assert!(!c.stop_if_idle().unwrap());
    assert_eq!(carve_mps::shm::mounted_fs(&shm).as_deref(), Some("tmpfs"));
    // The last goes: the daemon stops, the tmpfs is unmounted and removed.
    assert!(c.remove_client("claim-b", "s1").unwrap());
    assert!(c.stop_if_idle().unwrap());
    assert!(node.daemons().is_empty());
    assert_eq!(carve_mps::shm::mounted_fs(&shm), None);
    assert!(!shm.exists());
}

#[test]
fn a_daemon_that_fails_to_start_leaves_no_tmpfs() {
    if !root() {
        eprintln!("skipped: mounting the unit's tmpfs needs root");
        return;
    }
    let mut node = Node::new(&[("FAKE_MPS_SERVER_STATUS", "Starting")]);
    node.cfg.shm_launcher = Some(PathBuf::from(FAKE));
    let support = detect(&node.cfg).unwrap();
    let dev = MpsDeviceSpec::whole(&h100(), support.capabilities()).unwrap();
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    let err = c
        .prepare(&dev, &cc("2Gi", "8"), "claim-a", "s1", None)
        .unwrap_err();
    assert!(matches!(err, MpsError::ServerNotReady { .. }), "{err}");
    assert!(node.daemons().is_empty());
    let shm = c.dir().join("shm");
    assert_eq!(carve_mps::shm::mounted_fs(&shm), None);
    assert!(!shm.exists());
    // A launcher that cannot exec the control binary: the same.
    let mut bad = Node::new(&[]);
    bad.cfg.shm_launcher = Some(PathBuf::from(FAKE));
    let support = detect(&bad.cfg).unwrap();
    bad.cfg.control_binary = bad.tmp.path().join("missing-control");
    let mut c = MpsControl::open(&bad.cfg, &support, whole_target()).unwrap();
    let err = c
        .prepare(&dev, &cc("2Gi", "8"), "claim-a", "s1", None)
        .unwrap_err();
    assert!(err.to_string().contains("gpu-0-mps"), "{err}");
    assert!(!c.dir().join("shm").exists());
}

/// Real cgroup hierarchies for the daemon-cgroup tests, as a v1 host lays
/// them out below its cgroup root: `<root>/unified` (the cgroup v2 tree) and
/// `<root>/named` (a v1 hierarchy of no controller, `name=carve_t<pid>`).
/// Dropped: every cgroup made below `carve-test-<pid>` is emptied (its
/// processes killed) and removed, and both are unmounted.
struct Hierarchies {
    root: tempfile::TempDir,
    mounts: Vec<PathBuf>,
}

impl Hierarchies {
    fn mount() -> Self {
        let root = tempfile::tempdir().unwrap();
        let mut mounts = Vec::new();
        let named = format!("none,name=carve_t{}", std::process::id());
        // Sorted, as the plugin lists them.
        for (dir, args) in [
            ("named", vec!["-t", "cgroup", "-o", &named, "cgroup"]),
            ("unified", vec!["-t", "cgroup2", "none"]),
        ] {
            let m = root.path().join(dir);
            std::fs::create_dir(&m).unwrap();
            let st = Command::new("mount").args(&args).arg(&m).status().unwrap();
            assert!(st.success(), "mount {args:?} {}", m.display());
            mounts.push(m);
        }
        Self { root, mounts }
    }

    /// The daemon cgroup directory the tests configure (relative).
    fn dir() -> PathBuf {
        PathBuf::from(format!("carve-test-{}", std::process::id()))
    }

    fn unit(&self, unit: &str) -> Vec<PathBuf> {
        self.mounts
            .iter()
            .map(|m| m.join(Self::dir()).join(unit))
            .collect()
    }
}

fn remove_tree(d: &Path) {
    if let Ok(rd) = std::fs::read_dir(d) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_tree(&e.path());
            }
        }
    }
    for _ in 0..200 {
        let procs = std::fs::read_to_string(d.join("cgroup.procs")).unwrap_or_default();
        for pid in procs.split_whitespace() {
            sigkill(pid.parse().unwrap());
        }
        if std::fs::remove_dir(d).is_ok() || !d.exists() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl Drop for Hierarchies {
    fn drop(&mut self) {
        for m in &self.mounts {
            remove_tree(&m.join(Self::dir()));
            let _ = Command::new("umount").arg(m).status();
        }
        let _ = &self.root;
    }
}

/// The cgroup of `pid` in each hierarchy, as `/proc/<pid>/cgroup` lists them.
fn cgroups_of(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default()
}

/// Session id of `pid` (`/proc/<pid>/stat` field 6).
fn session_of(pid: u32) -> u32 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &s[s.rfind(')').unwrap() + 1..];
    rest.split_whitespace().nth(3).unwrap().parse().unwrap()
}

#[test]
fn each_daemon_runs_in_a_cgroup_and_session_of_its_own_removed_when_it_stops() {
    if !root() {
        eprintln!("skipped: cgroup mounts and moves need root");
        return;
    }
    let h = Hierarchies::mount();
    let mut node = Node::new(&[]);
    node.cfg.shm_launcher = Some(PathBuf::from(FAKE));
    node.cfg.cgroup_root = h.root.path().to_path_buf();
    node.cfg.daemon_cgroup = Some(Hierarchies::dir());
    let support = detect(&node.cfg).unwrap();
    let dev = MpsDeviceSpec::whole(&h100(), support.capabilities()).unwrap();
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    let a = c
        .prepare(&dev, &cc("2Gi", "8"), "claim-a", "s1", None)
        .unwrap();
    let id = c.identity().unwrap().clone();
    let dirs = h.unit("gpu-0-mps");
    assert_eq!(id.cgroups, dirs, "recorded in the daemon's identity");
    // The kernel puts the daemon (and the servers it forks) there, in both
    // hierarchies, and in a session of its own.
    let rel = format!("/{}/gpu-0-mps", Hierarchies::dir().display());
    let cg = cgroups_of(id.pid);
    assert!(cg.lines().any(|l| l == format!("0::{rel}")), "{cg}");
    assert!(
        cg.lines()
            .any(|l| l.ends_with(&format!(":name=carve_t{}:{rel}", std::process::id()))),
        "{cg}"
    );
    for d in &dirs {
        let procs = std::fs::read_to_string(d.join("cgroup.procs")).unwrap();
        assert!(
            procs.split_whitespace().any(|p| p == id.pid.to_string()),
            "{}: {procs}",
            d.display()
        );
    }
    // The session the launcher made (its pid, which became `-d`, the
    // daemon's parent), not this process's.
    assert_ne!(session_of(id.pid), session_of(std::process::id()));
    // It serves: a client through the share's mounts reaches its namespace.
    assert!(
        client_of(&a, 1000)
            .starts_with(&format!("server=carve namespace={} ", ns("claim-a", "s1")))
    );
    // The last share goes: the daemon stops and its cgroups are removed
    // (their parent, shared by all units, stays).
    assert!(c.remove_client("claim-a", "s1").unwrap());
    assert!(c.stop_if_idle().unwrap());
    assert!(node.daemons().is_empty());
    for d in &dirs {
        assert!(!d.exists(), "{} left", d.display());
        assert!(d.parent().unwrap().is_dir());
    }
}

#[test]
fn a_daemon_that_fails_to_start_leaves_no_cgroup_and_a_missing_tree_is_named() {
    if !root() {
        eprintln!("skipped: cgroup mounts and moves need root");
        return;
    }
    let h = Hierarchies::mount();
    let mut node = Node::new(&[("FAKE_MPS_SERVER_STATUS", "Starting")]);
    node.cfg.shm_launcher = Some(PathBuf::from(FAKE));
    node.cfg.cgroup_root = h.root.path().to_path_buf();
    node.cfg.daemon_cgroup = Some(Hierarchies::dir());
    let support = detect(&node.cfg).unwrap();
    let dev = MpsDeviceSpec::whole(&h100(), support.capabilities()).unwrap();
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    let err = c
        .prepare(&dev, &cc("2Gi", "8"), "claim-a", "s1", None)
        .unwrap_err();
    assert!(matches!(err, MpsError::ServerNotReady { .. }), "{err}");
    assert!(node.daemons().is_empty());
    for d in h.unit("gpu-0-mps") {
        assert!(!d.exists(), "{} left", d.display());
    }
    assert!(!c.dir().join("shm").exists());

    // A cgroup root without any hierarchy: an error naming the unit and the
    // root; no daemon, no tmpfs.
    let mut bare = Node::new(&[]);
    bare.cfg.shm_launcher = Some(PathBuf::from(FAKE));
    let empty = bare.tmp.path().join("no-cgroups");
    std::fs::create_dir(&empty).unwrap();
    bare.cfg.cgroup_root.clone_from(&empty);
    bare.cfg.daemon_cgroup = Some(Hierarchies::dir());
    let support = detect(&bare.cfg).unwrap();
    let mut c = MpsControl::open(&bare.cfg, &support, whole_target()).unwrap();
    let err = c
        .prepare(&dev, &cc("2Gi", "8"), "claim-a", "s1", None)
        .unwrap_err();
    let t = err.to_string();
    assert!(matches!(err, MpsError::DaemonCgroup { .. }), "{t}");
    assert!(
        t.contains("gpu-0-mps") && t.contains(&empty.display().to_string()),
        "{t}"
    );
    assert!(bare.daemons().is_empty());
    assert!(!c.dir().join("shm").exists());

    // A cgroup the launcher cannot join (here: a plain directory standing in
    // for a hierarchy, whose `cgroup.procs` is a file): the start fails
    // naming the unit and the file; no daemon, no tmpfs.
    let mut fakeh = Node::new(&[]);
    fakeh.cfg.shm_launcher = Some(PathBuf::from(FAKE));
    let fr = fakeh.tmp.path().join("fake-root");
    std::fs::create_dir_all(&fr).unwrap();
    std::fs::write(fr.join("cgroup.procs"), "").unwrap();
    // Not writable as a directory entry: `cgroup.procs` of the unit is a directory.
    std::fs::create_dir_all(fr.join("d/gpu-0-mps/cgroup.procs")).unwrap();
    fakeh.cfg.cgroup_root.clone_from(&fr);
    fakeh.cfg.daemon_cgroup = Some(PathBuf::from("d"));
    // The unit's directory stays (it is not empty); do not wait 10 s for it.
    fakeh.cfg.timeout = Duration::from_secs(2);
    let support = detect(&fakeh.cfg).unwrap();
    let mut c = MpsControl::open(&fakeh.cfg, &support, whole_target()).unwrap();
    let err = c
        .prepare(&dev, &cc("2Gi", "8"), "claim-a", "s1", None)
        .unwrap_err();
    let t = err.to_string();
    assert!(
        t.contains("gpu-0-mps") && t.contains("d/gpu-0-mps/cgroup.procs"),
        "{t}"
    );
    assert!(fakeh.daemons().is_empty());
    assert!(!c.dir().join("shm").exists());
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

#[test]
fn v3_several_claims_on_one_gpu_get_a_namespace_each_that_their_pods_connect_to() {
    let node = Node::new(&[]);
    let support = detect(&node.cfg).unwrap();
    assert_eq!(support.protocol, Protocol::V3);
    let caps = support.capabilities();
    // The namespace's pinned limit can be escaped by the tenant [DYN]: client.
    assert_eq!(caps.memory_limit, MemoryLimit::Client);
    assert_eq!(caps.compute_limit, ComputeLimit::Percentage);
    assert!(node.daemons().is_empty(), "probe daemon left behind");

    let gpu = h100();
    let dev = MpsDeviceSpec::whole(&gpu, caps).unwrap();
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    let a = c
        .prepare(&dev, &cc("2Gi", "8"), "claim-a", "s1", None)
        .unwrap();
    let b = c
        .prepare(&dev, &cc("3000Mi", "17"), "claim-b", "s1", None)
        .unwrap();
    let (la, lb) = (
        translate(&cc("2Gi", "8"), &dev).unwrap(),
        translate(&cc("3000Mi", "17"), &dev).unwrap(),
    );
    assert_eq!(lb.memory_limit_mib, 3072);
    let p = pipe(&c);
    let (na, nb) = (ns("claim-a", "s1"), ns("claim-b", "s1"));
    assert!(
        na.len() <= 64
            && na
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    );
    let add = |n: &str, l: &carve_model::sharing::MpsLimits| {
        vec![
            "verb server get carve status".to_string(),
            format!("verb namespace create {n} --server=carve"),
            format!(
                "verb namespace set {n} --server=carve --pinned-memory-limit={}M --active-thread-percentage={}",
                l.memory_limit_mib, l.active_thread_percentage
            ),
            format!("verb namespace get {n} carve pipe-directory"),
        ]
    };
    let mut want = vec![
        format!("verb server create carve --allowed-devices={GPU_UUID}"),
        "verb server get carve status".to_string(),
    ];
    want.extend(add(&na, &la));
    want.extend(add(&nb, &lb));
    assert_eq!(requests(&p), want);
    let log = std::fs::read_to_string(p.join("fake-mps-control.log")).unwrap();
    assert!(log.contains("multiuser=true"), "{log}");
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
    // No dmem file is written by carve.
    assert!(!node.cgroup("pod-a").join("dmem.max").exists());
    // Each share mounts only its namespace's directory, at the same path.
    let ns_dir = p.join("carve").join(&na);
    assert_eq!(
        a.env,
        [format!("CUDA_MPS_PIPE_DIRECTORY={}", ns_dir.display())]
    );
    assert_eq!(a.mounts.len(), 1);
    assert_eq!(a.mounts[0].host_path, ns_dir);
    assert_ne!(a.mounts[0].host_path, p);
    assert_ne!(a.cdi_name, b.cdi_name);
    // A pod's client through that directory lands in its namespace, with
    // its limits, whatever its UID; not in a uid_ server.
    assert_eq!(
        client_of(&a, 1000),
        format!(
            "server=carve namespace={na} pinned=2048M atp={}",
            la.active_thread_percentage
        )
    );
    assert_eq!(
        client_of(&b, 2000),
        format!(
            "server=carve namespace={nb} pinned=3072M atp={}",
            lb.active_thread_percentage
        )
    );
    // (Had carve mounted the daemon's whole directory, the main socket would
    // route it by UID to an unlimited server.)
    let whole = carve_mps::ShareEdits {
        env: vec![format!("CUDA_MPS_PIPE_DIRECTORY={}", p.display())],
        mounts: vec![],
        ..a.clone()
    };
    assert_eq!(
        client_of(&whole, 1000),
        "server=uid_1000 namespace=default pinned=none atp=none"
    );
    let pid = c.identity().unwrap().pid;
    assert_eq!(node.daemons(), [pid]);

    // Unprepare one: its namespace goes, the daemon stays for the other.
    assert!(c.remove_client("claim-a", "s1").unwrap());
    assert!(!c.remove_client("claim-a", "s1").unwrap());
    assert!(!c.stop_if_idle().unwrap());
    assert_eq!(
        requests(&p).last().unwrap(),
        &format!("verb namespace delete {na} --server=carve --force")
    );
    assert!(!ns_dir.exists());
    assert_eq!(namespaces(&p), vec![nb]);

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
fn v2_shares_of_one_claim_get_client_variables_under_ceilings_set_on_the_running_server() {
    let node = Node::v2_only();
    let support = detect(&node.cfg).unwrap();
    assert_eq!(support.protocol, Protocol::V2);
    let caps = support.capabilities();
    assert_eq!(caps.memory_limit, MemoryLimit::Client);
    assert_eq!(caps.compute_limit, ComputeLimit::Client);
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
    // A's pod starts the server: it takes the ceiling of now (A's).
    let p = pipe(&c);
    assert_eq!(
        client_of(&a, 0),
        format!(
            "server=v2_40001 namespace=none pinned=2048M atp={}",
            la.active_thread_percentage
        )
    );
    // Share s2 of the same claim (a v2 unit serves one claim, its pods may
    // share it) is larger: set_default_* alone would leave the running server at
    // A's ceiling [V2]; carve sets it on the running server too.
    let b = c
        .prepare(&dev, &cc("8Gi", "32"), "claim-a", "s2", None)
        .unwrap();
    assert_eq!(
        client_of(&b, 0),
        format!(
            "server=v2_40001 namespace=none pinned=8192M atp={}",
            lb.active_thread_percentage
        )
    );
    c.remove_client("claim-a", "s2").unwrap();
    let pct = |l: &carve_model::sharing::MpsLimits| {
        format!(
            "cmd set_default_active_thread_percentage {}",
            l.active_thread_percentage
        )
    };
    let mem = |mib: u64| format!("cmd set_default_device_pinned_mem_limit {GPU_UUID} {mib}M");
    let list = "cmd get_server_list".to_string();
    let on = |mib: u64, l: &carve_model::sharing::MpsLimits| {
        [
            format!("cmd set_device_pinned_mem_limit 40001 {GPU_UUID} {mib}M"),
            format!(
                "cmd set_active_thread_percentage 40001 {}",
                l.active_thread_percentage
            ),
        ]
    };
    let mut want = vec![mem(2048), pct(&la), list.clone()];
    want.extend([mem(8192), pct(&lb), list.clone()]);
    want.extend(on(8192, &lb));
    want.extend([mem(2048), pct(&la), list.clone()]);
    want.extend(on(2048, &la));
    assert_eq!(requests(&p), want);
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
        format!("verb server create carve --allowed-devices={MIG_UUID}")
    );
    let nb = ns("claim-b", "s2");
    assert!(
        r.contains(&format!(
            "verb namespace set {nb} --server=carve --pinned-memory-limit=4096M --active-thread-percentage={}",
            (800u32).div_ceil(sms)
        )),
        "{r:?}"
    );
    assert!(started_env(&p).contains(&format!("CUDA_VISIBLE_DEVICES={MIG_UUID}")));
    // Memory partitioning does not support MIG: never hard there.
    assert_eq!(c.capabilities().memory_limit, MemoryLimit::Client);
    assert_eq!(dev.caps.memory_limit, MemoryLimit::Client);
    assert!(!node.cgroup("pod-a").join("dmem.max").exists());
    let before = requests(&p);
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
    assert_eq!(requests(&p), before);
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
    // The new daemon gets the server (checked Ready) and both namespaces
    // with their limits again.
    let again = requests(&p);
    assert_eq!(again[..2], before[..2]);
    for (cl, l) in [("claim-a", "2048M"), ("claim-b", "4096M")] {
        let n = ns(cl, "s1");
        assert!(
            again.iter().any(|r| r.starts_with(&format!(
                "verb namespace set {n} --server=carve --pinned-memory-limit={l}"
            ))),
            "{again:?}"
        );
    }
    let mut want = vec![ns("claim-a", "s1"), ns("claim-b", "s1")];
    want.sort();
    assert_eq!(namespaces(&p), want);
    let (e, _) = c.share("claim-a", "s1").unwrap();
    assert!(client_of(&e, 1000).contains(&format!("namespace={}", ns("claim-a", "s1"))));
    c.remove_client("claim-a", "s1").unwrap();
    c.remove_client("claim-b", "s1").unwrap();
    c.stop_if_idle().unwrap();
    wait_dead(new);
}

#[test]
fn v2_crash_mid_command_keeps_the_other_share_and_restarts_it_alone() {
    // The fake dies when it sees share s2's percentage.
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
        .prepare(&dev, &cc("4Gi", &half), "claim-a", "s2", None)
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
            "cmd get_server_list".to_string(),
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
    // Claim B: the server checked, its namespace created, set, located.
    assert_eq!(requests(&p).len(), before.len() + 4);
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
    assert_eq!(namespaces(&p), [ns("claim-a", "s1")]);
    c.remove_client("claim-a", "s1").unwrap();
    assert!(c.stop_if_idle().unwrap());
    wait_dead(pid);
}

#[test]
fn a_first_claim_the_daemon_rejects_leaves_no_daemon() {
    let na = ns("claim-a", "s1");
    let node = Node::new(&[("FAKE_MPS_CRASH_ON", &na)]);
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

    // A daemon that stays up but refuses the first claim's limits: the
    // namespace it made is deleted, then the daemon is quit.
    let node = Node::new(&[("FAKE_MPS_REJECT", "--pinned-memory-limit=2048M")]);
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
    assert!(e.to_string().contains("gpu-0-mps"), "{e}");
    assert!(
        requests(&pipe(&c)).ends_with(&[
            format!("verb namespace delete {na} --server=carve --force"),
            "verb -q".to_string()
        ]),
        "{:?}",
        requests(&pipe(&c))
    );
    assert!(c.identity().is_none());
    assert!(node.daemons().is_empty());
    // Claim B is accepted by a fresh daemon afterwards.
    c.prepare(
        &dev,
        &cc("3Gi", "8"),
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

    // v3 needs no cgroup v2 (carve binds no namespace to a cgroup).
    let node = Node::new(&[]);
    std::fs::remove_file(node.cfg.cgroup_root.join("cgroup.controllers")).unwrap();
    let mut cfg = node.cfg.clone();
    cfg.protocol = ProtocolChoice::V3;
    let s: Support = detect(&cfg).unwrap();
    assert_eq!(s.protocol, Protocol::V3);
    assert!(!s.cgroup_v2);
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

#[test]
fn a_server_that_never_becomes_ready_fails_the_claim_by_unit_and_leaves_no_daemon() {
    // [DYN]: `server create` succeeds, the server exits at once.
    let node = Node::new(&[("FAKE_MPS_SERVER_EXITS", "carve")]);
    let support = detect(&node.cfg).unwrap();
    let dev = MpsDeviceSpec::whole(&h100(), support.capabilities()).unwrap();
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    let e = c
        .prepare(&dev, &cc("2Gi", "8"), "claim-a", "s1", None)
        .unwrap_err();
    assert!(
        matches!(&e, MpsError::ServerNotReady { unit, server, .. } if unit == "gpu-0-mps" && server == "carve"),
        "{e}"
    );
    assert!(e.to_string().contains("no CUDA-capable device"), "{e}");
    assert!(c.identity().is_none() && c.is_idle());
    assert!(node.daemons().is_empty());

    // A server stuck in another status is no better.
    let node = Node::new(&[("FAKE_MPS_SERVER_STATUS", "Starting")]);
    let support = detect(&node.cfg).unwrap();
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    let e = c
        .prepare(&dev, &cc("2Gi", "8"), "claim-a", "s1", None)
        .unwrap_err();
    assert!(e.to_string().contains("status: Starting"), "{e}");
    assert!(node.daemons().is_empty());
}

#[test]
fn a_daemon_refusing_or_dying_on_a_second_share_leaves_the_first_untouched() {
    // Refused: B's limits. B's namespace is removed again, A keeps its own.
    let node = Node::new(&[("FAKE_MPS_REJECT", "--pinned-memory-limit=4096M")]);
    let support = detect(&node.cfg).unwrap();
    let dev = MpsDeviceSpec::whole(&h100(), support.capabilities()).unwrap();
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    let a = c
        .prepare(&dev, &cc("2Gi", "8"), "claim-a", "s1", None)
        .unwrap();
    let pid = c.identity().unwrap().pid;
    let p = pipe(&c);
    let e = c
        .prepare(&dev, &cc("4Gi", "8"), "claim-b", "s1", None)
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("gpu-0-mps") && msg.contains("rejected on request"),
        "{msg}"
    );
    let nb = ns("claim-b", "s1");
    assert_eq!(
        requests(&p).last().unwrap(),
        &format!("verb namespace delete {nb} --server=carve --force")
    );
    assert_eq!(namespaces(&p), [ns("claim-a", "s1")]);
    assert!(!p.join("carve").join(&nb).exists());
    assert_eq!(c.clients().count(), 1);
    assert_eq!(c.identity().unwrap().pid, pid);
    assert!(client_of(&a, 1000).contains("pinned=2048M"));
    c.remove_client("claim-a", "s1").unwrap();
    assert!(c.stop_if_idle().unwrap());
    wait_dead(pid);

    // Dying: on B's namespace. A is kept and comes back alone.
    let nb = ns("claim-b", "s1");
    let node = Node::new(&[("FAKE_MPS_CRASH_ON", &nb)]);
    let support = detect(&node.cfg).unwrap();
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    c.prepare(&dev, &cc("2Gi", "8"), "claim-a", "s1", None)
        .unwrap();
    let old = c.identity().unwrap().pid;
    let e = c
        .prepare(&dev, &cc("4Gi", "8"), "claim-b", "s1", None)
        .unwrap_err();
    assert!(matches!(e, MpsError::Command { .. }), "{e}");
    assert!(e.to_string().contains("gpu-0-mps"), "{e}");
    wait_dead(old);
    assert_eq!(c.clients().count(), 1);
    assert_eq!(c.ensure_running().unwrap(), Ensure::Restarted);
    let p = pipe(&c);
    assert_eq!(namespaces(&p), [ns("claim-a", "s1")]);
    let (a, _) = c.share("claim-a", "s1").unwrap();
    assert!(client_of(&a, 1000).contains("pinned=2048M"));
    c.remove_client("claim-a", "s1").unwrap();
    assert!(c.stop_if_idle().unwrap());
    assert!(node.daemons().is_empty());
}

/// The same on this machine's own cgroup tree, where it is cgroup v1 with
/// its real controllers (cpuset among them, which refuses a process in a
/// cgroup without CPUs): the daemon runs in its unit's cgroup in every
/// hierarchy and serves; the cgroups go with it. Root only; skipped where
/// `/sys/fs/cgroup` is not a writable v1 tree with cpuset.
#[test]
fn on_the_hosts_cgroup_v1_tree_the_daemon_joins_every_hierarchy_cpuset_included() {
    let host = Path::new("/sys/fs/cgroup");
    let dir = PathBuf::from(format!("carve-test-mps-{}", std::process::id()));
    if !root()
        || !host.join("cpuset/cpuset.cpus").is_file()
        || std::fs::create_dir(host.join("cpuset").join(&dir)).is_err()
    {
        eprintln!(
            "skipped: needs root and a writable cgroup v1 tree with cpuset at /sys/fs/cgroup"
        );
        return;
    }
    let _ = std::fs::remove_dir(host.join("cpuset").join(&dir));
    let mut node = Node::new(&[]);
    node.cfg.shm_launcher = Some(PathBuf::from(FAKE));
    node.cfg.cgroup_root = host.to_path_buf();
    node.cfg.daemon_cgroup = Some(dir.clone());
    let support = detect(&node.cfg).unwrap();
    let dev = MpsDeviceSpec::whole(&h100(), support.capabilities()).unwrap();
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    let prepared = c.prepare(&dev, &cc("2Gi", "8"), "claim-a", "s1", None);
    let seen = prepared.as_ref().ok().map(|a| {
        let id = c.identity().unwrap().clone();
        let joined: Vec<(PathBuf, bool)> = id
            .cgroups
            .iter()
            .map(|d| {
                let procs = std::fs::read_to_string(d.join("cgroup.procs")).unwrap_or_default();
                let has = procs.split_whitespace().any(|p| p == id.pid.to_string());
                (d.clone(), has)
            })
            .collect();
        (joined, client_of(a, 1000))
    });
    let stopped = prepared.is_ok()
        && c.remove_client("claim-a", "s1").unwrap_or(false)
        && c.stop_if_idle().unwrap_or(false);
    // Clean up the shared parents in every hierarchy, whatever happened.
    if let Ok(rd) = std::fs::read_dir(host) {
        for e in rd.flatten() {
            let p = e.path().join(&dir);
            let _ = std::fs::remove_dir(p.join("gpu-0-mps"));
            let _ = std::fs::remove_dir(&p);
        }
    }
    prepared.unwrap();
    let (joined, client) = seen.unwrap();
    assert!(joined.len() > 1, "one cgroup per v1 hierarchy: {joined:?}");
    assert!(
        joined
            .iter()
            .any(|(d, _)| d.starts_with(host.join("cpuset"))),
        "{joined:?}"
    );
    for (d, has) in &joined {
        assert!(has, "daemon not in {}", d.display());
        assert!(!d.exists(), "{} left", d.display());
    }
    assert!(
        client.starts_with(&format!("server=carve namespace={} ", ns("claim-a", "s1"))),
        "{client}"
    );
    assert!(stopped, "the daemon stops with its last share");
}

/// The second GPU of a two-GPU node, its MPS device and target.
fn second_unit(caps: carve_model::sharing::MpsCapabilities) -> (MpsDeviceSpec, MpsTarget) {
    let mut g = simulated_node("h100-80gb", 2).unwrap().remove(1);
    g.uuid = "GPU-99999999-2222-3333-4444-555555555555".into();
    let dev = MpsDeviceSpec::whole(&g, caps).unwrap();
    let t = MpsTarget {
        unit: dev.name.clone(),
        uuid: g.uuid.clone(),
        pci_bus_id: None,
        mig: false,
    };
    (dev, t)
}

/// The host directory a share's container reaches as its
/// `CUDA_MPS_PIPE_DIRECTORY`.
fn container_pipe(e: &carve_mps::ShareEdits) -> PathBuf {
    let v = e
        .env
        .iter()
        .find_map(|kv| kv.strip_prefix("CUDA_MPS_PIPE_DIRECTORY="))
        .unwrap();
    e.mounts
        .iter()
        .find(|m| m.container_path == v)
        .map(|m| m.host_path.clone())
        .unwrap()
}

#[test]
fn v2_a_claims_container_reaches_only_its_own_daemon_and_a_second_claim_is_refused() {
    let node = Node::v2_only();
    let support = detect(&node.cfg).unwrap();
    assert_eq!(support.protocol, Protocol::V2);
    let caps = support.capabilities();
    // What the node publishes for a v2 unit: one claim (carve-model).
    assert!(caps.one_claim_per_unit());
    let dev_a = MpsDeviceSpec::whole(&h100(), caps).unwrap();
    let published = dev_a.device(&h100(), vec![]).unwrap();
    assert_eq!(
        published.attributes.as_ref().unwrap()["mpsDaemon"]
            .string
            .as_deref(),
        Some("claim")
    );
    let (dev_b, target_b) = second_unit(caps);
    let mut ca = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    let mut cb = MpsControl::open(&node.cfg, &support, target_b).unwrap();
    let a = ca
        .prepare(&dev_a, &cc("2Gi", "8"), "claim-a", "s1", None)
        .unwrap();
    let b = cb
        .prepare(&dev_b, &cc("4Gi", "16"), "claim-b", "s1", None)
        .unwrap();

    // A second claim on A's unit is refused before anything reaches the
    // daemon, naming the unit, both claims and why.
    let before_a = requests(&pipe(&ca));
    let e = ca
        .prepare(&dev_a, &cc("2Gi", "8"), "claim-b", "s2", None)
        .unwrap_err();
    assert!(matches!(e, MpsError::V2UnitTaken { .. }), "{e}");
    let msg = e.to_string();
    for w in ["gpu-0-mps", "claim-b", "claim-a", "v2", "quit"] {
        assert!(msg.contains(w), "{w}: {msg}");
    }
    assert_eq!(requests(&pipe(&ca)), before_a);
    assert_eq!(ca.clients().count(), 1);
    // The same claim's other share is fine (its pods share the daemon).
    ca.prepare(&dev_a, &cc("2Gi", "8"), "claim-a", "s2", None)
        .unwrap();

    // B's pod runs: its server and its limits.
    let b_seen = client_of(&b, 0);
    assert!(b_seen.contains("pinned=4096M"), "{b_seen}");
    let b_pipe = pipe(&cb);
    let b_server = String::from_utf8(send(&b_pipe, "get_server_list\n").stdout).unwrap();
    let b_server = b_server.trim().to_string();
    assert!(!b_server.is_empty());
    let b_log = requests(&b_pipe);
    let b_pid = cb.identity().unwrap().pid;

    // What A's container was given is A's unit directory only.
    let a_dir = container_pipe(&a);
    assert!(a_dir.starts_with(ca.dir()), "{}", a_dir.display());
    for m in &a.mounts {
        assert!(!m.host_path.starts_with(cb.dir()), "{m:?}");
    }
    // A tenant of claim A drives the daemon through it: limit commands
    // naming B's server and `quit`.
    send(
        &a_dir,
        &format!(
            "set_active_thread_percentage {b_server} 100\nset_device_pinned_mem_limit {b_server} GPU-99999999-2222-3333-4444-555555555555 81920M\n"
        ),
    );
    let a_pid = ca.identity().unwrap().pid;
    assert!(send(&a_dir, "quit\n").status.success());
    // B's daemon still runs, got none of it, and B's clients keep B's limits.
    assert!(alive(b_pid));
    assert_eq!(requests(&b_pipe), b_log);
    assert_eq!(client_of(&b, 0), b_seen);
    cb.remove_client("claim-b", "s1").unwrap();
    assert!(cb.stop_if_idle().unwrap());
    wait_dead(b_pid);
    // A's daemon took A's own `quit`: the supervisor restarts it for A.
    wait_dead(a_pid);
    assert_eq!(ca.ensure_running().unwrap(), Ensure::Restarted);
    ca.remove_client("claim-a", "s1").unwrap();
    ca.remove_client("claim-a", "s2").unwrap();
    assert!(ca.stop_if_idle().unwrap());
    assert!(node.daemons().is_empty());
}

#[test]
fn v3_a_claims_namespace_directory_reaches_no_control_command() {
    let node = Node::new(&[]);
    let support = detect(&node.cfg).unwrap();
    assert_eq!(support.protocol, Protocol::V3);
    assert!(!support.capabilities().one_claim_per_unit());
    let dev = MpsDeviceSpec::whole(&h100(), support.capabilities()).unwrap();
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    let a = c
        .prepare(&dev, &cc("2Gi", "8"), "claim-a", "s1", None)
        .unwrap();
    let b = c
        .prepare(&dev, &cc("4Gi", "16"), "claim-b", "s1", None)
        .unwrap();
    let b_seen = client_of(&b, 1000);
    let pid = c.identity().unwrap().pid;
    let a_dir = container_pipe(&a);
    assert_ne!(a_dir, pipe(&c));
    assert!(!a_dir.join(PID_FILE).exists());
    let before = requests(&pipe(&c));
    // v2 commands and v3 verbs through A's namespace socket are refused.
    let nb = ns("claim-b", "s1");
    let out = send(&a_dir, "quit\n");
    assert!(!out.status.success());
    for args in [
        vec!["-q"],
        vec![
            "namespace",
            "set",
            nb.as_str(),
            "--server=carve",
            "--active-thread-percentage=100",
        ],
        vec![
            "namespace",
            "delete",
            nb.as_str(),
            "--server=carve",
            "--force",
        ],
    ] {
        let o = Command::new(FAKE)
            .env("CUDA_MPS_PIPE_DIRECTORY", &a_dir)
            .args(&args)
            .output()
            .unwrap();
        assert!(!o.status.success(), "{args:?} went through");
    }
    assert!(alive(pid));
    assert_eq!(requests(&pipe(&c)), before);
    assert_eq!(client_of(&b, 1000), b_seen);
    assert_eq!(namespaces(&pipe(&c)).len(), 2);
    c.remove_client("claim-a", "s1").unwrap();
    c.remove_client("claim-b", "s1").unwrap();
    assert!(c.stop_if_idle().unwrap());
    wait_dead(pid);
}

/// The plugin's image (distroless) has no `kill`: the supervisor must stop
/// and restart daemons without one. Runs [`supervise_without_kill_on_path`]
/// in a child test process whose `PATH` is an empty directory.
#[test]
fn without_kill_on_path_a_daemon_ignoring_quit_is_still_stopped_and_restarted() {
    let empty = tempfile::tempdir().unwrap();
    let o = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "supervise_without_kill_on_path",
            "--ignored",
            "--test-threads=1",
        ])
        .env("PATH", empty.path())
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("1 passed"),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
#[ignore = "run by without_kill_on_path_a_daemon_ignoring_quit_is_still_stopped_and_restarted, with PATH naming an empty directory"]
fn supervise_without_kill_on_path() {
    for d in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
        assert!(!d.join("kill").exists(), "kill on PATH in {}", d.display());
    }
    // The daemon refuses `quit`: stopping it takes a signal.
    let node = Node::new(&[("FAKE_MPS_MAX_PROTOCOL", "2"), ("FAKE_MPS_REJECT", "quit")]);
    let support = detect(&node.cfg).unwrap();
    assert!(node.daemons().is_empty(), "probe daemon left behind");
    let dev = MpsDeviceSpec::whole(&h100(), support.capabilities()).unwrap();
    let mut c = MpsControl::open(&node.cfg, &support, whole_target()).unwrap();
    c.prepare(&dev, &cc("2Gi", "8"), "claim-a", "s1", None)
        .unwrap();
    let old = c.identity().unwrap().pid;
    send(&pipe(&c), "crash\n");
    wait_dead(old);
    assert_eq!(c.ensure_running().unwrap(), Ensure::Restarted);
    let new = c.identity().unwrap().pid;
    assert!(alive(new));
    c.remove_client("claim-a", "s1").unwrap();
    assert!(c.stop_if_idle().unwrap());
    wait_dead(new);
    assert!(node.daemons().is_empty());
}
