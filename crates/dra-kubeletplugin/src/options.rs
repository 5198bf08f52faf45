//! What the kit needs to know to serve a driver, and the socket paths that
//! follow from it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::Error;

/// Where the kubelet looks for plugin data directories: the default parent of
/// [`PluginOptions::plugin_data_dir`] (Go `kubeletplugin.KubeletPluginsDir`).
pub const KUBELET_PLUGINS_DIR: &str = "/var/lib/kubelet/plugins";
/// Where the kubelet's plugin watcher looks for registration sockets: the
/// default [`PluginOptions::registrar_dir`] (Go `kubeletplugin.KubeletRegistryDir`).
pub const KUBELET_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";

/// Longest path `sockaddr_un` takes (108 bytes including the NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// How the plugin presents itself to the kubelet. The counterpart of Go's
/// `kubeletplugin.Start` options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginOptions {
    /// The DRA driver name (`GetInfo.name`, and the prefix of the
    /// registration socket).
    pub driver_name: String,
    /// The directory the kubelet's plugin watcher watches, as the same path
    /// inside and outside the plugin's container. Default
    /// [`KUBELET_REGISTRY_DIR`].
    pub registrar_dir: PathBuf,
    /// The directory of `dra.sock` (and of `serialize.lock` under rolling
    /// updates), reserved for this driver. The kubelet dials the socket at the
    /// path given in `GetInfo.endpoint`, so this must be the same path inside
    /// and outside the container. Default `KUBELET_PLUGINS_DIR/<driver>`.
    pub plugin_data_dir: PathBuf,
    /// The plugin pod's UID: enables rolling updates (two plugin pods of one
    /// driver serving at once during a DaemonSet update with `maxSurge` > 0,
    /// which the kubelet supports from Kubernetes 1.33). Both pods' sockets
    /// then carry their UID: `<driver>-<uid>-reg.sock` and `dra-<uid>.sock`
    /// (Go `kubeletplugin.RollingUpdate`). Each pod must stop cleanly on
    /// SIGTERM: it cannot remove the other's sockets.
    pub rolling_update_uid: Option<String>,
    /// Run prepare and unprepare calls one at a time (Go's default): an
    /// in-process lock, and with [`rolling_update_uid`](Self::rolling_update_uid)
    /// also an exclusive `flock` on `<plugin_data_dir>/serialize.lock`, so that
    /// the two pods of a rolling update take turns. A driver that handles
    /// concurrency itself turns this off. Default `true`.
    pub serialize: bool,
    /// Serve and advertise `v1beta1.DRAPlugin` besides `v1.DRAPlugin`
    /// (kubelets before 1.34 know only v1beta1). Default `true`.
    pub v1beta1: bool,
    /// Resend the complete health list at least this often even without a
    /// change (the kubelet marks devices not updated within its health
    /// timeout Unknown). `None`: send on changes only. Default 10 s.
    pub health_resend: Option<Duration>,
}

impl PluginOptions {
    /// Defaults for a driver: the kubelet's standard directories, no rolling
    /// update, serialized calls, both DRA versions, health resent every 10 s.
    #[must_use]
    pub fn new(driver_name: impl Into<String>) -> Self {
        let driver_name = driver_name.into();
        Self {
            registrar_dir: KUBELET_REGISTRY_DIR.into(),
            plugin_data_dir: Path::new(KUBELET_PLUGINS_DIR).join(&driver_name),
            driver_name,
            rolling_update_uid: None,
            serialize: true,
            v1beta1: true,
            health_resend: Some(Duration::from_secs(10)),
        }
    }

    /// Check what would make the sockets unusable.
    ///
    /// # Errors
    /// [`Error::InvalidOptions`]: an empty driver name or UID, or one that
    /// is not a single file-name component.
    pub fn validate(&self) -> Result<(), Error> {
        file_component("driver_name", &self.driver_name)?;
        if let Some(uid) = &self.rolling_update_uid {
            file_component("rolling_update_uid", uid)?;
        }
        Ok(())
    }

    /// The sockets these options give; see [`SocketPaths::new`].
    ///
    /// # Errors
    /// As [`SocketPaths::new`].
    pub fn socket_paths(&self) -> Result<SocketPaths, Error> {
        SocketPaths::new(self)
    }
}

impl From<&PluginOptions> for PluginOptions {
    fn from(o: &PluginOptions) -> Self {
        o.clone()
    }
}

fn file_component(field: &'static str, v: &str) -> Result<(), Error> {
    let problem = if v.is_empty() {
        "is empty".to_string()
    } else if v.contains(['/', '\0']) {
        format!("{v:?} contains '/' or NUL; it becomes part of a socket file name")
    } else {
        return Ok(());
    };
    Err(Error::InvalidOptions { field, problem })
}

/// Where the plugin's two sockets live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SocketPaths {
    /// Registration socket (in the plugins registry dir).
    pub registration: PathBuf,
    /// DRA service socket (`PluginInfo.endpoint`).
    pub dra: PathBuf,
}

