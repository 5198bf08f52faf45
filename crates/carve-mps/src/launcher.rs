//! The launcher a unit's control daemon starts through:
//! `<launcher> --carve-mps-exec [--cgroup <dir>]… [--shm <dir>] -- <program> <args…>`.
//! The launcher is the `carve` binary in the plugin (and the fake's binary in
//! tests, [`crate::MpsConfig::shm_launcher`]). It prepares its own process,
//! then execs the control binary, so that the daemon it forks and the
//! servers that forks inherit what it set up, and nothing of it needs code
//! between `fork` and `exec` in the plugin:
//! 1. with `--cgroup` (each hierarchy's unit cgroup, [`crate::daemon_cgroup`]):
//!    its pid into each `cgroup.procs`, out of the plugin container's cgroup;
//! 2. a session of its own (`setsid`): out of the plugin's process group;
//! 3. with `--shm`: a new mount namespace whose mounts follow the parent's
//!    (`MS_SLAVE`, so host mounts made later still reach the daemon), with
//!    the unit's tmpfs bound over `/dev/shm` ([`crate::shm`]); the caller's
//!    namespace stays untouched.

use std::ffi::OsString;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use nix::mount::MsFlags;

use crate::shm::DEV_SHM;

/// The argument that makes a launcher run [`exec_main`].
pub const EXEC_FLAG: &str = "--carve-mps-exec";

/// The command that starts `program` through `launcher`, in `cgroups`, with
/// `shm` as its `/dev/shm` if given. The caller adds the program's arguments.
pub(crate) fn command(
    launcher: &Path,
    cgroups: &[PathBuf],
    shm: Option<&Path>,
    program: &Path,
) -> Command {
    let mut c = Command::new(launcher);
    c.arg(EXEC_FLAG);
    for g in cgroups {
        c.arg("--cgroup").arg(g);
    }
    if let Some(s) = shm {
        c.arg("--shm").arg(s);
    }
    c.arg("--").arg(program);
    c
}

#[derive(Debug, Default, PartialEq, Eq)]
struct Plan {
    cgroups: Vec<PathBuf>,
    shm: Option<PathBuf>,
    program: OsString,
    args: Vec<OsString>,
}

fn parse(args: &[OsString]) -> Result<Plan, String> {
    let mut p = Plan::default();
    let mut it = args.iter();
    loop {
        let Some(a) = it.next() else {
            return Err("no `--` before the program".into());
        };
        let mut value = |flag: &str| {
            it.next()
                .map(PathBuf::from)
                .ok_or_else(|| format!("{flag} needs a directory"))
        };
        match a.to_str() {
            Some("--cgroup") => p.cgroups.push(value("--cgroup")?),
            Some("--shm") => p.shm = Some(value("--shm")?),
            Some("--") => break,
            _ => return Err(format!("unknown launcher argument {a:?}")),
        }
    }
    p.program = it.next().ok_or("no program after `--`")?.clone();
    p.args = it.cloned().collect();
    Ok(p)
}

fn prepare(p: &Plan) -> Result<(), String> {
    crate::daemon_cgroup::join(&p.cgroups)?;
    nix::unistd::setsid().map_err(|e| format!("setsid: {e}"))?;
    let Some(shm) = &p.shm else { return Ok(()) };
    let step = |what: &str, r: nix::Result<()>| r.map_err(|e| format!("{what}: {e}"));
    step(
        "unshare the mount namespace",
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS),
    )?;
    step(
        "make / a slave mount",
        nix::mount::mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_REC | MsFlags::MS_SLAVE,
            None::<&str>,
        ),
    )?;
    step(
        &format!("bind {} on {DEV_SHM}", shm.display()),
        nix::mount::mount(
            Some(shm),
            DEV_SHM,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        ),
    )
}

/// The launcher side (`args`: what follows [`EXEC_FLAG`]): prepare this
/// process as the module says, then exec the program. On any failure it
/// execs nothing and exits 1 (2 for a bad command line), saying on stderr
/// which step failed, and on what path.
#[must_use]
pub fn exec_main(args: &[OsString]) -> ExitCode {
    let plan = match parse(args) {
        Ok(p) => p,
        Err(e) => {
            eprintln!(
                "carve MPS launcher: {e}; usage: {EXEC_FLAG} [--cgroup <dir>]… [--shm <dir>] -- <program> [args…]"
            );
            return ExitCode::from(2);
        }
    };
    if let Err(e) = prepare(&plan) {
        eprintln!("carve MPS launcher: {e}");
        return ExitCode::from(1);
    }
    let e = Command::new(&plan.program).args(&plan.args).exec();
    eprintln!(
        "carve MPS launcher: exec {}: {e}",
        Path::new(&plan.program).display()
    );
    ExitCode::from(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(a: &[&str]) -> Vec<OsString> {
        a.iter().map(OsString::from).collect()
    }

    #[test]
    fn the_command_line_round_trips() {
        let c = command(
            Path::new("/carve"),
            &[PathBuf::from("/cg/a/u"), PathBuf::from("/cg/b/u")],
            Some(Path::new("/m/u/shm")),
            Path::new("/bin/ctl"),
        );
        let mut args: Vec<OsString> = c.get_args().map(OsString::from).collect();
        assert_eq!(args.remove(0), EXEC_FLAG);
        args.extend(os(&["-d", "--", "x"]));
        assert_eq!(
            parse(&args).unwrap(),
            Plan {
                cgroups: vec!["/cg/a/u".into(), "/cg/b/u".into()],
                shm: Some("/m/u/shm".into()),
                program: "/bin/ctl".into(),
                args: os(&["-d", "--", "x"]),
            }
        );
        let plain = parse(&os(&["--", "/bin/ctl"])).unwrap();
        assert!(plain.cgroups.is_empty() && plain.shm.is_none());
    }

    #[test]
    fn bad_command_lines_are_refused() {
        for bad in [
            &[][..],
            &["/bin/ctl"],
            &["--cgroup"],
            &["--shm", "/x"],
            &["--"],
            &["--what", "--", "/bin/ctl"],
        ] {
            assert!(parse(&os(bad)).is_err(), "{bad:?}");
        }
    }
}
