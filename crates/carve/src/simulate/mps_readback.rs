//! What an MPS share really got, read back from what the plugin wrote
//! (claim status, the unit's `state.json`, CDI edits) and what the fake
//! control daemon received, checked against each other.

use super::*;

/// The parts of an MPS unit's `state.json` (written by `carve_mps::MpsControl`
/// in the plugin) that simulate shows.
#[derive(Debug)]
pub(super) struct UnitStateView {
    pub(super) identity: Option<DaemonIdentity>,
    pub(super) clients: BTreeMap<String, ClientSpec>,
}

pub(super) fn read_unit_state(path: &Path) -> Result<UnitStateView, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let bad = |e: serde_json::Error| format!("{} does not decode: {e}", path.display());
    let mut v: serde_json::Value = serde_json::from_slice(&bytes).map_err(bad)?;
    let mut take = |k: &str| v.get_mut(k).map(serde_json::Value::take);
    let identity = match take("identity") {
        None | Some(serde_json::Value::Null) => None,
        Some(i) => Some(serde_json::from_value(i).map_err(bad)?),
    };
    let clients = match take("clients") {
        None | Some(serde_json::Value::Null) => BTreeMap::new(),
        Some(c) => serde_json::from_value(c).map_err(bad)?,
    };
    Ok(UnitStateView { identity, clients })
}

/// State letter and start time (`/proc/<pid>/stat` fields 3 and 22) of
/// process `pid`, if there is one.
pub(super) fn process_stat(pid: u32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `comm` may hold spaces and parentheses: the fields start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some((f.first()?.chars().next()?, f.get(19)?.parse().ok()?))
}

/// Whether process `pid` runs and started at `start_time`, i.e. is not gone,
/// a zombie, or a recycled pid.
pub(super) fn process_alive(pid: u32, start_time: u64) -> bool {
    matches!(process_stat(pid), Some((s, t)) if s != 'Z' && s != 'X' && t == start_time)
}

/// An MPS share as the plugin reports it in the claim's
/// `status.devices[].data.mps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct StatusShare {
    /// The MPS unit (directory under `<state-dir>/mps`).
    pub(super) unit: String,
    pub(super) memory_limit_mib: u64,
    pub(super) multiprocessors: u64,
    pub(super) active_thread_percentage: u64,
    /// Enforcement levels (`hard` | `client`, `percentage` | `partition` | `client`).
    pub(super) memory_limit: Option<String>,
    pub(super) compute_limit: Option<String>,
    /// The pod cgroup the share is bound to, relative to the cgroup root.
    pub(super) cgroup: Option<String>,
    /// Why the plugin left the memory limit `client` on this share.
    pub(super) memory_why: Option<String>,
}

impl StatusShare {
    pub(super) fn from_data(data: &serde_json::Value) -> Result<Self, String> {
        let m = data
            .get("mps")
            .ok_or("the claim's status.devices[].data has no \"mps\" entry")?;
        let num = |k: &str| {
            m.get(k)
                .and_then(serde_json::Value::as_u64)
                .ok_or_else(|| format!("status.devices[].data.mps.{k} is missing or not a number"))
        };
        let text = |k: &str| {
            m.get(k)
                .and_then(serde_json::Value::as_str)
                .map(str::to_string)
        };
        Ok(Self {
            unit: text("unit").ok_or("status.devices[].data.mps.unit is missing")?,
            memory_limit_mib: num("memoryLimitMiB")?,
            multiprocessors: num("multiprocessors")?,
            active_thread_percentage: num("activeThreadPercentage")?,
            memory_limit: text("memoryLimit"),
            compute_limit: text("computeLimit"),
            cgroup: text("cgroup"),
            memory_why: text("memoryLimitWhy"),
        })
    }
}

/// What the plugin and the fake daemon say about one MPS share, read right
/// after it was prepared: the claim status (limits, enforcement, cgroup), the
/// unit's `state.json` (daemon, and the same share as the supervisor keeps
/// it), the published device attributes, the fake daemon's log and the CDI
/// spec. Disagreements between them are problems.
#[derive(Debug, Clone, Default)]
pub(super) struct MpsShare {
    /// The share as the claim status reports it.
    pub(super) status: Option<StatusShare>,
    /// The unit's `state.json`, relative to the temporary directory.
    pub(super) state_file: String,
    /// The daemon `state.json` names.
    pub(super) daemon: Option<DaemonIdentity>,
    /// `mpsMemoryLimit` and `mpsComputeLimit` of the device as published.
    pub(super) memory_level: Option<String>,
    pub(super) compute_level: Option<String>,
    /// Lines of the fake daemon's log about this daemon and share.
    pub(super) received: Vec<String>,
    /// Container edits per CDI id, from the claim's CDI spec file.
    pub(super) cdi_edits: BTreeMap<String, String>,
    /// Where the sources disagree, or one is missing.
    pub(super) problems: Vec<String>,
}

