//! [`MpsControl`]: one MPS control daemon per shared unit (a whole GPU or one
//! MIG instance), its clients, and their limits.
//!
//! Files, all under `<MPS root>/<unit>/` (directories 0700):
//! `pipe/` (`CUDA_MPS_PIPE_DIRECTORY`, where the daemon writes
//! `nvidia-cuda-mps-control.pid`), `log/` (`CUDA_MPS_LOG_DIRECTORY`) and
//! `state.json` (daemon identity, clients and, in v3, each share's namespace
//! pipe directory, written atomically), which lets a restarted plugin adopt
//! the running daemon without sending it anything.
//!
//! v3 (`../shared/reference/mps-v3.md`): the daemon runs with `-m -p 3`; one
//! server `carve` allowed on the unit's device, checked `Ready`; per claim
//! share one namespace ([`v3::namespace_name`]) created, then given both
//! limits with `namespace set`; the share's container gets only that
//! namespace's pipe directory ([`crate::cdi`]). v2: per-share client
//! variables under per-server ceilings.
//!
//! # v2: one claim per unit
//!
//! A v2 client finds its server through the daemon's pipe directory, the
//! same directory that holds the daemon's `control` endpoint and pid file;
//! NVIDIA's MPS documentation ("Legacy MPS v2 Interface",
//! docs.nvidia.com/deploy/mps; [V2] in `../shared/reference/mps-v3.md`)
//! drives the daemon through that endpoint (`quit`,
//! `set_active_thread_percentage <PID>`, `set_device_pinned_mem_limit
//! <PID>`, `terminate_client`) with no check beyond the directory's
//! permissions, which a root container meets. Any v2 client can therefore
//! stop MPS or change the limits of every client of the daemon. So a v2 unit's daemon serves one claim: [`MpsControl::add_client`]
//! refuses a share of a second claim ([`MpsError::V2UnitTaken`]), and the
//! published v2 device lets one claim take the whole unit (see
//! `carve_model::sharing`), as NVIDIA's DRA driver runs one daemon per
//! claim. The claim's own pods and containers share that daemon. Cost: one
//! claim per GPU or MIG instance through MPS under v2.
//!
//! Signals go to the daemon identity carve recorded when it started the
//! daemon (pid and start time), through `kill(2)` ([`crate::proc::kill`]).

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use carve_model::sharing::{MpsCapabilities, MpsDeviceSpec, MpsLimits, translate};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde::{Deserialize, Serialize};

use crate::cdi::{ShareEdits, SharePipe, share_edits};
use crate::detect::{MpsConfig, Support};
use crate::error::{MpsError, io};
use crate::proc;

/// File the control daemon writes its pid to, in the pipe directory.
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// The daemon's control endpoint in the pipe directory (a FIFO for the real
/// daemon, a Unix socket for the fake); readiness needs it and the pid file.
pub const CONTROL_FILE: &str = "control";
const STATE_FILE: &str = "state.json";
const STATE_VERSION: u32 = 1;

/// MPS control protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// Legacy: commands on stdin, per-server ceilings plus client variables.
    V2,
    /// Verbs on the command line; one namespace, with its own socket
    /// directory and limits, per claim share.
    V3,
}

/// MPS v2 stdin commands (NVIDIA MPS docs, "legacy interface"; dra-api.md E).
pub mod v2 {
    /// Start the daemon in the background.
    pub const START: [&str; 1] = ["-d"];
    /// Stop the daemon and its servers.
    pub const QUIT: &str = "quit";
    /// List server pids.
    pub const GET_SERVER_LIST: &str = "get_server_list";

    /// Default per-client device memory limit of future servers.
    #[must_use]
    pub fn set_default_device_pinned_mem_limit(uuid: &str, mib: u64) -> String {
        format!("set_default_device_pinned_mem_limit {uuid} {mib}M")
    }

    /// Default active-thread percentage of future servers.
    #[must_use]
    pub fn set_default_active_thread_percentage(pct: u32) -> String {
        format!("set_default_active_thread_percentage {pct}")
    }

    /// Memory limit of the running server `pid`, for its clients created
    /// afterwards [V2].
    #[must_use]
    pub fn set_device_pinned_mem_limit(pid: u32, uuid: &str, mib: u64) -> String {
        format!("set_device_pinned_mem_limit {pid} {uuid} {mib}M")
    }

    /// Active-thread percentage of the running server `pid` [V2].
    #[must_use]
    pub fn set_active_thread_percentage(pid: u32, pct: u32) -> String {
        format!("set_active_thread_percentage {pid} {pct}")
    }
}

/// MPS v3 verbs, as NVIDIA documents them for release 615 ([IF], [NS] in
/// `../shared/reference/mps-v3.md`): names are positional; `namespace create`
/// takes only `--server`, limits follow with `namespace set`; memory is a bare
/// `<n>M`. Release 620 is driven the same way: its additions (cgroup routing)
/// have no documented CLI spelling, so carve uses none of them on either.
/// Everything carve sends in v3 is built here.
pub mod v3 {
    use carve_model::sharing::MpsLimits;

