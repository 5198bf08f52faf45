//! Built-in GPU model tables: fixtures for the NVML simulator and the tests.
//!
//! Sources: `shared/reference/dra-api.md` section D.2 (NVIDIA MIG user guide,
//! `nvidia-smi mig -lgip`/`-lgipp` captures). Every profile whose values are not
//! all from a primary source carries `inferred: true`; the doc comment of each
//! model says which values are inferred. On real hardware carve reads all of this
//! from NVML; these tables are never the only source there.

use crate::spec::{Architecture, Engines, GpuSpec, MigProfile, Placement};

/// A built-in GPU model.
#[derive(Clone, Copy, Debug)]
pub struct GpuModel {
    /// Short key used on the command line, e.g. `h100-80gb`.
    pub key: &'static str,
    /// Other accepted spellings.
    pub aliases: &'static [&'static str],
    build: fn() -> GpuSpec,
}

impl GpuModel {
    /// The model's full specification.
    #[must_use]
    pub fn spec(&self) -> GpuSpec {
        (self.build)()
    }

    /// Look a model up by key or alias (case-insensitive).
    #[must_use]
    pub fn find(key: &str) -> Option<&'static GpuModel> {
        let k = key.to_ascii_lowercase();
        MODELS
            .iter()
            .find(|m| m.key == k || m.aliases.contains(&k.as_str()))
    }

    /// Every key, for error messages.
    #[must_use]
    pub fn keys() -> Vec<&'static str> {
        MODELS.iter().map(|m| m.key).collect()
    }
}

/// Every built-in model.
pub static MODELS: &[GpuModel] = &[
    GpuModel {
        key: "a100-40gb",
        aliases: &["a100", "a100-40"],
        build: a100_40gb,
    },
    GpuModel {
        key: "a100-80gb",
        aliases: &["a100-80"],
        build: a100_80gb,
    },
    GpuModel {
        key: "a30-24gb",
        aliases: &["a30"],
        build: a30_24gb,
    },
    GpuModel {
        key: "h100-80gb",
        aliases: &["h100", "h100-80"],
        build: h100_80gb,
    },
    GpuModel {
        key: "h100-94gb",
        aliases: &["h100-nvl", "h100-94"],
        build: h100_94gb,
    },
    GpuModel {
        key: "h200-141gb",
        aliases: &["h200", "h200-141"],
        build: h200_141gb,
    },
    GpuModel {
        key: "b200-180gb",
        aliases: &["b200", "b200-180"],
        build: b200_180gb,
    },
    GpuModel {
        key: "l4-24gb",
        aliases: &["l4"],
        build: l4_24gb,
    },
];

/// Engines shorthand: copy, decoders, encoders, jpeg, ofa.
const fn eng(copy: u32, decoders: u32, encoders: u32, jpeg: u32, ofa: u32) -> Engines {
    Engines {
        copy,
        decoders,
        encoders,
        jpeg,
        ofa,
    }
}

struct P {
    name: &'static str,
    index: u32,
    id: u32,
    mem: u8,
    compute: u8,
    sms: u32,
    mib: u64,
    engines: Engines,
    max: u8,
    starts: &'static [u8],
    inferred: bool,
}

fn build(ps: &[P]) -> Vec<MigProfile> {
    ps.iter()
        .map(|p| MigProfile {
            name: p.name.to_string(),
            index: p.index,
            id: p.id,
            memory_slices: p.mem,
            compute_slices: p.compute,
            multiprocessors: p.sms,
            memory_mib: p.mib,
            engines: p.engines,
            max_instances: p.max,
            placements: p.starts.iter().map(|&s| Placement::new(s, p.mem)).collect(),
            media_extensions: p.name.ends_with("+me"),
            inferred: p.inferred,
        })
        .collect()
}

const ALL7: &[u8] = &[0, 1, 2, 3, 4, 5, 6];
const EVEN4: &[u8] = &[0, 2, 4, 6];
const EVEN3: &[u8] = &[0, 2, 4];
const HALVES: &[u8] = &[0, 4];
const ZERO: &[u8] = &[0];

/// A100-SXM4-40GB. Ids, placements, SMs and memory from the MIG guide;
/// engine counts are inferred (marked per profile).
fn a100_40gb() -> GpuSpec {
    a100(
        "NVIDIA A100-SXM4-40GB",
        40960,
        [4864, 9984, 9984, 20096, 20096, 40448],
        [
            "1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb",
        ],
    )
}

