//! Opt-in authentication and authorization through a real `kube::Client`
//! with a bearer token: 401 and 403 as the real API server answers them,
//! and the DRAResourceClaimGranularStatusAuthorization checks of claim
//! status writes (`src/strategy.rs` `authorize_claim_status` cites the
//! upstream rules) at the versions that have the gate.

use carve_apiserver::{
    ApiServer, FeatureGate, Identity, KubeVersion, Options, PolicyRule, Resource,
};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const TOKEN: &str = "plugin-token";
const DRIVER: &str = "gpu.carve.dev";
const SA: &str = "system:serviceaccount:carve-system:carve";

fn v(minor: u32) -> KubeVersion {
    KubeVersion { major: 1, minor }
}

async fn server(version: KubeVersion) -> ApiServer {
    ApiServer::start(Options {
        version,
        ..Options::default()
    })
    .await
    .unwrap()
}

/// A kube client that sends `Authorization: Bearer <token>`.
fn client(s: &ApiServer, token: &str) -> kube::Client {
    let mut config = s.config();
    config.default_retry = false;
    config.auth_info.token = Some(token.to_string().into());
    kube::Client::try_from(config).unwrap()
}

fn claims(s: &ApiServer, token: &str) -> Api<ResourceClaim> {
    Api::namespaced(client(s, token), "default")
}

fn rule(resources: &[&str], verbs: &[&str]) -> PolicyRule {
    PolicyRule::new(&["resource.k8s.io"], resources, verbs)
}

fn driver_rule(verb: &str) -> PolicyRule {
    rule(&["resourceclaims/driver"], &[verb]).with_resource_names(&[DRIVER])
}

/// What carve's chart grants the kubelet plugin, without the driver rule.
fn plugin_rules() -> Vec<PolicyRule> {
    vec![
        rule(
            &["resourceslices"],
            &[
                "get", "list", "watch", "create", "update", "patch", "delete",
            ],
        ),
        rule(&["resourceclaims"], &["get", "list", "watch"]),
        rule(&["resourceclaims/status"], &["patch"]),
    ]
}

/// The plugin's ServiceAccount on `node` with `extra` rules beside [`plugin_rules`].
fn plugin(node: Option<&str>, extra: Vec<PolicyRule>) -> Identity {
    let mut id = Identity::new(SA);
    id.node_name = node.map(str::to_string);
    id.rules = plugin_rules();
    id.rules.extend(extra);
    id
}

fn entry(driver: &str, device: &str) -> Value {
    json!({"driver": driver, "pool": "node-a", "device": device,
           "data": {"uuid": format!("GPU-{device}")}})
}

/// A claim allocated on `node` (the node selector the scheduler writes),
/// with `devices` as its `status.devices`, stored directly.
fn insert_claim(s: &ApiServer, name: &str, node: &str, devices: Vec<Value>) {
    let mut status = json!({
        "allocation": {
            "devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": node, "device": "gpu-0"}
            ]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}
            ]}]}
        },
        "reservedFor": [{"resource": "pods", "name": "p", "uid": "u-1"}]
    });
    if !devices.is_empty() {
        status["devices"] = Value::Array(devices);
    }
    s.store()
        .insert(
            Resource::ResourceClaims,
            json!({
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"devices": {"requests": [
                    {"name": "gpu", "exactly": {"deviceClassName": "gpu.carve.dev"}}
                ]}},
                "status": status,
            }),
        )
        .unwrap();
}

fn stored_devices(s: &ApiServer, name: &str) -> Value {
    s.store()
        .get(Resource::ResourceClaims, Some("default"), name)
        .unwrap()
        .pointer("/status/devices")
        .cloned()
        .unwrap_or(Value::Null)
}

async fn patch_devices(
    s: &ApiServer,
    name: &str,
    devices: Vec<Value>,
) -> Result<ResourceClaim, (u16, String, String)> {
    let p = json!({"status": {"devices": devices}});
    claims(s, TOKEN)
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&p))
        .await
        .map_err(api_error)
}

fn api_error(e: kube::Error) -> (u16, String, String) {
    match e {
        kube::Error::Api(st) => (st.code, st.reason, st.message),
        other => panic!("not an API error: {other}"),
    }
}

/// The 422 text for a refused `status.devices` change of `driver`.
fn devices_refused(claim: &str, verbs: &str, first_verb: &str, driver: &str) -> String {
    format!(
        "ResourceClaim.resource.k8s.io \"{claim}\" is invalid: status.devices: Forbidden: changing status.devices requires resource=\"resourceclaims/driver\", verb=\"[{verbs}]\" permission: resourceclaims.resource.k8s.io \"{driver}\" is forbidden: User \"{SA}\" cannot {first_verb} resource \"resourceclaims/driver\" in API group \"resource.k8s.io\" in the namespace \"default\""
    )
}

