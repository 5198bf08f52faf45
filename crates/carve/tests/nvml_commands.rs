//! The commands that read the node's GPUs through the real NVML backend, here
//! loaded on the NVML simulator library, run as the built binary:
//! `carve slices --from-nvml` prints what the kubelet plugin would publish, and
//! `carve nvml-events` prints the health events the plugin would act on. Neither
//! changes anything on the GPUs.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead as _, BufReader, Read as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use carve_gpu::{EventKind, GpuEvent};
use k8s_openapi::api::resource::v1::ResourceSlice;
use nvidia_ml_sim::{GpuEntry, SimConfig, SimEvent, inject_event};

/// The simulator library built next to the `carve` binary.
fn sim_lib() -> PathBuf {
    let exe = Path::new(env!("CARGO_BIN_EXE_carve"));
    let dir = exe.parent().unwrap();
    [
        dir.join("libnvidia_ml_sim.so"),
        dir.join("deps/libnvidia_ml_sim.so"),
    ]
    .into_iter()
    .find(|p| p.is_file())
    .expect("libnvidia_ml_sim.so is built with the carve binary")
}

/// `carve <sub>` with the simulator configured by `config` (none: unconfigured).
fn command(sub: &str, config: Option<&Path>) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_carve"));
    cmd.arg(sub)
        .env_remove("CARVE_NVML_SIM_CONFIG")
        .env_remove("CARVE_NVML_SIM_FAULTS")
        .env_remove("CARVE_NVML_LIB");
    if let Some(c) = config {
        cmd.env("CARVE_NVML_SIM_CONFIG", c);
    }
    cmd
}

fn carve(args: &[&str], config: Option<&Path>) -> Output {
    command("slices", config)
        .args(args)
        .output()
        .expect("running the carve binary")
}

/// A simulated node of `gpus` in `dir`, adjusted by `edit`; its configuration
/// and the configuration file's path.
fn sim_node(
    dir: &Path,
    gpus: Vec<GpuEntry>,
    edit: impl FnOnce(&mut SimConfig),
) -> (SimConfig, PathBuf) {
    let mut cfg = SimConfig::new("node-a", gpus, dir);
    edit(&mut cfg);
    let path = dir.join("sim.json");
    cfg.to_file(&path).unwrap();
    (cfg, path)
}

fn slices(o: &Output) -> Vec<ResourceSlice> {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).expect("carve slices -o json prints a list of slices")
}

/// Device name → its JSON, over every slice.
fn devices(s: &[ResourceSlice]) -> BTreeMap<String, serde_json::Value> {
    s.iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .map(|d| (d.name.clone(), serde_json::to_value(d).unwrap()))
        .collect()
}

/// Counter set name → its JSON.
fn counter_sets(s: &[ResourceSlice]) -> BTreeMap<String, serde_json::Value> {
    s.iter()
        .flat_map(|s| s.spec.shared_counters.iter().flatten())
        .map(|c| (c.name.clone(), serde_json::to_value(c).unwrap()))
        .collect()
}

/// A node of two H100s with MIG mode off and one A100 with MIG mode on.
fn node(dir: &Path) -> PathBuf {
    let gpus = vec![
        GpuEntry::new("h100-80gb", 2, false),
        GpuEntry::new("a100-40gb", 1, true),
    ];
    sim_node(dir, gpus, |_| {}).1
}

#[test]
fn a_dynamic_node_publishes_what_the_plugin_would() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = node(dir.path());
    let lib = sim_lib();
    let lib = lib.to_str().unwrap();
    let read = slices(&carve(
        &[
            "--from-nvml",
            "--nvml-lib",
            lib,
            "--node",
            "node-a",
            "-o",
            "json",
        ],
        Some(&cfg),
    ));
    let sim = slices(&carve(
        // The plugin's default: no shared devices (a simulated node's
        // default publishes simulate's).
        &[
            "--gpus",
            "h100-80gb:2",
            "--sharing",
            "none",
            "--node",
            "node-a",
            "-o",
            "json",
        ],
        None,
    ));
    let (read_dev, sim_dev) = (devices(&read), devices(&sim));

    // The H100s (MIG mode off, enabled by the plugin on demand) publish the same
    // devices, counters and consumption as the simulated node; only what NVML
    // reports about the hardware (UUIDs, PCI addresses, driver version) differs.
    let hw = [
        "uuid",
        "resource.kubernetes.io/pciBusID",
        "resource.kubernetes.io/pcieRoot",
        "driverVersion",
        "parentUUID",
    ];
    let strip = |mut d: serde_json::Value| {
        if let Some(a) = d.get_mut("attributes").and_then(|a| a.as_object_mut()) {
            for k in hw {
                a.remove(k);
            }
        }
        d
    };
    for (name, d) in &sim_dev {
        let got = read_dev
            .get(name)
            .unwrap_or_else(|| panic!("{name} is missing from --from-nvml"));
        assert_eq!(strip(got.clone()), strip(d.clone()), "{name}");
    }
    for set in ["gpu-0-counters", "gpu-1-counters"] {
        assert_eq!(
            counter_sets(&read).get(set),
            counter_sets(&sim).get(set),
            "{set}"
        );
    }

    // The A100 is in MIG mode: every placement, and no whole GPU, which an
    // Ampere GPU in MIG mode could not run work on.
    let gpu2: BTreeSet<&str> = read_dev
        .keys()
        .filter(|n| n.starts_with("gpu-2"))
        .map(String::as_str)
        .collect();
    assert!(gpu2.contains("gpu-2-mig-1g5gb-6"), "{gpu2:?}");
    assert!(gpu2.contains("gpu-2-mig-7g40gb-0"), "{gpu2:?}");
    assert!(!gpu2.contains("gpu-2"), "{gpu2:?}");
    let uuid = read_dev["gpu-2-mig-7g40gb-0"]["attributes"]["parentUUID"]["string"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(uuid.starts_with("GPU-"), "{uuid}");
}