/// A100-SXM4-80GB: same ids and placements as the 40GB part (MIG guide note);
/// per-profile memory is inferred as twice the 40GB values.
fn a100_80gb() -> GpuSpec {
    a100(
        "NVIDIA A100-SXM4-80GB",
        81920,
        [9728, 19968, 19968, 40192, 40192, 80896],
        [
            "1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb",
        ],
    )
}

fn a100(product: &str, total_mib: u64, mib: [u64; 6], n: [&'static str; 6]) -> GpuSpec {
    let me: &'static str = Box::leak(format!("{}+me", n[0]).into_boxed_str());
    GpuSpec {
        product_name: product.into(),
        architecture: Architecture::Ampere,
        cuda_compute_capability: (8, 0),
        memory_mib: total_mib,
        multiprocessors: 108,
        memory_slices: 8,
        compute_slices: 7,
        engines: eng(7, 5, 0, 1, 1),
        mig_capable: true,
        profiles: build(&[
            P {
                name: n[0],
                index: 0,
                id: 19,
                mem: 1,
                compute: 1,
                sms: 14,
                mib: mib[0],
                engines: eng(1, 0, 0, 0, 0),
                max: 7,
                starts: ALL7,
                inferred: true,
            },
            P {
                name: me,
                index: 7,
                id: 20,
                mem: 1,
                compute: 1,
                sms: 14,
                mib: mib[0],
                engines: eng(1, 1, 0, 1, 1),
                max: 1,
                starts: ALL7,
                inferred: true,
            },
            P {
                name: n[1],
                index: 9,
                id: 15,
                mem: 2,
                compute: 1,
                sms: 14,
                mib: mib[1],
                engines: eng(1, 1, 0, 0, 0),
                max: 4,
                starts: EVEN4,
                inferred: true,
            },
            P {
                name: n[2],
                index: 1,
                id: 14,
                mem: 2,
                compute: 2,
                sms: 28,
                mib: mib[2],
                engines: eng(2, 1, 0, 0, 0),
                max: 3,
                starts: EVEN3,
                inferred: true,
            },
            P {
                name: n[3],
                index: 2,
                id: 9,
                mem: 4,
                compute: 3,
                sms: 42,
                mib: mib[3],
                engines: eng(3, 2, 0, 0, 0),
                max: 2,
                starts: HALVES,
                inferred: true,
            },
            P {
                name: n[4],
                index: 3,
                id: 5,
                mem: 4,
                compute: 4,
                sms: 56,
                mib: mib[4],
                engines: eng(4, 2, 0, 0, 0),
                max: 1,
                starts: ZERO,
                inferred: true,
            },
            P {
                name: n[5],
                index: 4,
                id: 0,
                mem: 8,
                compute: 7,
                sms: 98,
                mib: mib[5],
                engines: eng(7, 5, 0, 1, 1),
                max: 1,
                starts: ZERO,
                inferred: true,
            },
        ]),
    }
}

/// A30-24GB: 4 memory and 4 compute slices. Ids and placements from a user
/// capture; `2g.12gb+me` id and placements, and all engine counts, inferred.
fn a30_24gb() -> GpuSpec {
    GpuSpec {
        product_name: "NVIDIA A30".into(),
        architecture: Architecture::Ampere,
        cuda_compute_capability: (8, 0),
        memory_mib: 24576,
        multiprocessors: 56,
        memory_slices: 4,
        compute_slices: 4,
        engines: eng(4, 4, 0, 1, 1),
        mig_capable: true,
        profiles: build(&[
            P {
                name: "1g.6gb",
                index: 0,
                id: 14,
                mem: 1,
                compute: 1,
                sms: 14,
                mib: 5952,
                engines: eng(1, 0, 0, 0, 0),
                max: 4,
                starts: &[0, 1, 2, 3],
                inferred: true,
            },
            P {
                name: "1g.6gb+me",
                index: 7,
                id: 21,
                mem: 1,
                compute: 1,
                sms: 14,
                mib: 5952,
                engines: eng(1, 1, 0, 1, 1),
                max: 1,
                starts: &[0, 1, 2, 3],
                inferred: true,
            },
            P {
                name: "2g.12gb",
                index: 1,
                id: 5,
                mem: 2,
                compute: 2,
                sms: 28,
                mib: 11968,
                engines: eng(2, 2, 0, 0, 0),
                max: 2,
                starts: &[0, 2],
                inferred: true,
            },
            P {
                name: "2g.12gb+me",
                index: 8,
                id: 6,
                mem: 2,
                compute: 2,
                sms: 28,
                mib: 11968,
                engines: eng(2, 2, 0, 1, 1),
                max: 1,
                starts: &[0, 2],
                inferred: true,
            },
            P {
                name: "4g.24gb",
                index: 3,
                id: 0,
                mem: 4,
                compute: 4,
                sms: 56,
                mib: 24064,
                engines: eng(4, 4, 0, 1, 1),
                max: 1,
                starts: ZERO,
                inferred: true,
            },
        ]),
    }
}

/// Hopper/Blackwell profile set: `[1g, 1g+me, 1g 2-slice, 2g, 3g, 4g, 7g]`.
struct Hopper {
    product: &'static str,
    arch: Architecture,
    cc: (u32, u32),
    total_mib: u64,
    total_sms: u32,
    names: [&'static str; 7],
    mib: [u64; 7],
    sms: [u32; 7],
    engines: [Engines; 7],
    whole: Engines,
    inferred: bool,
}

fn hopper(h: &Hopper) -> GpuSpec {
    let ids = [19, 20, 15, 14, 9, 5, 0];
    let idx = [0, 7, 9, 1, 2, 3, 4];
    let mem = [1, 1, 2, 2, 4, 4, 8];
    let compute = [1, 1, 1, 2, 3, 4, 7];
    let max = [7, 1, 4, 3, 2, 1, 1];
    let starts = [ALL7, ALL7, EVEN4, EVEN3, HALVES, ZERO, ZERO];
    let ps: Vec<P> = (0..7)
        .map(|i| P {
            name: h.names[i],
            index: idx[i],
            id: ids[i],
            mem: mem[i],
            compute: compute[i],
            sms: h.sms[i],
            mib: h.mib[i],
            engines: h.engines[i],
            max: max[i],
            starts: starts[i],
            inferred: h.inferred,
        })
        .collect();
    GpuSpec {
        product_name: h.product.into(),
        architecture: h.arch,
        cuda_compute_capability: h.cc,
        memory_mib: h.total_mib,
        multiprocessors: h.total_sms,
        memory_slices: 8,
        compute_slices: 7,
        engines: h.whole,
        mig_capable: true,
        profiles: build(&ps),
    }
}

/// Engines of H100/H200 profiles: read through NVML on a real H200 (agreeing
/// with the MIG guide's media units); inferred for the H100s.
const HOPPER_ENGINES: [Engines; 7] = [
    eng(1, 1, 0, 1, 0),
    eng(1, 1, 0, 1, 1),
    eng(1, 1, 0, 1, 0),
    eng(2, 2, 0, 2, 0),
    eng(3, 3, 0, 3, 0),
    eng(4, 4, 0, 4, 0),
    eng(8, 7, 0, 7, 1),
];
const HOPPER_SMS: [u32; 7] = [16, 16, 26, 32, 60, 64, 132];

/// H100-SXM5-80GB. Ids, SMs and memory from an lgip capture; placements inferred
/// identical to H100 NVL's lgipp capture; copy engines inferred.
fn h100_80gb() -> GpuSpec {
    hopper(&Hopper {
        product: "NVIDIA H100 80GB HBM3",
        arch: Architecture::Hopper,
        cc: (9, 0),
        total_mib: 81559,
        total_sms: 132,
        names: [
            "1g.10gb",
            "1g.10gb+me",
            "1g.20gb",
            "2g.20gb",
            "3g.40gb",
            "4g.40gb",
            "7g.80gb",
        ],
        mib: [9984, 9984, 20096, 20096, 40448, 40448, 81152],
        sms: HOPPER_SMS,
        engines: HOPPER_ENGINES,
        whole: eng(8, 7, 0, 7, 1),
        inferred: true,
    })
}

/// H100 NVL 94GB: lgip and lgipp captured on real hardware (driver 560.35.03);
/// engines inferred as H100's.
fn h100_94gb() -> GpuSpec {
    hopper(&Hopper {
        product: "NVIDIA H100 NVL",
        arch: Architecture::Hopper,
        cc: (9, 0),
        total_mib: 95830,
        total_sms: 132,
        names: [
            "1g.12gb",
            "1g.12gb+me",
            "1g.24gb",
            "2g.24gb",
            "3g.47gb",
            "4g.47gb",
            "7g.94gb",
        ],
        mib: [11008, 11008, 22144, 22144, 47488, 47488, 95360],
        sms: HOPPER_SMS,
        engines: HOPPER_ENGINES,
        whole: eng(8, 7, 0, 7, 1),
        inferred: true,
    })
}

/// H200-141GB: every value read through NVML on a real H200 (driver 580.159.04,
/// MIG mode off; `carve nvml-probe`, kept in
/// `crates/carve-nvml/tests/fixtures/hardware/`): profile ids and indexes,
/// slices, SMs, memory, engines, instance counts and placements. The
/// per-profile memory inferred earlier from H100 was wrong by up to 1 GiB.
fn h200_141gb() -> GpuSpec {
    hopper(&Hopper {
        product: "NVIDIA H200",
        arch: Architecture::Hopper,
        cc: (9, 0),
        total_mib: 143771,
        total_sms: 132,
        names: [
            "1g.18gb",
            "1g.18gb+me",
            "1g.35gb",
            "2g.35gb",
            "3g.71gb",
            "4g.71gb",
            "7g.141gb",
        ],
        mib: [16384, 16384, 33280, 33280, 71424, 71424, 143360],
        sms: HOPPER_SMS,
        engines: HOPPER_ENGINES,
        whole: eng(8, 7, 0, 7, 1),
        inferred: false,
    })
}

/// B200-180GB: names, slices, media engines and copy engines from the MIG guide
/// (Table 9); ids, placements, SMs and per-profile memory UNVERIFIED/inferred.
fn b200_180gb() -> GpuSpec {
    hopper(&Hopper {
        product: "NVIDIA B200",
        arch: Architecture::Blackwell,
        cc: (10, 0),
        total_mib: 183359,
        total_sms: 148,
        names: [
            "1g.23gb",
            "1g.23gb+me",
            "1g.45gb",
            "2g.45gb",
            "3g.90gb",
            "4g.90gb",
            "7g.180gb",
        ],
        mib: [23040, 23040, 45568, 45568, 91392, 91392, 182528],
        sms: [18, 18, 18, 36, 54, 72, 148],
        engines: [
            eng(2, 1, 0, 1, 0),
            eng(2, 1, 0, 1, 1),
            eng(2, 1, 0, 1, 0),
            eng(3, 1, 0, 1, 0),
            eng(6, 1, 0, 1, 0),
            eng(8, 1, 0, 1, 0),
            eng(16, 1, 0, 1, 1),
        ],
        whole: eng(16, 7, 0, 7, 1),
        inferred: true,
    })
}

/// L4: not MIG-capable; publishes only the whole GPU.
fn l4_24gb() -> GpuSpec {
    GpuSpec {
        product_name: "NVIDIA L4".into(),
        architecture: Architecture::Other,
        cuda_compute_capability: (8, 9),
        memory_mib: 23034,
        multiprocessors: 58,
        memory_slices: 0,
        compute_slices: 0,
        engines: eng(2, 4, 2, 4, 1),
        mig_capable: false,
        profiles: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_model_validates() {
        for m in MODELS {
            m.spec()
                .validate()
                .unwrap_or_else(|e| panic!("{}: {e}", m.key));
        }
    }

    #[test]
    fn lookup_by_alias_and_case() {
        assert_eq!(GpuModel::find("H100").map(|m| m.key), Some("h100-80gb"));
        assert_eq!(GpuModel::find("h200").map(|m| m.key), Some("h200-141gb"));
        assert!(GpuModel::find("v100").is_none());
    }

    #[test]
    fn profile_index_is_not_profile_id() {
        let a30 = GpuModel::find("a30").unwrap().spec();
        assert_eq!(a30.profile("1g.6gb").unwrap().id, 14);
        let h100 = GpuModel::find("h100").unwrap().spec();
        assert_eq!(h100.profile("1g.10gb").unwrap().id, 19);
        assert_eq!(h100.profile("1g.10gb").unwrap().index, 0);
        assert_eq!(h100.profile("7g.80gb").unwrap().index, 4);
    }
}
