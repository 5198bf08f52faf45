//! The examples under `examples/` as a user meets them: each is a Pod and
//! its ResourceClaimTemplate with the `kubectl apply` command in its README,
//! and `carve simulate` (the built binary, its stdout and exit status)
//! prepares every one that can fit on a node shape, and says plainly why the
//! others cannot.

use std::path::{Path, PathBuf};

mod common;
use common::carve_isolated;

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

/// The example directories, in name order.
fn example_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(examples_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

const MIG: &[&str] = &[
    "mig-1g",
    "mig-by-memory",
    "mig-first-available",
    "mig-same-parent",
];
const SHARING: &[(&str, &str)] = &[
    ("mps-share", "mps"),
    ("timeslice", "timeslice"),
    ("mig-mps", "mig-mps"),
];

/// A node shape: simulate's arguments, and the examples that cannot fit
/// there with what the run must say about each.
type Shape<'a> = (Vec<&'a str>, Vec<(&'a str, String)>);

/// The first line of claim `name`'s block: `- default/NAME (examples/...): ...`.
fn head<'a>(out: &'a str, name: &str) -> &'a str {
    let start = format!("- default/{name} (examples/{name}/pod.yaml): ");
    out.lines()
        .find(|l| l.starts_with(&start))
        .unwrap_or_else(|| panic!("no line for {name}:\n{out}"))
}

/// The `(as expected on this node: ...)` line of claim `name`'s block.
fn expected_line<'a>(out: &'a str, name: &str) -> Option<&'a str> {
    let start = format!("- default/{name} (");
    out.lines()
        .skip_while(|l| !l.starts_with(&start))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .find(|l| l.starts_with("  (as expected on this node: "))
}

#[test]
fn every_example_that_fits_a_node_shape_is_prepared_and_the_rest_say_why() {
    let mig_off_a100 = "no GPU of this node publishes MIG partitions: NVIDIA A100-SXM4-40GB (MIG mode off, and on this architecture turning it on needs a GPU reset";
    let shapes: Vec<Shape> = vec![
        (vec![], vec![]),
        // Shares go on the GPUs --shared-gpus names (the scheduler a 1.35
        // API server may have does not count them); the rest stay exclusive.
        (
            vec![
                "--gpus",
                "h200:8",
                "--shared-gpus",
                "5=mps,6=timeslice,7=mig-mps:2g.35gb",
            ],
            vec![],
        ),
        (
            vec![
                "--gpus",
                "h100-80gb:1,h200:4",
                "--shared-gpus",
                "3=mps,4=mig-mps:2g.35gb",
            ],
            vec![(
                "timeslice",
                "none is named for these; add INDEX=timeslice to --shared-gpus".into(),
            )],
        ),
        (
            vec![
                "--gpus",
                "a100-40gb:4",
                "--shared-gpus",
                "1=mps,2=timeslice",
            ],
            MIG.iter()
                .map(|n| (*n, mig_off_a100.to_string()))
                .chain([(
                    "mig-mps",
                    "add INDEX=mig-mps:PROFILE to --shared-gpus".to_string(),
                )])
                .collect(),
        ),
        (
            vec!["--sharing", "none"],
            SHARING
                .iter()
                .chain(&[("mps-hard-limit", "mps")])
                .map(|(n, flag)| {
                    (
                        *n,
                        format!("this run has --sharing none; add {flag} to --sharing"),
                    )
                })
                .collect(),
        ),
        (
            vec![
                "--gpus",
                "h200:4",
                "--sharing",
                "mps",
                "--shared-gpus",
                "3=mps",
            ],
            vec![
                (
                    "timeslice",
                    "this run has --sharing mps; add timeslice to --sharing".into(),
                ),
                (
                    "mig-mps",
                    "this run has --sharing mps; add mig-mps to --sharing".into(),
                ),
            ],
        ),
    ];
    let names = example_names();
    for (args, unfit) in &shapes {
        let mut argv = vec!["simulate"];
        argv.extend(args.iter().copied());
        let r = carve_isolated(&argv);
        let ctx = || format!("carve {}\n{}", argv.join(" "), r.context());
        assert_eq!(r.code, 0, "{}", ctx());
        assert!(!r.stdout.contains("\nnot prepared: "), "{}", ctx());
        assert!(r.stdout.contains("no GPU instance left"), "{}", ctx());
        for name in &names {
            let line = head(&r.stdout, name);
            if let Some((_, why)) = unfit.iter().find(|(n, _)| n == name) {
                let said = expected_line(&r.stdout, name)
                    .unwrap_or_else(|| panic!("{name}: no reason given\n{}", ctx()));
                assert!(said.contains(why.as_str()), "{name}: {said}\n{}", ctx());
            } else if name == "mps-hard-limit" {
                // Pending by design on the simulated node, with its reason.
                let said = expected_line(&r.stdout, name)
                    .unwrap_or_else(|| panic!("{name}: no reason given\n{}", ctx()));
                assert!(said.contains("no memory partitioning"), "{}", ctx());
            } else {
                assert!(
                    line.ends_with("allocated and prepared"),
                    "{name}: {line}\n{}",
                    ctx()
                );
            }
        }
    }
}

