//! CPU time of this process's threads, read from their thread CPU clocks.

use std::collections::BTreeMap;
use std::time::Duration;

/// CPU time used so far by the threads of this process, but those named
/// `skip`, each read from its thread CPU clock (as `pthread_getcpuclockid`
/// makes it; exact also for a thread that is running). The threads are
/// listed from `/proc/self/task`. `None` where that or the clocks are
/// unavailable.
pub(super) struct ThreadCpu {
    own: Duration,
    others: BTreeMap<i32, u64>,
}

impl ThreadCpu {
    /// Read the other threads first and this one last, so that reading
    /// costs as little as possible of the span it opens.
    pub(super) fn before(skip: &str) -> Option<Self> {
        let others = Self::others(skip)?;
        Some(Self {
            own: Self::own()?,
            others,
        })
    }

    /// CPU time used since `self`; this thread read first.
    pub(super) fn since(&self, skip: &str) -> Option<Duration> {
        let own = Self::own()?.saturating_sub(self.own);
        let others: u64 = Self::others(skip)?
            .iter()
            .map(|(tid, ns)| ns.saturating_sub(self.others.get(tid).copied().unwrap_or(0)))
            .sum();
        Some(own + Duration::from_nanos(others))
    }

    pub(super) fn own() -> Option<Duration> {
        Self::clock(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
    }

    pub(super) fn clock(id: nix::time::ClockId) -> Option<Duration> {
        Some(Duration::from(nix::time::clock_gettime(id).ok()?))
    }

    /// The CPU clock of thread `tid` of this process: the kernel's encoding
    /// of a per-thread scheduler clock, `(!tid << 3) | PERTHREAD | SCHED`.
    pub(super) fn thread_clock(tid: i32) -> nix::time::ClockId {
        const CPUCLOCK_PERTHREAD: i32 = 4;
        const CPUCLOCK_SCHED: i32 = 2;
        nix::time::ClockId::from_raw((!tid << 3) | CPUCLOCK_PERTHREAD | CPUCLOCK_SCHED)
    }

    pub(super) fn others(skip: &str) -> Option<BTreeMap<i32, u64>> {
        let me = nix::unistd::gettid().as_raw();
        let mut out = BTreeMap::new();
        for entry in std::fs::read_dir("/proc/self/task").ok()? {
            let entry = entry.ok()?;
            let Some(tid) = entry
                .file_name()
                .to_str()
                .and_then(|t| t.parse::<i32>().ok())
            else {
                continue;
            };
            if tid == me {
                continue;
            }
            // A thread that exited since the listing is skipped.
            let Ok(comm) = std::fs::read_to_string(entry.path().join("comm")) else {
                continue;
            };
            if comm.trim_end() == skip {
                continue;
            }
            if let Some(t) = Self::clock(Self::thread_clock(tid)) {
                out.insert(tid, u64::try_from(t.as_nanos()).ok()?);
            }
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread that used `cpu` of CPU time, then sleeps until `release`
    /// drops; reports its thread id.
    fn busy_thread(
        name: &str,
        cpu: Duration,
        release: std::sync::mpsc::Receiver<()>,
    ) -> (i32, std::thread::JoinHandle<()>) {
        let (tx, rx) = std::sync::mpsc::channel();
        let h = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                while ThreadCpu::own().unwrap() < cpu {
                    std::hint::black_box((0..1000u64).sum::<u64>());
                }
                tx.send(nix::unistd::gettid().as_raw()).unwrap();
                let _ = release.recv();
            })
            .unwrap();
        (rx.recv().unwrap(), h)
    }

    #[test]
    fn thread_cpu_counts_the_other_threads_but_the_skipped_ones() {
        // This thread's clock read through the per-thread encoding agrees
        // with CLOCK_THREAD_CPUTIME_ID.
        let me = nix::unistd::gettid().as_raw();
        let a = ThreadCpu::own().unwrap();
        let b = ThreadCpu::clock(ThreadCpu::thread_clock(me)).unwrap();
        let c = ThreadCpu::own().unwrap();
        assert!(a <= b && b <= c, "{a:?} {b:?} {c:?}");
        let before = ThreadCpu::before("skipped").unwrap();
        let (stop_a, ra) = std::sync::mpsc::channel();
        let (stop_b, rb) = std::sync::mpsc::channel();
        let (counted, ha) = busy_thread("counted", Duration::from_millis(40), ra);
        let (skipped, hb) = busy_thread("skipped", Duration::from_millis(40), rb);
        let others = ThreadCpu::others("skipped").unwrap();
        assert!(!others.contains_key(&skipped));
        assert!(!others.contains_key(&nix::unistd::gettid().as_raw()));
        assert!(others[&counted] >= 40_000_000, "{others:?}");
        // The counted thread is new since `before`: all its time counts.
        assert!(before.since("skipped").unwrap() >= Duration::from_millis(40));
        drop((stop_a, stop_b));
        ha.join().unwrap();
        hb.join().unwrap();
    }
}
