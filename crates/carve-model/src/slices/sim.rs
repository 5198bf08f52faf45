//! Simulated GPUs of the built-in models, for `carve slices --gpus h100-80gb:8`,
//! the simulator and tests: fake but stable UUIDs and PCI addresses.

use super::SliceError;
use crate::models::GpuModel;
use crate::spec::PhysicalGpu;

fn known() -> String {
    GpuModel::keys().join(", ")
}

/// The most GPUs a simulated node may have, all models together. A real
/// node has at most 16; the slices (and the simulated plugin's work) grow
/// with the GPU count, so a typo like `h100:100000` is refused instead of
/// running until it is killed.
pub const MAX_SIMULATED_GPUS: u32 = 64;

/// Parse `model:count[,model:count...]` (a bare `model` means one GPU) into
/// canonical model keys and counts.
///
/// # Errors
/// [`SliceError::GpuListSyntax`] for bad syntax or a zero count,
/// [`SliceError::UnknownModel`] listing the known models,
/// [`SliceError::TooManyGpus`] beyond [`MAX_SIMULATED_GPUS`] in all.
pub fn parse_gpu_spec(s: &str) -> Result<Vec<(String, u32)>, SliceError> {
    let gpus = parse_gpu_items(s)?;
    let total: u64 = gpus.iter().map(|(_, n)| u64::from(*n)).sum();
    if total > u64::from(MAX_SIMULATED_GPUS) {
        return Err(SliceError::TooManyGpus {
            input: s.to_string(),
            total,
            max: MAX_SIMULATED_GPUS,
        });
    }
    Ok(gpus)
}

fn parse_gpu_items(s: &str) -> Result<Vec<(String, u32)>, SliceError> {
    let syntax = |why: String| SliceError::GpuListSyntax {
        input: s.to_string(),
        why,
    };
    if s.trim().is_empty() {
        return Err(syntax(format!(
            "empty; expected model:count[,model:count], models: {}",
            known()
        )));
    }
    s.split(',')
        .map(|item| {
            let item = item.trim();
            let (model, count) = match item.split_once(':') {
                Some((m, c)) => {
                    let n: u32 = c.trim().parse().map_err(|_| {
                        syntax(format!("count {c:?} of {m:?} is not a positive integer"))
                    })?;
                    (m.trim(), n)
                }
                None => (item, 1),
            };
            if model.is_empty() {
                return Err(syntax(format!("item {item:?} names no model")));
            }
            if count == 0 {
                return Err(syntax(format!("count of {model:?} is 0")));
            }
            let m = GpuModel::find(model).ok_or_else(|| SliceError::UnknownModel {
                model: model.to_string(),
                known: known(),
            })?;
            Ok((m.key.to_string(), count))
        })
        .collect()
}

fn mix(mut x: u64) -> u64 {
    // splitmix64 finaliser: a stable, well-spread function of the index.
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Simulated GPUs for a list of (model, count), indexes 0.. in list order.
/// UUID `GPU-<uuid>` derived from the index, PCI bus id
/// `<domain>:<bus>:00.0`, PCIe root `pci<domain>:<bus-1>`, minor = index,
/// driver `580.65.06`.
///
/// # Errors
/// [`SliceError::UnknownModel`] listing the known models.
pub fn simulated_gpus(models: &[(String, u32)]) -> Result<Vec<PhysicalGpu>, SliceError> {
    let mut out = Vec::new();
    for (key, count) in models {
        let m = GpuModel::find(key).ok_or_else(|| SliceError::UnknownModel {
            model: key.clone(),
            known: known(),
        })?;
        let spec = m.spec();
        for _ in 0..*count {
            let index = out.len() as u32;
            let (a, b) = (mix(u64::from(index)), mix(u64::from(index) ^ 0xa5a5));
            let uuid = format!(
                "GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
                a >> 32,
                (a >> 16) & 0xffff,
                a & 0xffff,
                b >> 48,
                b & 0xffff_ffff_ffff
            );
            let domain = index / 15;
            let bus = 0x10 * (index % 15 + 1) + 0x08;
            out.push(PhysicalGpu {
                index,
                minor: index,
                uuid,
                pci_bus_id: Some(format!("{domain:04x}:{bus:02x}:00.0")),
                pcie_root: Some(format!("pci{domain:04x}:{:02x}", bus - 1)),
                driver_version: "580.65.06".into(),
                spec: spec.clone(),
            });
        }
    }
    Ok(out)
}

/// `count` simulated GPUs of one model (see [`simulated_gpus`]).
///
/// # Errors
/// [`SliceError::UnknownModel`] listing the known models.
pub fn simulated_node(model_key: &str, count: u32) -> Result<Vec<PhysicalGpu>, SliceError> {
    simulated_gpus(&[(model_key.to_string(), count)])
}