#[test]
fn reading_changes_nothing_on_the_gpus() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = node(dir.path());
    let lib = sim_lib();
    let lib = lib.to_str().unwrap();
    let state = SimConfig::from_file(&cfg).unwrap().state_file;
    let before = std::fs::read(&state).ok();
    for policy in ["dynamic", "static"] {
        let read = slices(&carve(
            &[
                "--from-nvml",
                "--nvml-lib",
                lib,
                "--mig-policy",
                policy,
                "-o",
                "json",
            ],
            Some(&cfg),
        ));
        assert!(!devices(&read).is_empty(), "{policy}");
    }
    assert_eq!(
        std::fs::read(&state).ok(),
        before,
        "the simulator's GPU state (MIG modes, instances) is unchanged"
    );
}

#[test]
fn a_static_gpu_publishes_only_its_existing_instances() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = node(dir.path());
    let lib = sim_lib();
    let read = slices(&carve(
        &[
            "--from-nvml",
            "--nvml-lib",
            lib.to_str().unwrap(),
            "--mig-policy",
            "dynamic,2=static",
            "-o",
            "json",
        ],
        Some(&cfg),
    ));
    // GPU 2 has no instances yet: nothing of it is published as MIG devices.
    let names = devices(&read);
    assert!(
        !names.keys().any(|n| n.starts_with("gpu-2-mig")),
        "{:?}",
        names.keys().collect::<Vec<_>>()
    );
    assert!(names.contains_key("gpu-0-mig-1g10gb-0"));
}

#[test]
fn a_missing_library_is_named_in_one_line() {
    let o = carve(
        &[
            "--from-nvml",
            "--nvml-lib",
            "/nonexistent/libnvidia-ml.so.1",
        ],
        None,
    );
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("/nonexistent/libnvidia-ml.so.1"), "{err}");
    assert!(o.stdout.is_empty(), "nothing half-printed");
}

#[test]
fn nvml_flags_need_from_nvml() {
    let o = carve(&["--mig-policy", "static"], None);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--from-nvml"));
    let o = carve(&["--from-nvml", "--gpus", "h100-80gb:1"], None);
    assert!(!o.status.success());
}

/// Runs `carve nvml-events` for `seconds` on a two-H100 node; `edit` adjusts the
/// simulator, `during` runs once the command says it is watching. Returns the
/// events printed and stderr.
fn watch(
    seconds: u32,
    edit: impl FnOnce(&mut SimConfig),
    during: impl FnOnce(&SimConfig),
) -> (Vec<GpuEvent>, String) {
    let dir = tempfile::tempdir().unwrap();
    let gpus = vec![GpuEntry::new("h100-80gb", 2, false)];
    let (cfg, path) = sim_node(dir.path(), gpus, edit);
    let lib = sim_lib();
    let mut child = command("nvml-events", Some(&path))
        .args(["--seconds", &seconds.to_string(), "--nvml-lib"])
        .arg(&lib)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    // Log lines may come first (an unwatched GPU is logged as well).
    let mut first = String::new();
    while !first.contains("carve nvml-events: watching") {
        assert!(err.read_line(&mut first).unwrap() > 0, "{first}");
    }
    during(&cfg);
    let mut rest = String::new();
    err.read_to_string(&mut rest).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{first}{rest}");
    let events = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    (events, first + &rest)
}

#[test]
fn events_while_watching_are_printed_as_json_lines() {
    let (events, err) = watch(
        2,
        |_| {},
        |cfg| {
            inject_event(cfg, &SimEvent::xid(1, 79)).unwrap();
            inject_event(cfg, &SimEvent::dbe(0)).unwrap();
        },
    );
    let got: Vec<(u32, EventKind)> = events.into_iter().map(|e| (e.gpu, e.kind)).collect();
    assert_eq!(
        got,
        vec![(1, EventKind::Xid(79)), (0, EventKind::DoubleBitEcc)],
        "{err}"
    );
    assert!(err.contains("watching 2 of 2 GPUs"), "{err}");
    assert!(err.trim_end().ends_with("2 events"), "{err}");
}

#[test]
fn a_gpu_that_cannot_be_watched_is_reported_once() {
    let (events, err) = watch(1, |c| c.events_unsupported = vec![1], |_| {});
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].gpu, 1);
    assert!(
        matches!(events[0].kind, EventKind::Unmonitored { .. }),
        "{events:?}"
    );
    assert!(err.contains("watching 1 of 2 GPUs"), "{err}");
}
