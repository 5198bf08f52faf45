//! A whole-GPU claim on a GPU that an administrator left in MIG mode: on
//! Hopper (MIG mode changes without a reset) the plugin turns MIG mode off
//! and hands the GPU out; on Ampere (a reset is needed) and on a static GPU it
//! refuses with a per-claim error and changes nothing.

mod common;

use carve_plugin::{Driver, GpuPolicy};
use common::*;
use nvidia_ml_sim::GpuEntry;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hopper_in_mig_mode_is_handed_out_whole_after_mig_mode_goes_off() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 2, true)]);
    let mut cfg = node.config.clone();
    cfg.gpu_policy.insert(1, GpuPolicy::Static);
    let api = api().await;
    let driver = Driver::new(cfg, node.backend(), api.client())
        .await
        .unwrap();
    driver.recover().await.unwrap();
    let b = node.backend();
    assert!(b.mig_mode(0).unwrap().current);

    let w = put_claim(&api, "w", "u-w", &[("r", "gpu-0")], serde_json::json!([]));
    let s = put_claim(&api, "s", "u-s", &[("r", "gpu-1")], serde_json::json!([]));
    let out = driver.prepare(vec![w, s]).await;
    let r = |uid: &str| &out.iter().find(|(c, _)| c.uid == uid).unwrap().1;
    r("u-w").as_ref().unwrap();
    assert!(
        !b.mig_mode(0).unwrap().current,
        "MIG mode is off for the whole GPU"
    );
    let e = r("u-s").as_ref().unwrap_err().to_string();
    assert!(
        e.contains("GPU 1 is in MIG mode") && e.contains("static"),
        "{e}"
    );
    assert!(
        b.mig_mode(1).unwrap().current,
        "the static GPU is untouched"
    );

    // After the whole GPU is released, a MIG claim turns MIG mode on again.
    driver.unprepare_one("u-w").await.unwrap();
    let m = put_claim(
        &api,
        "m",
        "u-m",
        &[("r", "gpu-0-mig-1g10gb-6")],
        serde_json::json!([]),
    );
    driver.prepare(vec![m]).await[0].1.as_ref().unwrap();
    assert!(b.mig_mode(0).unwrap().current);
    driver.unprepare_one("u-m").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ampere_in_mig_mode_is_refused_whole() {
    let node = Node::new(vec![GpuEntry::new("a100-40gb", 1, true)]);
    let api = api().await;
    let driver = Driver::new(node.config.clone(), node.backend(), api.client())
        .await
        .unwrap();
    driver.recover().await.unwrap();
    let w = put_claim(&api, "w", "u-w", &[("r", "gpu-0")], serde_json::json!([]));
    let e = driver.prepare(vec![w]).await[0]
        .1
        .as_ref()
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs a GPU reset"), "{e}");
    assert!(node.backend().mig_mode(0).unwrap().current);
    assert!(driver.snapshot().await.claims.is_empty());
}
