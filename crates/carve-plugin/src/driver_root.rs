//! The node's NVIDIA driver as a container needs it: what a claim's CDI spec
//! mounts, creates and runs so that CUDA works in a container that has no
//! driver of its own (CDI mode, no legacy NVIDIA runtime hook), following what
//! NVIDIA's Container Toolkit generator (`nvcdi`) puts in its specs.
//!
//! Discovery runs at plugin start, not per prepare: under the driver root as
//! the plugin sees it (`--container-driver-root`, `/` by default; the GPU
//! Operator's is `/run/nvidia/driver`), for the driver version NVML reports.
//! Every path it finds is written into specs as a **host** path
//! (`--host-driver-root`): the container runtime reads the spec on the host.
//! Before each prepare the plugin checks that `libcuda.so.<version>` is still
//! there, and discovers again (with the version NVML reports then) when it is
//! not, or when discovery had failed: a driver installed, fixed or upgraded
//! after the plugin started is picked up without a restart.
//!
//! The dynamic loader of the container must find `libcuda.so.1` and the
//! other sonames. With the Container Toolkit's `nvidia-cdi-hook`
//! (`--nvidia-cdi-hook`, a host path) the spec runs its `create-symlinks`,
//! `update-ldcache`, `enable-cuda-compat` and `disable-device-node-modification`
//! hooks, as NVIDIA's specs do. Without it, each library is also mounted at
//! every name the driver directory links to it (its soname link as ldconfig
//! made it, `libcuda.so.1`, and development links such as `libcuda.so`):
//! a loader that searches the library directory's container path (Debian and
//! Ubuntu images search `/usr/lib/x86_64-linux-gnu` by default) then finds
//! them without an ld.so cache entry.

use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::cdi::{ContainerEdits, DeviceNode, Hook, Mount};

/// Where the driver is, and the files that describe the driver's devices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverRootConfig {
    /// The driver root as the plugin sees it (`--container-driver-root`).
    pub container_root: PathBuf,
    /// The same root on the host, written into specs (`--host-driver-root`).
    pub host_root: PathBuf,
    /// Host path of the Container Toolkit's `nvidia-cdi-hook`
    /// (`--nvidia-cdi-hook`); `None`: libraries are mounted at their soname
    /// paths instead.
    pub nvidia_cdi_hook: Option<PathBuf>,
    /// `/proc/devices` (`--proc-devices`): the `nvidia-caps` major.
    pub proc_devices: PathBuf,
    /// `/proc/driver/nvidia` (`--proc-driver-nvidia`): the MIG capability
    /// files' `DeviceFileMode`.
    pub proc_driver_nvidia: PathBuf,
}

impl Default for DriverRootConfig {
    fn default() -> Self {
        Self {
            container_root: "/".into(),
            host_root: "/".into(),
            nvidia_cdi_hook: None,
            proc_devices: "/proc/devices".into(),
            proc_driver_nvidia: "/proc/driver/nvidia".into(),
        }
    }
}

/// Why the driver's files or device numbers could not be found.
#[derive(Debug, thiserror::Error)]
pub enum DriverRootError {
    /// No `libcuda.so.<version>` in any library directory of the root.
    #[error(
        "NVIDIA driver root {root}: no libcuda.so.{version} (the version NVML reports); looked for {looked}"
    )]
    NoLibcuda {
        /// The driver root (plugin's view).
        root: PathBuf,
        /// The driver version.
        version: String,
        /// The paths looked at.
        looked: String,
    },
    /// The driver root has no NVML library.
    #[error("NVIDIA driver root {root}: no {name}; looked for {looked}")]
    NoNvml {
        /// The driver root (plugin's view).
        root: PathBuf,
        /// The library's name.
        name: String,
        /// The paths looked at.
        looked: String,
    },
    /// NVML reported no driver version (no GPU).
    #[error("NVML reports no GPU, so no driver version to look for the driver's libraries with")]
    NoVersion,
    /// `/proc/devices` has no `nvidia-caps` character device.
    #[error(
        "{file}: no `nvidia-caps` character device (the major of the MIG capability nodes /dev/nvidia-caps/*); is the NVIDIA driver loaded with MIG support?"
    )]
    NoCapsMajor {
        /// The devices file.
        file: PathBuf,
    },
    /// A MIG capability file has no `DeviceFileMode:` line.
    #[error("{file}: no valid `DeviceFileMode: <N>` line")]
    NoCapMode {
        /// The access file.
        file: PathBuf,
    },
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// Library directories looked at under the root, in order (NVIDIA's
/// installer and distribution packages use one of these).
const LIB_DIRS: &[&str] = &[
    "usr/lib/x86_64-linux-gnu",
    "usr/lib64",
    "usr/lib/aarch64-linux-gnu",
    "lib/x86_64-linux-gnu",
    "lib64",
    "usr/lib",
    "lib",
    "usr/local/lib",
];

