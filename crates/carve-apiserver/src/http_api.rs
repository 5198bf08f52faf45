//! Request routing and the Kubernetes REST semantics on top of [`Store`].

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http::request::Parts;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use crate::authz::{Attributes, Identity, bearer_token, forbidden, forbidden_path, unauthorized};
use crate::patch::{find_directive, json_patch, merge_patch};
use crate::resource::{API_VERSION, GROUP, Resource, VERSION};
use crate::selector::{FieldSelector, LabelSelector, Selectors};
use crate::server::{Caller, FaultAction, ServerState};
use crate::store::{ApiError, Event, EventKind, Part, Preconditions, Store};
use crate::strategy::{Gates, authorize_claim_status, prepare};
use crate::{KubeVersion, RequestRecord};

pub(crate) type RespBody = BoxBody<Bytes, Infallible>;

/// Returned to hyper while the server is down, so that it closes the
/// connection without an answer.
#[derive(Debug, thiserror::Error)]
#[error("the API server is down: connection closed without an answer")]
pub(crate) struct Refused;

/// Interval between periodic BOOKMARK events on watches that allow them.
const BOOKMARK_INTERVAL: Duration = Duration::from_secs(60);

#[derive(Debug)]
enum Route {
    Version,
    Api,
    CoreV1,
    Apis,
    Group,
    GroupVersion,
    Health,
    Collection {
        res: Resource,
        ns: Option<String>,
    },
    Item {
        res: Resource,
        /// `""` for cluster-scoped resources.
        ns: String,
        name: String,
        status: bool,
    },
    Unknown,
}

fn route(path: &str) -> Route {
    match path {
        "/version" | "/version/" => return Route::Version,
        "/api" | "/api/" => return Route::Api,
        "/api/v1" | "/api/v1/" => return Route::CoreV1,
        "/apis" | "/apis/" => return Route::Apis,
        "/apis/resource.k8s.io" | "/apis/resource.k8s.io/" => return Route::Group,
        "/apis/resource.k8s.io/v1" | "/apis/resource.k8s.io/v1/" => return Route::GroupVersion,
        "/healthz" | "/livez" | "/readyz" => return Route::Health,
        _ => {}
    }
    let Some(rest) = path.strip_prefix("/apis/resource.k8s.io/v1/") else {
        return Route::Unknown;
    };
    let segs: Vec<&str> = rest.split('/').collect();
    if segs.iter().any(|s| s.is_empty()) {
        return Route::Unknown;
    }
    let res = |s: &str| Resource::ALL.into_iter().find(|r| r.plural() == s);
    let item = |res: Resource, ns: &str, name: &str, status: bool| Route::Item {
        res,
        ns: ns.to_string(),
        name: name.to_string(),
        status,
    };
    let found = match segs.as_slice() {
        [p] => res(p).map(|res| Route::Collection { res, ns: None }),
        [p, name] => res(p)
            .filter(|r| !r.namespaced())
            .map(|r| item(r, "", name, false)),
        [p, name, "status"] => res(p)
            .filter(|r| !r.namespaced() && r.has_status())
            .map(|r| item(r, "", name, true)),
        ["namespaces", ns, p] => res(p)
            .filter(|r| r.namespaced())
            .map(|res| Route::Collection {
                res,
                ns: Some(ns.to_string()),
            }),
        ["namespaces", ns, p, name] => res(p)
            .filter(|r| r.namespaced())
            .map(|r| item(r, ns, name, false)),
        ["namespaces", ns, p, name, "status"] => res(p)
            .filter(|r| r.namespaced() && r.has_status())
            .map(|r| item(r, ns, name, true)),
        _ => None,
    };
    found.unwrap_or(Route::Unknown)
}

#[derive(Debug, Default)]
struct Query(Vec<(String, String)>);

