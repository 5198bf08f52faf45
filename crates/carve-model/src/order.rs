//! Device order inside a pool: a placement policy.
//!
//! The scheduler's allocator walks a pool's devices in published order and takes
//! the first that fits. The order carve publishes therefore decides where a new
//! partition lands. Only the order among devices of the same profile matters (a
//! claim asks for one profile), so every function here orders the devices of
//! one profile.
//!
//! # carve's order ([`DeviceOrder::Carve`], [`node_device_order`])
//!
//! For one profile on a node, devices are sorted by
//! 1. **tier** ([`placement_tier`]): first the placements that leave every
//!    larger single-placement profile possible (on H100/A100: the right half,
//!    memory slices 4–7, which `4g` never needs), then the others;
//! 2. **GPU index**, ascending;
//! 3. **placement rank** ([`carve_rank`]): least blocking first
//!    ([`blocking_cost`]), ties to the higher start.
//!
//! What it achieves (`carve bench fragmentation`, openb trace mapped to H100
//! MIG profiles; figures, commands and caveats in `docs/benchmarks.md`,
//! "Fragmentation"): inside a modelled kube-scheduler with its default
//! LeastAllocated scoring, the lowest mean unallocated compute over 100–130 %
//! arrived of every policy compared, best-fit and a re-packing heuristic
//! included (default trace 3.90 % against 5.79 % for name order, −33 %;
//! `gpushare100` 5.53 % against 10.09 %, −45 %; medians over seeds 1–50), and
//! re-pack-avoidable failures of 0.016 % of capacity on the default trace.
//! Under MostAllocated every order lands within about 0.5 points of every
//! other. Against the exact per-node optimum (one node, forced placement) it
//! is 0.15–1.23 points off, where best-fit and a GPU-major order are
//! 0.00–0.98: the tier key spreads small profiles over the right halves of
//! many GPUs, which keeps `4g` homes (good in a cluster, where a rejected
//! task gets another node) but uses up empty GPUs a single node needs for
//! `7g`. Name and first-fit put `3g` at slice 0 and small profiles at low
//! slices, which forbids `4g` (only placeable at 0) on that GPU. Windowed,
//! GPU-major and mixed variants were measured and lost in the cluster (see
//! the benchmarks document).

use crate::spec::{GpuSpec, Placement};

/// A device order policy for the MIG placements of a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceOrder {
    /// Sorted by NVIDIA-style device name as a string ([`nvidia_device_name`]).
    Name,
    /// Lowest GPU, then lowest placement start.
    FirstFit,
    /// carve's order: tier, then GPU, then least blocking placement.
    Carve,
}

/// Whether `a` is a larger profile than `b`: more compute or more memory slices.
fn larger(a: &crate::spec::MigProfile, b: &crate::spec::MigProfile) -> bool {
    a.compute_slices > b.compute_slices || a.memory_slices > b.memory_slices
}

/// How much capacity of larger profiles (more compute or more memory slices) a
/// placement of `profile` blocks: the sum, over every placement of every larger profile, of the
/// compute × memory slices of that placement if the two overlap. Lower blocks less.
#[must_use]
pub fn blocking_cost(spec: &GpuSpec, profile: usize, placement: Placement) -> u32 {
    let me = &spec.profiles[profile];
    let mut cost = 0;
    for other in &spec.profiles {
        if !larger(other, me) || other.media_extensions {
            continue;
        }
        for &pl in &other.placements {
            if pl.overlaps(placement) {
                cost += u32::from(other.compute_slices) * u32::from(other.memory_slices);
            }
        }
    }
    cost
}

/// 1 when a placement of `profile` overlaps every placement of some larger
/// profile (more compute or memory slices, not the whole GPU, not `+me`), i.e. it forbids
/// that profile on the GPU outright; 0 otherwise. On H100/A100 the tier-1
/// placements are exactly those touching memory slices 0–3, the only `4g` home.
#[must_use]
pub fn placement_tier(spec: &GpuSpec, profile: usize, placement: Placement) -> u8 {
    let me = &spec.profiles[profile];
    let forbids = spec.profiles.iter().any(|other| {
        larger(other, me)
            && other.compute_slices < spec.compute_slices
            && !other.media_extensions
            && !other.placements.is_empty()
            && other.placements.iter().all(|&pl| pl.overlaps(placement))
    });
    u8::from(forbids)
}

