//! The offline commands (`explain`, `defrag`, `advise`, `simulate`'s flags) run as a
//! user runs them: what they see on stdout and stderr, and the exit status.

use std::path::Path;
use std::process::Command;

mod common;
use common::{Run, carve, write};

/// `carve explain CLAIM --gpus GPUS`.
fn explain(claim: &str, gpus: &str) -> Run {
    carve(&["explain", claim, "--gpus", gpus])
}

fn example(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples")
        .join(name)
        .join("pod.yaml")
        .to_string_lossy()
        .into_owned()
}

const MIG_CLAIM: &str = "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: c, namespace: default}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n        deviceClassName: mig.gpu.carve.dev\n        SELECTORS:\n        - cel: {expression: 'device.attributes[\"gpu.carve.dev\"].profile == \"7g.80gb\"'}\n";

#[test]
fn a_typo_in_a_claim_is_an_error_naming_the_field_not_a_fit() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        dir.path(),
        "typo.yaml",
        &MIG_CLAIM.replace("SELECTORS", "selector"),
    );
    let r = explain(p.to_str().unwrap(), "a100-40gb:1");
    assert_ne!(r.code, 0, "{}", r.stdout);
    assert!(r.stdout.is_empty(), "{}", r.stdout);
    assert!(
        r.stderr
            .contains("unknown field \"spec.devices.requests.0.exactly.selector\""),
        "{}",
        r.stderr
    );
    // Spelled right, the selector applies: no 7g.80gb on an A100-40GB.
    let ok = write(
        dir.path(),
        "ok.yaml",
        &MIG_CLAIM.replace("SELECTORS", "selectors"),
    );
    let r = explain(ok.to_str().unwrap(), "a100-40gb:1");
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("does not fit"), "{}", r.stdout);
}

#[test]
fn rejections_are_one_line_per_reason_and_devices_only_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        dir.path(),
        "c.yaml",
        &MIG_CLAIM
            .replace("SELECTORS", "selectors")
            .replace("7g.80gb", "9g.999gb"),
    );
    let path = p.to_str().unwrap();
    // No shared devices: the MIG and whole-GPU rejections only.
    let grouped = carve(&["explain", path, "--gpus", "h200:8", "--sharing", "none"]);
    assert_eq!(grouped.code, 1, "{}", grouped.stderr);
    let reason_lines: Vec<&str> = grouped
        .stdout
        .lines()
        .filter(|l| l.contains("device(s):"))
        .collect();
    // The MIG placements the selector rejects, and the whole GPUs the class
    // rejects: two lines for 208 devices, each with its count per GPU.
    assert_eq!(reason_lines.len(), 2, "{}", grouped.stdout);
    assert!(
        reason_lines[0].contains("200 device(s): request selector #0 is false")
            && reason_lines[0].contains("gpu-0 25, ")
            && reason_lines[0].contains("gpu-7 25]"),
        "{}",
        grouped.stdout
    );
    assert!(
        reason_lines[1].contains("8 device(s): class mig.gpu.carve.dev selector #0 is false"),
        "{}",
        grouped.stdout
    );
    assert!(grouped.stdout.lines().count() < 10, "{}", grouped.stdout);

    let listed = carve(&[
        "explain",
        path,
        "--gpus",
        "h200:8",
        "--sharing",
        "none",
        "--devices",
    ]);
    assert_eq!(listed.code, 1);
    let device_lines = listed
        .stdout
        .lines()
        .filter(|l| l.contains(": request selector #0 is false"))
        .count();
    assert!(device_lines > 100, "{}", listed.stdout);
}

