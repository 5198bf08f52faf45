//! The optimal **online** policy of the per-node reference, by exact dynamic
//! programming.
//!
//! [`crate::optimum`] is clairvoyant: it knows the whole task sequence. A
//! device order (static or state-aware) is an online policy: it places each
//! task knowing only the node's present occupancy and the distribution the
//! tasks are drawn from. The optimal online policy computed here knows a
//! little more, the compute arrived so far (rejected tasks included, which
//! a node does not see), so its value bounds every device order from above.
//! It is computed for the reference's own model: tasks drawn
//! i.i.d. and uniformly from the mapped trace's rows (as
//! [`crate::sim::draw_sequence`] draws them) while less than 100 % of the
//! node's compute has arrived; a task that fits must be placed, one that does
//! not is lost.
//!
//! The value of a state is the expected compute the rest of the sequence
//! accepts under the best policy:
//!
//! `V(a, s) = Σ_t p_t · Q_t(a, s)` for `a < C`, `V = 0` once `a ≥ C`,
//!
//! with `a` the compute arrived so far, `C` the node's compute, `s` the
//! occupancy (GPU states sorted: GPUs are interchangeable; plus the used CPU
//! and RAM when the shape limits them), and `Q_t` the best over `t`'s
//! placements of `c_t + V(a + c_t, s')`, or `V(a + c_t, s)` when `t` does not
//! fit. A task that leaves the state unchanged (a CPU-only task on a
//! geometry-only shape, or one that does not fit) is a self-loop:
//! `V = Σ_{t moves} p_t Q_t / (1 − Σ_{t loops} p_t)`. Every other task raises
//! the arrived compute or the used CPU/RAM, so the recursion ends.
//!
//! The GPU state is the optimum's (used compute slices, occupied memory
//! slices), under the same checks ([`crate::optimum::NodeOptimum::new`]).
//! The number of states grows with the GPUs (and explodes with CPU/RAM
//! sums); [`OnlineOptimum::solve`] stops with an error at a state budget
//! instead of running for hours.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use carve_model::GpuSpec;

use crate::error::FragError;
use crate::mapping::Demand;
use crate::optimum::{MAX_GPUS, NodeOptimum, NodeShape};

/// One kind of task of the distribution: what the DP distinguishes.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Kind {
    profile: Option<usize>,
    count: u32,
    compute: u32,
    cpu_milli: u64,
    memory_mib: u64,
    /// Probability of a draw.
    p: f64,
}

/// One GPU: used compute slices and occupied memory slices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Gpu {
    used: u8,
    mask: u16,
}

/// A fast hasher for the memo keys (multiply-xorshift; no DoS concern here).
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(29) ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn write_u128(&mut self, v: u128) {
        self.write_u64(v as u64);
        self.write_u64((v >> 64) as u64);
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(u64::from(v));
    }
    fn write_u16(&mut self, v: u16) {
        self.write_u64(u64::from(v));
    }
}

type Memo = HashMap<Key, f64, BuildHasherDefault<KeyHasher>>;

/// `(arrived compute, used CPU, used RAM, sorted GPU-state indices packed
/// 8 bits each)`.
type Key = (u16, u64, u64, u128);

/// The default state budget of [`OnlineOptimum::solve`]: about 1 GiB of memo
/// at most.
pub const DEFAULT_MAX_STATES: usize = 10_000_000;

/// The deepest recursion [`OnlineOptimum::solve`] goes (tasks of one
/// sequence), so that it stays within a worker thread's stack.
const MAX_DEPTH: u32 = 1000;

/// The exact online optimum of one node shape under one task distribution.
#[derive(Debug)]
pub struct OnlineOptimum {
    shape: NodeShape,
    capacity: u32,
    kinds: Vec<Kind>,
    /// Per profile: `(memory mask, compute slices)` of each placement.
    placements: Vec<Vec<(u16, u8)>>,
    compute: u8,
    full_mask: u16,
    /// GPU states seen so far; index 0 = empty.
    gpus: Vec<Gpu>,
    index: HashMap<Gpu, u8>,
    /// Permutations of the memory slices that map every tracked profile's
    /// placements onto themselves (the identity first): GPU states one of
    /// them maps onto each other have the same futures.
    automorphisms: Vec<Vec<u8>>,
    /// Per free mask: the most compute disjoint placements could still take
    /// there.
    max_fit: Vec<u8>,
    /// Off only in tests, to check the canonical form against raw states.
    canonicalise: bool,
    /// `succ[(gpu index, profile)]`: GPU-state indices after each fitting
    /// placement of the profile.
    succ: HashMap<(u8, usize), Vec<u8>>,
    memo: Memo,
    max_states: usize,
    limited: bool,
}

/// Why the DP could not finish.
fn budget_error(shape: &NodeShape, max: usize) -> FragError {
    FragError::Config {
        field: "online optimum",
        reason: format!(
            "{}: more than {max} states; the exact DP is out of reach for this shape",
            shape.label
        ),
    }
}