    /// Start the daemon in the background, multi-user (clients of any UID,
    /// as pods run; the daemon runs as root), protocol 3 [IF 1.1], [DYN].
    pub const START: [&str; 4] = ["-d", "-m", "-p", "3"];
    /// The documented v3 test: lists `server` and `namespace` [DYN].
    pub const HELP: [&str; 3] = ["-p", "3", "-h"];
    /// Stop the daemon and its servers [IF 1.1].
    pub const QUIT: [&str; 1] = ["-q"];
    /// The named server carve creates per daemon.
    pub const SERVER: &str = "carve";
    /// The status of a server that serves [IF 1.3].
    pub const READY: &str = "Ready";

    fn v(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| (*s).to_string()).collect()
    }

    /// Create carve's server, allowed on the unit's device only. No `--uid`:
    /// in multiuser mode only `--uid=0` is allowed, and the connecting user
    /// (root) owns it [IF 1.3].
    #[must_use]
    pub fn server_create(uuid: &str) -> Vec<String> {
        let mut a = v(&["server", "create", SERVER]);
        a.push(format!("--allowed-devices={uuid}"));
        a
    }

    /// `server get carve status` [IF 1.3].
    #[must_use]
    pub fn server_status() -> Vec<String> {
        v(&["server", "get", SERVER, "status"])
    }

    /// `namespace create <ns> --server=carve` [IF 1.4].
    #[must_use]
    pub fn namespace_create(ns: &str) -> Vec<String> {
        v(&["namespace", "create", ns, &format!("--server={SERVER}")])
    }

    /// `namespace set <ns> --server=carve --pinned-memory-limit=<N>M
    /// --active-thread-percentage=<p>`: both limits, since a named namespace
    /// inherits none of the server's [DYN].
    #[must_use]
    pub fn namespace_set(ns: &str, l: &MpsLimits) -> Vec<String> {
        v(&[
            "namespace",
            "set",
            ns,
            &format!("--server={SERVER}"),
            &format!("--pinned-memory-limit={}M", l.memory_limit_mib),
            &format!("--active-thread-percentage={}", l.active_thread_percentage),
        ])
    }

    /// `namespace get <ns> carve pipe-directory` [IF 1.4], [NS].
    #[must_use]
    pub fn namespace_pipe_directory(ns: &str) -> Vec<String> {
        v(&["namespace", "get", ns, SERVER, "pipe-directory"])
    }

    /// `namespace delete <ns> --server=carve --force`: at unprepare the pod's
    /// containers are gone; `--force` ends a client process they left [IF].
    #[must_use]
    pub fn namespace_delete(ns: &str) -> Vec<String> {
        v(&[
            "namespace",
            "delete",
            ns,
            &format!("--server={SERVER}"),
            "--force",
        ])
    }

    /// The namespace of a claim share: `c_` and 16 hex digits of the SHA-256
    /// of `<claim UID>/<share ID>`. Valid (`[a-z0-9_]`, at most 64 [IF 1.2]),
    /// short enough for socket paths, and the same after a restart.
    #[must_use]
    pub fn namespace_name(claim_uid: &str, share_id: &str) -> String {
        use sha2::Digest as _;
        let d = sha2::Sha256::digest(format!("{claim_uid}/{share_id}").as_bytes());
        let hex: String = d[..8].iter().map(|b| format!("{b:02x}")).collect();
        format!("c_{hex}")
    }
}

/// Who the running daemon is: for the plugin's checkpoint and for adoption.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DaemonIdentity {
    /// Daemon pid.
    pub pid: u32,
    /// Its start time (`/proc/<pid>/stat` field 22): tells a recycled pid apart.
    pub start_time: u64,
    /// `CUDA_MPS_PIPE_DIRECTORY`.
    pub pipe_dir: PathBuf,
    /// `CUDA_MPS_LOG_DIRECTORY`.
    pub log_dir: PathBuf,
    /// Protocol it speaks.
    pub protocol: Protocol,
    /// The unit's tmpfs, where the daemon has it as its `/dev/shm`
    /// ([`crate::shm`]); `None` for a daemon started without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm: Option<PathBuf>,
    /// The daemon's own cgroup in each hierarchy
    /// ([`crate::daemon_cgroup`]); empty for a daemon left in the plugin's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cgroups: Vec<PathBuf>,
}

/// The shared unit a daemon serves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsTarget {
    /// Device name (`gpu-0-mps`, `gpu-0-mig-1g10gb-3-mps`); names the unit directory.
    pub unit: String,
    /// UUID the daemon is given as `CUDA_VISIBLE_DEVICES` and limits name:
    /// `GPU-…` or, for a MIG instance, `MIG-…`.
    pub uuid: String,
    /// PCI bus id of the GPU, where known (the key of a memory-partitioning
    /// limit, which carve does not set yet).
    pub pci_bus_id: Option<String>,
    /// Whether the unit is a MIG instance (memory partitioning never applies
    /// to MIG [MP]).
    pub mig: bool,
}

