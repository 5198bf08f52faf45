//! `carve simulate`: one simulated GPU node, end to end. The NVML simulator,
//! the real `carve kubelet-plugin` (a child process of this executable on real
//! Unix sockets), the API-server stand-in (in-process), the offline allocator
//! acting as the scheduler, and a fake kubelet: every claim is allocated,
//! prepared, shown on a picture of the GPUs, then released, and the run ends
//! by checking that no GPU instance and no MPS control daemon is left.
//!
//! MPS shares run on the fake `nvidia-cuda-mps-control` ([`carve_mps::fake`]:
//! this executable under that name, through a link in the temporary
//! directory), with a fake cgroup v2 tree standing in for `/sys/fs/cgroup`.
//! What simulate shows of a share (daemon, limits, enforcement, container
//! edits) is read back from what the plugin wrote and what the fake daemon
//! received, not computed here.
//!
//! It is not a cluster: one node, no scheduler scoring, no kubelet beyond
//! registration, prepare and unprepare; each claim is reserved for a made-up
//! pod that is only a UID and a cgroup directory. Claims that do not fit, or
//! whose device class has no published device, are reported and do not fail
//! the run (exit 0); a failed prepare or unprepare, an MPS share the plugin
//! did not set up as it reported, a leaked GPU instance, CDI spec or MPS
//! daemon, and bad input do (exit 1).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail};
use carve_alloc::{AllocError, Allocator, Inputs, Object};
use carve_apiserver::{ApiServer, KubeVersion, Options, Resource, Store};
use carve_model::names::DeviceName;
use carve_model::sharing::Sharing;
use carve_model::slices::{self, KubeLayout};
use carve_model::{DRIVER_NAME, GpuModel, GpuSpec};
use carve_mps::{ClientSpec, DaemonIdentity};
use carve_plugin::ClaimRef;
use carve_plugin::testing::FakeKubelet;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use nvidia_ml_sim::{GpuEntry, SimConfig, SimState};

use crate::render::{GpuPicture, Held, Whole, to_svg};

/// Node name of the simulated node (also its pool name).
const NODE: &str = "sim-node";
/// Namespace of claims that name none.
const DEFAULT_NAMESPACE: &str = "default";
/// File name of the NVML simulator library.
const SIM_LIB: &str = "libnvidia_ml_sim.so";
/// How often readiness is polled.
const POLL: Duration = Duration::from_millis(20);
/// How long the plugin may take to publish and register.
const READY_DEADLINE: Duration = Duration::from_secs(60);
/// Lines of the plugin log shown when it fails.
const LOG_TAIL: usize = 30;
/// Lines of an allocator explanation shown for a claim that does not fit.
const EXPLAIN_LINES: usize = 8;

/// The example claims, embedded so the binary works from any directory, in
/// the order they are applied: each is allocated next to the ones before it,
/// as a scheduler sees claims arriving in this order. The one with a
/// same-GPU constraint comes early; applied after `mig-by-memory` and
/// `mig-first-available` it does not fit on the default node (the static
/// device order spreads those two over both H100s). The MIG claims fill both
/// H100s but for a 2g.20gb placement at slice 0 of the second, where
/// `mig-mps` (a Pod and its ResourceClaimTemplate) goes last; `whole-gpu`,
/// the two MPS shares (one GPU, one daemon) and `timeslice` each need a GPU
/// of their own: the A100s.
/// Built-in examples that stay pending by design, and why: their pending is
/// the result they show, not a failure of the run.
const STAYS_PENDING: &[(&str, &str)] = &[(
    "examples/mps-hard-limit/claim.yaml",
    "no carve device publishes mpsMemoryLimit hard, so a claim that demands it stays pending",
)];

const EXAMPLES: &[(&str, &str)] = &[
    (
        "examples/mig-1g/claim.yaml",
        include_str!("../../../examples/mig-1g/claim.yaml"),
    ),
    (
        "examples/mig-same-parent/claim.yaml",
        include_str!("../../../examples/mig-same-parent/claim.yaml"),
    ),
    (
        "examples/mig-by-memory/claim.yaml",
        include_str!("../../../examples/mig-by-memory/claim.yaml"),
    ),
    (
        "examples/mig-first-available/claim.yaml",
        include_str!("../../../examples/mig-first-available/claim.yaml"),
    ),
    (
        "examples/whole-gpu/claim.yaml",
        include_str!("../../../examples/whole-gpu/claim.yaml"),
    ),
    (
        "examples/mps-share/claim.yaml",
        include_str!("../../../examples/mps-share/claim.yaml"),
    ),
    (
        "examples/mps-hard-limit/claim.yaml",
        include_str!("../../../examples/mps-hard-limit/claim.yaml"),
    ),
    (
        "examples/timeslice/claim.yaml",
        include_str!("../../../examples/timeslice/claim.yaml"),
    ),
    (
        "examples/mig-mps/pod.yaml",
        include_str!("../../../examples/mig-mps/pod.yaml"),
    ),
];

#[derive(Debug, clap::Args)]
pub struct SimulateArgs {
    /// GPUs of the simulated node: `model:count[,model:count]` (see `carve models`).
    /// Every GPU starts with MIG mode off: on Hopper and newer the plugin turns it
    /// on when a claim needs it; an Ampere GPU (where that needs a reset) is
    /// published as a whole GPU only. The default has room for every example: the
    /// MIG ones and the MIG-MPS share on the H100s, the whole GPU, the MPS shares
    /// and the time-sliced GPU on one A100 each.
    #[arg(long, default_value = "h100-80gb:2,a100-40gb:3")]
    pub gpus: String,
    /// Shared devices the plugin publishes besides MIG partitions and whole GPUs
    /// (its `--sharing`): `mps` (MPS shares of a whole GPU), `mig-mps` (of a MIG
    /// partition), `timeslice`, or `none`. MPS runs on a fake
    /// `nvidia-cuda-mps-control` and a fake cgroup tree.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_values = ["mps", "mig-mps", "timeslice"]
    )]
    pub sharing: Vec<SimSharing>,
    /// MPS control protocol the plugin uses (its `--mps-protocol`): `v3` gives
    /// each share a namespace with its limits, which the pod reaches through
    /// the namespace's own pipe directory; `v2` leaves the per-share limits to
    /// client variables; `auto` takes the strongest.
    #[arg(long, value_enum, default_value = "auto")]
    pub mps_protocol: MpsProtocol,
    /// Claims to apply instead of the built-in examples: a directory of YAML files
    /// (`*.yaml`, `*.yml`) or of subdirectories holding `claim.yaml` or `pod.yaml`,
    /// applied in name order. They hold ResourceClaims, or ResourceClaimTemplates
    /// and the Pods that name them (the claim is then reserved for that pod).
    /// DeviceClasses found there are added to the built-in ones.
    #[arg(long)]
    pub claims: Option<PathBuf>,
    /// Kubernetes version the API-server stand-in reports (decides the slice layout).
    #[arg(long, default_value = "1.35", value_parser = crate::parse_kube_version)]
    pub kube_version: KubeVersion,
    /// Keep the temporary directory (sockets, CDI specs, checkpoint, simulator
    /// state, plugin log) and print its path.
    #[arg(long)]
    pub keep: bool,
    /// Stop once every claim is prepared and keep that state to inspect: the
    /// GPU instances in the simulator's state, the CDI specs, the checkpoint
    /// (implies `--keep`; nothing is released, MPS daemons are stopped).
    #[arg(long)]
    pub no_release: bool,
    /// Also write the picture of the GPUs as SVG to this file (atomically).
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// The NVML simulator library. Default: the newer of `libnvidia_ml_sim.so`
    /// next to this executable and in its `deps/` directory (where cargo builds it).
    #[arg(long)]
    pub nvml_sim_lib: Option<PathBuf>,
}

/// A kind of shared device for `--sharing`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SimSharing {
    /// MPS shares of a whole GPU.
    Mps,
    /// MPS shares of a MIG partition.
    MigMps,
    /// Time-sliced whole GPUs.
    Timeslice,
    /// No shared devices.
    None,
}

fn sharing_list(kinds: &[SimSharing]) -> String {
    kinds
        .iter()
        .map(|k| k.flag().unwrap_or("none"))
        .collect::<Vec<_>>()
        .join(",")
}

impl SimSharing {
    fn flag(self) -> Option<&'static str> {
        match self {
            Self::Mps => Some("mps"),
            Self::MigMps => Some("mig-mps"),
            Self::Timeslice => Some("timeslice"),
            Self::None => None,
        }
    }
}

/// `--mps-protocol`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MpsProtocol {
    /// The strongest the fake supports (v3).
    Auto,
    /// Legacy: daemon-wide defaults and client variables.
    V2,
    /// A namespace per share, reached through its own pipe directory.
    V3,
}

impl MpsProtocol {
    fn flag(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::V2 => "v2",
            Self::V3 => "v3",
        }
    }
}

/// A claim and where it came from.
#[derive(Debug, Clone)]
struct SourcedClaim {
    /// File it was read from (`examples/...` for the built-in ones).
    source: String,
    /// The claim, namespace filled in.
    claim: ResourceClaim,
    /// The Pod of the same file whose `spec.resourceClaims` names it (the
    /// claim is reserved for it); `None`: a made-up `<claim>-pod`.
    pod: Option<String>,
}

impl SourcedClaim {
    fn name(&self) -> &str {
        self.claim.metadata.name.as_deref().unwrap_or_default()
    }

    fn namespace(&self) -> &str {
        self.claim
            .metadata
            .namespace
            .as_deref()
            .unwrap_or(DEFAULT_NAMESPACE)
    }

    fn label(&self) -> String {
        format!("{}/{} ({})", self.namespace(), self.name(), self.source)
    }
}

/// Claims to apply and the DeviceClasses to create.
#[derive(Debug)]
struct ClaimSet {
    claims: Vec<SourcedClaim>,
    classes: Vec<DeviceClass>,
}

/// Run `carve simulate`.
pub fn run(args: &SimulateArgs) -> anyhow::Result<ExitCode> {
    let models =
        slices::parse_gpu_spec(&args.gpus).with_context(|| format!("--gpus {:?}", args.gpus))?;
    // The layout's error names the version.
    KubeLayout::for_version(args.kube_version.major, args.kube_version.minor)
        .context("--kube-version")?;
    if args.sharing.contains(&SimSharing::None) && args.sharing.len() > 1 {
        bail!(
            "--sharing none cannot be combined with other kinds (got {})",
            sharing_list(&args.sharing)
        );
    }
    let set = load_claims(args.claims.as_deref())?;
    if let Some(svg) = &args.svg {
        check_output_dir(svg)?;
    }
    let lib = find_sim_lib(args.nvml_sim_lib.as_deref())?;
    let exe = std::env::current_exe()
        .context("locating this executable (to run `carve kubelet-plugin`)")?;
    let node = Node::create(&models, &lib, &exe)?;
    let keep = args.keep || args.no_release;
    if keep {
        say(&format!(
            "temporary directory (kept): {}",
            node.dir.path().display()
        ));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let result = rt.block_on(simulate(args, &node, &set, &exe));
    drop(rt);
    if keep {
        let path = node.dir.keep();
        say(&format!("kept {}", path.display()));
    }
    result
}

/// How a run ended: every claim the user asked for prepared (0), or some
/// did not fit or found no device (1, after everything was released).
fn exit_code(unplaced: &[String]) -> ExitCode {
    if unplaced.is_empty() {
        return ExitCode::SUCCESS;
    }
    say("");
    say(&format!(
        "not prepared: {} claim(s) did not fit or found no device: {}",
        unplaced.len(),
        unplaced.join(", ")
    ));
    ExitCode::from(1)
}

/// Writes a line to stdout; a closed stdout (`| head`) is not an error.
fn say(line: &str) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{line}");
}

