//! Device names: DNS labels that parse back to (GPU index, profile, placement)
//! without any other state.
//!
//! | device | name |
//! |---|---|
//! | whole GPU | `gpu-0` |
//! | MIG placement | `gpu-0-mig-1g10gb-3` (profile `1g.10gb`, start 3) |
//! | MIG placement with media extensions | `gpu-0-mig-1g10gbme-3` |
//! | MPS share of a whole GPU | `gpu-0-mps` |
//! | MPS share of a MIG placement | `gpu-0-mig-1g10gb-3-mps` |
//! | time-sliced whole GPU | `gpu-0-ts` |

use std::fmt;
use std::str::FromStr;

/// Profile suffixes and their name tokens. Order matters for parsing: longer
/// tokens first.
const SUFFIXES: &[(&str, &str)] = &[
    ("+me.all", "meall"),
    ("+gfx", "gfx"),
    ("-me", "nome"),
    ("+me", "me"),
    ("", ""),
];

/// A MIG profile name in DNS-label form, e.g. `1g10gbme` for `1g.10gb+me`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProfileToken(String);

impl ProfileToken {
    /// Token for a profile name like `1g.10gb+me`; `None` if the name is not of the
    /// form `<n>g.<m>gb[suffix]`.
    #[must_use]
    pub fn from_profile_name(name: &str) -> Option<Self> {
        let (g, rest) = name.split_once("g.")?;
        if g.is_empty() || !g.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let gb = rest.find("gb")?;
        let mem = &rest[..gb];
        if mem.is_empty() || !mem.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let suffix = &rest[gb + 2..];
        let (_, tok) = SUFFIXES.iter().find(|(s, _)| *s == suffix)?;
        Some(Self(format!("{g}g{mem}gb{tok}")))
    }

    /// The profile name this token stands for.
    #[must_use]
    pub fn profile_name(&self) -> String {
        // Every token is built by `from_profile_name` or checked by `parse`,
        // so it always splits.
        split_token(&self.0).map_or_else(String::new, |(g, mem, suffix)| {
            format!("{g}g.{mem}gb{suffix}")
        })
    }

    /// The token text.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A token as it appears in a device name: `<n>g<m>gb<suffix token>`, in
    /// the one spelling `from_profile_name` gives (no leading zeros).
    fn parse(tok: &str) -> Option<Self> {
        let (g, mem, suffix) = split_token(tok)?;
        let t = Self::from_profile_name(&format!("{g}g.{mem}gb{suffix}"))?;
        let canonical = t.0 == tok && num::<u32>(g).is_some() && num::<u32>(mem).is_some();
        canonical.then_some(t)
    }
}

/// `<n>g<m>gb<suffix token>` into (n, m, profile suffix); `None` for anything
/// else, whatever the bytes.
fn split_token(tok: &str) -> Option<(&str, &str, &'static str)> {
    let (g, rest) = tok.split_once('g')?;
    let (mem, suffix_tok) = rest.split_once("gb")?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(g) || !digits(mem) {
        return None;
    }
    let (suffix, _) = SUFFIXES.iter().find(|(_, t)| *t == suffix_tok)?;
    Some((g, mem, suffix))
}

/// A parsed device name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceName {
    /// The whole GPU.
    Gpu {
        /// GPU index.
        gpu: u32,
    },
    /// A MIG placement.
    Mig {
        /// Parent GPU index.
        gpu: u32,
        /// Profile token.
        profile: ProfileToken,
        /// Placement start.
        start: u8,
    },
    /// The MPS-shared whole GPU.
    Mps {
        /// GPU index.
        gpu: u32,
    },
    /// An MPS-shared MIG placement.
    MigMps {
        /// Parent GPU index.
        gpu: u32,
        /// Profile token.
        profile: ProfileToken,
        /// Placement start.
        start: u8,
    },
    /// The time-sliced whole GPU.
    TimeSlice {
        /// GPU index.
        gpu: u32,
    },
}

/// A device name that is not one of carve's.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "device name {name:?} is not a carve device name (expected gpu-<i>, gpu-<i>-mig-<profile>-<start>, gpu-<i>-mps, gpu-<i>-mig-<profile>-<start>-mps or gpu-<i>-ts): {why}"
)]
pub struct NameError {
    /// The name.
    pub name: String,
    /// What is wrong.
    pub why: &'static str,
}

impl DeviceName {
    /// A MIG placement device name.
    ///
    /// # Errors
    /// The profile name has no token form.
    pub fn mig(gpu: u32, profile: &str, start: u8) -> Result<Self, NameError> {
        let profile = ProfileToken::from_profile_name(profile).ok_or(NameError {
            name: profile.to_string(),
            why: "profile name has no DNS-label form",
        })?;
        Ok(Self::Mig {
            gpu,
            profile,
            start,
        })
    }

    /// The GPU index the device lives on.
    #[must_use]
    pub fn gpu(&self) -> u32 {
        match self {
            Self::Gpu { gpu }
            | Self::Mig { gpu, .. }
            | Self::Mps { gpu }
            | Self::MigMps { gpu, .. }
            | Self::TimeSlice { gpu } => *gpu,
        }
    }

