//! The checkpoint file shared with other plugin processes (with a pod UID)
//! and across boots: a file another process wrote is read again, and a
//! checkpoint torn by a power loss is told apart from a corrupt one of the
//! current boot by the boot marker.

mod common;

use carve_plugin::{Checkpoint, ClaimState, Driver};
use common::*;
use nvidia_ml_sim::GpuEntry;

fn marker(node: &Node) -> String {
    let mut p = node.config.checkpoint_path.as_os_str().to_owned();
    p.push(".boot");
    std::fs::read_to_string(std::path::PathBuf::from(p)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_another_process_wrote_is_read_again_under_the_host_lock() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let mut cfg = node.config.clone();
    cfg.pod_uid = Some("pod-1".into());
    let api = api().await;
    let driver = started(&node, cfg.clone(), &api).await;
    let a = put_claim(
        &api,
        "c-a",
        "u-a",
        &[("r", "gpu-0-mig-1g10gb-4")],
        serde_json::json!([]),
    );
    driver.prepare_one(&a).await.unwrap();

    // Another plugin pod (rolling update) replaces the file: same size, one
    // byte different (the claim's name), and a claim this process never saw.
    let path = &cfg.checkpoint_path;
    let before = std::fs::read(path).unwrap();
    let mut cp = Checkpoint::load(path).unwrap().unwrap();
    let mut other = cp.body.claims["u-a"].clone();
    cp.body.claims.get_mut("u-a").unwrap().name = "c-x".into();
    Checkpoint::store(&cp.body, path, None).unwrap();
    assert_eq!(std::fs::read(path).unwrap().len(), before.len());
    assert_ne!(std::fs::read(path).unwrap(), before);
    // Any operation takes the lock and rereads: unpreparing an unknown claim.
    driver.unprepare_one("u-unknown").await.unwrap();
    assert_eq!(driver.snapshot().await.claims["u-a"].name, "c-x");

    other.uid = "u-other".into();
    other.name = "c-other".into();
    other.devices.clear();
    cp.body.claims.insert("u-other".into(), other);
    Checkpoint::store(&cp.body, path, None).unwrap();
    driver.unprepare_one("u-unknown").await.unwrap();
    let snap = driver.snapshot().await;
    assert_eq!(snap.claims.len(), 2, "{:?}", snap.claims.keys());
    assert_eq!(snap.claims["u-other"].state, ClaimState::PrepareCompleted);

    // This process's own writes keep both claims (the file it wrote is not
    // parsed again, and the state it keeps for it is the same).
    driver.unprepare_one("u-a").await.unwrap();
    driver.unprepare_one("u-unknown").await.unwrap();
    let snap = driver.snapshot().await;
    assert_eq!(snap.claims.keys().collect::<Vec<_>>(), ["u-other"]);
    let on_disk = Checkpoint::load(path).unwrap().unwrap().body;
    assert_eq!(on_disk.claims.keys().collect::<Vec<_>>(), ["u-other"]);
    assert!(node.instances().is_empty());
}

/// Prepare one MIG claim in boot `boot-1`, stop, and leave a checkpoint of
/// zero bytes (what a write that was not fsynced can leave after a power
/// loss). Returns the node and the API server.
async fn torn_checkpoint() -> (Node, carve_apiserver::ApiServer) {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let api = api().await;
    let driver = started(&node, node.config.clone(), &api).await;
    assert_eq!(marker(&node), "boot-1\n");
    let a = put_claim(
        &api,
        "c-a",
        "u-a",
        &[("r", "gpu-0-mig-1g10gb-4")],
        serde_json::json!([]),
    );
    driver.prepare_one(&a).await.unwrap();
    drop(driver);
    std::fs::write(&node.config.checkpoint_path, b"").unwrap();
    (node, api)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_checkpoint_from_an_earlier_boot_is_discarded_not_rebuilt() {
    let (node, api) = torn_checkpoint().await;
    // A new boot (the simulator keeps the instance: the sweep removes it).
    std::fs::write(node.dir.path().join("boot_id"), "boot-2\n").unwrap();
    let driver = Driver::new(node.config.clone(), node.backend(), api.client())
        .await
        .unwrap();
    let report = driver.recover().await.unwrap();
    assert!(report.discarded_other_boot, "{report:?}");
    assert!(report.moved_aside.is_some(), "{report:?}");
    assert!(report.adopted.is_empty(), "{report:?}");
    assert_eq!(report.swept.len(), 1, "{report:?}");
    assert!(driver.snapshot().await.claims.is_empty());
    assert_eq!(marker(&node), "boot-2\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unusable_checkpoint_of_the_current_boot_is_rebuilt() {
    let (node, api) = torn_checkpoint().await;
    let driver = Driver::new(node.config.clone(), node.backend(), api.client())
        .await
        .unwrap();
    let report = driver.recover().await.unwrap();
    assert!(!report.discarded_other_boot, "{report:?}");
    assert!(report.moved_aside.is_some(), "{report:?}");
    assert_eq!(report.adopted, ["u-a"], "{report:?}");
    assert!(report.swept.is_empty(), "{report:?}");
    assert_eq!(marker(&node), "boot-1\n");
}

/// An API server that never answers the rebuild's claim list: recovery fails
/// within the API timeout with an error naming the list, and destroys
/// nothing; the unusable checkpoint stays where the next start finds it, so
/// once the server answers the claim is adopted, its instance intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_whose_api_server_hangs_fails_in_time_and_loses_nothing() {
    let (node, api) = torn_checkpoint().await;
    let mut config = node.config.clone();
    config.api_timeout = std::time::Duration::from_millis(300);
    api.inject(carve_apiserver::Fault::DelayNext {
        count: 1000,
        delay: std::time::Duration::from_secs(3600),
        writes_only: false,
        resource: None,
    });
    let driver = Driver::new(config.clone(), node.backend(), api.client())
        .await
        .unwrap();
    let e = tokio::time::timeout(std::time::Duration::from_secs(20), driver.recover())
        .await
        .expect("recovery waited past its API timeout")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("API server: list ResourceClaims: no answer within 300ms"),
        "{e}"
    );
    assert_eq!(node.instances().len(), 1, "the claim's instance was kept");
    assert!(
        node.config.checkpoint_path.exists(),
        "the unusable checkpoint stays for the next start"
    );
    drop(driver);

    api.clear_faults();
    let driver = Driver::new(config, node.backend(), api.client())
        .await
        .unwrap();
    let report = driver.recover().await.unwrap();
    assert!(report.moved_aside.is_some(), "{report:?}");
    assert_eq!(report.adopted, ["u-a"], "{report:?}");
    assert!(report.swept.is_empty(), "{report:?}");
    assert_eq!(node.instances().len(), 1);
}
