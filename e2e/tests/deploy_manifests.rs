//! Renders and lints the Helm chart in `deploy/helm/carve` with Helm itself
//! (Helm v4's Go SDK, from PyPI's `helm-python-sdk`, driven by
//! `helm_chart.py`; no helm binary, no network) and checks every manifest
//! against the Kubernetes OpenAPI types. Without that package the tests fail,
//! naming it (`.ci/run` installs it).
//!
//! Each rendered document is deserialized into its k8s-openapi type and
//! serialized back; the result must equal the rendered document, so unknown or
//! misspelled fields (which k8s-openapi would silently drop) fail the test.
//!
//! The DeviceClass selectors and the ValidatingAdmissionPolicy are evaluated
//! with the `cel` interpreter on hand-built inputs. That interpreter is not
//! the API server's (no type checking against the OpenAPI schema), so these
//! tests show the expressions' logic, not their acceptance by a cluster.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::path::{Path, PathBuf};

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Container, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
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

fn yaml_file(path: &Path) -> serde_norway::Value {
    serde_norway::from_str(&read(path))
        .unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

// ---------------------------------------------------------------- values

/// Helm's value coalescing: maps merge key by key, anything else in the
/// overlay replaces the base, and an overlay `null` deletes the key.
fn merge_values(base: &mut serde_norway::Value, overlay: &serde_norway::Value) {
    match (base, overlay) {
        (serde_norway::Value::Mapping(b), serde_norway::Value::Mapping(o)) => {
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

fn default_values() -> serde_norway::Value {
    yaml_file(&chart_dir().join("values.yaml"))
}

fn values_with(overlay_yaml: &str) -> serde_norway::Value {
    let mut v = default_values();
    let overlay: serde_norway::Value =
        serde_norway::from_str(overlay_yaml).expect("overlay parses");
    merge_values(&mut v, &overlay);
    v
}

fn kind_values() -> serde_norway::Value {
    values_with(&read(&repo_root().join("deploy/kind/values-kind.yaml")))
}

fn to_json(v: &serde_norway::Value) -> Json {
    serde_json::to_value(v).expect("values convert to JSON")
}

// ---------------------------------------------------------------- Helm

/// `python3` with `helm-python-sdk` (Helm's Go SDK, `.ci/run` installs it).
fn helm(job: Json) -> Json {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/helm_chart.py");
    let mut child = std::process::Command::new("python3")
        .arg(&script)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("running python3");
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), job.to_string().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("No module named 'helm_python'"),
        "python3 lacks Helm's SDK: pip install helm-python-sdk (.ci/run does)"
    );
    assert!(
        out.status.success(),
        "{} failed: {stderr}",
        script.display()
    );
    serde_json::from_slice(&out.stdout).expect("helm_chart.py prints JSON")
}

/// Renders the chart with `values` (already merged over the defaults) by
/// Helm itself, as `helm template carve -n carve-system` does: schema
/// validation, then every template; parses the output into YAML documents.
/// `Err` is Helm's refusal (a schema violation or a template `fail`).
fn render_chart(values: &serde_norway::Value) -> Result<Vec<Doc>, String> {
    render_with(values, false)
}

/// As [`render_chart`]; `skip_schema` renders without `values.schema.json`
/// (`helm template --skip-schema-validation`), to show the templates' checks.
fn render_with(values: &serde_norway::Value, skip_schema: bool) -> Result<Vec<Doc>, String> {
    let out = helm(serde_json::json!({
        "op": "render",
        "chart": chart_dir(),
        "values": to_json(values),
        "release": RELEASE,
        "namespace": NAMESPACE,
        "skip_schema": skip_schema,
    }));
    if let Some(e) = out.get("error") {
        return Err(e.as_str().unwrap_or_default().to_string());
    }
    let manifests: BTreeMap<String, String> =
        serde_json::from_value(out["manifests"].clone()).expect("template path -> text");
    let mut docs = Vec::new();
    for (path, text) in manifests {
        let name = path.rsplit('/').next().unwrap_or(&path).to_string();
        for (i, text) in split_documents(&text).into_iter().enumerate() {
            let value: Json = serde_norway::from_str(&text)
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

/// `helm lint --strict` with `values`: the messages at warning or above.
fn lint(values: &serde_norway::Value) -> Vec<String> {
    let out = helm(serde_json::json!({
        "op": "lint",
        "chart": chart_dir(),
        "values": to_json(values),
        "namespace": NAMESPACE,
        "kube_version": "v1.34.0",
    }));
    let report = &out["lint"];
    assert_eq!(report["total_charts_linted"], 1, "{report}");
    report["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["severity"].as_i64().unwrap_or(3) >= 2)
        .map(|m| format!("{}: {}", m["path"], m["error"]))
        .chain(
            report["errors"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e.to_string()),
        )
        .collect()
}

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
    network_policies: Vec<NetworkPolicy>,
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
            ("networking.k8s.io/v1", "NetworkPolicy") => {
                m.network_policies.push(round_trip(doc));
            }
            (api, kind) => panic!(
                "{}: unexpected {api} {kind}; add it to validate()",
                doc.template
            ),
        }
    }
    m
}

fn render_valid(values: &serde_norway::Value) -> Manifests {
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

/// The chart's ValidatingAdmissionPolicy whose name ends with `suffix`.
fn policy<'a>(m: &'a Manifests, suffix: &str) -> &'a ValidatingAdmissionPolicy {
    let found: Vec<_> = m
        .policies
        .iter()
        .filter(|p| {
            p.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.ends_with(suffix))
        })
        .collect();
    let what = format!("ValidatingAdmissionPolicy named *{suffix}");
    let found: &&ValidatingAdmissionPolicy = one(&found, &what);
    found
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
        "--resync-seconds=60",
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
    // The kubelet's directories are mounted at their host paths and passed
    // as such: the DRA socket the plugin registers (under --plugins-dir) is
    // the path the kubelet dials on the host.
    let hp = host_paths(ds);
    for (volume, flag) in [
        ("plugins", "--plugins-dir="),
        ("plugins-registry", "--registry-dir="),
    ] {
        let mount = c
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == volume)
            .unwrap_or_else(|| panic!("no mount of {volume}"));
        assert_eq!(
            mount.mount_path, hp[volume],
            "{volume} mounted at its host path"
        );
        assert!(
            a.contains(&format!("{flag}{}", hp[volume])),
            "{flag} is not {} in {a:?}",
            hp[volume]
        );
    }
    // The driver root, read-only at /driver-root, named by both flags.
    let driver = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "driver-root")
        .expect("driver root mounted");
    assert_eq!(driver.mount_path, "/driver-root");
    assert_eq!(driver.read_only, Some(true));
    assert!(
        a.contains(&"--container-driver-root=/driver-root".to_string()),
        "{a:?}"
    );
    assert!(
        a.contains(&format!("--host-driver-root={}", hp["driver-root"])),
        "{a:?}"
    );
    assert!(a.iter().any(|x| x.starts_with("--proc-devices=/")), "{a:?}");
    assert!(
        a.iter()
            .any(|x| x == "--log-format=text" || x == "--log-format=json"),
        "{a:?}"
    );
    assert_eq!(hp["plugins"], "/var/lib/kubelet/plugins");
    assert_eq!(hp["plugins-registry"], "/var/lib/kubelet/plugins_registry");
    assert_eq!(hp["cdi"], "/var/run/cdi");
    assert_eq!(hp["state"], "/var/lib/carve");

    // RBAC: exactly the rules the plugin uses, bound to its ServiceAccount
    // (the real-cluster suite's audit log shows each verb used and none
    // refused: e2e/tests/real_cluster/grants.rs).
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
        // Only the driver subresource is narrowed by name: to this driver.
        let narrowed = r
            .resources
            .iter()
            .flatten()
            .any(|x| x == "resourceclaims/driver");
        assert_eq!(
            r.resource_names.clone(),
            narrowed.then(|| vec!["gpu.carve.dev".to_string()]),
            "{r:?}"
        );
        assert!(r.non_resource_urls.is_none());
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
                v(&["get", "list"])
            ),
            (
                "resource.k8s.io".to_string(),
                "resourceclaims/driver".to_string(),
                v(&["associated-node:patch"])
            ),
            (
                "resource.k8s.io".to_string(),
                "resourceclaims/status".to_string(),
                v(&["patch"])
            ),
            (
                "resource.k8s.io".to_string(),
                "resourceslices".to_string(),
                v(&["list", "watch", "create", "update", "delete"])
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

    // Admission policies: one for slices, one for claim status; each bound.
    assert_eq!(m.policies.len(), 2, "{:#?}", m.policies);
    assert_eq!(m.policy_bindings.len(), 2, "{:#?}", m.policy_bindings);
    for pb in &m.policy_bindings {
        assert!(
            m.policies
                .iter()
                .any(|p| p.metadata.name.as_ref() == Some(&pb.spec.policy_name)),
            "binding of a policy the chart lacks: {pb:#?}"
        );
        assert_eq!(pb.spec.validation_actions, ["Deny"]);
    }
    // Each policy: fails closed, matches only the plugin's ServiceAccount,
    // on the one resource rule it guards.
    for (suffix, resource, ops) in [
        (
            "-resourceslices",
            "resourceslices",
            &["CREATE", "DELETE", "UPDATE"][..],
        ),
        (
            "-resourceclaim-status",
            "resourceclaims/status",
            &["UPDATE"][..],
        ),
    ] {
        let spec = policy(m, suffix).spec.as_ref().unwrap();
        assert_eq!(spec.failure_policy.as_deref(), Some("Fail"), "{suffix}");
        let rule = one(
            spec.match_constraints
                .as_ref()
                .unwrap()
                .resource_rules
                .as_deref()
                .unwrap(),
            "resource rule",
        );
        assert_eq!(
            rule.resources.as_deref(),
            Some(&[resource.to_string()][..]),
            "{suffix}"
        );
        assert_eq!(
            rule.api_groups.as_deref(),
            Some(&["resource.k8s.io".to_string()][..]),
            "{suffix}"
        );
        let mut got = rule.operations.clone().unwrap();
        got.sort();
        assert_eq!(got, ops, "{suffix}");
        let cond = one(spec.match_conditions.as_deref().unwrap(), "match condition");
        assert!(
            cond.expression
                .contains(&format!("\"system:serviceaccount:{NAMESPACE}:{sa_name}\"")),
            "{suffix}: match condition does not name the plugin ServiceAccount: {}",
            cond.expression
        );
    }
    // The slice policy: only its node and pool, only this driver, never
    // cluster-wide slices.
    let vspec = policy(m, "-resourceslices").spec.as_ref().unwrap();
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
        "variables.slice.spec.pool.name == variables.userNodeName",
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
            "mig-mps.gpu.carve.dev",
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
    let workers: Vec<&serde_norway::Value> = kind["nodes"]
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
            serde_norway::Value::Bool(true),
            "{gate}"
        );
    }
    let patches = serde_norway::to_string(&kind["containerdConfigPatches"]).unwrap();
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

