//! The replay: a cluster of MIG GPUs, the scheduler's node choice, the DRA
//! allocator's first-fit over a published device order, and the policies.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};

use carve_model::geometry::{Instance, Occupancy, layouts};
use carve_model::order::{DeviceOrder, node_device_order, placement_order};
use carve_model::{GpuSpec, Stranded};

use crate::live_order::LiveOrder;
use crate::mapping::Demand;
use crate::rng::SplitMix64;

/// A device-order policy (or reference) compared by the benchmark.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Policy {
    /// NVIDIA's driver: device names sorted as strings.
    Name,
    /// Lowest GPU, then lowest placement start.
    FirstFit,
    /// Dynamic reference, not a static order: the GPU with the least free
    /// compute that still fits, then carve's placement rank inside it.
    BestFit,
    /// A random static order per node (seeded).
    Random,
    /// carve's static order ([`carve_model::order::DeviceOrder::Carve`]).
    Carve,
    /// The state-aware order ([`crate::live_order::LiveOrder`]): after
    /// every prepare and unprepare on a node the plugin republishes the
    /// node's devices in the order computed from its live occupancy. The
    /// scheduler allocates from the version published `lag` device events
    /// (prepares or unprepares on that node) ago: 0 = the republish always
    /// lands before the next allocation; 1 = every allocation sees the order
    /// from before the node's previous event. Its own view of which devices
    /// are free is always current (it tracks allocated claims itself).
    StateAware {
        /// Device events on the node the published order lags behind.
        lag: u8,
    },
    /// A re-packing *heuristic*, not a bound: carve's order, and when the
    /// task does not fit a node as it is, the node counts as feasible if its
    /// live instances plus the new ones pack onto its GPUs; the chosen node is
    /// then re-packed (migrations allowed). It re-packs only the chosen node,
    /// only on a miss, and so changes which nodes the scheduler finds feasible
    /// afterwards: it can end below or above a static order.
    RepackHeuristic,
}

/// kube-scheduler's `NodeResourcesFit` scoring strategy (cpu and memory,
/// weight 1 each); `NodeResourcesBalancedAllocation` is added under both.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scoring {
    /// The default: prefer the node with the most free CPU and RAM (spreads).
    #[default]
    LeastAllocated,
    /// Prefer the node with the least free CPU and RAM (packs).
    MostAllocated,
}

impl Scoring {
    /// Both strategies, in report order.
    pub const ALL: [Scoring; 2] = [Scoring::LeastAllocated, Scoring::MostAllocated];

    /// The strategy's name in kube-scheduler's configuration.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            Scoring::LeastAllocated => "LeastAllocated",
            Scoring::MostAllocated => "MostAllocated",
        }
    }
}

impl std::fmt::Display for Scoring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

impl std::str::FromStr for Scoring {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Scoring::ALL
            .into_iter()
            .find(|p| p.label().eq_ignore_ascii_case(s))
            .ok_or_else(|| format!("unknown scoring {s:?}; known: LeastAllocated, MostAllocated"))
    }
}

/// Why a task found no node, decided at the moment it failed; the causes
/// partition the failures ([`Totals::fail_causes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FailCause {
    /// No node (of the task's `gpu_spec` models) has the free CPU and RAM:
    /// no device order and no re-packing could have placed it.
    NoHost,
    /// A multi-GPU task: every node with the CPU and RAM has fewer GPUs
    /// that could be emptied for it than it needs, even re-packing the node.
    NoEmptyGpus,
    /// A single-device task: every node with the CPU and RAM is too full for
    /// it even re-packed (its live instances plus the task do not pack).
    NoRoom,
    /// Some node with the CPU and RAM could have held it had its live
    /// instances been placed differently (re-packing that one node now): a
    /// loss a device order is answerable for.
    RepackAvoidable,
}

impl FailCause {
    /// Every cause, in report order.
    pub const ALL: [FailCause; 4] = [
        FailCause::NoHost,
        FailCause::NoEmptyGpus,
        FailCause::NoRoom,
        FailCause::RepackAvoidable,
    ];

    /// The label used in tables and CSV.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            FailCause::NoHost => "no-host",
            FailCause::NoEmptyGpus => "no-empty-gpus",
            FailCause::NoRoom => "no-room",
            FailCause::RepackAvoidable => "repack-avoidable",
        }
    }
}

impl Policy {
    /// Every policy, in report order (the state-aware order at lags 0 and 1).
    pub const ALL: [Policy; 8] = [
        Policy::Name,
        Policy::FirstFit,
        Policy::BestFit,
        Policy::Random,
        Policy::Carve,
        Policy::StateAware { lag: 0 },
        Policy::StateAware { lag: 1 },
        Policy::RepackHeuristic,
    ];

    /// The largest lag [`Policy::StateAware`] accepts on the command line.
    pub const MAX_LAG: u8 = 16;

    /// Whether the policy is a static device order (or the dynamic best-fit)
    /// that never moves a live instance: the ones the per-node optimum bounds.
    #[must_use]
    pub fn never_migrates(self) -> bool {
        self != Policy::RepackHeuristic
    }

    /// The label used in tables, CSV and on the command line
    /// (`state-aware`, `state-aware-lag1`, ...).
    #[must_use]
    pub fn label(self) -> Cow<'static, str> {
        match self {
            Policy::Name => "name".into(),
            Policy::FirstFit => "first-fit".into(),
            Policy::BestFit => "best-fit".into(),
            Policy::Random => "random".into(),
            Policy::Carve => "carve".into(),
            Policy::StateAware { lag: 0 } => "state-aware".into(),
            Policy::StateAware { lag } => format!("state-aware-lag{lag}").into(),
            Policy::RepackHeuristic => "repack-heuristic".into(),
        }
    }
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.label())
    }
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(n) = s.strip_prefix("state-aware-lag") {
            return match n.parse::<u8>() {
                Ok(lag) if lag <= Policy::MAX_LAG && !n.starts_with('+') => {
                    Ok(Policy::StateAware { lag })
                }
                _ => Err(format!(
                    "policy {s:?}: the lag must be a whole number of device events from 0 to {}",
                    Policy::MAX_LAG
                )),
            };
        }
        Policy::ALL
            .into_iter()
            .find(|p| p.label() == s)
            .ok_or_else(|| {
                let all: Vec<Cow<'static, str>> = Policy::ALL.iter().map(|p| p.label()).collect();
                format!(
                    "unknown policy {s:?}; known: {} (and state-aware-lagN, N ≤ {})",
                    all.join(", "),
                    Policy::MAX_LAG
                )
            })
    }
}

/// A node as the replay sees it.
#[derive(Clone, Debug)]
pub(crate) struct NodeCap {
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub gpus: u32,
    /// This node's model as a bit of [`Demand::models`] (`u64::MAX` = matches
    /// every task).
    pub model_bit: u64,
}