impl Query {
    fn parse(q: Option<&str>) -> Query {
        Query(
            form_urlencoded::parse(q.unwrap_or("").as_bytes())
                .into_owned()
                .collect(),
        )
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    fn flag(&self, key: &str) -> bool {
        matches!(self.get(key), Some("true" | "1"))
    }

    fn selectors(&self, res: Resource) -> Result<Selectors, ApiError> {
        let bad = |e: crate::SelectorError| ApiError::bad_request(e.to_string());
        Ok(Selectors {
            labels: LabelSelector::parse(self.get("labelSelector").unwrap_or("")).map_err(bad)?,
            fields: FieldSelector::parse(self.get("fieldSelector").unwrap_or(""), res)
                .map_err(bad)?,
        })
    }

    fn dry_run(&self) -> Result<bool, ApiError> {
        match self.get("dryRun") {
            None => Ok(false),
            Some("All") => Ok(true),
            Some(other) => Err(ApiError::bad_request(format!(
                "unsupported dryRun value {other:?}: only \"All\" is accepted"
            ))),
        }
    }
}

/// Verb, resource label and write-ness of a request, for counters and faults.
struct Described {
    verb: String,
    resource: String,
    base: Option<&'static str>,
    write: bool,
}

fn describe(route: &Route, method: &Method, query: &Query, path: &str) -> Described {
    let other = || method.as_str().to_ascii_lowercase();
    let (verb, resource, base) = match route {
        Route::Collection { res, .. } => {
            let verb = match *method {
                Method::GET if query.flag("watch") => "watch".to_string(),
                Method::GET => "list".to_string(),
                Method::POST => "create".to_string(),
                Method::DELETE => "deletecollection".to_string(),
                _ => other(),
            };
            (verb, res.plural().to_string(), Some(res.plural()))
        }
        Route::Item { res, status, .. } => {
            let verb = match *method {
                Method::GET => "get".to_string(),
                Method::PUT => "update".to_string(),
                Method::PATCH => "patch".to_string(),
                Method::DELETE => "delete".to_string(),
                _ => other(),
            };
            let label = if *status {
                format!("{}/status", res.plural())
            } else {
                res.plural().to_string()
            };
            (verb, label, Some(res.plural()))
        }
        _ => {
            let verb = if *method == Method::GET {
                "get".to_string()
            } else {
                other()
            };
            (verb, path.to_string(), None)
        }
    };
    let write = matches!(
        verb.as_str(),
        "create" | "update" | "patch" | "delete" | "deletecollection"
    );
    Described {
        verb,
        resource,
        base,
        write,
    }
}

fn json_response(code: u16, body: &Value) -> Response<RespBody> {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    let mut resp = Response::new(Full::new(Bytes::from(bytes)).boxed());
    *resp.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    resp
}

fn error_response(e: &ApiError) -> Response<RespBody> {
    json_response(e.code, &e.status_json())
}

fn reason_for(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        405 => "MethodNotAllowed",
        409 => "Conflict",
        410 => "Expired",
        415 => "UnsupportedMediaType",
        422 => "Invalid",
        429 => "TooManyRequests",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "InternalError",
    }
}

fn injected(status: u16) -> ApiError {
    let code = if (400..=599).contains(&status) {
        status
    } else {
        500
    };
    ApiError::new(
        code,
        reason_for(code),
        format!("injected fault: HTTP {code}"),
    )
}

/// Serves one request (hyper service function).
pub(crate) async fn handle(
    state: Arc<ServerState>,
    req: Request<Incoming>,
) -> Result<Response<RespBody>, Refused> {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_string();
    let route = route(&path);
    let query = Query::parse(parts.uri.query());
    let d = describe(&route, &parts.method, &query, &path);
    let mut rec = RequestRecord {
        method: parts.method.to_string(),
        path,
        query: parts.uri.query().unwrap_or("").to_string(),
        verb: d.verb,
        resource: d.resource,
        status: 0,
    };
    if state.is_down() {
        state.record(rec, d.write);
        return Err(Refused);
    }
    let resp = match state.take_fault(d.write, d.base) {
        Some(FaultAction::Fail(status)) => error_response(&injected(status)),
        delayed => {
            if let Some(FaultAction::Delay(delay)) = delayed {
                tokio::time::sleep(delay).await;
            }
            let token = bearer_token(
                parts
                    .headers
                    .get(header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok()),
            );
            let caller = state.authenticate(token);
            match authorize(caller, &route, &rec.verb, &query, &rec.path) {
                Ok(who) => dispatch(&state, route, &parts, &query, body, who.as_ref())
                    .await
                    .unwrap_or_else(|e| error_response(&e)),
                Err(e) => error_response(&e),
            }
        }
    };
    rec.status = resp.status().as_u16();
    state.record(rec, d.write);
    Ok(resp)
}

