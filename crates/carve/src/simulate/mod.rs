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

mod claims;
mod lifecycle;
mod mps_readback;
mod node;
mod report;

use claims::*;
use lifecycle::*;
use mps_readback::*;
pub use node::find_sim_lib;
use node::*;
use report::*;

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
    "examples/mps-hard-limit/pod.yaml",
    "the simulated node has no memory partitioning (its cgroup tree has no dmem controller and no nvidia-smi is configured), so no device publishes mpsMemoryLimit hard and a claim that demands it stays pending",
)];

const EXAMPLES: &[(&str, &str)] = &[
    (
        "examples/mig-1g/pod.yaml",
        include_str!("../../../../examples/mig-1g/pod.yaml"),
    ),
    (
        "examples/mig-same-parent/pod.yaml",
        include_str!("../../../../examples/mig-same-parent/pod.yaml"),
    ),
    (
        "examples/mig-by-memory/pod.yaml",
        include_str!("../../../../examples/mig-by-memory/pod.yaml"),
    ),
    (
        "examples/mig-first-available/pod.yaml",
        include_str!("../../../../examples/mig-first-available/pod.yaml"),
    ),
    (
        "examples/whole-gpu/pod.yaml",
        include_str!("../../../../examples/whole-gpu/pod.yaml"),
    ),
    (
        "examples/mps-share/pod.yaml",
        include_str!("../../../../examples/mps-share/pod.yaml"),
    ),
    (
        "examples/mps-hard-limit/pod.yaml",
        include_str!("../../../../examples/mps-hard-limit/pod.yaml"),
    ),
    (
        "examples/timeslice/pod.yaml",
        include_str!("../../../../examples/timeslice/pod.yaml"),
    ),
    (
        "examples/mig-mps/pod.yaml",
        include_str!("../../../../examples/mig-mps/pod.yaml"),
    ),
];

#[derive(Debug, clap::Args)]
pub struct SimulateArgs {
    /// GPUs of the simulated node: `model:count[,model:count]` (see `carve models`).
    /// Every GPU starts with MIG mode off: on Hopper and newer the plugin turns it
    /// on when a claim needs it; an Ampere GPU (where that needs a reset) is
    /// published as a whole GPU only. The default has room for every example: the
    /// MIG ones on the first two H100s, the whole GPU, the MPS shares and the
    /// time-sliced GPU on one A100 each, the MIG-MPS shares on the last H100.
    #[arg(long, default_value = crate::slices::DEFAULT_GPUS, value_parser = crate::parse_gpus_flag)]
    pub gpus: String,
    /// Shared devices the plugin publishes besides MIG partitions and whole GPUs
    /// (its `--sharing`): `mps` (MPS shares of a whole GPU), `mig-mps` (of a MIG
    /// partition), `timeslice`, or `none`. MPS runs on a fake
    /// `nvidia-cuda-mps-control` and a fake cgroup tree.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_values = crate::slices::DEFAULT_SHARING
    )]
    pub sharing: Vec<SimSharing>,
    #[command(flatten)]
    pub shares: crate::shares::ShareArgs,
    /// MPS control protocol the plugin uses (its `--mps-protocol`): `v3` gives
    /// each share a namespace with its limits, which the pod reaches through
    /// the namespace's own pipe directory; `v2` leaves the per-share limits to
    /// client variables; `auto` takes the strongest.
    #[arg(long, value_enum, default_value = "auto")]
    pub mps_protocol: MpsProtocol,
    /// Claims to apply instead of the built-in examples: a YAML file (one or
    /// more documents), or a directory of YAML files (`*.yaml`, `*.yml`) or of
    /// subdirectories holding `claim.yaml` or `pod.yaml`, applied in name order. They hold ResourceClaims, or ResourceClaimTemplates
    /// and the Pods that name them (the claim is then reserved for that pod).
    /// DeviceClasses found there are added to the built-in ones.
    #[arg(long)]
    pub claims: Option<PathBuf>,
    /// Kubernetes version the API-server stand-in reports (decides the slice layout).
    #[arg(long, default_value = crate::slices::DEFAULT_KUBE_VERSION, value_parser = crate::parse_kube_version)]
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
    /// One of the built-in examples (not a `--claims` one): where the node
    /// shape or `--sharing` leaves it no device, that is said and does not
    /// fail the run.
    builtin: bool,
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
    /// The classes the run's `--sharing` leaves without devices, and why.
    off: BTreeMap<String, String>,
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
    let mut set = load_claims(args.claims.as_deref())?;
    let shares = share_decision(args);
    set.off = classes_off_by_sharing(&args.sharing, &shares);
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

/// How the simulated node publishes its shares (as `carve slices` decides
/// it: [`crate::slices::share_decision`]), with the flags given to the
/// plugin so that it publishes the same.
pub(super) fn share_decision(args: &SimulateArgs) -> crate::shares::ShareDecision {
    let sargs = crate::slices::SlicesArgs {
        shares: args.shares.clone(),
        ..crate::slices::SlicesArgs::simulated(&args.gpus, args.kube_version, "sim-node")
    };
    crate::slices::share_decision(&sargs)
}

/// The share flags the plugin of the simulated node gets: those given, and
/// on the default node its shared GPUs.
pub(super) fn plugin_share_flags(args: &SimulateArgs) -> Vec<String> {
    let mut shares = args.shares.clone();
    if shares.shared_gpus.is_none() && args.gpus == crate::slices::DEFAULT_GPUS {
        shares.shared_gpus = Some(crate::shares::default_node_shared(&args.sharing));
    }
    shares.to_flags()
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
        write(d.path(), "a/pod.yaml", &claim("ay"));
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
            set.claims[0].source.ends_with("a/pod.yaml"),
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
    fn a_claims_file_is_read_as_it_is_whatever_its_name() {
        let d = tempfile::tempdir().unwrap();
        let f = write(
            d.path(),
            "claims.txt",
            &format!("{}---\n{}", claim("one"), claim("two")),
        );
        let set = load_claims(Some(&f)).unwrap();
        let names: Vec<&str> = set.claims.iter().map(SourcedClaim::name).collect();
        assert_eq!(names, ["one", "two"]);
        assert!(set.claims[1].source.ends_with("claims.txt"));
        let empty = write(
            d.path(),
            "none.yaml",
            "apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata: {name: x.example.com}\nspec: {}\n",
        );
        let e = format!("{:#}", load_claims(Some(&empty)).unwrap_err());
        assert!(e.contains("none.yaml: no ResourceClaim found"), "{e}");
        assert!(!e.contains("looked in"), "{e}");
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
        // A plain MPS share and one of a MIG partition name different
        // classes: mps.gpu.carve.dev never hands out a MIG partition.
        let class_of = |name: &str| {
            let c = set.claims.iter().find(|c| c.name() == name).unwrap();
            claim_classes(&c.claim)
        };
        assert_eq!(class_of("mps-share"), ["mps.gpu.carve.dev"]);
        assert_eq!(class_of("mig-mps"), ["mig-mps.gpu.carve.dev"]);
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
