//! The allocator: the structured-parameters algorithm of kube-scheduler, offline.
//!
//! Behaviour taken from `k8s.io/dynamic-resource-allocation/structured`
//! (`internal/incubating/allocator_incubating.go`, `pools_incubating.go`,
//! `consumable_capacity.go`, kubernetes/kubernetes master, 2026):
//! - requests are allocated in claim order, devices of a request in pool order,
//!   then slice order, then device order; the first complete solution wins, with
//!   backtracking over earlier picks; within one request only combinations (not
//!   permutations) are tried;
//! - a device is checked for: in use (exclusively), class then request
//!   selectors, capacity requests, shared counters, taints, constraints;
//! - `firstAvailable` subrequests are tried in order; `All` takes every
//!   selectable device and fails if one of them cannot be taken or a pool of
//!   the node is incomplete or invalid;
//! - counters of a multi-allocatable device are checked and charged only when
//!   it has no share yet (`skipCounterCheck` in `allocateDevice`), and committed
//!   devices are charged once per device however many shares they have
//!   (`checkAvailableCounters`);
//! - consumed capacity is recorded for multi-allocatable devices only, with
//!   every capacity of the device (rounded by its requestPolicy, the default or
//!   the full value when not requested).
//!
//! Differences: Go iterates pools from a map, here pools are sorted by driver
//! and pool name; a claim config naming several requests is copied once (the
//! Go loop may append it once per matching request); the counters of a
//! multi-allocatable device are released when its last share of an attempt is
//! backtracked.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::rc::Rc;

use carve_model::names::DeviceName;
use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};
use k8s_openapi::api::resource::v1::{
    AllocationResult, Device, DeviceAllocationConfiguration, DeviceAllocationResult,
    DeviceAttribute, DeviceClass, DeviceRequestAllocationResult, DeviceSelector, DeviceToleration,
    ResourceClaim, ResourceSlice,
};
use sha2::{Digest, Sha256};

use crate::celenv::{CEL_COST_LIMIT, CEL_MAX_LENGTH, CelEnv, CompileFailure, Compiled, DeviceView};
use crate::error::AllocError;
use crate::explain::{
    Explanation, PoolNote, Reason, Rejection, Release, RequestExplanation, SliceRange, Suggestion,
};
use crate::inventory::{self, DevInfo, Policy, Pool, SliceInfo, qualify};
use crate::quantity::Qty;

/// Most devices one claim may get (`AllocationResultsMaxSize`).
pub const MAX_RESULTS: usize = 32;
/// Search steps after which a claim is reported as not fitting.
const MAX_STEPS: u64 = 2_000_000;
/// Release sets tried per device before settling for an irreducible (not
/// necessarily smallest) one.
const MAX_SUGGEST_CHECKS: usize = 512;
/// Release sets tried for all devices of one explanation; devices after that
/// get no suggestion (the explanation says so).
const MAX_SUGGEST_TOTAL: usize = 8192;

/// Advances `comb` (strictly increasing indices below `n`) to the next
/// combination of the same size in lexicographic order; false after the last.
pub(crate) fn next_combination(comb: &mut [usize], n: usize) -> bool {
    let k = comb.len();
    for i in (0..k).rev() {
        if comb[i] < n - k + i {
            comb[i] += 1;
            for j in i + 1..k {
                comb[j] = comb[j - 1] + 1;
            }
            return true;
        }
    }
    false
}

/// Everything the allocator looks at.
#[derive(Debug, Clone, Default)]
pub struct Inputs {
    /// ResourceSlices of all nodes.
    pub slices: Vec<ResourceSlice>,
    /// DeviceClasses.
    pub classes: Vec<DeviceClass>,
    /// Claims that already have `status.allocation`.
    pub claims_allocated: Vec<ResourceClaim>,
}

pub(crate) type DevKey = (String, String, String);
/// (blocking counters + wanted devices held, counters of wanted devices held).
pub(crate) type BlockScore = (usize, usize);

pub(crate) fn claim_ref(c: &ResourceClaim) -> String {
    format!(
        "{}/{}",
        c.metadata.namespace.as_deref().unwrap_or("default"),
        c.metadata.name.as_deref().unwrap_or("")
    )
}

/// Offline allocator over a fixed set of slices and classes, and a growing set of
/// allocated claims.
#[derive(Debug)]
pub struct Allocator<'a> {
    slices: &'a [ResourceSlice],
    parsed: Vec<SliceInfo>,
    classes: HashMap<&'a str, &'a DeviceClass>,
    committed: Vec<ResourceClaim>,
    cel: CelEnv,
}

/// A device reachable from the node.
#[derive(Debug, Clone)]
struct Cand {
    pool: usize,
    slice: usize,
    dev: usize,
    key: DevKey,
}

#[derive(Debug, Default)]
struct Committed {
    exclusive: HashMap<DevKey, Vec<String>>,
    /// Consumed capacity by `domain/id`, holders (one per share).
    shared: HashMap<DevKey, (BTreeMap<String, Qty>, Vec<String>)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Count(usize),
    All,
}

#[derive(Debug)]
struct Req<'c> {
    id: usize,
    full: String,
    base: String,
    class_name: String,
    class: &'c DeviceClass,
    class_sels: Vec<(String, Rc<Compiled>)>,
    req_sels: Vec<(String, Rc<Compiled>)>,
    mode: Mode,
    capacity: Vec<(String, Qty)>,
    admin: bool,
    tolerations: Vec<DeviceToleration>,
}

