//! A test double of `nvidia-cuda-mps-control`, for tests and `carve simulate`
//! on machines without NVIDIA drivers. It is not MPS: it starts no server
//! process, limits nothing and touches no GPU. It models what NVIDIA documents
//! of the control daemon (`../shared/reference/mps-v3.md`; the tags below name
//! the page of each rule: [IF] the v3 interface, [NS] namespaces, [CT] common
//! tasks, [QS] quick start, [ENV] environment variables, [V2] the legacy
//! interface, [ARCH] architecture, [LOG] logging, [DYN] NVIDIA Dynamo's MPS
//! guide with its measured behaviour), and REJECTS what the real daemon
//! rejects, so a test of carve can fail where the real daemon would.
//!
//! Two ways to run it: the `carve-fake-mps-control` binary of this crate, and
//! the `carve` binary invoked through a link named [`PROGRAM`] (`carve
//! simulate` does that). Both call [`run`].
//!
//! # Invocations
//! - `-d` / `-f` with `-p <2|3>` and `-m`: start the daemon (background /
//!   foreground) [IF]. `CUDA_MPS_PROTOCOL_VERSION` wins over `-p` [IF]; the
//!   default protocol is 2 [IF]. A second daemon on one pipe directory is
//!   refused. The daemon writes `nvidia-cuda-mps-control.pid` in
//!   `CUDA_MPS_PIPE_DIRECTORY` [ARCH] and listens on `<pipe>/control`.
//! - `-h` (with `-p 3`: lists the modules, `server` and `namespace` among
//!   them, the documented v3 test [DYN]); `-p 3` on a v2-only binary is an
//!   unknown option (knob `FAKE_MPS_MAX_PROTOCOL=2`).
//! - `-q`: quit [IF]. No arguments: v2 commands on stdin [V2]. Otherwise a v3
//!   verb `<module> <verb> [positional…] [--key=value|key=value…] [--flag…]`
//!   [IF]. A call follows the running daemon's protocol [IF]: v3 verbs to a v2
//!   daemon fail, and v2 commands to a v3 daemon.
//! - `--fake-cuda-client [--uid=<n>] [--dev-shm=<dir>] [--hold]`: NOT a real
//!   option; models a CUDA process initialising: it connects to
//!   `$CUDA_MPS_PIPE_DIRECTORY/control` (as a pod would through its mounted
//!   directory), prints where it landed (`server=… namespace=… pinned=…
//!   atp=…`) with the limits it gets, and with `--hold` stays alive as an
//!   active client until killed. Without a socket there it prints
//!   `server=none` and succeeds: a client with a wrong pipe directory
//!   silently runs without MPS on the whole GPU [DYN]. `--dev-shm` is the
//!   client's `/dev/shm` as its container has it (default `/dev/shm`): the
//!   client fails unless the server's `cuda.shm.*` file is there (below).
//!
//! # What it models (v3)
//! - Sockets: `<pipe>/control` (main, UID-routed), `<pipe>/<server>/control`
//!   (the server's `default` namespace) and `<pipe>/<server>/<ns>/control`
//!   [NS]; each server directory also holds `log` [IF]; logs in
//!   `$CUDA_MPS_LOG_DIRECTORY/control.log` and `<server>/server.log` [LOG].
//! - The main socket routes a client by UID to a server `uid_<uid>`, created
//!   on first use, with no limits [CT], [QS], [NS]: a test sees a client that
//!   landed outside its namespace.
//! - A named namespace gets only its own limits, not the server's [DYN]; a
//!   namespace's active-thread percentage overrides the client's variable
//!   [ENV]; `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` can only lower the pinned limit
//!   [ENV], and one entry naming a device the client cannot see drops every
//!   pinned limit, the namespace's included [DYN] (why carve publishes the
//!   namespace limit as `client`, not `hard`).
//! - A client of another UID than the daemon's is refused
//!   (`CUDA_ERROR_NOT_PERMITTED`) unless the daemon runs as root with `-m`
//!   [DYN], [IF]. The daemon's UID is the process's, or `FAKE_MPS_AS_UID`.
//! - `/dev/shm`: each server, once started, keeps a 4 KiB
//!   `cuda.shm.<uid>.<n>.1` file in the daemon's `/dev/shm` (the literal
//!   path, so in the daemon's mount namespace), and a client needs that file
//!   in its own `/dev/shm` (NVIDIA/k8s-device-plugin issue #467: such a file
//!   "is required when using MPS" and the path is fixed; NVIDIA's drivers
//!   give the daemon and the clients one tmpfs as `/dev/shm` for it, see
//!   [`crate::shm`]). What a real client does without it is not documented;
//!   the fake's client fails. The file goes when its server does.
//! - A `server create` whose `--allowed-devices` names a device the daemon
//!   cannot see (its `CUDA_VISIBLE_DEVICES`) succeeds, but the server exits
//!   and drops out of `server list` [DYN]. Knob `FAKE_MPS_SERVER_EXITS=<name>`
//!   does the same for one server name; `FAKE_MPS_SERVER_STATUS=<status>`
//!   leaves created servers in that status instead of `Ready`.
//!
//! # Rejected (the list at the end of mps-v3.md)
//! 1. `server create --name=…`, and `server create` with neither a positional
//!    name nor `--uid` [IF 1.3].
//! 2. Server and namespace names outside `[a-z0-9_]` or longer than 64 [IF 1.2].
//! 3. Any `namespace create` option but `--server=` (release 615 [IF 1.4]:
//!    `--cgroup`, `--pinned-memory-limit`, `--active-thread-percentage`), and
//!    `namespace set` / `server set` without an option [IF].
//! 4. A memory limit other than `<int>K|M|G` (so `<dev>=<size>`) [IF 1.2].
//! 5. `namespace delete --name=…`, and `namespace delete` / `server delete`
//!    with active clients and no `--force` [IF].
//! 6. `namespace create` for a server that does not exist [IF]. (`-a` is
//!    refused as not modelled, so no TOML is accepted unchecked.)
//! 7. A client of another UID without `-m` (above).
//! 8. In multiuser mode, `server create --uid=<n>` with `n` other than 0 [IF].
//!    More than 3 positional arguments; unknown options; an active-thread
//!    percentage outside 1–100 [IF].
//!
//! Not modelled: release 620's cgroup routing and TOML keys (their CLI is not
//! known [NS620]), `-a`, the `device`, `sm-partition`, `feature`, `memacct`
//! and `context-share` modules (refused), the real daemon's output formats
//! (the fake's are its own), and v2's wait for another UID's server (refused
//! at once instead of blocking).
//!
//! # v2 [V2], [ARCH]
//! One server at a time, started by the first client, for that client's UID;
//! it takes the `set_default_*` values current when it starts (later
//! `set_default_*` calls do not reach it). `get_server_list` prints server
//! pids; `set_device_pinned_mem_limit <PID> <dev> <value>` and
//! `set_active_thread_percentage <PID> <pct>` change a running server, for
//! clients created afterwards. A client of another UID is refused while the
//! server has clients.
//!
//! # Fault knobs
//! `FAKE_MPS_CRASH_ON=<text>`: a request containing it kills the daemon
//! without cleanup (also the v2 command `crash`). `FAKE_MPS_REJECT=<text>`: a
//! request containing it fails without effect.
//!
//! Every request is recorded in [`LOG`] (`fake-mps-control.log`) in the main
//! pipe directory: `start …`, `env …`, `cmd <v2 command>`, `verb <v3 args>`,
//! `client …`, `quit`.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The program name under which the `carve` binary runs the fake.
pub const PROGRAM: &str = "carve-fake-mps-control";
/// The fake's record of requests, in the main pipe directory.
pub const LOG: &str = "fake-mps-control.log";
/// The option that makes the fake act as a CUDA client (not a real option).
pub const CUDA_CLIENT: &str = "--fake-cuda-client";
const PID_FILE: &str = crate::control::PID_FILE;
const SOCKET: &str = crate::control::CONTROL_FILE;

