//! Pictures of GPUs' memory slices for the terminal and as SVG: which claim
//! holds which slice, what is free, what is stranded.

use std::fmt::Write as _;

use carve_model::GpuSpec;
use carve_model::geometry::{Instance, Occupancy};
use carve_model::sharing::Sharing;

/// One MIG instance on a GPU and who holds it.
#[derive(Clone, Debug)]
pub struct Held {
    /// Short label of the holder (claim name; several, `+`-joined, for an
    /// instance shared through MPS).
    pub holder: String,
    /// Profile name.
    pub profile: String,
    /// Placement start.
    pub start: u8,
    /// The instance is shared through MPS (a `mig-mps` device), however many
    /// shares it has now.
    pub shared: bool,
    /// What its MPS shares consume of the instance (their allocated memory
    /// and SMs, summed), for a shared instance.
    pub used: Option<ShareUse>,
}

/// What one GPU looks like.
#[derive(Clone, Debug)]
pub struct GpuPicture {
    /// Device name of the GPU (`gpu-0`).
    pub name: String,
    /// Its spec.
    pub spec: GpuSpec,
    /// Instances on it.
    pub held: Vec<Held>,
    /// The whole GPU is held, not partitioned.
    pub whole: Option<Whole>,
}

/// Who holds a whole GPU, and how.
#[derive(Clone, Debug)]
pub struct Whole {
    /// Claim names, in the order they got it.
    pub holders: Vec<String>,
    /// One claim alone, or shares through MPS or time-slicing.
    pub sharing: Sharing,
    /// What the MPS shares consume of the GPU's capacity (their allocated
    /// `memory` and `multiprocessors`, summed); none for an exclusive or
    /// time-sliced GPU.
    pub used: Option<ShareUse>,
}

/// Capacity the shares of a GPU consume.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShareUse {
    /// Memory, MiB.
    pub memory_mib: u64,
    /// Streaming multiprocessors (a ceiling per share, summed).
    pub multiprocessors: u64,
}

/// Cells of the text bar of a shared GPU's memory.
const SHARE_BAR: usize = 20;
/// Units across the SVG row of a shared GPU (its memory in hundredths).
const SHARE_UNITS: usize = 100;

impl Whole {
    /// The letter the picture uses.
    fn letter(&self) -> char {
        match self.sharing {
            Sharing::Exclusive => 'W',
            Sharing::Mps => 'M',
            Sharing::Timeslice => 'T',
        }
    }

    /// `whole-gpu (whole GPU)`, `a, b (whole GPU shared through MPS)`.
    fn describe(&self) -> String {
        let how = match self.sharing {
            Sharing::Exclusive => "whole GPU",
            Sharing::Mps => "whole GPU shared through MPS",
            Sharing::Timeslice => "whole GPU, time-sliced",
        };
        format!("{} ({how})", self.holders.join(", "))
    }
}

/// State of one memory slice.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Cell {
    Held(usize),
    Whole,
    Free,
    Stranded,
}

impl GpuPicture {
    fn cells(&self) -> (Vec<Cell>, carve_model::Stranded) {
        let n = usize::from(self.spec.memory_slices);
        let mut cells = vec![Cell::Free; n];
        if self.whole.is_some() {
            return (vec![Cell::Whole; n], carve_model::Stranded::default());
        }
        let mut occ = Occupancy::new(&self.spec);
        for (k, h) in self.held.iter().enumerate() {
            if let Some(pi) = self.spec.profiles.iter().position(|p| p.name == h.profile) {
                // The picture shows what exists even if it conflicts; the
                // stranded figure uses only what fits.
                let _ = occ.place(Instance {
                    profile: pi,
                    start: h.start,
                });
                let size = self.spec.profiles[pi].memory_slices;
                for s in h.start..(h.start + size).min(self.spec.memory_slices) {
                    cells[usize::from(s)] = Cell::Held(k);
                }
            }
        }
        let stranded = occ.stranded();
        // Mark free slices that no feasible placement covers.
        let mut coverable = 0u16;
        for i in occ.feasible() {
            let size = self.spec.profiles[i.profile].memory_slices;
            coverable |= carve_model::Placement::new(i.start, size).mask();
        }
        for (s, c) in cells.iter_mut().enumerate() {
            if *c == Cell::Free && coverable & (1 << s) == 0 {
                *c = Cell::Stranded;
            }
        }
        (cells, stranded)
    }

