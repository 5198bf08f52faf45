//! The stand-in rejects or drops what the real API server of the version it
//! reports rejects or drops (`src/strategy.rs` cites the upstream rules): one
//! test per rule, each with the case the real server accepts beside it.

use carve_apiserver::{ApiServer, FeatureGate, KubeVersion, Options, Resource};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const V134: KubeVersion = KubeVersion {
    major: 1,
    minor: 34,
};
const V135: KubeVersion = KubeVersion {
    major: 1,
    minor: 35,
};
const V136: KubeVersion = KubeVersion {
    major: 1,
    minor: 36,
};

async fn server(version: KubeVersion) -> ApiServer {
    ApiServer::start(Options {
        version,
        ..Options::default()
    })
    .await
    .unwrap()
}

fn slices(s: &ApiServer) -> Api<ResourceSlice> {
    Api::all(s.client())
}

fn device(name: &str) -> Value {
    json!({"name": name, "attributes": {"type": {"string": "gpu"}}})
}

fn slice(name: &str, devices: Vec<Value>) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": "gpu.carve.dev",
            "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 0, "resourceSliceCount": 1},
            "devices": devices,
        }
    })
}

fn tainted(effect: &str) -> Value {
    let mut d = device("gpu-0");
    d["taints"] = json!([{"key": "gpu.carve.dev/xid", "value": "94", "effect": effect}]);
    d
}

/// Creates the slice; `Ok(stored)` or `Err((code, message))`.
async fn create(s: &ApiServer, obj: Value) -> Result<ResourceSlice, (u16, String)> {
    let obj: ResourceSlice = serde_json::from_value(obj).unwrap();
    slices(s)
        .create(&PostParams::default(), &obj)
        .await
        .map_err(|e| match e {
            kube::Error::Api(st) => (st.code, st.message),
            other => panic!("not an API error: {other}"),
        })
}

async fn rejected(s: &ApiServer, obj: Value, want: &[&str]) {
    let (code, msg) = create(s, obj).await.expect_err("accepted");
    assert_eq!(code, 422, "{msg}");
    for w in want {
        assert!(msg.contains(w), "{msg:?} lacks {w:?}");
    }
}

#[tokio::test]
async fn taint_effect_none_is_invalid_on_1_34_only() {
    let s = server(V134).await;
    rejected(
        &s,
        slice("a", vec![tainted("None")]),
        &[
            "spec.devices[0].taints[0].effect",
            "\"None\"",
            "\"NoSchedule\"",
        ],
    )
    .await;
    for (i, e) in ["NoSchedule", "NoExecute"].iter().enumerate() {
        create(&s, slice(&format!("ok-{i}"), vec![tainted(e)]))
            .await
            .unwrap();
    }
    for v in [V135, V136] {
        s.set_version(v);
        create(
            &s,
            slice(&format!("none-{}", v.minor), vec![tainted("None")]),
        )
        .await
        .unwrap_or_else(|e| panic!("{v}: {e:?}"));
    }
}

#[tokio::test]
async fn taint_key_value_and_effect_syntax() {
    for v in [V134, V135, V136] {
        let s = server(v).await;
        for (effect, want) in [
            ("", "Required value"),
            ("PreferNoSchedule", "Unsupported value"),
        ] {
            rejected(&s, slice("a", vec![tainted(effect)]), &[want]).await;
        }
        let mut d = tainted("NoSchedule");
        d["taints"][0]["key"] = json!("Bad Key");
        rejected(&s, slice("a", vec![d]), &["taints[0].key"]).await;
        let mut d = tainted("NoSchedule");
        d["taints"][0]["value"] = json!("-x");
        rejected(&s, slice("a", vec![d]), &["taints[0].value"]).await;
    }
}

fn many_taints(n: usize) -> Value {
    let mut d = device("gpu-0");
    d["taints"] = (0..n)
        .map(|i| json!({"key": format!("k{i}"), "effect": "NoSchedule"}))
        .collect();
    d
}

#[tokio::test]
async fn taints_per_device_4_on_1_34_and_16_from_1_35() {
    let s = server(V134).await;
    create(&s, slice("four", vec![many_taints(4)]))
        .await
        .unwrap();
    rejected(&s, slice("five", vec![many_taints(5)]), &["at most 4"]).await;
    s.set_version(V135);
    create(&s, slice("five", vec![many_taints(5)]))
        .await
        .unwrap();
    create(&s, slice("sixteen", vec![many_taints(16)]))
        .await
        .unwrap();
    rejected(
        &s,
        slice("seventeen", vec![many_taints(17)]),
        &["at most 16"],
    )
    .await;
}