fn check_output_dir(file: &Path) -> anyhow::Result<()> {
    let dir = match file.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        bail!(
            "--svg {}: directory {} does not exist",
            file.display(),
            dir.display()
        );
    }
    Ok(())
}

/// Write `bytes` to `path` through a temporary file in the same directory and
/// a rename: readers see the old file or the new one, never half of one.
fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp.{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let res = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res.with_context(|| format!("writing {}", path.display()))
}

// === claims ===

fn embedded_classes() -> anyhow::Result<Vec<DeviceClass>> {
    let objs = carve_alloc::parse_yaml_documents(
        Path::new("examples/deviceclasses.yaml"),
        crate::explain::DEVICE_CLASSES,
    )?;
    Ok(objs
        .into_iter()
        .filter_map(|o| match o {
            Object::Class(c) => Some(c),
            _ => None,
        })
        .collect())
}

/// The claims to apply: the built-in examples, or those under `dir`.
fn load_claims(dir: Option<&Path>) -> anyhow::Result<ClaimSet> {
    let mut set = ClaimSet {
        claims: Vec::new(),
        classes: embedded_classes()?,
    };
    match dir {
        None => {
            for (source, text) in EXAMPLES {
                let objs = carve_alloc::parse_yaml_documents(Path::new(source), text)?;
                add_objects(&mut set, source, objs)?;
            }
        }
        Some(dir) => {
            for file in claim_files(dir)? {
                let objs = carve_alloc::load_yaml_documents(&file)?;
                add_objects(&mut set, &file.display().to_string(), objs)?;
            }
            if set.claims.is_empty() {
                bail!(
                    "--claims {}: no ResourceClaim found, nor a ResourceClaimTemplate (looked in *.yaml and *.yml files and in */claim.yaml and */pod.yaml)",
                    dir.display()
                );
            }
        }
    }
    Ok(set)
}

/// `dir/*.yaml`, `dir/*.yml`, `dir/*/claim.yaml` and `dir/*/pod.yaml`, in
/// name order.
fn claim_files(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let rd = std::fs::read_dir(dir)
        .with_context(|| format!("--claims {}: cannot read the directory", dir.display()))?;
    let mut entries = Vec::new();
    for e in rd {
        let e = e.with_context(|| format!("--claims {}: reading the directory", dir.display()))?;
        entries.push(e.path());
    }
    entries.sort();
    let mut files = Vec::new();
    for p in entries {
        if p.is_dir() {
            for name in ["claim.yaml", "pod.yaml"] {
                let c = p.join(name);
                if c.is_file() {
                    files.push(c);
                }
            }
        } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
            files.push(p);
        }
    }
    Ok(files)
}

fn add_objects(set: &mut ClaimSet, source: &str, objs: Vec<Object>) -> anyhow::Result<()> {
    let first = set.claims.len();
    let mut pods = Vec::new();
    for (k, o) in objs.into_iter().enumerate() {
        match o {
            Object::Pod(p) => pods.push(*p),
            Object::Claim(mut c) => {
                if c.metadata.name.as_deref().unwrap_or_default().is_empty() {
                    bail!("{source}: ResourceClaim #{k}: field metadata.name is missing");
                }
                if c.metadata
                    .namespace
                    .as_deref()
                    .unwrap_or_default()
                    .is_empty()
                {
                    c.metadata.namespace = Some(DEFAULT_NAMESPACE.into());
                }
                if c.status.is_some() {
                    bail!(
                        "{source}: ResourceClaim {}: field status is set; simulate allocates claims itself",
                        c.metadata.name.as_deref().unwrap_or_default()
                    );
                }
                let new = SourcedClaim {
                    source: source.to_string(),
                    claim: c,
                    pod: None,
                };
                if let Some(old) = set
                    .claims
                    .iter()
                    .find(|o| o.name() == new.name() && o.namespace() == new.namespace())
                {
                    bail!(
                        "{source}: ResourceClaim {}/{} is also defined in {}",
                        new.namespace(),
                        new.name(),
                        old.source
                    );
                }
                set.claims.push(new);
            }
            Object::Class(c) => {
                set.classes.retain(|x| x.metadata.name != c.metadata.name);
                set.classes.push(c);
            }
            Object::Slice(s) => bail!(
                "{source}: ResourceSlice {}: simulate publishes the node's slices itself (through the plugin); remove it",
                s.metadata.name.as_deref().unwrap_or_default()
            ),
        }
    }
    for pod in &pods {
        reserve_for_pod(&mut set.claims[first..], source, pod)?;
    }
    Ok(())
}

/// Reserve the claims a Pod of `source` names (`spec.resourceClaims`, by
/// template or claim name, in the pod's namespace) for that pod. A name that
/// is not among the file's claims and templates is an error: the pod would
/// never start.
fn reserve_for_pod(
    claims: &mut [SourcedClaim],
    source: &str,
    pod: &k8s_openapi::api::core::v1::Pod,
) -> anyhow::Result<()> {
    let Some(name) = pod.metadata.name.as_deref().filter(|n| !n.is_empty()) else {
        bail!("{source}: Pod: field metadata.name is missing");
    };
    let namespace = pod
        .metadata
        .namespace
        .as_deref()
        .filter(|n| !n.is_empty())
        .unwrap_or(DEFAULT_NAMESPACE);
    let refs = pod
        .spec
        .as_ref()
        .and_then(|s| s.resource_claims.as_ref())
        .map(Vec::as_slice)
        .unwrap_or_default();
    if refs.is_empty() {
        bail!("{source}: Pod {namespace}/{name}: spec.resourceClaims is empty; it uses no claim");
    }
    for (i, r) in refs.iter().enumerate() {
        let target = r
            .resource_claim_template_name
            .as_deref()
            .or(r.resource_claim_name.as_deref())
            .ok_or_else(|| {
                anyhow!(
                    "{source}: Pod {namespace}/{name}: spec.resourceClaims[{i}] ({}) names neither resourceClaimTemplateName nor resourceClaimName",
                    r.name
                )
            })?;
        let claim = claims
            .iter_mut()
            .find(|c| c.name() == target && c.namespace() == namespace)
            .ok_or_else(|| {
                anyhow!(
                    "{source}: Pod {namespace}/{name}: spec.resourceClaims[{i}] ({}) names {target}, which is not a ResourceClaim or ResourceClaimTemplate of this file",
                    r.name
                )
            })?;
        if let Some(other) = &claim.pod {
            bail!(
                "{source}: Pod {namespace}/{name}: claim {target} is already used by Pod {other}; simulate gives each pod's claim its own template"
            );
        }
        claim.pod = Some(name.to_string());
    }
    Ok(())
}

/// The DeviceClasses a claim's requests name, in order, without repeats.
fn claim_classes(c: &ResourceClaim) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let requests = c.spec.devices.as_ref().and_then(|d| d.requests.as_ref());
    for r in requests.into_iter().flatten() {
        let names = r.exactly.iter().map(|e| e.device_class_name.clone()).chain(
            r.first_available
                .iter()
                .flatten()
                .map(|s| s.device_class_name.clone()),
        );
        for n in names {
            if !out.contains(&n) {
                out.push(n);
            }
        }
    }
    out
}

// === the simulator library and the node's files ===

/// The NVML simulator library: `explicit`, or the newer of the copies next to
/// this executable and in its `deps/` directory.
pub fn find_sim_lib(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = explicit {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(anyhow!("--nvml-sim-lib {}: no such file", p.display()))
        };
    }
    let exe = std::env::current_exe().context("locating this executable")?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    let candidates = [dir.join(SIM_LIB), dir.join("deps").join(SIM_LIB)];
    find_newest_file(&candidates)
}

/// The newest of `candidates` that exist: cargo rebuilds `deps/` with every
/// build of `carve`, while a copy next to the executable may be left over
/// from an older direct build of the simulator.
fn find_newest_file(candidates: &[PathBuf]) -> anyhow::Result<PathBuf> {
    let mtime = |p: &PathBuf| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    candidates
        .iter()
        .filter(|p| p.is_file())
        .max_by_key(|p| mtime(p))
        .cloned()
        .ok_or_else(|| {
            let looked: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
            anyhow!(
                "NVML simulator library {SIM_LIB} not found; looked at {}. Build it with `cargo build -p carve` (it builds carve-nvml-sim) or pass --nvml-sim-lib PATH",
                looked.join(" and ")
            )
        })
}

/// The simulated node's directories and simulator configuration, under a
/// temporary directory removed on drop.
#[derive(Debug)]
struct Node {
    dir: tempfile::TempDir,
    plugins_dir: PathBuf,
    registry_dir: PathBuf,
    cdi_dir: PathBuf,
    state_dir: PathBuf,
    /// Private copy of the simulator library.
    nvml_lib: PathBuf,
    /// Its side-car configuration `<lib>.json`.
    sim_config_path: PathBuf,
    sim: SimConfig,
    /// Spec of each GPU, by index.
    specs: Vec<GpuSpec>,
    /// MIG mode each GPU starts with, by index.
    mig_at_start: Vec<bool>,
    /// The models as given (`h100-80gb:2,...`), canonical keys.
    models: Vec<(String, u32)>,
    /// `bin/carve-fake-mps-control`: a link to this executable, the plugin's
    /// `--mps-control`.
    fake_mps: PathBuf,
    /// The fake cgroup v2 root (`--cgroup-root`), with the made-up pods' cgroups.
    cgroup_root: PathBuf,
    /// The fake driver root and `/proc/devices` (`--container-driver-root`,
    /// `--proc-devices`).
    driver: nvidia_ml_sim::driver_root::FakeDriver,
    /// MPS daemons seen during the run: unit, identity.
    daemons_seen: Mutex<BTreeSet<(String, u32, u64)>>,
}

impl Node {
    fn create(models: &[(String, u32)], lib: &Path, exe: &Path) -> anyhow::Result<Self> {
        let tmp = std::env::temp_dir();
        // A short base path: socket paths must fit in sockaddr_un (108 bytes).
        let dir = tempfile::Builder::new()
            .prefix("carve-sim-")
            .tempdir_in(&tmp)
            .with_context(|| format!("creating a temporary directory in {}", tmp.display()))?;
        let root = dir.path().to_path_buf();
        let sub = |n: &str| -> anyhow::Result<PathBuf> {
            let p = root.join(n);
            std::fs::create_dir_all(&p).with_context(|| format!("creating {}", p.display()))?;
            Ok(p)
        };
        let plugins_dir = sub("plugins")?;
        let registry_dir = sub("registry")?;
        let cdi_dir = sub("cdi")?;
        let state_dir = sub("state")?;
        let lib_dir = sub("lib")?;
        let sim_dir = sub("sim")?;
        let fake_mps = sub("bin")?.join(carve_mps::fake::PROGRAM);
        std::os::unix::fs::symlink(exe, &fake_mps)
            .with_context(|| format!("linking {} to {}", fake_mps.display(), exe.display()))?;
        let cgroup_root = sub("cgroup")?;
        let controllers = cgroup_root.join("cgroup.controllers");
        std::fs::write(&controllers, "cpu memory pids\n")
            .with_context(|| format!("writing {}", controllers.display()))?;
        let nvml_lib = lib_dir.join(SIM_LIB);
        std::fs::copy(lib, &nvml_lib)
            .with_context(|| format!("copying {} to {}", lib.display(), nvml_lib.display()))?;
        let mut specs = Vec::new();
        let mut entries = Vec::new();
        for (key, count) in models {
            let model = GpuModel::find(key).ok_or_else(|| anyhow!("unknown GPU model {key:?}"))?;
            let spec = model.spec();
            entries.push(GpuEntry::new(model.key, *count, false));
            specs.extend(std::iter::repeat_n(spec, *count as usize));
        }
        let sim = SimConfig::new(NODE, entries, &sim_dir);
        // What a node's driver root and /proc/devices hold, for the specs.
        let minors: Vec<u32> = (0..u32::try_from(specs.len()).unwrap_or(0)).collect();
        let driver =
            nvidia_ml_sim::driver_root::write_fake_driver(&root, &sim.driver_version, &minors)
                .context("writing the fake NVIDIA driver root")?;
        let mig_at_start = sim.initial_mig();
        let mut cfg = nvml_lib.as_os_str().to_owned();
        cfg.push(nvidia_ml_sim::SIDECAR_SUFFIX);
        let sim_config_path = PathBuf::from(cfg);
        sim.to_file(&sim_config_path)?;
        Ok(Self {
            dir,
            plugins_dir,
            registry_dir,
            cdi_dir,
            state_dir,
            nvml_lib,
            sim_config_path,
            sim,
            specs,
            mig_at_start,
            models: models.to_vec(),
            fake_mps,
            cgroup_root,
            driver,
            daemons_seen: Mutex::new(BTreeSet::new()),
        })
    }

