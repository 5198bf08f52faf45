//! Reading ResourceSlices, DeviceClasses and ResourceClaims from YAML files.

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;

use crate::alloc::Inputs;

/// One object of an input file.
#[derive(Debug, Clone)]
pub enum Object {
    /// A `resource.k8s.io/v1` ResourceSlice.
    Slice(ResourceSlice),
    /// A `resource.k8s.io/v1` DeviceClass.
    Class(DeviceClass),
    /// A `resource.k8s.io/v1` ResourceClaim, or the claim a
    /// `ResourceClaimTemplate` stands for (named after the template, with its
    /// `spec.spec`, as the claim controller would create it for a pod).
    Claim(ResourceClaim),
    /// A `v1` Pod, as users write it next to the `ResourceClaimTemplate` its
    /// `spec.resourceClaims` name. Decoded as strictly as the others; the
    /// allocator does not read it ([`Inputs::from_objects`] leaves it out).
    Pod(Box<Pod>),
}

/// Why a file could not be loaded; every variant names the file, and the
/// document (0-based) where there is one.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    /// The message names the OS error; it is not also the error's `source`,
    /// or a printed chain would say it twice.
    #[error("{}: {error}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        error: std::io::Error,
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
    #[error("{} document {index}{}: unsupported object {api_version}/{kind} (expected resource.k8s.io/v1 ResourceSlice, DeviceClass, ResourceClaim or ResourceClaimTemplate, a v1 Pod, or a v1 List of them)", path.display(), item_suffix(*item))]
    UnknownKind {
        /// The file.
        path: PathBuf,
        /// The document index.
        index: usize,
        /// The item of a `kind: List` document, where it is one.
        item: Option<usize>,
        /// Its apiVersion.
        api_version: String,
        /// Its kind.
        kind: String,
    },
    /// A document does not match its type's schema.
    #[error("{} document {index}{} ({kind}): field {field}: {msg}", path.display(), item_suffix(*item))]
    Decode {
        /// The file.
        path: PathBuf,
        /// The document index.
        index: usize,
        /// The item of a `kind: List` document, where it is one.
        item: Option<usize>,
        /// Its kind.
        kind: String,
        /// The path of the offending field (`.` when at the top).
        field: String,
        /// What was wrong.
        msg: String,
    },
    /// A document has a field its type does not have (a typo such as
    /// `selector:` for `selectors:`). The API server rejects such an object
    /// (`kubectl apply` fails with "unknown field"), so it is refused here
    /// rather than read without the field.
    #[error("{} document {index}{} ({kind}): unknown field {field:?}", path.display(), item_suffix(*item))]
    UnknownField {
        /// The file.
        path: PathBuf,
        /// The document index.
        index: usize,
        /// The item of a `kind: List` document, where it is one.
        item: Option<usize>,
        /// Its kind.
        kind: String,
        /// The field's path, e.g. `spec.devices.requests.0.exactly.selector`.
        field: String,
    },
    /// A `kind: List` document whose `items` is missing or not a list.
    #[error("{} document {index} (List): items: {msg}", path.display())]
    BadList {
        /// The file.
        path: PathBuf,
        /// The document index.
        index: usize,
        /// What was wrong.
        msg: &'static str,
    },
}

fn item_suffix(item: Option<usize>) -> String {
    item.map(|i| format!(" item {i}")).unwrap_or_default()
}

/// Where an object sits in a file: its document and, inside a `kind: List`
/// document, its item.
#[derive(Clone, Copy)]
struct At<'a> {
    path: &'a Path,
    index: usize,
    item: Option<usize>,
}

/// `spec.devices.requests.0.exactly.selector`: the map keys and list indexes
/// of an ignored field, without serde's `Option`/newtype layers.
fn field_path(p: &serde_ignored::Path<'_>) -> String {
    use serde_ignored::Path;
    let join = |parent: &Path<'_>, last: String| match field_path(parent) {
        up if up.is_empty() => last,
        up => format!("{up}.{last}"),
    };
    match p {
        Path::Root => String::new(),
        Path::Seq { parent, index } => join(parent, index.to_string()),
        Path::Map { parent, key } => join(parent, key.clone()),
        Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => field_path(parent),
    }
}

/// Decodes one object strictly: a field that the type does not have is an
/// error naming it, as the API server's strict decoding makes it.
fn decode<T: serde::de::DeserializeOwned>(
    at: At<'_>,
    kind: &str,
    value: serde_norway::Value,
) -> Result<T, LoadError> {
    let mut unknown: Option<String> = None;
    let mut note = |field: serde_ignored::Path<'_>| {
        unknown.get_or_insert_with(|| field_path(&field));
    };
    let strict = serde_ignored::Deserializer::new(value, &mut note);
    let decoded = serde_path_to_error::deserialize(strict).map_err(|e| LoadError::Decode {
        path: at.path.to_path_buf(),
        index: at.index,
        item: at.item,
        kind: kind.to_string(),
        field: e.path().to_string(),
        msg: e.inner().to_string(),
    })?;
    match unknown {
        Some(field) => Err(LoadError::UnknownField {
            path: at.path.to_path_buf(),
            index: at.index,
            item: at.item,
            kind: kind.to_string(),
            field,
        }),
        None => Ok(decoded),
    }
}

