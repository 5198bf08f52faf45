//! Hard memory limits against the `nvidia-smi memory-limits` double
//! (`carve_mps::fake_smi`): the double rejects what NVIDIA documents as
//! rejected, and carve sets, reads back and clears limits by calling it
//! (never by writing `dmem.*` itself).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use carve_mps::fake_smi::{self, Config, FakeGpu, NOT_SUPPORTED, fixture};
use carve_mps::memlimit::{Gpu, MIB, MemLimitFailure, MemLimits, dmem_value};

const FAKE: &str = env!("CARGO_BIN_EXE_carve-fake-mps-control");
const UUID: &str = "GPU-11111111-2222-3333-4444-555555555555";
const MIG_GPU: &str = "GPU-99999999-2222-3333-4444-555555555555";
const KEY: &str = "nvidia/0000:3b:00.0/vidmem";
const KEY1: &str = "nvidia/0000:86:00.0/vidmem";
const POD: &str = "kubepods/besteffort/pod0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";

struct Node {
    _d: tempfile::TempDir,
    root: PathBuf,
    bin: PathBuf,
    smi: PathBuf,
}

fn config(root: &Path, fail: Option<&str>) -> Config {
    Config {
        cgroup_root: root.to_path_buf(),
        gpus: vec![
            FakeGpu {
                index: 0,
                uuid: UUID.into(),
                pci: "00000000:3B:00.0".into(),
                mig: false,
            },
            FakeGpu {
                index: 1,
                uuid: MIG_GPU.into(),
                pci: "00000000:86:00.0".into(),
                mig: true,
            },
        ],
        fail: fail.map(str::to_string),
        as_uid: 0,
    }
}

/// A dmem cgroup tree with the pod cgroup (kubepods and besteffort enable
/// `+dmem` for their children), and the double installed.
fn node() -> Node {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("cg");
    fixture::root(
        &root,
        &[
            (KEY.into(), 80 * 1024 * MIB),
            (KEY1.into(), 80 * 1024 * MIB),
        ],
        true,
    )
    .unwrap();
    fixture::cgroup(&root, Path::new(POD), true).unwrap();
    let bin = d.path().join("bin");
    let smi = fake_smi::install(&bin, Path::new(FAKE), &config(&root, None)).unwrap();
    Node {
        _d: d,
        root,
        bin,
        smi,
    }
}

impl Node {
    fn smi(&self, args: &[&str]) -> (bool, String) {
        let o = Command::new(&self.smi).args(args).output().unwrap();
        (
            o.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ),
        )
    }

    fn pod(&self) -> String {
        self.root.join(POD).display().to_string()
    }

    fn file(&self, rel: &str, f: &str, key: &str) -> String {
        let t = std::fs::read_to_string(self.root.join(rel).join(f)).unwrap();
        dmem_value(&t, key).unwrap().to_string()
    }

    fn limits(&self) -> MemLimits {
        MemLimits {
            tool: self.smi.clone(),
            cgroup_root: self.root.clone(),
            timeout: Duration::from_secs(10),
        }
    }

    fn knob(&self, fail: Option<&str>) {
        fake_smi::write_config(&self.bin, &config(&self.root, fail)).unwrap();
    }
}

fn gpu() -> Gpu<'static> {
    Gpu {
        uuid: UUID,
        key: KEY,
    }
}

#[test]
fn fixture_has_dmem_files_only_where_the_parent_enables_dmem() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("cg");
    fixture::root(&root, &[(KEY.into(), MIB)], false).unwrap();
    fixture::cgroup(&root, Path::new("a/b"), true).unwrap();
    assert!(
        !root.join("dmem.max").exists(),
        "the root has no limit files"
    );
    assert!(
        !root.join("a/dmem.max").exists(),
        "root does not enable +dmem"
    );
    assert!(root.join("a/b/dmem.max").exists(), "a enables +dmem");
    fixture::cgroup(&root, Path::new("c/d"), false).unwrap();
    assert!(
        !root.join("c/d/dmem.max").exists(),
        "c does not enable +dmem"
    );
}

