//! The chart's grants on the real API server: enough, and no wider.
//!
//! *Enough*: the API server's audit log (every request of a ServiceAccount
//! outside kube-system, [`Cluster::audit_events`]) shows no request of the
//! plugin's ServiceAccount refused through the whole suite.
//! *No wider*: every verb the chart binds to that ServiceAccount was used by
//! the plugin at least once (a verb nothing calls is a grant to remove), and
//! with the plugin's own kind of credential (a token bound to its pod, so
//! it carries the pod's node) the API server refuses: another node's
//! ResourceSlices and another driver's (the chart's ValidatingAdmissionPolicy),
//! a slice of its node under another node's pool name (the same policy),
//! verbs and resources not granted (RBAC), and the device status of a claim
//! on another node or of another driver, or a change of a claim's
//! reservation: from Kubernetes 1.36 the API server's own check
//! (`resourceclaims/driver` with `associated-node:patch` only, no
//! `resourceclaims/binding`), before it the chart's claim-status policy.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Pod, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use k8s_openapi::jiff;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

use super::{NS, PLUGIN_NS, R, cluster, plugin_pods, say, wait};
use carve_e2e::cluster::Cluster;

const DRIVER: &str = "gpu.carve.dev";
const OTHER_NODE: &str = "carve-e2e-other-node";
const OTHER_DRIVER: &str = "gpu.other.example.com";
/// Synthetic subresources: the API server authorizes them inside a
/// `resourceclaims/status` write; no request ever names them.
const SYNTHETIC: [&str; 2] = ["resourceclaims/driver", "resourceclaims/binding"];

/// Every rule bound to the ServiceAccount, by ClusterRoleBindings and
/// RoleBindings alike.
async fn bound_rules(client: &Client, sa: &str) -> R<Vec<PolicyRule>> {
    let ours = |subjects: &Option<Vec<k8s_openapi::api::rbac::v1::Subject>>| {
        subjects.iter().flatten().any(|s| {
            s.kind == "ServiceAccount" && s.name == sa && s.namespace.as_deref() == Some(PLUGIN_NS)
        })
    };
    let mut rules = Vec::new();
    let crbs: Api<ClusterRoleBinding> = Api::all(client.clone());
    let crs: Api<ClusterRole> = Api::all(client.clone());
    for b in crbs.list(&ListParams::default()).await? {
        if ours(&b.subjects) {
            let role = crs.get(&b.role_ref.name).await?;
            rules.extend(role.rules.unwrap_or_default());
        }
    }
    let rbs: Api<RoleBinding> = Api::all(client.clone());
    for b in rbs.list(&ListParams::default()).await? {
        if ours(&b.subjects) {
            let ns = b.metadata.namespace.clone().unwrap_or_default();
            if b.role_ref.kind == "ClusterRole" {
                rules.extend(crs.get(&b.role_ref.name).await?.rules.unwrap_or_default());
            } else {
                let roles: Api<Role> = Api::namespaced(client.clone(), &ns);
                rules.extend(roles.get(&b.role_ref.name).await?.rules.unwrap_or_default());
            }
        }
    }
    Ok(rules)
}

/// The plugin's own write paths, so that the audit log sees them: a slice
/// of its node and driver that it did not publish (it must delete it) and
/// one of its slices changed behind its back (it must write it back).
async fn stray_and_tampered(client: &Client) -> R<()> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let stray: ResourceSlice = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "carve-e2e-stray"},
        "spec": {
            "driver": DRIVER,
            "nodeName": cluster::NODE,
            "pool": {"name": "carve-e2e-stray", "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "stray-0"}],
        },
    }))?;
    slices.create(&PostParams::default(), &stray).await?;
    let lp = ListParams::default().fields(&format!(
        "spec.nodeName={},spec.driver={DRIVER}",
        cluster::NODE
    ));
    let victim = slices
        .list(&lp)
        .await?
        .items
        .into_iter()
        .find(|s| s.spec.devices.as_ref().is_some_and(|d| d.len() > 1))
        .ok_or("no slice of carve's with two devices or more")?;
    let name = victim
        .metadata
        .name
        .clone()
        .ok_or("a slice without a name")?;
    let all = victim.spec.devices.clone().unwrap_or_default();
    let devices = all.len();
    // A merge patch replaces the list: the slice loses its first device.
    let patch = json!({"spec": {"devices": &all[1..]}});
    slices
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    wait(
        "the plugin deletes a stray slice of its node and restores a changed one",
        Duration::from_secs(150),
        || async {
            let stray_gone = matches!(slices.get_opt("carve-e2e-stray").await, Ok(None));
            let restored = slices
                .get(&name)
                .await
                .ok()
                .and_then(|s| s.spec.devices.map(|d| d.len()))
                == Some(devices);
            (stray_gone && restored).then_some(())
        },
    )
    .await?;
    say(
        "the plugin deleted a stray slice of its node and wrote back a slice changed behind its back",
    );
    Ok(())
}

