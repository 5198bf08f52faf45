//! Mapping a trace task (a fractional or whole-GPU request) onto MIG profiles.
//!
//! Rule A, compute cover (`fragmentation.md` §8.2): a share of one GPU becomes
//! the smallest profile whose compute fraction `k / C` is at least
//! `gpu_milli / 1000` (`C` = compute slices of the GPU, 7 on H100); among
//! profiles with equal compute the one with the fewest memory slices, never a
//! media-extension profile. A task with `num_gpu = n` whole GPUs becomes `n`
//! whole-GPU profiles (`7g.*`) on one node. CPU-only tasks map to no device.

use carve_model::GpuSpec;

use crate::error::FragError;
use crate::trace::TaskRow;

/// What one task asks of a node after mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Demand {
    /// CPU, thousandths of a core.
    pub cpu_milli: u64,
    /// Host RAM, MiB.
    pub memory_mib: u64,
    /// The MIG profile (position in `GpuSpec::profiles`), `None` for CPU-only.
    pub profile: Option<usize>,
    /// How many devices of `profile` (more than one only for whole GPUs).
    pub count: u32,
    /// Compute slices the task occupies in total.
    pub compute_slices: u32,
    /// Memory slices the task occupies in total.
    pub memory_slices: u32,
    /// GPU thousandths requested in the trace (`num_gpu × gpu_milli`).
    pub requested_milli: u32,
    /// Failure class (position in [`Mapper::classes`]).
    pub class: usize,
    /// The node models the task may run on (`gpu_spec`): bit `i` = model `i`
    /// of the node list ([`crate::sim::NodeCap::model_bit`]); `u64::MAX` = any.
    pub models: u64,
}

/// Rule A for one GPU spec.
#[derive(Clone, Debug)]
pub struct Mapper {
    /// `(profile, compute slices, largest gpu_milli it covers)`, smallest first.
    steps: Vec<(usize, u8, u32)>,
    whole: usize,
    compute: u8,
    memory: u8,
    names: Vec<String>,
}

impl Mapper {
    /// Rule A for `spec`.
    ///
    /// # Errors
    /// `spec` is not MIG-capable or has no whole-GPU profile.
    pub fn new(spec: &GpuSpec) -> Result<Self, FragError> {
        let not_mig = || FragError::NotMigCapable {
            model: spec.product_name.clone(),
            known: String::new(),
        };
        if !spec.mig_capable || spec.compute_slices == 0 {
            return Err(not_mig());
        }
        let c = spec.compute_slices;
        let mut best: Vec<Option<usize>> = vec![None; usize::from(c) + 1];
        for (i, p) in spec.profiles.iter().enumerate() {
            if p.media_extensions || p.name.contains('+') || p.name.contains("-me") {
                continue;
            }
            let slot = &mut best[usize::from(p.compute_slices)];
            match *slot {
                Some(j) if spec.profiles[j].memory_slices <= p.memory_slices => {}
                _ => *slot = Some(i),
            }
        }
        let steps: Vec<(usize, u8, u32)> = best
            .iter()
            .enumerate()
            .filter_map(|(k, p)| p.map(|p| (p, k as u8, (k as u32 * 1000) / u32::from(c))))
            .collect();
        let whole = spec
            .profiles
            .iter()
            .position(|p| {
                p.compute_slices == c
                    && p.memory_slices == spec.memory_slices
                    && !p.media_extensions
            })
            .ok_or_else(not_mig)?;
        let mut names: Vec<String> = steps
            .iter()
            .map(|&(p, _, _)| spec.profiles[p].name.clone())
            .collect();
        names.push(format!("multi-gpu (n × {})", spec.profiles[whole].name));
        names.push("cpu-only".into());
        Ok(Self {
            steps,
            whole,
            compute: c,
            memory: spec.memory_slices,
            names,
        })
    }

    /// The profile rule A gives a share of `gpu_milli` (1..=1000) of one GPU.
    #[must_use]
    pub fn profile_for_milli(&self, gpu_milli: u32) -> usize {
        self.steps
            .iter()
            .find(|&&(_, _, max)| gpu_milli <= max)
            .map_or(self.whole, |&(p, _, _)| p)
    }

    /// The profiles the rule can produce, smallest first.
    #[must_use]
    pub fn profiles(&self) -> Vec<usize> {
        self.steps.iter().map(|&(p, _, _)| p).collect()
    }

