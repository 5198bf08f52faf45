//! Churn mode: Poisson arrivals at an offered load ρ, departures after the
//! task's own lifetime from the trace (`deletion_time − creation_time`, capped
//! at the 99th percentile of GPU tasks, at least 1 s). Reports the acceptance
//! rate and the time-averaged unallocated compute slices over a measurement
//! window that follows a warm-up.
//!
//! Offered load ρ = λ · E[compute slices × lifetime] / capacity, the
//! expectation over the trace rows (tasks are drawn uniformly with
//! replacement), so λ = ρ · capacity / E[...]. Arrival times and task draws
//! depend only on the seed and ρ: every policy sees the same sequence.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use crate::bench::{BenchConfig, parallel, prepare};
use crate::error::FragError;
use crate::rng::SplitMix64;
use crate::sim::{Policy, Replay};

/// Churn settings on top of a [`BenchConfig`] (its trace, nodes, model, seeds,
/// policies and threads are used; `max_load_pct` is not).
#[derive(Clone, Debug, PartialEq)]
pub struct ChurnConfig {
    /// Offered loads ρ, fractions of compute capacity.
    pub rhos: Vec<f64>,
    /// Warm-up before measuring, seconds; `None` = 2 × the lifetime cap.
    pub warmup_s: Option<f64>,
    /// Measurement window, seconds; `None` = 2 × the lifetime cap.
    pub window_s: Option<f64>,
}

impl Default for ChurnConfig {
    fn default() -> Self {
        Self {
            rhos: vec![0.8, 0.9, 1.0, 1.1],
            warmup_s: None,
            window_s: None,
        }
    }
}

/// One churn run: a policy, ρ and seed.
#[derive(Clone, Debug, PartialEq)]
pub struct ChurnRow {
    /// Policy.
    pub policy: Policy,
    /// Offered load.
    pub rho: f64,
    /// Seed.
    pub seed: u64,
    /// GPU tasks that arrived in the window.
    pub arrived: u64,
    /// Of those, placed.
    pub accepted: u64,
    /// Compute slices that arrived in the window.
    pub arrived_compute: u64,
    /// Of those, placed.
    pub accepted_compute: u64,
    /// Time-averaged unallocated compute slices over the window, % of capacity.
    pub mean_unallocated_pct: f64,
    /// Time-averaged stranded compute slices over the window, % of capacity.
    pub mean_stranded_pct: f64,
    /// Whole run: prepares and unprepares of tasks with GPU devices.
    pub device_events: u64,
    /// Whole run: device events after which the node's published order
    /// changed (ResourceSlice writes of the state-aware order).
    pub republishes: u64,
    /// Whole run: devices allocated.
    pub device_picks: u64,
    /// Whole run: devices taken from a stale slice version that the node's
    /// current order would have placed elsewhere.
    pub stale_picks: u64,
}

impl ChurnRow {
    /// Accepted GPU tasks, % of arrived.
    #[must_use]
    pub fn acceptance_pct(&self) -> f64 {
        if self.arrived == 0 {
            100.0
        } else {
            100.0 * self.accepted as f64 / self.arrived as f64
        }
    }
}

/// Everything a churn run measured.
#[derive(Clone, Debug)]
pub struct ChurnReport {
    /// Pod list.
    pub trace: PathBuf,
    /// Nodes, GPUs and compute slices replayed.
    pub nodes: usize,
    /// GPUs replayed.
    pub gpus: u64,
    /// Compute slices of the cluster.
    pub compute_capacity: u64,
    /// Lifetime cap (p99), seconds.
    pub lifetime_cap_s: f64,
    /// Mean (capped) lifetime of the trace rows, seconds.
    pub mean_lifetime_s: f64,
    /// Warm-up and window, seconds.
    pub warmup_s: f64,
    /// Measurement window, seconds.
    pub window_s: f64,
    /// Policies in report order.
    pub policies: Vec<Policy>,
    /// Offered loads.
    pub rhos: Vec<f64>,
    /// Seeds.
    pub seeds: Vec<u64>,
    /// One row per policy × ρ × seed.
    pub rows: Vec<ChurnRow>,
}

fn exp_sample(rng: &mut SplitMix64, rate: f64) -> f64 {
    let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    -(1.0 - u).ln() / rate
}

