//! `carve kubelet-plugin`: the node agent. Reads the GPUs through NVML, publishes
//! the node's ResourceSlices (and keeps them published), registers with the
//! kubelet and serves NodePrepareResources / NodeUnprepareResources, with
//! Prometheus metrics and health endpoints.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use carve_gpu::GpuBackend;
use carve_model::slices::{self, GpuPolicy as SlicePolicy, KubeVersion, NodeGpu, SliceOptions};
use carve_plugin::{GpuPolicy, PluginConfig};
use k8s_openapi::api::resource::v1::ResourceSlice;

#[derive(Debug, clap::Args)]
pub struct PluginArgs {
    /// This node's name (the pool name of its slices).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// This pod's UID: socket names carry it so a new plugin pod can take over
    /// without a gap during a rolling update.
    #[arg(long, env = "POD_UID")]
    pub pod_uid: Option<String>,
    /// Kubelet's plugins directory; the DRA socket goes to `<dir>/gpu.carve.dev/`.
    #[arg(long, default_value = "/var/lib/kubelet/plugins")]
    pub plugins_dir: PathBuf,
    /// Kubelet's plugin registration directory.
    #[arg(long, default_value = "/var/lib/kubelet/plugins_registry")]
    pub registry_dir: PathBuf,
    /// Where transient CDI specs are written.
    #[arg(long, default_value = "/var/run/cdi")]
    pub cdi_dir: PathBuf,
    /// The plugin's state (checkpoint).
    #[arg(long, default_value = "/var/lib/carve")]
    pub state_dir: PathBuf,
    #[command(flatten)]
    pub nvml: crate::NvmlArgs,
    /// Talk to this API server over plain HTTP (the stand-in, tests); default:
    /// kubeconfig or in-cluster configuration.
    #[arg(long)]
    pub kube_api_url: Option<String>,
    /// Address of `/metrics`, `/healthz` and `/readyz` (`:9400` = all interfaces).
    #[arg(long, default_value = ":9400", value_parser = parse_listen_addr)]
    pub metrics_addr: SocketAddr,
    /// MIG policy: a default, then per-GPU overrides, e.g. `dynamic` or
    /// `dynamic,1=static,3=static`. `static` GPUs keep an admin's layout.
    #[arg(long, default_value = "dynamic", value_parser = parse_mig_policy)]
    pub mig_policy: MigPolicy,
    /// `nvidia-cuda-mps-control` to use for MPS sharing (needed with
    /// `--sharing mps` or `mig-mps`).
    #[arg(long)]
    pub mps_control: Option<PathBuf>,
    /// MPS control protocol: `auto` (v3 where the control daemon offers it,
    /// else v2), `v2`, or `v3` (refuse to start without it).
    #[arg(long, default_value = "auto", value_enum)]
    pub mps_protocol: MpsProtocolArg,
    /// Where MPS daemons keep their pipe, log and state directories (one per
    /// shared GPU or MIG instance); default `<state-dir>/mps`. The pipe
    /// directories are bind-mounted into workload containers, so this must be
    /// a host path mounted at the same path in the plugin container.
    #[arg(long)]
    pub mps_dir: Option<PathBuf>,
    /// The cgroup v2 mount: its `dmem.capacity` says which GPUs have memory
    /// partitioning, and hard MPS memory limits go on pod cgroups below it.
    #[arg(long, default_value = "/sys/fs/cgroup")]
    pub cgroup_root: PathBuf,
    /// `nvidia-smi`, through which hard MPS memory limits are set (`nvidia-smi
    /// memory-limits`) on a whole GPU with memory partitioning (dmem). Unset:
    /// no limits are set and MPS memory is published `client`.
    #[arg(long)]
    pub nvidia_smi: Option<PathBuf>,
    /// The `/dev/shm` of MPS daemons and their clients: `unit-tmpfs` (a tmpfs
    /// per shared GPU or MIG instance, the daemon's `/dev/shm` and bound at
    /// `/dev/shm` in every share's containers, as CUDA MPS clients need;
    /// needs CAP_SYS_ADMIN), or `none` (daemons keep the plugin's `/dev/shm`
    /// and containers get none of theirs: real MPS clients cannot reach the
    /// server then; only for `carve simulate` run without root).
    #[arg(long, default_value = "unit-tmpfs", value_enum)]
    pub mps_dev_shm: MpsDevShm,
    /// The cgroup, relative to `--cgroup-root` and made in each of its
    /// hierarchies, under which each MPS daemon runs in a cgroup `<unit>` of
    /// its own, outside the plugin's: a container restart or rolling update
    /// of the plugin then leaves the daemons running (the plugin must run in
    /// the host's PID namespace and see the host's cgroup tree at
    /// `--cgroup-root`). `none`: the daemons stay in the plugin's cgroup
    /// and end with its container.
    #[arg(long, default_value = "none", value_parser = parse_daemon_cgroup)]
    pub mps_daemon_cgroup: DaemonCgroupArg,
    /// How often MPS daemons are checked and restarted if they died (seconds).
    #[arg(long, default_value_t = 10)]
    pub mps_supervise_seconds: u64,
    /// How often prepared claims whose ResourceClaim is gone are cleaned up (seconds; 0 = never).
    #[arg(long, default_value_t = 600)]
    pub gc_interval_seconds: u64,
    /// Shared devices to publish besides MIG partitions and whole GPUs
    /// (consumable capacity: Kubernetes 1.36+, or 1.34/1.35 with the
    /// DRAConsumableCapacity gate): `mps` (MPS shares of a whole GPU with memory
    /// and SM limits), `mig-mps` (MPS shares of one MIG instance), `timeslice`
    /// (a shareable whole GPU, no memory or fault isolation).
    #[arg(long, value_delimiter = ',', value_enum)]
    pub sharing: Vec<SharingKind>,
    #[command(flatten)]
    pub shares: crate::shares::ShareArgs,
    /// How often NVML health events are polled (seconds).
    #[arg(long, default_value_t = 5)]
    pub health_poll_seconds: u64,
    /// How long one API-server call for a claim (its GET, its status write)
    /// may take before the claim fails with an error naming the API server
    /// (seconds; well under the kubelet's 45 s per call); also bounds each
    /// ResourceSlice request of the publisher, which then retries.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=40))]
    pub api_timeout_seconds: u64,
    /// How often the slices are re-checked against the API server (seconds).
    #[arg(long, default_value_t = 60)]
    pub resync_seconds: u64,
    /// The NVIDIA driver's root as this process sees it: its libraries,
    /// utilities, firmware and sockets go into every claim's CDI spec (the GPU
    /// Operator's driver container: mount `/run/nvidia/driver` here).
    #[arg(long, default_value = "/")]
    pub container_driver_root: PathBuf,
    /// The same driver root on the host, written into the CDI specs (the
    /// container runtime reads them on the host): `/` or `/run/nvidia/driver`.
    #[arg(long, default_value = "/")]
    pub host_driver_root: PathBuf,
    /// Host path of the NVIDIA Container Toolkit's `nvidia-cdi-hook`: specs
    /// then run its create-symlinks, update-ldcache, enable-cuda-compat and
    /// disable-device-node-modification hooks. Without it each driver library
    /// is also mounted at its soname path (`libcuda.so.1`, ...).
    #[arg(long)]
    pub nvidia_cdi_hook: Option<PathBuf>,
    /// The node's `/proc/devices` (the `nvidia-caps` major of the MIG
    /// capability device nodes).
    #[arg(long, default_value = "/proc/devices")]
    pub proc_devices: PathBuf,
    /// File with the node's boot id.
    #[arg(long, default_value = "/proc/sys/kernel/random/boot_id", hide = true)]
    pub boot_id_path: PathBuf,
}

