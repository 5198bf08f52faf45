//! The exact per-node reference: one node receives tasks drawn from the
//! mapped trace until 100 % of its compute slices have arrived; a task that
//! fits must be placed (that is what the scheduler hands a node), a task that
//! does not is lost. The reference is the clairvoyant optimum: the most
//! compute any sequence of placements could accept, found by exhaustive
//! memoised search over every placement of every task.
//!
//! The search state of one GPU is its occupied memory slices and its used
//! compute slices: whether a placement fits depends on nothing else when no
//! profile's instance limit can bind before those do and no media-extension
//! profile is tracked ([`NodeOptimum::new`] checks this and refuses
//! otherwise). GPUs of the same node are interchangeable, so the node state
//! is the sorted multiset of GPU states; with the task position and the
//! node's used CPU and RAM it keys the memo.

use std::collections::HashMap;

use carve_model::GpuSpec;

use crate::error::FragError;
use crate::mapping::Demand;
use crate::online::{OnlineFigures, mean_se, online_figures};
use crate::sim::{NodeCap, Policy, Scoring, World, draw_sequence, replay};

/// One node shape of the per-node reference.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeShape {
    /// Label in tables and CSV, e.g. `8 GPUs/96 cores/384 GiB`.
    pub label: String,
    /// GPUs on the node.
    pub gpus: u32,
    /// CPU capacity, thousandths of a core; `None` = no limit (geometry only).
    pub cpu_milli: Option<u64>,
    /// RAM capacity, MiB; `None` = no limit.
    pub memory_mib: Option<u64>,
}

impl NodeShape {
    /// A node with CPU and RAM limits.
    #[must_use]
    pub fn limited(gpus: u32, cpu_milli: u64, memory_mib: u64) -> Self {
        Self {
            label: format!(
                "{gpus} GPUs/{} cores/{} GiB",
                cpu_milli / 1000,
                memory_mib / 1024
            ),
            gpus,
            cpu_milli: Some(cpu_milli),
            memory_mib: Some(memory_mib),
        }
    }

    /// GPUs only: no CPU or RAM limit.
    #[must_use]
    pub fn geometry(gpus: u32) -> Self {
        Self {
            label: format!("{gpus} GPUs, geometry only"),
            gpus,
            cpu_milli: None,
            memory_mib: None,
        }
    }

    /// For each of 8, 4 and 2 GPUs: the most common CPU and RAM among the
    /// nodes of `caps` with that many GPUs (`(cpu milli, memory MiB, gpus)`),
    /// then the three geometry-only shapes. GPU counts absent from `caps` are
    /// skipped for the limited shapes.
    #[must_use]
    pub fn of_cluster(caps: &[(u64, u64, u32)]) -> Vec<NodeShape> {
        let mut out = Vec::new();
        for g in [8u32, 4, 2] {
            let mut count: HashMap<(u64, u64), usize> = HashMap::new();
            for &(c, m, n) in caps {
                if n == g {
                    *count.entry((c, m)).or_default() += 1;
                }
            }
            // Most nodes first; ties to the larger node (deterministic).
            if let Some((&(c, m), _)) = count.iter().max_by_key(|&(&(c, m), &k)| (k, c, m)) {
                out.push(NodeShape::limited(g, c, m));
            }
        }
        out.extend([8, 4, 2].map(NodeShape::geometry));
        out
    }

    /// Compute slices of the node for `spec`.
    #[must_use]
    pub fn compute_capacity(&self, spec: &GpuSpec) -> u64 {
        u64::from(self.gpus) * u64::from(spec.compute_slices)
    }
}

/// The most GPUs a node shape of the exact search may have.
pub const MAX_GPUS: u32 = 16;

/// One GPU's search state: used compute slices and occupied memory slices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Gpu {
    used_compute: u8,
    mem_mask: u16,
}

impl Gpu {
    const EMPTY: Gpu = Gpu {
        used_compute: 0,
        mem_mask: 0,
    };
}