impl OnlineOptimum {
    /// The DP for `shape`, tasks drawn uniformly from `demands` (CPU-only
    /// rows included, as the reference draws them), the placements of
    /// `profiles` (positions in `spec.profiles`).
    ///
    /// # Errors
    /// As [`NodeOptimum::new`]; the shape has more than [`MAX_GPUS`] GPUs;
    /// more than 255 GPU states could arise; no task asks for compute.
    pub fn new(
        spec: &GpuSpec,
        profiles: &[usize],
        demands: &[Demand],
        shape: &NodeShape,
    ) -> Result<Self, FragError> {
        // The same model checks as the clairvoyant search.
        NodeOptimum::new(spec, profiles)?;
        if shape.gpus == 0 || shape.gpus > MAX_GPUS {
            return Err(FragError::Config {
                field: "node shape",
                reason: format!("{} GPUs; the DP takes 1..={MAX_GPUS}", shape.gpus),
            });
        }
        if demands.iter().all(|d| d.compute_slices == 0) {
            return Err(FragError::Config {
                field: "trace",
                reason: "no task asks for GPU compute, so no load arrives".into(),
            });
        }
        let limited = shape.cpu_milli.is_some() || shape.memory_mib.is_some();
        let mut placements = vec![Vec::new(); spec.profiles.len()];
        for &p in profiles {
            let pr = &spec.profiles[p];
            placements[p] = pr
                .placements
                .iter()
                .map(|pl| (mask(pl.start, pr.memory_slices), pr.compute_slices))
                .collect();
        }
        // Group the rows into kinds; CPU/RAM only matter on a limited shape.
        let mut kinds: Vec<Kind> = Vec::new();
        let mut at: HashMap<(Option<usize>, u32, u32, u64, u64), usize> = HashMap::new();
        let w = 1.0 / demands.len() as f64;
        for d in demands {
            if let Some(p) = d.profile
                && placements.get(p).is_none_or(Vec::is_empty)
            {
                return Err(FragError::Config {
                    field: "trace",
                    reason: format!(
                        "profile {} is not tracked by the DP",
                        spec.profiles.get(p).map_or("?", |x| x.name.as_str())
                    ),
                });
            }
            let (cpu, mem) = if limited {
                (d.cpu_milli, d.memory_mib)
            } else {
                (0, 0)
            };
            let key = (d.profile, d.count, d.compute_slices, cpu, mem);
            let k = *at.entry(key).or_insert_with(|| {
                kinds.push(Kind {
                    profile: d.profile,
                    count: d.count,
                    compute: d.compute_slices,
                    cpu_milli: cpu,
                    memory_mib: mem,
                    p: 0.0,
                });
                kinds.len() - 1
            });
            kinds[k].p += w;
        }
        let empty = Gpu { used: 0, mask: 0 };
        let automorphisms = automorphisms(spec.memory_slices, &placements);
        let full = mask(0, spec.memory_slices);
        let max_fit = (0..=full)
            .map(|free| max_fit(&placements, free, spec.compute_slices))
            .collect();
        Ok(Self {
            shape: shape.clone(),
            capacity: shape.gpus * u32::from(spec.compute_slices),
            kinds,
            placements,
            compute: spec.compute_slices,
            full_mask: mask(0, spec.memory_slices),
            gpus: vec![empty],
            index: HashMap::from([(empty, 0)]),
            automorphisms,
            max_fit,
            canonicalise: true,
            succ: HashMap::new(),
            memo: Memo::default(),
            max_states: DEFAULT_MAX_STATES,
            limited,
        })
    }

    /// Stop [`OnlineOptimum::solve`] with an error past `max` memo states.
    #[must_use]
    pub fn with_max_states(mut self, max: usize) -> Self {
        self.max_states = max;
        self
    }