#[derive(Debug)]
enum Entry<'c> {
    One(Req<'c>),
    First(Vec<Req<'c>>),
}

#[derive(Debug, Clone, PartialEq)]
enum AttrVal {
    Bool(bool),
    Int(i64),
    Str(String),
    Version(String),
    List(String),
}

fn attr_val(a: &DeviceAttribute) -> Option<AttrVal> {
    if let Some(b) = a.bool {
        return Some(AttrVal::Bool(b));
    }
    if let Some(i) = a.int {
        return Some(AttrVal::Int(i));
    }
    if let Some(s) = &a.string {
        return Some(AttrVal::Str(s.clone()));
    }
    if let Some(v) = &a.version {
        return Some(AttrVal::Version(v.clone()));
    }
    if a.bools.is_some() || a.ints.is_some() || a.strings.is_some() || a.versions.is_some() {
        return Some(AttrVal::List(format!(
            "{:?}{:?}{:?}{:?}",
            a.bools, a.ints, a.strings, a.versions
        )));
    }
    None
}

/// Looks a fully-qualified attribute name up on a device: the exact key, or the
/// bare identifier when the domain is the driver's.
fn lookup_attr(d: &Device, driver: &str, name: &str) -> Option<AttrVal> {
    let attrs = d.attributes.as_ref()?;
    if let Some(a) = attrs.get(name) {
        return attr_val(a);
    }
    let (domain, id) = name.split_once('/')?;
    if domain != driver {
        return None;
    }
    attrs.get(id).and_then(attr_val)
}

#[derive(Debug)]
struct ConstraintState {
    requests: Vec<String>,
    attr: String,
    distinct: bool,
    values: Vec<AttrVal>,
}

impl ConstraintState {
    fn applies(&self, r: &Req<'_>) -> bool {
        self.requests.is_empty()
            || self.requests.contains(&r.base)
            || self.requests.contains(&r.full)
    }

    fn add(&mut self, r: &Req<'_>, d: &Device, driver: &str) -> bool {
        if !self.applies(r) {
            return true;
        }
        let Some(v) = lookup_attr(d, driver, &self.attr) else {
            return false;
        };
        let ok = if self.distinct {
            !self.values.contains(&v)
        } else {
            self.values.first().is_none_or(|f| *f == v)
        };
        if ok {
            self.values.push(v);
        }
        ok
    }

    fn remove(&mut self, r: &Req<'_>) {
        if self.applies(r) {
            self.values.pop();
        }
    }
}

#[derive(Debug)]
struct Picked {
    request: String,
    cand: usize,
    share_id: Option<String>,
    consumed: Option<BTreeMap<String, Qty>>,
    admin: bool,
    tolerations: Vec<DeviceToleration>,
}

#[derive(Debug, Default)]
struct SharedAlloc {
    count: usize,
    consumed: BTreeMap<String, Qty>,
}

#[derive(Debug)]
struct Undo {
    cand: usize,
    charged: bool,
    multi: bool,
    consumed_fq: BTreeMap<String, Qty>,
}

/// Why a capacity request does not fit.
#[derive(Debug)]
struct CapFail {
    capacity: String,
    requested: Option<Qty>,
    consumed: Option<Qty>,
    remaining: Qty,
    detail: String,
}

fn policy_consumed(requested: Option<Qty>, value: Qty, policy: Option<&Policy>) -> Qty {
    let Some(req) = requested else {
        return policy.and_then(|p| p.default).unwrap_or(value);
    };
    let Some(p) = policy else {
        return req;
    };
    if let Some((min, _max, step)) = p.range {
        return match step {
            Some(step) => req.round_up_to_step(min, step),
            None => req.max(min),
        };
    }
    if let Some(values) = &p.valid_values {
        let mut sorted = values.clone();
        sorted.sort();
        return sorted.into_iter().find(|v| *v >= req).unwrap_or(req);
    }
    req
}

fn policy_violation(q: Qty, policy: Option<&Policy>) -> Option<String> {
    let p = policy?;
    if let Some((min, max, step)) = p.range {
        if q < min {
            return Some(format!("below validRange.min {min}"));
        }
        if let Some(max) = max
            && q > max
        {
            return Some(format!("above validRange.max {max}"));
        }
        if let Some(step) = step
            && step.nanos() > 0
            && (q.nanos() - min.nanos()) % step.nanos() != 0
        {
            return Some(format!("not min {min} plus a multiple of step {step}"));
        }
        return None;
    }
    if let Some(values) = &p.valid_values
        && !values.contains(&q)
    {
        let list: Vec<String> = values.iter().map(Qty::to_string).collect();
        return Some(format!("above every validValue [{}]", list.join(", ")));
    }
    None
}

fn taint_blocks(d: &Device, tolerations: &[DeviceToleration]) -> Option<Reason> {
    for t in d.taints.iter().flatten() {
        if t.effect != "NoSchedule" && t.effect != "NoExecute" {
            continue;
        }
        let tolerated = tolerations.iter().any(|tol| {
            let op = tol.operator.as_deref().unwrap_or("Equal");
            let key_ok = match tol.key.as_deref() {
                None | Some("") => op == "Exists",
                Some(k) => k == t.key,
            };
            let value_ok = op == "Exists"
                || tol.value.as_deref().unwrap_or("") == t.value.as_deref().unwrap_or("");
            let effect_ok = tol
                .effect
                .as_deref()
                .is_none_or(|e| e.is_empty() || e == t.effect);
            key_ok && value_ok && effect_ok
        });
        if !tolerated {
            return Some(Reason::Taint {
                key: t.key.clone(),
                value: t.value.clone(),
                effect: t.effect.clone(),
            });
        }
    }
    None
}

fn share_id(claim: &ResourceClaim, request: &str, key: &DevKey, ordinal: usize) -> String {
    let mut h = Sha256::new();
    for part in [
        claim.metadata.uid.as_deref().unwrap_or(""),
        &claim_ref(claim),
        request,
        &key.0,
        &key.1,
        &key.2,
        &ordinal.to_string(),
    ] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    let d = h.finalize();
    let mut b = [0u8; 16];
    b.copy_from_slice(&d[..16]);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// The per-claim setup shared by allocation and explanation.
#[derive(Debug)]
struct Setup<'c> {
    pools: Vec<Pool>,
    cands: Vec<Cand>,
    entries: Vec<Entry<'c>>,
    view: View,
}

/// What the committed claims hold on a node's pools.
#[derive(Debug)]
struct View {
    committed: Committed,
    /// Per pool: counter set → counter → consumed by committed devices.
    committed_counters: Vec<BTreeMap<String, BTreeMap<String, Qty>>>,
    /// Per pool: (set, counter) → claims holding devices that consume it.
    counter_holders: Vec<HashMap<(String, String), Vec<String>>>,
}

impl<'a> Allocator<'a> {
    /// Parses the slices and indexes the classes; commits the already allocated
    /// claims of `inputs`.
    pub fn new(inputs: &'a Inputs) -> Result<Allocator<'a>, AllocError> {
        let parsed = inputs
            .slices
            .iter()
            .map(inventory::parse_slice)
            .collect::<Result<_, _>>()?;
        let classes = inputs
            .classes
            .iter()
            .map(|c| (c.metadata.name.as_deref().unwrap_or(""), c))
            .collect();
        let mut a = Allocator {
            slices: &inputs.slices,
            parsed,
            classes,
            committed: Vec::new(),
            cel: CelEnv::new(),
        };
        for c in &inputs.claims_allocated {
            a.commit(c.clone())?;
        }
        Ok(a)
    }

    /// Records a claim with `status.allocation` as holding its devices, so that
    /// later claims are allocated around it.
    pub fn commit(&mut self, claim: ResourceClaim) -> Result<(), AllocError> {
        if claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .is_none()
        {
            return Err(AllocError::InvalidClaim {
                claim: claim_ref(&claim),
                field: "status.allocation".into(),
                msg: "missing; only allocated claims can be committed".into(),
            });
        }
        self.committed.push(claim);
        Ok(())
    }

    /// Claims committed so far.
    pub fn committed(&self) -> &[ResourceClaim] {
        &self.committed
    }

    /// Forgets the committed claims named `namespace/name` (their devices become
    /// free) and returns them; empty when no committed claim has that name.
    pub fn release(&mut self, claim: &str) -> Vec<ResourceClaim> {
        let (gone, kept) = std::mem::take(&mut self.committed)
            .into_iter()
            .partition(|c| claim_ref(c) == claim);
        self.committed = kept;
        gone
    }

    /// Swaps the committed claims for `claims` and returns the old ones.
    pub(crate) fn replace_committed(&mut self, claims: Vec<ResourceClaim>) -> Vec<ResourceClaim> {
        std::mem::replace(&mut self.committed, claims)
    }

    /// Node names the slices mention (`spec.nodeName`, and per-device
    /// `nodeName`), sorted.
    pub fn node_names(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for s in self.slices {
            let per_device = s
                .spec
                .devices
                .iter()
                .flatten()
                .filter_map(|d| d.node_name.as_ref());
            for n in s.spec.node_name.iter().chain(per_device) {
                if !out.contains(n) {
                    out.push(n.clone());
                }
            }
        }
        out.sort();
        out
    }

    /// Per committed claim (`namespace/name`, in commit order): how many
    /// blocking counters it holds plus how many wanted devices it holds itself,
    /// and how many counters of wanted devices it holds at all. Wanted devices
    /// are those on `node` whose selectors match a request of `claim`; a
    /// blocking counter (`(pool, set, counter)`) is one a wanted device consumes
    /// and that has too little left for it. Claims scoring (0, 0) are left out.
    pub(crate) fn blocking_scores(
        &self,
        claim: &ResourceClaim,
        node: &str,
    ) -> Result<Vec<(String, BlockScore)>, AllocError> {
        let setup = self.setup(claim, node, None)?;
        let probe = Search::new(self, claim, node, &setup, &setup.view, Vec::new());
        let mut wanted_keys: HashSet<&DevKey> = HashSet::new();
        let mut wanted_counters: HashSet<(usize, &str, &str)> = HashSet::new();
        let mut touched_counters: HashSet<(usize, &str, &str)> = HashSet::new();
        for entry in &setup.entries {
            let reqs: Vec<&Req<'_>> = match entry {
                Entry::One(r) => vec![r],
                Entry::First(v) => v.iter().collect(),
            };
            for r in reqs {
                for (ci, cand) in setup.cands.iter().enumerate() {
                    if probe.first_false_selector(ci, r)?.is_some() {
                        continue;
                    }
                    wanted_keys.insert(&cand.key);
                    let (_, _, info) = self.device(cand);
                    let pool = &setup.pools[cand.pool];
                    for (set, cs) in &info.consumes {
                        for (n, q) in cs {
                            let get = |m: &BTreeMap<String, BTreeMap<String, Qty>>| {
                                m.get(set).and_then(|s| s.get(n)).copied()
                            };
                            let total = get(&pool.counters).unwrap_or(Qty::ZERO);
                            let used =
                                get(&setup.view.committed_counters[cand.pool]).unwrap_or(Qty::ZERO);
                            let short = used.checked_add(*q).is_none_or(|need| need > total);
                            if q.nanos() > 0 {
                                touched_counters.insert((cand.pool, set, n));
                                if short {
                                    wanted_counters.insert((cand.pool, set, n));
                                }
                            }
                        }
                    }
                }
            }
        }
        // (driver, pool, device) → (pool index, device info) over the node's pools.
        let mut infos: HashMap<DevKey, (usize, &DevInfo)> = HashMap::new();
        for (pi, p) in setup.pools.iter().enumerate() {
            for &si in &p.all_slices {
                for (d, info) in self.slices[si]
                    .spec
                    .devices
                    .iter()
                    .flatten()
                    .zip(&self.parsed[si].devices)
                {
                    infos.insert(
                        (p.driver.clone(), p.name.clone(), d.name.clone()),
                        (pi, info),
                    );
                }
            }
        }
        let mut out: Vec<(String, BlockScore)> = Vec::new();
        for c in &self.committed {
            let who = claim_ref(c);
            let results = c
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .and_then(|a| a.devices.as_ref())
                .and_then(|d| d.results.as_ref());
            let mut counters: HashSet<(usize, &str, &str)> = HashSet::new();
            let mut touched: HashSet<(usize, &str, &str)> = HashSet::new();
            let mut devices = 0;
            for r in results.into_iter().flatten() {
                if r.admin_access == Some(true) {
                    continue;
                }
                let key = (r.driver.clone(), r.pool.clone(), r.device.clone());
                if wanted_keys.contains(&key) {
                    devices += 1;
                }
                if let Some((pi, info)) = infos.get(&key) {
                    for (set, cs) in &info.consumes {
                        for (n, q) in cs {
                            let k = (*pi, set.as_str(), n.as_str());
                            if q.nanos() > 0 && wanted_counters.contains(&k) {
                                counters.insert(k);
                            }
                            if q.nanos() > 0 && touched_counters.contains(&k) {
                                touched.insert(k);
                            }
                        }
                    }
                }
            }
            let score = (counters.len() + devices, touched.len());
            if score == (0, 0) {
                continue;
            }
            match out.iter_mut().find(|(w, _)| *w == who) {
                Some(e) => {
                    e.1.0 += score.0;
                    e.1.1 += score.1;
                }
                None => out.push((who, score)),
            }
        }
        Ok(out)
    }

    /// Allocates `claim` on `node` and commits the result (a copy of the claim
    /// with `status.allocation` set); returns the allocation.
    pub fn allocate_and_commit(
        &mut self,
        claim: &ResourceClaim,
        node: &str,
    ) -> Result<AllocationResult, AllocError> {
        let result = self.allocate(claim, node)?;
        let mut c = claim.clone();
        c.status.get_or_insert_with(Default::default).allocation = Some(result.clone());
        self.commit(c)?;
        Ok(result)
    }

    /// Allocates `claim` on `node` as kube-scheduler would, without committing.
    pub fn allocate(
        &self,
        claim: &ResourceClaim,
        node: &str,
    ) -> Result<AllocationResult, AllocError> {
        self.allocate_among(claim, node, None)
    }

    /// [`Allocator::allocate`] with the node's devices limited to `only`
    /// (`(driver, pool, device)` keys) when given.
    pub(crate) fn allocate_among(
        &self,
        claim: &ResourceClaim,
        node: &str,
        only: Option<&HashSet<DevKey>>,
    ) -> Result<AllocationResult, AllocError> {
        let setup = self.setup(claim, node, only)?;
        let (found, stopped) = self.search(claim, node, &setup, Counting::Exact)?;
        if let Some(r) = found {
            return Ok(r);
        }
        let mut e = self.explain_with(claim, node, &setup)?;
        if stopped {
            e.combination.push(format!(
                "search stopped after {MAX_STEPS} steps without a fit"
            ));
        }
        Err(AllocError::Unsatisfiable(Box::new(e)))
    }

    /// [`Allocator::allocate`] without the explanation when the claim does
    /// not fit (`Ok(None)`): the same search, for callers that only need the
    /// outcome.
    pub fn allocate_if_fits(
        &self,
        claim: &ResourceClaim,
        node: &str,
    ) -> Result<Option<AllocationResult>, AllocError> {
        self.try_allocate(claim, node, None)
    }

    /// Like [`Allocator::allocate_among`] but without an explanation when the
    /// claim does not fit (`Ok(None)`).
    pub(crate) fn try_allocate(
        &self,
        claim: &ResourceClaim,
        node: &str,
        only: Option<&HashSet<DevKey>>,
    ) -> Result<Option<AllocationResult>, AllocError> {
        let setup = self.setup(claim, node, only)?;
        Ok(self.search(claim, node, &setup, Counting::Exact)?.0)
    }

    /// True when `claim` fits on `node` but kube-scheduler's allocator before
    /// the fix of kubernetes/kubernetes#140436 (through 1.36.2; 1.36.3 and
    /// 1.37 roll rejected candidates' counters back, as the upstream
    /// allocator shows in e2e/tests/upstream_allocator.rs) would refuse it: that
    /// allocator keeps the shared counters of a candidate it rejects on a
    /// device taint or a `matchAttribute`/`distinctAttribute` constraint, and
    /// of an allow-multiple device it backtracks from, so later candidates of
    /// the same counter set look exhausted. Found by running the same search
    /// with those leaks.
    pub fn refused_by_upstream_counter_leak(
        &self,
        claim: &ResourceClaim,
        node: &str,
    ) -> Result<bool, AllocError> {
        let setup = self.setup(claim, node, None)?;
        let (exact, _) = self.search(claim, node, &setup, Counting::Exact)?;
        if exact.is_none() {
            return Ok(false);
        }
        let (leaky, stopped) = self.search(claim, node, &setup, Counting::UpstreamCounterLeak)?;
        Ok(leaky.is_none() && !stopped)
    }

    /// The backtracking search; the result, and whether it hit the step limit.
    fn search(
        &self,
        claim: &ResourceClaim,
        node: &str,
        setup: &Setup<'_>,
        counting: Counting,
    ) -> Result<(Option<AllocationResult>, bool), AllocError> {
        let constraints = claim_constraints(claim)?;
        let mut s = Search::new(self, claim, node, setup, &setup.view, constraints);
        s.counting = counting;
        if s.request(0)? {
            return Ok((Some(s.build_result()), false));
        }
        Ok((None, s.steps >= MAX_STEPS))
    }

    /// Says, per request and device, why `claim` does not fit on `node` now.
    pub fn explain(&self, claim: &ResourceClaim, node: &str) -> Result<Explanation, AllocError> {
        let setup = self.setup(claim, node, None)?;
        self.explain_with(claim, node, &setup)
    }

    fn device(&self, c: &Cand) -> (&'a ResourceSlice, &'a Device, &DevInfo) {
        let s = &self.slices[c.slice];
        let d = &s
            .spec
            .devices
            .as_ref()
            .expect("candidate slices have devices")[c.dev];
        (s, d, &self.parsed[c.slice].devices[c.dev])
    }

    fn committed_state(&self, released: &HashSet<String>) -> Committed {
        let mut st = Committed::default();
        for claim in &self.committed {
            let who = claim_ref(claim);
            if released.contains(&who) {
                continue;
            }
            let results = claim
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .and_then(|a| a.devices.as_ref())
                .and_then(|d| d.results.as_ref());
            for r in results.into_iter().flatten() {
                let key = (r.driver.clone(), r.pool.clone(), r.device.clone());
                if r.share_id.is_some() {
                    let e = st.shared.entry(key).or_default();
                    for (name, q) in r.consumed_capacity.iter().flatten() {
                        if let Ok(q) = Qty::from_quantity(q) {
                            let slot = e.0.entry(qualify(name, &r.driver)).or_insert(Qty::ZERO);
                            *slot = slot.checked_add(q).unwrap_or(*slot);
                        }
                    }
                    e.1.push(who.clone());
                } else if r.admin_access != Some(true) {
                    st.exclusive.entry(key).or_default().push(who.clone());
                }
            }
        }
        st
    }

    fn compile(
        &self,
        cache: &mut HashMap<String, Rc<Compiled>>,
        owner: &str,
        sels: Option<&Vec<DeviceSelector>>,
    ) -> Result<Vec<(String, Rc<Compiled>)>, AllocError> {
        let mut out = Vec::new();
        for (i, s) in sels.into_iter().flatten().enumerate() {
            let Some(cel) = &s.cel else {
                return Err(AllocError::CelCompile {
                    owner: owner.to_string(),
                    expr: String::new(),
                    msg: format!("selector #{i} has no cel expression"),
                });
            };
            let expr = &cel.expression;
            if let Some(c) = cache.get(expr) {
                out.push((expr.clone(), c.clone()));
                continue;
            }
            let c = self.cel.compile(expr).map_err(|f| match f {
                CompileFailure::TooLong(len) => AllocError::CelTooLong {
                    owner: owner.to_string(),
                    len,
                    limit: CEL_MAX_LENGTH,
                },
                CompileFailure::Syntax(msg) => AllocError::CelCompile {
                    owner: owner.to_string(),
                    expr: expr.clone(),
                    msg,
                },
                CompileFailure::TooCostly(cost) => AllocError::CelTooCostly {
                    owner: owner.to_string(),
                    expr: expr.clone(),
                    cost,
                    limit: CEL_COST_LIMIT,
                },
            })?;
            let c = Rc::new(c);
            cache.insert(expr.clone(), c.clone());
            out.push((expr.clone(), c));
        }
        Ok(out)
    }

    /// What the committed claims, less `released`, hold on `pools`.
    fn view(&self, pools: &[Pool], released: &HashSet<String>) -> View {
        let committed = self.committed_state(released);
        let mut committed_counters = vec![BTreeMap::new(); pools.len()];
        let mut counter_holders = vec![HashMap::new(); pools.len()];
        for (pi, p) in pools.iter().enumerate() {
            let used: &mut BTreeMap<String, BTreeMap<String, Qty>> = &mut committed_counters[pi];
            let holders: &mut HashMap<(String, String), Vec<String>> = &mut counter_holders[pi];
            for &si in &p.all_slices {
                for (d, info) in self.slices[si]
                    .spec
                    .devices
                    .iter()
                    .flatten()
                    .zip(&self.parsed[si].devices)
                {
                    let key = (p.driver.clone(), p.name.clone(), d.name.clone());
                    let who: Vec<String> = committed
                        .exclusive
                        .get(&key)
                        .or_else(|| committed.shared.get(&key).map(|s| &s.1))
                        .cloned()
                        .unwrap_or_default();
                    if who.is_empty() {
                        continue;
                    }
                    for (set, counters) in &info.consumes {
                        for (c, q) in counters {
                            let slot = used
                                .entry(set.clone())
                                .or_default()
                                .entry(c.clone())
                                .or_insert(Qty::ZERO);
                            *slot = slot.checked_add(*q).unwrap_or(*slot);
                            if q.nanos() > 0 {
                                let h = holders.entry((set.clone(), c.clone())).or_default();
                                for w in &who {
                                    if !h.contains(w) {
                                        h.push(w.clone());
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }

        View {
            committed,
            committed_counters,
            counter_holders,
        }
    }

    fn setup<'c>(
        &'c self,
        claim: &'c ResourceClaim,
        node: &str,
        only: Option<&HashSet<DevKey>>,
    ) -> Result<Setup<'c>, AllocError> {
        let who = claim_ref(claim);
        let pools = inventory::gather_pools(self.slices, &self.parsed, node);
        let mut cands = Vec::new();
        for (pi, p) in pools.iter().enumerate() {
            if p.usable.is_err() {
                continue;
            }
            for &si in &p.device_slices {
                let s = &self.slices[si];
                for (di, d) in s.spec.devices.iter().flatten().enumerate() {
                    let key = (p.driver.clone(), p.name.clone(), d.name.clone());
                    if only.is_some_and(|o| !o.contains(&key)) {
                        continue;
                    }
                    if inventory::device_visible(s, d, node) {
                        cands.push(Cand {
                            pool: pi,
                            slice: si,
                            dev: di,
                            key,
                        });
                    }
                }
            }
        }
        let view = self.view(&pools, &HashSet::new());

        let requests = claim
            .spec
            .devices
            .as_ref()
            .and_then(|d| d.requests.as_ref())
            .filter(|r| !r.is_empty())
            .ok_or_else(|| AllocError::InvalidClaim {
                claim: who.clone(),
                field: "spec.devices.requests".into(),
                msg: "no requests".into(),
            })?;
        let mut cache = HashMap::new();
        let mut entries = Vec::new();
        let mut next_id = 0;
        for (ri, r) in requests.iter().enumerate() {
            let field = format!("spec.devices.requests[{ri}]");
            match (&r.exactly, &r.first_available) {
                (Some(e), None) => {
                    let req = self.make_req(
                        &mut cache,
                        claim,
                        &field,
                        ReqSpec {
                            full: r.name.clone(),
                            base: r.name.clone(),
                            class: &e.device_class_name,
                            selectors: e.selectors.as_ref(),
                            mode: e.allocation_mode.as_deref(),
                            count: e.count,
                            capacity: e.capacity.as_ref().and_then(|c| c.requests.as_ref()),
                            admin: e.admin_access == Some(true),
                            tolerations: e.tolerations.clone().unwrap_or_default(),
                        },
                        next_id,
                    )?;
                    next_id += 1;
                    entries.push(Entry::One(req));
                }
                (None, Some(subs)) if !subs.is_empty() => {
                    let mut v = Vec::new();
                    for (si, sub) in subs.iter().enumerate() {
                        let req = self.make_req(
                            &mut cache,
                            claim,
                            &format!("{field}.firstAvailable[{si}]"),
                            ReqSpec {
                                full: format!("{}/{}", r.name, sub.name),
                                base: r.name.clone(),
                                class: &sub.device_class_name,
                                selectors: sub.selectors.as_ref(),
                                mode: sub.allocation_mode.as_deref(),
                                count: sub.count,
                                capacity: sub.capacity.as_ref().and_then(|c| c.requests.as_ref()),
                                admin: false,
                                tolerations: sub.tolerations.clone().unwrap_or_default(),
                            },
                            next_id,
                        )?;
                        next_id += 1;
                        v.push(req);
                    }
                    entries.push(Entry::First(v));
                }
                _ => {
                    return Err(AllocError::InvalidClaim {
                        claim: who,
                        field,
                        msg: "exactly one of exactly and firstAvailable (non-empty) must be set"
                            .into(),
                    });
                }
            }
        }
        Ok(Setup {
            pools,
            cands,
            entries,
            view,
        })
    }

    fn make_req<'c>(
        &'c self,
        cache: &mut HashMap<String, Rc<Compiled>>,
        claim: &ResourceClaim,
        field: &str,
        spec: ReqSpec<'_>,
        id: usize,
    ) -> Result<Req<'c>, AllocError> {
        let who = claim_ref(claim);
        let class = *self
            .classes
            .get(spec.class)
            .ok_or_else(|| AllocError::UnknownClass {
                claim: who.clone(),
                request: spec.full.clone(),
                class: spec.class.to_string(),
            })?;
        let mode = match (spec.mode, spec.count) {
            (None | Some("ExactCount"), None) => Mode::Count(1),
            (None | Some("ExactCount"), Some(n)) if (1..=MAX_RESULTS as i64).contains(&n) => {
                Mode::Count(n as usize)
            }
            (None | Some("ExactCount"), Some(n)) => {
                return Err(AllocError::InvalidClaim {
                    claim: who,
                    field: format!("{field}.count"),
                    msg: format!("{n} is not between 1 and {MAX_RESULTS}"),
                });
            }
            (Some("All"), None | Some(0)) => Mode::All,
            (Some("All"), Some(n)) => {
                return Err(AllocError::InvalidClaim {
                    claim: who,
                    field: format!("{field}.count"),
                    msg: format!("must not be set with allocationMode All (got {n})"),
                });
            }
            (Some(m), _) => {
                return Err(AllocError::InvalidClaim {
                    claim: who,
                    field: format!("{field}.allocationMode"),
                    msg: format!("unknown mode {m:?} (ExactCount or All)"),
                });
            }
        };
        let mut capacity = Vec::new();
        for (name, q) in spec.capacity.into_iter().flatten() {
            let field = format!("{field}.capacity.requests.{name}");
            let parsed = Qty::from_quantity(q).map_err(|e| AllocError::InvalidClaim {
                claim: who.clone(),
                field: field.clone(),
                msg: e.to_string(),
            })?;
            // A request is an amount of a device's capacity; Kubernetes
            // refuses one below zero (its allocator: "capacity value is
            // negative"), which would otherwise be rounded up to the
            // policy's minimum and allocated.
            if parsed < Qty::ZERO {
                return Err(AllocError::InvalidClaim {
                    claim: who.clone(),
                    field,
                    msg: format!("negative requested quantity {:?}: must be 0 or more", q.0),
                });
            }
            capacity.push((name.clone(), parsed));
        }
        let class_name = spec.class.to_string();
        let class_sels = self.compile(
            cache,
            &format!("DeviceClass {class_name}"),
            class.spec.selectors.as_ref(),
        )?;
        let req_sels = self.compile(
            cache,
            &format!("claim {who}: request {}", spec.full),
            spec.selectors,
        )?;
        Ok(Req {
            id,
            full: spec.full,
            base: spec.base,
            class_name,
            class,
            class_sels,
            req_sels,
            mode,
            capacity,
            admin: spec.admin,
            tolerations: spec.tolerations,
        })
    }

    fn explain_with(
        &self,
        claim: &ResourceClaim,
        node: &str,
        setup: &Setup<'_>,
    ) -> Result<Explanation, AllocError> {
        let probe = Search::new(self, claim, node, setup, &setup.view, Vec::new());
        let mut requests = Vec::new();
        let mut enough = Vec::new();
        let mut held: Vec<(&Req<'_>, usize)> = Vec::new();
        for entry in &setup.entries {
            let reqs: Vec<&Req<'_>> = match entry {
                Entry::One(r) => vec![r],
                Entry::First(v) => v.iter().collect(),
            };
            let mut any_enough = false;
            for r in reqs {
                let mut candidates = Vec::new();
                let mut rejected = Vec::new();
                for (ci, c) in setup.cands.iter().enumerate() {
                    let device = format!("{}/{}", c.key.1, c.key.2);
                    match probe.reject_reason(ci, r)? {
                        Some(reason) => {
                            if matches!(
                                reason,
                                Reason::InUse { .. }
                                    | Reason::Counter { .. }
                                    | Reason::Capacity { .. }
                            ) {
                                held.push((r, ci));
                            }
                            rejected.push(Rejection { device, reason });
                        }
                        None => candidates.push(device),
                    }
                }
                let wanted = match r.mode {
                    Mode::Count(n) => n.to_string(),
                    Mode::All => "All".to_string(),
                };
                let ok = match r.mode {
                    Mode::Count(n) => candidates.len() >= n,
                    Mode::All => {
                        !candidates.is_empty()
                            && rejected.iter().all(|x| {
                                !matches!(
                                    x.reason,
                                    Reason::InUse { .. }
                                        | Reason::Counter { .. }
                                        | Reason::Capacity { .. }
                                        | Reason::Taint { .. }
                                )
                            })
                    }
                };
                any_enough |= ok;
                requests.push(RequestExplanation {
                    request: r.full.clone(),
                    class: r.class_name.clone(),
                    wanted,
                    candidates,
                    rejected,
                });
            }
            enough.push(any_enough);
        }
        let unusable_pools: Vec<PoolNote> = setup
            .pools
            .iter()
            .filter_map(|p| {
                p.usable.as_ref().err().map(|reason| PoolNote {
                    pool: p.id(),
                    reason: reason.clone(),
                })
            })
            .collect();
        let mut combination = Vec::new();
        if setup.pools.is_empty() {
            combination.push(format!(
                "no ResourceSlice publishes devices for node {node}"
            ));
        }
        if enough.iter().all(|e| *e) && !setup.entries.is_empty() {
            let constraints = claim
                .spec
                .devices
                .as_ref()
                .and_then(|d| d.constraints.as_ref());
            for (i, c) in constraints.into_iter().flatten().enumerate() {
                let (kind, attr) = match (&c.match_attribute, &c.distinct_attribute) {
                    (Some(a), _) => ("matchAttribute", a),
                    (_, Some(a)) => ("distinctAttribute", a),
                    _ => continue,
                };
                let reqs = c.requests.clone().unwrap_or_default();
                combination.push(format!(
                    "constraint #{i} {kind} {attr} over {}: every request has candidates on its own, but no combination satisfies the constraints together with the devices' shared counters",
                    if reqs.is_empty() { "all requests".to_string() } else { reqs.join(", ") }
                ));
            }
            if combination.is_empty() {
                combination.push(
                    "every request has enough candidates on its own, but they compete for the same devices or shared counters"
                        .into(),
                );
            }
            if unusable_pools
                .iter()
                .any(|p| p.reason.starts_with("incomplete"))
                && setup.entries.iter().any(|e| match e {
                    Entry::One(r) => r.mode == Mode::All,
                    Entry::First(v) => v.iter().any(|r| r.mode == Mode::All),
                })
            {
                combination
                    .push("allocationMode All needs every pool of the node to be complete".into());
            }
        }
        let mut suggestions = Vec::new();
        let mut checks = 0usize;
        let held_count = held.len();
        for (i, (r, ci)) in held.into_iter().enumerate() {
            if checks >= MAX_SUGGEST_TOTAL {
                combination.push(format!(
                    "suggestions cover {i} of the {held_count} devices held by other claims (check budget of {MAX_SUGGEST_TOTAL} spent)"
                ));
                break;
            }
            if let Some(sg) = self.suggest(claim, node, setup, r, ci, &mut checks)? {
                suggestions.push((sg.release.len(), ci, sg));
            }
        }
        suggestions.sort_by_key(|(n, ci, _)| (*n, *ci));
        Ok(Explanation {
            claim: claim_ref(claim),
            node: node.to_string(),
            unusable_pools,
            requests,
            combination,
            suggestions: suggestions.into_iter().map(|(_, _, s)| s).collect(),
        })
    }

    /// Claims whose allocations touch candidate `c`: holders of the device and
    /// of devices that consume a counter it consumes.
    fn relevant_holders(&self, setup: &Setup<'_>, c: usize) -> Vec<String> {
        let cand = &setup.cands[c];
        let (_, _, info) = self.device(cand);
        let view = &setup.view;
        let mut out: Vec<String> = Vec::new();
        let mut add = |v: &Vec<String>| {
            for w in v {
                if !out.contains(w) {
                    out.push(w.clone());
                }
            }
        };
        if let Some(h) = view.committed.exclusive.get(&cand.key) {
            add(h);
        }
        if let Some((_, h)) = view.committed.shared.get(&cand.key) {
            add(h);
        }
        for (set, counters) in &info.consumes {
            for (name, q) in counters {
                if q.nanos() > 0
                    && let Some(h) =
                        view.counter_holders[cand.pool].get(&(set.clone(), name.clone()))
                {
                    add(h);
                }
            }
        }
        out
    }

    /// Whether request `r` alone could take candidate `c` with the claims in
    /// `released` gone.
    fn frees(
        &self,
        claim: &ResourceClaim,
        node: &str,
        setup: &Setup<'_>,
        r: &Req<'_>,
        c: usize,
        released: &HashSet<String>,
    ) -> Result<bool, AllocError> {
        let view = self.view(&setup.pools, released);
        let probe = Search::new(self, claim, node, setup, &view, Vec::new());
        Ok(probe.reject_reason(c, r)?.is_none())
    }

    /// The smallest set of committed claims whose release frees candidate `c`
    /// for request `r`, as a suggestion; `None` when releasing every claim
    /// involved does not free it (a selector, taint or policy is in the way).
    fn suggest(
        &self,
        claim: &ResourceClaim,
        node: &str,
        setup: &Setup<'_>,
        r: &Req<'_>,
        c: usize,
        total: &mut usize,
    ) -> Result<Option<Suggestion>, AllocError> {
        let mut holders = self.relevant_holders(setup, c);
        holders.sort();
        let all: HashSet<String> = holders.iter().cloned().collect();
        *total += 1;
        if holders.is_empty() || !self.frees(claim, node, setup, r, c, &all)? {
            return Ok(None);
        }
        let mut checks = 0usize;
        let mut found: Option<Vec<usize>> = None;
        'sizes: for k in 1..=holders.len() {
            let mut comb: Vec<usize> = (0..k).collect();
            loop {
                if checks >= MAX_SUGGEST_CHECKS {
                    break 'sizes;
                }
                checks += 1;
                *total += 1;
                let set: HashSet<String> = comb.iter().map(|&i| holders[i].clone()).collect();
                if self.frees(claim, node, setup, r, c, &set)? {
                    found = Some(comb);
                    break 'sizes;
                }
                if !next_combination(&mut comb, holders.len()) {
                    break;
                }
            }
        }
        let (chosen, minimum) = match found {
            Some(comb) => (comb.iter().map(|&i| holders[i].clone()).collect(), true),
            None => {
                // Budget spent: drop claims one by one while the rest still frees it.
                let mut keep: Vec<String> = holders.clone();
                let mut i = 0;
                while i < keep.len() {
                    let mut trial = keep.clone();
                    trial.remove(i);
                    let set: HashSet<String> = trial.iter().cloned().collect();
                    *total += 1;
                    if self.frees(claim, node, setup, r, c, &set)? {
                        keep = trial;
                    } else {
                        i += 1;
                    }
                }
                (keep, false)
            }
        };
        Ok(Some(self.describe(setup, r, c, chosen, minimum)))
    }

    /// Builds the suggestion text parts for freeing candidate `c` by releasing `claims`.
    fn describe(
        &self,
        setup: &Setup<'_>,
        r: &Req<'_>,
        c: usize,
        claims: Vec<String>,
        minimum: bool,
    ) -> Suggestion {
        let cand = &setup.cands[c];
        let (_, d, info) = self.device(cand);
        let mine: HashSet<(&str, &str)> = info
            .consumes
            .iter()
            .flat_map(|(set, cs)| {
                cs.iter()
                    .filter(|(_, q)| q.nanos() > 0)
                    .map(move |(n, _)| (set.as_str(), n.as_str()))
            })
            .collect();
        let pool = &setup.pools[cand.pool];
        let overlaps = |name: &str| -> bool {
            if name == cand.key.2 {
                return true;
            }
            pool.all_slices.iter().any(|&si| {
                self.slices[si]
                    .spec
                    .devices
                    .iter()
                    .flatten()
                    .zip(&self.parsed[si].devices)
                    .any(|(od, oi)| {
                        od.name == name
                            && oi.consumes.iter().any(|(set, cs)| {
                                cs.iter().any(|(n, q)| {
                                    q.nanos() > 0 && mine.contains(&(set.as_str(), n.as_str()))
                                })
                            })
                    })
            })
        };
        let release = claims
            .into_iter()
            .map(|who| {
                let mut devices: Vec<String> = Vec::new();
                for cl in self.committed.iter().filter(|cl| claim_ref(cl) == who) {
                    let results = cl
                        .status
                        .as_ref()
                        .and_then(|s| s.allocation.as_ref())
                        .and_then(|a| a.devices.as_ref())
                        .and_then(|d| d.results.as_ref());
                    for res in results.into_iter().flatten() {
                        if res.driver == cand.key.0
                            && res.pool == cand.key.1
                            && overlaps(&res.device)
                            && !devices.contains(&res.device)
                        {
                            devices.push(res.device.clone());
                        }
                    }
                }
                Release {
                    claim: who,
                    devices,
                }
            })
            .collect();
        let attr_int = |n: &str| {
            d.attributes
                .as_ref()
                .and_then(|a| a.get(n))
                .and_then(|a| a.int)
        };
        let profile = d
            .attributes
            .as_ref()
            .and_then(|a| a.get("profile"))
            .and_then(|a| a.string.clone());
        let slices = match (attr_int("placementStart"), attr_int("memorySlices")) {
            (Some(first), Some(n)) if n > 0 => Some(SliceRange {
                first,
                last: first + n - 1,
            }),
            _ => None,
        };
        let gpu = d
            .name
            .parse::<DeviceName>()
            .ok()
            .map(|n| DeviceName::Gpu { gpu: n.gpu() }.to_string());
        Suggestion {
            request: r.full.clone(),
            device: format!("{}/{}", cand.key.1, cand.key.2),
            profile,
            gpu,
            slices,
            release,
            minimum,
        }
    }
}

#[derive(Debug)]
struct ReqSpec<'s> {
    full: String,
    base: String,
    class: &'s str,
    selectors: Option<&'s Vec<DeviceSelector>>,
    mode: Option<&'s str>,
    count: Option<i64>,
    capacity: Option<&'s BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>,
    admin: bool,
    tolerations: Vec<DeviceToleration>,
}

fn claim_constraints(claim: &ResourceClaim) -> Result<Vec<ConstraintState>, AllocError> {
    let mut out = Vec::new();
    let constraints = claim
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.constraints.as_ref());
    for (i, c) in constraints.into_iter().flatten().enumerate() {
        let (attr, distinct) = match (&c.match_attribute, &c.distinct_attribute) {
            (Some(a), None) => (a.clone(), false),
            (None, Some(a)) => (a.clone(), true),
            _ => {
                return Err(AllocError::InvalidClaim {
                    claim: claim_ref(claim),
                    field: format!("spec.devices.constraints[{i}]"),
                    msg: "exactly one of matchAttribute and distinctAttribute must be set".into(),
                });
            }
        };
        if !attr.contains('/') {
            return Err(AllocError::InvalidClaim {
                claim: claim_ref(claim),
                field: format!("spec.devices.constraints[{i}]"),
                msg: format!("{attr:?} is not a fully qualified attribute name (domain/name)"),
            });
        }
        out.push(ConstraintState {
            requests: c.requests.clone().unwrap_or_default(),
            attr,
            distinct,
            values: Vec::new(),
        });
    }
    Ok(out)
}

/// The backtracking search of one claim.
/// How the search accounts counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Counting {
    /// As the scheduler's allocator is meant to (and is, with PR #140431).
    Exact,
    /// With the counter leaks of kubernetes/kubernetes#140436.
    UpstreamCounterLeak,
}

