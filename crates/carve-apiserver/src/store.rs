//! The object store: objects as `serde_json::Value` keyed by (resource,
//! namespace, name), one global resourceVersion counter and a bounded event
//! history for watches. All operations are synchronous and take one lock.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde_json::{Map, Value, json};
use tokio::sync::watch;

use crate::Error;
use crate::resource::{API_VERSION, GROUP, Resource};
use crate::selector::Selectors;

/// Events kept for watches; older resourceVersions answer 410 Gone.
pub(crate) const HISTORY_LIMIT: usize = 10_000;

/// An error answered to an HTTP client as a `Status` object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    /// Boxed: an `ApiError` travels in every `Result` of the HTTP layer.
    pub details: Option<Box<Details>>,
}

/// `Status.details`: what the failure is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Details {
    pub group: String,
    /// A plural resource name (NotFound, Conflict, Forbidden) or a kind (Invalid).
    pub kind: String,
    pub name: String,
    /// `(reason, message, field)` per field error of an Invalid answer.
    pub causes: Vec<(String, String, String)>,
}

impl ApiError {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }

    pub(crate) fn with_details(mut self, res: Resource, name: &str) -> Self {
        self.details = Some(Box::new(Details {
            group: GROUP.to_string(),
            kind: res.plural().to_string(),
            name: name.to_string(),
            causes: Vec::new(),
        }));
        self
    }

    /// Details as `NewForbidden` sets them: group, resource, name.
    pub fn with_forbidden_details(mut self, group: &str, resource: &str, name: &str) -> Self {
        self.details = Some(Box::new(Details {
            group: group.to_string(),
            kind: resource.to_string(),
            name: name.to_string(),
            causes: Vec::new(),
        }));
        self
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::new(400, "BadRequest", message)
    }

    pub fn not_found(res: Resource, name: &str) -> Self {
        ApiError::new(
            404,
            "NotFound",
            format!("{} {name:?} not found", res.qualified()),
        )
        .with_details(res, name)
    }

    fn already_exists(res: Resource, name: &str) -> Self {
        ApiError::new(
            409,
            "AlreadyExists",
            format!("{} {name:?} already exists", res.qualified()),
        )
        .with_details(res, name)
    }

    fn conflict(res: Resource, name: &str, why: &str) -> Self {
        ApiError::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} {name:?}: {why}",
                res.qualified()
            ),
        )
        .with_details(res, name)
    }

    pub fn invalid(res: Resource, name: &str, cause: &str) -> Self {
        ApiError::new(
            422,
            "Invalid",
            format!("{}.{GROUP} {name:?} is invalid: {cause}", res.kind()),
        )
        .with_details(res, name)
    }

    /// 422 Invalid from `field.Forbidden` errors `(field, detail)`, as
    /// k8s.io/apimachinery `pkg/api/errors/errors.go` `NewInvalid` builds it:
    /// message `<Kind>.<group> "<name>" is invalid: <field>: Forbidden:
    /// <detail>` (several errors, duplicates dropped, as `[e1, e2]`), details
    /// naming the kind, one cause per error.
    pub fn invalid_forbidden(res: Resource, name: &str, errs: &[(String, String)]) -> Self {
        let mut texts: Vec<String> = Vec::new();
        for (field, detail) in errs {
            let t = format!("{field}: Forbidden: {detail}");
            if !texts.contains(&t) {
                texts.push(t);
            }
        }
        let cause = match texts.as_slice() {
            [one] => one.clone(),
            many => format!("[{}]", many.join(", ")),
        };
        let mut e = ApiError::new(
            422,
            "Invalid",
            format!("{}.{GROUP} {name:?} is invalid: {cause}", res.kind()),
        );
        e.details = Some(Box::new(Details {
            group: GROUP.to_string(),
            kind: res.kind().to_string(),
            name: name.to_string(),
            causes: errs
                .iter()
                .map(|(field, detail)| {
                    (
                        "FieldValueForbidden".to_string(),
                        format!("Forbidden: {detail}"),
                        field.clone(),
                    )
                })
                .collect(),
        }));
        e
    }

    /// The `Status` body Kubernetes sends with a failure.
    pub fn status_json(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(d) = &self.details {
            status["details"] = json!({"name": d.name, "group": d.group, "kind": d.kind});
            if !d.causes.is_empty() {
                status["details"]["causes"] = d
                    .causes
                    .iter()
                    .map(|(reason, message, field)| {
                        json!({"reason": reason, "message": message, "field": field})
                    })
                    .collect();
            }
        }
        status
    }
}

