//! `carve bench ...`: figures measured side by side with their targets and
//! baselines. Never timed tests: these print. The benchmarks live with what
//! they measure (`carve_kube::bench`, `carve_frag`) or in `carve_bench`;
//! this file parses their flags, calls them and prints what they return.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;

use carve_model::slices::KubeLayout;

#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {
    /// Time to build and validate a node's slices, and API writes on an unchanged restart.
    Slices(SlicesBench),
    /// Driver overhead per prepare/unprepare, concurrent throughput, plugin RSS and
    /// time to registration, with the NVML simulator.
    Prepare(PrepareBench),
    /// Replay the Alibaba openb trace on MIG GPUs and compare device-order policies
    /// (NVIDIA's name order, first-fit, best-fit, random, carve, a re-packing
    /// heuristic) against the exact per-node optimum and inside a modelled
    /// kube-scheduler, with the failure decomposition.
    Fragmentation(FragBench),
    /// What publishing shares apart (for a kube-scheduler before 1.36.2)
    /// costs in packing: claims placed by carve's allocator on each layout
    /// of one node, paired over seeds.
    Shares(crate::bench_shares::SharesBench),
}

#[derive(Debug, clap::Args)]
pub struct FragBench {
    /// Pod list of the trace (e.g. shared/data/traces/openb_pod_list_default.csv);
    /// repeat for several traces, side by side.
    #[arg(long, required = true)]
    trace: Vec<std::path::PathBuf>,
    /// Node list (default: openb_node_list_gpu_node.csv next to the trace).
    #[arg(long)]
    nodes: Option<std::path::PathBuf>,
    /// Cluster seeds, e.g. `1..50` (both ends included) or `1,5,9`.
    #[arg(long, default_value = "1..5")]
    seeds: String,
    /// Per-node reference: one task sequence per seed and node shape; `none`
    /// skips it.
    #[arg(long, default_value = "1..100")]
    node_seeds: String,
    /// Per-node reference: also the optimal online policy (exact dynamic
    /// programming) on node shapes of at most this many GPUs, beside the
    /// clairvoyant optimum; 0 skips it. 8 GPUs are out of its reach.
    #[arg(long, default_value_t = 4)]
    online_max_gpus: u32,
    /// Policies to compare (comma-separated): name, first-fit, best-fit,
    /// random, carve, repack-heuristic, state-aware, state-aware-lag<N>
    /// (N ≤ 16: the scheduler allocates from the order published N device
    /// events ago).
    #[arg(long, value_delimiter = ',')]
    policies: Vec<carve_frag::Policy>,
    /// kube-scheduler NodeResourcesFit scoring strategies (comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "LeastAllocated,MostAllocated"
    )]
    scoring: Vec<carve_frag::Scoring>,
    /// Cluster shapes from the node list (comma-separated): `all`, or a GPU
    /// count (only the nodes with that many GPUs); `none` skips the cluster
    /// runs (per-node reference only).
    #[arg(long, value_delimiter = ',', default_value = "all,8")]
    clusters: Vec<String>,
    /// Worker threads (0 = available parallelism).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Also print the full per-run report (every metric at 90/100/110/130 %)
    /// of each cluster run.
    #[arg(long)]
    detail: bool,
    /// GPU model every GPU of the node list becomes (MIG-capable).
    #[arg(long, default_value = "h100-80gb")]
    model: String,
    /// Keep only this percentage of the nodes (stratified by GPUs per node).
    #[arg(long)]
    sample_nodes: Option<f64>,
    /// Feasible nodes the scheduler looks for before scoring, in % of the
    /// nodes (kube-scheduler's percentageOfNodesToScore); 0 = its adaptive
    /// default (497 of 1,213 nodes), 100 = score every feasible node.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=100))]
    nodes_to_score_pct: u32,
    /// Write every figure, one value a row
    /// (section,trace,shape,scoring,policy,seed,metric,value).
    #[arg(long)]
    csv: Option<std::path::PathBuf>,
    /// Write one CSV row per policy x seed x load point of the first cluster run.
    #[arg(long)]
    samples_csv: Option<std::path::PathBuf>,
    /// Churn mode: Poisson arrivals with departures at several offered loads.
    #[arg(long)]
    churn: bool,
}