#[derive(Debug)]
struct Search<'s, 'a, 'c> {
    counting: Counting,
    a: &'s Allocator<'a>,
    claim: &'s ResourceClaim,
    node: &'s str,
    setup: &'s Setup<'c>,
    view: &'s View,
    entries: &'s [Entry<'c>],
    match_cache: HashMap<(usize, usize), bool>,
    excl: HashSet<usize>,
    shared: HashMap<usize, SharedAlloc>,
    counters_used: Vec<BTreeMap<String, BTreeMap<String, Qty>>>,
    constraints: Vec<ConstraintState>,
    results: Vec<Picked>,
    chosen: HashMap<usize, usize>,
    steps: u64,
}

impl<'s, 'a, 'c> Search<'s, 'a, 'c> {
    fn new(
        a: &'s Allocator<'a>,
        claim: &'s ResourceClaim,
        node: &'s str,
        setup: &'s Setup<'c>,
        view: &'s View,
        constraints: Vec<ConstraintState>,
    ) -> Self {
        Search {
            counting: Counting::Exact,
            a,
            claim,
            node,
            setup,
            view,
            entries: &setup.entries,
            match_cache: HashMap::new(),
            excl: HashSet::new(),
            shared: HashMap::new(),
            counters_used: vec![BTreeMap::new(); setup.pools.len()],
            constraints,
            results: Vec::new(),
            chosen: HashMap::new(),
            steps: 0,
        }
    }
}

