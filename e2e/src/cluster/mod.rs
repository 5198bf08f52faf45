//! A real one-node Kubernetes cluster on this machine, as processes on
//! loopback and a bridge of its own: etcd, kube-apiserver,
//! kube-controller-manager, kube-scheduler and the kubelet built from
//! `k8s.io/kubernetes` (`e2e/cluster/build.sh`), containerd v2 with CDI on
//! Debian's runc and CNI plugins. No registry is reached: the images the
//! node runs are built here ([`image`]) and imported into containerd.
//!
//! Needs root. [`Binaries::locate`] says what is missing and how to get it.
//!
//! The network: a bridge `carve0` (10.99.0.1/16) that the CNI bridge plugin
//! puts pods on; the API server listens on 10.99.0.1:6443 only. The
//! `kubernetes` Service's address (10.98.0.1:443, what in-cluster clients
//! dial) is translated to it by two iptables DNAT rules (what kube-proxy
//! would do for that one Service), and the service range is routed onto the
//! bridge, so no packet for it leaves the machine. Everything is removed
//! when the cluster is dropped.

pub mod image;
pub mod pki;
pub mod procs;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use procs::{Proc, run};

/// The versions `e2e/cluster/build.sh` builds (keep the two in step).
pub mod versions {
    /// The Kubernetes release the suite runs by default.
    pub const KUBE: &str = "1.37.2";
    /// etcd's.
    pub const ETCD: &str = "3.6.16";
    /// containerd's.
    pub const CONTAINERD: &str = "2.2.9";
    /// runc's: what containerd's CI pins for that containerd.
    pub const RUNC: &str = "1.3.6";
    /// helm's.
    pub const HELM: &str = "4.3.1";
}

/// The node's name (kubelet `--hostname-override`, its certificate's CN,
/// the plugin's pool).
pub const NODE: &str = "carve-node";
/// The bridge's address: the API server's, and the pods' gateway.
pub const BRIDGE_IP: &str = "10.99.0.1";
const BRIDGE: &str = "carve0";
const POD_CIDR: &str = "10.99.0.0/16";
const SERVICE_CIDR: &str = "10.98.0.0/24";
const KUBERNETES_SERVICE_IP: &str = "10.98.0.1";
/// The image names the node runs.
pub const PAUSE_IMAGE: &str = "registry.local/carve/pause:e2e";
/// The image of the suite's pods: busybox.
pub const PROBE_IMAGE: &str = "registry.local/carve/probe:e2e";
/// carve's image, as the chart names it (`image.repository`, `image.tag`).
pub const CARVE_REPOSITORY: &str = "registry.local/carve/carve";
/// Its tag.
pub const CARVE_TAG: &str = "e2e";
/// The chart's `mps.daemonCgroup` in the suite: the cgroup (under the
/// host's root, in each hierarchy) of the MPS daemons, which outlive the
/// plugin's pod; the teardown kills and removes it.
pub const MPS_DAEMON_CGROUP: &str = "carve-e2e-mps";

/// What went wrong.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// Something the cluster needs is not on this machine.
    #[error("cluster prerequisite missing: {0}")]
    Prerequisite(String),
    /// A file operation failed.
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
    /// A command failed.
    #[error("{what} failed:\n{output}")]
    Command {
        /// The command.
        what: String,
        /// What it printed.
        output: String,
    },
    /// A JSON document could not be written.
    #[error("{what}: {source}")]
    Json {
        /// Which.
        what: &'static str,
        /// The error.
        #[source]
        source: serde_json::Error,
    },
    /// A component exited or did not become ready.
    #[error("{component}: {problem}; the last lines of its log ({log_path}):\n{log}")]
    Component {
        /// Which.
        component: String,
        /// What happened.
        problem: String,
        /// Its log file.
        log_path: PathBuf,
        /// Its last lines.
        log: String,
    },
    /// A Kubernetes API call failed.
    #[error("{what}: {source}")]
    Kube {
        /// The call.
        what: String,
        /// The error.
        #[source]
        source: kube::Error,
    },
}

impl ClusterError {
    pub(crate) fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.to_path_buf();
        move |source| ClusterError::Io { what, path, source }
    }

    pub(crate) fn json(what: &'static str) -> impl FnOnce(serde_json::Error) -> Self {
        move |source| ClusterError::Json { what, source }
    }

    /// An error for a kube call.
    pub fn kube(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Self {
        let what = what.into();
        move |source| ClusterError::Kube { what, source }
    }
}

/// The programs the cluster runs, found on this machine.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// The Kubernetes release.
    pub kube_version: String,
    /// `kube` (kube-apiserver, kube-controller-manager, kube-scheduler, kubelet).
    pub kube: PathBuf,
    /// `etcd`.
    pub etcd: PathBuf,
    /// The directory of `containerd`, `containerd-shim-runc-v2` and `ctr`.
    pub containerd_dir: PathBuf,
    /// `helm`.
    pub helm: PathBuf,
    /// The OCI runtime containerd's runc shim calls: the runc containerd's
    /// CI pins (Debian 12's runc 1.1.5 fails in `runc init` on containerd
    /// 2.2's specs, and its crun 1.8.1 refuses their spec version);
    /// `CARVE_E2E_OCI_RUNTIME` names another (a wrapper that logs, say).
    pub oci_runtime: PathBuf,
    /// The CNI plugins' directory (Debian's containernetworking-plugins).
    pub cni_dir: PathBuf,
    /// Debian's static busybox, the probe image's only program.
    pub busybox: PathBuf,
}

/// `CARVE_CLUSTER_CACHE`, else `~/.cache/carve-cluster` (as build.sh).
#[must_use]
pub fn cache_dir() -> PathBuf {
    std::env::var_os("CARVE_CLUSTER_CACHE").map_or_else(
        || {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()))
                .join(".cache/carve-cluster")
        },
        PathBuf::from,
    )
}

/// The Kubernetes release to run: `CARVE_KUBE_VERSION`, else
/// [`versions::KUBE`].
#[must_use]
pub fn kube_version() -> String {
    std::env::var("CARVE_KUBE_VERSION").unwrap_or_else(|_| versions::KUBE.to_string())
}

