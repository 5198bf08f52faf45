//! Issue 28's advice items, run as a user runs the commands: one default
//! node for `simulate`, `explain` and `slices`; "would fit if" only where it
//! is true; an allocated claim shown with its allocation; the profiles a
//! node offers to a claim that finds no device; `advise` for whole GPUs;
//! a shared GPU drawn by what its shares use; what `--no-release` leaves.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{carve, write};

/// The `[default: ...]` of flag `flag` in `carve CMD --help`.
fn help_default(cmd: &str, flag: &str) -> Option<String> {
    let r = carve(&[cmd, "--help"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let at = r.stdout.find(&format!("{flag} <"))?;
    let rest = &r.stdout[at..];
    let end = rest.find("\n  -").unwrap_or(rest.len());
    let d = rest[..end].find("[default: ")?;
    let v = &rest[d + "[default: ".len()..end];
    Some(v[..v.find(']')?].to_string())
}

fn claim(name: &str, class: &str, body: &str) -> String {
    format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n        deviceClassName: {class}\n{body}"
    )
}

fn mig_claim(name: &str, profile: &str) -> String {
    claim(
        name,
        "mig.gpu.carve.dev",
        &format!(
            "        selectors:\n        - cel: {{expression: 'device.attributes[\"gpu.carve.dev\"].profile == \"{profile}\"'}}\n"
        ),
    )
}

fn mps_claim(name: &str, memory: &str) -> String {
    claim(
        name,
        "mps.gpu.carve.dev",
        &format!(
            "        capacity:\n          requests: {{memory: {memory}, multiprocessors: \"27\"}}\n"
        ),
    )
}

#[test]
fn simulate_explain_and_slices_default_to_one_node_with_its_sharing() {
    let gpus = [
        help_default("simulate", "--gpus"),
        help_default("explain", "--gpus"),
        help_default("slices", "--gpus"),
    ];
    assert!(
        gpus.iter()
            .all(|g| g.as_deref() == Some("h100-80gb:2,a100-40gb:3,h100-80gb:1")),
        "{gpus:?}"
    );
    for flag in ["--sharing", "--kube-version"] {
        let d = help_default("simulate", flag);
        assert!(d.is_some(), "{flag}");
        assert_eq!(help_default("explain", flag), d, "{flag}");
    }
    assert_eq!(
        help_default("slices", "--kube-version"),
        help_default("simulate", "--kube-version")
    );
    // An MPS share fits in explain as simulate prepares it: no flag needed.
    let dir = tempfile::tempdir().unwrap();
    let c = write(dir.path(), "c.yaml", &mps_claim("share", "10Gi"));
    let r = carve(&["explain", c.to_str().unwrap()]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("-mps"), "{}", r.stdout);
    // The node is chosen with the same flag as simulate's; explain's former
    // name for it still works and means the same node.
    let named = carve(&[
        "explain",
        c.to_str().unwrap(),
        "--gpus",
        "h200:1",
        "--shared-gpus",
        "0=mps",
    ]);
    let old = carve(&[
        "explain",
        c.to_str().unwrap(),
        "--simulate-gpus",
        "h200:1",
        "--shared-gpus",
        "0=mps",
    ]);
    assert_eq!(named.code, 0, "{}{}", named.stdout, named.stderr);
    assert_eq!((named.code, &named.stdout), (old.code, &old.stdout));
    let bad = carve(&["explain", c.to_str().unwrap(), "--simulate-gpus", "h999:1"]);
    assert_eq!(
        bad.code, 2,
        "the alias reaches --gpus's check: {}",
        bad.stderr
    );
    assert!(bad.stderr.contains("h999"), "{}", bad.stderr);
    // And slices publishes the same shared devices by default, none with
    // `--sharing none`.
    let s = carve(&["slices", "-o", "table"]);
    assert_eq!(s.code, 0, "{}", s.stderr);
    let plain = carve(&["slices", "--sharing", "none"]);
    let all = carve(&["slices"]);
    assert!(all.stdout.contains("name: gpu-3-mps"), "{}", all.stdout);
    assert!(all.stdout.contains("name: gpu-4-ts"), "{}", all.stdout);
    assert!(!all.stdout.contains("name: gpu-2-mps"), "{}", all.stdout);
    assert!(!plain.stdout.contains("-mps"), "{}", plain.stdout);
    let r = carve(&["slices", "--sharing", "none,mps"]);
    assert_ne!(r.code, 0);
    assert!(r.stderr.contains("--sharing none"), "{}", r.stderr);
}

/// A claim allocated on `sim-node` holding `device` of class `class`.
fn allocated(name: &str, class: &str, device: &str) -> String {
    format!(
        "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly: {{deviceClassName: {class}}}\nstatus:\n  allocation:\n    devices:\n      results:\n      - {{request: gpu, driver: gpu.carve.dev, pool: sim-node, device: {device}}}\n    nodeSelector:\n      nodeSelectorTerms:\n      - matchFields:\n        - {{key: metadata.name, operator: In, values: [sim-node]}}\n"
    )
}

/// Two whole GPUs that must share a `productName` on a node of one H100 and
/// one A100: impossible however free the node is.
const TWO_ALIKE: &str = "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: pair, namespace: default}\nspec:\n  devices:\n    requests:\n    - name: a\n      exactly: {deviceClassName: gpu.carve.dev}\n    - name: b\n      exactly: {deviceClassName: gpu.carve.dev}\n    constraints:\n    - matchAttribute: gpu.carve.dev/productName\n";

#[test]
fn would_fit_if_is_said_only_when_the_claim_then_fits() {
    let dir = tempfile::tempdir().unwrap();
    let slices = carve(&[
        "slices",
        "--gpus",
        "h100-80gb:1,a100-40gb:1",
        "--sharing",
        "none",
    ]);
    assert_eq!(slices.code, 0, "{}", slices.stderr);
    let state = format!(
        "{}{}",
        slices.stdout,
        allocated("holder", "gpu.carve.dev", "gpu-0")
    );
    let state = write(dir.path(), "state.yaml", &state);
    let pair = write(dir.path(), "pair.yaml", TWO_ALIKE);
    let r = carve(&[
        "explain",
        pair.to_str().unwrap(),
        "--slices",
        state.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(!r.stdout.contains("would fit if"), "{}", r.stdout);
    assert!(
        r.stdout
            .contains("does not fit on node sim-node even with every device free"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("productName"), "{}", r.stdout);
    // defrag says the same of the same state.
    let d = carve(&[
        "defrag",
        "--state",
        state.to_str().unwrap(),
        "--request",
        pair.to_str().unwrap(),
    ]);
    assert!(
        d.stderr.contains("even with every device free"),
        "{}",
        d.stderr
    );
    // A claim that fits once the holder releases is still told so.
    let one = write(
        dir.path(),
        "one.yaml",
        &claim(
            "h100",
            "gpu.carve.dev",
            "        selectors:\n        - cel: {expression: 'device.attributes[\"gpu.carve.dev\"].productName.startsWith(\"NVIDIA H100\")'}\n",
        ),
    );
    let r = carve(&[
        "explain",
        one.to_str().unwrap(),
        "--slices",
        state.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stdout.contains("would fit if") && r.stdout.contains("default/holder"),
        "{}",
        r.stdout
    );
    let j = carve(&[
        "explain",
        pair.to_str().unwrap(),
        "--slices",
        state.to_str().unwrap(),
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&j.stdout).expect(&j.stdout);
    assert_eq!(v["fitsOnEmptyNode"], false, "{v}");
    assert_eq!(v["suggestions"], serde_json::json!([]), "{v}");
}

#[test]
fn a_claim_that_needs_several_releases_is_not_told_one_is_enough() {
    // Two whole H100s, each held by its own claim; a claim for both.
    let dir = tempfile::tempdir().unwrap();
    let slices = carve(&["slices", "--gpus", "h100-80gb:2", "--sharing", "none"]);
    let state = format!(
        "{}{}{}",
        slices.stdout,
        allocated("h0", "gpu.carve.dev", "gpu-0"),
        allocated("h1", "gpu.carve.dev", "gpu-1")
    );
    let state = write(dir.path(), "state.yaml", &state);
    let two = write(
        dir.path(),
        "two.yaml",
        &claim("two", "gpu.carve.dev", "        count: 2\n"),
    );
    let r = carve(&[
        "explain",
        two.to_str().unwrap(),
        "--slices",
        state.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(!r.stdout.contains("would fit if"), "{}", r.stdout);
    assert!(
        r.stdout.contains("it would fit with every device free, but freeing any one device it could use is not enough"),
        "{}",
        r.stdout
    );
}

#[test]
fn explain_on_an_allocated_claim_shows_its_allocation() {
    let dir = tempfile::tempdir().unwrap();
    let slices = carve(&["slices", "--gpus", "h100-80gb:1", "--sharing", "none"]);
    let state = format!(
        "{}{}",
        slices.stdout,
        allocated("holder", "gpu.carve.dev", "gpu-0")
    );
    let state = write(dir.path(), "state.yaml", &state);
    // The claim as the user wrote it (no status), explained against the
    // state that holds it allocated.
    let own = write(
        dir.path(),
        "holder.yaml",
        &claim("holder", "gpu.carve.dev", ""),
    );
    let r = carve(&[
        "explain",
        own.to_str().unwrap(),
        "--slices",
        state.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("already allocated"), "{}", r.stdout);
    assert!(
        r.stdout.contains("-> gpu-0 (pool sim-node)"),
        "{}",
        r.stdout
    );
    assert!(!r.stdout.contains("does not fit"), "{}", r.stdout);
}

#[test]
fn a_claim_that_finds_no_device_is_told_what_the_node_offers() {
    let dir = tempfile::tempdir().unwrap();
    let c = write(dir.path(), "c.yaml", &mig_claim("odd", "5g.50gb"));
    let r = carve(&["explain", c.to_str().unwrap()]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("node sim-node offers:"), "{}", r.stdout);
    assert!(
        r.stdout
            .contains("MIG partitions (class mig.gpu.carve.dev): 1g.10gb"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout
            .contains("MPS shares of whole GPUs (class mps.gpu.carve.dev)"),
        "{}",
        r.stdout
    );
}

#[test]
fn simulate_tells_a_claim_that_finds_no_device_what_the_node_offers() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "odd.yaml", &mig_claim("odd", "5g.50gb"));
    let r = carve(&[
        "simulate",
        "--gpus",
        "h100-80gb:1",
        "--claims",
        file.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    assert!(
        r.stdout.contains("- default/odd (")
            && r.stdout.contains("not even with every device free"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("  sim-node offers:\n"), "{}", r.stdout);
    assert!(
        r.stdout
            .contains("    MIG partitions (class mig.gpu.carve.dev): 1g.10gb"),
        "{}",
        r.stdout
    );
    let last = r.stdout.lines().rev().find(|l| !l.trim().is_empty());
    assert!(
        last.is_some_and(|l| l.starts_with("next: `carve explain CLAIM.yaml`")),
        "{}",
        r.stdout
    );
}

#[test]
fn advise_for_whole_gpu_sizes_recommends_whole_gpus_with_typed_templates() {
    let r = carve(&["advise", "--sizes", "1,1"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.starts_with("recommendation: whole GPUs"),
        "{}",
        r.stdout
    );
    assert!(!r.stdout.contains("mig.gpu.carve.dev"), "{}", r.stdout);
    let yaml = r
        .stdout
        .split_once("# use (one ResourceClaimTemplate per size class):\n")
        .map(|(_, y)| y)
        .unwrap_or_else(|| panic!("no template in:\n{}", r.stdout));
    assert!(
        yaml.contains("deviceClassName: gpu.carve.dev")
            && yaml.contains("device.attributes[\"gpu.carve.dev\"].type == \"gpu\""),
        "{yaml}"
    );
    assert!(!yaml.contains("7g"), "{yaml}");
    let dir = tempfile::tempdir().unwrap();
    let t = write(dir.path(), "t.yaml", yaml);
    let e = carve(&["explain", t.to_str().unwrap()]);
    assert_eq!(e.code, 0, "{}{}", e.stdout, e.stderr);
}

/// The lines of `carve simulate` about `gpu`, from its picture line on.
fn picture_of<'a>(stdout: &'a str, gpu: &str) -> Vec<&'a str> {
    stdout
        .lines()
        .skip_while(|l| !l.starts_with(&format!("{gpu} (")))
        .take(3)
        .collect()
}

#[test]
fn a_shared_gpu_is_drawn_by_what_its_shares_use_and_the_report_ends_with_what_next() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "share.yaml",
        &format!(
            "{}---\n{}",
            mps_claim("share-a", "10Gi"),
            mps_claim("share-b", "2Gi")
        ),
    );
    let r = carve(&[
        "simulate",
        "--gpus",
        "a100-40gb:1",
        "--shared-gpus",
        "0=mps",
        "--claims",
        file.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    let pic = picture_of(&r.stdout, "gpu-0");
    let first = pic.first().copied().unwrap_or_default();
    assert!(!first.contains("memory slices used"), "{}", r.stdout);
    assert!(
        first.contains("the shares use 12288 of 40960 MiB memory, 56 of 108 SMs"),
        "{}",
        r.stdout
    );
    // The container block once per distinct content.
    assert_eq!(
        r.stdout.matches("container gets: env").count(),
        1,
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("container gets: the same as share-a's"),
        "{}",
        r.stdout
    );
    let last = r.stdout.lines().rev().find(|l| !l.trim().is_empty());
    assert!(
        last.is_some_and(|l| l.starts_with("next: ")),
        "{}",
        r.stdout
    );
}

/// Mount points under `dir` now.
fn mounts_under(dir: &Path) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| Path::new(m).starts_with(dir))
        .map(str::to_string)
        .collect()
}

#[test]
fn no_release_names_the_files_it_keeps_and_the_mounts_it_leaves() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "share.yaml",
        &format!(
            "{}---\n{}",
            mig_claim("mig-a", "1g.10gb"),
            mps_claim("share-a", "10Gi")
        ),
    );
    let r = carve(&[
        "simulate",
        "--gpus",
        "h100-80gb:1,a100-40gb:1",
        "--shared-gpus",
        "1=mps",
        "--claims",
        file.to_str().unwrap(),
        "--no-release",
    ]);
    let kept = r
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("kept "))
        .map(PathBuf::from);
    let cleanup = |kept: &Option<PathBuf>| {
        if let Some(k) = kept {
            for m in mounts_under(k) {
                let _ = Command::new("umount").arg(&m).status();
            }
            let _ = std::fs::remove_dir_all(k);
        }
    };
    let outcome = std::panic::catch_unwind(|| {
        assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
        let kept = kept.clone().expect(&r.stdout);
        let named = |what: &str| -> PathBuf {
            let line = r
                .stdout
                .lines()
                .find(|l| l.trim_start().starts_with(what))
                .unwrap_or_else(|| panic!("no {what:?} line in {}", r.stdout));
            PathBuf::from(line.rsplit(": ").next().unwrap())
        };
        let state = named("GPU instances (the NVML simulator's state)");
        // The MIG claim's GPU instance is in that file.
        let text = std::fs::read_to_string(&state).unwrap_or_else(|e| panic!("{state:?}: {e}"));
        let v: serde_json::Value = serde_json::from_str(&text).expect(&text);
        assert_eq!(
            v["gpus"][0]["gpuInstances"].as_array().map(Vec::len),
            Some(1),
            "{text}"
        );
        let checkpoint = named("the plugin's checkpoint");
        assert!(checkpoint.is_file(), "{checkpoint:?}\n{}", r.stdout);
        assert!(
            std::fs::read_to_string(&checkpoint)
                .unwrap()
                .contains("share-a"),
            "{checkpoint:?}"
        );
        // Every mount left under the directory is named, with the command
        // that cleans it up.
        let left = mounts_under(&kept);
        let clean = r
            .stdout
            .lines()
            .find(|l| l.trim_start().starts_with("clean up: "))
            .unwrap_or_else(|| panic!("no clean-up line in {}", r.stdout));
        let rm = format!("rm -rf {}", kept.display());
        let umounted: Vec<&str> = clean
            .trim_start()
            .strip_prefix("clean up: ")
            .and_then(|c| c.strip_suffix(rm.as_str()))
            .map(|c| {
                c.trim_end_matches(" && ")
                    .trim_start_matches("umount")
                    .split_whitespace()
                    .collect()
            })
            .unwrap_or_else(|| panic!("{clean} does not end with {rm}"));
        let mut named_sorted = umounted.clone();
        let mut left_sorted: Vec<&str> = left.iter().map(String::as_str).collect();
        named_sorted.sort_unstable();
        left_sorted.sort_unstable();
        assert_eq!(named_sorted, left_sorted, "{clean}");
    });
    cleanup(&kept);
    if let Err(e) = outcome {
        std::panic::resume_unwind(e);
    }
}
