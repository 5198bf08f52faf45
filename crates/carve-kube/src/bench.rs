//! Figures for `carve bench slices` (feature `bench`, on by default): how long
//! building and validating a node's slices takes, and how many API writes an
//! unchanged restart of the publisher costs against the in-process API server
//! stand-in (`carve-apiserver`). This measures and prints; it asserts nothing
//! about time.

use std::fmt;
use std::time::{Duration, Instant};

use carve_apiserver::{ApiServer, Options};
use carve_model::slices::{
    KubeLayout, NodeGpu, SliceError, SliceOptions, build_slices, simulated_node,
};

use crate::{PublishError, SlicePublisher};

/// Target for one build + validate of the benchmarked node.
pub const BUILD_TARGET: Duration = Duration::from_millis(1);
/// Target for API writes when a publisher restarts and nothing changed.
pub const RESTART_WRITES_TARGET: u64 = 0;

/// What to benchmark.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceBenchOptions {
    /// GPU model key (see `carve_model::MODELS`), default `h200-141gb`.
    pub model: String,
    /// GPUs on the node, default 8.
    pub gpus: u32,
    /// Build + validate rounds to time, default 1000 (at least 1 is run).
    pub iterations: u32,
    /// Slice layout, default 1.35+.
    pub layout: KubeLayout,
}

impl Default for SliceBenchOptions {
    fn default() -> Self {
        Self {
            model: "h200-141gb".into(),
            gpus: 8,
            iterations: 1000,
            layout: KubeLayout::V135Plus,
        }
    }
}

/// The figures of one `carve bench slices` run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceBench {
    /// The options it ran with.
    pub options: SliceBenchOptions,
    /// Slices of the node.
    pub slices: usize,
    /// Devices in them.
    pub devices: usize,
    /// Rounds timed.
    pub iterations: u32,
    /// The process's first build + validate (the model's counters worked out).
    pub first: Duration,
    /// Build + validate time per round (after the first).
    pub total: Percentiles,
    /// API writes of the first publish (one create per slice expected).
    pub first_publish_writes: u64,
    /// API writes of a fresh publisher syncing the same set (target 0).
    pub restart_writes: u64,
    /// API requests of that restart sync (one list expected).
    pub restart_requests: u64,
}

impl SliceBench {
    /// Whether every figure meets its target.
    pub fn meets_targets(&self) -> bool {
        self.total.p99 <= BUILD_TARGET && self.restart_writes == RESTART_WRITES_TARGET
    }
}

/// Nearest-rank percentiles of timed rounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Percentiles {
    /// Median.
    pub p50: Duration,
    /// 99th percentile.
    pub p99: Duration,
    /// Slowest.
    pub max: Duration,
}

impl Percentiles {
    /// Percentiles of `times` (all zero when empty).
    pub fn of(mut times: Vec<Duration>) -> Self {
        times.sort_unstable();
        let rank = |p: f64| {
            let n = times.len();
            if n == 0 {
                return Duration::ZERO;
            }
            let i = ((p * n as f64).ceil() as usize).clamp(1, n) - 1;
            times[i]
        };
        Self {
            p50: rank(0.50),
            p99: rank(0.99),
            max: rank(1.0),
        }
    }
}

fn verdict(ok: bool) -> &'static str {
    if ok { "ok" } else { "MISSED" }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

impl fmt::Display for SliceBench {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.options;
        writeln!(
            f,
            "slices: {}x {} ({:?}): {} slices, {} devices",
            o.gpus, o.model, o.layout, self.slices, self.devices
        )?;
        writeln!(
            f,
            "build+validate ({} iterations): p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms  (target p99 <= {:.3} ms: {})",
            self.iterations,
            ms(self.total.p50),
            ms(self.total.p99),
            ms(self.total.max),
            ms(BUILD_TARGET),
            verdict(self.total.p99 <= BUILD_TARGET)
        )?;
        writeln!(
            f,
            "first build+validate in the process (model counters worked out, then kept): {:.3} ms",
            ms(self.first)
        )?;
        writeln!(
            f,
            "first publish: {} API writes (one per slice)",
            self.first_publish_writes
        )?;
        write!(
            f,
            "unchanged restart: {} API writes, {} requests  (target {} writes: {})",
            self.restart_writes,
            self.restart_requests,
            RESTART_WRITES_TARGET,
            verdict(self.restart_writes == RESTART_WRITES_TARGET)
        )
    }
}

