//! A test stand-in for `nvidia-cuda-mps-control`, for tests and `carve
//! simulate` on machines without NVIDIA drivers. It is not MPS: it starts no
//! server, limits nothing and touches no GPU; it speaks the control protocols
//! as carve uses them and records what it is told.
//!
//! Two ways to run it: the `carve-fake-mps-control` binary of this crate, and
//! the `carve` binary invoked through a link named [`PROGRAM`] (`carve
//! simulate` does that, since `cargo run -p carve` builds no other binary).
//! Both call [`run`].
//!
//! - `-d [-p N]` daemonises (re-runs this executable with `-f`, detached, with
//!   the same `argv[0]`, so a `carve` reached through the link runs the fake
//!   again) and returns once the daemon is ready; `-f [-p N]` is the daemon:
//!   it listens on the Unix socket `control` in `CUDA_MPS_PIPE_DIRECTORY` and
//!   writes `nvidia-cuda-mps-control.pid` there once ready.
//! - Without `-d`/`-f`: a client. No arguments: v2 commands from stdin. `-q` or
//!   verbs (`server create`, `namespace create|delete|list`, `client list`): v3.
//!   The client follows the running daemon's protocol, as the real one does; a
//!   request in the other protocol fails.
//! - Records every request, and the `CUDA_*` environment it started with, in
//!   [`LOG`] (`fake-mps-control.log`) in the pipe directory.
//! - `FAKE_MPS_MAX_PROTOCOL=2` makes `-p 3` an unknown option (a v2-only
//!   driver). The v2 command `crash`, or a request containing
//!   `FAKE_MPS_CRASH_ON`, kills the daemon without cleanup; a request
//!   containing `FAKE_MPS_REJECT` fails without effect.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

/// The program name under which the `carve` binary runs the fake.
pub const PROGRAM: &str = "carve-fake-mps-control";
/// The fake's record of requests, in the pipe directory.
pub const LOG: &str = "fake-mps-control.log";
const PID_FILE: &str = crate::control::PID_FILE;
const SOCKET: &str = crate::control::CONTROL_FILE;

