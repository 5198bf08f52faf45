//! `carve simulate`: one simulated GPU node, end to end. The NVML simulator,
//! the real `carve kubelet-plugin` (a child process of this executable on real
//! Unix sockets), the API-server stand-in (in-process), the offline allocator
//! acting as the scheduler, and a fake kubelet: every claim is allocated,
//! prepared, shown on a picture of the GPUs, then released, and the run ends
//! by checking that no GPU instance is left.
//!
//! It is not a cluster: one node, no pods, no scheduler scoring, no kubelet
//! beyond registration, prepare and unprepare. Claims that do not fit, or whose
//! device class has no published device, are reported and do not fail the run
//! (exit 0); a failed prepare or unprepare, a leaked GPU instance or CDI spec,
//! and bad input do (exit 1).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail};
use carve_alloc::{AllocError, Allocator, Inputs, Object};
use carve_apiserver::{ApiServer, KubeVersion, Options, Resource, Store};
use carve_model::names::DeviceName;
use carve_model::slices::{self, KubeLayout};
use carve_model::{DRIVER_NAME, GpuModel, GpuSpec};
use carve_plugin::ClaimRef;
use carve_plugin::testing::FakeKubelet;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use nvidia_ml_sim::{GpuEntry, SimConfig, SimState};

use crate::render::{GpuPicture, Held, to_svg};

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
/// device order spreads those two over both H100s).
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
];

#[derive(Debug, clap::Args)]
pub struct SimulateArgs {
    /// GPUs of the simulated node: `model:count[,model:count]` (see `carve models`).
    /// Every GPU starts with MIG mode off: on Hopper and newer the plugin turns it
    /// on when a claim needs it; an Ampere GPU (where that needs a reset) is
    /// published as a whole GPU only.
    #[arg(long, default_value = "h100-80gb:2,a100-40gb:1")]
    pub gpus: String,
    /// Claims to apply instead of the built-in examples: a directory of claim YAML
    /// files (`*.yaml`, `*.yml`) or of subdirectories holding `claim.yaml`, applied
    /// in name order. DeviceClasses found there are added to the built-in ones.
    #[arg(long)]
    pub claims: Option<PathBuf>,
    /// Kubernetes version the API-server stand-in reports (decides the slice layout).
    #[arg(long, default_value = "1.35", value_parser = crate::parse_kube_version)]
    pub kube_version: KubeVersion,
    /// Keep the temporary directory (sockets, CDI specs, checkpoint, simulator
    /// state, plugin log) and print its path.
    #[arg(long)]
    pub keep: bool,
    /// Also write the picture of the GPUs as SVG to this file (atomically).
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// The NVML simulator library. Default: the newer of `libnvidia_ml_sim.so`
    /// next to this executable and in its `deps/` directory (where cargo builds it).
    #[arg(long)]
    pub nvml_sim_lib: Option<PathBuf>,
}

/// A claim and where it came from.
#[derive(Debug, Clone)]
struct SourcedClaim {
    /// File it was read from (`examples/...` for the built-in ones).
    source: String,
    /// The claim, namespace filled in.
    claim: ResourceClaim,
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
    KubeLayout::for_version(args.kube_version.major, args.kube_version.minor)
        .with_context(|| format!("--kube-version {}", args.kube_version))?;
    let set = load_claims(args.claims.as_deref())?;
    if let Some(svg) = &args.svg {
        check_output_dir(svg)?;
    }
    let lib = find_sim_lib(args.nvml_sim_lib.as_deref())?;
    let exe = std::env::current_exe()
        .context("locating this executable (to run `carve kubelet-plugin`)")?;
    let node = Node::create(&models, &lib)?;
    if args.keep {
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
    if args.keep {
        let path = node.dir.keep();
        say(&format!("kept {}", path.display()));
    }
    result.map(|()| ExitCode::SUCCESS)
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
                    "--claims {}: no ResourceClaim found (looked in *.yaml and *.yml files and in */claim.yaml)",
                    dir.display()
                );
            }
        }
    }
    Ok(set)
}

/// `dir/*.yaml`, `dir/*.yml` and `dir/*/claim.yaml`, in name order.
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
            let c = p.join("claim.yaml");
            if c.is_file() {
                files.push(c);
            }
        } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
            files.push(p);
        }
    }
    Ok(files)
}