    /// `<state-dir>/mps`: one directory per MPS unit (device).
    fn mps_root(&self) -> PathBuf {
        self.state_dir.join("mps")
    }

    /// `path` relative to the temporary directory, for shorter lines.
    fn short(&self, path: &Path) -> String {
        path.strip_prefix(self.dir.path())
            .unwrap_or(path)
            .display()
            .to_string()
    }

    fn registration_socket(&self) -> PathBuf {
        self.registry_dir.join(format!("{DRIVER_NAME}-reg.sock"))
    }

    fn plugin_log(&self) -> PathBuf {
        self.dir.path().join("plugin.log")
    }

    /// The `carve kubelet-plugin` command line.
    fn plugin_args(&self, api_url: &str, args: &SimulateArgs) -> Vec<std::ffi::OsString> {
        let mut v: Vec<std::ffi::OsString> = Vec::new();
        let mut arg = |k: &str, val: &std::ffi::OsStr| {
            v.push(k.into());
            v.push(val.to_owned());
        };
        arg("--node-name", NODE.as_ref());
        arg("--plugins-dir", self.plugins_dir.as_os_str());
        arg("--registry-dir", self.registry_dir.as_os_str());
        arg("--cdi-dir", self.cdi_dir.as_os_str());
        arg("--state-dir", self.state_dir.as_os_str());
        arg("--proc-driver-nvidia", self.sim.proc_root.as_os_str());
        arg("--container-driver-root", self.driver.root.as_os_str());
        arg("--host-driver-root", self.driver.root.as_os_str());
        arg("--proc-devices", self.driver.devices_file.as_os_str());
        arg("--nvml-lib", self.nvml_lib.as_os_str());
        arg("--kube-api-url", api_url.as_ref());
        arg("--metrics-addr", "127.0.0.1:0".as_ref());
        let mut kinds: Vec<&str> = args.sharing.iter().filter_map(|k| k.flag()).collect();
        kinds.dedup();
        if !kinds.is_empty() {
            arg("--sharing", kinds.join(",").as_ref());
        }
        if args
            .sharing
            .iter()
            .any(|k| matches!(k, SimSharing::Mps | SimSharing::MigMps))
        {
            arg("--mps-control", self.fake_mps.as_os_str());
            arg("--mps-protocol", args.mps_protocol.flag().as_ref());
            arg("--cgroup-root", self.cgroup_root.as_os_str());
        }
        let mut out: Vec<std::ffi::OsString> = vec!["kubelet-plugin".into()];
        out.extend(v);
        out
    }

    fn models_label(&self) -> String {
        let v: Vec<String> = self
            .models
            .iter()
            .map(|(k, n)| format!("{k}:{n}"))
            .collect();
        v.join(",")
    }
}

// === the plugin process ===

/// The `carve kubelet-plugin` child; killed and reaped on drop.
#[derive(Debug)]
struct Plugin {
    child: Option<Child>,
    log: PathBuf,
}

