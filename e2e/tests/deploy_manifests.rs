//! Renders the Helm chart in `deploy/helm/carve` without a helm binary and
//! checks every manifest against the Kubernetes OpenAPI types.
//!
//! The chart is rendered with `gtmpl` (Go text/template) plus the handful of
//! Helm/Sprig functions the chart uses, implemented below with Helm's
//! semantics. It is not a Helm replacement: only what the chart uses exists
//! (no `tpl`, `lookup`, `.Capabilities`, `.Files`, subcharts or hooks).
//!
//! Each rendered document is deserialized into its k8s-openapi type and
//! serialized back; the result must equal the rendered document, so unknown or
//! misspelled fields (which k8s-openapi would silently drop) fail the test.
//!
//! The DeviceClass selectors and the ValidatingAdmissionPolicy are evaluated
//! with the `cel` interpreter on hand-built inputs. That interpreter is not
//! the API server's (no type checking against the OpenAPI schema), so these
//! tests show the expressions' logic, not their acceptance by a cluster.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Debug;
use std::path::{Path, PathBuf};

use gtmpl::{Context, Func, FuncError, Template, Value};
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Container, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::api::resource::v1::DeviceClass;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value as Json;

const DRIVER: &str = "gpu.carve.dev";
const RELEASE: &str = "carve";
const NAMESPACE: &str = "carve-system";

// ---------------------------------------------------------------- paths

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e/ has a parent")
        .to_path_buf()
}

fn chart_dir() -> PathBuf {
    repo_root().join("deploy/helm/carve")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn yaml_file(path: &Path) -> serde_yaml::Value {
    serde_yaml::from_str(&read(path)).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

// ---------------------------------------------------------------- values

/// Helm's value coalescing: maps merge key by key, anything else in the
/// overlay replaces the base, and an overlay `null` deletes the key.
fn merge_values(base: &mut serde_yaml::Value, overlay: &serde_yaml::Value) {
    match (base, overlay) {
        (serde_yaml::Value::Mapping(b), serde_yaml::Value::Mapping(o)) => {
            for (k, v) in o {
                if v.is_null() {
                    b.remove(k);
                } else if let Some(existing) = b.get_mut(k) {
                    merge_values(existing, v);
                } else {
                    b.insert(k.clone(), v.clone());
                }
            }
        }
        (b, o) => *b = o.clone(),
    }
}

fn default_values() -> serde_yaml::Value {
    yaml_file(&chart_dir().join("values.yaml"))
}

fn values_with(overlay_yaml: &str) -> serde_yaml::Value {
    let mut v = default_values();
    let overlay: serde_yaml::Value = serde_yaml::from_str(overlay_yaml).expect("overlay parses");
    merge_values(&mut v, &overlay);
    v
}

fn kind_values() -> serde_yaml::Value {
    values_with(&read(&repo_root().join("deploy/kind/values-kind.yaml")))
}

fn to_json(v: &serde_yaml::Value) -> Json {
    serde_json::to_value(v).expect("values convert to JSON")
}

// ---------------------------------------------------------------- gtmpl <-> YAML

fn yaml_to_gtmpl(v: &serde_yaml::Value) -> Value {
    match v {
        serde_yaml::Value::Null => Value::Nil,
        serde_yaml::Value::Bool(b) => Value::from(*b),
        serde_yaml::Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        serde_yaml::Value::String(s) => Value::from(s.as_str()),
        serde_yaml::Value::Sequence(s) => Value::Array(s.iter().map(yaml_to_gtmpl).collect()),
        serde_yaml::Value::Mapping(m) => Value::Map(
            m.iter()
                .map(|(k, v)| {
                    let key = match k {
                        serde_yaml::Value::String(s) => s.clone(),
                        other => serde_yaml::to_string(other)
                            .expect("scalar key")
                            .trim()
                            .to_string(),
                    };
                    (key, yaml_to_gtmpl(v))
                })
                .collect::<HashMap<_, _>>(),
        ),
        serde_yaml::Value::Tagged(t) => yaml_to_gtmpl(&t.value),
    }
}

fn gtmpl_to_yaml(v: &Value) -> serde_yaml::Value {
    match v {
        Value::NoValue | Value::Nil | Value::Function(_) => serde_yaml::Value::Null,
        Value::Bool(b) => serde_yaml::Value::Bool(*b),
        Value::String(s) => serde_yaml::Value::String(s.clone()),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                serde_yaml::Value::from(i)
            } else if let Some(u) = n.as_u64() {
                serde_yaml::Value::from(u)
            } else {
                serde_yaml::Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Value::Array(a) => serde_yaml::Value::Sequence(a.iter().map(gtmpl_to_yaml).collect()),
        Value::Map(m) | Value::Object(m) => {
            // Sorted, like Go's map iteration in toYaml.
            let sorted: BTreeMap<&String, &Value> = m.iter().collect();
            serde_yaml::Value::Mapping(
                sorted
                    .into_iter()
                    .map(|(k, v)| (serde_yaml::Value::String(k.clone()), gtmpl_to_yaml(v)))
                    .collect(),
            )
        }
    }
}

/// Go's `%v`-ish string form used by Sprig's string functions.
fn strval(v: &Value) -> String {
    match v {
        Value::NoValue | Value::Nil => String::new(),
        other => other.to_string(),
    }
}

/// Sprig's `empty`: nil, false, 0, "" and empty collections.
fn is_empty(v: &Value) -> bool {
    match v {
        Value::NoValue | Value::Nil => true,
        Value::Bool(b) => !b,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Map(m) | Value::Object(m) => m.is_empty(),
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::Function(_) => false,
    }
}

fn arg<'a>(args: &'a [Value], i: usize, name: &str, n: usize) -> Result<&'a Value, FuncError> {
    if args.len() != n {
        return Err(FuncError::ExactlyXArgs(name.to_string(), n));
    }
    Ok(&args[i])
}

fn int_arg(v: &Value, name: &str) -> Result<i64, FuncError> {
    match v {
        Value::Number(n) => n
            .as_i64()
            .ok_or_else(|| FuncError::Generic(format!("{name}: {v} is not an integer"))),
        _ => Err(FuncError::Generic(format!("{name}: {v} is not an integer"))),
    }
}

// ---------------------------------------------------------------- Helm functions

fn f_default(args: &[Value]) -> Result<Value, FuncError> {
    match args {
        [d] => Ok(d.clone()),
        [d, given] => Ok(if is_empty(given) {
            d.clone()
        } else {
            given.clone()
        }),
        _ => Err(FuncError::AtLeastXArgs("default".into(), 1)),
    }
}

fn f_quote(args: &[Value]) -> Result<Value, FuncError> {
    let quoted: Vec<String> = args
        .iter()
        .filter(|a| !matches!(a, Value::NoValue | Value::Nil))
        .map(|a| serde_json::to_string(&strval(a)).expect("string serializes"))
        .collect();
    Ok(Value::from(quoted.join(" ")))
}

