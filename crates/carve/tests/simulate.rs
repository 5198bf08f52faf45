//! `carve simulate` run as a user runs it: the built binary, which starts the
//! real `carve kubelet-plugin` child on the NVML simulator, real sockets and
//! files, and MPS daemons of the fake `nvidia-cuda-mps-control` (the same
//! binary under that name). Each run gets its own `TMPDIR`, so the tests can
//! check that nothing is left there and that no process of the run survives it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn carve(args: &[&str], tmp: &Path) -> Output {
    carve_with_faults(args, tmp, None)
}

/// Runs carve; `faults` (the simulator's `CARVE_NVML_SIM_FAULTS`) reach the
/// plugin child through the environment.
fn carve_with_faults(args: &[&str], tmp: &Path, faults: Option<&str>) -> Output {
    match faults {
        Some(f) => carve_with_env(args, tmp, &[("CARVE_NVML_SIM_FAULTS", f)]),
        None => carve_with_env(args, tmp, &[]),
    }
}

/// Runs carve with extra environment (which reaches the plugin child and the
/// fake MPS daemons it starts).
fn carve_with_env(args: &[&str], tmp: &Path, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_carve"));
    cmd.args(args)
        .env("TMPDIR", tmp)
        .env_remove("CARVE_NVML_SIM_CONFIG")
        .env_remove("CARVE_NVML_SIM_FAULTS")
        .env_remove("FAKE_MPS_REJECT")
        .env_remove("FAKE_MPS_CRASH_ON")
        .env_remove("FAKE_MPS_MAX_PROTOCOL");
    cmd.envs(env.iter().copied());
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

/// The value after `key` in `line` (up to the next space, `,` or `;`).
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let rest = &line[line.find(key)? + key.len()..];
    let end = rest.find([' ', ',', ';']).unwrap_or(rest.len());
    Some(&rest[..end])
}

