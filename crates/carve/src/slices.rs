//! `carve slices`: what a node would publish, as YAML, JSON or a table.

use std::fmt::Write as _;

use crate::simulate::SimSharing;
use anyhow::Context as _;
use carve_model::order::DeviceOrder;
use carve_model::slices::{self, KubeLayout, KubeVersion, NodeGpu, SliceOptions};
use k8s_openapi::api::resource::v1::ResourceSlice;

/// Output format.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Output {
    /// Multi-document YAML, as `kubectl apply -f` takes it.
    Yaml,
    /// A JSON list.
    Json,
    /// Per GPU: counters and how many devices of each profile.
    Table,
}

/// Device order policy published in the slices.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Order {
    /// carve's fragmentation-aware order.
    Carve,
    /// By NVIDIA-style device name (what NVIDIA's driver does).
    Name,
    /// Lowest GPU, then lowest placement start.
    FirstFit,
}

impl From<Order> for DeviceOrder {
    fn from(o: Order) -> Self {
        match o {
            Order::Carve => DeviceOrder::Carve,
            Order::Name => DeviceOrder::Name,
            Order::FirstFit => DeviceOrder::FirstFit,
        }
    }
}

/// `carve slices --mps-protocol`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SliceMpsProtocol {
    /// Legacy: client-applied limits.
    V2,
    /// A namespace per share (driver 615+).
    V3,
}

/// `--ampere-mig-mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AmpereMig {
    /// MIG mode off: the whole GPU only.
    Off,
    /// MIG mode on: MIG placements only.
    On,
}

/// The one simulated node that `carve simulate`, `carve explain` and `carve
/// slices` default to (`--gpus` of each): room for every example, with
/// every kind of share on GPUs of its own
/// ([`crate::shares::DEFAULT_NODE_SHARED_GPUS`]): MIG on the first two H100s,
/// a whole A100, an MPS-shared and a time-sliced A100, and MIG-MPS on the
/// last H100.
pub const DEFAULT_GPUS: &str = "h100-80gb:2,a100-40gb:3,h100-80gb:1";

/// The shared devices those commands publish by default (`--sharing`).
pub const DEFAULT_SHARING: [&str; 3] = ["mps", "mig-mps", "timeslice"];

/// The Kubernetes version (slice layout) those commands default to
/// (`--kube-version`).
pub const DEFAULT_KUBE_VERSION: &str = "1.36";

#[derive(Debug, clap::Args)]
pub struct SlicesArgs {
    /// GPUs of the simulated node: `model:count[,model:count]` (see `carve models`);
    /// by default the node `carve simulate` and `carve explain` run.
    #[arg(long, default_value = DEFAULT_GPUS, value_parser = crate::parse_gpus_flag)]
    pub gpus: String,
    /// The flag that gave `gpus`, for errors.
    #[arg(skip = "--gpus")]
    pub gpus_flag: &'static str,
    /// Read this node's GPUs through NVML instead of simulating `--gpus`: what the
    /// kubelet plugin would publish here, with its inventory rules. Read-only:
    /// nothing on the GPUs changes.
    #[arg(long, conflicts_with = "gpus")]
    pub from_nvml: bool,
    #[command(flatten)]
    pub nvml: crate::NvmlArgs,
    /// With `--from-nvml`: MIG policy, as the plugin's `--mig-policy`
    /// (`dynamic`, `static`, or per GPU like `dynamic,1=static`).
    #[arg(long, default_value = "dynamic", value_parser = crate::plugin::parse_mig_policy, requires = "from_nvml")]
    pub mig_policy: crate::plugin::MigPolicy,
    /// Kubernetes version of the API server; decides the slice layout (1.34 or 1.35+).
    #[arg(long, default_value = DEFAULT_KUBE_VERSION, value_parser = crate::parse_kube_version)]
    pub kube_version: carve_apiserver::KubeVersion,
    /// MIG mode of the simulated Ampere GPUs (A100, A30), where changing it
    /// needs a GPU reset: `off` (the NVML simulator's and a new node's state)
    /// publishes only the whole GPU, `on` only the MIG placements, as the
    /// plugin does. Hopper and later switch MIG mode on demand and publish both.
    #[arg(long, value_enum, default_value = "off")]
    pub ampere_mig_mode: AmpereMig,
    /// Shared devices to publish besides MIG placements and whole GPUs, as
    /// the plugin's `--sharing`: `mps`, `mig-mps`, `timeslice`, or `none`.
    /// Default: `mps,mig-mps,timeslice` for the simulated node (as `carve
    /// simulate` and `carve explain`), none with `--from-nvml` (as the plugin).
    #[arg(long, value_delimiter = ',', value_enum)]
    pub sharing: Option<Vec<crate::simulate::SimSharing>>,
    /// The MPS protocol the node's control daemon speaks (decides the
    /// enforcement levels MPS devices publish, as the plugin detects them).
    #[arg(long, value_enum, default_value = "v3")]
    pub mps_protocol: SliceMpsProtocol,
    /// Node name.
    #[arg(long, default_value = "sim-node")]
    pub node: String,
    /// Device order policy.
    #[arg(long, value_enum, default_value = "carve")]
    pub order: Order,
    #[command(flatten)]
    pub shares: crate::shares::ShareArgs,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "yaml")]
    pub output: Output,
}