fn pipe_dir() -> PathBuf {
    // [IF 1.1]: $CUDA_MPS_PIPE_DIRECTORY, else /run/nvidia-mps for root and
    // /tmp/nvidia-mps for others.
    std::env::var_os("CUDA_MPS_PIPE_DIRECTORY").map_or_else(
        || {
            PathBuf::from(if my_uid() == 0 {
                "/run/nvidia-mps"
            } else {
                "/tmp/nvidia-mps"
            })
        },
        PathBuf::from,
    )
}

/// The real UID of this process, from `/proc/self/status`.
fn my_uid() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|r| r.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(u32::MAX)
}

fn log(dir: &Path, line: &str) {
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(LOG))
    {
        let _ = writeln!(f, "{line}");
    }
}

/// Top-level options [IF 1.1].
#[derive(Default)]
struct Top {
    help: bool,
    daemon: bool,
    foreground: bool,
    multiuser: bool,
    quit: bool,
    version: bool,
    protocol: Option<String>,
    rest: Vec<String>,
}

fn parse_top(args: &[String]) -> Result<Top, String> {
    let mut t = Top::default();
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        match a {
            "-h" | "--help" => t.help = true,
            "-d" | "--daemon" => t.daemon = true,
            "-f" | "--foreground" => t.foreground = true,
            "-m" | "--multiuser" => t.multiuser = true,
            "-q" | "--quit" => t.quit = true,
            "-v" | "--version" => t.version = true,
            "-p" | "--protocol" => {
                i += 1;
                t.protocol = Some(args.get(i).cloned().ok_or("-p needs a value")?);
            }
            "-a" | "--apply" => return Err("-a/--apply is not modelled by the fake".into()),
            _ if a.starts_with('-') && !a.starts_with("--fake") => {
                return Err(format!("unknown option {a}"));
            }
            _ => {
                t.rest = args[i..].to_vec();
                break;
            }
        }
        i += 1;
    }
    Ok(t)
}

/// The fake's binaries' entry (the command line after the program name):
/// as `--carve-mps-exec …` the MPS launcher
/// ([`crate::launcher::exec_main`], what the `carve` binary is in the plugin, so
/// tests can use a fake's binary as [`crate::MpsConfig::shm_launcher`]),
/// otherwise the fake ([`run`]).
#[must_use]
pub fn main(args: &[std::ffi::OsString]) -> ExitCode {
    if args
        .first()
        .is_some_and(|a| a == crate::launcher::EXEC_FLAG)
    {
        return crate::launcher::exec_main(&args[1..]);
    }
    let args: Vec<String> = args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    run(&args)
}

/// Run the fake with `args` (the command line after the program name).
#[must_use]
pub fn run(args: &[String]) -> ExitCode {
    let max: u32 = std::env::var("FAKE_MPS_MAX_PROTOCOL")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    if args.first().map(String::as_str) == Some(CUDA_CLIENT) {
        return cuda_client(&args[1..]);
    }
    let t = match parse_top(args) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("nvidia-cuda-mps-control: {e}");
            return ExitCode::from(2);
        }
    };
    // [IF 1.1]: -p selects the protocol; CUDA_MPS_PROTOCOL_VERSION wins over
    // it; 2 is the default.
    let asked = std::env::var("CUDA_MPS_PROTOCOL_VERSION")
        .ok()
        .or_else(|| t.protocol.clone());
    let protocol = match asked.as_deref() {
        None => 2,
        Some(p) => match p.parse::<u32>() {
            Ok(n) if (2..=max).contains(&n) => n,
            _ => {
                eprintln!("nvidia-cuda-mps-control: unknown option -p {p}");
                return ExitCode::from(2);
            }
        },
    };
    if t.version {
        println!("carve-fake-mps-control (a test double), protocols 2..={max}");
        return ExitCode::SUCCESS;
    }
    if t.help {
        // [IF 1.1]: a later call follows a running daemon's protocol.
        let p = running_protocol().unwrap_or(protocol);
        print!("{}", top_help(p));
        return ExitCode::SUCCESS;
    }
    if t.daemon || t.foreground {
        if !t.rest.is_empty() {
            eprintln!("nvidia-cuda-mps-control: unexpected arguments {:?}", t.rest);
            return ExitCode::from(2);
        }
        if running_protocol().is_some() {
            eprintln!("An instance of this daemon is already running");
            return ExitCode::from(1);
        }
        return if t.daemon {
            launch(protocol, t.multiuser)
        } else {
            serve(protocol, t.multiuser)
        };
    }
    if t.quit {
        return client("v3", &["-q".to_string()]);
    }
    if t.rest.is_empty() {
        let mut s = String::new();
        if std::io::stdin().read_to_string(&mut s).is_err() {
            return ExitCode::from(1);
        }
        return client("v2", &s.lines().map(str::to_string).collect::<Vec<_>>());
    }
    client("v3", &t.rest)
}

fn top_help(protocol: u32) -> String {
    let mut s = String::from(
        "Usage: nvidia-cuda-mps-control [options] [<module> <verb> [args]]\n\
         Options:\n  -h, --help\n  -d, --daemon\n  -f, --foreground\n  -m, --multiuser\n  \
         -a, --apply <file>\n  -p, --protocol <2|3>\n  -q, --quit\n  -v, --version\n",
    );
    if protocol == 3 {
        s.push_str("Modules:\n");
        for m in MODULES {
            s.push_str(&format!("  {m}\n"));
        }
    } else {
        s.push_str("Commands are read from stdin (protocol 2).\n");
    }
    s
}

/// [IF 1.2].
const MODULES: [&str; 8] = [
    "server",
    "namespace",
    "client",
    "device",
    "sm-partition",
    "feature",
    "memacct",
    "context-share",
];

/// The protocol of a daemon already serving this pipe directory.
fn running_protocol() -> Option<u32> {
    let dir = pipe_dir();
    let pid: u32 = std::fs::read_to_string(dir.join(PID_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    if !pid_alive(pid) {
        return None;
    }
    let mut c = UnixStream::connect(dir.join(SOCKET)).ok()?;
    c.write_all(b"protocol\n0\n").ok()?;
    c.shutdown(std::net::Shutdown::Write).ok()?;
    let mut s = String::new();
    c.read_to_string(&mut s).ok()?;
    s.lines().next()?.trim().parse().ok()
}

fn pid_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rfind(')')
            .and_then(|i| s[i + 1..].split_whitespace().next())
            .is_some_and(|st| st != "Z" && st != "X")
    })
}

