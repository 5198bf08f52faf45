//! `carve bench ...`: figures measured side by side with their targets and
//! baselines. Never timed tests: these print.

use std::process::ExitCode;

use carve_model::slices::KubeLayout;

#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {
    /// Time to build and validate a node's slices, and API writes on an unchanged restart.
    Slices(SlicesBench),
    /// Driver overhead per prepare/unprepare, concurrent throughput, plugin RSS and
    /// time to registration, with the NVML simulator.
    Prepare(crate::bench_prepare::PrepareBench),
    /// Replay the Alibaba openb trace on MIG GPUs and compare device-order policies
    /// (NVIDIA's name order, first-fit, best-fit, random, carve, a repack bound).
    Fragmentation(FragBench),
}

#[derive(Debug, clap::Args)]
pub struct FragBench {
    /// Pod list of the trace (e.g. shared/data/traces/openb_pod_list_default.csv).
    #[arg(long)]
    trace: std::path::PathBuf,
    /// Node list (default: openb_node_list_gpu_node.csv next to the trace).
    #[arg(long)]
    nodes: Option<std::path::PathBuf>,
    /// Seeds, e.g. `42..51` (both ends included) or `1,5,9`.
    #[arg(long, default_value = "42..51")]
    seeds: String,
    /// GPU model every GPU of the node list becomes (MIG-capable).
    #[arg(long, default_value = "h100-80gb")]
    model: String,
    /// Keep only this percentage of the nodes (stratified by GPUs per node).
    #[arg(long)]
    sample_nodes: Option<f64>,
    /// Arrived load to stop at, in % of capacity.
    #[arg(long, default_value_t = 130)]
    max_load: u32,
    /// Feasible nodes the scheduler looks for before scoring, in % of the
    /// nodes (kube-scheduler's percentageOfNodesToScore); 0 = its adaptive
    /// default (497 of 1,213 nodes), 100 = score every feasible node.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=100))]
    nodes_to_score_pct: u32,
    /// Write one CSV row per policy x seed x load point.
    #[arg(long)]
    csv: Option<std::path::PathBuf>,
    /// Churn mode: Poisson arrivals with departures at several offered loads.
    #[arg(long)]
    churn: bool,
}

#[derive(Debug, clap::Args)]
pub struct SlicesBench {
    /// GPU model of the node.
    #[arg(long, default_value = "h200-141gb")]
    model: String,
    /// GPUs on the node.
    #[arg(long, default_value_t = 8)]
    gpus: u32,
    /// Timed rounds.
    #[arg(long, default_value_t = 1000)]
    iterations: u32,
    /// Kubernetes version (decides the slice layout).
    #[arg(long, default_value = "1.35", value_parser = crate::parse_kube_version)]
    kube_version: carve_apiserver::KubeVersion,
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        BenchCommand::Slices(a) => {
            let layout = KubeLayout::for_version(a.kube_version.major, a.kube_version.minor)?;
            let rt = tokio::runtime::Runtime::new()?;
            let figures = rt.block_on(carve_kube::bench::run(
                carve_kube::bench::SliceBenchOptions {
                    model: a.model,
                    gpus: a.gpus,
                    iterations: a.iterations,
                    layout,
                },
            ))?;
            println!("{figures}");
            Ok(ExitCode::SUCCESS)
        }
        BenchCommand::Prepare(a) => crate::bench_prepare::run(&a),
        BenchCommand::Fragmentation(a) => {
            let mut cfg = carve_frag::BenchConfig::new(&a.trace);
            cfg.nodes = a.nodes;
            cfg.seeds = carve_frag::parse_seeds(&a.seeds)?;
            cfg.model = a.model;
            cfg.sample_nodes_pct = a.sample_nodes;
            cfg.max_load_pct = a.max_load;
            cfg.nodes_to_score_pct = a.nodes_to_score_pct;
            if a.churn {
                let report = carve_frag::run_churn(&cfg, &carve_frag::ChurnConfig::default())?;
                print!("{report}");
                if let Some(csv) = &a.csv {
                    report.write_csv(csv)?;
                }
            } else {
                let report = carve_frag::run(&cfg)?;
                print!("{report}");
                if let Some(csv) = &a.csv {
                    report.write_csv(csv)?;
                }
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