/// Where utilities are looked for.
const BIN_DIRS: &[&str] = &["usr/bin", "usr/sbin", "bin", "sbin", "usr/local/bin"];

/// The utilities a container gets where the driver has them. Not
/// `nvidia-cuda-mps-control`: a workload needs no control client (its CUDA
/// library finds the server through `CUDA_MPS_PIPE_DIRECTORY`), and the
/// binary is what drives a daemon's `quit` and limit commands; only the
/// plugin runs it.
const BINARIES: &[&str] = &[
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-server",
    "nvidia-imex",
    "nvidia-imex-ctl",
];

/// IPC sockets of the driver's daemons.
const SOCKETS: &[&str] = &[
    "run/nvidia-persistenced/socket",
    "run/nvidia-fabricmanager/socket",
];

/// Graphics configuration files (Vulkan ICD and layers, glvnd EGL vendor,
/// EGL external platforms).
const CONFIGS: &[&str] = &[
    "etc/vulkan/icd.d/nvidia_icd.json",
    "usr/share/vulkan/icd.d/nvidia_icd.json",
    "etc/vulkan/implicit_layer.d/nvidia_layers.json",
    "usr/share/vulkan/implicit_layer.d/nvidia_layers.json",
    "usr/share/glvnd/egl_vendor.d/10_nvidia.json",
    "usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json",
    "usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json",
];

/// Control device nodes a container gets where they exist.
const CONTROL_NODES: &[&str] = &[
    "nvidiactl",
    "nvidia-uvm",
    "nvidia-uvm-tools",
    "nvidia-modeset",
];

/// Mount options of every driver file (as NVIDIA's specs have them).
fn ro_options() -> Vec<String> {
    ["ro", "nosuid", "nodev", "rbind", "rprivate"]
        .into_iter()
        .map(String::from)
        .collect()
}

/// What [`discover`] found: the edits every claim spec carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverFiles {
    /// The driver version the files are of.
    pub version: String,
    /// `libcuda.so.<version>` as the plugin sees it (checked before prepares).
    pub libcuda: PathBuf,
    /// The library directory's path in the container.
    pub lib_dir: String,
    /// Spec-level edits: control nodes, mounts, hooks, environment.
    pub common: ContainerEdits,
    /// Where the plugin looks for `/dev/nvidia<minor>`.
    dev_root: PathBuf,
    /// The same on the host.
    host_dev_root: PathBuf,
}

/// The root-relative form of `p` (`usr/lib/...`) under `root`.
fn rel<'a>(root: &Path, p: &'a Path) -> &'a Path {
    p.strip_prefix(root).unwrap_or(p)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DriverRootError + '_ {
    move |source| DriverRootError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A device node of the container at `/dev/<name>`, fully specified from the