/// The name a list or watch is limited to by a field selector that requires
/// `metadata.name=<name>` (k8s.io/apiserver `requestinfo.go`), else `""`.
fn selected_name(query: &Query) -> String {
    query
        .get("fieldSelector")
        .unwrap_or("")
        .split(',')
        .find_map(|term| {
            let (k, v) = term.split_once("==").or_else(|| term.split_once('='))?;
            let v = v.trim();
            (k.trim() == "metadata.name"
                && !matches!(v, "" | "." | "..")
                && !v.contains(['/', '%']))
            .then(|| v.to_string())
        })
        .unwrap_or_default()
}

/// Authentication and authorization of one request (see the `authz`
/// module): the identity to check status writes against, `None` while no
/// identity is registered.
fn authorize(
    caller: Caller,
    route: &Route,
    verb: &str,
    query: &Query,
    path: &str,
) -> Result<Option<Identity>, ApiError> {
    let who = match caller {
        Caller::Anyone => return Ok(None),
        Caller::Unknown => return Err(unauthorized()),
        Caller::Known(who) => who,
    };
    let attrs = match route {
        Route::Collection { res, ns } => {
            let name = if matches!(verb, "list" | "watch") {
                selected_name(query)
            } else {
                String::new()
            };
            Attributes::new(verb, res.plural(), "", ns.as_deref().unwrap_or(""), &name)
        }
        Route::Item {
            res,
            ns,
            name,
            status,
        } => Attributes::new(
            verb,
            res.plural(),
            if *status { "status" } else { "" },
            ns,
            name,
        ),
        Route::Unknown => return Ok(Some(who)),
        Route::Version
        | Route::Api
        | Route::CoreV1
        | Route::Apis
        | Route::Group
        | Route::GroupVersion
        | Route::Health => {
            return if verb == "get" {
                Ok(Some(who))
            } else {
                Err(forbidden_path(&who.username, verb, path))
            };
        }
    };
    if who.allows(&attrs) {
        Ok(Some(who))
    } else {
        Err(forbidden(&who.username, &attrs))
    }
}

/// What a write goes through before it is stored: the version's and gates'
/// strategy, then, for a ResourceClaim status write by an identity, the
/// granular status authorization.
#[derive(Clone, Copy)]
struct WriteRules<'a> {
    version: KubeVersion,
    gates: Gates,
    who: Option<&'a Identity>,
    /// `update` or `patch`.
    verb: &'static str,
}

impl WriteRules<'_> {
    fn apply(
        &self,
        res: Resource,
        part: Part,
        (ns, name): (&str, &str),
        obj: &mut Value,
        old: Option<&Value>,
    ) -> Result<(), ApiError> {
        prepare(res, part, obj, old, self.version, self.gates)?;
        if let (Resource::ResourceClaims, Part::Status, Some(who), Some(old)) =
            (res, part, self.who, old)
        {
            authorize_claim_status(who, self.verb, (ns, name), obj, old, self.gates)?;
        }
        Ok(())
    }
}

fn method_not_allowed(method: &Method, what: &str) -> ApiError {
    ApiError::new(
        405,
        "MethodNotAllowed",
        format!("the server does not allow method {method} on {what}"),
    )
}

