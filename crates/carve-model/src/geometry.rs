//! Placement math on one GPU: which placements overlap, which stay free given the
//! existing instances, every valid layout, and how much of the GPU is stranded.

use serde::{Deserialize, Serialize};

use crate::spec::{Engines, GpuSpec, Placement};

/// One GPU instance: a profile (by position in [`GpuSpec::profiles`]) at a start.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Instance {
    /// Position of the profile in `GpuSpec::profiles`.
    pub profile: usize,
    /// Placement start (memory slice).
    pub start: u8,
}

/// A set of instances that can coexist on one GPU.
pub type Layout = Vec<Instance>;

/// Why an instance cannot be placed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Conflict {
    /// The profile index does not exist.
    #[error("no profile #{0}")]
    UnknownProfile(usize),
    /// The start is not an allowed placement of the profile.
    #[error("start {start} is not an allowed placement of {profile}")]
    NotAPlacement {
        /// Profile name.
        profile: String,
        /// Requested start.
        start: u8,
    },
    /// The placement shares memory slices with an existing instance.
    #[error("placement {placement} of {profile} overlaps {other} at {other_placement}")]
    Overlap {
        /// Profile name.
        profile: String,
        /// Requested placement.
        placement: Placement,
        /// Profile of the instance in the way.
        other: String,
        /// Its placement.
        other_placement: Placement,
    },
    /// Not enough compute slices left.
    #[error("{profile} needs {need} compute slices, {free} free")]
    ComputeExhausted {
        /// Profile name.
        profile: String,
        /// Needed.
        need: u8,
        /// Free.
        free: u8,
    },
    /// The profile's instance limit is reached.
    #[error("{profile} already has its maximum of {max} instances")]
    MaxInstances {
        /// Profile name.
        profile: String,
        /// The limit.
        max: u8,
    },
    /// A media-extension instance already exists.
    #[error("{profile} needs the media extensions, already held by another instance")]
    MediaExtensionsInUse {
        /// Profile name.
        profile: String,
    },
}

/// Stranded capacity of a GPU: free, but usable by no placement of any profile.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Stranded {
    /// Free memory slices that no feasible placement covers.
    pub memory_slices: u8,
    /// Free compute slices minus the most any extension of the layout can use.
    pub compute_slices: u8,
}

/// The instances on one GPU, with the bookkeeping to answer placement questions fast.
#[derive(Clone, Debug)]
pub struct Occupancy<'a> {
    spec: &'a GpuSpec,
    instances: Vec<Instance>,
    mem_mask: u16,
    compute_used: u8,
    per_profile: Vec<u8>,
    media_used: bool,
}

impl<'a> Occupancy<'a> {
    /// An empty GPU.
    #[must_use]
    pub fn new(spec: &'a GpuSpec) -> Self {
        Self {
            spec,
            instances: Vec::new(),
            mem_mask: 0,
            compute_used: 0,
            per_profile: vec![0; spec.profiles.len()],
            media_used: false,
        }
    }

    /// A GPU holding `instances`.
    ///
    /// # Errors
    /// The first instance that conflicts with the ones before it.
    pub fn with(spec: &'a GpuSpec, instances: &[Instance]) -> Result<Self, Conflict> {
        let mut o = Self::new(spec);
        for &i in instances {
            o.place(i)?;
        }
        Ok(o)
    }

