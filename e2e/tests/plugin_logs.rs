//! What the real `carve kubelet-plugin` writes to its log, run as an admin
//! runs it with `--log-format json`: through a start, a prepare, an
//! unprepare, a slice deleted behind its back and a stop, every line is one
//! JSON object; the start-up line carries the version and the settings; a
//! clean start logs no change behind the publisher's back (the deletion
//! does); recovery is summed up once, in fields; prepare and unprepare
//! lines name the claim.

use carve_alloc::{Allocator, Inputs, Object, load_yaml_documents};
use carve_apiserver::{ApiServer, Options};
use carve_e2e::{SimNode, carve_binary, claim_ref, wait_for, workspace_root};
use carve_plugin::testing::FakeKubelet;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use nvidia_ml_sim::GpuEntry;
use serde_json::Value;

const NODE: &str = "node-logs";
const NS: &str = "team-a";
const CLAIM: &str = "logs-1g";
const BEHIND: &str = "ResourceSlices changed behind the publisher's back";

/// Every line of `log`, each parsed as JSON; panics naming a line that is not
/// one JSON object.
fn json_lines(log: &str) -> Vec<Value> {
    log.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| match serde_json::from_str::<Value>(l) {
            Ok(v) if v.is_object() => v,
            _ => panic!("a log line that is not a JSON object: {l}\nthe whole log:\n{log}"),
        })
        .collect()
}

fn message(line: &Value) -> &str {
    line.pointer("/fields/message")
        .and_then(Value::as_str)
        .unwrap_or_default()
}

fn field<'a>(line: &'a Value, name: &str) -> &'a Value {
    line.get("fields")
        .and_then(|f| f.get(name))
        .unwrap_or(&Value::Null)
}

async fn device_classes(api: &ApiServer) -> Vec<DeviceClass> {
    carve_e2e::create_example_classes(api.client()).await
}