/// `-d`: start the daemon detached and wait until it is ready.
fn launch(protocol: u32, multiuser: bool) -> ExitCode {
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("current_exe: {e}");
            return ExitCode::from(1);
        }
    };
    let mut cmd = Command::new(exe);
    // Keep argv[0]: through a link named PROGRAM, current_exe() is the binary
    // behind it, which needs the name to run the fake again.
    if let Some(arg0) = std::env::args_os().next() {
        cmd.arg0(arg0);
    }
    cmd.args(["-f", "-p", &protocol.to_string()]);
    if multiuser {
        cmd.arg("-m");
    }
    let mut child = match cmd
        .env_remove("CUDA_MPS_PROTOCOL_VERSION")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("spawn daemon: {e}");
            return ExitCode::from(1);
        }
    };
    let pid_file = pipe_dir().join(PID_FILE);
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(Some(s)) = child.try_wait() {
            eprintln!("daemon exited during start: {s}");
            return ExitCode::from(1);
        }
        if std::fs::read_to_string(&pid_file).is_ok_and(|p| p.trim() == child.id().to_string()) {
            return ExitCode::SUCCESS;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    eprintln!("daemon not ready");
    ExitCode::from(1)
}

/// Limits of one namespace (or of a server's `default` namespace).
#[derive(Clone, Debug, Default)]
struct Limits {
    /// As given (`2048M`), and in bytes.
    pinned: Option<(String, u64)>,
    atp: Option<u32>,
    priority: Option<u32>,
}

#[derive(Debug, Default)]
struct Ns {
    limits: Limits,
    /// Pids of the clients that connected to it.
    clients: Vec<u32>,
}

impl Ns {
    fn active(&mut self) -> Vec<u32> {
        self.clients.retain(|p| pid_alive(*p));
        self.clients.clone()
    }
}

#[derive(Debug)]
struct Server {
    uid: u32,
    pid: u32,
    /// Its `cuda.shm.*` file in the daemon's `/dev/shm`.
    shm: Option<PathBuf>,
    status: String,
    allowed: String,
    /// Includes `default`.
    namespaces: BTreeMap<String, Ns>,
}

#[derive(Debug, Default)]
struct V2Server {
    pid: u32,
    shm: Option<PathBuf>,
    uid: u32,
    mem: BTreeMap<String, String>,
    pct: Option<u32>,
    clients: Vec<u32>,
}

struct State {
    protocol: u32,
    multiuser: bool,
    uid: u32,
    pipe: PathBuf,
    log_dir: Option<PathBuf>,
    /// The daemon's `CUDA_VISIBLE_DEVICES` entries; `None`: every device.
    visible: Option<Vec<String>>,
    servers: BTreeMap<String, Server>,
    next_pid: u32,
    v2_mem: BTreeMap<String, String>,
    v2_pct: Option<u32>,
    v2_server: Option<V2Server>,
}

type Shared = Arc<Mutex<State>>;

/// `-f`: the daemon.
fn serve(protocol: u32, multiuser: bool) -> ExitCode {
    let dir = pipe_dir();
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("create {}: {e}", dir.display());
        return ExitCode::from(1);
    }
    let sock = dir.join(SOCKET);
    let _ = std::fs::remove_file(&sock);
    let listener = match UnixListener::bind(&sock) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("bind {}: {e}", sock.display());
            return ExitCode::from(1);
        }
    };
    let pid = std::process::id();
    let uid = std::env::var("FAKE_MPS_AS_UID")
        .ok()
        .and_then(|u| u.parse().ok())
        .unwrap_or_else(my_uid);
    log(
        &dir,
        &format!("start pid={pid} protocol={protocol} multiuser={multiuser} uid={uid}"),
    );
    let mut env: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| k.starts_with("CUDA_"))
        .collect();
    env.sort();
    for (k, v) in &env {
        log(&dir, &format!("env {k}={v}"));
    }
    let log_dir = std::env::var_os("CUDA_MPS_LOG_DIRECTORY").map(PathBuf::from);
    if let Some(l) = &log_dir {
        let _ = std::fs::create_dir_all(l);
        let _ = std::fs::write(l.join("control.log"), format!("started {pid}\n"));
    }
    let visible = std::env::var("CUDA_VISIBLE_DEVICES")
        .ok()
        .map(|v| v.split(',').map(str::to_string).collect());
    let st: Shared = Arc::new(Mutex::new(State {
        protocol,
        multiuser,
        uid,
        pipe: dir.clone(),
        log_dir,
        visible,
        servers: BTreeMap::new(),
        next_pid: 40_000,
        v2_mem: BTreeMap::new(),
        v2_pct: None,
        v2_server: None,
    }));
    let _ = SHARED.set(st.clone());
    let tmp = dir.join(format!("{PID_FILE}.tmp"));
    if std::fs::write(&tmp, format!("{pid}\n")).is_err()
        || std::fs::rename(&tmp, dir.join(PID_FILE)).is_err()
    {
        return ExitCode::from(1);
    }
    let crash_on = std::env::var("FAKE_MPS_CRASH_ON").ok();
    let reject = std::env::var("FAKE_MPS_REJECT").ok();
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        let mut req = String::new();
        if conn.read_to_string(&mut req).is_err() {
            continue;
        }
        if crash_on.as_deref().is_some_and(|c| req.contains(c)) {
            log(&dir, &format!("crash on {:?}", req.trim()));
            crash();
        }
        if reject.as_deref().is_some_and(|r| req.contains(r)) {
            log(&dir, &format!("reject {:?}", req.trim()));
            let _ = write!(conn, "rejected on request\n#status 1\n");
            continue;
        }
        let (out, status, quit) = handle(&st, &req, None);
        // Logged before the answer: a client that saw the quit succeed
        // finds it in the log.
        if quit {
            log(&dir, "quit");
        }
        let _ = write!(conn, "{out}\n#status {status}\n");
        drop(conn);
        if quit {
            // [IF 1.1]: -q stops the daemon and all servers.
            let st = st.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            for (name, s) in &st.servers {
                let _ = std::fs::remove_dir_all(dir.join(name));
                remove_shm(s.shm.as_ref());
            }
            remove_shm(st.v2_server.as_ref().and_then(|s| s.shm.as_ref()));
            let _ = std::fs::remove_file(dir.join(PID_FILE));
            let _ = std::fs::remove_file(&sock);
            return ExitCode::SUCCESS;
        }
    }
    ExitCode::SUCCESS
}

/// One request: `<kind>\n<caller uid>\n<payload…>`. `route` is the socket it
/// came in on: `None` for the main socket, `Some((server, ns))` otherwise.
fn handle(st: &Shared, req: &str, route: Option<(&str, &str)>) -> (String, i32, bool) {
    let mut lines = req.lines();
    let kind = lines.next().unwrap_or("");
    let uid: u32 = lines
        .next()
        .and_then(|u| u.parse().ok())
        .unwrap_or(u32::MAX);
    let mut st = st.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = st.pipe.clone();
    let r = match (kind, route) {
        ("protocol", None) => Ok(st.protocol.to_string()),
        ("cuda", _) => {
            let f: Vec<&str> = lines.collect();
            cuda_connect(&mut st, uid, &f, route)
        }
        ("v2", None) => {
            let mut out = String::new();
            let mut quit = false;
            for cmd in lines.map(str::trim).filter(|l| !l.is_empty()) {
                log(&dir, &format!("cmd {cmd}"));
                if cmd == "crash" {
                    crash();
                }
                match v2(&mut st, cmd) {
                    Ok(o) => {
                        if !o.is_empty() {
                            out.push_str(&o);
                            out.push('\n');
                        }
                    }
                    Err(e) => return (out + &e, 1, false),
                }
                if cmd == "quit" {
                    quit = true;
                    break;
                }
            }
            return (out.trim_end().to_string(), 0, quit);
        }
        ("v3", None) => {
            let args: Vec<&str> = lines
                .next()
                .unwrap_or("")
                .split('\u{1f}')
                .filter(|s| !s.is_empty())
                .collect();
            log(&dir, &format!("verb {}", args.join(" ")));
            if args == ["-q"] {
                return (String::new(), 0, true);
            }
            if st.protocol != 3 {
                Err(format!(
                    "the running daemon speaks protocol {} [IF]: {:?} needs 3",
                    st.protocol,
                    args.join(" ")
                ))
            } else {
                v3(&mut st, uid, &args)
            }
        }
        (_, Some(_)) => Err("this socket accepts CUDA clients only".into()),
        _ => Err("bad request".into()),
    };
    match r {
        Ok(o) => (o, 0, false),
        Err(e) => (e, 1, false),
    }
}