/// character device at `<dev_root>/dev/<name>`, so the runtime creates it
/// without looking at the host's `/dev`; `None` where there is no such
/// character device.
fn char_node(dev_root: &Path, host_dev_root: &Path, name: &str) -> Option<DeviceNode> {
    let seen = dev_root.join("dev").join(name);
    let m = std::fs::symlink_metadata(&seen).ok()?;
    if !m.file_type().is_char_device() {
        return None;
    }
    let rdev = m.rdev();
    let path = format!("/dev/{name}");
    let host = host_dev_root.join("dev").join(name).display().to_string();
    Some(DeviceNode {
        host_path: (host != path).then_some(host),
        path,
        dev_type: Some("c".into()),
        major: i64::try_from(nix::sys::stat::major(rdev)).ok(),
        minor: i64::try_from(nix::sys::stat::minor(rdev)).ok(),
        file_mode: Some(m.mode() & 0o777),
    })
}

impl DriverFiles {
    /// The node of GPU `minor`: fully specified where the plugin sees the
    /// character device, else by path (the runtime then reads it on the host).
    #[must_use]
    pub fn gpu_node(&self, minor: u32) -> DeviceNode {
        char_node(
            &self.dev_root,
            &self.host_dev_root,
            &format!("nvidia{minor}"),
        )
        .unwrap_or_else(|| DeviceNode::path(format!("/dev/nvidia{minor}")))
    }

    /// Whether `libcuda.so.<version>` is still where discovery found it.
    #[must_use]
    pub fn still_there(&self) -> bool {
        self.libcuda.is_file()
    }
}

/// A MIG capability node `/dev/nvidia-caps/nvidia-cap<minor>`, fully
/// specified (type, the `nvidia-caps` major, minor, mode) so that the runtime
/// creates it whether or not the host has the node yet.
#[must_use]
pub fn cap_node(caps_major: u32, minor: u32, mode: u32) -> DeviceNode {
    DeviceNode {
        path: format!("/dev/nvidia-caps/nvidia-cap{minor}"),
        host_path: None,
        dev_type: Some("c".into()),
        major: Some(i64::from(caps_major)),
        minor: Some(i64::from(minor)),
        file_mode: Some(mode),
    }
}

/// The `nvidia-caps` major from a `/proc/devices` file.
///
/// # Errors
/// The file is unreadable or has no `nvidia-caps` character device.
pub fn caps_major(file: &Path) -> Result<u32, DriverRootError> {
    let text = std::fs::read_to_string(file).map_err(io(file))?;
    let mut chars = false;
    for line in text.lines() {
        let t = line.trim();
        if t.ends_with(':') {
            chars = t == "Character devices:";
            continue;
        }
        if !chars {
            continue;
        }
        if let Some((num, name)) = t.split_once(char::is_whitespace)
            && name.trim() == "nvidia-caps"
            && let Ok(n) = num.parse()
        {
            return Ok(n);
        }
    }
    Err(DriverRootError::NoCapsMajor {
        file: file.to_path_buf(),
    })
}

/// The `DeviceFileMode` of a MIG capability
/// (`<proc>/capabilities/gpu<m>/mig/gi<g>[/ci<c>]/access`, decimal).
///
/// # Errors
/// The file is unreadable or has no valid mode line.
pub fn cap_mode(
    proc_driver_nvidia: &Path,
    gpu_minor: u32,
    gi: u32,
    ci: Option<u32>,
) -> Result<u32, DriverRootError> {
    let mut file = proc_driver_nvidia
        .join("capabilities")
        .join(format!("gpu{gpu_minor}"))
        .join("mig")
        .join(format!("gi{gi}"));
    if let Some(c) = ci {
        file.push(format!("ci{c}"));
    }
    file.push("access");
    let text = std::fs::read_to_string(&file).map_err(io(&file))?;
    text.lines()
        .find_map(|l| l.strip_prefix("DeviceFileMode:"))
        .and_then(|v| v.trim().parse::<u32>().ok())
        .map(|m| m & 0o7777)
        .ok_or(DriverRootError::NoCapMode { file })
}