impl MpsShare {
    pub(super) fn read(s: &Session<'_>, claim_uid: &str, pod: &Pod, dev: &PreparedDevice) -> Self {
        let node = s.node;
        let mut out = Self::default();
        let (memory_level, compute_level) = published_levels(&s.slices, &dev.device);
        out.memory_level = memory_level;
        out.compute_level = compute_level;
        match dev.data.as_ref().map(StatusShare::from_data) {
            Some(Ok(st)) => out.status = Some(st),
            Some(Err(e)) => out.problems.push(e),
            None => out
                .problems
                .push("the plugin wrote no status.devices entry".to_string()),
        }
        let unit_name = out
            .status
            .as_ref()
            .map_or(dev.device.clone(), |st| st.unit.clone());
        let unit = node.mps_root().join(&unit_name);
        let state_path = unit.join("state.json");
        out.state_file = node.short(&state_path);
        let Some(share_id) = dev.share_id.as_deref() else {
            out.problems
                .push("the allocation result has no shareID".to_string());
            return out;
        };
        let mut client = None;
        match read_unit_state(&state_path) {
            Ok(st) => {
                client = st
                    .clients
                    .into_values()
                    .find(|c| c.claim_uid == claim_uid && c.share_id == share_id);
                out.daemon = st.identity;
            }
            Err(e) => out.problems.push(e),
        }
        let pipe_dir = match &out.daemon {
            Some(d) => {
                if let Ok(mut seen) = node.daemons_seen.lock() {
                    seen.insert((unit_name.clone(), d.pid, d.start_time));
                }
                if !process_alive(d.pid, d.start_time) {
                    out.problems.push(format!(
                        "the MPS daemon pid {} named in {} is not running",
                        d.pid, out.state_file
                    ));
                }
                d.pipe_dir.clone()
            }
            None => {
                out.problems
                    .push(format!("{} names no running daemon", out.state_file));
                unit.join("pipe")
            }
        };
        out.check_agreement(client.as_ref(), pod, claim_uid, share_id);
        out.read_fake_log(node, &pipe_dir, claim_uid, share_id);
        out.read_cdi(node, claim_uid, &dev.cdi_ids);
        out
    }

    /// The claim status against `state.json`, the pod and the published attributes.
    pub(super) fn check_agreement(
        &mut self,
        client: Option<&ClientSpec>,
        pod: &Pod,
        claim_uid: &str,
        share_id: &str,
    ) {
        let Some(c) = client else {
            self.problems.push(format!(
                "{} lists no client for claim {claim_uid} share {share_id}",
                self.state_file
            ));
            return;
        };
        let Some(st) = self.status.clone() else {
            return;
        };
        let l = &c.limits;
        let kept = (
            l.memory_limit_mib,
            u64::from(l.multiprocessors),
            u64::from(l.active_thread_percentage),
        );
        let told = (
            st.memory_limit_mib,
            st.multiprocessors,
            st.active_thread_percentage,
        );
        if kept != told {
            self.problems.push(format!(
                "limits (MiB, SMs, %) in the claim status {told:?} differ from {} {kept:?}",
                self.state_file
            ));
        }
        let kept_cgroup = c.cgroup.as_ref().map(|p| p.display().to_string());
        if kept_cgroup != st.cgroup {
            self.problems.push(format!(
                "cgroup in the claim status {:?} differs from {} {kept_cgroup:?}",
                st.cgroup, self.state_file
            ));
        }
        let pod_cgroup = pod.cgroup.display().to_string();
        match &st.cgroup {
            Some(cg) if *cg != pod_cgroup => self.problems.push(format!(
                "share bound to cgroup {cg}, but the claim's pod {} is in {pod_cgroup}",
                pod.uid
            )),
            None if st.memory_limit.as_deref() == Some("hard") => self
                .problems
                .push("memory limit hard, but the share is bound to no cgroup".to_string()),
            _ => {}
        }
        if (&st.memory_limit, &st.compute_limit) != (&self.memory_level, &self.compute_level) {
            self.problems.push(format!(
                "enforcement in the claim status (memory {:?}, compute {:?}) differs from the published device (mpsMemoryLimit {:?}, mpsComputeLimit {:?})",
                st.memory_limit, st.compute_limit, self.memory_level, self.compute_level
            ));
        }
    }