async fn dispatch(
    state: &Arc<ServerState>,
    route: Route,
    parts: &Parts,
    query: &Query,
    body: Incoming,
    who: Option<&Identity>,
) -> Result<Response<RespBody>, ApiError> {
    let method = &parts.method;
    let store = &state.store;
    let non_resource = |v: Value| {
        if *method == Method::GET {
            Ok(json_response(200, &v))
        } else {
            Err(method_not_allowed(method, parts.uri.path()))
        }
    };
    match route {
        Route::Version => non_resource(version_json(state.version())),
        Route::Api => non_resource(json!({
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": state.addr.to_string()}],
        })),
        Route::CoreV1 => non_resource(
            json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "v1", "resources": []}),
        ),
        Route::Apis => non_resource(json!({
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [group_json()],
        })),
        Route::Group => non_resource({
            let mut g = group_json();
            g["kind"] = "APIGroup".into();
            g["apiVersion"] = "v1".into();
            g
        }),
        Route::GroupVersion => non_resource(resource_list_json()),
        Route::Health => {
            if *method == Method::GET {
                let mut resp = Response::new(Full::new(Bytes::from_static(b"ok")).boxed());
                resp.headers_mut().insert(
                    header::CONTENT_TYPE,
                    header::HeaderValue::from_static("text/plain"),
                );
                Ok(resp)
            } else {
                Err(method_not_allowed(method, parts.uri.path()))
            }
        }
        Route::Unknown => Err(ApiError::new(
            404,
            "NotFound",
            format!(
                "the server could not find the requested resource ({method} {})",
                parts.uri.path()
            ),
        )),
        Route::Collection { res, ns } => match *method {
            Method::GET => {
                let sel = query.selectors(res)?;
                if query.flag("watch") {
                    start_watch(state, res, ns, sel, query)
                } else {
                    let (items, rv) = store.snapshot(res, ns.as_deref(), &sel);
                    Ok(json_response(200, &list_json(res, items, rv)))
                }
            }
            Method::POST => {
                let ns = match (res.namespaced(), ns) {
                    (true, Some(ns)) => ns,
                    (true, None) => {
                        return Err(method_not_allowed(
                            method,
                            &format!("{res} across all namespaces (POST to /namespaces/NS/{res})"),
                        ));
                    }
                    (false, _) => String::new(),
                };
                let dry = query.dry_run()?;
                let mut obj = read_json(parts, body).await?;
                prepare(
                    res,
                    Part::Main,
                    &mut obj,
                    None,
                    state.version(),
                    state.gates(),
                )?;
                let created = store.create(res, &ns, obj, dry)?;
                Ok(json_response(201, &created))
            }
            Method::DELETE => {
                let sel = query.selectors(res)?;
                let dry = query.dry_run()? || delete_options(parts, body).await?.1;
                let (items, rv) = store.delete_collection(res, ns.as_deref(), &sel, dry)?;
                Ok(json_response(200, &list_json(res, items, rv)))
            }
            _ => Err(method_not_allowed(method, res.plural())),
        },
        Route::Item {
            res,
            ns,
            name,
            status,
        } => {
            let part = if status { Part::Status } else { Part::Main };
            match *method {
                Method::GET => store
                    .get(res, Some(&ns), &name)
                    .map(|o| json_response(200, &o))
                    .ok_or_else(|| ApiError::not_found(res, &name)),
                Method::PUT => {
                    let dry = query.dry_run()?;
                    let mut obj = read_json(parts, body).await?;
                    let old = store.get(res, Some(&ns), &name);
                    let rules = WriteRules {
                        version: state.version(),
                        gates: state.gates(),
                        who,
                        verb: "update",
                    };
                    rules.apply(res, part, (&ns, &name), &mut obj, old.as_ref())?;
                    let updated = store.update(res, &ns, &name, obj, part, dry)?;
                    Ok(json_response(200, &updated))
                }
                Method::PATCH => {
                    let dry = query.dry_run()?;
                    let rules = WriteRules {
                        version: state.version(),
                        gates: state.gates(),
                        who,
                        verb: "patch",
                    };
                    let patched =
                        patch(store, res, &ns, &name, part, dry, rules, parts, query, body).await?;
                    Ok(json_response(200, &patched))
                }
                Method::DELETE => {
                    let (pre, body_dry) = delete_options(parts, body).await?;
                    let dry = query.dry_run()? || body_dry;
                    let (obj, gone) = store.delete_one(res, &ns, &name, &pre, dry)?;
                    Ok(json_response(if gone { 200 } else { 202 }, &obj))
                }
                _ => Err(method_not_allowed(method, res.plural())),
            }
        }
    }
}

fn media_type(parts: &Parts) -> Option<String> {
    parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
}

async fn read_bytes(body: Incoming) -> Result<Bytes, ApiError> {
    body.collect()
        .await
        .map(|c| c.to_bytes())
        .map_err(|e| ApiError::bad_request(format!("cannot read the request body: {e}")))
}

