//! `carve kubelet-plugin` refuses bad flags and unusable paths with a one-line
//! reason and a non-zero exit, before touching anything.

use std::process::Command;

fn plugin(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_carve"))
        .arg("kubelet-plugin")
        .args(args)
        .env_remove("NODE_NAME")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn missing_registry_dir_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-registry");
    let (code, err) = plugin(&[
        "--node-name",
        "n1",
        "--registry-dir",
        missing.to_str().unwrap(),
        "--state-dir",
        dir.path().join("state").to_str().unwrap(),
    ]);
    assert_ne!(code, 0);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("--registry-dir") && err.contains("no-such-registry"),
        "{err}"
    );
    assert!(
        !dir.path().join("state").exists(),
        "nothing is created before the flags are checked"
    );
}

#[test]
fn bad_mig_policy_is_named() {
    let (code, err) = plugin(&["--node-name", "n1", "--mig-policy", "dynamic,1=sometimes"]);
    assert_ne!(code, 0);
    assert!(err.contains("sometimes"), "{err}");
}

#[test]
fn missing_nvml_library_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let reg = dir.path().join("registry");
    std::fs::create_dir(&reg).unwrap();
    let (code, err) = plugin(&[
        "--node-name",
        "n1",
        "--registry-dir",
        reg.to_str().unwrap(),
        "--state-dir",
        dir.path().join("state").to_str().unwrap(),
        "--cdi-dir",
        dir.path().join("cdi").to_str().unwrap(),
        "--plugins-dir",
        dir.path().join("plugins").to_str().unwrap(),
        "--nvml-lib",
        "/nonexistent/libnvidia-ml.so.1",
    ]);
    assert_ne!(code, 0);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("/nonexistent/libnvidia-ml.so.1"), "{err}");
}

#[test]
fn mps_flags_are_checked_before_anything_is_created() {
    let dir = tempfile::tempdir().unwrap();
    let reg = dir.path().join("registry");
    std::fs::create_dir(&reg).unwrap();
    let state = dir.path().join("state");
    let base = [
        "--node-name",
        "n1",
        "--registry-dir",
        reg.to_str().unwrap(),
        "--state-dir",
        state.to_str().unwrap(),
    ];
    let with = |extra: &[&str]| {
        let mut a: Vec<&str> = base.to_vec();
        a.extend_from_slice(extra);
        plugin(&a)
    };
    let (code, err) = with(&["--sharing", "mps"]);
    assert_ne!(code, 0);
    assert!(err.contains("--mps-control"), "{err}");
    let (code, err) = with(&["--mps-control", "/bin/true"]);
    assert_ne!(code, 0);
    assert!(err.contains("--sharing"), "{err}");
    let (code, err) = with(&[
        "--sharing",
        "mps,timeslice",
        "--mps-control",
        "/no/such/mps-control",
    ]);
    assert_ne!(code, 0);
    assert!(
        err.contains("MPS is not installed") && err.contains("/no/such/mps-control"),
        "{err}"
    );
    assert!(
        !state.exists(),
        "nothing is created before the flags are checked"
    );
}

#[test]
fn driver_paths_written_into_cdi_specs_must_be_absolute() {
    let dir = tempfile::tempdir().unwrap();
    for (flag, value) in [
        ("--nvidia-cdi-hook", "usr/bin/nvidia-cdi-hook"),
        ("--host-driver-root", "run/nvidia/driver"),
    ] {
        let (code, err) = plugin(&[
            "--node-name",
            "n1",
            "--registry-dir",
            dir.path().to_str().unwrap(),
            "--state-dir",
            dir.path().join("state").to_str().unwrap(),
            flag,
            value,
        ]);
        assert_ne!(code, 0);
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(
            err.contains(flag) && err.contains(value) && err.contains("absolute"),
            "{err}"
        );
        assert!(!dir.path().join("state").exists());
    }
}