/// Asserts that the schema rejects `overlay` (both the `jsonschema` crate and
/// Helm's render, naming the value), and that the templates, rendered by Helm
/// without the schema, fail with a message containing `message`.
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
        Ok(_) => panic!("Helm rendered {overlay:?}"),
        Err(e) => assert!(
            e.contains("HelmValuesError") && e.contains(schema_path),
            "Helm's error {e:?} does not name {schema_path}"
        ),
    }
    match render_with(&values, true) {
        Ok(_) => panic!("render of {overlay:?} without the schema succeeded"),
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
    let mut v: serde_norway::Value =
        serde_norway::from_str(&read(&repo_root().join("deploy/kind/values-kind.yaml"))).unwrap();
    merge_values(&mut v, &serde_norway::from_str(change).unwrap());
    serde_norway::to_string(&v).unwrap()
}

#[test]
fn simulator_without_library_takes_nvml_from_the_driver_root() {
    // The simulator placed where a GPU node's driver has libnvidia-ml.so.1
    // (the real-cluster suite does so): no --nvml-lib, the plugin looks in
    // the driver root.
    let v: serde_norway::Value = serde_norway::from_str(&kind_overlay("nvml: {lib: ''}")).unwrap();
    let m = render_valid(&v);
    let a = args(plugin_container(one(&m.daemonsets, "DaemonSet")));
    assert!(!a.iter().any(|x| x.starts_with("--nvml-lib")), "{a:?}");
    assert!(
        a.contains(&"--container-driver-root=/driver-root".to_string()),
        "{a:?}"
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
        "kubeletPlugin: {resyncSeconds: 0}",
        "kubeletPlugin: {resyncSeconds: fast}",
        "mps: {protocol: v4}",
        "mps: {migInstances: yes-please}",
        "mps: {daemonCgroup: ../escape}",
        "mps: {daemonCgroup: /sys/fs/cgroup/carve}",
        "mps: {daemonCgroup: a/./b}",
        "mps: {nvidiaSmi: usr/bin/nvidia-smi}",
        "mps: {hostCgroupRoot: sys/fs/cgroup}",
        "timeslice: {enabled: true, slices: 4}",
        "logFormat: xml",
        "driverRoot: run/nvidia/driver",
        "nvidiaCdiHook: nvidia-cdi-hook",
        "kubeletPlugin: {procDevices: devices}",
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
    // The units' /dev/shm tmpfs, mounted by the plugin, must reach the host.
    assert_eq!(mount.mount_propagation.as_deref(), Some("Bidirectional"));
    // The daemons outlive the container: each in a cgroup of its own under
    // the host's tree (mounted read-write where --cgroup-root points), and
    // the pod in the host's PID namespace.
    let spec = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(spec.host_pid, Some(true));
    assert!(
        a.contains(&"--mps-daemon-cgroup=carve-mps".to_string()),
        "{a:?}"
    );
    assert!(
        a.contains(&"--cgroup-root=/host/sys/fs/cgroup".to_string()),
        "{a:?}"
    );
    assert_eq!(
        host_paths(ds).get("host-cgroup").map(String::as_str),
        Some("/sys/fs/cgroup")
    );
    let cg = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|v| v.name == "host-cgroup")
        .expect("the host cgroup mount");
    assert_eq!(cg.mount_path, "/host/sys/fs/cgroup");
    assert_ne!(cg.read_only, Some(true), "mounted read-write");
}

