//! The figures as table rows, next to their targets and baselines.

use std::fmt::Write as _;
use std::time::Duration;

use super::in_process::{Call, InProcess};
use super::process::ProcessFigures;
use super::{NVIDIA_HELP_RSS_BYTES, OVERHEAD_TARGET, Options, RSS_TARGET_BYTES, START_TARGET};

/// Nearest-rank percentile of durations (sorted in place).
fn pct(v: &mut [Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort_unstable();
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

fn mb(kib: u64) -> f64 {
    kib as f64 * 1024.0 / 1e6
}

fn verdict(ok: bool) -> &'static str {
    if ok { "ok" } else { "MISSED" }
}

/// `value / target` of a lower-is-better figure.
fn ratio(value: Duration, target: Duration) -> String {
    format!(
        "{:.2}x target",
        value.as_secs_f64() / target.as_secs_f64().max(f64::MIN_POSITIVE)
    )
}

/// Verdict and ratio side by side.
fn versus(ok: bool, value: Duration, target: Duration) -> String {
    format!("{} ({})", verdict(ok), ratio(value, target))
}

fn row(out: &mut String, figure: &str, value: &str, target: &str, baseline: &str, result: &str) {
    let _ = writeln!(
        out,
        "{figure:<54} {value:>32}  {target:<16} {baseline:<34} {result}"
    );
}

/// Whether figures met their targets, and their rows.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Table rows, one a line, under [`table_header`].
    pub rows: String,
    /// Every target was met (the counts of created and destroyed instances
    /// included).
    pub met: bool,
}

/// The header row of the table.
pub fn table_header() -> String {
    let mut out = String::new();
    row(&mut out, "figure", "value", "target", "baseline", "result");
    out
}

fn p50_p99(v: impl IntoIterator<Item = Duration>) -> (Duration, Duration) {
    let mut v: Vec<Duration> = v.into_iter().collect();
    (pct(&mut v, 50.0), pct(&mut v, 99.0))
}

fn pair(p: (Duration, Duration)) -> String {
    format!("{} / {}", ms(p.0), ms(p.1))
}

impl InProcess {
    /// The in-process rows: per call kind, the API round trips alone, the
    /// concurrent throughput, the instance counts.
    pub fn report(&self, a: &Options) -> Report {
        let mut out = String::new();
        let mut met = true;
        for (name, v) in [("prepare", &self.prepare), ("unprepare", &self.unprepare)] {
            met &= call_rows(name, v, &mut out);
        }
        self.alone_rows(&mut out);
        self.throughput_rows(a, &mut out);
        met &= self.count_rows(&mut out);
        Report { rows: out, met }
    }

    /// The API-server round trips, the blocking-thread hand-off and the
    /// context switches, each alone.
    fn alone_rows(&self, out: &mut String) {
        let r = self;
        row(
            out,
            "claim GET to the stand-in, alone, p50 / p99 (ms)",
            &pair(p50_p99(r.api_get.iter().copied())),
            "",
            "in prepare's overhead",
            "",
        );
        row(
            out,
            "status PATCH to the stand-in, alone, p50 / p99 (ms)",
            &pair(p50_p99(r.api_patch.iter().copied())),
            "",
            "background; settled before each unprepare",
            "",
        );
        row(
            out,
            "blocking-thread hand-off, empty, p50 / p99 (ms)",
            &pair(p50_p99(r.hop.iter().copied())),
            "",
            "one per NVML hop, in the overhead",
            "",
        );
        row(
            out,
            "context switches per prepare+unprepare cycle (whole process)",
            &format!("{:.1}", r.switches_per_cycle),
            "",
            "thread hand-offs, counted",
            "",
        );
    }