/// The suite's last step: the chart's grants, enough and no wider.
pub(super) async fn grants(c: &Cluster, client: &Client) -> R<()> {
    stray_and_tampered(client).await?;
    let plugin = plugin_pods(client)
        .await
        .into_iter()
        .find(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .ok_or("no running plugin pod")?;
    let sa = plugin
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.clone())
        .ok_or("the plugin pod names no ServiceAccount")?;
    let user = format!("system:serviceaccount:{PLUGIN_NS}:{sa}");

    // Enough: nothing the plugin asked for was refused, save while an API
    // server that had just started had not yet loaded the RBAC bindings
    // (seen once in CI: one 403 on `list resourceslices` right after the
    // fault that restarts the API server, the plugin's retry then allowed).
    // Such a refusal must be followed by the same verb on the same resource
    // allowed; any other fails the test.
    let events = c.audit_events(&user)?;
    let api_starts = c.started(carve_e2e::cluster::Component::ApiServer);
    let mut used: BTreeMap<(String, String), usize> = BTreeMap::new();
    // (verb, resource, when, what) of each refusal.
    let mut refused: Vec<(String, String, jiff::Timestamp, String)> = Vec::new();
    let mut last_ok: BTreeMap<(String, String), jiff::Timestamp> = BTreeMap::new();
    for ev in &events {
        let code = ev["responseStatus"]["code"].as_u64().unwrap_or(0);
        let verb = ev["verb"].as_str().unwrap_or_default().to_string();
        let at: jiff::Timestamp = ev["requestReceivedTimestamp"]
            .as_str()
            .and_then(|t| t.parse().ok())
            .ok_or("an audit event without requestReceivedTimestamp")?;
        let res = match ev.get("objectRef") {
            Some(obj) => {
                let r = obj["resource"].as_str().unwrap_or_default();
                match obj["subresource"].as_str() {
                    Some(sub) => format!("{r}/{sub}"),
                    None => r.to_string(),
                }
            }
            // /version, discovery
            None => ev["requestURI"].as_str().unwrap_or_default().to_string(),
        };
        if code == 401 || code == 403 {
            refused.push((
                verb.clone(),
                res.clone(),
                at,
                format!(
                    "{at} {code} {verb} {}: {}",
                    ev["requestURI"].as_str().unwrap_or_default(),
                    ev["responseStatus"]["message"].as_str().unwrap_or_default()
                ),
            ));
        } else if code < 300 {
            let k = (res.clone(), verb.clone());
            if last_ok.get(&k).is_none_or(|t| *t < at) {
                last_ok.insert(k.clone(), at);
            }
            if ev.get("objectRef").is_some() {
                *used.entry(k).or_default() += 1;
            }
        }
    }
    if events.is_empty() {
        return Err(format!("the audit log has no request of {user}").into());
    }
    let just_started = |at: jiff::Timestamp| {
        api_starts.iter().any(|s| {
            let s = jiff::Timestamp::try_from(*s).unwrap_or(jiff::Timestamp::MAX);
            at >= s && at.duration_since(s) <= jiff::SignedDuration::from_secs(60)
        })
    };
    let (transient, lasting): (Vec<_>, Vec<_>) =
        refused.into_iter().partition(|(verb, res, at, _)| {
            just_started(*at)
                && last_ok
                    .get(&(res.clone(), verb.clone()))
                    .is_some_and(|ok| ok > at)
        });
    if !lasting.is_empty() {
        return Err(format!(
            "the API server refused the plugin ({user}):\n{}",
            lasting
                .iter()
                .map(|r| r.3.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        )
        .into());
    }
    for r in &transient {
        say(&format!(
            "refused within 60 s of an API server start, then allowed on retry: {}",
            r.3
        ));
    }

    // No wider: every granted verb was used.
    let rules = bound_rules(client, &sa).await?;
    if rules.is_empty() {
        return Err(format!("no rule is bound to {user}").into());
    }
    let mut unused = BTreeSet::new();
    for r in &rules {
        for res in r.resources.iter().flatten() {
            for verb in &r.verbs {
                if res == "*" || verb == "*" {
                    return Err(format!("the chart grants a wildcard: {verb} {res}").into());
                }
                if SYNTHETIC.contains(&res.as_str()) {
                    continue;
                }
                if !used.contains_key(&(res.clone(), verb.clone())) {
                    unused.insert(format!("{verb} {res}"));
                }
            }
        }
    }
    let table: Vec<String> = used
        .iter()
        .map(|((r, v), n)| format!("{v} {r}: {n}"))
        .collect();
    if !unused.is_empty() {
        return Err(format!(
            "the chart grants {user} verbs the plugin never used through the suite: {}\n(used: {})",
            unused.into_iter().collect::<Vec<_>>().join(", "),
            table.join(", ")
        )
        .into());
    }
    say(&format!(
        "audit log: {} requests of {user}, none refused; every granted verb used ({})",
        events.len(),
        table.join(", ")
    ));

    refusals(c, client, &plugin, &sa).await
}

/// What the plugin's own kind of credential must not do.
async fn refusals(c: &Cluster, admin: &Client, plugin: &Pod, sa: &str) -> R<()> {
    let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), PLUGIN_NS);
    let tr = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: None,
            bound_object_ref: Some(BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: plugin.metadata.name.clone(),
                uid: plugin.metadata.uid.clone(),
            }),
            expiration_seconds: Some(600),
        }),
        ..Default::default()
    };
    let token = sas
        .create_token_request(sa, &PostParams::default(), &tr)
        .await?
        .status
        .ok_or("a TokenRequest without status")?
        .token
        .ok_or("a TokenRequest without a token")?;
    let me = c.client_with_token(&token).await?;
    let minor = cluster::minor(c.release(carve_e2e::cluster::Component::ApiServer));

    let slice = |name: &str, node: &str, driver: &str| -> R<ResourceSlice> {
        Ok(serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {
                "driver": driver,
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": [{"name": "probe-0"}],
            },
        }))?)
    };
    let slices: Api<ResourceSlice> = Api::all(me.clone());
    // The credential is the plugin's: its own node's slice goes through
    // (the policy's first rule wants the token's node name).
    slices
        .create(
            &PostParams::default(),
            &slice("carve-e2e-grant-own", cluster::NODE, DRIVER)?,
        )
        .await
        .map_err(|e| {
            format!("the plugin's credential could not create a slice of its own node: {e}")
        })?;
    let _ = slices
        .delete("carve-e2e-grant-own", &DeleteParams::default())
        .await;

    let mut checks: Vec<(String, Result<(), kube::Error>, &str)> = Vec::new();
    let r = slices
        .create(
            &PostParams::default(),
            &slice("carve-e2e-grant-node", OTHER_NODE, DRIVER)?,
        )
        .await
        .map(drop);
    checks.push((
        "a slice of another node".into(),
        r,
        "may not write ResourceSlices of node",
    ));
    let r = slices
        .create(
            &PostParams::default(),
            &slice("carve-e2e-grant-driver", cluster::NODE, OTHER_DRIVER)?,
        )
        .await
        .map(drop);
    checks.push((
        "a slice of another driver".into(),
        r,
        "may only write ResourceSlices of driver gpu.carve.dev",
    ));
    let mut foreign_pool = slice("carve-e2e-grant-pool", cluster::NODE, DRIVER)?;
    foreign_pool.spec.pool.name = OTHER_NODE.into();
    let r = slices
        .create(&PostParams::default(), &foreign_pool)
        .await
        .map(drop);
    checks.push((
        "a slice of its node under another node's pool".into(),
        r,
        "may only write ResourceSlices of its own pool",
    ));
    let claims: Api<ResourceClaim> = Api::namespaced(me.clone(), NS);
    let r = claims
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await
        .map(drop);
    checks.push((
        "deleting claims".into(),
        r,
        "cannot deletecollection resource",
    ));
    let r = Api::<Pod>::all(me.clone())
        .list(&ListParams::default())
        .await
        .map(drop);
    checks.push(("listing pods".into(), r, "cannot list resource \"pods\""));
    let r = Api::<Secret>::namespaced(me.clone(), PLUGIN_NS)
        .list(&ListParams::default())
        .await
        .map(drop);
    checks.push((
        "listing secrets".into(),
        r,
        "cannot list resource \"secrets\"",
    ));
    let class: DeviceClass = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": {"name": "carve-e2e-grant"}, "spec": {},
    }))?;
    let r = Api::<DeviceClass>::all(me.clone())
        .create(&PostParams::default(), &class)
        .await
        .map(drop);
    checks.push((
        "creating a DeviceClass".into(),
        r,
        "cannot create resource \"deviceclasses\"",
    ));

    // Device status. Two claims allocated by the admin (no pod uses them):
    // one on this node, with a device of carve's and one of another
    // driver, and one on another node.
    let admin_claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), NS);
    for (name, node) in [
        ("carve-e2e-grant-here", cluster::NODE),
        ("carve-e2e-grant-there", OTHER_NODE),
    ] {
        let claim: ResourceClaim = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [
                {"name": "ours", "exactly": {"deviceClassName": "gpu.carve.dev"}},
                {"name": "theirs", "exactly": {"deviceClassName": "gpu.carve.dev"}},
            ]}},
        }))?;
        let _ = admin_claims.delete(name, &DeleteParams::default()).await;
        admin_claims.create(&PostParams::default(), &claim).await?;
        let allocation = json!({"status": {"allocation": {
            "devices": {"results": [
                {"request": "ours", "driver": DRIVER, "pool": node, "device": "carve-e2e-probe"},
                {"request": "theirs", "driver": OTHER_DRIVER, "pool": node, "device": "probe"},
            ]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]},
            ]}]},
        }}});
        admin_claims
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&allocation))
            .await?;
    }
    let status = |driver: &str, node: &str, device: &str| {
        json!({"status": {"devices": [
            {"driver": driver, "pool": node, "device": device,
             "conditions": [{"type": "Ready", "status": "True", "reason": "Probe",
                             "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]},
        ]}})
    };
    // Its own driver's entry on a claim of its node: allowed everywhere.
    claims
        .patch_status(
            "carve-e2e-grant-here",
            &PatchParams::default(),
            &Patch::Merge(&status(DRIVER, cluster::NODE, "carve-e2e-probe")),
        )
        .await
        .map_err(|e| {
            format!("the plugin's credential could not write its device status on its node: {e}")
        })?;
    let other_driver = claims
        .patch_status(
            "carve-e2e-grant-here",
            &PatchParams::default(),
            &Patch::Merge(&status(OTHER_DRIVER, cluster::NODE, "probe")),
        )
        .await
        .map(drop);
    let other_node = claims
        .patch_status(
            "carve-e2e-grant-there",
            &PatchParams::default(),
            &Patch::Merge(&status(DRIVER, OTHER_NODE, "carve-e2e-probe")),
        )
        .await
        .map(drop);
    // Clearing the reservation of a claim: its devices would be handed out
    // again under a running pod.
    let cleared = claims
        .patch_status(
            "carve-e2e-grant-here",
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {"reservedFor": [
                {"resource": "pods", "name": "carve-e2e-probe", "uid": "00000000-0000-0000-0000-000000000001"},
            ]}})),
        )
        .await
        .map(drop);
    // From 1.36 the API server refuses these itself (the registry's status
    // check runs before admission); before, the chart's claim-status policy.
    let (driver_msg, node_msg, binding_msg) = if minor >= 36 {
        (
            "requires resource=\"resourceclaims/driver\"",
            "requires resource=\"resourceclaims/driver\"",
            "requires resource=\"resourceclaims/binding\"",
        )
    } else {
        (
            "may only change status.devices entries of driver gpu.carve.dev",
            "may only write the status of claims allocated on that node",
            "may not change status.allocation or status.reservedFor",
        )
    };
    checks.push((
        "another driver's device status".into(),
        other_driver,
        driver_msg,
    ));
    checks.push((
        "the device status of a claim on another node".into(),
        other_node,
        node_msg,
    ));
    checks.push((
        "changing a claim's reservedFor".into(),
        cleared,
        binding_msg,
    ));
    for name in ["carve-e2e-grant-here", "carve-e2e-grant-there"] {
        admin_claims.delete(name, &DeleteParams::default()).await?;
    }

    let mut wrong = Vec::new();
    for (what, r, wanted) in &checks {
        match r {
            Ok(()) => wrong.push(format!("{what}: allowed")),
            Err(e) if !e.to_string().contains(wanted) => {
                wrong.push(format!("{what}: refused, but not with {wanted:?}: {e}"));
            }
            Err(_) => {}
        }
    }
    if !wrong.is_empty() {
        return Err(format!(
            "the plugin's credential ({sa}, bound to its pod) is wider than it should be:\n{}",
            wrong.join("\n")
        )
        .into());
    }
    say(&format!(
        "the plugin's credential is refused: {}",
        checks
            .iter()
            .map(|(w, _, _)| w.as_str())
            .collect::<Vec<_>>()
            .join("; ")
    ));
    Ok(())
}