    /// The GPU's spec.
    #[must_use]
    pub fn spec(&self) -> &'a GpuSpec {
        self.spec
    }

    /// Current instances, in placement order of arrival.
    #[must_use]
    pub fn instances(&self) -> &[Instance] {
        &self.instances
    }

    /// Bit mask of used memory slices.
    #[must_use]
    pub fn memory_mask(&self) -> u16 {
        self.mem_mask
    }

    /// Free memory slices.
    #[must_use]
    pub fn free_memory_slices(&self) -> u8 {
        self.spec.memory_slices - self.mem_mask.count_ones() as u8
    }

    /// Free compute slices.
    #[must_use]
    pub fn free_compute_slices(&self) -> u8 {
        self.spec.compute_slices - self.compute_used
    }

    /// Whether the GPU holds no instance.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.instances.is_empty()
    }

    /// Whether `inst` could be placed now, without saying why (no allocation:
    /// the hot path of layout enumeration and stranded-slice math).
    #[must_use]
    pub fn fits(&self, inst: Instance) -> bool {
        let Some(p) = self.spec.profiles.get(inst.profile) else {
            return false;
        };
        let Some(pl) = p.placements.iter().find(|pl| pl.start == inst.start) else {
            return false;
        };
        pl.mask() & self.mem_mask == 0
            && p.compute_slices <= self.free_compute_slices()
            && self.per_profile[inst.profile] < p.max_instances
            && !(p.media_extensions && self.media_used)
    }

    /// Whether `inst` could be placed now.
    ///
    /// # Errors
    /// Why it cannot.
    pub fn check(&self, inst: Instance) -> Result<(), Conflict> {
        let p = self
            .spec
            .profiles
            .get(inst.profile)
            .ok_or(Conflict::UnknownProfile(inst.profile))?;
        let Some(&pl) = p.placements.iter().find(|pl| pl.start == inst.start) else {
            return Err(Conflict::NotAPlacement {
                profile: p.name.clone(),
                start: inst.start,
            });
        };
        if pl.mask() & self.mem_mask != 0 {
            let other = self
                .instances
                .iter()
                .find(|o| {
                    Placement::new(o.start, self.spec.profiles[o.profile].memory_slices)
                        .overlaps(pl)
                })
                .copied()
                .unwrap_or(inst);
            let op = &self.spec.profiles[other.profile];
            return Err(Conflict::Overlap {
                profile: p.name.clone(),
                placement: pl,
                other: op.name.clone(),
                other_placement: Placement::new(other.start, op.memory_slices),
            });
        }
        if p.compute_slices > self.free_compute_slices() {
            return Err(Conflict::ComputeExhausted {
                profile: p.name.clone(),
                need: p.compute_slices,
                free: self.free_compute_slices(),
            });
        }
        if self.per_profile[inst.profile] >= p.max_instances {
            return Err(Conflict::MaxInstances {
                profile: p.name.clone(),
                max: p.max_instances,
            });
        }
        if p.media_extensions && self.media_used {
            return Err(Conflict::MediaExtensionsInUse {
                profile: p.name.clone(),
            });
        }
        Ok(())
    }

    /// Place `inst`.
    ///
    /// # Errors
    /// Why it cannot be placed; the occupancy is unchanged then.
    pub fn place(&mut self, inst: Instance) -> Result<(), Conflict> {
        self.check(inst)?;
        self.place_unchecked(inst);
        Ok(())
    }

    /// Place an instance already known to fit (see [`Self::fits`]).
    fn place_unchecked(&mut self, inst: Instance) {
        let p = &self.spec.profiles[inst.profile];
        self.mem_mask |= Placement::new(inst.start, p.memory_slices).mask();
        self.compute_used += p.compute_slices;
        self.per_profile[inst.profile] += 1;
        self.media_used |= p.media_extensions;
        self.instances.push(inst);
    }

    /// Remove `inst`; returns whether it was there. Frees exactly its slices.
    pub fn remove(&mut self, inst: Instance) -> bool {
        let Some(pos) = self.instances.iter().position(|&i| i == inst) else {
            return false;
        };
        self.instances.swap_remove(pos);
        let p = &self.spec.profiles[inst.profile];
        self.mem_mask &= !Placement::new(inst.start, p.memory_slices).mask();
        self.compute_used -= p.compute_slices;
        self.per_profile[inst.profile] -= 1;
        if p.media_extensions {
            self.media_used = false;
        }
        true
    }

    /// Every instance that could be placed now.
    pub fn feasible(&self) -> impl Iterator<Item = Instance> + '_ {
        self.spec
            .profiles
            .iter()
            .enumerate()
            .flat_map(move |(pi, p)| {
                p.placements
                    .iter()
                    .map(move |pl| Instance {
                        profile: pi,
                        start: pl.start,
                    })
                    .filter(|&i| self.fits(i))
            })
    }

    /// Stranded capacity in the current state.
    #[must_use]
    pub fn stranded(&self) -> Stranded {
        let mut coverable = 0u16;
        for i in self.feasible() {
            coverable |=
                Placement::new(i.start, self.spec.profiles[i.profile].memory_slices).mask();
        }
        let all = ((1u32 << self.spec.memory_slices) - 1) as u16;
        let free = all & !self.mem_mask;
        let memory_slices = (free & !coverable).count_ones() as u8;
        let mut best = 0u8;
        let mut scratch = self.clone();
        max_extra_compute(&mut scratch, 0, 0, &mut best);
        Stranded {
            memory_slices,
            compute_slices: self.free_compute_slices() - best,
        }
    }
}