// ---------------------------------------------------------------- v2 [V2]

/// `<int>G|M` [V2 1.11].
fn v2_value(v: &str) -> Result<(), String> {
    let (n, unit) = v.split_at(v.len().saturating_sub(1));
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) || !matches!(unit, "M" | "G") {
        return Err(format!(
            "Invalid memory limit {v}: want <integer>G or <integer>M"
        ));
    }
    Ok(())
}

fn v2_pct(p: &str) -> Result<u32, String> {
    match p.parse::<u32>() {
        Ok(p) if (1..=100).contains(&p) => Ok(p),
        _ => Err(format!("Invalid active thread percentage {p}")),
    }
}

fn v2(st: &mut State, cmd: &str) -> Result<String, String> {
    if st.protocol != 2 {
        return Err(format!(
            "the running daemon speaks protocol {}: {cmd:?} is a v2 command",
            st.protocol
        ));
    }
    let w: Vec<&str> = cmd.split_whitespace().collect();
    let server = |st: &mut State, pid: &str| -> Result<(), String> {
        match &st.v2_server {
            Some(s) if s.pid.to_string() == pid => Ok(()),
            _ => Err(format!("Server {pid} not found")),
        }
    };
    match w.as_slice() {
        ["quit"] => Ok(String::new()),
        ["get_server_list"] => Ok(st
            .v2_server
            .as_ref()
            .map(|s| s.pid.to_string())
            .unwrap_or_default()),
        // [V2]: defaults reach only servers started later.
        ["set_default_device_pinned_mem_limit", dev, v] => {
            v2_value(v)?;
            st.v2_mem.insert((*dev).to_string(), (*v).to_string());
            Ok(String::new())
        }
        ["get_default_device_pinned_mem_limit", dev] => {
            Ok(st.v2_mem.get(*dev).cloned().unwrap_or_else(|| "0".into()))
        }
        ["set_default_active_thread_percentage", p] => {
            st.v2_pct = Some(v2_pct(p)?);
            Ok(p.to_string())
        }
        ["get_default_active_thread_percentage"] => Ok(st.v2_pct.unwrap_or(100).to_string()),
        // [V2]: per running server, for its clients created afterwards.
        ["set_device_pinned_mem_limit", pid, dev, v] => {
            server(st, pid)?;
            v2_value(v)?;
            if let Some(s) = &mut st.v2_server {
                s.mem.insert((*dev).to_string(), (*v).to_string());
            }
            Ok(String::new())
        }
        ["get_device_pinned_mem_limit", pid, dev] => {
            server(st, pid)?;
            Ok(st
                .v2_server
                .as_ref()
                .and_then(|s| s.mem.get(*dev).cloned())
                .unwrap_or_else(|| "0".into()))
        }
        ["set_active_thread_percentage", pid, p] => {
            server(st, pid)?;
            let p = v2_pct(p)?;
            if let Some(s) = &mut st.v2_server {
                s.pct = Some(p);
            }
            Ok(p.to_string())
        }
        ["get_active_thread_percentage", pid] => {
            server(st, pid)?;
            Ok(st
                .v2_server
                .as_ref()
                .and_then(|s| s.pct)
                .unwrap_or(100)
                .to_string())
        }
        _ => Err(format!("Unknown command {cmd:?}")),
    }
}

// ---------------------------------------------------------------- v3 [IF]

/// Parsed `<module> <verb>` arguments [IF 1.2].
struct Args<'a> {
    pos: Vec<&'a str>,
    kv: BTreeMap<&'a str, &'a str>,
    flags: Vec<&'a str>,
}

fn parse_args<'a>(args: &[&'a str]) -> Result<Args<'a>, String> {
    let mut a = Args {
        pos: vec![],
        kv: BTreeMap::new(),
        flags: vec![],
    };
    for x in args {
        let body = x.strip_prefix("--");
        match (body, x.split_once('=')) {
            (Some(b), _) => match b.split_once('=') {
                Some((k, v)) => {
                    a.kv.insert(k, v);
                }
                None => a.flags.push(b),
            },
            // [IF 1.2]: `key=value` without dashes is accepted too.
            (None, Some((k, v))) => {
                a.kv.insert(k, v);
            }
            (None, None) => a.pos.push(x),
        }
    }
    if a.pos.len() > 3 {
        return Err(format!(
            "at most 3 positional arguments [IF], got {:?}",
            a.pos
        ));
    }
    Ok(a)
}

impl Args<'_> {
    /// Reject options outside `keys` and flags outside `flags`.
    fn only(&self, verb: &str, keys: &[&str], flags: &[&str]) -> Result<(), String> {
        if let Some(k) = self.kv.keys().find(|k| !keys.contains(k)) {
            return Err(format!("{verb}: unknown option --{k} [IF]"));
        }
        if let Some(f) = self.flags.iter().find(|f| !flags.contains(f)) {
            return Err(format!("{verb}: unknown flag --{f} [IF]"));
        }
        Ok(())
    }

    fn name(&self, verb: &str, i: usize, what: &str) -> Result<String, String> {
        let n = self
            .pos
            .get(i)
            .ok_or_else(|| format!("{verb}: missing positional <{what}> [IF]"))?;
        check_name(n)?;
        Ok((*n).to_string())
    }
}

/// [IF 1.2]: lowercase letters, digits and underscores, at most 64.
fn check_name(n: &str) -> Result<(), String> {
    if n.is_empty()
        || n.len() > 64
        || !n
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        return Err(format!("invalid name {n:?}: want 1-64 of [a-z0-9_] [IF]"));
    }
    Ok(())
}

/// [IF 1.2]: `<int>K|M|G`; bytes.
fn memory(v: &str) -> Result<u64, String> {
    let bad = || format!("invalid memory limit {v:?}: want <integer>K, M or G [IF]");
    let (n, unit) = v.split_at(v.len().saturating_sub(1));
    let shift = match unit {
        "K" => 10,
        "M" => 20,
        "G" => 30,
        _ => return Err(bad()),
    };
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    n.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .ok_or_else(bad)
}

fn percentage(v: &str) -> Result<u32, String> {
    match v.parse::<u32>() {
        Ok(p) if (1..=100).contains(&p) => Ok(p),
        _ => Err(format!(
            "invalid --active-thread-percentage {v:?}: want 1-100 [IF]"
        )),
    }
}

fn priority(v: &str) -> Result<u32, String> {
    match v {
        "0" => Ok(0),
        "1" => Ok(1),
        _ => Err(format!("invalid --client-priority {v:?}: want 0 or 1 [IF]")),
    }
}