#[test]
fn json_is_printed_when_the_claim_fits_too() {
    let r = carve(&[
        "explain",
        &example("mig-1g"),
        "--gpus",
        "h100-80gb:1",
        "--json",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).expect(&r.stdout);
    assert_eq!(v["fits"], true);
    assert!(
        v["results"][0]["device"]
            .as_str()
            .unwrap()
            .starts_with("gpu-0-mig-1g10gb-"),
        "{v}"
    );
}

#[test]
fn a_bad_simulated_node_names_the_flag_the_user_gave() {
    let r = carve(&["explain", &example("mig-1g"), "--gpus", "h999:1"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("invalid value 'h999:1' for '--gpus <GPUS>'"),
        "{}",
        r.stderr
    );
}

#[test]
fn the_template_that_advise_prints_can_be_explained() {
    let advice = carve(&[
        "advise",
        "--contention",
        "no",
        "--fault-isolation",
        "yes",
        "--sizes",
        "0.1",
    ]);
    assert_eq!(advice.code, 0, "{}", advice.stderr);
    let yaml = advice
        .stdout
        .split_once("# use (one ResourceClaimTemplate per size class):\n")
        .map(|(_, y)| y)
        .unwrap_or_else(|| panic!("no template in:\n{}", advice.stdout));
    assert!(yaml.contains("kind: ResourceClaimTemplate"), "{yaml}");
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "t.yaml", yaml);
    let r = explain(p.to_str().unwrap(), "h100-80gb:1");
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("fits on node"), "{}", r.stdout);
}

