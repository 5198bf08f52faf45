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

/// The longest namespace the API server accepts: a DNS-1123 label.
pub const MAX_NAMESPACE_LEN: usize = 63;
/// The longest ResourceClaim name the API server accepts: a DNS-1123
/// subdomain (`NameIsDNSSubdomain`).
pub const MAX_NAME_LEN: usize = 253;
/// The longest UID the plugin takes. The API server assigns 36-character
/// UUIDs; the UID names the claim's CDI spec and checkpoint record.
pub const MAX_UID_LEN: usize = 128;

/// What is wrong with a field of a claim in a kubelet request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldProblem {
    /// The field is empty.
    Empty,
    /// The field is longer than any the API server accepts: no such claim
    /// can exist, so the plugin does not ask for it.
    TooLong {
        /// Its length in bytes.
        len: usize,
        /// The most allowed.
        max: usize,
    },
}

/// A claim in a kubelet request with a field missing or too long.
///
/// The message shows each field at most [`SHOWN`] bytes long (a longer one
/// cut, with its length), so a claim with a huge field gets a short error:
/// the kubelet takes responses of 4 MiB at most.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("claim {}/{} uid {}: field {field} {}", shown(namespace), shown(name), shown(uid), describe(*problem))]
pub struct InvalidClaim {
    /// Namespace as sent.
    pub namespace: String,
    /// Name as sent.
    pub name: String,
    /// UID as sent.
    pub uid: String,
    /// The offending field.
    pub field: &'static str,
    /// What is wrong with it.
    pub problem: FieldProblem,
}

/// How many bytes of a field an [`InvalidClaim`] message shows.
pub const SHOWN: usize = 64;

/// `s` quoted, cut to [`SHOWN`] bytes as escaped (at a character boundary)
/// with its length when longer.
fn shown(s: &str) -> String {
    // Counted as escaped: a control character escapes to up to ten bytes
    // (`\u{10ffff}`), so cutting the raw bytes alone would not bound it.
    let (mut end, mut width) = (0, 0);
    for (i, c) in s.char_indices() {
        let w: usize = c.escape_debug().map(char::len_utf8).sum();
        if width + w > SHOWN {
            break;
        }
        width += w;
        end = i + c.len_utf8();
    }
    if end == s.len() {
        format!("{s:?}")
    } else {
        format!("{:?}... ({} bytes)", &s[..end], s.len())
    }
}

fn describe(p: FieldProblem) -> String {
    match p {
        FieldProblem::Empty => "is empty".to_string(),
        FieldProblem::TooLong { len, max } => {
            format!("is {len} bytes long, longer than the {max} the API server allows")
        }
    }
}

fn convert(namespace: String, name: String, uid: String) -> Result<ClaimRef, InvalidClaim> {
    let check = |field: &'static str, v: &str, max: usize| {
        if v.is_empty() {
            Some((field, FieldProblem::Empty))
        } else if v.len() > max {
            Some((field, FieldProblem::TooLong { len: v.len(), max }))
        } else {
            None
        }
    };
    let bad = check("uid", &uid, MAX_UID_LEN)
        .or_else(|| check("namespace", &namespace, MAX_NAMESPACE_LEN))
        .or_else(|| check("name", &name, MAX_NAME_LEN));
    match bad {
        Some((field, problem)) => Err(InvalidClaim {
            namespace,
            name,
            uid,
            field,
            problem,
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
    fn fields_of_control_characters_stay_bounded_once_escaped() {
        // Found by cargo fuzz (kubelet_claim): 64 bytes of \x10 escape to
        // 384, three such fields past 1 KiB.
        let ctl = "\u{10}".repeat(300);
        let e = ClaimRef::try_from(dra_v1::Claim {
            namespace: ctl.clone(),
            name: ctl.clone(),
            uid: ctl,
        })
        .unwrap_err()
        .to_string();
        assert!(e.len() < 512, "{} bytes: {e}", e.len());
        assert!(e.contains("(300 bytes)"), "{e}");
        assert_eq!(shown("ab"), "\"ab\"");
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
        assert_eq!(e.problem, FieldProblem::Empty);
        assert_eq!(
            e.to_string(),
            r#"claim "ns"/"" uid "u": field name is empty"#
        );
        let ok = ClaimRef::try_from(dra_v1beta1::Claim {
            namespace: "ns".into(),
            uid: "u".into(),
            name: "n".into(),
        })
        .unwrap();
        assert_eq!(ok.to_string(), "ns/n (u)");
    }

    #[test]
    fn fields_longer_than_the_api_server_allows_are_refused_with_a_short_error() {
        let claim = |ns: &str, name: &str, uid: &str| dra_v1::Claim {
            namespace: ns.into(),
            name: name.into(),
            uid: uid.into(),
        };
        // The longest each field may be is accepted.
        let ok = claim(
            &"n".repeat(MAX_NAMESPACE_LEN),
            &"c".repeat(MAX_NAME_LEN),
            &"u".repeat(MAX_UID_LEN),
        );
        assert!(ClaimRef::try_from(ok).is_ok());
        for (c, field, len, max) in [
            (
                claim("ns", &"c".repeat(MAX_NAME_LEN + 1), "u"),
                "name",
                MAX_NAME_LEN + 1,
                MAX_NAME_LEN,
            ),
            (
                claim(&"n".repeat(100), "c", "u"),
                "namespace",
                100,
                MAX_NAMESPACE_LEN,
            ),
            (
                claim("ns", "c", &"u".repeat(4096)),
                "uid",
                4096,
                MAX_UID_LEN,
            ),
        ] {
            let e = ClaimRef::try_from(c).unwrap_err();
            assert_eq!(
                (e.field, e.problem),
                (field, FieldProblem::TooLong { len, max })
            );
            let msg = e.to_string();
            assert!(
                msg.contains(&format!(
                    "field {field} is {len} bytes long, longer than the {max}"
                )),
                "{msg}"
            );
            assert!(msg.contains(&format!("... ({len} bytes)")), "{msg}");
            assert!(msg.len() < 400, "{} bytes: {msg}", msg.len());
        }
        // A multi-byte character at the cut is not split.
        let wide = format!("a{}", "é".repeat(200));
        let e = ClaimRef::try_from(claim("ns", &wide, "u")).unwrap_err();
        let cut = format!("a{}", "é".repeat((SHOWN - 1) / 2));
        assert!(
            e.to_string().contains(&format!("{cut:?}... (401 bytes)")),
            "{e}"
        );
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