#[tokio::test]
async fn a_request_without_a_registered_token_is_401_once_identities_exist() {
    let s = server(v(37)).await;
    insert_claim(&s, "c", "node-a", vec![]);
    // Open until the first identity is registered.
    let open: Api<ResourceClaim> = Api::namespaced(s.client(), "default");
    open.get("c").await.unwrap();

    s.set_identity(TOKEN, plugin(Some("node-a"), vec![]));
    for api in [open.clone(), claims(&s, "not-registered")] {
        let (code, reason, msg) = api_error(api.get("c").await.unwrap_err());
        assert_eq!(
            (code, reason.as_str(), msg.as_str()),
            (401, "Unauthorized", "Unauthorized")
        );
        let e = api.into_client().apiserver_version().await.unwrap_err();
        assert_eq!(api_error(e).0, 401, "/version needs a token too");
    }
    // With the token: the claim, /version and discovery.
    claims(&s, TOKEN).get("c").await.unwrap();
    let c = client(&s, TOKEN);
    assert_eq!(c.apiserver_version().await.unwrap().minor, "37");
    let discovery = kube::Discovery::new(c).run().await.unwrap();
    assert!(discovery.has_group("resource.k8s.io"));

    // Without identities it is open again.
    assert!(s.remove_identity(TOKEN).is_some());
    open.get("c").await.unwrap();
}

#[tokio::test]
async fn an_ungranted_verb_is_403_in_the_real_servers_words() {
    let s = server(v(37)).await;
    insert_claim(&s, "c", "node-a", vec![]);
    s.set_identity(
        TOKEN,
        Identity::new(SA).with_rule(rule(&["resourceclaims"], &["get"])),
    );
    let api = claims(&s, TOKEN);
    api.get("c").await.unwrap();

    let (code, reason, msg) =
        api_error(api.delete("c", &DeleteParams::default()).await.unwrap_err());
    assert_eq!((code, reason.as_str()), (403, "Forbidden"));
    assert_eq!(
        msg,
        format!(
            "resourceclaims.resource.k8s.io \"c\" is forbidden: User \"{SA}\" cannot delete resource \"resourceclaims\" in API group \"resource.k8s.io\" in the namespace \"default\""
        )
    );
    assert!(
        s.store()
            .get(Resource::ResourceClaims, Some("default"), "c")
            .is_some(),
        "a refused delete deleted"
    );

    // The status subresource is a resource of its own.
    let p = json!({"status": {"devices": [entry(DRIVER, "gpu-0")]}});
    let (code, _, msg) = api_error(
        api.patch_status("c", &PatchParams::default(), &Patch::Merge(&p))
            .await
            .unwrap_err(),
    );
    assert_eq!(code, 403, "{msg}");
    assert!(
        msg.ends_with("cannot patch resource \"resourceclaims/status\" in API group \"resource.k8s.io\" in the namespace \"default\""),
        "{msg}"
    );
    assert_eq!(stored_devices(&s, "c"), Value::Null);

    // A list names no object; a cluster-scoped resource has no namespace.
    let slices: Api<ResourceSlice> = Api::all(client(&s, TOKEN));
    let (code, _, msg) = api_error(slices.list(&ListParams::default()).await.unwrap_err());
    assert_eq!(code, 403);
    assert_eq!(
        msg,
        format!(
            "resourceslices.resource.k8s.io is forbidden: User \"{SA}\" cannot list resource \"resourceslices\" in API group \"resource.k8s.io\" at the cluster scope"
        )
    );
    // A resourceName-limited rule allows a list limited to that name only.
    s.set_identity(
        TOKEN,
        Identity::new(SA)
            .with_rule(rule(&["resourceclaims"], &["list"]).with_resource_names(&["c"])),
    );
    let one = ListParams::default().fields("metadata.name=c");
    assert_eq!(api.list(&one).await.unwrap().items.len(), 1);
    assert_eq!(
        api_error(api.list(&ListParams::default()).await.unwrap_err()).0,
        403
    );
}

#[tokio::test]
async fn the_plugin_writes_its_devices_on_its_own_node_with_associated_node_patch() {
    for minor in [36, 37] {
        let s = server(v(minor)).await;
        assert!(s.feature_gate(FeatureGate::ResourceClaimGranularStatusAuthorization));
        insert_claim(&s, "c", "node-a", vec![]);
        s.set_identity(
            TOKEN,
            plugin(Some("node-a"), vec![driver_rule("associated-node:patch")]),
        );
        let written = vec![entry(DRIVER, "gpu-0")];
        patch_devices(&s, "c", written.clone())
            .await
            .unwrap_or_else(|e| panic!("1.{minor}: {e:?}"));
        assert_eq!(stored_devices(&s, "c"), Value::Array(written), "1.{minor}");
        // Changing and removing its own entries is allowed as well.
        patch_devices(&s, "c", vec![entry(DRIVER, "gpu-1")])
            .await
            .unwrap_or_else(|e| panic!("1.{minor}: {e:?}"));
        patch_devices(&s, "c", vec![])
            .await
            .unwrap_or_else(|e| panic!("1.{minor}: {e:?}"));
    }
}

