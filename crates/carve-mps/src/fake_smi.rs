//! A test double of `nvidia-smi memory-limits`, and a cgroup v2 fixture with
//! the `dmem` controller, so carve's hard memory limits are tested against
//! what NVIDIA documents: carve must call the tool, which writes `dmem.*`,
//! and must never write those files itself. It is not nvidia-smi: it knows
//! only the `memory-limits` subcommand, touches no GPU and enforces nothing.
//!
//! Each rule cites its source (`../shared/reference/mps-v3.md` 1.9, 1.10):
//! [MP] NVIDIA's memory-partitioning page, [NVML] the NVML memory-limit
//! struct pages, [DYN] NVIDIA Dynamo's MPS guide (with its measured
//! behaviour). Where NVIDIA documents no behaviour, the double refuses
//! (marked "not documented"), so carve is held to the documented forms.
//!
//! # Invocation
//! It runs as a program named [`PROGRAM`] (a link to a fake binary; the
//! binaries dispatch on their name). Its configuration is the JSON file
//! [`CONFIG`] next to that link ([`Config`]): the GPUs it sees, the cgroup
//! root, and failure knobs. Every call is appended to [`LOG`] in the same
//! directory, one line of arguments, so a test can show that carve called
//! the tool.
//!
//! # Rules
//! 1. The first argument must be `memory-limits` [DYN: "`memory-limits` must
//!    come first"].
//! 2. `--set` (as [MP] writes it) or no mode (as [DYN] writes it) sets;
//!    `--get` reads [MP]. Its output format is not documented, so the double
//!    prints a line no parser should rely on.
//! 3. `-n`/`--namespace` takes the full cgroup path [DYN]; it must be an
//!    existing directory with a `dmem.max` file, i.e. its parent enables
//!    `+dmem`; otherwise `Unable to get memory limit: Not Supported` and a
//!    non-zero exit [MP], [DYN]. A relative path, or one outside the
//!    configured cgroup root, is refused the same way (not a cgroup).
//! 4. `-i` takes an index or a UUID [MP], [DYN]; it is required (every
//!    documented form has it; without it: not documented). A GPU the node
//!    does not have is refused; a MIG device (a `MIG-` UUID, or a GPU with
//!    MIG mode on) is refused: "MIG is explicitly unsupported ... NVML
//!    rejects MIG handles" [MP].
//! 5. `--soft-limit` / `--hard-limit` values are MiB integers, `max` or
//!    `default` [DYN]; `40G` is rejected [DYN]; so is the `--flag=value`
//!    form (the documented examples separate flag and value; the `=` form's
//!    acceptance is not documented). A set needs at least one of them.
//! 6. Setting needs root [MP]: with `"asUid"` non-zero in the config the
//!    double refuses a set (reading does not need root [MP]).
//! 7. Effect of a set [MP], [DYN]: the cgroup's `dmem.max` line for the GPU's
//!    key `nvidia/<PCI BDF>/vidmem` becomes the hard limit in bytes (`max`
//!    for `max`/`default`), its `dmem.min` line the soft limit in bytes
//!    (`0` for `default`; `max` stays `max`), and the change of the soft limit
//!    is added to every ancestor's `dmem.min` that has the key ("When the
//!    driver sets a leaf's soft limit it adds it to every ancestor's
//!    `dmem.min`" [MP]).
//!
//! # Knobs (config `fail`)
//! - `"refuse"`: every set fails (exit 1) before changing anything, as a
//!   tool that refuses would.
//! - `"die"`: the process aborts (SIGABRT) before changing anything.
//! - `"lie"`: the set exits 0 but writes a hard limit 1 MiB off, modelling a
//!   limit that did not take as asked (so read-back must catch it).
//! - `"refuseClear"`: a set with hard `max` fails (clearing refused).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde::{Deserialize, Serialize};

use crate::memlimit::{MIB, dmem_value};

/// The name the double answers to.
pub const PROGRAM: &str = "nvidia-smi";
/// Its configuration file, next to the program link.
pub const CONFIG: &str = "fake-nvidia-smi.json";
/// Its call log, next to the program link.
pub const LOG: &str = "fake-nvidia-smi.log";
/// The message for a cgroup without `dmem.*` files [DYN].
pub const NOT_SUPPORTED: &str = "Unable to get memory limit: Not Supported";

/// One GPU the double sees.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct FakeGpu {
    /// nvidia-smi index.
    pub index: u32,
    /// UUID.
    pub uuid: String,
    /// PCI bus id (`00000000:3B:00.0`).
    pub pci: String,
    /// MIG mode on.
    #[serde(default)]
    pub mig: bool,
}