/// Where `build.sh` puts the `kube` binary of a release.
#[must_use]
pub fn kube_binary(release: &str) -> PathBuf {
    cache_dir().join(format!("kube-v{release}/kube"))
}

impl Binaries {
    /// Finds every program, or names each missing one and how to get it.
    ///
    /// # Errors
    /// [`ClusterError::Prerequisite`], listing all that is missing.
    pub fn locate(kube_version: &str) -> Result<Self, ClusterError> {
        let cache = cache_dir();
        let b = Binaries {
            kube_version: kube_version.to_string(),
            kube: kube_binary(kube_version),
            etcd: cache.join(format!("etcd-v{}/etcd", versions::ETCD)),
            containerd_dir: cache.join(format!("containerd-v{}", versions::CONTAINERD)),
            helm: cache.join(format!("helm-v{}/helm", versions::HELM)),
            oci_runtime: std::env::var_os("CARVE_E2E_OCI_RUNTIME").map_or_else(
                || cache.join(format!("runc-v{}/runc", versions::RUNC)),
                PathBuf::from,
            ),
            cni_dir: PathBuf::from("/usr/lib/cni"),
            busybox: PathBuf::from("/bin/busybox"),
        };
        let build = format!("e2e/cluster/build.sh {kube_version}");
        let mut missing = Vec::new();
        let mut need = |p: &Path, how: &str| {
            if !p.is_file() {
                missing.push(format!("{} ({how})", p.display()));
            }
        };
        need(&b.kube, &build);
        need(&b.etcd, &build);
        for c in ["containerd", "containerd-shim-runc-v2", "ctr"] {
            need(&b.containerd_dir.join(c), &build);
        }
        need(&b.helm, &build);
        need(&b.oci_runtime, &build);
        for p in ["bridge", "host-local", "loopback", "portmap"] {
            need(
                &b.cni_dir.join(p),
                "apt-get install containernetworking-plugins",
            );
        }
        need(&b.busybox, "apt-get install busybox-static");
        for tool in ["openssl", "iptables", "ip", "gcc", "ldd", "mount"] {
            if !on_path(tool) {
                missing.push(format!(
                    "{tool} on PATH (apt-get install openssl iptables iproute2 gcc libc6-dev)"
                ));
            }
        }
        if !nix::unistd::Uid::effective().is_root() {
            missing.push("root (the kubelet, containerd and the network setup need it)".into());
        }
        if missing.is_empty() {
            Ok(b)
        } else {
            Err(ClusterError::Prerequisite(missing.join("; ")))
        }
    }

    fn containerd(&self, name: &str) -> PathBuf {
        self.containerd_dir.join(name)
    }
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

/// A component of the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Component {
    /// etcd.
    Etcd,
    /// kube-apiserver.
    ApiServer,
    /// kube-controller-manager.
    ControllerManager,
    /// kube-scheduler.
    Scheduler,
    /// containerd.
    Containerd,
    /// kubelet.
    Kubelet,
}

impl Component {
    /// Its program name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Component::Etcd => "etcd",
            Component::ApiServer => "kube-apiserver",
            Component::ControllerManager => "kube-controller-manager",
            Component::Scheduler => "kube-scheduler",
            Component::Containerd => "containerd",
            Component::Kubelet => "kubelet",
        }
    }
}

/// The feature gates carve's slices and claims need, per minor version
/// (`../shared/reference/real-cluster.md` §3): partitionable devices,
/// consumable capacity, device taints and extended resources are alpha and
/// off on 1.34 and 1.35; from 1.36 they are beta and on (1.37: GA or beta),
/// so nothing is set there. On 1.34 consumable capacity stays off, as the
/// README tells admins: its allocator crashes on a request for several
/// devices with it on, and carve publishes no share for a 1.34 scheduler
/// (`carve_model::scheduler`). Every component accepts every gate. The
/// names of the gates to turn on.
#[must_use]
pub fn feature_gates(kube_version: &str) -> &'static [&'static str] {
    if minor(kube_version) == 34 {
        &[
            "DRAPartitionableDevices",
            "DRADeviceTaints",
            "DRAExtendedResource",
        ]
    } else if minor(kube_version) < 36 {
        &[
            "DRAPartitionableDevices",
            "DRAConsumableCapacity",
            "DRADeviceTaints",
            "DRAExtendedResource",
        ]
    } else {
        &[]
    }
}

/// The minor version of `1.<minor>.<patch>` (0 if unreadable).
#[must_use]
pub fn minor(kube_version: &str) -> u32 {
    kube_version
        .split('.')
        .nth(1)
        .and_then(|m| m.parse().ok())
        .unwrap_or(0)
}

/// Where the cluster's files are.
#[derive(Debug, Clone)]
pub struct Layout {
    /// The root of it all (a bind mount of itself, `rshared`, so that
    /// containers' mount propagation works under it).
    pub root: PathBuf,
    /// The kubelet's `--root-dir` (the chart's `kubeletPlugin.kubeletRootDir`).
    pub kubelet_root: PathBuf,
    /// Where containerd reads CDI specs (the chart's `kubeletPlugin.cdiDir`).
    pub cdi: PathBuf,
    /// Logs of every component.
    pub logs: PathBuf,
}

impl Layout {
    fn new(root: &Path) -> Self {
        Layout {
            root: root.to_path_buf(),
            kubelet_root: root.join("kubelet"),
            cdi: root.join("cdi"),
            logs: root.join("logs"),
        }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.root.join(p)
    }

    fn containerd_sock(&self) -> PathBuf {
        self.path("containerd/containerd.sock")
    }
}

/// A running cluster. Dropping it stops every process it started, kills the
/// pods' containers, undoes the mounts and the network setup, and removes
/// its directory (`CARVE_E2E_KEEP=1` keeps the directory).
#[derive(Debug)]
pub struct Cluster {
    /// The programs.
    pub bins: Binaries,
    /// The files.
    pub layout: Layout,
    /// The certificates.
    pub pki: pki::Pki,
    /// The admin's kubeconfig (group system:masters).
    pub admin_kubeconfig: PathBuf,
    procs: BTreeMap<Component, Proc>,
    /// The Kubernetes release each Kubernetes component runs (all
    /// `bins.kube_version` at start; [`Cluster::run_release`] moves one).
    releases: BTreeMap<Component, String>,
    /// Feature gates set against a component's defaults for its release
    /// ([`Cluster::set_feature_gate`]).
    gate_overrides: BTreeMap<Component, BTreeMap<String, bool>>,
    net: Vec<Vec<String>>,
    mounted: bool,
    /// When each component was (re)started, in order.
    starts: Vec<(Component, std::time::SystemTime)>,
}

