//! The seam: what a driver implements ([`DraDriver`]) and the values it
//! takes and returns.

use std::collections::HashMap;
use std::future::Future;

use carve_proto::{dra_v1, dra_v1beta1};

use crate::health::HealthWatch;

/// A per-claim failure: its message goes into the claim's `error` field, and
/// the kubelet retries the claim later.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What one claim's preparation gave: its devices, or why it failed.
pub type PrepareResult = Result<Vec<Device>, BoxError>;

/// What one claim's unpreparation gave.
pub type UnprepareResult = Result<(), BoxError>;

/// A claim as the kubelet names it in `NodePrepareResources` and
/// `NodeUnprepareResources`, passed on as sent (the kit neither validates nor
/// reads the ResourceClaim: that is the driver's business, as only it knows
/// what it needs from the claim).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Claim {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID: results are keyed by it.
    pub uid: String,
}

impl std::fmt::Display for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} ({})", self.namespace, self.name, self.uid)
    }
}

impl From<dra_v1::Claim> for Claim {
    fn from(c: dra_v1::Claim) -> Self {
        Self {
            namespace: c.namespace,
            name: c.name,
            uid: c.uid,
        }
    }
}

impl From<dra_v1beta1::Claim> for Claim {
    fn from(c: dra_v1beta1::Claim) -> Self {
        Self {
            namespace: c.namespace,
            name: c.name,
            uid: c.uid,
        }
    }
}

/// One device handed to the kubelet for a claim (Go `kubeletplugin.Device`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Device {
    /// The claim's requests this device serves. A subrequest reference
    /// (`request/subrequest`, as in the allocation result) may be given; the
    /// kit sends the request part only, as the kubelet expects. Empty: all
    /// requests.
    pub request_names: Vec<String>,
    /// The pool of the device (non-empty).
    pub pool_name: String,
    /// The device's name in the pool (non-empty).
    pub device_name: String,
    /// Fully-qualified CDI device IDs (`vendor/class=name`) for the container
    /// runtime; may be empty.
    pub cdi_device_ids: Vec<String>,
    /// The share ID of a consumable-capacity device (v1 only: v1beta1 has no
    /// such field, and the kit leaves it out there).
    pub share_id: Option<String>,
}

/// The part of a request reference before `/` (Go `resourceclaim.BaseRequestRef`).
fn base_request(name: String) -> String {
    match name.split_once('/') {
        Some((base, _)) => base.to_string(),
        None => name,
    }
}

impl From<Device> for dra_v1::Device {
    fn from(d: Device) -> Self {
        Self {
            request_names: d.request_names.into_iter().map(base_request).collect(),
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
            share_id: d.share_id,
        }
    }
}

impl From<Device> for dra_v1beta1::Device {
    fn from(d: Device) -> Self {
        Self {
            request_names: d.request_names.into_iter().map(base_request).collect(),
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
        }
    }
}

/// A DRA driver's node part, as the kit serves it (Go
/// `kubeletplugin.DRAPlugin`).
///
/// The kit calls [`prepare`](Self::prepare) and
/// [`unprepare`](Self::unprepare) for the kubelet's `NodePrepareResources` and
/// `NodeUnprepareResources` (v1 and v1beta1 alike), one at a time when
/// [`crate::PluginOptions::serialize`] is on, concurrently otherwise.
pub trait DraDriver: Send + Sync + 'static {
    /// Prepare the claims of one pod: every device allocated to them on this
    /// node, ready for the container runtime (usually by writing CDI specs).
    /// Return one result per claim UID; a claim without a result gets an
    /// error saying so. Must be idempotent: the kubelet asks again after a
    /// restart or a failure.
    fn prepare(
        &self,
        claims: Vec<Claim>,
    ) -> impl Future<Output = HashMap<String, PrepareResult>> + Send;

    /// Undo [`prepare`](Self::prepare). The ResourceClaims may be gone by now:
    /// keep what unprepare needs. Must be idempotent, and succeed for a claim
    /// that is not prepared.
    fn unprepare(
        &self,
        claims: Vec<Claim>,
    ) -> impl Future<Output = HashMap<String, UnprepareResult>> + Send;

    /// Device health to stream to the kubelet
    /// (`v1alpha1.DRAResourceHealth/NodeWatchResources`); asked once, when
    /// serving starts. `None` (the default): the health service is neither
    /// served nor advertised.
    fn health(&self) -> Option<HealthWatch> {
        None
    }

    /// Called once at shutdown, after the gRPC servers have stopped (no call
    /// is running any more) and before the sockets are removed: finish
    /// background work here. The default does nothing.
    fn stopped(&self) -> impl Future<Output = ()> + Send {
        async {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subrequest_names_are_cut_to_their_request_and_v1beta1_drops_the_share() {
        let d = Device {
            request_names: vec!["gpu/large".into(), "nic".into()],
            pool_name: "p".into(),
            device_name: "d".into(),
            cdi_device_ids: vec!["example.com/dev=x".into()],
            share_id: Some("s".into()),
        };
        let v1 = dra_v1::Device::from(d.clone());
        assert_eq!(v1.request_names, ["gpu", "nic"]);
        assert_eq!(v1.share_id.as_deref(), Some("s"));
        let b = dra_v1beta1::Device::from(d);
        assert_eq!(b.request_names, ["gpu", "nic"]);
        assert_eq!(b.cdi_device_ids, ["example.com/dev=x"]);
    }
}
