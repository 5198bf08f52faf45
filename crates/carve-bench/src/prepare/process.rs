//! The plugin-process part: the real `carve kubelet-plugin`, started and
//! stopped for its time to registration, then driven through a fake kubelet
//! for its RSS.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use carve_apiserver::{ApiServer, Options as ApiOptions, Store};
use carve_model::GpuModel;
use carve_plugin::ClaimRef;
use carve_plugin::testing::{FakeKubelet, FakeKubeletError, uds_channel};

use super::node::{BenchNode, NODE, concurrent_devices, put_claims};
use super::{MALLOC_ARENA_MAX, Options, PROCESS_DEADLINE, STARTS};
use crate::BenchError;

/// Figures of the plugin-process part; [`ProcessFigures::report`] makes them
/// rows.
#[derive(Debug, Default)]
pub struct ProcessFigures {
    pub(super) starts: Vec<Duration>,
    /// VmRSS, VmHWM, RssAnon, RssFile once registered.
    pub(super) rss_idle_kib: [u64; 4],
    /// The same after the cycles.
    pub(super) rss_after_kib: [u64; 4],
    pub(super) rss_kib: u64,
    pub(super) hwm_kib: u64,
    /// Resident KiB per mapping once registered, largest first.
    pub(super) rss_idle_by_mapping: Vec<(String, u64)>,
    /// Resident KiB per mapping after the cycles, largest first.
    pub(super) rss_by_mapping: Vec<(String, u64)>,
    pub(super) cycles: u64,
    pub(super) help_peak_kib: u64,
    pub(super) live_at_end: usize,
}

/// `VmRSS`, `VmHWM`, `RssAnon` and `RssFile` of a process, KiB.
fn proc_rss(pid: u32) -> Result<[u64; 4], BenchError> {
    let path = format!("/proc/{pid}/status");
    let text =
        std::fs::read_to_string(&path).map_err(|e| BenchError::io(format!("reading {path}"), e))?;
    let field = |name: &str| -> Result<u64, BenchError> {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .ok_or_else(|| BenchError::Plugin(format!("{path}: no {name} line")))
    };
    Ok([
        field("VmRSS:")?,
        field("VmHWM:")?,
        field("RssAnon:")?,
        field("RssFile:")?,
    ])
}

/// Resident KiB of a process per mapping, largest first: the file name of a
/// file mapping (`carve`, `libc.so.6`, ...), `[heap]`, `[stack]`, and
/// `anon` for the unnamed anonymous ones (thread stacks, mmapped allocations).
fn proc_rss_by_mapping(pid: u32) -> Result<Vec<(String, u64)>, BenchError> {
    let path = format!("/proc/{pid}/smaps");
    let text =
        std::fs::read_to_string(&path).map_err(|e| BenchError::io(format!("reading {path}"), e))?;
    let mut by: BTreeMap<String, u64> = BTreeMap::new();
    let mut current = String::new();
    for line in text.lines() {
        if let Some(kib) = line.strip_prefix("Rss:") {
            let kib: u64 = kib
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .unwrap_or(0);
            *by.entry(current.clone()).or_default() += kib;
        } else if line
            .split_whitespace()
            .next()
            .is_some_and(|range| range.contains('-') && !range.ends_with(':'))
        {
            // `start-end perms offset dev inode [path]`
            current = match line.split_whitespace().nth(5) {
                Some(p) if p.starts_with('[') => p.to_string(),
                Some(p) => Path::new(p)
                    .file_name()
                    .map_or_else(|| p.to_string(), |n| n.to_string_lossy().into_owned()),
                None => "anon".to_string(),
            };
        }
    }
    let mut v: Vec<(String, u64)> = by.into_iter().filter(|(_, k)| *k > 0).collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok(v)
}

/// The largest peak RSS (KiB) among this process's reaped children.
fn children_max_rss_kib() -> Result<u64, BenchError> {
    let u = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)
        .map_err(|e| BenchError::setup("getrusage(RUSAGE_CHILDREN)", e))?;
    Ok(u64::try_from(u.max_rss()).unwrap_or(0))
}