#[test]
fn a_claim_naming_another_models_profile_is_shown_the_nodes_profiles() {
    // An H100 profile name on an H200 node: no device, and the run says
    // which profiles the node has.
    let dir = tempfile::tempdir().unwrap();
    let claim = std::fs::read_to_string(examples_dir().join("mig-1g/pod.yaml"))
        .unwrap()
        .replace(
            "device.attributes[\"gpu.carve.dev\"].computeSlices == 1 &&",
            "device.attributes[\"gpu.carve.dev\"].profile == \"1g.10gb\" &&",
        );
    assert!(claim.contains("\"1g.10gb\""), "{claim}");
    let file = dir.path().join("h100-profile.yaml");
    std::fs::write(&file, claim).unwrap();
    let r = carve_isolated(&[
        "simulate",
        "--gpus",
        "h200:1",
        "--claims",
        file.to_str().unwrap(),
    ]);
    assert_eq!(r.code, 1, "{}", r.context());
    assert!(
        r.stdout.contains("- default/mig-1g (") && r.stdout.contains(": does not fit on "),
        "{}",
        r.context()
    );
    assert!(
        r.stdout.contains("  profile names differ between GPU models (this node's are below); select on memory or computeSlices to fit any model\n  sim-node offers:\n    whole GPUs (class gpu.carve.dev): NVIDIA H200\n    MIG partitions (class mig.gpu.carve.dev): 1g.18gb, 1g.18gb+me, 1g.35gb, 2g.35gb, 3g.71gb, 4g.71gb, 7g.141gb\n"),
        "{}",
        r.context()
    );
    // A claim the user gave still fails the run, with its name.
    assert!(
        r.stdout
            .contains("not prepared: 1 claim(s) did not fit or found no device: mig-1g"),
        "{}",
        r.context()
    );
}

#[test]
fn a_users_shared_claim_with_that_sharing_off_names_the_flag() {
    let r = carve_isolated(&[
        "simulate",
        "--gpus",
        "h100:1",
        "--sharing",
        "none",
        "--claims",
        examples_dir().join("mps-share/pod.yaml").to_str().unwrap(),
    ]);
    assert_eq!(r.code, 1, "{}", r.context());
    assert!(
        r.stdout.contains(
            "  mps.gpu.carve.dev: this node publishes no MPS shares of whole GPUs: this run has --sharing none; add mps to --sharing to publish them"
        ),
        "{}",
        r.context()
    );
    assert!(!r.stdout.contains("as expected"), "{}", r.context());
}

#[test]
fn every_example_is_a_pod_with_its_template_and_the_apply_commands() {
    let names = example_names();
    assert!(names.len() >= 9, "{names:?}");
    for name in &names {
        let dir = examples_dir().join(name);
        assert!(
            !dir.join("claim.yaml").exists(),
            "{name}: a bare claim.yaml"
        );
        let text = std::fs::read_to_string(dir.join("pod.yaml"))
            .unwrap_or_else(|e| panic!("{name}/pod.yaml: {e}"));
        let docs: Vec<serde_norway::Value> = serde_norway::Deserializer::from_str(&text)
            .map(|d| serde::Deserialize::deserialize(d).unwrap())
            .collect();
        let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["ResourceClaimTemplate", "Pod"], "{name}");
        let template = docs[0]["metadata"]["name"].as_str().unwrap();
        let pod = &docs[1]["spec"];
        assert_eq!(
            pod["resourceClaims"][0]["resourceClaimTemplateName"].as_str(),
            Some(template),
            "{name}: the Pod names its template"
        );
        let claim = pod["resourceClaims"][0]["name"].as_str().unwrap();
        let c = &pod["containers"][0];
        assert_eq!(
            c["resources"]["claims"][0]["name"].as_str(),
            Some(claim),
            "{name}: the container uses the pod's claim"
        );
        assert!(
            c["image"]
                .as_str()
                .is_some_and(|i| i.starts_with("nvcr.io/nvidia/cuda:")),
            "{name}: {:?}",
            c["image"]
        );
        // Portable: no profile name of one GPU model in a selector.
        assert!(
            !text.contains(".profile =="),
            "{name}: selects a model-specific profile name"
        );
        let readme = std::fs::read_to_string(dir.join("README.md")).unwrap();
        assert!(
            readme.contains("kubectl apply -f examples/deviceclasses.yaml")
                && readme.contains(&format!("kubectl apply -f examples/{name}/pod.yaml")),
            "{name}/README.md gives no apply commands:\n{readme}"
        );
    }
}

#[test]
fn explain_reads_every_example_as_a_user_passes_it() {
    // `carve explain examples/NAME/pod.yaml`: the template is read, the Pod
    // next to it is not an error.
    for name in example_names() {
        let p = examples_dir().join(&name).join("pod.yaml");
        let r = carve_isolated(&["explain", p.to_str().unwrap(), "--gpus", "h200:1"]);
        assert!(r.stderr.is_empty(), "{name}: {}", r.context());
        assert!(
            r.stdout.starts_with("claim ") && r.stdout.lines().next().unwrap().contains(&name),
            "{name}: {}",
            r.context()
        );
    }
}