impl MpsTarget {
    /// The target of an MPS device; `uuid` is the GPU's, or the MIG instance's
    /// once created.
    #[must_use]
    pub fn of(device: &MpsDeviceSpec, uuid: &str, pci_bus_id: Option<String>) -> Self {
        Self {
            unit: device.name.clone(),
            uuid: uuid.to_string(),
            pci_bus_id,
            mig: device.mig.is_some(),
        }
    }
}

/// One claim share to add.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientSpec {
    /// Claim UID.
    pub claim_uid: String,
    /// `shareID` of the allocation result.
    pub share_id: String,
    /// Its limits ([`translate`]).
    pub limits: MpsLimits,
    /// The pod cgroup, relative to the cgroup root. Unused by MPS today
    /// (release 615 has no cgroup binding, 620's CLI for it is unknown);
    /// kept for the checkpoint format.
    pub cgroup: Option<PathBuf>,
}

impl ClientSpec {
    fn key(&self) -> String {
        format!("{}/{}", self.claim_uid, self.share_id)
    }

    /// Its v3 namespace ([`v3::namespace_name`]).
    #[must_use]
    pub fn namespace(&self) -> String {
        v3::namespace_name(&self.claim_uid, &self.share_id)
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct UnitState {
    version: u32,
    identity: Option<DaemonIdentity>,
    clients: BTreeMap<String, ClientSpec>,
    /// v3: each share's namespace pipe directory, as the daemon named it.
    #[serde(default)]
    pipe_dirs: BTreeMap<String, PathBuf>,
}

/// What [`MpsControl::ensure_running`] found or did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum Ensure {
    /// No clients and no daemon: nothing to do.
    Idle,
    /// The daemon this `MpsControl` started or adopted still runs.
    Running,
    /// A daemon from before a plugin restart runs and was adopted untouched.
    Adopted,
    /// No daemon ran; one was started.
    Started,
    /// The daemon had died; a new one runs with every client's limits re-applied.
    Restarted,
}

/// Supervisor of one unit's MPS control daemon. Blocking; run it off the
/// async executor.
#[derive(Debug)]
pub struct MpsControl {
    cfg: MpsConfig,
    support: Support,
    target: MpsTarget,
    dir: PathBuf,
    state: UnitState,
    verified: bool,
}

pub(crate) fn make_private_dir(path: &Path) -> Result<(), MpsError> {
    std::fs::create_dir_all(path).map_err(io("create directory", path))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
        .map_err(io("chmod 0700", path))
}

fn check_id(what: &'static str, v: &str) -> Result<(), MpsError> {
    let ok = !v.is_empty()
        && v.len() <= 64
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && !v.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(MpsError::BadId {
            what,
            value: v.to_string(),
        })
    }
}

/// Talks to one daemon.
#[derive(Debug)]
pub(crate) struct Daemon<'a> {
    cfg: &'a MpsConfig,
    unit: &'a str,
    pipe_dir: PathBuf,
    log_dir: PathBuf,
    shm_dir: PathBuf,
    uuid: Option<&'a str>,
}

impl<'a> Daemon<'a> {
    pub(crate) fn new(
        cfg: &'a MpsConfig,
        unit: &'a str,
        dir: &Path,
        uuid: Option<&'a str>,
    ) -> Self {
        Self {
            cfg,
            unit,
            pipe_dir: dir.join("pipe"),
            log_dir: dir.join("log"),
            shm_dir: dir.join(crate::shm::SHM_DIR),
            uuid,
        }
    }

    fn command(&self) -> Command {
        let mut c = Command::new(&self.cfg.control_binary);
        self.env(&mut c);
        c
    }