fn pipe_dir() -> PathBuf {
    std::env::var_os("CUDA_MPS_PIPE_DIRECTORY")
        .map_or_else(|| PathBuf::from("/tmp/nvidia-mps"), PathBuf::from)
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

/// Run the fake with `args` (the command line after the program name).
#[must_use]
pub fn run(args: &[String]) -> ExitCode {
    let max: u32 = std::env::var("FAKE_MPS_MAX_PROTOCOL")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let daemon = args.first().map(String::as_str);
    if daemon == Some("--version") {
        println!("carve-fake-mps-control, protocols 2..={max}");
        return ExitCode::SUCCESS;
    }
    if matches!(daemon, Some("-d" | "-f")) {
        let protocol = match args.get(1..).unwrap_or(&[]) {
            [] => std::env::var("CUDA_MPS_PROTOCOL_VERSION")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(2),
            [p, n] if p == "-p" => match n.parse::<u32>() {
                Ok(n) if (2..=max).contains(&n) => n,
                _ => {
                    eprintln!("nvidia-cuda-mps-control: unknown option -p {n}");
                    return ExitCode::from(2);
                }
            },
            other => {
                eprintln!("nvidia-cuda-mps-control: unknown options {other:?}");
                return ExitCode::from(2);
            }
        };
        return if daemon == Some("-d") {
            launch(protocol)
        } else {
            serve(protocol)
        };
    }
    client(args)
}

/// `-d`: start the daemon detached and wait until it is ready.
fn launch(protocol: u32) -> ExitCode {
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
    let mut child = match cmd
        .args(["-f", "-p", &protocol.to_string()])
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

#[derive(Default)]
struct State {
    protocol: u32,
    mem: BTreeMap<String, String>,
    pct: u32,
    servers: Vec<String>,
    namespaces: BTreeMap<String, Vec<String>>,
}

/// `-f`: the daemon.
fn serve(protocol: u32) -> ExitCode {
    let dir = pipe_dir();
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
    log(&dir, &format!("start pid={pid} protocol={protocol}"));
    let mut env: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| k.starts_with("CUDA_"))
        .collect();
    env.sort();
    for (k, v) in env {
        log(&dir, &format!("env {k}={v}"));
    }
    if let Some(l) = std::env::var_os("CUDA_MPS_LOG_DIRECTORY") {
        let _ = std::fs::write(
            Path::new(&l).join("control.log"),
            format!("started {pid}\n"),
        );
    }
    let tmp = dir.join(format!("{PID_FILE}.tmp"));
    if std::fs::write(&tmp, format!("{pid}\n")).is_err()
        || std::fs::rename(&tmp, dir.join(PID_FILE)).is_err()
    {
        return ExitCode::from(1);
    }
    let crash_on = std::env::var("FAKE_MPS_CRASH_ON").ok();
    let reject = std::env::var("FAKE_MPS_REJECT").ok();
    let mut st = State {
        protocol,
        pct: 100,
        ..State::default()
    };
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        let mut req = String::new();
        if conn.read_to_string(&mut req).is_err() {
            continue;
        }
        if crash_on.as_deref().is_some_and(|c| req.contains(c)) {
            log(&dir, &format!("crash on {:?}", req.trim()));
            std::process::exit(139);
        }
        if reject.as_deref().is_some_and(|r| req.contains(r)) {
            log(&dir, &format!("reject {:?}", req.trim()));
            let _ = write!(conn, "rejected on request\n#status 1\n");
            continue;
        }
        let (mut out, mut status, mut quit) = (String::new(), 0, false);
        let mut lines = req.lines();
        match lines.next() {
            Some("v2") => {
                for cmd in lines.map(str::trim).filter(|l| !l.is_empty()) {
                    log(&dir, &format!("cmd {cmd}"));
                    if cmd == "crash" {
                        std::process::exit(139);
                    }
                    match v2(&mut st, cmd) {
                        Ok(Some(o)) => out.push_str(&(o + "\n")),
                        Ok(None) => {}
                        Err(e) => {
                            out.push_str(&(e + "\n"));
                            status = 1;
                        }
                    }
                    if cmd == "quit" && status == 0 {
                        quit = true;
                        break;
                    }
                }
            }
            Some("v3") => {
                let args: Vec<&str> = lines
                    .next()
                    .unwrap_or("")
                    .split('\u{1f}')
                    .filter(|s| !s.is_empty())
                    .collect();
                log(&dir, &format!("verb {}", args.join(" ")));
                if args == ["-q"] {
                    quit = true;
                } else {
                    match v3(&mut st, &args) {
                        Ok(o) => out = o,
                        Err(e) => {
                            out = e;
                            status = 1;
                        }
                    }
                }
            }
            _ => {
                out = "bad request".into();
                status = 1;
            }
        }
        // Logged before the answer: a client that saw the quit succeed
        // finds it in the log (after the answer it raced with the reader).
        if quit {
            log(&dir, "quit");
        }
        let _ = write!(conn, "{out}\n#status {status}\n");
        drop(conn);
        if quit {
            let _ = std::fs::remove_file(dir.join(PID_FILE));
            let _ = std::fs::remove_file(&sock);
            return ExitCode::SUCCESS;
        }
    }
    ExitCode::SUCCESS
}

fn v2(st: &mut State, cmd: &str) -> Result<Option<String>, String> {
    if st.protocol != 2 {
        return Err(format!(
            "daemon speaks protocol {}: {cmd:?} is v2",
            st.protocol
        ));
    }
    let w: Vec<&str> = cmd.split_whitespace().collect();
    match w.as_slice() {
        ["quit"] | ["get_server_list"] => Ok(None),
        ["set_default_device_pinned_mem_limit", dev, v] => {
            let (n, unit) = v.split_at(v.len().saturating_sub(1));
            if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) || !matches!(unit, "M" | "G")
            {
                return Err(format!("Invalid memory limit {v}"));
            }
            st.mem.insert((*dev).to_string(), (*v).to_string());
            Ok(None)
        }
        ["get_default_device_pinned_mem_limit", dev] => Ok(Some(
            st.mem.get(*dev).cloned().unwrap_or_else(|| "0".into()),
        )),
        ["set_default_active_thread_percentage", p] => match p.parse::<u32>() {
            Ok(p) if (1..=100).contains(&p) => {
                st.pct = p;
                Ok(Some(p.to_string()))
            }
            _ => Err(format!("Invalid percentage {p}")),
        },
        ["get_default_active_thread_percentage"] => Ok(Some(st.pct.to_string())),
        _ => Err(format!("Unknown command {cmd:?}")),
    }
}

