//! A fake NVIDIA driver root and `/proc/devices` for a simulated node, so the
//! kubelet plugin's driver discovery and its CDI specs see what they see on a
//! real node: the driver's libraries (tiny ELF shared objects with the real
//! sonames, built by `build.rs`) beside their soname links, the utilities,
//! GSP firmware, the persistenced socket, graphics configs, and, when the
//! process may create device nodes (root), the control and GPU device nodes
//! with the NVIDIA driver's numbers.
//!
//! It is not a driver: the libraries export `cuInit` (libcuda, returning 0)
//! and `nvmlInit_v2` (libnvidia-ml) and nothing else, the binaries print that
//! they are fakes and fail, and the device nodes have no driver behind them.

use std::path::{Path, PathBuf};

use crate::config::SimError;

/// The fake libraries: (soname, ELF bytes).
const LIBRARIES: &[(&str, &[u8])] = include!(concat!(env!("OUT_DIR"), "/fake_libraries.rs"));

/// Directory of the libraries under the driver root (Debian/Ubuntu layout).
pub const LIB_DIR: &str = "usr/lib/x86_64-linux-gnu";

/// The NVIDIA driver's fixed character major (`/dev/nvidia<minor>`,
/// `/dev/nvidiactl` 255, `/dev/nvidia-modeset` 254).
pub const NVIDIA_MAJOR: u32 = 195;

/// The `nvidia-caps` major the fake `/proc/devices` lists (a real node's is
/// assigned dynamically at module load).
pub const CAPS_MAJOR: u32 = 237;

/// The `nvidia-uvm` major the fake `/proc/devices` lists (dynamic on a node).
pub const UVM_MAJOR: u32 = 508;

/// Utilities a driver installs in `usr/bin`.
pub const BINARIES: &[&str] = &[
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
];

/// What [`write_fake_driver`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeDriver {
    /// The driver root (`--container-driver-root`).
    pub root: PathBuf,
    /// The fake `/proc/devices` (`--proc-devices`).
    pub devices_file: PathBuf,
    /// The driver version in the library names.
    pub version: String,
    /// Sonames of the libraries, `libcuda.so.1` first.
    pub sonames: Vec<String>,
    /// Whether `root/dev` holds character devices (only root may make them).
    pub device_nodes: bool,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SimError + '_ {
    move |source| SimError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn write(path: &Path, bytes: &[u8], mode: u32) -> Result<(), SimError> {
    use std::os::unix::fs::PermissionsExt as _;
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).map_err(io(d))?;
    }
    std::fs::write(path, bytes).map_err(io(path))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(io(path))
}

fn symlink(target: &str, link: &Path) -> Result<(), SimError> {
    match std::fs::remove_file(link) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(link)(e)),
        _ => {}
    }
    std::os::unix::fs::symlink(target, link).map_err(io(link))
}

/// The `/proc/devices` text of a node with the NVIDIA driver loaded;
/// `with_caps: false` leaves out the `nvidia-caps` line (a driver without MIG
/// capability devices, or a broken node).
#[must_use]
pub fn proc_devices_text(with_caps: bool) -> String {
    let caps = if with_caps {
        format!("{CAPS_MAJOR} nvidia-caps\n")
    } else {
        String::new()
    };
    format!(
        "Character devices:\n  1 mem\n  4 /dev/vc/0\n  5 /dev/tty\n{NVIDIA_MAJOR} nvidia-frontend\n{caps}{UVM_MAJOR} nvidia-uvm\n\nBlock devices:\n  8 sd\n"
    )
}