/// Each symlink in `dir` that leads (in up to 4 hops within `dir`) to one of
/// `libs`: (link name, its own target, the library file).
fn soname_links(
    dir: &Path,
    libs: &[String],
) -> Result<Vec<(String, String, String)>, DriverRootError> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).map_err(io(dir))?.flatten() {
        let Ok(ft) = e.file_type() else { continue };
        if !ft.is_symlink() {
            continue;
        }
        let name = e.file_name().to_string_lossy().into_owned();
        let Ok(first) = std::fs::read_link(e.path()) else {
            continue;
        };
        let first = first.to_string_lossy().into_owned();
        let mut cur = first.clone();
        for _ in 0..4 {
            let base = Path::new(&cur)
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default();
            if libs.contains(&base) {
                out.push((name.clone(), first.clone(), base));
                break;
            }
            match std::fs::read_link(dir.join(&base)) {
                Ok(next) => cur = next.to_string_lossy().into_owned(),
                Err(_) => break,
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Find the driver's files of `version` under `cfg.container_root`.
///
/// # Errors
/// No `libcuda.so.<version>`, or the library directory is unreadable.
pub fn discover(cfg: &DriverRootConfig, version: &str) -> Result<DriverFiles, DriverRootError> {
    let root = &cfg.container_root;
    let libcuda = find_libcuda(root, version)?;
    let dir = libcuda.parent().unwrap_or(root).to_path_buf();
    let roots = Roots {
        root,
        host: &cfg.host_root,
    };
    let lib_dir = roots.container_of(&dir);

    let libs = driver_libraries(&dir, version)?;
    let mut mounts: Vec<Mount> = libs.iter().map(|l| roots.bind(&dir.join(l))).collect();
    let links = soname_links(&dir, &libs)?;
    let hooks = match &cfg.nvidia_cdi_hook {
        None => {
            // The loader finds each soname at its path in the library directory.
            mounts.extend(links.iter().map(|(link, _, lib)| Mount {
                host_path: roots.host_of(&dir.join(lib)),
                container_path: format!("{lib_dir}/{link}"),
                options: ro_options(),
            }));
            Vec::new()
        }
        Some(hook) => cdi_hooks(hook, &links, version, &lib_dir),
    };
    mounts.extend(other_files(root, version).iter().map(|p| roots.bind(p)));
    mounts.extend(sockets(root).iter().map(|p| {
        let mut m = roots.bind(p);
        m.options.push("noexec".into());
        m
    }));
    mounts.extend(configs(root).iter().map(|p| roots.bind(p)));
    let (dev_root, host_dev_root) = dev_roots(cfg);
    let device_nodes = CONTROL_NODES
        .iter()
        .filter_map(|n| char_node(&dev_root, &host_dev_root, n))
        .collect();
    let env = vec![
        "NVIDIA_VISIBLE_DEVICES=void".to_string(),
        format!("NVIDIA_CTK_LIBCUDA_DIR={lib_dir}"),
    ];
    Ok(DriverFiles {
        version: version.to_string(),
        libcuda,
        lib_dir,
        common: ContainerEdits {
            env,
            device_nodes,
            mounts,
            hooks,
        },
        dev_root,
        host_dev_root,
    })
}

/// Where the device nodes are, as the plugin sees them and on the host:
/// the driver root's `/dev` where it has the control node (a driver
/// container's), else the node's.
fn dev_roots(cfg: &DriverRootConfig) -> (PathBuf, PathBuf) {
    if cfg.container_root.join("dev/nvidiactl").exists() {
        (cfg.container_root.clone(), cfg.host_root.clone())
    } else {
        (PathBuf::from("/"), PathBuf::from("/"))
    }
}

/// The driver root as the plugin sees it and as the host does: a path
/// found under the one, written into specs under the other.
#[derive(Debug, Clone, Copy)]
struct Roots<'a> {
    root: &'a Path,
    host: &'a Path,
}

impl Roots<'_> {
    fn host_of(&self, p: &Path) -> String {
        self.host.join(rel(self.root, p)).display().to_string()
    }

    fn container_of(&self, p: &Path) -> String {
        Path::new("/").join(rel(self.root, p)).display().to_string()
    }

    /// `p` bind-mounted read-only at the same path in the container.
    fn bind(&self, p: &Path) -> Mount {
        Mount {
            host_path: self.host_of(p),
            container_path: self.container_of(p),
            options: ro_options(),
        }
    }
}

/// `name` in the first library directory under `root` that has it, or
/// every path looked at.
fn find_library(root: &Path, name: &str) -> Result<PathBuf, String> {
    let candidates: Vec<PathBuf> = LIB_DIRS.iter().map(|d| root.join(d).join(name)).collect();
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| {
            let looked: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
            looked.join(", ")
        })
}

