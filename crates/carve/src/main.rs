//! `carve`: the one binary of the carve DRA driver for NVIDIA GPUs.
//!
//! Subcommands wire the library crates together; this is the only place that
//! uses `anyhow`.

mod render;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// carve: a Kubernetes DRA driver that carves NVIDIA GPUs into MIG partitions on demand.
#[derive(Debug, Parser)]
#[command(name = "carve", version, about, propagate_version = true)]
struct Cli {
    /// Log format.
    #[arg(long, global = true, value_enum, default_value = "text", env = "CARVE_LOG_FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List the built-in GPU models (simulator fixtures) and their MIG profiles.
    Models,
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CARVE_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let b = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => b.init(),
        LogFormat::Json => b.json().init(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    match run(cli.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("carve: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cmd: Command) -> anyhow::Result<ExitCode> {
    match cmd {
        Command::Models => {
            print!("{}", models_table());
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn models_table() -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    for m in carve_model::MODELS {
        let s = m.spec();
        let _ = writeln!(out, "{:<11} {} ({}, {} MiB, {} SMs)", m.key, s.product_name, s.architecture, s.memory_mib, s.multiprocessors);
        for p in &s.profiles {
            let starts: Vec<String> = p.placements.iter().map(|pl| pl.start.to_string()).collect();
            let _ = writeln!(
                out,
                "    {:<12} id {:>2}  {}m/{}c slices  {:>3} SMs  {:>6} MiB  max {}  starts {{{}}}{}",
                p.name,
                p.id,
                p.memory_slices,
                p.compute_slices,
                p.multiprocessors,
                p.memory_mib,
                p.max_instances,
                starts.join(","),
                if p.inferred { "  (some values inferred)" } else { "" }
            );
        }
    }
    out
}