/// Candidate instances of a spec in a fixed order (profile, then start).
fn candidates(spec: &GpuSpec) -> Vec<Instance> {
    spec.profiles
        .iter()
        .enumerate()
        .flat_map(|(pi, p)| {
            p.placements.iter().map(move |pl| Instance {
                profile: pi,
                start: pl.start,
            })
        })
        .collect()
}

fn max_extra_compute(o: &mut Occupancy<'_>, from: usize, extra: u8, best: &mut u8) {
    *best = (*best).max(extra);
    if *best == o.free_compute_slices() + extra {
        return;
    }
    let cands = candidates(o.spec);
    max_extra_rec(o, &cands, from, extra, best);
}

fn max_extra_rec(o: &mut Occupancy<'_>, cands: &[Instance], from: usize, extra: u8, best: &mut u8) {
    *best = (*best).max(extra);
    if *best == o.free_compute_slices() + extra {
        return;
    }
    for (k, &c) in cands.iter().enumerate().skip(from) {
        if o.fits(c) {
            o.place_unchecked(c);
            let cs = o.spec.profiles[c.profile].compute_slices;
            max_extra_rec(o, cands, k + 1, extra + cs, best);
            o.remove(c);
        }
    }
}

/// Every valid non-empty layout of the GPU (sets of instances that can coexist),
/// each listed once, instances in candidate order.
#[must_use]
pub fn layouts(spec: &GpuSpec) -> Vec<Layout> {
    let cands = candidates(spec);
    let mut out = Vec::new();
    let mut o = Occupancy::new(spec);
    fn rec(o: &mut Occupancy<'_>, cands: &[Instance], from: usize, out: &mut Vec<Layout>) {
        for k in from..cands.len() {
            if o.fits(cands[k]) {
                o.place_unchecked(cands[k]);
                let mut l = o.instances().to_vec();
                l.sort();
                out.push(l);
                rec(o, cands, k + 1, out);
                o.remove(cands[k]);
            }
        }
    }
    rec(&mut o, &cands, 0, &mut out);
    out
}

/// Resource totals of a set of instances.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Memory slices.
    pub memory_slices: u32,
    /// Compute slices.
    pub compute_slices: u32,
    /// Multiprocessors.
    pub multiprocessors: u32,
    /// Memory, MiB.
    pub memory_mib: u64,
    /// Engines.
    pub engines: Engines,
}

impl Totals {
    /// Sum over the instances of a layout.
    #[must_use]
    pub fn of(spec: &GpuSpec, layout: &[Instance]) -> Self {
        layout
            .iter()
            .fold(Self::default(), |t, i| t.plus(&spec.profiles[i.profile]))
    }

    /// These totals plus one instance of `p`.
    #[must_use]
    pub fn plus(self, p: &crate::spec::MigProfile) -> Self {
        Self {
            memory_slices: self.memory_slices + u32::from(p.memory_slices),
            compute_slices: self.compute_slices + u32::from(p.compute_slices),
            multiprocessors: self.multiprocessors + p.multiprocessors,
            memory_mib: self.memory_mib + p.memory_mib,
            engines: self.engines.plus(p.engines),
        }
    }

    /// Component-wise maximum.
    #[must_use]
    pub fn max(self, o: Self) -> Self {
        Self {
            memory_slices: self.memory_slices.max(o.memory_slices),
            compute_slices: self.compute_slices.max(o.compute_slices),
            multiprocessors: self.multiprocessors.max(o.multiprocessors),
            memory_mib: self.memory_mib.max(o.memory_mib),
            engines: self.engines.max(o.engines),
        }
    }
}