/// `libcuda.so.<version>` in the first library directory under `root`
/// that has it.
fn find_libcuda(root: &Path, version: &str) -> Result<PathBuf, DriverRootError> {
    find_library(root, &format!("libcuda.so.{version}")).map_err(|looked| {
        DriverRootError::NoLibcuda {
            root: root.to_path_buf(),
            version: version.to_string(),
            looked,
        }
    })
}

/// The driver's NVML, `name` (`libnvidia-ml.so.1`), in the first library
/// directory under the driver root `root` (as the plugin sees it) that has
/// it: a host driver's (`/`) or a driver container's (the GPU Operator's
/// `/run/nvidia/driver`), whose libraries the plugin's image does not have.
///
/// # Errors
/// [`DriverRootError::NoNvml`], naming every path looked at.
pub fn find_nvml(root: &Path, name: &str) -> Result<PathBuf, DriverRootError> {
    find_library(root, name).map_err(|looked| DriverRootError::NoNvml {
        root: root.to_path_buf(),
        name: name.to_string(),
        looked,
    })
}

/// Libraries: every regular file `*.so.<version>` in `dir` (beside
/// libcuda), by name.
fn driver_libraries(dir: &Path, version: &str) -> Result<Vec<String>, DriverRootError> {
    let suffix = format!(".so.{version}");
    let mut libs: Vec<String> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(&suffix))
        .collect();
    libs.sort();
    Ok(libs)
}

/// The Container Toolkit's hooks, as NVIDIA's specs run them: the soname
/// `links` created, CUDA compat enabled, the ld.so cache updated for
/// `lib_dir`, device-node modification disabled.
fn cdi_hooks(
    hook: &Path,
    links: &[(String, String, String)],
    version: &str,
    lib_dir: &str,
) -> Vec<Hook> {
    let path = hook.display().to_string();
    let h = |args: Vec<String>| Hook {
        hook_name: "createContainer".into(),
        path: path.clone(),
        args: std::iter::once("nvidia-cdi-hook".to_string())
            .chain(args)
            .collect(),
        env: Vec::new(),
        timeout: None,
    };
    let mut hooks = Vec::new();
    if !links.is_empty() {
        let mut args = vec!["create-symlinks".to_string()];
        for (link, target, _) in links {
            args.push("--link".into());
            args.push(format!("{target}::{lib_dir}/{link}"));
        }
        hooks.push(h(args));
    }
    hooks.push(h(vec![
        "enable-cuda-compat".into(),
        format!("--host-driver-version={version}"),
    ]));
    hooks.push(h(vec![
        "update-ldcache".into(),
        "--folder".into(),
        lib_dir.to_string(),
    ]));
    hooks.push(h(vec!["disable-device-node-modification".into()]));
    hooks
}

/// The utilities (the first of each name on the search path) and the GSP
/// firmware of `version` under `root`.
fn other_files(root: &Path, version: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = BINARIES
        .iter()
        .filter_map(|b| {
            BIN_DIRS
                .iter()
                .map(|d| root.join(d).join(b))
                .find(|p| p.is_file())
        })
        .collect();
    for fw_dir in ["lib/firmware/nvidia", "usr/lib/firmware/nvidia"] {
        let d = root.join(fw_dir).join(version);
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        let mut fw: Vec<PathBuf> = rd
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name().is_some_and(|n| {
                    let n = n.to_string_lossy();
                    n.starts_with("gsp_") && n.ends_with(".bin")
                })
            })
            .collect();
        fw.sort();
        out.extend(fw);
    }
    out
}