/// Apply `--pinned-memory-limit`, `--active-thread-percentage`,
/// `--client-priority` from `a`; at least one option is needed [IF].
fn set_limits(verb: &str, a: &Args<'_>, l: &mut Limits, extra: &[&str]) -> Result<(), String> {
    let settable = [
        "pinned-memory-limit",
        "active-thread-percentage",
        "client-priority",
    ];
    if !a
        .kv
        .keys()
        .any(|k| settable.contains(k) || extra.contains(k))
    {
        return Err(format!("{verb}: needs at least one option to set [IF]"));
    }
    let mut n = l.clone();
    if let Some(v) = a.kv.get("pinned-memory-limit") {
        n.pinned = Some(((*v).to_string(), memory(v)?));
    }
    if let Some(v) = a.kv.get("active-thread-percentage") {
        n.atp = Some(percentage(v)?);
    }
    if let Some(v) = a.kv.get("client-priority") {
        n.priority = Some(priority(v)?);
    }
    *l = n;
    Ok(())
}

fn format_opt(a: &Args<'_>) -> Result<(bool, bool), String> {
    // (csv, header)
    match a.kv.get("format").copied() {
        None | Some("table") => Ok((false, true)),
        Some("table,noheader") => Ok((false, false)),
        Some("csv") => Ok((true, true)),
        Some("csv,noheader") => Ok((true, false)),
        Some(f) => Err(format!("invalid --format={f} [IF]")),
    }
}

fn rows(csv: bool, header: bool, head: &[&str], body: Vec<Vec<String>>) -> String {
    let sep = if csv { "," } else { " " };
    let mut out = vec![];
    if header {
        out.push(head.join(sep));
    }
    for r in body {
        out.push(r.join(sep));
    }
    out.join("\n")
}