#[test]
fn defrag_of_a_claim_that_already_fits_says_so_and_succeeds() {
    // The state: an empty simulated node, as `carve slices` prints it.
    let dir = tempfile::tempdir().unwrap();
    let slices = carve(&["slices", "--gpus", "h100-80gb:1"]);
    assert_eq!(slices.code, 0, "{}", slices.stderr);
    let state = write(dir.path(), "state.yaml", &slices.stdout);
    let r = carve(&[
        "defrag",
        "--state",
        state.to_str().unwrap(),
        "--request",
        &example("mig-1g"),
    ]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stdout.contains("already fits") && r.stdout.contains("nothing to do"),
        "{}",
        r.stdout
    );
    let r = carve(&[
        "defrag",
        "--state",
        state.to_str().unwrap(),
        "--request",
        &example("mig-1g"),
        "--json",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).expect(&r.stdout);
    assert_eq!(v["alreadyFits"], true, "{v}");
}

#[test]
fn simulate_refuses_none_beside_other_sharing_kinds() {
    let r = carve(&["simulate", "--sharing", "none,mps"]);
    assert_ne!(r.code, 0, "{}", r.stdout);
    assert!(
        r.stderr
            .contains("--sharing none cannot be combined with other kinds (got none,mps)"),
        "{}",
        r.stderr
    );
}

#[test]
fn slices_of_a_simulated_ampere_gpu_follow_the_plugins_mig_mode_rules() {
    // MIG mode off (a new node): the plugin publishes only the whole A100,
    // since turning MIG on needs a GPU reset; carve slices must agree.
    let off = carve(&[
        "slices",
        "--gpus",
        "a100-40gb:1",
        "--sharing",
        "none",
        "-o",
        "table",
    ]);
    assert_eq!(off.code, 0, "{}", off.stderr);
    assert!(off.stdout.contains("devices:  gpu×1\n"), "{}", off.stdout);
    assert!(!off.stdout.contains("1g.5gb"), "{}", off.stdout);
    // MIG mode on: placements only, no whole GPU.
    let on = carve(&[
        "slices",
        "--gpus",
        "a100-40gb:1",
        "--ampere-mig-mode",
        "on",
        "--sharing",
        "none",
        "-o",
        "table",
    ]);
    assert_eq!(on.code, 0, "{}", on.stderr);
    assert!(on.stdout.contains("1g.5gb×7"), "{}", on.stdout);
    assert!(!on.stdout.contains("gpu×1"), "{}", on.stdout);
    // Hopper switches MIG mode on demand: both.
    let h = carve(&["slices", "--gpus", "h100-80gb:1", "-o", "table"]);
    assert!(
        h.stdout.contains("1g.10gb×") && h.stdout.contains("gpu×1"),
        "{}",
        h.stdout
    );
}

#[test]
fn apiserver_on_port_zero_prints_the_port_it_serves() {
    use std::io::{BufRead as _, BufReader};
    let mut child = Command::new(env!("CARGO_BIN_EXE_carve"))
        .args(["apiserver", "--addr", "127.0.0.1:0"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stderr.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .rsplit_once("http://")
        .map(|(_, a)| a.to_string())
        .unwrap_or_else(|| panic!("{line}"));
    let port: u16 = addr.rsplit_once(':').unwrap().1.parse().unwrap();
    assert_ne!(port, 0, "{line}");
    // It serves there.
    let served = std::net::TcpStream::connect(&addr).is_ok();
    let _ = child.kill();
    let _ = child.wait();
    assert!(served, "nothing listens on {addr}");
}

/// An allocated claim holding `device` (a MIG placement) of pool `node-a`.
fn allocated(name: &str, device: &str) -> String {
    allocated_of_class(name, "mig.gpu.carve.dev", device)
}

#[test]
fn explain_says_when_the_unfixed_scheduler_would_refuse_a_claim_that_fits() {
    // gpu-0 holds a 4g and a 2g: room for mig-same-parent's 1g, not its 3g.
    let dir = tempfile::tempdir().unwrap();
    let slices = carve(&["slices", "--gpus", "h100-80gb:2", "--node", "node-a"]);
    assert_eq!(slices.code, 0, "{}", slices.stderr);
    let state = format!(
        "{}{}{}",
        slices.stdout,
        allocated("four", "gpu-0-mig-4g40gb-0"),
        allocated("two", "gpu-0-mig-2g20gb-4")
    );
    let state = write(dir.path(), "state.yaml", &state);
    let r = carve(&[
        "explain",
        &example("mig-same-parent"),
        "--slices",
        state.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("-> gpu-1-mig-3g40gb-0"), "{}", r.stdout);
    assert!(
        r.stdout.contains("kube-scheduler 1.36.2 and earlier")
            && r.stdout.contains("kubernetes/kubernetes#140436"),
        "{}",
        r.stdout
    );
    // A scheduler with the fix (1.36.3, 1.37) refuses nothing: no note.
    for fixed in ["1.36.3", "1.37"] {
        let r = carve(&[
            "explain",
            &example("mig-same-parent"),
            "--slices",
            state.to_str().unwrap(),
            "--scheduler-version",
            fixed,
        ]);
        assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
        assert!(!r.stdout.contains("#140436"), "{fixed}: {}", r.stdout);
    }
    // On the empty node nothing is rejected on the constraint: no note.
    let empty = explain(&example("mig-same-parent"), "h100-80gb:2");
    assert_eq!(empty.code, 0, "{}", empty.stderr);
    assert!(!empty.stdout.contains("#140436"), "{}", empty.stdout);
}

#[test]
fn slices_publish_sharing_devices_as_the_plugin_would() {
    // For a scheduler that counts shares: every share beside the GPU's
    // exclusive devices.
    let counted = ["--kube-version", "1.37", "--scheduler-version", "1.37.2"];
    let r = carve(
        &[
            &[
                "slices",
                "--gpus",
                "h100-80gb:1",
                "--sharing",
                "mps,timeslice",
                "-o",
                "json",
            ][..],
            &counted,
        ]
        .concat(),
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let slices: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    let devices: Vec<&serde_json::Value> = slices
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().into_iter().flatten())
        .collect();
    let mps = devices
        .iter()
        .find(|d| d["name"] == "gpu-0-mps")
        .unwrap_or_else(|| panic!("no gpu-0-mps in {}", r.stdout));
    let attrs = &mps["attributes"];
    // No MPS device enforces memory hard (issue 18); v3's compute ceiling.
    assert_eq!(attrs["mpsMemoryLimit"]["string"], "client", "{mps}");
    assert_eq!(attrs["mpsComputeLimit"]["string"], "percentage", "{mps}");
    assert!(devices.iter().any(|d| d["name"] == "gpu-0-ts"));
    // With --sharing none: neither; without --sharing: both, as `carve
    // simulate` publishes them by default.
    let plain = carve(&[
        "slices",
        "--gpus",
        "h100-80gb:1",
        "--sharing",
        "none",
        "-o",
        "json",
    ]);
    assert!(!plain.stdout.contains("gpu-0-mps") && !plain.stdout.contains("gpu-0-ts"));
    let default = carve(
        &[
            &["slices", "--gpus", "h100-80gb:1", "-o", "json"][..],
            &counted,
        ]
        .concat(),
    );
    assert!(default.stdout.contains("gpu-0-mps") && default.stdout.contains("gpu-0-ts"));
    // For the scheduler a 1.37 API server may have (1.36.0): no share
    // without --shared-gpus, and a note on stderr saying why.
    let apart = carve(&[
        "slices",
        "--gpus",
        "h100-80gb:1",
        "--kube-version",
        "1.37",
        "-o",
        "json",
    ]);
    assert_eq!(apart.code, 0, "{}", apart.stderr);
    assert!(
        !apart.stdout.contains("-mps\"") && !apart.stdout.contains("-ts\""),
        "{}",
        apart.stdout
    );
    assert!(
        apart.stderr.contains("kube-scheduler may be 1.36.0")
            && apart.stderr.contains("--shared-gpus"),
        "{}",
        apart.stderr
    );
    let listed = carve(&[
        "slices",
        "--gpus",
        "h100-80gb:2",
        "--kube-version",
        "1.37",
        "--shared-gpus",
        "1=timeslice",
        "-o",
        "json",
    ]);
    assert_eq!(listed.code, 0, "{}", listed.stderr);
    assert!(
        listed.stdout.contains("\"gpu-1-ts\"") && !listed.stdout.contains("\"gpu-1\""),
        "{}",
        listed.stdout
    );
    assert!(listed.stdout.contains("\"gpu-0\"") && !listed.stdout.contains("gpu-0-mps"));
    let bad = carve(&["slices", "--gpus", "h100-80gb:2", "--shared-gpus", "2=mps"]);
    assert_eq!(bad.code, 1, "{}", bad.stderr);
    assert!(
        bad.stderr.contains("no GPU 2 (its GPUs: 0, 1)"),
        "{}",
        bad.stderr
    );
    let bad = carve(&["slices", "--shared-gpus", "0=mig-mps"]);
    assert_eq!(bad.code, 2, "{}", bad.stderr);
    assert!(bad.stderr.contains("mig-mps:PROFILE"), "{}", bad.stderr);
}

/// The error line carve prints (stderr's `carve: ...` line).
fn error_line(r: &Run) -> &str {
    r.stderr
        .lines()
        .find(|l| l.starts_with("carve: "))
        .unwrap_or_else(|| panic!("no error line:\n{}", r.stderr))
}

/// How often `part` occurs in `line`.
fn times(line: &str, part: &str) -> usize {
    line.matches(part).count()
}

#[test]
fn a_missing_file_is_named_with_the_os_error_once() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.yaml");
    let missing = missing.to_str().unwrap();
    let claim = example("mig-1g");
    for args in [
        vec!["explain", missing],
        vec!["explain", claim.as_str(), "--slices", missing],
        vec!["defrag", "--state", missing, "--request", claim.as_str()],
        vec!["advise", "--trace", missing],
    ] {
        let r = carve(&args);
        assert_eq!(r.code, 1, "{args:?}: {}", r.stderr);
        let line = error_line(&r);
        assert_eq!(times(line, missing), 1, "{args:?}: {line}");
        assert_eq!(
            times(line, "No such file or directory (os error 2)"),
            1,
            "{args:?}: {line}"
        );
    }
}

#[test]
fn an_address_that_cannot_be_bound_is_said_once() {
    // 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never an address of this host.
    let r = carve(&["apiserver", "--addr", "192.0.2.1:1"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    let line = error_line(&r);
    assert!(
        line.starts_with("carve: cannot listen on 192.0.2.1:1: "),
        "{line}"
    );
    assert_eq!(times(line, "Cannot assign requested address"), 1, "{line}");
}

#[test]
fn a_missing_nvml_library_is_named_once() {
    let dir = tempfile::tempdir().unwrap();
    let lib = dir.path().join("libnvidia-ml.so.1");
    let lib = lib.to_str().unwrap();
    let r = carve(&["nvml-probe", "--nvml-lib", lib]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    let line = error_line(&r);
    assert!(line.contains("NVML unavailable"), "{line}");
    assert_eq!(times(line, lib), 1, "{line}");
}

#[test]
fn an_unknown_model_or_version_is_named_once() {
    let r = carve(&["bench", "slices", "--model", "v100", "--iterations", "1"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    let line = error_line(&r);
    assert!(
        line.starts_with("carve: --model: unknown GPU model"),
        "{line}"
    );
    assert_eq!(times(line, "v100"), 1, "{line}");
    // A version carve does not model is a usage error of the flag (clap's
    // `error:` line), the value named once.
    let r = carve(&["simulate", "--kube-version", "1.20"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    let line = usage_error_line(&r);
    assert!(line.contains("'--kube-version <KUBE_VERSION>'"), "{line}");
    assert_eq!(times(line, "1.20"), 1, "{line}");
}

/// The `error:` line clap prints for a bad flag value.
fn usage_error_line(r: &Run) -> &str {
    r.stderr
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no usage error line:\n{}", r.stderr))
}

/// `carve ARGS`, killed after `secs` seconds (`None` then): for commands
/// that, given the input the test gives them, ran until killed before.
fn carve_within(args: &[&str], secs: u64) -> Option<Run> {
    let dir = tempfile::tempdir().unwrap();
    let (out, err) = (dir.path().join("out"), dir.path().join("err"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_carve"))
        .args(args)
        .env("TMPDIR", dir.path())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    Some(Run {
        code: status.code().unwrap_or(-1),
        stdout: std::fs::read_to_string(&out).unwrap(),
        stderr: std::fs::read_to_string(&err).unwrap(),
    })
}

#[test]
fn every_kube_version_flag_refuses_a_version_carve_does_not_model() {
    // Before, `2.0` was taken as a layout after 1.35 and `apiserver` served it.
    let claim = example("mig-1g");
    for args in [
        vec!["simulate", "--kube-version", "2.0"],
        vec!["slices", "--kube-version", "2.0"],
        vec![
            "bench",
            "slices",
            "--iterations",
            "1",
            "--kube-version",
            "2.0",
        ],
        vec![
            "apiserver",
            "--addr",
            "127.0.0.1:0",
            "--kube-version",
            "2.0",
        ],
        vec!["slices", "--kube-version", "1.38"],
        vec!["slices", "--kube-version", "1.33"],
        vec!["explain", &claim, "--kube-version", "2.0"],
    ] {
        let r = carve_within(&args, 60).unwrap_or_else(|| panic!("{args:?} ran past 60 s"));
        assert_eq!(r.code, 2, "{args:?}: {}", r.stderr);
        assert!(r.stdout.is_empty(), "{args:?}: {}", r.stdout);
        let line = usage_error_line(&r);
        assert!(line.contains("'--kube-version <KUBE_VERSION>'"), "{line}");
        assert!(
            line.ends_with("carve models Kubernetes 1.34, 1.35, 1.36, 1.37 only"),
            "{line}"
        );
    }
    // The modelled ones still work.
    for v in ["1.34", "1.35", "1.36", "1.37"] {
        let r = carve(&[
            "slices",
            "--gpus",
            "l4:1",
            "--kube-version",
            v,
            "-o",
            "json",
        ]);
        assert_eq!(r.code, 0, "{v}: {}", r.stderr);
    }
    let r = carve(&["explain", &claim, "--gpus", "h100:1"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    // explain's simulated node takes a modelled version too.
    let r = carve(&["explain", &claim, "--kube-version", "1.34", "--json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

#[test]
fn every_gpus_flag_refuses_more_gpus_than_a_node_may_have() {
    // Before, `simulate --gpus h100:100000` ran until killed and `slices`
    // printed slices for them. Just past the limit here, so that a binary
    // without the limit finishes (and fails the test) instead of taking the
    // machine's memory.
    let claim = example("mig-1g");
    for (args, flag, total) in [
        (
            vec!["simulate", "--gpus", "h100:40,a100:25"],
            "--gpus <GPUS>",
            "65",
        ),
        (
            vec!["slices", "--gpus", "h100:60,l4:5"],
            "--gpus <GPUS>",
            "65",
        ),
        (
            vec!["explain", claim.as_str(), "--gpus", "h100:65"],
            "--gpus <GPUS>",
            "65",
        ),
    ] {
        let r = carve_within(&args, 60).unwrap_or_else(|| panic!("{args:?} ran past 60 s"));
        assert_eq!(r.code, 2, "{args:?}: {}", r.stderr);
        assert!(r.stdout.is_empty(), "{args:?}: {}", r.stdout);
        let line = usage_error_line(&r);
        assert!(line.contains(&format!("'{flag}'")), "{line}");
        assert!(
            line.contains(&format!(
                "{total} GPUs on one node, more than the 64 a simulated node may have"
            )),
            "{line}"
        );
    }
    for args in [
        vec!["bench", "slices", "--iterations", "1", "--gpus", "65"],
        vec!["bench", "prepare", "--iterations", "1", "--gpus", "65"],
    ] {
        let r = carve_within(&args, 60).unwrap_or_else(|| panic!("{args:?} ran past 60 s"));
        assert_eq!(r.code, 2, "{args:?}: {}", r.stderr);
        let line = usage_error_line(&r);
        assert!(
            line.contains("'--gpus <GPUS>'") && line.contains("1 to 64"),
            "{line}"
        );
    }
    // 64 is allowed.
    let r = carve(&["slices", "--gpus", "l4:64", "-o", "table"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

#[test]
fn a_bad_claim_given_to_simulate_is_named_once_with_its_file() {
    let dir = tempfile::tempdir().unwrap();
    let claims = dir.path().join("claims");
    std::fs::create_dir(&claims).unwrap();
    let big = write(
        &claims,
        "big.yaml",
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: big}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n        deviceClassName: mig.gpu.carve.dev\n        count: 99\n",
    );
    let out = Command::new(env!("CARGO_BIN_EXE_carve"))
        .args(["simulate", "--gpus", "h100:1", "--claims"])
        .arg(&claims)
        .env("TMPDIR", dir.path())
        .output()
        .unwrap();
    let r = Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let line = error_line(&r);
    assert_eq!(
        line,
        format!(
            "carve: {}: claim default/big: spec.devices.requests[0].count: 99 is not between 1 and 32",
            big.display()
        )
    );
}

/// The documents of `yaml` as PyYAML (a YAML 1.1 reader) reads them, as JSON.
fn pyyaml_as_json(yaml: &str) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "out.yaml", yaml);
    let out = Command::new("python3")
        .args([
            "-c",
            "import json, sys, yaml\nprint(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))",
        ])
        .arg(&p)
        .output()
        .expect("python3 (with PyYAML) runs");
    assert!(
        out.status.success(),
        "python3 with PyYAML is needed here (pip install pyyaml): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Where `got` and `want` first differ, as `path: got != want`.
fn first_difference(
    got: &serde_json::Value,
    want: &serde_json::Value,
    path: &str,
) -> Option<String> {
    use serde_json::Value;
    match (got, want) {
        (Value::Object(g), Value::Object(w)) if g.len() == w.len() => {
            w.iter().find_map(|(k, wv)| match g.get(k) {
                Some(gv) => first_difference(gv, wv, &format!("{path}.{k}")),
                None => Some(format!("{path}.{k}: missing")),
            })
        }
        (Value::Array(g), Value::Array(w)) if g.len() == w.len() => g
            .iter()
            .zip(w)
            .enumerate()
            .find_map(|(i, (gv, wv))| first_difference(gv, wv, &format!("{path}[{i}]"))),
        _ if got == want => None,
        _ => Some(format!("{path}: {got} != {want}")),
    }
}

#[test]
fn slices_yaml_reads_the_same_in_a_yaml_1_1_reader_as_the_json() {
    // Before, `string: 0000:18:00.0` came out unquoted and PyYAML read the
    // PCI bus ID as the base-60 number 1080.0.
    for gpus in ["h100-80gb:2,a100-40gb:1,l4:1", "h200:8", "a30:2,b200:1"] {
        for extra in [&[][..], &["--sharing", "mps,timeslice"][..]] {
            let mut args = vec!["slices", "--gpus", gpus];
            args.extend_from_slice(extra);
            let yaml = carve(&[&args[..], &["-o", "yaml"]].concat());
            assert_eq!(yaml.code, 0, "{}", yaml.stderr);
            let json = carve(&[&args[..], &["-o", "json"]].concat());
            assert_eq!(json.code, 0, "{}", json.stderr);
            let want: serde_json::Value = serde_json::from_str(&json.stdout).unwrap();
            let got = pyyaml_as_json(&yaml.stdout);
            assert_eq!(first_difference(&got, &want, ""), None, "{args:?}");
            assert!(yaml.stdout.contains("string: '0000:"), "{}", yaml.stdout);
        }
    }
}

/// An MPS share claim asking for `memory` and `multiprocessors`.
fn share_claim(name: &str, memory: &str, sms: &str) -> String {
    format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n        deviceClassName: mps.gpu.carve.dev\n        capacity:\n          requests:\n            memory: {memory}\n            multiprocessors: \"{sms}\"\n"
    )
}

#[test]
fn a_negative_capacity_request_is_refused_naming_the_request_and_value() {
    // Before, `memory: -10Gi` was rounded up to the policy's minimum and the
    // share prepared with 1 GiB and 2 SMs.
    let dir = tempfile::tempdir().unwrap();
    for (name, memory, sms, field, value) in [
        ("neg-mem", "-10Gi", "4", "memory", "-10Gi"),
        ("neg-sms", "4Gi", "-5", "multiprocessors", "-5"),
    ] {
        let claims = dir.path().join(name);
        std::fs::create_dir(&claims).unwrap();
        let file = write(&claims, "claim.yaml", &share_claim(name, memory, sms));
        let want = format!(
            "spec.devices.requests[0].capacity.requests.{field}: negative requested quantity \"{value}\": must be 0 or more"
        );
        let r = carve(&["explain", file.to_str().unwrap(), "--gpus", "h100:1"]);
        assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
        assert!(r.stdout.is_empty(), "{}", r.stdout);
        let line = error_line(&r);
        assert!(line.contains(&want), "{line}");
        assert!(line.contains(name), "{line}");

        let r = carve(&[
            "simulate",
            "--gpus",
            "h100:1",
            "--claims",
            claims.to_str().unwrap(),
        ]);
        assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
        let all = format!("{}{}", r.stdout, r.stderr);
        assert!(all.contains(&want), "{all}");
        assert!(
            all.contains("nothing to release"),
            "nothing prepared: {all}"
        );
    }
}

#[test]
fn simulate_takes_a_claims_file_as_well_as_a_directory() {
    // Before, a file was refused with "Not a directory".
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "shares.yaml",
        &format!(
            "{}---\n{}",
            share_claim("share-a", "4Gi", "8"),
            share_claim("share-b", "2Gi", "4")
        ),
    );
    let r = carve(&[
        "simulate",
        "--gpus",
        "h100:1",
        "--shared-gpus",
        "0=mps",
        "--claims",
        file.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    for name in ["share-a", "share-b"] {
        assert!(r.stdout.contains(name), "{name}: {}", r.stdout);
    }
}

// `carve explain --scheduler-version`: what an older kube-scheduler's
// allocator does differently from carve's, said beside the answer.

/// A claim allocated on `node-a` holding `device` of class `class`.
fn allocated_of_class(name: &str, class: &str, device: &str) -> String {
    format!(
        "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly: {{deviceClassName: {class}}}\nstatus:\n  allocation:\n    devices:\n      results:\n      - {{request: gpu, driver: gpu.carve.dev, pool: node-a, device: {device}}}\n    nodeSelector:\n      nodeSelectorTerms:\n      - matchFields:\n        - {{key: metadata.name, operator: In, values: [node-a]}}\n"
    )
}

fn mig_1g() -> String {
    example("mig-1g")
}

/// `carve explain CLAIM --slices STATE --scheduler-version V [more]`.
fn explain_on(claim: &str, state: &str, v: &str, more: &[&str]) -> Run {
    let mut args = vec![
        "explain",
        claim,
        "--slices",
        state,
        "--scheduler-version",
        v,
    ];
    args.extend_from_slice(more);
    carve(&args)
}

const SHARED_NOTE: &str = "does not count the counters of shared devices already allocated";

#[test]
fn an_unfixed_scheduler_is_said_to_place_over_a_running_share() {
    let dir = tempfile::tempdir().unwrap();
    // Slices published for a scheduler that counts shares (the share beside
    // the MIG devices of its GPU), read by one that does not.
    let slices = carve(&[
        "slices",
        "--gpus",
        "h100-80gb:2",
        "--node",
        "node-a",
        "--sharing",
        "mps",
        "--kube-version",
        "1.37",
        "--scheduler-version",
        "1.37",
    ]);
    assert_eq!(slices.code, 0, "{}", slices.stderr);
    let state = dir.path().join("state.yaml");
    std::fs::write(
        &state,
        format!(
            "{}{}",
            slices.stdout,
            allocated_of_class("share", "mps.gpu.carve.dev", "gpu-0-mps")
        ),
    )
    .unwrap();
    let state = state.to_str().unwrap();
    let claim = mig_1g();
    for v in ["1.34", "1.35", "1.35.6", "1.36", "1.36.1"] {
        let r = explain_on(&claim, state, v, &[]);
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
                && r.stdout
                    .contains("(gpu-0-mps on this node, which other published devices overlap)")
                && r.stdout.contains("fixed in 1.36.2"),
            "{v}: {}",
            r.stdout
        );
    }
    for v in ["1.36.2", "1.37"] {
        let r = explain_on(&claim, state, v, &[]);
        assert_eq!(r.code, 0, "{v}: {}", r.stderr);
        assert!(!r.stdout.contains("note:"), "{v}: {}", r.stdout);
    }
    // JSON carries the notes too.
    let r = explain_on(&claim, state, "1.35", &["--json"]);
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
        "--gpus",
        "h100-80gb:1",
        "--scheduler-version",
        "1.35",
    ]);
    assert_eq!(empty.code, 0, "{}", empty.stderr);
    assert!(!empty.stdout.contains("note:"), "{}", empty.stdout);
    // Shares published apart (GPU 0 hosts only the MPS share): nothing
    // overlaps the share, so the older scheduler cannot place over it.
    let apart = carve(&[
        "slices",
        "--gpus",
        "h100-80gb:2",
        "--node",
        "node-a",
        "--sharing",
        "mps",
        "--shared-gpus",
        "0=mps",
    ]);
    assert_eq!(apart.code, 0, "{}", apart.stderr);
    let state = dir.path().join("apart.yaml");
    std::fs::write(
        &state,
        format!(
            "{}{}",
            apart.stdout,
            allocated_of_class("share", "mps.gpu.carve.dev", "gpu-0-mps")
        ),
    )
    .unwrap();
    let r = explain_on(&claim, state.to_str().unwrap(), "1.35", &[]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("-> gpu-1-mig-1g10gb-"), "{}", r.stdout);
    assert!(!r.stdout.contains("note:"), "{}", r.stdout);
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
        "--gpus",
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
        "--gpus",
        "h100-80gb:2",
        "--scheduler-version",
        "1.35",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(!r.stdout.contains("distinctAttribute"), "{}", r.stdout);
    // Without --scheduler-version, a simulated node's API server version
    // says which schedulers may run beside it: on 1.34 only 1.34.
    let r = carve(&[
        "explain",
        claim,
        "--gpus",
        "h100-80gb:2",
        "--kube-version",
        "1.34",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout
            .contains("note: kube-scheduler 1.34.0 does not enforce distinctAttribute")
            && r.stdout.contains("note: kube-scheduler 1.34.0 is assumed"),
        "{}",
        r.stdout
    );
    let r = carve(&[
        "explain",
        claim,
        "--gpus",
        "h100-80gb:2",
        "--kube-version",
        "1.36",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(!r.stdout.contains("note:"), "{}", r.stdout);
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

/// A claim for several devices meets 1.34's capacity check on the wrong
/// device, which crashes that scheduler with DRAConsumableCapacity on:
/// `explain --scheduler-version 1.34` says so; for 1.35 it does not, nor
/// for one device.
#[test]
fn explain_warns_that_a_1_34_scheduler_crashes_on_a_request_for_several_devices() {
    let dir = tempfile::tempdir().unwrap();
    let claim = |count: u32| {
        format!(
            "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: gpus\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n        deviceClassName: gpu.carve.dev\n        count: {count}\n"
        )
    };
    let two = write(dir.path(), "two.yaml", &claim(2));
    let one = write(dir.path(), "one.yaml", &claim(1));
    let run = |c: &Path, v: &str| {
        let r = carve(&[
            "explain",
            c.to_str().unwrap(),
            "--gpus",
            "h100-80gb:2",
            "--kube-version",
            "1.35",
            "--scheduler-version",
            v,
        ]);
        assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
        r.stdout
    };
    let out = run(&two, "1.34");
    assert!(
        out.contains("note: kube-scheduler 1.34 with DRAConsumableCapacity on")
            && out.contains("crashes kube-scheduler"),
        "{out}"
    );
    assert!(!run(&two, "1.35").contains("DRAConsumableCapacity"));
    assert!(!run(&one, "1.34").contains("DRAConsumableCapacity"));
}
