//! Wire ↔ domain conversion of claims and prepared devices.

use std::borrow::Cow;

use carve_proto::{dra_v1, dra_v1beta1};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimSpec, ResourceClaimStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// A claim kubelet asks about.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClaimRef {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
}

impl std::fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} ({})", self.namespace, self.name, self.uid)
    }
}

/// A claim in a kubelet request with a field missing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("claim {namespace:?}/{name:?} uid {uid:?}: field {field} is empty")]
pub struct InvalidClaim {
    /// Namespace as sent.
    pub namespace: String,
    /// Name as sent.
    pub name: String,
    /// UID as sent.
    pub uid: String,
    /// The empty field.
    pub field: &'static str,
}

fn convert(namespace: String, name: String, uid: String) -> Result<ClaimRef, InvalidClaim> {
    let field = if uid.is_empty() {
        Some("uid")
    } else if namespace.is_empty() {
        Some("namespace")
    } else if name.is_empty() {
        Some("name")
    } else {
        None
    };
    match field {
        Some(field) => Err(InvalidClaim {
            namespace,
            name,
            uid,
            field,
        }),
        None => Ok(ClaimRef {
            namespace,
            name,
            uid,
        }),
    }
}

impl TryFrom<dra_v1::Claim> for ClaimRef {
    type Error = InvalidClaim;
    fn try_from(c: dra_v1::Claim) -> Result<Self, InvalidClaim> {
        convert(c.namespace, c.name, c.uid)
    }
}

impl TryFrom<dra_v1beta1::Claim> for ClaimRef {
    type Error = InvalidClaim;
    fn try_from(c: dra_v1beta1::Claim) -> Result<Self, InvalidClaim> {
        convert(c.namespace, c.name, c.uid)
    }
}

/// One device handed to kubelet for a claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedDevice {
    /// Requests (subrequest suffix stripped).
    pub request_names: Vec<String>,
    /// Pool.
    pub pool_name: String,
    /// Device.
    pub device_name: String,
    /// Fully-qualified CDI ids.
    pub cdi_device_ids: Vec<String>,
    /// Share id.
    pub share_id: Option<String>,
}

impl From<PreparedDevice> for dra_v1::Device {
    fn from(d: PreparedDevice) -> Self {
        Self {
            request_names: d.request_names,
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
            share_id: d.share_id,
        }
    }
}