/// Exhaustive memoised search for one node shape and one GPU spec.
#[derive(Debug)]
pub struct NodeOptimum<'a> {
    spec: &'a GpuSpec,
    /// Per profile: `(memory mask, compute slices)` of each placement.
    placements: Vec<Vec<(u16, u8)>>,
    compute: u8,
    /// The whole-GPU mask.
    full_mask: u16,
    memo: HashMap<(u32, u64, u64, Vec<Gpu>), u32>,
    /// States the last [`NodeOptimum::solve`] visited (memo entries).
    pub visited: usize,
}

impl<'a> NodeOptimum<'a> {
    /// A search over the placements of `profiles` (positions in
    /// `spec.profiles`).
    ///
    /// # Errors
    /// A tracked profile has media extensions, or an instance limit that can
    /// bind before the memory and compute slices do (the per-GPU state would
    /// then not capture the geometry exactly).
    pub fn new(spec: &'a GpuSpec, profiles: &[usize]) -> Result<Self, FragError> {
        if spec.memory_slices > 16 {
            return Err(FragError::Config {
                field: "model",
                reason: format!("{}: more than 16 memory slices per GPU", spec.product_name),
            });
        }
        let mut placements = vec![Vec::new(); spec.profiles.len()];
        for &p in profiles {
            let pr = &spec.profiles[p];
            let disjoint = max_disjoint(
                &pr.placements
                    .iter()
                    .map(|pl| mask(pl.start, pr.memory_slices))
                    .collect::<Vec<_>>(),
            );
            let by_compute = spec
                .compute_slices
                .checked_div(pr.compute_slices)
                .map_or(u32::MAX, u32::from);
            if pr.media_extensions || u32::from(pr.max_instances) < disjoint.min(by_compute) {
                return Err(FragError::Config {
                    field: "model",
                    reason: format!(
                        "the exact per-node search models memory and compute slices only; profile {} of {} has {}",
                        pr.name,
                        spec.product_name,
                        if pr.media_extensions {
                            "media extensions".to_string()
                        } else {
                            format!("an instance limit ({}) that binds first", pr.max_instances)
                        }
                    ),
                });
            }
            placements[p] = pr
                .placements
                .iter()
                .map(|pl| (mask(pl.start, pr.memory_slices), pr.compute_slices))
                .collect();
        }
        Ok(Self {
            spec,
            placements,
            compute: spec.compute_slices,
            full_mask: mask(0, spec.memory_slices),
            memo: HashMap::new(),
            visited: 0,
        })
    }

    /// The most compute slices any placement sequence could accept when
    /// the tasks `seq` (positions into `demands`) arrive in order at an
    /// empty node of `shape`, every task that fits being placed.
    ///
    /// # Errors
    /// The shape has more than [`MAX_GPUS`] GPUs, or a task asks for a
    /// profile the search does not track.
    pub fn solve(
        &mut self,
        shape: &NodeShape,
        demands: &[Demand],
        seq: &[u32],
    ) -> Result<u32, FragError> {
        if shape.gpus > MAX_GPUS {
            return Err(FragError::Config {
                field: "node shape",
                reason: format!(
                    "{} GPUs; the exact search takes at most {MAX_GPUS}",
                    shape.gpus
                ),
            });
        }
        for &i in seq {
            if let Some(p) = demands[i as usize].profile
                && self.placements.get(p).is_none_or(Vec::is_empty)
            {
                return Err(FragError::Config {
                    field: "trace",
                    reason: format!(
                        "profile {} is not tracked by the exact search",
                        self.spec.profiles.get(p).map_or("?", |x| x.name.as_str())
                    ),
                });
            }
        }
        self.memo.clear();
        let tasks: Vec<Demand> = seq.iter().map(|&i| demands[i as usize]).collect();
        let gpus = vec![Gpu::EMPTY; shape.gpus as usize];
        let cap = (
            shape.cpu_milli.unwrap_or(u64::MAX),
            shape.memory_mib.unwrap_or(u64::MAX),
        );
        let limited = (shape.cpu_milli.is_some(), shape.memory_mib.is_some());
        let best = self.go(&tasks, 0, 0, 0, &gpus, cap, limited);
        self.visited = self.memo.len();
        Ok(best)
    }