fn short_hash(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn fit(dir: &Path, full: String, hashed: impl FnOnce() -> String) -> Result<PathBuf, Error> {
    let p = dir.join(full);
    if p.as_os_str().len() <= MAX_SOCKET_PATH {
        return Ok(p);
    }
    let h = dir.join(hashed());
    if h.as_os_str().len() <= MAX_SOCKET_PATH {
        return Ok(h);
    }
    Err(Error::SocketPathTooLong {
        len: h.as_os_str().len(),
        path: h,
    })
}

impl SocketPaths {
    /// Socket paths for a configuration: `<driver>-reg.sock` and `dra.sock`,
    /// or with a rolling-update UID `<driver>-<uid>-reg.sock` and
    /// `dra-<uid>.sock` (Go's names). Where a path would not fit
    /// `sockaddr_un`, the UID (then the driver name and UID) is replaced by a
    /// hash of it.
    ///
    /// # Errors
    /// [`Error::InvalidOptions`] (see [`PluginOptions::validate`]), or
    /// [`Error::SocketPathTooLong`] for a path that does not fit even hashed.
    pub fn new(options: impl Into<PluginOptions>) -> Result<Self, Error> {
        let o = options.into();
        o.validate()?;
        let d = &o.driver_name;
        match &o.rolling_update_uid {
            None => Ok(Self {
                registration: fit(&o.registrar_dir, format!("{d}-reg.sock"), || {
                    format!("{}-reg.sock", short_hash(d))
                })?,
                dra: fit(&o.plugin_data_dir, "dra.sock".into(), || "dra.sock".into())?,
            }),
            Some(uid) => Ok(Self {
                registration: fit(&o.registrar_dir, format!("{d}-{uid}-reg.sock"), || {
                    format!("{d}-{}-reg.sock", short_hash(uid))
                })
                .or_else(|_| {
                    let h = short_hash(&format!("{d}-{uid}"));
                    fit(&o.registrar_dir, format!("{h}-reg.sock"), || {
                        format!("{h}-reg.sock")
                    })
                })?,
                dra: fit(&o.plugin_data_dir, format!("dra-{uid}.sock"), || {
                    format!("dra-{}.sock", short_hash(uid))
                })?,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> PluginOptions {
        let mut o = PluginOptions::new("gpu.carve.dev");
        o.registrar_dir = "/r".into();
        o.plugin_data_dir = "/p/gpu.carve.dev".into();
        o
    }

    #[test]
    fn defaults_are_the_kubelets_directories() {
        let o = PluginOptions::new("dra.example.com");
        assert_eq!(
            o.socket_paths().unwrap(),
            SocketPaths {
                registration: "/var/lib/kubelet/plugins_registry/dra.example.com-reg.sock".into(),
                dra: "/var/lib/kubelet/plugins/dra.example.com/dra.sock".into(),
            }
        );
        assert!(o.serialize && o.v1beta1);
    }

    #[test]
    fn socket_names() {
        let mut c = opts();
        let p = SocketPaths::new(&c).unwrap();
        assert_eq!(p.registration, Path::new("/r/gpu.carve.dev-reg.sock"));
        assert_eq!(p.dra, Path::new("/p/gpu.carve.dev/dra.sock"));
        c.rolling_update_uid = Some("6a1c".into());
        let p = SocketPaths::new(&c).unwrap();
        assert_eq!(p.registration, Path::new("/r/gpu.carve.dev-6a1c-reg.sock"));
        assert_eq!(p.dra, Path::new("/p/gpu.carve.dev/dra-6a1c.sock"));
    }

    #[test]
    fn long_paths_fall_back_to_a_hash() {
        let mut c = opts();
        c.registrar_dir = PathBuf::from("/").join("r".repeat(40));
        c.plugin_data_dir = PathBuf::from("/").join("p".repeat(40));
        c.rolling_update_uid = Some("0123456789abcdef-0123-4567-89ab-cdef01234567".repeat(2));
        let p = SocketPaths::new(&c).unwrap();
        for s in [&p.registration, &p.dra] {
            assert!(s.as_os_str().len() <= MAX_SOCKET_PATH, "{}", s.display());
        }
        assert!(p.registration.to_string_lossy().ends_with("-reg.sock"));
        c.plugin_data_dir = PathBuf::from("/").join("p".repeat(120));
        assert!(matches!(
            SocketPaths::new(&c),
            Err(Error::SocketPathTooLong { .. })
        ));
    }

    #[test]
    fn names_that_are_not_one_file_name_are_refused() {
        for (driver, uid, field) in [
            ("", None, "driver_name"),
            ("a/b", None, "driver_name"),
            ("d", Some(""), "rolling_update_uid"),
            ("d", Some("../x"), "rolling_update_uid"),
        ] {
            let mut o = PluginOptions::new(driver);
            o.rolling_update_uid = uid.map(String::from);
            let e = SocketPaths::new(&o).unwrap_err();
            assert!(
                matches!(&e, Error::InvalidOptions { field: f, .. } if *f == field),
                "{e}"
            );
            assert!(e.to_string().contains(field), "{e}");
        }
    }
}
