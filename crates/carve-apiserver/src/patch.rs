//! JSON merge patch (RFC 7386) and JSON patch (RFC 6902) over `serde_json::Value`.

use serde_json::{Map, Value};

/// Why a patch could not be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatchError {
    /// The patch document has the wrong shape.
    #[error("malformed patch: {0}")]
    Malformed(String),
    /// Operation number `index` of a JSON patch failed.
    #[error("JSON patch operation {index} ({op} {path}) failed: {reason}")]
    OpFailed {
        /// Zero-based index of the operation.
        index: usize,
        /// The `op` value.
        op: String,
        /// The `path` value.
        path: String,
        /// What went wrong.
        reason: String,
    },
}

/// Applies an RFC 7386 merge patch to `target` in place.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = Value::Object(Map::new());
            }
            if let Value::Object(t) = target {
                for (k, v) in p {
                    if v.is_null() {
                        t.remove(k);
                    } else {
                        merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                    }
                }
            }
        }
        other => *target = other.clone(),
    }
}

/// Finds a key starting with `$` (a strategic-merge-patch directive), if any.
pub fn find_directive(patch: &Value) -> Option<String> {
    match patch {
        Value::Object(m) => m.iter().find_map(|(k, v)| {
            if k.starts_with('$') {
                Some(k.clone())
            } else {
                find_directive(v)
            }
        }),
        Value::Array(a) => a.iter().find_map(find_directive),
        _ => None,
    }
}

fn parse_pointer(path: &str) -> Result<Vec<String>, String> {
    if path.is_empty() {
        return Ok(Vec::new());
    }
    let rest = path
        .strip_prefix('/')
        .ok_or_else(|| format!("path {path:?} does not start with '/'"))?;
    Ok(rest
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect())
}

fn array_index(token: &str, len: usize, allow_end: bool) -> Result<usize, String> {
    if allow_end && token == "-" {
        return Ok(len);
    }
    let i: usize = token
        .parse()
        .map_err(|_| format!("{token:?} is not an array index"))?;
    let max = if allow_end {
        len
    } else {
        len.saturating_sub(1)
    };
    if i > max || (!allow_end && len == 0) {
        return Err(format!("index {i} out of bounds (length {len})"));
    }
    Ok(i)
}

fn parent_mut<'a>(doc: &'a mut Value, tokens: &[String]) -> Result<&'a mut Value, String> {
    let mut cur = doc;
    for t in tokens {
        cur = match cur {
            Value::Object(m) => m.get_mut(t).ok_or_else(|| format!("no member {t:?}"))?,
            Value::Array(a) => {
                let i = array_index(t, a.len(), false)?;
                &mut a[i]
            }
            _ => return Err(format!("cannot descend into a scalar at {t:?}")),
        };
    }
    Ok(cur)
}

fn get<'a>(doc: &'a Value, tokens: &[String]) -> Result<&'a Value, String> {
    let mut cur = doc;
    for t in tokens {
        cur = match cur {
            Value::Object(m) => m.get(t).ok_or_else(|| format!("no member {t:?}"))?,
            Value::Array(a) => &a[array_index(t, a.len(), false)?],
            _ => return Err(format!("cannot descend into a scalar at {t:?}")),
        };
    }
    Ok(cur)
}

fn add(doc: &mut Value, tokens: &[String], value: Value) -> Result<(), String> {
    let Some((last, parent)) = tokens.split_last() else {
        *doc = value;
        return Ok(());
    };
    match parent_mut(doc, parent)? {
        Value::Object(m) => {
            m.insert(last.clone(), value);
            Ok(())
        }
        Value::Array(a) => {
            let i = array_index(last, a.len(), true)?;
            a.insert(i, value);
            Ok(())
        }
        _ => Err("parent is not an object or array".into()),
    }
}

fn remove(doc: &mut Value, tokens: &[String]) -> Result<Value, String> {
    let (last, parent) = tokens
        .split_last()
        .ok_or_else(|| "cannot remove the whole document".to_string())?;
    match parent_mut(doc, parent)? {
        Value::Object(m) => m.remove(last).ok_or_else(|| format!("no member {last:?}")),
        Value::Array(a) => {
            let i = array_index(last, a.len(), false)?;
            Ok(a.remove(i))
        }
        _ => Err("parent is not an object or array".into()),
    }
}