#[test]
fn mps_daemon_cgroup_none_and_no_mps_need_neither_host_pid_nor_the_cgroup_mount() {
    for values in [
        "{mps: {enabled: true, controlBinary: /usr/bin/nvidia-cuda-mps-control, daemonCgroup: none}}",
        "{timeslice: {enabled: true}}",
        "{}",
    ] {
        let m = render_valid(&values_with(values));
        let ds = one(&m.daemonsets, "DaemonSet");
        let spec = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        assert_ne!(spec.host_pid, Some(true), "{values}");
        let a = args(plugin_container(ds));
        assert!(
            !a.iter()
                .any(|x| x.starts_with("--mps-daemon-cgroup") || x.starts_with("--cgroup-root")),
            "{values}: {a:?}"
        );
        assert!(!host_paths(ds).contains_key("host-cgroup"), "{values}");
    }
}

/// `mps.nvidiaSmi` alone (no daemon cgroup): the tool's flag and the host's
/// cgroup tree (the pod cgroups the limits go on), but not hostPID; without
/// MPS, neither.
#[test]
fn nvidia_smi_brings_the_host_cgroup_tree_and_its_flag_only_with_mps() {
    let m = render_valid(&values_with(
        "{mps: {enabled: true, controlBinary: /usr/bin/nvidia-cuda-mps-control, daemonCgroup: none, nvidiaSmi: /driver-root/usr/bin/nvidia-smi}}",
    ));
    let ds = one(&m.daemonsets, "DaemonSet");
    let spec = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_ne!(spec.host_pid, Some(true));
    let a = args(plugin_container(ds));
    for want in [
        "--nvidia-smi=/driver-root/usr/bin/nvidia-smi",
        "--cgroup-root=/host/sys/fs/cgroup",
    ] {
        assert!(a.iter().any(|x| x == want), "{want}: {a:?}");
    }
    assert!(
        !a.iter().any(|x| x.starts_with("--mps-daemon-cgroup")),
        "{a:?}"
    );
    assert_eq!(host_paths(ds)["host-cgroup"], "/sys/fs/cgroup");

    let m = render_valid(&values_with(
        "{mps: {enabled: false, nvidiaSmi: /driver-root/usr/bin/nvidia-smi}}",
    ));
    let ds = one(&m.daemonsets, "DaemonSet");
    let a = args(plugin_container(ds));
    assert!(
        !a.iter()
            .any(|x| x.starts_with("--nvidia-smi") || x.starts_with("--cgroup-root")),
        "{a:?}"
    );
    assert!(!host_paths(ds).contains_key("host-cgroup"));
}