/// A kind of shared device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SharingKind {
    /// MPS shares of whole GPUs.
    Mps,
    /// MPS shares of MIG instances.
    MigMps,
    /// Time-sliced whole GPUs.
    Timeslice,
}

/// `--mps-protocol`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MpsProtocolArg {
    /// The strongest the node supports.
    Auto,
    /// Legacy v2 (per-daemon defaults, client variables).
    V2,
    /// v3 (a namespace with its own limits per share); an error where unsupported.
    V3,
}

/// `--mps-dev-shm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MpsDevShm {
    /// A tmpfs per shared unit, shared by its daemon and its shares' containers.
    UnitTmpfs,
    /// No `/dev/shm` of MPS's own (unprivileged simulation only).
    None,
}

/// `--mps-daemon-cgroup`: `none` or a relative cgroup path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonCgroupArg(pub Option<PathBuf>);

fn parse_daemon_cgroup(s: &str) -> Result<DaemonCgroupArg, String> {
    if s == "none" {
        return Ok(DaemonCgroupArg(None));
    }
    let p = PathBuf::from(s);
    if carve_mps::daemon_cgroup::valid_dir(&p) {
        Ok(DaemonCgroupArg(Some(p)))
    } else {
        Err(format!(
            "{s:?} is neither `none` nor a relative cgroup path without `.` or `..` (e.g. carve-mps)"
        ))
    }
}

/// Detect MPS support when `--sharing` asks for MPS devices.
fn mps_setup(args: &PluginArgs) -> anyhow::Result<Option<carve_plugin::MpsSetup>> {
    let wanted =
        args.sharing.contains(&SharingKind::Mps) || args.sharing.contains(&SharingKind::MigMps);
    let Some(binary) = &args.mps_control else {
        if wanted {
            bail!(
                "--sharing mps/mig-mps needs --mps-control (the path of nvidia-cuda-mps-control)"
            );
        }
        return Ok(None);
    };
    if !wanted {
        bail!(
            "--mps-control {} is set but --sharing lists neither mps nor mig-mps",
            binary.display()
        );
    }
    let mut config = carve_mps::MpsConfig::new(&args.state_dir);
    config.control_binary.clone_from(binary);
    if let Some(d) = &args.mps_dir {
        config.root.clone_from(d);
    }
    config.cgroup_root.clone_from(&args.cgroup_root);
    config.nvidia_smi.clone_from(&args.nvidia_smi);
    // Daemons start through this binary, on their unit's tmpfs as /dev/shm.
    match args.mps_dev_shm {
        MpsDevShm::UnitTmpfs => {
            config.shm_launcher = Some(
                std::env::current_exe().context("locating the carve binary (the MPS launcher)")?,
            );
        }
        MpsDevShm::None => tracing::warn!(
            "--mps-dev-shm none: MPS daemons keep the plugin's /dev/shm and share containers get none of theirs; real CUDA MPS clients cannot reach the server so (only for unprivileged simulation)"
        ),
    }
    if let Some(dir) = &args.mps_daemon_cgroup.0 {
        if config.shm_launcher.is_none() {
            bail!(
                "--mps-daemon-cgroup {} needs --mps-dev-shm unit-tmpfs: the daemon moves to its cgroup through the carve launcher, which --mps-dev-shm none does not use",
                dir.display()
            );
        }
        // Found (and the hierarchies listed) now, not at the first share.
        let found = carve_mps::daemon_cgroup::hierarchies(&config.cgroup_root, "(any unit)")
            .context("--mps-daemon-cgroup needs the host's cgroup tree at --cgroup-root")?;
        tracing::info!(
            dir = %dir.display(),
            hierarchies = ?found,
            "MPS daemons run in a cgroup of their own under each hierarchy, outside the plugin's"
        );
        config.daemon_cgroup = Some(dir.clone());
    }
    config.protocol = match args.mps_protocol {
        MpsProtocolArg::Auto => carve_mps::ProtocolChoice::Auto,
        MpsProtocolArg::V2 => carve_mps::ProtocolChoice::V2,
        MpsProtocolArg::V3 => carve_mps::ProtocolChoice::V3,
    };
    let support = carve_mps::detect(&config).context("detecting MPS support")?;
    let caps = support.capabilities();
    tracing::info!(
        protocol = ?support.protocol,
        cgroup_v2 = support.cgroup_v2,
        dmem_regions = support.dmem_regions.len(),
        memory_limit = caps.memory_limit.as_str(),
        compute_limit = caps.compute_limit.as_str(),
        "MPS support"
    );
    Ok(Some(carve_plugin::MpsSetup { config, support }))
}

