//! MPS daemons outlive the plugin's container: the real `carve
//! kubelet-plugin` binary on the NVML simulator, with the fake
//! `nvidia-cuda-mps-control` (the `carve` binary under its name), runs as a
//! container runtime runs it: in a cgroup (v2) and a process group of its
//! own. A claim gets an MPS share; then the plugin is ended as a runtime
//! ends a container, by `cgroup.kill` of its whole cgroup and a SIGKILL to
//! its whole process group. With `--mps-daemon-cgroup` the unit's daemon
//! lives on (same pid), its share still reaches its namespace through the
//! share's mounted pipe directory, a new plugin (another process, another
//! cgroup) adopts it, a second claim on the unit attaches to the same
//! daemon, and the last unprepare stops it and removes its cgroup. The
//! negative control, `--mps-daemon-cgroup none`, shows that the same kill
//! takes the daemon with it.
//!
//! Needs root (a cgroup v2 mount, moving processes between cgroups, the
//! unit's tmpfs); skipped otherwise, saying so on stderr.

use std::io::Write as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use carve_apiserver::{ApiServer, Options, Resource};
use carve_e2e::{SimNode, carve_binary, wait_for};
use carve_plugin::testing::FakeKubelet;
use carve_plugin::{CdiSpec, ClaimRef, claim_spec_path};
use nvidia_ml_sim::GpuEntry;

const NODE: &str = "node-a";
const UNIT: &str = "gpu-0-mps";

fn report(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

fn root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|r| r.split_whitespace().nth(1))
            == Some("0")
    })
}

/// A cgroup v2 mount of the test's own; every cgroup made under it below
/// `carve-e2e-<pid>-<tag>` is emptied and removed, and it is unmounted, on drop.
struct CgroupV2 {
    mnt: tempfile::TempDir,
    base: String,
}

impl CgroupV2 {
    fn mount(tag: &str) -> Self {
        let mnt = tempfile::tempdir().unwrap();
        let st = Command::new("mount")
            .args(["-t", "cgroup2", "none"])
            .arg(mnt.path())
            .status()
            .unwrap();
        assert!(st.success(), "mount -t cgroup2 {}", mnt.path().display());
        let base = format!("carve-e2e-{}-{tag}", std::process::id());
        std::fs::create_dir(mnt.path().join(&base)).unwrap();
        Self { mnt, base }
    }