    /// The whole-GPU profile.
    #[must_use]
    pub fn whole(&self) -> usize {
        self.whole
    }

    /// Failure-class labels: one per profile, then multi-GPU, then CPU-only.
    #[must_use]
    pub fn classes(&self) -> &[String] {
        &self.names
    }

    /// Map one task.
    #[must_use]
    pub fn map(&self, spec: &GpuSpec, t: &TaskRow) -> Demand {
        let base = Demand {
            cpu_milli: t.cpu_milli,
            memory_mib: t.memory_mib,
            profile: None,
            count: 0,
            compute_slices: 0,
            memory_slices: 0,
            requested_milli: t.num_gpu * t.gpu_milli,
            class: self.names.len() - 1,
            models: u64::MAX,
        };
        if t.num_gpu == 0 {
            return base;
        }
        let (profile, count, class) = if t.num_gpu == 1 {
            let p = self.profile_for_milli(t.gpu_milli);
            let class = self
                .steps
                .iter()
                .position(|&(q, _, _)| q == p)
                .unwrap_or(self.steps.len() - 1);
            (p, 1, class)
        } else {
            (self.whole, t.num_gpu, self.names.len() - 2)
        };
        let pr = &spec.profiles[profile];
        Demand {
            profile: Some(profile),
            count,
            compute_slices: count * u32::from(pr.compute_slices),
            memory_slices: count * u32::from(pr.memory_slices),
            class,
            ..base
        }
    }

    /// The rule in words, with the thresholds for this spec.
    #[must_use]
    pub fn rule_text(&self, spec: &GpuSpec) -> String {
        let mut parts: Vec<String> = self
            .steps
            .iter()
            .filter(|&&(p, _, _)| p != self.whole)
            .map(|&(p, _, max)| format!("≤{max} → {}", spec.profiles[p].name))
            .collect();
        parts.push(format!("else {}", spec.profiles[self.whole].name));
        format!(
            "rule A (compute cover): a share becomes the smallest profile with k/{c} ≥ gpu_milli/1000: {}; \
             num_gpu = n whole GPUs → n × {} on one node; CPU-only tasks use CPU and RAM only",
            parts.join(", "),
            spec.profiles[self.whole].name,
            c = self.compute
        )
    }

    /// Internal fragmentation of the mapping over `tasks` (GPU tasks only).
    #[must_use]
    pub fn internal(&self, spec: &GpuSpec, tasks: &[TaskRow]) -> InternalFrag {
        let mut f = InternalFrag::default();
        for t in tasks.iter().filter(|t| t.num_gpu > 0) {
            let d = self.map(spec, t);
            let req = f64::from(d.requested_milli) / 1000.0;
            let comp = f64::from(d.compute_slices) / f64::from(self.compute);
            let mem = f64::from(d.memory_slices) / f64::from(self.memory);
            f.all.add(req, comp, mem);
            if t.num_gpu == 1 && t.gpu_milli < 1000 {
                f.sharing.add(req, comp, mem);
            }
        }
        f
    }
}

/// Requested versus MIG-allocated GPU capacity of a set of tasks, in GPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Inflation {
    /// Tasks counted.
    pub tasks: u64,
    /// GPUs requested (Σ num_gpu × gpu_milli / 1000).
    pub requested: f64,
    /// GPUs of compute the mapped profiles take (Σ compute slices / C).
    pub compute: f64,
    /// GPUs of memory the mapped profiles take (Σ memory slices / M).
    pub memory: f64,
}

impl Inflation {
    fn add(&mut self, req: f64, comp: f64, mem: f64) {
        self.tasks += 1;
        self.requested += req;
        self.compute += comp;
        self.memory += mem;
    }

    /// Compute taken per GPU requested (1.0 = no internal fragmentation).
    #[must_use]
    pub fn compute_ratio(&self) -> f64 {
        if self.requested > 0.0 {
            self.compute / self.requested
        } else {
            1.0
        }
    }

    /// Memory taken per GPU requested.
    #[must_use]
    pub fn memory_ratio(&self) -> f64 {
        if self.requested > 0.0 {
            self.memory / self.requested
        } else {
            1.0
        }
    }
}

/// Internal fragmentation of the mapping: what MIG's coarse sizes cost before
/// any placement, reported apart from placement-caused fragmentation.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct InternalFrag {
    /// Sharing tasks (one GPU, `gpu_milli` < 1000).
    pub sharing: Inflation,
    /// All GPU tasks.
    pub all: Inflation,
}