    /// The shares' memory as a fraction of the GPU's, 0 to 1.
    fn shared_fraction(&self, u: ShareUse) -> f64 {
        let total = self.spec.memory_mib.max(1) as f64;
        (u.memory_mib as f64 / total).clamp(0.0, 1.0)
    }

    /// Text of a GPU shared through MPS or time-slicing: by what the shares
    /// use, not as memory slices (a shared GPU has no MIG partitions).
    fn shared_text(&self, w: &Whole) -> Option<String> {
        let mut out = String::new();
        match (w.sharing, w.used) {
            (Sharing::Mps, Some(u)) => {
                let frac = self.shared_fraction(u);
                let full = ((frac * SHARE_BAR as f64).ceil() as usize)
                    .min(SHARE_BAR)
                    .max(usize::from(u.memory_mib > 0));
                let _ = writeln!(
                    out,
                    "{} ({}): shared through MPS, the shares use {} of {} MiB memory, {} of {} SMs (SM limits are ceilings)",
                    self.name,
                    self.spec.product_name,
                    u.memory_mib,
                    self.spec.memory_mib,
                    u.multiprocessors,
                    self.spec.multiprocessors
                );
                let _ = writeln!(
                    out,
                    "  memory |{}{}|",
                    "M".repeat(full),
                    ".".repeat(SHARE_BAR - full)
                );
                let _ = writeln!(out, "   M = {}", w.describe());
            }
            (Sharing::Timeslice, _) => {
                let _ = writeln!(
                    out,
                    "{} ({}): time-sliced, every share sees all {} MiB and {} SMs (no memory partition)",
                    self.name,
                    self.spec.product_name,
                    self.spec.memory_mib,
                    self.spec.multiprocessors
                );
                let _ = writeln!(out, "   T = {}", w.describe());
            }
            _ => return None,
        }
        Some(out)
    }

    /// Text picture: one row of cells, then a legend.
    #[must_use]
    pub fn to_text(&self) -> String {
        if let Some(t) = self.whole.as_ref().and_then(|w| self.shared_text(w)) {
            return t;
        }
        let mut out = String::new();
        if !self.spec.mig_capable {
            let who = self
                .whole
                .as_ref()
                .map_or_else(|| "free".to_string(), Whole::describe);
            let _ = writeln!(
                out,
                "{} ({}): not MIG-capable, whole GPU: {who}",
                self.name, self.spec.product_name
            );
            return out;
        }
        let (cells, stranded) = self.cells();
        let used = cells
            .iter()
            .filter(|c| matches!(c, Cell::Held(_) | Cell::Whole))
            .count();
        let _ = writeln!(
            out,
            "{} ({}): {used}/{} memory slices used, stranded {} memory / {} compute slices",
            self.name,
            self.spec.product_name,
            self.spec.memory_slices,
            stranded.memory_slices,
            stranded.compute_slices
        );
        let mut row = String::from("  |");
        let mut idx = String::from("   ");
        for (s, c) in cells.iter().enumerate() {
            let label = match c {
                Cell::Held(k) => letter(*k).to_string(),
                Cell::Whole => self.whole.as_ref().map_or('W', Whole::letter).to_string(),
                Cell::Free => ".".into(),
                Cell::Stranded => "x".into(),
            };
            let _ = write!(row, " {label:^3} |");
            let _ = write!(idx, " {s:^3}  ");
        }
        let _ = writeln!(out, "{idx}");
        let _ = writeln!(out, "{row}");
        for (k, h) in self.held.iter().enumerate() {
            let shared = match (h.shared, h.used) {
                (false, _) => String::new(),
                (true, None) => " (MIG instance shared through MPS)".into(),
                (true, Some(u)) => {
                    let p = self.spec.profiles.iter().find(|p| p.name == h.profile);
                    format!(
                        " (MIG instance shared through MPS; the shares use {} of {} MiB, {} of {} SMs)",
                        u.memory_mib,
                        p.map_or(0, |p| p.memory_mib),
                        u.multiprocessors,
                        p.map_or(0, |p| p.multiprocessors)
                    )
                }
            };
            let _ = writeln!(
                out,
                "   {} = {} {} at slice {}{shared}",
                letter(k),
                h.holder,
                h.profile,
                h.start,
            );
        }
        if let Some(w) = &self.whole {
            let _ = writeln!(out, "   {} = {}", w.letter(), w.describe());
        }
        out
    }
}