/// Helm's own linter, strict (warnings are errors), finds nothing.
#[test]
fn helm_lints_the_chart_clean() {
    for (what, values) in [("values.yaml", default_values()), ("kind", kind_values())] {
        let problems = lint(&values);
        assert!(
            problems.is_empty(),
            "helm lint --strict ({what}): {problems:#?}"
        );
    }
}

/// A kubelet root other than /var/lib/kubelet (k0s, some distributions):
/// the plugin sees and registers the host's paths.
#[test]
fn a_non_default_kubelet_root_is_mounted_and_registered_at_its_host_path() {
    let m = render_valid(&values_with(
        "kubeletPlugin: {kubeletRootDir: /var/lib/k0s/kubelet/}",
    ));
    let ds = one(&m.daemonsets, "DaemonSet");
    let c = plugin_container(ds);
    let a = args(c);
    let hp = host_paths(ds);
    assert_eq!(hp["plugins"], "/var/lib/k0s/kubelet/plugins");
    assert_eq!(
        hp["plugins-registry"],
        "/var/lib/k0s/kubelet/plugins_registry"
    );
    assert!(
        a.contains(&"--plugins-dir=/var/lib/k0s/kubelet/plugins".to_string()),
        "{a:?}"
    );
    assert!(
        a.contains(&"--registry-dir=/var/lib/k0s/kubelet/plugins_registry".to_string()),
        "{a:?}"
    );
    let mounts: BTreeMap<&str, &str> = c
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| (m.name.as_str(), m.mount_path.as_str()))
        .collect();
    assert_eq!(mounts["plugins"], "/var/lib/k0s/kubelet/plugins");
    assert_eq!(
        mounts["plugins-registry"],
        "/var/lib/k0s/kubelet/plugins_registry"
    );
    assert!(
        !a.iter()
            .chain(
                mounts
                    .values()
                    .map(|s| s.to_string())
                    .collect::<Vec<_>>()
                    .iter()
            )
            .any(|x| x.contains("/var/lib/kubelet")),
        "a path of the default kubelet root is left: {a:?} {mounts:?}"
    );
}