impl From<PreparedDevice> for dra_v1beta1::Device {
    fn from(d: PreparedDevice) -> Self {
        Self {
            request_names: d.request_names,
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An allocated claim as the API server returns it.
    fn served_claim() -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {
                "name": "pod-gpu-x7", "namespace": "team", "uid": "u-1",
                "resourceVersion": "42", "generateName": "pod-gpu-",
                "creationTimestamp": "2026-11-29T10:00:00Z",
                "annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"},
                "finalizers": ["resource.kubernetes.io/delete-protection"],
                "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "pod", "uid": "p-1"}],
                "managedFields": [{
                    "manager": "kube-scheduler", "operation": "Update", "subresource": "status",
                    "apiVersion": "resource.k8s.io/v1", "fieldsType": "FieldsV1",
                    "fieldsV1": {"f:status": {"f:allocation": {".": {}}, "f:reservedFor": {}}}
                }]
            },
            "spec": {"devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "mig.gpu.carve.dev"}}],
                "config": [{"requests": ["gpu"], "opaque": {"driver": "gpu.carve.dev", "parameters": {"x": 1}}}]
            }},
            "status": {
                "allocation": {
                    "devices": {
                        "results": [{"request": "gpu", "driver": "gpu.carve.dev", "pool": "n", "device": "gpu-0-mig-1g10gb-3"}],
                        "config": [{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": "gpu.carve.dev", "parameters": {"x": 1}}}]
                    },
                    "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n"]}]}]}
                },
                "reservedFor": [{"resource": "pods", "name": "pod", "uid": "p-1"}],
                "devices": [{"driver": "other.example.com", "pool": "n", "device": "d"}]
            }
        })
    }

    #[test]
    fn a_read_claim_keeps_spec_status_and_identity_and_skips_the_rest() {
        let full: ResourceClaim = serde_json::from_value(served_claim()).unwrap();
        assert!(full.metadata.managed_fields.is_some());
        let ReadClaim(read) = serde_json::from_value(served_claim()).unwrap();
        assert_eq!(read.spec, full.spec);
        assert_eq!(read.status, full.status);
        assert_eq!(
            (
                read.metadata.name,
                read.metadata.namespace,
                read.metadata.uid
            ),
            (
                full.metadata.name,
                full.metadata.namespace,
                full.metadata.uid
            )
        );
        assert_eq!(read.metadata.managed_fields, None);
        assert_eq!(read.metadata.owner_references, None);
        assert_eq!(read.metadata.resource_version, None);
        // A claim without status (not allocated yet) reads as such.
        let mut bare = served_claim();
        bare.as_object_mut().unwrap().remove("status");
        let ReadClaim(read) = serde_json::from_value(bare).unwrap();
        assert_eq!(read.status, None);
        // Malformed content is still an error, not an empty claim.
        let mut bad = served_claim();
        bad["status"]["reservedFor"] = serde_json::json!("pods");
        assert!(serde_json::from_value::<ReadClaim>(bad).is_err());
    }

    #[test]
    fn a_read_claim_has_the_resource_claim_url() {
        use kube::Resource as _;
        assert_eq!(
            ReadClaim::url_path(&(), Some("team")),
            ResourceClaim::url_path(&(), Some("team"))
        );
        assert_eq!(ReadClaim::api_version(&()), ResourceClaim::api_version(&()));
    }

    #[test]
    fn empty_fields_are_named() {
        let c = dra_v1::Claim {
            namespace: "ns".into(),
            uid: "u".into(),
            name: String::new(),
        };
        let e = ClaimRef::try_from(c).unwrap_err();
        assert_eq!(e.field, "name");
        let ok = ClaimRef::try_from(dra_v1beta1::Claim {
            namespace: "ns".into(),
            uid: "u".into(),
            name: "n".into(),
        })
        .unwrap();
        assert_eq!(ok.to_string(), "ns/n (u)");
    }
}

/// A ResourceClaim as the plugin reads it from the API server: its `spec`
/// and `status` whole, and of its metadata only name, namespace and UID. The
/// rest of the metadata (above all `managedFields`, one entry per writer with
/// the set of fields it owns; the owner reference, annotations, finalizers)
/// is skipped while the response is parsed, not parsed and then dropped.
/// Requests go to the same URL as for `ResourceClaim`.
#[derive(Clone, Debug, Default)]
pub struct ReadClaim(pub ResourceClaim);

impl<'de> serde::Deserialize<'de> for ReadClaim {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        struct Meta {
            name: Option<String>,
            namespace: Option<String>,
            uid: Option<String>,
        }
        #[derive(serde::Deserialize)]
        struct Read {
            metadata: Meta,
            #[serde(default)]
            spec: ResourceClaimSpec,
            status: Option<ResourceClaimStatus>,
        }
        let r = Read::deserialize(d)?;
        Ok(Self(ResourceClaim {
            metadata: ObjectMeta {
                name: r.metadata.name,
                namespace: r.metadata.namespace,
                uid: r.metadata.uid,
                ..ObjectMeta::default()
            },
            spec: r.spec,
            status: r.status,
        }))
    }
}

impl kube::Resource for ReadClaim {
    type DynamicType = ();
    type Scope = <ResourceClaim as kube::Resource>::Scope;

    fn kind(dt: &()) -> Cow<'_, str> {
        <ResourceClaim as kube::Resource>::kind(dt)
    }
    fn group(dt: &()) -> Cow<'_, str> {
        <ResourceClaim as kube::Resource>::group(dt)
    }
    fn version(dt: &()) -> Cow<'_, str> {
        <ResourceClaim as kube::Resource>::version(dt)
    }
    fn plural(dt: &()) -> Cow<'_, str> {
        <ResourceClaim as kube::Resource>::plural(dt)
    }
    fn meta(&self) -> &ObjectMeta {
        &self.0.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.0.metadata
    }
}