/// Placement starts of `profile` in carve's order within one GPU: least
/// blocking first; among equals, the higher start (keeps slice 0, which 4g and
/// 7g need, free longest).
#[must_use]
pub fn carve_rank(spec: &GpuSpec, profile: usize) -> Vec<u8> {
    let mut pls: Vec<Placement> = spec.profiles[profile].placements.clone();
    pls.sort_by_key(|&pl| {
        (
            blocking_cost(spec, profile, pl),
            std::cmp::Reverse(pl.start),
        )
    });
    pls.into_iter().map(|pl| pl.start).collect()
}

/// Starts of `profile` in the order a policy visits them within one GPU
/// (for [`DeviceOrder::Carve`]: tier, then [`carve_rank`]).
#[must_use]
pub fn placement_order(spec: &GpuSpec, profile: usize, order: DeviceOrder) -> Vec<u8> {
    match order {
        DeviceOrder::Name | DeviceOrder::FirstFit => {
            let mut s: Vec<u8> = spec.profiles[profile]
                .placements
                .iter()
                .map(|p| p.start)
                .collect();
            s.sort_unstable();
            s
        }
        DeviceOrder::Carve => {
            let size = spec.profiles[profile].memory_slices;
            let mut r = carve_rank(spec, profile);
            r.sort_by_key(|&s| placement_tier(spec, profile, Placement::new(s, size)));
            r
        }
    }
}

/// The NVIDIA-style device name of a MIG placement,
/// `gpu-<gpu>-mig-<profile token>-<profile id>-<start>`; [`DeviceOrder::Name`]
/// sorts these as strings (so `gpu-10` sorts before `gpu-2`).
#[must_use]
pub fn nvidia_device_name(spec: &GpuSpec, gpu: u32, profile: usize, start: u8) -> String {
    let p = &spec.profiles[profile];
    let token = crate::names::ProfileToken::from_profile_name(&p.name).map_or_else(
        || p.name.replace(['.', '+'], ""),
        |t| t.as_str().to_string(),
    );
    format!("gpu-{gpu}-mig-{token}-{}-{start}", p.id)
}

/// The sort key of a device under [`DeviceOrder::Carve`] among the devices of
/// the same profile on a node: `(tier, gpu, position in carve_rank)`. Sorting
/// a node's devices by `(profile, carve_device_key)` gives carve's published
/// order ([`node_device_order`] for one profile).
#[must_use]
pub fn carve_device_key(spec: &GpuSpec, profile: usize, gpu: u32, start: u8) -> (u8, u32, usize) {
    let size = spec.profiles[profile].memory_slices;
    let rank = carve_rank(spec, profile)
        .iter()
        .position(|&s| s == start)
        .unwrap_or(usize::MAX);
    (
        placement_tier(spec, profile, Placement::new(start, size)),
        gpu,
        rank,
    )
}