/// Checks the block of a prepared MPS share: daemon, limits, published
/// enforcement, what the fake daemon received, container edits. Returns the
/// daemon pid.
fn check_mps_share(
    out: &str,
    name: &str,
    mib: u64,
    sms: u32,
    protocol: &str,
    memory_level: &str,
) -> u32 {
    let b = block(out, name);
    let ctx = || format!("{name}: {b:#?}\n{out}");
    assert!(
        b.first()
            .is_some_and(|l| l.ends_with("allocated and prepared")),
        "{}",
        ctx()
    );
    let line = |prefix: &str| {
        b.iter()
            .find(|l| l.trim_start().starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} line: {}", ctx()))
    };
    assert!(
        line("request gpu -> ").contains("-mps: MPS share "),
        "{}",
        ctx()
    );
    let daemon = line("daemon: pid ");
    let pid: u32 = field(daemon, "pid ").unwrap().parse().unwrap();
    assert_eq!(field(daemon, "protocol "), Some(protocol), "{}", ctx());
    let limits = line("limits: ");
    assert!(
        limits.contains(&format!("memory {mib} MiB, {sms} SMs = ")),
        "{}",
        ctx()
    );
    let pct: u32 = field(limits, "SMs = ").unwrap().parse().unwrap();
    let pod_uid = field(limits, "(uid ").unwrap().trim_end_matches(')');
    let enforcement = line("enforcement: ");
    assert_eq!(
        field(enforcement, "memory "),
        Some(memory_level),
        "{}",
        ctx()
    );
    // The simulated node has no memory partitioning: each share says why
    // its memory limit is not hard.
    if memory_level == "client" {
        let why = line("memory not hard: ");
        assert!(
            why.contains("nvidia-smi") || why.contains("MIG"),
            "{}",
            ctx()
        );
    }
    assert!(
        b.iter()
            .any(|l| l.contains(&format!("daemon got: start pid={pid} protocol="))),
        "{}",
        ctx()
    );
    assert!(!pod_uid.is_empty(), "{}", ctx());
    if protocol == "v3" {
        // The share's namespace, created, then given both limits; the
        // container gets only that namespace's pipe directory.
        let create = line("daemon got: verb namespace create c_");
        let ns = field(create, "create ").unwrap();
        let set = line("daemon got: verb namespace set ");
        assert!(
            set.contains(&format!(
                "set {ns} --server=carve --pinned-memory-limit={mib}M --active-thread-percentage={pct}"
            )),
            "{}",
            ctx()
        );
        assert!(limits.ends_with("cgroup none"), "{}", ctx());
        let env = line("env ");
        assert!(
            env.contains("CUDA_MPS_PIPE_DIRECTORY=")
                && env.contains(&format!("/pipe/carve/{ns}"))
                && !env.contains("CUDA_MPS_PINNED"),
            "{}",
            ctx()
        );
        assert!(
            b.iter()
                .any(|l| l.contains("mount ") && l.contains(&format!("/pipe/carve/{ns} -> "))),
            "{}",
            ctx()
        );
    } else {
        let env = line("env ");
        assert!(
            env.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=GPU-")
                && env.contains(&format!("={mib}M"))
                && env.contains(&format!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={pct}")),
            "client limits in the container environment: {}",
            ctx()
        );
        // v2: the daemon's pipe directory.
        let env = line("env ");
        assert!(
            env.contains("CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"),
            "{}",
            ctx()
        );
        assert!(
            b.iter()
                .any(|l| l.contains("mount ") && l.contains("/pipe -> ")),
            "{}",
            ctx()
        );
    }
    assert!(
        b.iter()
            .any(|l| l.trim_start().starts_with("CDI k8s.gpu.carve.dev/claim=")),
        "{}",
        ctx()
    );
    assert!(!b.iter().any(|l| l.contains("PROBLEM")), "{}", ctx());
    pid
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
    // For the scheduler a 1.35 API server may have, shares are apart: the
    // last H100 publishes only MIG-MPS shares on its three 2g.20gb
    // placements, the first two no share at all.
    assert!(
        out.contains(
            "gpu-5 (NVIDIA H100 80GB HBM3, MIG off until a claim needs it): MIG-MPS 2g.20gb×3"
        ),
        "H100 MIG-MPS devices published: {out}"
    );
    assert!(out.contains("7g.80gb×1 gpu×1\n"), "exclusive H100s: {out}");
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
        // What the container gets (issue 16): the driver from the fake driver
        // root, said in full once (the first MIG claim's), then named; the MIG
        // capability nodes per device.
        let full = b.iter().any(|l| {
            l.trim_start()
                .starts_with("container gets: env NVIDIA_VISIBLE_DEVICES=void")
        });
        let same = b
            .iter()
            .any(|l| l.trim_start().starts_with("container gets: the same as "));
        assert!(full != same, "{name}: {b:#?}");
        assert_eq!(
            full,
            b.iter()
                .any(|l| l.contains("libraries, also at") && l.contains("libcuda.so.1")),
            "{name}: {b:#?}"
        );
        assert!(
            b.iter()
                .any(|l| l.trim_start().starts_with("device /dev/nvidia")
                    && l.contains("/dev/nvidia-caps/nvidia-cap")),
            "{name}: {b:#?}"
        );
    }
    let whole = block(&out, "whole-gpu");
    assert!(
        whole.iter().any(|l| l.contains("whole GPU GPU-")),
        "whole-gpu: {whole:#?}\n{out}"
    );
    // The MPS share on v3 (the fake speaks v3): memory `client`, since no
    // device enforces memory hard today, so the example demanding `hard`
    // finds no device. 33 SMs round up to 34.
    let a = check_mps_share(&out, "mps-share", 10240, 34, "v3", "client");
    assert!(
        block(&out, "mps-share")
            .iter()
            .any(|l| l.contains("request gpu -> gpu-3-mps: MPS share ")),
        "mps-share takes a whole-GPU MPS device: {out}"
    );
    // The Pod and ResourceClaimTemplate of examples/mig-mps: an MPS share of
    // a 2g.20gb MIG instance with the template's limits (16 of its 32 SMs),
    // reserved for the pod the file names.
    let m = check_mps_share(&out, "mig-mps", 8192, 16, "v3", "client");
    let mig_mps = block(&out, "mig-mps");
    assert!(
        mig_mps[0].contains("(examples/mig-mps/pod.yaml)"),
        "{mig_mps:#?}"
    );
    assert!(
        mig_mps.iter().any(
            |l| l.contains("request gpu -> gpu-5-mig-2g20gb-4-mps: MPS share ")
                && l.contains("(2g.20gb at memory slice 4, GPU instance")
        ),
        "{mig_mps:#?}\n{out}"
    );
    assert!(
        mig_mps
            .iter()
            .any(|l| l.contains("16 SMs = 50 % active threads; pod default/mig-mps (uid ")),
        "{mig_mps:#?}"
    );
    assert_ne!(a, m, "one daemon per MPS device:\n{out}");
    assert!(
        // Drawn within its MIG instance by what its shares use.
        out.contains(
            " = mig-mps 2g.20gb at slice 4 (MIG instance shared through MPS; the shares use "
        ),
        "{out}"
    );
    // It asks for hard memory, which no device of this node offers: no
    // release of other claims could help.
    let hard = block(&out, "mps-hard-limit");
    assert!(
        hard.first().is_some_and(
            |l| l.ends_with("does not fit on sim-node, not even with every device free:")
        ),
        "{hard:#?}\n{out}"
    );
    let ts = block(&out, "timeslice");
    assert!(
        ts.iter().any(|l| l.contains("-ts: time-sliced GPU GPU-")
            && l.contains("no memory or fault isolation")),
        "timeslice: {ts:#?}\n{out}"
    );
    // The picture: every GPU, with the claims' letters.
    for g in ["gpu-0 (", "gpu-1 (", "gpu-2 (", "gpu-3 (", "gpu-4 ("] {
        assert!(out.contains(g), "{g} missing from the picture:\n{out}");
    }
    assert!(out.contains("memory slices used"), "{out}");
    assert!(out.contains(" = mig-same-parent 3g.40gb at slice"), "{out}");
    assert!(
        out.contains("M = mps-share (whole GPU shared through MPS)"),
        "{out}"
    );
    assert!(
        out.contains("T = timeslice (whole GPU, time-sliced)"),
        "{out}"
    );
    assert!(
        out.contains("released 8 claim(s): unprepared and deleted"),
        "{out}"
    );
    assert!(
        out.contains("no GPU instance left: 0 GPU instances on 6 GPU(s)"),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "no MPS daemon left: 2 daemon(s) served claims (pid {a} on gpu-3-mps, pid {m} on gpu-5-mig-2g20gb-4-mps), all gone"
        )),
        "{out}"
    );
    assert_nothing_left(tmp.path());
}