impl Plugin {
    fn spawn(exe: &Path, node: &Node, api_url: &str, args: &SimulateArgs) -> anyhow::Result<Self> {
        let log = node.plugin_log();
        let out =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out
            .try_clone()
            .with_context(|| format!("duplicating {}", log.display()))?;
        let mut cmd = Command::new(exe);
        cmd.args(node.plugin_args(api_url, args))
            .env(nvidia_ml_sim::CONFIG_ENV, &node.sim_config_path)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        if std::env::var_os("CARVE_LOG").is_none() && std::env::var_os("RUST_LOG").is_none() {
            cmd.env("CARVE_LOG", "info");
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {} kubelet-plugin", exe.display()))?;
        Ok(Self {
            child: Some(child),
            log,
        })
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Kill (if still running) and reap.
    fn stop(&mut self) -> Option<ExitStatus> {
        let mut c = self.child.take()?;
        let _ = c.kill();
        c.wait().ok()
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let from = lines.len().saturating_sub(LOG_TAIL);
        let mut out = format!(
            "last {} line(s) of {}:",
            lines.len() - from,
            self.log.display()
        );
        for l in &lines[from..] {
            let _ = write!(out, "\n  {l}");
        }
        out
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The node's complete ResourceSlice pool in the stand-in, if published: every
/// slice of the newest generation, as many as `resourceSliceCount` says.
fn published_pool(store: &Store) -> anyhow::Result<Option<Vec<ResourceSlice>>> {
    let mut found = Vec::new();
    for v in store.list(Resource::ResourceSlices) {
        let s: ResourceSlice = serde_json::from_value(v)
            .context("a ResourceSlice in the API-server stand-in does not decode")?;
        if s.spec.pool.name == NODE && s.spec.driver == DRIVER_NAME {
            found.push(s);
        }
    }
    let Some(generation) = found.iter().map(|s| s.spec.pool.generation).max() else {
        return Ok(None);
    };
    found.retain(|s| s.spec.pool.generation == generation);
    let want = found
        .first()
        .map_or(0, |s| s.spec.pool.resource_slice_count);
    Ok((i64::try_from(found.len()).ok() == Some(want)).then_some(found))
}

/// Polls until the plugin has published the node's slices and created its
/// registration socket; fails with its log if it exits or takes too long.
async fn wait_ready(
    plugin: &mut Plugin,
    store: &Store,
    socket: &Path,
) -> anyhow::Result<Vec<ResourceSlice>> {
    let start = Instant::now();
    loop {
        let pool = published_pool(store)?;
        if socket.exists()
            && let Some(p) = pool
        {
            return Ok(p);
        }
        if let Some(status) = plugin.exited() {
            bail!(
                "carve kubelet-plugin exited ({status}) before it was ready; {}",
                plugin.log_tail()
            );
        }
        if start.elapsed() > READY_DEADLINE {
            bail!(
                "carve kubelet-plugin was not ready after {READY_DEADLINE:?} (registration socket {}: {}; ResourceSlices published: {}); {}",
                socket.display(),
                if socket.exists() { "present" } else { "absent" },
                if published_pool(store)?.is_some() {
                    "yes"
                } else {
                    "no"
                },
                plugin.log_tail()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

// === the run ===

/// One device of a prepared claim.
#[derive(Debug, Clone)]
struct PreparedDevice {
    /// Request (`req` or `req/sub`) it was allocated for.
    request: String,
    /// Device name.
    device: String,
    /// CDI ids from NodePrepareResources.
    cdi_ids: Vec<String>,
    /// `status.devices[].data` the plugin wrote, if any.
    data: Option<serde_json::Value>,
    /// `shareID` of the allocation result (shareable devices).
    share_id: Option<String>,
    /// For an MPS share: what the plugin and the daemon say about it.
    mps: Option<MpsShare>,
}

/// The claim once the plugin's `status.devices` names every result of this
/// driver, or as it is after [`carve_plugin::STATUS_SETTLE`]: the plugin
/// writes the status after its prepare returned (a missing entry is then
/// reported by the caller).
async fn read_back(
    api: &Api<ResourceClaim>,
    name: &str,
    results: &[k8s_openapi::api::resource::v1::DeviceRequestAllocationResult],
) -> kube::Result<ResourceClaim> {
    let deadline = std::time::Instant::now() + carve_plugin::STATUS_SETTLE;
    loop {
        let back = api.get(name).await?;
        let written = back.status.as_ref().and_then(|st| st.devices.as_ref());
        let all = results.iter().filter(|r| r.driver == DRIVER_NAME).all(|r| {
            written.into_iter().flatten().any(|d| {
                d.driver == DRIVER_NAME && d.device == r.device && d.share_id == r.share_id
            })
        });
        if all || std::time::Instant::now() >= deadline {
            return Ok(back);
        }
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}

/// The made-up pod a claim is reserved for (`status.reservedFor`): a UID and
/// a cgroup directory in the fake cgroup tree, as the kubelet creates it
/// before it prepares the pod's claims.
#[derive(Debug, Clone)]
struct Pod {
    name: String,
    uid: String,
    /// Its cgroup, relative to the cgroup root.
    cgroup: PathBuf,
}

impl Pod {
    /// The pod of claim `claim` (the Pod that names it, or a made-up
    /// `<claim>-pod`) with a fresh UID and its cgroup directory (cgroupfs
    /// driver, BestEffort QoS).
    fn create(node: &Node, claim: &SourcedClaim) -> anyhow::Result<Self> {
        let src = "/proc/sys/kernel/random/uuid";
        let uid = std::fs::read_to_string(src)
            .with_context(|| format!("reading a pod UID from {src}"))?
            .trim()
            .to_string();
        let cgroup = PathBuf::from(format!("kubepods/besteffort/pod{uid}"));
        let dir = node.cgroup_root.join(&cgroup);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self {
            name: claim
                .pod
                .clone()
                .unwrap_or_else(|| format!("{}-pod", claim.name())),
            uid,
            cgroup,
        })
    }

    /// Remove its cgroup directory (the kubelet does once the pod is gone).
    fn remove(&self, node: &Node) -> anyhow::Result<()> {
        let dir = node.cgroup_root.join(&self.cgroup);
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))
    }
}

/// A claim allocated and prepared.
#[derive(Debug, Clone)]
struct Prepared {
    source: SourcedClaim,
    /// The claim as stored, with `status.allocation` and its uid.
    stored: ResourceClaim,
    uid: String,
    /// The pod it is reserved for.
    pod: Pod,
    devices: Vec<PreparedDevice>,
}

impl Prepared {
    fn claim_ref(&self) -> ClaimRef {
        ClaimRef {
            namespace: self.source.namespace().into(),
            name: self.source.name().into(),
            uid: self.uid.clone(),
        }
    }
}

/// Everything the run works with once the plugin is up.
struct Session<'a> {
    node: &'a Node,
    client: kube::Client,
    kubelet: FakeKubelet,
    slices: Vec<ResourceSlice>,
    classes: &'a [DeviceClass],
}

impl std::fmt::Debug for Session<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("node", &self.node)
            .field("slices", &self.slices.len())
            .finish_non_exhaustive()
    }
}

async fn simulate(
    args: &SimulateArgs,
    node: &Node,
    set: &ClaimSet,
    exe: &Path,
) -> anyhow::Result<ExitCode> {
    let opts = Options {
        version: args.kube_version,
        ..Options::default()
    };
    let api = ApiServer::start(opts)
        .await
        .context("starting the API-server stand-in")?;
    // Ctrl-C drops the run: the plugin guard kills the child, and the caller
    // removes the temporary directory (GPU instances live only in there).
    let result = tokio::select! {
        r = with_api(args, &api, node, set, exe) => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
    };
    api.shutdown().await;
    result
}

async fn with_api(
    args: &SimulateArgs,
    api: &ApiServer,
    node: &Node,
    set: &ClaimSet,
    exe: &Path,
) -> anyhow::Result<ExitCode> {
    let client = api.try_client()?;
    let capi: Api<DeviceClass> = Api::all(client.clone());
    for c in &set.classes {
        capi.create(&PostParams::default(), c)
            .await
            .with_context(|| {
                format!(
                    "creating DeviceClass {}",
                    c.metadata.name.as_deref().unwrap_or_default()
                )
            })?;
    }
    say(&format!(
        "carve simulate: node {NODE} with {} GPU(s) ({}), Kubernetes {} API-server stand-in at {}",
        node.specs.len(),
        node.models_label(),
        args.kube_version,
        api.url()
    ));
    let mut plugin = Plugin::spawn(exe, node, &api.url(), args)?;
    let result = with_plugin(args, &mut plugin, api, client, node, set).await;
    plugin.stop();
    if args.no_release {
        // The prepared state stays for inspection; daemons do not outlive the run.
        for l in mps_leftovers(node) {
            say(&format!("stopped: {l}"));
        }
        return result;
    }
    let leftovers = final_check(node);
    let code = result?;
    leftovers?;
    Ok(code)
}

/// After the plugin is gone: no GPU instance, no CDI spec and no MPS daemon
/// may be left. MPS daemons outlive the plugin by design, so any left running
/// are killed after they are reported.
fn final_check(node: &Node) -> anyhow::Result<()> {
    let state = SimState::for_config(&node.sim, &node.sim_config_path)
        .context("reading the NVML simulator state")?;
    let mut left = Vec::new();
    for (g, gpu) in state.gpus.iter().enumerate() {
        for gi in &gpu.gpu_instances {
            left.push(format!(
                "gpu-{g}: GPU instance {} (profile id {}) at slice {}",
                gi.id, gi.profile_id, gi.start
            ));
        }
    }
    let cdi: Vec<String> = std::fs::read_dir(&node.cdi_dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .map(|e| e.path().display().to_string())
                .collect()
        })
        .unwrap_or_default();
    let mps = mps_leftovers(node);
    let seen: Vec<String> = node
        .daemons_seen
        .lock()
        .map(|s| {
            s.iter()
                .map(|(unit, pid, _)| format!("pid {pid} on {unit}"))
                .collect()
        })
        .unwrap_or_default();
    if left.is_empty() && cdi.is_empty() && mps.is_empty() {
        say(&format!(
            "no GPU instance left: 0 GPU instances on {} GPU(s) in the NVML simulator, no CDI spec left",
            state.gpus.len()
        ));
        say(&if seen.is_empty() {
            "no MPS daemon left (no prepared claim used one)".to_string()
        } else {
            format!(
                "no MPS daemon left: {} daemon(s) served claims ({}), all gone",
                seen.len(),
                seen.join(", ")
            )
        });
        return Ok(());
    }
    say(&format!(
        "LEFT BEHIND: {} GPU instance(s), {} CDI spec(s), {} MPS leftover(s)",
        left.len(),
        cdi.len(),
        mps.len()
    ));
    for l in left.iter().chain(&cdi).chain(&mps) {
        say(&format!("  {l}"));
    }
    bail!(
        "{} GPU instance(s), {} CDI spec(s) and {} MPS leftover(s) after every claim was released",
        left.len(),
        cdi.len(),
        mps.len()
    )
}

/// MPS daemons still running (killed here once found) and unit state that
/// still names clients: from the daemons seen during the run, every unit's
/// `state.json`, and any process running as this run's fake control binary.
fn mps_leftovers(node: &Node) -> Vec<String> {
    let mut left = Vec::new();
    let mut running: BTreeSet<u32> = BTreeSet::new();
    let seen: Vec<(String, u32, u64)> = node
        .daemons_seen
        .lock()
        .map(|s| s.iter().cloned().collect())
        .unwrap_or_default();
    for (unit, pid, start) in &seen {
        if process_alive(*pid, *start) && running.insert(*pid) {
            left.push(format!("{unit}: MPS daemon pid {pid} still running"));
        }
    }
    let mut units: Vec<PathBuf> = std::fs::read_dir(node.mps_root())
        .map(|rd| rd.filter_map(Result::ok).map(|e| e.path()).collect())
        .unwrap_or_default();
    units.sort();
    for dir in units {
        let path = dir.join("state.json");
        if !path.is_file() {
            continue;
        }
        let unit = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        match read_unit_state(&path) {
            Ok(st) => {
                if let Some(d) = &st.identity
                    && process_alive(d.pid, d.start_time)
                    && running.insert(d.pid)
                {
                    left.push(format!(
                        "{unit}: MPS daemon pid {} still running ({})",
                        d.pid,
                        node.short(&path)
                    ));
                }
                if !st.clients.is_empty() {
                    let keys: Vec<&String> = st.clients.keys().collect();
                    left.push(format!(
                        "{unit}: {} still lists {} share(s): {keys:?}",
                        node.short(&path),
                        keys.len()
                    ));
                }
            }
            Err(e) => left.push(format!("{unit}: {e}")),
        }
    }
    for pid in processes_named(&node.fake_mps) {
        if running.insert(pid) {
            left.push(format!(
                "process {pid} still running as {}",
                node.short(&node.fake_mps)
            ));
        }
    }
    for pid in &running {
        if let Ok(raw) = i32::try_from(*pid) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(raw),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
    if !running.is_empty() {
        left.push(format!(
            "killed the MPS daemon process(es) left running: {running:?}"
        ));
    }
    left
}

/// Pids of processes whose `argv[0]` is `program`.
fn processes_named(program: &Path) -> Vec<u32> {
    let want = program.as_os_str().as_encoded_bytes();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        if cmd.split(|&b| b == 0).next() == Some(want) {
            out.push(pid);
        }
    }
    out
}

async fn with_plugin(
    args: &SimulateArgs,
    plugin: &mut Plugin,
    api: &ApiServer,
    client: kube::Client,
    node: &Node,
    set: &ClaimSet,
) -> anyhow::Result<ExitCode> {
    let socket = node.registration_socket();
    let slices = wait_ready(plugin, &api.store(), &socket).await?;
    let kubelet = FakeKubelet::register(&socket, DRIVER_NAME)
        .await
        .with_context(|| {
            format!(
                "registering with the plugin at {}; {}",
                socket.display(),
                plugin.log_tail()
            )
        })?;
    say(&format!(
        "kubelet plugin (pid {}) registered as {} ({})",
        plugin.pid().unwrap_or_default(),
        kubelet.info.name,
        kubelet.info.supported_versions.join(", ")
    ));
    for w in plugin_warnings(node) {
        say(&format!("plugin: {w}"));
    }
    say("");
    say(&published_text(node, &slices));
    let s = Session {
        node,
        client,
        kubelet,
        slices,
        classes: &set.classes,
    };
    let mut prepared: Vec<Prepared> = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    let mut unplaced: Vec<String> = Vec::new();
    say("claims, in order:");
    let mut result = apply_all(&s, &set.claims, &mut prepared, &mut failures, &mut unplaced).await;
    if result.is_ok() {
        result = show_pictures(args, node, &prepared);
    }
    if args.no_release {
        result?;
        say("");
        say(&format!(
            "not released (--no-release): {} claim(s) stay prepared; CDI specs in {}, the checkpoint under {}, GPU instances in {}",
            prepared.len(),
            node.cdi_dir.display(),
            node.dir.path().join("state").display(),
            node.sim_config_path.display()
        ));
    } else {
        let released = release(&s, &prepared).await;
        result?;
        released?;
    }
    if !failures.is_empty() {
        bail!(
            "{} claim(s) failed: {}",
            failures.len(),
            failures.join("; ")
        );
    }
    Ok(exit_code(&unplaced))
}

/// The plugin's warnings and errors so far (its log), which a user of the
/// simulation should see, such as a feature gate the Kubernetes version
/// leaves off by default.
fn plugin_warnings(node: &Node) -> Vec<String> {
    std::fs::read_to_string(node.plugin_log())
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (_, rest) = l.split_once(" WARN ").or_else(|| l.split_once(" ERROR "))?;
            let level = if l.contains(" WARN ") {
                "warning"
            } else {
                "error"
            };
            Some(format!("{level}: {}", rest.trim()))
        })
        .collect()
}

