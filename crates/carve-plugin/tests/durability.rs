//! Which checkpoint writes are fsynced: only those that record (or replace a
//! file that records, or overwrite a spare that may record) a GPU whose MIG
//! mode the plugin enabled, the one state in the checkpoint that a reboot does
//! not undo. Alone in its test binary: the fsync counter is process-wide.

mod common;

use carve_plugin::{Checkpoint, Driver};
use common::*;
use nvidia_ml_sim::GpuEntry;

/// Checkpoint fsyncs done by `f`.
async fn syncs<T>(f: impl std::future::Future<Output = T>) -> (u64, T) {
    let before = Checkpoint::sync_totals().0;
    let r = f.await;
    (Checkpoint::sync_totals().0 - before, r)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_writes_are_fsynced_only_while_they_record_plugin_enabled_mig_mode() {
    for pod_uid in [None, Some("pod-1")] {
        // MIG mode already on: nothing the checkpoint records outlives a
        // reboot, no write is fsynced but recovery's.
        let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
        let mut cfg = node.config.clone();
        cfg.pod_uid = pod_uid.map(String::from);
        let api = api().await;
        let driver = Driver::new(cfg.clone(), node.backend(), api.client())
            .await
            .unwrap();
        let (n, r) = syncs(driver.recover()).await;
        r.unwrap();
        assert_eq!(n, 1, "recovery's write is durable");
        let c = put_claim(
            &api,
            "c-a",
            "u-a",
            &[("r", "gpu-0-mig-1g10gb-4")],
            serde_json::json!([]),
        );
        // The first write after recovery overwrites the spare, which holds
        // the file recovery replaced (for all this process knows, one of an
        // earlier boot that records MIG mode): durable. Then none is.
        let (n, r) = syncs(driver.prepare_one(&c)).await;
        r.unwrap();
        assert_eq!(n, 1, "{pod_uid:?}: first prepare after recovery");
        for round in 0..2 {
            if round > 0 {
                let (n, r) = syncs(driver.prepare_one(&c)).await;
                r.unwrap();
                assert_eq!(n, 0, "{pod_uid:?}: prepare with MIG mode already on");
            }
            let (n, r) = syncs(driver.unprepare_one("u-a")).await;
            r.unwrap();
            assert_eq!(n, 0, "{pod_uid:?}: unprepare with MIG mode already on");
        }
        let cp = Checkpoint::load(&cfg.checkpoint_path).unwrap().unwrap();
        assert!(cp.body.claims.is_empty() && cp.body.mig_enabled_by_plugin.is_empty());
        drop(driver);

        // MIG mode off: the plugin turns it on for the claim, and every write
        // that records that is durable, up to and including the one that
        // records it turned off again.
        let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, false)]);
        let mut cfg = node.config.clone();
        cfg.pod_uid = pod_uid.map(String::from);
        let driver = started(&node, cfg.clone(), &api).await;
        let c = put_claim(
            &api,
            "c-b",
            "u-b",
            &[("r", "gpu-0-mig-1g10gb-4")],
            serde_json::json!([]),
        );
        let (n, r) = syncs(driver.prepare_one(&c)).await;
        r.unwrap();
        // PrepareStarted (records MIG mode enabled), PrepareCompleted.
        assert_eq!(n, 2, "{pod_uid:?}: prepare that enables MIG mode");
        let cp = Checkpoint::load(&cfg.checkpoint_path).unwrap().unwrap();
        assert_eq!(cp.body.mig_enabled_by_plugin.len(), 1);
        let (n, r) = syncs(driver.unprepare_one("u-b")).await;
        r.unwrap();
        // UnprepareStarted, claim removed, MIG mode off again (that last
        // write replaces a file that records MIG mode enabled).
        assert_eq!(n, 3, "{pod_uid:?}: unprepare that disables MIG mode");
        let cp = Checkpoint::load(&cfg.checkpoint_path).unwrap().unwrap();
        assert!(cp.body.claims.is_empty() && cp.body.mig_enabled_by_plugin.is_empty());
        assert!(!node.backend().mig_mode(0).unwrap().current);
        // The next write overwrites the spare, which still records MIG mode
        // enabled: durable. From there on nothing records it: no fsync.
        let c = put_claim(&api, "c-c", "u-c", &[("r", "gpu-0")], serde_json::json!([]));
        let (n, r) = syncs(driver.prepare_one(&c)).await;
        r.unwrap();
        assert_eq!(n, 1, "{pod_uid:?}: whole-GPU prepare");
        let (n, r) = syncs(driver.unprepare_one("u-c")).await;
        r.unwrap();
        assert_eq!(n, 0, "{pod_uid:?}: whole-GPU unprepare");
    }
}