/// The `examples/mig-1g` claim as `NS/CLAIM`, allocated on the node and
/// its `status.allocation` written.
async fn allocated_claim(
    api: &ApiServer,
    node: &mut SimNode,
    classes: Vec<DeviceClass>,
) -> ResourceClaim {
    let slices = carve_e2e::wait_published(node, &api.store())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let path = workspace_root().join("examples/mig-1g/pod.yaml");
    let mut claim = load_yaml_documents(&path)
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .find_map(|o| match o {
            Object::Claim(c) => Some(c),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{} holds no ResourceClaim", path.display()));
    claim.metadata.name = Some(CLAIM.into());
    claim.metadata.namespace = Some(NS.into());
    let inputs = Inputs {
        slices,
        classes,
        claims_allocated: Vec::new(),
    };
    let result = Allocator::new(&inputs)
        .unwrap()
        .allocate(&claim, NODE)
        .unwrap();
    let claims: Api<ResourceClaim> = Api::namespaced(api.client(), NS);
    claims.create(&PostParams::default(), &claim).await.unwrap();
    let patch = serde_json::json!({"status": {"allocation": result}});
    claims
        .patch_status(CLAIM, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap()
}

/// Waits until the plugin's log has a line whose message contains `text`.
async fn logged(node: &mut SimNode, text: &str) {
    let what = format!("the log line {text:?}");
    wait_for(node, &what, |n| n.log().contains(text).then_some(()))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_json_mode_every_line_is_json_and_names_what_an_admin_needs() {
    let carve = carve_binary().unwrap_or_else(|e| panic!("{e}"));
    let api = ApiServer::start(Options::default()).await.unwrap();
    let classes = device_classes(&api).await;
    let mut node = SimNode::new(
        NODE,
        vec![GpuEntry::new("h100-80gb", 1, true)],
        carve,
        &api.url(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    node.extra_args = ["--log-format", "json", "--resync-seconds", "600"]
        .map(String::from)
        .to_vec();

    // Start: registered, serving, the slices published and the watch's
    // first list through (its settle time is 200 ms).
    let reg = node.start_plugin().await.unwrap_or_else(|e| panic!("{e}"));
    let kubelet = FakeKubelet::register(&reg, carve_model::DRIVER_NAME)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", node.log()));
    logged(&mut node, "serving the kubelet").await;
    let claim = allocated_claim(&api, &mut node, classes).await;
    let r = claim_ref(&claim).unwrap();

    // Prepare and unprepare through the kubelet's API.
    let resp = kubelet.prepare(std::slice::from_ref(&r)).await.unwrap();
    assert!(resp.claims[&r.uid].error.is_empty(), "{:?}", resp.claims);
    let resp = kubelet.unprepare(std::slice::from_ref(&r)).await.unwrap();
    assert!(resp.claims[&r.uid].error.is_empty(), "{:?}", resp.claims);
    logged(&mut node, "\"unprepared\"").await;
    // Well past the watch's settle time: a report of the first list would
    // be logged by now.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let clean = node.log().lines().count();

    // Someone else deletes one of the plugin's slices.
    let slices: Api<ResourceSlice> = Api::all(api.client());
    let victim = api
        .store()
        .list(carve_apiserver::Resource::ResourceSlices)
        .iter()
        .find_map(|s| s.pointer("/metadata/name")?.as_str().map(str::to_owned))
        .expect("a published slice");
    slices.delete(&victim, &Default::default()).await.unwrap();
    logged(&mut node, BEHIND).await;

    let status = node.terminate().await.unwrap_or_else(|e| panic!("{e}"));
    assert!(status.success(), "{status}\n{}", node.log());
    let log = node.log();
    let lines = json_lines(&log);
    let all = |m: &str| -> Vec<&Value> { lines.iter().filter(|l| message(l) == m).collect() };

    // The start-up line: version and settings, each a field.
    let start = all("carve kubelet-plugin starting");
    assert_eq!(start.len(), 1, "{log}");
    let s = start[0];
    assert_eq!(field(s, "version"), env!("CARGO_PKG_VERSION"), "{s}");
    assert_eq!(field(s, "node_name"), NODE, "{s}");
    let dir = |p: &std::path::Path| Value::from(p.display().to_string());
    assert_eq!(field(s, "state_dir"), &dir(&node.state_dir), "{s}");
    assert_eq!(field(s, "cdi_dir"), &dir(&node.cdi_dir), "{s}");
    assert_eq!(field(s, "plugins_dir"), &dir(&node.plugins_dir), "{s}");
    assert_eq!(field(s, "registry_dir"), &dir(&node.registry_dir), "{s}");
    assert_eq!(field(s, "host_driver_root"), &dir(&node.driver.root), "{s}");
    assert_eq!(field(s, "mig_policy"), "dynamic", "{s}");
    assert_eq!(field(s, "mps"), false, "{s}");
    assert_eq!(field(s, "mps_protocol"), "auto", "{s}");
    assert_eq!(field(s, "resync_seconds"), 600, "{s}");
    assert_eq!(field(s, "api_timeout_seconds"), 10, "{s}");
    assert_eq!(field(s, "log_format"), "json", "{s}");

    // The socket served, as fields.
    let serving = all("serving the kubelet");
    assert_eq!(serving.len(), 1, "{log}");
    assert!(
        field(serving[0], "dra_socket")
            .as_str()
            .is_some_and(|p| p.ends_with("dra.sock")),
        "{}",
        serving[0]
    );

    // Recovery summed up once, in fields, not a Debug dump.
    let recovery = all("recovery done");
    assert_eq!(recovery.len(), 1, "{log}");
    assert_eq!(field(recovery[0], "kept"), 0, "{}", recovery[0]);
    assert_eq!(field(recovery[0], "instances_destroyed"), 0);
    assert_eq!(field(recovery[0], "checkpoint_moved_aside"), false);
    assert!(!log.contains("RecoveryReport"), "{log}");
    assert!(all("recovered").is_empty(), "{log}");

    // A clean start is no change behind the publisher's back; the deletion is.
    let (before, after) = lines.split_at(lines.len().min(clean));
    let behind = |ls: &[Value]| -> Vec<Value> {
        ls.iter()
            .filter(|l| message(l) == BEHIND)
            .cloned()
            .collect()
    };
    assert!(behind(before).is_empty(), "on a clean start:\n{log}");
    let reported = behind(after);
    assert!(!reported.is_empty(), "{log}");
    assert_eq!(reported[0]["level"], "WARN", "{}", reported[0]);
    assert!(
        reported[0].to_string().contains(&victim),
        "the warning does not name {victim}: {}",
        reported[0]
    );

    // Prepare and unprepare lines name the claim: namespace/name and uid;
    // so do the NVML lines of its instance (made and destroyed on a
    // blocking thread, in the claim's span).
    let named = format!("{NS}/{CLAIM}");
    let claim_lines: Vec<&Value> = lines
        .iter()
        .filter(|l| {
            let m = message(l).to_lowercase();
            m.contains("prepare") || m.starts_with("gpu instance")
        })
        .collect();
    for m in [
        "prepared",
        "unprepared",
        "GPU instance created",
        "GPU instance destroyed",
    ] {
        assert!(
            claim_lines.iter().any(|l| message(l) == m),
            "no {m:?} line:\n{log}"
        );
    }
    for l in &claim_lines {
        let text = l.to_string();
        assert!(
            text.contains(&named) && text.contains(&r.uid),
            "a prepare/unprepare line does not name {named} ({}): {l}",
            r.uid
        );
    }

    // The stop is logged too (in JSON like the rest).
    assert!(!all("shutting down").is_empty(), "{log}");
}