async fn read_json(parts: &Parts, body: Incoming) -> Result<Value, ApiError> {
    if let Some(mt) = media_type(parts)
        && mt != "application/json"
    {
        return Err(ApiError::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format ({mt}) - accepted media types include: application/json"
            ),
        ));
    }
    let bytes = read_bytes(body).await?;
    serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::bad_request(format!("couldn't decode the request body as JSON: {e}"))
    })
}

/// Preconditions and dry-run flag from a `DeleteOptions` body (may be empty).
async fn delete_options(parts: &Parts, body: Incoming) -> Result<(Preconditions, bool), ApiError> {
    let _ = parts;
    let bytes = read_bytes(body).await?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok((Preconditions::default(), false));
    }
    let opts: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("couldn't decode DeleteOptions: {e}")))?;
    let field = |p: &str| opts.pointer(p).and_then(Value::as_str).map(str::to_string);
    let pre = Preconditions {
        uid: field("/preconditions/uid"),
        resource_version: field("/preconditions/resourceVersion"),
    };
    let dry = opts
        .get("dryRun")
        .and_then(Value::as_array)
        .is_some_and(|a| a.iter().any(|v| v == "All"));
    Ok((pre, dry))
}

#[allow(clippy::too_many_arguments)]
async fn patch(
    store: &Store,
    res: Resource,
    ns: &str,
    name: &str,
    part: Part,
    dry: bool,
    rules: WriteRules<'_>,
    parts: &Parts,
    query: &Query,
    body: Incoming,
) -> Result<Value, ApiError> {
    let mt = media_type(parts).unwrap_or_default();
    if mt == "application/apply-patch+yaml" {
        if !(res == Resource::ResourceClaims && matches!(part, Part::Status)) {
            return Err(ApiError::new(
                415,
                "UnsupportedMediaType",
                "this test server serves server-side apply only for resourceclaims/status",
            ));
        }
        let manager = query.get("fieldManager").unwrap_or_default().to_string();
        if manager.is_empty() {
            return Err(ApiError::bad_request(
                "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch",
            ));
        }
        let force = query.flag("force");
        let bytes = read_bytes(body).await?;
        // kube sends the configuration as JSON, which is YAML too.
        let doc: Value = serde_json::from_slice(&bytes).map_err(|e| {
            ApiError::bad_request(format!(
                "this test server reads apply configurations as JSON only: {e}"
            ))
        })?;
        return store.patch(res, ns, name, part, dry, |cur| {
            let mut v = crate::apply::apply_claim_status(res, name, cur, &doc, &manager, force)?;
            rules.apply(res, part, (ns, name), &mut v, Some(cur))?;
            Ok(v)
        });
    }
    let unsupported = || {
        ApiError::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format ({mt:?}) - accepted media types include: application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json (applied as a merge patch), application/apply-patch+yaml (resourceclaims/status only)"
            ),
        )
    };
    if !matches!(
        mt.as_str(),
        "application/merge-patch+json"
            | "application/strategic-merge-patch+json"
            | "application/json-patch+json"
    ) {
        return Err(unsupported());
    }
    let bytes = read_bytes(body).await?;
    let doc: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("couldn't decode the patch as JSON: {e}")))?;
    match mt.as_str() {
        "application/json-patch+json" => store.patch(res, ns, name, part, dry, |cur| {
            let mut v =
                json_patch(cur, &doc).map_err(|e| ApiError::invalid(res, name, &e.to_string()))?;
            rules.apply(res, part, (ns, name), &mut v, Some(cur))?;
            Ok(v)
        }),
        strategic_or_merge => {
            if strategic_or_merge == "application/strategic-merge-patch+json"
                && let Some(d) = find_directive(&doc)
            {
                return Err(ApiError::bad_request(format!(
                    "strategic merge patch directive {d:?} is not supported by this test server; send a JSON merge patch instead"
                )));
            }
            store.patch(res, ns, name, part, dry, |cur| {
                let mut v = cur.clone();
                merge_patch(&mut v, &doc);
                rules.apply(res, part, (ns, name), &mut v, Some(cur))?;
                Ok(v)
            })
        }
    }
}

