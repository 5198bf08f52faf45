//! Errors of the ResourceSlice publisher.

use std::fmt;

/// The API verb a failed request used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    /// `GET /apis/resource.k8s.io/v1/resourceslices` (with field selector).
    List,
    /// `POST` a new slice.
    Create,
    /// `PUT` (replace) an existing slice with its observed resourceVersion.
    Update,
    /// `DELETE` a slice.
    Delete,
}

impl fmt::Display for Verb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verb::List => "list",
            Verb::Create => "create",
            Verb::Update => "update",
            Verb::Delete => "delete",
        })
    }
}

/// Everything that can go wrong while publishing ResourceSlices.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// A slice of the desired set cannot be published as given (wrong driver or
    /// node, missing or duplicate name, inconsistent pool). Nothing was written.
    #[error("desired ResourceSlice {slice:?}: {reason}")]
    InvalidDesired {
        /// `metadata.name` of the offending slice (may be empty when that is the problem).
        slice: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The API server stored a slice without the counter fields it was sent:
    /// the DRAPartitionableDevices feature gate is off. The sync stopped there.
    #[error(
        "{verb} ResourceSlice {slice}: the API server dropped {dropped} and stored the slice without them: the DRAPartitionableDevices feature gate is off (its default in Kubernetes 1.34 and 1.35); enable it (--feature-gates=DRAPartitionableDevices=true on kube-apiserver, kube-scheduler and kube-controller-manager), without it MIG partitions cannot be published safely"
    )]
    CountersDropped {
        /// Create or update.
        verb: Verb,
        /// The slice.
        slice: String,
        /// What was dropped.
        dropped: String,
    },
    /// The API server stored a slice without fields of a feature gate that is
    /// off (DRADeviceTaints: taints; DRAConsumableCapacity:
    /// allowMultipleAllocations, requestPolicy). The sync stopped there.
    #[error(
        "{verb} ResourceSlice {slice}: the API server dropped {dropped} and stored the slice without them: the {gate} feature gate is off (its default in Kubernetes 1.34 and 1.35); enable it (--feature-gates={gate}=true on kube-apiserver, kube-scheduler and kube-controller-manager); {consequence}"
    )]
    FieldsDropped {
        /// Create or update.
        verb: Verb,
        /// The slice.
        slice: String,
        /// The gate that is off.
        gate: crate::dropped::FeatureGate,
        /// What was dropped.
        dropped: String,
        /// What publishing without the gate would mean.
        consequence: &'static str,
    },
    /// Listing the slices of this driver on this node failed.
    #[error("list ResourceSlices of driver {driver} on node {node}")]
    List {
        /// The node whose slices were listed.
        node: String,
        /// The driver whose slices were listed.
        driver: String,
        /// The client error.
        #[source]
        source: kube::Error,
    },
    /// A create, update or delete of one slice failed with an error that is not
    /// retried (anything but 409 Conflict).
    #[error("{verb} ResourceSlice {slice}")]
    Api {
        /// The verb of the failed request.
        verb: Verb,
        /// `metadata.name` of the slice.
        slice: String,
        /// The client error (for API errors, the server's `Status`).
        #[source]
        source: kube::Error,
    },
    /// Writes kept hitting 409 Conflict (or the slice vanished) after every
    /// re-read; the publisher gave up.
    #[error("{verb} ResourceSlice {slice}: still conflicting after {attempts} attempts")]
    Conflict {
        /// The verb of the last conflicting request.
        verb: Verb,
        /// `metadata.name` of the slice that conflicted last.
        slice: String,
        /// How many sync passes were made.
        attempts: u32,
        /// The last conflict error.
        #[source]
        source: kube::Error,
    },
    /// One API request got no answer within the publisher's request timeout
    /// (the API server is hung, overloaded or unreachable). The sync stopped
    /// there; the next one starts from a fresh list.
    #[error(
        "{verb} ResourceSlice {slice}: no answer within {after:?} (the API server is hung, overloaded or unreachable)"
    )]
    Timeout {
        /// The verb of the request that ran out.
        verb: Verb,
        /// `metadata.name` of the slice (for a list, which slices).
        slice: String,
        /// The request timeout.
        after: std::time::Duration,
    },
    /// `GET /version` failed.
    #[error("read the API server version")]
    Version {
        /// The client error.
        #[source]
        source: kube::Error,
    },
    /// `GET /version` got no answer within the request timeout.
    #[error(
        "read the API server version: no answer within {after:?} (the API server is hung, overloaded or unreachable)"
    )]
    VersionTimeout {
        /// The request timeout.
        after: std::time::Duration,
    },
    /// `GET /version` answered, but its `major`/`minor` (and `gitVersion`) fields
    /// do not hold a version number.
    #[error("API server version field {field} = {value:?} is not a version number")]
    BadVersion {
        /// Which field of the version document was unusable.
        field: &'static str,
        /// Its value.
        value: String,
    },
}

impl PublishError {
    /// The HTTP status code of the API error behind this error, if any.
    pub fn status_code(&self) -> Option<u16> {
        match self {
            PublishError::List { source, .. }
            | PublishError::Api { source, .. }
            | PublishError::Conflict { source, .. }
            | PublishError::Version { source } => api_code(source),
            PublishError::InvalidDesired { .. }
            | PublishError::BadVersion { .. }
            | PublishError::Timeout { .. }
            | PublishError::VersionTimeout { .. }
            | PublishError::CountersDropped { .. }
            | PublishError::FieldsDropped { .. } => None,
        }
    }
}

/// The HTTP status code of a `kube::Error::Api`.
pub(crate) fn api_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}