/// The double's configuration ([`CONFIG`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Config {
    /// The cgroup v2 root that namespaces must be under.
    pub cgroup_root: PathBuf,
    /// The GPUs.
    pub gpus: Vec<FakeGpu>,
    /// Failure knob (module docs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fail: Option<String>,
    /// Run as this UID (0: root).
    #[serde(default)]
    pub as_uid: u32,
}

/// The dmem key of a GPU at `pci`, as the driver names it (`nvidia/<BDF>/vidmem`,
/// BDF lowercase with a four-digit domain, as in [DYN]'s example).
#[must_use]
pub fn dmem_key(pci: &str) -> String {
    let s = pci.to_ascii_lowercase();
    let s = match s.split_once(':') {
        Some((dom, rest)) if dom.len() > 4 => format!("{}:{rest}", &dom[dom.len() - 4..]),
        _ => s,
    };
    format!("nvidia/{s}/vidmem")
}

/// Install the double in `dir`: a link [`PROGRAM`] to `binary` (a fake
/// binary that dispatches on its name) and its [`CONFIG`]. Returns the
/// link's path.
///
/// # Errors
/// File errors.
pub fn install(dir: &Path, binary: &Path, config: &Config) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let link = dir.join(PROGRAM);
    if link.symlink_metadata().is_ok() {
        std::fs::remove_file(&link)?;
    }
    std::os::unix::fs::symlink(binary, &link)?;
    write_config(dir, config)?;
    Ok(link)
}

/// Rewrite the double's configuration in `dir` (to change a knob).
///
/// # Errors
/// File errors.
pub fn write_config(dir: &Path, config: &Config) -> std::io::Result<()> {
    let text = serde_json::to_string_pretty(config).map_err(std::io::Error::other)?;
    std::fs::write(dir.join(CONFIG), text)
}

/// The calls logged in `dir`, one argument line each.
#[must_use]
pub fn calls(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join(LOG))
        .map(|t| t.lines().map(str::to_string).collect())
        .unwrap_or_default()
}

/// Whether `argv0` names the double.
#[must_use]
pub fn invoked_as(argv0: &std::ffi::OsStr) -> bool {
    Path::new(argv0).file_name() == Some(std::ffi::OsStr::new(PROGRAM))
}

/// Entry point: `argv0` is the program path as invoked, `args` the rest.
#[must_use]
pub fn main(argv0: &std::ffi::OsStr, args: &[std::ffi::OsString]) -> ExitCode {
    let dir = Path::new(argv0)
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
    let args: Vec<String> = args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(LOG))
    {
        let _ = writeln!(f, "{}", args.join(" "));
    }
    let cfg: Config = match std::fs::read_to_string(dir.join(CONFIG))
        .map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "fake nvidia-smi: no usable {CONFIG} in {}: {e}",
                dir.display()
            );
            return ExitCode::from(2);
        }
    };
    match run(&cfg, &args) {
        Ok(out) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            // nvidia-smi prints its errors on stdout; carve reads both.
            println!("{e}");
            ExitCode::from(1)
        }
    }
}

#[derive(Debug, Default)]
struct Parsed {
    get: bool,
    namespace: Option<String>,
    device: Option<String>,
    soft: Option<String>,
    hard: Option<String>,
}

fn parse(args: &[String]) -> Result<Parsed, String> {
    // Rule 1 [DYN].
    match args.first().map(String::as_str) {
        Some("memory-limits") => {}
        Some(other) => {
            return Err(format!(
                "fake nvidia-smi: only `memory-limits` is modelled, and it must come first (got {other:?})"
            ));
        }
        None => return Err("fake nvidia-smi: no subcommand".into()),
    }
    let mut p = Parsed::default();
    let mut set = false;
    let mut it = args[1..].iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .cloned()
                .ok_or_else(|| format!("Option {name} requires a value"))
        };
        match a.as_str() {
            "--set" => set = true,
            "--get" => p.get = true,
            "-n" | "--namespace" => p.namespace = Some(value(a)?),
            "-i" | "--id" => p.device = Some(value(a)?),
            "--soft-limit" => p.soft = Some(value(a)?),
            "--hard-limit" => p.hard = Some(value(a)?),
            // Rule 5: the `=` form is not documented.
            other if other.contains('=') => {
                return Err(format!(
                    "Invalid combination of input arguments: {other:?} (the flag and its value are separate arguments)"
                ));
            }
            other => return Err(format!("Invalid argument {other:?}")),
        }
    }
    if set && p.get {
        return Err("Invalid combination of input arguments: --set and --get".into());
    }
    Ok(p)
}