    /// Compute slices of the node.
    #[must_use]
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Distinct task kinds of the distribution (with their CPU/RAM on a
    /// limited shape): the branching factor of every state.
    #[must_use]
    pub fn kinds(&self) -> usize {
        self.kinds.len()
    }

    /// Canonical GPU states met so far.
    #[must_use]
    pub fn gpu_states(&self) -> usize {
        self.gpus.len()
    }

    /// States memoised so far (a size figure).
    #[must_use]
    pub fn states(&self) -> usize {
        self.memo.len()
    }

    /// The expected compute the optimal online policy accepts from an empty
    /// node.
    ///
    /// # Errors
    /// The state budget is exceeded (see [`OnlineOptimum::with_max_states`]).
    pub fn solve(&mut self) -> Result<f64, FragError> {
        let start = self.start();
        self.value(0, 0, 0, start, 0)
    }

    fn start(&self) -> u128 {
        0 // every GPU at index 0 (empty)
    }

    /// The canonical form of a GPU state: remaining compute capped at what
    /// the free slices could still take (beyond that it never binds), a
    /// state where nothing fits any more as the full GPU, and the smallest
    /// mask among its images under the automorphisms. Exact: each step maps
    /// a state onto one with the same feasible futures.
    fn canonical(&self, g: Gpu) -> Gpu {
        if !self.canonicalise {
            return g;
        }
        let free = self.full_mask & !g.mask;
        let fit = self.max_fit[free as usize];
        if fit == 0 {
            return Gpu {
                used: self.compute,
                mask: self.full_mask,
            };
        }
        let used = g.used.max(self.compute - fit);
        let mask = self
            .automorphisms
            .iter()
            .map(|perm| permute(g.mask, perm))
            .min()
            .unwrap_or(g.mask);
        Gpu { used, mask }
    }

    fn gpu_index(&mut self, g: Gpu) -> Result<u8, FragError> {
        let g = self.canonical(g);
        if let Some(&i) = self.index.get(&g) {
            return Ok(i);
        }
        let i = u8::try_from(self.gpus.len()).map_err(|_| FragError::Config {
            field: "online optimum",
            reason: "more than 255 GPU states".into(),
        })?;
        self.gpus.push(g);
        self.index.insert(g, i);
        Ok(i)
    }

    fn unpack(&self, s: u128) -> Vec<u8> {
        (0..self.shape.gpus).map(|k| (s >> (8 * k)) as u8).collect()
    }

    fn pack(v: &mut [u8]) -> u128 {
        // Sorted descending so that empty GPUs (index 0) sit in the high
        // bytes; any fixed order is a canonical form.
        v.sort_unstable_by(|a, b| b.cmp(a));
        v.iter()
            .enumerate()
            .fold(0u128, |acc, (k, &x)| acc | (u128::from(x) << (8 * k)))
    }

    /// The GPU-state indices each fitting placement of `p` leads to from
    /// GPU state `gi`.
    fn successors(&mut self, gi: u8, p: usize) -> Result<Vec<u8>, FragError> {
        if let Some(v) = self.succ.get(&(gi, p)) {
            return Ok(v.clone());
        }
        let g = self.gpus[gi as usize];
        let mut out = Vec::new();
        for (m, c) in self.placements[p].clone() {
            if g.mask & m == 0 && g.used + c <= self.compute {
                out.push(self.gpu_index(Gpu {
                    used: g.used + c,
                    mask: g.mask | m,
                })?);
            }
        }
        self.succ.insert((gi, p), out.clone());
        Ok(out)
    }

    /// The node states `kind` may lead to from `s` (empty: it does not fit
    /// the GPUs). Every one of them accepts the task.
    fn next_states(&mut self, s: u128, kind: &Kind) -> Result<Vec<u128>, FragError> {
        let Some(p) = kind.profile else {
            return Ok(vec![s]);
        };
        let cur = self.unpack(s);
        let mut out = Vec::new();
        if kind.count > 1 {
            // Whole GPUs on empty GPUs, which are interchangeable.
            let whole = self.placements[p].first().copied();
            let empty = cur.iter().filter(|&&g| g == 0).count();
            if let Some((m, c)) = whole
                && m == self.full_mask
                && empty >= kind.count as usize
            {
                let full = self.gpu_index(Gpu { used: c, mask: m })?;
                let mut next = cur.clone();
                let mut left = kind.count;
                for g in &mut next {
                    if left > 0 && *g == 0 {
                        *g = full;
                        left -= 1;
                    }
                }
                out.push(Self::pack(&mut next));
            }
            return Ok(out);
        }
        for k in 0..cur.len() {
            if k > 0 && cur[k - 1] == cur[k] {
                continue; // the same GPU state: the same branches
            }
            for ni in self.successors(cur[k], p)? {
                let mut next = cur.clone();
                next[k] = ni;
                let packed = Self::pack(&mut next);
                if !out.contains(&packed) {
                    out.push(packed);
                }
            }
        }
        Ok(out)
    }

    fn host_fits(&self, cpu: u64, mem: u64, d_cpu: u64, d_mem: u64) -> bool {
        cpu.saturating_add(d_cpu) <= self.shape.cpu_milli.unwrap_or(u64::MAX)
            && mem.saturating_add(d_mem) <= self.shape.memory_mib.unwrap_or(u64::MAX)
    }

    /// `V(a, cpu, mem, s)`.
    fn value(&mut self, a: u32, cpu: u64, mem: u64, s: u128, depth: u32) -> Result<f64, FragError> {
        if a >= self.capacity {
            return Ok(0.0);
        }
        let key = (a as u16, cpu, mem, s);
        if let Some(&v) = self.memo.get(&key) {
            return Ok(v);
        }
        if self.memo.len() >= self.max_states {
            return Err(budget_error(&self.shape, self.max_states));
        }
        if depth > MAX_DEPTH {
            return Err(FragError::Config {
                field: "online optimum",
                reason: format!(
                    "{}: more than {MAX_DEPTH} tasks deep; the exact DP is out of reach for this shape",
                    self.shape.label
                ),
            });
        }
        let mut moves = 0.0;
        let mut loops = 0.0;
        for k in 0..self.kinds.len() {
            let kind = self.kinds[k];
            let q = self.q(a, cpu, mem, s, &kind, depth)?;
            match q {
                None => loops += kind.p,
                Some(v) => moves += kind.p * v,
            }
        }
        let v = moves / (1.0 - loops);
        self.memo.insert(key, v);
        Ok(v)
    }

    /// `Q_t`, or `None` when the task leaves the state as it is.
    fn q(
        &mut self,
        a: u32,
        cpu: u64,
        mem: u64,
        s: u128,
        kind: &Kind,
        depth: u32,
    ) -> Result<Option<f64>, FragError> {
        let a2 = a + kind.compute;
        let host = self.host_fits(cpu, mem, kind.cpu_milli, kind.memory_mib);
        let nexts = if host {
            self.next_states(s, kind)?
        } else {
            Vec::new()
        };
        let (cpu2, mem2) = (cpu + kind.cpu_milli, mem + kind.memory_mib);
        if nexts.is_empty() {
            // Lost: only the arrived compute moves.
            return if kind.compute == 0 {
                Ok(None)
            } else {
                self.value(a2, cpu, mem, s, depth + 1).map(Some)
            };
        }
        if kind.compute == 0 && cpu2 == cpu && mem2 == mem && nexts == [s] {
            return Ok(None);
        }
        let mut best = f64::NEG_INFINITY;
        for n in nexts {
            let v = f64::from(kind.compute) + self.value(a2, cpu2, mem2, n, depth + 1)?;
            if v > best {
                best = v;
            }
        }
        Ok(Some(best))
    }

    /// What the optimal online policy accepts on the sequence `seq`
    /// (positions into `demands`) at an empty node of `shape` (the same GPU
    /// count as the DP's): for each task that fits, the placement with the
    /// highest `c + V` (the first on a tie). On a limited `shape` with a
    /// geometry-only DP this is the geometry policy run under the shape's
    /// CPU/RAM: an online policy, so a lower bound on that shape's online
    /// optimum, not the optimum.
    ///
    /// # Errors
    /// `shape` has another GPU count, or is limited while the DP is for
    /// another limited shape; the state budget is exceeded.
    pub fn simulate(
        &mut self,
        shape: &NodeShape,
        demands: &[Demand],
        seq: &[u32],
    ) -> Result<u32, FragError> {
        if shape.gpus != self.shape.gpus || (self.limited && *shape != self.shape) {
            return Err(FragError::Config {
                field: "node shape",
                reason: format!("the DP is for {}, not {}", self.shape.label, shape.label),
            });
        }
        let (cap_cpu, cap_mem) = (
            shape.cpu_milli.unwrap_or(u64::MAX),
            shape.memory_mib.unwrap_or(u64::MAX),
        );
        let (mut a, mut cpu, mut mem, mut s) = (0u32, 0u64, 0u64, self.start());
        let mut accepted = 0;
        for &i in seq {
            let d = demands[i as usize];
            let host = cpu.saturating_add(d.cpu_milli) <= cap_cpu
                && mem.saturating_add(d.memory_mib) <= cap_mem;
            let kind = Kind {
                profile: d.profile,
                count: d.count,
                compute: d.compute_slices,
                cpu_milli: if self.limited { d.cpu_milli } else { 0 },
                memory_mib: if self.limited { d.memory_mib } else { 0 },
                p: 0.0,
            };
            let nexts = if host {
                self.next_states(s, &kind)?
            } else {
                Vec::new()
            };
            let a2 = a + d.compute_slices;
            if !nexts.is_empty() {
                // The DP's key: the used CPU/RAM only where the DP tracks them.
                let (kc, km) = if self.limited {
                    (cpu + d.cpu_milli, mem + d.memory_mib)
                } else {
                    (0, 0)
                };
                let mut best = (f64::NEG_INFINITY, s);
                for n in nexts {
                    let v = self.value(a2, kc, km, n, 0)?;
                    if v > best.0 {
                        best = (v, n);
                    }
                }
                s = best.1;
                accepted += d.compute_slices;
                cpu += d.cpu_milli;
                mem += d.memory_mib;
            }
            a = a2;
        }
        Ok(accepted)
    }
}

/// The optimal online policy beside the clairvoyant optimum, on the
/// per-node reference's own sequences.
#[derive(Clone, Debug, PartialEq)]
pub struct OnlineFigures {
    /// The exact expected accepted compute slices of the optimal online
    /// policy for this shape; `None` when the DP was out of reach (then see
    /// [`OnlineFigures::unsolved`]).
    pub expected: Option<f64>,
    /// Per sequence: what the policy accepted. When `expected` is `None` on
    /// a limited shape: the policy of the geometry-only DP of the same GPU
    /// count run under the shape's CPU/RAM, an online policy and so a lower
    /// bound of this shape's online optimum, not the optimum.
    pub accepted: Vec<u32>,
    /// Memo states of the DP whose policy ran.
    pub states: usize,
    /// Canonical GPU states of the DP whose policy ran.
    pub gpu_states: usize,
    /// Distinct task kinds of this shape's own DP (with their CPU/RAM on a
    /// limited shape).
    pub kinds: usize,
    /// Why this shape's own DP was not solved, if it was not.
    pub unsolved: Option<String>,
}

impl OnlineFigures {
    /// Whether [`OnlineFigures::accepted`] is the optimal online policy of
    /// the shape (not a lower bound).
    #[must_use]
    pub fn exact(&self) -> bool {
        self.expected.is_some()
    }
}

/// The state budget of the exact DP of a shape with CPU/RAM limits inside
/// [`online_figures`]: the used CPU and RAM are sums over the tasks placed
/// so far, so the states multiply with every task; a budget larger than
/// this only delays the refusal.
pub const LIMITED_MAX_STATES: usize = 500_000;

/// The online optimum of `shape` on the sequences `seqs` (drawn by the
/// reference): this shape's own DP within `max_states`; on a limited shape
/// whose DP is out of reach, the geometry-only DP's policy under the
/// shape's CPU/RAM. `None` when the shape has more than `max_gpus` GPUs or
/// no DP of it finished within the budget.
///
/// # Errors
/// As [`OnlineOptimum::new`].
pub(crate) fn online_figures(
    spec: &GpuSpec,
    profiles: &[usize],
    demands: &[Demand],
    shape: &NodeShape,
    seqs: &[Vec<u32>],
    max_gpus: u32,
    max_states: usize,
) -> Result<Option<OnlineFigures>, FragError> {
    if shape.gpus > max_gpus {
        return Ok(None);
    }
    let run = |dp: &mut OnlineOptimum| -> Result<Vec<u32>, FragError> {
        seqs.iter()
            .map(|q| dp.simulate(shape, demands, q))
            .collect()
    };
    let own_budget = if shape.cpu_milli.is_some() || shape.memory_mib.is_some() {
        max_states.min(LIMITED_MAX_STATES)
    } else {
        max_states
    };
    let mut own = OnlineOptimum::new(spec, profiles, demands, shape)?.with_max_states(own_budget);
    let kinds = own.kinds();
    let unsolved = match own.solve() {
        Ok(v) => {
            let accepted = run(&mut own)?;
            return Ok(Some(OnlineFigures {
                expected: Some(v),
                accepted,
                states: own.states(),
                gpu_states: own.gpu_states(),
                kinds,
                unsolved: None,
            }));
        }
        Err(e) => e.to_string(),
    };
    drop(own);
    let geometry = NodeShape::geometry(shape.gpus);
    let none = |kinds, unsolved| {
        Ok(Some(OnlineFigures {
            expected: None,
            accepted: Vec::new(),
            states: 0,
            gpu_states: 0,
            kinds,
            unsolved: Some(unsolved),
        }))
    };
    if geometry == *shape {
        return none(kinds, unsolved);
    }
    let mut g = OnlineOptimum::new(spec, profiles, demands, &geometry)?.with_max_states(max_states);
    if g.solve().is_err() {
        return none(kinds, unsolved);
    }
    let accepted = run(&mut g)?;
    Ok(Some(OnlineFigures {
        expected: None,
        accepted,
        states: g.states(),
        gpu_states: g.gpu_states(),
        kinds,
        unsolved: Some(unsolved),
    }))
}

/// Mean and standard error of the mean of `xs`.
#[must_use]
pub fn mean_se(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    if xs.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let m = xs.iter().sum::<f64>() / n;
    if xs.len() < 2 {
        return (m, f64::NAN);
    }
    let var = xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (n - 1.0);
    (m, (var / n).sqrt())
}

fn mask(start: u8, size: u8) -> u16 {
    (((1u32 << size) - 1) << start) as u16
}

fn permute(m: u16, perm: &[u8]) -> u16 {
    perm.iter()
        .enumerate()
        .filter(|&(i, _)| m >> i & 1 == 1)
        .fold(0, |acc, (_, &j)| acc | 1 << j)
}

/// Every permutation of `n` memory slices (none past 8: the identity only)
/// that maps each profile's set of placement masks onto itself.
fn automorphisms(n: u8, placements: &[Vec<(u16, u8)>]) -> Vec<Vec<u8>> {
    let identity: Vec<u8> = (0..n).collect();
    if n > 8 {
        return vec![identity];
    }
    let sets: Vec<Vec<u16>> = placements
        .iter()
        .filter(|p| !p.is_empty())
        .map(|p| {
            let mut v: Vec<u16> = p.iter().map(|&(m, _)| m).collect();
            v.sort_unstable();
            v
        })
        .collect();
    let mut out = Vec::new();
    let mut perm = identity.clone();
    // Heap's algorithm over every permutation.
    fn heap(k: usize, perm: &mut Vec<u8>, sets: &[Vec<u16>], out: &mut Vec<Vec<u8>>) {
        if k <= 1 {
            let ok = sets.iter().all(|set| {
                let mut img: Vec<u16> = set.iter().map(|&m| permute(m, perm)).collect();
                img.sort_unstable();
                img == *set
            });
            if ok {
                out.push(perm.clone());
            }
            return;
        }
        for i in 0..k {
            heap(k - 1, perm, sets, out);
            let j = if k.is_multiple_of(2) { i } else { 0 };
            perm.swap(j, k - 1);
        }
    }
    heap(n as usize, &mut perm, &sets, &mut out);
    // The identity first (it is always there).
    out.retain(|p| *p != identity);
    out.insert(0, identity);
    out
}

/// The most compute disjoint placements within the free slices `free`
/// could take, at most `compute`.
fn max_fit(placements: &[Vec<(u16, u8)>], free: u16, compute: u8) -> u8 {
    let all: Vec<(u16, u8)> = placements
        .iter()
        .flatten()
        .copied()
        .filter(|&(m, _)| m & !free == 0)
        .collect();
    fn go(all: &[(u16, u8)], used: u16) -> u32 {
        match all.split_first() {
            None => 0,
            Some((&(m, c), rest)) => {
                let skip = go(rest, used);
                if m & used == 0 {
                    skip.max(u32::from(c) + go(rest, used | m))
                } else {
                    skip
                }
            }
        }
    }
    go(&all, 0).min(u32::from(compute)) as u8
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_tasks::{h100, task, tracked};

    use crate::rng::SplitMix64;
    use crate::sim::draw_sequence;

    fn cpu_only(cpu_milli: u64) -> Demand {
        Demand {
            cpu_milli,
            memory_mib: 1,
            profile: None,
            count: 0,
            compute_slices: 0,
            memory_slices: 0,
            requested_milli: 0,
            class: 0,
            models: u64::MAX,
        }
    }

    fn dp(s: &GpuSpec, demands: &[Demand], shape: &NodeShape) -> OnlineOptimum {
        OnlineOptimum::new(s, &tracked(s), demands, shape).unwrap()
    }

    /// One H100, 3g or 4g with probability ½ each, until 7 slices arrived.
    /// By hand: a first 4g takes slice 0 (its only home), then a 3g fits
    /// beside it (½ · 3): 5.5. A first 3g goes to slice 4 (at 0 it would
    /// block the 4g); then a 3g fits (3, and the GPU is full) or a 4g fits
    /// (4): 3 + 3.5 = 6.5. V = (5.5 + 6.5) / 2 = 6.
    #[test]
    fn the_value_of_a_hand_checked_case() {
        let s = h100();
        let d = [task(&s, "3g.40gb", 1, 1), task(&s, "4g.40gb", 1, 1)];
        let v = dp(&s, &d, &NodeShape::geometry(1)).solve().unwrap();
        assert!((v - 6.0).abs() < 1e-12, "{v}");
        // A CPU-only row is a self-loop on a geometry-only shape: the same
        // value, whatever its share (here ⅓ of the rows).
        let d3 = [d[0], d[1], cpu_only(5)];
        let v3 = dp(&s, &d3, &NodeShape::geometry(1)).solve().unwrap();
        assert!((v3 - 6.0).abs() < 1e-12, "{v3}");
    }

    /// One H100, 1g or 7g with probability ½ each. A 7g on an empty GPU
    /// ends the run with 7; a first 1g means the 7g never fits again, so
    /// only 1g's count: with a 1g the GPU takes 1g's until 7 slices arrived.
    /// V = ½·7 + ½·(1 + W(1)), W(a) = ½·(1 + W(a+1)) + ½·0 (a 7g arrives and
    /// is lost, ending the run), W(7) = 0: W(6) = ½, W(5) = ¾, W(4) = ⅞,
    /// W(3) = 15/16, W(2) = 31/32, W(1) = 63/64. V = 3.5 + ½·127/64.
    #[test]
    fn the_value_of_a_second_hand_checked_case() {
        let s = h100();
        let d = [task(&s, "1g.10gb", 1, 1), task(&s, "7g.80gb", 1, 1)];
        let v = dp(&s, &d, &NodeShape::geometry(1)).solve().unwrap();
        let want = 3.5 + 0.5 * 127.0 / 64.0;
        assert!((v - want).abs() < 1e-12, "{v} vs {want}");
    }

    /// Every sequence of a small distribution with its probability, until
    /// `cap` compute arrived (as `draw_sequence` stops).
    fn enumerate(demands: &[Demand], cap: u32) -> Vec<(f64, Vec<u32>)> {
        fn go(
            d: &[Demand],
            cap: u32,
            a: u32,
            p: f64,
            seq: &mut Vec<u32>,
            out: &mut Vec<(f64, Vec<u32>)>,
        ) {
            if a >= cap {
                out.push((p, seq.clone()));
                return;
            }
            for i in 0..d.len() {
                seq.push(i as u32);
                go(
                    d,
                    cap,
                    a + d[i].compute_slices,
                    p / d.len() as f64,
                    seq,
                    out,
                );
                seq.pop();
            }
        }
        let mut out = Vec::new();
        go(demands, cap, 0, 1.0, &mut Vec::new(), &mut out);
        out
    }

    /// On random small distributions without CPU-only rows, over every
    /// sequence exactly: the DP's value is the expectation of its own
    /// policy; its policy never beats the clairvoyant optimum on any
    /// sequence; the expected clairvoyant optimum is at least the DP's value,
    /// and every simple online policy (first fit in a few fixed orders) is at
    /// most it. At least one case shows a strict clairvoyance gap.
    #[test]
    fn the_online_optimum_sits_between_every_policy_and_the_clairvoyant_one() {
        let s = h100();
        let names = ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"];
        let mut rng = SplitMix64::new(11);
        let mut strict = 0;
        let mut search = NodeOptimum::new(&s, &tracked(&s)).unwrap();
        for case in 0..24 {
            let gpus = 1 + (case % 2) as u32;
            let n = 2 + rng.below(2) as usize;
            let mut d: Vec<Demand> = Vec::new();
            while d.len() < n {
                // No 1g on two GPUs: the enumeration stays small.
                let k = if gpus > 1 {
                    1 + rng.below(5) as usize
                } else {
                    rng.below(5) as usize
                };
                let t = if k == 5 {
                    task(&s, "7g.80gb", 2, 1)
                } else {
                    task(&s, names[k], 1, 1)
                };
                if !d.contains(&t) {
                    d.push(t);
                }
            }
            let shape = NodeShape::geometry(gpus);
            let mut o = dp(&s, &d, &shape);
            let v = o.solve().unwrap();
            let seqs = enumerate(&d, o.capacity());
            let (mut own, mut clair) = (0.0, 0.0);
            let mut fixed = [0.0f64; 3];
            for (p, seq) in &seqs {
                let got = o.simulate(&shape, &d, seq).unwrap();
                let best = search.solve(&shape, &d, seq).unwrap();
                assert!(got <= best, "case {case}: {got} > {best} on {seq:?}");
                own += p * f64::from(got);
                clair += p * f64::from(best);
                for (k, f) in fixed.iter_mut().enumerate() {
                    *f += p * f64::from(first_fit(&s, gpus, &d, seq, k));
                }
            }
            assert!(
                (own - v).abs() < 1e-9,
                "case {case}: policy {own} vs DP {v}"
            );
            assert!(clair >= v - 1e-9, "case {case}: {clair} < {v}");
            for f in fixed {
                assert!(f <= v + 1e-9, "case {case}: a fixed order {f} > {v}");
            }
            if clair > v + 1e-9 {
                strict += 1;
            }
        }
        assert!(strict > 0, "no case separates online and clairvoyant");
    }

    /// First fit over GPUs in index order and a profile's placements in
    /// order `k`: 0 ascending, 1 descending, 2 rotated by one.
    fn first_fit(s: &GpuSpec, gpus: u32, d: &[Demand], seq: &[u32], k: usize) -> u32 {
        let mut g = vec![Gpu { used: 0, mask: 0 }; gpus as usize];
        let full = mask(0, s.memory_slices);
        let mut acc = 0;
        'task: for &i in seq {
            let t = d[i as usize];
            let p = t.profile.unwrap();
            let pr = &s.profiles[p];
            if t.count > 1 {
                let empty: Vec<usize> = (0..g.len()).filter(|&x| g[x].mask == 0).collect();
                if empty.len() >= t.count as usize {
                    for &x in empty.iter().take(t.count as usize) {
                        g[x] = Gpu {
                            used: s.compute_slices,
                            mask: full,
                        };
                    }
                    acc += t.compute_slices;
                }
                continue;
            }
            let mut pls: Vec<u8> = pr.placements.iter().map(|pl| pl.start).collect();
            match k {
                1 => pls.reverse(),
                2 => pls.rotate_left(1),
                _ => {}
            }
            for x in &mut g {
                for &st in &pls {
                    let m = mask(st, pr.memory_slices);
                    if x.mask & m == 0 && x.used + pr.compute_slices <= s.compute_slices {
                        x.mask |= m;
                        x.used += pr.compute_slices;
                        acc += t.compute_slices;
                        continue 'task;
                    }
                }
            }
        }
        acc
    }