/// Mark the GPUs whose whole-GPU MPS memory limit is `hard` (memory
/// partitioning holds and carve can set and read it back), logging per GPU
/// why or why not.
fn mark_hard_memory(gpus: &mut [NodeGpu], m: &carve_plugin::MpsSetup) {
    for g in gpus {
        match carve_mps::memlimit::whole_gpu(
            &m.support,
            &m.config.cgroup_root,
            g.gpu.pci_bus_id.as_deref(),
        ) {
            Ok(key) => {
                tracing::info!(gpu.index = g.gpu.index, dmem = %key, "whole-GPU MPS memory limit: hard (memory partitioning set through nvidia-smi, read back from dmem.max)");
                g.mps_memory_hard = true;
            }
            Err(why) => {
                tracing::info!(gpu.index = g.gpu.index, reason = %why, "whole-GPU MPS memory limit: client");
                g.mps_memory_hard = false;
            }
        }
    }
}

/// Default and per-GPU MIG policies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigPolicy {
    /// Policy of GPUs not listed.
    pub default: GpuPolicy,
    /// Per GPU index.
    pub per_gpu: BTreeMap<u32, GpuPolicy>,
}

impl MigPolicy {
    fn of(&self, gpu: u32) -> GpuPolicy {
        self.per_gpu.get(&gpu).copied().unwrap_or(self.default)
    }
}

fn policy_word(s: &str) -> Result<GpuPolicy, String> {
    match s {
        "dynamic" => Ok(GpuPolicy::Dynamic),
        "static" => Ok(GpuPolicy::Static),
        _ => Err(format!("{s:?} is not a MIG policy (dynamic or static)")),
    }
}

/// Parse `dynamic` or `dynamic,1=static,3=static`.
pub fn parse_mig_policy(s: &str) -> Result<MigPolicy, String> {
    let mut parts = s.split(',');
    let default = policy_word(parts.next().unwrap_or_default().trim())?;
    let mut per_gpu = BTreeMap::new();
    for p in parts {
        let (i, w) = p
            .split_once('=')
            .ok_or_else(|| format!("{p:?} is not <gpu index>=<policy>"))?;
        let i: u32 = i
            .trim()
            .parse()
            .map_err(|_| format!("{i:?} is not a GPU index"))?;
        if per_gpu.insert(i, policy_word(w.trim())?).is_some() {
            return Err(format!("GPU {i} is listed twice"));
        }
    }
    Ok(MigPolicy { default, per_gpu })
}

/// Parse `:9400`, `0.0.0.0:9400` or `127.0.0.1:0`.
pub fn parse_listen_addr(s: &str) -> Result<SocketAddr, String> {
    let full = if s.starts_with(':') {
        format!("0.0.0.0{s}")
    } else {
        s.to_string()
    };
    full.parse()
        .map_err(|_| format!("{s:?} is not a listen address like :9400 or 127.0.0.1:9400"))
}

/// What the node publishes, read once from the backend.
pub(crate) struct Inventory {
    pub(crate) gpus: Vec<NodeGpu>,
}

/// Read the GPUs and decide per GPU what can be published. A GPU whose MIG data
/// cannot be read or is inconsistent publishes only the whole device, with one
/// error logged for it: the plugin still serves the rest.
/// Read-only: it lists GPUs, profiles and, for static GPUs, instances.
pub(crate) fn inventory(backend: &dyn GpuBackend, policy: &MigPolicy) -> anyhow::Result<Inventory> {
    let infos = backend.gpus().context("listing GPUs through NVML")?;
    let mut gpus = Vec::with_capacity(infos.len());
    for info in infos {
        let whole_only = |reason: &str| {
            tracing::error!(gpu.index = info.index, gpu.uuid = %info.uuid, reason, "publishing only the whole GPU");
        };
        let mut profiles = Vec::new();
        if info.mig_capable {
            match backend.profiles(info.index) {
                Ok(p) => profiles = p,
                Err(e) => whole_only(&e.to_string()),
            }
        }
        let mut spec = info.spec(profiles);
        if spec.mig_capable
            && let Err(e) = spec.validate()
        {
            whole_only(&e.to_string());
            spec.profiles.clear();
        }
        if spec.profiles.is_empty() {
            spec.mig_capable = false;
            spec.memory_slices = 0;
            spec.compute_slices = 0;
        }
        let mig_on = info.mig_mode.is_some_and(|m| m.current);
        // An Ampere GPU in MIG mode runs CUDA work only inside MIG instances and
        // leaves MIG mode only with a GPU reset: its whole device could never be
        // handed out usefully.
        let mig_locked = spec.mig_capable && mig_on && info.architecture.mig_mode_needs_reset();
        let slice_policy = if !spec.mig_capable {
            SlicePolicy::Dynamic
        } else {
            match policy.of(info.index) {
                GpuPolicy::Static => {
                    let gis = backend
                        .gpu_instances(info.index)
                        .with_context(|| format!("GPU {}: listing GPU instances", info.index))?;
                    let instances = gis
                        .iter()
                        .filter_map(|gi| {
                            spec.profile_by_id(gi.profile_id)
                                .map(|p| (p.name.clone(), gi.placement.start))
                        })
                        .collect();
                    SlicePolicy::Static { instances }
                }
                GpuPolicy::Dynamic if !mig_on && info.architecture.mig_mode_needs_reset() => {
                    // A configuration, not a fault: info, not error.
                    tracing::info!(gpu.index = info.index, gpu.uuid = %info.uuid, reason = "MIG mode is off and enabling it needs a GPU reset on this architecture", "publishing only the whole GPU");
                    SlicePolicy::Static {
                        instances: Vec::new(),
                    }
                }
                GpuPolicy::Dynamic => SlicePolicy::Dynamic,
            }
        };
        gpus.push(NodeGpu {
            gpu: info.physical(spec),
            policy: slice_policy,
            mig_locked,
            mps_memory_hard: false,
        });
    }
    Ok(Inventory { gpus })
}

