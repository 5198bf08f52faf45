//! OCI image archives built from files on this machine, for a cluster that
//! can pull from no registry: the pod sandbox (`pause`), the probe image the
//! suite's pods run (Debian's static busybox), and carve's own image (the
//! `carve` binary and the NVML simulator with the C runtime they link, as
//! `deploy/Dockerfile` lays them out on `distroless/cc-debian12`, whose
//! libraries are Debian 12's, as this machine's are).
//!
//! The archive is an OCI image layout (image-spec v1.1: `oci-layout`,
//! `index.json`, `blobs/sha256/`) in a tar: one uncompressed layer, its
//! config (whose `rootfs.diff_ids` is the layer's digest, uncompressed), and
//! a manifest named in the index by the `io.containerd.image.name`
//! annotation, which `ctr images import` takes as the image's name.

use std::path::{Path, PathBuf};

use serde_json::json;
use sha2::{Digest as _, Sha256};

use super::ClusterError;

/// One entry of an image's single layer.
#[derive(Debug, Clone)]
pub enum Entry {
    /// A file copied from this machine, with its mode.
    File {
        /// The path in the image (absolute).
        at: String,
        /// The file on this machine.
        from: PathBuf,
        /// Its mode in the image.
        mode: u32,
    },
    /// A file with these bytes.
    Bytes {
        /// The path in the image.
        at: String,
        /// Its content.
        bytes: Vec<u8>,
        /// Its mode.
        mode: u32,
    },
    /// A symbolic link.
    Symlink {
        /// The link's path in the image.
        at: String,
        /// What it points at.
        target: String,
    },
    /// An empty directory.
    Dir {
        /// Its path in the image.
        at: String,
        /// Its mode.
        mode: u32,
    },
}

/// An image to build: its name, its files and how it runs.
#[derive(Debug, Clone)]
pub struct Image {
    /// The full reference containerd lists it under
    /// (`registry.local/carve/probe:e2e`).
    pub name: String,
    /// The layer's entries; parent directories are added as needed.
    pub entries: Vec<Entry>,
    /// `config.Entrypoint`.
    pub entrypoint: Vec<String>,
    /// `config.Env` (`KEY=value`).
    pub env: Vec<String>,
}

fn tar_err(path: &Path) -> impl FnOnce(std::io::Error) -> ClusterError + '_ {
    move |source| ClusterError::Io {
        what: "writing an image archive",
        path: path.to_path_buf(),
        source,
    }
}

fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

impl Image {
    /// The layer's tar, entries in the order given, each parent directory
    /// before its first child.
    fn layer(&self, archive: &Path) -> Result<Vec<u8>, ClusterError> {
        let mut b = tar::Builder::new(Vec::new());
        b.mode(tar::HeaderMode::Deterministic);
        let mut dirs = std::collections::BTreeSet::new();
        for e in &self.entries {
            let at = match e {
                Entry::File { at, .. }
                | Entry::Bytes { at, .. }
                | Entry::Symlink { at, .. }
                | Entry::Dir { at, .. } => at.trim_start_matches('/'),
            };
            let mut parent = PathBuf::new();
            for part in Path::new(at)
                .parent()
                .into_iter()
                .flat_map(Path::components)
            {
                parent.push(part);
                if dirs.insert(parent.clone()) {
                    dir_entry(&mut b, &parent, 0o755).map_err(tar_err(archive))?;
                }
            }
            match e {
                Entry::File { from, mode, .. } => {
                    let bytes = std::fs::read(from).map_err(|source| ClusterError::Io {
                        what: "reading a file for an image",
                        path: from.clone(),
                        source,
                    })?;
                    file_entry(&mut b, at, &bytes, *mode).map_err(tar_err(archive))?;
                }
                Entry::Bytes { bytes, mode, .. } => {
                    file_entry(&mut b, at, bytes, *mode).map_err(tar_err(archive))?;
                }
                Entry::Symlink { target, .. } => {
                    let mut h = tar::Header::new_gnu();
                    h.set_entry_type(tar::EntryType::Symlink);
                    h.set_size(0);
                    h.set_mode(0o777);
                    b.append_link(&mut h, at, target)
                        .map_err(tar_err(archive))?;
                }
                Entry::Dir { mode, .. } => {
                    if dirs.insert(PathBuf::from(at)) {
                        dir_entry(&mut b, Path::new(at), *mode).map_err(tar_err(archive))?;
                    }
                }
            }
        }
        b.into_inner().map_err(tar_err(archive))
    }