#[tokio::test]
async fn unchanged_taints_are_not_validated_again() {
    // Stored on 1.35 with effect None, then the server reports 1.34: an
    // update that keeps the taints passes, one that changes them does not.
    let s = server(V135).await;
    let stored = create(&s, slice("a", vec![tainted("None")])).await.unwrap();
    s.set_version(V134);
    let mut keep = stored.clone();
    keep.spec.pool.generation = 1;
    let kept = slices(&s)
        .replace("a", &PostParams::default(), &keep)
        .await
        .unwrap();
    let mut change = kept.clone();
    change.spec.devices.as_mut().unwrap()[0]
        .taints
        .as_mut()
        .unwrap()[0]
        .value = Some("63".into());
    let e = slices(&s)
        .replace("a", &PostParams::default(), &change)
        .await
        .unwrap_err();
    assert!(
        matches!(e, kube::Error::Api(ref st) if st.code == 422),
        "{e}"
    );
}

fn counters(name: &str) -> Value {
    json!([{"name": name, "counters": {"memory-slice-0": {"value": "1"}}}])
}

fn consuming(name: &str, set: &str) -> Value {
    let mut d = device(name);
    d["consumesCounters"] =
        json!([{"counterSet": set, "counters": {"memory-slice-0": {"value": "1"}}}]);
    d
}

#[tokio::test]
async fn layout_rules_follow_the_version() {
    // 1.34 layout: counter sets and the devices consuming them in one slice.
    let mut v134 = slice("v134", vec![consuming("gpu-0", "gpu-0-counters")]);
    v134["spec"]["sharedCounters"] = counters("gpu-0-counters");
    // 1.35 layout: a device slice consuming a set of another slice.
    let v135 = slice("v135", vec![consuming("gpu-0", "gpu-0-counters")]);

    let s = server(V134).await;
    create(&s, v134.clone()).await.unwrap();
    rejected(
        &s,
        v135.clone(),
        &["consumesCounters[0].counterSet", "gpu-0-counters"],
    )
    .await;
    for v in [V135, V136] {
        let s = server(v).await;
        rejected(
            &s,
            v134.clone(),
            &["only one of `sharedCounters` or `devices`"],
        )
        .await;
        create(&s, v135.clone()).await.unwrap();
    }
}

#[tokio::test]
async fn device_limit_is_64_with_taints_or_counters_from_1_35() {
    let devices = |n: usize, taint: bool| -> Vec<Value> {
        (0..n)
            .map(|i| {
                let mut d = device(&format!("gpu-{i}"));
                if taint && i == 0 {
                    d["taints"] = json!([{"key": "k", "effect": "NoSchedule"}]);
                }
                d
            })
            .collect()
    };
    let s = server(V134).await;
    create(&s, slice("a", devices(65, true))).await.unwrap();
    rejected(&s, slice("b", devices(129, false)), &["at most 128"]).await;
    let s = server(V135).await;
    create(&s, slice("a", devices(128, false))).await.unwrap();
    rejected(&s, slice("b", devices(65, true)), &["at most 64"]).await;
}

fn listed(n: usize) -> Value {
    let mut d = device("gpu-0");
    d["attributes"]["pcieRoots"] = json!({"ints": (0..n).collect::<Vec<_>>()});
    d
}

#[tokio::test]
async fn list_attributes_exist_from_1_36() {
    for v in [V134, V135] {
        let s = server(v).await;
        rejected(
            &s,
            slice("a", vec![listed(2)]),
            &["attributes[pcieRoots]", "exactly one value"],
        )
        .await;
    }
    let s = server(V136).await;
    create(&s, slice("a", vec![listed(2)])).await.unwrap();
    // 47 list items + the `type` attribute = 48 values; one more is too many.
    create(&s, slice("b", vec![listed(47)])).await.unwrap();
    rejected(&s, slice("c", vec![listed(48)]), &["must not exceed 48"]).await;
    rejected(&s, slice("d", vec![listed(0)]), &["must not be empty"]).await;
}

fn shared_device() -> Value {
    json!({
        "name": "gpu-0-mps",
        "allowMultipleAllocations": true,
        "capacity": {"memory": {"value": "80Gi", "requestPolicy": {"default": "1Gi", "validRange": {"min": "1Gi"}}}}
    })
}

#[tokio::test]
async fn request_policy_needs_allow_multiple_allocations() {
    let s = server(V135).await;
    create(&s, slice("a", vec![shared_device()])).await.unwrap();
    let mut d = shared_device();
    d.as_object_mut()
        .unwrap()
        .remove("allowMultipleAllocations");
    rejected(
        &s,
        slice("b", vec![d]),
        &[
            "capacity[memory].requestPolicy",
            "allowMultipleAllocations must be true",
        ],
    )
    .await;
}

