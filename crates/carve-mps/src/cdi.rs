//! The container edits of one MPS share, as plain data for the plugin's CDI
//! spec writer: one CDI device per claim share, named after the share.

use std::path::{Path, PathBuf};

use carve_model::sharing::{ComputeLimit, MemoryLimit, MpsCapabilities, MpsLimits};
use serde::{Deserialize, Serialize};

/// Where the unit's pipe directory appears in the container.
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

/// The CDI device name of a share.
#[must_use]
pub fn share_cdi_name(claim_uid: &str, share_id: &str) -> String {
    format!("mps-{claim_uid}-{share_id}")
}

/// Container edits for a share: the pipe directory bind-mounted at
/// [`CONTAINER_PIPE_DIR`] and named by `CUDA_MPS_PIPE_DIRECTORY`; the limit
/// variables only where they are the enforcement (`client` level), since a
/// server-side limit must not look like something the workload may tune.
#[must_use]
pub fn share_edits(
    pipe_dir: &Path,
    uuid: &str,
    caps: MpsCapabilities,
    limits: &MpsLimits,
    claim_uid: &str,
    share_id: &str,
) -> ShareEdits {
    let mut env = vec![format!("CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}")];
    if caps.memory_limit == MemoryLimit::Client {
        env.push(format!(
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={uuid}={}M",
            limits.memory_limit_mib
        ));
    }
    if caps.compute_limit == ComputeLimit::Client {
        env.push(format!(
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={}",
            limits.active_thread_percentage
        ));
    }
    ShareEdits {
        cdi_name: share_cdi_name(claim_uid, share_id),
        env,
        mounts: vec![Mount {
            host_path: pipe_dir.to_path_buf(),
            container_path: CONTAINER_PIPE_DIR.to_string(),
            options: vec!["rbind".into(), "rw".into(), "nosuid".into(), "nodev".into()],
        }],
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
    fn client_level_sets_the_limit_variables() {
        let caps = MpsCapabilities {
            memory_limit: MemoryLimit::Client,
            compute_limit: ComputeLimit::Client,
        };
        let e = share_edits(Path::new("/s/pipe"), "GPU-1", caps, &L, "c1", "s1");
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
    fn hard_limits_set_no_variables_and_names_differ_per_share() {
        let caps = MpsCapabilities {
            memory_limit: MemoryLimit::Hard,
            compute_limit: ComputeLimit::Percentage,
        };
        let a = share_edits(Path::new("/p"), "GPU-1", caps, &L, "c1", "s1");
        let b = share_edits(Path::new("/p"), "GPU-1", caps, &L, "c1", "s2");
        assert_eq!(a.env, ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]);
        assert_ne!(a.cdi_name, b.cdi_name);
    }
}