    /// `<mount>/<base>/<name>`, made.
    fn make(&self, name: &str) -> PathBuf {
        let d = self.mnt.path().join(&self.base).join(name);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// The daemon cgroup directory relative to the mount (`--mps-daemon-cgroup`).
    fn daemons_rel(&self) -> String {
        format!("{}/mps", self.base)
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
    if d.join("cgroup.kill").exists() {
        let _ = std::fs::write(d.join("cgroup.kill"), "1");
    }
    for _ in 0..300 {
        if std::fs::remove_dir(d).is_ok() || !d.exists() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl Drop for CgroupV2 {
    fn drop(&mut self) {
        remove_tree(&self.mnt.path().join(&self.base));
        let _ = Command::new("umount").arg(self.mnt.path()).status();
    }
}

/// The plugin child: killed (its process group) and reaped on drop.
struct Plugin {
    child: Child,
    log: PathBuf,
}

impl Plugin {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .stderr(Stdio::null())
            .status();
        let _ = self.child.wait();
    }
}

fn fake_mps(node: &SimNode) -> PathBuf {
    let link = node.dir.path().join(carve_mps::fake::PROGRAM);
    if !link.exists() {
        std::os::unix::fs::symlink(carve_binary().unwrap(), &link).unwrap();
    }
    link
}

/// Start the plugin with MPS sharing, as a runtime starts a container's
/// process: moved into `cgroup` before it execs, leading a process group of
/// its own. Waits for its registration socket and registers a kubelet.
async fn start(
    node: &mut SimNode,
    cgroup_root: &Path,
    cgroup: &Path,
    daemon_cgroup: &str,
    run: u32,
) -> (Plugin, FakeKubelet) {
    for s in node.registration_sockets() {
        std::fs::remove_file(&s).unwrap();
    }
    let log = node.dir.path().join(format!("plugin-lifetime-{run}.log"));
    let out = std::fs::File::create(&log).unwrap();
    let err = out.try_clone().unwrap();
    let mut args = node.plugin_args();
    let fake = fake_mps(node);
    args.extend([
        "--sharing".into(),
        "mps".into(),
        "--mps-control".into(),
        fake.display().to_string(),
        "--cgroup-root".into(),
        cgroup_root.display().to_string(),
        "--mps-daemon-cgroup".into(),
        daemon_cgroup.into(),
        "--mps-supervise-seconds".into(),
        "1".into(),
    ]);
    // `sh` moves itself into the cgroup, then execs the plugin (same pid).
    let child = Command::new("sh")
        .arg("-c")
        .arg("echo $$ > \"$0/cgroup.procs\" && exec \"$@\"")
        .arg(cgroup)
        .arg(carve_binary().unwrap())
        .args(args)
        .env(nvidia_ml_sim::CONFIG_ENV, &node.sim_config_path)
        .env("RUST_LOG", "info")
        .env("FAKE_MPS_AS_UID", "0")
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .unwrap();
    let plugin = Plugin { child, log };
    let reg = wait_for(node, "the plugin's registration socket", |n| {
        n.registration_sockets().into_iter().next()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", plugin.log()));
    let kubelet = FakeKubelet::register(&reg, carve_model::DRIVER_NAME)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", plugin.log()));
    (plugin, kubelet)
}

/// End the plugin as a container runtime ends a container: every process in
/// its cgroup (`cgroup.kill`) and its whole process group (SIGKILL).
fn kill_container(plugin: &mut Plugin, cgroup: &Path) {
    std::fs::write(cgroup.join("cgroup.kill"), "1").unwrap();
    // The group may already be gone (cgroup.kill got there first).
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", plugin.child.id())])
        .stderr(Stdio::null())
        .status()
        .unwrap();
    let status = plugin.child.wait().unwrap();
    assert!(!status.success(), "the plugin was killed: {status}");
    // Nothing is left in the plugin's cgroup.
    let empty = wait_until(Duration::from_secs(5), || {
        std::fs::read_to_string(cgroup.join("cgroup.events"))
            .is_ok_and(|e| e.lines().any(|l| l == "populated 0"))
    });
    assert!(
        empty,
        "{}",
        std::fs::read_to_string(cgroup.join("cgroup.procs")).unwrap_or_default()
    );
}

fn wait_until(t: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + t;
    while Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}

fn put_claim(api: &ApiServer, name: &str, uid: &str, share: &str) -> ClaimRef {
    let obj = serde_json::json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default", "uid": uid},
        "spec": {"devices": {"requests": []}},
        "status": {"allocation": {"devices": {"results": [{
            "request": "r", "driver": carve_model::DRIVER_NAME, "pool": NODE,
            "device": UNIT, "shareID": share,
            "consumedCapacity": {"memory": "8Gi", "multiprocessors": "10"}
        }]}}},
    });
    api.store().insert(Resource::ResourceClaims, obj).unwrap();
    ClaimRef {
        namespace: "default".into(),
        name: name.into(),
        uid: uid.into(),
    }
}

async fn prepare(k: &FakeKubelet, c: &ClaimRef, p: &Plugin) {
    let resp = k
        .prepare(std::slice::from_ref(c))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", p.log()));
    let one = resp.claims.get(&c.uid).expect("an answer for the claim");
    assert!(one.error.is_empty(), "{}\n{}", one.error, p.log());
}

async fn unprepare(k: &FakeKubelet, c: &ClaimRef, p: &Plugin) {
    let resp = k
        .unprepare(std::slice::from_ref(c))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", p.log()));
    let one = resp.claims.get(&c.uid).expect("an answer for the claim");
    assert!(one.error.is_empty(), "{}\n{}", one.error, p.log());
}

fn unit_dir(node: &SimNode) -> PathBuf {
    node.state_dir.join("mps").join(UNIT)
}

fn daemon_pid(node: &SimNode) -> Option<u32> {
    std::fs::read_to_string(unit_dir(node).join("pipe").join(carve_mps::PID_FILE))
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit(')')
            .next()
            .is_some_and(|r| !r.trim_start().starts_with('Z'))
    })
}

/// A CUDA client (the fake's) in the share's container as its CDI spec
/// makes it: `CUDA_MPS_PIPE_DIRECTORY` and `/dev/shm` mapped to their host
/// paths. Its answer names the server and namespace it landed in.
fn client_through_share(node: &SimNode, uid: &str) -> Result<String, String> {
    let spec =
        CdiSpec::read(&claim_spec_path(&node.cdi_dir, uid)).ok_or("no CDI spec for the claim")?;
    let edits = &spec.devices[0].container_edits;
    let host = |container: &str| {
        edits
            .mounts
            .iter()
            .find(|m| m.container_path == container)
            .map(|m| m.host_path.clone())
    };
    let pipe = edits
        .env
        .iter()
        .find_map(|e| e.strip_prefix("CUDA_MPS_PIPE_DIRECTORY="))
        .ok_or("no CUDA_MPS_PIPE_DIRECTORY in the share's edits")?;
    let pipe = host(pipe).ok_or("the pipe directory is not mounted")?;
    let shm = host("/dev/shm").ok_or("no /dev/shm mount")?;
    let o = Command::new(fake_mps(node))
        .args([carve_mps::fake::CUDA_CLIENT, "--uid=1000"])
        .arg(format!("--dev-shm={shm}"))
        .env_clear()
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .output()
        .map_err(|e| e.to_string())?;
    if o.status.success() {
        Ok(String::from_utf8_lossy(&o.stdout).trim().to_string())
    } else {
        Err(String::from_utf8_lossy(&o.stderr).trim().to_string())
    }
}

fn ns(claim: &str, share: &str) -> String {
    carve_mps::control::v3::namespace_name(claim, share)
}

async fn rig(tag: &str) -> Option<(ApiServer, SimNode, CgroupV2)> {
    if !root() {
        report("SKIPPED mps_lifetime: cgroup mounts, cgroup moves and the unit tmpfs need root");
        return None;
    }
    let carve = carve_binary().unwrap_or_else(|e| panic!("{e}"));
    let api = ApiServer::start(Options::default()).await.unwrap();
    let node = SimNode::new(
        NODE,
        vec![GpuEntry::new("h100-80gb", 1, false)],
        carve,
        &api.url(),
    )
    .unwrap();
    Some((api, node, CgroupV2::mount(tag)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemons_outlive_the_plugin_container_and_the_next_plugin_adopts_them() {
    let Some((api, mut node, cg)) = rig("live").await else {
        return;
    };
    let mnt = cg.mnt.path().to_path_buf();
    let daemons = cg.daemons_rel();
    let first = cg.make("plugin-1");
    let (mut plugin, kubelet) = start(&mut node, &mnt, &first, &daemons, 1).await;
    let a = put_claim(&api, "a", "u-a", "s-a");
    prepare(&kubelet, &a, &plugin).await;
    let pid = daemon_pid(&node).expect("a daemon for the unit");
    let unit_cg = mnt.join(&daemons).join(UNIT);
    let procs = std::fs::read_to_string(unit_cg.join("cgroup.procs")).unwrap();
    assert!(
        procs.split_whitespace().any(|p| p == pid.to_string()),
        "the daemon runs in its unit's cgroup {}: {procs}",
        unit_cg.display()
    );
    let before = client_through_share(&node, "u-a").unwrap();
    assert!(
        before.starts_with(&format!("server=carve namespace={} ", ns("u-a", "s-a"))),
        "{before}"
    );

    // The container goes: its whole cgroup and its process group.
    kill_container(&mut plugin, &first);
    drop(plugin);
    assert!(alive(pid), "the daemon survived the container's end");
    assert_eq!(daemon_pid(&node), Some(pid));
    // The share keeps working with no plugin at all.
    assert_eq!(client_through_share(&node, "u-a").unwrap(), before);

    // A new plugin, in a new cgroup: it adopts the daemon.
    let second = cg.make("plugin-2");
    let (plugin, kubelet) = start(&mut node, &mnt, &second, &daemons, 2).await;
    let adopted = wait_until(Duration::from_secs(10), || {
        plugin.log().contains("adopted running MPS control daemon")
    });
    assert!(adopted, "{}", plugin.log());
    assert!(alive(pid));
    assert_eq!(daemon_pid(&node), Some(pid));
    assert_eq!(client_through_share(&node, "u-a").unwrap(), before);
    // The same claim again (the kubelet repeats a prepare): the same answer.
    prepare(&kubelet, &a, &plugin).await;
    // A second claim on the unit attaches to the same daemon.
    let b = put_claim(&api, "b", "u-b", "s-b");
    prepare(&kubelet, &b, &plugin).await;
    assert_eq!(daemon_pid(&node), Some(pid), "{}", plugin.log());
    let got = client_through_share(&node, "u-b").unwrap();
    assert!(
        got.starts_with(&format!("server=carve namespace={} ", ns("u-b", "s-b"))),
        "{got}"
    );
    // Supervision ticks (every second) leave the adopted daemon alone.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(daemon_pid(&node), Some(pid));

    // One share goes: the daemon stays for the other. The last goes: the
    // daemon stops, and its cgroup is removed.
    unprepare(&kubelet, &a, &plugin).await;
    assert!(alive(pid));
    unprepare(&kubelet, &b, &plugin).await;
    assert!(
        wait_until(Duration::from_secs(5), || !alive(pid)),
        "the daemon stopped after the last share"
    );
    assert!(!unit_cg.exists(), "{} left", unit_cg.display());
    assert!(
        !unit_dir(&node).join("shm").exists(),
        "the unit's tmpfs left"
    );
    assert!(
        client_through_share(&node, "u-a").is_err(),
        "no CDI spec, no daemon"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_daemon_cgroup_the_same_kill_takes_the_daemon_with_it() {
    let Some((api, mut node, cg)) = rig("none").await else {
        return;
    };
    let mnt = cg.mnt.path().to_path_buf();
    let first = cg.make("plugin-1");
    let (mut plugin, kubelet) = start(&mut node, &mnt, &first, "none", 1).await;
    let a = put_claim(&api, "a", "u-a", "s-a");
    prepare(&kubelet, &a, &plugin).await;
    let pid = daemon_pid(&node).expect("a daemon for the unit");
    let procs = std::fs::read_to_string(first.join("cgroup.procs")).unwrap();
    assert!(
        procs.split_whitespace().any(|p| p == pid.to_string()),
        "the daemon runs in the plugin's cgroup: {procs}"
    );
    assert!(client_through_share(&node, "u-a").is_ok());
    kill_container(&mut plugin, &first);
    drop(plugin);
    assert!(
        wait_until(Duration::from_secs(5), || !alive(pid)),
        "the daemon ended with the container"
    );
    // The share's client finds no daemon: a plain CUDA process, no MPS, no limits.
    let after = client_through_share(&node, "u-a").unwrap();
    assert!(after.starts_with("server=none namespace=none "), "{after}");
    // The next plugin finds the daemon dead and restarts it for the share
    // (supervision); then the claim unprepares cleanly.
    let second = cg.make("plugin-2");
    let (plugin, kubelet) = start(&mut node, &mnt, &second, "none", 2).await;
    let back = wait_until(Duration::from_secs(10), || {
        daemon_pid(&node).is_some_and(|p| p != pid && alive(p))
    });
    assert!(back, "{}", plugin.log());
    unprepare(&kubelet, &a, &plugin).await;
}