#[tokio::test]
async fn device_taints_gate_off_drops_taints_unless_in_use() {
    let s = server(V135).await;
    let kept = create(&s, slice("before", vec![tainted("NoSchedule")]))
        .await
        .unwrap();
    s.set_feature_gate(FeatureGate::DeviceTaints, false);
    assert!(!s.feature_gate(FeatureGate::DeviceTaints));
    let got = create(&s, slice("after", vec![tainted("NoSchedule")]))
        .await
        .unwrap();
    assert_eq!(
        got.spec.devices.as_ref().unwrap()[0].taints,
        None,
        "dropped on create"
    );
    // Off, but the stored slice already has taints: an update keeps them.
    let mut upd = kept.clone();
    upd.spec.pool.generation = 1;
    let upd = slices(&s)
        .replace("before", &PostParams::default(), &upd)
        .await
        .unwrap();
    assert!(upd.spec.devices.as_ref().unwrap()[0].taints.is_some());
    // Dropped taints are not validated: an effect 1.34 refuses passes there.
    s.set_version(V134);
    let got = create(&s, slice("none", vec![tainted("None")]))
        .await
        .unwrap();
    assert_eq!(got.spec.devices.as_ref().unwrap()[0].taints, None);
}

#[tokio::test]
async fn consumable_capacity_gate_off_drops_sharing_fields() {
    let s = server(V135).await;
    s.set_feature_gate(FeatureGate::ConsumableCapacity, false);
    let got = create(&s, slice("a", vec![shared_device()])).await.unwrap();
    let d = &got.spec.devices.as_ref().unwrap()[0];
    assert_eq!(d.allow_multiple_allocations, None);
    assert_eq!(d.capacity.as_ref().unwrap()["memory"].request_policy, None);
    assert_eq!(
        s.store().list(Resource::ResourceSlices)[0]
            .pointer("/spec/devices/0/allowMultipleAllocations"),
        None
    );
    // The claim side: results' shareID and consumedCapacity, devices' shareID.
    let claims: Api<ResourceClaim> = Api::namespaced(s.client(), "default");
    let claim: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c"},
        "spec": {"devices": {"requests": [{"name": "r", "exactly": {
            "deviceClassName": "mps.gpu.carve.dev",
            "capacity": {"requests": {"memory": "4Gi"}}
        }}]}}
    }))
    .unwrap();
    let created = claims.create(&PostParams::default(), &claim).await.unwrap();
    let req = &created
        .spec
        .devices
        .as_ref()
        .unwrap()
        .requests
        .as_ref()
        .unwrap()[0];
    assert_eq!(
        req.exactly.as_ref().unwrap().capacity,
        None,
        "spec capacity dropped"
    );
    let status = json!({"status": {"allocation": {"devices": {"results": [{
        "request": "r", "driver": "gpu.carve.dev", "pool": "node-a", "device": "gpu-0-mps",
        "shareID": "0b0c5a6e-5f36-4a8e-9c1b-2f6d3f1e7a10",
        "consumedCapacity": {"memory": "4Gi"}
    }]}}}});
    let patched = claims
        .patch_status("c", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    let r = &patched
        .status
        .unwrap()
        .allocation
        .unwrap()
        .devices
        .unwrap()
        .results
        .unwrap()[0];
    assert_eq!(r.device, "gpu-0-mps");
    assert_eq!(r.share_id, None);
    assert_eq!(r.consumed_capacity, None);
    // With the gate on, both are kept.
    s.set_feature_gate(FeatureGate::ConsumableCapacity, true);
    let patched = claims
        .patch_status("c", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    let r = &patched
        .status
        .unwrap()
        .allocation
        .unwrap()
        .devices
        .unwrap()
        .results
        .unwrap()[0];
    assert!(r.share_id.is_some() && r.consumed_capacity.is_some());
}

#[tokio::test]
async fn partitionable_devices_gate_off_drops_per_device_node_selection() {
    let s = server(V135).await;
    s.set_feature_gate(FeatureGate::PartitionableDevices, false);
    let mut obj = slice("a", vec![device("gpu-0")]);
    obj["spec"].as_object_mut().unwrap().remove("nodeName");
    obj["spec"]["perDeviceNodeSelection"] = json!(true);
    obj["spec"]["devices"][0]["nodeName"] = json!("node-a");
    let got = create(&s, obj).await.unwrap();
    assert_eq!(got.spec.per_device_node_selection, None);
    assert_eq!(got.spec.devices.as_ref().unwrap()[0].node_name, None);
}
