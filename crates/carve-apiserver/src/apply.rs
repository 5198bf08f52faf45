//! Server-side apply of a ResourceClaim's `status.devices`, the one apply a
//! DRA driver makes (carve writes its device status this way, under its own
//! field manager, so that other drivers' entries are never dropped).
//!
//! What the stand-in models, from Kubernetes' "Server-Side Apply" page
//! (kubernetes.io/docs/reference/using-api/server-side-apply) and the
//! `AllocatedDeviceStatus` list type (`+listType=map`, keys driver, device,
//! pool and shareID, `staging/src/k8s.io/api/resource/v1/types.go`):
//! - an apply needs `fieldManager` (400 without it) and a body naming the
//!   object's apiVersion, kind and name;
//! - the entries of `status.devices` in the applied configuration become the
//!   manager's; an entry it owned before and no longer applies is removed;
//!   every other entry stays as it is, whoever wrote it;
//! - an applied entry that exists with other content and is not the
//!   manager's is a conflict (409, "Apply failed with N conflict(s)"),
//!   unless `force=true`, which takes it over;
//! - ownership is recorded in `metadata.managedFields` (operation `Apply`,
//!   subresource `status`, `fieldsV1` with one `k:{...}` key per entry, the
//!   key's fields in JSON with sorted names, as the API server writes them).
//!
//! Simplified: ownership is per entry, not per field inside an entry (carve
//! owns its entries whole); writes other than apply record no ownership, so
//! an entry nobody applied counts as someone else's; nothing else of the
//! object can be applied (415 names what is served).

use serde_json::{Map, Value, json};

use crate::resource::Resource;
use crate::store::ApiError;

/// The key of one `status.devices` entry, as `fieldsV1` writes it:
/// `k:{"device":…,"driver":…,"pool":…}` (plus `shareID` when set).
fn entry_key(entry: &Value) -> String {
    let mut k = Map::new();
    for f in ["device", "driver", "pool", "shareID"] {
        if let Some(v) = entry.get(f).filter(|v| !v.is_null()) {
            k.insert(f.into(), v.clone());
        }
    }
    // serde_json's Map is ordered by key: the sorted names fieldsV1 uses.
    format!("k:{}", Value::Object(k))
}

fn devices(obj: &Value) -> Vec<Value> {
    obj.pointer("/status/devices")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

/// The entry keys `manager` owns on the status subresource.
fn owned(cur: &Value, manager: &str) -> Vec<String> {
    managed_fields(cur)
        .iter()
        .filter(|m| is_entry_of(m, manager))
        .filter_map(|m| m.pointer("/fieldsV1/f:status/f:devices"))
        .filter_map(Value::as_object)
        .flat_map(|o| o.keys().cloned())
        .collect()
}

fn managed_fields(obj: &Value) -> Vec<Value> {
    obj.pointer("/metadata/managedFields")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

fn is_entry_of(m: &Value, manager: &str) -> bool {
    m["manager"] == manager && m["operation"] == "Apply" && m["subresource"] == "status"
}

/// `cur` with `applied` server-side applied to its status by `manager`.
pub(crate) fn apply_claim_status(
    res: Resource,
    name: &str,
    cur: &Value,
    applied: &Value,
    manager: &str,
    force: bool,
) -> Result<Value, ApiError> {
    if applied["kind"] != "ResourceClaim" || applied["apiVersion"].as_str().is_none() {
        return Err(ApiError::bad_request(
            "an apply configuration needs apiVersion and kind (ResourceClaim)",
        ));
    }
    if applied.pointer("/metadata/name").and_then(Value::as_str) != Some(name) {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({:?}) does not match the name on the URL ({name:?})",
            applied.pointer("/metadata/name")
        )));
    }
    let status = applied.get("status").cloned().unwrap_or(json!({}));
    if let Some(other) = status
        .as_object()
        .and_then(|o| o.keys().find(|k| *k != "devices"))
    {
        return Err(ApiError::new(
            415,
            "UnsupportedMediaType",
            format!(
                "this test server applies only status.devices of a ResourceClaim, not status.{other}"
            ),
        ));
    }
    let wanted = devices(applied);
    let mine_before = owned(cur, manager);
    let mut conflicts = Vec::new();
    let mut out: Vec<Value> = Vec::new();
    for e in devices(cur) {
        let key = entry_key(&e);
        let reapplied = wanted.iter().find(|w| entry_key(w) == key);
        match reapplied {
            Some(w) => {
                if !mine_before.contains(&key) && w != &e && !force {
                    conflicts.push(key);
                }
                out.push(w.clone());
            }
            // The manager's own entry, no longer applied: removed.
            None if mine_before.contains(&key) => {}
            None => out.push(e),
        }
    }
    let cur_keys: Vec<String> = devices(cur).iter().map(entry_key).collect();
    out.extend(
        wanted
            .iter()
            .filter(|w| !cur_keys.contains(&entry_key(w)))
            .cloned(),
    );
    if !conflicts.is_empty() {
        return Err(ApiError::new(
            409,
            "Conflict",
            format!(
                "Apply failed with {} conflict{}: {}",
                conflicts.len(),
                if conflicts.len() == 1 { "" } else { "s" },
                conflicts
                    .iter()
                    .map(|k| format!("conflict with another manager: .status.devices[{k}]"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
        .with_details(res, name));
    }
    let mut next = cur.clone();
    if let Some(s) = next.as_object_mut() {
        let st = s.entry("status").or_insert_with(|| json!({}));
        if let Some(st) = st.as_object_mut() {
            if out.is_empty() {
                st.remove("devices");
            } else {
                st.insert("devices".into(), Value::Array(out));
            }
        }
    }
    let fields: Map<String, Value> = wanted.iter().map(|w| (entry_key(w), json!({}))).collect();
    let mut managed: Vec<Value> = managed_fields(cur)
        .into_iter()
        .filter(|m| !is_entry_of(m, manager))
        .collect();
    if !fields.is_empty() {
        managed.push(json!({
            "manager": manager,
            "operation": "Apply",
            "apiVersion": applied["apiVersion"],
            "time": jiff::Timestamp::now().to_string(),
            "fieldsType": "FieldsV1",
            "fieldsV1": {"f:status": {"f:devices": fields}},
            "subresource": "status",
        }));
    }
    if let Some(meta) = next.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.insert("managedFields".into(), Value::Array(managed));
    }
    Ok(next)
}