/// Kind of a watch event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EventKind {
    Added,
    Modified,
    Deleted,
}

/// One change, kept in the history for watchers.
#[derive(Clone, Debug)]
pub(crate) struct Event {
    pub rv: u64,
    pub resource: Resource,
    pub kind: EventKind,
    /// The object after the change (for deletions: its last state, carrying the deletion's resourceVersion).
    pub object: Value,
    /// The object before the change (modifications only), so selector transitions can be reported.
    pub old: Option<Value>,
}

/// Which part of an object an update may change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    /// The main endpoint: everything but `.status` (for resources with a status subresource).
    Main,
    /// The `/status` subresource: only `.status`.
    Status,
}

/// Delete preconditions (`DeleteOptions.preconditions`).
#[derive(Clone, Debug, Default)]
pub(crate) struct Preconditions {
    pub uid: Option<String>,
    pub resource_version: Option<String>,
}

/// A watch asked for a resourceVersion older than the retained history.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Gone {
    pub requested: u64,
    pub oldest: u64,
}

type Key = (Resource, String, String);

#[derive(Debug, Default)]
struct Inner {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    history: VecDeque<Event>,
    /// Highest resourceVersion whose event was dropped from `history`.
    compacted: u64,
}

#[derive(Debug)]
struct Shared {
    inner: Mutex<Inner>,
    changed: watch::Sender<u64>,
}

/// A cheap-to-clone handle on the object store, for direct access from tests
/// (no HTTP). Changes made through it are seen by watchers like any other.
#[derive(Clone, Debug)]
pub struct Store {
    shared: Arc<Shared>,
}

impl Default for Store {
    fn default() -> Self {
        Store::new()
    }
}

pub(crate) fn now_timestamp() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

fn meta(obj: &Value) -> Option<&Map<String, Value>> {
    obj.get("metadata").and_then(Value::as_object)
}

fn meta_str<'a>(obj: &'a Value, field: &str) -> &'a str {
    meta(obj)
        .and_then(|m| m.get(field))
        .and_then(Value::as_str)
        .unwrap_or("")
}

/// `metadata` as a mutable map; the caller has checked `obj` is an object
/// whose `metadata` is absent or an object.
fn meta_mut(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj.get("metadata").is_some_and(Value::is_object) {
        obj["metadata"] = Value::Object(Map::new());
    }
    match obj.get_mut("metadata") {
        Some(Value::Object(m)) => m,
        _ => unreachable!("metadata was just made an object"),
    }
}

fn has_finalizers(obj: &Value) -> bool {
    meta(obj)
        .and_then(|m| m.get("finalizers"))
        .and_then(Value::as_array)
        .is_some_and(|f| !f.is_empty())
}

fn is_dns_subdomain(name: &str) -> bool {
    let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    name.len() <= 253
        && name.chars().all(|c| ok_char(c) || c == '-' || c == '.')
        && name.chars().next().is_some_and(ok_char)
        && name.chars().last().is_some_and(ok_char)
}

fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    uuid::Uuid::new_v4().as_bytes()[..5]
        .iter()
        .map(|b| ALPHABET[usize::from(*b) % ALPHABET.len()] as char)
        .collect()
}

/// Checks `obj` is a JSON object of `res`'s kind, filling in a missing
/// `apiVersion`/`kind`, and that `metadata` (if present) is an object.
fn check_type(res: Resource, obj: &mut Value) -> Result<(), ApiError> {
    let Value::Object(map) = obj else {
        return Err(ApiError::bad_request(format!(
            "the body of a {} must be a JSON object",
            res.kind()
        )));
    };
    match map.get("apiVersion") {
        None | Some(Value::Null) => {
            map.insert("apiVersion".into(), API_VERSION.into());
        }
        Some(Value::String(v)) if v == API_VERSION => {}
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "apiVersion {other} does not match the request: expected {API_VERSION:?} for {}",
                res.plural()
            )));
        }
    }
    match map.get("kind") {
        None | Some(Value::Null) => {
            map.insert("kind".into(), res.kind().into());
        }
        Some(Value::String(k)) if k == res.kind() => {}
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "kind {other} does not match the request: expected {:?} for {}",
                res.kind(),
                res.plural()
            )));
        }
    }
    match map.get("metadata") {
        None | Some(Value::Object(_)) => Ok(()),
        Some(other) => Err(ApiError::bad_request(format!(
            "metadata of a {} must be an object, got {other}",
            res.kind()
        ))),
    }
}

