//! Configuration, the run over seeds × policies, the report and its CSV.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use carve_model::{GpuModel, GpuSpec, MODELS};

use crate::error::FragError;
use crate::mapping::{Demand, InternalFrag, Mapper};
use crate::rng::SplitMix64;
use crate::sim::{NodeCap, Policy, Scoring, Totals, World, draw_sequence, replay};
use crate::trace::{NodeRow, load_nodes, load_tasks};
#[cfg(test)]
use std::collections::HashMap;

/// Load points printed in the table (arrived compute, % of capacity).
pub const REPORT_POINTS: [u32; 4] = [90, 100, 110, 130];

/// What to run.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchConfig {
    /// Pod list (`openb_pod_list_*.csv`).
    pub trace: PathBuf,
    /// Node list; `None` = `openb_node_list_gpu_node.csv` next to the trace.
    pub nodes: Option<PathBuf>,
    /// Seeds; each gives one task sequence shared by every policy.
    pub seeds: Vec<u64>,
    /// carve-model key of the GPU every trace GPU becomes (MIG-capable).
    pub model: String,
    /// Stratified node sample in percent (keeps the GPUs-per-node mix);
    /// `None` = every node.
    pub sample_nodes_pct: Option<f64>,
    /// Policies to compare, in report order.
    pub policies: Vec<Policy>,
    /// Arrived load to stop at, % of compute capacity (130 in the protocol).
    pub max_load_pct: u32,
    /// Worker threads; 0 = available parallelism.
    pub threads: usize,
    /// kube-scheduler's `percentageOfNodesToScore`: 0 = its compiled-in
    /// adaptive default (41 % of 1,213 nodes), 100 = score every feasible node.
    pub nodes_to_score_pct: u32,
    /// kube-scheduler's `NodeResourcesFit` scoring strategy.
    pub scoring: Scoring,
    /// Keep only the nodes with this many GPUs (a different cluster shape
    /// from the same node list); `None` = every node.
    pub only_gpus: Option<u32>,
}

impl BenchConfig {
    /// The protocol's defaults for `trace`: seeds 42..=51, H100-80GB, every
    /// node, every policy, up to 130 %.
    #[must_use]
    pub fn new(trace: impl Into<PathBuf>) -> Self {
        Self {
            trace: trace.into(),
            nodes: None,
            seeds: (42..=51).collect(),
            model: "h100-80gb".into(),
            sample_nodes_pct: None,
            policies: Policy::ALL.to_vec(),
            max_load_pct: 130,
            threads: 0,
            nodes_to_score_pct: 0,
            scoring: Scoring::LeastAllocated,
            only_gpus: None,
        }
    }

    /// The node list in effect.
    #[must_use]
    pub fn nodes_path(&self) -> PathBuf {
        self.nodes.clone().unwrap_or_else(|| {
            self.trace
                .parent()
                .unwrap_or(Path::new("."))
                .join("openb_node_list_gpu_node.csv")
        })
    }
}

/// Parse `42..51` (both ends included, as the FGD paper's "42–51"), `42..=51`,
/// `42` or `1,5,9`.
///
/// # Errors
/// Not of those forms, or an empty range.
pub fn parse_seeds(s: &str) -> Result<Vec<u64>, FragError> {
    let bad = |reason: String| FragError::Config {
        field: "seeds",
        reason,
    };
    let num = |t: &str| {
        t.trim()
            .parse::<u64>()
            .map_err(|_| bad(format!("{t:?} is not a non-negative integer")))
    };
    if let Some((a, b)) = s.split_once("..") {
        let b = b.strip_prefix('=').unwrap_or(b);
        let (a, b) = (num(a)?, num(b)?);
        if b < a {
            return Err(bad(format!("empty range {s:?}")));
        }
        return Ok((a..=b).collect());
    }
    s.split(',').map(num).collect()
}

/// One sample: a policy and seed at one whole percent of arrived load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    /// Policy.
    pub policy: Policy,
    /// Seed.
    pub seed: u64,
    /// Arrived compute load, % of capacity.
    pub load_pct: u32,
    /// Cluster totals at that point.
    pub totals: Totals,
}

/// Everything a run measured.
#[derive(Clone, Debug)]
pub struct BenchReport {
    /// Pod list.
    pub trace: PathBuf,
    /// Node list.
    pub nodes_file: PathBuf,
    /// Model key.
    pub model: String,
    /// Nodes replayed.
    pub nodes: usize,
    /// GPUs replayed.
    pub gpus: u64,
    /// Compute slices of the cluster.
    pub compute_capacity: u64,
    /// Memory slices of the cluster.
    pub memory_capacity: u64,
    /// Seeds.
    pub seeds: Vec<u64>,
    /// Policies, in report order.
    pub policies: Vec<Policy>,
    /// Rows in the pod list.
    pub trace_tasks: usize,
    /// Tasks submitted per seed.
    pub submitted: Vec<usize>,
    /// Mapping rule, in words.
    pub rule: String,
    /// Failure classes.
    pub classes: Vec<String>,
    /// Internal fragmentation of the mapping over the trace rows.
    pub internal: InternalFrag,
    /// Every sample: policy × seed × load point (1..=max).
    pub samples: Vec<Sample>,
    /// Feasible nodes the modelled scheduler finds and scores per task
    /// (`percentageOfNodesToScore`).
    pub nodes_to_find: usize,
    /// Per tracked profile (the first classes): its popularity, the share of
    /// single-device GPU tasks of the trace mapped to it (weights of the
    /// fragmentation amount).
    pub popularity: Vec<f64>,
    /// Per tracked profile: the typical host request of its tasks, `(cpu
    /// milli, memory MiB)`, medians over the trace rows mapped to it.
    pub requests: Vec<(u64, u64)>,
    /// The scheduler's scoring strategy.
    pub scoring: Scoring,
    /// Failure classes of the single-device profiles with more than half a
    /// GPU's compute (on H100: `4g`, `7g`): those that need slice 0.
    pub large_classes: Vec<usize>,
    /// Rows of the trace with a `gpu_spec` (honoured as a node filter).
    pub gpu_spec_rows: usize,
    /// Warnings about the inputs (e.g. `gpu_spec` models absent from the
    /// node list), each naming the rows.
    pub warnings: Vec<String>,
}

