//! Defragmentation planning: which claims to move so that a claim fits.
//!
//! [`plan_defrag`] looks for the smallest set of allocated claims (at most
//! [`MAX_MOVES`]) whose re-allocation, elsewhere on the node or on another node
//! of the inputs, lets a claim fit on the node. It only plans: nothing is
//! evicted. A plan is kept only if replaying it step by step through the
//! [`Allocator`] succeeds.
//!
//! Search: candidate claims are those holding counters or devices the claim
//! could use on the node, most blocking counters (counters a usable device
//! needs and cannot get now) first; sets of 1, 2, then 3
//! candidates are tried in that order. For a set, the claims are released, the
//! claim is allocated first-fit, then each moved claim is allocated first-fit
//! around it (this node first, then the other nodes by name). This is greedy per
//! set: a set can be reported as not working when another placement order would
//! have worked.

use std::collections::HashSet;
use std::fmt;

use k8s_openapi::api::resource::v1::{AllocationResult, ResourceClaim};
use serde::Serialize;

use crate::alloc::{Allocator, DevKey, Inputs, claim_ref, next_combination};
use crate::error::AllocError;

/// Most claims a plan moves.
pub const MAX_MOVES: usize = 3;
/// Most sets of claims tried before giving up.
pub const MAX_SETS: usize = 400;

/// A plan that makes a claim fit on a node by moving other claims.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DefragPlan {
    /// `namespace/name` of the claim to fit.
    pub claim: String,
    /// The node it is to fit on.
    pub node: String,
    /// The claims moved, in step order.
    pub moves: Vec<Move>,
    /// Every step, in the order to carry them out.
    pub steps: Vec<Step>,
    /// Sets of claims tried before this one worked.
    pub sets_tried: usize,
}

/// One claim moved by a plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Move {
    /// `namespace/name`.
    pub claim: String,
    /// `pool/device` it holds now (on the plan's node).
    pub from: Vec<String>,
    /// The node it moves to.
    pub to_node: String,
    /// `pool/device` it gets there.
    pub to: Vec<String>,
}

/// One step of a plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "action", rename_all = "camelCase")]
pub enum Step {
    /// Free the devices of an allocated claim (e.g. delete its pods and
    /// deallocate it).
    #[serde(rename_all = "camelCase")]
    Release {
        /// `namespace/name`.
        claim: String,
        /// The node it was on.
        node: String,
        /// `pool/device` it frees.
        devices: Vec<String>,
    },
    /// Allocate a released claim again, to these devices.
    #[serde(rename_all = "camelCase")]
    Reallocate {
        /// `namespace/name`.
        claim: String,
        /// The node.
        node: String,
        /// `pool/device` it gets.
        devices: Vec<String>,
    },
    /// Allocate the claim the plan is for.
    #[serde(rename_all = "camelCase")]
    Allocate {
        /// `namespace/name`.
        claim: String,
        /// The node.
        node: String,
        /// `pool/device` it gets.
        devices: Vec<String>,
    },
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Release {
                claim,
                node,
                devices,
            } => write!(
                f,
                "release claim {claim} from {} on node {node}",
                devices.join(", ")
            ),
            Step::Reallocate {
                claim,
                node,
                devices,
            } => write!(
                f,
                "re-allocate claim {claim} to {} on node {node}",
                devices.join(", ")
            ),
            Step::Allocate {
                claim,
                node,
                devices,
            } => write!(
                f,
                "allocate claim {claim} to {} on node {node}",
                devices.join(", ")
            ),
        }
    }
}

impl fmt::Display for DefragPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "claim {} fits on node {} after moving {} claim(s) ({} set(s) tried; nothing is evicted automatically):",
            self.claim,
            self.node,
            self.moves.len(),
            self.sets_tried
        )?;
        for (i, s) in self.steps.iter().enumerate() {
            writeln!(f, "  {}. {s}", i + 1)?;
        }
        Ok(())
    }
}

fn keys(r: &AllocationResult) -> Vec<DevKey> {
    let mut v: Vec<DevKey> = r
        .devices
        .iter()
        .flat_map(|d| d.results.iter().flatten())
        .map(|x| (x.driver.clone(), x.pool.clone(), x.device.clone()))
        .collect();
    v.sort();
    v
}

fn names(k: &[DevKey]) -> Vec<String> {
    k.iter().map(|(_, p, d)| format!("{p}/{d}")).collect()
}

fn with_allocation(c: &ResourceClaim, r: Option<AllocationResult>) -> ResourceClaim {
    let mut c = c.clone();
    c.status.get_or_insert_with(Default::default).allocation = r;
    c
}