/// The API server's URL, as host processes dial it.
#[must_use]
pub fn server_url() -> String {
    format!("https://{BRIDGE_IP}:6443")
}

impl Cluster {
    /// Lays out the node under `root` (which must not exist), builds and
    /// imports the images, and starts every component, waiting for each to be
    /// ready and for the node to be `Ready`.
    ///
    /// `carve` and `sim_lib` are the binaries carve's image is built from.
    ///
    /// # Errors
    /// A component fails to start, with its log.
    pub async fn start(
        bins: Binaries,
        root: &Path,
        carve: &Path,
        sim_lib: &Path,
    ) -> Result<Self, ClusterError> {
        let mut c = Self::lay_out(bins, root)?;
        c.start_component(Component::Etcd).await?;
        c.start_component(Component::ApiServer).await?;
        c.bind_kubelet_api_access().await?;
        c.start_component(Component::ControllerManager).await?;
        c.start_component(Component::Scheduler).await?;
        c.start_component(Component::Containerd).await?;
        c.import_images(carve, sim_lib)?;
        c.start_component(Component::Kubelet).await?;
        c.wait_node_ready(Duration::from_secs(120)).await?;
        Ok(c)
    }

    /// The directories, certificates, configuration, mounts and network of
    /// a cluster, nothing started.
    fn lay_out(bins: Binaries, root: &Path) -> Result<Self, ClusterError> {
        let layout = Layout::new(root);
        for d in [
            &layout.root,
            &layout.logs,
            &layout.cdi,
            &layout.kubelet_root,
        ] {
            std::fs::create_dir_all(d).map_err(ClusterError::io("creating", d))?;
        }
        let pki = pki::Pki::new(&layout.path("pki"))?;
        let admin = pki.issue("admin", "/O=system:masters/CN=carve-e2e-admin", None)?;
        let admin_kubeconfig = pki.kubeconfig("admin", &server_url(), &admin)?;
        let mut c = Cluster {
            bins,
            layout,
            pki,
            admin_kubeconfig,
            procs: BTreeMap::new(),
            releases: BTreeMap::new(),
            gate_overrides: BTreeMap::new(),
            net: Vec::new(),
            mounted: false,
            starts: Vec::new(),
        };
        sweep_stale(&c.bins);
        c.mount_root()?;
        c.network()?;
        c.write_configs()?;
        Ok(c)
    }

    /// Only etcd, the API server and the scheduler, under `root` (which must
    /// not exist): no kubelet, no containerd, no controller manager (its node
    /// lifecycle controller would taint Node objects no kubelet heartbeats).
    /// For Node objects made by hand, to schedule onto (a benchmark of the
    /// scheduler).
    ///
    /// # Errors
    /// A component fails to start, with its log.
    pub async fn start_control_plane(bins: Binaries, root: &Path) -> Result<Self, ClusterError> {
        let mut c = Self::lay_out(bins, root)?;
        c.start_component(Component::Etcd).await?;
        c.start_component(Component::ApiServer).await?;
        c.start_component(Component::Scheduler).await?;
        Ok(c)
    }

    /// The pid of `c`'s process, while it runs.
    #[must_use]
    pub fn pid(&self, c: Component) -> Option<u32> {
        self.procs.get(&c).map(Proc::pid)
    }

    /// A client with the admin's credentials.
    ///
    /// # Errors
    /// The kubeconfig cannot be read.
    pub async fn client(&self) -> Result<kube::Client, ClusterError> {
        let kc = kube::config::Kubeconfig::read_from(&self.admin_kubeconfig).map_err(|e| {
            ClusterError::Command {
                what: "reading the admin kubeconfig".into(),
                output: e.to_string(),
            }
        })?;
        let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .map_err(|e| ClusterError::Command {
                what: "the admin kubeconfig".into(),
                output: e.to_string(),
            })?;
        kube::Client::try_from(cfg).map_err(ClusterError::kube("building the admin client"))
    }

    /// A client that authenticates with `token` (a ServiceAccount token),
    /// trusting the cluster's CA.
    ///
    /// # Errors
    /// The admin kubeconfig cannot be read.
    pub async fn client_with_token(&self, token: &str) -> Result<kube::Client, ClusterError> {
        let kc = kube::config::Kubeconfig::read_from(&self.admin_kubeconfig).map_err(|e| {
            ClusterError::Command {
                what: "reading the admin kubeconfig".into(),
                output: e.to_string(),
            }
        })?;
        let mut cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .map_err(|e| ClusterError::Command {
                what: "the admin kubeconfig".into(),
                output: e.to_string(),
            })?;
        // The token alone: no client certificate of the admin's.
        cfg.auth_info = kube::config::AuthInfo {
            token: Some(token.to_string().into()),
            ..Default::default()
        };
        kube::Client::try_from(cfg).map_err(ClusterError::kube("building a token client"))
    }

    /// The API server's audit log: ServiceAccounts' requests outside
    /// kube-system, one JSON event a line (across restarts and releases).
    #[must_use]
    pub fn audit_log(&self) -> PathBuf {
        self.layout.logs.join("audit.log")
    }