impl NodeCap {
    /// A node that matches every `gpu_spec`.
    pub fn any_model(cpu_milli: u64, memory_mib: u64, gpus: u32) -> Self {
        Self {
            cpu_milli,
            memory_mib,
            gpus,
            model_bit: u64::MAX,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct StateInfo {
    mask: u64,
    fits: u64,
    free_compute: u8,
    free_memory: u8,
    stranded: Stranded,
}

/// Per-GPU states by instance set, each computed once with [`Occupancy`]:
/// which candidates still fit, free slices and stranded slices.
#[derive(Debug)]
pub(crate) struct Geometry<'s> {
    spec: &'s GpuSpec,
    cands: Vec<Instance>,
    /// `cand_of[profile][start]`, `u8::MAX` when not a placement.
    cand_of: Vec<Vec<u8>>,
    profile_mask: Vec<u64>,
    states: Vec<StateInfo>,
    lookup: HashMap<u64, u32>,
}

impl<'s> Geometry<'s> {
    pub fn new(spec: &'s GpuSpec) -> Self {
        let mut cands = Vec::new();
        let mut cand_of = vec![vec![u8::MAX; usize::from(spec.memory_slices)]; spec.profiles.len()];
        let mut profile_mask = vec![0u64; spec.profiles.len()];
        for (pi, p) in spec.profiles.iter().enumerate() {
            for pl in &p.placements {
                let k = cands.len();
                assert!(k < 64, "more than 64 placements per GPU");
                cand_of[pi][usize::from(pl.start)] = k as u8;
                profile_mask[pi] |= 1 << k;
                cands.push(Instance {
                    profile: pi,
                    start: pl.start,
                });
            }
        }
        let mut g = Self {
            spec,
            cands,
            cand_of,
            profile_mask,
            states: Vec::new(),
            lookup: HashMap::new(),
        };
        g.state(0);
        g
    }

    /// The state id of the instance set `mask` (bit k = candidate k).
    pub fn state(&mut self, mask: u64) -> u32 {
        if let Some(&id) = self.lookup.get(&mask) {
            return id;
        }
        let insts: Vec<Instance> = (0..self.cands.len())
            .filter(|k| mask & (1 << k) != 0)
            .map(|k| self.cands[k])
            .collect();
        let occ = Occupancy::with(self.spec, &insts)
            .expect("the replay only places candidates its fit mask allows");
        let mut fits = 0u64;
        for (k, &c) in self.cands.iter().enumerate() {
            if occ.check(c).is_ok() {
                fits |= 1 << k;
            }
        }
        let info = StateInfo {
            mask,
            fits,
            free_compute: occ.free_compute_slices(),
            free_memory: occ.free_memory_slices(),
            stranded: occ.stranded(),
        };
        let id = self.states.len() as u32;
        self.states.push(info);
        self.lookup.insert(mask, id);
        id
    }

    fn info(&self, id: u32) -> &StateInfo {
        &self.states[id as usize]
    }

    fn fits(&self, id: u32, profile: usize) -> bool {
        self.info(id).fits & self.profile_mask[profile] != 0
    }

    fn cand(&self, profile: usize, start: u8) -> u8 {
        self.cand_of[profile][usize::from(start)]
    }

    /// The instances of a state.
    pub fn instances(&self, id: u32) -> Vec<Instance> {
        let m = self.info(id).mask;
        (0..self.cands.len())
            .filter(|k| m & (1 << k) != 0)
            .map(|k| self.cands[k])
            .collect()
    }
}

/// Whether a multiset of profiles can be packed onto `g` empty GPUs, by
/// depth-first search over the maximal per-GPU multisets (memoised).
#[derive(Debug)]
pub(crate) struct Repacker {
    spec: GpuSpec,
    /// Profiles tracked (positions in `GpuSpec::profiles`).
    profiles: Vec<usize>,
    compute: Vec<u32>,
    gpu_compute: u32,
    /// Maximal per-GPU multisets and one concrete layout of each.
    maximal: Vec<(Vec<u16>, Vec<Instance>)>,
    memo: HashMap<(Vec<u16>, u32), Option<u16>>,
}

impl Repacker {
    pub fn new(spec: &GpuSpec, profiles: &[usize]) -> Self {
        let k = profiles.len();
        let mut sets: Vec<(Vec<u16>, Vec<Instance>)> = Vec::new();
        for l in layouts(spec) {
            if l.iter().any(|i| !profiles.contains(&i.profile)) {
                continue;
            }
            let mut c = vec![0u16; k];
            for i in &l {
                let j = profiles.iter().position(|&p| p == i.profile).unwrap_or(0);
                c[j] += 1;
            }
            if !sets.iter().any(|(s, _)| *s == c) {
                sets.push((c, l));
            }
        }
        let dominated = |a: &[u16], b: &[u16]| a != b && a.iter().zip(b).all(|(x, y)| x <= y);
        let maximal: Vec<(Vec<u16>, Vec<Instance>)> = sets
            .iter()
            .filter(|(a, _)| !sets.iter().any(|(b, _)| dominated(a, b)))
            .cloned()
            .collect();
        // Most compute first: the search finds dense packings sooner.
        let compute: Vec<u32> = profiles
            .iter()
            .map(|&p| u32::from(spec.profiles[p].compute_slices))
            .collect();
        let mut maximal = maximal;
        maximal.sort_by_key(|(c, _)| {
            std::cmp::Reverse(
                c.iter()
                    .zip(&compute)
                    .map(|(&n, &w)| u32::from(n) * w)
                    .sum::<u32>(),
            )
        });
        Self {
            spec: spec.clone(),
            profiles: profiles.to_vec(),
            compute,
            gpu_compute: u32::from(spec.compute_slices),
            maximal,
            memo: HashMap::new(),
        }
    }

    fn slot(&self, profile: usize) -> Option<usize> {
        self.profiles.iter().position(|&p| p == profile)
    }

    /// Whether `m` fits `g` GPUs; memoises the first maximal set that works.
    fn solve(&mut self, m: &[u16], g: u32) -> bool {
        if m.iter().all(|&x| x == 0) {
            return true;
        }
        if g == 0 {
            return false;
        }
        let need: u32 = m
            .iter()
            .zip(&self.compute)
            .map(|(&n, &w)| u32::from(n) * w)
            .sum();
        if need > g * self.gpu_compute {
            return false;
        }
        let key = (m.to_vec(), g);
        if let Some(r) = self.memo.get(&key) {
            return r.is_some();
        }
        let mut found = None;
        for i in 0..self.maximal.len() {
            let s = &self.maximal[i].0;
            if !m.iter().zip(s).any(|(&a, &b)| a > 0 && b > 0) {
                continue;
            }
            let rest: Vec<u16> = m
                .iter()
                .zip(s)
                .map(|(&a, &b)| a.saturating_sub(b))
                .collect();
            if self.solve(&rest, g - 1) {
                found = Some(i as u16);
                break;
            }
        }
        self.memo.insert(key, found);
        found.is_some()
    }

    /// The same instances laid out as carve's order would place them, largest
    /// first, each at its first free start in carve's per-GPU order; `gpu`
    /// unchanged if that greedy layout does not hold them all.
    fn canonical(&self, gpu: Vec<Instance>) -> Vec<Instance> {
        let mut profs: Vec<usize> = gpu.iter().map(|i| i.profile).collect();
        profs.sort_by_key(|&p| {
            let pr = &self.spec.profiles[p];
            std::cmp::Reverse((pr.compute_slices, pr.memory_slices))
        });
        let mut occ = Occupancy::new(&self.spec);
        for p in profs {
            let placed = placement_order(&self.spec, p, DeviceOrder::Carve)
                .into_iter()
                .any(|start| occ.place(Instance { profile: p, start }).is_ok());
            if !placed {
                return gpu;
            }
        }
        occ.instances().to_vec()
    }

    /// A packing of `m` onto `g` GPUs: one instance list per GPU.
    fn pack(&mut self, m: &[u16], g: u32) -> Option<Vec<Vec<Instance>>> {
        if !self.solve(m, g) {
            return None;
        }
        let mut rest = m.to_vec();
        let mut out = Vec::new();
        for left in (1..=g).rev() {
            if rest.iter().all(|&x| x == 0) {
                out.push(Vec::new());
                continue;
            }
            let i = usize::from(self.memo.get(&(rest.clone(), left))?.as_ref().copied()?);
            let (s, layout) = &self.maximal[i];
            let mut take: Vec<u16> = rest.iter().zip(s).map(|(&a, &b)| a.min(b)).collect();
            let mut gpu = Vec::new();
            for inst in layout {
                let j = self.slot(inst.profile)?;
                if take[j] > 0 {
                    take[j] -= 1;
                    gpu.push(*inst);
                }
            }
            for (r, &b) in rest.iter_mut().zip(s) {
                *r = r.saturating_sub(b);
            }
            out.push(self.canonical(gpu));
        }
        Some(out)
    }
}

/// Cluster totals sampled at each load point.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Tasks submitted so far.
    pub tasks: u64,
    /// Compute slices of all submitted tasks.
    pub arrived_compute: u64,
    /// Tasks placed.
    pub placed: u64,
    /// Compute slices in use.
    pub used_compute: u64,
    /// Memory slices in use.
    pub used_memory: u64,
    /// Stranded compute slices (sum of [`Occupancy::stranded`]).
    pub stranded_compute: u64,
    /// Stranded memory slices.
    pub stranded_memory: u64,
    /// Failed tasks per class.
    pub failures: Vec<u64>,
    /// Compute slices of the failed tasks, per class.
    pub failed_compute: Vec<u64>,
    /// Node re-packings so far (repack heuristic only).
    pub repacks: u64,
    /// Device events: prepares (and, in churn mode, unprepares) of tasks with
    /// GPU devices.
    pub device_events: u64,
    /// Device events after which the node's published order changed, i.e.
    /// ResourceSlice writes the state-aware order costs (0 for a static order).
    pub republishes: u64,
    /// Allocations (one per device) where the version the scheduler saw led
    /// to another device than the node's current order would have
    /// (state-aware order with a lag only).
    pub stale_picks: u64,
    /// Devices allocated from a published order (every policy).
    pub device_picks: u64,
    /// Failed tasks by [`FailCause`] (positions as [`FailCause::ALL`]); they
    /// sum to the failures of every class.
    pub fail_causes: [u64; 4],
    /// Compute slices of the failed tasks by [`FailCause`].
    pub fail_cause_compute: [u64; 4],
    /// Per tracked profile (the mapper's profiles, smallest first): free
    /// compute slices that profile cannot use, i.e. those on GPUs where it has
    /// no free placement or whose node has less free CPU or RAM than the
    /// profile's typical request ([`World::requests`]). The inputs of the
    /// FGD-style MIG fragmentation amount (`fragmentation.md` §8.3 step 2).
    /// Filled at the sample points of an inflation replay; empty in churn mode.
    pub unusable_compute: Vec<u64>,
}

/// One placement: (task position in the sequence, node, GPU on the node,
/// profile, start).
pub(crate) type Placed = (usize, usize, u32, usize, u8);

/// One replay's result: the totals each time arrived load crossed k %.
#[derive(Clone, Debug)]
pub(crate) struct Trajectory {
    /// `points[k - 1]` = totals when arrived load first reached k %.
    pub points: Vec<Totals>,
    /// Every placement made, `(task position, node, gpu, profile, start)`, when
    /// asked for (tests).
    #[cfg_attr(not(test), allow(dead_code))]
    pub log: Vec<Placed>,
    /// The instances on every GPU at the end (cluster-wide GPU order).
    #[cfg_attr(not(test), allow(dead_code))]
    pub final_gpus: Vec<Vec<Instance>>,
}

#[derive(Clone, Debug)]
struct Node {
    cpu_cap: u64,
    mem_cap: u64,
    cpu_used: u64,
    mem_used: u64,
    gpu0: usize,
    gpus: u32,
    /// GPUs where each profile has a free placement.
    fit_count: Vec<u8>,
    /// Live instances per tracked profile.
    counts: Vec<u16>,
    model_bit: u64,
    /// Static order table.
    order: usize,
}

/// Everything one replay needs that does not change during it.
#[derive(Debug)]
pub(crate) struct World<'a> {
    pub spec: &'a GpuSpec,
    pub nodes: &'a [NodeCap],
    pub demands: &'a [Demand],
    pub profiles: &'a [usize],
    pub classes: usize,
    pub compute_capacity: u64,
    /// Feasible nodes the scheduler looks for before it stops filtering and
    /// scores them ([`nodes_to_find`]); `nodes.len()` = every feasible node.
    pub nodes_to_find: usize,
    /// Per tracked profile (as `profiles`): the typical host request of a
    /// task of that profile, `(cpu milli, memory MiB)`, for the fragmentation
    /// amount ([`Totals::unusable_compute`]).
    pub requests: &'a [(u64, u64)],
    /// The scheduler's `NodeResourcesFit` strategy.
    pub scoring: Scoring,
}

