//! The driver's metrics: a real `Driver` over the NVML simulator library and
//! the API-server stand-in, with a `carve_metrics::Metrics` registry in its
//! config, scraped through `Metrics::encode()`.

mod common;

use std::sync::Arc;

use carve_metrics::Metrics;
use carve_plugin::Driver;
use common::*;
use nvidia_ml_sim::GpuEntry;

/// The value of one exposition line `<series> <value>`; panics naming the
/// series when it is absent.
fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.split_whitespace().next())
        .unwrap_or_else(|| panic!("series {series} not in:\n{text}"))
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_and_unprepare_are_recorded() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let api = api().await;
    let metrics = Arc::new(Metrics::new());
    let mut config = node.config.clone();
    config.metrics = Some(metrics.clone());
    let backend = node.backend();
    let uuid = backend.gpus().unwrap()[0].uuid.clone();
    let driver = Driver::new(config, backend, api.client()).await.unwrap();
    driver.recover().await.unwrap();
    let after_recover = metrics.encode();
    let writes0 = value(&after_recover, "carve_checkpoint_writes_total");
    assert!(writes0 >= 1.0, "recovery stores the checkpoint");
    assert_eq!(
        value(
            &after_recover,
            &format!("carve_gpu_instances{{gpu=\"{uuid}\"}}")
        ),
        0.0
    );

    let good = put_claim(
        &api,
        "good",
        "u-good",
        &[("r", "gpu-0-mig-1g10gb-6")],
        serde_json::json!([]),
    );
    let bad = put_claim(
        &api,
        "bad",
        "u-bad",
        &[("r", "gpu-0-mig-1g10gb-9")],
        serde_json::json!([]),
    );
    let missing = carve_plugin::ClaimRef {
        namespace: "default".into(),
        name: "missing".into(),
        uid: "u-missing".into(),
    };
    let out = driver
        .prepare(vec![good.clone(), bad.clone(), missing.clone()])
        .await;
    assert!(out[0].1.is_ok(), "{:?}", out[0].1);
    assert!(out[1].1.is_err() && out[2].1.is_err());

    let m = metrics.encode();
    assert_eq!(
        value(&m, "carve_prepare_duration_seconds_count{result=\"ok\"}"),
        1.0
    );
    assert_eq!(
        value(&m, "carve_prepare_duration_seconds_count{result=\"error\"}"),
        2.0
    );
    assert_eq!(
        value(&m, "carve_prepare_errors_total{reason=\"invalid_claim\"}"),
        1.0
    );
    assert_eq!(
        value(&m, "carve_prepare_errors_total{reason=\"claim_not_found\"}"),
        1.0
    );
    assert_eq!(
        value(&m, "carve_prepare_errors_total{reason=\"nvml\"}"),
        0.0
    );
    // MIG mode is already on, so nothing outlives the claim: only
    // PrepareCompleted is written (a crash before it leaves an instance no
    // completed claim owns, which recovery sweeps).
    assert_eq!(value(&m, "carve_checkpoint_writes_total"), writes0 + 1.0);
    assert_eq!(
        value(&m, &format!("carve_gpu_instances{{gpu=\"{uuid}\"}}")),
        1.0
    );
    assert_eq!(
        value(&m, &format!("carve_compute_instances{{gpu=\"{uuid}\"}}")),
        1.0
    );
    // 1g.10gb at slice 6 leaves slice 7 usable by no placement.
    assert_eq!(
        value(
            &m,
            &format!("carve_stranded_memory_slices{{gpu=\"{uuid}\"}}")
        ),
        1.0
    );
    for f in [
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        "nvmlGpuInstanceCreateComputeInstance",
        "nvmlDeviceGetGpuInstances",
    ] {
        assert!(
            value(
                &m,
                &format!("carve_nvml_call_duration_seconds_count{{function=\"{f}\"}}")
            ) >= 1.0,
            "{f}"
        );
    }

    let out = driver.unprepare(vec![good]).await;
    assert!(out[0].1.is_ok(), "{:?}", out[0].1);
    let m = metrics.encode();
    assert_eq!(
        value(&m, "carve_unprepare_duration_seconds_count{result=\"ok\"}"),
        1.0
    );
    assert_eq!(
        value(&m, &format!("carve_gpu_instances{{gpu=\"{uuid}\"}}")),
        0.0
    );
    assert_eq!(
        value(
            &m,
            &format!("carve_stranded_memory_slices{{gpu=\"{uuid}\"}}")
        ),
        0.0
    );
    assert!(
        value(
            &m,
            "carve_nvml_call_duration_seconds_count{function=\"nvmlGpuInstanceDestroy\"}"
        ) >= 1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_metrics_nothing_is_recorded_and_prepare_works() {
    let node = Node::new(vec![GpuEntry::new("a30-24gb", 1, true)]);
    let api = api().await;
    assert!(node.config.metrics.is_none());
    let driver = Driver::new(node.config.clone(), node.backend(), api.client())
        .await
        .unwrap();
    driver.recover().await.unwrap();
    let c = put_claim(
        &api,
        "c",
        "u-c",
        &[("r", "gpu-0-mig-1g6gb-0")],
        serde_json::json!([]),
    );
    let out = driver.prepare(vec![c]).await;
    assert!(out[0].1.is_ok(), "{:?}", out[0].1);
}