/// Which figure of a sample to summarise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    /// Unallocated compute slices, % of capacity.
    UnallocatedCompute,
    /// Unallocated memory slices, % of capacity.
    UnallocatedMemory,
    /// Stranded compute slices, % of capacity.
    StrandedCompute,
    /// Stranded memory slices, % of capacity.
    StrandedMemory,
    /// Failed GPU tasks (all classes but CPU-only).
    FailedGpuTasks,
    /// FGD-style MIG fragmentation amount, % of capacity: the sum over the
    /// profiles `k` of popularity `p_k` × the free compute slices `k` cannot
    /// use (no free placement on the GPU, or the node lacks `k`'s typical CPU
    /// or RAM).
    FragAmount,
    /// The fragmentation amount as a share of the free compute slices, %.
    FragRatio,
}

fn pct_f(x: f64, cap: u64) -> f64 {
    100.0 * x / cap as f64
}

pub(crate) fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

impl BenchReport {
    /// The value of `metric` for one sample.
    #[must_use]
    pub fn value(&self, s: &Sample, metric: Metric) -> f64 {
        let pct = |x: u64, cap: u64| 100.0 * x as f64 / cap as f64;
        let t = &s.totals;
        match metric {
            Metric::UnallocatedCompute => pct(
                self.compute_capacity - t.used_compute,
                self.compute_capacity,
            ),
            Metric::UnallocatedMemory => {
                pct(self.memory_capacity - t.used_memory, self.memory_capacity)
            }
            Metric::StrandedCompute => pct(t.stranded_compute, self.compute_capacity),
            Metric::StrandedMemory => pct(t.stranded_memory, self.memory_capacity),
            Metric::FailedGpuTasks => {
                let n = t.failures.len();
                t.failures[..n.saturating_sub(1)].iter().sum::<u64>() as f64
            }
            Metric::FragAmount => pct_f(self.frag_amount(t), self.compute_capacity),
            Metric::FragRatio => {
                let idle = self.compute_capacity - t.used_compute;
                if idle == 0 {
                    0.0
                } else {
                    pct_f(self.frag_amount(t), idle)
                }
            }
        }
    }

    /// The fragmentation amount of `t` in compute slices:
    /// `Σ_k p_k × unusable_k` ([`Totals::unusable_compute`]).
    #[must_use]
    pub fn frag_amount(&self, t: &Totals) -> f64 {
        self.popularity
            .iter()
            .zip(&t.unusable_compute)
            .map(|(&p, &u)| p * u as f64)
            .sum()
    }

    /// The sample of `policy` and `seed` at `load_pct`.
    #[must_use]
    pub fn sample(&self, policy: Policy, seed: u64, load_pct: u32) -> Option<&Sample> {
        self.samples
            .iter()
            .find(|s| s.policy == policy && s.seed == seed && s.load_pct == load_pct)
    }

    /// Mean of unallocated compute %, over the load points `lo..=hi`, of one
    /// policy and seed (`None` when a point is missing).
    #[must_use]
    pub fn band_mean(&self, policy: Policy, seed: u64, lo: u32, hi: u32) -> Option<f64> {
        let mut sum = 0.0;
        for load in lo..=hi {
            sum += self.value(self.sample(policy, seed, load)?, Metric::UnallocatedCompute);
        }
        Some(sum / f64::from(hi - lo + 1))
    }

    /// Compute slices of failed tasks of the [`BenchReport::large_classes`]
    /// (on H100 `4g` and `7g`), % of capacity.
    #[must_use]
    pub fn failed_large_pct(&self, t: &Totals) -> f64 {
        let s: u64 = self
            .large_classes
            .iter()
            .map(|&c| t.failed_compute[c])
            .sum();
        pct_f(s as f64, self.compute_capacity)
    }

    /// Values of `metric` for `policy` at `load_pct`, one per seed.
    #[must_use]
    pub fn values(&self, policy: Policy, load_pct: u32, metric: Metric) -> Vec<f64> {
        self.samples
            .iter()
            .filter(|s| s.policy == policy && s.load_pct == load_pct)
            .map(|s| self.value(s, metric))
            .collect()
    }

    /// Median over seeds of `metric` for `policy` at `load_pct`.
    #[must_use]
    pub fn median(&self, policy: Policy, load_pct: u32, metric: Metric) -> Option<f64> {
        median(self.values(policy, load_pct, metric))
    }

    /// Write one row per policy × seed × load point, atomically (a temporary
    /// file in the same folder, renamed over `path`).
    ///
    /// # Errors
    /// The folder is not writable; `path` is then left untouched.
    pub fn write_csv(&self, path: &Path) -> Result<(), FragError> {
        let werr = |source: std::io::Error| FragError::Write {
            path: path.to_path_buf(),
            source,
        };
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let tmp = tempfile::NamedTempFile::new_in(dir).map_err(werr)?;
        {
            let mut w = csv::Writer::from_writer(std::io::BufWriter::new(tmp.as_file()));
            let mut header: Vec<String> = [
                "policy",
                "seed",
                "arrived_pct",
                "tasks_submitted",
                "tasks_placed",
                "arrived_compute_slices",
                "used_compute_slices",
                "used_memory_slices",
                "unallocated_compute_pct",
                "unallocated_memory_pct",
                "stranded_compute_slices",
                "stranded_memory_slices",
                "mig_frag_amount_slices",
                "mig_frag_ratio_pct",
            ]
            .iter()
            .map(|s| (*s).to_string())
            .collect();
            header.extend(
                self.classes
                    .iter()
                    .map(|c| format!("failed_{}", c.split(' ').next().unwrap_or(c))),
            );
            let cerr = |e: csv::Error| werr(std::io::Error::other(e));
            w.write_record(&header).map_err(cerr)?;
            for s in &self.samples {
                let t = &s.totals;
                let mut row = vec![
                    s.policy.label().to_string(),
                    s.seed.to_string(),
                    s.load_pct.to_string(),
                    t.tasks.to_string(),
                    t.placed.to_string(),
                    t.arrived_compute.to_string(),
                    t.used_compute.to_string(),
                    t.used_memory.to_string(),
                    format!("{:.4}", self.value(s, Metric::UnallocatedCompute)),
                    format!("{:.4}", self.value(s, Metric::UnallocatedMemory)),
                    t.stranded_compute.to_string(),
                    t.stranded_memory.to_string(),
                    format!("{:.2}", self.frag_amount(t)),
                    format!("{:.4}", self.value(s, Metric::FragRatio)),
                ];
                row.extend(t.failures.iter().map(u64::to_string));
                w.write_record(&row).map_err(cerr)?;
            }
            w.flush().map_err(werr)?;
        }
        tmp.as_file().sync_all().map_err(werr)?;
        tmp.persist(path).map_err(|e| werr(e.error))?;
        Ok(())
    }
}