fn add_objects(set: &mut ClaimSet, source: &str, objs: Vec<Object>) -> anyhow::Result<()> {
    for (k, o) in objs.into_iter().enumerate() {
        match o {
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
}

impl Node {
    fn create(models: &[(String, u32)], lib: &Path) -> anyhow::Result<Self> {
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
        })
    }

    fn registration_socket(&self) -> PathBuf {
        self.registry_dir.join(format!("{DRIVER_NAME}-reg.sock"))
    }

    fn plugin_log(&self) -> PathBuf {
        self.dir.path().join("plugin.log")
    }

    /// The `carve kubelet-plugin` command line.
    fn plugin_args(&self, api_url: &str) -> Vec<std::ffi::OsString> {
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
        arg("--nvml-lib", self.nvml_lib.as_os_str());
        arg("--kube-api-url", api_url.as_ref());
        arg("--metrics-addr", "127.0.0.1:0".as_ref());
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
    fn spawn(exe: &Path, node: &Node, api_url: &str) -> anyhow::Result<Self> {
        let log = node.plugin_log();
        let out =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out
            .try_clone()
            .with_context(|| format!("duplicating {}", log.display()))?;
        let mut cmd = Command::new(exe);
        cmd.args(node.plugin_args(api_url))
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
}

/// A claim allocated and prepared.
#[derive(Debug, Clone)]
struct Prepared {
    source: SourcedClaim,
    /// The claim as stored, with `status.allocation` and its uid.
    stored: ResourceClaim,
    uid: String,
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
) -> anyhow::Result<()> {
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
) -> anyhow::Result<()> {
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
    let mut plugin = Plugin::spawn(exe, node, &api.url())?;
    let result = with_plugin(args, &mut plugin, api, client, node, set).await;
    plugin.stop();
    let leftovers = final_check(node);
    result?;
    leftovers
}

/// After the plugin is gone: no GPU instance and no CDI spec may be left.
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
    if left.is_empty() && cdi.is_empty() {
        say(&format!(
            "no GPU instance left: 0 GPU instances on {} GPU(s) in the NVML simulator, no CDI spec left",
            state.gpus.len()
        ));
        return Ok(());
    }
    say(&format!(
        "LEFT BEHIND: {} GPU instance(s), {} CDI spec(s)",
        left.len(),
        cdi.len()
    ));
    for l in left.iter().chain(&cdi) {
        say(&format!("  {l}"));
    }
    bail!(
        "{} GPU instance(s) and {} CDI spec(s) left after every claim was released",
        left.len(),
        cdi.len()
    )
}

async fn with_plugin(
    args: &SimulateArgs,
    plugin: &mut Plugin,
    api: &ApiServer,
    client: kube::Client,
    node: &Node,
    set: &ClaimSet,
) -> anyhow::Result<()> {
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
    say("claims, in order:");
    let mut result = apply_all(&s, &set.claims, &mut prepared, &mut failures).await;
    if result.is_ok() {
        result = show_pictures(args, node, &prepared);
    }
    let released = release(&s, &prepared).await;
    result?;
    released?;
    if !failures.is_empty() {
        bail!(
            "{} claim(s) failed: {}",
            failures.len(),
            failures.join("; ")
        );
    }
    Ok(())
}

/// Published devices per GPU, from the slices read back from the stand-in.
fn published_text(node: &Node, slices: &[ResourceSlice]) -> String {
    let devices: usize = slices
        .iter()
        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        .sum();
    let mut out = format!(
        "published: {} ResourceSlice(s), {devices} device(s)",
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
        let d: Vec<String> = g.devices.iter().map(|(k, v)| format!("{k}×{v}")).collect();
        let _ = write!(out, "\n  {name} ({about}): {}", d.join(" "));
    }
    out
}

async fn apply_all(
    s: &Session<'_>,
    claims: &[SourcedClaim],
    prepared: &mut Vec<Prepared>,
    failures: &mut Vec<String>,
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
                    let text = expl.to_string();
                    // Devices that are not even of the right kind say little here.
                    let lines: Vec<&str> = text
                        .lines()
                        .skip(1)
                        .filter(|l| !(l.contains(" selector #") && l.contains(" is false")))
                        .collect();
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
                continue;
            }
            Err((e, label)) => return Err(anyhow!(e).context(format!("claim {label}"))),
        };
        match prepare(s, c, result).await? {
            Ok(p) => {
                say(&prepared_text(&p));
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
                return Err(anyhow!(e).context(format!("claim {}: DeviceClass {class}", c.label())));
            }
        }
    }
    Ok(missing)
}

