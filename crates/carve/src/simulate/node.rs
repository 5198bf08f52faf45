//! The real processes of a run and their files: the NVML simulator library
//! and configuration, the node's directories, the `carve kubelet-plugin`
//! child, and waiting for it to publish and register.

use super::*;

// === the simulator library and the node's files ===

/// The NVML simulator library: `explicit`, or the newer of the copies next to
/// this executable and in its `deps/` directory.
pub fn find_sim_lib(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = explicit {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(anyhow!("--nvml-sim-lib {}: no such file", p.display()))
        };
    }
    let exe = std::env::current_exe().context("locating this executable")?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    let candidates = [dir.join(SIM_LIB), dir.join("deps").join(SIM_LIB)];
    find_newest_file(&candidates)
}

/// The newest of `candidates` that exist: cargo rebuilds `deps/` with every
/// build of `carve`, while a copy next to the executable may be left over
/// from an older direct build of the simulator.
pub(super) fn find_newest_file(candidates: &[PathBuf]) -> anyhow::Result<PathBuf> {
    let mtime = |p: &PathBuf| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    candidates
        .iter()
        .filter(|p| p.is_file())
        .max_by_key(|p| mtime(p))
        .cloned()
        .ok_or_else(|| {
            let looked: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
            anyhow!(
                "NVML simulator library {SIM_LIB} not found; looked at {}. Build it with `cargo build -p carve` (it builds carve-nvml-sim) or pass --nvml-sim-lib PATH",
                looked.join(" and ")
            )
        })
}

/// The simulated node's directories and simulator configuration, under a
/// temporary directory removed on drop.
#[derive(Debug)]
pub(super) struct Node {
    pub(super) dir: tempfile::TempDir,
    pub(super) plugins_dir: PathBuf,
    pub(super) registry_dir: PathBuf,
    pub(super) cdi_dir: PathBuf,
    pub(super) state_dir: PathBuf,
    /// Private copy of the simulator library.
    pub(super) nvml_lib: PathBuf,
    /// Its side-car configuration `<lib>.json`.
    pub(super) sim_config_path: PathBuf,
    pub(super) sim: SimConfig,
    /// Spec of each GPU, by index.
    pub(super) specs: Vec<GpuSpec>,
    /// MIG mode each GPU starts with, by index.
    pub(super) mig_at_start: Vec<bool>,
    /// The models as given (`h100-80gb:2,...`), canonical keys.
    pub(super) models: Vec<(String, u32)>,
    /// `bin/carve-fake-mps-control`: a link to this executable, the plugin's
    /// `--mps-control`.
    pub(super) fake_mps: PathBuf,
    /// The fake cgroup v2 root (`--cgroup-root`), with the made-up pods' cgroups.
    pub(super) cgroup_root: PathBuf,
    /// The fake driver root and `/proc/devices` (`--container-driver-root`,
    /// `--proc-devices`).
    pub(super) driver: nvidia_ml_sim::driver_root::FakeDriver,
    /// MPS daemons seen during the run: unit, identity.
    pub(super) daemons_seen: Mutex<BTreeSet<(String, u32, u64)>>,
}