fn f_to_yaml(args: &[Value]) -> Result<Value, FuncError> {
    let v = arg(args, 0, "toYaml", 1)?;
    let text = serde_yaml::to_string(&gtmpl_to_yaml(v))
        .map_err(|e| FuncError::Generic(format!("toYaml: {e}")))?;
    Ok(Value::from(text.trim_end_matches('\n')))
}

fn f_to_json(args: &[Value]) -> Result<Value, FuncError> {
    let v = arg(args, 0, "toJson", 1)?;
    let text = serde_json::to_string(&gtmpl_to_yaml(v))
        .map_err(|e| FuncError::Generic(format!("toJson: {e}")))?;
    Ok(Value::from(text))
}

fn f_has_prefix(args: &[Value]) -> Result<Value, FuncError> {
    let prefix = strval(arg(args, 0, "hasPrefix", 2)?);
    Ok(Value::from(strval(&args[1]).starts_with(&prefix)))
}

fn f_list(args: &[Value]) -> Result<Value, FuncError> {
    Ok(Value::Array(args.to_vec()))
}

fn indent_text(n: i64, text: &str) -> String {
    let pad = " ".repeat(usize::try_from(n).unwrap_or(0));
    format!("{pad}{}", text.replace('\n', &format!("\n{pad}")))
}

fn f_indent(args: &[Value]) -> Result<Value, FuncError> {
    let n = int_arg(arg(args, 0, "indent", 2)?, "indent")?;
    Ok(Value::from(indent_text(n, &strval(&args[1]))))
}

fn f_nindent(args: &[Value]) -> Result<Value, FuncError> {
    let n = int_arg(arg(args, 0, "nindent", 2)?, "nindent")?;
    Ok(Value::from(format!(
        "\n{}",
        indent_text(n, &strval(&args[1]))
    )))
}

fn f_fail(args: &[Value]) -> Result<Value, FuncError> {
    Err(FuncError::Generic(strval(arg(args, 0, "fail", 1)?)))
}

fn f_contains(args: &[Value]) -> Result<Value, FuncError> {
    let needle = strval(arg(args, 0, "contains", 2)?);
    Ok(Value::from(strval(&args[1]).contains(&needle)))
}

fn f_trunc(args: &[Value]) -> Result<Value, FuncError> {
    let n = int_arg(arg(args, 0, "trunc", 2)?, "trunc")?;
    let s = strval(&args[1]);
    let n = usize::try_from(n).unwrap_or(usize::MAX);
    Ok(Value::from(s.chars().take(n).collect::<String>()))
}

fn f_trim_suffix(args: &[Value]) -> Result<Value, FuncError> {
    let suffix = strval(arg(args, 0, "trimSuffix", 2)?);
    let s = strval(&args[1]);
    Ok(Value::from(s.strip_suffix(&suffix).unwrap_or(&s)))
}

thread_local! {
    /// The chart's `_*.tpl` helper text, for `include` (gtmpl functions are
    /// plain `fn` pointers and cannot capture the template set).
    static HELPERS: RefCell<String> = const { RefCell::new(String::new()) };
}

fn f_include(args: &[Value]) -> Result<Value, FuncError> {
    let name = strval(arg(args, 0, "include", 2)?);
    let helpers = HELPERS.with(|h| h.borrow().clone());
    let mut t = Template::with_name("include");
    t.add_funcs(HELM_FUNCS);
    t.add_template("_helpers", helpers)
        .map_err(|e| FuncError::Generic(format!("include {name:?}: {e}")))?;
    t.parse(format!(
        "{{{{ template {} . }}}}",
        serde_json::to_string(&name).expect("name")
    ))
    .map_err(|e| FuncError::Generic(format!("include {name:?}: {e}")))?;
    let out = t
        .render(&Context::from(args[1].clone()))
        .map_err(|e| FuncError::Generic(format!("include {name:?}: {e}")))?;
    Ok(Value::from(out))
}

static HELM_FUNCS: &[(&str, Func)] = &[
    ("default", f_default as Func),
    ("quote", f_quote as Func),
    ("toYaml", f_to_yaml as Func),
    ("toJson", f_to_json as Func),
    ("hasPrefix", f_has_prefix as Func),
    ("list", f_list as Func),
    ("indent", f_indent as Func),
    ("nindent", f_nindent as Func),
    ("fail", f_fail as Func),
    ("contains", f_contains as Func),
    ("trunc", f_trunc as Func),
    ("trimSuffix", f_trim_suffix as Func),
    ("include", f_include as Func),
];

// ---------------------------------------------------------------- renderer

/// One rendered YAML document and the template file it came from.
#[derive(Debug, Clone)]
struct Doc {
    template: String,
    value: Json,
}

impl Doc {
    fn kind(&self) -> &str {
        self.value["kind"].as_str().unwrap_or("")
    }
    fn name(&self) -> &str {
        self.value["metadata"]["name"].as_str().unwrap_or("")
    }
}

fn render_template(name: &str, text: &str, ctx: &Value) -> Result<String, String> {
    let mut t = Template::with_name(name);
    t.add_funcs(HELM_FUNCS);
    let helpers = HELPERS.with(|h| h.borrow().clone());
    t.add_template("_helpers", helpers)
        .map_err(|e| format!("{name}: helpers: {e}"))?;
    t.parse(text).map_err(|e| format!("{name}: parse: {e}"))?;
    let out = t
        .render(&Context::from(ctx.clone()))
        .map_err(|e| format!("{name}: {e}"))?;
    // Helm replaces Go's rendering of missing map keys with nothing.
    Ok(out.replace("<no value>", ""))
}

/// Renders every template of the chart with `values` (already merged over the
/// defaults) and parses the output into YAML documents.
fn render_chart(values: &serde_yaml::Value) -> Result<Vec<Doc>, String> {
    let dir = chart_dir();
    let chart = yaml_file(&dir.join("Chart.yaml"));
    let chart_ctx: HashMap<String, Value> = [
        ("Name", "name"),
        ("Version", "version"),
        ("AppVersion", "appVersion"),
    ]
    .into_iter()
    .map(|(k, field)| (k.to_string(), yaml_to_gtmpl(&chart[field])))
    .collect();
    let release: HashMap<String, Value> = [
        ("Name".to_string(), Value::from(RELEASE)),
        ("Namespace".to_string(), Value::from(NAMESPACE)),
        ("Service".to_string(), Value::from("Helm")),
    ]
    .into_iter()
    .collect();
    let ctx = Value::Map(
        [
            ("Values".to_string(), yaml_to_gtmpl(values)),
            ("Release".to_string(), Value::Map(release)),
            ("Chart".to_string(), Value::Map(chart_ctx)),
        ]
        .into_iter()
        .collect(),
    );

    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir.join("templates"))
        .map_err(|e| format!("listing templates: {e}"))?
        .map(|e| e.map(|e| e.path()).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    entries.sort();
    let file_name = |p: &PathBuf| p.file_name().unwrap().to_string_lossy().into_owned();
    let helpers: String = entries
        .iter()
        .filter(|p| file_name(p).starts_with('_'))
        .map(|p| read(p))
        .collect::<Vec<_>>()
        .join("\n");
    HELPERS.with(|h| *h.borrow_mut() = helpers);

    let mut docs = Vec::new();
    for path in &entries {
        let name = file_name(path);
        if name.starts_with('_') || !(name.ends_with(".yaml") || name.ends_with(".yml")) {
            continue;
        }
        let out = render_template(&name, &read(path), &ctx)?;
        for (i, text) in split_documents(&out).into_iter().enumerate() {
            let value: Json = serde_yaml::from_str(&text)
                .map_err(|e| format!("{name} document {i}: {e}\n{text}"))?;
            if value.is_null() {
                continue;
            }
            docs.push(Doc {
                template: name.clone(),
                value,
            });
        }
    }
    Ok(docs)
}