/// Write a fake driver root of `version` at `dir/driver` and a fake
/// `/proc/devices` at `dir/devices`. Device nodes (`dev/nvidiactl`,
/// `dev/nvidia-uvm`, `dev/nvidia-uvm-tools`, `dev/nvidia-modeset`,
/// `dev/nvidia<m>` for each of `gpu_minors`) are made with `mknod` only when
/// this process runs as root; otherwise `dev/` stays empty.
///
/// # Errors
/// A file could not be written, or `mknod` failed as root.
pub fn write_fake_driver(
    dir: &Path,
    version: &str,
    gpu_minors: &[u32],
) -> Result<FakeDriver, SimError> {
    let root = dir.join("driver");
    let lib = root.join(LIB_DIR);
    let mut sonames = Vec::new();
    for (soname, elf) in LIBRARIES {
        let stem = soname.split(".so").next().unwrap_or(soname);
        let file = format!("{stem}.so.{version}");
        write(&lib.join(&file), elf, 0o755)?;
        // What the installer and ldconfig leave: the soname link, and the
        // development link for libcuda and libnvidia-ml.
        symlink(&file, &lib.join(soname))?;
        if matches!(*soname, "libcuda.so.1" | "libnvidia-ml.so.1") {
            symlink(soname, &lib.join(format!("{stem}.so")))?;
        }
        sonames.push((*soname).to_string());
    }
    for b in BINARIES {
        let text = format!(
            "#!/bin/sh\necho '{b}: a fake of the carve NVML simulator, no GPU behind it' >&2\nexit 1\n"
        );
        write(&root.join("usr/bin").join(b), text.as_bytes(), 0o755)?;
    }
    let fw = root.join("lib/firmware/nvidia").join(version);
    for f in ["gsp_ga10x.bin", "gsp_tu10x.bin"] {
        write(&fw.join(f), b"fake GSP firmware\n", 0o644)?;
    }
    let icd = r#"{"file_format_version": "1.0.1", "ICD": {"library_path": "libGLX_nvidia.so.0", "api_version": "1.3"}}
"#;
    write(
        &root.join("etc/vulkan/icd.d/nvidia_icd.json"),
        icd.as_bytes(),
        0o644,
    )?;
    write(
        &root.join("usr/share/glvnd/egl_vendor.d/10_nvidia.json"),
        b"{\"file_format_version\": \"1.0.0\", \"ICD\": {\"library_path\": \"libEGL_nvidia.so.0\"}}\n",
        0o644,
    )?;
    let sock_dir = root.join("run/nvidia-persistenced");
    std::fs::create_dir_all(&sock_dir).map_err(io(&sock_dir))?;
    let sock = sock_dir.join("socket");
    let _ = std::fs::remove_file(&sock);
    // The listener is dropped at once: the socket file stays, as a stopped
    // daemon's does.
    drop(std::os::unix::net::UnixListener::bind(&sock).map_err(io(&sock))?);

    let dev = root.join("dev");
    std::fs::create_dir_all(&dev).map_err(io(&dev))?;
    let device_nodes = is_root();
    if device_nodes {
        let mut nodes = vec![
            ("nvidiactl".to_string(), NVIDIA_MAJOR, 255),
            ("nvidia-modeset".to_string(), NVIDIA_MAJOR, 254),
            ("nvidia-uvm".to_string(), UVM_MAJOR, 0),
            ("nvidia-uvm-tools".to_string(), UVM_MAJOR, 1),
        ];
        nodes.extend(
            gpu_minors
                .iter()
                .map(|m| (format!("nvidia{m}"), NVIDIA_MAJOR, *m)),
        );
        for (name, major, minor) in nodes {
            let p = dev.join(&name);
            let _ = std::fs::remove_file(&p);
            let out = std::process::Command::new("mknod")
                .args(["-m", "666"])
                .arg(&p)
                .args(["c", &major.to_string(), &minor.to_string()])
                .output()
                .map_err(io(&p))?;
            if !out.status.success() {
                return Err(SimError::Io {
                    path: p,
                    source: std::io::Error::other(format!(
                        "mknod: {}",
                        String::from_utf8_lossy(&out.stderr).trim()
                    )),
                });
            }
        }
    }
    let devices_file = dir.join("devices");
    write(&devices_file, proc_devices_text(true).as_bytes(), 0o644)?;
    Ok(FakeDriver {
        root,
        devices_file,
        version: version.to_string(),
        sonames,
        device_nodes,
    })
}

/// Whether this process runs as root (owner of its own `/proc/self`).
fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_libraries_carry_their_sonames_and_links() {
        let d = tempfile::tempdir().unwrap();
        let f = write_fake_driver(d.path(), "580.65.06", &[0]).unwrap();
        assert_eq!(f.sonames[0], "libcuda.so.1");
        let lib = f.root.join(LIB_DIR);
        let elf = std::fs::read(lib.join("libcuda.so.580.65.06")).unwrap();
        assert_eq!(&elf[..4], b"\x7fELF");
        // DT_SONAME's string is in the dynamic string table.
        assert!(elf.windows(12).any(|w| w == b"libcuda.so.1"));
        assert_eq!(
            std::fs::read_link(lib.join("libcuda.so.1")).unwrap(),
            Path::new("libcuda.so.580.65.06")
        );
        assert_eq!(
            std::fs::read_link(lib.join("libcuda.so")).unwrap(),
            Path::new("libcuda.so.1")
        );
        let devices = std::fs::read_to_string(&f.devices_file).unwrap();
        assert!(devices.contains(&format!("{CAPS_MAJOR} nvidia-caps\n")));
        assert!(!proc_devices_text(false).contains("nvidia-caps"));
        // Rewriting over an existing root works.
        write_fake_driver(d.path(), "580.65.06", &[0]).unwrap();
    }
}
