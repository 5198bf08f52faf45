//! Which device an MPS claim gets, run as a user runs the binary (issue 28):
//! a plain MPS claim (class `mps.gpu.carve.dev`, as the README, the
//! `mps-share` example and `carve advise` write it) gets a whole GPU's MPS
//! share and never a MIG partition, which would switch the GPU into MIG mode;
//! MIG-backed MPS is asked for through `mig-mps.gpu.carve.dev`.

use std::path::{Path, PathBuf};
use std::process::Command;

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn carve(args: &[&str], tmp: &Path) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_carve"))
        .args(args)
        .env("TMPDIR", tmp)
        .env_remove("CARVE_NVML_SIM_CONFIG")
        .env_remove("CARVE_NVML_SIM_FAULTS")
        .env_remove("FAKE_MPS_REJECT")
        .env_remove("FAKE_MPS_CRASH_ON")
        .env_remove("FAKE_MPS_MAX_PROTOCOL")
        .output()
        .expect("running the carve binary");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// The first ```yaml block of README.md after the line `intro`.
fn readme_yaml(intro: &str) -> String {
    let readme = std::fs::read_to_string(repo("README.md")).unwrap();
    let rest = &readme[readme
        .find(intro)
        .unwrap_or_else(|| panic!("README.md has no {intro:?}"))..];
    let body = &rest[rest.find("```yaml\n").expect("a yaml block") + "```yaml\n".len()..];
    body[..body.find("```").expect("the block's end")].to_string()
}

/// A ResourceClaim `name` around a README snippet of `requests:`, which the
/// README indents for a ResourceClaimTemplate (six spaces).
fn claim_of_snippet(name: &str, snippet: &str) -> String {
    let requests: String = snippet
        .lines()
        .map(|l| format!("{}\n", l.strip_prefix("  ").unwrap_or(l)))
        .collect();
    assert!(requests.starts_with("    requests:\n"), "{requests}");
    format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  devices:\n{requests}"
    )
}

const WHOLE_GPU_SNIPPET: &str = "An MPS share of 10 GiB and 33 SMs of a whole GPU:";
const MIG_SNIPPET: &str = "An MPS share of a MIG partition (here 8 GiB and";

/// Whether `device` is a whole GPU's MPS device, `gpu-<i>-mps`.
fn whole_gpu_mps(device: &str) -> bool {
    device
        .strip_prefix("gpu-")
        .and_then(|d| d.strip_suffix("-mps"))
        .is_some_and(|i| !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()))
}

/// The devices `carve explain` allocated, from its `request NAME -> DEVICE
/// (pool ...)` lines.
fn explained_devices(out: &str) -> Vec<String> {
    out.lines()
        .filter_map(|l| l.trim_start().strip_prefix("request "))
        .filter_map(|l| l.split_once(" -> "))
        .map(|(_, d)| d.split_whitespace().next().unwrap().to_string())
        .collect()
}

/// The slices of a node of `gpus` with every sharing kind on, as
/// `carve slices` prints them (what the plugin with `--sharing
/// mps,mig-mps,timeslice` publishes), written to `dir/state.yaml`.
fn sharing_node(dir: &Path, gpus: &str) -> PathBuf {
    let r = carve(
        &[
            "slices",
            "--gpus",
            gpus,
            "--sharing",
            "mps,mig-mps,timeslice",
            // Every share beside the MIG devices: a scheduler that counts
            // shares.
            "--kube-version",
            "1.36",
            "--scheduler-version",
            "1.36.2",
        ],
        dir,
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.contains("-mig-1g10gb-") && r.stdout.contains("-mps"),
        "the node publishes MIG-MPS and MPS devices: {}",
        r.stdout
    );
    write(dir, "state.yaml", &r.stdout)
}

fn explain_on(claim: &Path, state: &Path, tmp: &Path) -> Vec<String> {
    let r = carve(
        &[
            "explain",
            claim.to_str().unwrap(),
            "--slices",
            state.to_str().unwrap(),
        ],
        tmp,
    );
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("fits on node"), "{}", r.stdout);
    explained_devices(&r.stdout)
}

#[test]
fn the_readmes_mps_snippets_get_the_device_kind_they_say_in_explain() {
    let dir = tempfile::tempdir().unwrap();
    let state = sharing_node(dir.path(), "h100-80gb:2");
    let plain = write(
        dir.path(),
        "plain.yaml",
        &claim_of_snippet("plain", &readme_yaml(WHOLE_GPU_SNIPPET)),
    );
    let got = explain_on(&plain, &state, dir.path());
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(whole_gpu_mps(&got[0]), "a whole GPU's MPS device: {got:?}");

    let mig = write(
        dir.path(),
        "mig.yaml",
        &claim_of_snippet("mig", &readme_yaml(MIG_SNIPPET)),
    );
    let got = explain_on(&mig, &state, dir.path());
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(
        got[0].starts_with("gpu-") && got[0].contains("-mig-2g20gb-") && got[0].ends_with("-mps"),
        "a 2g.20gb MIG-MPS device: {got:?}"
    );
}