impl Node {
    pub(super) fn create(models: &[(String, u32)], lib: &Path, exe: &Path) -> anyhow::Result<Self> {
        let tmp = std::env::temp_dir();
        // A short base path: socket paths must fit in sockaddr_un (108 bytes).
        let dir = tempfile::Builder::new()
            .prefix("carve-sim-")
            .tempdir_in(&tmp)
            .with_context(|| format!("creating a temporary directory in {}", tmp.display()))?;
        let root = dir.path().to_path_buf();
        let sub = |n: &str| -> anyhow::Result<PathBuf> {
            let p = root.join(n);
            std::fs::create_dir_all(&p).with_context(|| format!("creating {}", p.display()))?;
            Ok(p)
        };
        let plugins_dir = sub("plugins")?;
        let registry_dir = sub("registry")?;
        let cdi_dir = sub("cdi")?;
        let state_dir = sub("state")?;
        let lib_dir = sub("lib")?;
        let sim_dir = sub("sim")?;
        let fake_mps = sub("bin")?.join(carve_mps::fake::PROGRAM);
        std::os::unix::fs::symlink(exe, &fake_mps)
            .with_context(|| format!("linking {} to {}", fake_mps.display(), exe.display()))?;
        let cgroup_root = sub("cgroup")?;
        let controllers = cgroup_root.join("cgroup.controllers");
        std::fs::write(&controllers, "cpu memory pids\n")
            .with_context(|| format!("writing {}", controllers.display()))?;
        let nvml_lib = lib_dir.join(SIM_LIB);
        std::fs::copy(lib, &nvml_lib)
            .with_context(|| format!("copying {} to {}", lib.display(), nvml_lib.display()))?;
        let mut specs = Vec::new();
        let mut entries = Vec::new();
        for (key, count) in models {
            let model = GpuModel::find(key).ok_or_else(|| anyhow!("unknown GPU model {key:?}"))?;
            let spec = model.spec();
            entries.push(GpuEntry::new(model.key, *count, false));
            specs.extend(std::iter::repeat_n(spec, *count as usize));
        }
        let sim = SimConfig::new(NODE, entries, &sim_dir);
        // What a node's driver root and /proc/devices hold, for the specs.
        let minors: Vec<u32> = (0..u32::try_from(specs.len()).unwrap_or(0)).collect();
        let driver =
            nvidia_ml_sim::driver_root::write_fake_driver(&root, &sim.driver_version, &minors)
                .context("writing the fake NVIDIA driver root")?;
        let mig_at_start = sim.initial_mig();
        let mut cfg = nvml_lib.as_os_str().to_owned();
        cfg.push(nvidia_ml_sim::SIDECAR_SUFFIX);
        let sim_config_path = PathBuf::from(cfg);
        sim.to_file(&sim_config_path)?;
        Ok(Self {
            dir,
            plugins_dir,
            registry_dir,
            cdi_dir,
            state_dir,
            nvml_lib,
            sim_config_path,
            sim,
            specs,
            mig_at_start,
            models: models.to_vec(),
            fake_mps,
            cgroup_root,
            driver,
            daemons_seen: Mutex::new(BTreeSet::new()),
        })
    }

    /// `<state-dir>/mps`: one directory per MPS unit (device).
    pub(super) fn mps_root(&self) -> PathBuf {
        self.state_dir.join("mps")
    }

    /// `path` relative to the temporary directory, for shorter lines.
    pub(super) fn short(&self, path: &Path) -> String {
        path.strip_prefix(self.dir.path())
            .unwrap_or(path)
            .display()
            .to_string()
    }

    pub(super) fn registration_socket(&self) -> PathBuf {
        self.registry_dir.join(format!("{DRIVER_NAME}-reg.sock"))
    }

    pub(super) fn plugin_log(&self) -> PathBuf {
        self.dir.path().join("plugin.log")
    }

    /// The `carve kubelet-plugin` command line.
    pub(super) fn plugin_args(
        &self,
        api_url: &str,
        args: &SimulateArgs,
    ) -> Vec<std::ffi::OsString> {
        let mut v: Vec<std::ffi::OsString> = Vec::new();
        let mut arg = |k: &str, val: &std::ffi::OsStr| {
            v.push(k.into());
            v.push(val.to_owned());
        };
        arg("--node-name", NODE.as_ref());
        arg("--plugins-dir", self.plugins_dir.as_os_str());
        arg("--registry-dir", self.registry_dir.as_os_str());
        arg("--cdi-dir", self.cdi_dir.as_os_str());
        arg("--state-dir", self.state_dir.as_os_str());
        arg("--proc-driver-nvidia", self.sim.proc_root.as_os_str());
        arg("--container-driver-root", self.driver.root.as_os_str());
        arg("--host-driver-root", self.driver.root.as_os_str());
        arg("--proc-devices", self.driver.devices_file.as_os_str());
        arg("--nvml-lib", self.nvml_lib.as_os_str());
        arg("--kube-api-url", api_url.as_ref());
        arg("--metrics-addr", "127.0.0.1:0".as_ref());
        let mut kinds: Vec<&str> = args.sharing.iter().filter_map(|k| k.flag()).collect();
        kinds.dedup();
        if !kinds.is_empty() {
            arg("--sharing", kinds.join(",").as_ref());
        }
        let share_flags = super::plugin_share_flags(args);
        if args
            .sharing
            .iter()
            .any(|k| matches!(k, SimSharing::Mps | SimSharing::MigMps))
        {
            arg("--mps-control", self.fake_mps.as_os_str());
            arg("--mps-protocol", args.mps_protocol.flag().as_ref());
            arg("--cgroup-root", self.cgroup_root.as_os_str());
            // A unit's /dev/shm tmpfs needs CAP_SYS_ADMIN; without root the
            // daemons keep the plugin's /dev/shm (the plugin warns, and the
            // warning is shown).
            if !nix::unistd::geteuid().is_root() {
                arg("--mps-dev-shm", "none".as_ref());
            }
        }
        let mut out: Vec<std::ffi::OsString> = vec!["kubelet-plugin".into()];
        out.extend(v);
        out.extend(share_flags.into_iter().map(Into::into));
        out
    }