/// kube-scheduler's `numFeasibleNodesToFind`: how many feasible nodes it
/// finds (and then scores) before it stops filtering. `pct` is the
/// `percentageOfNodesToScore` setting; 0 is the compiled-in default, an
/// adaptive `max(50 - nodes/125, 5)` %, and at least 100 nodes
/// (`minFeasibleNodesToFind`); clusters under 100 nodes and `pct` ≥ 100
/// search every node. 1,213 nodes: 41 % → 497.
#[must_use]
pub fn nodes_to_find(num_all: usize, pct: u32) -> usize {
    const MIN_FEASIBLE_NODES_TO_FIND: usize = 100;
    const MIN_FEASIBLE_NODES_PERCENTAGE_TO_FIND: usize = 5;
    if num_all < MIN_FEASIBLE_NODES_TO_FIND || pct >= 100 {
        return num_all;
    }
    let pct = if pct == 0 {
        50usize
            .saturating_sub(num_all / 125)
            .max(MIN_FEASIBLE_NODES_PERCENTAGE_TO_FIND)
    } else {
        pct as usize
    };
    (num_all * pct / 100).max(MIN_FEASIBLE_NODES_TO_FIND)
}

/// What the state-aware order needs during a replay.
struct LiveState<'a> {
    order: LiveOrder<'a>,
    lag: usize,
    /// Per node: its GPUs' instance sets after each of its last `lag + 1`
    /// device events, oldest first (the initial empty node counts as one).
    /// The front is the version the scheduler allocates from.
    history: Vec<VecDeque<Vec<u64>>>,
    /// Per node: the order last published, per profile of the spec.
    published: Vec<Vec<Vec<(u32, u8)>>>,
}

impl LiveState<'_> {
    fn full_order(&mut self, masks: &[u64], profiles: usize) -> Vec<Vec<(u32, u8)>> {
        (0..profiles)
            .map(|p| {
                self.order
                    .order_masks(masks, p)
                    .expect("the replay's GPU states are valid instance sets")
            })
            .collect()
    }
}

/// The weights of the state-aware order in the replay: carve-model's
/// default (every profile without media extensions weighs 1).
fn live_weights(spec: &GpuSpec) -> Vec<u32> {
    crate::live_order::default_weights(spec)
}

/// The state of one replay.
pub(crate) struct Replay<'a, 'w> {
    w: &'w World<'a>,
    geo: Geometry<'a>,
    repack: Option<Repacker>,
    /// For classifying failures (built at the first failure).
    diag: Option<Repacker>,
    policy: Policy,
    nodes: Vec<Node>,
    gpu_state: Vec<u32>,
    /// `tables[order][profile]` = `(gpu, candidate)` in published order.
    tables: Vec<Vec<Vec<(u8, u8)>>>,
    carve_starts: Vec<Vec<u8>>,
    /// State-aware policies only.
    live: Option<LiveState<'a>>,
    t: Totals,
    rng: SplitMix64,
    /// Where the next node search starts (kube-scheduler's
    /// `nextStartNodeIndex`, round-robin over the node list).
    next_start: usize,
    log: Option<Vec<Placed>>,
}

fn table(geo: &Geometry<'_>, spec: &GpuSpec, gpus: u32, order: DeviceOrder) -> Vec<Vec<(u8, u8)>> {
    (0..spec.profiles.len())
        .map(|p| {
            node_device_order(spec, gpus, p, order)
                .into_iter()
                .map(|(g, s)| (g as u8, geo.cand(p, s)))
                .collect()
        })
        .collect()
}