/// Splits a multi-document YAML stream on `---` lines.
fn split_documents(text: &str) -> Vec<String> {
    let mut docs = vec![String::new()];
    for line in text.lines() {
        if line.trim_end() == "---" {
            docs.push(String::new());
        } else {
            let cur = docs.last_mut().expect("non-empty");
            cur.push_str(line);
            cur.push('\n');
        }
    }
    docs
}

// ---------------------------------------------------------------- typed validation

/// Deserializes `doc` as `T` and checks that serializing it back gives the
/// same JSON, i.e. the document has no field the OpenAPI type lacks.
fn round_trip<T: DeserializeOwned + Serialize>(doc: &Doc) -> T {
    let typed: T = serde_json::from_value(doc.value.clone()).unwrap_or_else(|e| {
        panic!(
            "{} {}/{}: does not deserialize: {e}",
            doc.template,
            doc.kind(),
            doc.name()
        )
    });
    let back = serde_json::to_value(&typed).expect("serializes");
    if let Some(diff) = first_difference(&doc.value, &back, "") {
        panic!(
            "{} {}/{}: the OpenAPI type does not keep {diff} (unknown or misspelled field?)",
            doc.template,
            doc.kind(),
            doc.name()
        );
    }
    typed
}

/// The JSON pointer of the first place where `a` and `b` differ, with both values.
fn first_difference(a: &Json, b: &Json, path: &str) -> Option<String> {
    match (a, b) {
        (Json::Object(x), Json::Object(y)) => x.keys().chain(y.keys()).find_map(|k| {
            let (l, r) = (
                x.get(k).unwrap_or(&Json::Null),
                y.get(k).unwrap_or(&Json::Null),
            );
            first_difference(l, r, &format!("{path}/{k}"))
        }),
        (Json::Array(x), Json::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (l, r))| first_difference(l, r, &format!("{path}/{i}"))),
        _ if a == b => None,
        _ => Some(format!("{path}: rendered {a}, typed {b}")),
    }
}

/// The typed objects of one render, validated against their OpenAPI types.
#[derive(Debug, Default)]
struct Manifests {
    daemonsets: Vec<DaemonSet>,
    service_accounts: Vec<ServiceAccount>,
    cluster_roles: Vec<ClusterRole>,
    cluster_role_bindings: Vec<ClusterRoleBinding>,
    policies: Vec<ValidatingAdmissionPolicy>,
    policy_bindings: Vec<ValidatingAdmissionPolicyBinding>,
    device_classes: Vec<DeviceClass>,
    config_maps: Vec<ConfigMap>,
}

fn validate(docs: &[Doc]) -> Manifests {
    let mut m = Manifests::default();
    for doc in docs {
        let api = doc.value["apiVersion"].as_str().unwrap_or("");
        match (api, doc.kind()) {
            ("apps/v1", "DaemonSet") => m.daemonsets.push(round_trip(doc)),
            ("v1", "ServiceAccount") => m.service_accounts.push(round_trip(doc)),
            ("v1", "ConfigMap") => m.config_maps.push(round_trip(doc)),
            ("rbac.authorization.k8s.io/v1", "ClusterRole") => {
                m.cluster_roles.push(round_trip(doc));
            }
            ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
                m.cluster_role_bindings.push(round_trip(doc));
            }
            ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy") => {
                m.policies.push(round_trip(doc));
            }
            ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding") => {
                m.policy_bindings.push(round_trip(doc));
            }
            ("resource.k8s.io/v1", "DeviceClass") => m.device_classes.push(round_trip(doc)),
            (api, kind) => panic!(
                "{}: unexpected {api} {kind}; add it to validate()",
                doc.template
            ),
        }
    }
    m
}

fn render_valid(values: &serde_yaml::Value) -> Manifests {
    let docs = render_chart(values).unwrap_or_else(|e| panic!("render failed: {e}"));
    validate(&docs)
}

fn one<'a, T: Debug>(items: &'a [T], what: &str) -> &'a T {
    assert_eq!(
        items.len(),
        1,
        "expected exactly one {what}, got {items:#?}"
    );
    &items[0]
}

fn plugin_container(ds: &DaemonSet) -> &Container {
    let spec = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    one(&spec.containers, "container")
}

fn args(c: &Container) -> Vec<String> {
    c.args.clone().unwrap_or_default()
}

fn host_paths(ds: &DaemonSet) -> BTreeMap<String, String> {
    let spec = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    spec.volumes
        .iter()
        .flatten()
        .filter_map(|v| {
            v.host_path
                .as_ref()
                .map(|h| (v.name.clone(), h.path.clone()))
        })
        .collect()
}

// ---------------------------------------------------------------- checks shared by renders