    #[allow(clippy::too_many_arguments)]
    fn go(
        &mut self,
        tasks: &[Demand],
        pos: usize,
        cpu: u64,
        mem: u64,
        gpus: &[Gpu],
        cap: (u64, u64),
        limited: (bool, bool),
    ) -> u32 {
        let Some(d) = tasks.get(pos) else { return 0 };
        let key = (
            pos as u32,
            if limited.0 { cpu } else { 0 },
            if limited.1 { mem } else { 0 },
            gpus.to_vec(),
        );
        if let Some(&v) = self.memo.get(&key) {
            return v;
        }
        let host =
            cpu.saturating_add(d.cpu_milli) <= cap.0 && mem.saturating_add(d.memory_mib) <= cap.1;
        let (cpu2, mem2) = (
            cpu.saturating_add(d.cpu_milli),
            mem.saturating_add(d.memory_mib),
        );
        let best = match (host, d.profile) {
            (false, _) => self.go(tasks, pos + 1, cpu, mem, gpus, cap, limited),
            (true, None) => self.go(tasks, pos + 1, cpu2, mem2, gpus, cap, limited),
            (true, Some(p)) if d.count > 1 => {
                // Whole GPUs only (the mapping's multi-GPU tasks): they fit
                // empty GPUs, which are interchangeable.
                let empty = gpus.iter().filter(|g| **g == Gpu::EMPTY).count();
                let whole = self.placements[p].first().copied();
                match whole {
                    Some((m, c)) if m == self.full_mask && empty >= d.count as usize => {
                        let mut next = gpus.to_vec();
                        let mut left = d.count;
                        for g in &mut next {
                            if left > 0 && *g == Gpu::EMPTY {
                                *g = Gpu {
                                    used_compute: c,
                                    mem_mask: m,
                                };
                                left -= 1;
                            }
                        }
                        next.sort_unstable();
                        d.compute_slices + self.go(tasks, pos + 1, cpu2, mem2, &next, cap, limited)
                    }
                    _ => self.go(tasks, pos + 1, cpu, mem, gpus, cap, limited),
                }
            }
            (true, Some(p)) => {
                let mut best: Option<u32> = None;
                let pls = self.placements[p].clone();
                for (k, g) in gpus.iter().enumerate() {
                    if k > 0 && gpus[k - 1] == *g {
                        continue; // the same GPU state: the same branches
                    }
                    for &(m, c) in &pls {
                        if g.mem_mask & m != 0 || g.used_compute + c > self.compute {
                            continue;
                        }
                        let mut next = gpus.to_vec();
                        next[k] = Gpu {
                            used_compute: g.used_compute + c,
                            mem_mask: g.mem_mask | m,
                        };
                        next.sort_unstable();
                        let v = d.compute_slices
                            + self.go(tasks, pos + 1, cpu2, mem2, &next, cap, limited);
                        best = Some(best.map_or(v, |b| b.max(v)));
                    }
                }
                // No placement fits: the task is lost, the node unchanged.
                best.unwrap_or_else(|| self.go(tasks, pos + 1, cpu, mem, gpus, cap, limited))
            }
        };
        self.memo.insert(key, best);
        best
    }
}

/// Every policy and the optimum on the sequences of one node shape.
#[derive(Clone, Debug)]
pub struct NodeReference {
    /// The node shape.
    pub shape: NodeShape,
    /// Compute slices of the node.
    pub capacity: u64,
    /// Seeds, one sequence each.
    pub seeds: Vec<u64>,
    /// Per sequence: the optimum's accepted compute slices.
    pub optimum: Vec<u32>,
    /// Per policy: accepted compute slices per sequence.
    pub policies: Vec<(Policy, Vec<u32>)>,
    /// Memo entries of the largest search (a size figure, not a time).
    pub max_states: usize,
    /// The optimal online policy on the same sequences ([`crate::online`]),
    /// where it was asked for.
    pub online: Option<OnlineFigures>,
}