fn opts<'a>(args: &[&'a str]) -> BTreeMap<&'a str, &'a str> {
    args.iter()
        .filter_map(|a| a.strip_prefix("--")?.split_once('='))
        .collect()
}

fn v3(st: &mut State, args: &[&str]) -> Result<String, String> {
    if st.protocol != 3 {
        return Err(format!(
            "daemon speaks protocol {}: verbs need 3",
            st.protocol
        ));
    }
    let o = opts(args);
    match args {
        ["server", "create", ..] => {
            let name = o.get("name").ok_or("server create: --name missing")?;
            if st.servers.iter().any(|s| s == name) {
                return Err(format!("server {name} exists"));
            }
            st.servers.push((*name).to_string());
            Ok(String::new())
        }
        ["namespace", "create", ..] => {
            let server = o.get("server").ok_or("--server missing")?;
            if !st.servers.iter().any(|s| s == server) {
                return Err(format!("no server {server}"));
            }
            let name = o.get("name").ok_or("--name missing")?;
            let cg = o.get("cgroup").ok_or("--cgroup missing")?;
            if !Path::new(cg).is_absolute() || !Path::new(cg).is_dir() {
                return Err(format!("cgroup {cg} not found"));
            }
            let mem = o
                .get("pinned-memory-limit")
                .ok_or("--pinned-memory-limit missing")?;
            let (_, v) = mem.rsplit_once('=').ok_or("limit needs <dev>=<value>")?;
            if !(v.ends_with('M') || v.ends_with('G')) {
                return Err(format!("invalid memory limit {v}"));
            }
            let pct: u32 = o
                .get("active-thread-percentage")
                .and_then(|p| p.parse().ok())
                .filter(|p| (1..=100).contains(p))
                .ok_or("invalid --active-thread-percentage")?;
            if st.namespaces.contains_key(*name) {
                return Err(format!("namespace {name} exists"));
            }
            st.namespaces.insert(
                (*name).to_string(),
                vec![(*cg).to_string(), (*mem).to_string(), pct.to_string()],
            );
            Ok(String::new())
        }
        ["namespace", "delete", ..] => {
            let name = o.get("name").ok_or("--name missing")?;
            st.namespaces
                .remove(*name)
                .map(|_| String::new())
                .ok_or_else(|| format!("no namespace {name}"))
        }
        ["namespace", "list", ..] => {
            Ok(st.namespaces.keys().cloned().collect::<Vec<_>>().join("\n"))
        }
        ["client", "list", ..] => Ok(String::new()),
        _ => Err(format!("unknown verb {args:?}")),
    }
}

/// A client invocation: forward to the daemon, print its answer.
fn client(args: &[String]) -> ExitCode {
    let req = if args.is_empty() {
        let mut s = String::new();
        if std::io::stdin().read_to_string(&mut s).is_err() {
            return ExitCode::from(1);
        }
        format!("v2\n{s}")
    } else {
        format!("v3\n{}\n", args.join("\u{1f}"))
    };
    let sock = pipe_dir().join(SOCKET);
    let Ok(mut conn) = UnixStream::connect(&sock) else {
        eprintln!("Cannot find MPS control daemon process");
        return ExitCode::from(1);
    };
    let mut resp = String::new();
    if conn.write_all(req.as_bytes()).is_err()
        || conn.shutdown(std::net::Shutdown::Write).is_err()
        || conn.read_to_string(&mut resp).is_err()
    {
        eprintln!("lost connection to the MPS control daemon");
        return ExitCode::from(1);
    }
    let (body, status) = match resp.trim_end().rsplit_once("#status ") {
        Some((b, s)) => (b.trim_end(), s.trim().parse().unwrap_or(1)),
        None => {
            // The daemon went away before it answered (a crash mid-request).
            eprintln!("the MPS control daemon closed the connection without an answer");
            (resp.as_str(), 1)
        }
    };
    if !body.is_empty() {
        println!("{body}");
    }
    ExitCode::from(status)
}