    /// The H100's placement structure has 16 automorphisms (swap slices 0
    /// and 1, 2 and 3, 4 and 5, the pairs {0,1} and {2,3}), and the 153
    /// reachable GPU states fall into fewer canonical ones; a 1g at slice 0
    /// or 1 is the same state, one at slice 6 is not.
    #[test]
    fn gpu_states_are_canonical_under_the_placement_symmetries() {
        let s = h100();
        let d = [task(&s, "1g.10gb", 1, 1)];
        let o = dp(&s, &d, &NodeShape::geometry(1));
        assert_eq!(o.automorphisms.len(), 16);
        let g = |used, mask| o.canonical(Gpu { used, mask });
        assert_eq!(g(1, 0b1), g(1, 0b10));
        assert_eq!(g(1, 0b1), g(1, 0b1000));
        assert_ne!(g(1, 0b1), g(1, 0b100_0000));
        // 3g or 4g at slice 0: slices 4..8 can take 3 more slices either way.
        assert_eq!(g(3, 0x0F), g(4, 0x0F));
        // 3g + 3g and 7 × 1g: nothing fits any more.
        assert_eq!(g(6, 0xFF), g(7, 0x7F));
        assert_eq!(max_fit(&o.placements, 0xF0, 7), 3);
        assert_eq!(max_fit(&o.placements, 0xFF, 7), 7);
        // Every tracked profile on one GPU: 41 canonical states are reached
        // (of 153 raw ones).
        let all: Vec<Demand> = ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
            .iter()
            .map(|n| task(&s, n, 1, 1))
            .collect();
        let mut one = dp(&s, &all, &NodeShape::geometry(1));
        one.solve().unwrap();
        assert_eq!(one.gpu_states(), 41);
        let mut raw = dp(&s, &all, &NodeShape::geometry(1));
        raw.canonicalise = false;
        raw.solve().unwrap();
        assert_eq!(raw.gpu_states(), 153);
    }

