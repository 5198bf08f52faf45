//! Errors of the allocator.

use crate::explain::Explanation;

/// Why a claim got no allocation.
#[derive(Debug, thiserror::Error)]
pub enum AllocError {
    /// The input is fine but the claim does not fit on the node now; the
    /// explanation says why, per request and device.
    #[error("{0}")]
    Unsatisfiable(Box<Explanation>),
    /// A request names a DeviceClass that is not among the inputs.
    #[error("claim {claim}: request {request}: DeviceClass {class:?} not found")]
    UnknownClass {
        /// `namespace/name` of the claim.
        claim: String,
        /// The request (`<req>` or `<req>/<sub>`).
        request: String,
        /// The missing class name.
        class: String,
    },
    /// A CEL selector is not valid CEL.
    #[error("{owner}: CEL expression {expr:?} does not compile: {msg}")]
    CelCompile {
        /// The class or claim request holding the selector.
        owner: String,
        /// The expression.
        expr: String,
        /// The parser's message.
        msg: String,
    },
    /// A CEL selector is longer than the API allows.
    #[error("{owner}: CEL expression is {len} bytes long, the limit is {limit}")]
    CelTooLong {
        /// The class or claim request holding the selector.
        owner: String,
        /// Its length in bytes.
        len: usize,
        /// The limit (10240).
        limit: usize,
    },
    /// A CEL selector's estimated cost is over the per-expression limit.
    #[error(
        "{owner}: CEL expression {expr:?} has an estimated cost of {cost}, the limit is {limit}"
    )]
    CelTooCostly {
        /// The class or claim request holding the selector.
        owner: String,
        /// The expression.
        expr: String,
        /// The static estimate.
        cost: u64,
        /// The limit.
        limit: u64,
    },
    /// A CEL selector failed at runtime on a device (e.g. an unknown field); this
    /// aborts the claim's allocation as the scheduler does.
    #[error("{owner}: CEL expression {expr:?} failed on device {device}: {msg}")]
    Cel {
        /// The class or claim request holding the selector.
        owner: String,
        /// The expression.
        expr: String,
        /// `driver/pool/device`.
        device: String,
        /// The evaluation error.
        msg: String,
    },
    /// A claim is malformed (no requests, bad mode, bad count, ...).
    #[error("claim {claim}: {field}: {msg}")]
    InvalidClaim {
        /// `namespace/name` of the claim.
        claim: String,
        /// The offending field, e.g. `spec.devices.requests[0].exactly.count`.
        field: String,
        /// What is wrong.
        msg: String,
    },
    /// Defragmentation was asked for a claim that fits on the node as things are.
    #[error("claim {claim} already fits on node {node} (devices {}): nothing to do", devices.join(", "))]
    AlreadyFits {
        /// `namespace/name` of the claim.
        claim: String,
        /// The node.
        node: String,
        /// `pool/device` it would get now.
        devices: Vec<String>,
    },
    /// The claim does not fit on the node even with no claim allocated, so no
    /// moving of other claims can help.
    #[error(
        "claim {claim} does not fit on node {node} even with every device free (too large for the node):\n{explanation}"
    )]
    NeverFits {
        /// `namespace/name` of the claim.
        claim: String,
        /// The node.
        node: String,
        /// Why it does not fit on the empty node.
        explanation: Box<Explanation>,
    },
    /// No set of at most `max_moves` claims could be moved so that the claim fits.
    #[error(
        "no defragmentation plan for claim {claim} on node {node} moves at most {max_moves} claim(s): tried {sets_tried} set(s) of the {candidates} claim(s) in the way{}",
        if *budget_spent { " before the search budget ran out" } else { "" }
    )]
    NoPlan {
        /// `namespace/name` of the claim.
        claim: String,
        /// The node.
        node: String,
        /// The bound on claims moved.
        max_moves: usize,
        /// Claims on the node holding counters or devices the claim could use.
        candidates: usize,
        /// Sets of claims tried.
        sets_tried: usize,
        /// Whether the search stopped at its budget before trying every set.
        budget_spent: bool,
    },
    /// A ResourceSlice holds a value the allocator cannot use (e.g. a bad quantity).
    #[error("ResourceSlice {slice}: {field}: {msg}")]
    InvalidSlice {
        /// Name of the slice.
        slice: String,
        /// The offending field.
        field: String,
        /// What is wrong.
        msg: String,
    },
}
