//! Offline DRA allocator for carve: given ResourceSlices, DeviceClasses and the
//! claims already allocated, it says which devices a ResourceClaim would get on a
//! node, with the semantics of kube-scheduler's structured-parameters allocator
//! (`k8s.io/dynamic-resource-allocation/structured`), or why it does not fit.
//!
//! It covers CEL selectors (Kubernetes environment, quantity and semver
//! libraries), `exactly` (count / `All`), `firstAvailable`, `matchAttribute` and
//! `distinctAttribute`, shared counters in both slice layouts, pool generations
//! and completeness, multi-allocatable devices with consumable capacity, taints,
//! class and claim config, and the node selector of the result.
//!
//! When a claim does not fit, the [`Explanation`] also says what would make it
//! fit: per device held by other claims, the fewest claims to release
//! ([`Suggestion`]). [`plan_defrag`] goes further and plans which claims to
//! move (at most three) so that the claim fits, verified by replaying the plan
//! through the [`Allocator`]; it never evicts anything.
//!
//! It is not a scheduler: it looks at one node at a time, knows nodes only by
//! name (slice node selectors are matched on `metadata.name` fields only), does
//! not score, and ignores binding conditions beyond copying them. It does no I/O
//! except [`load`], which reads YAML files.

pub mod alloc;
pub mod celenv;
pub mod defrag;
pub mod error;
pub mod explain;
mod inventory;
pub mod load;
pub mod quantity;

pub use alloc::{Allocator, Inputs, MAX_RESULTS, explain};
pub use defrag::{DefragPlan, Move, Step, plan_defrag};
pub use error::AllocError;
pub use explain::{
    Explanation, PoolNote, Reason, Rejection, Release, RequestExplanation, SliceRange, Suggestion,
};
pub use load::{LoadError, Object, load_yaml_documents, parse_yaml_documents};