#[test]
fn mig_examples_on_an_l4_are_reported_and_the_whole_gpu_is_prepared() {
    let tmp = tempfile::tempdir().unwrap();
    let o = carve(&["simulate", "--gpus", "l4:1"], tmp.path());
    let (out, err) = text(&o);
    // Every example either runs or cannot run on this node by its shape and
    // flags: the MIG ones (no MIG), and the shares, which go only on GPUs
    // named by --shared-gpus for the scheduler a 1.35 API server may have.
    assert!(
        o.status.success() && !out.contains("\nnot prepared: "),
        "exit {}\nstdout:\n{out}\nstderr:\n{err}",
        o.status
    );
    for entry in ["INDEX=mps", "INDEX=timeslice", "INDEX=mig-mps:PROFILE"] {
        assert!(
            out.contains(&format!(
                "none is named for these; add {entry} to --shared-gpus"
            )),
            "{entry}\n{out}"
        );
    }
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
        o.status.code() == Some(1) && out.contains("\nnot prepared: "),
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
    // A usage error of the flag.
    assert_eq!(o.status.code(), Some(2), "stdout:\n{out}\nstderr:\n{err}");
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

/// A claims directory with the two MPS examples.
fn mps_examples() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    for name in ["mps-share", "mps-hard-limit"] {
        std::fs::copy(
            examples.join(name).join("pod.yaml"),
            dir.path().join(format!("{name}.yaml")),
        )
        .unwrap();
    }
    dir
}

