//! Device order inside a pool: a placement policy.
//!
//! The scheduler's allocator walks a pool's devices in published order and takes
//! the first that fits. The order carve publishes therefore decides where a new
//! partition lands. [`carve_rank`] orders the placements of one profile so that
//! first-fit packs small partitions onto the placements that block the fewest
//! larger ones, and onto already-used GPUs before empty ones.

use crate::spec::{GpuSpec, Placement};

/// A device order policy for the MIG placements of a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceOrder {
    /// Sorted by device name, as NVIDIA's driver publishes them.
    Name,
    /// Lowest GPU, then lowest placement start.
    FirstFit,
    /// carve's order: lowest GPU, then the placement that blocks the least.
    Carve,
}

/// How much capacity of larger profiles a placement of `profile` blocks: the
/// sum, over every placement of every profile with more memory slices, of the
/// compute slices of that placement if the two overlap. Lower blocks less.
#[must_use]
pub fn blocking_cost(spec: &GpuSpec, profile: usize, placement: Placement) -> u32 {
    let me = &spec.profiles[profile];
    let mut cost = 0;
    for other in &spec.profiles {
        if other.memory_slices <= me.memory_slices || other.media_extensions {
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

/// Placement starts of `profile` in carve's order: least blocking first; among
/// equals, the higher start (keeps slice 0, which 4g and 7g need, free longest).
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

/// Starts of `profile` in the order a policy publishes them within one GPU.
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
        DeviceOrder::Carve => carve_rank(spec, profile),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::GpuModel;

    #[test]
    fn carve_puts_small_profiles_away_from_slice_zero() {
        let s = GpuModel::find("h100").unwrap().spec();
        let p1 = s.profiles.iter().position(|p| p.name == "1g.10gb").unwrap();
        let r = carve_rank(&s, p1);
        assert_eq!(r.len(), 7);
        assert_ne!(r[0], 0, "1g first at slice 0 would block 4g and 7g: {r:?}");
        assert_eq!(*r.last().unwrap(), 0);
        let p3 = s.profiles.iter().position(|p| p.name == "3g.40gb").unwrap();
        assert_eq!(carve_rank(&s, p3), vec![4, 0]);
    }
}