impl NodeReference {
    fn of(&self, policy: Policy) -> Option<&[u32]> {
        self.policies
            .iter()
            .find(|(p, _)| *p == policy)
            .map(|(_, v)| v.as_slice())
    }

    /// Mean gap of `policy` to the optimum, points of node capacity.
    #[must_use]
    pub fn mean_gap_points(&self, policy: Policy) -> Option<f64> {
        let v = self.of(policy)?;
        if v.is_empty() {
            return None;
        }
        let sum: u64 = v
            .iter()
            .zip(&self.optimum)
            .map(|(&g, &o)| u64::from(o.saturating_sub(g)))
            .sum();
        Some(100.0 * sum as f64 / (v.len() as f64 * self.capacity as f64))
    }

    /// Share of the sequences where `policy` reaches the optimum, %.
    #[must_use]
    pub fn optimal_share_pct(&self, policy: Policy) -> Option<f64> {
        let v = self.of(policy)?;
        if v.is_empty() {
            return None;
        }
        let hit = v.iter().zip(&self.optimum).filter(|(g, o)| g >= o).count();
        Some(100.0 * hit as f64 / v.len() as f64)
    }

    /// Per sequence, `a − b` in points of node capacity.
    fn diff_points(&self, a: &[u32], b: &[u32]) -> Vec<f64> {
        a.iter()
            .zip(b)
            .map(|(&x, &y)| 100.0 * (f64::from(x) - f64::from(y)) / self.capacity as f64)
            .collect()
    }

    /// Mean accepted compute of the clairvoyant optimum, % of the node, and
    /// its standard error over the sequences.
    #[must_use]
    pub fn optimum_accepted_pct(&self) -> (f64, f64) {
        let zero = vec![0; self.optimum.len()];
        mean_se(&self.diff_points(&self.optimum, &zero))
    }

    /// Mean accepted compute of `policy` (or of the online policy with
    /// `None`), % of the node, and its standard error.
    #[must_use]
    pub fn accepted_pct(&self, policy: Option<Policy>) -> Option<(f64, f64)> {
        let v = match policy {
            Some(p) => self.of(p)?,
            None => self.online.as_ref().map(|o| o.accepted.as_slice())?,
        };
        if v.is_empty() {
            return None;
        }
        let zero = vec![0; v.len()];
        Some(mean_se(&self.diff_points(v, &zero)))
    }

    /// Gap of `policy` (or of the online policy with `None`) to the
    /// clairvoyant optimum on the same sequences, points of node capacity:
    /// mean and standard error of the paired differences.
    #[must_use]
    pub fn clairvoyant_gap(&self, policy: Option<Policy>) -> Option<(f64, f64)> {
        let v = match policy {
            Some(p) => self.of(p)?,
            None => self.online.as_ref().map(|o| o.accepted.as_slice())?,
        };
        if v.is_empty() {
            return None;
        }
        Some(mean_se(&self.diff_points(&self.optimum, v)))
    }

    /// Gap of `policy` to the online policy on the same sequences, points:
    /// mean and standard error of the paired differences (negative on a
    /// sample where the policy happened to do better).
    #[must_use]
    pub fn online_gap(&self, policy: Policy) -> Option<(f64, f64)> {
        let o = self.online.as_ref().filter(|o| !o.accepted.is_empty())?;
        let v = self.of(policy)?;
        Some(mean_se(&self.diff_points(&o.accepted, v)))
    }

    /// The exact expected accepted compute of the online optimum, % of the
    /// node, where the DP solved the shape.
    #[must_use]
    pub fn online_expected_pct(&self) -> Option<f64> {
        let e = self.online.as_ref()?.expected?;
        Some(100.0 * e / self.capacity as f64)
    }