/// Run churn mode.
///
/// # Errors
/// As [`crate::run`]; also a task row without creation or deletion time, a
/// deletion before creation, or a ρ that is not positive.
pub fn run_churn(cfg: &BenchConfig, churn: &ChurnConfig) -> Result<ChurnReport, FragError> {
    if churn.rhos.is_empty() || churn.rhos.iter().any(|&r| !(r > 0.0 && r <= 10.0)) {
        return Err(FragError::Config {
            field: "rho",
            reason: format!("{:?}: need one or more loads in (0, 10]", churn.rhos),
        });
    }
    for (field, v) in [("warmup", churn.warmup_s), ("window", churn.window_s)] {
        if let Some(v) = v
            && !(v >= 0.0 && v.is_finite())
        {
            return Err(FragError::Config {
                field,
                reason: format!("{v} s is not a non-negative duration"),
            });
        }
    }
    let pr = prepare(cfg)?;
    let mut raw = Vec::with_capacity(pr.tasks.len());
    for t in &pr.tasks {
        let (Some(c), Some(d)) = (t.creation_time, t.deletion_time) else {
            return Err(FragError::Config {
                field: "trace",
                reason: format!(
                    "{}: task {} lacks creation_time or deletion_time, which churn mode needs",
                    cfg.trace.display(),
                    t.name
                ),
            });
        };
        let life = d.checked_sub(c).ok_or_else(|| FragError::Config {
            field: "trace",
            reason: format!(
                "{}: task {} is deleted ({d}) before it is created ({c})",
                cfg.trace.display(),
                t.name
            ),
        })?;
        raw.push(life as f64);
    }
    let mut gpu_lives: Vec<f64> = raw
        .iter()
        .zip(&pr.demands)
        .filter(|(_, d)| d.compute_slices > 0)
        .map(|(&l, _)| l)
        .collect();
    gpu_lives.sort_by(f64::total_cmp);
    let cap = gpu_lives
        .get(((gpu_lives.len() as f64 * 0.99) as usize).min(gpu_lives.len().saturating_sub(1)))
        .copied()
        .unwrap_or(1.0)
        .max(1.0);
    let lives: Vec<f64> = raw.iter().map(|&l| l.clamp(1.0, cap)).collect();
    let work: f64 = lives
        .iter()
        .zip(&pr.demands)
        .map(|(&l, d)| l * f64::from(d.compute_slices))
        .sum::<f64>()
        / lives.len() as f64;
    let mean_life = lives.iter().sum::<f64>() / lives.len() as f64;
    let warmup = churn.warmup_s.unwrap_or(2.0 * cap);
    let window = churn.window_s.unwrap_or(2.0 * cap);
    let world = pr.world();
    let jobs: Vec<(Policy, usize, u64)> = cfg
        .policies
        .iter()
        .flat_map(|&p| {
            (0..churn.rhos.len()).flat_map(move |r| cfg.seeds.iter().map(move |&s| (p, r, s)))
        })
        .collect();
    let capacity = pr.compute_capacity as f64;
    let rows = parallel(jobs.len(), cfg.threads, |j| {
        let (policy, ri, seed) = jobs[j];
        let rho = churn.rhos[ri];
        let rate = rho * capacity / work;
        let mut rng = SplitMix64::new(seed ^ rho.to_bits());
        let mut sim = Replay::new(&world, policy, seed, false);
        let mut departures: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
        let mut live = HashMap::new();
        let (end, mut now, mut next_id) = (warmup + window, 0.0f64, 0u64);
        let mut next_arrival = exp_sample(&mut rng, rate);
        let mut row = ChurnRow {
            policy,
            rho,
            seed,
            arrived: 0,
            accepted: 0,
            arrived_compute: 0,
            accepted_compute: 0,
            mean_unallocated_pct: 0.0,
            mean_stranded_pct: 0.0,
            device_events: 0,
            republishes: 0,
            device_picks: 0,
            stale_picks: 0,
        };
        let (mut unalloc_area, mut stranded_area) = (0.0, 0.0);
        loop {
            let dep = departures.peek().map(|Reverse((t, _))| f64::from_bits(*t));
            let (t, is_arrival) = match dep {
                Some(d) if d <= next_arrival => (d, false),
                _ => (next_arrival, true),
            };
            let until = t.min(end);
            if until > warmup {
                let from = now.max(warmup);
                let tot = sim.totals();
                unalloc_area += (until - from) * (capacity - tot.used_compute as f64);
                stranded_area += (until - from) * tot.stranded_compute as f64;
            }
            if t >= end {
                break;
            }
            now = t;
            if is_arrival {
                let i = rng.below(world.demands.len() as u64) as usize;
                let d = world.demands[i];
                let placed = sim.submit(0, &d);
                if now >= warmup && d.compute_slices > 0 {
                    row.arrived += 1;
                    row.arrived_compute += u64::from(d.compute_slices);
                    if placed.is_some() {
                        row.accepted += 1;
                        row.accepted_compute += u64::from(d.compute_slices);
                    }
                }
                if let Some(l) = placed {
                    departures.push(Reverse(((now + lives[i]).to_bits(), next_id)));
                    live.insert(next_id, l);
                    next_id += 1;
                }
                next_arrival = now + exp_sample(&mut rng, rate);
            } else if let Some(Reverse((_, id))) = departures.pop()
                && let Some(l) = live.remove(&id)
            {
                sim.depart(&l);
            }
        }
        let tot = sim.totals();
        row.device_events = tot.device_events;
        row.republishes = tot.republishes;
        row.device_picks = tot.device_picks;
        row.stale_picks = tot.stale_picks;
        if window > 0.0 {
            row.mean_unallocated_pct = 100.0 * unalloc_area / (window * capacity);
            row.mean_stranded_pct = 100.0 * stranded_area / (window * capacity);
        }
        row
    });
    Ok(ChurnReport {
        trace: cfg.trace.clone(),
        nodes: pr.caps.len(),
        gpus: pr.gpus,
        compute_capacity: pr.compute_capacity,
        lifetime_cap_s: cap,
        mean_lifetime_s: mean_life,
        warmup_s: warmup,
        window_s: window,
        policies: cfg.policies.clone(),
        rhos: churn.rhos.clone(),
        seeds: cfg.seeds.clone(),
        rows,
    })
}