fn mig_keys() -> String {
    MODELS
        .iter()
        .filter(|m| m.spec().mig_capable)
        .map(|m| m.key)
        .collect::<Vec<_>>()
        .join(", ")
}

fn model_spec(key: &str) -> Result<(&'static str, GpuSpec), FragError> {
    let m = GpuModel::find(key).ok_or_else(|| FragError::UnknownModel {
        model: key.to_string(),
        known: mig_keys(),
    })?;
    let spec = m.spec();
    if !spec.mig_capable {
        return Err(FragError::NotMigCapable {
            model: m.key.to_string(),
            known: mig_keys(),
        });
    }
    Ok((m.key, spec))
}

/// A stratified sample: in each group of nodes with the same GPU count, a fixed
/// shuffle (seed 0, independent of the run's seeds) keeps `round(pct %)` of the
/// group, at least one node.
#[must_use]
pub fn sample_nodes(nodes: &[NodeRow], pct: f64) -> Vec<NodeRow> {
    let mut groups: std::collections::BTreeMap<u32, Vec<usize>> = Default::default();
    for (i, n) in nodes.iter().enumerate() {
        groups.entry(n.gpus).or_default().push(i);
    }
    let mut rng = SplitMix64::new(0);
    let mut keep = Vec::new();
    for idx in groups.values_mut() {
        rng.shuffle(idx);
        let k = ((idx.len() as f64 * pct / 100.0).round() as usize).clamp(1, idx.len());
        keep.extend_from_slice(&idx[..k]);
    }
    keep.sort_unstable();
    keep.into_iter().map(|i| nodes[i].clone()).collect()
}

/// Loaded and checked inputs shared by the inflation and churn runs.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub model: &'static str,
    pub spec: GpuSpec,
    pub nodes_file: PathBuf,
    pub caps: Vec<NodeCap>,
    pub tasks: Vec<crate::trace::TaskRow>,
    pub mapper: Mapper,
    pub demands: Vec<Demand>,
    pub profiles: Vec<usize>,
    pub gpus: u64,
    pub compute_capacity: u64,
    pub memory_capacity: u64,
    pub nodes_to_find: usize,
    /// See [`BenchReport::popularity`].
    pub popularity: Vec<f64>,
    /// See [`BenchReport::requests`].
    pub requests: Vec<(u64, u64)>,
    /// See [`BenchReport::gpu_spec_rows`].
    pub gpu_spec_rows: usize,
    /// See [`BenchReport::warnings`].
    pub warnings: Vec<String>,
    pub scoring: Scoring,
}

impl Prepared {
    pub fn world(&self) -> World<'_> {
        World {
            spec: &self.spec,
            nodes: &self.caps,
            demands: &self.demands,
            profiles: &self.profiles,
            classes: self.mapper.classes().len(),
            compute_capacity: self.compute_capacity,
            nodes_to_find: self.nodes_to_find,
            requests: &self.requests,
            scoring: self.scoring,
        }
    }
}

/// Node models as bits, in order of first appearance in the node list.
///
/// # Errors
/// More than 64 distinct models.
fn model_bits(nodes: &[NodeRow], path: &Path) -> Result<Vec<String>, FragError> {
    let mut models: Vec<String> = Vec::new();
    for n in nodes {
        if !models.contains(&n.model) {
            models.push(n.model.clone());
        }
    }
    if models.len() > 64 {
        return Err(FragError::Config {
            field: "nodes",
            reason: format!(
                "{}: {} distinct GPU models; at most 64 are supported",
                path.display(),
                models.len()
            ),
        });
    }
    Ok(models)
}

/// Apply each task's `gpu_spec` as a node filter ([`Demand::models`]); a
/// warning for the rows that name models absent from the node list (they
/// can run only on the models that are present, or nowhere).
fn apply_gpu_spec(
    tasks: &[crate::trace::TaskRow],
    demands: &mut [Demand],
    models: &[String],
    trace: &Path,
) -> (usize, Vec<String>) {
    let mut rows = 0usize;
    let mut unknown: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for (t, d) in tasks.iter().zip(demands.iter_mut()) {
        if t.gpu_spec.is_empty() {
            continue;
        }
        rows += 1;
        let mut mask = 0u64;
        for m in &t.gpu_spec {
            match models.iter().position(|x| x == m) {
                Some(i) => mask |= 1 << i,
                None => unknown.entry(m.clone()).or_default().push(t.name.clone()),
            }
        }
        d.models = mask;
    }
    let warnings = unknown
        .into_iter()
        .map(|(m, names)| {
            let shown: Vec<&str> = names.iter().take(5).map(String::as_str).collect();
            format!(
                "{}: gpu_spec model {m:?} is not in the node list; {} row(s) name it ({}{}); they may run only on the other models they name, or on no node",
                trace.display(),
                names.len(),
                shown.join(", "),
                if names.len() > shown.len() { ", …" } else { "" }
            )
        })
        .collect();
    (rows, warnings)
}