impl<'a, 'w> Replay<'a, 'w> {
    pub fn new(w: &'w World<'a>, policy: Policy, seed: u64, log: bool) -> Self {
        let geo = Geometry::new(w.spec);
        let mut tables = Vec::new();
        let mut by_gpus: HashMap<u32, usize> = HashMap::new();
        let mut order_rng = SplitMix64::new(seed ^ 0x0bad_5eed_0f0d_e75e);
        let static_order = match policy {
            Policy::Name => DeviceOrder::Name,
            Policy::FirstFit => DeviceOrder::FirstFit,
            _ => DeviceOrder::Carve,
        };
        let mut nodes = Vec::with_capacity(w.nodes.len());
        let mut gpu0 = 0;
        for n in w.nodes {
            let order = if policy == Policy::Random {
                let mut t = table(&geo, w.spec, n.gpus, DeviceOrder::FirstFit);
                for per_profile in &mut t {
                    order_rng.shuffle(per_profile);
                }
                tables.push(t);
                tables.len() - 1
            } else {
                *by_gpus.entry(n.gpus).or_insert_with(|| {
                    tables.push(table(&geo, w.spec, n.gpus, static_order));
                    tables.len() - 1
                })
            };
            let gpus = u8::try_from(n.gpus).unwrap_or(u8::MAX);
            nodes.push(Node {
                cpu_cap: n.cpu_milli,
                mem_cap: n.memory_mib,
                cpu_used: 0,
                mem_used: 0,
                gpu0,
                gpus: n.gpus,
                fit_count: w.spec.profiles.iter().map(|_| gpus).collect(),
                counts: vec![0; w.profiles.len()],
                model_bit: n.model_bit,
                order,
            });
            gpu0 += n.gpus as usize;
        }
        let carve_starts = (0..w.spec.profiles.len())
            .map(|p| placement_order(w.spec, p, DeviceOrder::Carve))
            .collect();
        let repack = (policy == Policy::RepackHeuristic).then(|| Repacker::new(w.spec, w.profiles));
        let live = match policy {
            Policy::StateAware { lag } => {
                let order = LiveOrder::new(w.spec, live_weights(w.spec))
                    .expect("a MIG spec with one weight per profile");
                assert_eq!(
                    order.candidates(),
                    geo.cands.as_slice(),
                    "the replay and the live order number placements alike"
                );
                let mut st = LiveState {
                    order,
                    lag: usize::from(lag),
                    history: Vec::with_capacity(nodes.len()),
                    published: Vec::with_capacity(nodes.len()),
                };
                let mut first: HashMap<u32, Vec<Vec<(u32, u8)>>> = HashMap::new();
                for n in &nodes {
                    let empty = vec![0u64; n.gpus as usize];
                    let o = match first.get(&n.gpus) {
                        Some(o) => o.clone(),
                        None => {
                            let o = st.full_order(&empty, w.spec.profiles.len());
                            first.insert(n.gpus, o.clone());
                            o
                        }
                    };
                    st.history.push(VecDeque::from([empty]));
                    st.published.push(o);
                }
                Some(st)
            }
            _ => None,
        };
        Self {
            w,
            geo,
            repack,
            diag: None,
            policy,
            nodes,
            gpu_state: vec![0; gpu0],
            tables,
            carve_starts,
            live,
            t: Totals {
                failures: vec![0; w.classes],
                failed_compute: vec![0; w.classes],
                ..Totals::default()
            },
            rng: SplitMix64::new(seed ^ 0x7135_b4ea_c0ff_ee00),
            next_start: 0,
            log: log.then(Vec::new),
        }
    }

    fn set_gpu(&mut self, gpu: usize, new: u32) {
        let old = self.gpu_state[gpu];
        let (o, n) = (*self.geo.info(old), *self.geo.info(new));
        let cap_c = u64::from(self.w.spec.compute_slices);
        let cap_m = u64::from(self.w.spec.memory_slices);
        self.t.used_compute = self.t.used_compute + (cap_c - u64::from(n.free_compute))
            - (cap_c - u64::from(o.free_compute));
        self.t.used_memory = self.t.used_memory + (cap_m - u64::from(n.free_memory))
            - (cap_m - u64::from(o.free_memory));
        self.t.stranded_compute = self.t.stranded_compute + u64::from(n.stranded.compute_slices)
            - u64::from(o.stranded.compute_slices);
        self.t.stranded_memory = self.t.stranded_memory + u64::from(n.stranded.memory_slices)
            - u64::from(o.stranded.memory_slices);
        self.gpu_state[gpu] = new;
    }

    fn refresh(&mut self, node: usize) {
        let n = &self.nodes[node];
        let (g0, g) = (n.gpu0, n.gpus as usize);
        let counts: Vec<u8> = (0..self.w.spec.profiles.len())
            .map(|p| {
                (g0..g0 + g)
                    .filter(|&i| self.geo.fits(self.gpu_state[i], p))
                    .count() as u8
            })
            .collect();
        self.nodes[node].fit_count = counts;
    }

    fn with_added(&self, node: usize, d: &Demand) -> Option<Vec<u16>> {
        let p = d.profile?;
        let slot = self.w.profiles.iter().position(|&q| q == p)?;
        let mut m = self.nodes[node].counts.clone();
        m[slot] += u16::try_from(d.count).ok()?;
        Some(m)
    }

    /// Whether the node's free CPU and RAM (and model) admit the task.
    fn host_fits(&self, node: usize, d: &Demand) -> bool {
        let n = &self.nodes[node];
        n.cpu_used + d.cpu_milli <= n.cpu_cap
            && n.mem_used + d.memory_mib <= n.mem_cap
            && d.models & n.model_bit != 0
    }

    /// Free compute slices of a node.
    fn node_free_compute(&self, node: usize) -> u32 {
        let n = &self.nodes[node];
        self.gpu_state[n.gpu0..n.gpu0 + n.gpus as usize]
            .iter()
            .map(|&st| u32::from(self.geo.info(st).free_compute))
            .sum()
    }

    /// Why a task that found no feasible node failed (see [`FailCause`]).
    fn classify_failure(&mut self, d: &Demand) -> FailCause {
        let hosts: Vec<usize> = (0..self.nodes.len())
            .filter(|&n| self.host_fits(n, d))
            .collect();
        if hosts.is_empty() || d.profile.is_none() {
            return FailCause::NoHost;
        }
        if self.diag.is_none() {
            self.diag = Some(Repacker::new(self.w.spec, self.w.profiles));
        }
        for node in hosts {
            let gpus = self.nodes[node].gpus;
            if gpus < d.count || self.node_free_compute(node) < d.compute_slices {
                continue;
            }
            let Some(m) = self.with_added(node, d) else {
                continue;
            };
            if self.diag.as_mut().is_some_and(|r| r.solve(&m, gpus)) {
                return FailCause::RepackAvoidable;
            }
        }
        if d.count > 1 {
            FailCause::NoEmptyGpus
        } else {
            FailCause::NoRoom
        }
    }

    fn feasible(&mut self, node: usize, d: &Demand) -> bool {
        if !self.host_fits(node, d) {
            return false;
        }
        let n = &self.nodes[node];
        let Some(p) = d.profile else { return true };
        if u32::from(n.fit_count[p]) >= d.count {
            return true;
        }
        let gpus = n.gpus;
        match self.with_added(node, d) {
            Some(m) => self.repack.as_mut().is_some_and(|r| r.solve(&m, gpus)),
            None => false,
        }
    }

    /// kube-scheduler default scoring for a pod with CPU and memory requests:
    /// NodeResourcesFit LeastAllocated (cpu, memory, weight 1 each) plus
    /// NodeResourcesBalancedAllocation (cpu, memory), both plugin weight 1, in
    /// the scheduler's integer arithmetic.
    fn score(&self, node: usize, d: &Demand) -> i64 {
        let n = &self.nodes[node];
        let cpu_req = n.cpu_used + d.cpu_milli;
        let mem_req = n.mem_used + d.memory_mib;
        let least = |req: u64, cap: u64| -> i64 {
            if cap == 0 || req > cap {
                0
            } else {
                ((cap - req) * 100 / cap) as i64
            }
        };
        let most = |req: u64, cap: u64| -> i64 {
            (req.min(cap) * 100).checked_div(cap).unwrap_or(0) as i64
        };
        let fit = match self.w.scoring {
            Scoring::LeastAllocated => (least(cpu_req, n.cpu_cap) + least(mem_req, n.mem_cap)) / 2,
            Scoring::MostAllocated => (most(cpu_req, n.cpu_cap) + most(mem_req, n.mem_cap)) / 2,
        };
        let frac = |req: u64, cap: u64| -> f64 {
            if cap == 0 {
                1.0
            } else {
                (req as f64 / cap as f64).min(1.0)
            }
        };
        let std = (frac(cpu_req, n.cpu_cap) - frac(mem_req, n.mem_cap)).abs() / 2.0;
        let balanced = ((1.0 - std) * 100.0) as i64;
        fit + balanced
    }

