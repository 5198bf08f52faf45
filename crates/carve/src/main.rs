//! `carve`: the one binary of the carve DRA driver for NVIDIA GPUs.
//!
//! Subcommands wire the library crates together; this is the only place that
//! uses `anyhow`.

mod advise;
mod bench;
mod bench_shares;
mod explain;
mod plugin;
mod render;
mod shares;
mod simulate;
mod slices;
mod yaml;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The environment variables logging reads, for the help texts.
const LOG_ENV_HELP: &str = "\
Logging (to stderr):
  CARVE_LOG         Which log lines to write; wins over RUST_LOG. tracing-subscriber's
                    EnvFilter syntax, e.g. `info` or `warn,carve_kube=debug`.
  RUST_LOG          The same as CARVE_LOG, read when CARVE_LOG is unset.
                    Neither set: `warn` (warnings and errors only). The plugin's start-up
                    line (version and settings) and its prepare/unprepare lines are `info`.
  CARVE_LOG_FORMAT  `text` or `json` (one JSON object per line), as --log-format.";

/// carve: a Kubernetes DRA driver that carves NVIDIA GPUs into MIG partitions on demand.
#[derive(Debug, Parser)]
#[command(
    name = "carve",
    version,
    about,
    propagate_version = true,
    after_help = LOG_ENV_HELP
)]
struct Cli {
    /// Log format: `text`, or `json` (one JSON object per line, for log collectors).
    #[arg(
        long,
        global = true,
        value_enum,
        default_value = "text",
        env = "CARVE_LOG_FORMAT"
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

impl LogFormat {
    /// The flag's value.
    fn as_str(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The kubelet plugin (node agent): publish the node's GPUs, prepare and
    /// unprepare claims.
    #[command(after_help = LOG_ENV_HELP)]
    KubeletPlugin(Box<plugin::PluginArgs>),
    /// The main job: a simulated GPU node with the real kubelet plugin, the example
    /// claims allocated, prepared and released, and a picture of the GPUs.
    Simulate(simulate::SimulateArgs),
    /// Print exactly the ResourceSlices carve would publish for a simulated node.
    Slices(slices::SlicesArgs),
    /// Say which devices a claim would get, or why it does not fit and what would make it fit.
    Explain(explain::ExplainArgs),
    /// Print (JSON) everything the NVML backend reads: GPUs, MIG profiles, placements,
    /// instances. Read-only: changes nothing on the GPUs.
    NvmlProbe(NvmlArgs),
    /// Watch the GPUs' health events (XID, ECC) through NVML for a while, as the
    /// plugin's health monitor does, and print each as a JSON line. Read-only.
    NvmlEvents(NvmlEventsArgs),
    /// Benchmarks that print figures against carve's targets.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Plan the smallest set of claim moves that would let a request fit (a plan only:
    /// nothing is evicted).
    Defrag(explain::DefragArgs),
    /// List the built-in GPU models (simulator fixtures) and their MIG profiles.
    Models,
    /// Run the Kubernetes API-server stand-in (resource.k8s.io/v1 slices, claims,
    /// device classes) until interrupted: for local experiments and e2e suites.
    Apiserver(ApiserverArgs),
    /// Recommend MIG, MPS or time-slicing for a workload mix, with the YAML to use.
    Advise(AdviseArgs),
}

/// Where NVML comes from.
#[derive(Debug, Clone, clap::Args)]
pub struct NvmlArgs {
    /// NVML library to load (a path, or a name the dynamic loader finds). The NVML
    /// simulator is `libnvidia_ml_sim.so`.
    #[arg(long, default_value = "libnvidia-ml.so.1", env = "CARVE_NVML_LIB")]
    pub nvml_lib: std::path::PathBuf,
    /// Root of the MIG capability files.
    #[arg(long, default_value = "/proc/driver/nvidia")]
    pub proc_driver_nvidia: std::path::PathBuf,
}

impl NvmlArgs {
    /// Open the NVML backend.
    pub fn open(&self) -> anyhow::Result<carve_nvml::NvmlBackend> {
        let opts = carve_nvml::NvmlOptions {
            lib_path: Some(self.nvml_lib.clone()),
            proc_root: self.proc_driver_nvidia.clone(),
        };
        // The backend's error names the library it tried.
        carve_nvml::NvmlBackend::open(opts).map_err(|e| anyhow::anyhow!("opening NVML: {e}"))
    }