/// Popularity and typical `(cpu milli, memory MiB)` request of each tracked
/// profile over the single-device GPU tasks of the trace (medians; `(0, 0)`
/// for a profile no task maps to).
fn profile_mix(demands: &[Demand], profiles: &[usize]) -> (Vec<f64>, Vec<(u64, u64)>) {
    let single: Vec<&Demand> = demands.iter().filter(|d| d.count == 1).collect();
    let med = |mut v: Vec<u64>| {
        v.sort_unstable();
        v.get(v.len() / 2).copied().unwrap_or(0)
    };
    profiles
        .iter()
        .map(|&p| {
            let of: Vec<&&Demand> = single.iter().filter(|d| d.profile == Some(p)).collect();
            let pop = if single.is_empty() {
                0.0
            } else {
                of.len() as f64 / single.len() as f64
            };
            let req = (
                med(of.iter().map(|d| d.cpu_milli).collect()),
                med(of.iter().map(|d| d.memory_mib).collect()),
            );
            (pop, req)
        })
        .unzip()
}

pub(crate) fn prepare(cfg: &BenchConfig) -> Result<Prepared, FragError> {
    if cfg.seeds.is_empty() {
        return Err(FragError::Config {
            field: "seeds",
            reason: "no seed given".into(),
        });
    }
    if cfg.policies.is_empty() {
        return Err(FragError::Config {
            field: "policies",
            reason: "no policy given".into(),
        });
    }
    if !(1..=1000).contains(&cfg.max_load_pct) {
        return Err(FragError::Config {
            field: "max-load",
            reason: format!("{} % is not in 1..=1000", cfg.max_load_pct),
        });
    }
    if let Some(p) = cfg.sample_nodes_pct
        && !(p > 0.0 && p <= 100.0)
    {
        return Err(FragError::Config {
            field: "sample-nodes",
            reason: format!("{p} % is not in (0, 100]"),
        });
    }
    let (model, spec) = model_spec(&cfg.model)?;
    let nodes_file = cfg.nodes_path();
    let mut node_rows = load_nodes(&nodes_file)?;
    let models = model_bits(&node_rows, &nodes_file)?;
    if let Some(g) = cfg.only_gpus {
        node_rows.retain(|n| n.gpus == g);
    }
    if let Some(p) = cfg.sample_nodes_pct {
        node_rows = sample_nodes(&node_rows, p);
    }
    let tasks = load_tasks(&cfg.trace)?;
    let mapper = Mapper::new(&spec)?;
    let mut demands: Vec<Demand> = tasks.iter().map(|t| mapper.map(&spec, t)).collect();
    let (gpu_spec_rows, warnings) = apply_gpu_spec(&tasks, &mut demands, &models, &cfg.trace);
    let caps: Vec<NodeCap> = node_rows
        .iter()
        .map(|n| NodeCap {
            cpu_milli: n.cpu_milli,
            memory_mib: n.memory_mib,
            gpus: n.gpus,
            model_bit: 1 << models.iter().position(|m| *m == n.model).unwrap_or(0),
        })
        .collect();
    let gpus: u64 = caps.iter().map(|n| u64::from(n.gpus)).sum();
    if gpus == 0 {
        return Err(FragError::NoGpus { path: nodes_file });
    }
    if demands.iter().all(|d| d.compute_slices == 0) {
        return Err(FragError::Config {
            field: "trace",
            reason: format!(
                "{} holds no GPU task, so no load arrives",
                cfg.trace.display()
            ),
        });
    }
    let compute_capacity = gpus * u64::from(spec.compute_slices);
    let memory_capacity = gpus * u64::from(spec.memory_slices);
    let profiles = mapper.profiles();
    let nodes_to_find = crate::sim::nodes_to_find(caps.len(), cfg.nodes_to_score_pct);
    let (popularity, requests) = profile_mix(&demands, &profiles);
    Ok(Prepared {
        model,
        spec,
        nodes_file,
        caps,
        tasks,
        mapper,
        demands,
        profiles,
        gpus,
        compute_capacity,
        memory_capacity,
        nodes_to_find,
        popularity,
        requests,
        gpu_spec_rows,
        warnings,
        scoring: cfg.scoring,
    })
}

/// Run `job(j)` for every `j < jobs` on up to `threads` threads (0 = available
/// parallelism); results in job order.
pub(crate) fn parallel<T: Send>(
    jobs: usize,
    threads: usize,
    job: impl Fn(usize) -> T + Sync,
) -> Vec<T> {
    let threads = if threads == 0 {
        std::thread::available_parallelism().map_or(1, usize::from)
    } else {
        threads
    }
    .clamp(1, jobs.max(1));
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<T>>> = Mutex::new((0..jobs).map(|_| None).collect());
    std::thread::scope(|sc| {
        for _ in 0..threads {
            sc.spawn(|| {
                loop {
                    let j = next.fetch_add(1, Ordering::Relaxed);
                    if j >= jobs {
                        break;
                    }
                    let r = job(j);
                    results
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)[j] = Some(r);
                }
            });
        }
    });
    results
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .into_iter()
        .flatten()
        .collect()
}

/// Run the benchmark.
///
/// # Errors
/// A trace file is missing or malformed, the model is unknown or not
/// MIG-capable, or a setting is out of range.
pub fn run(cfg: &BenchConfig) -> Result<BenchReport, FragError> {
    let pr = prepare(cfg)?;
    let world = pr.world();
    let (demands, compute_capacity) = (&pr.demands, pr.compute_capacity);
    let seqs: Vec<Vec<u32>> = cfg
        .seeds
        .iter()
        .map(|&s| draw_sequence(demands, s, compute_capacity, cfg.max_load_pct))
        .collect();
    let jobs: Vec<(usize, Policy)> = (0..cfg.seeds.len())
        .flat_map(|s| cfg.policies.iter().map(move |&p| (s, p)))
        .collect();
    let results = parallel(jobs.len(), cfg.threads, |j| {
        let (si, policy) = jobs[j];
        replay(
            &world,
            policy,
            cfg.seeds[si],
            &seqs[si],
            cfg.max_load_pct,
            false,
        )
        .points
    });
    let mut samples = Vec::new();
    for (j, points) in results.into_iter().enumerate() {
        let (si, policy) = jobs[j];
        for (k, totals) in points.into_iter().enumerate() {
            samples.push(Sample {
                policy,
                seed: cfg.seeds[si],
                load_pct: k as u32 + 1,
                totals,
            });
        }
    }
    Ok(BenchReport {
        trace: cfg.trace.clone(),
        nodes_file: pr.nodes_file.clone(),
        model: pr.model.to_string(),
        nodes: pr.caps.len(),
        gpus: pr.gpus,
        compute_capacity,
        memory_capacity: pr.memory_capacity,
        seeds: cfg.seeds.clone(),
        policies: cfg.policies.clone(),
        trace_tasks: pr.tasks.len(),
        submitted: seqs.iter().map(Vec::len).collect(),
        rule: pr.mapper.rule_text(&pr.spec),
        classes: pr.mapper.classes().to_vec(),
        internal: pr.mapper.internal(&pr.spec, &pr.tasks),
        samples,
        nodes_to_find: pr.nodes_to_find,
        popularity: pr.popularity.clone(),
        requests: pr.requests.clone(),
        scoring: cfg.scoring,
        large_classes: pr
            .profiles
            .iter()
            .enumerate()
            .filter(|&(_, &p)| 2 * pr.spec.profiles[p].compute_slices > pr.spec.compute_slices)
            .map(|(k, _)| k)
            .collect(),
        gpu_spec_rows: pr.gpu_spec_rows,
        warnings: pr.warnings.clone(),
    })
}

