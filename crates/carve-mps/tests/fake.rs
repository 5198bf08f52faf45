//! The fake `nvidia-cuda-mps-control` rejects what NVIDIA documents the real
//! daemon to reject (one test per rule of the list at the end of
//! `../shared/reference/mps-v3.md`), and models sockets, routing, limits and
//! a server that never becomes `Ready`. Real processes and Unix sockets.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

const FAKE: &str = env!("CARGO_BIN_EXE_carve-fake-mps-control");
const GPU: &str = "GPU-11111111-2222-3333-4444-555555555555";

/// One fake daemon in a temp pipe directory; quit (and killed) on drop.
struct Daemon {
    tmp: tempfile::TempDir,
    env: Vec<(String, String)>,
    held: Vec<Child>,
}

impl Daemon {
    fn start(opts: &[&str], env: &[(&str, &str)]) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let d = Self {
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect(),
            tmp,
            held: vec![],
        };
        let o = d.run(opts);
        assert!(o.status.success(), "start {opts:?}: {}", text(&o));
        d
    }

    /// `-d -p 3 -m`, the daemon's owner root (as carve runs it).
    fn v3() -> Self {
        Self::start(&["-d", "-m", "-p", "3"], &[("FAKE_MPS_AS_UID", "0")])
    }

    fn pipe(&self) -> PathBuf {
        self.tmp.path().join("pipe")
    }

    fn cmd(&self) -> Command {
        let mut c = Command::new(FAKE);
        c.env("CUDA_MPS_PIPE_DIRECTORY", self.pipe())
            .env("CUDA_MPS_LOG_DIRECTORY", self.tmp.path().join("log"))
            .env("CUDA_VISIBLE_DEVICES", GPU)
            .env_remove("CUDA_MPS_PROTOCOL_VERSION")
            .env_remove("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
            .env_remove("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
        for (k, v) in &self.env {
            c.env(k, v);
        }
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        self.cmd().args(args).output().unwrap()
    }

    fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args);
        assert!(o.status.success(), "{args:?} failed: {}", text(&o));
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    /// Must fail; its output must name `why`.
    fn refused(&self, args: &[&str], why: &str) {
        let o = self.run(args);
        assert!(!o.status.success(), "{args:?} was accepted: {}", text(&o));
        assert!(text(&o).contains(why), "{args:?}: {}", text(&o));
    }

    /// A CUDA client with `CUDA_MPS_PIPE_DIRECTORY=dir`: where it landed.
    fn client(&self, dir: &Path, uid: u32, env: &[(&str, &str)]) -> Output {
        let mut c = self.cmd();
        c.env("CUDA_MPS_PIPE_DIRECTORY", dir)
            .args([carve_mps::fake::CUDA_CLIENT, &format!("--uid={uid}")]);
        for (k, v) in env {
            c.env(k, v);
        }
        c.output().unwrap()
    }

    fn landed(&self, dir: &Path, env: &[(&str, &str)]) -> String {
        let o = self.client(dir, 1000, env);
        assert!(o.status.success(), "client: {}", text(&o));
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    /// A client that stays connected (active) until killed.
    fn hold(&mut self, dir: &Path) -> u32 {
        let mut c = self.cmd();
        let mut child = c
            .env("CUDA_MPS_PIPE_DIRECTORY", dir)
            .args([carve_mps::fake::CUDA_CLIENT, "--uid=1000", "--hold"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        // Wait for its answer: then the daemon has recorded it.
        let mut out = child.stdout.take().unwrap();
        let mut buf = [0u8; 1];
        use std::io::Read;
        assert_eq!(out.read(&mut buf).unwrap(), 1, "held client got no answer");
        let pid = child.id();
        self.held.push(child);
        pid
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        for c in &mut self.held {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = self.run(&["-q"]);
    }
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn rule_1_server_create_takes_a_positional_name_or_a_uid() {
    let d = Daemon::v3();
    d.refused(
        &["server", "create", "--name=carve"],
        "unknown option --name",
    );
    d.refused(&["server", "create"], "positional <name> or --uid");
    d.refused(
        &["server", "create", "--allowed-devices=0"],
        "positional <name> or --uid",
    );
    d.ok(&["server", "create", "carve"]);
    d.ok(&["server", "create", "--uid=0"]);
    assert_eq!(d.ok(&["server", "get", "uid_0", "status"]), "Ready");
    d.refused(&["server", "create", "carve"], "exists");
}

#[test]
fn rule_2_names_are_lowercase_digits_underscores_at_most_64() {
    let d = Daemon::v3();
    let long = "a".repeat(65);
    for bad in [
        "claim-a.s1",
        "Carve",
        "a.b",
        "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0.0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0",
        long.as_str(),
    ] {
        d.refused(&["server", "create", bad], "[a-z0-9_]");
    }
    d.ok(&["server", "create", &"a".repeat(64)]);
    d.ok(&["server", "create", "carve"]);
    for bad in ["claim-a.s1", "u-a.s-a", long.as_str()] {
        d.refused(&["namespace", "create", bad, "--server=carve"], "[a-z0-9_]");
    }
    d.ok(&[
        "namespace",
        "create",
        "c_0123456789abcdef",
        "--server=carve",
    ]);
}

#[test]
fn rule_3_namespace_create_takes_only_server_and_set_needs_an_option() {
    let d = Daemon::v3();
    d.ok(&["server", "create", "carve"]);
    for opt in [
        "--cgroup=/sys/fs/cgroup/kubepods/pod-a",
        "--pinned-memory-limit=2048M",
        "--active-thread-percentage=10",
        "--name=ns",
    ] {
        d.refused(
            &["namespace", "create", "ns", "--server=carve", opt],
            "unknown option",
        );
    }
    d.refused(&["namespace", "create", "ns"], "--server=<s> is required");
    d.ok(&["namespace", "create", "ns", "--server=carve"]);
    d.refused(
        &["namespace", "set", "ns", "--server=carve"],
        "at least one option",
    );
    d.refused(&["server", "set", "carve"], "at least one option");
    d.ok(&[
        "namespace",
        "set",
        "ns",
        "--server=carve",
        "--pinned-memory-limit=2048M",
        "--active-thread-percentage=10",
    ]);
    assert_eq!(
        d.ok(&["namespace", "get", "ns", "carve", "pinned-memory-limit"]),
        "2048M"
    );
    assert_eq!(
        d.ok(&[
            "namespace",
            "get",
            "ns",
            "carve",
            "active-thread-percentage"
        ]),
        "10"
    );
}

#[test]
fn rule_4_memory_limits_are_a_bare_size_with_k_m_or_g() {
    let d = Daemon::v3();
    d.ok(&["server", "create", "carve"]);
    d.ok(&["namespace", "create", "ns", "--server=carve"]);
    let set = |v: &str| {
        vec![
            "namespace".to_string(),
            "set".into(),
            "ns".into(),
            "--server=carve".into(),
            format!("--pinned-memory-limit={v}"),
        ]
    };
    for bad in [
        &format!("{GPU}=2048M") as &str,
        "0=2G",
        "2048",
        "2048m",
        "2T",
        "G",
        "-1G",
    ] {
        let a = set(bad);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        d.refused(&a, "invalid memory limit");
    }
    for good in ["1024K", "2048M", "4G"] {
        let a = set(good);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        d.ok(&a);
    }
    for bad in ["0", "101", "x"] {
        d.refused(
            &[
                "namespace",
                "set",
                "ns",
                "--server=carve",
                &format!("--active-thread-percentage={bad}"),
            ],
            "1-100",
        );
    }
}

#[test]
fn rule_5_namespace_delete_is_positional_and_refuses_active_clients_without_force() {
    let mut d = Daemon::v3();
    d.ok(&["server", "create", "carve"]);
    d.ok(&["namespace", "create", "ns", "--server=carve"]);
    d.refused(
        &["namespace", "delete", "--name=ns", "--server=carve"],
        "unknown option --name",
    );
    let ns_dir = PathBuf::from(d.ok(&["namespace", "get", "ns", "carve", "pipe-directory"]));
    let pid = d.hold(&ns_dir);
    assert!(d.ok(&["client", "list"]).contains(&pid.to_string()));
    d.refused(
        &["namespace", "delete", "ns", "--server=carve"],
        "active clients",
    );
    d.refused(&["server", "delete", "carve"], "active clients");
    d.ok(&["namespace", "delete", "ns", "--server=carve", "--force"]);
    // --force terminated the client first.
    let c = d.held.last_mut().unwrap();
    let status = c.wait().unwrap();
    assert!(!status.success());
    assert!(!ns_dir.exists());
    d.refused(
        &["namespace", "get", "ns", "carve", "pipe-directory"],
        "not found",
    );
}

#[test]
fn rule_6_a_namespace_needs_an_existing_server_and_no_toml_is_taken_unchecked() {
    let d = Daemon::v3();
    d.refused(
        &["namespace", "create", "ns", "--server=nope"],
        "server nope not found",
    );
    let o = d.run(&["-d", "-p", "3", "-a", "/nonexistent.toml"]);
    assert!(!o.status.success(), "{}", text(&o));
}

#[test]
fn rule_7_another_uid_needs_a_root_daemon_in_multiuser_mode() {
    // Not multiuser: a client of another UID than the daemon's is refused.
    let d = Daemon::start(&["-d", "-p", "3"], &[("FAKE_MPS_AS_UID", "0")]);
    let o = d.client(&d.pipe(), 1000, &[]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("CUDA_ERROR_NOT_PERMITTED"),
        "{}",
        text(&o)
    );
    assert!(d.client(&d.pipe(), 0, &[]).status.success());
    // Multiuser, but the daemon not root: still refused [DYN].
    let d = Daemon::start(&["-d", "-m", "-p", "3"], &[("FAKE_MPS_AS_UID", "1000")]);
    let o = d.client(&d.pipe(), 2000, &[]);
    assert!(
        text(&o).contains("CUDA_ERROR_NOT_PERMITTED"),
        "{}",
        text(&o)
    );
    // Root and multiuser: accepted.
    let d = Daemon::v3();
    assert!(d.client(&d.pipe(), 1000, &[]).status.success());
}

#[test]
fn rule_8_multiuser_server_create_allows_only_uid_0_and_at_most_3_positionals() {
    let d = Daemon::v3();
    d.refused(&["server", "create", "a", "--uid=1000"], "only --uid=0");
    d.ok(&["server", "create", "a", "--uid=0"]);
    d.refused(
        &["namespace", "get", "a", "b", "c", "d"],
        "at most 3 positional",
    );
    d.refused(&["sm-partition", "list"], "not modelled");
    d.refused(&["nosuchmodule", "list"], "unknown module");
}

#[test]
fn the_main_socket_routes_by_uid_to_an_unlimited_server_and_a_namespace_socket_to_its_limits() {
    let d = Daemon::v3();
    d.ok(&[
        "server",
        "create",
        "carve",
        &format!("--allowed-devices={GPU}"),
    ]);
    d.ok(&[
        "server",
        "set",
        "carve",
        "--pinned-memory-limit=1G",
        "--active-thread-percentage=50",
    ]);
    d.ok(&["namespace", "create", "ns", "--server=carve"]);
    d.ok(&["namespace", "create", "bare", "--server=carve"]);
    d.ok(&[
        "namespace",
        "set",
        "ns",
        "--server=carve",
        "--pinned-memory-limit=2048M",
        "--active-thread-percentage=13",
    ]);
    let dir = |ns: &str| PathBuf::from(d.ok(&["namespace", "get", ns, "carve", "pipe-directory"]));
    assert_eq!(dir("ns"), d.pipe().join("carve").join("ns"));
    assert_eq!(dir("default"), d.pipe().join("carve"));
    // Main socket: UID routing to uid_1000, no limits.
    assert_eq!(
        d.landed(&d.pipe(), &[]),
        "server=uid_1000 namespace=default pinned=none atp=none"
    );
    assert!(d.ok(&["server", "list"]).contains("uid_1000"));
    // The server's socket: its default namespace with the server's limits.
    assert_eq!(
        d.landed(&dir("default"), &[]),
        "server=carve namespace=default pinned=1024M atp=50"
    );
    // A namespace socket: that namespace's limits only [DYN].
    assert_eq!(
        d.landed(&dir("ns"), &[]),
        "server=carve namespace=ns pinned=2048M atp=13"
    );
    assert_eq!(
        d.landed(&dir("bare"), &[]),
        "server=carve namespace=bare pinned=none atp=none"
    );
    // [ENV]: the namespace's percentage wins over the variable; the variable
    // can lower the pinned limit.
    assert_eq!(
        d.landed(
            &dir("ns"),
            &[
                ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100"),
                ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G")
            ]
        ),
        "server=carve namespace=ns pinned=1024M atp=13"
    );
    // [DYN]: one entry naming a device the client cannot see drops every
    // pinned limit, the namespace's too (why it is not `hard`).
    assert_eq!(
        d.landed(
            &dir("ns"),
            &[
                ("CUDA_VISIBLE_DEVICES", "0"),
                ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=2G,1=4G")
            ]
        ),
        "server=carve namespace=ns pinned=none atp=13"
    );
    // [DYN]: a wrong pipe directory: no MPS at all, silently.
    assert_eq!(
        d.landed(&d.tmp.path().join("nowhere"), &[]),
        "server=none namespace=none pinned=none atp=none"
    );
    // Issue #467 (NVIDIA/k8s-device-plugin): the client needs the server's
    // cuda.shm file in its own /dev/shm; one whose /dev/shm is another
    // tmpfs (a container's own) does not get to the server.
    let elsewhere = d.tmp.path().join("container-shm");
    std::fs::create_dir_all(&elsewhere).unwrap();
    let o = d.client(&dir("ns"), 1000, &[]);
    assert!(o.status.success(), "{}", text(&o));
    let mut c = d.cmd();
    let o = c
        .env("CUDA_MPS_PIPE_DIRECTORY", dir("ns"))
        .args([
            carve_mps::fake::CUDA_CLIENT,
            "--uid=1000",
            &format!("--dev-shm={}", elsewhere.display()),
        ])
        .output()
        .unwrap();
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("shared memory cuda.shm."), "{}", text(&o));
}

#[test]
fn a_server_on_a_device_the_daemon_cannot_see_is_created_but_never_ready() {
    let d = Daemon::v3();
    // [DYN]: success, the server exits, it is not listed.
    d.ok(&[
        "server",
        "create",
        "carve",
        "--allowed-devices=GPU-99999999-9999-9999-9999-999999999999",
    ]);
    assert!(!d.ok(&["server", "list"]).contains("carve"));
    d.refused(&["server", "get", "carve", "status"], "not found");
    let log = std::fs::read_to_string(d.tmp.path().join("log/carve/server.log")).unwrap();
    assert!(log.contains("no CUDA-capable device"), "{log}");
    // The knobs: one name exits; every server stays in another status.
    let d = Daemon::start(
        &["-d", "-m", "-p", "3"],
        &[("FAKE_MPS_AS_UID", "0"), ("FAKE_MPS_SERVER_EXITS", "carve")],
    );
    d.ok(&["server", "create", "carve"]);
    d.refused(&["server", "get", "carve", "status"], "not found");
    let d = Daemon::start(
        &["-d", "-m", "-p", "3"],
        &[
            ("FAKE_MPS_AS_UID", "0"),
            ("FAKE_MPS_SERVER_STATUS", "Starting"),
        ],
    );
    d.ok(&["server", "create", "carve"]);
    assert_eq!(d.ok(&["server", "get", "carve", "status"]), "Starting");
}

#[test]
fn help_with_p_3_lists_server_and_namespace_and_a_v2_binary_rejects_it() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut c = Command::new(FAKE);
        c.env("CUDA_MPS_PIPE_DIRECTORY", tmp.path())
            .env_remove("CUDA_MPS_PROTOCOL_VERSION")
            .args(args);
        for (k, v) in env {
            c.env(k, v);
        }
        c.output().unwrap()
    };
    let o = run(&["-p", "3", "-h"], &[]);
    assert!(o.status.success());
    let h = String::from_utf8_lossy(&o.stdout);
    assert!(
        h.contains("  server\n") && h.contains("  namespace\n"),
        "{h}"
    );
    let v2 = String::from_utf8_lossy(&run(&["-h"], &[]).stdout).into_owned();
    assert!(!v2.contains("namespace"), "{v2}");
    // [IF]: the variable wins over -p.
    let o = run(&["-p", "3", "-h"], &[("CUDA_MPS_PROTOCOL_VERSION", "2")]);
    assert!(!String::from_utf8_lossy(&o.stdout).contains("namespace"));
    let o = run(&["-p", "3", "-h"], &[("FAKE_MPS_MAX_PROTOCOL", "2")]);
    assert!(!o.status.success());
    assert!(text(&o).contains("unknown option -p 3"), "{}", text(&o));
}

#[test]
fn a_call_follows_the_running_daemons_protocol() {
    let d = Daemon::start(&["-d"], &[]);
    d.refused(&["server", "create", "carve"], "protocol 2");
    let v3 = Daemon::v3();
    let mut c = v3.cmd();
    let o = c
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        o.stdin
            .as_ref()
            .unwrap()
            .write_all(b"get_server_list\n")
            .unwrap();
    }
    let o = o.wait_with_output().unwrap();
    assert!(!o.status.success());
    assert!(text(&o).contains("v2 command"), "{}", text(&o));
    // A second daemon on the same pipe directory is refused.
    let o = v3.run(&["-d", "-p", "3"]);
    assert!(!o.status.success());
}

fn v2(d: &Daemon, cmds: &str) -> Output {
    use std::io::Write;
    let mut c = d
        .cmd()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(cmds.as_bytes()).unwrap();
    c.wait_with_output().unwrap()
}

fn v2_ok(d: &Daemon, cmds: &str) -> String {
    let o = v2(d, cmds);
    assert!(o.status.success(), "{cmds}: {}", text(&o));
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

#[test]
fn v2_defaults_reach_only_later_servers_and_per_server_commands_the_running_one() {
    let d = Daemon::start(&["-d"], &[("FAKE_MPS_AS_UID", "1000")]);
    assert_eq!(v2_ok(&d, "get_server_list\n"), "");
    v2_ok(
        &d,
        &format!(
            "set_default_device_pinned_mem_limit {GPU} 2048M\nset_default_active_thread_percentage 20\n"
        ),
    );
    // The first client starts the server with the defaults of now.
    assert!(d.landed(&d.pipe(), &[]).ends_with("pinned=2048M atp=20"));
    let pid = v2_ok(&d, "get_server_list\n");
    assert!(!pid.is_empty());
    // [V2]: later defaults do not reach the running server.
    v2_ok(
        &d,
        &format!(
            "set_default_device_pinned_mem_limit {GPU} 8G\nset_default_active_thread_percentage 60\n"
        ),
    );
    assert!(d.landed(&d.pipe(), &[]).ends_with("pinned=2048M atp=20"));
    // Per-server commands do, for clients created afterwards.
    v2_ok(
        &d,
        &format!(
            "set_device_pinned_mem_limit {pid} {GPU} 8192M\nset_active_thread_percentage {pid} 60\n"
        ),
    );
    assert!(d.landed(&d.pipe(), &[]).ends_with("pinned=8192M atp=60"));
    assert_eq!(
        v2_ok(&d, &format!("get_active_thread_percentage {pid}\n")),
        "60"
    );
    // Bad values and unknown servers are refused.
    for bad in [
        format!("set_device_pinned_mem_limit {pid} {GPU} 8T\n"),
        format!("set_device_pinned_mem_limit 1 {GPU} 8G\n"),
        format!("set_active_thread_percentage {pid} 0\n"),
        "set_default_device_pinned_mem_limit 0 12\n".to_string(),
        "no_such_command\n".to_string(),
    ] {
        assert!(!v2(&d, &bad).status.success(), "{bad}");
    }
}