    /// Open the NVML backend of the NVIDIA driver under `driver_root` (the
    /// plugin's view of it): a library name (the default
    /// `libnvidia-ml.so.1`) is looked for in the driver root's library
    /// directories first, since the plugin's image has no driver, and then
    /// through the dynamic loader; a path is opened as it is.
    pub fn open_in_driver_root(
        &self,
        driver_root: &std::path::Path,
    ) -> anyhow::Result<carve_nvml::NvmlBackend> {
        let name = self.nvml_lib.to_string_lossy();
        if name.contains('/') {
            return self.open();
        }
        let in_root = match carve_plugin::find_nvml(driver_root, &name) {
            Ok(path) => {
                tracing::info!(path = %path.display(), "NVML from the driver root");
                let at = NvmlArgs {
                    nvml_lib: path,
                    ..self.clone()
                };
                return at.open();
            }
            Err(e) => e,
        };
        self.open().map_err(|loader| {
            anyhow::anyhow!(
                "{in_root}; and the dynamic loader: {loader:#}. Point the chart's driverRoot \
                 (--container-driver-root in the plugin) at the NVIDIA driver's root: / for a \
                 driver on the host, /run/nvidia/driver for the GPU Operator's driver container; \
                 or --nvml-lib (nvml.lib) at the library"
            )
        })
    }
}

#[derive(Debug, clap::Args)]
struct NvmlEventsArgs {
    #[command(flatten)]
    nvml: NvmlArgs,
    /// How long to watch.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
}

/// `carve nvml-events`: events as JSON lines on stdout, what is watched and how
/// many arrived on stderr.
fn nvml_events(a: &NvmlEventsArgs) -> anyhow::Result<()> {
    use carve_gpu::{EventKind, GpuBackend as _, GpuEvents as _};
    use std::io::Write as _;
    let backend = a.nvml.open()?;
    let gpus = backend.gpus()?.len();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(a.seconds);
    // A zero wait starts watching: events from then on are delivered, and a
    // GPU that cannot be watched is reported at once.
    let first = backend.wait_events(std::time::Duration::ZERO)?;
    let unmonitored = first
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Unmonitored { .. }))
        .count();
    eprintln!(
        "carve nvml-events: watching {} of {gpus} GPUs for XID and ECC events for {} s",
        gpus - unmonitored.min(gpus),
        a.seconds
    );
    let mut out = std::io::stdout().lock();
    let mut count = 0usize;
    let mut batch = first;
    loop {
        for e in &batch {
            writeln!(out, "{}", serde_json::to_string(e)?)?;
        }
        out.flush()?;
        count += batch.len();
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            break;
        }
        batch = backend.wait_events(left.min(std::time::Duration::from_millis(500)))?;
    }
    eprintln!("carve nvml-events: {count} events");
    Ok(())
}

#[derive(Debug, clap::Args)]
struct ApiserverArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:6443")]
    addr: std::net::SocketAddr,
    /// Kubernetes version to report (`/version`).
    #[arg(long, default_value = "1.35", value_parser = parse_kube_version)]
    kube_version: carve_apiserver::KubeVersion,
}

/// Parse `1.35` (or `v1.35`, `1.35.2`) into a version carve models
/// ([`carve_model::slices::KubeVersion::MODELLED`]); the error lists them.
/// The message leaves the value out: clap's error already names it.
pub(crate) fn parse_kube_version(s: &str) -> Result<carve_apiserver::KubeVersion, String> {
    use carve_model::slices::KubeVersion as Modelled;
    let t = s.trim_start_matches('v');
    let mut it = t.split('.');
    let major = it.next().and_then(|m| m.parse().ok());
    let minor = it.next().and_then(|m| m.parse().ok());
    match (major, minor) {
        (Some(major), Some(minor)) if Modelled::new(major, minor).is_modelled() => {
            Ok(carve_apiserver::KubeVersion { major, minor })
        }
        (Some(_), Some(_)) => Err(format!(
            "carve models Kubernetes {} only",
            Modelled::modelled_list()
        )),
        _ => Err(format!(
            "not a Kubernetes version like 1.35 (carve models {})",
            Modelled::modelled_list()
        )),
    }
}