    /// The fake daemon's record: its start, and what it was told for this share.
    pub(super) fn read_fake_log(
        &mut self,
        node: &Node,
        pipe_dir: &Path,
        claim_uid: &str,
        share_id: &str,
    ) {
        let path = pipe_dir.join(carve_mps::fake::LOG);
        let Ok(text) = std::fs::read_to_string(&path) else {
            self.problems
                .push(format!("no fake daemon log {}", node.short(&path)));
            return;
        };
        // Paths in the temporary directory as `<tmp>/...`: shorter, still absolute-looking.
        let tmp = node.dir.path().display().to_string();
        let lines: Vec<String> = text.lines().map(|l| l.replace(&tmp, "<tmp>")).collect();
        if let Some(d) = &self.daemon {
            let start = format!("start pid={} ", d.pid);
            match lines.iter().rfind(|l| l.starts_with(&start)) {
                Some(l) => self.received.push(l.clone()),
                None => self.problems.push(format!(
                    "the fake daemon's log has no start of pid {}",
                    d.pid
                )),
            }
        }
        let v3 = self
            .daemon
            .as_ref()
            .is_some_and(|d| d.protocol == carve_mps::Protocol::V3);
        let before = self.received.len();
        if v3 {
            let ns = carve_mps::control::v3::namespace_name(claim_uid, share_id);
            self.received.extend(
                lines
                    .iter()
                    .filter(|l| {
                        [
                            format!("verb namespace create {ns} "),
                            format!("verb namespace set {ns} "),
                        ]
                        .iter()
                        .any(|p| l.starts_with(p.as_str()))
                    })
                    .cloned(),
            );
        } else {
            // v2: daemon-wide defaults (the largest share); the share's own
            // limits are in its client variables.
            for cmd in [
                "cmd set_default_device_pinned_mem_limit ",
                "cmd set_default_active_thread_percentage ",
            ] {
                if let Some(l) = lines.iter().rfind(|l| l.starts_with(cmd)) {
                    self.received.push(l.clone());
                }
            }
        }
        if self.daemon.is_some() && self.received.len() == before {
            self.problems.push(format!(
                "the fake daemon's log {} has no limits for this share",
                node.short(&path)
            ));
        }
    }

    /// Each CDI id's container edits, from the claim's CDI spec file.
    pub(super) fn read_cdi(&mut self, node: &Node, claim_uid: &str, cdi_ids: &[String]) {
        let path = carve_plugin::claim_spec_path(&node.cdi_dir, claim_uid);
        let spec: serde_json::Value = match std::fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
        {
            Ok(v) => v,
            Err(e) => {
                self.problems
                    .push(format!("CDI spec {}: {e}", node.short(&path)));
                return;
            }
        };
        if cdi_ids.is_empty() {
            self.problems
                .push("NodePrepareResources gave no CDI id".to_string());
        }
        let devices = spec.get("devices").and_then(serde_json::Value::as_array);
        for id in cdi_ids {
            let name = id.rsplit_once('=').map_or(id.as_str(), |(_, n)| n);
            let Some(edits) = devices
                .into_iter()
                .flatten()
                .find(|d| d.get("name").and_then(serde_json::Value::as_str) == Some(name))
                .and_then(|d| d.get("containerEdits"))
            else {
                self.problems.push(format!(
                    "CDI id {id}: no device {name:?} in {}",
                    node.short(&path)
                ));
                continue;
            };
            self.cdi_edits
                .insert(id.clone(), describe_edits(node, edits));
        }
    }
}

/// `env A=1, B=2; mount host -> container` of CDI container edits.
pub(super) fn describe_edits(node: &Node, edits: &serde_json::Value) -> String {
    let strs = |k: &str| -> Vec<String> {
        edits
            .get(k)
            .and_then(serde_json::Value::as_array)
            .into_iter()
            .flatten()
            .map(|v| match v {
                serde_json::Value::String(s) => s.clone(),
                other => {
                    let get = |f: &str| other.get(f).and_then(serde_json::Value::as_str);
                    match (get("hostPath"), get("containerPath"), get("path")) {
                        (Some(h), Some(c), _) => {
                            format!("{} -> {c}", node.short(Path::new(h)))
                        }
                        (_, _, Some(p)) => p.to_string(),
                        _ => other.to_string(),
                    }
                }
            })
            .collect()
    };
    let mut parts = Vec::new();
    for (key, label) in [
        ("env", "env"),
        ("mounts", "mount"),
        ("deviceNodes", "device"),
    ] {
        let v = strs(key);
        if !v.is_empty() {
            parts.push(format!("{label} {}", v.join(", ")));
        }
    }
    if parts.is_empty() {
        "no container edits".to_string()
    } else {
        parts.join("; ")
    }
}

/// The published `mpsMemoryLimit` and `mpsComputeLimit` of `device`.
pub(super) fn published_levels(
    slices: &[ResourceSlice],
    device: &str,
) -> (Option<String>, Option<String>) {
    let dev = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| d.name == device);
    let attr = |k: &str| {
        dev.and_then(|d| d.attributes.as_ref())
            .and_then(|a| a.get(k))
            .and_then(|a| a.string.clone())
    };
    (attr("mpsMemoryLimit"), attr("mpsComputeLimit"))
}
