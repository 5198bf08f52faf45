//! Real containers from carve's CDI specs (issue 16 §2): podman (Debian's
//! package, with crun) reads the claim specs the plugin wrote, injects them
//! through the CDI library that containerd and CRI-O use too, and runs a small
//! C program in a root filesystem that has only that program, the C library
//! and the dynamic loader. Inside, the program `dlopen`s every driver soname
//! (the loader must find `libcuda.so.1` with no ld.so cache entry), calls the
//! fake `cuInit`, lists every character device under `/dev`, checks the
//! driver's utilities, and prints its environment.
//!
//! The GPU and control nodes are character devices made with `mknod` in the
//! NVML simulator's fake driver root (`nvidia_ml_sim::driver_root`), with the
//! NVIDIA driver's numbers; the MIG capability nodes exist nowhere on the
//! host, so a spec that names them by path alone fails here as on a node.
//! podman runs in a private mount namespace (`unshare -m`) where the plugin's
//! CDI directory is bind-mounted on `/var/run/cdi` (podman 4.3 has no
//! `--cdi-spec-dir`), and where, on a host with hybrid cgroups, the cgroup v2
//! mount is unmounted so crun uses cgroup v1.
//!
//! With `--nvidia-cdi-hook` the spec's hooks are run by crun; the hook is a
//! stand-in written from the Container Toolkit's documented interface (see
//! [`HOOK_PY`]), since the toolkit is not packaged in Debian.
//!
//! Needs root (mknod, mounts, rootful podman) and podman: skipped, saying
//! why, where either is missing, except on CI (`CI=true`), where it fails.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use carve_gpu::GpuBackend;
use carve_mps::{MpsConfig, ProtocolChoice};
use carve_plugin::{ClaimRef, Driver, MpsSetup, PreparedDevice};
use common::*;
use nvidia_ml_sim::GpuEntry;
use nvidia_ml_sim::driver_root::{CAPS_MAJOR, NVIDIA_MAJOR, UVM_MAJOR};

const FAKE_MPS: &str = env!("CARGO_BIN_EXE_carve-plugin-fake-mps-control");

const PROBE_C: &str = r#"
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>
extern char **environ;
static void walk(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        struct stat st;
        if (lstat(p, &st)) continue;
        if (S_ISCHR(st.st_mode))
            printf("node %s %u %u %o\n", p, major(st.st_rdev), minor(st.st_rdev), st.st_mode & 07777);
        else if (S_ISDIR(st.st_mode) && strcmp(p, "/dev/pts") && strcmp(p, "/dev/mqueue") && strcmp(p, "/dev/shm"))
            walk(p);
    }
    closedir(d);
}
int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (argv[i][0] == '/') {
            printf("file %s %s\n", argv[i], access(argv[i], R_OK) == 0 ? "ok" : "missing");
            continue;
        }
        void *h = dlopen(argv[i], RTLD_NOW);
        if (!h) { printf("dlopen %s FAILED %s\n", argv[i], dlerror()); continue; }
        struct link_map *lm = 0;
        dlinfo(h, RTLD_DI_LINKMAP, &lm);
        printf("dlopen %s ok %s\n", argv[i], lm ? lm->l_name : "?");
        int (*init)(unsigned) = (int (*)(unsigned))dlsym(h, "cuInit");
        if (init) printf("cuInit %d\n", init(0));
    }
    walk("/dev");
    for (char **e = environ; *e; e++) printf("env %s\n", *e);
    return 0;
}
"#;

/// Why this machine cannot run the test, if it cannot; panics on CI.
fn unable() -> Option<String> {
    use std::os::unix::fs::MetadataExt as _;
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let why = if !std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0) {
        Some(
            "not running as root (mknod, mount namespaces and rootful podman need root)"
                .to_string(),
        )
    } else if !Command::new("podman")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        Some("podman is not installed (.ci/run installs Debian's package)".to_string())
    } else if !Command::new("unshare")
        .arg("--help")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        Some("unshare (util-linux) is not installed".to_string())
    } else {
        None
    };
    if let Some(w) = &why {
        assert!(!ci, "CI=true: the podman CDI test must run, but {w}");
        eprintln!("SKIPPED: {w}");
    }
    why
}