    /// Mean unallocated compute of the optimum at the end, % of the node.
    #[must_use]
    pub fn optimum_unallocated_pct(&self) -> f64 {
        let sum: u64 = self.optimum.iter().map(|&o| u64::from(o)).sum();
        100.0 - 100.0 * sum as f64 / (self.optimum.len().max(1) as f64 * self.capacity as f64)
    }

    /// Sequences where a policy that never migrates (the online policy
    /// included) accepted more than the optimum: always 0 unless the search
    /// or the replay is wrong.
    #[must_use]
    pub fn violations(&self) -> usize {
        let online = self.online.iter().map(|o| {
            o.accepted
                .iter()
                .zip(&self.optimum)
                .filter(|(g, o)| g > o)
                .count()
        });
        self.policies
            .iter()
            .filter(|(p, _)| p.never_migrates())
            .map(|(_, v)| v.iter().zip(&self.optimum).filter(|(g, o)| g > o).count())
            .chain(online)
            .sum()
    }
}

/// Run the per-node reference: for each seed one sequence of `demands`
/// (drawn with replacement until 100 % of the node's compute has arrived),
/// its optimum, and what each policy (that never migrates) accepts on it.
/// `gpu_spec` is ignored here (the shape has no model). With `online` =
/// `(max GPUs, max states)`, the optimal online policy too, on shapes of at
/// most that many GPUs ([`crate::online`]).
///
/// # Errors
/// See [`NodeOptimum::new`] and [`NodeOptimum::solve`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn node_reference(
    spec: &GpuSpec,
    profiles: &[usize],
    classes: usize,
    demands: &[Demand],
    shape: &NodeShape,
    policies: &[Policy],
    seeds: &[u64],
    online: Option<(u32, usize)>,
) -> Result<NodeReference, FragError> {
    let demands: Vec<Demand> = demands
        .iter()
        .map(|d| Demand {
            models: u64::MAX,
            ..*d
        })
        .collect();
    let capacity = shape.compute_capacity(spec);
    // No limit: far above any trace request, and small enough for the
    // scheduler's score arithmetic.
    const UNLIMITED: u64 = 1 << 40;
    let node = [NodeCap::any_model(
        shape.cpu_milli.unwrap_or(UNLIMITED),
        shape.memory_mib.unwrap_or(UNLIMITED),
        shape.gpus,
    )];
    let w = World {
        spec,
        nodes: &node,
        demands: &demands,
        profiles,
        classes,
        compute_capacity: capacity,
        nodes_to_find: 1,
        requests: &[],
        scoring: Scoring::LeastAllocated,
    };
    let mut search = NodeOptimum::new(spec, profiles)?;
    let policies: Vec<Policy> = policies
        .iter()
        .copied()
        .filter(|p| p.never_migrates())
        .collect();
    let mut optimum = Vec::with_capacity(seeds.len());
    let mut got: Vec<Vec<u32>> = vec![Vec::with_capacity(seeds.len()); policies.len()];
    let mut max_states = 0;
    let seqs: Vec<Vec<u32>> = seeds
        .iter()
        .map(|&seed| draw_sequence(&demands, seed, capacity, 100))
        .collect();
    for (&seed, seq) in seeds.iter().zip(&seqs) {
        let seq = seq.as_slice();
        optimum.push(search.solve(shape, &demands, seq)?);
        max_states = max_states.max(search.visited);
        for (k, &p) in policies.iter().enumerate() {
            let tr = replay(&w, p, seed, seq, 100, false);
            let used = tr.points.last().map_or(0, |t| t.used_compute);
            got[k].push(used as u32);
        }
    }
    drop(search);
    let online = match online {
        Some((g, s)) => online_figures(spec, profiles, &demands, shape, &seqs, g, s)?,
        None => None,
    };
    Ok(NodeReference {
        shape: shape.clone(),
        capacity,
        seeds: seeds.to_vec(),
        optimum,
        policies: policies.into_iter().zip(got).collect(),
        max_states,
        online,
    })
}

