//! A state-aware device order: the order a node would publish for one profile
//! given the instances live on its GPUs now, so that the allocator's first
//! fit is the placement that keeps the most capacity for what may come next.
//!
//! The scheduler's allocator takes the first device of the published order
//! that fits ([`carve_model::order`]). A static order fixes that choice for every
//! occupancy; this order is recomputed from the live occupancy, so the plugin
//! would have to republish its pool after each prepare and unprepare that
//! changes it (one ResourceSlice write).
//!
//! # The order ([`LiveOrder::order`])
//!
//! - **Value of a GPU** ([`LiveOrder::gpu_value`]): for every profile `q`, the
//!   compute slices the most additional instances of `q` alone could still
//!   take on it (a `7g` needs the empty GPU, a `4g` memory slices 0–3, ...),
//!   weighted by `q`'s weight, summed. The **loss** of a placement is the
//!   value it removes from its GPU.
//! - **Chain**: the first device is the placement of least loss over the
//!   node; the second the least loss *given the first placed*, and so on
//!   until no further instance of the profile fits. Walking the order is
//!   therefore also the right sequence of choices when the allocator walks it
//!   again before the republish lands (a claim for several devices, or the
//!   next claim from a stale slice version): it takes the next chain element.
//! - **Ties** (equal loss) go to carve's static order
//!   ([`carve_model::order::carve_device_key`]: tier, GPU, placement rank).
//! - **Tail**: the devices the chain does not reach (occupied, or blocked by the
//!   chain), in carve's static order, so that the order is always a
//!   permutation of every device of the profile and a device freed after the
//!   order was computed is still found.
//!
//! It lives in the benchmark, not in carve-model, because it did not win:
//! measured by `carve bench fragmentation` (the `state-aware` rows) it is
//! closer to the exact per-node optimum than carve's static order on 10 of
//! the 12 node shapes, but above it on the cluster band mean in all 8 runs,
//! with more re-pack-avoidable failures on 6 of them, at about one
//! ResourceSlice write per prepare and per unprepare. Figures and caveats in
//! `docs/benchmarks.md`, "Fragmentation".

use std::collections::HashMap;
use std::rc::Rc;

use carve_model::geometry::{Conflict, Instance, Occupancy};
use carve_model::order::{carve_rank, placement_tier};
use carve_model::spec::{GpuSpec, Placement};

/// Why a live order cannot be computed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LiveOrderError {
    /// The spec has more placements, over all profiles, than a 64-bit set holds.
    #[error("{gpu}: {placements} placements over all profiles; the live order handles at most 64")]
    TooManyPlacements {
        /// Product name.
        gpu: String,
        /// Placements counted.
        placements: usize,
    },
    /// The weights do not give one value per profile.
    #[error("{gpu}: {got} weight(s) given for {want} profile(s)")]
    Weights {
        /// Product name.
        gpu: String,
        /// Weights given.
        got: usize,
        /// Profiles of the spec.
        want: usize,
    },
    /// No such profile.
    #[error("no profile #{0}")]
    UnknownProfile(usize),
    /// A GPU's instances do not coexist (or name a placement the spec lacks).
    #[error("GPU {gpu}: {source}")]
    Instances {
        /// GPU index on the node.
        gpu: u32,
        /// The first conflict.
        source: Conflict,
    },
    /// A GPU of the node is of another spec than the order's.
    #[error("GPU {gpu} is a {other}, the order is for {gpu_spec}")]
    OtherSpec {
        /// GPU index on the node.
        gpu: u32,
        /// Its product name.
        other: String,
        /// The order's product name.
        gpu_spec: String,
    },
    /// A bit of an instance set names no placement.
    #[error("GPU {gpu}: instance set {mask:#x} has a bit beyond the {placements} placements")]
    UnknownPlacement {
        /// GPU index on the node.
        gpu: u32,
        /// The set.
        mask: u64,
        /// Placements of the spec.
        placements: usize,
    },
}

/// One weight per profile of a spec (positions as `GpuSpec::profiles`): every
/// profile without media extensions weighs 1, `+me` variants 0 (they take
/// the same slices as their plain profile and would count them twice).
#[must_use]
pub fn default_weights(spec: &GpuSpec) -> Vec<u32> {
    spec.profiles
        .iter()
        .map(|p| u32::from(!p.media_extensions))
        .collect()
}