    /// The audit events of `user`, one per request (the event of a request's
    /// last stage: `ResponseComplete`, or `ResponseStarted` for a watch
    /// still open).
    ///
    /// # Errors
    /// The log cannot be read or a line is not JSON.
    pub fn audit_events(&self, user: &str) -> Result<Vec<serde_json::Value>, ClusterError> {
        let path = self.audit_log();
        let text = std::fs::read_to_string(&path).map_err(ClusterError::io("reading", &path))?;
        let mut by_id: std::collections::BTreeMap<String, serde_json::Value> = Default::default();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let ev: serde_json::Value =
                serde_json::from_str(line).map_err(ClusterError::json("an audit event"))?;
            if ev["user"]["username"] != user {
                continue;
            }
            let id = ev["auditID"].as_str().unwrap_or_default().to_string();
            let complete = ev["stage"] == "ResponseComplete";
            match by_id.get(&id) {
                Some(old) if old["stage"] == "ResponseComplete" && !complete => {}
                _ => {
                    by_id.insert(id, ev);
                }
            }
        }
        Ok(by_id.into_values().collect())
    }

    /// The log of `c` so far (last `lines` lines).
    #[must_use]
    pub fn log(&self, c: Component, lines: usize) -> String {
        procs::tail(&self.log_path(c), lines)
    }

    fn log_path(&self, c: Component) -> PathBuf {
        self.layout.logs.join(format!("{}.log", c.name()))
    }

    /// Every component's last lines, for a failure message.
    #[must_use]
    pub fn logs(&self, lines: usize) -> String {
        let mut s = String::new();
        for c in [
            Component::Kubelet,
            Component::Containerd,
            Component::Scheduler,
            Component::ControllerManager,
            Component::ApiServer,
        ] {
            s.push_str(&format!("\n--- {} ---\n{}\n", c.name(), self.log(c, lines)));
        }
        s
    }

    /// Bind-mounts the root on itself, `rshared`: the chart's
    /// `HostToContainer` and `Bidirectional` volumes need a shared mount
    /// under their host path (runc refuses them on a private one).
    fn mount_root(&mut self) -> Result<(), ClusterError> {
        let r = self.layout.root.display().to_string();
        let mut bind = Command::new("mount");
        bind.args(["--bind", &r, &r]);
        run("mount --bind (the cluster root)", bind)?;
        self.mounted = true;
        let mut shared = Command::new("mount");
        shared.args(["--make-rshared", &r]);
        run("mount --make-rshared (the cluster root)", shared)?;
        Ok(())
    }

    /// The bridge, the route for the service range and the DNAT rules for
    /// the `kubernetes` Service (see the module documentation). Each step's
    /// undo is recorded before the next.
    fn network(&mut self) -> Result<(), ClusterError> {
        let steps: Vec<(Vec<String>, Vec<String>)> = vec![
            (
                words(&format!("ip link add {BRIDGE} type bridge")),
                words(&format!("ip link del {BRIDGE}")),
            ),
            (
                words(&format!("ip addr add {BRIDGE_IP}/16 dev {BRIDGE}")),
                vec![],
            ),
            (words(&format!("ip link set {BRIDGE} up")), vec![]),
            (
                words(&format!("ip route add {SERVICE_CIDR} dev {BRIDGE}")),
                words(&format!("ip route del {SERVICE_CIDR} dev {BRIDGE}")),
            ),
        ];
        let dnat = format!(
            "-d {KUBERNETES_SERVICE_IP}/32 -p tcp --dport 443 -j DNAT --to-destination {BRIDGE_IP}:6443 -m comment --comment carve-e2e"
        );
        let mut all = steps;
        for chain in ["PREROUTING", "OUTPUT"] {
            all.push((
                words(&format!("iptables -w -t nat -A {chain} {dnat}")),
                words(&format!("iptables -w -t nat -D {chain} {dnat}")),
            ));
        }
        for (step, undo) in all {
            let mut cmd = Command::new(&step[0]);
            cmd.args(&step[1..]);
            run(&step.join(" "), cmd)?;
            if !undo.is_empty() {
                self.net.push(undo);
            }
        }
        Ok(())
    }

    fn write(&self, rel: &str, text: &str) -> Result<PathBuf, ClusterError> {
        let p = self.layout.path(rel);
        if let Some(d) = p.parent() {
            std::fs::create_dir_all(d).map_err(ClusterError::io("creating", d))?;
        }
        std::fs::write(&p, text).map_err(ClusterError::io("writing", &p))?;
        Ok(p)
    }

    /// Certificates, kubeconfigs and the configuration files of the
    /// scheduler, containerd, CNI and the kubelet.
    fn write_configs(&self) -> Result<(), ClusterError> {
        self.pki.issue(
            "apiserver",
            "/CN=kube-apiserver",
            Some(&format!(
                "IP:{BRIDGE_IP},IP:{KUBERNETES_SERVICE_IP},IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
            )),
        )?;
        // The API server's client certificate for calls to the kubelet
        // (logs, exec): the kubelet authorizes it through the API server.
        self.pki.issue(
            "apiserver-kubelet-client",
            "/CN=kube-apiserver-kubelet-client",
            None,
        )?;
        let server = server_url();
        for (name, subject) in [
            ("controller-manager", "/CN=system:kube-controller-manager"),
            ("scheduler", "/CN=system:kube-scheduler"),
            (
                "kubelet",
                &*format!("/O=system:nodes/CN=system:node:{NODE}"),
            ),
        ] {
            let cert = self.pki.issue(name, subject, None)?;
            self.pki.kubeconfig(name, &server, &cert)?;
        }
        self.pki.issue(
            "kubelet-serving",
            &format!("/CN={NODE}"),
            Some(&format!("IP:{BRIDGE_IP},IP:127.0.0.1,DNS:localhost")),
        )?;
        let pki = &self.pki.dir;
        // Every request of a ServiceAccount outside kube-system (carve's
        // plugin), at Metadata level: who, verb, resource, name, answer.
        // The suite checks from it that each verb the chart grants is used
        // and none was refused. RequestReceived is left out: one event per
        // request when it is answered (and one when a watch starts).
        self.write(
            "audit-policy.yaml",
            "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n  - level: None\n    userGroups: [\"system:serviceaccounts:kube-system\"]\n  - level: Metadata\n    userGroups: [\"system:serviceaccounts\"]\n  - level: None\n",
        )?;
        self.write(
            "scheduler.yaml",
            &format!(
                "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\nclientConnection:\n  kubeconfig: {}\nleaderElection:\n  leaderElect: false\n",
                pki.join("scheduler.kubeconfig").display()
            ),
        )?;
        let root = &self.layout.root;
        self.write(
            "containerd/config.toml",
            &format!(
                r#"version = 3
root = "{root}/containerd/root"
state = "{root}/containerd/state"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "{PAUSE_IMAGE}"
[plugins.'io.containerd.cri.v1.runtime']
  # No pod's oom_score_adj below containerd's own: the kubelet asks -998
  # for node-critical pods (the plugin's), and lowering it needs
  # CAP_SYS_RESOURCE, which a sandboxed machine (this one) may not grant.
  restrict_oom_score_adj = true
  enable_cdi = true
  cdi_spec_dirs = ["{cdi}"]
[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ["{cni}"]
  conf_dir = "{root}/cni/net.d"
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = "{runc}"
  SystemdCgroup = false
"#,
                root = root.display(),
                sock = self.layout.containerd_sock().display(),
                cdi = self.layout.cdi.display(),
                cni = self.bins.cni_dir.display(),
                runc = self.bins.oci_runtime.display(),
            ),
        )?;
        self.write(
            "cni/net.d/10-carve-e2e.conflist",
            &serde_json::to_string_pretty(&serde_json::json!({
                "cniVersion": "1.0.0",
                "name": "carve-e2e",
                "plugins": [
                    {
                        "type": "bridge",
                        "bridge": BRIDGE,
                        "isGateway": true,
                        "ipMasq": false,
                        "ipam": {
                            "type": "host-local",
                            "dataDir": root.join("cni/ipam"),
                            "ranges": [[{"subnet": POD_CIDR, "gateway": BRIDGE_IP}]],
                            // Only the host and the Service range: no
                            // default route, so a pod reaches nothing else.
                            "routes": [{"dst": SERVICE_CIDR}],
                        },
                    },
                    {"type": "portmap", "capabilities": {"portMappings": true}},
                ],
            }))
            .map_err(ClusterError::json("the CNI configuration"))?,
        )?;
        self.write_kubelet_config()
    }

    /// The kubelet's configuration file, with the feature gates of the
    /// release it runs.
    fn write_kubelet_config(&self) -> Result<(), ClusterError> {
        let pki = &self.pki.dir;
        let root = &self.layout.root;
        let gates: serde_json::Map<String, serde_json::Value> = self
            .gates(Component::Kubelet)
            .into_iter()
            .map(|(k, v)| (k, serde_json::Value::Bool(v)))
            .collect();
        // JSON is YAML: the kubelet reads this as its configuration file.
        let kubelet = serde_json::json!({
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": BRIDGE_IP,
            "healthzBindAddress": "127.0.0.1",
            "authentication": {
                "anonymous": {"enabled": false},
                "webhook": {"enabled": true},
                "x509": {"clientCAFile": self.pki.ca()},
            },
            "authorization": {"mode": "Webhook"},
            "tlsCertFile": pki.join("kubelet-serving.crt"),
            "tlsPrivateKeyFile": pki.join("kubelet-serving.key"),
            "cgroupDriver": "cgroupfs",
            "containerRuntimeEndpoint": format!("unix://{}", self.layout.containerd_sock().display()),
            "podLogsDir": root.join("pod-logs"),
            "failSwapOn": false,
            // This machine is cgroup v1: 1.35+ kubelets refuse it unless told.
            "failCgroupV1": false,
            // The kubelet would act on the host's disk otherwise (as kind).
            "imageGCHighThresholdPercent": 100,
            "evictionHard": {"nodefs.available": "0%", "imagefs.available": "0%", "nodefs.inodesFree": "0%"},
            "serializeImagePulls": false,
            "featureGates": gates,
        });
        self.write(
            "kubelet.yaml",
            &serde_json::to_string_pretty(&kubelet)
                .map_err(ClusterError::json("the kubelet configuration"))?,
        )?;
        Ok(())
    }

    /// The Kubernetes release `c` runs (etcd and containerd: the cluster's).
    #[must_use]
    pub fn release(&self, c: Component) -> &str {
        self.releases
            .get(&c)
            .map_or(self.bins.kube_version.as_str(), String::as_str)
    }

    /// `c`'s feature gates: those its release needs, then the overrides.
    fn gates(&self, c: Component) -> BTreeMap<String, bool> {
        let mut gates: BTreeMap<String, bool> = feature_gates(self.release(c))
            .iter()
            .map(|g| ((*g).to_string(), true))
            .collect();
        if let Some(o) = self.gate_overrides.get(&c) {
            gates.extend(o.iter().map(|(k, v)| (k.clone(), *v)));
        }
        gates
    }

    /// Sets `gate` on (`Some(true)`), off (`Some(false)`) or back to its
    /// release's setting (`None`) for `c`, from its next start.
    pub fn set_feature_gate(&mut self, c: Component, gate: &str, on: Option<bool>) {
        let o = self.gate_overrides.entry(c).or_default();
        match on {
            Some(on) => {
                o.insert(gate.to_string(), on);
            }
            None => {
                o.remove(gate);
            }
        }
    }

    /// Restarts `c` on another Kubernetes release (an upgrade or a
    /// downgrade of that one component), with that release's flags and
    /// feature gates, and waits until it is ready.
    ///
    /// # Errors
    /// The release is not built ([`ClusterError::Prerequisite`]), or `c`
    /// does not start on it.
    pub async fn run_release(&mut self, c: Component, release: &str) -> Result<(), ClusterError> {
        if matches!(c, Component::Etcd | Component::Containerd) {
            return Err(ClusterError::Prerequisite(format!(
                "{} is not a Kubernetes component",
                c.name()
            )));
        }
        let bin = kube_binary(release);
        if !bin.is_file() {
            return Err(ClusterError::Prerequisite(format!(
                "{} (e2e/cluster/build.sh {release})",
                bin.display()
            )));
        }
        self.stop_component(c);
        self.releases.insert(c, release.to_string());
        self.start_component(c).await
    }

    fn command(&self, c: Component) -> Command {
        let pki = &self.pki.dir;
        let p = |f: &str| pki.join(f).display().to_string();
        let gates = self
            .gates(c)
            .into_iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        let kube = kube_binary(self.release(c));
        let mut cmd;
        match c {
            Component::Etcd => {
                cmd = Command::new(&self.bins.etcd);
                cmd.arg(format!("--data-dir={}", self.layout.path("etcd").display()))
                    .args([
                        "--listen-client-urls=http://127.0.0.1:2379",
                        "--advertise-client-urls=http://127.0.0.1:2379",
                        "--listen-peer-urls=http://127.0.0.1:2380",
                        "--initial-advertise-peer-urls=http://127.0.0.1:2380",
                        "--initial-cluster=default=http://127.0.0.1:2380",
                        "--listen-metrics-urls=http://127.0.0.1:2381",
                        "--log-level=warn",
                    ]);
            }
            Component::ApiServer => {
                cmd = Command::new(&kube);
                cmd.arg("kube-apiserver").args([
                    "--etcd-servers=http://127.0.0.1:2379".to_string(),
                    format!("--bind-address={BRIDGE_IP}"),
                    format!("--advertise-address={BRIDGE_IP}"),
                    "--secure-port=6443".into(),
                    format!("--cert-dir={}", self.layout.path("apiserver").display()),
                    format!("--tls-cert-file={}", p("apiserver.crt")),
                    format!("--tls-private-key-file={}", p("apiserver.key")),
                    format!("--client-ca-file={}", p("ca.crt")),
                    format!(
                        "--kubelet-client-certificate={}",
                        p("apiserver-kubelet-client.crt")
                    ),
                    format!("--kubelet-client-key={}", p("apiserver-kubelet-client.key")),
                    // The kubelet by its node address, never by a host name
                    // (no DNS lookup leaves the machine).
                    "--kubelet-preferred-address-types=InternalIP".into(),
                    format!("--service-account-key-file={}", p("sa.pub")),
                    format!("--service-account-signing-key-file={}", p("sa.key")),
                    "--service-account-issuer=https://kubernetes.default.svc".into(),
                    format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                    "--authorization-mode=Node,RBAC".into(),
                    "--enable-admission-plugins=NodeRestriction".into(),
                    // The chart's plugin runs privileged on GPU nodes.
                    "--allow-privileged=true".into(),
                    "--profiling=false".into(),
                    format!(
                        "--audit-policy-file={}",
                        self.layout.path("audit-policy.yaml").display()
                    ),
                    format!("--audit-log-path={}", self.audit_log().display()),
                    "--audit-log-format=json".into(),
                ]);
                // 1.34's scheduler, with DRADeviceTaints on, waits for an
                // informer of v1alpha3 DeviceTaintRules, which the server
                // serves only with the alpha API on: without it no pod is
                // ever scheduled (seen on 1.34.4).
                if minor(self.release(c)) == 34 {
                    cmd.arg("--runtime-config=resource.k8s.io/v1alpha3=true");
                }
            }
            Component::ControllerManager => {
                cmd = Command::new(&kube);
                let kc = p("controller-manager.kubeconfig");
                cmd.arg("kube-controller-manager").args([
                    format!("--kubeconfig={kc}"),
                    format!("--authentication-kubeconfig={kc}"),
                    format!("--authorization-kubeconfig={kc}"),
                    format!("--service-account-private-key-file={}", p("sa.key")),
                    format!("--root-ca-file={}", p("ca.crt")),
                    "--use-service-account-credentials=true".into(),
                    "--leader-elect=false".into(),
                    "--bind-address=127.0.0.1".into(),
                    format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                    "--controllers=*".into(),
                ]);
            }
            Component::Scheduler => {
                cmd = Command::new(&kube);
                let kc = p("scheduler.kubeconfig");
                cmd.arg("kube-scheduler").args([
                    format!("--config={}", self.layout.path("scheduler.yaml").display()),
                    format!("--authentication-kubeconfig={kc}"),
                    format!("--authorization-kubeconfig={kc}"),
                    "--bind-address=127.0.0.1".into(),
                ]);
            }
            Component::Containerd => {
                cmd = Command::new(self.bins.containerd("containerd"));
                cmd.arg(format!(
                    "--config={}",
                    self.layout.path("containerd/config.toml").display()
                ));
            }
            Component::Kubelet => {
                cmd = Command::new(&kube);
                cmd.arg("kubelet").args([
                    format!("--config={}", self.layout.path("kubelet.yaml").display()),
                    format!("--kubeconfig={}", p("kubelet.kubeconfig")),
                    format!("--root-dir={}", self.layout.kubelet_root.display()),
                    format!("--hostname-override={NODE}"),
                    // Not loopback: the kubelet refuses it as a node address,
                    // and the API server reaches the kubelet (logs) there.
                    format!("--node-ip={BRIDGE_IP}"),
                    // What GPU Feature Discovery sets on a GPU node; the
                    // chart's default node selector.
                    "--node-labels=nvidia.com/gpu.present=true".into(),
                    "--v=2".into(),
                ]);
            }
        }
        if !gates.is_empty()
            && !matches!(
                c,
                Component::Etcd | Component::Containerd | Component::Kubelet
            )
        {
            cmd.arg(format!("--feature-gates={gates}"));
        }
        // containerd finds its shim, and the shim runc, on PATH.
        let path = std::env::var_os("PATH").unwrap_or_default();
        let mut dirs = vec![self.bins.containerd_dir.clone()];
        dirs.extend(std::env::split_paths(&path));
        if let Ok(joined) = std::env::join_paths(dirs) {
            cmd.env("PATH", joined);
        }
        cmd
    }

    /// Starts `c` (again) and waits until it is ready.
    ///
    /// # Errors
    /// It exits or is not ready in time.
    pub async fn start_component(&mut self, c: Component) -> Result<(), ClusterError> {
        if let Some(mut old) = self.procs.remove(&c) {
            old.stop(Duration::from_secs(10));
        }
        if c == Component::Kubelet {
            self.write_kubelet_config()?;
        }
        self.starts.push((c, std::time::SystemTime::now()));
        let p = Proc::start(c.name(), self.command(c), &self.log_path(c))?;
        self.procs.insert(c, p);
        self.wait_ready(c, Duration::from_secs(120)).await
    }

    /// When `c` was started, each time, oldest first.
    #[must_use]
    pub fn started(&self, c: Component) -> Vec<std::time::SystemTime> {
        self.starts
            .iter()
            .filter(|(x, _)| *x == c)
            .map(|(_, t)| *t)
            .collect()
    }

    /// Stops `c` (SIGTERM, then SIGKILL after 10 s).
    pub fn stop_component(&mut self, c: Component) {
        if let Some(mut p) = self.procs.remove(&c) {
            p.stop(Duration::from_secs(10));
        }
    }

    fn failed(&self, c: Component, problem: String) -> ClusterError {
        ClusterError::Component {
            component: c.name().into(),
            problem,
            log_path: self.log_path(c),
            log: self.log(c, 40),
        }
    }

    async fn wait_ready(&mut self, c: Component, within: Duration) -> Result<(), ClusterError> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.procs.get_mut(&c).and_then(Proc::exited) {
                return Err(self.failed(c, format!("exited with {status}")));
            }
            if self.ready(c).await {
                return Ok(());
            }
            if start.elapsed() > within {
                return Err(self.failed(c, format!("not ready after {within:?}")));
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    async fn ready(&self, c: Component) -> bool {
        match c {
            Component::Etcd => tcp_open("127.0.0.1:2379"),
            Component::ApiServer => match self.client().await {
                Ok(client) => {
                    let req = http::Request::get("/readyz").body(Vec::new());
                    match req {
                        Ok(r) => client.request_text(r).await.is_ok_and(|t| t.trim() == "ok"),
                        Err(_) => false,
                    }
                }
                Err(_) => false,
            },
            Component::ControllerManager => tcp_open("127.0.0.1:10257"),
            Component::Scheduler => tcp_open("127.0.0.1:10259"),
            Component::Containerd => {
                self.layout.containerd_sock().exists() && self.ctr(&["version"]).is_ok()
            }
            Component::Kubelet => tcp_open("127.0.0.1:10248"),
        }
    }

    /// Runs `ctr` against the node's containerd, namespace `k8s.io`.
    ///
    /// # Errors
    /// It fails.
    pub fn ctr(&self, args: &[&str]) -> Result<String, ClusterError> {
        let mut cmd = Command::new(self.bins.containerd("ctr"));
        cmd.arg(format!(
            "--address={}",
            self.layout.containerd_sock().display()
        ))
        .args(["--namespace", "k8s.io"])
        .args(args);
        run(&format!("ctr {}", args.join(" ")), cmd)
    }

    /// Runs the built helm with the admin's kubeconfig.
    ///
    /// # Errors
    /// helm fails, with its output.
    pub fn helm(&self, args: &[&str]) -> Result<String, ClusterError> {
        let mut cmd = Command::new(&self.bins.helm);
        cmd.arg(format!("--kubeconfig={}", self.admin_kubeconfig.display()))
            .args(args)
            .env("HELM_CACHE_HOME", self.layout.path("helm/cache"))
            .env("HELM_CONFIG_HOME", self.layout.path("helm/config"))
            .env("HELM_DATA_HOME", self.layout.path("helm/data"));
        run(&format!("helm {}", args.join(" ")), cmd)
    }

    /// The API server calls the kubelet (logs, exec) as
    /// `kube-apiserver-kubelet-client`; the kubelet asks the API server
    /// whether that user may (webhook authorization). Grant it the kubelet
    /// API, as `hack/local-up-cluster.sh` does.
    async fn bind_kubelet_api_access(&self) -> Result<(), ClusterError> {
        use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
        let client = self.client().await?;
        let api: kube::Api<ClusterRoleBinding> = kube::Api::all(client);
        let crb: ClusterRoleBinding = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "carve-e2e-apiserver-kubelet"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:kubelet-api-admin"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "kube-apiserver-kubelet-client"}],
        }))
        .map_err(ClusterError::json("a ClusterRoleBinding"))?;
        api.create(&Default::default(), &crb)
            .await
            .map_err(ClusterError::kube("binding system:kubelet-api-admin"))?;
        Ok(())
    }

    /// Builds the pause, probe and carve images and imports them.
    fn import_images(&self, carve: &Path, sim_lib: &Path) -> Result<(), ClusterError> {
        use image::{Entry, Image};
        let dir = self.layout.path("images");
        std::fs::create_dir_all(&dir).map_err(ClusterError::io("creating", &dir))?;
        let pause_bin = dir.join("pause");
        let src = crate::workspace_root().join("e2e/cluster/images/pause.c");
        let mut gcc = Command::new("gcc");
        gcc.args(["-static", "-O2", "-o"]).arg(&pause_bin).arg(&src);
        run("gcc -static pause.c", gcc)?;
        let busybox_links = [
            "sh", "ls", "cat", "env", "sleep", "test", "grep", "stat", "head", "echo", "mount",
            "readlink",
        ];
        let mut probe = vec![Entry::File {
            at: "/bin/busybox".into(),
            from: self.bins.busybox.clone(),
            mode: 0o755,
        }];
        probe.extend(busybox_links.iter().map(|l| Entry::Symlink {
            at: format!("/bin/{l}"),
            target: "busybox".into(),
        }));
        probe.push(Entry::Dir {
            at: "/tmp".into(),
            mode: 0o1777,
        });
        let mut carve_entries = vec![
            Entry::File {
                at: "/usr/local/bin/carve".into(),
                from: carve.to_path_buf(),
                mode: 0o755,
            },
            Entry::File {
                at: "/opt/carve/libnvidia_ml_sim.so".into(),
                from: sim_lib.to_path_buf(),
                mode: 0o755,
            },
            Entry::Bytes {
                at: "/etc/passwd".into(),
                bytes: b"root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n".to_vec(),
                mode: 0o644,
            },
            Entry::Bytes {
                at: "/etc/group".into(),
                bytes: b"root:x:0:\nnonroot:x:65532:\n".to_vec(),
                mode: 0o644,
            },
            Entry::Dir {
                at: "/tmp".into(),
                mode: 0o1777,
            },
        ];
        carve_entries.extend(image::runtime_of(&[carve, sim_lib])?);
        let images = [
            Image {
                name: PAUSE_IMAGE.into(),
                entries: vec![Entry::File {
                    at: "/pause".into(),
                    from: pause_bin,
                    mode: 0o755,
                }],
                entrypoint: vec!["/pause".into()],
                env: vec![],
            },
            Image {
                name: PROBE_IMAGE.into(),
                entries: probe,
                entrypoint: vec!["/bin/sh".into()],
                env: vec!["PATH=/bin".into()],
            },
            Image {
                name: format!("{CARVE_REPOSITORY}:{CARVE_TAG}"),
                entries: carve_entries,
                entrypoint: vec!["/usr/local/bin/carve".into()],
                env: vec![
                    "PATH=/usr/local/bin:/usr/bin:/bin".into(),
                    "MALLOC_ARENA_MAX=1".into(),
                ],
            },
        ];
        for img in &images {
            let file = dir.join(format!(
                "{}.tar",
                img.name
                    .rsplit('/')
                    .next()
                    .unwrap_or("image")
                    .replace(':', "-")
            ));
            img.write(&file)?;
            self.ctr(&["images", "import", &file.display().to_string()])?;
        }
        Ok(())
    }

    /// Waits until the node reports `Ready`.
    ///
    /// # Errors
    /// Not in time; the kubelet's log is in the error.
    pub async fn wait_node_ready(&self, within: Duration) -> Result<(), ClusterError> {
        use k8s_openapi::api::core::v1::Node;
        let client = self.client().await?;
        let nodes: kube::Api<Node> = kube::Api::all(client);
        let start = Instant::now();
        loop {
            if let Ok(Some(n)) = nodes.get_opt(NODE).await
                && n.status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
            {
                return Ok(());
            }
            if start.elapsed() > within {
                return Err(self.failed(
                    Component::Kubelet,
                    format!("node {NODE} not Ready after {within:?}"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Kills every container process of the node's pods (their shims and
    /// whatever the pods' cgroups hold).
    fn kill_containers(&self) {
        let shim = self.bins.containerd("containerd-shim-runc-v2");
        for pid in pids_of(&shim) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        kill_node_cgroups();
    }

    /// Unmounts everything under the root, deepest first.
    fn unmount_all(&self) {
        let root = self.layout.root.display().to_string();
        unmount_where(|m| m == root || m.starts_with(&format!("{root}/")));
    }
}

/// Unmounts (lazily) every mount point `pick` chooses, deepest first.
fn unmount_where(pick: impl Fn(&str) -> bool) {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut points: Vec<&str> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| pick(m))
        .collect();
    points.sort_by_key(|m| std::cmp::Reverse(m.len()));
    for m in points {
        let _ = nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in [
            Component::Kubelet,
            Component::Scheduler,
            Component::ControllerManager,
            Component::ApiServer,
            Component::Etcd,
            Component::Containerd,
        ] {
            if let Some(mut p) = self.procs.remove(&c) {
                p.stop(Duration::from_secs(5));
            }
        }
        self.kill_containers();
        if self.mounted {
            self.unmount_all();
        }
        for undo in self.net.drain(..).rev() {
            let _ = Command::new(&undo[0]).args(&undo[1..]).output();
        }
        if std::env::var_os("CARVE_E2E_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.layout.root);
        }
    }
}

/// What a run that died without its drop (killed, or the machine's
/// session ended) left behind: its processes (by their executables in the
/// cache), its mounts under `/tmp/carve-cl-*`, the bridge and the DNAT rules.
fn sweep_stale(bins: &Binaries) {
    let shim = bins.containerd("containerd-shim-runc-v2");
    // Every release's kube binary (an upgrade run runs several).
    let kubes: Vec<PathBuf> = std::fs::read_dir(cache_dir())
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("kube-v"))
        .map(|e| e.path().join("kube"))
        .collect();
    for exe in kubes
        .iter()
        .chain([&bins.etcd, &bins.containerd("containerd"), &shim])
    {
        for pid in pids_of(exe) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
    kill_node_cgroups();
    unmount_where(|m| m.starts_with("/tmp/carve-cl-"));
    let _ = Command::new("ip").args(["link", "del", BRIDGE]).output();
    if let Ok(out) = Command::new("iptables")
        .args(["-w", "-t", "nat", "-S"])
        .output()
    {
        for rule in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some(r) = rule.strip_prefix("-A ").filter(|r| r.contains("carve-e2e")) {
                let mut del = vec!["-w", "-t", "nat", "-D"];
                // The comment is one word, so splitting on spaces is exact.
                del.extend(r.split_whitespace().map(|w| w.trim_matches('"')));
                let _ = Command::new("iptables").args(&del).output();
            }
        }
    }
}

fn words(s: &str) -> Vec<String> {
    s.split_whitespace().map(String::from).collect()
}

fn tcp_open(addr: &str) -> bool {
    addr.parse()
        .is_ok_and(|a| std::net::TcpStream::connect_timeout(&a, Duration::from_millis(200)).is_ok())
}

/// Processes whose executable is `exe`.
fn pids_of(exe: &Path) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| p == exe))
        .collect()
}

