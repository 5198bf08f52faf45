//! The resources this server serves and what is special about each.

use std::fmt;
use std::str::FromStr;

/// API group of every served resource.
pub const GROUP: &str = "resource.k8s.io";
/// API version of every served resource.
pub const VERSION: &str = "v1";
/// `apiVersion` value objects must carry.
pub const API_VERSION: &str = "resource.k8s.io/v1";

/// A resource served under `/apis/resource.k8s.io/v1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Resource {
    /// `resourceslices`, cluster-scoped.
    ResourceSlices,
    /// `resourceclaims`, namespaced, with a `status` subresource.
    ResourceClaims,
    /// `deviceclasses`, cluster-scoped.
    DeviceClasses,
}

impl Resource {
    /// Every served resource.
    pub const ALL: [Resource; 3] = [
        Resource::DeviceClasses,
        Resource::ResourceClaims,
        Resource::ResourceSlices,
    ];

    /// Plural (URL) name, e.g. `resourceslices`.
    pub fn plural(self) -> &'static str {
        match self {
            Resource::ResourceSlices => "resourceslices",
            Resource::ResourceClaims => "resourceclaims",
            Resource::DeviceClasses => "deviceclasses",
        }
    }

    /// Singular name, e.g. `resourceslice`.
    pub fn singular(self) -> &'static str {
        match self {
            Resource::ResourceSlices => "resourceslice",
            Resource::ResourceClaims => "resourceclaim",
            Resource::DeviceClasses => "deviceclass",
        }
    }

    /// `kind` of one object, e.g. `ResourceSlice`.
    pub fn kind(self) -> &'static str {
        match self {
            Resource::ResourceSlices => "ResourceSlice",
            Resource::ResourceClaims => "ResourceClaim",
            Resource::DeviceClasses => "DeviceClass",
        }
    }

    /// `kind` of a list, e.g. `ResourceSliceList`.
    pub fn list_kind(self) -> String {
        format!("{}List", self.kind())
    }

    /// Whether objects live in a namespace.
    pub fn namespaced(self) -> bool {
        matches!(self, Resource::ResourceClaims)
    }

    /// Whether the resource has a `status` subresource (so that the main
    /// endpoint ignores `.status` and `/status` changes only `.status`).
    pub fn has_status(self) -> bool {
        matches!(self, Resource::ResourceClaims)
    }

    /// Field-selector keys accepted besides `metadata.name` and `metadata.namespace`.
    pub fn extra_fields(self) -> &'static [&'static str] {
        match self {
            Resource::ResourceSlices => &["spec.nodeName", "spec.driver", "spec.pool.name"],
            Resource::ResourceClaims | Resource::DeviceClasses => &[],
        }
    }

    /// `<plural>.<group>`, as Kubernetes names a resource in messages.
    pub fn qualified(self) -> String {
        format!("{}.{}", self.plural(), GROUP)
    }
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.plural())
    }
}

/// A resource name that this server does not serve.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown resource {0:?} (served: deviceclasses, resourceclaims, resourceslices)")]
pub struct UnknownResource(pub String);

impl FromStr for Resource {
    type Err = UnknownResource;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Resource::ALL
            .into_iter()
            .find(|r| r.plural() == s || r.singular() == s || r.kind() == s)
            .ok_or_else(|| UnknownResource(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plural_singular_and_kind() {
        for r in Resource::ALL {
            assert_eq!(r.plural().parse::<Resource>(), Ok(r));
            assert_eq!(r.singular().parse::<Resource>(), Ok(r));
            assert_eq!(r.kind().parse::<Resource>(), Ok(r));
        }
        assert_eq!(
            "pods".parse::<Resource>(),
            Err(UnknownResource("pods".into()))
        );
    }
}