struct Plugin {
    child: tokio::process::Child,
    log: PathBuf,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("pid", &self.child.id())
            .field("log", &self.log)
            .finish()
    }
}

fn tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let start = s.len().saturating_sub(4000);
    let start = (start..s.len())
        .find(|i| s.is_char_boundary(*i))
        .unwrap_or(s.len());
    s[start..].to_string()
}

impl Plugin {
    /// Spawn `carve kubelet-plugin` for `node`; returns it with the start instant.
    fn spawn(
        carve: &Path,
        node: &BenchNode,
        api_url: &str,
        n: usize,
    ) -> Result<(Self, Instant), BenchError> {
        let c = &node.config;
        let reg = node.registration_socket()?;
        if reg.exists() {
            std::fs::remove_file(&reg)
                .map_err(|e| BenchError::io(format!("removing stale {}", reg.display()), e))?;
        }
        let log = node.dir.path().join(format!("plugin-{n}.log"));
        let out = std::fs::File::create(&log)
            .map_err(|e| BenchError::io(format!("creating {}", log.display()), e))?;
        let err = out
            .try_clone()
            .map_err(|e| BenchError::io(format!("opening {} again", log.display()), e))?;
        let s = |p: &Path| p.display().to_string();
        let mut cmd = tokio::process::Command::new(carve);
        cmd.arg("kubelet-plugin")
            .args(["--node-name", NODE])
            .args(["--plugins-dir", &s(&c.plugin_dir)])
            .args(["--registry-dir", &s(&c.plugins_registry_dir)])
            .args(["--cdi-dir", &s(&c.cdi_dir)])
            .args(["--state-dir", &s(&node.dir.path().join("state"))])
            .args(["--proc-driver-nvidia", &s(&node.sim.proc_root)])
            .args(["--container-driver-root", &s(&c.driver.container_root)])
            .args(["--host-driver-root", &s(&c.driver.host_root)])
            .args(["--proc-devices", &s(&c.driver.proc_devices)])
            .args(["--nvml-lib", &s(&node.lib)])
            .args(["--kube-api-url", api_url])
            .args(["--metrics-addr", "127.0.0.1:0"])
            .args(c.pod_uid.iter().flat_map(|u| ["--pod-uid", u.as_str()]))
            .env("MALLOC_ARENA_MAX", MALLOC_ARENA_MAX)
            .env(nvidia_ml_sim::CONFIG_ENV, &node.sidecar)
            .env_remove(nvidia_ml_sim::FAULTS_ENV)
            .env_remove("CARVE_NVML_LIB")
            .stdin(std::process::Stdio::null())
            .stdout(out)
            .stderr(err)
            .kill_on_drop(true);
        let t0 = Instant::now();
        let child = cmd.spawn().map_err(|e| {
            BenchError::io(format!("spawning {} kubelet-plugin", carve.display()), e)
        })?;
        Ok((Self { child, log }, t0))
    }

    fn pid(&self) -> Result<u32, BenchError> {
        self.child
            .id()
            .ok_or_else(|| BenchError::Plugin("plugin process already reaped".into()))
    }