/// A root filesystem with the probe, the C library and the loader only.
struct Rootfs {
    dir: tempfile::TempDir,
}

impl Rootfs {
    fn build() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("probe.c");
        std::fs::write(&src, PROBE_C).unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("usr/lib/x86_64-linux-gnu")).unwrap();
        let probe = root.join("probe");
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let o = Command::new(&cc)
            .arg("-o")
            .arg(&probe)
            .arg(&src)
            .arg("-ldl")
            .output()
            .unwrap_or_else(|e| panic!("{cc}: {e}"));
        assert!(
            o.status.success(),
            "{cc}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        // The probe's own libraries (the C library and the loader), at their paths.
        let ldd = Command::new("ldd").arg(&probe).output().unwrap();
        let text = String::from_utf8_lossy(&ldd.stdout).into_owned();
        for path in text
            .split_whitespace()
            .filter(|w| w.starts_with('/'))
            .map(PathBuf::from)
        {
            let to = root.join(path.strip_prefix("/").unwrap());
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::copy(&path, &to).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
        Self { dir }
    }

    fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }
}

/// What the probe saw in a container.
#[derive(Debug, Default)]
struct Seen {
    /// soname -> path the loader found it at (or the failure).
    dlopen: BTreeMap<String, String>,
    cu_init: Option<String>,
    /// `/dev` character devices: path -> (major, minor, mode).
    nodes: BTreeMap<String, (u32, u32, u32)>,
    files: BTreeMap<String, String>,
    env: Vec<String>,
    raw: String,
}

impl Seen {
    fn nvidia_nodes(&self) -> BTreeMap<String, (u32, u32, u32)> {
        self.nodes
            .iter()
            .filter(|(p, _)| p.starts_with("/dev/nvidia"))
            .map(|(p, v)| (p.clone(), *v))
            .collect()
    }
}

/// Run the probe in a container with these CDI devices.
fn run(rootfs: &Rootfs, node: &Node, cdi_ids: &[String], args: &[String]) -> Seen {
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let script = r#"set -e
if [ "$(stat -fc %T /sys/fs/cgroup)" != cgroup2fs ] && mountpoint -q /sys/fs/cgroup/unified; then
    umount /sys/fs/cgroup/unified
fi
[ -d /etc/cdi ] && mount -t tmpfs none /etc/cdi
mkdir -p /var/run/cdi
mount --bind "$CARVE_CDI_DIR" /var/run/cdi
exec podman "$@"
"#;
    let mut cmd = Command::new("unshare");
    cmd.args(["-m", "--propagation", "private", "sh", "-c", script, "sh"])
        .env("CARVE_CDI_DIR", &node.config.cdi_dir)
        .arg("--root")
        .arg(w.join("storage"))
        .arg("--runroot")
        .arg(w.join("run"))
        .args([
            "--storage-driver",
            "vfs",
            "--cgroup-manager",
            "cgroupfs",
            "--events-backend",
            "none",
            "run",
            "--rm",
            "--network",
            "none",
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=1024:1024",
        ]);
    for id in cdi_ids {
        cmd.arg("--device").arg(id);
    }
    cmd.arg("--rootfs")
        .arg(rootfs.root())
        .arg("/probe")
        .args(args);
    let o = cmd.output().expect("running unshare/podman");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        o.status.success(),
        "podman run with {cdi_ids:?} failed ({}):\nstdout:\n{out}\nstderr:\n{err}\nspecs: {:?}",
        o.status,
        node.cdi_files()
    );
    let mut s = Seen {
        raw: out.clone(),
        ..Seen::default()
    };
    for line in out.lines() {
        let f: Vec<&str> = line.splitn(4, ' ').collect();
        match f.as_slice() {
            ["dlopen", name, "ok", path] => {
                s.dlopen.insert((*name).into(), (*path).into());
            }
            ["dlopen", name, rest @ ..] => {
                s.dlopen
                    .insert((*name).into(), format!("FAILED {}", rest.join(" ")));
            }
            ["cuInit", v] => s.cu_init = Some((*v).into()),
            ["node", p, maj, rest] => {
                let mut it = rest.split(' ');
                let min = it.next().unwrap_or("").parse().unwrap_or(u32::MAX);
                let mode = u32::from_str_radix(it.next().unwrap_or(""), 8).unwrap_or(u32::MAX);
                s.nodes
                    .insert((*p).into(), (maj.parse().unwrap_or(u32::MAX), min, mode));
            }
            ["file", p, state] => {
                s.files.insert((*p).into(), (*state).into());
            }
            _ => {}
        }
        if let Some(e) = line.strip_prefix("env ") {
            s.env.push(e.to_string());
        }
    }
    s
}