fn mask(start: u8, size: u8) -> u16 {
    (((1u32 << size) - 1) << start) as u16
}

/// The most pairwise disjoint masks among `ms`.
fn max_disjoint(ms: &[u16]) -> u32 {
    fn go(ms: &[u16], used: u16) -> u32 {
        match ms.split_first() {
            None => 0,
            Some((&m, rest)) => {
                let skip = go(rest, used);
                if m & used == 0 {
                    skip.max(1 + go(rest, used | m))
                } else {
                    skip
                }
            }
        }
    }
    go(ms, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_tasks::{h100, pidx, task, tracked};
    use carve_model::geometry::{Instance, Occupancy};

    use crate::rng::SplitMix64;

    fn solve(s: &GpuSpec, shape: &NodeShape, tasks: &[Demand]) -> u32 {
        let seq: Vec<u32> = (0..tasks.len() as u32).collect();
        NodeOptimum::new(s, &tracked(s))
            .unwrap()
            .solve(shape, tasks, &seq)
            .unwrap()
    }

    /// One H100, 3g then 4g: first-fit (and name order) put the 3g at slice
    /// 0, the only home of 4g, and accept 3 slices; the optimum puts it at 4
    /// and accepts all 7.
    #[test]
    fn first_fit_is_suboptimal_where_the_optimum_is_not() {
        let s = h100();
        let tasks = [task(&s, "3g.40gb", 1, 1), task(&s, "4g.40gb", 1, 1)];
        assert_eq!(solve(&s, &NodeShape::geometry(1), &tasks), 7);
        let mut occ = Occupancy::new(&s);
        let first = carve_model::order::node_device_order(
            &s,
            1,
            pidx(&s, "3g.40gb"),
            carve_model::order::DeviceOrder::FirstFit,
        )[0];
        occ.place(Instance {
            profile: pidx(&s, "3g.40gb"),
            start: first.1,
        })
        .unwrap();
        assert!(
            occ.check(Instance {
                profile: pidx(&s, "4g.40gb"),
                start: 0
            })
            .is_err(),
            "first-fit's 3g blocks the 4g"
        );
    }

    /// A task that fits must be placed, even when skipping it would let a
    /// larger one in: a 10-core node, a 1g taking 8 cores, then a 7g taking
    /// 4: the 1g is placed, the 7g is lost (CPU), 1 slice.
    #[test]
    fn a_task_that_fits_is_placed_even_when_that_costs() {
        let s = h100();
        let tasks = [task(&s, "1g.10gb", 1, 8000), task(&s, "7g.80gb", 1, 4000)];
        assert_eq!(
            solve(&s, &NodeShape::limited(1, 10_000, 1 << 20), &tasks),
            1
        );
        assert_eq!(
            solve(&s, &NodeShape::geometry(1), &tasks),
            1,
            "7g needs an empty GPU"
        );
        assert_eq!(solve(&s, &NodeShape::geometry(2), &tasks), 8);
    }

    /// Two H100s: 1g, then 2 × 7g (a two-GPU task), then 7g. The 1g takes
    /// one GPU whatever the placement, so the pair never fits; the last 7g
    /// takes the other GPU: 1 + 7.
    #[test]
    fn multi_gpu_tasks_need_empty_gpus() {
        let s = h100();
        let tasks = [
            task(&s, "1g.10gb", 1, 1),
            task(&s, "7g.80gb", 2, 1),
            task(&s, "7g.80gb", 1, 1),
        ];
        assert_eq!(solve(&s, &NodeShape::geometry(2), &tasks), 8);
        assert_eq!(solve(&s, &NodeShape::geometry(3), &tasks), 15);
        assert_eq!(solve(&s, &NodeShape::geometry(1), &[]), 0);
    }

    /// 3g + 3g on one GPU covers every memory slice: a following 1g is lost
    /// whatever the placement (6 slices), while 2g, 2g, 3g fit exactly.
    #[test]
    fn geometry_limits_are_exact() {
        let s = h100();
        let g = NodeShape::geometry(1);
        let three = [
            task(&s, "3g.40gb", 1, 1),
            task(&s, "3g.40gb", 1, 1),
            task(&s, "1g.10gb", 1, 1),
        ];
        assert_eq!(solve(&s, &g, &three), 6);
        let packs = [
            task(&s, "2g.20gb", 1, 1),
            task(&s, "2g.20gb", 1, 1),
            task(&s, "3g.40gb", 1, 1),
        ];
        assert_eq!(solve(&s, &g, &packs), 7);
    }

    /// The memoised search over (memory mask, compute) states agrees with a
    /// plain enumeration of every instance placement (carve-model's
    /// `Occupancy`, no memo, no canonical form) on random small sequences.
    #[test]
    fn the_search_matches_brute_force_over_instances() {
        let s = h100();
        let names = ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"];
        fn brute(s: &GpuSpec, occ: &mut Vec<Occupancy<'_>>, tasks: &[Demand]) -> u32 {
            let Some((d, rest)) = tasks.split_first() else {
                return 0;
            };
            let p = d.profile.unwrap();
            let mut best = None;
            if d.count > 1 {
                let empty: Vec<usize> = (0..occ.len())
                    .filter(|&g| occ[g].instances().is_empty())
                    .take(d.count as usize)
                    .collect();
                if empty.len() == d.count as usize {
                    let saved = occ.clone();
                    for &g in &empty {
                        occ[g]
                            .place(Instance {
                                profile: p,
                                start: 0,
                            })
                            .unwrap();
                    }
                    best = Some(d.compute_slices + brute(s, occ, rest));
                    *occ = saved;
                }
            } else {
                for g in 0..occ.len() {
                    for pl in s.profiles[p].placements.clone() {
                        let inst = Instance {
                            profile: p,
                            start: pl.start,
                        };
                        if occ[g].check(inst).is_ok() {
                            let saved = occ[g].clone();
                            occ[g].place(inst).unwrap();
                            let v = d.compute_slices + brute(s, occ, rest);
                            best = Some(best.map_or(v, |b: u32| b.max(v)));
                            occ[g] = saved;
                        }
                    }
                }
            }
            best.unwrap_or_else(|| brute(s, occ, rest))
        }
        let mut rng = SplitMix64::new(7);
        let mut search = NodeOptimum::new(&s, &tracked(&s)).unwrap();
        for case in 0..60 {
            let gpus = 1 + (case % 3) as u32;
            let n = 3 + rng.below(4) as usize;
            let tasks: Vec<Demand> = (0..n)
                .map(|_| {
                    let k = rng.below(6) as usize;
                    if k == 5 {
                        task(&s, "7g.80gb", 2, 1)
                    } else {
                        task(&s, names[k], 1, 1)
                    }
                })
                .collect();
            let seq: Vec<u32> = (0..n as u32).collect();
            let got = search
                .solve(&NodeShape::geometry(gpus), &tasks, &seq)
                .unwrap();
            let mut occ: Vec<Occupancy<'_>> = (0..gpus).map(|_| Occupancy::new(&s)).collect();
            assert_eq!(got, brute(&s, &mut occ, &tasks), "case {case}: {gpus} GPUs");
        }
    }

    #[test]
    fn shapes_of_the_openb_cluster() {
        let caps = [
            (96_000, 393_216, 8),
            (96_000, 393_216, 8),
            (128_000, 786_432, 8),
            (32_000, 131_072, 4),
            (104_000, 524_288, 2),
        ];
        let labels: Vec<String> = NodeShape::of_cluster(&caps)
            .into_iter()
            .map(|s| s.label)
            .collect();
        assert_eq!(
            labels,
            [
                "8 GPUs/96 cores/384 GiB",
                "4 GPUs/32 cores/128 GiB",
                "2 GPUs/104 cores/512 GiB",
                "8 GPUs, geometry only",
                "4 GPUs, geometry only",
                "2 GPUs, geometry only"
            ]
        );
    }
}