/// The driver's sockets under `root` that exist.
fn sockets(root: &Path) -> Vec<PathBuf> {
    SOCKETS
        .iter()
        .map(|s| root.join(s))
        .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_socket()))
        .collect()
}

/// The driver's configuration files under `root` that exist.
fn configs(root: &Path) -> Vec<PathBuf> {
    CONFIGS
        .iter()
        .map(|c| root.join(c))
        .filter(|p| p.is_file())
        .collect()
}

/// The node's driver as the last discovery found it (shared by prepares).
#[derive(Debug)]
pub(crate) struct NodeDriver {
    /// The driver's files.
    pub(crate) files: Result<Arc<DriverFiles>, Arc<DriverRootError>>,
    /// The `nvidia-caps` major.
    pub(crate) caps_major: Result<u32, Arc<DriverRootError>>,
}

impl NodeDriver {
    /// Discover for `version` (NVML's), with the caps major.
    pub(crate) fn discover(cfg: &DriverRootConfig, version: Option<&str>) -> Self {
        let files = match version {
            Some(v) => discover(cfg, v).map(Arc::new).map_err(Arc::new),
            None => Err(Arc::new(DriverRootError::NoVersion)),
        };
        Self {
            files,
            caps_major: caps_major(&cfg.proc_devices).map_err(Arc::new),
        }
    }

    /// Whether this discovery is still good: files found and still there,
    /// and the caps major found where `needs_caps` (a MIG-capable GPU).
    pub(crate) fn healthy(&self, needs_caps: bool) -> bool {
        self.files.as_ref().is_ok_and(|f| f.still_there())
            && (self.caps_major.is_ok() || !needs_caps)
    }

