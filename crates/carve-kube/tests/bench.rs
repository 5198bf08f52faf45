//! `carve bench slices` figures, run small: the counts are checked, the times
//! only printed.

#![cfg(feature = "bench")]

use carve_kube::bench::{SliceBenchOptions, run};

#[tokio::test]
async fn bench_counts_writes_and_prints_targets() {
    let figures = run(SliceBenchOptions {
        iterations: 3,
        ..SliceBenchOptions::default()
    })
    .await
    .unwrap();
    assert!(figures.slices >= 2, "{figures}");
    assert!(figures.devices >= 8, "{figures}");
    assert_eq!(figures.first_publish_writes, figures.slices as u64);
    assert_eq!(figures.restart_writes, 0);
    assert_eq!(figures.restart_requests, 1);
    assert!(figures.total.p50 <= figures.total.p99 && figures.total.p99 <= figures.total.max);
    let text = figures.to_string();
    assert!(text.contains("8x h200-141gb"), "{text}");
    assert!(text.contains("target p99 <= 1.000 ms"), "{text}");
    assert!(text.contains("unchanged restart: 0 API writes"), "{text}");
    println!("{text}");
}

#[tokio::test]
async fn unknown_model_is_named() {
    let e = run(SliceBenchOptions {
        model: "z900".into(),
        iterations: 1,
        ..SliceBenchOptions::default()
    })
    .await
    .unwrap_err();
    assert!(e.to_string().contains("z900"), "{e}");
}