impl Search<'_, '_, '_> {
    fn request(&mut self, ei: usize) -> Result<bool, AllocError> {
        let entries = self.entries;
        let Some(entry) = entries.get(ei) else {
            return Ok(true);
        };
        match entry {
            Entry::One(r) => self.device(ei, r, 0, 0),
            Entry::First(subs) => {
                for (si, r) in subs.iter().enumerate() {
                    if self.device(ei, r, 0, 0)? {
                        self.chosen.insert(ei, si);
                        return Ok(true);
                    }
                }
                Ok(false)
            }
        }
    }

    fn all_devices(&mut self, r: &Req<'_>) -> Result<Option<Vec<usize>>, AllocError> {
        if self.setup.pools.iter().any(|p| p.usable.is_err()) {
            return Ok(None);
        }
        let mut v = Vec::new();
        for c in 0..self.setup.cands.len() {
            if self.selectable(c, r)? && self.capacity(c, r).is_ok() {
                v.push(c);
            }
        }
        Ok(Some(v))
    }

    fn device(
        &mut self,
        ei: usize,
        r: &Req<'_>,
        k: usize,
        start: usize,
    ) -> Result<bool, AllocError> {
        self.steps += 1;
        if self.steps >= MAX_STEPS {
            return Ok(false);
        }
        if let Mode::Count(n) = r.mode
            && k == n
        {
            return self.request(ei + 1);
        }
        if self.results.len() >= MAX_RESULTS {
            return Ok(false);
        }
        if r.mode == Mode::All {
            let Some(all) = self.all_devices(r)? else {
                return Ok(false);
            };
            if all.is_empty() || all.len() > MAX_RESULTS {
                return Ok(false);
            }
            let mut undos = Vec::new();
            for &c in &all {
                match self.take(c, r)? {
                    Some(u) => undos.push(u),
                    None => {
                        while let Some(u) = undos.pop() {
                            self.untake(u, r);
                        }
                        return Ok(false);
                    }
                }
            }
            if self.request(ei + 1)? {
                return Ok(true);
            }
            while let Some(u) = undos.pop() {
                self.untake(u, r);
            }
            return Ok(false);
        }
        for c in start..self.setup.cands.len() {
            if let Some(u) = self.take(c, r)? {
                if self.device(ei, r, k + 1, c + 1)? {
                    return Ok(true);
                }
                self.untake(u, r);
                if self.steps >= MAX_STEPS {
                    return Ok(false);
                }
            }
        }
        Ok(false)
    }

    fn selectable(&mut self, c: usize, r: &Req<'_>) -> Result<bool, AllocError> {
        if let Some(m) = self.match_cache.get(&(c, r.id)) {
            return Ok(*m);
        }
        let m = self.first_false_selector(c, r)?.is_none();
        self.match_cache.insert((c, r.id), m);
        Ok(m)
    }

    /// The first selector (class ones first) that is false for the device.
    fn first_false_selector(&self, c: usize, r: &Req<'_>) -> Result<Option<Reason>, AllocError> {
        let cand = &self.setup.cands[c];
        let (_s, d, info) = self.a.device(cand);
        let view = DeviceView {
            driver: &cand.key.0,
            attributes: d.attributes.as_ref(),
            capacity: d.capacity.as_ref(),
            allow_multiple_allocations: info.multi,
        };
        let device = format!("{}/{}/{}", cand.key.0, cand.key.1, cand.key.2);
        for (i, (expr, prog)) in r.class_sels.iter().enumerate() {
            let ok = self
                .a
                .cel
                .eval(prog, &view)
                .map_err(|msg| AllocError::Cel {
                    owner: format!("DeviceClass {}", r.class_name),
                    expr: expr.clone(),
                    device: device.clone(),
                    msg,
                })?;
            if !ok {
                return Ok(Some(Reason::ClassSelector {
                    class: r.class_name.clone(),
                    index: i,
                    expression: expr.clone(),
                }));
            }
        }
        for (i, (expr, prog)) in r.req_sels.iter().enumerate() {
            let ok = self
                .a
                .cel
                .eval(prog, &view)
                .map_err(|msg| AllocError::Cel {
                    owner: format!("claim {}: request {}", claim_ref(self.claim), r.full),
                    expr: expr.clone(),
                    device: device.clone(),
                    msg,
                })?;
            if !ok {
                return Ok(Some(Reason::RequestSelector {
                    index: i,
                    expression: expr.clone(),
                }));
            }
        }
        Ok(None)
    }

    /// The capacity each of the device's capacities would consume (by published
    /// name), or why the request does not fit.
    fn capacity(&self, c: usize, r: &Req<'_>) -> Result<BTreeMap<String, Qty>, Box<CapFail>> {
        let cand = &self.setup.cands[c];
        let (_, _, info) = self.a.device(cand);
        let driver = &cand.key.0;
        let mut requested: HashMap<&str, Qty> = HashMap::new();
        for (name, q) in &r.capacity {
            let found = info
                .caps
                .iter()
                .find(|cap| cap.published == *name || cap.fq == qualify(name, driver));
            match found {
                Some(cap) => {
                    requested.insert(cap.fq.as_str(), *q);
                }
                None => {
                    return Err(Box::new(CapFail {
                        capacity: name.clone(),
                        requested: Some(*q),
                        consumed: None,
                        remaining: Qty::ZERO,
                        detail: "the device has no such capacity".into(),
                    }));
                }
            }
        }
        let mut out = BTreeMap::new();
        for cap in &info.caps {
            let req = requested.get(cap.fq.as_str()).copied();
            let consumed = policy_consumed(req, cap.value, cap.policy.as_ref());
            let used_committed = self
                .view
                .committed
                .shared
                .get(&cand.key)
                .and_then(|s| s.0.get(&cap.fq))
                .copied()
                .unwrap_or(Qty::ZERO);
            let used_now = self
                .shared
                .get(&c)
                .and_then(|s| s.consumed.get(&cap.fq))
                .copied()
                .unwrap_or(Qty::ZERO);
            let used = used_committed.checked_add(used_now).unwrap_or(cap.value);
            let remaining = cap.value.checked_sub(used).unwrap_or(Qty::ZERO);
            if let Some(detail) = policy_violation(consumed, cap.policy.as_ref()) {
                return Err(Box::new(CapFail {
                    capacity: cap.published.clone(),
                    requested: req,
                    consumed: Some(consumed),
                    remaining,
                    detail,
                }));
            }
            if consumed > remaining {
                return Err(Box::new(CapFail {
                    capacity: cap.published.clone(),
                    requested: req,
                    consumed: Some(consumed),
                    remaining,
                    detail: "exceeds what is left".into(),
                }));
            }
            out.insert(cap.published.clone(), consumed);
        }
        Ok(out)
    }

    fn counter_short(&self, c: usize) -> Option<Reason> {
        let cand = &self.setup.cands[c];
        let (_, _, info) = self.a.device(cand);
        let pool = &self.setup.pools[cand.pool];
        for (set, counters) in &info.consumes {
            for (name, need) in counters {
                let total = pool
                    .counters
                    .get(set)
                    .and_then(|s| s.get(name))
                    .copied()
                    .unwrap_or(Qty::ZERO);
                let get = |m: &BTreeMap<String, BTreeMap<String, Qty>>| {
                    m.get(set)
                        .and_then(|s| s.get(name))
                        .copied()
                        .unwrap_or(Qty::ZERO)
                };
                let used = get(&self.view.committed_counters[cand.pool])
                    .checked_add(get(&self.counters_used[cand.pool]))
                    .unwrap_or(total);
                let available = total.checked_sub(used).unwrap_or(Qty::ZERO);
                if *need > available {
                    let holders = self.view.counter_holders[cand.pool]
                        .get(&(set.clone(), name.clone()))
                        .cloned()
                        .unwrap_or_default();
                    return Some(Reason::Counter {
                        counter_set: set.clone(),
                        counter: name.clone(),
                        needs: need.to_string(),
                        available: available.max(Qty::ZERO).to_string(),
                        holders,
                    });
                }
            }
        }
        None
    }

    /// Whether taking device `c` charges its counters: always for an exclusive
    /// device, only for the first share of a multi-allocatable one.
    fn charges_counters(&self, c: usize) -> bool {
        let (_, _, info) = self.a.device(&self.setup.cands[c]);
        if info.consumes.is_empty() {
            return false;
        }
        !(info.multi && self.shared_in_use(c))
    }

    fn shared_in_use(&self, c: usize) -> bool {
        self.shared.contains_key(&c)
            || self
                .view
                .committed
                .shared
                .contains_key(&self.setup.cands[c].key)
    }

    fn in_use(&self, c: usize, r: &Req<'_>) -> bool {
        if r.admin {
            return false;
        }
        self.excl.contains(&c)
            || self
                .view
                .committed
                .exclusive
                .contains_key(&self.setup.cands[c].key)
    }

    fn charge(&mut self, c: usize, sign: bool) {
        let cand = &self.setup.cands[c];
        let (_, _, info) = self.a.device(cand);
        let used = &mut self.counters_used[cand.pool];
        for (set, counters) in &info.consumes {
            for (name, q) in counters {
                let slot = used
                    .entry(set.clone())
                    .or_default()
                    .entry(name.clone())
                    .or_insert(Qty::ZERO);
                *slot = if sign {
                    slot.checked_add(*q)
                } else {
                    slot.checked_sub(*q)
                }
                .unwrap_or(*slot);
            }
        }
    }

    /// Tries to give device `c` to request `r`; on success the state holds it.
    fn take(&mut self, c: usize, r: &Req<'_>) -> Result<Option<Undo>, AllocError> {
        if self.in_use(c, r) || !self.selectable(c, r)? {
            return Ok(None);
        }
        let Ok(consumed) = self.capacity(c, r) else {
            return Ok(None);
        };
        let cand = &self.setup.cands[c];
        let (_, d, info) = self.a.device(cand);
        let multi = info.multi;
        let charged = self.charges_counters(c);
        if charged && self.counter_short(c).is_some() {
            return Ok(None);
        }
        // Upstream (before PR #140431) reserves the counters first and keeps
        // them when the taint or a constraint then rejects the candidate.
        let leak = charged && self.counting == Counting::UpstreamCounterLeak;
        if taint_blocks(d, &r.tolerations).is_some() {
            if leak {
                self.charge(c, true);
            }
            return Ok(None);
        }
        let driver = cand.key.0.clone();
        for i in 0..self.constraints.len() {
            if !self.constraints[i].add(r, d, &driver) {
                for j in (0..i).rev() {
                    self.constraints[j].remove(r);
                }
                if leak {
                    self.charge(c, true);
                }
                return Ok(None);
            }
        }
        if charged {
            self.charge(c, true);
        }
        let consumed_fq: BTreeMap<String, Qty> = consumed
            .iter()
            .map(|(k, v)| (qualify(k, &driver), *v))
            .collect();
        let mut share = None;
        if multi {
            let ordinal = self
                .view
                .committed
                .shared
                .get(&cand.key)
                .map_or(0, |s| s.1.len())
                + self.shared.get(&c).map_or(0, |s| s.count);
            share = Some(share_id(self.claim, &r.full, &cand.key, ordinal));
            let e = self.shared.entry(c).or_default();
            e.count += 1;
            for (k, v) in &consumed_fq {
                let slot = e.consumed.entry(k.clone()).or_insert(Qty::ZERO);
                *slot = slot.checked_add(*v).unwrap_or(*slot);
            }
        } else if !r.admin {
            self.excl.insert(c);
        }
        self.results.push(Picked {
            request: r.full.clone(),
            cand: c,
            share_id: share,
            consumed: (multi && !consumed.is_empty()).then_some(consumed),
            admin: r.admin,
            tolerations: r.tolerations.clone(),
        });
        Ok(Some(Undo {
            cand: c,
            charged,
            multi,
            consumed_fq,
        }))
    }

    fn untake(&mut self, u: Undo, r: &Req<'_>) {
        self.results.pop();
        for cs in self.constraints.iter_mut().rev() {
            cs.remove(r);
        }
        if u.multi {
            if let Some(e) = self.shared.get_mut(&u.cand) {
                e.count -= 1;
                for (k, v) in &u.consumed_fq {
                    if let Some(slot) = e.consumed.get_mut(k) {
                        *slot = slot.checked_sub(*v).unwrap_or(*slot);
                    }
                }
                if e.count == 0 {
                    self.shared.remove(&u.cand);
                }
            }
        } else {
            self.excl.remove(&u.cand);
        }
        // Upstream's undo of an allow-multiple device released its capacity
        // but not the counters of its first allocation.
        if u.charged && !(u.multi && self.counting == Counting::UpstreamCounterLeak) {
            self.charge(u.cand, false);
        }
    }

    /// Why device `c` does not fit request `r` alone, against committed claims.
    fn reject_reason(&self, c: usize, r: &Req<'_>) -> Result<Option<Reason>, AllocError> {
        let cand = &self.setup.cands[c];
        if !r.admin
            && let Some(holders) = self.view.committed.exclusive.get(&cand.key)
        {
            // A false selector is the decisive reason: freeing the device would
            // not help. The scheduler skips an allocated device before it
            // evaluates selectors, so a selector that fails to evaluate on it
            // is no error here, and the device is reported in use.
            return Ok(Some(match self.first_false_selector(c, r) {
                Ok(Some(selector)) => selector,
                Ok(None) | Err(_) => Reason::InUse {
                    holders: holders.clone(),
                },
            }));
        }
        if let Some(reason) = self.first_false_selector(c, r)? {
            return Ok(Some(reason));
        }
        if let Err(f) = self.capacity(c, r) {
            let holders = self
                .view
                .committed
                .shared
                .get(&cand.key)
                .map(|s| s.1.clone())
                .unwrap_or_default();
            return Ok(Some(Reason::Capacity {
                capacity: f.capacity,
                requested: f.requested.map(|q| q.to_string()),
                consumed: f.consumed.map(|q| q.to_string()),
                remaining: f.remaining.to_string(),
                detail: f.detail,
                holders,
            }));
        }
        let (_, d, _) = self.a.device(cand);
        if self.charges_counters(c)
            && let Some(reason) = self.counter_short(c)
        {
            return Ok(Some(reason));
        }
        Ok(taint_blocks(d, &r.tolerations))
    }

    fn build_result(&self) -> AllocationResult {
        let mut results = Vec::new();
        for p in &self.results {
            let cand = &self.setup.cands[p.cand];
            let (_, d, _) = self.a.device(cand);
            // Newer k8s-openapi versions add fields (v1_37: skipNodeOperations).
            #[allow(clippy::needless_update)]
            results.push(DeviceRequestAllocationResult {
                request: p.request.clone(),
                driver: cand.key.0.clone(),
                pool: cand.key.1.clone(),
                device: cand.key.2.clone(),
                share_id: p.share_id.clone(),
                consumed_capacity: p.consumed.as_ref().map(|m| {
                    m.iter()
                        .map(|(k, v)| (k.clone(), v.to_quantity()))
                        .collect()
                }),
                admin_access: p.admin.then_some(true),
                tolerations: (!p.tolerations.is_empty()).then(|| p.tolerations.clone()),
                binding_conditions: d.binding_conditions.clone().filter(|v| !v.is_empty()),
                binding_failure_conditions: d
                    .binding_failure_conditions
                    .clone()
                    .filter(|v| !v.is_empty()),
                ..Default::default()
            });
        }
        AllocationResult {
            devices: Some(DeviceAllocationResult {
                results: Some(results),
                config: Some(self.configs()).filter(|c| !c.is_empty()),
            }),
            node_selector: self.node_selector(),
            allocation_timestamp: None,
        }
    }

    fn configs(&self) -> Vec<DeviceAllocationConfiguration> {
        let mut out: Vec<DeviceAllocationConfiguration> = Vec::new();
        let mut class_ranges: HashMap<String, (usize, usize)> = HashMap::new();
        let mut chosen_names: Vec<(String, String)> = Vec::new(); // (base, full)
        for (ei, e) in self.entries.iter().enumerate() {
            let r = match e {
                Entry::One(r) => r,
                Entry::First(v) => &v[self.chosen.get(&ei).copied().unwrap_or(0)],
            };
            chosen_names.push((r.base.clone(), r.full.clone()));
            if let Some(&(start, end)) = class_ranges.get(&r.class_name) {
                for c in &mut out[start..end] {
                    c.requests.get_or_insert_with(Vec::new).push(r.full.clone());
                }
                continue;
            }
            let start = out.len();
            for c in r.class.spec.config.iter().flatten() {
                out.push(DeviceAllocationConfiguration {
                    source: "FromClass".into(),
                    requests: Some(vec![r.full.clone()]),
                    opaque: c.opaque.clone(),
                });
            }
            class_ranges.insert(r.class_name.clone(), (start, out.len()));
        }
        let claim_configs = self
            .claim
            .spec
            .devices
            .as_ref()
            .and_then(|d| d.config.as_ref());
        for c in claim_configs.into_iter().flatten() {
            let reqs = c.requests.clone().unwrap_or_default();
            let applies = reqs.is_empty()
                || chosen_names
                    .iter()
                    .any(|(base, full)| reqs.contains(base) || reqs.contains(full));
            if applies {
                out.push(DeviceAllocationConfiguration {
                    source: "FromClaim".into(),
                    requests: c.requests.clone().filter(|r| !r.is_empty()),
                    opaque: c.opaque.clone(),
                });
            }
        }
        let n = self.entries.len();
        for c in &mut out {
            if c.requests.as_ref().is_some_and(|r| r.len() == n) {
                c.requests = None;
            }
        }
        out
    }

    fn node_selector(&self) -> Option<NodeSelector> {
        let mut fields: Vec<NodeSelectorRequirement> = Vec::new();
        let mut exprs: Vec<NodeSelectorRequirement> = Vec::new();
        for p in &self.results {
            let cand = &self.setup.cands[p.cand];
            let (s, d, _) = self.a.device(cand);
            let (node_name, selector) = if s.spec.per_device_node_selection == Some(true) {
                (d.node_name.as_ref(), d.node_selector.as_ref())
            } else {
                (s.spec.node_name.as_ref(), s.spec.node_selector.as_ref())
            };
            if node_name.is_some() || d.binds_to_node == Some(true) {
                return Some(NodeSelector {
                    node_selector_terms: vec![NodeSelectorTerm {
                        match_fields: Some(vec![NodeSelectorRequirement {
                            key: "metadata.name".into(),
                            operator: "In".into(),
                            values: Some(vec![self.node.to_string()]),
                        }]),
                        match_expressions: None,
                    }],
                });
            }
            if let Some(sel) = selector
                && let [term] = sel.node_selector_terms.as_slice()
            {
                for r in term.match_fields.iter().flatten() {
                    if !fields.contains(r) {
                        fields.push(r.clone());
                    }
                }
                for r in term.match_expressions.iter().flatten() {
                    if !exprs.contains(r) {
                        exprs.push(r.clone());
                    }
                }
            }
        }
        if fields.is_empty() && exprs.is_empty() {
            return None;
        }
        Some(NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm {
                match_fields: Some(fields).filter(|f| !f.is_empty()),
                match_expressions: Some(exprs).filter(|e| !e.is_empty()),
            }],
        })
    }
}

/// Explains why `claim` does not fit on `node` given `inputs`.
pub fn explain(
    claim: &ResourceClaim,
    inputs: &Inputs,
    node: &str,
) -> Result<Explanation, AllocError> {
    Allocator::new(inputs)?.explain(claim, node)
}