impl SlicesArgs {
    /// A simulated node of `gpus` (`model:count[,...]`), carve's order, YAML.
    pub fn simulated(gpus: &str, kube_version: carve_apiserver::KubeVersion, node: &str) -> Self {
        SlicesArgs {
            gpus: gpus.into(),
            gpus_flag: "--gpus",
            from_nvml: false,
            nvml: crate::NvmlArgs {
                nvml_lib: "libnvidia-ml.so.1".into(),
                proc_driver_nvidia: "/proc/driver/nvidia".into(),
            },
            mig_policy: crate::plugin::MigPolicy {
                default: carve_plugin::GpuPolicy::Dynamic,
                per_gpu: std::collections::BTreeMap::new(),
            },
            kube_version,
            ampere_mig_mode: AmpereMig::Off,
            sharing: None,
            mps_protocol: SliceMpsProtocol::V3,
            node: node.into(),
            order: Order::Carve,
            shares: crate::shares::ShareArgs::default(),
            output: Output::Yaml,
        }
    }
}

/// What the plugin's inventory rules make of a simulated GPU: an Ampere GPU
/// cannot leave or enter MIG mode without a reset, so it publishes its whole
/// GPU (MIG off) or its placements (MIG on, `mig_locked`); later GPUs are
/// partitioned on demand.
fn simulated_policy(gpu: carve_model::spec::PhysicalGpu, mig: AmpereMig) -> NodeGpu {
    if !(gpu.spec.mig_capable && gpu.spec.architecture.mig_mode_needs_reset()) {
        return NodeGpu::dynamic(gpu);
    }
    match mig {
        AmpereMig::Off => NodeGpu::new(
            gpu,
            carve_model::slices::GpuPolicy::Static {
                instances: Vec::new(),
            },
        ),
        AmpereMig::On => NodeGpu {
            mig_locked: true,
            ..NodeGpu::dynamic(gpu)
        },
    }
}

/// The shared-device kinds to publish: `--sharing` as given, else the
/// default ([`DEFAULT_SHARING`] for the simulated node, none from NVML).
fn sharing_kinds(args: &SlicesArgs) -> anyhow::Result<Vec<SimSharing>> {
    let kinds = match &args.sharing {
        Some(k) => k.clone(),
        None if args.from_nvml => Vec::new(),
        None => default_sharing(),
    };
    if kinds.contains(&SimSharing::None) && kinds.len() > 1 {
        anyhow::bail!("--sharing none cannot be combined with other kinds");
    }
    Ok(kinds)
}