#[test]
fn the_double_rejects_each_undocumented_form() {
    let n = node();
    let pod = n.pod();
    let nope = format!("{pod}/nope");
    let ok = [
        "memory-limits",
        "--set",
        "--namespace",
        &pod,
        "--soft-limit",
        "1024",
        "--hard-limit",
        "1024",
        "-i",
        "0",
    ];
    // The documented forms work: [MP] with --set and -i <idx>, [DYN] without
    // --set, -n, and -i <UUID>.
    let (set, out) = n.smi(&ok);
    assert!(set, "{out}");
    let dyn_form = [
        "memory-limits",
        "-n",
        &pod,
        "--soft-limit",
        "max",
        "--hard-limit",
        "default",
        "-i",
        UUID,
    ];
    assert!(n.smi(&dyn_form).0, "{}", n.smi(&dyn_form).1);
    let bad: Vec<(&str, Vec<&str>, &str)> = vec![
        (
            "memory-limits not first",
            vec![
                "--set",
                "memory-limits",
                "-n",
                &pod,
                "--hard-limit",
                "1",
                "-i",
                "0",
            ],
            "must come first",
        ),
        (
            "a size with a unit",
            vec![
                "memory-limits",
                "--set",
                "-n",
                &pod,
                "--soft-limit",
                "40G",
                "-i",
                "0",
            ],
            "Invalid value",
        ),
        (
            "the = form",
            vec![
                "memory-limits",
                "--set",
                "-n",
                &pod,
                "--soft-limit=40960",
                "-i",
                "0",
            ],
            "separate arguments",
        ),
        (
            "a negative value",
            vec![
                "memory-limits",
                "--set",
                "-n",
                &pod,
                "--hard-limit",
                "-1",
                "-i",
                "0",
            ],
            "Invalid value",
        ),
        (
            "a relative namespace",
            vec![
                "memory-limits",
                "--set",
                "-n",
                POD,
                "--hard-limit",
                "1",
                "-i",
                "0",
            ],
            NOT_SUPPORTED,
        ),
        (
            "a missing cgroup",
            vec![
                "memory-limits",
                "--set",
                "-n",
                &nope,
                "--hard-limit",
                "1",
                "-i",
                "0",
            ],
            NOT_SUPPORTED,
        ),
        (
            "no device",
            vec!["memory-limits", "--set", "-n", &pod, "--hard-limit", "1"],
            "-i",
        ),
        (
            "an unknown GPU",
            vec![
                "memory-limits",
                "--set",
                "-n",
                &pod,
                "--hard-limit",
                "1",
                "-i",
                "7",
            ],
            "No device",
        ),
        (
            "a GPU in MIG mode",
            vec![
                "memory-limits",
                "--set",
                "-n",
                &pod,
                "--hard-limit",
                "1",
                "-i",
                "1",
            ],
            "MIG",
        ),
        (
            "a MIG UUID",
            vec![
                "memory-limits",
                "--set",
                "-n",
                &pod,
                "--hard-limit",
                "1",
                "-i",
                "MIG-aaaaaaaa-2222-3333-4444-555555555555",
            ],
            "MIG",
        ),
        (
            "a set without a limit",
            vec!["memory-limits", "--set", "-n", &pod, "-i", "0"],
            "needs --soft-limit or --hard-limit",
        ),
        ("another subcommand", vec!["-q"], "must come first"),
    ];
    for (what, args, want) in bad {
        let (ok, out) = n.smi(&args);
        assert!(!ok, "{what}: accepted");
        assert!(out.contains(want), "{what}: {out}");
    }
}

#[test]
fn a_cgroup_whose_parent_lacks_dmem_is_not_supported() {
    let n = node();
    // kubepods.slice: created by a root that enables +dmem, but its own
    // children do not get dmem (it does not enable it).
    fixture::cgroup(&n.root, Path::new("plain"), false).unwrap();
    fixture::cgroup(&n.root, Path::new("plain/leaf"), false).unwrap();
    let leaf = n.root.join("plain/leaf").display().to_string();
    let (ok, out) = n.smi(&[
        "memory-limits",
        "--set",
        "-n",
        &leaf,
        "--hard-limit",
        "1",
        "-i",
        "0",
    ]);
    assert!(!ok);
    assert_eq!(out.trim(), NOT_SUPPORTED);
}

#[test]
fn setting_needs_root() {
    let n = node();
    let mut c = config(&n.root, None);
    c.as_uid = 1000;
    fake_smi::write_config(&n.bin, &c).unwrap();
    let (ok, out) = n.smi(&[
        "memory-limits",
        "--set",
        "-n",
        &n.pod(),
        "--hard-limit",
        "1",
        "-i",
        "0",
    ]);
    assert!(!ok);
    assert!(out.contains("Insufficient Permissions"), "{out}");
}