    fn env(&self, c: &mut Command) {
        c.env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe_dir)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log_dir)
            .env_remove("CUDA_MPS_PROTOCOL_VERSION");
    }

    /// The unit's daemon cgroups under the configured
    /// [`MpsConfig::daemon_cgroup`]; empty without one.
    pub(crate) fn cgroup_dirs(&self) -> Result<Vec<PathBuf>, MpsError> {
        match &self.cfg.daemon_cgroup {
            Some(d) => crate::daemon_cgroup::unit_dirs(&self.cfg.cgroup_root, d, self.unit),
            None => Ok(Vec::new()),
        }
    }

    /// Remove the unit's daemon cgroups (the recorded ones and those of the
    /// configuration), once no process of the daemon is left in them.
    pub(crate) fn remove_cgroups(&self, recorded: &[PathBuf]) -> Result<(), MpsError> {
        let mut dirs = recorded.to_vec();
        // A daemon that died unrecorded may have left the configured ones.
        if let Ok(more) = self.cgroup_dirs() {
            dirs.extend(more.into_iter().filter(|d| !recorded.contains(d)));
        }
        crate::daemon_cgroup::remove(self.unit, &dirs, self.cfg.timeout)
    }

    /// Start a daemon and wait for its pid file and control endpoint; with a
    /// launcher configured, on the unit's tmpfs as its `/dev/shm`
    /// ([`crate::shm`]), and with [`MpsConfig::daemon_cgroup`], in the unit's
    /// own cgroup ([`crate::daemon_cgroup`]). On error no daemon runs, no
    /// tmpfs stays mounted and no cgroup of the unit is left.
    pub(crate) fn start(&self, protocol: Protocol) -> Result<DaemonIdentity, MpsError> {
        let cgroups = self.cgroup_dirs()?;
        let Some(launcher) = &self.cfg.shm_launcher else {
            if !cgroups.is_empty() {
                return Err(MpsError::StartFailed {
                    unit: self.unit.to_string(),
                    binary: self.cfg.control_binary.clone(),
                    args: String::new(),
                    why: "a daemon cgroup is configured but no launcher (shm_launcher) that could move the daemon there".into(),
                });
            }
            return self.start_on(protocol, None, &cgroups);
        };
        crate::daemon_cgroup::create(self.unit, &cgroups)?;
        let started = crate::shm::mount(&self.shm_dir)
            .and_then(|()| self.start_on(protocol, Some(launcher), &cgroups));
        if started.is_err() {
            if let Err(e) = crate::shm::unmount(&self.shm_dir) {
                tracing::warn!(unit = self.unit, error = %e, "removing the MPS tmpfs after a failed start");
            }
            if let Err(e) = crate::daemon_cgroup::remove(self.unit, &cgroups, self.cfg.timeout) {
                tracing::warn!(unit = self.unit, error = %e, "removing the MPS daemon cgroup after a failed start");
            }
        }
        started
    }

    fn start_on(
        &self,
        protocol: Protocol,
        launcher: Option<&PathBuf>,
        cgroups: &[PathBuf],
    ) -> Result<DaemonIdentity, MpsError> {
        make_private_dir(&self.pipe_dir)?;
        make_private_dir(&self.log_dir)?;
        for f in [PID_FILE, CONTROL_FILE] {
            let p = self.pipe_dir.join(f);
            if p.exists() {
                std::fs::remove_file(&p).map_err(io("remove stale", &p))?;
            }
        }
        let args: &[&str] = match protocol {
            Protocol::V2 => &v2::START,
            Protocol::V3 => &v3::START,
        };
        let mut cmd = match launcher {
            Some(l) => {
                let mut c = crate::launcher::command(
                    l,
                    cgroups,
                    Some(&self.shm_dir),
                    &self.cfg.control_binary,
                );
                self.env(&mut c);
                c
            }
            None => self.command(),
        };
        cmd.args(args);
        match self.uuid {
            Some(u) => cmd.env("CUDA_VISIBLE_DEVICES", u),
            None => cmd.env_remove("CUDA_VISIBLE_DEVICES"),
        };
        let failed = |why: String| MpsError::StartFailed {
            unit: self.unit.to_string(),
            binary: self.cfg.control_binary.clone(),
            args: args.join(" "),
            why,
        };
        // Could not run it at all (spawn error, timeout): not a refusal.
        let out = proc::run(cmd, "", self.cfg.timeout).map_err(|why| MpsError::Command {
            unit: self.unit.to_string(),
            command: format!("{} {}", self.cfg.control_binary.display(), args.join(" ")),
            why,
        })?;
        if !out.status.success() {
            return Err(failed(format!("{}: {}", out.status, out.stderr.trim())));
        }
        let pid_file = self.pipe_dir.join(PID_FILE);
        let ready = proc::wait_until(self.cfg.timeout, || {
            pid_file.exists() && self.pipe_dir.join(CONTROL_FILE).exists()
        });
        let pid = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok());
        // The pid file lies in the pipe directory, which a v2 claim's
        // containers get read-write: a pid in it is only the daemon's if
        // that process started after the command that launched it.
        let stat = pid
            .and_then(proc::stat)
            .filter(|(_, t)| out.started.is_some_and(|s| *t >= s));
        match (ready, pid, stat) {
            (true, Some(pid), Some((_, start_time))) => {
                tracing::info!(
                    unit = self.unit,
                    pid,
                    ?protocol,
                    "MPS control daemon started"
                );
                Ok(DaemonIdentity {
                    pid,
                    start_time,
                    pipe_dir: self.pipe_dir.clone(),
                    log_dir: self.log_dir.clone(),
                    protocol,
                    shm: launcher.map(|_| self.shm_dir.clone()),
                    cgroups: cgroups.to_vec(),
                })
            }
            (_, pid, stat) => {
                if let (Some(pid), Some((_, start_time))) = (pid, stat)
                    && let Err(e) = proc::kill(pid, start_time)
                {
                    tracing::warn!(unit = self.unit, error = %e, "stopping an MPS daemon that did not get ready");
                }
                Err(MpsError::NotReady {
                    unit: self.unit.to_string(),
                    pipe_dir: self.pipe_dir.clone(),
                    waited_ms: self.cfg.timeout.as_millis(),
                })
            }
        }
    }

    fn check(&self, what: String, out: Result<proc::Output, String>) -> Result<String, MpsError> {
        let err = |why| MpsError::Command {
            unit: self.unit.to_string(),
            command: what.clone(),
            why,
        };
        let out = out.map_err(err)?;
        if out.status.success() {
            Ok(out.stdout)
        } else {
            Err(err(format!(
                "{}: {}{}",
                out.status,
                out.stdout.trim(),
                out.stderr.trim()
            )))
        }
    }

    /// Send v2 commands (newline-separated) on stdin.
    pub(crate) fn v2(&self, commands: &[String]) -> Result<String, MpsError> {
        let text = commands.join("\n") + "\n";
        let out = proc::run(self.command(), &text, self.cfg.timeout);
        self.check(commands.join("; "), out)
    }

    /// Run one v3 verb.
    pub(crate) fn v3(&self, args: &[String]) -> Result<String, MpsError> {
        let mut c = self.command();
        c.args(args);
        let out = proc::run(c, "", self.cfg.timeout);
        self.check(args.join(" "), out)
    }

    /// Quit the daemon and wait until it is gone.
    pub(crate) fn stop(&self, id: &DaemonIdentity) -> Result<(), MpsError> {
        if proc::alive(id.pid, id.start_time) {
            let sent = match id.protocol {
                Protocol::V2 => self.v2(&[v2::QUIT.to_string()]).map(drop),
                Protocol::V3 => self.v3(&v3::QUIT.map(String::from)).map(drop),
            };
            let gone = proc::wait_until(self.cfg.timeout, || !proc::alive(id.pid, id.start_time));
            if !gone {
                tracing::warn!(
                    unit = self.unit,
                    pid = id.pid,
                    "MPS daemon ignores quit; killing it"
                );
                if let Err(e) = proc::kill(id.pid, id.start_time) {
                    tracing::warn!(unit = self.unit, error = %e, "killing the MPS daemon");
                }
                if !proc::wait_until(self.cfg.timeout, || !proc::alive(id.pid, id.start_time)) {
                    return Err(MpsError::StopTimeout {
                        unit: self.unit.to_string(),
                        pid: id.pid,
                    });
                }
            } else if let Err(e) = sent {
                // Gone anyway (it may have died while we asked).
                tracing::debug!(unit = self.unit, error = %e, "quit failed but the daemon is gone");
            }
            tracing::info!(unit = self.unit, pid = id.pid, "MPS control daemon stopped");
        }
        let pid_file = self.pipe_dir.join(PID_FILE);
        if pid_file.exists() {
            std::fs::remove_file(&pid_file).map_err(io("remove", &pid_file))?;
        }
        // The daemon and its servers are gone: nothing uses the tmpfs or the cgroup.
        crate::shm::unmount(&self.shm_dir)?;
        self.remove_cgroups(&id.cgroups)
    }
}