    /// The concurrent throughput, next to the one-at-a-time rate.
    fn throughput_rows(&self, a: &Options, out: &mut String) {
        let r = self;
        let seq_total: Duration = r.prepare.iter().chain(&r.unprepare).map(|x| x.total).sum();
        let seq_rate = if seq_total.is_zero() {
            0.0
        } else {
            r.prepare.len() as f64 / seq_total.as_secs_f64()
        };
        let rate = |wall: Duration| {
            if wall.is_zero() {
                0.0
            } else {
                r.concurrent_claims as f64 / wall.as_secs_f64()
            }
        };
        let both = r.concurrent_prepare_wall + r.concurrent_unprepare_wall;
        row(
            out,
            &format!(
                "concurrent prepare, {} at once on {} GPUs (claims/s)",
                a.concurrency, a.gpus
            ),
            &format!("{:.0}", rate(r.concurrent_prepare_wall)),
            "",
            "",
            "",
        );
        row(
            out,
            "concurrent unprepare (claims/s)",
            &format!("{:.0}", rate(r.concurrent_unprepare_wall)),
            "",
            "",
            "",
        );
        row(
            out,
            "concurrent prepare+unprepare cycles (claims/s)",
            &format!("{:.0}", rate(both)),
            "",
            &format!("one at a time: {seq_rate:.0} claims/s"),
            "",
        );
    }

    /// Instances created and destroyed, one per prepare and unprepare, and
    /// none left; whether they match.
    fn count_rows(&self, out: &mut String) -> bool {
        let r = self;
        let prepares = r.prepares_ok;
        let unprepares = r.unprepares_ok;
        let counts_ok = r.counts.gi_created == prepares
            && r.counts.ci_created == prepares
            && r.counts.gi_destroyed == unprepares
            && r.counts.ci_destroyed == unprepares
            && r.live_at_end == 0
            && r.cdi_left == 0;
        row(
            out,
            "GI/CI created, destroyed; live; CDI left",
            &format!(
                "{}/{}, {}/{}; {}; {}",
                r.counts.gi_created,
                r.counts.ci_created,
                r.counts.gi_destroyed,
                r.counts.ci_destroyed,
                r.live_at_end,
                r.cdi_left
            ),
            &format!("{prepares}, {unprepares}; 0; 0"),
            "",
            verdict(counts_ok),
        );
        counts_ok
    }
}

/// The rows of one call kind (`prepare`, `unprepare`); whether its
/// overhead met the target.
fn call_rows(name: &str, v: &[Call], out: &mut String) -> bool {
    let t = p50_p99(v.iter().map(|x| x.total));
    let n = p50_p99(v.iter().map(|x| x.nvml));
    let f = p50_p99(v.iter().map(|x| x.sync));
    let o = p50_p99(v.iter().map(Call::overhead));
    let od = p50_p99(v.iter().map(|x| x.overhead().saturating_sub(x.sync)));
    let syncs = v.iter().map(|x| x.syncs).sum::<u64>() as f64 / v.len().max(1) as f64;
    row(
        out,
        &format!("{name}: total p50 / p99 (ms)"),
        &pair(t),
        "",
        "",
        "",
    );
    row(
        out,
        &format!("{name}: inside NVML p50 / p99 (ms)"),
        &pair(n),
        "",
        "",
        "",
    );
    row(
        out,
        &format!("{name}: checkpoint fsyncs/call; their p50 / p99 (ms)"),
        &format!("{syncs:.1}; {}", pair(f)),
        "",
        "",
        "",
    );
    let ok = o.1 <= OVERHEAD_TARGET;
    row(
        out,
        &format!("{name}: overhead (total - NVML) p50 / p99 (ms)"),
        &pair(o),
        "p99 <= 1 ms",
        "",
        &versus(ok, o.1, OVERHEAD_TARGET),
    );
    row(
        out,
        &format!("{name}: overhead - fsync p50 / p99 (ms)"),
        &pair(od),
        "(p99 <= 1 ms)",
        "",
        &ratio(od.1, OVERHEAD_TARGET),
    );
    let cpu: Option<Vec<Duration>> = v.iter().map(Call::cpu_overhead).collect();
    match cpu {
        Some(cpu) if !cpu.is_empty() => {
            let c = p50_p99(cpu);
            row(
                out,
                &format!("{name}: CPU time - NVML p50 / p99 (ms)"),
                &pair(c),
                "(p99 <= 1 ms)",
                "all threads but the stand-in's",
                &ratio(c.1, OVERHEAD_TARGET),
            );
        }
        _ => row(
            out,
            &format!("{name}: CPU time - NVML"),
            "unavailable",
            "",
            "no per-thread CPU time from the kernel",
            "",
        ),
    }
    ok
}