#[test]
fn the_mps_share_example_gets_a_whole_gpu_share_in_explain() {
    let dir = tempfile::tempdir().unwrap();
    let state = sharing_node(dir.path(), "h100-80gb:2");
    let got = explain_on(&repo("examples/mps-share/pod.yaml"), &state, dir.path());
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(whole_gpu_mps(&got[0]), "{got:?}");
}

#[test]
fn every_mps_template_advise_prints_gets_a_whole_gpu_share() {
    let dir = tempfile::tempdir().unwrap();
    // No isolation needed and sizes MIG fits poorly: MPS.
    let advice = carve(
        &[
            "advise",
            "--contention",
            "no",
            "--fault-isolation",
            "no",
            "--sizes",
            "0.3,0.3,0.6",
        ],
        dir.path(),
    );
    assert_eq!(advice.code, 0, "{}", advice.stderr);
    assert!(
        advice.stdout.contains("recommendation: MPS shares"),
        "{}",
        advice.stdout
    );
    let yaml = advice
        .stdout
        .split_once("# use (one ResourceClaimTemplate per size class):\n")
        .map(|(_, y)| y)
        .unwrap_or_else(|| panic!("no template in:\n{}", advice.stdout));
    let state = sharing_node(dir.path(), "h100-80gb:1");
    let templates: Vec<&str> = yaml.split("---\n").collect();
    assert_eq!(templates.len(), 2, "one per size class: {yaml}");
    for (i, t) in templates.iter().enumerate() {
        assert!(t.contains("deviceClassName: mps.gpu.carve.dev"), "{t}");
        let p = write(dir.path(), &format!("t{i}.yaml"), t);
        let got = explain_on(&p, &state, dir.path());
        assert_eq!(got.len(), 1, "{t}: {got:?}");
        assert!(whole_gpu_mps(&got[0]), "{t}: {got:?}");
    }
}

/// The output block of one claim in `carve simulate`: its `- default/NAME (`
/// line and the indented lines under it.
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

/// The device of a claim's `request gpu -> DEVICE: ...` line in `carve simulate`.
fn simulated_device(out: &str, name: &str) -> String {
    let b = block(out, name);
    b.iter()
        .find_map(|l| l.trim_start().strip_prefix("request gpu -> "))
        .and_then(|l| l.split(':').next())
        .unwrap_or_else(|| panic!("{name}: no device: {b:#?}\n{out}"))
        .to_string()
}

#[test]
fn the_readmes_mps_snippets_run_through_simulate() {
    let tmp = tempfile::tempdir().unwrap();
    let claims = tempfile::tempdir().unwrap();
    write(
        claims.path(),
        "a-plain.yaml",
        &claim_of_snippet("readme-mps", &readme_yaml(WHOLE_GPU_SNIPPET)),
    );
    write(
        claims.path(),
        "b-mig.yaml",
        &claim_of_snippet("readme-mig-mps", &readme_yaml(MIG_SNIPPET)),
    );
    // The default node (2×H100, 3×A100) and sharing kinds.
    let r = carve(
        &["simulate", "--claims", claims.path().to_str().unwrap()],
        tmp.path(),
    );
    assert_eq!(r.code, 0, "stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    let out = &r.stdout;

    let plain = simulated_device(out, "readme-mps");
    assert!(whole_gpu_mps(&plain), "{plain}\n{out}");
    let b = block(out, "readme-mps").join("\n");
    assert!(
        !b.contains("GPU instance") && !b.contains("MIG-"),
        "no MIG instance for a plain MPS claim: {b}"
    );
    assert!(
        out.contains("= readme-mps (whole GPU shared through MPS)"),
        "{out}"
    );

    let mig = simulated_device(out, "readme-mig-mps");
    assert!(
        mig.contains("-mig-2g20gb-") && mig.ends_with("-mps"),
        "{mig}\n{out}"
    );
    assert!(
        block(out, "readme-mig-mps")
            .iter()
            .any(|l| l.contains("(2g.20gb at memory slice") && l.contains("GPU instance")),
        "{out}"
    );
    assert!(out.contains("no GPU instance left"), "{out}");
}