impl MpsControl {
    /// Open the unit of `target`: create its directories (0700) and load its
    /// state. Starts nothing.
    ///
    /// # Errors
    /// A bad unit name, a directory that cannot be made, or a corrupt state file.
    pub fn open(cfg: &MpsConfig, support: &Support, target: MpsTarget) -> Result<Self, MpsError> {
        if target.unit.parse::<carve_model::DeviceName>().is_err() {
            return Err(MpsError::BadId {
                what: "unit",
                value: target.unit.clone(),
            });
        }
        let root = cfg.mps_root();
        make_private_dir(&root)?;
        let dir = root.join(&target.unit);
        make_private_dir(&dir)?;
        let path = dir.join(STATE_FILE);
        let state = match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|source| MpsError::State {
                path: path.clone(),
                source,
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => UnitState {
                version: STATE_VERSION,
                ..Default::default()
            },
            Err(e) => return Err(io("read", &path)(e)),
        };
        Ok(Self {
            cfg: cfg.clone(),
            support: support.clone(),
            target,
            dir,
            state,
            verified: false,
        })
    }

    /// The unit directory.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The running daemon, as last known.
    #[must_use]
    pub fn identity(&self) -> Option<&DaemonIdentity> {
        self.state.identity.as_ref()
    }

    /// Current clients, by `<claim>/<share>`.
    pub fn clients(&self) -> impl Iterator<Item = &ClientSpec> {
        self.state.clients.values()
    }

    /// The container edits and cgroup of a recorded share, as
    /// [`MpsControl::add_client`] returned them.
    #[must_use]
    pub fn share(&self, claim_uid: &str, share_id: &str) -> Option<(ShareEdits, Option<PathBuf>)> {
        let c = self.state.clients.get(&format!("{claim_uid}/{share_id}"))?;
        Some((self.edits(c)?, c.cgroup.clone()))
    }

    /// Whether no claim uses the unit (then a MIG instance behind it may go).
    #[must_use]
    pub fn is_idle(&self) -> bool {
        self.state.clients.is_empty()
    }