#[derive(Clone, Copy, Debug)]
struct Info {
    value: u64,
    /// Bit k: candidate k fits.
    fits: u64,
}

/// One step of a GPU's chain: the candidate placed and the value it removed.
#[derive(Clone, Copy, Debug)]
struct Step {
    cand: u8,
    loss: u64,
}

/// The state-aware order of one GPU spec and weighting, with its memo (every
/// GPU state is valued once). Pure: no I/O, the same inputs give the same
/// order.
#[derive(Debug)]
pub struct LiveOrder<'s> {
    spec: &'s GpuSpec,
    weights: Vec<u32>,
    /// Candidate k = bit k of an instance set: every placement of every
    /// profile, profile by profile in spec order, placements as listed.
    cands: Vec<Instance>,
    /// `cand_of[profile][start]`, `u8::MAX` when not a placement.
    cand_of: Vec<Vec<u8>>,
    /// Per candidate: `(tier, position in carve_rank)`.
    key: Vec<(u8, u8)>,
    info: HashMap<u64, Info>,
    chains: HashMap<(u64, usize), Rc<[Step]>>,
}

impl<'s> LiveOrder<'s> {
    /// The order for GPUs of `spec`, valuing each profile by `weights`
    /// (one per profile, e.g. [`default_weights`]).
    ///
    /// # Errors
    /// More than 64 placements, or not one weight per profile.
    pub fn new(spec: &'s GpuSpec, weights: Vec<u32>) -> Result<Self, LiveOrderError> {
        if weights.len() != spec.profiles.len() {
            return Err(LiveOrderError::Weights {
                gpu: spec.product_name.clone(),
                got: weights.len(),
                want: spec.profiles.len(),
            });
        }
        let placements: usize = spec.profiles.iter().map(|p| p.placements.len()).sum();
        if placements > 64 {
            return Err(LiveOrderError::TooManyPlacements {
                gpu: spec.product_name.clone(),
                placements,
            });
        }
        let slots = usize::from(spec.memory_slices).max(1);
        let mut cands = Vec::with_capacity(placements);
        let mut cand_of = vec![vec![u8::MAX; slots]; spec.profiles.len()];
        let mut key = Vec::with_capacity(placements);
        for (pi, p) in spec.profiles.iter().enumerate() {
            let rank = carve_rank(spec, pi);
            for pl in &p.placements {
                if let Some(slot) = cand_of[pi].get_mut(usize::from(pl.start)) {
                    *slot = cands.len() as u8;
                }
                let r = rank.iter().position(|&s| s == pl.start).unwrap_or(0);
                key.push((placement_tier(spec, pi, *pl), r as u8));
                cands.push(Instance {
                    profile: pi,
                    start: pl.start,
                });
            }
        }
        Ok(Self {
            spec,
            weights,
            cands,
            cand_of,
            key,
            info: HashMap::new(),
            chains: HashMap::new(),
        })
    }

    /// The placements of the spec in instance-set bit order.
    #[must_use]
    pub fn candidates(&self) -> &[Instance] {
        &self.cands
    }

    /// The instance set (bit k = [`Self::candidates`]`[k]`) of a GPU.
    ///
    /// # Errors
    /// An instance names a placement the spec does not have.
    pub fn mask_of(&self, gpu: u32, occ: &Occupancy<'_>) -> Result<u64, LiveOrderError> {
        let mut m = 0u64;
        for i in occ.instances() {
            let c = self
                .cand_of
                .get(i.profile)
                .and_then(|v| v.get(usize::from(i.start)))
                .copied()
                .filter(|&c| c != u8::MAX)
                .ok_or_else(|| LiveOrderError::Instances {
                    gpu,
                    source: Conflict::NotAPlacement {
                        profile: self
                            .spec
                            .profiles
                            .get(i.profile)
                            .map_or_else(|| format!("#{}", i.profile), |p| p.name.clone()),
                        start: i.start,
                    },
                })?;
            m |= 1 << c;
        }
        Ok(m)
    }