#[test]
fn the_double_propagates_soft_limits_to_ancestors() {
    let n = node();
    let (ok, out) = n.smi(&[
        "memory-limits",
        "--set",
        "-n",
        &n.pod(),
        "--soft-limit",
        "2048",
        "--hard-limit",
        "4096",
        "-i",
        UUID,
    ]);
    assert!(ok, "{out}");
    assert_eq!(n.file(POD, "dmem.max", KEY), (4096 * MIB).to_string());
    assert_eq!(n.file(POD, "dmem.min", KEY), (2048 * MIB).to_string());
    assert_eq!(
        n.file("kubepods/besteffort", "dmem.min", KEY),
        (2048 * MIB).to_string()
    );
    assert_eq!(
        n.file("kubepods", "dmem.min", KEY),
        (2048 * MIB).to_string()
    );
    // The other GPU's lines are untouched.
    assert_eq!(n.file(POD, "dmem.max", KEY1), "max");
    let (ok, _) = n.smi(&[
        "memory-limits",
        "--set",
        "-n",
        &n.pod(),
        "--soft-limit",
        "0",
        "-i",
        UUID,
    ]);
    assert!(ok);
    assert_eq!(n.file("kubepods", "dmem.min", KEY), "0");
}

#[test]
fn set_reads_back_and_clear_zeroes_soft_then_hard() {
    let n = node();
    let l = n.limits();
    l.set(&gpu(), Path::new(POD), 10240).unwrap();
    assert_eq!(n.file(POD, "dmem.max", KEY), (10240 * MIB).to_string());
    assert_eq!(n.file(POD, "dmem.min", KEY), (10240 * MIB).to_string());
    assert_eq!(
        n.file("kubepods", "dmem.min", KEY),
        (10240 * MIB).to_string()
    );
    l.clear(&gpu(), Path::new(POD)).unwrap();
    assert_eq!(n.file(POD, "dmem.max", KEY), "max");
    assert_eq!(n.file(POD, "dmem.min", KEY), "0");
    assert_eq!(
        n.file("kubepods", "dmem.min", KEY),
        "0",
        "no reservation left"
    );
    let calls = fake_smi::calls(&n.bin);
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(
        calls[0].starts_with("memory-limits --set --namespace "),
        "{calls:?}"
    );
    assert!(calls[0].ends_with(&format!("--soft-limit 10240 --hard-limit 10240 -i {UUID}")));
    assert!(calls[1].ends_with(&format!("--soft-limit 0 --hard-limit max -i {UUID}")));
}

#[test]
fn a_refusing_tool_fails_naming_gpu_cgroup_and_output() {
    let n = node();
    n.knob(Some("refuse"));
    let e = n.limits().set(&gpu(), Path::new(POD), 1024).unwrap_err();
    assert!(matches!(*e.what, MemLimitFailure::Refused { .. }), "{e}");
    let m = e.to_string();
    assert!(
        m.contains(UUID) && m.contains(POD) && m.contains("knob refuse"),
        "{m}"
    );
    assert_eq!(n.file(POD, "dmem.max", KEY), "max");
}

#[test]
fn a_dying_tool_fails() {
    let n = node();
    n.knob(Some("die"));
    let e = n.limits().set(&gpu(), Path::new(POD), 1024).unwrap_err();
    assert!(matches!(*e.what, MemLimitFailure::Refused { .. }), "{e}");
    assert!(e.to_string().contains("signal"), "{e}");
    assert_eq!(n.file(POD, "dmem.max", KEY), "max");
}

#[test]
fn a_read_back_mismatch_fails_and_clears() {
    let n = node();
    n.knob(Some("lie"));
    let e = n.limits().set(&gpu(), Path::new(POD), 1024).unwrap_err();
    assert!(
        matches!(
            *e.what,
            MemLimitFailure::ReadBack {
                file: "dmem.max",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains(KEY), "{e}");
    // Cleared again (the clear's `max` is not bent by the knob).
    assert_eq!(n.file(POD, "dmem.max", KEY), "max");
    assert_eq!(n.file(POD, "dmem.min", KEY), "0");
    assert_eq!(n.file("kubepods", "dmem.min", KEY), "0");
}

#[test]
fn a_missing_cgroup_is_a_refusal_and_a_gone_one_needs_no_clear() {
    let n = node();
    let e = n
        .limits()
        .set(&gpu(), Path::new("kubepods/podnothere"), 1024)
        .unwrap_err();
    assert!(e.to_string().contains(NOT_SUPPORTED), "{e}");
    n.limits()
        .clear(&gpu(), Path::new("kubepods/podnothere"))
        .unwrap();
}