    /// kube-scheduler's node choice: filter nodes round-robin from where the
    /// last search stopped until `nodes_to_find` feasible ones are found (or
    /// every node was tried), score those, take the best (ties at random, as
    /// `selectHost` does), and start the next search after the last node
    /// processed.
    fn choose_node(&mut self, d: &Demand) -> Option<usize> {
        let mut best: Option<(i64, usize)> = None;
        let mut ties = 0u64;
        let n = self.nodes.len();
        let want = self.w.nodes_to_find.max(1);
        let (start, mut processed, mut found) = (self.next_start, 0usize, 0usize);
        for k in 0..n {
            if found >= want {
                break;
            }
            let node = (start + k) % n;
            processed += 1;
            if !self.feasible(node, d) {
                continue;
            }
            found += 1;
            let s = self.score(node, d);
            match best {
                Some((b, _)) if s < b => {}
                Some((b, _)) if s == b => {
                    ties += 1;
                    if self.rng.below(ties) == 0 {
                        best = Some((s, node));
                    }
                }
                _ => {
                    best = Some((s, node));
                    ties = 1;
                }
            }
        }
        if n > 0 {
            self.next_start = (start + processed) % n;
        }
        best.map(|(_, n)| n)
    }

    fn place_one(&mut self, pos: usize, node: usize, gpu: u32, profile: usize, start: u8) {
        let gi = self.nodes[node].gpu0 + gpu as usize;
        let cand = self.geo.cand(profile, start);
        let st = self.gpu_state[gi];
        debug_assert!(self.geo.info(st).fits & (1 << cand) != 0);
        let mask = self.geo.info(st).mask | (1 << cand);
        let new = self.geo.state(mask);
        self.set_gpu(gi, new);
        if let Some(l) = &mut self.log {
            l.push((pos, node, gpu, profile, start));
        }
    }

    /// The instance sets of a node's GPUs now.
    fn node_masks(&self, node: usize) -> Vec<u64> {
        let n = &self.nodes[node];
        self.gpu_state[n.gpu0..n.gpu0 + n.gpus as usize]
            .iter()
            .map(|&st| self.geo.info(st).mask)
            .collect()
    }

    /// After a prepare or unprepare on `node`: count it, and under the
    /// state-aware order republish (count a write) when the order changed and
    /// age the versions the scheduler may see.
    fn device_event(&mut self, node: usize) {
        self.t.device_events += 1;
        if self.live.is_none() {
            return;
        }
        let masks = self.node_masks(node);
        let profiles = self.w.spec.profiles.len();
        let Some(live) = self.live.as_mut() else {
            return;
        };
        let now = live.full_order(&masks, profiles);
        if now != live.published[node] {
            self.t.republishes += 1;
            live.published[node] = now;
        }
        let h = &mut live.history[node];
        h.push_back(masks);
        while h.len() > live.lag + 1 {
            h.pop_front();
        }
    }

    /// The device the policy yields for one instance of `p` on `node`, if any.
    fn pick(&mut self, node: usize, p: usize) -> Option<(u32, u8)> {
        let n = &self.nodes[node];
        match self.policy {
            Policy::BestFit => {
                let g = (0..n.gpus)
                    .filter(|&g| self.geo.fits(self.gpu_state[n.gpu0 + g as usize], p))
                    .min_by_key(|&g| {
                        (
                            self.geo
                                .info(self.gpu_state[n.gpu0 + g as usize])
                                .free_compute,
                            g,
                        )
                    })?;
                let fits = self.geo.info(self.gpu_state[n.gpu0 + g as usize]).fits;
                self.carve_starts[p]
                    .iter()
                    .find(|&&s| fits & (1 << self.geo.cand(p, s)) != 0)
                    .map(|&s| (g, s))
            }
            Policy::StateAware { .. } => {
                let live = self.live.as_mut()?;
                let seen = live.history[node].front()?;
                let order = live
                    .order
                    .order_masks(seen, p)
                    .expect("the replay's GPU states are valid instance sets");
                let (geo, states) = (&self.geo, &self.gpu_state);
                let fits = |&(g, s): &(u32, u8)| {
                    geo.info(states[n.gpu0 + g as usize]).fits & (1 << geo.cand(p, s)) != 0
                };
                let got = order.into_iter().find(fits);
                if live.lag > 0 {
                    let now: Vec<u64> = states[n.gpu0..n.gpu0 + n.gpus as usize]
                        .iter()
                        .map(|&st| geo.info(st).mask)
                        .collect();
                    let fresh = live
                        .order
                        .order_masks(&now, p)
                        .expect("the replay's GPU states are valid instance sets")
                        .into_iter()
                        .find(fits);
                    if fresh != got {
                        self.t.stale_picks += 1;
                    }
                }
                got
            }
            _ => self.tables[n.order][p]
                .iter()
                .find(|&&(g, c)| {
                    self.geo.info(self.gpu_state[n.gpu0 + usize::from(g)]).fits & (1 << c) != 0
                })
                .map(|&(g, c)| (u32::from(g), self.geo.cands[usize::from(c)].start)),
        }
    }

    fn repack_node(&mut self, pos: usize, node: usize, d: &Demand) -> bool {
        let Some(m) = self.with_added(node, d) else {
            return false;
        };
        let gpus = self.nodes[node].gpus;
        let Some(packing) = self.repack.as_mut().and_then(|r| r.pack(&m, gpus)) else {
            return false;
        };
        let g0 = self.nodes[node].gpu0;
        self.t.repacks += 1;
        for (g, insts) in packing.into_iter().enumerate() {
            let mut mask = 0u64;
            for i in &insts {
                mask |= 1 << self.geo.cand(i.profile, i.start);
            }
            let new = self.geo.state(mask);
            self.set_gpu(g0 + g, new);
            if let Some(l) = &mut self.log {
                for i in insts {
                    l.push((pos, node, g as u32, i.profile, i.start));
                }
            }
        }
        true
    }

    /// Schedule one task; `None` when no node passes the filter.
    pub fn submit(&mut self, pos: usize, d: &Demand) -> Option<Live> {
        self.t.tasks += 1;
        self.t.arrived_compute += u64::from(d.compute_slices);
        let Some(node) = self.choose_node(d) else {
            self.t.failures[d.class] += 1;
            self.t.failed_compute[d.class] += u64::from(d.compute_slices);
            let cause = self.classify_failure(d) as usize;
            self.t.fail_causes[cause] += 1;
            self.t.fail_cause_compute[cause] += u64::from(d.compute_slices);
            return None;
        };
        let mut devices = Vec::new();
        if let Some(p) = d.profile {
            let fits_now = u32::from(self.nodes[node].fit_count[p]) >= d.count;
            if fits_now {
                for _ in 0..d.count {
                    let Some((g, s)) = self.pick(node, p) else {
                        unreachable!("fit count promised a free placement")
                    };
                    self.t.device_picks += 1;
                    self.place_one(pos, node, g, p, s);
                    devices.push((self.nodes[node].gpu0 + g as usize, self.geo.cand(p, s)));
                }
            } else if !self.repack_node(pos, node, d) {
                unreachable!("the node filter promised a re-packing")
            }
            if let Some(slot) = self.w.profiles.iter().position(|&q| q == p) {
                self.nodes[node].counts[slot] += d.count as u16;
            }
            self.refresh(node);
            self.device_event(node);
        }
        let n = &mut self.nodes[node];
        n.cpu_used += d.cpu_milli;
        n.mem_used += d.memory_mib;
        self.t.placed += 1;
        Some(Live {
            node,
            demand: *d,
            devices,
        })
    }