/// [`DEFAULT_SHARING`] as values.
pub fn default_sharing() -> Vec<SimSharing> {
    use clap::ValueEnum as _;
    DEFAULT_SHARING
        .iter()
        .filter_map(|k| SimSharing::from_str(k, false).ok())
        .collect()
}

/// Build the slices of the simulated node, or of this node's GPUs with `--from-nvml`.
pub fn build(args: &SlicesArgs) -> anyhow::Result<Vec<ResourceSlice>> {
    let node: Vec<NodeGpu> = if args.from_nvml {
        let backend = args.nvml.open()?;
        crate::plugin::inventory(&backend, &args.mig_policy)?.gpus
    } else {
        let models = slices::parse_gpu_spec(&args.gpus)
            .with_context(|| format!("{} {:?}", args.gpus_flag, args.gpus))?;
        slices::simulated_gpus(&models)?
            .into_iter()
            .map(|gpu| simulated_policy(gpu, args.ampere_mig_mode))
            .collect()
    };
    let layout = KubeLayout::for_version(args.kube_version.major, args.kube_version.minor)?;
    let mut opts = SliceOptions::new(&args.node, layout);
    opts.order = args.order.into();
    // The plugin's rules (its `--sharing`), with the levels its MPS
    // detection would find for the protocol.
    let sharing = sharing_kinds(args)?;
    opts.sharing.timeslice = sharing.contains(&SimSharing::Timeslice);
    opts.sharing.mps = sharing.contains(&SimSharing::Mps);
    opts.sharing.mig_mps = sharing.contains(&SimSharing::MigMps);
    if opts.sharing.mps || opts.sharing.mig_mps {
        opts.sharing.mps_caps = Some(carve_mps::detect::capabilities(match args.mps_protocol {
            SliceMpsProtocol::V2 => carve_mps::Protocol::V2,
            SliceMpsProtocol::V3 => carve_mps::Protocol::V3,
        }));
    }
    opts.shares = share_decision(args).layout;
    Ok(slices::build_slices(&node, &opts)?)
}

/// How these slices publish their shares: for `--scheduler-version`, or the
/// oldest scheduler the skew policy allows beside `--kube-version`; with
/// `--shared-gpus`, or [`crate::shares::DEFAULT_NODE_SHARED_GPUS`] on the
/// default simulated node.
pub fn share_decision(args: &SlicesArgs) -> crate::shares::ShareDecision {
    let default_shared = if !args.from_nvml && args.gpus == DEFAULT_GPUS {
        crate::shares::default_node_shared(&sharing_kinds(args).unwrap_or_default())
    } else {
        std::collections::BTreeMap::new()
    };
    let api = KubeVersion::new(args.kube_version.major, args.kube_version.minor);
    args.shares.decide(api, &default_shared)
}

/// [`share_decision`]'s note, where it has one and the node shares.
pub fn share_note(args: &SlicesArgs) -> anyhow::Result<Option<String>> {
    let on = sharing_kinds(args)?.iter().any(|k| *k != SimSharing::None);
    Ok(share_decision(args).note(on))
}

/// Render the slices.
pub fn run(args: &SlicesArgs) -> anyhow::Result<String> {
    let built = build(args)?;
    Ok(match args.output {
        Output::Yaml => {
            let mut out = String::new();
            for s in &built {
                out.push_str("---\n");
                out.push_str(&crate::yaml::to_string(s)?);
            }
            out
        }
        Output::Json => serde_json::to_string_pretty(&built)? + "\n",
        Output::Table => table(&built),
    })
}