    fn state(&mut self, gpu: u32, mask: u64) -> Result<Info, LiveOrderError> {
        if let Some(&i) = self.info.get(&mask) {
            return Ok(i);
        }
        let n = self.cands.len();
        if n < 64 && mask >> n != 0 {
            return Err(LiveOrderError::UnknownPlacement {
                gpu,
                mask,
                placements: n,
            });
        }
        let insts: Vec<Instance> = (0..n)
            .filter(|k| mask & (1 << k) != 0)
            .map(|k| self.cands[k])
            .collect();
        let occ = Occupancy::with(self.spec, &insts)
            .map_err(|source| LiveOrderError::Instances { gpu, source })?;
        let mut fits = 0u64;
        for (k, &c) in self.cands.iter().enumerate() {
            if occ.fits(c) {
                fits |= 1 << k;
            }
        }
        let mut value = 0u64;
        let mut scratch = occ.clone();
        for (pi, p) in self.spec.profiles.iter().enumerate() {
            let w = u64::from(self.weights[pi]);
            if w == 0 {
                continue;
            }
            let most = most_instances(&mut scratch, pi, &p.placements);
            value += w * u64::from(most) * u64::from(p.compute_slices);
        }
        let i = Info { value, fits };
        self.info.insert(mask, i);
        Ok(i)
    }

    /// The value of a GPU holding the instance set `mask`: Σ over profiles of
    /// weight × compute slices of the most extra instances of that profile
    /// alone.
    ///
    /// # Errors
    /// The set names an unknown placement or its instances do not coexist.
    pub fn gpu_value(&mut self, mask: u64) -> Result<u64, LiveOrderError> {
        Ok(self.state(0, mask)?.value)
    }

    /// The greedy chain of `profile` on one GPU from `mask`.
    fn chain(&mut self, gpu: u32, mask: u64, profile: usize) -> Result<Rc<[Step]>, LiveOrderError> {
        if let Some(c) = self.chains.get(&(mask, profile)) {
            return Ok(Rc::clone(c));
        }
        let own: Vec<u8> = self.cand_of[profile]
            .iter()
            .copied()
            .filter(|&c| c != u8::MAX)
            .collect();
        let mut steps = Vec::new();
        let mut m = mask;
        loop {
            let here = self.state(gpu, m)?;
            let mut best: Option<(u64, (u8, u8), u8)> = None;
            for &c in &own {
                if here.fits & (1 << c) == 0 {
                    continue;
                }
                let after = self.state(gpu, m | (1 << c))?;
                let loss = here.value - after.value;
                let k = (loss, self.key[usize::from(c)], c);
                if best.is_none_or(|b| (k.0, k.1) < (b.0, b.1)) {
                    best = Some(k);
                }
            }
            let Some((loss, _, cand)) = best else { break };
            steps.push(Step { cand, loss });
            m |= 1 << cand;
        }
        let steps: Rc<[Step]> = steps.into();
        self.chains.insert((mask, profile), Rc::clone(&steps));
        Ok(steps)
    }

    /// The published order of `profile` on a node whose GPU `g` holds the
    /// instance set `gpus[g]`: every device of the profile exactly once, as
    /// `(gpu index, placement start)`, chain first, then the tail (see the
    /// module documentation).
    ///
    /// # Errors
    /// An unknown profile, or a GPU's set is not a valid instance set.
    pub fn order_masks(
        &mut self,
        gpus: &[u64],
        profile: usize,
    ) -> Result<Vec<(u32, u8)>, LiveOrderError> {
        if profile >= self.spec.profiles.len() {
            return Err(LiveOrderError::UnknownProfile(profile));
        }
        let chains: Vec<Rc<[Step]>> = gpus
            .iter()
            .enumerate()
            .map(|(g, &m)| self.chain(g as u32, m, profile))
            .collect::<Result<_, _>>()?;
        let per_gpu = self.spec.profiles[profile].placements.len();
        let mut out = Vec::with_capacity(gpus.len() * per_gpu);
        let mut emitted = vec![0u64; gpus.len()];
        let mut head = vec![0usize; gpus.len()];
        loop {
            let mut best: Option<(u64, u8, usize, u8)> = None;
            for (g, c) in chains.iter().enumerate() {
                let Some(s) = c.get(head[g]) else { continue };
                let (tier, rank) = self.key[usize::from(s.cand)];
                let k = (s.loss, tier, g, rank);
                if best.is_none_or(|b| k < b) {
                    best = Some(k);
                }
            }
            let Some((_, _, g, _)) = best else { break };
            let cand = chains[g][head[g]].cand;
            head[g] += 1;
            emitted[g] |= 1 << cand;
            out.push((g as u32, self.cands[usize::from(cand)].start));
        }
        // The tail in carve's static order: tier, then GPU, then rank.
        let mut tail: Vec<(u8, u32, u8, u8)> = Vec::new();
        for (g, &done) in emitted.iter().enumerate() {
            for &c in &self.cand_of[profile] {
                if c != u8::MAX && done & (1 << c) == 0 {
                    let (tier, rank) = self.key[usize::from(c)];
                    tail.push((tier, g as u32, rank, self.cands[usize::from(c)].start));
                }
            }
        }
        tail.sort_unstable();
        out.extend(tail.into_iter().map(|(_, g, _, s)| (g, s)));
        Ok(out)
    }