async fn kube_client(url: Option<&str>) -> anyhow::Result<kube::Client> {
    match url {
        Some(u) => {
            let uri = u.parse().with_context(|| format!("--kube-api-url {u:?}"))?;
            Ok(kube::Client::try_from(kube::Config::new(uri))?)
        }
        None => kube::Client::try_default().await.context(
            "building a Kubernetes client from kubeconfig or the in-cluster configuration",
        ),
    }
}

fn ensure_dir(path: &Path, what: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(path)
        .with_context(|| format!("{what} {}: cannot create", path.display()))
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
}

impl std::fmt::Display for MigPolicy {
    /// As `--mig-policy` takes it: `dynamic,1=static`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let word = |p: GpuPolicy| match p {
            GpuPolicy::Dynamic => "dynamic",
            GpuPolicy::Static => "static",
        };
        f.write_str(word(self.default))?;
        for (i, p) in &self.per_gpu {
            write!(f, ",{i}={}", word(*p))?;
        }
        Ok(())
    }
}

/// A `--kube-api-url` as it may be logged: user information
/// (`http://user:password@host`) replaced by `***`.
fn loggable_url(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((_, host)) if scheme.is_empty() => format!("***@{host}{path}"),
        Some((_, host)) => format!("{scheme}://***@{host}{path}"),
        None => url.to_string(),
    }
}

/// The start-up line: carve's version and the effective settings, each a
/// field of its own (no secret among them).
fn log_start(args: &PluginArgs, log_format: &str) {
    fn value(v: &impl clap::ValueEnum) -> String {
        v.to_possible_value()
            .map(|p| p.get_name().to_string())
            .unwrap_or_default()
    }
    let path = |p: &Path| p.display().to_string();
    let opt = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
    let sharing: Vec<String> = args.sharing.iter().map(value).collect();
    let mps =
        args.sharing.contains(&SharingKind::Mps) || args.sharing.contains(&SharingKind::MigMps);
    let kube_api = args
        .kube_api_url
        .as_deref()
        .map_or_else(|| "kubeconfig or in-cluster".to_string(), loggable_url);
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        node_name = %args.node_name,
        pod_uid = args.pod_uid.as_deref(),
        kube_api = %kube_api,
        plugins_dir = %path(&args.plugins_dir),
        registry_dir = %path(&args.registry_dir),
        cdi_dir = %path(&args.cdi_dir),
        state_dir = %path(&args.state_dir),
        container_driver_root = %path(&args.container_driver_root),
        host_driver_root = %path(&args.host_driver_root),
        nvml_lib = %path(&args.nvml.nvml_lib),
        proc_driver_nvidia = %path(&args.nvml.proc_driver_nvidia),
        proc_devices = %path(&args.proc_devices),
        nvidia_cdi_hook = opt(&args.nvidia_cdi_hook).as_deref(),
        metrics_addr = %args.metrics_addr,
        mig_policy = %args.mig_policy,
        sharing = %sharing.join(","),
        scheduler_version = args.shares.scheduler_version.map(|v| v.to_string()).as_deref(),
        shared_gpus = args.shares.shared_gpus.as_ref().map(carve_model::scheduler::shared_gpus_string).as_deref(),
        mps,
        mps_protocol = %value(&args.mps_protocol),
        mps_control = opt(&args.mps_control).as_deref(),
        mps_dir = opt(&args.mps_dir).as_deref(),
        mps_dev_shm = %value(&args.mps_dev_shm),
        mps_daemon_cgroup = %opt(&args.mps_daemon_cgroup.0).unwrap_or_else(|| "none".into()),
        mps_supervise_seconds = args.mps_supervise_seconds,
        cgroup_root = %path(&args.cgroup_root),
        nvidia_smi = opt(&args.nvidia_smi).as_deref(),
        gc_interval_seconds = args.gc_interval_seconds,
        health_poll_seconds = args.health_poll_seconds,
        api_timeout_seconds = args.api_timeout_seconds,
        resync_seconds = args.resync_seconds,
        log_format,
        "carve kubelet-plugin starting"
    );
}

/// Run the plugin until SIGTERM / Ctrl-C.
pub fn run(args: PluginArgs, log_format: &str) -> anyhow::Result<()> {
    log_start(&args, log_format);
    check_paths(&args)?;
    // MPS flags and support before anything is created (detection fails
    // first on a missing control binary).
    let mps = mps_setup(&args)?;
    ensure_dir(&args.state_dir, "--state-dir")?;
    ensure_dir(&args.cdi_dir, "--cdi-dir")?;
    let plugin_dir = args.plugins_dir.join(carve_model::DRIVER_NAME);
    ensure_dir(&plugin_dir, "--plugins-dir")?;
    let nvml = Arc::new(args.nvml.open_in_driver_root(&args.container_driver_root)?);
    let backend: Arc<dyn GpuBackend> = nvml.clone();
    let events: Arc<dyn carve_gpu::GpuEvents> = nvml;
    let inv = inventory(backend.as_ref(), &args.mig_policy)?;
    let node = Node {
        plugin_dir,
        mps,
        backend,
        events,
        inv,
    };
    runtime()?.block_on(serve(args, node))
}

