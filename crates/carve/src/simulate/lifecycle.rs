//! One claim's way through the run: allocated by the offline allocator,
//! created and reserved for its pod in the API-server stand-in, prepared
//! through the fake kubelet, read back, and at the end unprepared and
//! deleted; then the check that nothing is left.

use super::*;

// === the run ===

/// One device of a prepared claim.
#[derive(Debug, Clone)]
pub(super) struct PreparedDevice {
    /// Request (`req` or `req/sub`) it was allocated for.
    pub(super) request: String,
    /// Device name.
    pub(super) device: String,
    /// CDI ids from NodePrepareResources.
    pub(super) cdi_ids: Vec<String>,
    /// `status.devices[].data` the plugin wrote, if any.
    pub(super) data: Option<serde_json::Value>,
    /// `shareID` of the allocation result (shareable devices).
    pub(super) share_id: Option<String>,
    /// For an MPS share: what the plugin and the daemon say about it.
    pub(super) mps: Option<MpsShare>,
}

/// The claim once the plugin's `status.devices` names every result of this
/// driver, or as it is after [`carve_plugin::STATUS_SETTLE`]: the plugin
/// writes the status after its prepare returned (a missing entry is then
/// reported by the caller).
pub(super) async fn read_back(
    api: &Api<ResourceClaim>,
    name: &str,
    results: &[k8s_openapi::api::resource::v1::DeviceRequestAllocationResult],
) -> kube::Result<ResourceClaim> {
    let deadline = std::time::Instant::now() + carve_plugin::STATUS_SETTLE;
    loop {
        let back = api.get(name).await?;
        let written = back.status.as_ref().and_then(|st| st.devices.as_ref());
        let all = results.iter().filter(|r| r.driver == DRIVER_NAME).all(|r| {
            written.into_iter().flatten().any(|d| {
                d.driver == DRIVER_NAME && d.device == r.device && d.share_id == r.share_id
            })
        });
        if all || std::time::Instant::now() >= deadline {
            return Ok(back);
        }
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}

/// The made-up pod a claim is reserved for (`status.reservedFor`): a UID and
/// a cgroup directory in the fake cgroup tree, as the kubelet creates it
/// before it prepares the pod's claims.
#[derive(Debug, Clone)]
pub(super) struct Pod {
    pub(super) name: String,
    pub(super) uid: String,
    /// Its cgroup, relative to the cgroup root.
    pub(super) cgroup: PathBuf,
}

impl Pod {
    /// The pod of claim `claim` (the Pod that names it, or a made-up
    /// `<claim>-pod`) with a fresh UID and its cgroup directory (cgroupfs
    /// driver, BestEffort QoS).
    pub(super) fn create(node: &Node, claim: &SourcedClaim) -> anyhow::Result<Self> {
        let src = "/proc/sys/kernel/random/uuid";
        let uid = std::fs::read_to_string(src)
            .with_context(|| format!("reading a pod UID from {src}"))?
            .trim()
            .to_string();
        let cgroup = PathBuf::from(format!("kubepods/besteffort/pod{uid}"));
        let dir = node.cgroup_root.join(&cgroup);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self {
            name: claim
                .pod
                .clone()
                .unwrap_or_else(|| format!("{}-pod", claim.name())),
            uid,
            cgroup,
        })
    }

    /// Remove its cgroup directory (the kubelet does once the pod is gone).
    pub(super) fn remove(&self, node: &Node) -> anyhow::Result<()> {
        let dir = node.cgroup_root.join(&self.cgroup);
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))
    }
}

/// A claim allocated and prepared.
#[derive(Debug, Clone)]
pub(super) struct Prepared {
    pub(super) source: SourcedClaim,
    /// The claim as stored, with `status.allocation` and its uid.
    pub(super) stored: ResourceClaim,
    pub(super) uid: String,
    /// The pod it is reserved for.
    pub(super) pod: Pod,
    pub(super) devices: Vec<PreparedDevice>,
}