fn median(mut v: Vec<f64>) -> Option<f64> {
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

impl ChurnReport {
    /// Median over seeds of `get` for a policy and ρ.
    #[must_use]
    pub fn median(&self, policy: Policy, rho: f64, get: impl Fn(&ChurnRow) -> f64) -> Option<f64> {
        median(
            self.rows
                .iter()
                .filter(|r| r.policy == policy && r.rho == rho)
                .map(get)
                .collect(),
        )
    }

    /// Write one row per policy × ρ × seed, atomically (temp file + rename).
    ///
    /// # Errors
    /// The folder is not writable; `path` is then left untouched.
    pub fn write_csv(&self, path: &Path) -> Result<(), FragError> {
        crate::csvout::write_atomically(path, |w| {
            w.write_record([
                "policy",
                "rho",
                "seed",
                "arrived_gpu_tasks",
                "accepted_gpu_tasks",
                "acceptance_pct",
                "arrived_compute_slices",
                "accepted_compute_slices",
                "mean_unallocated_compute_pct",
                "mean_stranded_compute_pct",
                "device_events",
                "republishes",
                "device_picks",
                "stale_picks",
            ])?;
            for r in &self.rows {
                w.write_record([
                    r.policy.label().to_string(),
                    r.rho.to_string(),
                    r.seed.to_string(),
                    r.arrived.to_string(),
                    r.accepted.to_string(),
                    format!("{:.4}", r.acceptance_pct()),
                    r.arrived_compute.to_string(),
                    r.accepted_compute.to_string(),
                    format!("{:.4}", r.mean_unallocated_pct),
                    format!("{:.4}", r.mean_stranded_pct),
                    r.device_events.to_string(),
                    r.republishes.to_string(),
                    r.device_picks.to_string(),
                    r.stale_picks.to_string(),
                ])?;
            }
            Ok(())
        })
    }
}

/// A figure of one churn row.
type RowMetric = fn(&ChurnRow) -> f64;

impl fmt::Display for ChurnReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "carve bench fragmentation — churn mode")?;
        writeln!(
            f,
            "  trace: {}; {} nodes, {} GPUs ({} compute slices); seeds {}",
            self.trace.display(),
            self.nodes,
            self.gpus,
            self.compute_capacity,
            self.seeds.len()
        )?;
        writeln!(
            f,
            "  Poisson arrivals at offered load ρ; lifetime = deletion − creation, capped at p99 = {:.0} s (mean {:.0} s); warm-up {:.0} s, window {:.0} s",
            self.lifetime_cap_s, self.mean_lifetime_s, self.warmup_s, self.window_s
        )?;
        let tables: [(&str, RowMetric); 5] = [
            ("GPU tasks accepted, % of arrived", ChurnRow::acceptance_pct),
            ("Compute slices accepted, % of arrived", |r| {
                if r.arrived_compute == 0 {
                    100.0
                } else {
                    100.0 * r.accepted_compute as f64 / r.arrived_compute as f64
                }
            }),
            ("Time-averaged unallocated compute slices, %", |r| {
                r.mean_unallocated_pct
            }),
            (
                "ResourceSlice writes per device event (prepare or unprepare), whole run",
                |r| {
                    if r.device_events == 0 {
                        0.0
                    } else {
                        r.republishes as f64 / r.device_events as f64
                    }
                },
            ),
            (
                "Devices taken from a stale slice version that the current order would have placed elsewhere, %",
                |r| {
                    if r.device_picks == 0 {
                        0.0
                    } else {
                        100.0 * r.stale_picks as f64 / r.device_picks as f64
                    }
                },
            ),
        ];
        for (title, get) in tables {
            writeln!(f, "\n{title} (median over seeds):")?;
            write!(f, "  {:<17}", "policy")?;
            for rho in &self.rhos {
                write!(f, " {:>10}", format!("ρ={rho}"))?;
            }
            writeln!(f)?;
            for &p in &self.policies {
                write!(f, "  {:<17}", p.label())?;
                for &rho in &self.rhos {
                    let v = self.median(p, rho, get);
                    write!(f, " {:>10}", v.map_or("-".into(), |v| format!("{v:.2}")))?;
                }
                writeln!(f)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> BenchConfig {
        BenchConfig {
            seeds: vec![42],
            threads: 2,
            policies: vec![Policy::Name, Policy::Carve, Policy::RepackHeuristic],
            ..BenchConfig::new(
                Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/openb_pod_list_sample.csv"),
            )
        }
    }

    #[test]
    fn churn_runs_are_deterministic_and_sane() {
        let churn = ChurnConfig {
            rhos: vec![0.5, 1.5],
            warmup_s: Some(2_000_000.0),
            window_s: Some(2_000_000.0),
        };
        let a = run_churn(&cfg(), &churn).unwrap();
        let b = run_churn(&cfg(), &churn).unwrap();
        assert_eq!(a.rows, b.rows);
        assert_eq!(a.rows.len(), 3 * 2);
        for r in &a.rows {
            assert!(r.arrived > 0 && r.accepted <= r.arrived, "{r:?}");
            assert!((0.0..=100.0).contains(&r.mean_unallocated_pct), "{r:?}");
            assert!(r.mean_stranded_pct <= r.mean_unallocated_pct);
            // Same arrivals for every policy at one ρ and seed.
            let same = a
                .rows
                .iter()
                .find(|o| o.rho == r.rho && o.policy == Policy::Name)
                .unwrap();
            assert_eq!(
                (r.arrived, r.arrived_compute),
                (same.arrived, same.arrived_compute)
            );
        }
        // More offered load: lower acceptance, less idle capacity.
        let acc = |rho| {
            a.median(Policy::Carve, rho, ChurnRow::acceptance_pct)
                .unwrap()
        };
        let idle = |rho| {
            a.median(Policy::Carve, rho, |r| r.mean_unallocated_pct)
                .unwrap()
        };
        assert!(acc(1.5) < acc(0.5));
        assert!(idle(1.5) < idle(0.5));
        assert!(a.to_string().contains("ρ=1.5"));
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("churn.csv");
        a.write_csv(&out).unwrap();
        assert_eq!(
            std::fs::read_to_string(&out).unwrap().lines().count(),
            1 + 6
        );
    }

    #[test]
    fn bad_churn_settings_are_named() {
        let e = run_churn(
            &cfg(),
            &ChurnConfig {
                rhos: vec![0.0],
                ..ChurnConfig::default()
            },
        )
        .unwrap_err();
        assert!(matches!(e, FragError::Config { field: "rho", .. }), "{e}");
        let e = run_churn(
            &cfg(),
            &ChurnConfig {
                window_s: Some(-1.0),
                ..ChurnConfig::default()
            },
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                FragError::Config {
                    field: "window",
                    ..
                }
            ),
            "{e}"
        );
    }
}
