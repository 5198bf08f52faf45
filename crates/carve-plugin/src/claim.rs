//! Wire ↔ domain conversion of claims and prepared devices.

use carve_proto::{dra_v1, dra_v1beta1};

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