    /// A placed task leaves: its CPU, RAM and instances are freed. Under the
    /// repack heuristic instances may have moved, so any instance of the task's
    /// profile on its node is removed (equivalent, since migration is allowed).
    pub fn depart(&mut self, live: &Live) {
        let d = &live.demand;
        let node = live.node;
        if let Some(p) = d.profile {
            if self.repack.is_some() {
                let (g0, g) = (self.nodes[node].gpu0, self.nodes[node].gpus as usize);
                for _ in 0..d.count {
                    let hit = (g0..g0 + g).find_map(|gi| {
                        let m = self.geo.info(self.gpu_state[gi]).mask & self.geo.profile_mask[p];
                        (m != 0).then(|| (gi, m.trailing_zeros() as u8))
                    });
                    if let Some((gi, c)) = hit {
                        self.unplace(gi, c);
                    }
                }
            } else {
                for &(gi, c) in &live.devices {
                    self.unplace(gi, c);
                }
            }
            if let Some(slot) = self.w.profiles.iter().position(|&q| q == p) {
                let c = &mut self.nodes[node].counts[slot];
                *c = c.saturating_sub(d.count as u16);
            }
            self.refresh(node);
            self.device_event(node);
        }
        let n = &mut self.nodes[node];
        n.cpu_used -= d.cpu_milli;
        n.mem_used -= d.memory_mib;
    }

    fn unplace(&mut self, gi: usize, cand: u8) {
        let mask = self.geo.info(self.gpu_state[gi]).mask;
        debug_assert!(
            mask & (1 << cand) != 0,
            "removing an instance that is not there"
        );
        let new = self.geo.state(mask & !(1 << cand));
        self.set_gpu(gi, new);
    }

    /// Cluster totals now.
    pub fn totals(&self) -> &Totals {
        &self.t
    }

    /// Cluster totals now, with [`Totals::unusable_compute`] filled in (one
    /// pass over every GPU: done only at sample points).
    pub fn sample(&self) -> Totals {
        let profiles = self.w.profiles;
        let mut unusable = vec![0u64; profiles.len()];
        for n in &self.nodes {
            let cpu_free = n.cpu_cap.saturating_sub(n.cpu_used);
            let mem_free = n.mem_cap.saturating_sub(n.mem_used);
            for &st in &self.gpu_state[n.gpu0..n.gpu0 + n.gpus as usize] {
                let free = u64::from(self.geo.info(st).free_compute);
                if free == 0 {
                    continue;
                }
                for (k, &p) in profiles.iter().enumerate() {
                    let (cpu, mem) = self.w.requests.get(k).copied().unwrap_or((0, 0));
                    if cpu > cpu_free || mem > mem_free || !self.geo.fits(st, p) {
                        unusable[k] += free;
                    }
                }
            }
        }
        Totals {
            unusable_compute: unusable,
            ..self.t.clone()
        }
    }
}

/// A placed task: where it went, so that it can leave again.
#[derive(Clone, Debug)]
pub(crate) struct Live {
    node: usize,
    demand: Demand,
    /// `(cluster-wide GPU, candidate)` per device (empty after a re-packing).
    devices: Vec<(usize, u8)>,
}

/// Replay `seq` (positions into `w.demands`) under `policy`, sampling totals at
/// every whole percent of arrived compute load up to `max_pct`.
pub(crate) fn replay(
    w: &World<'_>,
    policy: Policy,
    seed: u64,
    seq: &[u32],
    max_pct: u32,
    log: bool,
) -> Trajectory {
    let mut r = Replay::new(w, policy, seed, log);
    let mut points = Vec::with_capacity(max_pct as usize);
    let cap = w.compute_capacity;
    for (pos, &i) in seq.iter().enumerate() {
        r.submit(pos, &w.demands[i as usize]);
        while (points.len() as u32) < max_pct
            && r.t.arrived_compute * 100 >= (points.len() as u64 + 1) * cap
        {
            points.push(r.sample());
        }
    }
    let final_gpus = r.gpu_state.iter().map(|&st| r.geo.instances(st)).collect();
    Trajectory {
        points,
        log: r.log.unwrap_or_default(),
        final_gpus,
    }
}

/// Tasks drawn with replacement (uniformly over the rows, seeded) until their
/// compute slices reach `max_pct` % of `capacity`.
pub(crate) fn draw_sequence(
    demands: &[Demand],
    seed: u64,
    capacity: u64,
    max_pct: u32,
) -> Vec<u32> {
    let mut rng = SplitMix64::new(seed);
    let mut seq = Vec::new();
    let mut arrived = 0u64;
    let target = capacity * u64::from(max_pct);
    if demands.iter().all(|d| d.compute_slices == 0) {
        return seq;
    }
    while arrived * 100 < target {
        let i = rng.below(demands.len() as u64) as u32;
        arrived += u64::from(demands[i as usize].compute_slices);
        seq.push(i);
    }
    seq
}

#[cfg(test)]
mod tests {
    use super::*;
    use carve_model::GpuModel;

    fn h100() -> GpuSpec {
        GpuModel::find("h100-80gb").unwrap().spec()
    }

    fn pidx(s: &GpuSpec, name: &str) -> usize {
        s.profiles.iter().position(|p| p.name == name).unwrap()
    }

    fn demand(s: &GpuSpec, name: &str, class: usize) -> Demand {
        let p = pidx(s, name);
        Demand {
            cpu_milli: 1000,
            memory_mib: 1024,
            profile: Some(p),
            count: 1,
            compute_slices: u32::from(s.profiles[p].compute_slices),
            memory_slices: u32::from(s.profiles[p].memory_slices),
            requested_milli: 400,
            class,
            models: u64::MAX,
        }
    }

    /// One node with two H100s; tasks 3g, 3g, 4g, 4g (by hand):
    /// - name/first-fit: 3g→GPU0@0, 3g→GPU0@4 (3g+3g strands a slice), 4g→GPU1@0,
    ///   the second 4g fails: 10 of 14 slices used, 1 stranded.
    /// - carve: 3g→GPU0@4, 3g→GPU1@4, 4g→GPU0@0, 4g→GPU1@0: all 14 used.
    #[test]
    fn name_order_strands_where_carve_does_not() {
        let s = h100();
        let demands = vec![demand(&s, "3g.40gb", 0), demand(&s, "4g.40gb", 1)];
        let nodes = vec![NodeCap::any_model(64_000, 1 << 20, 2)];
        let profiles = vec![pidx(&s, "3g.40gb"), pidx(&s, "4g.40gb")];
        let w = World {
            spec: &s,
            nodes: &nodes,
            demands: &demands,
            profiles: &profiles,
            classes: 2,
            compute_capacity: 14,
            nodes_to_find: 1,
            requests: &[],
            scoring: Scoring::LeastAllocated,
        };
        let seq = [0, 0, 1, 1];
        let (p3, p4) = (pidx(&s, "3g.40gb"), pidx(&s, "4g.40gb"));
        for pol in [Policy::Name, Policy::FirstFit] {
            let tr = replay(&w, pol, 42, &seq, 1000, true);
            let end = tr.points.last().unwrap();
            assert_eq!(end.used_compute, 10, "{pol}");
            assert_eq!(end.stranded_compute, 1, "{pol}");
            assert_eq!(end.failures, vec![0, 1], "{pol}");
            assert_eq!(
                tr.log,
                vec![(0, 0, 0, p3, 0), (1, 0, 0, p3, 4), (2, 0, 1, p4, 0)],
                "{pol}"
            );
        }
        for pol in [Policy::Carve, Policy::RepackHeuristic] {
            let tr = replay(&w, pol, 42, &seq, 1000, true);
            let end = tr.points.last().unwrap();
            assert_eq!((end.used_compute, end.stranded_compute), (14, 0), "{pol}");
            assert_eq!(end.failures, vec![0, 0], "{pol}");
            assert_eq!(
                tr.log,
                vec![
                    (0, 0, 0, p3, 4),
                    (1, 0, 1, p3, 4),
                    (2, 0, 0, p4, 0),
                    (3, 0, 1, p4, 0)
                ],
                "{pol}"
            );
        }
    }

