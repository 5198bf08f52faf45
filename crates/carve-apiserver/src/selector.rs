//! Label and field selectors as the Kubernetes list/watch query strings spell them.

use serde_json::Value;

use crate::resource::Resource;

/// Why a selector string was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    /// A label selector could not be parsed.
    #[error("invalid label selector {selector:?}: {reason}")]
    Label {
        /// The whole selector string.
        selector: String,
        /// What was wrong.
        reason: String,
    },
    /// A field selector term could not be parsed.
    #[error("invalid field selector {selector:?}: {reason}")]
    Field {
        /// The whole selector string.
        selector: String,
        /// What was wrong.
        reason: String,
    },
    /// A field selector names a field this resource does not support.
    #[error("field label not supported: {field}")]
    UnsupportedField {
        /// The field label, e.g. `spec.foo`.
        field: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum LabelReq {
    Exists(String),
    NotExists(String),
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A parsed label selector: every requirement must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(Vec<LabelReq>);

fn valid_key(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 317
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'))
}

fn valid_value(v: &str) -> bool {
    v.len() <= 63
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// Splits on commas that are not inside parentheses.
fn split_top_level(s: &str) -> Option<Vec<&str>> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.checked_sub(1)?,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return None;
    }
    parts.push(&s[start..]);
    Some(parts)
}

impl LabelSelector {
    /// Parses `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`, comma-joined.
    pub fn parse(selector: &str) -> Result<Self, SelectorError> {
        let err = |reason: String| SelectorError::Label {
            selector: selector.to_string(),
            reason,
        };
        if selector.trim().is_empty() {
            return Ok(LabelSelector::default());
        }
        let parts =
            split_top_level(selector).ok_or_else(|| err("unbalanced parentheses".into()))?;
        let mut reqs = Vec::new();
        for part in parts {
            let part = part.trim();
            if part.is_empty() {
                return Err(err("empty requirement".into()));
            }
            let check_key = |k: &str| {
                if valid_key(k) {
                    Ok(k.to_string())
                } else {
                    Err(err(format!("invalid label key {k:?}")))
                }
            };
            let check_value = |v: &str| {
                if valid_value(v) {
                    Ok(v.to_string())
                } else {
                    Err(err(format!("invalid label value {v:?}")))
                }
            };
            let req = if let Some(k) = part.strip_prefix('!') {
                LabelReq::NotExists(check_key(k.trim())?)
            } else if let Some((k, v)) = part.split_once("!=") {
                LabelReq::NotEq(check_key(k.trim())?, check_value(v.trim())?)
            } else if let Some((k, v)) = part.split_once("==") {
                LabelReq::Eq(check_key(k.trim())?, check_value(v.trim())?)
            } else if let Some((k, v)) = part.split_once('=') {
                LabelReq::Eq(check_key(k.trim())?, check_value(v.trim())?)
            } else if let Some(open) = part.find('(') {
                let head: Vec<&str> = part[..open].split_whitespace().collect();
                let body = part[open + 1..]
                    .strip_suffix(')')
                    .ok_or_else(|| err(format!("expected ')' at the end of {part:?}")))?;
                let values = body
                    .split(',')
                    .map(|v| check_value(v.trim()))
                    .collect::<Result<Vec<_>, _>>()?;
                match head.as_slice() {
                    [k, "in"] => LabelReq::In(check_key(k)?, values),
                    [k, "notin"] => LabelReq::NotIn(check_key(k)?, values),
                    _ => {
                        return Err(err(format!(
                            "expected `KEY in (..)` or `KEY notin (..)`, got {part:?}"
                        )));
                    }
                }
            } else {
                LabelReq::Exists(check_key(part)?)
            };
            reqs.push(req);
        }
        Ok(LabelSelector(reqs))
    }

    /// Whether the object's `metadata.labels` satisfy every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        let labels = obj.pointer("/metadata/labels").and_then(Value::as_object);
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|req| match req {
            LabelReq::Exists(k) => get(k).is_some(),
            LabelReq::NotExists(k) => get(k).is_none(),
            LabelReq::Eq(k, v) => get(k) == Some(v.as_str()),
            LabelReq::NotEq(k, v) => get(k) != Some(v.as_str()),
            LabelReq::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            LabelReq::NotIn(k, vs) => !get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct FieldReq {
    field: String,
    value: String,
    equal: bool,
}

/// A parsed field selector: every `field=value` / `field!=value` term must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(Vec<FieldReq>);

/// The value of a selectable field of `obj` (`""` when absent, as Kubernetes does).
fn field_value<'a>(obj: &'a Value, field: &str) -> &'a str {
    let pointer = match field {
        "metadata.name" => "/metadata/name",
        "metadata.namespace" => "/metadata/namespace",
        "spec.nodeName" => "/spec/nodeName",
        "spec.driver" => "/spec/driver",
        "spec.pool.name" => "/spec/pool/name",
        _ => return "",
    };
    obj.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

impl FieldSelector {
    /// Parses `f=v`, `f==v`, `f!=v` terms, comma-joined, accepting only the
    /// fields `resource` supports.
    pub fn parse(selector: &str, resource: Resource) -> Result<Self, SelectorError> {
        if selector.trim().is_empty() {
            return Ok(FieldSelector::default());
        }
        let mut reqs = Vec::new();
        for part in selector.split(',') {
            let part = part.trim();
            let (field, value, equal) = if let Some((f, v)) = part.split_once("!=") {
                (f, v, false)
            } else if let Some((f, v)) = part.split_once("==") {
                (f, v, true)
            } else if let Some((f, v)) = part.split_once('=') {
                (f, v, true)
            } else {
                return Err(SelectorError::Field {
                    selector: selector.to_string(),
                    reason: format!("term {part:?} is not FIELD=VALUE or FIELD!=VALUE"),
                });
            };
            let field = field.trim();
            let supported = matches!(field, "metadata.name" | "metadata.namespace")
                || resource.extra_fields().contains(&field);
            if !supported {
                return Err(SelectorError::UnsupportedField {
                    field: field.to_string(),
                });
            }
            reqs.push(FieldReq {
                field: field.to_string(),
                value: value.trim().to_string(),
                equal,
            });
        }
        Ok(FieldSelector(reqs))
    }

    /// Whether `obj` satisfies every term.
    pub fn matches(&self, obj: &Value) -> bool {
        self.0
            .iter()
            .all(|r| (field_value(obj, &r.field) == r.value) == r.equal)
    }
}

/// Label and field selector together.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selectors {
    /// Label requirements.
    pub labels: LabelSelector,
    /// Field requirements.
    pub fields: FieldSelector,
}

impl Selectors {
    /// Whether `obj` satisfies both.
    pub fn matches(&self, obj: &Value) -> bool {
        self.labels.matches(obj) && self.fields.matches(obj)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(labels: Value) -> Value {
        json!({"metadata": {"name": "a", "labels": labels}, "spec": {"nodeName": "n1", "driver": "gpu.carve.dev"}})
    }

    #[test]
    fn label_selector_forms() {
        let o = obj(json!({"app": "x", "tier": "gpu"}));
        let m = |s: &str| LabelSelector::parse(s).unwrap().matches(&o);
        assert!(m(""));
        assert!(m("app=x"));
        assert!(m("app==x,tier=gpu"));
        assert!(!m("app=y"));
        assert!(m("app!=y"));
        assert!(!m("app!=x"));
        assert!(m("missing!=x"));
        assert!(m("app"));
        assert!(!m("missing"));
        assert!(m("!missing"));
        assert!(!m("!app"));
        assert!(m("tier in (cpu, gpu)"));
        assert!(!m("tier notin (cpu,gpu)"));
        assert!(m("missing notin (a)"));
        assert!(m("tier in (gpu),app=x"));
    }

    #[test]
    fn label_selector_rejects_garbage() {
        for bad in [
            "app=x,",
            "a b",
            "tier in (gpu",
            "k=v v",
            "tier foo (a)",
            "bad key=1",
        ] {
            assert!(
                LabelSelector::parse(bad).is_err(),
                "{bad:?} should be rejected"
            );
        }
    }

    #[test]
    fn field_selector_supported_fields_only() {
        let o = obj(json!({}));
        let fs = FieldSelector::parse(
            "spec.nodeName=n1,metadata.name!=b",
            Resource::ResourceSlices,
        )
        .unwrap();
        assert!(fs.matches(&o));
        let fs = FieldSelector::parse("spec.driver=other", Resource::ResourceSlices).unwrap();
        assert!(!fs.matches(&o));
        assert_eq!(
            FieldSelector::parse("spec.nodeName=n1", Resource::ResourceClaims),
            Err(SelectorError::UnsupportedField {
                field: "spec.nodeName".into()
            })
        );
        assert!(matches!(
            FieldSelector::parse("spec.nodeName", Resource::ResourceSlices),
            Err(SelectorError::Field { .. })
        ));
    }
}