#[test]
fn driver_root_hook_and_log_format_render_their_flags() {
    let m = render_valid(&values_with(
        "{driverRoot: /run/nvidia/driver, nvidiaCdiHook: /usr/bin/nvidia-cdi-hook, logFormat: json, kubeletPlugin: {procDevices: /host-proc/devices}}",
    ));
    let ds = one(&m.daemonsets, "DaemonSet");
    let a = args(plugin_container(ds));
    for want in [
        "--host-driver-root=/run/nvidia/driver",
        "--container-driver-root=/driver-root",
        "--nvidia-cdi-hook=/usr/bin/nvidia-cdi-hook",
        "--log-format=json",
        "--proc-devices=/host-proc/devices",
    ] {
        assert!(a.contains(&want.to_string()), "missing {want} in {a:?}");
    }
    assert_eq!(host_paths(ds)["driver-root"], "/run/nvidia/driver");
    let d = render_valid(&default_values());
    let ds = one(&d.daemonsets, "DaemonSet");
    let a = args(plugin_container(ds));
    assert!(a.contains(&"--host-driver-root=/".to_string()), "{a:?}");
    assert!(a.contains(&"--log-format=text".to_string()), "{a:?}");
    assert!(
        a.contains(&"--proc-devices=/proc/devices".to_string()),
        "{a:?}"
    );
    assert!(
        !a.iter().any(|x| x.starts_with("--nvidia-cdi-hook")),
        "{a:?}"
    );
    assert_eq!(host_paths(ds)["driver-root"], "/");
}

#[test]
fn timeslice_alone_renders_its_sharing_flag() {
    let m = render_valid(&values_with("{timeslice: {enabled: true}}"));
    let a = args(plugin_container(one(&m.daemonsets, "DaemonSet")));
    assert!(a.contains(&"--sharing=timeslice".to_string()), "{a:?}");
    assert!(!a.iter().any(|x| x.starts_with("--mps")), "{a:?}");
}

