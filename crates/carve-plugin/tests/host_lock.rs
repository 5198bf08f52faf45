//! With a pod UID (as the Helm chart runs the plugin) every operation takes
//! the cross-process checkpoint lock. Many claims at once on a runtime with a
//! small blocking pool (as `carve kubelet-plugin` builds it) must all finish:
//! claims waiting for the lock must not use up the threads the holder needs.

mod common;

use carve_apiserver::ApiServer;
use carve_plugin::ClaimRef;
use common::*;
use nvidia_ml_sim::GpuEntry;

/// `n` claims `c<i>`/`u-<i>` of one 1g.10gb each, spread over 8 GPUs, on
/// placements from `first_start` up.
fn small_claims(api: &ApiServer, n: u32, first_start: u32) -> Vec<ClaimRef> {
    (0..n)
        .map(|i| {
            let dev = format!("gpu-{}-mig-1g10gb-{}", i % 8, first_start + i / 8);
            put_claim(
                api,
                &format!("c{i}"),
                &format!("u-{i}"),
                &[("r", dev.as_str())],
                serde_json::json!([]),
            )
        })
        .collect()
}

#[test]
fn many_concurrent_claims_with_the_host_lock_finish_on_a_small_blocking_pool() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(4)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let node = Node::new(vec![GpuEntry::new("h100-80gb", 8, false)]);
        let mut cfg = node.config.clone();
        cfg.pod_uid = Some("pod-1".into());
        let api = api().await;
        let driver = carve_plugin::Driver::new(cfg, node.backend(), api.client())
            .await
            .unwrap();
        driver.recover().await.unwrap();
        let claims = small_claims(&api, 24, 4);
        let out = tokio::time::timeout(std::time::Duration::from_secs(120), driver.prepare(claims))
            .await
            .expect("24 concurrent prepares with the host lock did not finish: deadlock");
        for (c, r) in &out {
            r.as_ref().unwrap_or_else(|e| panic!("{c}: {e}"));
        }
        assert_eq!(node.backend().gpu_instances(0).unwrap().len(), 3);
    });
}

/// The lock held by another process (here: another open file description,
/// which `flock` treats the same): a prepare waits for it without creating
/// anything, then goes on once it is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepare_waits_while_another_plugin_holds_the_host_lock() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let mut cfg = node.config.clone();
    cfg.pod_uid = Some("pod-1".into());
    let mut lock_path = cfg.checkpoint_path.clone().into_os_string();
    lock_path.push(".lock");
    let api = api().await;
    let driver = std::sync::Arc::new(
        carve_plugin::Driver::new(cfg, node.backend(), api.client())
            .await
            .unwrap(),
    );
    driver.recover().await.unwrap();
    let held = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .unwrap();
    held.lock().unwrap();
    let c = put_device_claim(&api, "c", "u-1", "gpu-0-mig-1g10gb-0");
    let d = driver.clone();
    let c2 = c.clone();
    let prep = tokio::spawn(async move { d.prepare_one(&c2).await });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        !prep.is_finished(),
        "prepare went on while the lock was held"
    );
    assert!(node.backend().gpu_instances(0).unwrap().is_empty());
    drop(held);
    let r = tokio::time::timeout(std::time::Duration::from_secs(30), prep)
        .await
        .expect("prepare did not go on after the lock was released")
        .unwrap();
    r.unwrap_or_else(|e| panic!("{c}: {e}"));
    assert_eq!(node.backend().gpu_instances(0).unwrap().len(), 1);
}

/// A burst of prepares on different GPUs (no pod UID: no host lock, they run
/// in parallel) opens about `API_CONCURRENCY` connections to the API server,
/// not one per claim: the kube client keeps every connection it opened idle
/// in its pool. About: a request's permit is released when its response is
/// read, and its connection goes back to the pool a moment later (once the
/// connection task has seen the response end), so the next request may find
/// none idle and open one more (5 seen under a loaded test run). Without the
/// limit the burst opens one per claim (32).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_prepares_keeps_few_api_connections() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 8, true)]);
    let api = api().await;
    let driver = started(&node, node.config.clone(), &api).await;
    let before = api.connections();
    let claims = small_claims(&api, 32, 0);
    for (c, r) in &driver.prepare(claims.clone()).await {
        r.as_ref().unwrap_or_else(|e| panic!("{c}: {e}"));
    }
    for c in &claims {
        driver.unprepare_one(&c.uid).await.unwrap();
    }
    let opened = api.connections() - before;
    assert!(
        opened <= 2 * carve_plugin::API_CONCURRENCY as u64,
        "{opened} connections for 32 claims"
    );
}

/// The host lock's directory is made when the lock file cannot be opened
/// (not on every operation): removed behind the plugin's back, it is made
/// again, and the claim that follows is prepared and recorded there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_checkpoint_directory_is_made_again() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let mut cfg = node.config.clone();
    cfg.pod_uid = Some("pod-1".into());
    let dir = cfg.checkpoint_path.parent().unwrap().to_path_buf();
    let api = api().await;
    let driver = started(&node, cfg.clone(), &api).await;
    let a = put_device_claim(&api, "a", "u-a", "gpu-0-mig-1g10gb-0");
    driver.prepare_one(&a).await.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let b = put_device_claim(&api, "b", "u-b", "gpu-0-mig-1g10gb-1");
    driver
        .prepare_one(&b)
        .await
        .unwrap_or_else(|e| panic!("{b}: {e}"));
    let mut lock = cfg.checkpoint_path.clone().into_os_string();
    lock.push(".lock");
    assert!(std::path::Path::new(&lock).is_file());
    // The in-memory state was kept: both claims are in the new checkpoint.
    let text = std::fs::read_to_string(&cfg.checkpoint_path).unwrap();
    assert!(
        text.contains("\"u-a\"") && text.contains("\"u-b\""),
        "{text}"
    );
    assert_eq!(node.backend().gpu_instances(0).unwrap().len(), 2);
}