fn version_json(v: KubeVersion) -> Value {
    json!({
        "major": v.major.to_string(),
        "minor": v.minor.to_string(),
        "emulationMajor": v.major.to_string(),
        "emulationMinor": v.minor.to_string(),
        "minCompatibilityMajor": v.major.to_string(),
        "minCompatibilityMinor": v.minor.saturating_sub(1).to_string(),
        "gitVersion": v.to_string(),
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "1970-01-01T00:00:00Z",
        "goVersion": "go1.25.0",
        "compiler": "gc",
        "platform": "linux/amd64",
    })
}

fn group_json() -> Value {
    let gv = json!({"groupVersion": API_VERSION, "version": VERSION});
    json!({"name": GROUP, "versions": [gv.clone()], "preferredVersion": gv})
}

fn resource_list_json() -> Value {
    let verbs = json!([
        "create",
        "delete",
        "deletecollection",
        "get",
        "list",
        "patch",
        "update",
        "watch"
    ]);
    let mut resources: Vec<Value> = Resource::ALL
        .iter()
        .map(|r| {
            json!({
                "name": r.plural(),
                "singularName": r.singular(),
                "namespaced": r.namespaced(),
                "kind": r.kind(),
                "verbs": verbs,
            })
        })
        .collect();
    for r in Resource::ALL.iter().filter(|r| r.has_status()) {
        resources.push(json!({
            "name": format!("{}/status", r.plural()),
            "singularName": "",
            "namespaced": r.namespaced(),
            "kind": r.kind(),
            "verbs": ["get", "patch", "update"],
        }));
    }
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": API_VERSION,
        "resources": resources,
    })
}

fn list_json(res: Resource, items: Vec<Value>, rv: u64) -> Value {
    json!({
        "kind": res.list_kind(),
        "apiVersion": API_VERSION,
        "metadata": {"resourceVersion": rv.to_string()},
        "items": items,
    })
}

// === watch ===

fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&json!({"type": kind, "object": object})).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

fn bookmark_line(res: Resource, rv: u64, initial_events_end: bool) -> Bytes {
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if initial_events_end {
        meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    event_line(
        "BOOKMARK",
        &json!({"kind": res.kind(), "apiVersion": API_VERSION, "metadata": meta}),
    )
}

/// What a watcher with these filters sees of `e`, if anything: selector
/// transitions turn modifications into ADDED/DELETED, as in Kubernetes.
fn translate<'a>(
    e: &'a Event,
    res: Resource,
    ns: Option<&str>,
    sel: &Selectors,
) -> Option<(&'static str, &'a Value)> {
    if e.resource != res {
        return None;
    }
    if let Some(ns) = ns
        && e.object
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            != Some(ns)
    {
        return None;
    }
    let now = sel.matches(&e.object);
    match e.kind {
        EventKind::Added => now.then_some(("ADDED", &e.object)),
        EventKind::Deleted => now.then_some(("DELETED", &e.object)),
        EventKind::Modified => {
            let before = e.old.as_ref().is_some_and(|o| sel.matches(o));
            match (before, now) {
                (true, true) => Some(("MODIFIED", &e.object)),
                (true, false) => Some(("DELETED", &e.object)),
                (false, true) => Some(("ADDED", &e.object)),
                (false, false) => None,
            }
        }
    }
}

struct Watcher {
    store: Store,
    res: Resource,
    ns: Option<String>,
    sel: Selectors,
    cursor: u64,
    initial: Vec<Value>,
    initial_end_bookmark: bool,
    bookmarks: bool,
    timeout: Option<Duration>,
    changed: watch::Receiver<u64>,
    epoch: watch::Receiver<u64>,
    bookmark_now: watch::Receiver<u64>,
    tx: mpsc::Sender<Bytes>,
}