/// A limit value in bytes, or `None` for `max` [DYN].
fn value(flag: &str, v: &str, default_is_max: bool) -> Result<Option<u64>, String> {
    match v {
        "max" => Ok(None),
        // Rule 7: `default` clears (soft 0, hard max) [NVML].
        "default" => Ok(if default_is_max { None } else { Some(0) }),
        _ if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) => v
            .parse::<u64>()
            .ok()
            .and_then(|m| m.checked_mul(MIB))
            .map(Some)
            .ok_or_else(|| format!("Invalid value {v:?} for {flag}")),
        _ => Err(format!(
            "Invalid value {v:?} for {flag}: expected an integer number of MiB, max or default"
        )),
    }
}

fn text(v: Option<u64>) -> String {
    v.map_or_else(|| "max".into(), |b| b.to_string())
}

fn run(cfg: &Config, args: &[String]) -> Result<String, String> {
    let p = parse(args)?;
    // Rule 4.
    let dev = p
        .device
        .as_deref()
        .ok_or("fake nvidia-smi: -i <index|UUID> is required (every documented form has it)")?;
    if dev.starts_with("MIG-") {
        return Err(format!(
            "{NOT_SUPPORTED} ({dev} is a MIG device; memory partitioning does not support MIG)"
        ));
    }
    let gpu = cfg
        .gpus
        .iter()
        .find(|g| g.uuid == dev || g.index.to_string() == dev)
        .ok_or_else(|| format!("No device found with id {dev:?}"))?;
    if gpu.mig {
        return Err(format!(
            "{NOT_SUPPORTED} (GPU {} is in MIG mode; memory partitioning does not support MIG)",
            gpu.uuid
        ));
    }
    // Rule 3.
    let ns = p
        .namespace
        .as_deref()
        .ok_or("fake nvidia-smi: -n/--namespace <cgroup path> is required")?;
    let ns = PathBuf::from(ns);
    if !ns.is_absolute()
        || !ns.starts_with(&cfg.cgroup_root)
        || ns
            .components()
            .any(|c| c == std::path::Component::ParentDir)
        || !ns.join("dmem.max").is_file()
    {
        return Err(NOT_SUPPORTED.into());
    }
    let key = dmem_key(&gpu.pci);
    if p.get {
        if p.soft.is_some() || p.hard.is_some() {
            return Err("Invalid combination of input arguments: --get with a limit".into());
        }
        // The real output format is not documented: nothing to parse here.
        let read = |f: &str| {
            std::fs::read_to_string(ns.join(f))
                .ok()
                .and_then(|t| dmem_value(&t, &key).map(str::to_string))
                .unwrap_or_default()
        };
        return Ok(format!(
            "fake-nvidia-smi undocumented-format soft={} hard={}\n",
            read("dmem.min"),
            read("dmem.max")
        ));
    }
    // Rule 5.
    let soft = p
        .soft
        .as_deref()
        .map(|v| value("--soft-limit", v, false))
        .transpose()?;
    let hard = p
        .hard
        .as_deref()
        .map(|v| value("--hard-limit", v, true))
        .transpose()?;
    if soft.is_none() && hard.is_none() {
        return Err(
            "Invalid combination of input arguments: a set needs --soft-limit or --hard-limit"
                .into(),
        );
    }
    // Rule 6 [MP].
    if cfg.as_uid != 0 {
        return Err("Insufficient Permissions: setting memory limits needs root".into());
    }
    match cfg.fail.as_deref() {
        Some("refuse") => return Err("Unknown Error (fake nvidia-smi: knob refuse)".into()),
        Some("die") => std::process::abort(),
        Some("refuseClear") if p.hard.as_deref() == Some("max") => {
            return Err("Unknown Error (fake nvidia-smi: knob refuseClear)".into());
        }
        _ => {}
    }
    // Rule 7.
    if let Some(h) = hard {
        let h = match (h, cfg.fail.as_deref()) {
            (Some(b), Some("lie")) => Some(b + MIB),
            (h, _) => h,
        };
        write_key(&ns.join("dmem.max"), &key, &text(h))?;
    }
    if let Some(s) = soft {
        let old = std::fs::read_to_string(ns.join("dmem.min"))
            .ok()
            .and_then(|t| dmem_value(&t, &key).and_then(|v| v.parse::<u64>().ok()))
            .unwrap_or(0);
        let new = s.unwrap_or(u64::MAX);
        write_key(&ns.join("dmem.min"), &key, &text(s))?;
        let mut up = ns.parent();
        while let Some(a) =
            up.filter(|a| a.starts_with(&cfg.cgroup_root) && a.join("dmem.min").is_file())
        {
            let f = a.join("dmem.min");
            let cur = std::fs::read_to_string(&f)
                .ok()
                .and_then(|t| dmem_value(&t, &key).and_then(|v| v.parse::<u64>().ok()))
                .unwrap_or(0);
            let next = cur.saturating_add(new).saturating_sub(old);
            write_key(&f, &key, &next.to_string())?;
            up = a.parent();
        }
    }
    Ok(String::new())
}