/// What `run` found on the node before the runtime starts.
struct Node {
    plugin_dir: PathBuf,
    mps: Option<carve_plugin::MpsSetup>,
    backend: Arc<dyn GpuBackend>,
    events: Arc<dyn carve_gpu::GpuEvents>,
    inv: Inventory,
}

/// The directories the kubelet owns exist; CDI's host paths are absolute.
fn check_paths(args: &PluginArgs) -> anyhow::Result<()> {
    if !args.registry_dir.is_dir() {
        bail!(
            "--registry-dir {}: not a directory (the kubelet creates it)",
            args.registry_dir.display()
        );
    }
    for (flag, p) in [
        ("--host-driver-root", Some(&args.host_driver_root)),
        ("--nvidia-cdi-hook", args.nvidia_cdi_hook.as_ref()),
    ] {
        if let Some(p) = p
            && !p.is_absolute()
        {
            bail!("{flag} {}: must be an absolute host path", p.display());
        }
    }
    Ok(())
}

/// Publish the node's slices, recover, serve the kubelet and `/metrics`
/// until a signal; then stop everything in order.
async fn serve(args: PluginArgs, node: Node) -> anyhow::Result<()> {
    let client = kube_client(args.kube_api_url.as_deref()).await?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let Publishing {
        metrics,
        health,
        task: publish_task,
    } = publish(&args, &node, client.clone(), stop_rx.clone()).await?;

    let cfg = plugin_config(&args, node.plugin_dir, metrics.clone(), node.mps);
    let driver = Arc::new(carve_plugin::Driver::new(cfg, node.backend, client).await?);
    // Recovery logs its own summary.
    driver.recover().await?;
    let supervisor = supervise_mps(
        driver.clone(),
        Duration::from_secs(args.mps_supervise_seconds.max(1)),
        stop_rx.clone(),
    );
    let serve_opts = carve_plugin::health::ServeOptions {
        health: Some(health.clone()),
        ..Default::default()
    };
    let serving =
        carve_plugin::health::serve_with(driver, serve_opts, stopped(stop_rx.clone())).await?;
    // Ready: registered with the kubelet and the DRA socket answers (the kit's check).
    let readiness = serving.readiness();
    let ready = carve_metrics::ReadyCheck::new(move || {
        let readiness = readiness.clone();
        async move { readiness.check().await.map_err(|e| e.to_string()) }
    });
    let metrics_server =
        carve_metrics::bind(args.metrics_addr, metrics, ready, stopped(stop_rx)).await?;
    tracing::info!(
        dra_socket = %serving.paths.dra.display(),
        metrics_addr = %metrics_server.local_addr(),
        "serving the kubelet"
    );

    shutdown_signal().await;
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    serving.wait().await?;
    let _ = publish_task.await;
    let _ = supervisor.await;
    let _ = metrics_server.wait().await;
    health.stop().await?;
    Ok(())
}

/// What publishing started: the metrics of the published devices, the
/// health monitor whose taints go on them, the task that keeps them published.
struct Publishing {
    metrics: Arc<carve_metrics::Metrics>,
    health: carve_plugin::health::HealthHandle,
    task: tokio::task::JoinHandle<()>,
}