    /// The enforcement levels this unit gives its clients.
    #[must_use]
    pub fn capabilities(&self) -> MpsCapabilities {
        let c = Support {
            protocol: self.protocol(),
            ..self.support.clone()
        }
        .capabilities();
        if self.target.mig { c.on_mig() } else { c }
    }

    fn protocol(&self) -> Protocol {
        self.state
            .identity
            .as_ref()
            .map_or(self.support.protocol, |i| i.protocol)
    }

    fn daemon(&self) -> Daemon<'_> {
        Daemon::new(
            &self.cfg,
            &self.target.unit,
            &self.dir,
            Some(&self.target.uuid),
        )
    }

    fn save(&self) -> Result<(), MpsError> {
        let path = self.dir.join(STATE_FILE);
        let mut f =
            tempfile::NamedTempFile::new_in(&self.dir).map_err(io("create temp in", &self.dir))?;
        let json = serde_json::to_vec_pretty(&self.state).map_err(|source| MpsError::State {
            path: path.clone(),
            source,
        })?;
        f.write_all(&json)
            .map_err(io("write", f.path().to_path_buf()))?;
        f.as_file()
            .sync_all()
            .map_err(io("sync", f.path().to_path_buf()))?;
        f.persist(&path)
            .map_err(|e| io("rename onto", &path)(e.error))?;
        Ok(())
    }

    fn running(&self) -> bool {
        self.state
            .identity
            .as_ref()
            .is_some_and(|i| proc::alive(i.pid, i.start_time))
    }

    /// Make sure a daemon runs when the unit has clients: adopt one that runs
    /// (sending it nothing), or start one and re-apply every client's limits.
    ///
    /// # Errors
    /// The daemon cannot be started or configured; then none is left running.
    pub fn ensure_running(&mut self) -> Result<Ensure, MpsError> {
        if self.state.clients.is_empty() && !self.running() {
            if self.state.identity.take().is_some() {
                self.save()?;
            }
            // A daemon that died without clients leaves its tmpfs and cgroup behind.
            crate::shm::unmount(&self.dir.join(crate::shm::SHM_DIR))?;
            self.daemon().remove_cgroups(&[])?;
            return Ok(Ensure::Idle);
        }
        self.ensure_daemon()
    }

    fn ensure_daemon(&mut self) -> Result<Ensure, MpsError> {
        if self.running() {
            let first = !self.verified;
            self.verified = true;
            return Ok(if first && !self.state.clients.is_empty() {
                tracing::info!(unit = %self.target.unit, "adopted running MPS control daemon");
                Ensure::Adopted
            } else {
                Ensure::Running
            });
        }
        let restarted = self.state.identity.is_some() && !self.state.clients.is_empty();
        if let Some(old) = self.state.identity.take() {
            tracing::warn!(unit = %self.target.unit, pid = old.pid, "MPS control daemon died");
            // Its cgroups, where another configuration put them; the new
            // daemon's are made again below.
            let stale: Vec<PathBuf> = old
                .cgroups
                .iter()
                .filter(|d| !self.daemon().cgroup_dirs().is_ok_and(|c| c.contains(d)))
                .cloned()
                .collect();
            if let Err(e) =
                crate::daemon_cgroup::remove(&self.target.unit, &stale, self.cfg.timeout)
            {
                tracing::warn!(unit = %self.target.unit, error = %e, "removing a dead MPS daemon's cgroup");
            }
        }
        let protocol = self.support.protocol;
        let id = self.daemon().start(protocol)?;
        self.state.identity = Some(id.clone());
        self.state.pipe_dirs.clear();
        let configured = self.configure_all();
        if let Err(e) = configured {
            let _ = self.daemon().stop(&id);
            self.state.identity = None;
            let _ = self.save();
            return Err(e);
        }
        self.verified = true;
        self.save()?;
        Ok(if restarted {
            Ensure::Restarted
        } else {
            Ensure::Started
        })
    }

    /// Apply the daemon-wide setup and every client's limits to a fresh daemon.
    fn configure_all(&mut self) -> Result<(), MpsError> {
        match self.protocol() {
            Protocol::V3 => {
                self.daemon().v3(&v3::server_create(&self.target.uuid))?;
                self.check_ready()?;
                let clients: Vec<ClientSpec> = self.state.clients.values().cloned().collect();
                for c in clients {
                    let dir = self.v3_add(&c)?;
                    self.state.pipe_dirs.insert(c.key(), dir);
                }
                Ok(())
            }
            Protocol::V2 => self.v2_limits(self.state.clients.values()),
        }
    }

    /// v3: the server must be `Ready`. A `server create` can succeed and
    /// leave no server (it exits at once and drops out of `server list`),
    /// and clients then run without MPS and without limits [DYN].
    fn check_ready(&self) -> Result<(), MpsError> {
        let status = self.daemon().v3(&v3::server_status());
        let status = match status {
            Ok(s) => s.trim().to_string(),
            Err(MpsError::Command { why, .. }) => format!("not listed ({})", why.trim()),
            Err(e) => return Err(e),
        };
        if status == v3::READY {
            return Ok(());
        }
        let log = self.dir.join("log").join(v3::SERVER).join("server.log");
        let tail = std::fs::read_to_string(&log)
            .map(|t| t.lines().rev().take(3).collect::<Vec<_>>().join(" / "))
            .unwrap_or_default();
        Err(MpsError::ServerNotReady {
            unit: self.target.unit.clone(),
            server: v3::SERVER.to_string(),
            status,
            log: tail,
        })
    }

    /// v2: every share's limit is its client variables (see [`crate::cdi`]);
    /// the daemon's ceilings are the largest share, set as defaults (for
    /// servers started later) and on each running server (`set_default_*`
    /// does not reach a running one [V2]).
    fn v2_limits<'c>(&self, clients: impl Iterator<Item = &'c ClientSpec>) -> Result<(), MpsError> {
        let (mut mib, mut pct) = (0, 0);
        for c in clients {
            mib = mib.max(c.limits.memory_limit_mib);
            pct = pct.max(c.limits.active_thread_percentage);
        }
        if mib == 0 {
            return Ok(());
        }
        let d = self.daemon();
        let uuid = &self.target.uuid;
        d.v2(&[
            v2::set_default_device_pinned_mem_limit(uuid, mib),
            v2::set_default_active_thread_percentage(pct),
        ])?;
        let list = d.v2(&[v2::GET_SERVER_LIST.to_string()])?;
        let mut cmds = Vec::new();
        for pid in list.split_whitespace() {
            let pid: u32 = pid.parse().map_err(|_| MpsError::Command {
                unit: self.target.unit.clone(),
                command: v2::GET_SERVER_LIST.into(),
                why: format!("not a server pid: {pid:?}"),
            })?;
            cmds.push(v2::set_device_pinned_mem_limit(pid, uuid, mib));
            cmds.push(v2::set_active_thread_percentage(pid, pct));
        }
        if !cmds.is_empty() {
            d.v2(&cmds)?;
        }
        Ok(())
    }

    /// v3: the share's namespace with its limits; its pipe directory.
    /// Nothing of it is left when this fails.
    fn v3_add(&self, c: &ClientSpec) -> Result<PathBuf, MpsError> {
        let d = self.daemon();
        let ns = c.namespace();
        d.v3(&v3::namespace_create(&ns))?;
        let rest = (|| {
            d.v3(&v3::namespace_set(&ns, &c.limits))?;
            let out = d.v3(&v3::namespace_pipe_directory(&ns))?;
            let dir = PathBuf::from(out.trim());
            let pipe = self.dir.join("pipe");
            if !dir.starts_with(&pipe) || dir == pipe || !dir.join(CONTROL_FILE).exists() {
                return Err(MpsError::Command {
                    unit: self.target.unit.clone(),
                    command: v3::namespace_pipe_directory(&ns).join(" "),
                    why: format!(
                        "pipe directory {} is not a namespace socket directory under {}",
                        dir.display(),
                        pipe.display()
                    ),
                });
            }
            Ok(dir)
        })();
        if rest.is_err()
            && let Err(e) = d.v3(&v3::namespace_delete(&ns))
        {
            tracing::warn!(unit = %self.target.unit, namespace = %ns, error = %e, "removing a half-made namespace failed");
        }
        rest
    }

    /// Translate an allocation and add it as a client ([`translate`] +
    /// [`MpsControl::add_client`]). A bad allocation starts nothing.
    ///
    /// # Errors
    /// [`MpsError::Translate`], or as [`MpsControl::add_client`].
    pub fn prepare(
        &mut self,
        device: &MpsDeviceSpec,
        consumed_capacity: &BTreeMap<String, Quantity>,
        claim_uid: &str,
        share_id: &str,
        cgroup: Option<PathBuf>,
    ) -> Result<ShareEdits, MpsError> {
        let limits =
            translate(consumed_capacity, device).map_err(|source| MpsError::Translate {
                claim: claim_uid.to_string(),
                share: share_id.to_string(),
                source: Box::new(source),
            })?;
        self.add_client(ClientSpec {
            claim_uid: claim_uid.to_string(),
            share_id: share_id.to_string(),
            limits,
            cgroup,
        })
    }

    /// Add a claim share: start the daemon if needed, apply its limits, record
    /// it. Idempotent for the same share and limits.
    ///
    /// # Errors
    /// Bad ids, a share already present with other limits, a server that is
    /// not `Ready`, or a daemon failure. On error the client is not recorded,
    /// no namespace of it is left, other clients keep their limits, and a
    /// daemon started for it is stopped.
    pub fn add_client(&mut self, c: ClientSpec) -> Result<ShareEdits, MpsError> {
        check_id("claim", &c.claim_uid)?;
        check_id("share", &c.share_id)?;
        let key = c.key();
        if let Some(old) = self.state.clients.get(&key) {
            if *old != c {
                return Err(MpsError::ShareConflict {
                    unit: self.target.unit.clone(),
                    claim: c.claim_uid,
                    share: c.share_id,
                });
            }
            let _: Ensure = self.ensure_daemon()?;
            if self.protocol() == Protocol::V3 && !self.state.pipe_dirs.contains_key(&key) {
                // A state written before carve recorded pipe directories.
                let out = self
                    .daemon()
                    .v3(&v3::namespace_pipe_directory(&c.namespace()))?;
                self.state
                    .pipe_dirs
                    .insert(key.clone(), PathBuf::from(out.trim()));
                self.save()?;
            }
            return self.edits(&c).ok_or_else(|| self.no_pipe_dir(&c));
        }
        if self.protocol() == Protocol::V2
            && let Some(holder) = self
                .state
                .clients
                .values()
                .find(|o| o.claim_uid != c.claim_uid)
        {
            return Err(MpsError::V2UnitTaken {
                unit: self.target.unit.clone(),
                claim: c.claim_uid,
                holder: holder.claim_uid.clone(),
            });
        }
        let _: Ensure = self.ensure_daemon()?;
        let applied = match self.protocol() {
            Protocol::V3 => self.check_ready().and_then(|()| self.v3_add(&c)).map(Some),
            Protocol::V2 => self
                .v2_limits(self.state.clients.values().chain([&c]))
                .map(|()| None),
        };
        let dir = match applied {
            Ok(d) => d,
            Err(e) => {
                if self.state.clients.is_empty() {
                    self.stop_daemon()?;
                } else if self.protocol() == Protocol::V2 {
                    // Put the others' ceilings back; the failed command may have half-applied.
                    let _ = self.v2_limits(self.state.clients.values());
                }
                return Err(e);
            }
        };
        if let Some(d) = dir {
            self.state.pipe_dirs.insert(key.clone(), d);
        }
        let edits = self.edits(&c).ok_or_else(|| self.no_pipe_dir(&c))?;
        self.state.clients.insert(key, c);
        self.save()?;
        Ok(edits)
    }

    fn no_pipe_dir(&self, c: &ClientSpec) -> MpsError {
        MpsError::Command {
            unit: self.target.unit.clone(),
            command: v3::namespace_pipe_directory(&c.namespace()).join(" "),
            why: "no pipe directory recorded for the share's namespace".into(),
        }
    }

    /// The share's container edits; `None` for a v3 share whose namespace
    /// pipe directory is not known.
    fn edits(&self, c: &ClientSpec) -> Option<ShareEdits> {
        let pipe = match self.protocol() {
            Protocol::V3 => SharePipe::Namespace(self.state.pipe_dirs.get(&c.key())?.clone()),
            Protocol::V2 => SharePipe::Daemon(self.dir.join("pipe")),
        };
        let shm = self.state.identity.as_ref().and_then(|i| i.shm.as_deref());
        Some(share_edits(
            &pipe,
            shm,
            &self.target.uuid,
            &c.limits,
            &c.claim_uid,
            &c.share_id,
        ))
    }

    /// Remove a claim share and its limits. Does not stop the daemon (see
    /// [`MpsControl::stop_if_idle`]). `Ok(false)` if it was not a client.
    ///
    /// # Errors
    /// The daemon refuses the change; the client stays recorded then.
    pub fn remove_client(&mut self, claim_uid: &str, share_id: &str) -> Result<bool, MpsError> {
        let key = format!("{claim_uid}/{share_id}");
        let Some(c) = self.state.clients.get(&key).cloned() else {
            return Ok(false);
        };
        if self.running() {
            match self.protocol() {
                Protocol::V3 => {
                    self.daemon().v3(&v3::namespace_delete(&c.namespace()))?;
                }
                Protocol::V2 => {
                    self.v2_limits(self.state.clients.values().filter(|o| o.key() != key))?;
                }
            }
        }
        self.state.clients.remove(&key);
        self.state.pipe_dirs.remove(&key);
        self.save()?;
        Ok(true)
    }

    /// After the last client: quit the daemon and wait until it is gone.
    /// `Ok(true)` if a daemon was stopped.
    ///
    /// # Errors
    /// The daemon does not exit even when killed.
    pub fn stop_if_idle(&mut self) -> Result<bool, MpsError> {
        if !self.state.clients.is_empty() {
            return Ok(false);
        }
        if self.state.identity.is_none() {
            crate::shm::unmount(&self.dir.join(crate::shm::SHM_DIR))?;
            self.daemon().remove_cgroups(&[])?;
            return Ok(false);
        }
        self.stop_daemon()?;
        Ok(true)
    }

    fn stop_daemon(&mut self) -> Result<(), MpsError> {
        if let Some(id) = self.state.identity.clone() {
            self.daemon().stop(&id)?;
            self.state.identity = None;
            self.verified = false;
            self.save()?;
        }
        Ok(())
    }
}
