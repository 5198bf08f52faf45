//! Time-slice devices (`gpu-<i>-ts`): a real `Driver` over the NVML simulator
//! library and the API-server stand-in. Several claims share one GPU; MIG and
//! whole-GPU uses of that GPU are refused while they do, and the shares
//! survive a plugin restart.

mod common;

use carve_apiserver::ApiServer;
use carve_plugin::{CdiSpec, ClaimRef, Driver, PreparedKind, claim_spec_path};
use common::*;
use nvidia_ml_sim::GpuEntry;

/// An allocated claim with one result carrying a `shareID`.
fn put_share(api: &ApiServer, name: &str, uid: &str, device: &str, share: &str) -> ClaimRef {
    let r = serde_json::json!({"request": "r", "driver": "gpu.carve.dev", "pool": NODE,
        "device": device, "shareID": share,
        "consumedCapacity": {"memory": "0", "multiprocessors": "0"}});
    put_results(api, name, uid, vec![r], &[])
}

async fn start(node: &Node, api: &ApiServer) -> Driver {
    started(node, node.config.clone(), api).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_share_a_time_sliced_gpu_and_exclude_other_uses() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 2, false)]);
    let api = api().await;
    let driver = start(&node, &api).await;
    let b = node.backend();
    let uuid0 = b.gpus().unwrap()[0].uuid.clone();

    let a = put_share(&api, "a", "u-a", "gpu-0-ts", "11111111-aaaa");
    let c = put_share(&api, "c", "u-c", "gpu-0-ts", "22222222-bbbb");
    let out = driver.prepare(vec![a.clone(), c.clone()]).await;
    for (claim, r) in &out {
        let devs = r.as_ref().unwrap_or_else(|e| panic!("{claim}: {e}"));
        assert_eq!(devs.len(), 1);
        assert_eq!(devs[0].device_name, "gpu-0-ts");
        assert!(devs[0].share_id.is_some());
        // One CDI device per claim, the whole GPU, no limits.
        let spec = CdiSpec::read(&claim_spec_path(&node.config.cdi_dir, &claim.uid)).unwrap();
        assert_eq!(spec.devices.len(), 1);
        let env = &spec.devices[0].container_edits.env;
        // The whole GPU's node (issue 16: no per-device visible-device variables).
        assert_eq!(
            spec.devices[0].container_edits.device_nodes[0].path,
            "/dev/nvidia0"
        );
        assert!(
            !env.iter().any(|e| e.contains("VISIBLE_DEVICES")),
            "{env:?} ({uuid0})"
        );
        assert!(!env.iter().any(|e| e.starts_with("CUDA_MPS")), "{env:?}");
    }
    assert_ne!(
        out[0].1.as_ref().unwrap()[0].cdi_device_ids,
        out[1].1.as_ref().unwrap()[0].cdi_device_ids
    );
    let snap = driver.snapshot().await;
    for uid in ["u-a", "u-c"] {
        assert_eq!(snap.claims[uid].devices[0].kind, PreparedKind::TimeSlice);
    }
    // No hardware change: no MIG mode, no instance.
    assert!(!b.mig_mode(0).unwrap().current);
    assert!(live(&*b, 0).is_empty());
    // The status names the sharing.
    let rc = claim_with_status(&api, "a").await;
    assert_eq!(
        rc["status"]["devices"][0]["data"]["sharing"], "timeslice",
        "{rc}"
    );

    // MIG or the whole GPU on a time-sliced GPU: refused, naming the holder;
    // the other GPU is unaffected.
    let mig = put_claim(
        &api,
        "mig",
        "u-mig",
        &[("r", "gpu-0-mig-1g10gb-0")],
        serde_json::json!([]),
    );
    let whole = put_claim(
        &api,
        "whole",
        "u-whole",
        &[("r", "gpu-0")],
        serde_json::json!([]),
    );
    let other = put_claim(
        &api,
        "other",
        "u-other",
        &[("r", "gpu-1-mig-1g10gb-0")],
        serde_json::json!([]),
    );
    let out = driver
        .prepare(vec![mig.clone(), whole.clone(), other.clone()])
        .await;
    let e = claim_error(&out, "u-mig");
    assert!(
        e.contains("GPU 0 is held") && e.contains("as a time-sliced GPU"),
        "{e}"
    );
    let e = claim_error(&out, "u-whole");
    assert!(e.contains("as a time-sliced GPU"), "{e}");
    assert!(out[2].1.is_ok(), "{:?}", out[2].1);
    assert!(!b.mig_mode(0).unwrap().current);

    // Time-slicing a GPU with a MIG claim on it: refused.
    let ts1 = put_share(&api, "ts1", "u-ts1", "gpu-1-ts", "33333333-cccc");
    let out = driver.prepare(vec![ts1.clone()]).await;
    let e = claim_error(&out, "u-ts1");
    assert!(e.contains("using its MIG devices"), "{e}");

    // Restart: the shares are kept and prepare stays idempotent.
    drop(driver);
    let driver = start(&node, &api).await;
    let snap = driver.snapshot().await;
    assert!(snap.claims.contains_key("u-a") && snap.claims.contains_key("u-c"));
    let again = driver.prepare(vec![a.clone()]).await;
    assert_eq!(again[0].1.as_ref().unwrap()[0].device_name, "gpu-0-ts");

    // After the last share the GPU is free for MIG again.
    for (_, r) in driver.unprepare(vec![a.clone(), c.clone()]).await {
        r.unwrap();
    }
    assert!(!claim_spec_path(&node.config.cdi_dir, "u-a").exists());
    let out = driver.prepare(vec![mig]).await;
    assert!(out[0].1.is_ok(), "{:?}", out[0].1);
    // The whole GPU after time-slice claims on it: still refused while the
    // MIG claim holds it.
    let out = driver.prepare(vec![whole]).await;
    assert!(claim_error(&out, "u-whole").contains("using its MIG devices"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_without_mig_time_slices_and_mps_is_still_refused_per_claim() {
    let node = Node::new(vec![GpuEntry::new("l4-24gb", 1, false)]);
    let api = api().await;
    let driver = start(&node, &api).await;
    let ts = put_share(&api, "ts", "u-ts", "gpu-0-ts", "44444444-dddd");
    let mps = put_share(&api, "mps", "u-mps", "gpu-0-mps", "55555555-eeee");
    let out = driver.prepare(vec![ts, mps]).await;
    assert!(out[0].1.is_ok(), "{:?}", out[0].1);
    let e = claim_error(&out, "u-mps");
    assert!(e.contains("gpu-0-mps") && e.contains("MPS"), "{e}");
    assert!(!driver.snapshot().await.claims.contains_key("u-mps"));
}
