//! Development driver for the suite (the user-facing command is `carve bench
//! fragmentation`): `cargo run --release -p carve-frag --example suite --
//! TRACE... [seeds=1..5] [node_seeds=1..100] [shapes=all,8] [scorings=least,most]
//! [policies=name,carve] [csv=PATH] [threads=N] [online=MAX_GPUS] [online_states=N] [churn=1 [rhos=0.8,1.0]]`;
//! `churn=1` runs churn mode on the first trace instead (`--churn`).
use carve_frag::{ClusterShape, Scoring, SuiteConfig, parse_seeds, run_suite};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut traces = Vec::new();
    let mut cfg = SuiteConfig::new(Vec::new());
    let mut csv = None;
    let mut churn = false;
    let mut rhos = carve_frag::ChurnConfig::default().rhos;
    for a in std::env::args().skip(1) {
        match a.split_once('=') {
            Some(("seeds", v)) => cfg.seeds = parse_seeds(v)?,
            Some(("node_seeds", v)) => {
                cfg.node_seeds = if v.is_empty() {
                    Vec::new()
                } else {
                    parse_seeds(v)?
                }
            }
            Some(("threads", v)) => cfg.threads = v.parse()?,
            Some(("online", v)) => cfg.online_max_gpus = v.parse()?,
            Some(("online_states", v)) => cfg.online_max_states = v.parse()?,
            Some(("csv", v)) => csv = Some(std::path::PathBuf::from(v)),
            Some(("churn", v)) => churn = v == "1",
            Some(("rhos", v)) => rhos = v.split(',').map(str::parse).collect::<Result<_, _>>()?,
            Some(("policies", v)) => {
                cfg.policies = v.split(',').map(str::parse).collect::<Result<_, _>>()?
            }
            Some(("scorings", v)) => {
                cfg.scorings = v
                    .split(',')
                    .map(|s| {
                        if s.starts_with("most") {
                            Scoring::MostAllocated
                        } else {
                            Scoring::LeastAllocated
                        }
                    })
                    .collect()
            }
            Some(("shapes", v)) => {
                cfg.shapes = if v.is_empty() {
                    Vec::new()
                } else {
                    v.split(',')
                        .map(|s| {
                            if s == "all" {
                                Ok(ClusterShape::All)
                            } else {
                                s.parse().map(ClusterShape::OnlyGpus)
                            }
                        })
                        .collect::<Result<_, _>>()?
                }
            }
            _ => traces.push(std::path::PathBuf::from(a)),
        }
    }
    if churn {
        // Churn mode on the first trace, as `carve bench fragmentation --churn`.
        let trace = traces.first().ok_or("no trace given")?;
        let bc = carve_frag::BenchConfig {
            seeds: cfg.seeds.clone(),
            policies: cfg.policies.clone(),
            threads: cfg.threads,
            ..carve_frag::BenchConfig::new(trace)
        };
        let cc = carve_frag::ChurnConfig {
            rhos,
            ..carve_frag::ChurnConfig::default()
        };
        let r = carve_frag::run_churn(&bc, &cc)?;
        print!("{r}");
        if let Some(p) = csv {
            r.write_csv(&p)?;
        }
        return Ok(());
    }
    cfg.traces = traces;
    let r = run_suite(&cfg)?;
    print!("{r}");
    if let Some(p) = csv {
        r.write_csv(&p)?;
    }
    Ok(())
}