fn table(built: &[ResourceSlice]) -> String {
    let mut out = String::new();
    let devices: usize = built
        .iter()
        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        .sum();
    let _ = writeln!(out, "{} slices, {} devices", built.len(), devices);
    for g in slices::summarize(built) {
        let name = g
            .gpu
            .map_or_else(|| "-".to_string(), |i| format!("gpu-{i}"));
        let _ = writeln!(
            out,
            "{name}  counter set {}",
            g.counter_set
                .as_deref()
                .unwrap_or("(none: not MIG-capable)")
        );
        if !g.counters.is_empty() {
            let c: Vec<String> = g.counters.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let _ = writeln!(out, "    counters: {}", c.join(" "));
        }
        let d: Vec<String> = g.devices.iter().map(|(k, v)| format!("{k}×{v}")).collect();
        let _ = writeln!(out, "    devices:  {}", d.join(" "));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(gpus: &str, minor: u32, output: Output) -> SlicesArgs {
        SlicesArgs {
            output,
            ..SlicesArgs::simulated(gpus, carve_apiserver::KubeVersion { major: 1, minor }, "n1")
        }
    }

    fn counting_scheduler() -> crate::shares::ShareArgs {
        crate::shares::ShareArgs {
            scheduler_version: Some(carve_model::scheduler::SchedulerVersion::new(36, Some(2))),
            shared_gpus: None,
        }
    }

    #[test]
    fn table_lists_every_gpu_with_profile_counts() {
        let t = run(&SlicesArgs {
            shares: counting_scheduler(),
            ..args("h100-80gb:2,l4:1", 36, Output::Table)
        })
        .unwrap();
        assert!(t.contains("gpu-0  counter set gpu-0-counters"), "{t}");
        // The default sharing, for a scheduler that counts shares: each MIG
        // placement has its MIG-MPS device (counted under its profile), and
        // the L4's MPS share draws on a counter set.
        assert!(t.contains("gpu-2  counter set gpu-2-counters"), "{t}");
        assert!(t.contains("devices:  gpu×1 mps×1 timeslice×1"), "{t}");
        let plain = run(&SlicesArgs {
            sharing: Some(vec![SimSharing::None]),
            ..args("h100-80gb:2,l4:1", 35, Output::Table)
        })
        .unwrap();
        assert!(
            plain.contains("gpu-2  counter set (none: not MIG-capable)"),
            "{plain}"
        );
        assert!(plain.contains("1g.10gb×7 "), "{plain}");
        assert!(t.contains("1g.10gb×14 "), "{t}");
        // For the scheduler a 1.36 API server may have (1.35), shares go
        // apart: none without --shared-gpus, else only on the GPUs listed.
        let apart = run(&args("h100-80gb:2,l4:1", 36, Output::Table)).unwrap();
        assert!(
            !apart.contains("mps") && !apart.contains("timeslice"),
            "{apart}"
        );
        let listed = run(&SlicesArgs {
            shares: crate::shares::ShareArgs {
                scheduler_version: None,
                shared_gpus: carve_model::scheduler::parse_shared_gpus("1=mig-mps:3g.40gb,2=mps")
                    .ok(),
            },
            ..args("h100-80gb:2,l4:1", 36, Output::Table)
        })
        .unwrap();
        assert!(listed.contains("devices:  3g.40gb×2\n"), "{listed}");
        assert!(listed.contains("devices:  mps×1\n"), "{listed}");
        // For a 1.35 API server's (1.34): no share, even listed.
        let none = run(&SlicesArgs {
            shares: crate::shares::ShareArgs {
                scheduler_version: None,
                shared_gpus: carve_model::scheduler::parse_shared_gpus("2=mps").ok(),
            },
            ..args("h100-80gb:2,l4:1", 35, Output::Table)
        })
        .unwrap();
        assert!(!none.contains("mps"), "{none}");
    }

    #[test]
    fn yaml_round_trips_to_the_same_slices() {
        let a = args("a30:1", 34, Output::Yaml);
        let y = run(&a).unwrap();
        let docs: Vec<ResourceSlice> = y
            .split("---\n")
            .filter(|d| !d.trim().is_empty())
            .map(|d| serde_norway::from_str(d).unwrap())
            .collect();
        assert_eq!(docs, build(&a).unwrap());
    }

    #[test]
    fn unknown_model_is_named() {
        let e = run(&args("v100:2", 35, Output::Table)).unwrap_err();
        let msg = format!("{e:#}");
        assert!(msg.contains("v100"), "{msg}");
    }
}