/// Published devices per GPU, from the slices read back from the stand-in.
fn published_text(node: &Node, slices: &[ResourceSlice]) -> String {
    let devices: usize = slices
        .iter()
        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        .sum();
    // The 1.35+ layout puts counter sets in slices of their own.
    let counters_apart = slices.iter().any(|s| {
        s.spec
            .shared_counters
            .as_ref()
            .is_some_and(|c| !c.is_empty())
            && s.spec.devices.as_ref().is_none_or(Vec::is_empty)
    });
    let layout = if counters_apart {
        "Kubernetes 1.35+ layout: each GPU's counter set in a slice of its own, the devices in others"
    } else {
        "Kubernetes 1.34 layout: each GPU's counter set in the slice of the devices that consume it"
    };
    let mut out = format!(
        "published: {} ResourceSlice(s), {devices} device(s), {layout}",
        slices.len()
    );
    for g in slices::summarize(slices) {
        let (name, about) = match g.gpu.and_then(|i| Some((i, node.specs.get(i as usize)?))) {
            Some((i, spec)) => {
                let mig = if !spec.mig_capable {
                    "not MIG-capable"
                } else if node.mig_at_start.get(i as usize).copied().unwrap_or(false) {
                    "MIG on"
                } else if spec.architecture.mig_mode_needs_reset() {
                    "MIG off, needs a GPU reset to change: whole GPU only"
                } else {
                    "MIG off until a claim needs it"
                };
                (format!("gpu-{i}"), format!("{}, {mig}", spec.product_name))
            }
            None => ("-".to_string(), "devices of no GPU".to_string()),
        };
        // The summary counts MIG-MPS devices under their profile: listed
        // apart, so a profile's count is its MIG devices.
        let mut devices = g.devices.clone();
        let mut mig_mps: BTreeMap<String, usize> = BTreeMap::new();
        for d in slices.iter().flat_map(|s| s.spec.devices.iter().flatten()) {
            let Ok(n @ DeviceName::MigMps { .. }) = d.name.parse::<DeviceName>() else {
                continue;
            };
            if Some(n.gpu()) != g.gpu {
                continue;
            }
            let profile = d
                .attributes
                .as_ref()
                .and_then(|a| a.get("profile"))
                .and_then(|a| a.string.clone())
                .or_else(|| n.mig_placement().map(|(p, _)| p))
                .unwrap_or_default();
            if let Some(c) = devices.get_mut(&profile) {
                *c = c.saturating_sub(1);
            }
            *mig_mps.entry(profile).or_default() += 1;
        }
        devices.retain(|_, c| *c > 0);
        let list = |m: &BTreeMap<String, usize>| {
            m.iter()
                .map(|(k, v)| format!("{k}×{v}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let _ = write!(out, "\n  {name} ({about}): {}", list(&devices));
        if !mig_mps.is_empty() {
            let _ = write!(out, "; MIG-MPS {}", list(&mig_mps));
        }
    }
    out
}

async fn apply_all(
    s: &Session<'_>,
    claims: &[SourcedClaim],
    prepared: &mut Vec<Prepared>,
    failures: &mut Vec<String>,
    unplaced: &mut Vec<String>,
) -> anyhow::Result<()> {
    for c in claims {
        let allocated: Vec<ResourceClaim> = prepared.iter().map(|p| p.stored.clone()).collect();
        let inputs = Inputs {
            slices: s.slices.clone(),
            classes: s.classes.to_vec(),
            claims_allocated: allocated,
        };
        let allocation = Allocator::new(&inputs)
            .and_then(|a| a.allocate(&c.claim, NODE))
            .map_err(|e| (e, c.label()));
        let result = match allocation {
            Ok(r) => r,
            Err((AllocError::Unsatisfiable(expl), _)) => {
                let missing = classes_without_devices(s, c)?;
                if missing.is_empty() {
                    say(&format!("- {}: does not fit on {NODE} now:", c.label()));
                    // One line per reason (a false selector included: on a
                    // node without the profile it is the only reason).
                    let text = expl.to_string();
                    let lines: Vec<&str> = text.lines().skip(1).collect();
                    for l in lines.iter().take(EXPLAIN_LINES) {
                        say(&format!("  {l}"));
                    }
                    if lines.len() > EXPLAIN_LINES {
                        say(&format!(
                            "  ... {} more line(s): see `carve explain`",
                            lines.len() - EXPLAIN_LINES
                        ));
                    }
                } else {
                    say(&format!(
                        "- {}: skipped: no published device matches class {}",
                        c.label(),
                        missing.join(", ")
                    ));
                }
                match STAYS_PENDING.iter().find(|(src, _)| *src == c.source) {
                    Some((_, why)) => say(&format!("  (as expected: {why})")),
                    None => unplaced.push(c.name().to_string()),
                }
                continue;
            }
            Err((e, label)) => return Err(claim_error(e, c, &label)),
        };
        match prepare(s, c, result).await? {
            Ok(p) => {
                say(&prepared_text(s.node, &p));
                for why in p
                    .devices
                    .iter()
                    .filter_map(|d| d.mps.as_ref())
                    .flat_map(|m| &m.problems)
                {
                    failures.push(format!("{}: {why}", c.label()));
                }
                prepared.push(p);
            }
            Err(why) => {
                say(&format!("- {}: FAILED: {why}", c.label()));
                failures.push(format!("{}: {why}", c.label()));
            }
        }
    }
    Ok(())
}

/// An allocator error about claim `c`, with `label` (the claim and where it
/// came from) in front, or only the claim's file where the error names the
/// claim itself.
fn claim_error(e: AllocError, c: &SourcedClaim, label: &str) -> anyhow::Error {
    let names_claim = match &e {
        AllocError::UnknownClass { .. }
        | AllocError::InvalidClaim { .. }
        | AllocError::AlreadyFits { .. }
        | AllocError::NeverFits { .. }
        | AllocError::NoPlan { .. } => true,
        AllocError::CelCompile { owner, .. }
        | AllocError::CelTooLong { owner, .. }
        | AllocError::CelTooCostly { owner, .. }
        | AllocError::Cel { owner, .. } => owner.starts_with("claim "),
        AllocError::Unsatisfiable(_) | AllocError::InvalidSlice { .. } => false,
    };
    if names_claim {
        anyhow!(e).context(c.source.clone())
    } else {
        anyhow!(e).context(format!("claim {label}"))
    }
}

/// The claim's DeviceClasses for which no published device matches (each
/// probed with a one-device request on the empty node).
fn classes_without_devices(s: &Session<'_>, c: &SourcedClaim) -> anyhow::Result<Vec<String>> {
    let inputs = Inputs {
        slices: s.slices.clone(),
        classes: s.classes.to_vec(),
        claims_allocated: Vec::new(),
    };
    let alloc = Allocator::new(&inputs)?;
    let mut missing = Vec::new();
    for class in claim_classes(&c.claim) {
        let probe: ResourceClaim = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "class-probe", "namespace": DEFAULT_NAMESPACE},
            "spec": {"devices": {"requests": [{"name": "probe", "exactly": {"deviceClassName": class}}]}},
        }))?;
        match alloc.allocate(&probe, NODE) {
            Ok(_) => {}
            Err(AllocError::Unsatisfiable(_)) => missing.push(class),
            Err(e) => {
                // The probe claim has no selector of its own: what can go
                // wrong is the class's (its errors name it) or the slices'.
                return Err(anyhow!(e).context(format!("claim {}", c.label())));
            }
        }
    }
    Ok(missing)
}

/// Create the claim, reserve it for a new pod, write its allocation, prepare
/// it through the fake kubelet and read back what the plugin wrote.
/// `Ok(Err(why))`: the claim was not prepared (it is deleted again and its
/// pod's cgroup removed); `Err`: the run cannot go on.
async fn prepare(
    s: &Session<'_>,
    c: &SourcedClaim,
    result: k8s_openapi::api::resource::v1::AllocationResult,
) -> anyhow::Result<Result<Prepared, String>> {
    let api: Api<ResourceClaim> = Api::namespaced(s.client.clone(), c.namespace());
    let label = c.label();
    let created = api
        .create(&PostParams::default(), &c.claim)
        .await
        .with_context(|| format!("creating ResourceClaim {label}"))?;
    let uid = created
        .metadata
        .uid
        .clone()
        .ok_or_else(|| anyhow!("ResourceClaim {label}: the API server gave it no uid"))?;
    // The scheduler reserves the claim for the pod it binds; the kubelet has
    // created the pod's cgroup by the time it prepares the pod's claims.
    let pod = Pod::create(s.node, c)?;
    let patch = serde_json::json!({"status": {
        "allocation": result,
        "reservedFor": [{"resource": "pods", "name": pod.name, "uid": pod.uid}],
    }});
    let stored = api
        .patch_status(c.name(), &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .with_context(|| {
            format!("writing status.allocation and status.reservedFor of ResourceClaim {label}")
        })?;
    let r = ClaimRef {
        namespace: c.namespace().into(),
        name: c.name().into(),
        uid: uid.clone(),
    };
    let answer = s.kubelet.prepare(std::slice::from_ref(&r)).await;
    let one = match answer {
        Ok(resp) => resp.claims.get(&uid).cloned(),
        Err(e) => return abandon(s, &api, c, &pod, format!("NodePrepareResources: {e}")).await,
    };
    let one = match one {
        Some(o) if o.error.is_empty() => o,
        other => {
            let why = format!(
                "NodePrepareResources: {}",
                one_error(other.as_ref().map(|o| o.error.as_str()), &uid)
            );
            return abandon(s, &api, c, &pod, why).await;
        }
    };
    let results = stored
        .status
        .as_ref()
        .and_then(|st| st.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref());
    let back = read_back(&api, c.name(), results.map_or(&[][..], Vec::as_slice))
        .await
        .with_context(|| format!("reading ResourceClaim {label} back"))?;
    let status_devices = back.status.as_ref().and_then(|st| st.devices.as_ref());
    let mut devices = Vec::new();
    for res in results
        .into_iter()
        .flatten()
        .filter(|x| x.driver == DRIVER_NAME)
    {
        let from_kubelet = one
            .devices
            .iter()
            .find(|d| d.device_name == res.device && d.share_id == res.share_id);
        let data = status_devices
            .into_iter()
            .flatten()
            .find(|d| {
                d.driver == DRIVER_NAME && d.device == res.device && d.share_id == res.share_id
            })
            .and_then(|d| d.data.as_ref())
            .map(|d| d.0.clone());
        let cdi_ids = from_kubelet
            .map(|d| d.cdi_device_ids.clone())
            .unwrap_or_default();
        let mut dev = PreparedDevice {
            request: res.request.clone(),
            device: res.device.clone(),
            cdi_ids,
            data,
            share_id: res.share_id.clone(),
            mps: None,
        };
        if matches!(
            res.device.parse::<DeviceName>(),
            Ok(DeviceName::Mps { .. } | DeviceName::MigMps { .. })
        ) {
            dev.mps = Some(MpsShare::read(s, &uid, &pod, &dev));
        }
        devices.push(dev);
    }
    Ok(Ok(Prepared {
        source: c.clone(),
        stored,
        uid,
        pod,
        devices,
    }))
}

/// A claim that was not prepared: delete it, remove its pod's cgroup, and
/// hand back why.
async fn abandon(
    s: &Session<'_>,
    api: &Api<ResourceClaim>,
    c: &SourcedClaim,
    pod: &Pod,
    why: String,
) -> anyhow::Result<Result<Prepared, String>> {
    delete_claim(api, c).await?;
    pod.remove(s.node)?;
    Ok(Err(why))
}

/// The parts of an MPS unit's `state.json` (written by `carve_mps::MpsControl`
/// in the plugin) that simulate shows.
#[derive(Debug)]
struct UnitStateView {
    identity: Option<DaemonIdentity>,
    clients: BTreeMap<String, ClientSpec>,
}

fn read_unit_state(path: &Path) -> Result<UnitStateView, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let bad = |e: serde_json::Error| format!("{} does not decode: {e}", path.display());
    let mut v: serde_json::Value = serde_json::from_slice(&bytes).map_err(bad)?;
    let mut take = |k: &str| v.get_mut(k).map(serde_json::Value::take);
    let identity = match take("identity") {
        None | Some(serde_json::Value::Null) => None,
        Some(i) => Some(serde_json::from_value(i).map_err(bad)?),
    };
    let clients = match take("clients") {
        None | Some(serde_json::Value::Null) => BTreeMap::new(),
        Some(c) => serde_json::from_value(c).map_err(bad)?,
    };
    Ok(UnitStateView { identity, clients })
}

/// State letter and start time (`/proc/<pid>/stat` fields 3 and 22) of
/// process `pid`, if there is one.
fn process_stat(pid: u32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `comm` may hold spaces and parentheses: the fields start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some((f.first()?.chars().next()?, f.get(19)?.parse().ok()?))
}

/// Whether process `pid` runs and started at `start_time`, i.e. is not gone,
/// a zombie, or a recycled pid.
fn process_alive(pid: u32, start_time: u64) -> bool {
    matches!(process_stat(pid), Some((s, t)) if s != 'Z' && s != 'X' && t == start_time)
}

/// An MPS share as the plugin reports it in the claim's
/// `status.devices[].data.mps`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct StatusShare {
    /// The MPS unit (directory under `<state-dir>/mps`).
    unit: String,
    memory_limit_mib: u64,
    multiprocessors: u64,
    active_thread_percentage: u64,
    /// Enforcement levels (`hard` | `client`, `percentage` | `partition` | `client`).
    memory_limit: Option<String>,
    compute_limit: Option<String>,
    /// The pod cgroup the share is bound to, relative to the cgroup root.
    cgroup: Option<String>,
}

impl StatusShare {
    fn from_data(data: &serde_json::Value) -> Result<Self, String> {
        let m = data
            .get("mps")
            .ok_or("the claim's status.devices[].data has no \"mps\" entry")?;
        let num = |k: &str| {
            m.get(k)
                .and_then(serde_json::Value::as_u64)
                .ok_or_else(|| format!("status.devices[].data.mps.{k} is missing or not a number"))
        };
        let text = |k: &str| {
            m.get(k)
                .and_then(serde_json::Value::as_str)
                .map(str::to_string)
        };
        Ok(Self {
            unit: text("unit").ok_or("status.devices[].data.mps.unit is missing")?,
            memory_limit_mib: num("memoryLimitMiB")?,
            multiprocessors: num("multiprocessors")?,
            active_thread_percentage: num("activeThreadPercentage")?,
            memory_limit: text("memoryLimit"),
            compute_limit: text("computeLimit"),
            cgroup: text("cgroup"),
        })
    }
}

