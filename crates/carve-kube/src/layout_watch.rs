//! Follows the API server's Kubernetes version, so the node publishes the
//! slice layout the server (and a scheduler of the same version) expects.
//!
//! The layout depends on the minor version (1.34: counter sets in the device
//! slices; 1.35+: counter sets in slices of their own, and a 1.35.6+ or 1.36
//! scheduler allocates nothing from a pool in the 1.34 layout). A control
//! plane upgraded under a running plugin must therefore be noticed:
//! [`VersionWatch::refresh`] re-reads `/version` (the caller does so every
//! resync and after a failed publish) and reports a change.
//!
//! Switching layouts needs nothing special from the publisher: the new
//! layout is a changed pool, so [`crate::SlicePublisher::sync`] writes every
//! slice of it at generation `g + 1` and deletes the old layout's leftovers
//! last. Consumers use only a pool's highest generation and treat it as
//! incomplete until they see `resourceSliceCount` slices of it, so no
//! consumer ever sees both layouts of one pool as one pool.
//!
//! What cannot be detected: the scheduler's version. A node agent sees only
//! the API server; Kubernetes allows kube-scheduler one minor version behind
//! kube-apiserver during an upgrade, and a 1.34 scheduler beside a 1.35+
//! API server ignores counters in the 1.35 layout (it can overcommit a GPU;
//! carve's prepare refuses the overlap). [`skew_warning`] says so when the
//! server crosses 1.34 → 1.35.

use carve_model::slices::{KubeLayout, KubeVersion};
use kube::Client;

use crate::error::PublishError;
use crate::version::server_version;

/// A change of the API server's version seen by [`VersionWatch::refresh`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VersionChange {
    /// The version before.
    pub from: KubeVersion,
    /// The version now.
    pub to: KubeVersion,
}

impl VersionChange {
    /// Whether the slice layout differs between the two versions (a version
    /// before 1.34 has no layout: that counts as a change).
    #[must_use]
    pub fn layout_changed(&self) -> bool {
        self.from.layout().ok() != self.to.layout().ok()
    }
}

/// The API server's version as last read.
#[derive(Clone)]
pub struct VersionWatch {
    client: Client,
    version: KubeVersion,
}

impl std::fmt::Debug for VersionWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VersionWatch")
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

impl VersionWatch {
    /// Reads the version once.
    ///
    /// # Errors
    /// [`PublishError::Version`] or [`PublishError::BadVersion`].
    pub async fn new(client: Client) -> Result<Self, PublishError> {
        let (major, minor) = server_version(&client).await?;
        Ok(Self {
            client,
            version: KubeVersion::new(major, minor),
        })
    }

    /// Reads the version once; where the API server does not answer (a
    /// plugin restarted while the control plane is down), starts from the
    /// version an earlier start recorded in `record` instead, so that the
    /// plugin can register with the kubelet and serve the claims it has
    /// prepared; [`VersionWatch::refresh`] then reads the real one when the
    /// server answers. A version read is recorded there.
    ///
    /// Returns the watch and, when it started from the record, why the
    /// server's version could not be read.
    ///
    /// # Errors
    /// The server did not answer and nothing was recorded (or the record is
    /// unreadable), or it answered with a version that cannot be read: the
    /// read's error.
    pub async fn new_or_recorded(
        client: Client,
        record: &std::path::Path,
    ) -> Result<(Self, Option<PublishError>), PublishError> {
        match Self::new(client.clone()).await {
            Ok(w) => {
                if let Err(e) = write_record(record, w.version) {
                    tracing::warn!(path = %record.display(), error = %e, "could not record the API server version");
                }
                Ok((w, None))
            }
            // Only a server that did not answer: one that answered with a
            // version carve cannot read is not worked around.
            Err(e @ (PublishError::Version { .. } | PublishError::VersionTimeout { .. })) => {
                match read_record(record) {
                    Some(version) => Ok((Self { client, version }, Some(e))),
                    None => Err(e),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// The version as last read.
    #[must_use]
    pub fn version(&self) -> KubeVersion {
        self.version
    }

    /// Reads `/version` again; `Some` when the `major.minor` changed (the
    /// new one is kept).
    ///
    /// # Errors
    /// [`PublishError::Version`] or [`PublishError::BadVersion`]; the
    /// version as last read is kept.
    pub async fn refresh(&mut self) -> Result<Option<VersionChange>, PublishError> {
        let (major, minor) = server_version(&self.client).await?;
        let now = KubeVersion::new(major, minor);
        if now == self.version {
            return Ok(None);
        }
        let change = VersionChange {
            from: self.version,
            to: now,
        };
        self.version = now;
        Ok(Some(change))
    }
}

/// `major.minor` on one line, replaced atomically (temp file and rename).
fn write_record(path: &std::path::Path, v: KubeVersion) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, format!("{v}\n"))?;
    std::fs::rename(&tmp, path)
}

/// The recorded version, if the file holds one.
fn read_record(path: &std::path::Path) -> Option<KubeVersion> {
    let text = std::fs::read_to_string(path).ok()?;
    let (major, minor) = text.trim().split_once('.')?;
    Some(KubeVersion::new(major.parse().ok()?, minor.parse().ok()?))
}

/// What to tell the operator when the API server's version changes in a way
/// a lagging scheduler cannot follow, if anything: from the 1.34 layout to
/// the 1.35+ one, a kube-scheduler still at 1.34 ignores the counters of the
/// new layout and may place more partitions on a GPU than fit.
#[must_use]
pub fn skew_warning(change: VersionChange) -> Option<String> {
    let (Ok(from), Ok(to)) = (change.from.layout(), change.to.layout()) else {
        return None;
    };
    (from == KubeLayout::V134 && to == KubeLayout::V135Plus).then(|| {
        format!(
            "the API server moved from Kubernetes {} to {}: carve now publishes the 1.35 slice layout (counter sets in their own slice). A kube-scheduler still at 1.34 ignores those counters and can place overlapping MIG partitions (carve's prepare refuses them, the pods fail); upgrade kube-scheduler together with kube-apiserver, or drain GPU workloads until both are at {}",
            change.from, change.to, change.to
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ch(a: u32, b: u32) -> VersionChange {
        VersionChange {
            from: KubeVersion::new(1, a),
            to: KubeVersion::new(1, b),
        }
    }

    #[test]
    fn layout_changes_only_across_1_34_and_1_35() {
        assert!(ch(34, 35).layout_changed());
        assert!(ch(35, 34).layout_changed());
        assert!(!ch(35, 36).layout_changed());
        assert!(ch(33, 34).layout_changed());
    }

    #[test]
    fn skew_is_warned_about_on_the_way_up_from_1_34() {
        let w = skew_warning(ch(34, 35)).unwrap();
        for part in ["1.34", "1.35", "kube-scheduler", "counter"] {
            assert!(w.contains(part), "{w:?} lacks {part:?}");
        }
        assert_eq!(skew_warning(ch(35, 36)), None);
        assert_eq!(skew_warning(ch(35, 34)), None);
        assert_eq!(skew_warning(ch(33, 34)), None);
    }
}