    /// The canonical form changes no value: raw GPU states give the same
    /// expectations on random small distributions, with more states.
    #[test]
    fn the_canonical_form_is_exact() {
        let s = h100();
        let names = ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"];
        let mut rng = SplitMix64::new(5);
        for case in 0..12 {
            let gpus = 1 + (case % 2) as u32;
            let d: Vec<Demand> = (0..4)
                .map(|_| task(&s, names[rng.below(5) as usize], 1, 1))
                .chain([task(&s, "7g.80gb", 2, 1)])
                .collect();
            let shape = NodeShape::geometry(gpus);
            let mut a = dp(&s, &d, &shape);
            let mut b = dp(&s, &d, &shape);
            b.canonicalise = false;
            let (va, vb) = (a.solve().unwrap(), b.solve().unwrap());
            assert!((va - vb).abs() < 1e-9, "case {case}: {va} vs {vb}");
            assert!(a.states() <= b.states());
        }
    }

    /// On a limited shape the CPU counts: a 1g taking 8 of 10 cores or a
    /// 7g taking 4, ½ each, one GPU. A first 1g fits and blocks both the
    /// CPU and the GPU for a 7g; then only 1g's could come but they need 8
    /// more cores: 1. A first 7g: 7. V = 4; the same on geometry-only is
    /// 3.5 + ½ · 127/64.
    #[test]
    fn cpu_and_ram_enter_the_state_on_a_limited_shape() {
        let s = h100();
        let d = [task(&s, "1g.10gb", 1, 8000), task(&s, "7g.80gb", 1, 4000)];
        let shape = NodeShape::limited(1, 10_000, 1 << 20);
        let mut o = dp(&s, &d, &shape);
        let v = o.solve().unwrap();
        assert!((v - 4.0).abs() < 1e-12, "{v}");
        // Its policy on enumerated sequences has the same expectation.
        let mut own = 0.0;
        for (p, seq) in enumerate(&d, 7) {
            own += p * f64::from(o.simulate(&shape, &d, &seq).unwrap());
        }
        assert!((own - 4.0).abs() < 1e-12, "{own}");
        // CPU-only rows that fit move the state (they use cores).
        let d2 = [d[0], d[1], cpu_only(7000)];
        let v2 = dp(&s, &d2, &shape).solve().unwrap();
        assert!(v2 < v, "{v2} vs {v}");
    }