/// Why the benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The benchmarked node's slices could not be built (unknown model, ...).
    #[error("build the slices of {gpus}x {model}")]
    Build {
        /// GPU model key.
        model: String,
        /// GPU count.
        gpus: u32,
        /// Why.
        #[source]
        source: SliceError,
    },
    /// The API server stand-in did not start.
    #[error("start the API server stand-in")]
    Server(#[source] carve_apiserver::Error),
    /// Publishing to the stand-in failed.
    #[error("publish to the API server stand-in")]
    Publish(#[source] PublishError),
}

const NODE: &str = "bench-node";

/// Runs both measurements. Needs a tokio runtime (the stand-in serves on
/// 127.0.0.1 with an ephemeral port).
pub async fn run(options: SliceBenchOptions) -> Result<SliceBench, BenchError> {
    let build_err = |source| BenchError::Build {
        model: options.model.clone(),
        gpus: options.gpus,
        source,
    };
    let gpus: Vec<NodeGpu> = simulated_node(&options.model, options.gpus)
        .map_err(build_err)?
        .into_iter()
        .map(NodeGpu::dynamic)
        .collect();
    let slice_opts = SliceOptions::new(NODE, options.layout);
    // `build_slices` validates every slice it returns (`validate_slices`), so
    // one call is the whole "build and validate" unit of work.
    let build = || build_slices(&gpus, &slice_opts).map_err(build_err);

    // The first build of a model in a process also works out its counters
    // (every layout of the model enumerated, then kept for later builds, as
    // the plugin's rebuilds reuse them): timed on its own, not in the rounds.
    let start = Instant::now();
    let mut slices = std::hint::black_box(build()?);
    let first = start.elapsed();
    let iterations = options.iterations.max(1);
    let mut totals = Vec::with_capacity(iterations as usize);
    for _ in 0..iterations {
        let start = Instant::now();
        let built = std::hint::black_box(build()?);
        totals.push(start.elapsed());
        // Dropping the previous round's slices is not building or
        // validating: keep it out of the timed span.
        slices = built;
    }
    let total = Percentiles::of(totals);
    let devices = slices
        .iter()
        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        .sum();

    let server = ApiServer::start(Options::default())
        .await
        .map_err(BenchError::Server)?;
    let client = server.try_client().map_err(BenchError::Server)?;
    let _ = SlicePublisher::new(client, NODE, &slice_opts.driver)
        .sync(slices.clone())
        .await
        .map_err(BenchError::Publish)?;
    let first_publish_writes = server.stats().writes;
    server.reset_stats();
    // The restart: a new client and a new publisher that remember nothing.
    let client = server.try_client().map_err(BenchError::Server)?;
    let _ = SlicePublisher::new(client, NODE, &slice_opts.driver)
        .sync(build()?)
        .await
        .map_err(BenchError::Publish)?;
    let stats = server.stats();
    server.shutdown().await;

    Ok(SliceBench {
        slices: slices.len(),
        devices,
        iterations,
        first,
        total,
        first_publish_writes,
        restart_writes: stats.writes,
        restart_requests: stats.requests,
        options,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let times: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        let p = Percentiles::of(times);
        assert_eq!(
            (p.p50, p.p99, p.max),
            (
                Duration::from_millis(50),
                Duration::from_millis(99),
                Duration::from_millis(100)
            )
        );
        let one = Percentiles::of(vec![Duration::from_millis(7)]);
        let seven = Duration::from_millis(7);
        assert_eq!((one.p50, one.p99, one.max), (seven, seven, seven));
        assert_eq!(Percentiles::of(Vec::new()).max, Duration::ZERO);
    }
}
