//! `carve bench ...`: figures measured side by side with their targets and
//! baselines. Never timed tests: these print.

use std::process::ExitCode;

use carve_model::slices::KubeLayout;

#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {
    /// Time to build and validate a node's slices, and API writes on an unchanged restart.
    Slices(SlicesBench),
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
            let figures = rt.block_on(carve_kube::bench::run(carve_kube::bench::SliceBenchOptions {
                model: a.model,
                gpus: a.gpus,
                iterations: a.iterations,
                layout,
            }))?;
            println!("{figures}");
            Ok(ExitCode::SUCCESS)
        }
    }
}
