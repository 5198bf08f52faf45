//! With a pod UID (as the Helm chart runs the plugin) every operation takes
//! the cross-process checkpoint lock. Many claims at once on a runtime with a
//! small blocking pool (as `carve kubelet-plugin` builds it) must all finish:
//! claims waiting for the lock must not use up the threads the holder needs.

mod common;

use common::*;
use nvidia_ml_sim::GpuEntry;

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
        let claims: Vec<_> = (0..24)
            .map(|i| {
                let dev = format!("gpu-{}-mig-1g10gb-{}", i % 8, 4 + i / 8);
                put_claim(
                    &api,
                    &format!("c{i}"),
                    &format!("u-{i}"),
                    &[("r", dev.as_str())],
                    serde_json::json!([]),
                )
            })
            .collect();
        let out = tokio::time::timeout(std::time::Duration::from_secs(120), driver.prepare(claims))
            .await
            .expect("24 concurrent prepares with the host lock did not finish: deadlock");
        for (c, r) in &out {
            r.as_ref().unwrap_or_else(|e| panic!("{c}: {e}"));
        }
        assert_eq!(node.backend().gpu_instances(0).unwrap().len(), 3);
    });
}