#[test]
fn mps_v2_puts_the_limits_in_the_container_environment() {
    // Only the MPS examples, on one A100, with the legacy protocol: the
    // enforcement is published as `client`, so the hard-limit claim finds no
    // device and is reported; the other share gets client variables.
    let tmp = tempfile::tempdir().unwrap();
    let dir = mps_examples();
    let o = carve(
        &[
            "simulate",
            "--gpus",
            "a100-40gb:1",
            "--shared-gpus",
            "0=mps",
            "--claims",
            dir.path().to_str().unwrap(),
            "--sharing",
            "mps",
            "--mps-protocol",
            "v2",
        ],
        tmp.path(),
    );
    let (out, err) = text(&o);
    assert!(
        o.status.code() == Some(1) && out.contains("\nnot prepared: "),
        "exit {}\nstdout:\n{out}\nstderr:\n{err}",
        o.status
    );
    // Under v2 the unit serves one claim: the 10 GiB / 34 SM request is
    // rounded up to the whole A100 (40960 MiB, 108 SMs, 100 %).
    let pid = check_mps_share(&out, "mps-share", 40960, 108, "v2", "client");
    // It asks for hard memory, which no device of this node offers: no
    // release of other claims could help.
    let hard = block(&out, "mps-hard-limit");
    assert!(
        hard.first().is_some_and(
            |l| l.ends_with("does not fit on sim-node, not even with every device free:")
        ),
        "{hard:#?}\n{out}"
    );
    assert!(
        out.contains(&format!(
            "no MPS daemon left: 1 daemon(s) served claims (pid {pid} on gpu-0-mps)"
        )),
        "{out}"
    );
    assert_nothing_left(tmp.path());
}

#[test]
fn the_carve_binary_runs_the_fake_mps_control_under_that_name() {
    // Through a link named carve-fake-mps-control, `-d` starts a daemon that is
    // the carve binary again, still under the link's name (argv[0]), and a
    // client invocation through the link stops it.
    let tmp = tempfile::tempdir().unwrap();
    let link = tmp.path().join("carve-fake-mps-control");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_carve"), &link).unwrap();
    let pipe = tmp.path().join("pipe");
    std::fs::create_dir(&pipe).unwrap();
    let run = |args: &[&str], stdin: &str| {
        use std::io::Write as _;
        let mut c = Command::new(&link)
            .args(args)
            .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        c.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
        c.wait_with_output().unwrap()
    };
    let o = run(&["-d", "-p", "3"], "");
    assert!(o.status.success(), "{:?}", text(&o));
    let pid = std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid")).unwrap();
    let pid = pid.trim();
    let proc_dir = Path::new("/proc").join(pid);
    let exe = std::fs::read_link(proc_dir.join("exe")).unwrap();
    assert_eq!(
        exe,
        std::fs::canonicalize(env!("CARGO_BIN_EXE_carve")).unwrap()
    );
    let cmdline = std::fs::read(proc_dir.join("cmdline")).unwrap();
    let argv: Vec<String> = cmdline
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    assert_eq!(
        argv,
        [link.to_str().unwrap(), "-f", "-p", "3"],
        "the daemon keeps the link's name"
    );
    // A v2 request to a v3 daemon fails, as with the real control binary.
    let o = run(&[], "get_default_active_thread_percentage\n");
    assert!(!o.status.success(), "{:?}", text(&o));
    let o = run(&["-q"], "");
    assert!(o.status.success(), "{:?}", text(&o));
    let log = std::fs::read_to_string(pipe.join("fake-mps-control.log")).unwrap();
    assert!(
        log.starts_with(&format!("start pid={pid} protocol=3 multiuser=false "))
            && log.ends_with("quit\n"),
        "{log}"
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::fs::read(proc_dir.join("cmdline")).is_ok_and(|c| !c.is_empty())
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(
        !std::fs::read(proc_dir.join("cmdline")).is_ok_and(|c| !c.is_empty()),
        "daemon {pid} still runs after -q"
    );
}

/// A directory with two claims sharing one 3g.40gb MIG instance through MPS.
fn mig_mps_claims() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for n in ["a", "b"] {
        std::fs::write(
            dir.path().join(format!("{n}.yaml")),
            format!(
                "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: migmps-{n}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n        deviceClassName: mig-mps.gpu.carve.dev\n        selectors:\n        - cel:\n            expression: device.attributes[\"gpu.carve.dev\"].profile == \"3g.40gb\"\n        capacity:\n          requests:\n            memory: 8Gi\n            multiprocessors: \"20\"\n"
            ),
        )
        .unwrap();
    }
    dir
}

