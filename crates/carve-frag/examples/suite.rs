//! Development driver for the suite (the user-facing command is `carve bench
//! fragmentation`): `cargo run --release -p carve-frag --example suite --
//! TRACE... [seeds=1..5] [node_seeds=1..100] [shapes=all,8] [scorings=least,most]
//! [policies=name,carve] [csv=PATH] [threads=N]`.
use carve_frag::{ClusterShape, Scoring, SuiteConfig, parse_seeds, run_suite};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut traces = Vec::new();
    let mut cfg = SuiteConfig::new(Vec::new());
    let mut csv = None;
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
            Some(("csv", v)) => csv = Some(std::path::PathBuf::from(v)),
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
    cfg.traces = traces;
    let r = run_suite(&cfg)?;
    print!("{r}");
    if let Some(p) = csv {
        r.write_csv(&p)?;
    }
    Ok(())
}