impl Prepared {
    pub(super) fn claim_ref(&self) -> ClaimRef {
        ClaimRef {
            namespace: self.source.namespace().into(),
            name: self.source.name().into(),
            uid: self.uid.clone(),
        }
    }
}

/// Everything the run works with once the plugin is up.
pub(super) struct Session<'a> {
    pub(super) node: &'a Node,
    pub(super) client: kube::Client,
    pub(super) kubelet: FakeKubelet,
    pub(super) slices: Vec<ResourceSlice>,
    pub(super) classes: &'a [DeviceClass],
    /// The classes `--sharing` leaves without devices, and why.
    pub(super) off: &'a BTreeMap<String, String>,
}

impl std::fmt::Debug for Session<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("node", &self.node)
            .field("slices", &self.slices.len())
            .finish_non_exhaustive()
    }
}

pub(super) async fn simulate(
    args: &SimulateArgs,
    node: &Node,
    set: &ClaimSet,
    exe: &Path,
) -> anyhow::Result<ExitCode> {
    let opts = Options {
        version: args.kube_version,
        ..Options::default()
    };
    let api = ApiServer::start(opts)
        .await
        .context("starting the API-server stand-in")?;
    // Ctrl-C drops the run: the plugin guard kills the child, and the caller
    // removes the temporary directory (GPU instances live only in there).
    let result = tokio::select! {
        r = with_api(args, &api, node, set, exe) => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
    };
    api.shutdown().await;
    result
}

pub(super) async fn with_api(
    args: &SimulateArgs,
    api: &ApiServer,
    node: &Node,
    set: &ClaimSet,
    exe: &Path,
) -> anyhow::Result<ExitCode> {
    let client = api.try_client()?;
    let capi: Api<DeviceClass> = Api::all(client.clone());
    for c in &set.classes {
        capi.create(&PostParams::default(), c)
            .await
            .with_context(|| {
                format!(
                    "creating DeviceClass {}",
                    c.metadata.name.as_deref().unwrap_or_default()
                )
            })?;
    }
    say(&format!(
        "carve simulate: node {NODE} with {} GPU(s) ({}), Kubernetes {} API-server stand-in at {}",
        node.specs.len(),
        node.models_label(),
        args.kube_version,
        api.url()
    ));
    let mut plugin = Plugin::spawn(exe, node, &api.url(), args)?;
    let result = with_plugin(args, &mut plugin, api, client, node, set).await;
    plugin.stop();
    // What to try next ends the report.
    let said_next = |(code, next): (ExitCode, Vec<String>)| {
        say("");
        for l in next {
            say(&l);
        }
        code
    };
    if args.no_release {
        // The prepared state stays for inspection; daemons do not outlive the run.
        for l in mps_leftovers(node) {
            say(&format!("stopped: {l}"));
        }
        return result.map(said_next);
    }
    let leftovers = final_check(node);
    let done = result?;
    leftovers?;
    Ok(said_next(done))
}