#[test]
fn two_claims_share_one_mig_instance_through_one_daemon() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = mig_mps_claims();
    let o = carve(
        &[
            "simulate",
            "--gpus",
            "h100:1",
            "--shared-gpus",
            "0=mig-mps:3g.40gb",
            "--claims",
            dir.path().to_str().unwrap(),
            "--sharing",
            "mig-mps",
        ],
        tmp.path(),
    );
    let (out, err) = text(&o);
    assert!(
        o.status.success(),
        "exit {}\nstdout:\n{out}\nstderr:\n{err}",
        o.status
    );
    // MIG-MPS is never hard: memory partitioning does not support MIG.
    let a = check_mps_share(&out, "migmps-a", 8192, 20, "v3", "client");
    let b = check_mps_share(&out, "migmps-b", 8192, 20, "v3", "client");
    assert_eq!(a, b, "one daemon for the instance:\n{out}");
    let device = |name: &str| {
        block(&out, name)
            .iter()
            .find_map(|l| l.trim_start().strip_prefix("request gpu -> "))
            .and_then(|l| l.split(':').next())
            .unwrap()
            .to_string()
    };
    assert_eq!(device("migmps-a"), device("migmps-b"));
    assert!(device("migmps-a").starts_with("gpu-0-mig-3g40gb-"), "{out}");
    assert!(
        block(&out, "migmps-a")
            .iter()
            .any(|l| l.contains("MPS share ")
                && l.contains(" of MIG-")
                && l.contains("(3g.40gb at memory slice")),
        "{out}"
    );
    assert!(
        out.contains("= migmps-a+migmps-b 3g.40gb at slice"),
        "{out}"
    );
    assert!(out.contains("no GPU instance left"), "{out}");
    assert!(
        out.contains(&format!(
            "no MPS daemon left: 1 daemon(s) served claims (pid {a} on gpu-0-mig-3g40gb-"
        )),
        "{out}"
    );
    assert_nothing_left(tmp.path());
}

#[test]
fn mps_shares_the_daemon_refuses_fail_their_claims_and_leave_no_daemon() {
    // The fake daemon rejects every namespace (its request carries the memory
    // limit): each MPS claim fails at prepare, the run goes on and exits 1.
    let tmp = tempfile::tempdir().unwrap();
    let dir = mig_mps_claims();
    let o = carve_with_env(
        &[
            "simulate",
            "--gpus",
            "h100:1",
            "--shared-gpus",
            "0=mig-mps:3g.40gb",
            "--claims",
            dir.path().to_str().unwrap(),
            "--sharing",
            "mig-mps",
        ],
        tmp.path(),
        &[("FAKE_MPS_REJECT", "--pinned-memory-limit")],
    );
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "stdout:\n{out}\nstderr:\n{err}");
    for name in ["migmps-a", "migmps-b"] {
        let b = block(&out, name);
        assert!(
            b.first()
                .is_some_and(|l| l.contains("FAILED: NodePrepareResources")),
            "{name}: {b:#?}\n{out}"
        );
    }
    assert!(err.contains("2 claim(s) failed"), "{err}");
    assert!(out.contains("no GPU instance left"), "{out}");
    assert!(
        out.contains("no MPS daemon left (no prepared claim used one)"),
        "{out}"
    );
    assert_nothing_left(tmp.path());
}