    /// Writes the image as an OCI layout archive at `archive`.
    ///
    /// # Errors
    /// A file to copy is unreadable, or the archive cannot be written.
    pub fn write(&self, archive: &Path) -> Result<(), ClusterError> {
        let layer = self.layer(archive)?;
        let layer_digest = sha256(&layer);
        let config = serde_json::to_vec(&json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": self.entrypoint, "Env": self.env},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        }))
        .map_err(ClusterError::json("an image config"))?;
        let config_digest = sha256(&config);
        let manifest = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": config.len(),
            },
            "layers": [{
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": layer_digest,
                "size": layer.len(),
            }],
        }))
        .map_err(ClusterError::json("an image manifest"))?;
        let manifest_digest = sha256(&manifest);
        let tag = self.name.rsplit_once(':').map_or("latest", |(_, t)| t);
        let index = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": manifest.len(),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    "io.containerd.image.name": self.name,
                    "org.opencontainers.image.ref.name": tag,
                },
            }],
        }))
        .map_err(ClusterError::json("an image index"))?;

        let file = std::fs::File::create(archive).map_err(tar_err(archive))?;
        let mut out = tar::Builder::new(std::io::BufWriter::new(file));
        out.mode(tar::HeaderMode::Deterministic);
        let blob = |d: &str| format!("blobs/sha256/{}", d.trim_start_matches("sha256:"));
        dir_entry(&mut out, Path::new("blobs"), 0o755).map_err(tar_err(archive))?;
        dir_entry(&mut out, Path::new("blobs/sha256"), 0o755).map_err(tar_err(archive))?;
        for (name, bytes) in [
            (
                "oci-layout".to_string(),
                br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(),
            ),
            ("index.json".to_string(), index),
            (blob(&manifest_digest), manifest),
            (blob(&config_digest), config),
            (blob(&layer_digest), layer),
        ] {
            file_entry(&mut out, &name, &bytes, 0o644).map_err(tar_err(archive))?;
        }
        out.into_inner()
            .map_err(tar_err(archive))?
            .into_inner()
            .map_err(|e| tar_err(archive)(e.into_error()))?;
        Ok(())
    }
}

fn file_entry<W: std::io::Write>(
    b: &mut tar::Builder<W>,
    at: &str,
    bytes: &[u8],
    mode: u32,
) -> std::io::Result<()> {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_size(bytes.len() as u64);
    h.set_mode(mode);
    b.append_data(&mut h, at, bytes)
}

fn dir_entry<W: std::io::Write>(
    b: &mut tar::Builder<W>,
    at: &Path,
    mode: u32,
) -> std::io::Result<()> {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Directory);
    h.set_size(0);
    h.set_mode(mode);
    b.append_data(&mut h, at, std::io::empty())
}

/// The shared libraries `binary` loads, as this machine's dynamic loader
/// resolves them (`ldd`), each with the path it has here, the loader first.
///
/// # Errors
/// `ldd` cannot run or names a library it did not find.
pub fn linked_libraries(binary: &Path) -> Result<Vec<PathBuf>, ClusterError> {
    let out = std::process::Command::new("ldd")
        .arg(binary)
        .output()
        .map_err(|source| ClusterError::Io {
            what: "running ldd on",
            path: binary.to_path_buf(),
            source,
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut libs = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.contains("not found") {
            return Err(ClusterError::Prerequisite(format!(
                "{}: the library {line} is not on this machine",
                binary.display()
            )));
        }
        // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)` or the
        // loader's own `/lib64/ld-linux-x86-64.so.2 (0x...)`.
        let path = line
            .split_once("=>")
            .map_or(line, |(_, p)| p.trim())
            .split_whitespace()
            .next()
            .unwrap_or_default();
        if path.starts_with('/') {
            libs.push(PathBuf::from(path));
        }
    }
    Ok(libs)
}

/// The entries that make a dynamically linked program run in an image: each
/// library at its path and at the path its link name resolves to here (the
/// loader's `/lib64/ld-linux-x86-64.so.2` is a link on Debian).
///
/// # Errors
/// See [`linked_libraries`].
pub fn runtime_of(binaries: &[&Path]) -> Result<Vec<Entry>, ClusterError> {
    let mut seen = std::collections::BTreeSet::new();
    let mut entries = Vec::new();
    for bin in binaries {
        for lib in linked_libraries(bin)? {
            let real = std::fs::canonicalize(&lib).map_err(|source| ClusterError::Io {
                what: "resolving",
                path: lib.clone(),
                source,
            })?;
            if seen.insert(real.clone()) {
                entries.push(Entry::File {
                    at: real.display().to_string(),
                    from: real.clone(),
                    mode: 0o755,
                });
            }
            if lib != real && seen.insert(lib.clone()) {
                entries.push(Entry::Symlink {
                    at: lib.display().to_string(),
                    target: real.display().to_string(),
                });
            }
        }
    }
    Ok(entries)
}