/// After the plugin is gone: no GPU instance, no CDI spec and no MPS daemon
/// may be left. MPS daemons outlive the plugin by design, so any left running
/// are killed after they are reported.
pub(super) fn final_check(node: &Node) -> anyhow::Result<()> {
    let state = SimState::for_config(&node.sim, &node.sim_config_path)
        .context("reading the NVML simulator state")?;
    let mut left = Vec::new();
    for (g, gpu) in state.gpus.iter().enumerate() {
        for gi in &gpu.gpu_instances {
            left.push(format!(
                "gpu-{g}: GPU instance {} (profile id {}) at slice {}",
                gi.id, gi.profile_id, gi.start
            ));
        }
    }
    let cdi: Vec<String> = std::fs::read_dir(&node.cdi_dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .map(|e| e.path().display().to_string())
                .collect()
        })
        .unwrap_or_default();
    let mps = mps_leftovers(node);
    let seen: Vec<String> = node
        .daemons_seen
        .lock()
        .map(|s| {
            s.iter()
                .map(|(unit, pid, _)| format!("pid {pid} on {unit}"))
                .collect()
        })
        .unwrap_or_default();
    if left.is_empty() && cdi.is_empty() && mps.is_empty() {
        say(&format!(
            "no GPU instance left: 0 GPU instances on {} GPU(s) in the NVML simulator, no CDI spec left",
            state.gpus.len()
        ));
        say(&if seen.is_empty() {
            "no MPS daemon left (no prepared claim used one)".to_string()
        } else {
            format!(
                "no MPS daemon left: {} daemon(s) served claims ({}), all gone",
                seen.len(),
                seen.join(", ")
            )
        });
        return Ok(());
    }
    say(&format!(
        "LEFT BEHIND: {} GPU instance(s), {} CDI spec(s), {} MPS leftover(s)",
        left.len(),
        cdi.len(),
        mps.len()
    ));
    for l in left.iter().chain(&cdi).chain(&mps) {
        say(&format!("  {l}"));
    }
    bail!(
        "{} GPU instance(s), {} CDI spec(s) and {} MPS leftover(s) after every claim was released",
        left.len(),
        cdi.len(),
        mps.len()
    )
}

/// MPS daemons still running (killed here once found) and unit state that
/// still names clients: from the daemons seen during the run, every unit's
/// `state.json`, and any process running as this run's fake control binary.
pub(super) fn mps_leftovers(node: &Node) -> Vec<String> {
    let mut left = Vec::new();
    let mut running: BTreeSet<u32> = BTreeSet::new();
    let seen: Vec<(String, u32, u64)> = node
        .daemons_seen
        .lock()
        .map(|s| s.iter().cloned().collect())
        .unwrap_or_default();
    for (unit, pid, start) in &seen {
        if process_alive(*pid, *start) && running.insert(*pid) {
            left.push(format!("{unit}: MPS daemon pid {pid} still running"));
        }
    }
    let mut units: Vec<PathBuf> = std::fs::read_dir(node.mps_root())
        .map(|rd| rd.filter_map(Result::ok).map(|e| e.path()).collect())
        .unwrap_or_default();
    units.sort();
    for dir in units {
        let path = dir.join("state.json");
        if !path.is_file() {
            continue;
        }
        let unit = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        match read_unit_state(&path) {
            Ok(st) => {
                if let Some(d) = &st.identity
                    && process_alive(d.pid, d.start_time)
                    && running.insert(d.pid)
                {
                    left.push(format!(
                        "{unit}: MPS daemon pid {} still running ({})",
                        d.pid,
                        node.short(&path)
                    ));
                }
                if !st.clients.is_empty() {
                    let keys: Vec<&String> = st.clients.keys().collect();
                    left.push(format!(
                        "{unit}: {} still lists {} share(s): {keys:?}",
                        node.short(&path),
                        keys.len()
                    ));
                }
            }
            Err(e) => left.push(format!("{unit}: {e}")),
        }
    }
    for pid in processes_named(&node.fake_mps) {
        if running.insert(pid) {
            left.push(format!(
                "process {pid} still running as {}",
                node.short(&node.fake_mps)
            ));
        }
    }
    for pid in &running {
        if let Ok(raw) = i32::try_from(*pid) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(raw),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
    if !running.is_empty() {
        left.push(format!(
            "killed the MPS daemon process(es) left running: {running:?}"
        ));
    }
    left
}

/// Pids of processes whose `argv[0]` is `program`.
pub(super) fn processes_named(program: &Path) -> Vec<u32> {
    let want = program.as_os_str().as_encoded_bytes();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        if cmd.split(|&b| b == 0).next() == Some(want) {
            out.push(pid);
        }
    }
    out
}