#[test]
fn a_daemon_crash_fails_the_claim_that_hit_it_and_leaves_no_daemon() {
    // The fake daemon dies on the second share's limits (20480M): that claim
    // fails with the client's error, the first share stays prepared and is
    // released, and no daemon process survives the run.
    let tmp = tempfile::tempdir().unwrap();
    let dir = mps_examples();
    std::fs::remove_file(dir.path().join("mps-hard-limit.yaml")).unwrap();
    let share = std::fs::read_to_string(dir.path().join("mps-share.yaml")).unwrap();
    std::fs::write(
        dir.path().join("mps-zbig.yaml"),
        share
            .replace("name: mps-share", "name: mps-zbig")
            .replace(
                "resourceClaimTemplateName: mps-share",
                "resourceClaimTemplateName: mps-zbig",
            )
            .replace("memory: 10Gi", "memory: 20Gi")
            .replace("\"33\"", "\"16\""),
    )
    .unwrap();
    let o = carve_with_env(
        &[
            "simulate",
            "--gpus",
            "a100-40gb:1",
            "--shared-gpus",
            "0=mps",
            "--claims",
            dir.path().to_str().unwrap(),
        ],
        tmp.path(),
        &[("FAKE_MPS_CRASH_ON", "=20480M")],
    );
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "stdout:\n{out}\nstderr:\n{err}");
    let pid = check_mps_share(&out, "mps-share", 10240, 34, "v3", "client");
    let failed = block(&out, "mps-zbig");
    assert!(
        failed
            .first()
            .is_some_and(|l| l.contains("FAILED: NodePrepareResources")
                && l.contains("closed the connection without an answer")),
        "{failed:#?}\n{out}"
    );
    assert!(out.contains("released 1 claim(s)"), "{out}");
    assert!(
        out.contains(&format!(
            "no MPS daemon left: 1 daemon(s) served claims (pid {pid} on gpu-0-mps), all gone"
        )),
        "{out}"
    );
    assert_nothing_left(tmp.path());
}

