//! The container edits of one MPS share, as plain data for the plugin's CDI
//! spec writer: one CDI device per claim share, named after the share.
//!
//! v3: the share's container gets only its namespace's pipe directory (from
//! `namespace get <ns> carve pipe-directory`), mounted at the same path and
//! named by `CUDA_MPS_PIPE_DIRECTORY`, so the client's `control` socket is the
//! namespace's and the limits are the namespace's [NS], [DYN]. Mounting the
//! daemon's whole pipe directory would route the pod through the main socket
//! to an unlimited `uid_<uid>` server and show it every other share's socket.
//! No limit variables: the namespace's percentage overrides the client's
//! [ENV], and a pinned-limit variable naming a device the process cannot see
//! drops every pinned limit, the namespace's included [DYN].
//!
//! v2 has no namespaces: the daemon's pipe directory at [`CONTAINER_PIPE_DIR`],
//! and the per-share limits as client variables (which the workload can
//! change: `client` enforcement).
//!
//! Both: where the unit's daemon was started with a tmpfs of its own as
//! `/dev/shm` ([`crate::shm`]), that tmpfs bind-mounted at `/dev/shm`, with
//! the options NVIDIA's DRA driver gives it (`rw,nosuid,nodev,bind`,
//! `GetCDIContainerEdits` in `cmd/gpu-kubelet-plugin/sharing.go`): the MPS
//! server and its clients meet there as well as in the pipe directory.

use std::path::{Path, PathBuf};

use carve_model::sharing::MpsLimits;
use serde::{Deserialize, Serialize};

/// Where a v2 unit's pipe directory appears in the container.
pub const CONTAINER_PIPE_DIR: &str = "/tmp/nvidia-mps";

/// A bind mount.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    /// Host path.
    pub host_path: PathBuf,
    /// Path in the container.
    pub container_path: String,
    /// Mount options.
    pub options: Vec<String>,
}

/// What the container of one claim share gets.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShareEdits {
    /// CDI device name, distinct per claim and share: `mps-<claim>-<share>`.
    pub cdi_name: String,
    /// `NAME=VALUE` environment entries.
    pub env: Vec<String>,
    /// Mounts.
    pub mounts: Vec<Mount>,
}

/// Which pipe directory a share's clients use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SharePipe {
    /// v3: the share's namespace directory (`namespace get … pipe-directory`).
    Namespace(PathBuf),
    /// v2: the daemon's pipe directory.
    Daemon(PathBuf),
}

/// The CDI device name of a share.
#[must_use]
pub fn share_cdi_name(claim_uid: &str, share_id: &str) -> String {
    format!("mps-{claim_uid}-{share_id}")
}

const OPTIONS: [&str; 4] = ["rbind", "rw", "nosuid", "nodev"];
/// NVIDIA DRA driver's options of the `/dev/shm` bind mount (`sharing.go`).
const SHM_OPTIONS: [&str; 4] = ["rw", "nosuid", "nodev", "bind"];

/// Container edits for a share (see the module docs); `shm`: the unit's
/// tmpfs, where its daemon has it as `/dev/shm`.
#[must_use]
pub fn share_edits(
    pipe: &SharePipe,
    shm: Option<&Path>,
    uuid: &str,
    limits: &MpsLimits,
    claim_uid: &str,
    share_id: &str,
) -> ShareEdits {
    let (host, container, env) = match pipe {
        SharePipe::Namespace(d) => {
            let p = d.display().to_string();
            (
                d.as_path(),
                p.clone(),
                vec![format!("CUDA_MPS_PIPE_DIRECTORY={p}")],
            )
        }
        SharePipe::Daemon(d) => (
            d.as_path(),
            CONTAINER_PIPE_DIR.to_string(),
            vec![
                format!("CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}"),
                format!(
                    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={uuid}={}M",
                    limits.memory_limit_mib
                ),
                format!(
                    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={}",
                    limits.active_thread_percentage
                ),
            ],
        ),
    };
    let mut mounts = vec![mount(host, container)];
    if let Some(shm) = shm {
        mounts.push(Mount {
            host_path: shm.to_path_buf(),
            container_path: crate::shm::DEV_SHM.to_string(),
            options: SHM_OPTIONS.iter().map(|s| (*s).to_string()).collect(),
        });
    }
    ShareEdits {
        cdi_name: share_cdi_name(claim_uid, share_id),
        env,
        mounts,
    }
}

fn mount(host: &Path, container: String) -> Mount {
    Mount {
        host_path: host.to_path_buf(),
        container_path: container,
        options: OPTIONS.iter().map(|s| (*s).to_string()).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: MpsLimits = MpsLimits {
        memory_limit_mib: 4096,
        multiprocessors: 16,
        active_thread_percentage: 13,
    };

    #[test]
    fn v2_sets_the_limit_variables_on_the_daemon_directory() {
        let e = share_edits(
            &SharePipe::Daemon("/s/pipe".into()),
            None,
            "GPU-1",
            &L,
            "c1",
            "s1",
        );
        assert_eq!(
            e.env,
            [
                "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=GPU-1=4096M",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=13"
            ]
        );
        assert_eq!(e.mounts[0].host_path, Path::new("/s/pipe"));
        assert_eq!(e.cdi_name, "mps-c1-s1");
    }

    #[test]
    fn v3_mounts_only_the_namespace_directory_at_its_own_path() {
        let ns = PathBuf::from("/s/pipe/carve/c_0123456789abcdef");
        let a = share_edits(
            &SharePipe::Namespace(ns.clone()),
            None,
            "GPU-1",
            &L,
            "c1",
            "s1",
        );
        let b = share_edits(
            &SharePipe::Namespace(ns.clone()),
            None,
            "GPU-1",
            &L,
            "c1",
            "s2",
        );
        assert_eq!(
            a.env,
            ["CUDA_MPS_PIPE_DIRECTORY=/s/pipe/carve/c_0123456789abcdef"]
        );
        assert_eq!(a.mounts.len(), 1);
        assert_eq!(a.mounts[0].host_path, ns);
        assert_eq!(a.mounts[0].container_path, ns.display().to_string());
        assert_ne!(a.cdi_name, b.cdi_name);
    }

    #[test]
    fn the_units_tmpfs_becomes_dev_shm_where_the_daemon_has_it() {
        let ns = SharePipe::Namespace("/s/pipe/carve/c_0123456789abcdef".into());
        let e = share_edits(&ns, Some(Path::new("/s/shm")), "GPU-1", &L, "c1", "s1");
        assert_eq!(e.mounts.len(), 2);
        assert_eq!(e.mounts[1].host_path, Path::new("/s/shm"));
        assert_eq!(e.mounts[1].container_path, "/dev/shm");
        assert_eq!(e.mounts[1].options, ["rw", "nosuid", "nodev", "bind"]);
        let v2 = share_edits(
            &SharePipe::Daemon("/s/pipe".into()),
            Some(Path::new("/s/shm")),
            "GPU-1",
            &L,
            "c1",
            "s1",
        );
        assert_eq!(v2.mounts[1].container_path, "/dev/shm");
    }
}