    /// The errors, one line each, for the log.
    pub(crate) fn problems(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Err(e) = &self.files {
            v.push(e.to_string());
        }
        if let Err(e) = &self.caps_major {
            v.push(e.to_string());
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_file_and_access_file_parse() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("devices");
        std::fs::write(
            &f,
            "Character devices:\n  1 mem\n195 nvidia-frontend\n236 nvidia-caps\n\nBlock devices:\n237 nvidia-caps\n",
        )
        .unwrap();
        assert_eq!(caps_major(&f).unwrap(), 236);
        std::fs::write(
            &f,
            "Character devices:\n195 nvidia-frontend\n\nBlock devices:\n236 nvidia-caps\n",
        )
        .unwrap();
        let e = caps_major(&f).unwrap_err().to_string();
        assert!(
            e.contains(&f.display().to_string()) && e.contains("nvidia-caps"),
            "{e}"
        );
        let acc = d.path().join("capabilities/gpu0/mig/gi1/ci0");
        std::fs::create_dir_all(&acc).unwrap();
        std::fs::write(
            acc.join("access"),
            "DeviceFileMinor: 12\nDeviceFileMode: 292\nDeviceFileModify: 1\n",
        )
        .unwrap();
        assert_eq!(cap_mode(d.path(), 0, 1, Some(0)).unwrap(), 0o444);
        let e = cap_mode(d.path(), 0, 1, None).unwrap_err().to_string();
        assert!(e.contains("gi1/access"), "{e}");
    }

    #[test]
    fn discovery_finds_the_fake_driver_and_writes_host_paths() {
        let d = tempfile::tempdir().unwrap();
        let fake =
            nvidia_ml_sim::driver_root::write_fake_driver(d.path(), "580.65.06", &[0]).unwrap();
        let cfg = DriverRootConfig {
            container_root: fake.root.clone(),
            host_root: "/run/nvidia/driver".into(),
            ..DriverRootConfig::default()
        };
        let f = discover(&cfg, "580.65.06").unwrap();
        assert_eq!(f.lib_dir, "/usr/lib/x86_64-linux-gnu");
        let m = |c: &str| f.common.mounts.iter().find(|m| m.container_path == c);
        let cuda = m("/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06").expect("libcuda mounted");
        assert_eq!(
            cuda.host_path,
            "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06"
        );
        // No hook: the soname path is a mount of the library itself.
        assert_eq!(
            m("/usr/lib/x86_64-linux-gnu/libcuda.so.1")
                .unwrap()
                .host_path,
            cuda.host_path
        );
        assert!(m("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1").is_some());
        assert!(m("/usr/bin/nvidia-smi").is_some());
        // The fake driver has the MPS control client; no workload gets it.
        assert!(fake.root.join("usr/bin/nvidia-cuda-mps-control").exists());
        assert!(
            f.common
                .mounts
                .iter()
                .all(|m| !m.container_path.contains("nvidia-cuda-mps-control")
                    && !m.host_path.contains("nvidia-cuda-mps-control")),
            "{:?}",
            f.common.mounts
        );
        assert!(m("/lib/firmware/nvidia/580.65.06/gsp_ga10x.bin").is_some());
        assert!(m("/run/nvidia-persistenced/socket").is_some());
        assert!(m("/etc/vulkan/icd.d/nvidia_icd.json").is_some());
        assert!(f.common.hooks.is_empty());
        assert!(
            f.common
                .env
                .contains(&"NVIDIA_VISIBLE_DEVICES=void".to_string())
        );
        assert!(
            f.common
                .env
                .contains(&"NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu".to_string())
        );
        if fake.device_nodes {
            let ctl = &f.common.device_nodes[0];
            assert_eq!(ctl.path, "/dev/nvidiactl");
            assert_eq!((ctl.major, ctl.minor), (Some(195), Some(255)));
            assert_eq!(
                ctl.host_path.as_deref(),
                Some("/run/nvidia/driver/dev/nvidiactl")
            );
            assert_eq!(f.gpu_node(0).major, Some(195));
        }
        // The wrong version finds nothing and says where it looked.
        let e = discover(&cfg, "999.1").unwrap_err().to_string();
        assert!(
            e.contains("libcuda.so.999.1") && e.contains("usr/lib64"),
            "{e}"
        );
    }

    #[test]
    fn with_the_hook_the_spec_runs_it_instead_of_soname_mounts() {
        let d = tempfile::tempdir().unwrap();
        let fake =
            nvidia_ml_sim::driver_root::write_fake_driver(d.path(), "580.65.06", &[]).unwrap();
        let cfg = DriverRootConfig {
            container_root: fake.root.clone(),
            nvidia_cdi_hook: Some("/usr/bin/nvidia-cdi-hook".into()),
            ..DriverRootConfig::default()
        };
        let f = discover(&cfg, "580.65.06").unwrap();
        assert!(
            !f.common
                .mounts
                .iter()
                .any(|m| m.container_path.ends_with("libcuda.so.1"))
        );
        let args: Vec<Vec<String>> = f.common.hooks.iter().map(|h| h.args.clone()).collect();
        assert!(
            f.common
                .hooks
                .iter()
                .all(|h| h.hook_name == "createContainer" && h.path == "/usr/bin/nvidia-cdi-hook")
        );
        let create = &args[0];
        assert_eq!(create[..2], ["nvidia-cdi-hook", "create-symlinks"]);
        assert!(
            create.contains(
                &"libcuda.so.580.65.06::/usr/lib/x86_64-linux-gnu/libcuda.so.1".to_string()
            )
        );
        assert!(create.contains(&"libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so".to_string()));
        assert!(args.contains(&vec![
            "nvidia-cdi-hook".into(),
            "enable-cuda-compat".into(),
            "--host-driver-version=580.65.06".into()
        ]));
        assert!(args.contains(&vec![
            "nvidia-cdi-hook".into(),
            "update-ldcache".into(),
            "--folder".into(),
            "/usr/lib/x86_64-linux-gnu".into()
        ]));
        assert!(args.contains(&vec![
            "nvidia-cdi-hook".into(),
            "disable-device-node-modification".into()
        ]));
    }
}