/// What the plugin and the fake daemon say about one MPS share, read right
/// after it was prepared: the claim status (limits, enforcement, cgroup), the
/// unit's `state.json` (daemon, and the same share as the supervisor keeps
/// it), the published device attributes, the fake daemon's log and the CDI
/// spec. Disagreements between them are problems.
#[derive(Debug, Clone, Default)]
struct MpsShare {
    /// The share as the claim status reports it.
    status: Option<StatusShare>,
    /// The unit's `state.json`, relative to the temporary directory.
    state_file: String,
    /// The daemon `state.json` names.
    daemon: Option<DaemonIdentity>,
    /// `mpsMemoryLimit` and `mpsComputeLimit` of the device as published.
    memory_level: Option<String>,
    compute_level: Option<String>,
    /// Lines of the fake daemon's log about this daemon and share.
    received: Vec<String>,
    /// Container edits per CDI id, from the claim's CDI spec file.
    cdi_edits: BTreeMap<String, String>,
    /// Where the sources disagree, or one is missing.
    problems: Vec<String>,
}

impl MpsShare {
    fn read(s: &Session<'_>, claim_uid: &str, pod: &Pod, dev: &PreparedDevice) -> Self {
        let node = s.node;
        let mut out = Self::default();
        let (memory_level, compute_level) = published_levels(&s.slices, &dev.device);
        out.memory_level = memory_level;
        out.compute_level = compute_level;
        match dev.data.as_ref().map(StatusShare::from_data) {
            Some(Ok(st)) => out.status = Some(st),
            Some(Err(e)) => out.problems.push(e),
            None => out
                .problems
                .push("the plugin wrote no status.devices entry".to_string()),
        }
        let unit_name = out
            .status
            .as_ref()
            .map_or(dev.device.clone(), |st| st.unit.clone());
        let unit = node.mps_root().join(&unit_name);
        let state_path = unit.join("state.json");
        out.state_file = node.short(&state_path);
        let Some(share_id) = dev.share_id.as_deref() else {
            out.problems
                .push("the allocation result has no shareID".to_string());
            return out;
        };
        let mut client = None;
        match read_unit_state(&state_path) {
            Ok(st) => {
                client = st
                    .clients
                    .into_values()
                    .find(|c| c.claim_uid == claim_uid && c.share_id == share_id);
                out.daemon = st.identity;
            }
            Err(e) => out.problems.push(e),
        }
        let pipe_dir = match &out.daemon {
            Some(d) => {
                if let Ok(mut seen) = node.daemons_seen.lock() {
                    seen.insert((unit_name.clone(), d.pid, d.start_time));
                }
                if !process_alive(d.pid, d.start_time) {
                    out.problems.push(format!(
                        "the MPS daemon pid {} named in {} is not running",
                        d.pid, out.state_file
                    ));
                }
                d.pipe_dir.clone()
            }
            None => {
                out.problems
                    .push(format!("{} names no running daemon", out.state_file));
                unit.join("pipe")
            }
        };
        out.check_agreement(client.as_ref(), pod, claim_uid, share_id);
        out.read_fake_log(node, &pipe_dir, claim_uid, share_id);
        out.read_cdi(node, claim_uid, &dev.cdi_ids);
        out
    }

    /// The claim status against `state.json`, the pod and the published attributes.
    fn check_agreement(
        &mut self,
        client: Option<&ClientSpec>,
        pod: &Pod,
        claim_uid: &str,
        share_id: &str,
    ) {
        let Some(c) = client else {
            self.problems.push(format!(
                "{} lists no client for claim {claim_uid} share {share_id}",
                self.state_file
            ));
            return;
        };
        let Some(st) = self.status.clone() else {
            return;
        };
        let l = &c.limits;
        let kept = (
            l.memory_limit_mib,
            u64::from(l.multiprocessors),
            u64::from(l.active_thread_percentage),
        );
        let told = (
            st.memory_limit_mib,
            st.multiprocessors,
            st.active_thread_percentage,
        );
        if kept != told {
            self.problems.push(format!(
                "limits (MiB, SMs, %) in the claim status {told:?} differ from {} {kept:?}",
                self.state_file
            ));
        }
        let kept_cgroup = c.cgroup.as_ref().map(|p| p.display().to_string());
        if kept_cgroup != st.cgroup {
            self.problems.push(format!(
                "cgroup in the claim status {:?} differs from {} {kept_cgroup:?}",
                st.cgroup, self.state_file
            ));
        }
        let pod_cgroup = pod.cgroup.display().to_string();
        match &st.cgroup {
            Some(cg) if *cg != pod_cgroup => self.problems.push(format!(
                "share bound to cgroup {cg}, but the claim's pod {} is in {pod_cgroup}",
                pod.uid
            )),
            None if st.memory_limit.as_deref() == Some("hard") => self
                .problems
                .push("memory limit hard, but the share is bound to no cgroup".to_string()),
            _ => {}
        }
        if (&st.memory_limit, &st.compute_limit) != (&self.memory_level, &self.compute_level) {
            self.problems.push(format!(
                "enforcement in the claim status (memory {:?}, compute {:?}) differs from the published device (mpsMemoryLimit {:?}, mpsComputeLimit {:?})",
                st.memory_limit, st.compute_limit, self.memory_level, self.compute_level
            ));
        }
    }

    /// The fake daemon's record: its start, and what it was told for this share.
    fn read_fake_log(&mut self, node: &Node, pipe_dir: &Path, claim_uid: &str, share_id: &str) {
        let path = pipe_dir.join(carve_mps::fake::LOG);
        let Ok(text) = std::fs::read_to_string(&path) else {
            self.problems
                .push(format!("no fake daemon log {}", node.short(&path)));
            return;
        };
        // Paths in the temporary directory as `<tmp>/...`: shorter, still absolute-looking.
        let tmp = node.dir.path().display().to_string();
        let lines: Vec<String> = text.lines().map(|l| l.replace(&tmp, "<tmp>")).collect();
        if let Some(d) = &self.daemon {
            let start = format!("start pid={} ", d.pid);
            match lines.iter().rfind(|l| l.starts_with(&start)) {
                Some(l) => self.received.push(l.clone()),
                None => self.problems.push(format!(
                    "the fake daemon's log has no start of pid {}",
                    d.pid
                )),
            }
        }
        let v3 = self
            .daemon
            .as_ref()
            .is_some_and(|d| d.protocol == carve_mps::Protocol::V3);
        let before = self.received.len();
        if v3 {
            let ns = carve_mps::control::v3::namespace_name(claim_uid, share_id);
            self.received.extend(
                lines
                    .iter()
                    .filter(|l| {
                        [
                            format!("verb namespace create {ns} "),
                            format!("verb namespace set {ns} "),
                        ]
                        .iter()
                        .any(|p| l.starts_with(p.as_str()))
                    })
                    .cloned(),
            );
        } else {
            // v2: daemon-wide defaults (the largest share); the share's own
            // limits are in its client variables.
            for cmd in [
                "cmd set_default_device_pinned_mem_limit ",
                "cmd set_default_active_thread_percentage ",
            ] {
                if let Some(l) = lines.iter().rfind(|l| l.starts_with(cmd)) {
                    self.received.push(l.clone());
                }
            }
        }
        if self.daemon.is_some() && self.received.len() == before {
            self.problems.push(format!(
                "the fake daemon's log {} has no limits for this share",
                node.short(&path)
            ));
        }
    }

    /// Each CDI id's container edits, from the claim's CDI spec file.
    fn read_cdi(&mut self, node: &Node, claim_uid: &str, cdi_ids: &[String]) {
        let path = carve_plugin::claim_spec_path(&node.cdi_dir, claim_uid);
        let spec: serde_json::Value = match std::fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
        {
            Ok(v) => v,
            Err(e) => {
                self.problems
                    .push(format!("CDI spec {}: {e}", node.short(&path)));
                return;
            }
        };
        if cdi_ids.is_empty() {
            self.problems
                .push("NodePrepareResources gave no CDI id".to_string());
        }
        let devices = spec.get("devices").and_then(serde_json::Value::as_array);
        for id in cdi_ids {
            let name = id.rsplit_once('=').map_or(id.as_str(), |(_, n)| n);
            let Some(edits) = devices
                .into_iter()
                .flatten()
                .find(|d| d.get("name").and_then(serde_json::Value::as_str) == Some(name))
                .and_then(|d| d.get("containerEdits"))
            else {
                self.problems.push(format!(
                    "CDI id {id}: no device {name:?} in {}",
                    node.short(&path)
                ));
                continue;
            };
            self.cdi_edits
                .insert(id.clone(), describe_edits(node, edits));
        }
    }
}

/// `env A=1, B=2; mount host -> container` of CDI container edits.
fn describe_edits(node: &Node, edits: &serde_json::Value) -> String {
    let strs = |k: &str| -> Vec<String> {
        edits
            .get(k)
            .and_then(serde_json::Value::as_array)
            .into_iter()
            .flatten()
            .map(|v| match v {
                serde_json::Value::String(s) => s.clone(),
                other => {
                    let get = |f: &str| other.get(f).and_then(serde_json::Value::as_str);
                    match (get("hostPath"), get("containerPath"), get("path")) {
                        (Some(h), Some(c), _) => {
                            format!("{} -> {c}", node.short(Path::new(h)))
                        }
                        (_, _, Some(p)) => p.to_string(),
                        _ => other.to_string(),
                    }
                }
            })
            .collect()
    };
    let mut parts = Vec::new();
    for (key, label) in [
        ("env", "env"),
        ("mounts", "mount"),
        ("deviceNodes", "device"),
    ] {
        let v = strs(key);
        if !v.is_empty() {
            parts.push(format!("{label} {}", v.join(", ")));
        }
    }
    if parts.is_empty() {
        "no container edits".to_string()
    } else {
        parts.join("; ")
    }
}

/// The published `mpsMemoryLimit` and `mpsComputeLimit` of `device`.
fn published_levels(slices: &[ResourceSlice], device: &str) -> (Option<String>, Option<String>) {
    let dev = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| d.name == device);
    let attr = |k: &str| {
        dev.and_then(|d| d.attributes.as_ref())
            .and_then(|a| a.get(k))
            .and_then(|a| a.string.clone())
    };
    (attr("mpsMemoryLimit"), attr("mpsComputeLimit"))
}

fn one_error(error: Option<&str>, uid: &str) -> String {
    match error {
        Some(e) => e.to_string(),
        None => format!("the answer has no entry for claim uid {uid}"),
    }
}

async fn delete_claim(api: &Api<ResourceClaim>, c: &SourcedClaim) -> anyhow::Result<()> {
    api.delete(c.name(), &DeleteParams::default())
        .await
        .with_context(|| format!("deleting ResourceClaim {}", c.label()))?;
    Ok(())
}

/// The claim's CDI spec file as JSON, if readable.
fn claim_spec(node: &Node, uid: &str) -> Option<serde_json::Value> {
    let b = std::fs::read(carve_plugin::claim_spec_path(&node.cdi_dir, uid)).ok()?;
    serde_json::from_slice(&b).ok()
}

/// The container edits of CDI device `id` in `spec`.
fn device_edits_of<'a>(
    spec: Option<&'a serde_json::Value>,
    id: &str,
) -> Option<&'a serde_json::Value> {
    let name = id.rsplit_once('=').map_or(id, |(_, n)| n);
    spec?
        .get("devices")?
        .as_array()?
        .iter()
        .find(|d| d.get("name").and_then(serde_json::Value::as_str) == Some(name))?
        .get("containerEdits")
}