#[tokio::test]
async fn without_the_driver_rule_1_36_refuses_and_1_35_allows() {
    let s = server(v(36)).await;
    insert_claim(&s, "c", "node-a", vec![]);
    s.set_identity(TOKEN, plugin(Some("node-a"), vec![]));
    let (code, reason, msg) = patch_devices(&s, "c", vec![entry(DRIVER, "gpu-0")])
        .await
        .unwrap_err();
    assert_eq!((code, reason.as_str()), (422, "Invalid"));
    assert_eq!(
        msg,
        devices_refused(
            "c",
            "associated-node:patch arbitrary-node:patch",
            "associated-node:patch",
            DRIVER
        )
    );
    assert_eq!(
        stored_devices(&s, "c"),
        Value::Null,
        "a refused write was stored"
    );

    // The gate turned off: the old rules.
    s.set_feature_gate(FeatureGate::ResourceClaimGranularStatusAuthorization, false);
    patch_devices(&s, "c", vec![entry(DRIVER, "gpu-0")])
        .await
        .unwrap();
    s.set_feature_gate(FeatureGate::ResourceClaimGranularStatusAuthorization, true);

    // 1.35 has no such gate, even set on.
    let old = server(v(35)).await;
    assert!(!old.feature_gate(FeatureGate::ResourceClaimGranularStatusAuthorization));
    insert_claim(&old, "c", "node-a", vec![]);
    old.set_identity(TOKEN, plugin(Some("node-a"), vec![]));
    patch_devices(&old, "c", vec![entry(DRIVER, "gpu-0")])
        .await
        .unwrap();
    assert_eq!(
        stored_devices(&old, "c"),
        Value::Array(vec![entry(DRIVER, "gpu-0")])
    );
    // It is the version that decides: the same server moved to 1.36 refuses.
    old.set_version(v(36));
    let (code, _, msg) = patch_devices(&old, "c", vec![entry(DRIVER, "gpu-1")])
        .await
        .unwrap_err();
    assert_eq!(code, 422, "{msg}");
}

#[tokio::test]
async fn associated_node_does_not_cover_another_nodes_claim() {
    let s = server(v(37)).await;
    insert_claim(&s, "c", "node-a", vec![]);
    for node in [Some("node-b"), None] {
        s.set_identity(
            TOKEN,
            plugin(node, vec![driver_rule("associated-node:patch")]),
        );
        let (code, _, msg) = patch_devices(&s, "c", vec![entry(DRIVER, "gpu-0")])
            .await
            .unwrap_err();
        assert_eq!(code, 422, "{node:?}: {msg}");
        assert_eq!(
            msg,
            devices_refused("c", "arbitrary-node:patch", "arbitrary-node:patch", DRIVER),
            "{node:?}"
        );
    }
    // A user that is no ServiceAccount is never on a node.
    let mut user = plugin(Some("node-a"), vec![driver_rule("associated-node:patch")]);
    user.username = "alice".into();
    s.set_identity(TOKEN, user);
    let (code, _, msg) = patch_devices(&s, "c", vec![entry(DRIVER, "gpu-0")])
        .await
        .unwrap_err();
    assert_eq!(code, 422, "{msg}");
    assert!(msg.contains("verb=\"[arbitrary-node:patch]\""), "{msg}");
    assert_eq!(stored_devices(&s, "c"), Value::Null);
}

#[tokio::test]
async fn another_drivers_entries_are_refused() {
    let s = server(v(37)).await;
    insert_claim(&s, "c", "node-a", vec![entry("other.example.com", "nic-0")]);
    s.set_identity(
        TOKEN,
        plugin(Some("node-a"), vec![driver_rule("associated-node:patch")]),
    );
    let both = |other: &str| vec![entry(DRIVER, "gpu-0"), entry("other.example.com", other)];
    // Its own entry added beside the other driver's unchanged entry: allowed.
    patch_devices(&s, "c", both("nic-0")).await.unwrap();
    let refused = devices_refused(
        "c",
        "associated-node:patch arbitrary-node:patch",
        "associated-node:patch",
        "other.example.com",
    );
    // Changing, adding or removing the other driver's entry: refused.
    for devices in [both("nic-1"), vec![entry(DRIVER, "gpu-0")]] {
        let (code, _, msg) = patch_devices(&s, "c", devices).await.unwrap_err();
        assert_eq!((code, msg.as_str()), (422, refused.as_str()));
    }
    assert_eq!(stored_devices(&s, "c"), Value::Array(both("nic-0")));
}