pub(super) async fn with_plugin(
    args: &SimulateArgs,
    plugin: &mut Plugin,
    api: &ApiServer,
    client: kube::Client,
    node: &Node,
    set: &ClaimSet,
) -> anyhow::Result<(ExitCode, Vec<String>)> {
    let socket = node.registration_socket();
    let slices = wait_ready(plugin, &api.store(), &socket).await?;
    let kubelet = FakeKubelet::register(&socket, DRIVER_NAME)
        .await
        .with_context(|| {
            format!(
                "registering with the plugin at {}; {}",
                socket.display(),
                plugin.log_tail()
            )
        })?;
    say(&format!(
        "kubelet plugin (pid {}) registered as {} ({})",
        plugin.pid().unwrap_or_default(),
        kubelet.info.name,
        kubelet.info.supported_versions.join(", ")
    ));
    for w in plugin_warnings(node) {
        say(&format!("plugin: {w}"));
    }
    say("");
    say(&published_text(node, &slices));
    let s = Session {
        node,
        client,
        kubelet,
        slices,
        classes: &set.classes,
        off: &set.off,
    };
    let mut prepared: Vec<Prepared> = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    let mut unplaced: Vec<String> = Vec::new();
    say("claims, in order:");
    let mut result = apply_all(&s, &set.claims, &mut prepared, &mut failures, &mut unplaced).await;
    if result.is_ok() {
        result = show_pictures(args, node, &prepared);
    }
    if args.no_release {
        result?;
        say("");
        for l in kept_state_text(node, prepared.len()) {
            say(&l);
        }
    } else {
        let released = release(&s, &prepared).await;
        result?;
        released?;
    }
    if !failures.is_empty() {
        bail!(
            "{} claim(s) failed: {}",
            failures.len(),
            failures.join("; ")
        );
    }
    Ok((exit_code(&unplaced), next_steps(args, &unplaced)))
}

/// What `--no-release` leaves, where it is, and how to clean it up: the
/// NVML simulator's state (the GPU instances), the plugin's checkpoint, the
/// CDI specs, and the tmpfs mounts under the directory (each MPS unit's
/// /dev/shm, which stopping its daemon leaves mounted).
pub(super) fn kept_state_text(node: &Node, claims: usize) -> Vec<String> {
    let checkpoint = node.state_dir.join("checkpoint.json");
    let checkpoint = if checkpoint.exists() {
        checkpoint
    } else {
        node.state_dir.clone()
    };
    let mounts = mounts_under(node.dir.path());
    let mut out = vec![
        format!("not released (--no-release): {claims} claim(s) stay prepared; to inspect:"),
        format!(
            "  GPU instances (the NVML simulator's state): {}",
            node.sim.state_file.display()
        ),
        format!("  the plugin's checkpoint: {}", checkpoint.display()),
        format!("  CDI specs: {}", node.cdi_dir.display()),
    ];
    let rm = format!("rm -rf {}", node.dir.path().display());
    if mounts.is_empty() {
        out.push(format!("  clean up: {rm}"));
    } else {
        out.push(format!(
            "  tmpfs mounts left ({}; each MPS unit's /dev/shm):",
            mounts.len()
        ));
        for m in &mounts {
            out.push(format!("    {}", m.display()));
        }
        let list: Vec<String> = mounts.iter().map(|m| m.display().to_string()).collect();
        out.push(format!("  clean up: umount {} && {rm}", list.join(" ")));
    }
    out
}

/// Mount points at or under `dir`, from /proc/self/mountinfo, deepest first
/// (the order they unmount in).
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut out: Vec<PathBuf> = text
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| {
            // mountinfo escapes space, tab, newline and backslash as octal.
            PathBuf::from(
                m.replace("\\040", " ")
                    .replace("\\011", "\t")
                    .replace("\\012", "\n")
                    .replace("\\134", "\\"),
            )
        })
        .filter(|m| m.starts_with(dir))
        .collect();
    out.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    out.dedup();
    out
}