/// Every device of `profile` on a node with `gpu_count` GPUs of `spec`, as
/// `(gpu index, placement start)`, in the order a policy publishes them. The
/// allocator takes the first free one, so this is the whole placement policy.
///
/// - `Name`: NVIDIA-style names sorted as strings.
/// - `FirstFit`: GPU, then start.
/// - `Carve`: [`placement_tier`], then GPU, then [`carve_rank`] — *not*
///   GPU-major: every GPU's tier-0 placements come before any tier-1 one.
#[must_use]
pub fn node_device_order(
    spec: &GpuSpec,
    gpu_count: u32,
    profile: usize,
    order: DeviceOrder,
) -> Vec<(u32, u8)> {
    let starts = placement_order(spec, profile, order);
    let mut out: Vec<(u32, u8)> = (0..gpu_count)
        .flat_map(|g| starts.iter().map(move |&s| (g, s)))
        .collect();
    match order {
        DeviceOrder::Name => {
            out.sort_by_cached_key(|&(g, s)| nvidia_device_name(spec, g, profile, s));
        }
        DeviceOrder::FirstFit => {}
        DeviceOrder::Carve => {
            let size = spec.profiles[profile].memory_slices;
            // Stable: within a tier and GPU the carve_rank order is kept.
            out.sort_by_key(|&(g, s)| (placement_tier(spec, profile, Placement::new(s, size)), g));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::{GpuModel, MODELS};

    fn h100() -> GpuSpec {
        GpuModel::find("h100").unwrap().spec()
    }

    fn idx(s: &GpuSpec, name: &str) -> usize {
        s.profiles.iter().position(|p| p.name == name).unwrap()
    }

    #[test]
    fn carve_puts_small_profiles_away_from_slice_zero() {
        let s = h100();
        let p1 = idx(&s, "1g.10gb");
        let r = carve_rank(&s, p1);
        assert_eq!(r, vec![6, 5, 4, 3, 2, 1, 0]);
        assert_eq!(carve_rank(&s, idx(&s, "3g.40gb")), vec![4, 0]);
        assert_eq!(carve_rank(&s, idx(&s, "2g.20gb")), vec![4, 2, 0]);
    }

    #[test]
    fn every_order_is_a_permutation_of_the_devices() {
        for m in MODELS.iter().filter(|m| m.spec().mig_capable) {
            let s = m.spec();
            for p in 0..s.profiles.len() {
                let mut all: Vec<(u32, u8)> = (0..11)
                    .flat_map(|g| s.profiles[p].placements.iter().map(move |pl| (g, pl.start)))
                    .collect();
                all.sort_unstable();
                for o in [DeviceOrder::Name, DeviceOrder::FirstFit, DeviceOrder::Carve] {
                    let mut v = node_device_order(&s, 11, p, o);
                    v.sort_unstable();
                    assert_eq!(v, all, "{} {} {o:?}", m.key, s.profiles[p].name);
                    let mut st = placement_order(&s, p, o);
                    st.sort_unstable();
                    let mut want: Vec<u8> =
                        s.profiles[p].placements.iter().map(|pl| pl.start).collect();
                    want.sort_unstable();
                    assert_eq!(st, want);
                }
            }
        }
    }

    #[test]
    fn tiers_on_h100_and_a30() {
        let s = h100();
        let p1 = idx(&s, "1g.10gb");
        let tiers: Vec<u8> = (0..7)
            .map(|st| placement_tier(&s, p1, Placement::new(st, 1)))
            .collect();
        assert_eq!(tiers, vec![1, 1, 1, 1, 0, 0, 0]);
        assert_eq!(
            placement_tier(&s, idx(&s, "3g.40gb"), Placement::new(4, 4)),
            0
        );
        assert_eq!(
            placement_tier(&s, idx(&s, "3g.40gb"), Placement::new(0, 4)),
            1
        );
        assert_eq!(
            placement_tier(&s, idx(&s, "4g.40gb"), Placement::new(0, 4)),
            0
        );
        // A30's only single-placement profile is the whole GPU: one tier.
        let a30 = GpuModel::find("a30").unwrap().spec();
        for (p, prof) in a30.profiles.iter().enumerate() {
            for &pl in &prof.placements {
                assert_eq!(placement_tier(&a30, p, pl), 0, "{}", prof.name);
            }
        }
    }

    #[test]
    fn carve_visits_every_right_half_before_any_left_half() {
        let s = h100();
        let p3 = idx(&s, "3g.40gb");
        assert_eq!(
            node_device_order(&s, 2, p3, DeviceOrder::Carve),
            vec![(0, 4), (1, 4), (0, 0), (1, 0)]
        );
        let v = node_device_order(&s, 3, idx(&s, "1g.10gb"), DeviceOrder::Carve);
        assert_eq!(&v[..4], &[(0, 6), (0, 5), (0, 4), (1, 6)]);
        let first_left = v.iter().position(|&(_, st)| st < 4).unwrap();
        assert_eq!(first_left, 9, "all 3 × 3 right-half starts first: {v:?}");
        assert_eq!(v[first_left], (0, 3));
    }

    #[test]
    fn carve_device_key_sorts_like_node_device_order() {
        for m in MODELS.iter().filter(|m| m.spec().mig_capable) {
            let s = m.spec();
            for p in 0..s.profiles.len() {
                let mut v = node_device_order(&s, 4, p, DeviceOrder::FirstFit);
                v.sort_by_key(|&(g, st)| carve_device_key(&s, p, g, st));
                assert_eq!(
                    v,
                    node_device_order(&s, 4, p, DeviceOrder::Carve),
                    "{}",
                    m.key
                );
            }
        }
    }

    #[test]
    fn name_order_is_lexicographic() {
        let s = h100();
        let p = idx(&s, "7g.80gb");
        let v = node_device_order(&s, 12, p, DeviceOrder::Name);
        let gpus: Vec<u32> = v.iter().map(|&(g, _)| g).collect();
        assert_eq!(gpus, vec![0, 1, 10, 11, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(
            nvidia_device_name(&s, 3, idx(&s, "1g.10gb"), 5),
            "gpu-3-mig-1g10gb-19-5"
        );
        // Up to 10 GPUs name order equals first-fit.
        for p in 0..s.profiles.len() {
            assert_eq!(
                node_device_order(&s, 8, p, DeviceOrder::Name),
                node_device_order(&s, 8, p, DeviceOrder::FirstFit)
            );
        }
    }
}