    /// [`Self::order_masks`] for the GPUs' occupancies.
    ///
    /// # Errors
    /// As [`Self::order_masks`], a GPU of another spec, or an instance the
    /// spec does not have.
    pub fn order(
        &mut self,
        gpus: &[Occupancy<'_>],
        profile: usize,
    ) -> Result<Vec<(u32, u8)>, LiveOrderError> {
        let mut masks = Vec::with_capacity(gpus.len());
        for (g, o) in gpus.iter().enumerate() {
            if !std::ptr::eq(o.spec(), self.spec) && o.spec() != self.spec {
                return Err(LiveOrderError::OtherSpec {
                    gpu: g as u32,
                    other: o.spec().product_name.clone(),
                    gpu_spec: self.spec.product_name.clone(),
                });
            }
            masks.push(self.mask_of(g as u32, o)?);
        }
        self.order_masks(&masks, profile)
    }
}

/// The most instances of `profile` (placements `pls`) that fit on `occ`
/// together, by exhaustive search (at most 8 placements per profile).
fn most_instances(occ: &mut Occupancy<'_>, profile: usize, pls: &[Placement]) -> u8 {
    fn go(occ: &mut Occupancy<'_>, profile: usize, pls: &[Placement]) -> u8 {
        let mut best = 0;
        for (k, pl) in pls.iter().enumerate() {
            let inst = Instance {
                profile,
                start: pl.start,
            };
            if occ.fits(inst) && occ.place(inst).is_ok() {
                best = best.max(1 + go(occ, profile, &pls[k + 1..]));
                occ.remove(inst);
            }
        }
        best
    }
    go(occ, profile, pls)
}

/// The state-aware order of `profile` on a node whose GPU `g` is `gpus[g]`,
/// with `weights` per profile ([`default_weights`]); see [`LiveOrder`]. Every
/// GPU must be of the first one's spec; no GPU, no device.
///
/// # Errors
/// As [`LiveOrder::new`] and [`LiveOrder::order`].
pub fn state_aware_order(
    gpus: &[Occupancy<'_>],
    profile: usize,
    weights: Vec<u32>,
) -> Result<Vec<(u32, u8)>, LiveOrderError> {
    let Some(spec) = gpus.first().map(Occupancy::spec) else {
        return Ok(Vec::new());
    };
    LiveOrder::new(spec, weights)?.order(gpus, profile)
}

#[cfg(test)]
mod tests {
    use super::*;
    use carve_model::order::{DeviceOrder, node_device_order};
    use carve_model::{GpuModel, MODELS};

    fn h100() -> GpuSpec {
        GpuModel::find("h100-80gb").unwrap().spec()
    }

    fn idx(s: &GpuSpec, name: &str) -> usize {
        s.profiles.iter().position(|p| p.name == name).unwrap()
    }

    fn node<'s>(s: &'s GpuSpec, gpus: &[&[(&str, u8)]]) -> Vec<Occupancy<'s>> {
        gpus.iter()
            .map(|insts| {
                let v: Vec<Instance> = insts
                    .iter()
                    .map(|&(n, start)| Instance {
                        profile: idx(s, n),
                        start,
                    })
                    .collect();
                Occupancy::with(s, &v).unwrap()
            })
            .collect()
    }