/// What every container of the claim gets from the spec's common edits: the
/// environment, the driver files by container path (libraries by name), the
/// control nodes and hooks.
fn container_text(edits: &serde_json::Value) -> String {
    let list = |k: &str| {
        edits
            .get(k)
            .and_then(serde_json::Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let s = |v: &serde_json::Value, f: &str| {
        v.get(f)
            .and_then(serde_json::Value::as_str)
            .unwrap_or("?")
            .to_string()
    };
    let env: Vec<String> = list("env")
        .iter()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect();
    let (mut libs, mut links, mut files) = (0, Vec::new(), Vec::new());
    for m in list("mounts") {
        let c = s(&m, "containerPath");
        let name = c
            .rsplit_once('/')
            .map_or(c.as_str(), |(_, n)| n)
            .to_string();
        if !(name.starts_with("lib") && name.contains(".so")) {
            files.push(name);
        } else if m
            .get("hostPath")
            .and_then(serde_json::Value::as_str)
            .is_some_and(|h| h.ends_with(&name))
        {
            libs += 1;
        } else {
            links.push(name);
        }
    }
    let nodes: Vec<String> = list("deviceNodes").iter().map(|n| s(n, "path")).collect();
    let hooks: Vec<String> = list("hooks")
        .iter()
        .map(|h| {
            h.get("args")
                .and_then(serde_json::Value::as_array)
                .and_then(|a| a.get(1))
                .and_then(serde_json::Value::as_str)
                .unwrap_or("?")
                .to_string()
        })
        .collect();
    let join = |v: &[String]| {
        if v.is_empty() {
            "none".to_string()
        } else {
            v.join(", ")
        }
    };
    format!(
        "\n    container gets: env {}; devices {}; hooks {}\n      driver: {libs} libraries, also at {}; {}",
        join(&env),
        join(&nodes),
        join(&hooks),
        join(&links),
        join(&files)
    )
}

fn prepared_text(node: &Node, p: &Prepared) -> String {
    let mut out = format!("- {}: allocated and prepared", p.source.label());
    let spec = claim_spec(node, &p.uid);
    if let Some(common) = spec.as_ref().and_then(|v| v.get("containerEdits")) {
        out.push_str(&container_text(common));
    }
    for d in &p.devices {
        let _ = write!(out, "\n    request {} -> {}", d.request, d.device);
        let str_of = |k: &str| {
            d.data
                .as_ref()
                .and_then(|v| v.get(k))
                .and_then(|v| v.as_str().map(str::to_string))
        };
        let num_of = |v: Option<&serde_json::Value>| v.and_then(serde_json::Value::as_u64);
        let share = d.share_id.as_deref().unwrap_or("none");
        match (&d.data, d.device.parse::<DeviceName>()) {
            (None, _) => out.push_str(": (the plugin wrote no status.devices entry)"),
            (Some(v), Ok(DeviceName::Mig { .. })) => {
                let place = v.get("placement");
                let _ = write!(
                    out,
                    ": {} at memory slice {} (size {}), GPU instance {}, compute instance {}, {}",
                    str_of("profile").unwrap_or_else(|| "?".into()),
                    num_of(place.and_then(|p| p.get("start")))
                        .map_or_else(|| "?".into(), |n| n.to_string()),
                    num_of(place.and_then(|p| p.get("size")))
                        .map_or_else(|| "?".into(), |n| n.to_string()),
                    num_of(v.get("gpuInstanceID")).map_or_else(|| "?".into(), |n| n.to_string()),
                    num_of(v.get("computeInstanceID"))
                        .map_or_else(|| "?".into(), |n| n.to_string()),
                    str_of("uuid").unwrap_or_else(|| "no MIG UUID".into()),
                );
            }
            (Some(_), Ok(DeviceName::TimeSlice { .. })) => {
                let _ = write!(
                    out,
                    ": time-sliced GPU {}, share {share} (no memory or fault isolation)",
                    str_of("uuid").unwrap_or_else(|| "(no UUID)".into())
                );
            }
            (Some(v), Ok(DeviceName::Mps { .. } | DeviceName::MigMps { .. })) => {
                let _ = write!(
                    out,
                    ": MPS share {share} of {}",
                    str_of("uuid").unwrap_or_else(|| "(no UUID)".into())
                );
                if let Some(profile) = str_of("profile") {
                    let _ = write!(
                        out,
                        " ({profile} at memory slice {}, GPU instance {})",
                        num_of(v.get("placement").and_then(|p| p.get("start")))
                            .map_or_else(|| "?".into(), |n| n.to_string()),
                        num_of(v.get("gpuInstanceID"))
                            .map_or_else(|| "?".into(), |n| n.to_string()),
                    );
                }
            }
            (Some(_), _) => {
                let _ = write!(
                    out,
                    ": whole GPU {}",
                    str_of("uuid").unwrap_or_else(|| "(no UUID)".into())
                );
            }
        }
        if let Some(m) = &d.mps {
            out.push_str(&mps_text(node, p, m));
        }
        for id in &d.cdi_ids {
            let _ = write!(out, "\n      CDI {id}");
            if let Some(e) = d.mps.as_ref().and_then(|m| m.cdi_edits.get(id)) {
                let _ = write!(out, "\n        {e}");
            } else if let Some(e) = device_edits_of(spec.as_ref(), id) {
                let _ = write!(out, "\n        {}", describe_edits(node, e));
            }
        }
        for why in d.mps.iter().flat_map(|m| &m.problems) {
            let _ = write!(out, "\n      MPS PROBLEM: {why}");
        }
    }
    out
}

/// The lines of one MPS share: daemon, limits, enforcement, what the daemon got.
fn mps_text(node: &Node, p: &Prepared, m: &MpsShare) -> String {
    let mut out = String::new();
    match &m.daemon {
        Some(d) => {
            let _ = write!(
                out,
                "\n      daemon: pid {}, protocol {} (from {}), pipe {}",
                d.pid,
                match d.protocol {
                    carve_mps::Protocol::V2 => "v2",
                    carve_mps::Protocol::V3 => "v3",
                },
                m.state_file,
                node.short(&d.pipe_dir)
            );
        }
        None => {
            let _ = write!(out, "\n      daemon: none in {}", m.state_file);
        }
    }
    if let Some(st) = &m.status {
        let _ = write!(
            out,
            "\n      limits: memory {} MiB, {} SMs = {} % active threads; pod {}/{} (uid {}) cgroup {}",
            st.memory_limit_mib,
            st.multiprocessors,
            st.active_thread_percentage,
            p.source.namespace(),
            p.pod.name,
            p.pod.uid,
            st.cgroup.as_deref().unwrap_or("none")
        );
        let v3 = m
            .daemon
            .as_ref()
            .is_some_and(|d| d.protocol == carve_mps::Protocol::V3);
        let _ = write!(
            out,
            "\n      enforcement: memory {} ({}), compute {} ({})",
            st.memory_limit.as_deref().unwrap_or("?"),
            memory_why(st.memory_limit.as_deref(), v3),
            st.compute_limit.as_deref().unwrap_or("?"),
            compute_why(st.compute_limit.as_deref()),
        );
    }
    for l in &m.received {
        let _ = write!(out, "\n      daemon got: {l}");
    }
    out
}

/// Why a share's memory enforcement level is what it is.
fn memory_why(level: Option<&str>, v3: bool) -> &'static str {
    match (level, v3) {
        (Some("client"), true) => {
            "the namespace's pinned limit, applied by the CUDA client; a tenant can escape it, and no memory partitioning is set up"
        }
        (Some("client"), false) => {
            "the CUDA_MPS_PINNED_DEVICE_MEM_LIMIT variable, which the workload can change"
        }
        (Some("hard"), _) => "memory partitioning on the pod's cgroup",
        _ => "unknown level",
    }
}

/// Why a share's compute enforcement level is what it is.
fn compute_why(level: Option<&str>) -> &'static str {
    match level {
        Some("percentage") => {
            "the namespace's active-thread percentage, over the client's variable: a ceiling, not a reservation"
        }
        Some("client") => {
            "the CUDA_MPS_ACTIVE_THREAD_PERCENTAGE variable, which the workload can change"
        }
        Some("partition") => "static SM partitions",
        _ => "unknown level",
    }
}

/// One picture per GPU of who holds which memory slice.
fn pictures(node: &Node, prepared: &[Prepared]) -> Vec<GpuPicture> {
    let mut by_gpu: BTreeMap<u32, (Vec<Held>, Option<Whole>)> = BTreeMap::new();
    for p in prepared {
        let holder = p.source.name().to_string();
        for d in &p.devices {
            let Ok(name) = d.device.parse::<DeviceName>() else {
                continue;
            };
            let e = by_gpu.entry(name.gpu()).or_default();
            let sharing = match &name {
                DeviceName::Gpu { .. } => Some(Sharing::Exclusive),
                DeviceName::Mps { .. } => Some(Sharing::Mps),
                DeviceName::TimeSlice { .. } => Some(Sharing::Timeslice),
                DeviceName::Mig { .. } | DeviceName::MigMps { .. } => None,
            };
            if let Some(sharing) = sharing {
                let w = e.1.get_or_insert_with(|| Whole {
                    holders: Vec::new(),
                    sharing,
                });
                if !w.holders.contains(&holder) {
                    w.holders.push(holder.clone());
                }
                continue;
            }
            // What the plugin says it created, else what was allocated.
            let created = d.data.as_ref().and_then(|v| {
                let profile = v.get("profile")?.as_str()?.to_string();
                let start = u8::try_from(v.get("placement")?.get("start")?.as_u64()?).ok()?;
                Some((profile, start))
            });
            let Some((profile, start)) = created.or_else(|| name.mig_placement()) else {
                continue;
            };
            // Shares of one MIG instance through MPS: one instance, several holders.
            match e
                .0
                .iter_mut()
                .find(|h| h.profile == profile && h.start == start)
            {
                Some(h) => {
                    h.holder.push('+');
                    h.holder.push_str(&holder);
                }
                None => e.0.push(Held {
                    holder: holder.clone(),
                    profile,
                    start,
                    shared: matches!(name, DeviceName::MigMps { .. }),
                }),
            }
        }
    }
    node.specs
        .iter()
        .enumerate()
        .map(|(i, spec)| {
            let (held, whole) = u32::try_from(i)
                .ok()
                .and_then(|i| by_gpu.remove(&i))
                .unwrap_or_default();
            GpuPicture {
                name: format!("gpu-{i}"),
                spec: spec.clone(),
                held,
                whole,
            }
        })
        .collect()
}

fn show_pictures(args: &SimulateArgs, node: &Node, prepared: &[Prepared]) -> anyhow::Result<()> {
    let pics = pictures(node, prepared);
    say("");
    say(&format!(
        "GPUs with {} claim(s) prepared (letters: holders, .: free, x: stranded):",
        prepared.len()
    ));
    for p in &pics {
        say(p.to_text().trim_end());
    }
    if let Some(path) = &args.svg {
        write_atomic(path, to_svg(&pics).as_bytes())?;
        say(&format!("SVG written to {}", path.display()));
    }
    Ok(())
}

