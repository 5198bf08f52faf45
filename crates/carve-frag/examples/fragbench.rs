//! Run the benchmark without the `carve` binary:
//! `cargo run --release -p carve-frag --example fragbench -- TRACE [SEEDS] [SAMPLE_PCT] [CSV] [churn]`.

use carve_frag::{BenchConfig, ChurnConfig, parse_seeds, run, run_churn};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let trace = args
        .first()
        .ok_or("usage: fragbench TRACE [SEEDS] [SAMPLE_PCT] [CSV]")?;
    let mut cfg = BenchConfig::new(trace);
    if let Some(s) = args.get(1) {
        cfg.seeds = parse_seeds(s)?;
    }
    if let Some(p) = args.get(2).filter(|p| *p != "100") {
        cfg.sample_nodes_pct = Some(p.parse()?);
    }
    let t = std::time::Instant::now();
    if args.get(4).is_some_and(|a| a == "churn") {
        let report = run_churn(&cfg, &ChurnConfig::default())?;
        print!("{report}");
        println!("\n(wall time {:.1} s)", t.elapsed().as_secs_f64());
        if let Some(csv) = args.get(3).filter(|c| *c != "-") {
            report.write_csv(std::path::Path::new(csv))?;
        }
        return Ok(());
    }
    let report = run(&cfg)?;
    print!("{report}");
    println!("\n(wall time {:.1} s)", t.elapsed().as_secs_f64());
    if let Some(csv) = args.get(3).filter(|c| *c != "-") {
        report.write_csv(std::path::Path::new(csv))?;
    }
    Ok(())
}