    /// A tiny deterministic generator for the random cases.
    fn next(x: &mut u64) -> u64 {
        *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A random valid occupancy: up to 6 random placements, those that fit.
    fn random_gpu<'s>(s: &'s GpuSpec, x: &mut u64) -> Occupancy<'s> {
        let mut o = Occupancy::new(s);
        for _ in 0..(next(x) % 7) {
            let p = (next(x) % s.profiles.len() as u64) as usize;
            let pls = &s.profiles[p].placements;
            let pl = pls[(next(x) % pls.len() as u64) as usize];
            let _ = o.place(Instance {
                profile: p,
                start: pl.start,
            });
        }
        o
    }

    /// Empty H100-80GB, default weights: 7g 7, 4g 4, 3g 2 × 3, 2g 3 × 2,
    /// 1g 7 × 1, 1g.20gb 4 × 1, `+me` 0: 34. With 4g at 0: 3g 3, 2g 2,
    /// 1g 3, 1g.20gb 2 (at 4 and 6; 3 compute slices left): 10.
    #[test]
    fn gpu_value_by_hand() {
        let s = h100();
        let mut lo = LiveOrder::new(&s, default_weights(&s)).unwrap();
        assert_eq!(lo.gpu_value(0).unwrap(), 34);
        let g = node(&s, &[&[("4g.40gb", 0)]]);
        let m = lo.mask_of(0, &g[0]).unwrap();
        assert_eq!(lo.gpu_value(m).unwrap(), 10);
        assert_eq!(default_weights(&s)[idx(&s, "1g.10gb+me")], 0);
    }

    /// Two empty H100s: the first 1g goes to GPU 0 at 6 (away from the 4g
    /// home and the 2g at 4), the next ones pack GPU 0 (5, 4, ...) before
    /// GPU 1 is touched: the chain keeps an empty GPU for 7g.
    #[test]
    fn small_profiles_pack_one_gpu_and_keep_the_other_empty() {
        let s = h100();
        let g = node(&s, &[&[], &[]]);
        let o = state_aware_order(&g, idx(&s, "1g.10gb"), default_weights(&s)).unwrap();
        assert_eq!(o[0], (0, 6));
        assert!(o[..7].iter().all(|&(gpu, _)| gpu == 0), "{o:?}");
        assert_eq!(o.len(), 14);
    }

    /// GPU 0 holds 4g at 0 (its right half free), GPU 1 a 1g at 6: a 3g goes
    /// to GPU 0 at 4 (it fills GPU 0), not to GPU 1 at 0, where it would
    /// block GPU 1's 4g home. With GPU 0 empty instead, both cost 17 (the
    /// empty GPU loses its 7g home, 34 → 17; GPU 1 its 4g and 3g homes,
    /// 22 → 5): the tie goes to carve's static order, the right half of
    /// GPU 0 (tier 0) before the left half of GPU 1.
    #[test]
    fn a_3g_fills_the_right_half_next_to_a_4g() {
        let s = h100();
        let p3 = idx(&s, "3g.40gb");
        let g = node(&s, &[&[("4g.40gb", 0)], &[("1g.10gb", 6)]]);
        let o = state_aware_order(&g, p3, default_weights(&s)).unwrap();
        assert_eq!(o[0], (0, 4));
        let g = node(&s, &[&[], &[("1g.10gb", 6)]]);
        let mut lo = LiveOrder::new(&s, default_weights(&s)).unwrap();
        let o = lo.order(&g, p3).unwrap();
        let (m0, m1) = (lo.mask_of(0, &g[0]).unwrap(), lo.mask_of(1, &g[1]).unwrap());
        let c0 = lo.cand_of[p3][4];
        let c1 = lo.cand_of[p3][0];
        let loss0 = lo.gpu_value(m0).unwrap() - lo.gpu_value(m0 | 1 << c0).unwrap();
        let loss1 = lo.gpu_value(m1).unwrap() - lo.gpu_value(m1 | 1 << c1).unwrap();
        assert_eq!((loss0, loss1), (17, 17));
        assert_eq!(o[0], (0, 4));
    }

    /// On random nodes of every MIG model: the order holds every device of
    /// the profile exactly once; its first device, when any fits, is a
    /// placement of least loss; walking it and placing each device that
    /// fits follows the chain (each placed device is the least-loss one
    /// given those before).
    #[test]
    fn the_order_is_a_permutation_and_its_chain_is_greedy() {
        let mut x = 11u64;
        for m in MODELS.iter().filter(|m| m.spec().mig_capable) {
            let s = m.spec();
            let mut lo = LiveOrder::new(&s, default_weights(&s)).unwrap();
            for case in 0..40 {
                let n = 1 + (case % 4) as usize;
                let gpus: Vec<Occupancy<'_>> = (0..n).map(|_| random_gpu(&s, &mut x)).collect();
                for p in 0..s.profiles.len() {
                    let o = lo.order(&gpus, p).unwrap();
                    let mut got = o.clone();
                    got.sort_unstable();
                    let mut want = node_device_order(&s, n as u32, p, DeviceOrder::FirstFit);
                    want.sort_unstable();
                    assert_eq!(got, want, "{} {}", m.key, s.profiles[p].name);
                    // Greedy: the first fitting device has the least loss.
                    let mut live = gpus.clone();
                    for _ in 0..3 {
                        let masks: Vec<u64> = live
                            .iter()
                            .enumerate()
                            .map(|(g, o)| lo.mask_of(g as u32, o).unwrap())
                            .collect();
                        let loss = |lo: &mut LiveOrder<'_>, g: u32, st: u8| {
                            let c = lo.cand_of[p][usize::from(st)];
                            let m = masks[g as usize];
                            lo.gpu_value(m).unwrap() - lo.gpu_value(m | 1 << c).unwrap()
                        };
                        let fits: Vec<(u32, u8)> = o
                            .iter()
                            .copied()
                            .filter(|&(g, st)| {
                                live[g as usize].fits(Instance {
                                    profile: p,
                                    start: st,
                                })
                            })
                            .collect();
                        let Some(&first) = fits.first() else { break };
                        let best = fits
                            .iter()
                            .map(|&(g, st)| loss(&mut lo, g, st))
                            .min()
                            .unwrap();
                        assert_eq!(
                            loss(&mut lo, first.0, first.1),
                            best,
                            "{} {}",
                            m.key,
                            s.profiles[p].name
                        );
                        // The walk from the same (now stale) order equals the
                        // order recomputed after the placement, for the chain.
                        live[first.0 as usize]
                            .place(Instance {
                                profile: p,
                                start: first.1,
                            })
                            .unwrap();
                        let fresh = lo.order(&live, p).unwrap();
                        let stale_next = o.iter().copied().find(|&(g, st)| {
                            live[g as usize].fits(Instance {
                                profile: p,
                                start: st,
                            })
                        });
                        let fresh_next = fresh.iter().copied().find(|&(g, st)| {
                            live[g as usize].fits(Instance {
                                profile: p,
                                start: st,
                            })
                        });
                        assert_eq!(stale_next.is_some(), fresh_next.is_some());
                    }
                }
            }
        }
    }

    #[test]
    fn bad_inputs_are_refused_with_the_reason() {
        let s = h100();
        assert!(matches!(
            LiveOrder::new(&s, vec![1; 3]),
            Err(LiveOrderError::Weights {
                got: 3,
                want: 7,
                ..
            })
        ));
        let mut lo = LiveOrder::new(&s, default_weights(&s)).unwrap();
        assert_eq!(
            lo.order_masks(&[0], 99),
            Err(LiveOrderError::UnknownProfile(99))
        );
        // 7g and 1g at 0 overlap: not an instance set.
        let c7 = lo.cand_of[idx(&s, "7g.80gb")][0];
        let c1 = lo.cand_of[idx(&s, "1g.10gb")][0];
        let e = lo.order_masks(&[0, (1 << c7) | (1 << c1)], 0).unwrap_err();
        assert!(matches!(e, LiveOrderError::Instances { gpu: 1, .. }), "{e}");
        let n = lo.candidates().len();
        assert!(matches!(
            lo.order_masks(&[1 << n], 0),
            Err(LiveOrderError::UnknownPlacement { gpu: 0, .. })
        ));
        let a100 = GpuModel::find("a100-40gb").unwrap().spec();
        let mixed = vec![Occupancy::new(&s), Occupancy::new(&a100)];
        let e = lo.order(&mixed, 0).unwrap_err();
        assert!(matches!(e, LiveOrderError::OtherSpec { gpu: 1, .. }), "{e}");
        assert!(e.to_string().contains("A100"), "{e}");
        assert_eq!(state_aware_order(&[], 0, Vec::new()), Ok(Vec::new()));
    }
}