#[tokio::test]
async fn arbitrary_node_patch_covers_every_node() {
    let s = server(v(37)).await;
    insert_claim(&s, "c", "node-a", vec![]);
    for node in [Some("node-b"), None, Some("node-a")] {
        s.set_identity(
            TOKEN,
            plugin(node, vec![driver_rule("arbitrary-node:patch")]),
        );
        let devices = vec![entry(DRIVER, node.unwrap_or("none"))];
        patch_devices(&s, "c", devices.clone())
            .await
            .unwrap_or_else(|e| panic!("{node:?}: {e:?}"));
        assert_eq!(stored_devices(&s, "c"), Value::Array(devices));
    }
    // The verb is the request's: a PUT needs arbitrary-node:update.
    s.set_identity(
        TOKEN,
        plugin(
            None,
            vec![
                driver_rule("arbitrary-node:patch"),
                rule(&["resourceclaims/status"], &["update"]),
            ],
        ),
    );
    let api = claims(&s, TOKEN);
    let mut c = api.get("c").await.unwrap();
    c.status.as_mut().unwrap().devices = None;
    let (code, _, msg) = api_error(
        api.replace_status("c", &PostParams::default(), &c)
            .await
            .unwrap_err(),
    );
    assert_eq!(code, 422, "{msg}");
    assert!(msg.contains("verb=\"[arbitrary-node:update]\""), "{msg}");
    // The admin identity may do it all.
    s.set_identity("admin", Identity::admin());
    let admin: Api<ResourceClaim> = Api::namespaced(client(&s, "admin"), "default");
    admin
        .replace_status("c", &PostParams::default(), &c)
        .await
        .unwrap();
    assert_eq!(stored_devices(&s, "c"), Value::Null);
}

#[tokio::test]
async fn an_allocation_change_needs_resourceclaims_binding() {
    let s = server(v(36)).await;
    insert_claim(&s, "c", "node-a", vec![]);
    s.set_identity(
        TOKEN,
        plugin(Some("node-a"), vec![driver_rule("associated-node:patch")]),
    );
    let api = claims(&s, TOKEN);
    let unreserve = json!({"status": {"reservedFor": null}});
    let (code, reason, msg) = api_error(
        api.patch_status("c", &PatchParams::default(), &Patch::Merge(&unreserve))
            .await
            .unwrap_err(),
    );
    assert_eq!((code, reason.as_str()), (422, "Invalid"));
    assert_eq!(
        msg,
        format!(
            "ResourceClaim.resource.k8s.io \"c\" is invalid: status.allocation: Forbidden: changing status.allocation or status.reservedFor requires resource=\"resourceclaims/binding\", verb=\"patch\" permission: resourceclaims.resource.k8s.io is forbidden: User \"{SA}\" cannot patch resource \"resourceclaims/binding\" in API group \"resource.k8s.io\" at the cluster scope"
        )
    );
    let deallocate = json!({"status": {"allocation": null}});
    let e = api
        .patch_status("c", &PatchParams::default(), &Patch::Merge(&deallocate))
        .await
        .unwrap_err();
    assert_eq!(api_error(e).0, 422);
    let stored = s
        .store()
        .get(Resource::ResourceClaims, Some("default"), "c")
        .unwrap();
    assert!(stored.pointer("/status/allocation").is_some());
    assert!(stored.pointer("/status/reservedFor").is_some());

    // Both refusals at once: binding first, then the driver.
    s.set_identity(TOKEN, plugin(Some("node-a"), vec![]));
    let p = json!({"status": {"reservedFor": null, "devices": [entry(DRIVER, "gpu-0")]}});
    let (_, _, msg) = api_error(
        api.patch_status("c", &PatchParams::default(), &Patch::Merge(&p))
            .await
            .unwrap_err(),
    );
    assert!(
        msg.starts_with(
            "ResourceClaim.resource.k8s.io \"c\" is invalid: [status.allocation: Forbidden: "
        ) && msg.contains(", status.devices: Forbidden: ")
            && msg.ends_with(']'),
        "{msg}"
    );

    // With the binding rule.
    s.set_identity(
        TOKEN,
        plugin(
            Some("node-a"),
            vec![rule(&["resourceclaims/binding"], &["patch"])],
        ),
    );
    api.patch_status("c", &PatchParams::default(), &Patch::Merge(&unreserve))
        .await
        .unwrap();
}