/// Puts the namespace the URL names into `obj`, or rejects a different one.
fn check_namespace(res: Resource, obj: &mut Value, url_ns: &str) -> Result<(), ApiError> {
    let body_ns = meta_str(obj, "namespace").to_string();
    if res.namespaced() {
        if !body_ns.is_empty() && body_ns != url_ns {
            return Err(ApiError::bad_request(format!(
                "the namespace of the provided object ({body_ns:?}) does not match the namespace sent on the request ({url_ns:?})"
            )));
        }
        meta_mut(obj).insert("namespace".into(), url_ns.into());
    } else {
        meta_mut(obj).remove("namespace");
    }
    Ok(())
}

impl Inner {
    fn commit(&mut self, res: Resource, kind: EventKind, object: Value, old: Option<Value>) {
        self.history.push_back(Event {
            rv: self.rv,
            resource: res,
            kind,
            object,
            old,
        });
        while self.history.len() > HISTORY_LIMIT {
            if let Some(e) = self.history.pop_front() {
                self.compacted = e.rv;
            }
        }
    }

    fn bump(&mut self, obj: &mut Value) -> u64 {
        self.rv += 1;
        meta_mut(obj).insert("resourceVersion".into(), self.rv.to_string().into());
        self.rv
    }

    fn create(
        &mut self,
        res: Resource,
        url_ns: &str,
        mut obj: Value,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        check_type(res, &mut obj)?;
        check_namespace(res, &mut obj, url_ns)?;
        let ns = meta_str(&obj, "namespace").to_string();
        if !meta_str(&obj, "resourceVersion").is_empty() {
            return Err(ApiError::new(
                500,
                "InternalError",
                "resourceVersion should not be set on objects to be created",
            ));
        }
        let mut name = meta_str(&obj, "name").to_string();
        if name.is_empty() {
            let prefix = meta_str(&obj, "generateName").to_string();
            if prefix.is_empty() {
                return Err(ApiError::invalid(
                    res,
                    "",
                    "metadata.name: Required value: name or generateName is required",
                ));
            }
            name = loop {
                let candidate = format!("{prefix}{}", random_suffix());
                if !self
                    .objects
                    .contains_key(&(res, ns.clone(), candidate.clone()))
                {
                    break candidate;
                }
            };
            meta_mut(&mut obj).insert("name".into(), name.clone().into());
        }
        if !is_dns_subdomain(&name) {
            return Err(ApiError::invalid(
                res,
                &name,
                &format!(
                    "metadata.name: Invalid value: {name:?}: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
                ),
            ));
        }
        let key = (res, ns, name.clone());
        if self.objects.contains_key(&key) {
            return Err(ApiError::already_exists(res, &name));
        }
        let m = meta_mut(&mut obj);
        m.insert("uid".into(), uuid::Uuid::new_v4().to_string().into());
        m.insert("creationTimestamp".into(), now_timestamp().into());
        m.insert("generation".into(), 1.into());
        m.remove("deletionTimestamp");
        m.remove("deletionGracePeriodSeconds");
        if res.has_status()
            && let Value::Object(map) = &mut obj
        {
            // Like the real ResourceClaim strategy: status is set only via /status.
            map.remove("status");
        }
        if dry_run {
            return Ok(obj);
        }
        self.bump(&mut obj);
        self.objects.insert(key, obj.clone());
        self.commit(res, EventKind::Added, obj.clone(), None);
        Ok(obj)
    }