/// The run's last lines: what to try next.
pub(super) fn next_steps(args: &SimulateArgs, unplaced: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    if !unplaced.is_empty() {
        out.push("next: `carve explain CLAIM.yaml` says why a claim does not fit and what would make it fit; `carve simulate --gpus ...` tries another node".to_string());
    } else if args.no_release {
        out.push("next: inspect the state named above, then run its clean-up line; without --no-release the run releases every claim and checks nothing is left".to_string());
    } else if args.claims.is_none() {
        out.push("next: `carve simulate --claims DIR` runs your own claims on this node; `carve explain CLAIM.yaml` shows where one would go".to_string());
    } else {
        out.push("next: `carve simulate --no-release` keeps the prepared state to inspect; `carve explain CLAIM.yaml` shows where one claim would go".to_string());
    }
    out
}

/// The plugin's warnings and errors so far (its log), which a user of the
/// simulation should see, such as a feature gate the Kubernetes version
/// leaves off by default.
pub(super) fn plugin_warnings(node: &Node) -> Vec<String> {
    std::fs::read_to_string(node.plugin_log())
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (_, rest) = l.split_once(" WARN ").or_else(|| l.split_once(" ERROR "))?;
            let level = if l.contains(" WARN ") {
                "warning"
            } else {
                "error"
            };
            Some(format!("{level}: {}", rest.trim()))
        })
        .collect()
}

pub(super) async fn apply_all(
    s: &Session<'_>,
    claims: &[SourcedClaim],
    prepared: &mut Vec<Prepared>,
    failures: &mut Vec<String>,
    unplaced: &mut Vec<String>,
) -> anyhow::Result<()> {
    let mut containers_seen: Vec<(String, String)> = Vec::new();
    for c in claims {
        let allocated: Vec<ResourceClaim> = prepared.iter().map(|p| p.stored.clone()).collect();
        let inputs = Inputs {
            slices: s.slices.clone(),
            classes: s.classes.to_vec(),
            claims_allocated: allocated,
        };
        let allocation = Allocator::new(&inputs)
            .and_then(|a| a.allocate(&c.claim, NODE))
            .map_err(|e| (e, c.label()));
        let result = match allocation {
            Ok(r) => r,
            Err((AllocError::Unsatisfiable(expl), _)) => {
                let missing = classes_without_devices(s, c)?;
                // The advice checked against the allocator: "would fit if"
                // only where it would, and said when nothing can help.
                let mut no_fit = crate::explain::NoFit::check(&inputs, &c.claim, NODE, *expl)
                    .map_err(|e| claim_error(e, c, &c.label()))?;
                let offers = std::mem::take(&mut no_fit.offers);
                if missing.is_empty() {
                    if no_fit.on_empty.is_some() {
                        say(&format!(
                            "- {}: does not fit on {NODE}, not even with every device free:",
                            c.label()
                        ));
                    } else {
                        say(&format!("- {}: does not fit on {NODE} now:", c.label()));
                    }
                    // One line per reason (a false selector included: on a
                    // node without the profile it is the only reason).
                    let text = no_fit.text(false);
                    let lines: Vec<&str> = text.lines().skip(1).collect();
                    for l in lines.iter().take(EXPLAIN_LINES) {
                        say(&format!("  {l}"));
                    }
                    if lines.len() > EXPLAIN_LINES {
                        say(&format!(
                            "  ... {} more line(s): see `carve explain`",
                            lines.len() - EXPLAIN_LINES
                        ));
                    }
                } else {
                    say(&format!(
                        "- {}: skipped: no published device matches class {}",
                        c.label(),
                        missing.join(", ")
                    ));
                }
                let unfit = unfit(s.node, &s.slices, c, &missing, s.off, !offers.is_empty());
                for l in &unfit.lines {
                    say(&format!("  {l}"));
                }
                if !offers.is_empty() {
                    say(&format!("  {NODE} offers:"));
                    for o in &offers {
                        say(&format!("    {o}"));
                    }
                }
                match unfit.expected {
                    Some(why) => say(&format!("  (as expected on this node: {why})")),
                    None => unplaced.push(c.name().to_string()),
                }
                continue;
            }
            Err((e, label)) => return Err(claim_error(e, c, &label)),
        };
        match prepare(s, c, result).await? {
            Outcome::Prepared(p) => {
                say(&prepared_text(s.node, &p, &mut containers_seen));
                for why in p
                    .devices
                    .iter()
                    .filter_map(|d| d.mps.as_ref())
                    .flat_map(|m| &m.problems)
                {
                    failures.push(format!("{}: {why}", c.label()));
                }
                prepared.push(*p);
            }
            Outcome::Failed(why) => {
                say(&format!("- {}: FAILED: {why}", c.label()));
                failures.push(format!("{}: {why}", c.label()));
            }
        }
    }
    Ok(())
}