/// Kills what the node's cgroups hold and removes them, in every hierarchy
/// (cgroup v1) or the one tree (v2): the pods' (`kubepods`) and the MPS
/// daemons' ([`MPS_DAEMON_CGROUP`], outside the pods' by design).
fn kill_node_cgroups() {
    let base = Path::new("/sys/fs/cgroup");
    let mut roots = vec![base.to_path_buf()];
    if let Ok(rd) = std::fs::read_dir(base) {
        roots.extend(rd.filter_map(Result::ok).map(|e| e.path()));
    }
    for r in roots {
        for name in ["kubepods", MPS_DAEMON_CGROUP] {
            let d = r.join(name);
            if d.is_dir() {
                kill_cgroup_tree(&d);
            }
        }
    }
}

/// SIGKILL to every process in the cgroup tree at `root`, then removes the
/// tree's directories, deepest first.
fn kill_cgroup_tree(root: &Path) {
    let mut dirs = vec![root.to_path_buf()];
    let mut i = 0;
    while i < dirs.len() {
        if let Ok(rd) = std::fs::read_dir(&dirs[i]) {
            for e in rd.filter_map(Result::ok) {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    dirs.push(e.path());
                }
            }
        }
        i += 1;
    }
    for d in &dirs {
        for pid in std::fs::read_to_string(d.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse::<i32>().ok())
        {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
    std::thread::sleep(Duration::from_millis(200));
    for d in dirs.iter().rev() {
        let _ = std::fs::remove_dir(d);
    }
}