fn letter(k: usize) -> char {
    char::from(b'A' + u8::try_from(k % 26).unwrap_or(0))
}

/// What a block of the picture is; each kind has one colour, the legend
/// lists them in this order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Mig,
    MigMps,
    Whole,
    WholeMps,
    Timeslice,
    Free,
    Stranded,
}

impl Kind {
    const ALL: [Kind; 7] = [
        Kind::Mig,
        Kind::MigMps,
        Kind::Whole,
        Kind::WholeMps,
        Kind::Timeslice,
        Kind::Free,
        Kind::Stranded,
    ];

    fn fill(self) -> &'static str {
        match self {
            Kind::Mig => "#4e79a7",
            Kind::MigMps => "#b07aa1",
            Kind::Whole => "#59a14f",
            Kind::WholeMps => "#f28e2b",
            Kind::Timeslice => "#edc948",
            Kind::Free => "#e6e6e6",
            Kind::Stranded => "url(#stranded)",
        }
    }

    /// Label colour that reads on the fill.
    fn ink(self) -> &'static str {
        match self {
            Kind::Mig | Kind::MigMps | Kind::Whole => "#ffffff",
            _ => "#222222",
        }
    }

    fn legend(self) -> &'static str {
        match self {
            Kind::Mig => "MIG instance",
            Kind::MigMps => "MIG instance shared through MPS",
            Kind::Whole => "whole GPU",
            Kind::WholeMps => "whole GPU shared through MPS",
            Kind::Timeslice => "whole GPU, time-sliced",
            Kind::Free => "free",
            Kind::Stranded => "stranded: free, but no profile fits",
        }
    }

    fn of_whole(w: &Whole) -> Kind {
        match w.sharing {
            Sharing::Exclusive => Kind::Whole,
            Sharing::Mps => Kind::WholeMps,
            Sharing::Timeslice => Kind::Timeslice,
        }
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Width of one character of the picture's 12 px monospace font.
const CHAR_W: f64 = 7.3;

/// `text` cut to what fits in `width` pixels, with an ellipsis where cut.
fn fit_label(text: &str, width: f64) -> String {
    let room = ((width - 10.0) / CHAR_W).floor().max(0.0) as usize;
    if text.chars().count() <= room {
        return text.to_string();
    }
    if room < 2 {
        return String::new();
    }
    let mut cut: String = text.chars().take(room - 1).collect();
    cut.push('\u{2026}');
    cut
}

/// One block of a row: `slices` memory slices from `first`, of one kind,
/// with up to two label lines.
struct Block {
    first: usize,
    slices: usize,
    kind: Kind,
    lines: Vec<String>,
}

impl GpuPicture {
    /// The row's blocks, left to right: each instance one block across its
    /// slices, each free or stranded slice a block of its own, a whole GPU one
    /// block across the row.
    fn blocks(&self) -> Vec<Block> {
        if let Some(w) = &self.whole
            && let (Sharing::Mps, Some(u)) = (w.sharing, w.used)
        {
            let used = ((self.shared_fraction(u) * SHARE_UNITS as f64).round() as usize)
                .clamp(usize::from(u.memory_mib > 0), SHARE_UNITS);
            let mut out = vec![Block {
                first: 0,
                slices: used,
                kind: Kind::WholeMps,
                lines: vec![
                    w.holders.join(", "),
                    format!("{} MiB, {} SMs", u.memory_mib, u.multiprocessors),
                ],
            }];
            if used < SHARE_UNITS {
                out.push(Block {
                    first: used,
                    slices: SHARE_UNITS - used,
                    kind: Kind::Free,
                    lines: vec![format!(
                        "free: {} MiB",
                        self.spec.memory_mib.saturating_sub(u.memory_mib)
                    )],
                });
            }
            return out;
        }
        if let Some(w) = &self.whole {
            return vec![Block {
                first: 0,
                slices: usize::from(self.spec.memory_slices).max(1),
                kind: Kind::of_whole(w),
                lines: vec![w.describe()],
            }];
        }
        if !self.spec.mig_capable {
            return vec![Block {
                first: 0,
                slices: 1,
                kind: Kind::Free,
                lines: vec!["free (not MIG-capable)".into()],
            }];
        }
        let (cells, _) = self.cells();
        let mut out: Vec<Block> = Vec::new();
        for (i, c) in cells.iter().enumerate() {
            match c {
                Cell::Held(k) => {
                    if let Some(b) = out.last_mut()
                        && b.first + b.slices == i
                        && matches!(cells[b.first], Cell::Held(j) if j == *k)
                    {
                        b.slices += 1;
                        continue;
                    }
                    let h = &self.held[*k];
                    out.push(Block {
                        first: i,
                        slices: 1,
                        kind: if h.shared { Kind::MigMps } else { Kind::Mig },
                        lines: vec![h.holder.replace('+', ", "), h.profile.clone()],
                    });
                }
                Cell::Whole => {}
                Cell::Free => out.push(Block {
                    first: i,
                    slices: 1,
                    kind: Kind::Free,
                    lines: vec!["free".into()],
                }),
                Cell::Stranded => out.push(Block {
                    first: i,
                    slices: 1,
                    kind: Kind::Stranded,
                    lines: vec!["stranded".into()],
                }),
            }
        }
        out
    }
}

/// An SVG of every GPU, one row each: each MIG instance is one block across
/// its memory slices, a colour per kind of device, and a legend of exactly
/// the kinds drawn.
#[must_use]
pub fn to_svg(gpus: &[GpuPicture]) -> String {
    let left = 200.0;
    let row_w = 8.0 * 110.0;
    let row_h = 66.0;
    let block_h = 52.0;
    let top = 58.0;
    let mut body = String::new();
    let mut used: Vec<Kind> = Vec::new();
    for (r, g) in gpus.iter().enumerate() {
        let y = top + r as f64 * row_h;
        let _ = writeln!(
            body,
            "<text x=\"12\" y=\"{:.0}\" font-weight=\"bold\">{}</text>\n<text x=\"12\" y=\"{:.0}\" fill=\"#555\">{}</text>",
            y + 22.0,
            esc(&g.name),
            y + 40.0,
            esc(&fit_label(&g.spec.product_name, left - 12.0))
        );
        let blocks = g.blocks();
        let n = blocks
            .iter()
            .map(|b| b.first + b.slices)
            .max()
            .unwrap_or(1)
            .max(1) as f64;
        let slice_w = row_w / n;
        for b in &blocks {
            if !used.contains(&b.kind) {
                used.push(b.kind);
            }
            let x = left + b.first as f64 * slice_w;
            let w = b.slices as f64 * slice_w;
            // The whole label as a tooltip, since the drawn one may be cut.
            let _ = writeln!(
                body,
                "<rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{w:.1}\" height=\"{block_h}\" rx=\"4\" fill=\"{}\" stroke=\"#ffffff\" stroke-width=\"3\"><title>{}</title></rect>",
                b.kind.fill(),
                esc(&b.lines.join(" "))
            );
            for (l, line) in b.lines.iter().enumerate() {
                let _ = writeln!(
                    body,
                    "<text x=\"{:.1}\" y=\"{:.1}\" fill=\"{}\">{}</text>",
                    x + 7.0,
                    y + 21.0 + l as f64 * 17.0,
                    b.kind.ink(),
                    esc(&fit_label(line, w))
                );
            }
        }
    }
    // The legend: the kinds drawn, in a fixed order.
    let legend_y = top + gpus.len() as f64 * row_h + 16.0;
    let mut x = 12.0;
    let mut ly = legend_y;
    let width = left + row_w + 12.0;
    for k in Kind::ALL.iter().filter(|k| used.contains(k)) {
        let item_w = 26.0 + k.legend().len() as f64 * CHAR_W + 24.0;
        if x + item_w > width {
            x = 12.0;
            ly += 24.0;
        }
        let _ = writeln!(
            body,
            "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"18\" height=\"18\" rx=\"3\" fill=\"{}\" stroke=\"#999\"/>\n<text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            ly,
            k.fill(),
            x + 26.0,
            ly + 14.0,
            k.legend()
        );
        x += item_w;
    }
    let height = ly + 36.0;
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width:.0}\" height=\"{height:.0}\" font-family=\"DejaVu Sans Mono, monospace\" font-size=\"12\">\n\
<defs><pattern id=\"stranded\" width=\"8\" height=\"8\" patternUnits=\"userSpaceOnUse\" patternTransform=\"rotate(45)\"><rect width=\"8\" height=\"8\" fill=\"#f4cccc\"/><line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"8\" stroke=\"#d9534f\" stroke-width=\"3\"/></pattern></defs>\n\
<rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n\
<text x=\"12\" y=\"26\" font-size=\"16\" font-weight=\"bold\">carve: who holds which memory slices, one GPU per row</text>\n\
<text x=\"{left}\" y=\"48\" fill=\"#555\">memory slices, left to right</text>\n{body}</svg>\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use carve_model::GpuModel;

    #[test]
    fn text_shows_holders_free_and_stranded() {
        let spec = GpuModel::find("h100").unwrap().spec();
        let g = GpuPicture {
            name: "gpu-0".into(),
            spec,
            held: (0..7)
                .map(|s| Held {
                    holder: format!("c{s}"),
                    profile: "1g.10gb".into(),
                    start: s,
                    shared: false,
                    used: None,
                })
                .collect(),
            whole: None,
        };
        let t = g.to_text();
        assert!(t.contains("7/8 memory slices used"), "{t}");
        assert!(t.contains("stranded 1 memory / 0 compute"), "{t}");
        assert!(t.contains(" x "), "slice 7 is stranded: {t}");
        assert!(t.contains("G = c6 1g.10gb at slice 6"), "{t}");
    }

    #[test]
    fn a_shared_whole_gpu_names_every_holder_and_how() {
        let g = |key: &str, sharing| GpuPicture {
            name: "gpu-3".into(),
            spec: GpuModel::find(key).unwrap().spec(),
            held: vec![],
            whole: Some(Whole {
                holders: vec!["a".into(), "b".into()],
                sharing,
                used: (sharing == Sharing::Mps).then_some(ShareUse {
                    memory_mib: 10240,
                    multiprocessors: 27,
                }),
            }),
        };
        // Drawn by what the shares use: 10 GiB of 40 GiB is a quarter.
        let t = g("a100-40gb", Sharing::Mps).to_text();
        assert!(!t.contains("memory slices used"), "{t}");
        assert!(
            t.contains("the shares use 10240 of 40960 MiB memory, 27 of 108 SMs"),
            "{t}"
        );
        assert!(t.contains("memory |MMMMM...............|"), "{t}");
        assert!(t.contains("M = a, b (whole GPU shared through MPS)"), "{t}");
        let svg = to_svg(&[g("a100-40gb", Sharing::Mps)]);
        assert!(svg.contains("free: 30720 MiB"), "{svg}");
        let t = g("l4", Sharing::Timeslice).to_text();
        assert!(t.contains("time-sliced, every share sees all"), "{t}");
        assert!(t.contains("T = a, b (whole GPU, time-sliced)"), "{t}");
        // A MIG instance shared through MPS: its shares' use within it.
        let m = GpuPicture {
            name: "gpu-0".into(),
            spec: GpuModel::find("h100").unwrap().spec(),
            held: vec![Held {
                holder: "a+b".into(),
                profile: "3g.40gb".into(),
                start: 0,
                shared: true,
                used: Some(ShareUse {
                    memory_mib: 8192,
                    multiprocessors: 20,
                }),
            }],
            whole: None,
        };
        let t = m.to_text();
        let p = m
            .spec
            .profiles
            .iter()
            .find(|p| p.name == "3g.40gb")
            .unwrap();
        assert!(
            t.contains(&format!(
                "A = a+b 3g.40gb at slice 0 (MIG instance shared through MPS; the shares use 8192 of {} MiB, 20 of {} SMs)",
                p.memory_mib, p.multiprocessors
            )),
            "{t}"
        );
        let svg = to_svg(&[g("h100", Sharing::Exclusive)]);
        assert!(svg.contains("a, b (whole"), "{svg}");
    }

    #[test]
    fn svg_draws_an_instance_as_one_block_and_a_legend_of_what_is_drawn() {
        let spec = GpuModel::find("a30").unwrap().spec();
        let g = GpuPicture {
            name: "gpu-0".into(),
            spec,
            held: vec![Held {
                holder: "<a>".into(),
                profile: "2g.12gb".into(),
                start: 2,
                shared: false,
                used: None,
            }],
            whole: None,
        };
        let svg = to_svg(&[g]);
        // Two free slices and one block for the 2-slice instance, across two
        // slices' width (the row is 880 px for the A30's 4 slices).
        let blocks: Vec<&str> = svg
            .lines()
            .filter(|l| l.starts_with("<rect x=") && l.contains("height=\"52\""))
            .collect();
        assert_eq!(blocks.len(), 3, "{svg}");
        assert!(
            blocks.iter().any(|b| b.contains("x=\"640.0\"")
                && b.contains("width=\"440.0\"")
                && b.contains("#4e79a7")),
            "{svg}"
        );
        assert!(svg.contains("&lt;a&gt;"));
        assert!(!svg.contains("<a>"));
        // The legend lists exactly the kinds drawn.
        assert!(svg.contains(">MIG instance</text>"), "{svg}");
        assert!(svg.contains(">free</text>"), "{svg}");
        assert!(
            !svg.contains(">stranded: free, but no profile fits</text>"),
            "{svg}"
        );
        assert!(!svg.contains(">whole GPU</text>"), "{svg}");
    }

    #[test]
    fn long_labels_are_cut_with_an_ellipsis_to_their_block() {
        assert_eq!(fit_label("mig-same-parent", 400.0), "mig-same-parent");
        let cut = fit_label("mig-same-parent", 90.0);
        assert!(
            cut.ends_with('\u{2026}') && cut.chars().count() == 10,
            "{cut}"
        );
        assert_eq!(fit_label("abc", 10.0), "");
    }

    #[test]
    fn each_kind_has_its_own_colour() {
        let mut fills: Vec<&str> = Kind::ALL.iter().map(|k| k.fill()).collect();
        fills.sort_unstable();
        fills.dedup();
        assert_eq!(fills.len(), Kind::ALL.len());
    }
}