    /// On sampled sequences (as the reference draws them) the DP's policy
    /// never beats the clairvoyant optimum, and the budget stops a run.
    #[test]
    fn sampled_sequences_and_the_state_budget() {
        let s = h100();
        let d = [
            task(&s, "1g.10gb", 1, 1),
            task(&s, "2g.20gb", 1, 1),
            task(&s, "3g.40gb", 1, 1),
            task(&s, "4g.40gb", 1, 1),
            task(&s, "7g.80gb", 1, 1),
            task(&s, "7g.80gb", 2, 1),
            cpu_only(1),
        ];
        let shape = NodeShape::geometry(2);
        let mut o = dp(&s, &d, &shape);
        o.solve().unwrap();
        let mut search = NodeOptimum::new(&s, &tracked(&s)).unwrap();
        for seed in 1..40 {
            let seq = draw_sequence(&d, seed, 14, 100);
            let got = o.simulate(&shape, &d, &seq).unwrap();
            assert!(got <= search.solve(&shape, &d, &seq).unwrap());
        }
        let e = dp(&s, &d, &NodeShape::geometry(4))
            .with_max_states(50)
            .solve()
            .unwrap_err();
        assert!(e.to_string().contains("more than 50 states"), "{e}");
        assert!(o.simulate(&NodeShape::geometry(3), &d, &[]).is_err());
    }
}
