//! End-to-end suites for carve, and the helpers they share: a simulated node
//! that runs the real `carve kubelet-plugin` binary as a child process on the
//! NVML simulator library ([`SimNode`]), the API-server stand-in, the offline
//! allocator, and the CDI and simulator-state checks ([`check_prepared`]).
//!
//! It is not a test framework for other crates and has no production use.
//! Waits poll a condition (a socket appears, slices are published) every
//! [`POLL`] until [`DEADLINE`], and give up at once when the child exits.

pub mod cluster;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use carve_apiserver::{Resource, Store};
use carve_model::GpuModel;
use carve_model::names::DeviceName;
use carve_plugin::{CDI_KIND, CdiSpec, claim_spec_path};
use k8s_openapi::api::resource::v1::{AllocationResult, DeviceClass, ResourceClaim, ResourceSlice};
use nvidia_ml_sim::{GpuEntry, SimConfig, SimState};

/// How often waits look again.
pub const POLL: Duration = Duration::from_millis(20);
/// How long a wait may take before the suite fails.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// What went wrong setting up or checking the end-to-end flow.
#[derive(Debug, thiserror::Error)]
pub enum E2eError {
    /// A file or directory operation failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A build artifact is missing.
    #[error("{what} not found at {path}: {hint}")]
    Missing {
        /// The artifact.
        what: &'static str,
        /// Where it was looked for.
        path: PathBuf,
        /// How to get it.
        hint: String,
    },
    /// A nested `cargo build` (of carve, or of the image's binaries) failed.
    #[error("building ({cmd}) failed: {status}")]
    Build {
        /// The command line.
        cmd: String,
        /// Its exit status.
        status: ExitStatus,
    },
    /// The plugin process exited while the suite waited for it.
    #[error(
        "carve kubelet-plugin exited with {status} while waiting for {waiting_for}; its log:\n{log}"
    )]
    PluginExited {
        /// Its exit status.
        status: ExitStatus,
        /// What the suite was waiting for.
        waiting_for: String,
        /// Its stdout and stderr.
        log: String,
    },
    /// A wait ran out of time.
    #[error("timed out after {after:?} waiting for {waiting_for}; plugin log:\n{log}")]
    Timeout {
        /// What the suite was waiting for.
        waiting_for: String,
        /// How long it waited.
        after: Duration,
        /// The plugin's log so far.
        log: String,
    },
    /// The simulator could not be configured or its state read.
    #[error("NVML simulator: {0}")]
    Sim(#[from] nvidia_ml_sim::SimError),
    /// An object from the API-server stand-in does not deserialize.
    #[error("{what}: {source}")]
    Json {
        /// Which object.
        what: String,
        /// The error.
        #[source]
        source: serde_json::Error,
    },
    /// A prepared claim does not look as it must.
    #[error("claim {claim}: {problem}")]
    Check {
        /// The claim UID.
        claim: String,
        /// What is wrong.
        problem: String,
    },
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> E2eError {
    let path = path.to_path_buf();
    move |source| E2eError::Io { what, path, source }
}

/// `target/<profile>` of the running test binary
/// (`target/<profile>/deps/<test>-<hash>`).
///
/// # Errors
/// The test executable's path has no such shape.
pub fn target_profile_dir() -> Result<PathBuf, E2eError> {
    let exe = std::env::current_exe().map_err(io("locating", Path::new("current_exe")))?;
    exe.parent()
        .filter(|d| d.file_name().is_some_and(|n| n == "deps"))
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .ok_or_else(|| E2eError::Missing {
            what: "target/<profile> directory",
            path: exe.clone(),
            hint: "run the suite with cargo test".into(),
        })
}

/// The workspace root (the parent of this crate's directory).
#[must_use]
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// The `carve` binary of this build profile, built with `cargo build -p carve`
/// first so it is never stale. `CARVE_BIN` overrides (no build then).
///
/// A binary-only package cannot be a dependency (`CARGO_BIN_EXE_carve` exists
/// only in the `carve` package's own tests), hence the nested build; cargo has
/// released its build lock while tests run.
///
/// Built once per test process; concurrent callers wait for that build.
///
/// # Errors
/// The build fails or produces no binary.
pub fn carve_binary() -> Result<PathBuf, E2eError> {
    static BUILT: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut built = BUILT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(p) = built.as_ref() {
        return Ok(p.clone());
    }
    let p = build_carve()?;
    *built = Some(p.clone());
    Ok(p)
}

fn build_carve() -> Result<PathBuf, E2eError> {
    if let Some(p) = std::env::var_os("CARVE_BIN") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(E2eError::Missing {
                what: "CARVE_BIN",
                path: p,
                hint: "point CARVE_BIN at a built carve binary or unset it".into(),
            })
        };
    }
    let dir = target_profile_dir()?;
    let profile = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let target_dir = dir.parent().map(Path::to_path_buf).unwrap_or_default();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(&cargo);
    cmd.current_dir(workspace_root())
        .args([
            "build",
            "--quiet",
            "-p",
            "carve",
            "--bin",
            "carve",
            "--target-dir",
        ])
        .arg(&target_dir);
    match profile.as_str() {
        "debug" => {}
        "release" => {
            cmd.arg("--release");
        }
        p => {
            cmd.args(["--profile", p]);
        }
    }
    let shown = format!("{cmd:?}");
    let status = cmd.status().map_err(io("running", Path::new(&cargo)))?;
    if !status.success() {
        return Err(E2eError::Build { cmd: shown, status });
    }
    let bin = dir.join("carve");
    if bin.is_file() {
        Ok(bin)
    } else {
        Err(E2eError::Missing {
            what: "carve binary",
            path: bin,
            hint: format!("{shown} succeeded but left no binary"),
        })
    }
}