    /// One H100 node, tasks 2g, 2g, 3g. carve: 2g@4, 2g@2, then 3g has no
    /// free placement (@4 and @0 both overlap) and fails. The repack heuristic
    /// re-packs the node to 3g@4 + 2g@2 + 2g@0 (7 of 7 slices) instead.
    /// 3g, 3g, 1g: no layout holds 7 compute slices in 3g + 3g + 1g (3g + 3g
    /// covers all memory slices), so both fail the 1g.
    #[test]
    fn repack_bound_migrates_only_when_needed() {
        let s = h100();
        let demands = vec![
            demand(&s, "1g.10gb", 0),
            demand(&s, "2g.20gb", 1),
            demand(&s, "3g.40gb", 2),
        ];
        let nodes = vec![NodeCap::any_model(64_000, 1 << 20, 1)];
        let profiles = vec![
            pidx(&s, "1g.10gb"),
            pidx(&s, "2g.20gb"),
            pidx(&s, "3g.40gb"),
        ];
        let w = World {
            spec: &s,
            nodes: &nodes,
            demands: &demands,
            profiles: &profiles,
            classes: 3,
            compute_capacity: 7,
            nodes_to_find: 1,
            requests: &[],
            scoring: Scoring::LeastAllocated,
        };
        let (p2, p3) = (pidx(&s, "2g.20gb"), pidx(&s, "3g.40gb"));
        let carve = replay(&w, Policy::Carve, 1, &[1, 1, 2], 1000, true);
        assert_eq!(carve.log, vec![(0, 0, 0, p2, 4), (1, 0, 0, p2, 2)]);
        let end = carve.points.last().unwrap();
        assert_eq!(
            (end.failures.clone(), end.used_compute, end.repacks),
            (vec![0, 0, 1], 4, 0)
        );

        let rp = replay(&w, Policy::RepackHeuristic, 1, &[1, 1, 2], 1000, true);
        let end = rp.points.last().unwrap();
        assert_eq!(
            (end.failures.clone(), end.used_compute, end.repacks),
            (vec![0, 0, 0], 7, 1)
        );
        let mut fin = rp.final_gpus[0].clone();
        fin.sort();
        let mut want = vec![
            Instance {
                profile: p3,
                start: 4,
            },
            Instance {
                profile: p2,
                start: 2,
            },
            Instance {
                profile: p2,
                start: 0,
            },
        ];
        want.sort();
        assert_eq!(fin, want);

        for pol in [Policy::Carve, Policy::RepackHeuristic] {
            let tr = replay(&w, pol, 1, &[2, 2, 0], 1000, false);
            let end = tr.points.last().unwrap();
            assert_eq!(
                (end.failures.clone(), end.used_compute, end.stranded_compute),
                (vec![1, 0, 0], 6, 1),
                "{pol}"
            );
        }
    }

    /// One node, two H100s, 16 cores; profiles 1g, 2g, 3g, 4g, 7g; one 4g
    /// task (2 cores). carve puts it at GPU 0 slice 0: GPU 0 keeps 3 free
    /// compute slices (usable by 1g, 2g, 3g at 4), GPU 1 all 7. 4g has no
    /// placement left on GPU 0 (3 unusable), nor 7g (3). With a typical 3g
    /// request of 15 cores (more than the 14 left) every free slice is
    /// unusable for 3g: 10.
    #[test]
    fn unusable_compute_per_profile_by_hand() {
        let s = h100();
        let names = ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"];
        let profiles: Vec<usize> = names.iter().map(|n| pidx(&s, n)).collect();
        let mut d = demand(&s, "4g.40gb", 3);
        d.cpu_milli = 2000;
        let demands = vec![d];
        let nodes = vec![NodeCap::any_model(16_000, 1 << 20, 2)];
        let requests = vec![(1000, 1024); 5];
        let mut w = World {
            spec: &s,
            nodes: &nodes,
            demands: &demands,
            profiles: &profiles,
            classes: 5,
            compute_capacity: 14,
            nodes_to_find: 1,
            requests: &requests,
            scoring: Scoring::LeastAllocated,
        };
        let tr = replay(&w, Policy::Carve, 1, &[0], 1000, true);
        assert_eq!(tr.log, vec![(0, 0, 0, pidx(&s, "4g.40gb"), 0)]);
        let end = tr.points.last().unwrap();
        assert_eq!(end.used_compute, 4);
        assert_eq!(end.unusable_compute, vec![0, 0, 0, 3, 3]);
        let mut busy = requests.clone();
        busy[2] = (15_000, 1024);
        w.requests = &busy;
        let end = replay(&w, Policy::Carve, 1, &[0], 1000, false)
            .points
            .pop()
            .unwrap();
        assert_eq!(end.unusable_compute, vec![0, 0, 10, 3, 3]);
    }

    #[test]
    fn nodes_to_find_matches_kube_scheduler() {
        // max(50 - n/125, 5) % of n, at least 100; all under 100 nodes.
        assert_eq!(nodes_to_find(1213, 0), 497);
        assert_eq!(nodes_to_find(99, 0), 99);
        assert_eq!(nodes_to_find(100, 0), 100);
        assert_eq!(nodes_to_find(5000, 0), 500);
        assert_eq!(nodes_to_find(10_000, 0), 500);
        assert_eq!(nodes_to_find(1213, 100), 1213);
        assert_eq!(nodes_to_find(1213, 10), 121);
        assert_eq!(nodes_to_find(1000, 5), 100);
    }

