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

/// The plugin's flags for a node whose driver root is `root` and whose NVML
/// is looked up by name (the default `--nvml-lib`).
fn driver_root_args(dir: &std::path::Path, root: &std::path::Path) -> Vec<String> {
    let reg = dir.join("registry");
    std::fs::create_dir_all(&reg).unwrap();
    let p = |n: &str| dir.join(n).display().to_string();
    vec![
        "--node-name".into(),
        "n1".into(),
        "--registry-dir".into(),
        reg.display().to_string(),
        "--state-dir".into(),
        p("state"),
        "--cdi-dir".into(),
        p("cdi"),
        "--plugins-dir".into(),
        p("plugins"),
        "--container-driver-root".into(),
        root.display().to_string(),
        "--kube-api-url".into(),
        // Nothing listens there: the plugin stops at the API server, after NVML.
        "http://127.0.0.1:9".into(),
        "--api-timeout-seconds".into(),
        "1".into(),
    ]
}

#[test]
fn nvml_is_looked_for_under_the_driver_root_and_every_place_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("driver");
    std::fs::create_dir_all(&root).unwrap();
    let args = driver_root_args(dir.path(), &root);
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, err) = plugin(&a);
    assert_ne!(code, 0);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    for want in [
        "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        "usr/lib64/libnvidia-ml.so.1",
        "the dynamic loader",
        "driverRoot",
    ] {
        assert!(err.contains(want), "{want:?} not in: {err}");
    }
    assert!(err.contains(&root.display().to_string()), "{err}");
}

#[test]
fn nvml_from_the_driver_root_is_loaded() {
    // The simulator placed where a driver installs libnvidia-ml.so.1: the
    // plugin gets past NVML (to the API server, which does not answer).
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("driver");
    let lib_dir = root.join("usr/lib64");
    std::fs::create_dir_all(&lib_dir).unwrap();
    let sim = std::path::Path::new(env!("CARGO_BIN_EXE_carve"))
        .parent()
        .unwrap()
        .join("deps/libnvidia_ml_sim.so");
    assert!(
        sim.is_file(),
        "{} (built with the workspace)",
        sim.display()
    );
    std::fs::copy(&sim, lib_dir.join("libnvidia-ml.so.1")).unwrap();
    let cfg = dir.path().join("sim.json");
    std::fs::write(
        &cfg,
        serde_json::json!({
            "nodeName": "n1",
            "gpus": [{"model": "a100-40gb"}],
            "stateFile": dir.path().join("sim-state.json"),
            "procRoot": dir.path().join("proc"),
        })
        .to_string(),
    )
    .unwrap();
    let args = driver_root_args(dir.path(), &root);
    let out = Command::new(env!("CARGO_BIN_EXE_carve"))
        .arg("kubelet-plugin")
        .args(&args)
        .args([
            "--proc-driver-nvidia",
            dir.path().join("proc").to_str().unwrap(),
        ])
        .env("CARVE_NVML_SIM_CONFIG", &cfg)
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("NVML from the driver root"), "{err}");
    assert!(!err.contains("opening NVML"), "{err}");
    assert!(err.contains("API server"), "{err}");
}

/// `carve --help` and `carve kubelet-plugin --help` name the variables
/// logging reads and say what they do.
#[test]
fn help_names_the_log_variables() {
    for args in [&["--help"][..], &["kubelet-plugin", "--help"]] {
        let out = Command::new(env!("CARGO_BIN_EXE_carve"))
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}");
        let help = String::from_utf8_lossy(&out.stdout);
        let line = |var: &str| {
            help.lines()
                .find(|l| l.trim_start().starts_with(&format!("{var} ")))
                .unwrap_or_else(|| panic!("`carve {args:?}` does not document {var}:\n{help}"))
                .to_string()
        };
        assert!(line("CARVE_LOG").contains("RUST_LOG"), "{help}");
        assert!(line("RUST_LOG").contains("CARVE_LOG"), "{help}");
        assert!(line("CARVE_LOG_FORMAT").contains("json"), "{help}");
        assert!(help.contains("Neither set: `warn`"), "{help}");
    }
}