/// Structural checks that hold for every valid render.
fn check_common(m: &Manifests) {
    let ds = one(&m.daemonsets, "DaemonSet");
    let sa = one(&m.service_accounts, "ServiceAccount");
    let sa_name = sa.metadata.name.clone().unwrap();
    let sa_ns = sa.metadata.namespace.clone().unwrap();
    assert_eq!(sa_ns, NAMESPACE);

    let spec = ds.spec.as_ref().unwrap();
    // The API server rejects a DaemonSet whose selector does not match its template.
    let selector = spec.selector.match_labels.clone().unwrap();
    let labels = spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    for (k, v) in &selector {
        assert_eq!(
            labels.get(k),
            Some(v),
            "selector label {k} missing from pod template"
        );
    }
    let pod = spec.template.spec.as_ref().unwrap();
    assert_eq!(pod.service_account_name.as_deref(), Some(sa_name.as_str()));

    // Rolling update that keeps a DRA socket served.
    let strategy = spec.update_strategy.as_ref().unwrap();
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    let ru = strategy.rolling_update.as_ref().unwrap();
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    assert_eq!(ru.max_surge, Some(IntOrString::Int(1)));
    assert_eq!(ru.max_unavailable, Some(IntOrString::Int(0)));

    let c = plugin_container(ds);
    let a = args(c);
    assert_eq!(a.first().map(String::as_str), Some("kubelet-plugin"));
    for want in [
        "--node-name=$(NODE_NAME)",
        "--pod-uid=$(POD_UID)",
        "--plugins-dir=/var/lib/kubelet/plugins",
        "--registry-dir=/var/lib/kubelet/plugins_registry",
        "--cdi-dir=/var/run/cdi",
        "--state-dir=/var/lib/carve",
        "--metrics-addr=:9400",
    ] {
        assert!(a.iter().any(|x| x == want), "missing flag {want} in {a:?}");
    }
    // Every $(VAR) in args must be an env var of the container, else the
    // kubelet passes the literal text.
    let env: BTreeMap<String, _> = c
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.clone(), e.clone()))
        .collect();
    for x in &a {
        if let Some(start) = x.find("$(") {
            let var = &x[start + 2..x[start..].find(')').unwrap() + start];
            assert!(env.contains_key(var), "{x} refers to undefined env {var}");
        }
    }
    let field = |name: &str| {
        env[name]
            .value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.clone())
    };
    assert_eq!(field("NODE_NAME").as_deref(), Some("spec.nodeName"));
    assert_eq!(field("POD_UID").as_deref(), Some("metadata.uid"));

    // Probes on the metrics port.
    let port = one(c.ports.as_deref().unwrap_or_default(), "port");
    assert_eq!(port.container_port, 9400);
    let metrics = port.name.clone().unwrap();
    for (probe, path) in [
        (&c.liveness_probe, "/healthz"),
        (&c.readiness_probe, "/readyz"),
    ] {
        let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
        assert_eq!(get.path.as_deref(), Some(path));
        assert_eq!(get.port, IntOrString::String(metrics.clone()));
    }

    // Every mount has a volume; kubelet and CDI dirs are host paths.
    let volumes: Vec<&str> = pod
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    for mount in c.volume_mounts.iter().flatten() {
        assert!(
            volumes.contains(&mount.name.as_str()),
            "mount {} has no volume",
            mount.name
        );
    }
    let hp = host_paths(ds);
    assert_eq!(hp["plugins"], "/var/lib/kubelet/plugins");
    assert_eq!(hp["plugins-registry"], "/var/lib/kubelet/plugins_registry");
    assert_eq!(hp["cdi"], "/var/run/cdi");
    assert_eq!(hp["state"], "/var/lib/carve");

    // RBAC: exactly the rules the plugin uses, bound to its ServiceAccount.
    let role = one(&m.cluster_roles, "ClusterRole");
    let mut rules: Vec<(String, String, Vec<String>)> = Vec::new();
    for r in role.rules.iter().flatten() {
        for g in r.api_groups.iter().flatten() {
            for res in r.resources.iter().flatten() {
                let mut verbs = r.verbs.clone();
                verbs.sort();
                rules.push((g.clone(), res.clone(), verbs));
            }
        }
        assert!(r.resource_names.is_none() && r.non_resource_urls.is_none());
    }
    rules.sort();
    let v = |s: &[&str]| {
        let mut v: Vec<String> = s.iter().map(|x| x.to_string()).collect();
        v.sort();
        v
    };
    assert_eq!(
        rules,
        vec![
            (
                "resource.k8s.io".to_string(),
                "resourceclaims".to_string(),
                v(&["get", "list", "watch"])
            ),
            (
                "resource.k8s.io".to_string(),
                "resourceclaims/status".to_string(),
                v(&["update", "patch"])
            ),
            (
                "resource.k8s.io".to_string(),
                "resourceslices".to_string(),
                v(&[
                    "get", "list", "watch", "create", "update", "patch", "delete"
                ])
            ),
        ]
    );
    let binding = one(&m.cluster_role_bindings, "ClusterRoleBinding");
    assert_eq!(binding.role_ref.kind, "ClusterRole");
    assert_eq!(Some(&binding.role_ref.name), role.metadata.name.as_ref());
    let subject = one(binding.subjects.as_deref().unwrap_or_default(), "subject");
    assert_eq!(subject.kind, "ServiceAccount");
    assert_eq!(subject.name, sa_name);
    assert_eq!(subject.namespace.as_deref(), Some(NAMESPACE));

    // Admission policy: only the plugin's ServiceAccount, only its node, only
    // this driver, never cluster-wide slices.
    let vap = one(&m.policies, "ValidatingAdmissionPolicy");
    let vspec = vap.spec.as_ref().unwrap();
    assert_eq!(vspec.failure_policy.as_deref(), Some("Fail"));
    let rule = one(
        vspec
            .match_constraints
            .as_ref()
            .unwrap()
            .resource_rules
            .as_deref()
            .unwrap(),
        "resource rule",
    );
    assert_eq!(
        rule.resources.as_deref(),
        Some(&["resourceslices".to_string()][..])
    );
    assert_eq!(
        rule.api_groups.as_deref(),
        Some(&["resource.k8s.io".to_string()][..])
    );
    let mut ops = rule.operations.clone().unwrap();
    ops.sort();
    assert_eq!(ops, ["CREATE", "DELETE", "UPDATE"]);
    let cond = one(
        vspec.match_conditions.as_deref().unwrap(),
        "match condition",
    );
    assert!(
        cond.expression
            .contains(&format!("\"system:serviceaccount:{NAMESPACE}:{sa_name}\"")),
        "match condition does not name the plugin ServiceAccount: {}",
        cond.expression
    );
    let all_cel: String = vspec
        .variables
        .iter()
        .flatten()
        .map(|v| v.expression.clone())
        .chain(
            vspec
                .validations
                .iter()
                .flatten()
                .map(|v| v.expression.clone()),
        )
        .collect::<Vec<_>>()
        .join("\n");
    for want in [
        "request.userInfo.extra[?'authentication.kubernetes.io/node-name']",
        "spec.?nodeName",
        &format!("spec.driver == \"{DRIVER}\""),
        "allNodes",
        "nodeSelector",
        "perDeviceNodeSelection",
        "oldObject.spec.?nodeName",
    ] {
        assert!(
            all_cel.contains(want),
            "policy CEL lacks {want}:\n{all_cel}"
        );
    }
    let pb = one(&m.policy_bindings, "ValidatingAdmissionPolicyBinding");
    let pbs = &pb.spec;
    assert_eq!(Some(&pbs.policy_name), vap.metadata.name.as_ref());
    assert_eq!(pbs.validation_actions, ["Deny"]);

    // DeviceClasses.
    let names: Vec<&str> = m
        .device_classes
        .iter()
        .map(|d| d.metadata.name.as_deref().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "gpu.carve.dev",
            "mig.gpu.carve.dev",
            "mps.gpu.carve.dev",
            "timeslice.gpu.carve.dev"
        ]
    );
}

fn selectors(classes: &[DeviceClass]) -> BTreeMap<String, Vec<String>> {
    classes
        .iter()
        .map(|d| {
            let exprs = d
                .spec
                .selectors
                .iter()
                .flatten()
                .filter_map(|s| s.cel.as_ref().map(|c| c.expression.trim().to_string()))
                .collect();
            (d.metadata.name.clone().unwrap(), exprs)
        })
        .collect()
}

// ---------------------------------------------------------------- tests