/// Applies an RFC 6902 JSON patch (an array of operations) to a copy of
/// `doc`; `doc` is left untouched when any operation fails.
pub fn json_patch(doc: &Value, patch: &Value) -> Result<Value, PatchError> {
    let ops = patch.as_array().ok_or_else(|| {
        PatchError::Malformed("a JSON patch must be an array of operations".into())
    })?;
    let mut out = doc.clone();
    for (index, op) in ops.iter().enumerate() {
        let field = |name: &str| op.get(name).and_then(Value::as_str).map(str::to_string);
        let opname = field("op").unwrap_or_default();
        let path = field("path").ok_or_else(|| {
            PatchError::Malformed(format!("operation {index} has no string \"path\""))
        })?;
        let fail = |reason: String| PatchError::OpFailed {
            index,
            op: opname.clone(),
            path: path.clone(),
            reason,
        };
        let tokens = parse_pointer(&path).map_err(fail)?;
        let value = || {
            op.get("value")
                .cloned()
                .ok_or_else(|| fail("missing \"value\"".into()))
        };
        let from = || {
            field("from")
                .ok_or_else(|| fail("missing \"from\"".into()))
                .and_then(|f| parse_pointer(&f).map_err(fail))
        };
        match opname.as_str() {
            "add" => add(&mut out, &tokens, value()?).map_err(fail)?,
            "remove" => {
                remove(&mut out, &tokens).map_err(fail)?;
            }
            "replace" => {
                let v = value()?;
                let target = parent_mut(&mut out, &tokens).map_err(fail)?;
                *target = v;
            }
            "move" => {
                let from = from()?;
                if tokens.starts_with(&from) && tokens.len() > from.len() {
                    return Err(fail("cannot move a value into its own child".into()));
                }
                let v = remove(&mut out, &from).map_err(fail)?;
                add(&mut out, &tokens, v).map_err(fail)?;
            }
            "copy" => {
                let v = get(&out, &from()?).map_err(fail)?.clone();
                add(&mut out, &tokens, v).map_err(fail)?;
            }
            "test" => {
                let expected = value()?;
                let actual = get(&out, &tokens).map_err(fail)?;
                if *actual != expected {
                    return Err(fail(format!("value is {actual}, expected {expected}")));
                }
            }
            other => {
                return Err(PatchError::Malformed(format!(
                    "operation {index} has unknown op {other:?}"
                )));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_patch_rfc7386_examples() {
        let mut t = json!({"a": "b", "c": {"d": "e", "f": "g"}});
        merge_patch(&mut t, &json!({"a": "z", "c": {"f": null}}));
        assert_eq!(t, json!({"a": "z", "c": {"d": "e"}}));
        let mut t = json!({"a": [1, 2]});
        merge_patch(&mut t, &json!({"a": [3]}));
        assert_eq!(t, json!({"a": [3]}));
    }

    #[test]
    fn json_patch_ops() {
        let doc = json!({"a": {"b": [1, 2]}, "c": "x"});
        let out = json_patch(
            &doc,
            &json!([
                {"op": "add", "path": "/a/b/-", "value": 3},
                {"op": "replace", "path": "/c", "value": "y"},
                {"op": "copy", "from": "/c", "path": "/d"},
                {"op": "move", "from": "/d", "path": "/e~1f"},
                {"op": "remove", "path": "/a/b/0"},
                {"op": "test", "path": "/a/b", "value": [2, 3]}
            ]),
        )
        .unwrap();
        assert_eq!(out, json!({"a": {"b": [2, 3]}, "c": "y", "e/f": "y"}));
    }

    #[test]
    fn json_patch_failure_names_operation() {
        let doc = json!({"a": 1});
        let err = json_patch(&doc, &json!([{"op": "test", "path": "/a", "value": 2}])).unwrap_err();
        assert!(
            matches!(err, PatchError::OpFailed { index: 0, .. }),
            "{err}"
        );
        let err = json_patch(&doc, &json!([{"op": "remove", "path": "/zz"}])).unwrap_err();
        assert!(err.to_string().contains("/zz"), "{err}");
        assert!(json_patch(&doc, &json!({"op": "add"})).is_err());
    }

    #[test]
    fn directives_are_found() {
        assert_eq!(
            find_directive(&json!({"spec": {"$patch": "replace"}})),
            Some("$patch".into())
        );
        assert_eq!(find_directive(&json!({"spec": {"a": [1]}})), None);
    }
}