    fn update(
        &mut self,
        res: Resource,
        ns: &str,
        name: &str,
        mut new: Value,
        part: Part,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        let key = (res, ns.to_string(), name.to_string());
        let old = self
            .objects
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(res, name))?;
        check_type(res, &mut new)?;
        let body_name = meta_str(&new, "name");
        if body_name.is_empty() {
            meta_mut(&mut new).insert("name".into(), name.into());
        } else if body_name != name {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({body_name:?}) does not match the name on the URL ({name:?})"
            )));
        }
        check_namespace(res, &mut new, ns)?;
        let old_rv = meta_str(&old, "resourceVersion");
        let new_rv = meta_str(&new, "resourceVersion");
        if !new_rv.is_empty() && new_rv != old_rv {
            return Err(ApiError::conflict(
                res,
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
            ));
        }
        let old_uid = meta_str(&old, "uid");
        let new_uid = meta_str(&new, "uid");
        if !new_uid.is_empty() && new_uid != old_uid {
            return Err(ApiError::conflict(
                res,
                name,
                &format!(
                    "Precondition failed: UID in precondition: {new_uid}, UID in object meta: {old_uid}"
                ),
            ));
        }
        let mut result = match part {
            Part::Main => {
                let mut r = new;
                let old_meta = meta(&old).cloned().unwrap_or_default();
                let m = meta_mut(&mut r);
                for field in [
                    "uid",
                    "creationTimestamp",
                    "generation",
                    "deletionTimestamp",
                    "deletionGracePeriodSeconds",
                ] {
                    match old_meta.get(field) {
                        Some(v) => m.insert(field.into(), v.clone()),
                        None => m.remove(field),
                    };
                }
                if res.has_status()
                    && let Value::Object(map) = &mut r
                {
                    match old.get("status") {
                        Some(s) => map.insert("status".into(), s.clone()),
                        None => map.remove("status"),
                    };
                }
                if r.get("spec") != old.get("spec") {
                    let generation = old_meta
                        .get("generation")
                        .and_then(Value::as_i64)
                        .unwrap_or(0);
                    meta_mut(&mut r).insert("generation".into(), (generation + 1).into());
                }
                r
            }
            Part::Status => {
                let mut r = old.clone();
                if let Value::Object(map) = &mut r {
                    match new.get("status") {
                        Some(s) if !s.is_null() => map.insert("status".into(), s.clone()),
                        _ => map.remove("status"),
                    };
                }
                // Field ownership is the object's, whichever endpoint
                // wrote it (a server-side apply of the status records it).
                if let Some(m) = new.pointer("/metadata/managedFields") {
                    meta_mut(&mut r).insert("managedFields".into(), m.clone());
                }
                r
            }
        };
        meta_mut(&mut result).insert("resourceVersion".into(), old_rv.into());
        if result == old || dry_run {
            // A no-op update changes nothing, not even the resourceVersion.
            return Ok(result);
        }
        self.bump(&mut result);
        if meta(&result).is_some_and(|m| m.contains_key("deletionTimestamp"))
            && !has_finalizers(&result)
        {
            self.objects.remove(&key);
            self.commit(res, EventKind::Deleted, result.clone(), None);
        } else {
            self.objects.insert(key, result.clone());
            self.commit(res, EventKind::Modified, result.clone(), Some(old));
        }
        Ok(result)
    }

    /// Deletes one object. Returns it and whether it is gone (`false`: it has
    /// finalizers and only got a deletionTimestamp).
    fn delete(
        &mut self,
        res: Resource,
        ns: &str,
        name: &str,
        pre: &Preconditions,
        dry_run: bool,
    ) -> Result<(Value, bool), ApiError> {
        let key = (res, ns.to_string(), name.to_string());
        let old = self
            .objects
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(res, name))?;
        if let Some(uid) = &pre.uid
            && uid != meta_str(&old, "uid")
        {
            return Err(ApiError::conflict(
                res,
                name,
                &format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                    meta_str(&old, "uid")
                ),
            ));
        }
        if let Some(rv) = &pre.resource_version
            && rv != meta_str(&old, "resourceVersion")
        {
            return Err(ApiError::conflict(
                res,
                name,
                &format!(
                    "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {}",
                    meta_str(&old, "resourceVersion")
                ),
            ));
        }
        if has_finalizers(&old) {
            if meta(&old).is_some_and(|m| m.contains_key("deletionTimestamp")) || dry_run {
                return Ok((old, false));
            }
            let mut obj = old.clone();
            let m = meta_mut(&mut obj);
            m.insert("deletionTimestamp".into(), now_timestamp().into());
            m.insert("deletionGracePeriodSeconds".into(), 0.into());
            let generation = m.get("generation").and_then(Value::as_i64).unwrap_or(0);
            m.insert("generation".into(), (generation + 1).into());
            self.bump(&mut obj);
            self.objects.insert(key, obj.clone());
            self.commit(res, EventKind::Modified, obj.clone(), Some(old));
            return Ok((obj, false));
        }
        if dry_run {
            return Ok((old, true));
        }
        let mut obj = old;
        self.bump(&mut obj);
        self.objects.remove(&key);
        self.commit(res, EventKind::Deleted, obj.clone(), None);
        Ok((obj, true))
    }

    fn select(&self, res: Resource, ns: Option<&str>, sel: &Selectors) -> Vec<Value> {
        self.objects
            .iter()
            .filter(|((r, n, _), obj)| *r == res && ns.is_none_or(|ns| ns == n) && sel.matches(obj))
            .map(|(_, obj)| obj.clone())
            .collect()
    }
}