#[test]
fn default_values_render_to_valid_manifests() {
    let m = render_valid(&default_values());
    check_common(&m);
    let ds = one(&m.daemonsets, "DaemonSet");
    let c = plugin_container(ds);
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.privileged, Some(true), "real NVML needs privileged");
    let a = args(c);
    assert!(a.contains(&"--mig-policy=dynamic".to_string()), "{a:?}");
    assert!(
        a.contains(&"--proc-driver-nvidia=/proc/driver/nvidia".to_string()),
        "{a:?}"
    );
    assert!(!a.iter().any(|x| x.starts_with("--nvml-lib")), "{a:?}");
    assert!(!a.iter().any(|x| x.starts_with("--mps-control")), "{a:?}");
    assert!(!a.iter().any(|x| x.starts_with("--sharing")), "{a:?}");
    assert_eq!(host_paths(ds).get("dev").map(String::as_str), Some("/dev"));
    let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(
        pod.node_selector
            .as_ref()
            .unwrap()
            .get("nvidia.com/gpu.present")
            .map(String::as_str),
        Some("true")
    );
    assert!(pod.tolerations.as_ref().is_some_and(|t| !t.is_empty()));
    assert!(
        m.config_maps.is_empty(),
        "no simulator ConfigMap by default"
    );
    assert_eq!(
        c.image.as_deref(),
        Some("ghcr.io/carve-dev/carve:0.1.0"),
        "image tag defaults to appVersion"
    );
}

#[test]
fn kind_values_render_to_valid_manifests() {
    let values = kind_values();
    let m = render_valid(&values);
    check_common(&m);
    let ds = one(&m.daemonsets, "DaemonSet");
    let c = plugin_container(ds);
    let a = args(c);
    assert!(
        a.contains(&"--nvml-lib=/opt/carve/libnvidia_ml_sim.so".to_string()),
        "{a:?}"
    );
    assert_eq!(c.image.as_deref(), Some("carve:dev"));
    assert_eq!(c.image_pull_policy.as_deref(), Some("Never"));

    // Least privilege with the simulator: nothing but root file ownership.
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.privileged, Some(false));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(
        sc.capabilities.as_ref().unwrap().drop.as_deref(),
        Some(&["ALL".to_string()][..])
    );
    assert!(
        !host_paths(ds).contains_key("dev"),
        "simulator needs no /dev"
    );

    // The simulator config: env names the file, the ConfigMap holds it as JSON.
    let env = c.env.as_ref().unwrap();
    let cfg_path = env
        .iter()
        .find(|e| e.name == "CARVE_NVML_SIM_CONFIG")
        .and_then(|e| e.value.clone())
        .expect("CARVE_NVML_SIM_CONFIG set");
    let (dir, file) = cfg_path.rsplit_once('/').unwrap();
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|v| v.mount_path == dir)
        .expect("sim config mounted");
    let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let vol = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .unwrap();
    let cm = one(&m.config_maps, "ConfigMap");
    assert_eq!(
        vol.config_map.as_ref().unwrap().name,
        cm.metadata.name.clone().unwrap()
    );
    let text = &cm.data.as_ref().unwrap()[file];
    let cfg: Json = serde_json::from_str(text).expect("simulator config is JSON");
    assert_eq!(cfg, to_json(&values["nvml"]["simulator"]["config"]));
    // The plugin reads the simulator's capability files, and the simulator
    // writes only below the plugin's writable state hostPath.
    let proc_root = cfg["procRoot"].as_str().unwrap();
    assert!(
        a.contains(&format!("--proc-driver-nvidia={proc_root}")),
        "{a:?}"
    );
    for key in ["stateFile", "procRoot"] {
        assert!(
            cfg[key].as_str().unwrap().starts_with("/var/lib/carve/"),
            "{key}"
        );
    }
    assert_eq!(sc.read_only_root_filesystem, Some(true));
}

