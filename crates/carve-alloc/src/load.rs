//! Reading ResourceSlices, DeviceClasses and ResourceClaims from YAML files.

use std::path::{Path, PathBuf};

use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use serde::Deserialize;

use crate::alloc::Inputs;

/// One object of an input file.
#[derive(Debug, Clone)]
pub enum Object {
    /// A `resource.k8s.io/v1` ResourceSlice.
    Slice(ResourceSlice),
    /// A `resource.k8s.io/v1` DeviceClass.
    Class(DeviceClass),
    /// A `resource.k8s.io/v1` ResourceClaim.
    Claim(ResourceClaim),
}

/// Why a file could not be loaded; every variant names the file, and the
/// document (0-based) where there is one.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A document is not YAML.
    #[error("{} document {index}: not valid YAML: {msg}", path.display())]
    Yaml {
        /// The file.
        path: PathBuf,
        /// The document index.
        index: usize,
        /// The parser's message.
        msg: String,
    },
    /// A document has no `apiVersion` or `kind`.
    #[error("{} document {index}: missing {field}", path.display())]
    MissingType {
        /// The file.
        path: PathBuf,
        /// The document index.
        index: usize,
        /// `apiVersion` or `kind`.
        field: &'static str,
    },
    /// A document is of a type this tool does not read.
    #[error("{} document {index}: unsupported object {api_version}/{kind} (expected resource.k8s.io/v1 ResourceSlice, DeviceClass or ResourceClaim)", path.display())]
    UnknownKind {
        /// The file.
        path: PathBuf,
        /// The document index.
        index: usize,
        /// Its apiVersion.
        api_version: String,
        /// Its kind.
        kind: String,
    },
    /// A document does not match its type's schema.
    #[error("{} document {index} ({kind}): field {field}: {msg}", path.display())]
    Decode {
        /// The file.
        path: PathBuf,
        /// The document index.
        index: usize,
        /// Its kind.
        kind: String,
        /// The path of the offending field (`.` when at the top).
        field: String,
        /// What was wrong.
        msg: String,
    },
}

fn decode<T: serde::de::DeserializeOwned>(
    path: &Path,
    index: usize,
    kind: &str,
    value: serde_yaml::Value,
) -> Result<T, LoadError> {
    serde_path_to_error::deserialize(value).map_err(|e| LoadError::Decode {
        path: path.to_path_buf(),
        index,
        kind: kind.to_string(),
        field: e.path().to_string(),
        msg: e.inner().to_string(),
    })
}

/// Parses multi-document YAML text; `path` only names the source in errors.
pub fn parse_yaml_documents(path: &Path, text: &str) -> Result<Vec<Object>, LoadError> {
    let mut out = Vec::new();
    for (index, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let value = serde_yaml::Value::deserialize(doc).map_err(|e| LoadError::Yaml {
            path: path.to_path_buf(),
            index,
            msg: e.to_string(),
        })?;
        if value.is_null() {
            continue;
        }
        let field = |name: &'static str| -> Result<String, LoadError> {
            value
                .get(name)
                .and_then(|v| v.as_str())
                .map(str::to_string)
                .ok_or(LoadError::MissingType {
                    path: path.to_path_buf(),
                    index,
                    field: name,
                })
        };
        let api_version = field("apiVersion")?;
        let kind = field("kind")?;
        let obj = match (api_version.as_str(), kind.as_str()) {
            ("resource.k8s.io/v1", "ResourceSlice") => {
                Object::Slice(decode(path, index, &kind, value)?)
            }
            ("resource.k8s.io/v1", "DeviceClass") => {
                Object::Class(decode(path, index, &kind, value)?)
            }
            ("resource.k8s.io/v1", "ResourceClaim") => {
                Object::Claim(decode(path, index, &kind, value)?)
            }
            _ => {
                return Err(LoadError::UnknownKind {
                    path: path.to_path_buf(),
                    index,
                    api_version,
                    kind,
                });
            }
        };
        out.push(obj);
    }
    Ok(out)
}

/// Reads a multi-document YAML file of ResourceSlices, DeviceClasses and
/// ResourceClaims.
pub fn load_yaml_documents(path: impl AsRef<Path>) -> Result<Vec<Object>, LoadError> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_yaml_documents(path, &text)
}

impl Inputs {
    /// Sorts objects into inputs; claims with `status.allocation` become
    /// allocated claims, the others are returned as claims to allocate.
    pub fn from_objects(objects: impl IntoIterator<Item = Object>) -> (Inputs, Vec<ResourceClaim>) {
        let mut inputs = Inputs::default();
        let mut pending = Vec::new();
        for o in objects {
            match o {
                Object::Slice(s) => inputs.slices.push(s),
                Object::Class(c) => inputs.classes.push(c),
                Object::Claim(c) => {
                    if c.status
                        .as_ref()
                        .and_then(|s| s.allocation.as_ref())
                        .is_some()
                    {
                        inputs.claims_allocated.push(c);
                    } else {
                        pending.push(c);
                    }
                }
            }
        }
        (inputs, pending)
    }
}
