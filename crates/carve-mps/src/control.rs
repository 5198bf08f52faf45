//! [`MpsControl`]: one MPS control daemon per shared unit (a whole GPU or one
//! MIG instance), its clients, and their limits.
//!
//! Files, all under `<MPS root>/<unit>/` (directories 0700):
//! `pipe/` (`CUDA_MPS_PIPE_DIRECTORY`, where the daemon writes
//! `nvidia-cuda-mps-control.pid`), `log/` (`CUDA_MPS_LOG_DIRECTORY`) and
//! `state.json` (daemon identity and clients, written atomically), which lets a
//! restarted plugin adopt the running daemon without sending it anything.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use carve_model::sharing::{MemoryLimit, MpsCapabilities, MpsDeviceSpec, MpsLimits, translate};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde::{Deserialize, Serialize};

use crate::cdi::{ShareEdits, share_edits};
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
    /// Legacy: commands on stdin, per-daemon defaults plus client variables.
    V2,
    /// Verbs on the command line, namespaces bound to cgroups.
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
}

/// MPS v3 verbs. The exact spellings are UNVERIFIED: dra-api.md E.2 names the
/// modules and settings (servers, namespaces with `cgroup`,
/// `pinned_memory_limit`, `active_thread_percentage`; `-p 3`; `-q`) but not
/// every command-line form. Everything carve sends in v3 is built here, so a
/// correction touches this table only.
pub mod v3 {
    use std::path::Path;

    use carve_model::sharing::MpsLimits;

    /// Start the daemon in the background with protocol 3.
    pub const START: [&str; 3] = ["-d", "-p", "3"];
    /// Stop the daemon.
    pub const QUIT: [&str; 1] = ["-q"];
    /// The named server carve creates per daemon.
    pub const SERVER: &str = "carve";

    /// Create carve's server, allowed on the unit's device only.
    #[must_use]
    pub fn server_create(uuid: &str) -> Vec<String> {
        vec![
            "server".into(),
            "create".into(),
            format!("--name={SERVER}"),
            format!("--allowed-devices={uuid}"),
        ]
    }

    /// One namespace per claim share, bound to the pod cgroup, with its limits.
    #[must_use]
    pub fn namespace_create(name: &str, cgroup: &Path, uuid: &str, l: &MpsLimits) -> Vec<String> {
        vec![
            "namespace".into(),
            "create".into(),
            format!("--server={SERVER}"),
            format!("--name={name}"),
            format!("--cgroup={}", cgroup.display()),
            format!("--pinned-memory-limit={uuid}={}M", l.memory_limit_mib),
            format!("--active-thread-percentage={}", l.active_thread_percentage),
        ]
    }

    /// Remove a namespace.
    #[must_use]
    pub fn namespace_delete(name: &str) -> Vec<String> {
        vec![
            "namespace".into(),
            "delete".into(),
            format!("--server={SERVER}"),
            format!("--name={name}"),
        ]
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
    /// PCI bus id of the GPU (for `dmem`), where known.
    pub pci_bus_id: Option<String>,
    /// Whether the unit is a MIG instance (`dmem` does not apply).
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
    /// The pod cgroup, relative to the cgroup root (required for hard limits).
    pub cgroup: Option<PathBuf>,
}

impl ClientSpec {
    fn key(&self) -> String {
        format!("{}/{}", self.claim_uid, self.share_id)
    }

    fn namespace(&self) -> String {
        format!("{}.{}", self.claim_uid, self.share_id)
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct UnitState {
    version: u32,
    identity: Option<DaemonIdentity>,
    clients: BTreeMap<String, ClientSpec>,
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
            uuid,
        }
    }