/// The simulator config in the kind values is one `carve-nvml-sim` accepts
/// (its type denies unknown fields) and names known GPU models; its nodeName
/// is the kind GPU worker's.
#[test]
fn kind_simulator_config_is_accepted_by_the_simulator() {
    let values = kind_values();
    let cfg: nvidia_ml_sim::SimConfig =
        serde_json::from_value(to_json(&values["nvml"]["simulator"]["config"]))
            .expect("kind simulator config is a carve-nvml-sim SimConfig");
    let keys = cfg
        .model_keys(Path::new("deploy/kind/values-kind.yaml"))
        .expect("known GPU models");
    assert!(!keys.is_empty());

    let kind = yaml_file(&repo_root().join("deploy/kind/kind-config.yaml"));
    let workers: Vec<&serde_yaml::Value> = kind["nodes"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter(|n| n["role"] == "worker")
        .collect();
    let worker = one(&workers, "kind worker");
    assert_eq!(
        cfg.node_name,
        format!("{}-worker", kind["name"].as_str().unwrap()),
        "kind names its only worker <cluster>-worker"
    );
    // The worker carries the chart's default nodeSelector label.
    let selector = &default_values()["kubeletPlugin"]["nodeSelector"];
    for (k, v) in selector.as_mapping().unwrap() {
        assert_eq!(&worker["labels"][k], v, "kind worker lacks label {k:?}");
    }
    // The DRA gates and CDI in containerd.
    for gate in ["DRAPartitionableDevices", "DRAConsumableCapacity"] {
        assert_eq!(
            kind["featureGates"][gate],
            serde_yaml::Value::Bool(true),
            "{gate}"
        );
    }
    let patches = serde_yaml::to_string(&kind["containerdConfigPatches"]).unwrap();
    assert!(patches.contains("enable_cdi = true"), "{patches}");
    assert!(patches.contains("\"/var/run/cdi\""), "{patches}");
}

#[test]
fn values_files_match_schema() {
    let schema: Json = serde_json::from_str(&read(&chart_dir().join("values.schema.json")))
        .expect("schema is JSON");
    let validator = jsonschema::validator_for(&schema).expect("schema is a valid JSON Schema");
    for (what, values) in [("values.yaml", default_values()), ("kind", kind_values())] {
        let instance = to_json(&values);
        let errors: Vec<String> = validator
            .iter_errors(&instance)
            .map(|e| format!("{} at {}", e, e.instance_path()))
            .collect();
        assert!(errors.is_empty(), "{what} violates the schema: {errors:#?}");
    }
}

/// Asserts that the schema rejects `overlay` and that rendering fails with a
/// message containing `message`.
fn assert_rejected(overlay: &str, schema_path: &str, message: &str) {
    let values = values_with(overlay);
    let schema: Json =
        serde_json::from_str(&read(&chart_dir().join("values.schema.json"))).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let instance = to_json(&values);
    let errors: Vec<String> = validator
        .iter_errors(&instance)
        .map(|e| format!("{}", e.instance_path()))
        .collect();
    assert!(
        errors.iter().any(|p| p.starts_with(schema_path)),
        "schema did not reject {overlay:?} at {schema_path}: {errors:?}"
    );
    match render_chart(&values) {
        Ok(_) => panic!("render of {overlay:?} succeeded"),
        Err(e) => assert!(e.contains(message), "render error {e:?} lacks {message:?}"),
    }
}

#[test]
fn mps_without_control_binary_is_rejected() {
    assert_rejected(
        "mps: {enabled: true}",
        "/mps",
        "mps.enabled is true but mps.controlBinary is empty",
    );
}

#[test]
fn mps_without_privileged_is_rejected() {
    assert_rejected(
        "{mps: {enabled: true, controlBinary: /usr/bin/nvidia-cuda-mps-control}, nvml: {lib: /opt/carve/libnvidia_ml_sim.so, simulator: {enabled: true, config: {nodeName: n, gpus: [{model: a100-40gb}], stateFile: /var/lib/carve/s.json, procRoot: /var/lib/carve/proc}}}, kubeletPlugin: {privileged: false, procDriverNvidia: /var/lib/carve/proc}}",
        "/kubeletPlugin/privileged",
        "mps.enabled is true but kubeletPlugin.privileged is false",
    );
}

/// A kind-values overlay with one simulator setting replaced.
fn kind_overlay(change: &str) -> String {
    let mut v: serde_yaml::Value =
        serde_yaml::from_str(&read(&repo_root().join("deploy/kind/values-kind.yaml"))).unwrap();
    merge_values(&mut v, &serde_yaml::from_str(change).unwrap());
    serde_yaml::to_string(&v).unwrap()
}

#[test]
fn simulator_without_library_is_rejected() {
    assert_rejected(
        &kind_overlay("nvml: {lib: ''}"),
        "/nvml",
        "nvml.simulator.enabled is true but nvml.lib is empty",
    );
}

#[test]
fn simulator_without_proc_root_is_rejected() {
    assert_rejected(
        &kind_overlay("nvml: {simulator: {config: {procRoot: null}}}"),
        "/nvml/simulator/config",
        "nvml.simulator.config.procRoot is empty",
    );
}

#[test]
fn simulator_files_outside_state_dir_are_rejected() {
    assert_rejected(
        &kind_overlay("nvml: {simulator: {config: {stateFile: /tmp/state.json}}}"),
        "/nvml/simulator/config/stateFile",
        "nvml.simulator.config.stateFile must lie under /var/lib/carve/",
    );
}

#[test]
fn simulator_proc_root_mismatch_fails_render() {
    // Equality of two values is not expressible in draft-07 JSON Schema, so
    // only the template catches this one.
    let values = values_with(&kind_overlay(
        "kubeletPlugin: {procDriverNvidia: /proc/driver/nvidia}",
    ));
    let err = render_chart(&values).expect_err("render must fail");
    assert!(
        err.contains("kubeletPlugin.procDriverNvidia (/proc/driver/nvidia) differs from nvml.simulator.config.procRoot (/var/lib/carve/nvml-sim/proc)"),
        "{err}"
    );
}

#[test]
fn unprivileged_real_nvml_is_rejected() {
    assert_rejected(
        "kubeletPlugin: {privileged: false}",
        "/kubeletPlugin/privileged",
        "kubeletPlugin.privileged is false without nvml.simulator.enabled",
    );
}

#[test]
fn schema_rejects_unknown_keys_and_bad_policies() {
    let schema: Json =
        serde_json::from_str(&read(&chart_dir().join("values.schema.json"))).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    for overlay in [
        "kubeletPlugin: {privilegd: true}",
        "migPolicy: {default: disabled}",
        "nvml: {simulator: {config: {gpus: [{model: h100-80gb, cnt: 2}]}}}",
        "migPolicy: {perGpu: [{gpu: -1, policy: dynamic}]}",
        "kubeletPlugin: {metricsPort: 70000}",
        "mps: {protocol: v4}",
        "mps: {migInstances: yes-please}",
        "timeslice: {enabled: true, slices: 4}",
        "typo: 1",
    ] {
        let instance = to_json(&values_with(overlay));
        assert!(
            !validator.is_valid(&instance),
            "schema accepted {overlay:?}"
        );
    }
}

#[test]
fn mps_and_per_gpu_policy_render_flags() {
    let m = render_valid(&values_with(
        "{mps: {enabled: true, controlBinary: /driver/usr/bin/nvidia-cuda-mps-control}, migPolicy: {perGpu: [{gpu: 1, policy: static}, {gpu: 3, policy: static}]}}",
    ));
    check_common(&m);
    let ds = one(&m.daemonsets, "DaemonSet");
    let c = plugin_container(ds);
    let a = args(c);
    assert!(
        a.contains(&"--mig-policy=dynamic,1=static,3=static".to_string()),
        "{a:?}"
    );
    assert!(
        a.contains(&"--mps-control=/driver/usr/bin/nvidia-cuda-mps-control".to_string()),
        "{a:?}"
    );
    // MPS state on the host path that is mounted at the same place (CDI
    // bind-mounts the pipe directories from it into workload containers).
    assert!(a.contains(&"--mps-dir=/run/carve/mps".to_string()), "{a:?}");
    assert!(a.contains(&"--mps-protocol=auto".to_string()), "{a:?}");
    assert!(a.contains(&"--sharing=mps,mig-mps".to_string()), "{a:?}");
    assert_eq!(
        host_paths(ds).get("mps-root").map(String::as_str),
        Some("/run/carve/mps")
    );
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|v| v.name == "mps-root")
        .unwrap();
    assert_eq!(
        mount.mount_path, "/run/carve/mps",
        "mounted at the host's path"
    );
}

#[test]
fn timeslice_alone_renders_its_sharing_flag() {
    let m = render_valid(&values_with("{timeslice: {enabled: true}}"));
    let a = args(plugin_container(one(&m.daemonsets, "DaemonSet")));
    assert!(a.contains(&"--sharing=timeslice".to_string()), "{a:?}");
    assert!(!a.iter().any(|x| x.starts_with("--mps")), "{a:?}");
}

#[test]
fn optional_objects_can_be_turned_off() {
    let m = render_valid(&values_with(
        "{deviceClasses: {enabled: false}, validatingAdmissionPolicy: {enabled: false}}",
    ));
    assert!(m.device_classes.is_empty());
    assert!(m.policies.is_empty() && m.policy_bindings.is_empty());
    assert_eq!(m.daemonsets.len(), 1);
}

#[test]
fn release_name_feeds_resource_names() {
    let m = render_valid(&values_with("fullnameOverride: gpu-driver"));
    let ds = one(&m.daemonsets, "DaemonSet");
    assert_eq!(
        ds.metadata.name.as_deref(),
        Some("gpu-driver-kubelet-plugin")
    );
    let sa = one(&m.service_accounts, "ServiceAccount");
    assert_eq!(sa.metadata.name.as_deref(), Some("gpu-driver"));
    let ds_default = render_valid(&default_values());
    // Release "carve" already contains the chart name: no "carve-carve".
    assert_eq!(
        one(&ds_default.daemonsets, "DaemonSet")
            .metadata
            .name
            .as_deref(),
        Some("carve-kubelet-plugin")
    );
}