/// Build the node's slices for the API server's version, start the health
/// monitor, publish, and keep publishing until `stop`.
async fn publish(
    args: &PluginArgs,
    node: &Node,
    client: kube::Client,
    stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<Publishing> {
    // The API server's version picks the slice layout; it is read again
    // every resync and after a failed publish (see `follow_version`).
    let record = args.state_dir.join("apiserver-version");
    let (versions, unread) = carve_kube::VersionWatch::new_or_recorded(client.clone(), &record)
        .await
        .context("reading the API server version (no version recorded by an earlier start)")?;
    if let Some(e) = unread {
        tracing::warn!(error = %e, version = %versions.version(), "the API server does not answer: starting with the version an earlier start read, to serve the kubelet; publishing resumes when the server answers");
    }
    let version = versions.version();
    let build = slice_builder(args, node, version)?;
    let desired = build.slices(version)?;

    let metrics = Arc::new(carve_metrics::Metrics::new());
    let names: Vec<carve_model::DeviceName> = desired
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .filter_map(|d| d.name.parse().ok())
        .collect();
    metrics.record_published(&names);

    // Health: NVML events become taints on the published devices and the
    // kubelet's health stream.
    let health = carve_plugin::health::HealthMonitor::start(
        node.backend.clone(),
        node.events.clone(),
        names,
        carve_plugin::health::HealthOptions {
            poll: Duration::from_secs(args.health_poll_seconds.max(1)),
            ..Default::default()
        },
    )
    .await?;

    let publisher =
        carve_kube::SlicePublisher::new(client, args.node_name.clone(), carve_model::DRIVER_NAME)
            .with_request_timeout(Duration::from_secs(args.api_timeout_seconds));
    let keep = KeepPublished {
        publisher,
        versions,
        current: Published {
            version,
            base: Arc::new(desired),
        },
        build,
        snapshots: health.subscribe(),
        resync: Duration::from_secs(args.resync_seconds.max(1)),
    };
    let task = keep.start(stop).await;
    Ok(Publishing {
        metrics,
        health,
        task,
    })
}

/// Resolves when `stop` turns (or its sender is gone).
async fn stopped(mut stop: tokio::sync::watch::Receiver<bool>) {
    let _ = stop.changed().await;
}

/// The slices to publish: the node's GPUs (hard MPS memory marked where it
/// holds) and the sharing kinds asked for, in the layout of `version`.
fn slice_builder(args: &PluginArgs, node: &Node, version: KubeVersion) -> anyhow::Result<Builder> {
    let mut opts = SliceOptions::new(&args.node_name, version.layout()?);
    opts.sharing.timeslice = args.sharing.contains(&SharingKind::Timeslice);
    opts.sharing.mps_caps = node.mps.as_ref().map(|m| m.support.capabilities());
    opts.sharing.mps = args.sharing.contains(&SharingKind::Mps);
    opts.sharing.mig_mps = args.sharing.contains(&SharingKind::MigMps);
    if !args.sharing.is_empty() && version < KubeVersion::V1_36 {
        tracing::warn!(%version, "shared devices need consumable capacity, off by default before Kubernetes 1.36");
    }
    let mut gpus = node.inv.gpus.clone();
    if let Some(m) = &node.mps {
        mark_hard_memory(&mut gpus, m);
    }
    Ok(Builder {
        gpus,
        opts,
        shares: args.shares.clone(),
    })
}

/// The driver's configuration from the flags.
fn plugin_config(
    args: &PluginArgs,
    plugin_dir: PathBuf,
    metrics: Arc<carve_metrics::Metrics>,
    mps: Option<carve_plugin::MpsSetup>,
) -> PluginConfig {
    let mut cfg = PluginConfig::new(args.node_name.clone());
    cfg.plugins_registry_dir = args.registry_dir.clone();
    cfg.plugin_dir = plugin_dir;
    cfg.cdi_dir = args.cdi_dir.clone();
    cfg.checkpoint_path = args.state_dir.join("checkpoint.json");
    cfg.boot_id_path = args.boot_id_path.clone();
    cfg.pod_uid = args.pod_uid.clone();
    cfg.default_policy = args.mig_policy.default;
    cfg.gpu_policy = args.mig_policy.per_gpu.clone();
    cfg.api_timeout = Duration::from_secs(args.api_timeout_seconds);
    cfg.gc_interval =
        (args.gc_interval_seconds > 0).then(|| Duration::from_secs(args.gc_interval_seconds));
    cfg.metrics = Some(metrics);
    cfg.mps = mps;
    cfg.driver = carve_plugin::DriverRootConfig {
        container_root: args.container_driver_root.clone(),
        host_root: args.host_driver_root.clone(),
        nvidia_cdi_hook: args.nvidia_cdi_hook.clone(),
        proc_devices: args.proc_devices.clone(),
        proc_driver_nvidia: args.nvml.proc_driver_nvidia.clone(),
    };
    cfg
}

/// MPS daemons that die are restarted with their shares' limits, every
/// `every` until `stop` (nothing to do without MPS).
fn supervise_mps(
    driver: Arc<carve_plugin::Driver>,
    every: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if driver.config().mps.is_none() {
            return;
        }
        loop {
            tokio::select! {
                _ = stop.changed() => return,
                () = tokio::time::sleep(every) => {}
            }
            let _ = driver.supervise_mps().await;
        }
    })
}

/// Keeps the slices published, with the current taints, in the layout of the
/// API server's current version: a resync with nothing changed makes no API
/// write.
struct KeepPublished {
    publisher: carve_kube::SlicePublisher,
    versions: carve_kube::VersionWatch,
    current: Published,
    build: Builder,
    snapshots: tokio::sync::watch::Receiver<carve_plugin::health::HealthSnapshot>,
    resync: Duration,
}

impl KeepPublished {
    /// Publish once (a failure is retried in the background), then keep
    /// publishing until `stop`.
    async fn start(
        mut self,
        stop: tokio::sync::watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        let first = self.current.tainted(&self.snapshots.borrow_and_update());
        match self.publisher.sync(&*first).await {
            Ok(r) => {
                tracing::info!(created = r.created, updated = r.updated, deleted = r.deleted, unchanged = r.unchanged, version = %self.current.version, "slices published")
            }
            Err(e) => {
                tracing::error!(error = %e, "publishing slices failed; retrying in the background");
                follow_version(&mut self.versions, &mut self.current, &self.build).await;
            }
        }
        // Slices deleted or changed behind the plugin's back are republished
        // as soon as the watch sees it.
        let slice_watch = self.publisher.watch();
        tokio::spawn(self.run(slice_watch, stop))
    }

    /// Republish on a health change, a slice changed or deleted behind the
    /// plugin's back (the watch), and every resync (the backstop, which also
    /// re-reads the API server's version).
    async fn run(
        mut self,
        mut slice_watch: carve_kube::SliceWatch,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        loop {
            let tick = tokio::select! {
                _ = stop.changed() => return,
                r = self.snapshots.changed() => if r.is_err() { return } else { false },
                _ = slice_watch.changed() => false,
                () = tokio::time::sleep(self.resync) => true,
            };
            if tick {
                follow_version(&mut self.versions, &mut self.current, &self.build).await;
            }
            self.republish().await;
        }
    }

    async fn republish(&mut self) {
        let want = self.current.tainted(&self.snapshots.borrow_and_update());
        if let Err(e) = self.publisher.sync(&*want).await {
            tracing::error!(error = %e, "republishing slices failed");
            // A failed write may mean the control plane was upgraded (a 1.35
            // server refuses the 1.34 layout): look at once.
            if follow_version(&mut self.versions, &mut self.current, &self.build).await {
                let want = self.current.tainted(&self.snapshots.borrow_and_update());
                if let Err(e) = self.publisher.sync(&*want).await {
                    tracing::error!(error = %e, "republishing slices in the new layout failed");
                }
            }
        }
    }
}

/// Builds the node's slices for a Kubernetes version (its layout).
struct Builder {
    gpus: Vec<NodeGpu>,
    opts: SliceOptions,
    shares: crate::shares::ShareArgs,
}