/// Check a `--gpus` list (`model:count[,model:count]`,
/// at most [`carve_model::slices::MAX_SIMULATED_GPUS`] GPUs) while the flags
/// are parsed, so that a bad list is a usage error (exit status 2) before
/// anything starts; the list stays text for the commands that read it.
pub(crate) fn parse_gpus_flag(s: &str) -> Result<String, String> {
    match carve_model::slices::parse_gpu_spec(s) {
        Ok(_) => Ok(s.to_string()),
        Err(e) => Err(e.to_string()),
    }
}

/// Check a bare GPU count (`carve bench ... --gpus N`): 1 to
/// [`carve_model::slices::MAX_SIMULATED_GPUS`].
pub(crate) fn parse_gpu_count(s: &str) -> Result<u32, String> {
    let max = carve_model::slices::MAX_SIMULATED_GPUS;
    match s.trim().parse::<u64>() {
        Ok(n) if (1..=u64::from(max)).contains(&n) => Ok(u32::try_from(n).unwrap_or(max)),
        Ok(n) => Err(format!(
            "{n} GPUs: a simulated node has 1 to {max} (a real node has at most 16)"
        )),
        Err(e) => Err(format!("not a GPU count: {e}")),
    }
}

#[derive(Debug, clap::Args)]
struct AdviseArgs {
    /// Do the co-located workloads compete for L2 cache / memory bandwidth?
    #[arg(long, value_enum, default_value = "unknown")]
    contention: advise::Answer,
    /// Must a fatal GPU fault of one tenant be kept from killing another's process?
    #[arg(long, value_enum, default_value = "unknown")]
    fault_isolation: advise::Answer,
    /// Request sizes as fractions of one GPU, comma-separated (e.g. 0.1,0.25,0.5).
    #[arg(
        long,
        value_delimiter = ',',
        required_unless_present = "trace",
        conflicts_with = "trace"
    )]
    sizes: Vec<f64>,
    /// Take the sizes from the GPU-sharing tasks (one GPU, `gpu_milli` < 1000) of an
    /// openb pod list (e.g. shared/data/traces/openb_pod_list_default.csv).
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
    /// GPU model (see `carve models`).
    #[arg(long, default_value = "h100-80gb")]
    model: String,
    /// The workloads are bursty or dev/test (favours time-slicing when no isolation is needed).
    #[arg(long)]
    bursty: bool,
}

/// The log filter: `CARVE_LOG`, else `RUST_LOG`, else `default`; and what
/// was wrong with a variable that is set but does not parse (it is skipped).
fn log_filter(
    var: impl Fn(&str) -> Option<String>,
    default: &str,
) -> (tracing_subscriber::EnvFilter, Vec<String>) {
    let mut unusable = Vec::new();
    for name in ["CARVE_LOG", "RUST_LOG"] {
        let Some(value) = var(name).filter(|v| !v.trim().is_empty()) else {
            continue;
        };
        match tracing_subscriber::EnvFilter::builder().parse(&value) {
            Ok(f) => return (f, unusable),
            Err(e) => unusable.push(format!("{name}={value:?} is not a log filter ({e})")),
        }
    }
    (tracing_subscriber::EnvFilter::new(default), unusable)
}

/// The filter when neither `CARVE_LOG` nor `RUST_LOG` is set: warnings and
/// errors only (the chart sets `RUST_LOG=info` for the plugin).
const DEFAULT_LOG_FILTER: &str = "warn";