/// The DeviceClass selectors select the intended carve devices, evaluated
/// with a CEL interpreter on devices shaped like the scheduler's CEL input.
#[test]
fn device_class_selectors_select_the_intended_devices() {
    let m = render_valid(&default_values());
    let sel = selectors(&m.device_classes);
    let device = |ty: &str, sharing: Option<&str>| {
        let mut attrs = serde_json::json!({ "type": ty, "uuid": "GPU-x" });
        if let Some(s) = sharing {
            attrs["sharing"] = Json::from(s);
        }
        serde_json::json!({ "driver": DRIVER, "attributes": { DRIVER: attrs }, "capacity": {} })
    };
    let other = serde_json::json!({
        "driver": "gpu.nvidia.com", "attributes": { "gpu.nvidia.com": { "type": "gpu" } }, "capacity": {}
    });
    let untyped = serde_json::json!({
        "driver": DRIVER, "attributes": { DRIVER: { "uuid": "GPU-y" } }, "capacity": {}
    });
    let cases = [
        ("gpu.carve.dev", device("gpu", None), true),
        ("gpu.carve.dev", device("mig", None), false),
        ("gpu.carve.dev", other.clone(), false),
        ("mig.gpu.carve.dev", device("mig", None), true),
        ("mig.gpu.carve.dev", device("gpu", None), false),
        ("mps.gpu.carve.dev", device("gpu", Some("mps")), true),
        ("mps.gpu.carve.dev", device("mig", Some("mps")), true),
        ("mps.gpu.carve.dev", device("gpu", Some("timeslice")), false),
        ("mps.gpu.carve.dev", other.clone(), false),
        // Devices without a sharing attribute must not make the selector fail.
        ("mps.gpu.carve.dev", device("gpu", None), false),
        ("timeslice.gpu.carve.dev", device("mig", None), false),
        // Nor devices without a type attribute.
        ("gpu.carve.dev", untyped.clone(), false),
        ("mig.gpu.carve.dev", untyped.clone(), false),
        (
            "timeslice.gpu.carve.dev",
            device("gpu", Some("timeslice")),
            true,
        ),
        ("timeslice.gpu.carve.dev", device("gpu", Some("mps")), false),
    ];
    for (class, dev, want) in cases {
        for expr in &sel[class] {
            let program = cel::Program::compile(expr)
                .unwrap_or_else(|e| panic!("{class}: {expr:?} does not parse: {e}"));
            let mut ctx = cel::Context::default();
            ctx.add_variable("device", dev.clone()).unwrap();
            let got = program.execute(&ctx);
            assert!(
                matches!(got, Ok(cel::Value::Bool(b)) if b == want),
                "{class}: {expr} on {dev} gave {got:?}, want {want}"
            );
        }
    }
}

#[test]
fn device_class_selectors_match_examples() {
    let path = repo_root().join("examples/deviceclasses.yaml");
    if !path.exists() {
        println!(
            "SKIPPED: {} does not exist yet; nothing to compare the chart's DeviceClasses with",
            path.display()
        );
        return;
    }
    let text = read(&path);
    let docs: Vec<Doc> = split_documents(&text)
        .into_iter()
        .filter_map(|t| serde_yaml::from_str::<Json>(&t).ok())
        .filter(|v| !v.is_null())
        .map(|value| Doc {
            template: "examples/deviceclasses.yaml".into(),
            value,
        })
        .collect();
    let examples: Vec<DeviceClass> = docs
        .iter()
        .filter(|d| d.kind() == "DeviceClass")
        .map(round_trip)
        .collect();
    let chart = render_valid(&default_values());
    assert_eq!(selectors(&chart.device_classes), selectors(&examples));
}

// ---------------------------------------------------------------- renderer self-tests

fn render_str(text: &str, values: &str) -> Result<String, String> {
    let v: serde_yaml::Value = serde_yaml::from_str(values).unwrap();
    HELPERS.with(|h| {
        *h.borrow_mut() = r#"{{- define "t.hello" -}}hello {{ .name }}{{- end -}}"#.to_string()
    });
    render_template("t", text, &yaml_to_gtmpl(&v))
}

