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
