//! `carve simulate` run as a user runs it: the built binary, which starts the
//! real `carve kubelet-plugin` child on the NVML simulator, real sockets and
//! files. Each run gets its own `TMPDIR`, so the tests can check that nothing
//! is left there and that no process of the run survives it.

use std::path::Path;
use std::process::{Command, Output};

fn carve(args: &[&str], tmp: &Path) -> Output {
    carve_with_faults(args, tmp, None)
}

/// Runs carve; `faults` (the simulator's `CARVE_NVML_SIM_FAULTS`) reach the
/// plugin child through the environment.
fn carve_with_faults(args: &[&str], tmp: &Path, faults: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_carve"));
    cmd.args(args)
        .env("TMPDIR", tmp)
        .env_remove("CARVE_NVML_SIM_CONFIG")
        .env_remove("CARVE_NVML_SIM_FAULTS");
    if let Some(f) = faults {
        cmd.env("CARVE_NVML_SIM_FAULTS", f);
    }
    cmd.output().expect("running the carve binary")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The output block of one claim: its `- default/NAME (...)` line and the
/// indented lines under it.
fn block<'a>(out: &'a str, name: &str) -> Vec<&'a str> {
    let head = format!("- default/{name} (");
    let mut lines = out.lines().skip_while(|l| !l.starts_with(&head));
    let Some(first) = lines.next() else {
        return Vec::new();
    };
    std::iter::once(first)
        .chain(lines.take_while(|l| l.starts_with("    ")))
        .collect()
}

/// Nothing left in the run's TMPDIR and no process whose command line names it.
fn assert_nothing_left(tmp: &Path) {
    let left: Vec<_> = std::fs::read_dir(tmp)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(left.is_empty(), "left in TMPDIR: {left:?}");
    let needle = tmp.to_string_lossy().into_owned();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            assert!(
                !cmd.contains(&needle),
                "process {} survived the run: {cmd}",
                e.file_name().to_string_lossy()
            );
        }
    }
}

#[test]
fn default_run_prepares_every_mig_example_and_leaves_no_instance() {
    let tmp = tempfile::tempdir().unwrap();
    let o = carve(&["simulate"], tmp.path());
    let (out, err) = text(&o);
    assert!(
        o.status.success(),
        "exit {}\nstdout:\n{out}\nstderr:\n{err}",
        o.status
    );
    assert!(out.contains("published:"), "{out}");
    assert!(
        out.contains("1g.10gb×7"),
        "H100 MIG devices published: {out}"
    );
    for name in [
        "mig-1g",
        "mig-by-memory",
        "mig-first-available",
        "mig-same-parent",
    ] {
        let b = block(&out, name);
        assert!(
            b.first()
                .is_some_and(|l| l.ends_with("allocated and prepared")),
            "{name}: {b:#?}\n{out}"
        );
        let devices: Vec<&&str> = b.iter().filter(|l| l.contains(" -> ")).collect();
        assert!(!devices.is_empty(), "{name}: no device: {b:#?}");
        for d in devices {
            assert!(
                d.contains("-mig-") && d.contains("GPU instance") && d.contains("MIG-"),
                "{name}: {d}"
            );
        }
        assert!(
            b.iter()
                .any(|l| l.trim_start().starts_with("CDI k8s.gpu.carve.dev/claim=")),
            "{name}: no CDI id: {b:#?}"
        );
    }
    let whole = block(&out, "whole-gpu");
    assert!(
        whole.iter().any(|l| l.contains("whole GPU GPU-")),
        "whole-gpu: {whole:#?}\n{out}"
    );
    for name in ["mps-share", "mps-hard-limit", "timeslice"] {
        let b = block(&out, name);
        assert!(
            b.first()
                .is_some_and(|l| l.contains("skipped: no published device matches class")),
            "{name}: {b:#?}\n{out}"
        );
    }
    // The picture: every GPU, with the claims' letters.
    for g in ["gpu-0 (", "gpu-1 (", "gpu-2 ("] {
        assert!(out.contains(g), "{g} missing from the picture:\n{out}");
    }
    assert!(out.contains("memory slices used"), "{out}");
    assert!(out.contains(" = mig-same-parent 3g.40gb at slice"), "{out}");
    assert!(
        out.contains("released 5 claim(s): unprepared and deleted"),
        "{out}"
    );
    assert!(
        out.contains("no GPU instance left: 0 GPU instances on 3 GPU(s)"),
        "{out}"
    );
    assert_nothing_left(tmp.path());
}

#[test]
fn mig_examples_on_an_l4_are_reported_and_the_whole_gpu_is_prepared() {
    // Exit 0: claims that find no device are a result, not a failure.
    let tmp = tempfile::tempdir().unwrap();
    let o = carve(&["simulate", "--gpus", "l4:1"], tmp.path());
    let (out, err) = text(&o);
    assert!(
        o.status.success(),
        "exit {}\nstdout:\n{out}\nstderr:\n{err}",
        o.status
    );
    for name in [
        "mig-1g",
        "mig-by-memory",
        "mig-first-available",
        "mig-same-parent",
    ] {
        let b = block(&out, name);
        assert!(
            b.first().is_some_and(
                |l| l.ends_with("skipped: no published device matches class mig.gpu.carve.dev")
            ),
            "{name}: {b:#?}\n{out}"
        );
    }
    assert!(
        block(&out, "whole-gpu")
            .first()
            .is_some_and(|l| l.ends_with("allocated and prepared")),
        "{out}"
    );
    assert!(
        out.contains("not MIG-capable, whole GPU: whole-gpu"),
        "{out}"
    );
    assert!(out.contains("no GPU instance left"), "{out}");
    assert_nothing_left(tmp.path());
}