/// An allocator error about claim `c`, with `label` (the claim and where it
/// came from) in front, or only the claim's file where the error names the
/// claim itself.
pub(super) fn claim_error(e: AllocError, c: &SourcedClaim, label: &str) -> anyhow::Error {
    let names_claim = match &e {
        AllocError::UnknownClass { .. }
        | AllocError::InvalidClaim { .. }
        | AllocError::AlreadyFits { .. }
        | AllocError::NeverFits { .. }
        | AllocError::NoPlan { .. } => true,
        AllocError::CelCompile { owner, .. }
        | AllocError::CelTooLong { owner, .. }
        | AllocError::CelTooCostly { owner, .. }
        | AllocError::Cel { owner, .. } => owner.starts_with("claim "),
        AllocError::Unsatisfiable(_) | AllocError::InvalidSlice { .. } => false,
    };
    if names_claim {
        anyhow!(e).context(c.source.clone())
    } else {
        anyhow!(e).context(format!("claim {label}"))
    }
}

/// The claim's DeviceClasses for which no published device matches (each
/// probed with a one-device request on the empty node).
pub(super) fn classes_without_devices(
    s: &Session<'_>,
    c: &SourcedClaim,
) -> anyhow::Result<Vec<String>> {
    let inputs = Inputs {
        slices: s.slices.clone(),
        classes: s.classes.to_vec(),
        claims_allocated: Vec::new(),
    };
    let alloc = Allocator::new(&inputs)?;
    let mut missing = Vec::new();
    for class in claim_classes(&c.claim) {
        let probe: ResourceClaim = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "class-probe", "namespace": DEFAULT_NAMESPACE},
            "spec": {"devices": {"requests": [{"name": "probe", "exactly": {"deviceClassName": class}}]}},
        }))?;
        match alloc.allocate(&probe, NODE) {
            Ok(_) => {}
            Err(AllocError::Unsatisfiable(_)) => missing.push(class),
            Err(e) => {
                // The probe claim has no selector of its own: what can go
                // wrong is the class's (its errors name it) or the slices'.
                return Err(anyhow!(e).context(format!("claim {}", c.label())));
            }
        }
    }
    Ok(missing)
}