#[derive(Debug, Clone, clap::Args)]
pub struct PrepareBench {
    /// Prepare+unprepare cycles: timed one at a time, then again concurrently,
    /// and driven through the plugin process for its RSS.
    #[arg(long, default_value_t = 1000)]
    pub iterations: u32,
    /// Simulated GPUs on the node (1 to 64, carve_model::slices::MAX_SIMULATED_GPUS).
    #[arg(long, default_value_t = 8, value_parser = crate::parse_gpu_count)]
    pub gpus: u32,
    /// Claims prepared at once in the throughput run (at most one per
    /// smallest-profile placement of the node: 56 on 8 H100s).
    #[arg(long, default_value_t = 56)]
    pub concurrency: u32,
    /// GPU model of the simulated node (MIG-capable).
    #[arg(long, default_value = "h100-80gb")]
    pub model: String,
    /// Skip the plugin-process part (RSS, time to registration).
    #[arg(long)]
    pub skip_rss: bool,
    /// The NVML simulator library (default: next to this executable).
    #[arg(long)]
    pub nvml_sim_lib: Option<PathBuf>,
    /// Where the plugin's files go (checkpoint, sockets): the node's disk by
    /// default; `/dev/shm` takes disk flushes out of the figures.
    #[arg(long, default_value = "/tmp")]
    pub files_dir: PathBuf,
    /// Where the CDI specs go: a tmpfs (`/dev/shm` where the host has it) by
    /// default, as `/var/run/cdi`, where the chart puts them, is on a node.
    #[arg(long)]
    pub cdi_dir: Option<PathBuf>,
    /// Run without a pod UID (no host lock, no checkpoint reread per
    /// operation), unlike the Helm chart.
    #[arg(long)]
    pub without_pod_uid: bool,
}