fn help(module: &str, verb: Option<&str>) -> String {
    let usage: &[(&str, &str)] = &[
        (
            "server create",
            "server create <name> [--uid=<n>] [--allowed-devices=<devices>] [--locality-domains=<true|false>]",
        ),
        ("server delete", "server delete <name> [--force]"),
        (
            "server list",
            "server list [<name>] [--format=<table|csv>[,noheader]]",
        ),
        (
            "server set",
            "server set <name> [--uid=<n>] [--pinned-memory-limit=<limit>] [--active-thread-percentage=<pct>] [--locality-domains=<true|false>] [--client-priority=<priority>]",
        ),
        (
            "server get",
            "server get <name> <name|uid|pid|status|pipe-directory|allowed-devices>",
        ),
        ("namespace create", "namespace create <name> --server=<s>"),
        (
            "namespace delete",
            "namespace delete <name> --server=<s> [--force]",
        ),
        (
            "namespace list",
            "namespace list [<name>] [--server=<s>] [--format=<table|csv>[,noheader]]",
        ),
        (
            "namespace set",
            "namespace set <name> --server=<s> [--pinned-memory-limit=<limit>] [--active-thread-percentage=<pct>] [--client-priority=<priority>]",
        ),
        (
            "namespace get",
            "namespace get <name> <server> <name|server|server-status|pipe-directory|pinned-memory-limit|active-thread-percentage|client-priority>",
        ),
        (
            "client list",
            "client list [--server=<s>] [--all] [--format=<table|csv>[,noheader]]",
        ),
        ("client terminate", "client terminate <pid>"),
    ];
    usage
        .iter()
        .filter(|(k, _)| {
            k.split_once(' ')
                .is_some_and(|(m, v)| m == module && verb.is_none_or(|w| w == v))
        })
        .map(|(_, u)| format!("Usage: {u}"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn v3(st: &mut State, uid: u32, args: &[&str]) -> Result<String, String> {
    let (module, verb, rest) = match args {
        [m, v, rest @ ..] => (*m, *v, rest),
        [m] => (*m, "", &[][..]),
        [] => return Err("missing module [IF]".into()),
    };
    if !MODULES.contains(&module) {
        return Err(format!("unknown module {module:?} [IF]"));
    }
    if verb == "help" {
        return Ok(help(module, None));
    }
    if rest.first() == Some(&"help") {
        return Ok(help(module, Some(verb)));
    }
    let a = parse_args(rest)?;
    match (module, verb) {
        ("server", "create") => server_create(st, uid, &a),
        ("server", "delete") => {
            a.only("server delete", &[], &["force"])?;
            let name = a.name("server delete", 0, "name")?;
            let force = a.flags.contains(&"force");
            let s = st
                .servers
                .get_mut(&name)
                .ok_or_else(|| format!("server {name} not found"))?;
            let active: Vec<u32> = s.namespaces.values_mut().flat_map(Ns::active).collect();
            if !active.is_empty() && !force {
                return Err(format!(
                    "server {name} has active clients {active:?}; use --force [IF]"
                ));
            }
            kill_all(&active);
            if let Some(s) = st.servers.remove(&name) {
                remove_shm(s.shm.as_ref());
            }
            let _ = std::fs::remove_dir_all(st.pipe.join(&name));
            Ok(String::new())
        }
        ("server", "list") => {
            a.only("server list", &["format"], &[])?;
            let (csv, header) = format_opt(&a)?;
            let want = a.pos.first().copied();
            let body = st
                .servers
                .iter()
                .filter(|(n, _)| want.is_none_or(|w| w == n.as_str()))
                .map(|(n, s)| {
                    vec![
                        n.clone(),
                        s.uid.to_string(),
                        s.pid.to_string(),
                        s.status.clone(),
                        st.pipe.join(n).display().to_string(),
                        s.allowed.clone(),
                        String::new(),
                    ]
                })
                .collect();
            Ok(rows(
                csv,
                header,
                &[
                    "name",
                    "uid",
                    "pid",
                    "status",
                    "pipe-directory",
                    "allowed-devices",
                    "context-ids",
                ],
                body,
            ))
        }
        ("server", "set") => {
            a.only(
                "server set",
                &[
                    "uid",
                    "pinned-memory-limit",
                    "active-thread-percentage",
                    "locality-domains",
                    "client-priority",
                ],
                &[],
            )?;
            let name = a.name("server set", 0, "name")?;
            let s = st
                .servers
                .get_mut(&name)
                .ok_or_else(|| format!("server {name} not found"))?;
            // [IF]: `server set` applies to the server's default namespace.
            let d = s.namespaces.entry("default".into()).or_default();
            set_limits(
                "server set",
                &a,
                &mut d.limits,
                &["uid", "locality-domains"],
            )?;
            if let Some(u) = a.kv.get("uid") {
                s.uid = u.parse().map_err(|_| format!("invalid --uid={u}"))?;
            }
            Ok(String::new())
        }
        ("server", "get") => {
            a.only("server get", &[], &[])?;
            let name = a.name("server get", 0, "name")?;
            let field = a.pos.get(1).ok_or("server get: missing <field> [IF]")?;
            let s = st
                .servers
                .get(&name)
                .ok_or_else(|| format!("server {name} not found"))?;
            match *field {
                "name" => Ok(name.clone()),
                "uid" => Ok(s.uid.to_string()),
                "pid" => Ok(s.pid.to_string()),
                "status" => Ok(s.status.clone()),
                "pipe-directory" => Ok(st.pipe.join(&name).display().to_string()),
                "allowed-devices" => Ok(s.allowed.clone()),
                f => Err(format!("server get: unknown field {f:?} [IF]")),
            }
        }
        ("namespace", "create") => {
            // [IF 1.4] release 615: only the name and --server.
            a.only("namespace create", &["server"], &[])?;
            let name = a.name("namespace create", 0, "name")?;
            let server =
                a.kv.get("server")
                    .ok_or("namespace create: --server=<s> is required [IF]")?;
            let pipe = st.pipe.clone();
            let s = st
                .servers
                .get_mut(*server)
                .ok_or_else(|| format!("server {server} not found"))?;
            if s.namespaces.contains_key(&name) {
                return Err(format!("namespace {name} exists on server {server}"));
            }
            let dir = pipe.join(server).join(&name);
            listen(&dir, server, &name)?;
            s.namespaces.insert(name, Ns::default());
            Ok(String::new())
        }
        ("namespace", "delete") => {
            a.only("namespace delete", &["server"], &["force"])?;
            let name = a.name("namespace delete", 0, "name")?;
            let server =
                a.kv.get("server")
                    .ok_or("namespace delete: --server=<s> is required [IF]")?;
            if name == "default" {
                return Err("the default namespace cannot be deleted".into());
            }
            let pipe = st.pipe.clone();
            let s = st
                .servers
                .get_mut(*server)
                .ok_or_else(|| format!("server {server} not found"))?;
            let ns = s
                .namespaces
                .get_mut(&name)
                .ok_or_else(|| format!("namespace {name} not found on server {server}"))?;
            let active = ns.active();
            if !active.is_empty() && !a.flags.contains(&"force") {
                return Err(format!(
                    "namespace {name} has active clients {active:?}; use --force [IF]"
                ));
            }
            kill_all(&active);
            s.namespaces.remove(&name);
            let _ = std::fs::remove_dir_all(pipe.join(server).join(&name));
            Ok(String::new())
        }
        ("namespace", "list") => {
            a.only("namespace list", &["server", "format"], &[])?;
            let (csv, header) = format_opt(&a)?;
            let want = a.pos.first().copied();
            let server = a.kv.get("server").copied();
            let mut body = vec![];
            for (sn, s) in &st.servers {
                if server.is_some_and(|w| w != sn) {
                    continue;
                }
                for (n, ns) in &s.namespaces {
                    if want.is_some_and(|w| w != n) {
                        continue;
                    }
                    body.push(vec![
                        n.clone(),
                        sn.clone(),
                        limit_text(&ns.limits, "pinned-memory-limit"),
                        limit_text(&ns.limits, "active-thread-percentage"),
                    ]);
                }
            }
            Ok(rows(
                csv,
                header,
                &[
                    "name",
                    "server",
                    "pinned-memory-limit",
                    "active-thread-percentage",
                ],
                body,
            ))
        }
        ("namespace", "set") => {
            a.only(
                "namespace set",
                &[
                    "server",
                    "pinned-memory-limit",
                    "active-thread-percentage",
                    "client-priority",
                ],
                &[],
            )?;
            let name = a.name("namespace set", 0, "name")?;
            let server =
                a.kv.get("server")
                    .ok_or("namespace set: --server=<s> is required [IF]")?;
            let ns = st
                .servers
                .get_mut(*server)
                .ok_or_else(|| format!("server {server} not found"))?
                .namespaces
                .get_mut(&name)
                .ok_or_else(|| format!("namespace {name} not found on server {server}"))?;
            set_limits("namespace set", &a, &mut ns.limits, &[])?;
            Ok(String::new())
        }
        ("namespace", "get") => {
            a.only("namespace get", &[], &[])?;
            let name = a.name("namespace get", 0, "name")?;
            let server = a.name("namespace get", 1, "server")?;
            let field = a.pos.get(2).ok_or("namespace get: missing <field> [IF]")?;
            let s = st
                .servers
                .get(&server)
                .ok_or_else(|| format!("server {server} not found"))?;
            let ns = s
                .namespaces
                .get(&name)
                .ok_or_else(|| format!("namespace {name} not found on server {server}"))?;
            match *field {
                "name" => Ok(name.clone()),
                "server" => Ok(server.clone()),
                "server-status" => Ok(s.status.clone()),
                // [NS]: the default namespace is the server's own socket.
                "pipe-directory" if name == "default" => {
                    Ok(st.pipe.join(&server).display().to_string())
                }
                "pipe-directory" => Ok(st.pipe.join(&server).join(&name).display().to_string()),
                f @ ("pinned-memory-limit" | "active-thread-percentage" | "client-priority") => {
                    Ok(limit_text(&ns.limits, f))
                }
                f => Err(format!("namespace get: unknown field {f:?} [IF]")),
            }
        }
        ("client", "list") => {
            a.only("client list", &["server", "format"], &["all"])?;
            let (csv, header) = format_opt(&a)?;
            let server = a.kv.get("server").copied();
            let mut body = vec![];
            for (sn, s) in &mut st.servers {
                if server.is_some_and(|w| w != sn) {
                    continue;
                }
                for (n, ns) in &mut s.namespaces {
                    for p in ns.active() {
                        body.push(vec![p.to_string(), sn.clone(), n.clone()]);
                    }
                }
            }
            Ok(rows(csv, header, &["pid", "server", "namespace"], body))
        }
        ("client", "terminate") => {
            a.only("client terminate", &[], &[])?;
            let pid: u32 = a
                .pos
                .first()
                .and_then(|p| p.parse().ok())
                .ok_or("client terminate: missing <pid> [IF]")?;
            let known = st
                .servers
                .values_mut()
                .flat_map(|s| s.namespaces.values_mut())
                .any(|ns| ns.active().contains(&pid));
            if !known {
                return Err(format!("client {pid} not found"));
            }
            kill_all(&[pid]);
            Ok(String::new())
        }
        (m, v) => Err(format!(
            "{m} {v}: not modelled by the fake (or not a verb) [IF]"
        )),
    }
}

fn limit_text(l: &Limits, field: &str) -> String {
    match field {
        "pinned-memory-limit" => l.pinned.as_ref().map_or("none".into(), |(t, _)| t.clone()),
        "active-thread-percentage" => l.atp.map_or("none".into(), |p| p.to_string()),
        _ => l.priority.map_or("none".into(), |p| p.to_string()),
    }
}

/// SIGKILL the fake's own server processes, through `kill(2)` (no `kill`
/// binary needed on `PATH`).
fn kill_all(pids: &[u32]) {
    for p in pids {
        if let Ok(raw) = i32::try_from(*p)
            && raw > 1
        {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(raw),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

fn visible(st: &State, dev: &str) -> bool {
    match &st.visible {
        None => true,
        Some(v) => v.iter().any(|d| d == dev) || dev.parse::<usize>().is_ok_and(|i| i < v.len()),
    }
}

fn server_create(st: &mut State, caller: u32, a: &Args<'_>) -> Result<String, String> {
    // Rule 1: `--name` is no option of `server create` [IF 1.3].
    a.only(
        "server create",
        &["uid", "allowed-devices", "locality-domains"],
        &[],
    )?;
    let uid = match a.kv.get("uid") {
        Some(u) => Some(
            u.parse::<u32>()
                .map_err(|_| format!("server create: invalid --uid={u}"))?,
        ),
        None => None,
    };
    let name = match (a.pos.first(), uid) {
        (Some(_), _) => a.name("server create", 0, "name")?,
        (None, Some(u)) => format!("uid_{u}"),
        (None, None) => {
            return Err("server create: give a positional <name> or --uid [IF]".into());
        }
    };
    // [IF 1.3]: in multiuser mode only --uid=0.
    if st.multiuser && uid.is_some_and(|u| u != 0) {
        return Err("server create: in multiuser mode only --uid=0 is allowed [IF]".into());
    }
    if let Some(l) = a.kv.get("locality-domains")
        && !matches!(*l, "true" | "false")
    {
        return Err(format!("invalid --locality-domains={l}"));
    }
    if st.servers.contains_key(&name) {
        return Err(format!("server {name} exists"));
    }
    let allowed = a.kv.get("allowed-devices").copied().unwrap_or("all");
    let missing: Vec<&str> = if allowed == "all" {
        vec![]
    } else {
        allowed.split(',').filter(|d| !visible(st, d)).collect()
    };
    let exits = std::env::var("FAKE_MPS_SERVER_EXITS").ok();
    if !missing.is_empty() || exits.as_deref() == Some(name.as_str()) {
        // [DYN]: success, but the server exits and drops out of `server list`.
        if let Some(l) = &st.log_dir {
            let d = l.join(&name);
            let _ = std::fs::create_dir_all(&d);
            let _ = std::fs::write(
                d.join("server.log"),
                "no CUDA-capable device is detected\nserver exited\n",
            );
        }
        log(&st.pipe, &format!("server {name} exited at once"));
        return Ok(String::new());
    }
    listen(&st.pipe.join(&name), &name, "default")?;
    let _ = std::fs::write(st.pipe.join(&name).join("log"), "");
    if let Some(l) = &st.log_dir {
        let d = l.join(&name);
        let _ = std::fs::create_dir_all(&d);
        let _ = std::fs::write(d.join("server.log"), "server started\n");
    }
    st.next_pid += 1;
    let status = std::env::var("FAKE_MPS_SERVER_STATUS").unwrap_or_else(|_| "Ready".into());
    let owner = uid.unwrap_or(caller);
    st.servers.insert(
        name,
        Server {
            uid: owner,
            pid: st.next_pid,
            shm: server_shm(owner, st.next_pid),
            status,
            allowed: allowed.to_string(),
            namespaces: BTreeMap::from([("default".to_string(), Ns::default())]),
        },
    );
    Ok(String::new())
}

/// Bind `<dir>/control` for server `server`, namespace `ns`, and serve CUDA
/// clients on it in a thread of its own.
fn listen(dir: &Path, server: &str, ns: &str) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let sock = dir.join(SOCKET);
    let _ = std::fs::remove_file(&sock);
    let l = UnixListener::bind(&sock).map_err(|e| format!("bind {}: {e}", sock.display()))?;
    let (server, ns) = (server.to_string(), ns.to_string());
    let st = SHARED.get().cloned();
    std::thread::spawn(move || {
        let Some(st) = st else { return };
        for conn in l.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut req = String::new();
            if conn.read_to_string(&mut req).is_err() {
                continue;
            }
            let (out, status, _) = handle(&st, &req, Some((&server, &ns)));
            let _ = write!(conn, "{out}\n#status {status}\n");
        }
    });
    Ok(())
}

static SHARED: std::sync::OnceLock<Shared> = std::sync::OnceLock::new();

/// The daemon's `/dev/shm` (the literal path: in the daemon's mount namespace).
const DEV_SHM: &str = "/dev/shm";

/// A started server's `cuda.shm.<uid>.<n>.1` in the daemon's `/dev/shm`
/// (4 KiB, mode 0600, as issue #467 shows it); `<n>` joins the daemon's pid
/// and the server's, so parallel fakes sharing one `/dev/shm` do not clash.
/// `None` when it cannot be written (the client will then fail).
fn server_shm(uid: u32, server_pid: u32) -> Option<PathBuf> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let p = Path::new(DEV_SHM).join(format!(
        "cuda.shm.{uid}.{}{server_pid}.1",
        std::process::id()
    ));
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&p)
        .ok()?;
    f.write_all(&[0u8; 4096]).ok()?;
    Some(p)
}

fn remove_shm(p: Option<&PathBuf>) {
    if let Some(p) = p {
        let _ = std::fs::remove_file(p);
    }
}

/// Die as a crash does, without answering. The servers' `cuda.shm.*` files
/// are removed first only to keep the test machine's `/dev/shm` clean (what
/// a real crash leaves there is not documented and no test looks).
fn crash() -> ! {
    if let Some(Ok(st)) = SHARED.get().map(|s| s.try_lock()) {
        for s in st.servers.values() {
            remove_shm(s.shm.as_ref());
        }
        remove_shm(st.v2_server.as_ref().and_then(|s| s.shm.as_ref()));
    } else {
        remove_shm_of(std::process::id());
    }
    std::process::exit(139);
}

/// Remove the `cuda.shm.*` files a fake daemon `pid` left in `/dev/shm`
/// (for tests that kill daemons with SIGKILL).
pub fn remove_shm_of(pid: u32) {
    let Ok(rd) = std::fs::read_dir(DEV_SHM) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        // cuda.shm.<uid>.<daemon pid><5-digit server pid>.1
        let mine = name
            .strip_prefix("cuda.shm.")
            .and_then(|r| r.split('.').nth(1))
            .is_some_and(|n| n.len() > 5 && n[..n.len() - 5] == pid.to_string());
        if mine {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// A CUDA client connecting: `f` = pid, pinned env, atp env, visible env.
fn cuda_connect(
    st: &mut State,
    uid: u32,
    f: &[&str],
    route: Option<(&str, &str)>,
) -> Result<String, String> {
    let field = |i: usize| f.get(i).copied().filter(|v| *v != "-");
    let pid: u32 = field(0).and_then(|p| p.parse().ok()).unwrap_or(0);
    let env_pinned = field(1);
    let env_atp = field(2).and_then(|p| p.parse::<u32>().ok());
    let client_visible: Option<Vec<String>> =
        field(3).map(|v| v.split(',').map(str::to_string).collect());
    let via = route.map_or_else(|| "main".to_string(), |(s, n)| format!("{s}/{n}"));
    // Rule 7 [DYN], [IF]: another UID only with a root daemon in -m mode.
    if uid != st.uid && !(st.multiuser && st.uid == 0) {
        log(
            &st.pipe,
            &format!("client pid={pid} uid={uid} via={via} refused: CUDA_ERROR_NOT_PERMITTED"),
        );
        return Err(format!(
            "CUDA_ERROR_NOT_PERMITTED: client uid {uid}, daemon uid {} without multiuser root",
            st.uid
        ));
    }
    if st.protocol == 2 {
        return v2_client(st, uid, pid, env_pinned, env_atp, &via);
    }
    let (server, ns) = match route {
        Some((s, n)) => (s.to_string(), n.to_string()),
        None => {
            // [CT], [QS], [NS]: the main socket routes by UID to `uid_<uid>`,
            // created with no limits.
            let name = format!("uid_{uid}");
            if !st.servers.contains_key(&name) {
                listen(&st.pipe.join(&name), &name, "default")?;
                st.next_pid += 1;
                st.servers.insert(
                    name.clone(),
                    Server {
                        uid,
                        pid: st.next_pid,
                        shm: server_shm(uid, st.next_pid),
                        status: "Ready".into(),
                        allowed: "all".into(),
                        namespaces: BTreeMap::from([("default".to_string(), Ns::default())]),
                    },
                );
            }
            (name, "default".to_string())
        }
    };
    let dev_ok = |d: &str| match &client_visible {
        Some(v) => v.iter().any(|x| x == d) || d.parse::<usize>().is_ok_and(|i| i < v.len()),
        None => visible(st, d),
    };
    let mut escape = false;
    let mut env_min: Option<u64> = None;
    for entry in env_pinned
        .unwrap_or("")
        .split(',')
        .filter(|e| !e.is_empty())
    {
        match entry.split_once('=') {
            Some((d, v)) if dev_ok(d) => {
                if let Ok(b) = memory(v) {
                    env_min = Some(env_min.map_or(b, |m| m.min(b)));
                }
            }
            // [DYN]: one entry naming a device the process cannot see drops
            // every pinned limit, the namespace's included.
            _ => escape = true,
        }
    }
    let s = st
        .servers
        .get_mut(&server)
        .ok_or_else(|| format!("server {server} not found"))?;
    if s.status != "Ready" {
        return Err(format!("server {server} is {}", s.status));
    }
    let shm = s.shm.clone();
    let n = s
        .namespaces
        .get_mut(&ns)
        .ok_or_else(|| format!("namespace {ns} not found on server {server}"))?;
    n.clients.push(pid);
    // [ENV]: the namespace's percentage overrides the client's variable; its
    // pinned limit can only be lowered by the variable.
    let atp = n.limits.atp.or(env_atp);
    let pinned = if escape {
        None
    } else {
        match (n.limits.pinned.as_ref().map(|p| p.1), env_min) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    };
    let out = format!(
        "server={server} namespace={ns} pinned={} atp={}",
        pinned.map_or("none".into(), |b| format!("{}M", b >> 20)),
        atp.map_or("none".into(), |p| p.to_string())
    );
    log(
        &st.pipe,
        &format!("client pid={pid} uid={uid} via={via} {out}"),
    );
    Ok(with_shm(out, shm.as_ref()))
}

/// The client's answer: where it landed, then the server's `cuda.shm.*` name.
fn with_shm(out: String, shm: Option<&PathBuf>) -> String {
    let name = shm
        .and_then(|p| p.file_name())
        .map_or_else(|| "-".to_string(), |n| n.to_string_lossy().into_owned());
    format!("{out}\nshm={name}")
}

fn v2_client(
    st: &mut State,
    uid: u32,
    pid: u32,
    env_pinned: Option<&str>,
    env_atp: Option<u32>,
    via: &str,
) -> Result<String, String> {
    if via != "main" {
        return Err("protocol 2 has only the main socket".into());
    }
    // [ARCH]: one server at a time, for one UID; another UID waits until the
    // server's clients are gone (the fake refuses instead of waiting).
    let replace = match &mut st.v2_server {
        Some(s) if s.uid == uid => false,
        Some(s) => {
            s.clients.retain(|p| pid_alive(*p));
            if !s.clients.is_empty() {
                return Err(format!(
                    "a server for uid {} has clients; uid {uid} would wait [ARCH]",
                    s.uid
                ));
            }
            true
        }
        None => true,
    };
    if replace {
        // [V2]: a new server takes the defaults current now.
        st.next_pid += 1;
        remove_shm(st.v2_server.as_ref().and_then(|s| s.shm.as_ref()));
        st.v2_server = Some(V2Server {
            pid: st.next_pid,
            shm: server_shm(uid, st.next_pid),
            uid,
            mem: st.v2_mem.clone(),
            pct: st.v2_pct,
            clients: vec![],
        });
        log(
            &st.pipe,
            &format!("v2 server pid={} uid={uid} started", st.next_pid),
        );
    }
    let Some(s) = st.v2_server.as_mut() else {
        return Err("no server".into());
    };
    s.clients.push(pid);
    let shm = s.shm.clone();
    let server_mem = s.mem.values().filter_map(|v| memory(v).ok()).min();
    let env_mem = env_pinned
        .and_then(|e| e.split_once('='))
        .and_then(|(_, v)| memory(v).ok());
    let pinned = match (server_mem, env_mem) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let atp = match (s.pct, env_atp) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let out = format!(
        "server=v2_{} namespace=none pinned={} atp={}",
        s.pid,
        pinned.map_or("none".into(), |b| format!("{}M", b >> 20)),
        atp.map_or("none".into(), |p| p.to_string())
    );
    log(
        &st.pipe,
        &format!("client pid={pid} uid={uid} via=main {out}"),
    );
    Ok(with_shm(out, shm.as_ref()))
}

/// `--fake-cuda-client [--uid=<n>] [--dev-shm=<dir>] [--hold]`.
fn cuda_client(args: &[String]) -> ExitCode {
    let mut uid = my_uid();
    let mut hold = false;
    let mut dev_shm = PathBuf::from(DEV_SHM);
    for a in args {
        if let Some(d) = a.strip_prefix("--dev-shm=") {
            dev_shm = PathBuf::from(d);
        } else if let Some(u) = a.strip_prefix("--uid=") {
            match u.parse() {
                Ok(u) => uid = u,
                Err(_) => {
                    eprintln!("bad --uid");
                    return ExitCode::from(2);
                }
            }
        } else if a == "--hold" {
            hold = true;
        } else {
            eprintln!("unknown client option {a}");
            return ExitCode::from(2);
        }
    }
    let env = |k: &str| std::env::var(k).unwrap_or_else(|_| "-".into());
    let req = format!(
        "cuda\n{uid}\n{}\n{}\n{}\n{}\n",
        std::process::id(),
        env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
        env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        env("CUDA_VISIBLE_DEVICES"),
    );
    let sock = pipe_dir().join(SOCKET);
    let Ok(mut conn) = UnixStream::connect(&sock) else {
        // [DYN]: no daemon at the pipe directory: a plain CUDA process.
        println!("server=none namespace=none pinned=none atp=none");
        return ExitCode::SUCCESS;
    };
    let (body, status) = exchange_raw(&mut conn, &req);
    if status != 0 {
        eprintln!("{body}");
        return ExitCode::from(status);
    }
    // The answer's last line names the server's `cuda.shm.*` file, which the
    // client needs in its own /dev/shm (module docs).
    let (landed, shm) = body.rsplit_once('\n').unwrap_or((body.as_str(), ""));
    let name = shm.strip_prefix("shm=").unwrap_or("-");
    if name == "-" || !dev_shm.join(name).is_file() {
        eprintln!(
            "MPS client: the server's shared memory {name} is not in {} (the client's /dev/shm is not the server's)",
            dev_shm.display()
        );
        return ExitCode::from(1);
    }
    println!("{landed}");
    let code = ExitCode::SUCCESS;
    if hold && code == ExitCode::SUCCESS {
        let _ = std::io::stdout().flush();
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    code
}

/// Send `req`, return the answer's body and status.
fn exchange_raw(conn: &mut UnixStream, req: &str) -> (String, u8) {
    let mut resp = String::new();
    if conn.write_all(req.as_bytes()).is_err()
        || conn.shutdown(std::net::Shutdown::Write).is_err()
        || conn.read_to_string(&mut resp).is_err()
    {
        return ("lost connection to the MPS control daemon".into(), 1);
    }
    match resp.trim_end().rsplit_once("#status ") {
        Some((b, s)) => (b.trim_end().to_string(), s.trim().parse().unwrap_or(1)),
        // The daemon went away before it answered (a crash mid-request).
        None => (
            format!("the MPS control daemon closed the connection without an answer{resp}"),
            1,
        ),
    }
}

fn exchange(conn: &mut UnixStream, req: &str) -> ExitCode {
    let (body, status) = exchange_raw(conn, req);
    if !body.is_empty() {
        if status == 0 {
            println!("{body}");
        } else {
            eprintln!("{body}");
        }
    }
    ExitCode::from(status)
}

/// A control invocation: forward to the daemon, print its answer.
fn client(kind: &str, lines: &[String]) -> ExitCode {
    let payload = if kind == "v3" {
        lines.join("\u{1f}")
    } else {
        lines.join("\n")
    };
    let req = format!("{kind}\n{}\n{payload}\n", my_uid());
    let sock = pipe_dir().join(SOCKET);
    let Ok(mut conn) = UnixStream::connect(&sock) else {
        eprintln!("Cannot find MPS control daemon process");
        return ExitCode::from(1);
    };
    exchange(&mut conn, &req)
}