/// Create the claim, reserve it for a new pod, write its allocation, prepare
/// it through the fake kubelet and read back what the plugin wrote.
/// `Ok(Err(why))`: the claim was not prepared (it is deleted again and its
/// pod's cgroup removed); `Err`: the run cannot go on.
pub(super) async fn prepare(
    s: &Session<'_>,
    c: &SourcedClaim,
    result: k8s_openapi::api::resource::v1::AllocationResult,
) -> anyhow::Result<Outcome> {
    let api: Api<ResourceClaim> = Api::namespaced(s.client.clone(), c.namespace());
    let label = c.label();
    let created = api
        .create(&PostParams::default(), &c.claim)
        .await
        .with_context(|| format!("creating ResourceClaim {label}"))?;
    let uid = created
        .metadata
        .uid
        .clone()
        .ok_or_else(|| anyhow!("ResourceClaim {label}: the API server gave it no uid"))?;
    // The scheduler reserves the claim for the pod it binds; the kubelet has
    // created the pod's cgroup by the time it prepares the pod's claims.
    let pod = Pod::create(s.node, c)?;
    let patch = serde_json::json!({"status": {
        "allocation": result,
        "reservedFor": [{"resource": "pods", "name": pod.name, "uid": pod.uid}],
    }});
    let stored = api
        .patch_status(c.name(), &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .with_context(|| {
            format!("writing status.allocation and status.reservedFor of ResourceClaim {label}")
        })?;
    let r = ClaimRef {
        namespace: c.namespace().into(),
        name: c.name().into(),
        uid: uid.clone(),
    };
    let answer = s.kubelet.prepare(std::slice::from_ref(&r)).await;
    let one = match answer {
        Ok(resp) => resp.claims.get(&uid).cloned(),
        Err(e) => return abandon(s, &api, c, &pod, format!("NodePrepareResources: {e}")).await,
    };
    let one = match one {
        Some(o) if o.error.is_empty() => o,
        other => {
            let why = format!(
                "NodePrepareResources: {}",
                one_error(other.as_ref().map(|o| o.error.as_str()), &uid)
            );
            return abandon(s, &api, c, &pod, why).await;
        }
    };
    let results = stored
        .status
        .as_ref()
        .and_then(|st| st.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref());
    let back = read_back(&api, c.name(), results.map_or(&[][..], Vec::as_slice))
        .await
        .with_context(|| format!("reading ResourceClaim {label} back"))?;
    let status_devices = back.status.as_ref().and_then(|st| st.devices.as_ref());
    // CDI ids the kubelet got, by device and share.
    let cdi_ids: BTreeMap<(String, Option<String>), Vec<String>> = one
        .devices
        .iter()
        .map(|d| {
            (
                (d.device_name.clone(), d.share_id.clone()),
                d.cdi_device_ids.clone(),
            )
        })
        .collect();
    let devices = prepared_devices(
        s,
        &uid,
        &pod,
        &cdi_ids,
        results.map_or(&[][..], Vec::as_slice),
        status_devices.map_or(&[][..], Vec::as_slice),
    );
    Ok(Outcome::Prepared(Box::new(Prepared {
        source: c.clone(),
        stored,
        uid,
        pod,
        devices,
    })))
}

/// What a claim's prepare came to in simulate.
pub(super) enum Outcome {
    /// Prepared: its devices, as the kubelet got them and as the claim's
    /// status and the MPS daemons show them.
    Prepared(Box<Prepared>),
    /// Not prepared (the claim deleted, its pod's cgroup removed): why.
    Failed(String),
}

/// The claim's devices of this driver: what the kubelet got (CDI ids), the
/// status data the plugin wrote, and each MPS share read back from its daemon.
fn prepared_devices(
    s: &Session<'_>,
    uid: &str,
    pod: &Pod,
    cdi_ids: &BTreeMap<(String, Option<String>), Vec<String>>,
    results: &[k8s_openapi::api::resource::v1::DeviceRequestAllocationResult],
    status_devices: &[k8s_openapi::api::resource::v1::AllocatedDeviceStatus],
) -> Vec<PreparedDevice> {
    let mut devices = Vec::new();
    for res in results.iter().filter(|x| x.driver == DRIVER_NAME) {
        let data = status_devices
            .iter()
            .find(|d| {
                d.driver == DRIVER_NAME && d.device == res.device && d.share_id == res.share_id
            })
            .and_then(|d| d.data.as_ref())
            .map(|d| d.0.clone());
        let cdi_ids = cdi_ids
            .get(&(res.device.clone(), res.share_id.clone()))
            .cloned()
            .unwrap_or_default();
        let mut dev = PreparedDevice {
            request: res.request.clone(),
            device: res.device.clone(),
            cdi_ids,
            data,
            share_id: res.share_id.clone(),
            mps: None,
        };
        if matches!(
            res.device.parse::<DeviceName>(),
            Ok(DeviceName::Mps { .. } | DeviceName::MigMps { .. })
        ) {
            dev.mps = Some(MpsShare::read(s, uid, pod, &dev));
        }
        devices.push(dev);
    }
    devices
}

/// A claim that was not prepared: delete it, remove its pod's cgroup, and
/// hand back why.
pub(super) async fn abandon(
    s: &Session<'_>,
    api: &Api<ResourceClaim>,
    c: &SourcedClaim,
    pod: &Pod,
    why: String,
) -> anyhow::Result<Outcome> {
    delete_claim(api, c).await?;
    pod.remove(s.node)?;
    Ok(Outcome::Failed(why))
}

pub(super) fn one_error(error: Option<&str>, uid: &str) -> String {
    match error {
        Some(e) => e.to_string(),
        None => format!("the answer has no entry for claim uid {uid}"),
    }
}

pub(super) async fn delete_claim(api: &Api<ResourceClaim>, c: &SourcedClaim) -> anyhow::Result<()> {
    api.delete(c.name(), &DeleteParams::default())
        .await
        .with_context(|| format!("deleting ResourceClaim {}", c.label()))?;
    Ok(())
}

/// The claim's CDI spec file as JSON, if readable.
pub(super) fn claim_spec(node: &Node, uid: &str) -> Option<serde_json::Value> {
    let b = std::fs::read(carve_plugin::claim_spec_path(&node.cdi_dir, uid)).ok()?;
    serde_json::from_slice(&b).ok()
}

/// The container edits of CDI device `id` in `spec`.
pub(super) fn device_edits_of<'a>(
    spec: Option<&'a serde_json::Value>,
    id: &str,
) -> Option<&'a serde_json::Value> {
    let name = id.rsplit_once('=').map_or(id, |(_, n)| n);
    spec?
        .get("devices")?
        .as_array()?
        .iter()
        .find(|d| d.get("name").and_then(serde_json::Value::as_str) == Some(name))?
        .get("containerEdits")
}