#[test]
fn scheduler_version_and_shared_gpus_render_their_flags_and_bad_ones_are_refused() {
    let m = render_valid(&values_with(
        "{mps: {enabled: true, controlBinary: /usr/bin/nvidia-cuda-mps-control}, scheduler: {version: '1.35.6'}, sharedGpus: '6=mps,7=mig-mps:2g.20gb'}",
    ));
    let a = args(plugin_container(one(&m.daemonsets, "DaemonSet")));
    assert!(
        a.contains(&"--scheduler-version=1.35.6".to_string()),
        "{a:?}"
    );
    assert!(
        a.contains(&"--shared-gpus=6=mps,7=mig-mps:2g.20gb".to_string()),
        "{a:?}"
    );
    // The defaults give neither: the plugin assumes the oldest scheduler
    // the skew policy allows, and names no GPU for shares.
    let d = render_valid(&default_values());
    let a = args(plugin_container(one(&d.daemonsets, "DaemonSet")));
    assert!(
        !a.iter()
            .any(|x| x.starts_with("--scheduler-version") || x.starts_with("--shared-gpus")),
        "{a:?}"
    );
    let schema: Json =
        serde_json::from_str(&read(&chart_dir().join("values.schema.json"))).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    for (overlay, path) in [
        ("{scheduler: {version: '1.35.x'}}", "/scheduler/version"),
        ("{scheduler: {version: '2'}}", "/scheduler/version"),
        ("{sharedGpus: '6=mig'}", "/sharedGpus"),
        ("{sharedGpus: 'mps'}", "/sharedGpus"),
        ("{sharedGpus: '6=mig-mps'}", "/sharedGpus"),
    ] {
        let errors: Vec<String> = validator
            .iter_errors(&to_json(&values_with(overlay)))
            .map(|e| format!("{}", e.instance_path()))
            .collect();
        assert!(errors.iter().any(|p| p == path), "{overlay}: {errors:?}");
    }
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
fn the_whole_gpu_class_can_name_an_extended_resource() {
    let extended = |m: &Manifests| -> Vec<(String, Option<String>)> {
        m.device_classes
            .iter()
            .map(|c| {
                (
                    c.metadata.name.clone().unwrap_or_default(),
                    c.spec.extended_resource_name.clone(),
                )
            })
            .filter(|(_, e)| e.is_some())
            .collect()
    };
    assert!(extended(&render_valid(&default_values())).is_empty());
    let m = render_valid(&values_with(
        "{deviceClasses: {gpuExtendedResourceName: gpu.carve.dev/gpu}}",
    ));
    assert_eq!(
        extended(&m),
        vec![(
            "gpu.carve.dev".to_string(),
            Some("gpu.carve.dev/gpu".to_string())
        )]
    );
    // Not an extended resource name (domain/name): Helm's schema check
    // refuses it before the API server would.
    let bad = values_with("{deviceClasses: {gpuExtendedResourceName: 'no slash'}}");
    match render_chart(&bad) {
        Ok(_) => panic!("Helm rendered a bad extended resource name"),
        Err(e) => assert!(e.contains("/deviceClasses/gpuExtendedResourceName"), "{e}"),
    }
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
        // Devices as carve publishes them: `type` and `sharing` together.
        ("mps.gpu.carve.dev", device("mps", Some("mps")), true),
        // A plain MPS claim never gets a MIG partition (which would switch
        // the GPU into MIG mode): MIG-backed MPS has its own class.
        ("mps.gpu.carve.dev", device("mig-mps", Some("mps")), false),
        ("mps.gpu.carve.dev", device("mig", None), false),
        (
            "mps.gpu.carve.dev",
            device("timeslice", Some("timeslice")),
            false,
        ),
        ("mps.gpu.carve.dev", other.clone(), false),
        (
            "mig-mps.gpu.carve.dev",
            device("mig-mps", Some("mps")),
            true,
        ),
        ("mig-mps.gpu.carve.dev", device("mps", Some("mps")), false),
        ("mig-mps.gpu.carve.dev", device("mig", None), false),
        ("mig-mps.gpu.carve.dev", other.clone(), false),
        // Devices without a sharing attribute must not make a selector fail.
        ("mps.gpu.carve.dev", device("gpu", None), false),
        ("mig-mps.gpu.carve.dev", device("gpu", None), false),
        ("timeslice.gpu.carve.dev", device("mig", None), false),
        // Nor devices without a type attribute.
        ("gpu.carve.dev", untyped.clone(), false),
        ("mig.gpu.carve.dev", untyped.clone(), false),
        ("mps.gpu.carve.dev", untyped.clone(), false),
        ("mig-mps.gpu.carve.dev", untyped.clone(), false),
        (
            "timeslice.gpu.carve.dev",
            device("timeslice", Some("timeslice")),
            true,
        ),
        ("timeslice.gpu.carve.dev", device("mps", Some("mps")), false),
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
        .filter_map(|t| serde_norway::from_str::<Json>(&t).ok())
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

// ---------------------------------------------------------------- values

#[test]
fn values_merge_like_helm() {
    let mut base: serde_norway::Value =
        serde_norway::from_str("{a: {b: 1, c: 2}, l: [1, 2], k: v}").unwrap();
    let overlay: serde_norway::Value =
        serde_norway::from_str("{a: {c: 3, d: 4}, l: [9], k: null}").unwrap();
    merge_values(&mut base, &overlay);
    let want: serde_norway::Value =
        serde_norway::from_str("{a: {b: 1, c: 3, d: 4}, l: [9]}").unwrap();
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
    let vap = policy(&m, "-resourceslices");
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

    // Its own node, but another node's pool: its devices would be counted
    // in that pool.
    let mut pool = own_slice("node-a");
    pool["spec"]["pool"]["name"] = Json::from("node-b");
    denied(
        plugin("CREATE", a, pool.clone(), Json::Null),
        "of its own pool 'node-a', not 'node-b'",
    );
    denied(
        plugin("UPDATE", a, pool.clone(), own_slice("node-a")),
        "of its own pool 'node-a', not 'node-b'",
    );
    // Deleting such a stray slice of its node is how it cleans up.
    assert_eq!(plugin("DELETE", a, Json::Null, pool), Admission::Allowed);

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

/// A claim allocated on `node` with a device of carve's and one of another
/// driver, reserved for one pod; `devices`: its `status.devices`.
fn allocated_claim(node: &str, devices: Json) -> Json {
    serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": { "name": "c", "namespace": "default" },
        "spec": { "devices": { "requests": [] } },
        "status": {
            "allocation": {
                "devices": { "results": [
                    { "request": "a", "driver": DRIVER, "pool": node, "device": "gpu-0" },
                    { "request": "b", "driver": "gpu.other.example.com", "pool": node, "device": "x" },
                ] },
                "nodeSelector": { "nodeSelectorTerms": [ { "matchFields": [
                    { "key": "metadata.name", "operator": "In", "values": [node] },
                ] } ] },
            },
            "reservedFor": [ { "resource": "pods", "name": "p", "uid": "u1" } ],
            "devices": devices,
        },
    })
}

fn device_status(driver: &str, pool: &str, device: &str, message: &str) -> Json {
    serde_json::json!({
        "driver": driver, "pool": pool, "device": device,
        "conditions": [ { "type": "Ready", "status": "True", "reason": "Prepared",
            "message": message, "lastTransitionTime": "2026-01-01T00:00:00Z" } ],
    })
}

#[test]
fn admission_policy_confines_claim_status_to_its_node_and_driver() {
    let m = render_valid(&default_values());
    let vap = policy(&m, "-resourceclaim-status");
    let sa = format!("system:serviceaccount:{NAMESPACE}:carve");
    let plugin =
        |node: Option<&str>, obj: Json, old: Json| admit(vap, "UPDATE", &sa, node, obj, old);
    let denied = |a: Admission, needle: &str| match a {
        Admission::Denied(msg) => assert!(msg.contains(needle), "{msg:?} lacks {needle:?}"),
        other => panic!("expected denial containing {needle:?}, got {other:?}"),
    };
    let a = Some("node-a");
    let theirs = device_status("gpu.other.example.com", "node-a", "x", "theirs");
    let ours = device_status(DRIVER, "node-a", "gpu-0", "ours");
    let before = allocated_claim("node-a", serde_json::json!([theirs]));

    // Its own entry on a claim of its node, the other driver's kept (in
    // either order), and rewriting its own entry.
    let after = allocated_claim("node-a", serde_json::json!([theirs, ours]));
    assert_eq!(plugin(a, after.clone(), before.clone()), Admission::Allowed);
    let reordered = allocated_claim("node-a", serde_json::json!([ours, theirs]));
    assert_eq!(plugin(a, reordered, before.clone()), Admission::Allowed);
    let rewritten = allocated_claim(
        "node-a",
        serde_json::json!([theirs, device_status(DRIVER, "node-a", "gpu-0", "again")]),
    );
    assert_eq!(plugin(a, rewritten, after.clone()), Admission::Allowed);

    // Another driver's entry changed, dropped, or added.
    let changed = allocated_claim(
        "node-a",
        serde_json::json!([
            device_status("gpu.other.example.com", "node-a", "x", "mine now"),
            ours
        ]),
    );
    denied(
        plugin(a, changed, after.clone()),
        "entries of driver gpu.carve.dev",
    );
    let dropped = allocated_claim("node-a", serde_json::json!([ours]));
    denied(
        plugin(a, dropped, after.clone()),
        "entries of driver gpu.carve.dev",
    );
    let added = allocated_claim(
        "node-a",
        serde_json::json!([
            theirs,
            ours,
            device_status("gpu.other.example.com", "node-a", "y", "")
        ]),
    );
    denied(
        plugin(a, added, after.clone()),
        "entries of driver gpu.carve.dev",
    );

    // Its own driver's entry under another pool.
    let pool = allocated_claim(
        "node-a",
        serde_json::json!([theirs, device_status(DRIVER, "node-b", "gpu-0", "")]),
    );
    denied(plugin(a, pool, before.clone()), "of its own pool 'node-a'");

    // A claim allocated on another node, or on no single node.
    let there_before = allocated_claim("node-b", serde_json::json!([]));
    let there_after = allocated_claim(
        "node-b",
        serde_json::json!([device_status(DRIVER, "node-a", "gpu-0", "")]),
    );
    denied(
        plugin(a, there_after, there_before),
        "claims allocated on that node, not on 'node-b'",
    );
    let mut unallocated = allocated_claim("node-a", serde_json::json!([ours]));
    unallocated["status"]
        .as_object_mut()
        .unwrap()
        .remove("allocation");
    let mut unallocated_before = unallocated.clone();
    unallocated_before["status"]["devices"] = serde_json::json!([]);
    denied(
        plugin(a, unallocated, unallocated_before),
        "not allocated to one node",
    );

    // Clearing the allocation or the reservation: the claim's devices would
    // be handed out again under a running pod.
    let mut cleared = after.clone();
    cleared["status"]["reservedFor"] = serde_json::json!([]);
    denied(
        plugin(a, cleared, after.clone()),
        "may not change status.allocation or status.reservedFor",
    );
    let mut deallocated = after.clone();
    deallocated["status"]
        .as_object_mut()
        .unwrap()
        .remove("allocation");
    denied(
        plugin(a, deallocated, after.clone()),
        "may not change status.allocation or status.reservedFor",
    );

    // A token without a node binding; and other principals are not this
    // policy's business.
    denied(
        plugin(None, after.clone(), before.clone()),
        "no node is bound",
    );
    assert_eq!(
        admit(
            vap,
            "UPDATE",
            "system:serviceaccount:kube-system:resourceclaim-controller",
            None,
            before.clone(),
            after
        ),
        Admission::NotMatched
    );
}

/// The NetworkPolicy: off by default; on, it selects exactly the plugin's
/// pods, admits no ingress without `metricsFrom`, and with it only the
/// metrics port from those peers; egress is not restricted.
#[test]
fn network_policy_admits_only_the_metrics_port_from_the_peers_named() {
    assert!(render_valid(&default_values()).network_policies.is_empty());
    let m = render_valid(&values_with("networkPolicy: {enabled: true}\n"));
    let ds = one(&m.daemonsets, "DaemonSet");
    let pod_labels = ds
        .spec
        .as_ref()
        .unwrap()
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    let np = one(&m.network_policies, "NetworkPolicy");
    let spec = np.spec.as_ref().unwrap();
    let selector = spec
        .pod_selector
        .as_ref()
        .unwrap()
        .match_labels
        .clone()
        .unwrap();
    assert!(
        selector.iter().all(|(k, v)| pod_labels.get(k) == Some(v)),
        "{selector:?} does not select the plugin pods {pod_labels:?}"
    );
    assert_eq!(
        spec.policy_types.as_deref(),
        Some(&["Ingress".to_string()][..])
    );
    assert_eq!(
        spec.ingress.as_deref(),
        Some(&[][..]),
        "no peers: no ingress"
    );

    let m = render_valid(&values_with(
        "networkPolicy:\n  enabled: true\n  metricsFrom:\n    - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}\n",
    ));
    let np = one(&m.network_policies, "NetworkPolicy");
    let rule = one(
        np.spec.as_ref().unwrap().ingress.as_deref().unwrap(),
        "ingress rule",
    );
    let port = one(rule.ports.as_deref().unwrap(), "port");
    let metrics = plugin_container(one(&m.daemonsets, "DaemonSet"))
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("metrics"))
        .unwrap()
        .container_port;
    assert_eq!(
        port.port,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(metrics))
    );
    let peer = one(rule.from.as_deref().unwrap(), "peer");
    assert_eq!(
        peer.namespace_selector
            .as_ref()
            .unwrap()
            .match_labels
            .as_ref()
            .unwrap()["kubernetes.io/metadata.name"],
        "monitoring"
    );
}