/// The binaries that go into carve's image: `carve` and the NVML simulator
/// built as `deploy/Dockerfile` builds them (`cargo build --profile dist
/// -p carve -p carve-nvml-sim`: fat LTO, `panic = "abort"`), so the image
/// under test is the one that ships. `CARVE_E2E_IMAGE_PROFILE` picks another
/// profile (`dev` reuses the test build: faster, but not what ships).
///
/// Built once per test process, into this build's target directory.
///
/// # Errors
/// The build fails or leaves no binary.
pub fn image_binaries() -> Result<(PathBuf, PathBuf), E2eError> {
    static BUILT: Mutex<Option<(PathBuf, PathBuf)>> = Mutex::new(None);
    let mut built = BUILT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(p) = built.as_ref() {
        return Ok(p.clone());
    }
    let profile = std::env::var("CARVE_E2E_IMAGE_PROFILE").unwrap_or_else(|_| "dist".into());
    let here = target_profile_dir()?;
    let this = here
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let pair = if profile == this || (profile == "dev" && this == "debug") {
        (carve_binary()?, sim_library()?)
    } else {
        let target_dir = here.parent().map(Path::to_path_buf).unwrap_or_default();
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = Command::new(&cargo);
        cmd.current_dir(workspace_root())
            .args(["build", "--quiet", "--locked", "--profile", &profile])
            .args(["-p", "carve", "-p", "carve-nvml-sim", "--target-dir"])
            .arg(&target_dir);
        let shown = format!("{cmd:?}");
        let status = cmd.status().map_err(io("running", Path::new(&cargo)))?;
        if !status.success() {
            return Err(E2eError::Build { cmd: shown, status });
        }
        let dir = target_dir.join(if profile == "dev" { "debug" } else { &profile });
        let found = |name: &str, what: &'static str| {
            let p = dir.join(name);
            if p.is_file() {
                Ok(p)
            } else {
                Err(E2eError::Missing {
                    what,
                    path: p,
                    hint: format!("{shown} succeeded but left no file there"),
                })
            }
        };
        (
            found("carve", "carve binary")?,
            found("libnvidia_ml_sim.so", "NVML simulator library")?,
        )
    };
    *built = Some(pair.clone());
    Ok(pair)
}

/// The DeviceClasses of `examples/deviceclasses.yaml` (what the examples'
/// claims name), created through `client`.
///
/// # Panics
/// The file cannot be read, holds no DeviceClass, or a create fails: a
/// test's setup, not a case to handle.
pub async fn create_example_classes(client: kube::Client) -> Vec<DeviceClass> {
    let path = workspace_root().join("examples/deviceclasses.yaml");
    let classes: Vec<DeviceClass> = carve_alloc::load_yaml_documents(&path)
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .filter_map(|o| match o {
            carve_alloc::Object::Class(c) => Some(c),
            _ => None,
        })
        .collect();
    assert!(
        !classes.is_empty(),
        "{} holds no DeviceClass",
        path.display()
    );
    let api: kube::Api<DeviceClass> = kube::Api::all(client);
    for c in &classes {
        api.create(&kube::api::PostParams::default(), c)
            .await
            .unwrap_or_else(|e| panic!("creating DeviceClass {:?}: {e}", c.metadata.name));
    }
    classes
}