/// Unprepare every prepared claim (last first) and delete it; goes on after
/// a failure and reports them all.
async fn release(s: &Session<'_>, prepared: &[Prepared]) -> anyhow::Result<()> {
    if prepared.is_empty() {
        say("");
        say("nothing to release");
        return Ok(());
    }
    let mut problems = Vec::new();
    for p in prepared.iter().rev() {
        let r = p.claim_ref();
        let label = p.source.label();
        match s.kubelet.unprepare(std::slice::from_ref(&r)).await {
            Ok(resp) => match resp.claims.get(&p.uid) {
                Some(one) if one.error.is_empty() => {}
                other => problems.push(format!(
                    "{label}: NodeUnprepareResources: {}",
                    one_error(other.map(|o| o.error.as_str()), &p.uid)
                )),
            },
            Err(e) => problems.push(format!("{label}: NodeUnprepareResources: {e}")),
        }
        let spec = carve_plugin::claim_spec_path(&s.node.cdi_dir, &p.uid);
        if spec.exists() {
            problems.push(format!(
                "{label}: CDI spec {} still there after unprepare",
                spec.display()
            ));
        }
        let api: Api<ResourceClaim> = Api::namespaced(s.client.clone(), p.source.namespace());
        if let Err(e) = delete_claim(&api, &p.source).await {
            problems.push(format!("{e:#}"));
        }
        if let Err(e) = p.pod.remove(s.node) {
            problems.push(format!("{label}: {e:#}"));
        }
    }
    say("");
    if problems.is_empty() {
        say(&format!(
            "released {} claim(s): unprepared and deleted",
            prepared.len()
        ));
        return Ok(());
    }
    for p in &problems {
        say(&format!("release FAILED: {p}"));
    }
    bail!("releasing claims: {}", problems.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        if let Some(d) = p.parent() {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(&p, text).unwrap();
        p
    }

    const CLAIM: &str = "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: NAME\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n        deviceClassName: gpu.carve.dev\n";

    fn claim(name: &str) -> String {
        CLAIM.replace("NAME", name)
    }

    #[test]
    fn every_example_directory_is_embedded() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
        let mut on_disk: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().path())
            .flat_map(|p| {
                ["claim.yaml", "pod.yaml"]
                    .into_iter()
                    .filter(|f| p.join(f).is_file())
                    .map(|f| format!("examples/{}/{f}", p.file_name().unwrap().to_string_lossy()))
                    .collect::<Vec<_>>()
            })
            .collect();
        on_disk.sort();
        let mut embedded: Vec<String> = EXAMPLES.iter().map(|(s, _)| (*s).to_string()).collect();
        embedded.sort();
        assert_eq!(embedded, on_disk);
        let set = load_claims(None).unwrap();
        assert_eq!(set.claims.len(), EXAMPLES.len());
        assert!(
            set.claims
                .iter()
                .all(|c| c.namespace() == DEFAULT_NAMESPACE)
        );
        assert!(
            set.classes
                .iter()
                .any(|c| c.metadata.name.as_deref() == Some("mig.gpu.carve.dev"))
        );
    }

    #[test]
    fn claims_dir_reads_files_and_subdirectories_in_name_order() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "b.yaml", &claim("bee"));
        write(d.path(), "a/claim.yaml", &claim("ay"));
        write(d.path(), "a/README.md", "not yaml");
        write(d.path(), "notes.txt", "ignored");
        write(
            d.path(),
            "c.yml",
            "apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata:\n  name: extra.example.com\nspec: {}\n",
        );
        let set = load_claims(Some(d.path())).unwrap();
        let names: Vec<&str> = set.claims.iter().map(SourcedClaim::name).collect();
        assert_eq!(names, ["ay", "bee"]);
        assert!(
            set.claims[0].source.ends_with("a/claim.yaml"),
            "{}",
            set.claims[0].source
        );
        assert!(
            set.classes
                .iter()
                .any(|c| c.metadata.name.as_deref() == Some("extra.example.com"))
        );
        assert!(
            set.classes
                .iter()
                .any(|c| c.metadata.name.as_deref() == Some("gpu.carve.dev"))
        );
    }

    const POD: &str = "apiVersion: v1\nkind: Pod\nmetadata: {name: POD}\nspec:\n  containers:\n  - name: c\n    image: i\n    resources: {claims: [{name: gpu}]}\n  resourceClaims:\n  - name: gpu\n    resourceClaimTemplateName: TEMPLATE\n";

    fn template(name: &str) -> String {
        format!(
            "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata: {{name: {name}}}\nspec:\n  spec:\n    devices:\n      requests:\n      - name: gpu\n        exactly: {{deviceClassName: gpu.carve.dev}}\n"
        )
    }

    #[test]
    fn a_pods_template_claim_is_reserved_for_that_pod() {
        let d = tempfile::tempdir().unwrap();
        let pod = POD.replace("POD", "trainer").replace("TEMPLATE", "one-gpu");
        write(
            d.path(),
            "t/pod.yaml",
            &format!("{}---\n{pod}", template("one-gpu")),
        );
        write(d.path(), "u.yaml", &claim("plain"));
        let set = load_claims(Some(d.path())).unwrap();
        let pods: Vec<(&str, Option<&str>)> = set
            .claims
            .iter()
            .map(|c| (c.name(), c.pod.as_deref()))
            .collect();
        assert_eq!(pods, [("one-gpu", Some("trainer")), ("plain", None)]);

        // A pod naming a template that is not there would never start.
        let bad = d.path().join("bad");
        write(
            &bad,
            "p.yaml",
            &format!(
                "{}---\n{}",
                template("one-gpu"),
                POD.replace("POD", "trainer")
                    .replace("TEMPLATE", "two-gpus")
            ),
        );
        let e = format!("{:#}", load_claims(Some(&bad)).unwrap_err());
        assert!(
            e.contains("p.yaml: Pod default/trainer: spec.resourceClaims[0] (gpu) names two-gpus, which is not a ResourceClaim or ResourceClaimTemplate of this file"),
            "{e}"
        );
    }

    #[test]
    fn bad_claims_dirs_are_named() {
        let d = tempfile::tempdir().unwrap();
        let err = |p: &Path| format!("{:#}", load_claims(Some(p)).unwrap_err());

        let missing = d.path().join("nope");
        let e = err(&missing);
        assert!(e.contains("nope") && e.contains("cannot read"), "{e}");

        let empty = d.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        let e = err(&empty);
        assert!(e.contains("no ResourceClaim found"), "{e}");

        let bad = d.path().join("bad");
        write(
            &bad,
            "x.yaml",
            &claim("x").replace("deviceClassName: gpu.carve.dev", "deviceClassName: [1, 2]"),
        );
        let e = err(&bad);
        assert!(e.contains("x.yaml") && e.contains("deviceClassName"), "{e}");

        let noname = d.path().join("noname");
        write(
            &noname,
            "x.yaml",
            &claim("x").replace("  name: x\n", "  labels: {}\n"),
        );
        let e = err(&noname);
        assert!(e.contains("x.yaml") && e.contains("metadata.name"), "{e}");

        let dup = d.path().join("dup");
        write(&dup, "a.yaml", &claim("same"));
        write(&dup, "b.yaml", &claim("same"));
        let e = err(&dup);
        assert!(
            e.contains("b.yaml") && e.contains("a.yaml") && e.contains("default/same"),
            "{e}"
        );

        let slice = d.path().join("slice");
        write(
            &slice,
            "s.yaml",
            "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata:\n  name: s1\nspec:\n  driver: gpu.carve.dev\n  pool: {name: p, generation: 1, resourceSliceCount: 1}\n  allNodes: true\n",
        );
        let e = err(&slice);
        assert!(
            e.contains("s.yaml") && e.contains("ResourceSlice s1"),
            "{e}"
        );
    }

    #[test]
    fn simulator_library_is_the_newest_copy_and_a_missing_one_names_every_place_looked() {
        let d = tempfile::tempdir().unwrap();
        let a = d.path().join("x").join(SIM_LIB);
        let b = d.path().join("y").join(SIM_LIB);
        let both = [a.clone(), b.clone()];
        let e = find_newest_file(&both).unwrap_err().to_string();
        assert!(
            e.contains(&a.display().to_string()) && e.contains(&b.display().to_string()),
            "{e}"
        );
        write(d.path(), &format!("y/{SIM_LIB}"), "");
        assert_eq!(find_newest_file(&both).unwrap(), b);
        // A stale copy next to the executable loses to the fresh one in deps/.
        write(d.path(), &format!("x/{SIM_LIB}"), "");
        let old = std::time::SystemTime::now() - Duration::from_secs(3600);
        std::fs::File::options()
            .write(true)
            .open(&a)
            .unwrap()
            .set_modified(old)
            .unwrap();
        assert_eq!(find_newest_file(&both).unwrap(), b);
        std::fs::File::options()
            .write(true)
            .open(&b)
            .unwrap()
            .set_modified(old - Duration::from_secs(60))
            .unwrap();
        assert_eq!(find_newest_file(&both).unwrap(), a);
        let e = find_sim_lib(Some(&d.path().join("none.so")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--nvml-sim-lib") && e.contains("none.so"), "{e}");
    }

    #[test]
    fn leftover_mps_daemons_are_reported_and_killed() {
        use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
        let d = tempfile::tempdir().unwrap();
        let lib = write(d.path(), "lib.so", "");
        let exe = std::env::current_exe().unwrap();
        let node = Node::create(&[("l4-24gb".into(), 1)], &lib, &exe).unwrap();
        assert!(mps_leftovers(&node).is_empty());
        // A process running as the run's fake control binary, named by a
        // unit's state.json that still lists a share.
        let mut child = Command::new("sleep")
            .arg0(&node.fake_mps)
            .arg("60")
            .spawn()
            .unwrap();
        let pid = child.id();
        let deadline = Instant::now() + Duration::from_secs(10);
        let start = loop {
            // Until exec is done, the child still runs as this test binary.
            let named = processes_named(&node.fake_mps).contains(&pid);
            match process_stat(pid) {
                Some((_, t)) if named => break t,
                _ if Instant::now() > deadline => panic!("child {pid} never ran as sleep"),
                _ => std::thread::sleep(Duration::from_millis(5)),
            }
        };
        let unit = node.mps_root().join("gpu-0-mps");
        std::fs::create_dir_all(&unit).unwrap();
        let state = serde_json::json!({
            "version": 1,
            "identity": {"pid": pid, "startTime": start, "pipeDir": unit.join("pipe"),
                "logDir": unit.join("log"), "protocol": "v3"},
            "clients": {"c/s": {"claimUid": "c", "shareId": "s", "cgroup": null,
                "limits": {"memoryLimitMib": 1024, "multiprocessors": 2, "activeThreadPercentage": 2}}},
        });
        std::fs::write(unit.join("state.json"), state.to_string()).unwrap();
        let left = mps_leftovers(&node);
        assert_eq!(left.len(), 3, "{left:#?}");
        assert!(
            left[0].starts_with(&format!("gpu-0-mps: MPS daemon pid {pid} still running")),
            "{left:#?}"
        );
        assert!(left[1].contains("still lists 1 share(s)"), "{left:#?}");
        assert!(left[2].contains("killed") && left[2].contains(&pid.to_string()));
        assert_eq!(child.wait().unwrap().signal(), Some(9));
        assert!(!process_alive(pid, start));
    }

    #[test]
    fn claim_classes_cover_exactly_and_first_available() {
        let set = load_claims(None).unwrap();
        let fa = set
            .claims
            .iter()
            .find(|c| c.name() == "mig-first-available")
            .unwrap();
        assert_eq!(claim_classes(&fa.claim), ["mig.gpu.carve.dev"]);
        let ts = set.claims.iter().find(|c| c.name() == "timeslice").unwrap();
        assert_eq!(claim_classes(&ts.claim), ["timeslice.gpu.carve.dev"]);
    }

    #[test]
    fn svg_is_written_atomically_and_a_missing_directory_is_named() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("out.svg");
        write_atomic(&p, b"<svg/>").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"<svg/>");
        let names: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        let e = check_output_dir(&d.path().join("no/such/out.svg"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no/such") && e.contains("does not exist"), "{e}");
        // A directory in the way: the write fails and leaves no temporary file.
        let blocked = d.path().join("blocked");
        std::fs::create_dir(&blocked).unwrap();
        assert!(write_atomic(&blocked, b"x").is_err());
        let count = std::fs::read_dir(d.path()).unwrap().count();
        assert_eq!(count, 2);
    }
}
