//! The real `carve kubelet-plugin` binary against the API-server stand-in at
//! Kubernetes 1.37 with authorization on: the plugin authenticates with a
//! bearer token (from a kubeconfig file) whose rules are the chart's
//! ClusterRole, read from `deploy/helm/carve/templates/rbac.yaml` at test
//! time. With those rules a prepared claim gets its `status.devices`
//! written; without the `resourceclaims/driver` rule the API server refuses
//! that write (DRAResourceClaimGranularStatusAuthorization), the plugin logs
//! it, and the claim stays prepared.

use std::collections::BTreeMap;
use std::path::Path;

use carve_alloc::{Allocator, Inputs, Object, load_yaml_documents};
use carve_apiserver::{ApiServer, Identity, KubeVersion, Options, PolicyRule, Resource};
use carve_e2e::{
    SimNode, allocated_devices, carve_binary, check_prepared, claim_ref, wait_for, workspace_root,
};
use carve_plugin::testing::FakeKubelet;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use nvidia_ml_sim::GpuEntry;
use serde_json::Value;

const NODE: &str = "node-a";
const NS: &str = "default";
const PLUGIN_TOKEN: &str = "carve-plugin-token";
const ADMIN_TOKEN: &str = "admin-token";

/// One rule as the chart writes it.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ChartRule {
    #[serde(default)]
    api_groups: Vec<String>,
    #[serde(default)]
    resources: Vec<String>,
    #[serde(default)]
    verbs: Vec<String>,
    #[serde(default)]
    resource_names: Vec<String>,
}

#[derive(Debug, serde::Deserialize)]
struct RulesOnly {
    rules: Vec<ChartRule>,
}