    pub(super) fn models_label(&self) -> String {
        let v: Vec<String> = self
            .models
            .iter()
            .map(|(k, n)| format!("{k}:{n}"))
            .collect();
        v.join(",")
    }
}

// === the plugin process ===

/// The `carve kubelet-plugin` child; killed and reaped on drop.
#[derive(Debug)]
pub(super) struct Plugin {
    pub(super) child: Option<Child>,
    pub(super) log: PathBuf,
}

impl Plugin {
    pub(super) fn spawn(
        exe: &Path,
        node: &Node,
        api_url: &str,
        args: &SimulateArgs,
    ) -> anyhow::Result<Self> {
        let log = node.plugin_log();
        let out =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out
            .try_clone()
            .with_context(|| format!("duplicating {}", log.display()))?;
        let mut cmd = Command::new(exe);
        cmd.args(node.plugin_args(api_url, args))
            .env(nvidia_ml_sim::CONFIG_ENV, &node.sim_config_path)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        if std::env::var_os("CARVE_LOG").is_none() && std::env::var_os("RUST_LOG").is_none() {
            cmd.env("CARVE_LOG", "info");
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {} kubelet-plugin", exe.display()))?;
        Ok(Self {
            child: Some(child),
            log,
        })
    }

    pub(super) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub(super) fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Kill (if still running) and reap.
    pub(super) fn stop(&mut self) -> Option<ExitStatus> {
        let mut c = self.child.take()?;
        let _ = c.kill();
        c.wait().ok()
    }

    pub(super) fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let from = lines.len().saturating_sub(LOG_TAIL);
        let mut out = format!(
            "last {} line(s) of {}:",
            lines.len() - from,
            self.log.display()
        );
        for l in &lines[from..] {
            let _ = write!(out, "\n  {l}");
        }
        out
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The node's complete ResourceSlice pool in the stand-in, if published: every
/// slice of the newest generation, as many as `resourceSliceCount` says.
pub(super) fn published_pool(store: &Store) -> anyhow::Result<Option<Vec<ResourceSlice>>> {
    let mut found = Vec::new();
    for v in store.list(Resource::ResourceSlices) {
        let s: ResourceSlice = serde_json::from_value(v)
            .context("a ResourceSlice in the API-server stand-in does not decode")?;
        if s.spec.pool.name == NODE && s.spec.driver == DRIVER_NAME {
            found.push(s);
        }
    }
    let Some(generation) = found.iter().map(|s| s.spec.pool.generation).max() else {
        return Ok(None);
    };
    found.retain(|s| s.spec.pool.generation == generation);
    let want = found
        .first()
        .map_or(0, |s| s.spec.pool.resource_slice_count);
    Ok((i64::try_from(found.len()).ok() == Some(want)).then_some(found))
}

/// Polls until the plugin has published the node's slices and created its
/// registration socket; fails with its log if it exits or takes too long.
pub(super) async fn wait_ready(
    plugin: &mut Plugin,
    store: &Store,
    socket: &Path,
) -> anyhow::Result<Vec<ResourceSlice>> {
    let start = Instant::now();
    loop {
        let pool = published_pool(store)?;
        if socket.exists()
            && let Some(p) = pool
        {
            return Ok(p);
        }
        if let Some(status) = plugin.exited() {
            bail!(
                "carve kubelet-plugin exited ({status}) before it was ready; {}",
                plugin.log_tail()
            );
        }
        if start.elapsed() > READY_DEADLINE {
            bail!(
                "carve kubelet-plugin was not ready after {READY_DEADLINE:?} (registration socket {}: {}; ResourceSlices published: {}); {}",
                socket.display(),
                if socket.exists() { "present" } else { "absent" },
                if published_pool(store)?.is_some() {
                    "yes"
                } else {
                    "no"
                },
                plugin.log_tail()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}