    /// Wait until the registration socket answers `GetInfo` (polled every
    /// 200 µs: this is a measurement, not a test wait).
    async fn wait_registered(&mut self, reg: &Path) -> Result<(), BenchError> {
        let t0 = Instant::now();
        loop {
            let exited = self
                .child
                .try_wait()
                .map_err(|e| BenchError::io("waiting for carve kubelet-plugin", e))?;
            if let Some(st) = exited {
                return Err(BenchError::Plugin(format!(
                    "carve kubelet-plugin exited with {st} before registering; its log:\n{}",
                    tail(&self.log)
                )));
            }
            if reg.exists()
                && let Ok(ch) = uds_channel(reg).await
            {
                let mut r =
                    carve_proto::registration::registration_client::RegistrationClient::new(ch);
                if r.get_info(carve_proto::registration::InfoRequest {})
                    .await
                    .is_ok()
                {
                    return Ok(());
                }
            }
            if t0.elapsed() > PROCESS_DEADLINE {
                return Err(BenchError::Plugin(format!(
                    "carve kubelet-plugin did not answer GetInfo on {} within {PROCESS_DEADLINE:?}; its log:\n{}",
                    reg.display(),
                    tail(&self.log)
                )));
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }

    /// SIGTERM, then SIGKILL if it has not exited within the deadline; reaps it.
    async fn stop(mut self) -> Result<(), BenchError> {
        if let Some(pid) = self.child.id().and_then(|p| i32::try_from(p).ok()) {
            let pid = nix::unistd::Pid::from_raw(pid);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        }
        let stopped = match tokio::time::timeout(PROCESS_DEADLINE, self.child.wait()).await {
            Ok(r) => r.map(drop),
            Err(_) => self.child.kill().await,
        };
        stopped.map_err(|e| BenchError::io("stopping carve kubelet-plugin", e))
    }
}

/// `carve --help` peak RSS (KiB) from the kernel's high-water mark of the
/// reaped child (the counter behind VmHWM; /proc is gone once it exits).
/// Linux also counts the memory the child had before `exec`, i.e. this
/// process's at spawn: run first, while this process is small, and still an
/// upper bound. Also one when this process reaped a bigger child earlier.
pub fn help_peak_kib(carve: &Path) -> Result<u64, BenchError> {
    let st = std::process::Command::new(carve)
        .arg("--help")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map_err(|e| BenchError::io(format!("running {} --help", carve.display()), e))?;
    if !st.success() {
        return Err(BenchError::Plugin(format!(
            "{} --help exited with {st}",
            carve.display()
        )));
    }
    children_max_rss_kib()
}

/// The plugin-process part: `carve` (this project's binary) started as
/// `carve kubelet-plugin` on the simulated node, against an API-server
/// stand-in, several times until its registration socket answers `GetInfo`;
/// then once more, driven through a fake kubelet for `iterations`
/// prepare+unprepare cycles, its RSS read before and after. `help_kib` is
/// [`help_peak_kib`], measured first.
pub async fn plugin_process(
    a: &Options,
    model: &GpuModel,
    lib: &Path,
    carve: &Path,
    help_kib: u64,
) -> Result<ProcessFigures, BenchError> {
    let mut f = ProcessFigures {
        help_peak_kib: help_kib,
        ..ProcessFigures::default()
    };
    let node = BenchNode::new(a, model, lib)?;
    let api = ApiServer::start(ApiOptions::default())
        .await
        .map_err(|e| BenchError::setup("starting the API-server stand-in", e))?;
    let reg = node.registration_socket()?;

    for n in 0..STARTS {
        let (mut p, t0) = Plugin::spawn(carve, &node, &api.url(), n)?;
        p.wait_registered(&reg).await?;
        f.starts.push(t0.elapsed());
        p.stop().await?;
    }

    let (mut p, _) = Plugin::spawn(carve, &node, &api.url(), STARTS)?;
    p.wait_registered(&reg).await?;
    let kubelet = FakeKubelet::register(&reg, carve_model::DRIVER_NAME)
        .await
        .map_err(|e| BenchError::setup("registering the fake kubelet", e))?;
    f.rss_idle_kib = proc_rss(p.pid()?)?;
    f.rss_idle_by_mapping = proc_rss_by_mapping(p.pid()?)?;
    f.cycles = cycle_claims(a, model, &api.store(), &kubelet, p.pid()?).await?;
    f.rss_after_kib = proc_rss(p.pid()?)?;
    f.rss_by_mapping = proc_rss_by_mapping(p.pid()?)?;
    f.rss_kib = f.rss_after_kib[0];
    f.hwm_kib = f.rss_after_kib[1];
    drop(kubelet);
    p.stop().await?;
    f.live_at_end = node.live_instances()?;
    api.shutdown().await;
    Ok(f)
}

/// `iterations` claims prepared and unprepared through the plugin process
/// `pid`, as many at once as `concurrency` devices allow; returns the
/// cycles done.
async fn cycle_claims(
    a: &Options,
    model: &GpuModel,
    store: &Store,
    kubelet: &FakeKubelet,
    pid: u32,
) -> Result<u64, BenchError> {
    let devices = concurrent_devices(model, a.gpus, a.concurrency)?;
    let mut done = 0u64;
    let mut round = 0u64;
    while done < u64::from(a.iterations) {
        let n = (u64::from(a.iterations) - done).min(devices.len() as u64) as usize;
        let batch = put_claims(store, &format!("rss-{round}"), &devices[..n])?;
        each_answered(pid, "prepare", &batch, |c| async move {
            let r = kubelet.prepare(std::slice::from_ref(c)).await?;
            Ok(r.claims.get(&c.uid).map(|x| x.error.clone()))
        })
        .await?;
        each_answered(pid, "unprepare", &batch, |c| async move {
            let r = kubelet.unprepare(std::slice::from_ref(c)).await?;
            Ok(r.claims.get(&c.uid).map(|x| x.error.clone()))
        })
        .await?;
        done += n as u64;
        round += 1;
    }
    Ok(done)
}

/// `call` (the kubelet's `what`) for each claim of `batch` at once, every
/// one answered in time and without a per-claim error. `call` returns the
/// claim's error in the answer, empty when it succeeded (`None`: no result
/// for the claim).
async fn each_answered<'c, F, Fut>(
    pid: u32,
    what: &str,
    batch: &'c [ClaimRef],
    call: F,
) -> Result<(), BenchError>
where
    F: Fn(&'c ClaimRef) -> Fut,
    Fut: std::future::Future<Output = Result<Option<String>, FakeKubeletError>>,
{
    let answers = answered(
        pid,
        what,
        batch.len(),
        futures::future::join_all(batch.iter().map(call)),
    )
    .await?;
    for (c, r) in batch.iter().zip(answers) {
        let e = r
            .map_err(|e| BenchError::setup(format!("plugin process: {what} {c}"), e))?
            .unwrap_or_else(|| "no result".into());
        if !e.is_empty() {
            return Err(BenchError::Plugin(format!(
                "plugin process: {what} {c}: {e}"
            )));
        }
    }
    Ok(())
}

/// `calls` concurrent calls to the plugin process, answered within
/// [`PROCESS_DEADLINE`] or an error that says where its threads wait.
async fn answered<T>(
    pid: u32,
    what: &str,
    calls: usize,
    f: impl std::future::Future<Output = T>,
) -> Result<T, BenchError> {
    tokio::time::timeout(PROCESS_DEADLINE, f).await.map_err(|_| {
        BenchError::Plugin(format!(
            "plugin process: {calls} concurrent {what} calls not all answered within {PROCESS_DEADLINE:?} (stuck?); its threads wait in: {}",
            thread_waits(pid)
        ))
    })
}

/// Kernel wait channel of each thread of a process, counted
/// (`locks_lock_inode_wait x7, do_epoll_wait x1, ...`).
fn thread_waits(pid: u32) -> String {
    let mut waits: BTreeMap<String, usize> = BTreeMap::new();
    let dir = format!("/proc/{pid}/task");
    for t in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let w = std::fs::read_to_string(t.path().join("wchan")).unwrap_or_default();
        let w = if w.trim().is_empty() || w.trim() == "0" {
            "running".to_string()
        } else {
            w.trim().to_string()
        };
        *waits.entry(w).or_default() += 1;
    }
    if waits.is_empty() {
        return format!("(cannot read {dir})");
    }
    waits
        .iter()
        .map(|(w, n)| format!("{w} x{n}"))
        .collect::<Vec<_>>()
        .join(", ")
}