/// The kubelet plugin's ClusterRole rules from the chart. The template's
/// metadata holds Helm directives, which are not YAML; its `rules:` block
/// holds none, so that block is parsed on its own.
fn chart_rules() -> Vec<PolicyRule> {
    let path = workspace_root().join("deploy/helm/carve/templates/rbac.yaml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let role = text
        .split("\n---")
        .find(|d| d.contains("\nkind: ClusterRole\n"))
        .unwrap_or_else(|| panic!("{} has no ClusterRole", path.display()));
    let at = role
        .find("\nrules:\n")
        .unwrap_or_else(|| panic!("the ClusterRole in {} has no rules", path.display()));
    assert!(
        !role[at..].contains("{{"),
        "the ClusterRole's rules in {} hold Helm directives; parse them another way",
        path.display()
    );
    let parsed: RulesOnly = serde_norway::from_str(&role[at..])
        .unwrap_or_else(|e| panic!("the ClusterRole's rules in {}: {e}", path.display()));
    assert!(!parsed.rules.is_empty());
    parsed
        .rules
        .into_iter()
        .map(|r| PolicyRule {
            api_groups: r.api_groups,
            resources: r.resources,
            verbs: r.verbs,
            resource_names: r.resource_names,
        })
        .collect()
}

/// The plugin's ServiceAccount, its token bound to a pod on [`NODE`].
fn plugin_identity(rules: Vec<PolicyRule>) -> Identity {
    let mut id = Identity::service_account("carve-system", "carve").on_node(NODE);
    id.rules = rules;
    id
}

fn write_kubeconfig(path: &Path, url: &str, token: &str) {
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: standin\n  cluster:\n    server: {url}\nusers:\n- name: plugin\n  user:\n    token: {token}\ncontexts:\n- name: standin\n  context:\n    cluster: standin\n    user: plugin\n    namespace: {NS}\ncurrent-context: standin\n"
    );
    std::fs::write(path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

fn admin_client(api: &ApiServer) -> kube::Client {
    api.client_with_token(ADMIN_TOKEN)
}

async fn create_classes(api: &ApiServer) -> Vec<DeviceClass> {
    carve_e2e::create_example_classes(admin_client(api)).await
}

fn whole_gpu_claim() -> ResourceClaim {
    let path = workspace_root().join("examples/whole-gpu/pod.yaml");
    load_yaml_documents(&path)
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .find_map(|o| match o {
            Object::Claim(c) => Some(c),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{} holds no ResourceClaim", path.display()))
}

/// Creates claim `name` (the whole-GPU example) and writes its allocation
/// on [`NODE`] as the scheduler would, as the admin.
async fn allocate(
    api: &ApiServer,
    node: &mut SimNode,
    classes: &[DeviceClass],
    allocated: &[ResourceClaim],
    name: &str,
) -> ResourceClaim {
    let slices = carve_e2e::wait_published(node, &api.store())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let inputs = Inputs {
        slices,
        classes: classes.to_vec(),
        claims_allocated: allocated.to_vec(),
    };
    let mut c = whole_gpu_claim();
    c.metadata.name = Some(name.into());
    c.metadata.namespace = Some(NS.into());
    let result = Allocator::new(&inputs)
        .unwrap()
        .allocate(&c, NODE)
        .unwrap_or_else(|e| panic!("allocating {name}: {e}"));
    let claims: Api<ResourceClaim> = Api::namespaced(admin_client(api), NS);
    claims.create(&PostParams::default(), &c).await.unwrap();
    let patch = serde_json::json!({"status": {"allocation": result}});
    claims
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap_or_else(|e| panic!("writing status.allocation of {name}: {e}"))
}

/// NodePrepareResources for `c`; the claim must be prepared (no error, the
/// CDI spec and devices as allocated).
async fn prepare(kubelet: &FakeKubelet, node: &SimNode, c: &ResourceClaim) {
    let r = claim_ref(c).unwrap();
    let resp = kubelet
        .prepare(std::slice::from_ref(&r))
        .await
        .unwrap_or_else(|e| panic!("NodePrepareResources({r}): {e}\n{}", node.log()));
    let one = resp
        .claims
        .get(&r.uid)
        .unwrap_or_else(|| panic!("no answer for {}", r.uid));
    assert!(
        one.error.is_empty(),
        "NodePrepareResources({r}): {}\n{}",
        one.error,
        node.log()
    );
    let prepared: BTreeMap<String, Vec<String>> = one
        .devices
        .iter()
        .map(|d| (d.device_name.clone(), d.cdi_device_ids.clone()))
        .collect();
    let alloc = c
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .unwrap();
    check_prepared(node, &r.uid, &allocated_devices(alloc), &prepared)
        .unwrap_or_else(|e| panic!("{e}\n{}", node.log()));
}

fn stored_devices(api: &ApiServer, name: &str) -> Option<Vec<Value>> {
    api.store()
        .get(Resource::ResourceClaims, Some(NS), name)
        .and_then(|c| {
            c.pointer("/status/devices")
                .and_then(Value::as_array)
                .cloned()
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_role_lets_the_plugin_write_device_status_on_1_37_and_only_with_the_driver_rule()
{
    let rules = chart_rules();
    let is_driver_rule = |r: &PolicyRule| r.resources.iter().any(|x| x == "resourceclaims/driver");
    assert!(
        rules.iter().any(is_driver_rule),
        "the chart's ClusterRole has no resourceclaims/driver rule: {rules:?}"
    );
    let without_driver: Vec<PolicyRule> = rules
        .iter()
        .filter(|r| !is_driver_rule(r))
        .cloned()
        .collect();

    let api = ApiServer::start(Options {
        version: KubeVersion {
            major: 1,
            minor: 37,
        },
        ..Options::default()
    })
    .await
    .unwrap();
    api.set_identity(ADMIN_TOKEN, Identity::admin());
    api.set_identity(PLUGIN_TOKEN, plugin_identity(rules));
    let classes = create_classes(&api).await;

    let carve = carve_binary().unwrap_or_else(|e| panic!("{e}"));
    let gpus = vec![GpuEntry::new("h100-80gb", 2, false)];
    let mut node = SimNode::new(NODE, gpus, carve, &api.url()).unwrap_or_else(|e| panic!("{e}"));
    let kubeconfig = node.dir.path().join("kubeconfig");
    write_kubeconfig(&kubeconfig, &api.url(), PLUGIN_TOKEN);
    node.kubeconfig = Some(kubeconfig);
    assert!(
        !node.plugin_args().iter().any(|a| a == "--kube-api-url"),
        "the plugin must find the API server through KUBECONFIG"
    );
    let reg = node.start_plugin().await.unwrap_or_else(|e| panic!("{e}"));
    let kubelet = FakeKubelet::register(&reg, carve_model::DRIVER_NAME)
        .await
        .unwrap_or_else(|e| panic!("registering: {e}\n{}", node.log()));

    // With the chart's rules: status.devices is written.
    let first = allocate(&api, &mut node, &classes, &[], "first").await;
    prepare(&kubelet, &node, &first).await;
    let want = allocated_devices(first.status.as_ref().unwrap().allocation.as_ref().unwrap());
    let written = wait_for(&mut node, "status.devices of claim first", |_| {
        stored_devices(&api, "first")
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let devices: Vec<&str> = written
        .iter()
        .filter(|d| d.get("driver").and_then(Value::as_str) == Some(carve_model::DRIVER_NAME))
        .filter_map(|d| d.get("device").and_then(Value::as_str))
        .collect();
    assert_eq!(devices, want, "status.devices: {written:?}");
    // The plugin's requests were its own: no 401 or 403 on the way.
    let refused: Vec<_> = api
        .request_log()
        .into_iter()
        .filter(|r| matches!(r.status, 401 | 403 | 422))
        .collect();
    assert!(refused.is_empty(), "refused: {refused:?}\n{}", node.log());

    // Without the resourceclaims/driver rule the write is refused; the
    // claim stays prepared.
    api.set_identity(PLUGIN_TOKEN, plugin_identity(without_driver));
    let second = allocate(
        &api,
        &mut node,
        &classes,
        std::slice::from_ref(&first),
        "second",
    )
    .await;
    prepare(&kubelet, &node, &second).await;
    let expected = "changing status.devices requires resource=\"resourceclaims/driver\", verb=\"[associated-node:patch arbitrary-node:patch]\" permission: resourceclaims.resource.k8s.io \"gpu.carve.dev\" is forbidden: User \"system:serviceaccount:carve-system:carve\" cannot associated-node:patch resource \"resourceclaims/driver\" in API group \"resource.k8s.io\" in the namespace \"default\"";
    let line = wait_for(&mut node, "the plugin's log of the refused write", |n| {
        n.log()
            .lines()
            .find(|l| l.contains("writing device status failed"))
            .map(str::to_string)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(line.contains(expected), "{line}");
    assert!(line.contains("the claim stays prepared"), "{line}");
    assert_eq!(stored_devices(&api, "second"), None);
    let status_writes: Vec<u16> = api
        .request_log()
        .into_iter()
        .filter(|r| r.resource == "resourceclaims/status" && r.path.ends_with("/second/status"))
        .map(|r| r.status)
        .collect();
    assert!(status_writes.contains(&422), "{status_writes:?}");
    // Still prepared: the CDI spec is there, and a second prepare answers
    // from the checkpoint without error.
    let uid = second.metadata.uid.as_deref().unwrap();
    assert!(carve_plugin::claim_spec_path(&node.cdi_dir, uid).exists());
    prepare(&kubelet, &node, &second).await;
}