impl Store {
    /// An empty store at resourceVersion 0.
    pub fn new() -> Store {
        Store {
            shared: Arc::new(Shared {
                inner: Mutex::new(Inner::default()),
                changed: watch::Sender::new(0),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.shared
            .inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` under the lock and wakes watchers if the resourceVersion moved.
    fn write<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        let mut inner = self.lock();
        let before = inner.rv;
        let out = f(&mut inner);
        let after = inner.rv;
        drop(inner);
        if after != before {
            self.shared.changed.send_replace(after);
        }
        out
    }

    /// Inserts or replaces an object directly (no HTTP, no faults, no
    /// counters). Unlike an HTTP create it keeps `.status`, an existing `uid`,
    /// `creationTimestamp` and `generation`; it always assigns a new
    /// resourceVersion and emits ADDED or MODIFIED to watchers.
    pub fn insert(&self, resource: Resource, mut obj: Value) -> Result<Value, Error> {
        let invalid = |reason: String| Error::InvalidObject { resource, reason };
        check_type(resource, &mut obj).map_err(|e| invalid(e.message))?;
        let name = meta_str(&obj, "name").to_string();
        if !is_dns_subdomain(&name) {
            return Err(invalid(format!(
                "metadata.name {name:?} is not a lowercase RFC 1123 subdomain"
            )));
        }
        let ns = meta_str(&obj, "namespace").to_string();
        if resource.namespaced() && ns.is_empty() {
            return Err(invalid(format!(
                "metadata.namespace is required for {resource} (object {name:?})"
            )));
        }
        if !resource.namespaced() {
            meta_mut(&mut obj).remove("namespace");
        }
        Ok(self.write(|inner| {
            let key = (resource, ns, name);
            let old = inner.objects.get(&key).cloned();
            let m = meta_mut(&mut obj);
            let keep = |field: &str, m: &mut Map<String, Value>, fallback: Value| {
                if !m.contains_key(field) {
                    let v = old
                        .as_ref()
                        .and_then(meta)
                        .and_then(|om| om.get(field).cloned())
                        .unwrap_or(fallback);
                    m.insert(field.into(), v);
                }
            };
            keep("uid", m, uuid::Uuid::new_v4().to_string().into());
            keep("creationTimestamp", m, now_timestamp().into());
            keep("generation", m, 1.into());
            inner.bump(&mut obj);
            inner.objects.insert(key, obj.clone());
            let kind = if old.is_some() {
                EventKind::Modified
            } else {
                EventKind::Added
            };
            inner.commit(resource, kind, obj.clone(), old);
            obj
        }))
    }

    /// One object; `namespace` is ignored for cluster-scoped resources.
    pub fn get(&self, resource: Resource, namespace: Option<&str>, name: &str) -> Option<Value> {
        let ns = if resource.namespaced() {
            namespace.unwrap_or("")
        } else {
            ""
        };
        self.lock()
            .objects
            .get(&(resource, ns.to_string(), name.to_string()))
            .cloned()
    }

    /// Every object of `resource`, ordered by namespace then name.
    pub fn list(&self, resource: Resource) -> Vec<Value> {
        self.lock().select(resource, None, &Selectors::default())
    }

    /// Removes an object at once (finalizers are not honoured) and emits
    /// DELETED; returns it, or `None` if there was none.
    pub fn delete(&self, resource: Resource, namespace: Option<&str>, name: &str) -> Option<Value> {
        let ns = if resource.namespaced() {
            namespace.unwrap_or("")
        } else {
            ""
        };
        self.write(|inner| {
            let mut obj = inner
                .objects
                .remove(&(resource, ns.to_string(), name.to_string()))?;
            inner.bump(&mut obj);
            inner.commit(resource, EventKind::Deleted, obj.clone(), None);
            Some(obj)
        })
    }

    /// The current (latest) resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.lock().rv
    }

    /// Forgets the whole event history, as etcd compaction does: a watch from
    /// any resourceVersion below the current one then gets 410 Gone.
    pub fn compact(&self) {
        let mut inner = self.lock();
        inner.history.clear();
        inner.compacted = inner.rv;
    }

    // === crate-internal operations used by the HTTP layer ===

    pub(crate) fn create(
        &self,
        res: Resource,
        ns: &str,
        obj: Value,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        self.write(|i| i.create(res, ns, obj, dry_run))
    }

    pub(crate) fn update(
        &self,
        res: Resource,
        ns: &str,
        name: &str,
        obj: Value,
        part: Part,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        self.write(|i| i.update(res, ns, name, obj, part, dry_run))
    }

    /// Applies `patch` (a function from the current object to the patched
    /// one) and stores the result like an update, under one lock.
    pub(crate) fn patch(
        &self,
        res: Resource,
        ns: &str,
        name: &str,
        part: Part,
        dry_run: bool,
        patch: impl FnOnce(&Value) -> Result<Value, ApiError>,
    ) -> Result<Value, ApiError> {
        self.write(|i| {
            let current = i
                .objects
                .get(&(res, ns.to_string(), name.to_string()))
                .ok_or_else(|| ApiError::not_found(res, name))?;
            let patched = patch(current)?;
            i.update(res, ns, name, patched, part, dry_run)
        })
    }

    pub(crate) fn delete_one(
        &self,
        res: Resource,
        ns: &str,
        name: &str,
        pre: &Preconditions,
        dry_run: bool,
    ) -> Result<(Value, bool), ApiError> {
        self.write(|i| i.delete(res, ns, name, pre, dry_run))
    }

    /// Deletes every matching object; returns them (in their final state).
    pub(crate) fn delete_collection(
        &self,
        res: Resource,
        ns: Option<&str>,
        sel: &Selectors,
        dry_run: bool,
    ) -> Result<(Vec<Value>, u64), ApiError> {
        self.write(|i| {
            let victims = i.select(res, ns, sel);
            let mut out = Vec::with_capacity(victims.len());
            for v in victims {
                let vns = meta_str(&v, "namespace").to_string();
                let vname = meta_str(&v, "name").to_string();
                out.push(
                    i.delete(res, &vns, &vname, &Preconditions::default(), dry_run)?
                        .0,
                );
            }
            Ok((out, i.rv))
        })
    }

    /// Matching objects and the resourceVersion they were read at.
    pub(crate) fn snapshot(
        &self,
        res: Resource,
        ns: Option<&str>,
        sel: &Selectors,
    ) -> (Vec<Value>, u64) {
        let inner = self.lock();
        (inner.select(res, ns, sel), inner.rv)
    }

    /// Events with resourceVersion above `after`, and the current resourceVersion.
    pub(crate) fn events_since(&self, after: u64) -> Result<(Vec<Event>, u64), Gone> {
        let inner = self.lock();
        if after < inner.compacted {
            return Err(Gone {
                requested: after,
                oldest: inner.compacted,
            });
        }
        let start = inner.history.partition_point(|e| e.rv <= after);
        Ok((inner.history.range(start..).cloned().collect(), inner.rv))
    }

    /// Receiver that changes whenever the resourceVersion moves.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.shared.changed.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(name: &str) -> Value {
        json!({"apiVersion": API_VERSION, "kind": "ResourceSlice", "metadata": {"name": name}, "spec": {"driver": "d"}})
    }

    #[test]
    fn create_assigns_metadata_and_rejects_duplicates() {
        let s = Store::new();
        let o = s
            .create(Resource::ResourceSlices, "", slice("a"), false)
            .unwrap();
        assert_eq!(o["metadata"]["resourceVersion"], "1");
        assert_eq!(o["metadata"]["generation"], 1);
        assert_eq!(o["metadata"]["uid"].as_str().unwrap().len(), 36);
        let e = s
            .create(Resource::ResourceSlices, "", slice("a"), false)
            .unwrap_err();
        assert_eq!((e.code, e.reason), (409, "AlreadyExists"));
        assert_eq!(s.resource_version(), 1);
    }

    #[test]
    fn rejected_writes_leave_store_untouched() {
        let s = Store::new();
        s.create(Resource::ResourceSlices, "", slice("a"), false)
            .unwrap();
        let mut wrong_kind = slice("b");
        wrong_kind["kind"] = "DeviceClass".into();
        assert_eq!(
            s.create(Resource::ResourceSlices, "", wrong_kind, false)
                .unwrap_err()
                .code,
            400
        );
        assert_eq!(
            s.create(Resource::ResourceSlices, "", slice("Bad_Name"), false)
                .unwrap_err()
                .code,
            422
        );
        let e = s
            .patch(Resource::ResourceSlices, "", "a", Part::Main, false, |_| {
                Err(ApiError::bad_request("nope"))
            })
            .unwrap_err();
        assert_eq!(e.code, 400);
        assert_eq!(s.list(Resource::ResourceSlices).len(), 1);
        assert_eq!(s.resource_version(), 1);
        assert_eq!(s.events_since(0).unwrap().0.len(), 1);
    }

    #[test]
    fn generation_moves_only_with_spec_and_noop_keeps_rv() {
        let s = Store::new();
        let o = s
            .create(Resource::ResourceSlices, "", slice("a"), false)
            .unwrap();
        let same = s
            .update(
                Resource::ResourceSlices,
                "",
                "a",
                o.clone(),
                Part::Main,
                false,
            )
            .unwrap();
        assert_eq!(same["metadata"]["resourceVersion"], "1");
        let mut labelled = o.clone();
        labelled["metadata"]["labels"] = json!({"x": "y"});
        let l = s
            .update(
                Resource::ResourceSlices,
                "",
                "a",
                labelled,
                Part::Main,
                false,
            )
            .unwrap();
        assert_eq!(
            (
                l["metadata"]["resourceVersion"].as_str(),
                l["metadata"]["generation"].as_i64()
            ),
            (Some("2"), Some(1))
        );
        let mut respec = l.clone();
        respec["spec"]["driver"] = "e".into();
        let r = s
            .update(Resource::ResourceSlices, "", "a", respec, Part::Main, false)
            .unwrap();
        assert_eq!(r["metadata"]["generation"], 2);
    }

    #[test]
    fn finalizers_delay_deletion_until_removed() {
        let s = Store::new();
        let mut o = slice("a");
        o["metadata"]["finalizers"] = json!(["x"]);
        s.create(Resource::ResourceSlices, "", o, false).unwrap();
        let (pending, gone) = s
            .delete_one(
                Resource::ResourceSlices,
                "",
                "a",
                &Preconditions::default(),
                false,
            )
            .unwrap();
        assert!(!gone);
        assert!(pending["metadata"]["deletionTimestamp"].is_string());
        let mut cleared = pending.clone();
        cleared["metadata"]["finalizers"] = json!([]);
        s.update(
            Resource::ResourceSlices,
            "",
            "a",
            cleared,
            Part::Main,
            false,
        )
        .unwrap();
        assert!(s.get(Resource::ResourceSlices, None, "a").is_none());
        let kinds: Vec<_> = s
            .events_since(0)
            .unwrap()
            .0
            .iter()
            .map(|e| e.kind)
            .collect();
        assert_eq!(
            kinds,
            [EventKind::Added, EventKind::Modified, EventKind::Deleted]
        );
    }

    #[test]
    fn compaction_makes_old_versions_gone() {
        let s = Store::new();
        s.insert(Resource::ResourceSlices, slice("a")).unwrap();
        s.insert(Resource::ResourceSlices, slice("b")).unwrap();
        s.compact();
        assert_eq!(
            s.events_since(1).unwrap_err(),
            Gone {
                requested: 1,
                oldest: 2
            }
        );
        assert!(s.events_since(2).unwrap().0.is_empty());
    }

    #[test]
    fn insert_validates() {
        let s = Store::new();
        let claim = json!({"metadata": {"name": "c"}});
        let e = s.insert(Resource::ResourceClaims, claim).unwrap_err();
        assert!(e.to_string().contains("metadata.namespace"), "{e}");
        assert!(s.list(Resource::ResourceClaims).is_empty());
    }
}