impl Builder {
    /// The slices for an API server of `version`: its layout, and shares
    /// apart unless the scheduler (stated, or the oldest the skew policy
    /// allows beside it) counts them.
    fn slices(&self, version: KubeVersion) -> anyhow::Result<Vec<ResourceSlice>> {
        let mut o = self.opts.clone();
        o.layout = version.layout()?;
        let decision = self
            .shares
            .decide(version, &std::collections::BTreeMap::new());
        let sharing_on = o.sharing.mps || o.sharing.mig_mps || o.sharing.timeslice;
        if let Some(note) = decision.note(sharing_on) {
            tracing::warn!(apiserver = %version, scheduler = %decision.scheduler, "{note}");
        }
        o.shares = decision.layout;
        Ok(slices::build_slices(&self.gpus, &o)?)
    }
}

/// What is being published: the slices as built for `version`, before taints.
struct Published {
    version: KubeVersion,
    base: Arc<Vec<ResourceSlice>>,
}

impl Published {
    /// The slices to send with the current health taints: those the version
    /// accepts (effect `None` is withheld on 1.34), validated for the version
    /// before they are sent; the untainted slices when that fails. A copy is
    /// made only while some device carries a taint.
    fn tainted(&self, snapshot: &carve_plugin::health::HealthSnapshot) -> Arc<Vec<ResourceSlice>> {
        if snapshot.taints.is_empty() {
            return Arc::clone(&self.base);
        }
        match carve_kube::desired::with_taints(&self.base, &snapshot.taints, self.version) {
            Ok(t) => {
                if !t.withheld.is_empty() {
                    tracing::info!(
                        version = %self.version,
                        devices = t.withheld.len(),
                        "taints with effect None withheld: this Kubernetes version does not accept them (the condition stays in the device health the kubelet gets)"
                    );
                }
                Arc::new(t.slices)
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot publish the health taints; publishing without them");
                Arc::clone(&self.base)
            }
        }
    }
}

/// Reads the API server's version again; when it changed, rebuilds the
/// slices for it (the publisher then writes the new layout as the pool's next
/// generation, see `carve_kube::layout_watch`) and says whether it did.
async fn follow_version(
    versions: &mut carve_kube::VersionWatch,
    current: &mut Published,
    build: &Builder,
) -> bool {
    let change = match versions.refresh().await {
        Ok(Some(c)) => c,
        Ok(None) => return false,
        Err(e) => {
            tracing::warn!(error = %e, "reading the API server version; keeping the current layout");
            return false;
        }
    };
    tracing::info!(from = %change.from, to = %change.to, layout_changed = change.layout_changed(), "the API server's Kubernetes version changed");
    if let Some(w) = carve_kube::skew_warning(change) {
        tracing::warn!("{w}");
    }
    match build.slices(change.to) {
        Ok(s) => {
            *current = Published {
                version: change.to,
                base: Arc::new(s),
            };
            true
        }
        Err(e) => {
            tracing::error!(error = %e, version = %change.to, "cannot build slices for this Kubernetes version; keeping the ones for {}", current.version);
            false
        }
    }
}