fn start_watch(
    state: &Arc<ServerState>,
    res: Resource,
    ns: Option<String>,
    sel: Selectors,
    query: &Query,
) -> Result<Response<RespBody>, ApiError> {
    let timeout = query
        .get("timeoutSeconds")
        .map(|t| {
            t.parse::<u64>().map(Duration::from_secs).map_err(|_| {
                ApiError::bad_request(format!(
                    "timeoutSeconds {t:?} is not a whole number of seconds"
                ))
            })
        })
        .transpose()?;
    let send_initial = query.flag("sendInitialEvents");
    let rv = query.get("resourceVersion").unwrap_or("");
    // Subscribe before reading, so that no change in between is missed.
    let changed = state.store.subscribe();
    let (initial, cursor) = if send_initial || rv.is_empty() || rv == "0" {
        state.store.snapshot(res, ns.as_deref(), &sel)
    } else {
        let r = rv.parse::<u64>().map_err(|_| {
            ApiError::bad_request(format!("invalid resourceVersion {rv:?}: not a number"))
        })?;
        (Vec::new(), r)
    };
    let bookmarks = query.flag("allowWatchBookmarks");
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let watcher = Watcher {
        store: state.store.clone(),
        res,
        ns,
        sel,
        cursor,
        initial,
        initial_end_bookmark: send_initial && bookmarks,
        bookmarks,
        timeout,
        changed,
        epoch: state.epoch.subscribe(),
        bookmark_now: state.bookmarks.subscribe(),
        tx,
    };
    tokio::spawn(run_watch(watcher));
    let stream = ReceiverStream::new(rx).map(|b| Ok::<_, Infallible>(Frame::data(b)));
    let mut resp = Response::new(BodyExt::boxed(StreamBody::new(stream)));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    Ok(resp)
}

async fn run_watch(w: Watcher) {
    let Watcher {
        store,
        res,
        ns,
        sel,
        mut cursor,
        initial,
        initial_end_bookmark,
        bookmarks,
        timeout,
        mut changed,
        mut epoch,
        mut bookmark_now,
        tx,
    } = w;
    for obj in &initial {
        if tx.send(event_line("ADDED", obj)).await.is_err() {
            return;
        }
    }
    if initial_end_bookmark && tx.send(bookmark_line(res, cursor, true)).await.is_err() {
        return;
    }
    let expired = async move {
        match timeout {
            Some(t) => tokio::time::sleep(t).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(expired);
    let start = tokio::time::Instant::now() + BOOKMARK_INTERVAL;
    let mut ticker = tokio::time::interval_at(start, BOOKMARK_INTERVAL);
    loop {
        match store.events_since(cursor) {
            Err(gone) => {
                let status = ApiError::new(
                    410,
                    "Expired",
                    format!(
                        "too old resource version: {} ({})",
                        gone.requested, gone.oldest
                    ),
                )
                .status_json();
                let _ = tx.send(event_line("ERROR", &status)).await;
                return;
            }
            Ok((events, now)) => {
                for e in &events {
                    if let Some((kind, obj)) = translate(e, res, ns.as_deref(), &sel)
                        && tx.send(event_line(kind, obj)).await.is_err()
                    {
                        return;
                    }
                }
                cursor = cursor.max(now);
            }
        }
        let send_bookmark = tokio::select! {
            r = changed.changed() => {
                if r.is_err() {
                    return;
                }
                false
            }
            _ = epoch.changed() => return,
            r = bookmark_now.changed() => {
                if r.is_err() {
                    return;
                }
                bookmarks
            }
            _ = ticker.tick() => bookmarks,
            () = &mut expired => return,
            () = tx.closed() => return,
        };
        if send_bookmark && tx.send(bookmark_line(res, cursor, false)).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert!(matches!(route("/version"), Route::Version));
        assert!(matches!(
            route("/apis/resource.k8s.io/v1/resourceslices"),
            Route::Collection {
                res: Resource::ResourceSlices,
                ns: None
            }
        ));
        assert!(matches!(
            route("/apis/resource.k8s.io/v1/namespaces/a/resourceclaims/c/status"),
            Route::Item {
                res: Resource::ResourceClaims,
                status: true,
                ..
            }
        ));
        // Wrong scope or unknown subresource.
        for p in [
            "/apis/resource.k8s.io/v1/resourceclaims/c",
            "/apis/resource.k8s.io/v1/namespaces/a/resourceslices",
            "/apis/resource.k8s.io/v1/resourceslices/s/status",
            "/apis/resource.k8s.io/v1/namespaces//resourceclaims",
            "/apis/resource.k8s.io/v1beta1/resourceslices",
            "/api/v1/pods",
        ] {
            assert!(matches!(route(p), Route::Unknown), "{p}");
        }
    }
}