    /// Three nodes, the middle one without room for the task's CPU; the
    /// scheduler stops at the first feasible node and the next search starts
    /// after the last node it processed: 0, 2 (1 skipped), 0, 2. Scoring every
    /// node instead spreads by LeastAllocated: the second task avoids node 0.
    #[test]
    fn node_search_is_round_robin_and_stops_at_nodes_to_find() {
        let s = h100();
        let demands = vec![demand(&s, "1g.10gb", 0)];
        let node = |cpu_milli| NodeCap::any_model(cpu_milli, 1 << 20, 1);
        let nodes = vec![node(64_000), node(500), node(64_000)];
        let profiles = vec![pidx(&s, "1g.10gb")];
        let mut w = World {
            spec: &s,
            nodes: &nodes,
            demands: &demands,
            profiles: &profiles,
            classes: 1,
            compute_capacity: 21,
            nodes_to_find: 1,
            requests: &[],
            scoring: Scoring::LeastAllocated,
        };
        let chosen = |w: &World<'_>| -> Vec<usize> {
            replay(w, Policy::Carve, 3, &[0, 0, 0, 0], 1000, true)
                .log
                .iter()
                .map(|l| l.1)
                .collect()
        };
        assert_eq!(chosen(&w), vec![0, 2, 0, 2]);
        w.nodes_to_find = 3;
        let all = chosen(&w);
        assert_eq!(all.len(), 4);
        assert!(all.iter().all(|&n| n != 1), "{all:?}");
        assert_ne!(all[0], all[1], "LeastAllocated spreads: {all:?}");
    }

    /// Two equal nodes scored on every feasible node: after the first task,
    /// LeastAllocated sends the second task to the other node (175 against
    /// 187 points), MostAllocated to the same one (125 against 112).
    #[test]
    fn most_allocated_packs_where_least_allocated_spreads() {
        let s = h100();
        // CPU and RAM in the same proportion, so that BalancedAllocation
        // scores every node alike and NodeResourcesFit decides.
        let mut d = demand(&s, "1g.10gb", 0);
        (d.cpu_milli, d.memory_mib) = (8000, 8192);
        let demands = vec![d];
        let nodes = vec![
            NodeCap::any_model(64_000, 65_536, 1),
            NodeCap::any_model(64_000, 65_536, 1),
        ];
        let profiles = vec![pidx(&s, "1g.10gb")];
        let mut w = World {
            spec: &s,
            nodes: &nodes,
            demands: &demands,
            profiles: &profiles,
            classes: 1,
            compute_capacity: 14,
            nodes_to_find: 2,
            requests: &[],
            scoring: Scoring::LeastAllocated,
        };
        let chosen = |w: &World<'_>| -> Vec<usize> {
            replay(w, Policy::Carve, 3, &[0, 0, 0], 1000, true)
                .log
                .iter()
                .map(|l| l.1)
                .collect()
        };
        let least = chosen(&w);
        assert_ne!(least[0], least[1], "{least:?}");
        w.scoring = Scoring::MostAllocated;
        let most = chosen(&w);
        assert_eq!(most[0], most[1], "{most:?}");
        assert_eq!(most[1], most[2], "{most:?}");
    }

    /// The failure causes at the moment of failure, by hand: one node of
    /// one H100 with 4 cores.
    /// - 3g, 3g (carve: @4 then @0), 4g: no 4g placement, but 3g + 4g would
    ///   pack re-placed, and 3g + 3g + 4g would not (10 > 7): no-room.
    /// - 2g (@4), 2g (@2), 3g: re-packed 3g@4 + 2g@2 + 2g@0: repack-avoidable.
    /// - a 5-core task: no-host; 2 × 7g on one GPU: no-empty-gpus.
    #[test]
    fn failure_causes_by_hand() {
        let s = h100();
        let mut big = demand(&s, "1g.10gb", 0);
        big.cpu_milli = 5000;
        let mut pair = demand(&s, "7g.80gb", 4);
        pair.count = 2;
        pair.compute_slices = 14;
        let demands = vec![
            demand(&s, "2g.20gb", 1),
            demand(&s, "3g.40gb", 2),
            demand(&s, "4g.40gb", 3),
            big,
            pair,
        ];
        let nodes = vec![NodeCap::any_model(4000, 1 << 20, 1)];
        let profiles: Vec<usize> = ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
            .iter()
            .map(|n| pidx(&s, n))
            .collect();
        let w = World {
            spec: &s,
            nodes: &nodes,
            demands: &demands,
            profiles: &profiles,
            classes: 5,
            compute_capacity: 7,
            nodes_to_find: 1,
            requests: &[],
            scoring: Scoring::LeastAllocated,
        };
        let causes = |seq: &[u32]| {
            replay(&w, Policy::Carve, 1, seq, 100_000, false)
                .points
                .last()
                .unwrap()
                .fail_causes
        };
        assert_eq!(causes(&[1, 1, 2]), [0, 0, 1, 0]);
        assert_eq!(causes(&[0, 0, 1]), [0, 0, 0, 1]);
        assert_eq!(causes(&[3, 4]), [1, 1, 0, 0]);
        // Name order on 3g, 4g: 3g@0 blocks the 4g; 3g@4 + 4g@0 would hold both.
        let name = replay(&w, Policy::Name, 1, &[1, 2], 100_000, false);
        assert_eq!(name.points.last().unwrap().fail_causes, [0, 0, 0, 1]);
    }

    /// Two H100s, state-aware order. 4g → GPU 0 at 0; 3g → GPU 0 at 4 (it
    /// fills GPU 0: loss 10 there, 17 on the empty GPU 1); 1g → GPU 1 at 6.
    /// The 3g leaves, then a 3g arrives. The current order puts it back on
    /// GPU 0 at 4; at lag 1 the scheduler allocates from the version
    /// published before the departure, where GPU 0 was full: its first
    /// free device is GPU 1 at 0 (the 4g home of GPU 1), a stale pick.
    /// Every prepare and unprepare here changed the order: one write each.
    #[test]
    fn a_stale_slice_version_changes_the_pick_after_a_departure() {
        let s = h100();
        let names = ["1g.10gb", "3g.40gb", "4g.40gb"];
        let demands: Vec<Demand> = names
            .iter()
            .enumerate()
            .map(|(k, n)| demand(&s, n, k))
            .collect();
        let nodes = vec![NodeCap::any_model(64_000, 1 << 20, 2)];
        let profiles: Vec<usize> = names.iter().map(|n| pidx(&s, n)).collect();
        let w = World {
            spec: &s,
            nodes: &nodes,
            demands: &demands,
            profiles: &profiles,
            classes: 3,
            compute_capacity: 14,
            nodes_to_find: 1,
            requests: &[],
            scoring: Scoring::LeastAllocated,
        };
        let (p1, p3, p4) = (profiles[0], profiles[1], profiles[2]);
        let run = |lag: u8| {
            let mut r = Replay::new(&w, Policy::StateAware { lag }, 1, true);
            r.submit(0, &demands[2]).unwrap();
            let three = r.submit(1, &demands[1]).unwrap();
            r.submit(2, &demands[0]).unwrap();
            r.depart(&three);
            r.submit(3, &demands[1]).unwrap();
            (r.log.clone().unwrap(), r.totals().clone())
        };
        let (log0, t0) = run(0);
        let head = [(0, 0, 0, p4, 0), (1, 0, 0, p3, 4), (2, 0, 1, p1, 6)];
        assert_eq!(log0[..3], head[..]);
        assert_eq!(log0[3], (3, 0, 0, p3, 4));
        assert_eq!((t0.stale_picks, t0.device_picks), (0, 4));
        let (log1, t1) = run(1);
        assert_eq!(log1[..3], head[..]);
        assert_eq!(log1[3], (3, 0, 1, p3, 0));
        assert_eq!((t1.stale_picks, t1.device_picks), (1, 4));
        for t in [&t0, &t1] {
            assert_eq!((t.device_events, t.republishes), (5, 5));
        }
        // A static order publishes once: no write per event.
        let mut r = Replay::new(&w, Policy::Carve, 1, false);
        r.submit(0, &demands[2]).unwrap();
        assert_eq!((r.totals().device_events, r.totals().republishes), (1, 0));
    }

    #[test]
    fn state_aware_labels_parse_back_and_bad_lags_are_refused() {
        for p in Policy::ALL {
            assert_eq!(p.label().parse::<Policy>(), Ok(p));
        }
        assert_eq!(Policy::StateAware { lag: 0 }.label(), "state-aware");
        assert_eq!(
            "state-aware-lag3".parse::<Policy>(),
            Ok(Policy::StateAware { lag: 3 })
        );
        for bad in [
            "state-aware-lag17",
            "state-aware-lag",
            "state-aware-lag-1",
            "state-aware-lag+2",
        ] {
            let e = bad.parse::<Policy>().unwrap_err();
            assert!(e.contains("lag must be"), "{bad}: {e}");
        }
        let e = "stateaware".parse::<Policy>().unwrap_err();
        assert!(
            e.contains("state-aware-lag1") && e.contains("state-aware-lagN"),
            "{e}"
        );
    }

    #[test]
    fn repacker_finds_packings_and_rejects_overfull_sets() {
        let s = h100();
        let profiles = vec![
            pidx(&s, "1g.10gb"),
            pidx(&s, "2g.20gb"),
            pidx(&s, "3g.40gb"),
            pidx(&s, "4g.40gb"),
            pidx(&s, "7g.80gb"),
        ];
        let mut r = Repacker::new(&s, &profiles);
        // 4g+3g, 4g+2g+1g on two GPUs.
        let m = [1, 1, 1, 2, 0];
        let packing = r.pack(&m, 2).expect("packs onto two GPUs");
        let mut count = [0u16; 5];
        for g in &packing {
            Occupancy::with(&s, g).expect("a valid layout");
            for i in g {
                count[profiles.iter().position(|&p| p == i.profile).unwrap()] += 1;
            }
        }
        assert_eq!(count, m);
        assert!(r.pack(&m, 1).is_none());
        // Two 4g need two GPUs; 3 × 3g need two GPUs; 8 × 1g need two GPUs.
        assert!(!r.solve(&[0, 0, 0, 2, 0], 1));
        assert!(!r.solve(&[0, 0, 3, 0, 0], 1));
        assert!(r.solve(&[0, 0, 3, 0, 0], 2));
        assert!(!r.solve(&[8, 0, 0, 0, 0], 1));
        assert!(r.solve(&[7, 0, 0, 0, 0], 1));
        assert!(!r.solve(&[0, 0, 0, 0, 1], 0));
    }
}