/// Create the claim, write its allocation, prepare it through the fake
/// kubelet and read back what the plugin wrote. `Ok(Err(why))`: the claim was
/// not prepared (and is deleted again); `Err`: the run cannot go on.
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
    let patch = serde_json::json!({"status": {"allocation": result}});
    let stored = api
        .patch_status(c.name(), &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("writing status.allocation of ResourceClaim {label}"))?;
    let r = ClaimRef {
        namespace: c.namespace().into(),
        name: c.name().into(),
        uid: uid.clone(),
    };
    let answer = s.kubelet.prepare(std::slice::from_ref(&r)).await;
    let one = match answer {
        Ok(resp) => resp.claims.get(&uid).cloned(),
        Err(e) => {
            delete_claim(&api, c).await?;
            return Ok(Err(format!("NodePrepareResources: {e}")));
        }
    };
    let one = match one {
        Some(o) if o.error.is_empty() => o,
        other => {
            delete_claim(&api, c).await?;
            return Ok(Err(format!(
                "NodePrepareResources: {}",
                one_error(other.as_ref().map(|o| o.error.as_str()), &uid)
            )));
        }
    };
    let back = api
        .get(c.name())
        .await
        .with_context(|| format!("reading ResourceClaim {label} back"))?;
    let status_devices = back.status.as_ref().and_then(|st| st.devices.as_ref());
    let results = stored
        .status
        .as_ref()
        .and_then(|st| st.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref());
    let mut devices = Vec::new();
    for res in results
        .into_iter()
        .flatten()
        .filter(|x| x.driver == DRIVER_NAME)
    {
        let from_kubelet = one.devices.iter().find(|d| d.device_name == res.device);
        let data = status_devices
            .into_iter()
            .flatten()
            .find(|d| d.driver == DRIVER_NAME && d.device == res.device)
            .and_then(|d| d.data.as_ref())
            .map(|d| d.0.clone());
        devices.push(PreparedDevice {
            request: res.request.clone(),
            device: res.device.clone(),
            cdi_ids: from_kubelet
                .map(|d| d.cdi_device_ids.clone())
                .unwrap_or_default(),
            data,
        });
    }
    Ok(Ok(Prepared {
        source: c.clone(),
        stored,
        uid,
        devices,
    }))
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

fn prepared_text(p: &Prepared) -> String {
    let mut out = format!("- {}: allocated and prepared", p.source.label());
    for d in &p.devices {
        let _ = write!(out, "\n    request {} -> {}", d.request, d.device);
        let str_of = |k: &str| {
            d.data
                .as_ref()
                .and_then(|v| v.get(k))
                .and_then(|v| v.as_str().map(str::to_string))
        };
        let num_of = |v: Option<&serde_json::Value>| v.and_then(serde_json::Value::as_u64);
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
            (Some(_), _) => {
                let _ = write!(
                    out,
                    ": whole GPU {}",
                    str_of("uuid").unwrap_or_else(|| "(no UUID)".into())
                );
            }
        }
        for id in &d.cdi_ids {
            let _ = write!(out, "\n      CDI {id}");
        }
    }
    out
}

/// One picture per GPU of who holds which memory slice.
fn pictures(node: &Node, prepared: &[Prepared]) -> Vec<GpuPicture> {
    let mut by_gpu: BTreeMap<u32, (Vec<Held>, Option<String>)> = BTreeMap::new();
    for p in prepared {
        for d in &p.devices {
            let Ok(name) = d.device.parse::<DeviceName>() else {
                continue;
            };
            let e = by_gpu.entry(name.gpu()).or_default();
            match &name {
                DeviceName::Gpu { .. } => e.1 = Some(p.source.name().to_string()),
                DeviceName::Mig { .. } => {
                    // What the plugin says it created, else what was allocated.
                    let created = d.data.as_ref().and_then(|v| {
                        let profile = v.get("profile")?.as_str()?.to_string();
                        let start =
                            u8::try_from(v.get("placement")?.get("start")?.as_u64()?).ok()?;
                        Some((profile, start))
                    });
                    if let Some((profile, start)) = created.or_else(|| name.mig_placement()) {
                        e.0.push(Held {
                            holder: p.source.name().to_string(),
                            profile,
                            start,
                        });
                    }
                }
                _ => {}
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
            .filter(|p| p.join("claim.yaml").is_file())
            .map(|p| {
                format!(
                    "examples/{}/claim.yaml",
                    p.file_name().unwrap().to_string_lossy()
                )
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