/// The probe's arguments: every soname of the fake driver, its utilities.
fn probe_args(sonames: &[String]) -> Vec<String> {
    let mut v = sonames.to_vec();
    v.extend(
        nvidia_ml_sim::driver_root::BINARIES
            .iter()
            .map(|b| format!("/usr/bin/{b}")),
    );
    v.push("/lib/firmware/nvidia/580.65.06/gsp_ga10x.bin".into());
    v
}

/// What every container with a carve device gets from the driver.
fn check_driver(s: &Seen, sonames: &[String]) {
    for so in sonames {
        assert_eq!(
            s.dlopen.get(so).map(String::as_str),
            Some(format!("/usr/lib/x86_64-linux-gnu/{so}").as_str()),
            "the loader resolves {so}:\n{}",
            s.raw
        );
    }
    assert_eq!(s.cu_init.as_deref(), Some("0"), "{}", s.raw);
    for (f, state) in &s.files {
        // Every utility of the driver but the MPS control client, which
        // drives a daemon's quit and limit commands: only the plugin runs it.
        let want = if f.ends_with("/nvidia-cuda-mps-control") {
            "missing"
        } else {
            "ok"
        };
        assert_eq!(state, want, "{f} in the container:\n{}", s.raw);
    }
    assert!(
        s.env.contains(&"NVIDIA_VISIBLE_DEVICES=void".to_string()),
        "{:?}",
        s.env
    );
    assert!(
        s.env
            .contains(&"NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu".to_string()),
        "{:?}",
        s.env
    );
    assert!(
        !s.env.iter().any(|e| e.starts_with("CUDA_VISIBLE_DEVICES=")),
        "{:?}",
        s.env
    );
}

fn control_nodes() -> BTreeMap<String, (u32, u32, u32)> {
    [
        ("/dev/nvidiactl", NVIDIA_MAJOR, 255),
        ("/dev/nvidia-modeset", NVIDIA_MAJOR, 254),
        ("/dev/nvidia-uvm", UVM_MAJOR, 0),
        ("/dev/nvidia-uvm-tools", UVM_MAJOR, 1),
    ]
    .into_iter()
    .map(|(p, a, b)| (p.to_string(), (a, b, 0o666)))
    .collect()
}

fn gpu_node(minor: u32) -> (String, (u32, u32, u32)) {
    (format!("/dev/nvidia{minor}"), (NVIDIA_MAJOR, minor, 0o666))
}

/// The capability nodes of every live MIG instance of GPU `gpu` (minor = index).
fn cap_nodes(b: &dyn GpuBackend, gpu: u32) -> BTreeMap<String, (u32, u32, u32)> {
    let mut m = BTreeMap::new();
    for gi in live(b, gpu) {
        let mut minors = vec![b.capability_minor(gpu, gi.id, None).unwrap()];
        for ci in &gi.compute_instances {
            minors.push(b.capability_minor(gpu, gi.id, Some(ci.id)).unwrap());
        }
        for n in minors {
            // The simulator's capability files say DeviceFileMode 292 (0444).
            m.insert(
                format!("/dev/nvidia-caps/nvidia-cap{n}"),
                (CAPS_MAJOR, n, 0o444),
            );
        }
    }
    m
}