fn init_tracing(format: LogFormat) {
    let (filter, unusable) = log_filter(|n| std::env::var(n).ok(), DEFAULT_LOG_FILTER);
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(carve_metrics::ansi_colours() && matches!(format, LogFormat::Text))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => b.init(),
        LogFormat::Json => b.json().init(),
    }
    for u in unusable {
        tracing::warn!("{u}; ignored");
    }
}

/// Whether this process was started under the fake MPS control's name
/// (`carve simulate` links [`carve_mps::fake::PROGRAM`] to this executable).
fn invoked_as_fake_mps_control() -> bool {
    std::env::args_os().next().is_some_and(|a| {
        std::path::Path::new(&a)
            .file_name()
            .is_some_and(|n| n == carve_mps::fake::PROGRAM)
    })
}

fn main() -> ExitCode {
    // The plugin starts each MPS control daemon through this executable, on
    // the unit's tmpfs as its /dev/shm and in its own cgroup (carve_mps::launcher).
    let raw: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if raw
        .get(1)
        .is_some_and(|a| a == carve_mps::launcher::EXEC_FLAG)
    {
        return carve_mps::launcher::exec_main(&raw[2..]);
    }
    if invoked_as_fake_mps_control() {
        let args: Vec<String> = std::env::args().skip(1).collect();
        return carve_mps::fake::run(&args);
    }
    let cli = Cli::parse();
    let format = cli.log_format;
    init_tracing(format);
    match run(cli.command, format) {
        Ok(code) => code,
        Err(e) => {
            let text = error_text(&e);
            match format {
                LogFormat::Text => eprintln!("carve: {text}"),
                // Every line in the chosen format, the last one too.
                LogFormat::Json => tracing::error!(error = %text, "carve: exiting on an error"),
            }
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, `: `-joined as `{:#}` prints them, but a cause
/// whose text the message before it already ends with is said once: an
/// error type of a library that puts its source both in its message and in
/// `source()` would otherwise repeat it ("...: No such file or directory
/// (os error 2): No such file or directory (os error 2)").
fn error_text(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.ends_with(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

fn run(cmd: Command, log_format: LogFormat) -> anyhow::Result<ExitCode> {
    match cmd {
        Command::Models => {
            print!("{}", models_table());
            Ok(ExitCode::SUCCESS)
        }
        Command::Simulate(a) => simulate::run(&a),
        Command::KubeletPlugin(a) => {
            plugin::run(*a, log_format.as_str())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Slices(a) => {
            if let Some(note) = slices::share_note(&a)? {
                eprintln!("note: {note}");
            }
            print!("{}", slices::run(&a)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Explain(a) => {
            let (text, fits) = explain::run(&a)?;
            print!("{text}");
            Ok(if fits {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Command::NvmlEvents(a) => {
            nvml_events(&a)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::NvmlProbe(a) => {
            let backend = a.open()?;
            let probe = carve_nvml::probe(&backend)?;
            println!("{}", serde_json::to_string_pretty(&probe)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench(b) => bench::run(b),
        Command::Defrag(a) => {
            print!("{}", explain::defrag(&a)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Apiserver(a) => {
            apiserver(&a)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Advise(a) => {
            print!("{}", advice(&a)?);
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `carve apiserver`: the stand-in served until Ctrl-C.
fn apiserver(a: &ApiserverArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let opts = carve_apiserver::Options {
            addr: a.addr,
            version: a.kube_version,
        };
        // Bound first, so the address printed is the one that serves
        // (`--addr 127.0.0.1:0` gets a port from the kernel).
        let server = carve_apiserver::ApiServer::start(opts).await?;
        eprintln!(
            "carve apiserver: serving Kubernetes {} on http://{}",
            a.kube_version,
            server.addr()
        );
        let _ = tokio::signal::ctrl_c().await;
        server.shutdown().await;
        anyhow::Ok(())
    })
}

/// `carve advise`: the advice for the request sizes given, or those of a
/// trace's fractional single-GPU tasks.
fn advice(a: &AdviseArgs) -> anyhow::Result<advise::Advice> {
    let spec = find_model(&a.model)?.spec();
    let sizes = match &a.trace {
        Some(t) => carve_frag::trace::load_tasks(t)?
            .iter()
            .filter(|r| r.num_gpu == 1 && r.gpu_milli > 0 && r.gpu_milli < 1000)
            .map(|r| f64::from(r.gpu_milli) / 1000.0)
            .collect(),
        None => a.sizes.clone(),
    };
    Ok(advise::advise(
        &spec,
        a.contention,
        a.fault_isolation,
        &sizes,
        a.bursty,
    )?)
}

fn find_model(key: &str) -> anyhow::Result<&'static carve_model::GpuModel> {
    carve_model::GpuModel::find(key).ok_or_else(|| {
        anyhow::anyhow!(
            "unknown GPU model {key:?}; known: {}",
            carve_model::GpuModel::keys().join(", ")
        )
    })
}

fn models_table() -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    for m in carve_model::MODELS {
        let s = m.spec();
        let _ = writeln!(
            out,
            "{:<11} {} ({}, {} MiB, {} SMs)",
            m.key, s.product_name, s.architecture, s.memory_mib, s.multiprocessors
        );
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
                if p.inferred {
                    "  (some values inferred)"
                } else {
                    ""
                }
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_modelled_kube_versions_parse() {
        for (text, minor) in [("1.34", 34), ("v1.35", 35), ("1.36.2", 36)] {
            let v = parse_kube_version(text).unwrap();
            assert_eq!((v.major, v.minor), (1, minor), "{text}");
        }
        for text in ["2.0", "1.33", "1.38", "1.20", "0.35"] {
            let e = parse_kube_version(text).unwrap_err();
            assert_eq!(
                e, "carve models Kubernetes 1.34, 1.35, 1.36, 1.37 only",
                "{text}"
            );
        }
        for text in ["", "1", "one.35", "1.x"] {
            let e = parse_kube_version(text).unwrap_err();
            assert!(
                e.starts_with("not a Kubernetes version like 1.35"),
                "{text}: {e}"
            );
            assert!(e.contains("1.34, 1.35, 1.36, 1.37"), "{text}: {e}");
        }
    }

    #[test]
    fn a_gpu_list_is_checked_with_its_limit() {
        assert_eq!(parse_gpus_flag("h100:64").unwrap(), "h100:64");
        let e = parse_gpus_flag("h100:65").unwrap_err();
        assert!(e.contains("65 GPUs") && e.contains("64"), "{e}");
        assert_eq!(parse_gpu_count("64"), Ok(64));
        assert_eq!(parse_gpu_count("1"), Ok(1));
        for bad in ["0", "65", "100000", "99999999999999"] {
            let e = parse_gpu_count(bad).unwrap_err();
            assert!(
                e.starts_with(&format!("{bad} GPUs: ")) && e.contains("1 to 64"),
                "{e}"
            );
        }
        assert!(
            parse_gpu_count("x")
                .unwrap_err()
                .starts_with("not a GPU count")
        );
        let e = parse_gpus_flag("v100:1").unwrap_err();
        assert!(e.contains("unknown GPU model \"v100\""), "{e}");
    }

    #[test]
    fn carve_log_wins_then_rust_log_then_the_default_and_bad_values_are_named() {
        let env = |carve: Option<&'static str>, rust: Option<&'static str>| {
            move |n: &str| match n {
                "CARVE_LOG" => carve.map(str::to_owned),
                "RUST_LOG" => rust.map(str::to_owned),
                _ => None,
            }
        };
        let (f, bad) = log_filter(env(Some("debug"), Some("warn")), "info");
        assert_eq!((f.to_string(), bad.len()), ("debug".into(), 0));
        let (f, _) = log_filter(env(Some(" "), Some("warn")), "info");
        assert_eq!(f.to_string(), "warn");
        let (f, _) = log_filter(env(None, None), "info");
        assert_eq!(f.to_string(), "info");
        let (f, bad) = log_filter(env(Some("carve=loud"), None), "info");
        assert_eq!(f.to_string(), "info");
        assert!(
            bad.len() == 1 && bad[0].contains("CARVE_LOG") && bad[0].contains("carve=loud"),
            "{bad:?}"
        );
    }
}