#[cfg(test)]
mod tests {
    use super::*;
    use carve_model::GpuModel;

    fn h100() -> GpuSpec {
        GpuModel::find("h100-80gb").unwrap().spec()
    }

    fn name(spec: &GpuSpec, m: &Mapper, milli: u32) -> String {
        spec.profiles[m.profile_for_milli(milli)].name.clone()
    }

    #[test]
    fn rule_a_table_on_h100() {
        let s = h100();
        let m = Mapper::new(&s).unwrap();
        let table: &[(u32, &str)] = &[
            (1, "1g.10gb"),
            (50, "1g.10gb"),
            (110, "1g.10gb"),
            (140, "1g.10gb"),
            (142, "1g.10gb"),
            (143, "2g.20gb"),
            (160, "2g.20gb"),
            (230, "2g.20gb"),
            (285, "2g.20gb"),
            (286, "3g.40gb"),
            (320, "3g.40gb"),
            (370, "3g.40gb"),
            (428, "3g.40gb"),
            (429, "4g.40gb"),
            (470, "4g.40gb"),
            (550, "4g.40gb"),
            (571, "4g.40gb"),
            (572, "7g.80gb"),
            (590, "7g.80gb"),
            (810, "7g.80gb"),
            (1000, "7g.80gb"),
        ];
        for &(milli, want) in table {
            assert_eq!(name(&s, &m, milli), want, "gpu_milli {milli}");
        }
        let text = m.rule_text(&s);
        assert!(
            text.contains("≤142 → 1g.10gb") && text.contains("≤571 → 4g.40gb"),
            "{text}"
        );
    }

    #[test]
    fn whole_and_multi_gpu_tasks_take_full_gpus() {
        let s = h100();
        let m = Mapper::new(&s).unwrap();
        let t = TaskRow {
            name: "p".into(),
            cpu_milli: 1000,
            memory_mib: 10,
            num_gpu: 4,
            gpu_milli: 1000,
            creation_time: None,
            deletion_time: None,
            gpu_spec: Vec::new(),
        };
        let d = m.map(&s, &t);
        assert_eq!(s.profiles[d.profile.unwrap()].name, "7g.80gb");
        assert_eq!((d.count, d.compute_slices, d.memory_slices), (4, 28, 32));
        assert_eq!(m.classes()[d.class], "multi-gpu (n × 7g.80gb)");
        let cpu = m.map(
            &s,
            &TaskRow {
                num_gpu: 0,
                gpu_milli: 0,
                ..t.clone()
            },
        );
        assert_eq!((cpu.profile, cpu.compute_slices), (None, 0));
        assert_eq!(m.classes()[cpu.class], "cpu-only");
    }

    #[test]
    fn internal_fragmentation_counts_rounding_up() {
        let s = h100();
        let m = Mapper::new(&s).unwrap();
        let t = |milli| TaskRow {
            name: "p".into(),
            cpu_milli: 1,
            memory_mib: 1,
            num_gpu: 1,
            gpu_milli: milli,
            creation_time: None,
            deletion_time: None,
            gpu_spec: Vec::new(),
        };
        // 470 → 4g.40gb: 4/7 compute and 4/8 memory of a GPU for 0.47 requested.
        let f = m.internal(&s, &[t(470), t(1000)]);
        assert_eq!(f.sharing.tasks, 1);
        assert!((f.sharing.compute_ratio() - (4.0 / 7.0) / 0.47).abs() < 1e-9);
        assert!((f.sharing.memory_ratio() - 0.5 / 0.47).abs() < 1e-9);
        assert_eq!(f.all.tasks, 2);
    }

    #[test]
    fn a30_and_non_mig_models() {
        let a30 = GpuModel::find("a30").unwrap().spec();
        let m = Mapper::new(&a30).unwrap();
        assert_eq!(name(&a30, &m, 250), "1g.6gb");
        assert_eq!(name(&a30, &m, 300), "2g.12gb");
        assert_eq!(name(&a30, &m, 600), "4g.24gb");
        let l4 = GpuModel::find("l4").unwrap().spec();
        assert!(matches!(
            Mapper::new(&l4),
            Err(FragError::NotMigCapable { .. })
        ));
    }
}