/// The plugin's runtime: one thread for the async work (gRPC, API calls,
/// checkpoint and CDI writes that do not fsync), blocking threads for NVML,
/// fsyncs and MPS. A few blocking threads are enough (operations on one GPU
/// are serialised anyway), and each extra thread costs a malloc arena.
///
/// One async thread, not a multi-thread runtime: the plugin's async work is
/// hand-offs, and on a multi-thread runtime each hand-off between its tasks
/// (the gRPC handler, the HTTP connection, the prepare) may wake a parked
/// worker on another CPU. `carve bench prepare` (which runs the driver on
/// this runtime, the API-server stand-in on a thread of its own) measured 2
/// workers against one thread in 4 alternating runs on 2 vCPUs: 24-25
/// against 11-12 context switches per prepare+unprepare cycle, prepare
/// overhead p50 0.71-0.78 against 0.42-0.64 ms, the claim GET 0.26-0.32
/// against 0.20-0.25 ms p50, 56 concurrent prepares about as fast (604-822
/// against 635-733 claims/s). Nothing on it blocks for long: the slice
/// build (a few ms at start and on health changes) is the largest.
pub(crate) fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .max_blocking_threads(8)
        .enable_all()
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_gpus_in_dmem_capacity_get_hard_memory_and_only_with_nvidia_smi() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("cg");
        carve_mps::fake_smi::fixture::root(
            &root,
            &[("nvidia/0000:3b:00.0/vidmem".into(), 1 << 30)],
            true,
        )
        .unwrap();
        let mut config = carve_mps::MpsConfig::new(d.path());
        config.control_binary = std::path::PathBuf::from("/bin/false");
        config.protocol = carve_mps::ProtocolChoice::V2;
        config.cgroup_root = root;
        let node = |pci: [&str; 2]| -> Vec<NodeGpu> {
            pci.iter()
                .enumerate()
                .map(|(i, p)| {
                    let mut g =
                        carve_model::slices::simulated_node("h100-80gb", 1).unwrap()[0].clone();
                    g.index = u32::try_from(i).unwrap();
                    g.pci_bus_id = Some((*p).to_string());
                    NodeGpu::dynamic(g)
                })
                .collect()
        };
        let mark = |config: &carve_mps::MpsConfig| {
            let support = carve_mps::detect(config).unwrap();
            let m = carve_plugin::MpsSetup {
                config: config.clone(),
                support,
            };
            let mut gpus = node(["00000000:3B:00.0", "00000000:86:00.0"]);
            mark_hard_memory(&mut gpus, &m);
            gpus.iter().map(|g| g.mps_memory_hard).collect::<Vec<_>>()
        };
        assert_eq!(mark(&config), [false, false], "no --nvidia-smi");
        config.nvidia_smi = Some(std::path::PathBuf::from("/bin/true"));
        assert_eq!(mark(&config), [true, false], "GPU 1 not in dmem.capacity");
        carve_mps::fake_smi::fixture::root_without_dmem(&config.cgroup_root).unwrap();
        assert_eq!(mark(&config), [false, false], "misc backend: no dmem");
    }

    /// The JSON lines `f` logs at info level and above.
    fn json_logs(f: impl FnOnce()) -> Vec<serde_json::Value> {
        #[derive(Clone, Default)]
        struct Buf(Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let w = buf.clone();
        let sub = tracing_subscriber::fmt()
            .json()
            .with_max_level(tracing::Level::INFO)
            .with_writer(move || w.clone())
            .finish();
        tracing::subscriber::with_default(sub, f);
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect()
    }

    #[test]
    fn the_start_line_names_the_version_and_each_setting_as_a_field() {
        let a = plugin_args(&[
            "--mig-policy",
            "dynamic,1=static",
            "--mps-protocol",
            "v3",
            "--resync-seconds",
            "17",
            "--state-dir",
            "/s",
            "--kube-api-url",
            "http://admin:hunter2@api.example:6443/x",
        ]);
        let lines = json_logs(|| log_start(&a, "json"));
        assert_eq!(lines.len(), 1, "{lines:?}");
        let f = &lines[0]["fields"];
        assert_eq!(f["version"], env!("CARGO_PKG_VERSION"));
        assert_eq!(f["node_name"], "n");
        assert_eq!(f["state_dir"], "/s");
        assert_eq!(f["mig_policy"], "dynamic,1=static");
        assert_eq!(f["sharing"], "mps");
        assert_eq!(f["mps"], true);
        assert_eq!(f["mps_protocol"], "v3");
        assert_eq!(f["resync_seconds"], 17);
        assert_eq!(f["api_timeout_seconds"], 10);
        assert_eq!(f["log_format"], "json");
        assert_eq!(f["host_driver_root"], "/");
        assert_eq!(f["kube_api"], "http://***@api.example:6443/x");
        let all = lines[0].to_string();
        assert!(!all.contains("hunter2"), "a password logged: {all}");
        assert!(!all.contains("PluginArgs"), "a Debug dump: {all}");
    }

    #[test]
    fn urls_lose_their_user_information_only() {
        assert_eq!(loggable_url("http://127.0.0.1:1"), "http://127.0.0.1:1");
        assert_eq!(loggable_url("https://u:p@h/a@b"), "https://***@h/a@b");
        assert_eq!(loggable_url("u@h:1"), "***@h:1");
    }

    #[test]
    fn mig_policy_parses_defaults_and_overrides() {
        let p = parse_mig_policy("dynamic,1=static,3=static").unwrap();
        assert_eq!(p.default, GpuPolicy::Dynamic);
        assert_eq!(p.of(1), GpuPolicy::Static);
        assert_eq!(p.of(2), GpuPolicy::Dynamic);
        assert_eq!(p.to_string(), "dynamic,1=static,3=static");
        assert!(parse_mig_policy("dynamc").unwrap_err().contains("dynamc"));
        assert!(
            parse_mig_policy("dynamic,x=static")
                .unwrap_err()
                .contains("GPU index")
        );
        assert!(
            parse_mig_policy("dynamic,1=static,1=dynamic")
                .unwrap_err()
                .contains("twice")
        );
    }

    #[test]
    fn listen_addresses() {
        assert_eq!(
            parse_listen_addr(":9400").unwrap(),
            "0.0.0.0:9400".parse().unwrap()
        );
        assert_eq!(
            parse_listen_addr("127.0.0.1:0").unwrap(),
            "127.0.0.1:0".parse().unwrap()
        );
        assert!(parse_listen_addr("nine").is_err());
    }

    #[derive(clap::Parser)]
    struct Args {
        #[command(flatten)]
        a: PluginArgs,
    }

    fn plugin_args(extra: &[&str]) -> PluginArgs {
        use clap::Parser as _;
        let base = ["carve", "--node-name", "n", "--sharing", "mps"];
        let base = base.iter().chain(extra);
        Args::try_parse_from(base).unwrap().a
    }

    #[test]
    fn mps_daemon_cgroup_is_none_by_default_or_a_relative_path() {
        assert_eq!(plugin_args(&[]).mps_daemon_cgroup, DaemonCgroupArg(None));
        assert_eq!(
            plugin_args(&["--mps-daemon-cgroup", "carve/mps"]).mps_daemon_cgroup,
            DaemonCgroupArg(Some("carve/mps".into()))
        );
        for bad in ["/sys/fs/cgroup/x", "../x", "a/./b", ""] {
            let e = parse_daemon_cgroup(bad).unwrap_err();
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn a_daemon_cgroup_needs_the_launcher_and_a_cgroup_tree() {
        let d = tempfile::tempdir().unwrap();
        let state = d.path().display().to_string();
        let common = [
            "--state-dir",
            &state,
            "--mps-control",
            "/nonexistent/nvidia-cuda-mps-control",
            "--mps-daemon-cgroup",
            "carve-mps",
        ];
        let mut a: Vec<&str> = common.to_vec();
        a.extend(["--mps-dev-shm", "none"]);
        let e = format!("{:#}", mps_setup(&plugin_args(&a)).unwrap_err());
        assert!(e.contains("needs --mps-dev-shm unit-tmpfs"), "{e}");
        // No cgroup hierarchy where --cgroup-root points: refused at start,
        // naming the root.
        let mut a: Vec<&str> = common.to_vec();
        a.extend(["--cgroup-root", &state]);
        let e = format!("{:#}", mps_setup(&plugin_args(&a)).unwrap_err());
        assert!(e.contains("--cgroup-root") && e.contains(&state), "{e}");
    }
}