/// The largest total of each resource over every valid layout: the capacity a
/// counter needs so that it never forbids a layout the hardware allows.
#[must_use]
pub fn max_layout_totals(spec: &GpuSpec) -> Totals {
    fn rec(o: &mut Occupancy<'_>, cands: &[Instance], from: usize, cur: Totals, best: &mut Totals) {
        *best = best.max(cur);
        for (k, &c) in cands.iter().enumerate().skip(from) {
            if o.fits(c) {
                o.place_unchecked(c);
                rec(o, cands, k + 1, cur.plus(&o.spec.profiles[c.profile]), best);
                o.remove(c);
            }
        }
    }
    let cands = candidates(spec);
    let mut best = Totals::default();
    rec(
        &mut Occupancy::new(spec),
        &cands,
        0,
        Totals::default(),
        &mut best,
    );
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::GpuModel;

    fn h100() -> GpuSpec {
        GpuModel::find("h100-80gb").unwrap().spec()
    }

    fn inst(spec: &GpuSpec, name: &str, start: u8) -> Instance {
        Instance {
            profile: spec.profiles.iter().position(|p| p.name == name).unwrap(),
            start,
        }
    }

    #[test]
    fn three_g_plus_three_g_strands_one_compute_slice() {
        let s = h100();
        let o = Occupancy::with(&s, &[inst(&s, "3g.40gb", 0), inst(&s, "3g.40gb", 4)]).unwrap();
        assert_eq!(
            o.stranded(),
            Stranded {
                memory_slices: 0,
                compute_slices: 1
            }
        );
    }

    #[test]
    fn seven_small_instances_strand_the_last_memory_slice() {
        let s = h100();
        let l: Vec<_> = (0..7).map(|k| inst(&s, "1g.10gb", k)).collect();
        let o = Occupancy::with(&s, &l).unwrap();
        assert_eq!(
            o.stranded(),
            Stranded {
                memory_slices: 1,
                compute_slices: 0
            }
        );
    }

    #[test]
    fn small_instance_at_zero_blocks_4g_and_7g() {
        let s = h100();
        let o = Occupancy::with(&s, &[inst(&s, "1g.10gb", 0)]).unwrap();
        assert!(matches!(
            o.check(inst(&s, "4g.40gb", 0)),
            Err(Conflict::Overlap { .. })
        ));
        assert!(o.check(inst(&s, "3g.40gb", 4)).is_ok());
        assert_eq!(o.stranded(), Stranded::default());
    }

    #[test]
    fn media_extensions_once_per_gpu() {
        let s = GpuModel::find("a30").unwrap().spec();
        let o = Occupancy::with(&s, &[inst(&s, "1g.6gb+me", 0)]).unwrap();
        assert!(matches!(
            o.check(inst(&s, "1g.6gb+me", 3)),
            Err(Conflict::MaxInstances { .. })
        ));
        assert!(matches!(
            o.check(inst(&s, "2g.12gb+me", 2)),
            Err(Conflict::MediaExtensionsInUse { .. })
        ));
        assert!(o.check(inst(&s, "2g.12gb", 2)).is_ok());
    }

    #[test]
    fn layouts_of_a100_include_the_well_known_mixes() {
        let s = GpuModel::find("a100-40gb").unwrap().spec();
        let ls = layouts(&s);
        let has = |want: &[(&str, u8)]| {
            let mut w: Vec<_> = want.iter().map(|&(n, st)| inst(&s, n, st)).collect();
            w.sort();
            ls.contains(&w)
        };
        assert!(has(&[("4g.20gb", 0), ("2g.10gb", 4), ("1g.5gb", 6)]));
        assert!(has(&[("3g.20gb", 0), ("3g.20gb", 4)]));
        assert!(has(&[
            ("2g.10gb", 0),
            ("2g.10gb", 2),
            ("2g.10gb", 4),
            ("1g.5gb", 6)
        ]));
        assert!(!has(&[("4g.20gb", 0), ("3g.20gb", 0)]));
        assert!(!ls.is_empty());
    }

    #[test]
    fn max_totals_cover_whole_gpu_profile() {
        for m in crate::MODELS.iter().filter(|m| m.spec().mig_capable) {
            let s = m.spec();
            let t = max_layout_totals(&s);
            assert_eq!(t.compute_slices, u32::from(s.compute_slices), "{}", m.key);
            assert!(t.memory_slices <= u32::from(s.memory_slices), "{}", m.key);
        }
    }
}