#[test]
fn the_kube_version_shows_in_the_layout_and_the_gate_warning_in_the_output() {
    let tmp = tempfile::tempdir().unwrap();
    let mig_1g = claims_dir(&["mig-1g"]);
    let run = |v: &str| {
        let o = carve(
            &[
                "simulate",
                "--gpus",
                "h100:1",
                "--kube-version",
                v,
                "--sharing",
                "none",
                "--claims",
                &mig_1g,
            ],
            tmp.path(),
        );
        let (out, err) = text(&o);
        assert!(o.status.success(), "{v}: stdout:\n{out}\nstderr:\n{err}");
        out
    };
    let old = run("1.34");
    assert!(
        old.contains("Kubernetes 1.34 layout: each GPU's counter set in the slice of the devices"),
        "{old}"
    );
    let new = run("1.35");
    assert!(
        new.contains("Kubernetes 1.35+ layout: each GPU's counter set in a slice of its own"),
        "{new}"
    );
    // With shared devices on 1.35 the plugin warns that consumable capacity
    // is a gate off by default there: the user sees it, not only plugin.log.
    let o = carve(
        &[
            "simulate",
            "--gpus",
            "h100:1",
            "--kube-version",
            "1.35",
            "--sharing",
            "timeslice",
            "--claims",
            &claims_dir(&["whole-gpu"]),
        ],
        tmp.path(),
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout:\n{out}\nstderr:\n{err}");
    assert!(
        out.contains("plugin: warning:") && out.contains("consumable capacity"),
        "{out}"
    );
}

/// A directory holding copies of the named examples' claims.
fn claims_dir(names: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap().keep();
    for n in names {
        let src = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../examples")
            .join(n)
            .join("pod.yaml");
        std::fs::copy(src, dir.join(format!("{n}.yaml"))).unwrap();
    }
    dir.display().to_string()
}

#[test]
fn no_release_keeps_the_prepared_state_to_inspect() {
    let tmp = tempfile::tempdir().unwrap();
    let o = carve(
        &[
            "simulate",
            "--gpus",
            "h100:1",
            "--sharing",
            "none",
            "--claims",
            &claims_dir(&["mig-1g"]),
            "--no-release",
        ],
        tmp.path(),
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout:\n{out}\nstderr:\n{err}");
    assert!(
        out.contains("not released (--no-release): 1 claim(s) stay prepared"),
        "{out}"
    );
    assert!(!out.contains("no GPU instance left"), "{out}");
    let kept = out
        .lines()
        .find_map(|l| l.strip_prefix("kept "))
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("{out}"));
    let specs: Vec<_> = std::fs::read_dir(kept.join("cdi")).unwrap().collect();
    assert_eq!(specs.len(), 1, "the claim's CDI spec stays: {specs:?}");
    let state = std::fs::read_to_string(kept.join("sim").join("state.json"))
        .or_else(|_| {
            // The simulator's state file, wherever its config puts it.
            std::fs::read_dir(kept.join("sim"))
                .unwrap()
                .filter_map(Result::ok)
                .find(|e| e.file_name().to_string_lossy().contains("state"))
                .map(|e| std::fs::read_to_string(e.path()).unwrap())
                .ok_or(())
        })
        .unwrap_or_else(|()| panic!("no simulator state under {}", kept.display()));
    assert!(
        state.contains("gpu_instances") || state.contains("gpuInstances"),
        "{state}"
    );
    let _ = std::fs::remove_dir_all(&kept);
}

#[test]
fn examples_that_do_not_fit_the_users_node_fail_the_run_with_their_reason() {
    // A claim of the user's naming an H100 profile (1g.10gb) that an H200
    // lacks. (The built-in examples select by size and fit an H200 node:
    // tests/examples.rs.)
    let tmp = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    let mig_1g = std::fs::read_to_string(examples.join("mig-1g/pod.yaml"))
        .unwrap()
        .replace(
            "device.attributes[\"gpu.carve.dev\"].computeSlices == 1 &&",
            "device.attributes[\"gpu.carve.dev\"].profile == \"1g.10gb\" &&",
        );
    std::fs::write(dir.path().join("mig-1g.yaml"), mig_1g).unwrap();
    let o = carve(
        &[
            "simulate",
            "--gpus",
            "h200:8",
            "--claims",
            dir.path().to_str().unwrap(),
        ],
        tmp.path(),
    );
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "stdout:\n{out}\nstderr:\n{err}");
    let b = block(&out, "mig-1g");
    assert!(
        b.iter()
            .any(|l| l.contains("request selector #0 is false") && l.contains("1g.10gb")),
        "{b:#?}"
    );
    assert!(out.contains("\nnot prepared: "), "{out}");
    assert!(out.contains("mig-1g"), "{out}");
    assert!(out.contains("no GPU instance left"), "{out}");
}

/// Without root, the MPS examples still run: the plugin cannot mount a
/// unit's `/dev/shm` tmpfs (CAP_SYS_ADMIN), so simulate starts it with
/// `--mps-dev-shm none`, and the plugin's warning that real MPS clients
/// would not reach the server so is shown. Run as uid 65534 through
/// util-linux `setpriv` (skipped where the test itself is not root).
#[test]
fn simulate_without_root_runs_mps_without_the_units_tmpfs_and_says_so() {
    let root = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .map(|u| u.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false);
    if !root || Command::new("setpriv").arg("--version").output().is_err() {
        eprintln!("skipped: needs root and setpriv to run simulate as another user");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let o = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(env!("CARGO_BIN_EXE_carve"))
        .arg("simulate")
        .env("TMPDIR", tmp.path())
        .env_remove("CARVE_NVML_SIM_CONFIG")
        .env_remove("CARVE_NVML_SIM_FAULTS")
        .output()
        .expect("running setpriv");
    let (out, err) = text(&o);
    assert!(
        o.status.success(),
        "exit {}\nstdout:\n{out}\nstderr:\n{err}",
        o.status
    );
    assert!(
        out.contains("--mps-dev-shm none") && out.contains("real CUDA MPS clients cannot reach"),
        "the warning is shown: {out}"
    );
    for name in ["mps-share", "mig-mps"] {
        let b = block(&out, name).join("\n");
        assert!(!b.is_empty() && !b.contains("FAILED"), "{name}: {b}\n{out}");
    }
    assert!(out.contains("no MPS daemon left"), "{out}");
    assert_nothing_left(tmp.path());
}