impl ProcessFigures {
    /// The plugin-process rows: RSS idle and after the claims, by mapping,
    /// `carve --help`'s peak, the time to registration, instances left.
    pub fn report(&self) -> Report {
        let mut out = String::new();
        let met = rss_rows(self, &mut out) & start_rows(self, &mut out);
        Report { rows: out, met }
    }
}

/// The RSS rows; whether RSS and its high-water mark met the target.
fn rss_rows(f: &ProcessFigures, out: &mut String) -> bool {
    let target = RSS_TARGET_BYTES as f64 / 1e6;
    let base = format!(
        "NVIDIA Go plugin --help: {:.0} MB",
        NVIDIA_HELP_RSS_BYTES as f64 / 1e6
    );
    let rss_ok = mb(f.rss_kib) * 1e6 <= RSS_TARGET_BYTES as f64;
    let hwm_ok = mb(f.hwm_kib) * 1e6 <= RSS_TARGET_BYTES as f64;
    let split = |k: [u64; 4]| {
        format!(
            "{:.1} (anon {:.1}, file {:.1})",
            mb(k[0]),
            mb(k[2]),
            mb(k[3])
        )
    };
    row(
        out,
        "plugin VmRSS registered, idle (MB)",
        &split(f.rss_idle_kib),
        "",
        "",
        "",
    );
    row(
        out,
        &format!("plugin VmRSS after {} claims (MB)", f.cycles),
        &split(f.rss_after_kib),
        &format!("<= {target:.0} MB"),
        &base,
        &format!(
            "{} ({:.2}x target)",
            verdict(rss_ok),
            mb(f.rss_kib) * 1e6 / RSS_TARGET_BYTES as f64
        ),
    );
    let top = |by: &[(String, u64)]| {
        by.iter()
            .take(6)
            .map(|(name, kib)| format!("{name} {:.1}", mb(*kib)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    row(
        out,
        "plugin RSS by mapping registered, idle (MB)",
        &top(&f.rss_idle_by_mapping),
        "",
        "",
        "",
    );
    row(
        out,
        &format!("plugin RSS by mapping after {} claims (MB)", f.cycles),
        &top(&f.rss_by_mapping),
        "",
        "",
        "",
    );
    row(
        out,
        &format!("plugin VmHWM after {} claims (MB)", f.cycles),
        &format!("{:.1}", mb(f.hwm_kib)),
        &format!("<= {target:.0} MB"),
        &base,
        &format!(
            "{} ({:.2}x target)",
            verdict(hwm_ok),
            mb(f.hwm_kib) * 1e6 / RSS_TARGET_BYTES as f64
        ),
    );
    row(
        out,
        "carve --help peak RSS (MB, upper bound, see docs)",
        &format!("{:.1}", mb(f.help_peak_kib)),
        "",
        &base,
        "",
    );
    rss_ok && hwm_ok
}

/// The time to registration and the instances left; whether both met
/// their targets.
fn start_rows(f: &ProcessFigures, out: &mut String) -> bool {
    let mut s = f.starts.clone();
    let p50 = pct(&mut s, 50.0);
    let max = s.iter().copied().max().unwrap_or_default();
    let start_ok = max <= START_TARGET;
    row(
        out,
        &format!(
            "start -> GetInfo answered, {} starts p50 / max (ms)",
            f.starts.len()
        ),
        &format!("{} / {}", ms(p50), ms(max)),
        "max <= 1 s",
        "",
        &versus(start_ok, max, START_TARGET),
    );
    let live_ok = f.live_at_end == 0;
    row(
        out,
        "plugin process: GPU instances left",
        &f.live_at_end.to_string(),
        "0",
        "",
        verdict(live_ok),
    );
    start_ok && live_ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        assert_eq!(pct(&mut v, 50.0), Duration::from_millis(50));
        assert_eq!(pct(&mut v, 99.0), Duration::from_millis(99));
        assert_eq!(
            pct(&mut [Duration::from_millis(7)], 99.0),
            Duration::from_millis(7)
        );
    }
}
