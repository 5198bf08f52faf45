//! Where a pod's cgroup is: where a share's hard memory limit goes
//! ([`crate::memlimit`], set through `nvidia-smi memory-limits` on the pod
//! cgroup). No MPS namespace is bound to a cgroup (release 615 has no
//! binding, 620's CLI for it is undocumented).
//!
//! The kubelet creates the pod cgroup before it prepares the pod's DRA claims
//! (`SyncPod` runs `pcm.EnsureExists(pod)`; the runtime's `SyncPod` then calls
//! `PrepareDynamicResources` before it creates the sandbox), so at
//! `NodePrepareResources` the pod cgroup exists while its containers' do not.
//! Its name depends on the kubelet's cgroup driver and the pod's QoS class:
//!
//! | driver | path under the cgroup root |
//! |---|---|
//! | cgroupfs | `kubepods/pod<uid>`, `kubepods/burstable/pod<uid>`, `kubepods/besteffort/pod<uid>` |
//! | systemd | `kubepods.slice/kubepods-pod<u>.slice`, `kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<u>.slice`, `…besteffort…` (`<u>`: the UID with `-` as `_`) |
//!
//! A kubelet with `--cgroup-root` nests these one or more levels deeper, so
//! after the well-known places carve searches the tree (a few levels deep) for
//! a directory with one of the two leaf names.

use std::path::{Path, PathBuf};

/// How deep [`pod_cgroup`] searches below the root when the well-known places miss.
const MAX_DEPTH: usize = 5;

fn leaf_names(pod_uid: &str) -> [String; 4] {
    let u = pod_uid.replace('-', "_");
    [
        format!("pod{pod_uid}"),
        format!("kubepods-pod{u}.slice"),
        format!("kubepods-burstable-pod{u}.slice"),
        format!("kubepods-besteffort-pod{u}.slice"),
    ]
}

/// Whether `uid` can be part of a path: a Kubernetes UID is hex and dashes.
fn plausible_uid(uid: &str) -> bool {
    !uid.is_empty() && uid.len() <= 64 && uid.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

/// The cgroup of pod `pod_uid`, relative to `root` (e.g.
/// `kubepods/besteffort/pod<uid>`), or `None` when it does not exist (or the
/// UID is not a UID).
#[must_use]
pub fn pod_cgroup(root: &Path, pod_uid: &str) -> Option<PathBuf> {
    if !plausible_uid(pod_uid) {
        return None;
    }
    let u = pod_uid.replace('-', "_");
    let known = [
        format!("kubepods/pod{pod_uid}"),
        format!("kubepods/burstable/pod{pod_uid}"),
        format!("kubepods/besteffort/pod{pod_uid}"),
        format!("kubepods.slice/kubepods-pod{u}.slice"),
        format!("kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice"),
        format!("kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice"),
    ];
    if let Some(k) = known.iter().find(|k| root.join(k).is_dir()) {
        return Some(PathBuf::from(k));
    }
    let names = leaf_names(pod_uid);
    search(root, Path::new(""), &names, 0)
}

fn search(root: &Path, rel: &Path, names: &[String], depth: usize) -> Option<PathBuf> {
    if depth >= MAX_DEPTH {
        return None;
    }
    let rd = std::fs::read_dir(root.join(rel)).ok()?;
    let mut dirs = Vec::new();
    for e in rd.flatten() {
        if !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let name = e.file_name();
        let child = rel.join(&name);
        if name.to_str().is_some_and(|s| names.iter().any(|n| n == s)) {
            return Some(child);
        }
        dirs.push(child);
    }
    dirs.sort();
    dirs.iter().find_map(|d| search(root, d, names, depth + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";

    #[test]
    fn finds_each_driver_and_qos_form() {
        let u = UID.replace('-', "_");
        for rel in [
            format!("kubepods/pod{UID}"),
            format!("kubepods/burstable/pod{UID}"),
            format!("kubepods/besteffort/pod{UID}"),
            format!("kubepods.slice/kubepods-pod{u}.slice"),
            format!("kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice"),
            format!("kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice"),
            // kubelet --cgroup-root=/kubelet.slice (kind nodes)
            format!(
                "kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice"
            ),
        ] {
            let d = tempfile::tempdir().unwrap();
            std::fs::create_dir_all(d.path().join(&rel)).unwrap();
            assert_eq!(
                pod_cgroup(d.path(), UID),
                Some(PathBuf::from(&rel)),
                "{rel}"
            );
        }
    }

    #[test]
    fn other_pods_files_and_bad_uids_do_not_match() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("kubepods/besteffort/pod1111")).unwrap();
        std::fs::write(d.path().join(format!("kubepods/pod{UID}")), "").unwrap();
        assert_eq!(pod_cgroup(d.path(), UID), None);
        std::fs::create_dir_all(d.path().join("x/pod..")).unwrap();
        assert_eq!(pod_cgroup(d.path(), ".."), None);
        assert_eq!(pod_cgroup(d.path(), "../etc"), None);
        assert_eq!(pod_cgroup(d.path(), ""), None);
    }

    #[test]
    fn search_depth_is_bounded() {
        let d = tempfile::tempdir().unwrap();
        let deep = format!("a/b/c/d/e/f/pod{UID}");
        std::fs::create_dir_all(d.path().join(&deep)).unwrap();
        assert_eq!(pod_cgroup(d.path(), UID), None);
    }
}
