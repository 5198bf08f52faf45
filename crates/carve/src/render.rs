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
}

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

    /// Text picture: one row of cells, then a legend.
    #[must_use]
    pub fn to_text(&self) -> String {
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
            let _ = writeln!(
                out,
                "   {} = {} {} at slice {}",
                letter(k),
                h.holder,
                h.profile,
                h.start
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

const COLORS: &[&str] = &[
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// An SVG of every GPU, one row each.
#[must_use]
pub fn to_svg(gpus: &[GpuPicture]) -> String {
    let cell = 90;
    let row_h = 60;
    let left = 230;
    let width = left + 8 * cell + 20;
    let height = 30 + gpus.len() * row_h + 20;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"monospace\" font-size=\"11\">\n<text x=\"10\" y=\"18\" font-size=\"13\">carve: memory slices per GPU (grey: free, hatched red: stranded)</text>\n"
    );
    for (r, g) in gpus.iter().enumerate() {
        let y = 30 + r * row_h;
        let _ = writeln!(
            s,
            "<text x=\"10\" y=\"{}\">{} {}</text>",
            y + 25,
            esc(&g.name),
            esc(&g.spec.product_name)
        );
        if !g.spec.mig_capable {
            let fill = if g.whole.is_some() {
                COLORS[0]
            } else {
                "#dddddd"
            };
            let _ = writeln!(
                s,
                "<rect x=\"{left}\" y=\"{y}\" width=\"{}\" height=\"40\" fill=\"{fill}\" stroke=\"#333\"/>",
                8 * cell
            );
            continue;
        }
        let (cells, _) = g.cells();
        for (i, c) in cells.iter().enumerate() {
            let x = left + i * cell;
            let (fill, label) = match c {
                Cell::Held(k) => (
                    COLORS[*k % COLORS.len()],
                    format!("{} {}", g.held[*k].holder, g.held[*k].profile),
                ),
                Cell::Whole => (
                    COLORS[0],
                    g.whole.as_ref().map(Whole::describe).unwrap_or_default(),
                ),
                Cell::Free => ("#dddddd", "free".into()),
                Cell::Stranded => ("#f4cccc", "stranded".into()),
            };
            let _ = writeln!(
                s,
                "<rect x=\"{x}\" y=\"{y}\" width=\"{cell}\" height=\"40\" fill=\"{fill}\" stroke=\"#333\"/>"
            );
            let short: String = label.chars().take(13).collect();
            let _ = writeln!(
                s,
                "<text x=\"{}\" y=\"{}\">{}</text>",
                x + 3,
                y + 24,
                esc(&short)
            );
        }
    }
    s.push_str("</svg>\n");
    s
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
            }),
        };
        let t = g("a100-40gb", Sharing::Mps).to_text();
        assert!(t.contains("8/8 memory slices used"), "{t}");
        assert!(t.contains("|  M  |  M  |"), "{t}");
        assert!(t.contains("M = a, b (whole GPU shared through MPS)"), "{t}");
        let t = g("l4", Sharing::Timeslice).to_text();
        assert!(
            t.contains("not MIG-capable, whole GPU: a, b (whole GPU, time-sliced)"),
            "{t}"
        );
        let svg = to_svg(&[g("h100", Sharing::Exclusive)]);
        assert!(svg.contains("a, b (whole"), "{svg}");
    }

    #[test]
    fn svg_has_one_rect_per_slice_and_escapes() {
        let spec = GpuModel::find("a30").unwrap().spec();
        let g = GpuPicture {
            name: "gpu-0".into(),
            spec,
            held: vec![Held {
                holder: "<a>".into(),
                profile: "2g.12gb".into(),
                start: 2,
            }],
            whole: None,
        };
        let svg = to_svg(&[g]);
        assert_eq!(svg.matches("<rect").count(), 4);
        assert!(svg.contains("&lt;a&gt;"));
        assert!(!svg.contains("<a>"));
    }
}