/// Set `key`'s line in a `dmem.*` file, keeping the other keys' lines.
fn write_key(file: &Path, key: &str, v: &str) -> Result<(), String> {
    let t = std::fs::read_to_string(file).unwrap_or_default();
    let mut lines: BTreeMap<String, String> = t
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            Some((w.next()?.to_string(), w.next().unwrap_or("").to_string()))
        })
        .collect();
    lines.insert(key.to_string(), v.to_string());
    let out: String = lines.iter().map(|(k, v)| format!("{k} {v}\n")).collect();
    std::fs::write(file, out).map_err(|e| format!("writing {}: {e}", file.display()))
}

/// A cgroup v2 tree with the dmem controller, under a scratch root: what a
/// node with kernel 6.14+ and the NVIDIA driver's dmem backend shows.
pub mod fixture {
    use std::path::Path;

    use super::write_key;

    /// The root: `cgroup.controllers` with `dmem`, `dmem.capacity` listing
    /// `regions` (key, bytes), and `+dmem` in the root's
    /// `cgroup.subtree_control` when `enable` [MP], [DYN]. The root itself
    /// has no `dmem.max` (a cgroup v2 root has no limit files).
    ///
    /// # Errors
    /// File errors.
    pub fn root(root: &Path, regions: &[(String, u64)], enable: bool) -> std::io::Result<()> {
        std::fs::create_dir_all(root)?;
        std::fs::write(
            root.join("cgroup.controllers"),
            "cpuset cpu io memory pids dmem\n",
        )?;
        let cap: String = regions.iter().map(|(k, b)| format!("{k} {b}\n")).collect();
        std::fs::write(root.join("dmem.capacity"), cap)?;
        std::fs::write(
            root.join("cgroup.subtree_control"),
            if enable {
                "memory pids dmem\n"
            } else {
                "memory pids\n"
            },
        )
    }

    /// A root without dmem: cgroup v2 whose kernel has no dmem controller
    /// (the driver then uses its misc backend, which has no files [MP]).
    ///
    /// # Errors
    /// File errors.
    pub fn root_without_dmem(root: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(root)?;
        std::fs::write(
            root.join("cgroup.controllers"),
            "cpuset cpu io memory pids misc\n",
        )?;
        std::fs::write(root.join("cgroup.subtree_control"), "memory pids\n")
    }

    /// Make cgroup `rel` and the missing ones above it. Each new cgroup gets
    /// `dmem.max` (`max` per region) and `dmem.min` (`0` per region) only
    /// where its parent's `cgroup.subtree_control` enables `dmem` (the
    /// kernel's rule), and enables `dmem` for its own children when `enable`.
    ///
    /// # Errors
    /// File errors.
    pub fn cgroup(root: &Path, rel: &Path, enable: bool) -> std::io::Result<()> {
        let regions: Vec<String> = std::fs::read_to_string(root.join("dmem.capacity"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split_whitespace().next().map(str::to_string))
            .collect();
        let mut cur = root.to_path_buf();
        for c in rel.components() {
            let parent = cur.clone();
            cur.push(c);
            if cur.is_dir() {
                continue;
            }
            std::fs::create_dir(&cur)?;
            let parent_enables = std::fs::read_to_string(parent.join("cgroup.subtree_control"))
                .unwrap_or_default()
                .split_whitespace()
                .any(|w| w == "dmem" || w == "+dmem");
            if parent_enables {
                for r in &regions {
                    write_key(&cur.join("dmem.max"), r, "max").map_err(std::io::Error::other)?;
                    write_key(&cur.join("dmem.min"), r, "0").map_err(std::io::Error::other)?;
                }
            }
            std::fs::write(
                cur.join("cgroup.subtree_control"),
                if enable {
                    "memory pids dmem\n"
                } else {
                    "memory pids\n"
                },
            )?;
        }
        Ok(())
    }
}