/// The claim the claim controller creates from a template (its spec; named
/// after the template, in the template's namespace).
fn claim_from_template(t: ResourceClaimTemplate) -> ResourceClaim {
    let labelled = t.spec.metadata.unwrap_or_default();
    ResourceClaim {
        metadata: ObjectMeta {
            name: t.metadata.name,
            namespace: t.metadata.namespace,
            labels: labelled.labels,
            annotations: labelled.annotations,
            ..ObjectMeta::default()
        },
        spec: t.spec.spec,
        status: None,
    }
}

fn type_field(
    at: At<'_>,
    value: &serde_norway::Value,
    name: &'static str,
) -> Result<String, LoadError> {
    value
        .get(name)
        .and_then(|v| v.as_str())
        .map(str::to_string)
        .ok_or(LoadError::MissingType {
            path: at.path.to_path_buf(),
            index: at.index,
            field: name,
        })
}

/// Decodes one object, or each item of a `v1 List` (what `kubectl get -o
/// yaml` prints for several objects).
fn decode_object(
    at: At<'_>,
    value: serde_norway::Value,
    out: &mut Vec<Object>,
) -> Result<(), LoadError> {
    let api_version = type_field(at, &value, "apiVersion")?;
    let kind = type_field(at, &value, "kind")?;
    let obj = match (api_version.as_str(), kind.as_str()) {
        ("v1", "List") if at.item.is_none() => {
            let bad = |msg| LoadError::BadList {
                path: at.path.to_path_buf(),
                index: at.index,
                msg,
            };
            let serde_norway::Value::Mapping(mut map) = value else {
                return Err(bad("not a mapping"));
            };
            let items = match map.remove("items") {
                Some(serde_norway::Value::Sequence(items)) => items,
                Some(serde_norway::Value::Null) | None => Vec::new(),
                Some(_) => return Err(bad("not a list")),
            };
            for (i, item) in items.into_iter().enumerate() {
                decode_object(
                    At {
                        item: Some(i),
                        ..at
                    },
                    item,
                    out,
                )?;
            }
            return Ok(());
        }
        ("v1", "Pod") => Object::Pod(Box::new(decode(at, &kind, value)?)),
        ("resource.k8s.io/v1", "ResourceSlice") => Object::Slice(decode(at, &kind, value)?),
        ("resource.k8s.io/v1", "DeviceClass") => Object::Class(decode(at, &kind, value)?),
        ("resource.k8s.io/v1", "ResourceClaim") => Object::Claim(decode(at, &kind, value)?),
        ("resource.k8s.io/v1", "ResourceClaimTemplate") => {
            Object::Claim(claim_from_template(decode(at, &kind, value)?))
        }
        _ => {
            return Err(LoadError::UnknownKind {
                path: at.path.to_path_buf(),
                index: at.index,
                item: at.item,
                api_version,
                kind,
            });
        }
    };
    out.push(obj);
    Ok(())
}

/// Parses multi-document YAML text; `path` only names the source in errors.
///
/// Every object is decoded strictly (an unknown field is an error naming it);
/// a `v1 List` contributes its items, and a `ResourceClaimTemplate` the claim
/// made from it.
pub fn parse_yaml_documents(path: &Path, text: &str) -> Result<Vec<Object>, LoadError> {
    let mut out = Vec::new();
    for (index, doc) in serde_norway::Deserializer::from_str(text).enumerate() {
        let value = serde_norway::Value::deserialize(doc).map_err(|e| LoadError::Yaml {
            path: path.to_path_buf(),
            index,
            msg: e.to_string(),
        })?;
        if value.is_null() {
            continue;
        }
        decode_object(
            At {
                path,
                index,
                item: None,
            },
            value,
            &mut out,
        )?;
    }
    Ok(out)
}

/// Reads a multi-document YAML file of ResourceSlices, DeviceClasses and
/// ResourceClaims.
pub fn load_yaml_documents(path: impl AsRef<Path>) -> Result<Vec<Object>, LoadError> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|error| LoadError::Io {
        path: path.to_path_buf(),
        error,
    })?;
    parse_yaml_documents(path, &text)
}

impl Inputs {
    /// Sorts objects into inputs; claims with `status.allocation` become
    /// allocated claims, the others are returned as claims to allocate. Pods
    /// are left out (their claims come from the templates beside them).
    pub fn from_objects(objects: impl IntoIterator<Item = Object>) -> (Inputs, Vec<ResourceClaim>) {
        let mut inputs = Inputs::default();
        let mut pending = Vec::new();
        for o in objects {
            match o {
                Object::Slice(s) => inputs.slices.push(s),
                Object::Class(c) => inputs.classes.push(c),
                Object::Pod(_) => {}
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