/// The binary takes every flag the chart passes it: the rendered arguments,
/// with every optional value on, are parsed by `carve` itself (`--help` at
/// the end stops it once they parsed; an unknown or malformed flag fails
/// before it).
#[test]
fn the_binary_accepts_every_flag_the_chart_renders() {
    for values in [
        default_values(),
        kind_values(),
        values_with(
            "driverRoot: /run/nvidia/driver\nnvidiaCdiHook: /usr/bin/nvidia-cdi-hook\nlogFormat: json\nmps: {enabled: true, controlBinary: /usr/bin/nvidia-cuda-mps-control}\ntimeslice: {enabled: true}\nmigPolicy: {default: dynamic, perGpu: [{gpu: 1, policy: static}]}\n",
        ),
    ] {
        let m = render_valid(&values);
        let c = plugin_container(one(&m.daemonsets, "DaemonSet"));
        let a = args(c);
        assert_eq!(
            c.command.as_deref(),
            Some(&["/usr/local/bin/carve".to_string()][..])
        );
        let carve = carve_e2e::carve_binary().unwrap_or_else(|e| panic!("{e}"));
        let out = std::process::Command::new(carve)
            .args(&a)
            .arg("--help")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "carve {a:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("--container-driver-root"),
            "--help of kubelet-plugin"
        );
    }
}