/// The smallest set of allocated claims (at most [`MAX_MOVES`]) whose move lets
/// `request` fit on `node`, as a plan replayed through the [`Allocator`].
///
/// # Errors
/// [`AllocError::AlreadyFits`] when nothing needs moving,
/// [`AllocError::NeverFits`] when the claim does not fit even on the empty
/// node, [`AllocError::NoPlan`] when no set within the bound works, and the
/// allocator's errors for bad input.
pub fn plan_defrag(
    inputs: &Inputs,
    request: &ResourceClaim,
    node: &str,
) -> Result<DefragPlan, AllocError> {
    let who = claim_ref(request);
    if inputs.claims_allocated.iter().any(|c| claim_ref(c) == who) {
        return Err(AllocError::InvalidClaim {
            claim: who,
            field: "metadata".into(),
            msg: "the inputs already hold an allocated claim of this namespace/name; plan for a claim that is not allocated".into(),
        });
    }
    let base = Allocator::new(inputs)?;
    if let Some(r) = base.try_allocate(request, node, None)? {
        return Err(AllocError::AlreadyFits {
            claim: who,
            node: node.to_string(),
            devices: names(&keys(&r)),
        });
    }
    let mut empty = Allocator::new(inputs)?;
    let all: Vec<String> = empty.committed().iter().map(claim_ref).collect();
    for c in &all {
        empty.release(c);
    }
    if empty.try_allocate(request, node, None)?.is_none() {
        return Err(AllocError::NeverFits {
            claim: who,
            node: node.to_string(),
            explanation: Box::new(empty.explain(request, node)?),
        });
    }
    let mut candidates = base.blocking_scores(request, node)?;
    // Most blocking counters first, then most counters shared with the devices
    // the claim could use; ties keep input order (the sort is stable).
    candidates.sort_by_key(|c| std::cmp::Reverse(c.1));
    let candidates: Vec<String> = candidates.into_iter().map(|(c, _)| c).collect();
    let mut nodes = vec![node.to_string()];
    nodes.extend(base.node_names().into_iter().filter(|n| n != node));

    let mut work = Allocator::new(inputs)?;
    let mut replay = Allocator::new(inputs)?;
    let mut tried = 0;
    let mut budget_spent = false;
    'sizes: for k in 1..=MAX_MOVES.min(candidates.len()) {
        let mut comb: Vec<usize> = (0..k).collect();
        loop {
            if tried >= MAX_SETS {
                budget_spent = true;
                break 'sizes;
            }
            tried += 1;
            let set: Vec<&str> = comb.iter().map(|&i| candidates[i].as_str()).collect();
            let found = try_set(&mut work, &mut replay, request, node, &nodes, &set);
            // Both allocators go back to the inputs' claims for the next set.
            work.replace_committed(inputs.claims_allocated.clone());
            replay.replace_committed(inputs.claims_allocated.clone());
            if let Some(mut plan) = found? {
                plan.sets_tried = tried;
                return Ok(plan);
            }
            if !next_combination(&mut comb, candidates.len()) {
                break;
            }
        }
    }
    Err(AllocError::NoPlan {
        claim: who,
        node: node.to_string(),
        max_moves: MAX_MOVES,
        candidates: candidates.len(),
        sets_tried: tried,
        budget_spent,
    })
}

/// Tries moving the claims `set`; a plan if it works and replays. `a` and `v`
/// hold the inputs' claims on entry; the caller restores them after.
fn try_set(
    a: &mut Allocator<'_>,
    v: &mut Allocator<'_>,
    request: &ResourceClaim,
    node: &str,
    nodes: &[String],
    set: &[&str],
) -> Result<Option<DefragPlan>, AllocError> {
    let mut moved: Vec<(ResourceClaim, Vec<DevKey>)> = Vec::new();
    for w in set {
        for c in a.release(w) {
            let from = c
                .status
                .as_ref()
                .and_then(|s| s.allocation.clone())
                .map(|r| keys(&r))
                .unwrap_or_default();
            moved.push((with_allocation(&c, None), from));
        }
    }
    let Some(target) = a.try_allocate(request, node, None)? else {
        return Ok(None);
    };
    a.commit(with_allocation(request, Some(target.clone())))?;
    let mut moves: Vec<(String, Vec<DevKey>)> = Vec::new();
    for (c, from) in &moved {
        let mut placed = None;
        for n in nodes {
            if let Some(r) = a.try_allocate(c, n, None)? {
                placed = Some((n.clone(), r));
                break;
            }
        }
        let Some((n, r)) = placed else {
            return Ok(None);
        };
        let to = keys(&r);
        if n == node && to == *from {
            // Not a move: a smaller set covers this.
            return Ok(None);
        }
        a.commit(with_allocation(c, Some(r)))?;
        moves.push((n, to));
    }

    // Replay in plan order: release all, re-allocate each, allocate the claim.
    let mut steps = Vec::new();
    for w in set {
        v.release(w);
    }
    for (c, from) in &moved {
        steps.push(Step::Release {
            claim: claim_ref(c),
            node: node.to_string(),
            devices: names(from),
        });
    }
    let mut out_moves = Vec::new();
    for ((c, from), (n, to)) in moved.iter().zip(&moves) {
        let only: HashSet<DevKey> = to.iter().cloned().collect();
        let Some(r) = v.try_allocate(c, n, Some(&only))? else {
            return Ok(None);
        };
        if keys(&r) != *to {
            return Ok(None);
        }
        v.commit(with_allocation(c, Some(r)))?;
        steps.push(Step::Reallocate {
            claim: claim_ref(c),
            node: n.clone(),
            devices: names(to),
        });
        out_moves.push(Move {
            claim: claim_ref(c),
            from: names(from),
            to_node: n.clone(),
            to: names(to),
        });
    }
    let want = keys(&target);
    let only: HashSet<DevKey> = want.iter().cloned().collect();
    let Some(r) = v.try_allocate(request, node, Some(&only))? else {
        return Ok(None);
    };
    if keys(&r) != want {
        return Ok(None);
    }
    steps.push(Step::Allocate {
        claim: claim_ref(request),
        node: node.to_string(),
        devices: names(&want),
    });
    Ok(Some(DefragPlan {
        claim: claim_ref(request),
        node: node.to_string(),
        moves: out_moves,
        steps,
        sets_tried: 0,
    }))
}