    fn command(&self) -> Command {
        let mut c = Command::new(&self.cfg.control_binary);
        c.env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe_dir)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log_dir)
            .env_remove("CUDA_MPS_PROTOCOL_VERSION");
        c
    }

    /// Start a daemon and wait for its pid file and control endpoint.
    pub(crate) fn start(&self, protocol: Protocol) -> Result<DaemonIdentity, MpsError> {
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
        let mut cmd = self.command();
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
        let stat = pid.and_then(proc::stat);
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
                })
            }
            (_, pid, _) => {
                if let Some(pid) = pid {
                    proc::kill(pid);
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
                proc::kill(id.pid);
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
        Ok(())
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
        Some((self.edits(c), c.cgroup.clone()))
    }

    /// Whether no claim uses the unit (then a MIG instance behind it may go).
    #[must_use]
    pub fn is_idle(&self) -> bool {
        self.state.clients.is_empty()
    }

    /// The enforcement levels this unit gives its clients.
    #[must_use]
    pub fn capabilities(&self) -> MpsCapabilities {
        Support {
            protocol: self.protocol(),
            ..self.support.clone()
        }
        .capabilities()
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
        }
        let protocol = self.support.protocol;
        let id = self.daemon().start(protocol)?;
        self.state.identity = Some(id.clone());
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
    fn configure_all(&self) -> Result<(), MpsError> {
        let d = self.daemon();
        match self.protocol() {
            Protocol::V3 => {
                d.v3(&v3::server_create(&self.target.uuid))?;
                for c in self.state.clients.values() {
                    self.v3_add(c)?;
                }
                Ok(())
            }
            Protocol::V2 => self.v2_defaults(self.state.clients.values()),
        }
    }

    /// v2: per-daemon defaults are ceilings for every future server: the
    /// largest share among the clients. Per-claim limits come from the client
    /// variables (see [`crate::cdi`]).
    fn v2_defaults<'c>(
        &self,
        clients: impl Iterator<Item = &'c ClientSpec>,
    ) -> Result<(), MpsError> {
        let (mut mib, mut pct) = (0, 0);
        for c in clients {
            mib = mib.max(c.limits.memory_limit_mib);
            pct = pct.max(c.limits.active_thread_percentage);
        }
        if mib == 0 {
            return Ok(());
        }
        self.daemon().v2(&[
            v2::set_default_device_pinned_mem_limit(&self.target.uuid, mib),
            v2::set_default_active_thread_percentage(pct),
        ])?;
        Ok(())
    }

    fn cgroup_dir(&self, c: &ClientSpec) -> Option<PathBuf> {
        c.cgroup
            .as_ref()
            .map(|p| self.cfg.cgroup_root.join(p.strip_prefix("/").unwrap_or(p)))
    }

    fn v3_add(&self, c: &ClientSpec) -> Result<(), MpsError> {
        let Some(cg) = self.cgroup_dir(c) else {
            return Err(self.missing_cgroup(c));
        };
        self.daemon().v3(&v3::namespace_create(
            &c.namespace(),
            &cg,
            &self.target.uuid,
            &c.limits,
        ))?;
        self.dmem(c, Some(c.limits.memory_limit_mib))
    }

    fn missing_cgroup(&self, c: &ClientSpec) -> MpsError {
        MpsError::MissingCgroup {
            unit: self.target.unit.clone(),
            claim: c.claim_uid.clone(),
            share: c.share_id.clone(),
        }
    }

    /// With the `dmem` controller (non-MIG only), also cap the pod cgroup's
    /// device memory in the kernel: `dmem.max` = the limit, or `max` to clear.
    fn dmem(&self, c: &ClientSpec, mib: Option<u64>) -> Result<(), MpsError> {
        if self.target.mig {
            return Ok(());
        }
        let Some(region) = self
            .target
            .pci_bus_id
            .as_deref()
            .and_then(|p| self.support.dmem_region(p))
        else {
            return Ok(());
        };
        let Some(dir) = self.cgroup_dir(c) else {
            return Ok(());
        };
        if mib.is_none() && !dir.exists() {
            return Ok(());
        }
        let value = mib.map_or_else(|| "max".to_string(), |m| (m * 1024 * 1024).to_string());
        let path = dir.join("dmem.max");
        std::fs::write(&path, format!("{region} {value}\n")).map_err(io("write", &path))
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
    /// Bad ids, a missing cgroup for hard limits, a share already present with
    /// other limits, or a daemon failure. On error the client is not recorded,
    /// other clients keep their limits, and a daemon started for it is stopped.
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
            return Ok(self.edits(&c));
        }
        if self.capabilities().memory_limit == MemoryLimit::Hard {
            let Some(dir) = self.cgroup_dir(&c) else {
                return Err(self.missing_cgroup(&c));
            };
            if !dir.is_dir() {
                return Err(MpsError::CgroupNotFound {
                    unit: self.target.unit.clone(),
                    claim: c.claim_uid,
                    path: dir,
                });
            }
        }
        let _: Ensure = self.ensure_daemon()?;
        let applied = match self.protocol() {
            Protocol::V3 => self.v3_add(&c),
            Protocol::V2 => self.v2_defaults(self.state.clients.values().chain([&c])),
        };
        if let Err(e) = applied {
            if self.state.clients.is_empty() {
                self.stop_daemon()?;
            } else if self.protocol() == Protocol::V2 {
                // Put the others' ceilings back; the failed command may have half-applied.
                let _ = self.v2_defaults(self.state.clients.values());
            }
            return Err(e);
        }
        let edits = self.edits(&c);
        self.state.clients.insert(key, c);
        self.save()?;
        Ok(edits)
    }

    fn edits(&self, c: &ClientSpec) -> ShareEdits {
        share_edits(
            &self.dir.join("pipe"),
            &self.target.uuid,
            self.capabilities(),
            &c.limits,
            &c.claim_uid,
            &c.share_id,
        )
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
                    self.v2_defaults(self.state.clients.values().filter(|o| o.key() != key))?;
                }
            }
        }
        self.dmem(&c, None)?;
        self.state.clients.remove(&key);
        self.save()?;
        Ok(true)
    }

    /// After the last client: quit the daemon and wait until it is gone.
    /// `Ok(true)` if a daemon was stopped.
    ///
    /// # Errors
    /// The daemon does not exit even when killed.
    pub fn stop_if_idle(&mut self) -> Result<bool, MpsError> {
        if !self.state.clients.is_empty() || self.state.identity.is_none() {
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
