//! `carve explain --scheduler-version`: what an older kube-scheduler's
//! allocator does differently from carve's, said beside the answer, as a
//! user runs the command.

use std::path::Path;
use std::process::Command;

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn carve(args: &[&str]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_carve"))
        .args(args)
        .output()
        .unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A claim allocated on `node-a` holding `device` of class `class`.
fn allocated(name: &str, class: &str, device: &str) -> String {
    format!(
        "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly: {{deviceClassName: {class}}}\nstatus:\n  allocation:\n    devices:\n      results:\n      - {{request: gpu, driver: gpu.carve.dev, pool: node-a, device: {device}}}\n    nodeSelector:\n      nodeSelectorTerms:\n      - matchFields:\n        - {{key: metadata.name, operator: In, values: [node-a]}}\n"
    )
}

fn mig_1g() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/mig-1g/claim.yaml")
        .to_string_lossy()
        .into_owned()
}

const SHARED_NOTE: &str = "does not count the counters of shared devices already allocated";

#[test]
fn an_unfixed_scheduler_is_said_to_place_over_a_running_share() {
    let dir = tempfile::tempdir().unwrap();
    let slices = carve(&[
        "slices",
        "--gpus",
        "h100-80gb:2",
        "--node",
        "node-a",
        "--sharing",
        "mps",
    ]);
    assert_eq!(slices.code, 0, "{}", slices.stderr);
    let state = dir.path().join("state.yaml");
    std::fs::write(
        &state,
        format!(
            "{}{}",
            slices.stdout,
            allocated("share", "mps.gpu.carve.dev", "gpu-0-mps")
        ),
    )
    .unwrap();
    let state = state.to_str().unwrap();
    let claim = mig_1g();
    for v in ["1.34", "1.35", "1.35.6", "1.36", "1.36.1"] {
        let r = carve(&[
            "explain",
            &claim,
            "--slices",
            state,
            "--scheduler-version",
            v,
        ]);
        assert_eq!(r.code, 0, "{v}: {}{}", r.stdout, r.stderr);
        // carve's allocator counts the share: the partition goes to GPU 1.
        assert!(
            r.stdout.contains("-> gpu-1-mig-1g10gb-"),
            "{v}: {}",
            r.stdout
        );
        assert!(
            r.stdout
                .contains(&format!("note: kube-scheduler {v} {SHARED_NOTE}"))
                && r.stdout.contains("(gpu-0-mps on this node)")
                && r.stdout.contains("fixed in 1.36.2"),
            "{v}: {}",
            r.stdout
        );
    }
    for v in ["1.36.2", "1.37"] {
        let r = carve(&[
            "explain",
            &claim,
            "--slices",
            state,
            "--scheduler-version",
            v,
        ]);
        assert_eq!(r.code, 0, "{v}: {}", r.stderr);
        assert!(!r.stdout.contains("note:"), "{v}: {}", r.stdout);
    }
    // JSON carries the notes too.
    let r = carve(&[
        "explain",
        &claim,
        "--slices",
        state,
        "--scheduler-version",
        "1.35",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    let notes = v["schedulerNotes"].as_array().unwrap();
    assert!(
        notes.len() == 1 && notes[0].as_str().unwrap().contains(SHARED_NOTE),
        "{notes:?}"
    );
    // No share allocated: nothing to say.
    let empty = carve(&[
        "explain",
        &claim,
        "--simulate-gpus",
        "h100-80gb:1",
        "--scheduler-version",
        "1.35",
    ]);
    assert_eq!(empty.code, 0, "{}", empty.stderr);
    assert!(!empty.stdout.contains("note:"), "{}", empty.stdout);
}

const DISTINCT: &str = "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: apart, namespace: default}\nspec:\n  devices:\n    requests:\n    - name: a\n      exactly: {deviceClassName: mig.gpu.carve.dev}\n    - name: b\n      exactly: {deviceClassName: mig.gpu.carve.dev}\n    constraints:\n    - requests: [a, b]\n      distinctAttribute: gpu.carve.dev/parentUUID\n";

#[test]
fn a_1_34_scheduler_is_said_to_ignore_distinct_attribute() {
    let dir = tempfile::tempdir().unwrap();
    let claim = dir.path().join("apart.yaml");
    std::fs::write(&claim, DISTINCT).unwrap();
    let claim = claim.to_str().unwrap();
    let r = carve(&[
        "explain",
        claim,
        "--simulate-gpus",
        "h100-80gb:2",
        "--scheduler-version",
        "1.34",
    ]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stdout.contains(
            "note: kube-scheduler 1.34 does not enforce distinctAttribute (gpu.carve.dev/parentUUID)"
        ),
        "{}",
        r.stdout
    );
    let r = carve(&[
        "explain",
        claim,
        "--simulate-gpus",
        "h100-80gb:2",
        "--scheduler-version",
        "1.35",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(!r.stdout.contains("distinctAttribute"), "{}", r.stdout);
}

#[test]
fn a_scheduler_version_carve_does_not_model_is_a_usage_error() {
    for v in ["2.0", "1.33", "1.38.1", "1.36.x", "1", "1.36.1.2"] {
        let r = carve(&["explain", &mig_1g(), "--scheduler-version", v]);
        assert_eq!(r.code, 2, "{v}: {}", r.stderr);
        assert!(
            r.stderr.contains("--scheduler-version") && r.stderr.contains("1.34, 1.35, 1.36, 1.37"),
            "{v}: {}",
            r.stderr
        );
    }
}