fn ids(devs: &[PreparedDevice]) -> Vec<String> {
    devs.iter().flat_map(|d| d.cdi_device_ids.clone()).collect()
}

async fn prepared(driver: &Driver, c: &ClaimRef) -> Vec<PreparedDevice> {
    let out = driver.prepare(vec![c.clone()]).await;
    match &out[0].1 {
        Ok(d) => d.clone(),
        Err(e) => panic!("prepare {}: {e}", c.uid),
    }
}

async fn unprepared(driver: &Driver, c: &ClaimRef) {
    let out = driver.unprepare(vec![c.clone()]).await;
    if let Err(e) = &out[0].1 {
        panic!("unprepare {}: {e}", c.uid);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn podman_runs_mig_whole_gpu_and_multi_device_containers_from_carve_specs() {
    if unable().is_some() {
        return;
    }
    let rootfs = Rootfs::build();
    // GPU 0 in MIG mode, GPU 1 not.
    let node = Node::new(vec![
        GpuEntry::new("h100-80gb", 1, true),
        GpuEntry::new("h100-80gb", 1, false),
    ]);
    let api = api().await;
    let driver = started(&node, node.config.clone(), &api).await;
    let b = node.backend();
    let sonames: Vec<String> = {
        let mut v: Vec<String> = std::fs::read_dir(
            node.config
                .driver
                .container_root
                .join("usr/lib/x86_64-linux-gnu"),
        )
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".so.1") || n.ends_with(".so.4"))
        .collect();
        v.sort();
        v
    };
    assert!(
        sonames.contains(&"libcuda.so.1".to_string())
            && sonames.contains(&"libnvidia-ml.so.1".to_string())
    );
    let args = probe_args(&sonames);

    // A MIG claim: its parent's node, its GI and CI capability nodes (which
    // exist nowhere on the host), the control nodes.
    let mig = put_device_claim(&api, "mig", "u-mig", "gpu-0-mig-1g10gb-0");
    let mig_devs = prepared(&driver, &mig).await;
    let s = run(&rootfs, &node, &ids(&mig_devs), &args);
    check_driver(&s, &sonames);
    let mut want = control_nodes();
    want.extend([gpu_node(0)]);
    want.extend(cap_nodes(&*b, 0));
    assert_eq!(want.len(), 4 + 1 + 2);
    assert_eq!(s.nvidia_nodes(), want, "{}", s.raw);

    // A whole GPU: its node only.
    let whole = put_device_claim(&api, "whole", "u-whole", "gpu-1");
    let whole_devs = prepared(&driver, &whole).await;
    let s = run(&rootfs, &node, &ids(&whole_devs), &args);
    check_driver(&s, &sonames);
    let mut want = control_nodes();
    want.extend([gpu_node(1)]);
    assert_eq!(s.nvidia_nodes(), want, "{}", s.raw);

    // Two claims in one container: both claims' devices, nothing overwritten.
    let mut both = ids(&mig_devs);
    both.extend(ids(&whole_devs));
    let s = run(&rootfs, &node, &both, &args);
    check_driver(&s, &sonames);
    let mut want = control_nodes();
    want.extend([gpu_node(0), gpu_node(1)]);
    want.extend(cap_nodes(&*b, 0));
    assert_eq!(s.nvidia_nodes(), want, "{}", s.raw);
    unprepared(&driver, &mig).await;
    unprepared(&driver, &whole).await;

    // One claim with two MIG devices of one GPU: both instances' capability nodes.
    let two = put_claim(
        &api,
        "two",
        "u-two",
        &[("a", "gpu-0-mig-1g10gb-1"), ("b", "gpu-0-mig-1g10gb-2")],
        serde_json::json!([]),
    );
    let two_devs = prepared(&driver, &two).await;
    assert_eq!(live(&*b, 0).len(), 2);
    let s = run(&rootfs, &node, &ids(&two_devs), &args);
    check_driver(&s, &sonames);
    let mut want = control_nodes();
    want.extend([gpu_node(0)]);
    want.extend(cap_nodes(&*b, 0));
    assert_eq!(want.len(), 4 + 1 + 4);
    assert_eq!(s.nvidia_nodes(), want, "{}", s.raw);
    unprepared(&driver, &two).await;
    assert!(node.cdi_files().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn podman_runs_an_mps_share_container_from_its_spec() {
    if unable().is_some() {
        return;
    }
    let rootfs = Rootfs::build();
    let mut node = Node::new(vec![GpuEntry::new("h100-80gb", 1, false)]);
    let d = node.dir.path().to_path_buf();
    let mut config = MpsConfig::new(d.join("state"));
    config.control_binary = PathBuf::from(FAKE_MPS);
    // The daemon on the unit's tmpfs as /dev/shm, through the fake's binary
    // as the launcher (the carve binary in the plugin).
    config.shm_launcher = Some(PathBuf::from(FAKE_MPS));
    config.protocol = ProtocolChoice::V2;
    config.timeout = std::time::Duration::from_secs(10);
    let unit = config.root.join("gpu-0-mps");
    let support = carve_mps::detect(&config).unwrap();
    node.config.mps = Some(MpsSetup { config, support });
    let api = api().await;
    let driver = started(&node, node.config.clone(), &api).await;
    let c = put_results(
        &api,
        "share",
        "u-share",
        vec![
            serde_json::json!({"request": "r", "driver": "gpu.carve.dev", "pool": NODE,
            "device": "gpu-0-mps", "shareID": "s-1",
            "consumedCapacity": {"memory": "1Gi", "multiprocessors": "2"}}),
        ],
        &[],
    );
    let devs = prepared(&driver, &c).await;
    // A first client starts the v2 server, which keeps its cuda.shm file in
    // its /dev/shm: the unit's tmpfs.
    let shm = unit.join("shm");
    let o = Command::new(FAKE_MPS)
        .env("CUDA_MPS_PIPE_DIRECTORY", unit.join("pipe"))
        .args([
            carve_mps::fake::CUDA_CLIENT,
            &format!("--dev-shm={}", shm.display()),
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let server_shm: Vec<String> = std::fs::read_dir(&shm)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("cuda.shm."))
        .collect();
    assert_eq!(server_shm.len(), 1, "{server_shm:?}");
    let sonames = vec!["libcuda.so.1".to_string(), "libnvidia-ml.so.1".to_string()];
    let mut args = probe_args(&sonames);
    args.push("/tmp/nvidia-mps".into());
    let in_container = format!("/dev/shm/{}", server_shm[0]);
    args.push(in_container.clone());
    let s = run(&rootfs, &node, &ids(&devs), &args);
    // The container's /dev/shm is the unit's tmpfs, where the server is.
    assert_eq!(
        s.files.get(&in_container).map(String::as_str),
        Some("ok"),
        "{}",
        s.raw
    );
    check_driver(&s, &sonames);
    let mut want = control_nodes();
    want.extend([gpu_node(0)]);
    assert_eq!(s.nvidia_nodes(), want, "{}", s.raw);
    // The share's own edits: its daemon's pipe directory and its limits.
    assert!(
        s.env
            .contains(&"CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps".to_string()),
        "{:?}",
        s.env
    );
    assert!(
        s.env
            .iter()
            .any(|e| e.starts_with("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=")),
        "{:?}",
        s.env
    );
    unprepared(&driver, &c).await;
    // The last share gone, the daemon stops and its tmpfs goes.
    assert!(!shm.exists(), "{} left behind", shm.display());
}

/// The names of the files under `dir`, recursively.
fn tree(dir: &Path) -> BTreeSet<PathBuf> {
    let mut v = BTreeSet::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            v.insert(e.path());
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                v.extend(tree(&e.path()));
            }
        }
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_root_without_libcuda_fails_each_prepare_naming_the_file_and_changes_nothing() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let lib = node
        .config
        .driver
        .container_root
        .join("usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06");
    std::fs::remove_file(&lib).unwrap();
    let api = api().await;
    // The plugin starts.
    let driver = started(&node, node.config.clone(), &api).await;
    let before = tree(node.dir.path());
    let a = put_device_claim(&api, "a", "u-a", "gpu-0-mig-1g10gb-0");
    let w = put_device_claim(&api, "w", "u-w", "gpu-0");
    let out = driver.prepare(vec![a, w]).await;
    for uid in ["u-a", "u-w"] {
        let e = claim_error(&out, uid);
        assert!(
            e.contains("libcuda.so.580.65.06")
                && e.contains(&node.config.driver.container_root.display().to_string()),
            "{uid}: {e}"
        );
    }
    assert!(live(&*node.backend(), 0).is_empty(), "no GPU instance made");
    assert!(node.cdi_files().is_empty(), "no spec written");
    let after = tree(node.dir.path());
    assert_eq!(before, after, "no file made or removed");

    // Once the library is back, the next prepare finds it without a restart.
    nvidia_ml_sim::driver_root::write_fake_driver(node.dir.path(), "580.65.06", &[0]).unwrap();
    let a = put_device_claim(&api, "a2", "u-a2", "gpu-0-mig-1g10gb-0");
    let out = driver.prepare(vec![a]).await;
    assert!(out[0].1.is_ok(), "{:?}", out[0].1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_nvidia_caps_in_the_devices_file_fails_each_mig_prepare_naming_the_file() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    std::fs::write(
        &node.config.driver.proc_devices,
        nvidia_ml_sim::driver_root::proc_devices_text(false),
    )
    .unwrap();
    let api = api().await;
    let driver = started(&node, node.config.clone(), &api).await;
    let a = put_device_claim(&api, "a", "u-a", "gpu-0-mig-1g10gb-0");
    let b2 = put_device_claim(&api, "b", "u-b", "gpu-0-mig-1g10gb-1");
    let out = driver.prepare(vec![a, b2]).await;
    for uid in ["u-a", "u-b"] {
        let e = claim_error(&out, uid);
        assert!(
            e.contains(&node.config.driver.proc_devices.display().to_string())
                && e.contains("nvidia-caps"),
            "{uid}: {e}"
        );
    }
    assert!(live(&*node.backend(), 0).is_empty(), "no GPU instance made");
    assert!(node.cdi_files().is_empty(), "no spec written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_with_the_driver_gone_keeps_prepared_claims_specs() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let api = api().await;
    let driver = started(&node, node.config.clone(), &api).await;
    let a = put_device_claim(&api, "a", "u-a", "gpu-0-mig-1g10gb-0");
    prepared(&driver, &a).await;
    let spec = node.cdi_files();
    assert_eq!(spec.len(), 1);
    let before = std::fs::read(&spec[0]).unwrap();
    drop(driver);
    std::fs::remove_file(
        node.config
            .driver
            .container_root
            .join("usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06"),
    )
    .unwrap();
    // The plugin starts; the prepared claim's spec stays as written.
    let driver = started(&node, node.config.clone(), &api).await;
    assert_eq!(node.cdi_files(), spec);
    assert_eq!(std::fs::read(&spec[0]).unwrap(), before);
    // The claim answers from the checkpoint; its unprepare works.
    prepared(&driver, &a).await;
    unprepared(&driver, &a).await;
    assert!(node.cdi_files().is_empty());
}

/// A stand-in for the Container Toolkit's `nvidia-cdi-hook`, written from its
/// documented interface (cmd/nvidia-cdi-hook/README.md of
/// NVIDIA/nvidia-container-toolkit, and the hook entries `nvidia-ctk cdi
/// generate` writes): an OCI `createContainer` hook that reads the container
/// state on stdin, finds the root filesystem from the bundle's config.json,
/// and for `create-symlinks --link TARGET::LINK` makes each link inside it,
/// for `update-ldcache --folder DIR` runs ldconfig on that root (which makes
/// the soname links and the cache), and accepts `enable-cuda-compat
/// --host-driver-version=V` and `disable-device-node-modification` without
/// doing anything here (no CUDA compat libraries, no params file in this
/// root). Any other subcommand or flag fails the hook, and so the container.
const HOOK_PY: &str = r#"#!/usr/bin/env python3
import json, os, subprocess, sys
args = sys.argv[1:]
state = json.load(sys.stdin)
with open(os.path.join(state["bundle"], "config.json")) as f:
    cfg = json.load(f)
root = cfg["root"]["path"]
if not os.path.isabs(root):
    root = os.path.join(state["bundle"], root)
# A hook gets only the spec's environment: the log goes beside the script.
log = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "hook.log"), "a")
log.write(" ".join(args) + "\n")
cmd, rest = args[0], args[1:]
if cmd == "create-symlinks":
    while rest:
        if rest[0] != "--link" or len(rest) < 2 or "::" not in rest[1]:
            sys.exit("create-symlinks: bad arguments %r" % rest)
        target, link = rest[1].split("::", 1)
        path = os.path.join(root, link.lstrip("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not os.path.lexists(path):
            os.symlink(target, path)
        rest = rest[2:]
elif cmd == "update-ldcache":
    folders = []
    while rest:
        if rest[0] != "--folder" or len(rest) < 2:
            sys.exit("update-ldcache: bad arguments %r" % rest)
        folders.append(rest[1])
        rest = rest[2:]
    os.makedirs(os.path.join(root, "etc"), exist_ok=True)
    subprocess.run(["ldconfig", "-r", root] + folders, check=True)
elif cmd == "enable-cuda-compat":
    if len(rest) != 1 or not rest[0].startswith("--host-driver-version="):
        sys.exit("enable-cuda-compat: bad arguments %r" % rest)
elif cmd == "disable-device-node-modification":
    if rest:
        sys.exit("disable-device-node-modification: bad arguments %r" % rest)
else:
    sys.exit("unknown command " + cmd)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_nvidia_cdi_hook_the_loader_finds_the_driver_through_the_hooks() {
    if unable().is_some() {
        return;
    }
    let rootfs = Rootfs::build();
    let mut node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let hook = node.dir.path().join("nvidia-cdi-hook");
    std::fs::write(&hook, HOOK_PY).unwrap();
    std::fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let hook_log = node.dir.path().join("hook.log");
    node.config.driver.nvidia_cdi_hook = Some(hook.clone());
    let api = api().await;
    let driver = started(&node, node.config.clone(), &api).await;
    let spec = {
        let c = put_device_claim(&api, "mig", "u-mig", "gpu-0-mig-1g10gb-0");
        let devs = prepared(&driver, &c).await;
        (c, devs)
    };
    // No soname mounts: only the hooks can make libcuda.so.1 resolvable.
    let cdi = carve_plugin::CdiSpec::read(&node.cdi_files()[0]).unwrap();
    let common = cdi.container_edits.unwrap();
    assert!(
        !common
            .mounts
            .iter()
            .any(|m| m.container_path.ends_with("/libcuda.so.1")),
        "{common:?}"
    );
    let sonames = vec!["libcuda.so.1".to_string(), "libnvidia-ml.so.1".to_string()];
    let s = run(&rootfs, &node, &ids(&spec.1), &probe_args(&sonames));
    check_driver(&s, &sonames);
    let log = std::fs::read_to_string(&hook_log).unwrap();
    for cmd in [
        "create-symlinks --link",
        "enable-cuda-compat --host-driver-version=580.65.06",
        "update-ldcache --folder /usr/lib/x86_64-linux-gnu",
        "disable-device-node-modification",
    ] {
        assert!(log.lines().any(|l| l.starts_with(cmd)), "{cmd}: {log}");
    }
    unprepared(&driver, &spec.0).await;
}