/// The NVML simulator cdylib cargo built for this profile
/// (`target/<profile>/deps/libnvidia_ml_sim.so`; `carve-nvml-sim` is a
/// dependency of this crate).
///
/// # Errors
/// It was not built.
pub fn sim_library() -> Result<PathBuf, E2eError> {
    let p = target_profile_dir()?
        .join("deps")
        .join("libnvidia_ml_sim.so");
    if p.is_file() {
        Ok(p)
    } else {
        Err(E2eError::Missing {
            what: "NVML simulator library",
            path: p,
            hint: "cargo test -p carve-e2e builds it".into(),
        })
    }
}

/// Waits until the node's pool is published, complete, in `store`
/// ([`published_pool`]), and returns its slices.
///
/// # Errors
/// A stored slice is not a ResourceSlice, the plugin exits, or the deadline
/// passes ([`wait_for`]).
pub async fn wait_published(
    node: &mut SimNode,
    store: &Store,
) -> Result<Vec<ResourceSlice>, E2eError> {
    let (s, name) = (store.clone(), node.node_name.clone());
    wait_for(
        node,
        "the node's ResourceSlices in the API server",
        move |_| published_pool(&s, &name).transpose(),
    )
    .await
    .and_then(|r| r)
}

/// Polls `cond` every [`POLL`] until it yields a value, the plugin exits, or
/// [`DEADLINE`] passes.
///
/// # Errors
/// [`E2eError::PluginExited`] or [`E2eError::Timeout`], with the plugin log.
pub async fn wait_for<T>(
    node: &mut SimNode,
    waiting_for: &str,
    mut cond: impl FnMut(&SimNode) -> Option<T>,
) -> Result<T, E2eError> {
    let start = Instant::now();
    loop {
        if let Some(v) = cond(node) {
            return Ok(v);
        }
        if let Some(status) = node.exited() {
            return Err(E2eError::PluginExited {
                status,
                waiting_for: waiting_for.into(),
                log: node.log(),
            });
        }
        if start.elapsed() > DEADLINE {
            return Err(E2eError::Timeout {
                waiting_for: waiting_for.into(),
                after: DEADLINE,
                log: node.log(),
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

/// A simulated node: its directories, the simulator configuration, and the
/// `carve kubelet-plugin` child process when running. Dropping it kills the
/// child.
#[derive(Debug)]
pub struct SimNode {
    /// Everything lives under this directory.
    pub dir: tempfile::TempDir,
    /// Node name (also the pool name).
    pub node_name: String,
    /// `--plugins-dir`.
    pub plugins_dir: PathBuf,
    /// `--registry-dir`.
    pub registry_dir: PathBuf,
    /// `--cdi-dir`.
    pub cdi_dir: PathBuf,
    /// `--state-dir`.
    pub state_dir: PathBuf,
    /// `--nvml-lib`: a private copy of the simulator library.
    pub nvml_lib: PathBuf,
    /// The simulator configuration file (`CARVE_NVML_SIM_CONFIG`).
    pub sim_config_path: PathBuf,
    /// The simulator configuration.
    pub sim: SimConfig,
    /// The fake NVIDIA driver root and `/proc/devices` the CDI specs are
    /// built from (`--container-driver-root`, `--host-driver-root`,
    /// `--proc-devices`).
    pub driver: nvidia_ml_sim::driver_root::FakeDriver,
    /// `--kube-api-url`.
    pub api_url: String,
    /// A kubeconfig file for the plugin (`KUBECONFIG`), e.g. one with a
    /// bearer token; when set, the plugin runs without `--kube-api-url`
    /// and `api_url` is unused. `None` by default.
    pub kubeconfig: Option<PathBuf>,
    /// Flags appended to [`SimNode::plugin_args`] (e.g. `--log-format
    /// json`). Empty by default.
    pub extra_args: Vec<String>,
    carve: PathBuf,
    child: Option<Child>,
    starts: u32,
}

impl SimNode {
    /// Lays out a node with `gpus` under a fresh temporary directory, copies
    /// the simulator library there and writes its configuration.
    ///
    /// # Errors
    /// File-system failures, or a missing binary or library.
    pub fn new(
        node_name: &str,
        gpus: Vec<GpuEntry>,
        carve: PathBuf,
        api_url: &str,
    ) -> Result<Self, E2eError> {
        // Short base path: socket paths must fit in sockaddr_un (108 bytes).
        let dir = tempfile::Builder::new()
            .prefix("carve-e2e-")
            .tempdir_in(std::env::temp_dir())
            .map_err(io("creating", &std::env::temp_dir()))?;
        let root = dir.path().to_path_buf();
        let sub = |n: &str| -> Result<PathBuf, E2eError> {
            let p = root.join(n);
            std::fs::create_dir_all(&p).map_err(io("creating", &p))?;
            Ok(p)
        };
        let plugins_dir = sub("plugins")?;
        let registry_dir = sub("registry")?;
        let cdi_dir = sub("cdi")?;
        let state_dir = sub("state")?;
        let lib_dir = sub("lib")?;
        let sim_dir = sub("sim")?;
        let nvml_lib = lib_dir.join("libnvidia_ml_sim.so");
        let src = sim_library()?;
        std::fs::copy(&src, &nvml_lib).map_err(io("copying the simulator to", &nvml_lib))?;
        let gpu_count: u32 = gpus.iter().map(|g| g.count).sum();
        let sim = SimConfig::new(node_name, gpus, &sim_dir);
        let sim_config_path = sim_dir.join("config.json");
        sim.to_file(&sim_config_path)?;
        let minors: Vec<u32> = (0..gpu_count).collect();
        let driver =
            nvidia_ml_sim::driver_root::write_fake_driver(&root, &sim.driver_version, &minors)?;
        Ok(Self {
            dir,
            node_name: node_name.into(),
            plugins_dir,
            registry_dir,
            cdi_dir,
            state_dir,
            nvml_lib,
            sim_config_path,
            sim,
            driver,
            api_url: api_url.into(),
            kubeconfig: None,
            extra_args: Vec::new(),
            carve,
            child: None,
            starts: 0,
        })
    }

    /// Rewrites the simulator configuration (e.g. to add or drop faults); the
    /// simulator reads it at the next `nvmlInit`, i.e. the next plugin start.
    ///
    /// # Errors
    /// The file cannot be written.
    pub fn set_sim_config(&mut self, sim: SimConfig) -> Result<(), E2eError> {
        sim.to_file(&self.sim_config_path)?;
        self.sim = sim;
        Ok(())
    }

    /// The command line the plugin runs with.
    #[must_use]
    pub fn plugin_args(&self) -> Vec<String> {
        let s = |p: &Path| p.display().to_string();
        let mut args: Vec<String> = vec![
            "kubelet-plugin".into(),
            "--node-name".into(),
            self.node_name.clone(),
            "--plugins-dir".into(),
            s(&self.plugins_dir),
            "--registry-dir".into(),
            s(&self.registry_dir),
            "--cdi-dir".into(),
            s(&self.cdi_dir),
            "--state-dir".into(),
            s(&self.state_dir),
            "--proc-driver-nvidia".into(),
            s(&self.sim.proc_root),
            "--container-driver-root".into(),
            s(&self.driver.root),
            "--host-driver-root".into(),
            s(&self.driver.root),
            "--proc-devices".into(),
            s(&self.driver.devices_file),
            "--nvml-lib".into(),
            s(&self.nvml_lib),
            "--metrics-addr".into(),
            "127.0.0.1:0".into(),
            "--mig-policy".into(),
            "dynamic".into(),
        ];
        if self.kubeconfig.is_none() {
            args.extend(["--kube-api-url".into(), self.api_url.clone()]);
        }
        args.extend(self.extra_args.iter().cloned());
        args
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join(format!("plugin-{}.log", self.starts))
    }

    /// Everything the plugin wrote to stdout and stderr in its latest run.
    #[must_use]
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Exit status if the plugin process has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// The registration socket(s) the plugin created in the registry dir.
    #[must_use]
    pub fn registration_sockets(&self) -> Vec<PathBuf> {
        std::fs::read_dir(&self.registry_dir)
            .map(|rd| {
                rd.filter_map(Result::ok)
                    .map(|e| e.path())
                    .filter(|p| p.to_string_lossy().ends_with("-reg.sock"))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Spawns `carve kubelet-plugin` and waits until its registration socket
    /// exists; returns the socket. Stale sockets of an earlier run are removed
    /// first so only the new process can satisfy the wait.
    ///
    /// # Errors
    /// Spawn failure, the process exiting (e.g. an unknown subcommand), or a
    /// timeout.
    pub async fn start_plugin(&mut self) -> Result<PathBuf, E2eError> {
        for s in self.registration_sockets() {
            std::fs::remove_file(&s).map_err(io("removing stale socket", &s))?;
        }
        self.starts += 1;
        let log = self.log_path();
        let out = File::create(&log).map_err(io("creating", &log))?;
        let err = out.try_clone().map_err(io("duplicating", &log))?;
        let mut cmd = Command::new(&self.carve);
        if let Some(k) = &self.kubeconfig {
            cmd.env("KUBECONFIG", k);
        }
        let child = cmd
            .args(self.plugin_args())
            .env(nvidia_ml_sim::CONFIG_ENV, &self.sim_config_path)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(io("spawning", &self.carve))?;
        self.child = Some(child);
        wait_for(self, "the plugin's registration socket", |n| {
            n.registration_sockets().into_iter().next()
        })
        .await
    }

    /// Waits until the plugin process exits on its own (e.g. an injected
    /// abort) and reaps it.
    ///
    /// # Errors
    /// [`E2eError::Timeout`], or no plugin was started.
    pub async fn wait_exit(&mut self, waiting_for: &str) -> Result<ExitStatus, E2eError> {
        if self.child.is_none() {
            return Err(E2eError::Missing {
                what: "plugin process",
                path: self.carve.clone(),
                hint: "start_plugin first".into(),
            });
        }
        let start = Instant::now();
        loop {
            if let Some(status) = self.exited() {
                self.child = None;
                return Ok(status);
            }
            if start.elapsed() > DEADLINE {
                return Err(E2eError::Timeout {
                    waiting_for: waiting_for.into(),
                    after: DEADLINE,
                    log: self.log(),
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Stops the plugin as the kubelet's container runtime does (SIGTERM)
    /// and waits until it exits.
    ///
    /// # Errors
    /// No plugin is running, signalling fails, or [`E2eError::Timeout`].
    pub async fn terminate(&mut self) -> Result<ExitStatus, E2eError> {
        let c = self.child.as_ref().ok_or_else(|| E2eError::Missing {
            what: "plugin process",
            path: self.carve.clone(),
            hint: "start_plugin first".into(),
        })?;
        let pid = nix::unistd::Pid::from_raw(i32::try_from(c.id()).unwrap_or(i32::MAX));
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).map_err(|e| {
            E2eError::Io {
                what: "sending SIGTERM to",
                path: self.carve.clone(),
                source: e.into(),
            }
        })?;
        self.wait_exit("the plugin to stop after SIGTERM").await
    }

    /// `kill -9` the plugin and reap it.
    ///
    /// # Errors
    /// No plugin is running, or signalling fails.
    pub fn kill9(&mut self) -> Result<ExitStatus, E2eError> {
        let mut c = self.child.take().ok_or_else(|| E2eError::Missing {
            what: "plugin process",
            path: self.carve.clone(),
            hint: "start_plugin first".into(),
        })?;
        c.kill().map_err(io("killing", &self.carve))?;
        c.wait().map_err(io("reaping", &self.carve))
    }

    /// The simulator's persisted state (instances as NVML sees them); the
    /// initial state from the configuration while nothing was changed yet.
    ///
    /// # Errors
    /// The state file is unreadable or does not match the configuration.
    pub fn sim_state(&self) -> Result<SimState, E2eError> {
        Ok(SimState::for_config(&self.sim, &self.sim_config_path)?)
    }

    /// GPU instances alive on the node, in total.
    ///
    /// # Errors
    /// See [`SimNode::sim_state`].
    pub fn gpu_instance_count(&self) -> Result<usize, E2eError> {
        Ok(self
            .sim_state()?
            .gpus
            .iter()
            .map(|g| g.gpu_instances.len())
            .sum())
    }

    /// CDI spec files in the CDI dir.
    #[must_use]
    pub fn cdi_files(&self) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(&self.cdi_dir)
            .map(|rd| rd.filter_map(Result::ok).map(|e| e.path()).collect())
            .unwrap_or_default();
        v.sort();
        v
    }
}

impl Drop for SimNode {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The node's complete ResourceSlice pool in the stand-in, if published: every
/// slice of the newest generation of pool `node`, as many as its
/// `resourceSliceCount` says.
///
/// # Errors
/// A stored slice does not deserialize.
pub fn published_pool(store: &Store, node: &str) -> Result<Option<Vec<ResourceSlice>>, E2eError> {
    let mut slices = Vec::new();
    for v in store.list(Resource::ResourceSlices) {
        let s: ResourceSlice = serde_json::from_value(v).map_err(|source| E2eError::Json {
            what: "ResourceSlice in the stand-in".into(),
            source,
        })?;
        if s.spec.pool.name == node && s.spec.driver == carve_model::DRIVER_NAME {
            slices.push(s);
        }
    }
    let Some(generation) = slices.iter().map(|s| s.spec.pool.generation).max() else {
        return Ok(None);
    };
    slices.retain(|s| s.spec.pool.generation == generation);
    let want = slices[0].spec.pool.resource_slice_count;
    Ok((i64::try_from(slices.len()).ok() == Some(want)).then_some(slices))
}

/// The `type` attribute (`gpu`, `mig`, `mps`, `timeslice`) of every published
/// device, by device name.
#[must_use]
pub fn device_types(slices: &[ResourceSlice]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for s in slices {
        for d in s.spec.devices.iter().flatten() {
            let ty = d
                .attributes
                .as_ref()
                .and_then(|a| a.get("type"))
                .and_then(|v| v.string.clone())
                .unwrap_or_default();
            out.insert(d.name.clone(), ty);
        }
    }
    out
}

/// The devices of `alloc` that belong to carve.
#[must_use]
pub fn allocated_devices(alloc: &AllocationResult) -> Vec<String> {
    alloc
        .devices
        .as_ref()
        .and_then(|d| d.results.as_ref())
        .map(|r| {
            r.iter()
                .filter(|r| r.driver == carve_model::DRIVER_NAME)
                .map(|r| r.device.clone())
                .collect()
        })
        .unwrap_or_default()
}

/// One claim's prepared devices as the plugin reported them: device name →
/// CDI device ids.
pub type Prepared = BTreeMap<String, Vec<String>>;

/// Checks a prepared claim against the files and the simulator:
///
/// * the CDI spec `<cdi>/k8s.gpu.carve.dev-claim_<uid>.json` exists, parses,
///   has kind `k8s.gpu.carve.dev/claim`, and holds a device
///   `<uid>-<device>` for every reported CDI id `k8s.gpu.carve.dev/claim=<uid>-<device>`;
/// * the reported devices are exactly the allocated ones;
/// * for each MIG device `gpu-G-mig-P-S`: GPU G has a GPU instance of profile P
///   (its NVML profile id) starting at memory slice S, and the CDI device's
///   nodes are exactly GPU G's `/dev/nvidia<G>` and the capability nodes of
///   that GPU instance and one of its compute instances (minors from the
///   driver's proc files);
/// * for a whole GPU: the device's only node is `/dev/nvidia<G>`;
/// * no device sets a visible-devices variable (two devices in one container
///   would overwrite each other's).
///
/// # Errors
/// [`E2eError::Check`] naming the claim and what is wrong.
pub fn check_prepared(
    node: &SimNode,
    uid: &str,
    allocated: &[String],
    prepared: &Prepared,
) -> Result<(), E2eError> {
    let bad = |problem: String| E2eError::Check {
        claim: uid.into(),
        problem,
    };
    let mut want: Vec<&String> = allocated.iter().collect();
    want.sort();
    let got: Vec<&String> = prepared.keys().collect();
    if want != got {
        return Err(bad(format!("prepared devices {got:?}, allocated {want:?}")));
    }
    let path = claim_spec_path(&node.cdi_dir, uid);
    let text =
        std::fs::read(&path).map_err(|e| bad(format!("CDI spec {}: {e}", path.display())))?;
    let spec: CdiSpec = serde_json::from_slice(&text)
        .map_err(|e| bad(format!("CDI spec {} does not parse: {e}", path.display())))?;
    if spec.kind != CDI_KIND {
        return Err(bad(format!(
            "CDI spec kind {:?}, want {CDI_KIND:?}",
            spec.kind
        )));
    }
    let state = node.sim_state()?;
    for (device, ids) in prepared {
        let cdi_name = format!("{uid}-{device}");
        let want_id = format!("{CDI_KIND}={cdi_name}");
        if !ids.contains(&want_id) {
            return Err(bad(format!(
                "device {device}: CDI ids {ids:?} lack {want_id}"
            )));
        }
        let dev = spec
            .devices
            .iter()
            .find(|d| d.name == cdi_name)
            .ok_or_else(|| {
                bad(format!(
                    "CDI spec {} has no device {cdi_name}",
                    path.display()
                ))
            })?;
        // Issue 16 §2: a device is identified by its device nodes; a
        // per-device NVIDIA_VISIBLE_DEVICES would overwrite another device's
        // in the same container.
        if let Some(v) = dev
            .container_edits
            .env
            .iter()
            .find(|e| e.contains("VISIBLE_DEVICES="))
        {
            return Err(bad(format!("CDI device {cdi_name} sets {v}")));
        }
        let nodes: Vec<&str> = dev
            .container_edits
            .device_nodes
            .iter()
            .map(|n| n.path.as_str())
            .collect();
        let name: DeviceName = device
            .parse()
            .map_err(|e| bad(format!("device name {device:?}: {e}")))?;
        match &name {
            DeviceName::Mig { gpu, .. } => {
                let (profile, start) = name
                    .mig_placement()
                    .ok_or_else(|| bad(format!("{device} has no placement")))?;
                let g = state
                    .gpus
                    .get(*gpu as usize)
                    .ok_or_else(|| bad(format!("{device}: simulator has no GPU {gpu}")))?;
                let spec = GpuModel::find(&g.model)
                    .ok_or_else(|| {
                        bad(format!("simulator GPU {gpu} has unknown model {}", g.model))
                    })?
                    .spec();
                let pid = spec
                    .profile(&profile)
                    .ok_or_else(|| bad(format!("{device}: {} has no profile {profile}", g.model)))?
                    .id;
                let gi = g
                    .gpu_instances
                    .iter()
                    .find(|gi| gi.start == start && gi.profile_id == pid)
                    .ok_or_else(|| {
                        bad(format!(
                            "{device}: no GPU instance of {profile} (id {pid}) at slice {start} on GPU {gpu}; instances: {:?}",
                            g.gpu_instances
                                .iter()
                                .map(|gi| (gi.profile_id, gi.start))
                                .collect::<Vec<_>>()
                        ))
                    })?;
                // The parent's node and the GI and CI capability nodes, whose
                // minors the driver's proc files give.
                let mig_dir = node
                    .sim
                    .proc_root
                    .join("capabilities")
                    .join(format!("gpu{gpu}"))
                    .join("mig")
                    .join(format!("gi{}", gi.id));
                let gi_cap = cap_minor(&mig_dir.join("access")).map_err(&bad)?;
                let matches_a_ci = gi.compute_instances.iter().any(|ci| {
                    cap_minor(&mig_dir.join(format!("ci{}", ci.id)).join("access")).is_ok_and(
                        |ci_cap| {
                            nodes
                                == [
                                    format!("/dev/nvidia{gpu}").as_str(),
                                    format!("/dev/nvidia-caps/nvidia-cap{gi_cap}").as_str(),
                                    format!("/dev/nvidia-caps/nvidia-cap{ci_cap}").as_str(),
                                ]
                        },
                    )
                });
                if !matches_a_ci {
                    return Err(bad(format!(
                        "{device}: device nodes {nodes:?} are not GPU {gpu}'s node and the capability nodes of GPU instance {} (cap {gi_cap}) and one of its compute instances",
                        gi.id
                    )));
                }
            }
            DeviceName::Gpu { gpu } => {
                if nodes != [format!("/dev/nvidia{gpu}").as_str()] {
                    return Err(bad(format!(
                        "{device}: device nodes {nodes:?}, want only /dev/nvidia{gpu}"
                    )));
                }
            }
            other => {
                return Err(bad(format!(
                    "{device}: the suite has no check for {other:?}"
                )));
            }
        }
    }
    Ok(())
}

/// The `DeviceFileMinor` of a driver capability `access` file.
fn cap_minor(access: &Path) -> Result<u32, String> {
    let text = std::fs::read_to_string(access).map_err(|e| format!("{}: {e}", access.display()))?;
    text.lines()
        .find_map(|l| l.strip_prefix("DeviceFileMinor:"))
        .and_then(|m| m.trim().parse().ok())
        .ok_or_else(|| format!("{}: no DeviceFileMinor", access.display()))
}

/// The claim's name and namespace as a kubelet `Claim`.
///
/// # Errors
/// The claim has no UID (it was not created through the API).
pub fn claim_ref(c: &ResourceClaim) -> Result<carve_plugin::ClaimRef, E2eError> {
    let uid = c.metadata.uid.clone().ok_or_else(|| E2eError::Check {
        claim: c.metadata.name.clone().unwrap_or_default(),
        problem: "has no metadata.uid".into(),
    })?;
    Ok(carve_plugin::ClaimRef {
        namespace: c
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into()),
        name: c.metadata.name.clone().unwrap_or_default(),
        uid,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvidia_ml_sim::{CiState, GiState};

    fn node_with_one_instance() -> SimNode {
        let node = SimNode::new(
            "n",
            vec![GpuEntry::new("h100-80gb", 1, true)],
            PathBuf::from("/nonexistent/carve"),
            "http://127.0.0.1:1",
        )
        .unwrap();
        let mut st = SimState::fresh(&["h100-80gb"], &[true]);
        let pid = GpuModel::find("h100-80gb")
            .unwrap()
            .spec()
            .profile("1g.10gb")
            .unwrap()
            .id;
        st.gpus[0].gpu_instances.push(GiState {
            serial: 1,
            id: 1,
            profile_id: pid,
            start: 3,
            cap_minor: 10,
            compute_instances: vec![CiState {
                serial: 2,
                id: 0,
                profile_id: 0,
                slices: 1,
                start: 0,
                cap_minor: 11,
                uuid: "MIG-x".into(),
                compute_mode: 0,
            }],
        });
        st.save(&node.sim.state_file).unwrap();
        // What the driver's proc files say of that GPU instance and its
        // compute instance (the simulator writes them when it creates one).
        let gi = node.sim.proc_root.join("capabilities/gpu0/mig/gi1");
        std::fs::create_dir_all(gi.join("ci0")).unwrap();
        std::fs::write(
            gi.join("access"),
            "DeviceFileMinor: 10\nDeviceFileMode: 292\n",
        )
        .unwrap();
        std::fs::write(
            gi.join("ci0/access"),
            "DeviceFileMinor: 11\nDeviceFileMode: 292\n",
        )
        .unwrap();
        node
    }

    /// A spec whose device has these device nodes (and, if given, env).
    fn write_spec_with(node: &SimNode, uid: &str, device: &str, nodes: &[&str], env: &[&str]) {
        let nodes: Vec<serde_json::Value> = nodes
            .iter()
            .map(|p| serde_json::json!({"path": p}))
            .collect();
        let spec = serde_json::json!({
            "cdiVersion": "0.5.0",
            "kind": CDI_KIND,
            "devices": [{"name": format!("{uid}-{device}"),
                         "containerEdits": {"env": env, "deviceNodes": nodes}}],
        });
        std::fs::write(
            claim_spec_path(&node.cdi_dir, uid),
            serde_json::to_vec(&spec).unwrap(),
        )
        .unwrap();
    }

    /// The nodes of the instance at slice 3: the GPU, its GI and CI caps.
    const MIG_NODES: [&str; 3] = [
        "/dev/nvidia0",
        "/dev/nvidia-caps/nvidia-cap10",
        "/dev/nvidia-caps/nvidia-cap11",
    ];

    fn write_spec(node: &SimNode, uid: &str, device: &str) {
        write_spec_with(node, uid, device, &MIG_NODES, &[]);
    }

    fn prepared(uid: &str, device: &str) -> Prepared {
        BTreeMap::from([(
            device.to_string(),
            vec![format!("{CDI_KIND}={uid}-{device}")],
        )])
    }

    #[test]
    fn check_prepared_accepts_the_truth_and_names_each_mismatch() {
        let node = node_with_one_instance();
        let dev = "gpu-0-mig-1g10gb-3";
        let alloc = [dev.to_string()];
        write_spec(&node, "u1", dev);
        check_prepared(&node, "u1", &alloc, &prepared("u1", dev)).unwrap();

        let err = |r: Result<(), E2eError>| r.unwrap_err().to_string();
        // Reported devices differ from the allocation.
        let e = err(check_prepared(
            &node,
            "u1",
            &["gpu-0-mig-1g10gb-4".into()],
            &prepared("u1", dev),
        ));
        assert!(e.contains("allocated"), "{e}");
        // No instance at the placement.
        let other = "gpu-0-mig-1g10gb-4";
        write_spec(&node, "u2", other);
        let e = err(check_prepared(
            &node,
            "u2",
            &[other.into()],
            &prepared("u2", other),
        ));
        assert!(
            e.contains("no GPU instance of 1g.10gb") && e.contains("slice 4"),
            "{e}"
        );
        // The container would see another device (another CI's capability).
        write_spec_with(
            &node,
            "u3",
            dev,
            &[
                "/dev/nvidia0",
                "/dev/nvidia-caps/nvidia-cap10",
                "/dev/nvidia-caps/nvidia-cap12",
            ],
            &[],
        );
        let e = err(check_prepared(&node, "u3", &alloc, &prepared("u3", dev)));
        assert!(e.contains("nvidia-cap12"), "{e}");
        // A per-device visible-devices variable (two devices in one container
        // would overwrite each other's).
        write_spec_with(
            &node,
            "u5",
            dev,
            &MIG_NODES,
            &["NVIDIA_VISIBLE_DEVICES=MIG-x"],
        );
        let e = err(check_prepared(&node, "u5", &alloc, &prepared("u5", dev)));
        assert!(e.contains("sets NVIDIA_VISIBLE_DEVICES=MIG-x"), "{e}");
        // No CDI spec.
        let e = err(check_prepared(&node, "u4", &alloc, &prepared("u4", dev)));
        assert!(e.contains("CDI spec"), "{e}");
        // A CDI id the spec does not define.
        let mut p = prepared("u1", dev);
        p.insert(dev.into(), vec!["k8s.gpu.carve.dev/claim=other".into()]);
        let e = err(check_prepared(&node, "u1", &alloc, &p));
        assert!(e.contains("lack"), "{e}");
    }
}