/// Unprepare every prepared claim (last first) and delete it; goes on after
/// a failure and reports them all.
pub(super) async fn release(s: &Session<'_>, prepared: &[Prepared]) -> anyhow::Result<()> {
    if prepared.is_empty() {
        say("");
        say("nothing to release");
        return Ok(());
    }
    let mut problems = Vec::new();
    for p in prepared.iter().rev() {
        let r = p.claim_ref();
        let label = p.source.label();
        match s.kubelet.unprepare(std::slice::from_ref(&r)).await {
            Ok(resp) => match resp.claims.get(&p.uid) {
                Some(one) if one.error.is_empty() => {}
                other => problems.push(format!(
                    "{label}: NodeUnprepareResources: {}",
                    one_error(other.map(|o| o.error.as_str()), &p.uid)
                )),
            },
            Err(e) => problems.push(format!("{label}: NodeUnprepareResources: {e}")),
        }
        let spec = carve_plugin::claim_spec_path(&s.node.cdi_dir, &p.uid);
        if spec.exists() {
            problems.push(format!(
                "{label}: CDI spec {} still there after unprepare",
                spec.display()
            ));
        }
        let api: Api<ResourceClaim> = Api::namespaced(s.client.clone(), p.source.namespace());
        if let Err(e) = delete_claim(&api, &p.source).await {
            problems.push(format!("{e:#}"));
        }
        if let Err(e) = p.pod.remove(s.node) {
            problems.push(format!("{label}: {e:#}"));
        }
    }
    say("");
    if problems.is_empty() {
        say(&format!(
            "released {} claim(s): unprepared and deleted",
            prepared.len()
        ));
        return Ok(());
    }
    for p in &problems {
        say(&format!("release FAILED: {p}"));
    }
    bail!("releasing claims: {}", problems.join("; "))
}