#[test]
fn renderer_functions_follow_helm() {
    assert_eq!(render_str(r#"{{ default "d" .x }}"#, "x: ''").unwrap(), "d");
    assert_eq!(
        render_str(r#"{{ .x | default "d" }}"#, "x: v").unwrap(),
        "v"
    );
    assert_eq!(
        render_str(r#"{{ default "d" .missing }}"#, "x: 1").unwrap(),
        "d"
    );
    assert_eq!(
        render_str(r#"{{ .x | quote }}"#, "x: 'a\"b'").unwrap(),
        r#""a\"b""#
    );
    assert_eq!(
        render_str("k:{{ toYaml .m | nindent 2 }}", "m: {b: 1, a: [x]}").unwrap(),
        "k:\n  a:\n  - x\n  b: 1"
    );
    assert_eq!(
        render_str("{{ .s | indent 2 }}", "s: \"a\\nb\"").unwrap(),
        "  a\n  b"
    );
    assert_eq!(
        render_str(r#"{{ include "t.hello" . | nindent 1 }}"#, "name: w").unwrap(),
        "\n hello w"
    );
    assert_eq!(
        render_str(r#"{{ contains "ar" .s }}"#, "s: carve").unwrap(),
        "true"
    );
    assert_eq!(
        render_str(r#"{{ .s | trunc 3 | trimSuffix "-" }}"#, "s: ab-cd").unwrap(),
        "ab"
    );
    assert_eq!(render_str("[{{ .missing }}]", "x: 1").unwrap(), "[]");
    let err = render_str(r#"{{ if .x }}{{ fail "x is bad" }}{{ end }}"#, "x: true").unwrap_err();
    assert!(err.contains("x is bad"), "{err}");
    assert_eq!(
        render_str(r#"{{ printf ",%v=%s" .n .s }}"#, "{n: 2, s: off}").unwrap(),
        ",2=off"
    );
    assert_eq!(
        render_str("{{ toJson .m }}", "m: {b: [1, x], a: true}").unwrap(),
        r#"{"a":true,"b":[1,"x"]}"#
    );
    assert_eq!(
        render_str(r#"{{ hasPrefix "/a/" .s }}"#, "s: /a/b").unwrap(),
        "true"
    );
    assert_eq!(
        render_str(r#"{{ range list "x" "y" }}{{ . }}{{ end }}"#, "{}").unwrap(),
        "xy"
    );
}

#[test]
fn values_merge_like_helm() {
    let mut base: serde_yaml::Value =
        serde_yaml::from_str("{a: {b: 1, c: 2}, l: [1, 2], k: v}").unwrap();
    let overlay: serde_yaml::Value =
        serde_yaml::from_str("{a: {c: 3, d: 4}, l: [9], k: null}").unwrap();
    merge_values(&mut base, &overlay);
    let want: serde_yaml::Value = serde_yaml::from_str("{a: {b: 1, c: 3, d: 4}, l: [9]}").unwrap();
    assert_eq!(base, want);
}

// ---------------------------------------------------------------- admission policy, evaluated

/// Outcome of evaluating the policy on one request, the way the API server
/// does: match conditions, then variables in order, then each validation.
#[derive(Debug, PartialEq)]
enum Admission {
    /// A match condition is false: the policy does not apply.
    NotMatched,
    Allowed,
    /// Denied with the message of the first failing validation.
    Denied(String),
}

/// The CEL standard library with optionals (`a.?b`, `m[?k]`, `orValue`), as
/// the API server's admission CEL has.
fn cel_env() -> std::sync::Arc<cel::Env> {
    std::sync::Arc::new(cel::Env::stdlib())
}

fn cel_eval(expr: &str, vars: &serde_json::Map<String, Json>) -> cel::Value {
    let env = cel_env();
    let program = env
        .compile(expr)
        .unwrap_or_else(|e| panic!("{expr:?} does not parse: {e}"));
    let mut ctx = cel::Context::with_env(env);
    for (k, v) in vars {
        ctx.add_variable(k.as_str(), v.clone()).unwrap();
    }
    program
        .execute(&ctx)
        .unwrap_or_else(|e| panic!("{expr:?} failed on {vars:?}: {e:?}"))
}

fn cel_to_json(v: &cel::Value) -> Json {
    match v {
        cel::Value::Null => Json::Null,
        cel::Value::Bool(b) => Json::from(*b),
        cel::Value::Int(i) => Json::from(*i),
        cel::Value::UInt(u) => Json::from(*u),
        cel::Value::Float(f) => Json::from(*f),
        cel::Value::String(s) => Json::from(s.as_str()),
        cel::Value::List(l) => Json::Array(l.iter().map(cel_to_json).collect()),
        cel::Value::Map(m) => Json::Object(
            m.map
                .iter()
                .map(|(k, v)| (k.to_string(), cel_to_json(v)))
                .collect(),
        ),
        other => panic!("unexpected CEL value {other:?}"),
    }
}

fn admit(
    policy: &ValidatingAdmissionPolicy,
    operation: &str,
    username: &str,
    node: Option<&str>,
    object: Json,
    old_object: Json,
) -> Admission {
    let spec = policy.spec.as_ref().unwrap();
    // A typed request: `extra` is an empty map when the token has no node.
    let extra = match node {
        Some(n) => serde_json::json!({ "authentication.kubernetes.io/node-name": [n] }),
        None => serde_json::json!({}),
    };
    let mut vars = serde_json::Map::new();
    vars.insert(
        "request".into(),
        serde_json::json!({
            "operation": operation,
            "userInfo": { "username": username, "extra": extra },
        }),
    );
    vars.insert("object".into(), object);
    vars.insert("oldObject".into(), old_object);
    for c in spec.match_conditions.iter().flatten() {
        if cel_eval(&c.expression, &vars) != cel::Value::Bool(true) {
            return Admission::NotMatched;
        }
    }
    let mut variables = serde_json::Map::new();
    for v in spec.variables.iter().flatten() {
        vars.insert("variables".into(), Json::Object(variables.clone()));
        let value = cel_to_json(&cel_eval(&v.expression, &vars));
        variables.insert(v.name.clone(), value);
    }
    vars.insert("variables".into(), Json::Object(variables));
    for v in spec.validations.iter().flatten() {
        match cel_eval(&v.expression, &vars) {
            cel::Value::Bool(true) => {}
            cel::Value::Bool(false) => {
                let message = match &v.message_expression {
                    Some(m) => match cel_eval(m, &vars) {
                        cel::Value::String(s) => s.to_string(),
                        other => panic!("messageExpression gave {other:?}"),
                    },
                    None => v.message.clone().unwrap_or_default(),
                };
                return Admission::Denied(message);
            }
            other => panic!("validation {:?} gave {other:?}", v.expression),
        }
    }
    Admission::Allowed
}

fn slice(spec: Json) -> Json {
    serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": { "name": "s" },
        "spec": spec,
    })
}

fn own_slice(node: &str) -> Json {
    slice(serde_json::json!({
        "driver": DRIVER,
        "nodeName": node,
        "pool": { "name": node, "generation": 1, "resourceSliceCount": 2 },
        "devices": [{ "name": "gpu-0" }],
    }))
}

#[test]
fn admission_policy_confines_the_plugin_to_its_node_and_driver() {
    let m = render_valid(&default_values());
    let vap = one(&m.policies, "ValidatingAdmissionPolicy");
    let sa = format!("system:serviceaccount:{NAMESPACE}:carve");
    let plugin =
        |op: &str, node: Option<&str>, obj: Json, old: Json| admit(vap, op, &sa, node, obj, old);
    let denied = |a: Admission, needle: &str| match a {
        Admission::Denied(msg) => assert!(msg.contains(needle), "{msg:?} lacks {needle:?}"),
        other => panic!("expected denial containing {needle:?}, got {other:?}"),
    };
    let a = Some("node-a");

    // Own node, own driver: devices, and a counter-only slice.
    assert_eq!(
        plugin("CREATE", a, own_slice("node-a"), Json::Null),
        Admission::Allowed
    );
    let counters = slice(serde_json::json!({
        "driver": DRIVER, "nodeName": "node-a",
        "pool": { "name": "node-a", "generation": 1, "resourceSliceCount": 2 },
        "sharedCounters": [{ "name": "gpu-0-counters", "counters": {} }],
    }));
    assert_eq!(
        plugin("CREATE", a, counters, Json::Null),
        Admission::Allowed
    );
    assert_eq!(
        plugin("UPDATE", a, own_slice("node-a"), own_slice("node-a")),
        Admission::Allowed
    );
    assert_eq!(
        plugin("DELETE", a, Json::Null, own_slice("node-a")),
        Admission::Allowed
    );

    // Another node's slices.
    denied(
        plugin("CREATE", a, own_slice("node-b"), Json::Null),
        "ResourceSlices of node 'node-b'",
    );
    denied(
        plugin("DELETE", a, Json::Null, own_slice("node-b")),
        "ResourceSlices of node 'node-b'",
    );
    denied(
        plugin("UPDATE", a, own_slice("node-a"), own_slice("node-b")),
        "belonged to another node or driver",
    );

    // Another driver.
    let mut foreign = own_slice("node-a");
    foreign["spec"]["driver"] = Json::from("gpu.nvidia.com");
    denied(
        plugin("CREATE", a, foreign, Json::Null),
        "not 'gpu.nvidia.com'",
    );

    // Cluster-wide or node-selected slices.
    let all = slice(serde_json::json!({
        "driver": DRIVER, "allNodes": true,
        "pool": { "name": "p", "generation": 1, "resourceSliceCount": 1 },
    }));
    denied(
        plugin("CREATE", a, all, Json::Null),
        "without spec.nodeName",
    );
    let mut selected = own_slice("node-a");
    selected["spec"]["nodeSelector"] = serde_json::json!({ "nodeSelectorTerms": [] });
    denied(
        plugin("CREATE", a, selected, Json::Null),
        "allNodes, nodeSelector",
    );
    let mut per_device = own_slice("node-a");
    per_device["spec"]["perDeviceNodeSelection"] = Json::from(true);
    denied(
        plugin("CREATE", a, per_device, Json::Null),
        "perDeviceNodeSelection",
    );

    // A token without a node binding.
    denied(
        plugin("CREATE", None, own_slice("node-a"), Json::Null),
        "no node is bound",
    );

    // Other principals (an administrator) are not this policy's business.
    assert_eq!(
        admit(
            vap,
            "CREATE",
            "kubernetes-admin",
            None,
            own_slice("node-b"),
            Json::Null
        ),
        Admission::NotMatched
    );
}