impl PrepareBench {
    fn options(&self) -> carve_bench::prepare::Options {
        carve_bench::prepare::Options {
            iterations: self.iterations,
            gpus: self.gpus,
            concurrency: self.concurrency,
            model: self.model.clone(),
            files_dir: self.files_dir.clone(),
            cdi_dir: self.cdi_dir.clone(),
            without_pod_uid: self.without_pod_uid,
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct SlicesBench {
    /// GPU model of the node.
    #[arg(long, default_value = "h200-141gb")]
    model: String,
    /// GPUs on the node (1 to 64, carve_model::slices::MAX_SIMULATED_GPUS).
    #[arg(long, default_value_t = 8, value_parser = crate::parse_gpu_count)]
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
            // Checked here so that the error names the flag, and the model once.
            crate::find_model(&a.model).context("--model")?;
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
        BenchCommand::Prepare(a) => prepare(&a),
        BenchCommand::Fragmentation(a) => fragmentation(a),
        BenchCommand::Shares(a) => {
            print!("{}", crate::bench_shares::run(&a)?);
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `carve bench prepare`: the in-process part on the plugin's runtime, then
/// (unless `--skip-rss`) the plugin process, this executable as
/// `carve kubelet-plugin`; fails when a target was missed.
fn prepare(a: &PrepareBench) -> anyhow::Result<ExitCode> {
    use carve_bench::prepare;
    let opts = a.options();
    let model = prepare::check(&opts)?;
    let lib = crate::simulate::find_sim_lib(a.nvml_sim_lib.as_deref())?;
    let carve = std::env::current_exe().context("locating this executable")?;
    // Measured first, while this process is small.
    let help_kib = if a.skip_rss {
        0
    } else {
        prepare::help_peak_kib(&carve)?
    };
    // The driver runs on the plugin's runtime; the stand-in on its own.
    let rt = crate::plugin::runtime()?;
    let stand_in = prepare::stand_in_runtime()?;
    println!("{}", prepare::title(&opts, model, &lib));
    let r = rt
        .block_on(prepare::in_process(&opts, model, &lib, stand_in.handle()))
        .context("in-process part")?;
    let mut report = r.report(&opts);
    print!("{}{}", prepare::table_header(), report.rows);
    if !a.skip_rss {
        let f = rt
            .block_on(prepare::plugin_process(
                &opts, model, &lib, &carve, help_kib,
            ))
            .context("plugin-process part (RSS, time to registration; --skip-rss skips it)")?;
        let p = f.report();
        report.met &= p.met;
        print!("{}", p.rows);
    }
    Ok(if report.met {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn cluster_shapes(v: &[String]) -> anyhow::Result<Vec<carve_frag::ClusterShape>> {
    if matches!(v, [s] if s.trim() == "none") {
        return Ok(Vec::new());
    }
    v.iter()
        .map(|s| match s.trim() {
            "all" => Ok(carve_frag::ClusterShape::All),
            g => g
                .parse::<u32>()
                .ok()
                .filter(|&g| g > 0)
                .map(carve_frag::ClusterShape::OnlyGpus)
                .ok_or_else(|| {
                    anyhow::anyhow!("--clusters: {s:?} is neither `all` nor a GPU count above 0")
                }),
        })
        .collect()
}

/// `--churn`: Poisson arrivals with departures, on the first trace.
fn fragmentation_churn(
    a: FragBench,
    seeds: Vec<u64>,
    policies: Vec<carve_frag::Policy>,
) -> anyhow::Result<ExitCode> {
    let mut cfg = carve_frag::BenchConfig::new(&a.trace[0]);
    cfg.nodes = a.nodes;
    cfg.seeds = seeds;
    cfg.model = a.model;
    cfg.sample_nodes_pct = a.sample_nodes;
    cfg.nodes_to_score_pct = a.nodes_to_score_pct;
    cfg.policies = policies;
    cfg.threads = a.threads;
    let report = carve_frag::run_churn(&cfg, &carve_frag::ChurnConfig::default())?;
    print!("{report}");
    if let Some(csv) = &a.csv {
        report.write_csv(csv)?;
    }
    Ok(ExitCode::SUCCESS)
}

fn fragmentation(a: FragBench) -> anyhow::Result<ExitCode> {
    let seeds = carve_frag::parse_seeds(&a.seeds)?;
    let policies = if a.policies.is_empty() {
        carve_frag::Policy::ALL.to_vec()
    } else {
        a.policies.clone()
    };
    if a.churn {
        return fragmentation_churn(a, seeds, policies);
    }
    let mut cfg = carve_frag::SuiteConfig::new(a.trace.clone());
    cfg.nodes = a.nodes;
    cfg.seeds = seeds;
    cfg.node_seeds = if a.node_seeds == "none" {
        Vec::new()
    } else {
        carve_frag::parse_seeds(&a.node_seeds)?
    };
    cfg.online_max_gpus = a.online_max_gpus;
    cfg.model = a.model;
    cfg.policies = policies;
    cfg.scorings = a.scoring;
    cfg.shapes = cluster_shapes(&a.clusters)?;
    cfg.sample_nodes_pct = a.sample_nodes;
    cfg.nodes_to_score_pct = a.nodes_to_score_pct;
    cfg.threads = a.threads;
    let report = carve_frag::run_suite(&cfg)?;
    print!("{report}");
    if a.detail {
        for run in &report.runs {
            println!(
                "\n=== {} / {} / {} ===",
                run.trace,
                run.shape.label(),
                run.report.scoring
            );
            print!("{}", run.report);
        }
    }
    if let Some(csv) = &a.csv {
        report.write_csv(csv)?;
    }
    if let (Some(path), Some(run)) = (&a.samples_csv, report.runs.first()) {
        run.report.write_csv(path)?;
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_missing_simulator_library_is_named() {
        let e = crate::simulate::find_sim_lib(Some(std::path::Path::new("/nonexistent/lib.so")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/lib.so"), "{e}");
    }
}