    /// Profile name and start, for MIG devices.
    #[must_use]
    pub fn mig_placement(&self) -> Option<(String, u8)> {
        match self {
            Self::Mig { profile, start, .. } | Self::MigMps { profile, start, .. } => {
                Some((profile.profile_name(), *start))
            }
            _ => None,
        }
    }
}

impl fmt::Display for DeviceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Gpu { gpu } => write!(f, "gpu-{gpu}"),
            Self::Mig {
                gpu,
                profile,
                start,
            } => write!(f, "gpu-{gpu}-mig-{}-{start}", profile.as_str()),
            Self::Mps { gpu } => write!(f, "gpu-{gpu}-mps"),
            Self::MigMps {
                gpu,
                profile,
                start,
            } => write!(f, "gpu-{gpu}-mig-{}-{start}-mps", profile.as_str()),
            Self::TimeSlice { gpu } => write!(f, "gpu-{gpu}-ts"),
        }
    }
}

fn num<T: FromStr>(s: &str) -> Option<T> {
    if s.is_empty() || (s.len() > 1 && s.starts_with('0')) || !s.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    s.parse().ok()
}

impl FromStr for DeviceName {
    type Err = NameError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        let err = |why| NameError {
            name: name.to_string(),
            why,
        };
        let parts: Vec<&str> = name.split('-').collect();
        if parts.first() != Some(&"gpu") || parts.len() < 2 {
            return Err(err("must start with gpu-<index>"));
        }
        let gpu = num::<u32>(parts[1]).ok_or_else(|| err("GPU index is not a number"))?;
        match &parts[2..] {
            [] => Ok(Self::Gpu { gpu }),
            ["mps"] => Ok(Self::Mps { gpu }),
            ["ts"] => Ok(Self::TimeSlice { gpu }),
            ["mig", tok, start, rest @ ..] => {
                let profile =
                    ProfileToken::parse(tok).ok_or_else(|| err("unknown profile token"))?;
                let start =
                    num::<u8>(start).ok_or_else(|| err("placement start is not a number"))?;
                match rest {
                    [] => Ok(Self::Mig {
                        gpu,
                        profile,
                        start,
                    }),
                    ["mps"] => Ok(Self::MigMps {
                        gpu,
                        profile,
                        start,
                    }),
                    _ => Err(err("unexpected suffix")),
                }
            }
            _ => Err(err("unexpected suffix")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_every_kind() {
        for n in [
            "gpu-0",
            "gpu-12",
            "gpu-3-mps",
            "gpu-1-ts",
            "gpu-0-mig-1g10gb-3",
            "gpu-7-mig-1g10gbme-6",
            "gpu-2-mig-7g141gb-0-mps",
        ] {
            let d: DeviceName = n.parse().unwrap();
            assert_eq!(d.to_string(), n);
        }
    }

    #[test]
    fn profile_tokens_round_trip() {
        for p in [
            "1g.10gb",
            "1g.10gb+me",
            "7g.180gb",
            "1g.24gb+me.all",
            "2g.24gb-me",
            "1g.24gb+gfx",
        ] {
            let t = ProfileToken::from_profile_name(p).unwrap();
            assert_eq!(t.profile_name(), p);
        }
        assert_eq!(
            ProfileToken::from_profile_name("1g.10gb+me")
                .unwrap()
                .as_str(),
            "1g10gbme"
        );
    }

    proptest::proptest! {
        /// Any string parses or is refused, never panics; what parses prints
        /// back as itself.
        #[test]
        fn any_name_parses_or_is_refused(tail in "[-a-z0-9.+\u{e9}]{0,24}") {
            for name in [format!("gpu-0-mig-{tail}"), format!("gpu-{tail}"), tail.clone()] {
                if let Ok(d) = name.parse::<DeviceName>() {
                    proptest::prop_assert_eq!(d.to_string(), name);
                }
            }
        }
    }

    #[test]
    fn mig_name_parses_to_placement() {
        let d: DeviceName = "gpu-4-mig-3g40gb-4".parse().unwrap();
        assert_eq!(d.gpu(), 4);
        assert_eq!(d.mig_placement(), Some(("3g.40gb".to_string(), 4)));
    }

    #[test]
    fn bad_names_are_rejected_with_reason() {
        for n in [
            "",
            "gpu",
            "gpu-x",
            "gpu-01",
            "gpu-0-mig",
            "gpu-0-mig-1g10gb",
            "gpu-0-mig-1g10gb-x",
            "gpu-0-mig-10gb-1",
            "gpu-0-mig-1g10gbzz-1",
            "node-0",
            "gpu-0-foo",
            // Malformed profile tokens (the first was found by cargo fuzz:
            // an empty token once panicked).
            "gpu-0-mig--13",
            "gpu-0-mig-g-1",
            "gpu-0-mig-1g-1",
            "gpu-0-mig-1ggb-1",
            "gpu-0-mig-gb-1",
            "gpu-0-mig-01g10gb-1",
            "gpu-0-mig-1g010gb-1",
            "gpu-0-mig-1g10gbgb-1",
            "gpu-0-mig-\u{e9}g10gb-1",
        ] {
            let e = n.parse::<DeviceName>().unwrap_err();
            assert_eq!(e.name, n);
        }
    }
}