fn fmt_opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.2}"))
}

impl BenchReport {
    fn table(
        &self,
        f: &mut fmt::Formatter<'_>,
        title: &str,
        metric: Metric,
        ratio: bool,
    ) -> fmt::Result {
        writeln!(
            f,
            "\n{title} (median over {} seeds{}):",
            self.seeds.len(),
            if ratio { "; × = vs name" } else { "" }
        )?;
        write!(f, "  {:<17}", "policy")?;
        for p in REPORT_POINTS {
            write!(f, " {:>15}", format!("arrived {p}%"))?;
        }
        if ratio {
            write!(f, " {:>15}", "100% min–max")?;
        }
        writeln!(f)?;
        for &pol in &self.policies {
            write!(f, "  {:<17}", pol.label())?;
            for p in REPORT_POINTS {
                let v = self.median(pol, p, metric);
                let base = self.median(Policy::Name, p, metric);
                let cell = match (ratio, v, base) {
                    (true, Some(v), Some(b)) if b > 0.0 => format!("{v:.2} ×{:.2}", v / b),
                    _ => fmt_opt(v),
                };
                write!(f, " {cell:>15}")?;
            }
            if ratio {
                let vs = self.values(pol, 100, metric);
                let lo = vs.iter().copied().reduce(f64::min);
                let hi = vs.iter().copied().reduce(f64::max);
                write!(f, " {:>15}", format!("{}–{}", fmt_opt(lo), fmt_opt(hi)))?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

impl BenchReport {
    fn per_class(
        &self,
        f: &mut fmt::Formatter<'_>,
        load: u32,
        get: impl Fn(&Totals, usize) -> f64,
        digits: usize,
    ) -> fmt::Result {
        write!(f, "  {:<17}", "policy")?;
        for c in &self.classes {
            write!(f, " {:>12}", c.split(' ').next().unwrap_or(c))?;
        }
        writeln!(f)?;
        for &pol in &self.policies {
            write!(f, "  {:<17}", pol.label())?;
            for ci in 0..self.classes.len() {
                let v: Vec<f64> = self
                    .samples
                    .iter()
                    .filter(|s| s.policy == pol && s.load_pct == load)
                    .map(|s| get(&s.totals, ci))
                    .collect();
                let cell = median(v).map_or("-".into(), |v| format!("{v:.digits$}"));
                write!(f, " {cell:>12}")?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let seeds = match (self.seeds.first(), self.seeds.last()) {
            (Some(a), Some(b)) if self.seeds.len() > 1 => {
                format!("{a}..{b} ({})", self.seeds.len())
            }
            (Some(a), _) => a.to_string(),
            _ => "-".into(),
        };
        let sub = median(self.submitted.iter().map(|&n| n as f64).collect()).unwrap_or(0.0);
        writeln!(f, "carve bench fragmentation")?;
        writeln!(
            f,
            "  trace: {} ({} tasks); nodes: {}",
            self.trace.display(),
            self.trace_tasks,
            self.nodes_file.display()
        )?;
        writeln!(
            f,
            "  cluster: {} nodes, {} GPUs, every GPU a {} ({} compute / {} memory slices); seeds {seeds}; {sub:.0} tasks submitted per seed (median)",
            self.nodes, self.gpus, self.model, self.compute_capacity, self.memory_capacity
        )?;
        writeln!(f, "  mapping: {}", self.rule)?;
        let i = &self.internal;
        writeln!(
            f,
            "  internal fragmentation of the mapping (MIG size vs requested gpu_milli, before placement): sharing tasks compute ×{:.3}, memory ×{:.3}; all GPU tasks compute ×{:.3}, memory ×{:.3}",
            i.sharing.compute_ratio(),
            i.sharing.memory_ratio(),
            i.all.compute_ratio(),
            i.all.memory_ratio()
        )?;
        writeln!(
            f,
            "  protocol: tasks drawn with replacement per seed, one at a time, no departures, failed tasks not retried, until arrived compute slices reach the top load; arrived load = mapped compute slices submitted / capacity"
        )?;
        writeln!(
            f,
            "  node choice: kube-scheduler defaults, the same for every policy: filter CPU, RAM and a free device (DynamicResources), round-robin from where the last search stopped, until {} feasible nodes are found (percentageOfNodesToScore{}); score them with NodeResourcesFit LeastAllocated (cpu, memory) + NodeResourcesBalancedAllocation, weight 1 each (DynamicResources has no score for single-request claims); ties broken at random (seeded)",
            self.nodes_to_find,
            if self.nodes_to_find >= self.nodes {
                ": every node".to_string()
            } else {
                format!(
                    ": {:.0} % of {} nodes; kube's default for this size is {}",
                    100.0 * self.nodes_to_find as f64 / self.nodes as f64,
                    self.nodes,
                    crate::sim::nodes_to_find(self.nodes, 0)
                )
            }
        )?;
        writeln!(
            f,
            "  device choice: first free device of the requested profile in the node's published order (DRA allocator); best-fit is dynamic (least free compute GPU that fits; a reference, not a static order)"
        )?;
        writeln!(
            f,
            "  repack-heuristic: carve's order while the profile has a free placement on a node; otherwise the node counts as feasible when its live instances plus the new ones pack onto its GPUs (exhaustive search over maximal per-GPU layouts) and the chosen node is then re-packed (migrations allowed). A heuristic, not a bound: it re-packs only the chosen node, only on a miss, and changes which nodes the scheduler finds feasible afterwards"
        )?;
        let mix: Vec<String> = self
            .popularity
            .iter()
            .zip(&self.requests)
            .zip(&self.classes)
            .map(|((p, (cpu, mem)), c)| {
                format!(
                    "{c} p={:.3} ({:.1} cores, {} MiB)",
                    p,
                    *cpu as f64 / 1000.0,
                    mem
                )
            })
            .collect();
        writeln!(
            f,
            "  fragmentation amount (fragmentation.md §8.3): per profile k, the free compute slices on GPUs where k has no free placement or whose node has less free CPU/RAM than k's median request, weighted by k's share of single-device GPU tasks: {}",
            mix.join(", ")
        )?;
        self.table(
            f,
            "Unallocated compute slices %",
            Metric::UnallocatedCompute,
            true,
        )?;
        self.table(
            f,
            "Unallocated memory slices %",
            Metric::UnallocatedMemory,
            true,
        )?;
        self.table(
            f,
            "Stranded compute slices, % of capacity",
            Metric::StrandedCompute,
            false,
        )?;
        self.table(
            f,
            "Stranded memory slices, % of capacity",
            Metric::StrandedMemory,
            false,
        )?;
        self.table(
            f,
            "MIG fragmentation amount (FGD-style: Σ over profiles of popularity × free compute slices the profile cannot use), % of capacity",
            Metric::FragAmount,
            true,
        )?;
        self.table(
            f,
            "MIG fragmentation ratio (fragmentation amount / free compute slices), %",
            Metric::FragRatio,
            false,
        )?;
        self.table(f, "Failed GPU tasks", Metric::FailedGpuTasks, false)?;
        if self.samples.iter().any(|s| s.load_pct == 100) {
            writeln!(
                f,
                "\nCompute slices of failed tasks by class at arrived 100%, % of capacity (median over seeds; at 100% arrived, unallocated ≈ failed):"
            )?;
            self.per_class(
                f,
                100,
                |t, ci| t.failed_compute[ci] as f64 * 100.0 / self.compute_capacity as f64,
                2,
            )?;
        }
        if self.policies.contains(&Policy::RepackHeuristic) {
            let v: Vec<f64> = self
                .samples
                .iter()
                .filter(|s| s.policy == Policy::RepackHeuristic && s.load_pct == 100)
                .map(|s| s.totals.repacks as f64)
                .collect();
            if let Some(m) = median(v) {
                writeln!(
                    f,
                    "\nrepack-heuristic re-packed a node {m:.0} times up to arrived 100% (median over seeds)"
                )?;
            }
        }
        let last = REPORT_POINTS
            .iter()
            .copied()
            .filter(|&p| self.samples.iter().any(|s| s.load_pct == p))
            .max();
        if let Some(p) = last {
            writeln!(
                f,
                "\nFailed tasks per class at arrived {p}% (median over seeds):"
            )?;
            self.per_class(f, p, |t, ci| t.failures[ci] as f64, 0)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use carve_model::geometry::Occupancy;

    fn data(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data")
            .join(name)
    }

    fn cfg(seeds: &[u64]) -> BenchConfig {
        BenchConfig {
            seeds: seeds.to_vec(),
            threads: 2,
            ..BenchConfig::new(data("openb_pod_list_sample.csv"))
        }
    }

    #[test]
    fn parse_seeds_forms() {
        assert_eq!(
            parse_seeds("42..51").unwrap(),
            (42..=51).collect::<Vec<_>>()
        );
        assert_eq!(parse_seeds("42..=43").unwrap(), vec![42, 43]);
        assert_eq!(parse_seeds("7").unwrap(), vec![7]);
        assert_eq!(parse_seeds("1,5, 9").unwrap(), vec![1, 5, 9]);
        assert!(matches!(
            parse_seeds("9..3"),
            Err(FragError::Config { field: "seeds", .. })
        ));
        assert!(matches!(
            parse_seeds("x"),
            Err(FragError::Config { field: "seeds", .. })
        ));
    }

    #[test]
    fn protocol_invariants_hold_for_every_policy() {
        let r = run(&cfg(&[42, 43])).unwrap();
        assert_eq!(r.nodes, 61);
        assert_eq!(r.gpus, 314);
        assert_eq!(r.compute_capacity, 314 * 7);
        for &seed in &r.seeds {
            for load in 1..=130u32 {
                let at: Vec<&Sample> = r
                    .samples
                    .iter()
                    .filter(|s| s.seed == seed && s.load_pct == load)
                    .collect();
                assert_eq!(at.len(), Policy::ALL.len(), "seed {seed} load {load}");
                // Same task sequence for every policy.
                for s in &at {
                    assert_eq!(s.totals.tasks, at[0].totals.tasks);
                    assert_eq!(s.totals.arrived_compute, at[0].totals.arrived_compute);
                    assert!(s.totals.arrived_compute * 100 >= u64::from(load) * r.compute_capacity);
                    // Every task is placed or failed exactly once.
                    let failed: u64 = s.totals.failures.iter().sum();
                    assert_eq!(s.totals.placed + failed, s.totals.tasks, "{}", s.policy);
                    // The failure causes partition the failures, in tasks
                    // and in compute slices.
                    assert_eq!(s.totals.fail_causes.iter().sum::<u64>(), failed);
                    assert_eq!(
                        s.totals.fail_cause_compute.iter().sum::<u64>(),
                        s.totals.failed_compute.iter().sum::<u64>()
                    );
                    if s.policy == Policy::RepackHeuristic {
                        // It re-packs whenever some node could take the task
                        // re-packed: nothing is re-pack-avoidable for it.
                        assert_eq!(s.totals.fail_causes[3], 0);
                    }
                    assert!(s.totals.used_compute <= r.compute_capacity);
                    assert!(
                        s.totals.stranded_compute <= r.compute_capacity - s.totals.used_compute
                    );
                    // The fragmentation amount counts free slices only, each
                    // at most once per profile (popularities sum to 1).
                    let idle = (r.compute_capacity - s.totals.used_compute) as f64;
                    assert_eq!(s.totals.unusable_compute.len(), r.popularity.len());
                    assert!(r.frag_amount(&s.totals) <= idle + 1e-9, "{}", s.policy);
                    assert!(s.totals.unusable_compute.iter().all(|&u| u as f64 <= idle));
                }
            }
        }
        let pop: f64 = r.popularity.iter().sum();
        assert!((pop - 1.0).abs() < 1e-9, "popularities sum to {pop}");
        // Arrived load reached 130 %, and the last task is the one that crossed it.
        let last = r
            .samples
            .iter()
            .filter(|s| s.load_pct == 130)
            .map(|s| s.totals.tasks)
            .max();
        assert_eq!(last.map(|t| t as usize), r.submitted.iter().copied().max());
        // The protocol's inflation leaves failures at 130 %.
        assert!(
            r.values(Policy::Name, 130, Metric::FailedGpuTasks)
                .iter()
                .all(|&f| f > 0.0)
        );
    }

    #[test]
    fn placements_never_overlap_and_failed_tasks_are_not_retried() {
        let spec = GpuModel::find("h100-80gb").unwrap().spec();
        let nodes = load_nodes(&data("openb_node_list_gpu_node.csv")).unwrap();
        let tasks = load_tasks(&data("openb_pod_list_sample.csv")).unwrap();
        let mapper = Mapper::new(&spec).unwrap();
        let demands: Vec<Demand> = tasks.iter().map(|t| mapper.map(&spec, t)).collect();
        let caps: Vec<NodeCap> = nodes
            .iter()
            .map(|n| NodeCap::any_model(n.cpu_milli, n.memory_mib, n.gpus))
            .collect();
        let gpu0: Vec<usize> = caps
            .iter()
            .scan(0usize, |acc, n| {
                let s = *acc;
                *acc += n.gpus as usize;
                Some(s)
            })
            .collect();
        let cap = caps.iter().map(|n| u64::from(n.gpus)).sum::<u64>() * 7;
        let profiles = mapper.profiles();
        let w = World {
            spec: &spec,
            nodes: &caps,
            demands: &demands,
            profiles: &profiles,
            classes: mapper.classes().len(),
            compute_capacity: cap,
            nodes_to_find: crate::sim::nodes_to_find(caps.len(), 0),
            requests: &[],
            scoring: Scoring::LeastAllocated,
        };
        let seq = draw_sequence(&demands, 44, cap, 130);
        for pol in Policy::ALL {
            let tr = replay(&w, pol, 44, &seq, 130, true);
            let end = tr.points.last().unwrap();
            assert_eq!(end.tasks as usize, seq.len());
            // The final layout of every GPU is legal and adds up.
            let mut used = 0u64;
            for g in &tr.final_gpus {
                Occupancy::with(&spec, g).expect("no overlap");
                used += g
                    .iter()
                    .map(|i| u64::from(spec.profiles[i.profile].compute_slices))
                    .sum::<u64>();
            }
            assert_eq!(used, end.used_compute, "{pol}");
            if pol == Policy::RepackHeuristic {
                continue;
            }
            // Replaying the log placement by placement: each one was free when made,
            // each task is placed at most once (num_gpu devices), in order.
            let mut occ: Vec<Occupancy<'_>> = (0..tr.final_gpus.len())
                .map(|_| Occupancy::new(&spec))
                .collect();
            let mut per_task: HashMap<usize, u32> = HashMap::new();
            let mut prev = 0;
            for &(pos, node, gpu, profile, start) in &tr.log {
                assert!(pos >= prev, "{pol}: task {pos} placed after {prev}");
                prev = pos;
                let gi = gpu0[node] + gpu as usize;
                occ[gi]
                    .place(carve_model::Instance { profile, start })
                    .unwrap_or_else(|e| panic!("{pol}: task {pos}: {e}"));
                *per_task.entry(pos).or_default() += 1;
            }
            for (pos, n) in per_task {
                assert_eq!(n, demands[seq[pos] as usize].count, "{pol}: task {pos}");
            }
        }
    }

    #[test]
    fn same_seed_same_report_other_seed_other_report() {
        let a = run(&cfg(&[42])).unwrap();
        let b = run(&BenchConfig {
            threads: 1,
            ..cfg(&[42])
        })
        .unwrap();
        assert_eq!(a.samples, b.samples);
        let c = run(&cfg(&[43])).unwrap();
        let strip = |r: &BenchReport| {
            r.samples
                .iter()
                .map(|s| s.totals.clone())
                .collect::<Vec<_>>()
        };
        assert_ne!(strip(&a), strip(&c));
    }

    #[test]
    fn report_prints_the_table_and_writes_csv_atomically() {
        let r = run(&BenchConfig {
            policies: vec![Policy::Name, Policy::Carve],
            ..cfg(&[42])
        })
        .unwrap();
        let text = r.to_string();
        for want in [
            "rule A (compute cover)",
            "arrived 100%",
            "name ",
            "carve ",
            "×1.00",
            "internal fragmentation",
            "MIG fragmentation amount",
            "MIG fragmentation ratio",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("frag.csv");
        r.write_csv(&out).unwrap();
        let body = std::fs::read_to_string(&out).unwrap();
        let lines: Vec<&str> = body.lines().collect();
        assert_eq!(lines.len(), 1 + 2 * 130);
        assert!(lines[0].starts_with("policy,seed,arrived_pct,"));
        assert!(lines[1].starts_with("name,42,1,"));
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temp file left"
        );
        // A destination that cannot be replaced (a directory) fails cleanly and
        // leaves nothing behind.
        let blocked = dir.path().join("blocked");
        std::fs::create_dir(&blocked).unwrap();
        let e = r.write_csv(&blocked).unwrap_err();
        assert!(matches!(e, FragError::Write { .. }), "{e}");
        assert!(blocked.is_dir());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
        let missing = dir.path().join("no/such/dir/frag.csv");
        assert!(matches!(
            r.write_csv(&missing),
            Err(FragError::Write { .. })
        ));
    }

    #[test]
    fn bad_settings_are_named() {
        let e = run(&BenchConfig {
            model: "v100".into(),
            ..cfg(&[42])
        })
        .unwrap_err();
        assert!(
            matches!(&e, FragError::UnknownModel { model, .. } if model == "v100"),
            "{e}"
        );
        assert!(e.to_string().contains("h100-80gb"));
        let e = run(&BenchConfig {
            model: "l4".into(),
            ..cfg(&[42])
        })
        .unwrap_err();
        assert!(matches!(e, FragError::NotMigCapable { .. }), "{e}");
        let e = run(&cfg(&[])).unwrap_err();
        assert!(matches!(e, FragError::Config { field: "seeds", .. }));
        let e = run(&BenchConfig {
            sample_nodes_pct: Some(0.0),
            ..cfg(&[42])
        })
        .unwrap_err();
        assert!(matches!(
            e,
            FragError::Config {
                field: "sample-nodes",
                ..
            }
        ));
        let e = run(&BenchConfig {
            nodes: Some(data("nope.csv")),
            ..cfg(&[42])
        })
        .unwrap_err();
        assert!(
            matches!(&e, FragError::Io { path, .. } if path.ends_with("nope.csv")),
            "{e}"
        );
    }

    #[test]
    fn stratified_sample_keeps_every_gpu_count() {
        let nodes = load_nodes(&data("openb_node_list_gpu_node.csv")).unwrap();
        let s = sample_nodes(&nodes, 50.0);
        let counts = |v: &[NodeRow]| {
            let mut m = std::collections::BTreeMap::new();
            for n in v {
                *m.entry(n.gpus).or_insert(0usize) += 1;
            }
            m
        };
        let (all, half) = (counts(&nodes), counts(&s));
        assert_eq!(
            all.keys().collect::<Vec<_>>(),
            half.keys().collect::<Vec<_>>()
        );
        for (g, n) in &all {
            let k = half[g];
            assert!(
                k >= 1 && k.abs_diff(n.div_ceil(2)) <= 1,
                "{g} GPUs: {k} of {n}"
            );
        }
        assert_eq!(
            sample_nodes(&nodes, 50.0),
            s,
            "the sample does not depend on run seeds"
        );
    }

    /// A copy of the fixture trace with `gpu_spec` set on every GPU task.
    fn with_gpu_spec(dir: &Path, spec: &str) -> PathBuf {
        let src = std::fs::read_to_string(data("openb_pod_list_sample.csv")).unwrap();
        let mut out = String::new();
        for (i, line) in src.lines().enumerate() {
            let mut f: Vec<&str> = line.split(',').collect();
            if i > 0 && f[3] != "0" {
                f[5] = spec;
            }
            out.push_str(&f.join(","));
            out.push('\n');
        }
        let p = dir.join(format!("spec_{}.csv", spec.replace('|', "_")));
        std::fs::write(&p, out).unwrap();
        p
    }

    #[test]
    fn gpu_spec_is_a_node_filter_and_unknown_models_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let nodes = data("openb_node_list_gpu_node.csv");
        let cfg = |trace: PathBuf| BenchConfig {
            nodes: Some(nodes.clone()),
            policies: vec![Policy::Carve],
            max_load_pct: 100,
            ..BenchConfig {
                trace,
                ..cfg(&[42])
            }
        };
        let plain = run(&cfg(data("openb_pod_list_sample.csv"))).unwrap();
        assert_eq!(plain.gpu_spec_rows, 0);
        let t4 = run(&cfg(with_gpu_spec(dir.path(), "T4"))).unwrap();
        assert!(t4.gpu_spec_rows > 0 && t4.warnings.is_empty());
        assert_ne!(
            plain.samples, t4.samples,
            "a trace that differs only in gpu_spec gives other figures"
        );
        // GPU tasks placed only on T4 nodes: far more fail than without.
        let failed = |r: &BenchReport| {
            r.value(
                r.sample(Policy::Carve, 42, 100).unwrap(),
                Metric::FailedGpuTasks,
            )
        };
        assert!(
            failed(&t4) > failed(&plain),
            "{} vs {}",
            failed(&t4),
            failed(&plain)
        );
        // A model absent from the node list is named, with the rows.
        let bad = run(&cfg(with_gpu_spec(dir.path(), "T4|H800"))).unwrap();
        assert_eq!(bad.warnings.len(), 1, "{:?}", bad.warnings);
        assert!(bad.warnings[0].contains("\"H800\"") && bad.warnings[0].contains("openb-pod-0000"));
        assert_eq!(bad.samples, t4.samples, "the known model still counts");
        let none = run(&cfg(with_gpu_spec(dir.path(), "H800"))).unwrap();
        let s = none.sample(Policy::Carve, 42, 100).unwrap();
        let gpu_failed: u64 = s.totals.failures[..s.totals.failures.len() - 1]
            .iter()
            .sum();
        assert_eq!(s.totals.used_compute, 0, "no node has the model");
        assert_eq!(
            s.totals.fail_causes[0], gpu_failed,
            "all counted as no-host"
        );
    }

    #[test]
    fn most_allocated_scoring_changes_the_node_choice() {
        let least = run(&BenchConfig {
            policies: vec![Policy::Name],
            ..cfg(&[42])
        })
        .unwrap();
        let most = run(&BenchConfig {
            policies: vec![Policy::Name],
            scoring: Scoring::MostAllocated,
            ..cfg(&[42])
        })
        .unwrap();
        assert_eq!(most.scoring, Scoring::MostAllocated);
        assert_ne!(least.samples, most.samples);
    }

    #[test]
    fn carve_beats_name_order_on_the_fixture() {
        let r = run(&BenchConfig {
            policies: vec![Policy::Name, Policy::Carve],
            ..cfg(&[42, 43, 44])
        })
        .unwrap();
        let name = r
            .median(Policy::Name, 130, Metric::UnallocatedCompute)
            .unwrap();
        let carve = r
            .median(Policy::Carve, 130, Metric::UnallocatedCompute)
            .unwrap();
        assert!(carve < name, "carve {carve} vs name {name}");
    }
}