#[test]
fn claims_that_do_not_fit_now_are_explained() {
    // Two 4g.40gb claims on one H100: the second does not fit next to the first.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let claim = |name: &str| {
        format!(
            "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: {name}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n        deviceClassName: mig.gpu.carve.dev\n        selectors:\n        - cel:\n            expression: device.attributes[\"gpu.carve.dev\"].profile == \"4g.40gb\"\n"
        )
    };
    std::fs::write(dir.path().join("a.yaml"), claim("first")).unwrap();
    std::fs::write(dir.path().join("b.yaml"), claim("second")).unwrap();
    let svg = dir.path().join("gpus.svg");
    let o = carve(
        &[
            "simulate",
            "--gpus",
            "h100:1",
            "--claims",
            dir.path().to_str().unwrap(),
            "--svg",
            svg.to_str().unwrap(),
            "--kube-version",
            "1.34",
        ],
        tmp.path(),
    );
    let (out, err) = text(&o);
    assert!(
        o.status.success(),
        "exit {}\nstdout:\n{out}\nstderr:\n{err}",
        o.status
    );
    assert!(
        block(&out, "first")
            .first()
            .is_some_and(|l| l.ends_with("allocated and prepared")),
        "{out}"
    );
    let second = block(&out, "second");
    assert!(
        second
            .first()
            .is_some_and(|l| l.ends_with("does not fit on sim-node now:")),
        "{second:#?}\n{out}"
    );
    assert!(second.len() > 1, "no explanation: {second:#?}");
    let svg_text = std::fs::read_to_string(&svg).unwrap();
    assert!(
        svg_text.starts_with("<svg") && svg_text.contains("first 4g.40gb"),
        "{svg_text}"
    );
    assert!(out.contains("no GPU instance left"), "{out}");
    assert_nothing_left(tmp.path());
}

#[test]
fn keep_keeps_the_directory_with_the_plugin_log() {
    let tmp = tempfile::tempdir().unwrap();
    let o = carve(&["simulate", "--gpus", "l4:1", "--keep"], tmp.path());
    let (out, err) = text(&o);
    assert!(
        o.status.success(),
        "exit {}\nstdout:\n{out}\nstderr:\n{err}",
        o.status
    );
    let kept = out
        .lines()
        .find_map(|l| l.strip_prefix("kept "))
        .unwrap_or_else(|| panic!("no kept path:\n{out}"));
    let kept = Path::new(kept);
    assert!(kept.starts_with(tmp.path()), "{}", kept.display());
    assert!(kept.join("plugin.log").is_file());
    assert!(kept.join("lib/libnvidia_ml_sim.so.json").is_file());
}

#[test]
fn a_bad_gpu_list_is_named_and_nothing_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let o = carve(&["simulate", "--gpus", "v100:2"], tmp.path());
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "stdout:\n{out}\nstderr:\n{err}");
    assert!(err.contains("--gpus") && err.contains("v100"), "{err}");
    assert!(err.contains("h100-80gb"), "known models listed: {err}");
    assert!(out.is_empty(), "{out}");
    assert_nothing_left(tmp.path());
}

#[test]
fn a_malformed_claim_is_named_with_its_field() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("bad.yaml"),
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: bad\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n        deviceClassName: [1]\n",
    )
    .unwrap();
    let o = carve(
        &["simulate", "--claims", dir.path().to_str().unwrap()],
        tmp.path(),
    );
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("bad.yaml") && err.contains("deviceClassName"),
        "{err}"
    );
    assert_nothing_left(tmp.path());
}

#[test]
fn an_unknown_device_class_stops_the_run_and_cleans_up() {
    // Found only once the plugin runs: the plugin is stopped, the temporary
    // directory removed, the error names the file and the class.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("odd.yaml"),
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: odd\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n        deviceClassName: nope.example.com\n",
    )
    .unwrap();
    let o = carve(
        &[
            "simulate",
            "--gpus",
            "l4:1",
            "--claims",
            dir.path().to_str().unwrap(),
        ],
        tmp.path(),
    );
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "stdout:\n{out}\nstderr:\n{err}");
    assert!(
        err.contains("odd.yaml") && err.contains("nope.example.com"),
        "{err}"
    );
    assert!(out.contains("no GPU instance left"), "{out}");
    assert_nothing_left(tmp.path());
}

#[test]
fn a_failed_prepare_is_reported_the_run_goes_on_and_exits_1() {
    // NVML refuses the first GPU-instance creation (NVML_ERROR_INVALID_ARGUMENT).
    let tmp = tempfile::tempdir().unwrap();
    let faults = r#"[{"function":"nvmlDeviceCreateGpuInstanceWithPlacement","nth":1,"action":{"kind":"fail","code":2}}]"#;
    let o = carve_with_faults(&["simulate", "--gpus", "h100:1"], tmp.path(), Some(faults));
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "stdout:\n{out}\nstderr:\n{err}");
    let first = block(&out, "mig-1g");
    assert!(
        first
            .first()
            .is_some_and(|l| l.contains("FAILED: NodePrepareResources")
                && l.contains("nvmlDeviceCreateGpuInstanceWithPlacement")),
        "{first:#?}\n{out}"
    );
    assert!(
        block(&out, "mig-same-parent")
            .first()
            .is_some_and(|l| l.ends_with("allocated and prepared")),
        "{out}"
    );
    assert!(
        err.contains("1 claim(s) failed") && err.contains("mig-1g"),
        "{err}"
    );
    assert!(out.contains("no GPU instance left"), "{out}");
    assert_nothing_left(tmp.path());
}
