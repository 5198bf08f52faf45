//! Builds the fake driver root's shared objects: one tiny ELF shared object per
//! NVIDIA driver library, carrying the library's real soname (`DT_SONAME`), so
//! a dynamic loader resolves `libcuda.so.1` and friends in a container exactly
//! as it resolves the real ones. Built with the C compiler Rust links with
//! (`$CC`, else `cc`), without libc; `libcuda` exports `cuInit` (returning 0),
//! every library a `carve_fake_driver_library` marker.

use std::path::PathBuf;
use std::process::Command;

/// (soname, exported C source) of each fake library; the list is shared with
/// `src/driver_root.rs` through `include!`.
const LIBRARIES: &[(&str, &str)] = include!("src/driver_libraries.in");

fn main() {
    println!("cargo:rerun-if-changed=src/driver_libraries.in");
    println!("cargo:rerun-if-env-changed=CC");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let mut table = String::from("&[\n");
    for (soname, body) in LIBRARIES {
        let src = out.join(format!("{soname}.c"));
        std::fs::write(
            &src,
            format!("int carve_fake_driver_library(void) {{ return 1; }}\n{body}\n"),
        )
        .expect("writing a fake library's source");
        let obj = out.join(format!("{soname}.bin"));
        let status = Command::new(&cc)
            .args(["-shared", "-fPIC", "-nostdlib", "-s", "-O1"])
            .arg(format!("-Wl,-soname,{soname}"))
            .arg("-o")
            .arg(&obj)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("running {cc} to build the fake {soname}: {e}"));
        assert!(status.success(), "{cc} failed building the fake {soname}");
        table.push_str(&format!(
            "    ({soname:?}, include_bytes!({:?}) as &[u8]),\n",
            obj.display().to_string()
        ));
    }
    table.push(']');
    std::fs::write(out.join("fake_libraries.rs"), table).expect("writing fake_libraries.rs");
}
