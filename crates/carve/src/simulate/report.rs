//! The report: what was published, what each prepared claim's container
//! gets, each MPS share's limits and why, and the pictures of the GPUs.

use super::*;

/// Published devices per GPU, from the slices read back from the stand-in.
pub(super) fn published_text(node: &Node, slices: &[ResourceSlice]) -> String {
    let devices: usize = slices
        .iter()
        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        .sum();
    // The 1.35+ layout puts counter sets in slices of their own.
    let counters_apart = slices.iter().any(|s| {
        s.spec
            .shared_counters
            .as_ref()
            .is_some_and(|c| !c.is_empty())
            && s.spec.devices.as_ref().is_none_or(Vec::is_empty)
    });
    let layout = if counters_apart {
        "Kubernetes 1.35+ layout: each GPU's counter set in a slice of its own, the devices in others"
    } else {
        "Kubernetes 1.34 layout: each GPU's counter set in the slice of the devices that consume it"
    };
    let mut out = format!(
        "published: {} ResourceSlice(s), {devices} device(s), {layout}",
        slices.len()
    );
    for g in slices::summarize(slices) {
        let (name, about) = match g.gpu.and_then(|i| Some((i, node.specs.get(i as usize)?))) {
            Some((i, spec)) => {
                let mig = if !spec.mig_capable {
                    "not MIG-capable"
                } else if node.mig_at_start.get(i as usize).copied().unwrap_or(false) {
                    "MIG on"
                } else if spec.architecture.mig_mode_needs_reset() {
                    "MIG off, needs a GPU reset to change: whole GPU only"
                } else {
                    "MIG off until a claim needs it"
                };
                (format!("gpu-{i}"), format!("{}, {mig}", spec.product_name))
            }
            None => ("-".to_string(), "devices of no GPU".to_string()),
        };
        // The summary counts MIG-MPS devices under their profile: listed
        // apart, so a profile's count is its MIG devices.
        let mut devices = g.devices.clone();
        let mut mig_mps: BTreeMap<String, usize> = BTreeMap::new();
        for d in slices.iter().flat_map(|s| s.spec.devices.iter().flatten()) {
            let Ok(n @ DeviceName::MigMps { .. }) = d.name.parse::<DeviceName>() else {
                continue;
            };
            if Some(n.gpu()) != g.gpu {
                continue;
            }
            let profile = d
                .attributes
                .as_ref()
                .and_then(|a| a.get("profile"))
                .and_then(|a| a.string.clone())
                .or_else(|| n.mig_placement().map(|(p, _)| p))
                .unwrap_or_default();
            if let Some(c) = devices.get_mut(&profile) {
                *c = c.saturating_sub(1);
            }
            *mig_mps.entry(profile).or_default() += 1;
        }
        devices.retain(|_, c| *c > 0);
        let list = |m: &BTreeMap<String, usize>| {
            m.iter()
                .map(|(k, v)| format!("{k}×{v}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let parts: Vec<String> = [
            (!devices.is_empty()).then(|| list(&devices)),
            (!mig_mps.is_empty()).then(|| format!("MIG-MPS {}", list(&mig_mps))),
        ]
        .into_iter()
        .flatten()
        .collect();
        let _ = write!(out, "\n  {name} ({about}): {}", parts.join("; "));
    }
    out
}

/// What every container of the claim gets from the spec's common edits: the
/// environment, the driver files by container path (libraries by name), the
/// control nodes and hooks.
pub(super) fn container_text(edits: &serde_json::Value) -> String {
    let list = |k: &str| {
        edits
            .get(k)
            .and_then(serde_json::Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let s = |v: &serde_json::Value, f: &str| {
        v.get(f)
            .and_then(serde_json::Value::as_str)
            .unwrap_or("?")
            .to_string()
    };
    let env: Vec<String> = list("env")
        .iter()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect();
    let (mut libs, mut links, mut files) = (0, Vec::new(), Vec::new());
    for m in list("mounts") {
        let c = s(&m, "containerPath");
        let name = c
            .rsplit_once('/')
            .map_or(c.as_str(), |(_, n)| n)
            .to_string();
        if !(name.starts_with("lib") && name.contains(".so")) {
            files.push(name);
        } else if m
            .get("hostPath")
            .and_then(serde_json::Value::as_str)
            .is_some_and(|h| h.ends_with(&name))
        {
            libs += 1;
        } else {
            links.push(name);
        }
    }
    let nodes: Vec<String> = list("deviceNodes").iter().map(|n| s(n, "path")).collect();
    let hooks: Vec<String> = list("hooks")
        .iter()
        .map(|h| {
            h.get("args")
                .and_then(serde_json::Value::as_array)
                .and_then(|a| a.get(1))
                .and_then(serde_json::Value::as_str)
                .unwrap_or("?")
                .to_string()
        })
        .collect();
    let join = |v: &[String]| {
        if v.is_empty() {
            "none".to_string()
        } else {
            v.join(", ")
        }
    };
    format!(
        "\n    container gets: env {}; devices {}; hooks {}\n      driver: {libs} libraries, also at {}; {}",
        join(&env),
        join(&nodes),
        join(&hooks),
        join(&links),
        join(&files)
    )
}

/// The report of one prepared claim. What its container gets is said in
/// full once per distinct content: `seen` holds each content said so far
/// with the claim that first had it, and a claim whose container gets the
/// same names that claim instead.
pub(super) fn prepared_text(node: &Node, p: &Prepared, seen: &mut Vec<(String, String)>) -> String {
    let mut out = format!("- {}: allocated and prepared", p.source.label());
    let spec = claim_spec(node, &p.uid);
    if let Some(common) = spec.as_ref().and_then(|v| v.get("containerEdits")) {
        let text = container_text(common);
        match seen.iter().find(|(t, _)| *t == text) {
            Some((_, first)) => {
                let _ = write!(out, "\n    container gets: the same as {first}'s");
            }
            None => {
                out.push_str(&text);
                seen.push((text, p.source.name().to_string()));
            }
        }
    }
    for d in &p.devices {
        let _ = write!(out, "\n    request {} -> {}", d.request, d.device);
        let str_of = |k: &str| {
            d.data
                .as_ref()
                .and_then(|v| v.get(k))
                .and_then(|v| v.as_str().map(str::to_string))
        };
        let num_of = |v: Option<&serde_json::Value>| v.and_then(serde_json::Value::as_u64);
        let share = d.share_id.as_deref().unwrap_or("none");
        match (&d.data, d.device.parse::<DeviceName>()) {
            (None, _) => out.push_str(": (the plugin wrote no status.devices entry)"),
            (Some(v), Ok(DeviceName::Mig { .. })) => {
                let place = v.get("placement");
                let _ = write!(
                    out,
                    ": {} at memory slice {} (size {}), GPU instance {}, compute instance {}, {}",
                    str_of("profile").unwrap_or_else(|| "?".into()),
                    num_of(place.and_then(|p| p.get("start")))
                        .map_or_else(|| "?".into(), |n| n.to_string()),
                    num_of(place.and_then(|p| p.get("size")))
                        .map_or_else(|| "?".into(), |n| n.to_string()),
                    num_of(v.get("gpuInstanceID")).map_or_else(|| "?".into(), |n| n.to_string()),
                    num_of(v.get("computeInstanceID"))
                        .map_or_else(|| "?".into(), |n| n.to_string()),
                    str_of("uuid").unwrap_or_else(|| "no MIG UUID".into()),
                );
            }
            (Some(_), Ok(DeviceName::TimeSlice { .. })) => {
                let _ = write!(
                    out,
                    ": time-sliced GPU {}, share {share} (no memory or fault isolation)",
                    str_of("uuid").unwrap_or_else(|| "(no UUID)".into())
                );
            }
            (Some(v), Ok(DeviceName::Mps { .. } | DeviceName::MigMps { .. })) => {
                let _ = write!(
                    out,
                    ": MPS share {share} of {}",
                    str_of("uuid").unwrap_or_else(|| "(no UUID)".into())
                );
                if let Some(profile) = str_of("profile") {
                    let _ = write!(
                        out,
                        " ({profile} at memory slice {}, GPU instance {})",
                        num_of(v.get("placement").and_then(|p| p.get("start")))
                            .map_or_else(|| "?".into(), |n| n.to_string()),
                        num_of(v.get("gpuInstanceID"))
                            .map_or_else(|| "?".into(), |n| n.to_string()),
                    );
                }
            }
            (Some(_), _) => {
                let _ = write!(
                    out,
                    ": whole GPU {}",
                    str_of("uuid").unwrap_or_else(|| "(no UUID)".into())
                );
            }
        }
        if let Some(m) = &d.mps {
            out.push_str(&mps_text(node, p, m));
        }
        for id in &d.cdi_ids {
            let _ = write!(out, "\n      CDI {id}");
            if let Some(e) = d.mps.as_ref().and_then(|m| m.cdi_edits.get(id)) {
                let _ = write!(out, "\n        {e}");
            } else if let Some(e) = device_edits_of(spec.as_ref(), id) {
                let _ = write!(out, "\n        {}", describe_edits(node, e));
            }
        }
        for why in d.mps.iter().flat_map(|m| &m.problems) {
            let _ = write!(out, "\n      MPS PROBLEM: {why}");
        }
    }
    out
}

/// The lines of one MPS share: daemon, limits, enforcement, what the daemon got.
pub(super) fn mps_text(node: &Node, p: &Prepared, m: &MpsShare) -> String {
    let mut out = String::new();
    match &m.daemon {
        Some(d) => {
            let _ = write!(
                out,
                "\n      daemon: pid {}, protocol {} (from {}), pipe {}",
                d.pid,
                match d.protocol {
                    carve_mps::Protocol::V2 => "v2",
                    carve_mps::Protocol::V3 => "v3",
                },
                m.state_file,
                node.short(&d.pipe_dir)
            );
        }
        None => {
            let _ = write!(out, "\n      daemon: none in {}", m.state_file);
        }
    }
    if let Some(st) = &m.status {
        let _ = write!(
            out,
            "\n      limits: memory {} MiB, {} SMs = {} % active threads; pod {}/{} (uid {}) cgroup {}",
            st.memory_limit_mib,
            st.multiprocessors,
            st.active_thread_percentage,
            p.source.namespace(),
            p.pod.name,
            p.pod.uid,
            st.cgroup.as_deref().unwrap_or("none")
        );
        let v3 = m
            .daemon
            .as_ref()
            .is_some_and(|d| d.protocol == carve_mps::Protocol::V3);
        let _ = write!(
            out,
            "\n      enforcement: memory {} ({}), compute {} ({})",
            st.memory_limit.as_deref().unwrap_or("?"),
            memory_why(st.memory_limit.as_deref(), v3),
            st.compute_limit.as_deref().unwrap_or("?"),
            compute_why(st.compute_limit.as_deref()),
        );
        if let Some(w) = &st.memory_why {
            let _ = write!(out, "\n      memory not hard: {w}");
        }
    }
    for l in &m.received {
        let _ = write!(out, "\n      daemon got: {l}");
    }
    out
}

/// Why a share's memory enforcement level is what it is.
pub(super) fn memory_why(level: Option<&str>, v3: bool) -> &'static str {
    match (level, v3) {
        (Some("client"), true) => {
            "the namespace's pinned limit, applied by the CUDA client; a tenant can escape it"
        }
        (Some("client"), false) => {
            "the CUDA_MPS_PINNED_DEVICE_MEM_LIMIT variable, which the workload can change"
        }
        (Some("hard"), _) => {
            "memory partitioning: soft = hard limit on the pod's cgroup, set through nvidia-smi memory-limits and read back from its dmem.max; allocations past it fail, though cudaMemGetInfo in the container still reports the whole GPU"
        }
        _ => "unknown level",
    }
}

/// Why a share's compute enforcement level is what it is.
pub(super) fn compute_why(level: Option<&str>) -> &'static str {
    match level {
        Some("percentage") => {
            "the namespace's active-thread percentage, over the client's variable: a ceiling, not a reservation"
        }
        Some("client") => {
            "the CUDA_MPS_ACTIVE_THREAD_PERCENTAGE variable, which the workload can change"
        }
        Some("partition") => "static SM partitions",
        _ => "unknown level",
    }
}

/// What the allocation result of `d` consumes: memory (MiB) and SMs.
fn consumed(p: &Prepared, d: &PreparedDevice) -> (u64, u64) {
    let result = p
        .stored
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|ds| ds.results.as_ref())
        .and_then(|rs| {
            rs.iter()
                .find(|r| r.device == d.device && r.request == d.request)
        });
    let get = |k: &str| -> u64 {
        result
            .and_then(|r| r.consumed_capacity.as_ref()?.get(k))
            .and_then(|q| carve_alloc::quantity::Qty::parse(&q.0).ok())
            .and_then(|q| q.as_i64_ceil())
            .and_then(|n| u64::try_from(n).ok())
            .unwrap_or(0)
    };
    (get("memory") / (1024 * 1024), get("multiprocessors"))
}

/// One picture per GPU of who holds which memory slice.
pub(super) fn pictures(node: &Node, prepared: &[Prepared]) -> Vec<GpuPicture> {
    let mut by_gpu: BTreeMap<u32, (Vec<Held>, Option<Whole>)> = BTreeMap::new();
    for p in prepared {
        let holder = p.source.name().to_string();
        for d in &p.devices {
            let Ok(name) = d.device.parse::<DeviceName>() else {
                continue;
            };
            let e = by_gpu.entry(name.gpu()).or_default();
            let sharing = match &name {
                DeviceName::Gpu { .. } => Some(Sharing::Exclusive),
                DeviceName::Mps { .. } => Some(Sharing::Mps),
                DeviceName::TimeSlice { .. } => Some(Sharing::Timeslice),
                DeviceName::Mig { .. } | DeviceName::MigMps { .. } => None,
            };
            if let Some(sharing) = sharing {
                let w = e.1.get_or_insert_with(|| Whole {
                    holders: Vec::new(),
                    sharing,
                    used: None,
                });
                if !w.holders.contains(&holder) {
                    w.holders.push(holder.clone());
                }
                if sharing == Sharing::Mps {
                    let u = w.used.get_or_insert_with(crate::render::ShareUse::default);
                    let (memory_mib, multiprocessors) = consumed(p, d);
                    u.memory_mib += memory_mib;
                    u.multiprocessors += multiprocessors;
                }
                continue;
            }
            // What the plugin says it created, else what was allocated.
            let created = d.data.as_ref().and_then(|v| {
                let profile = v.get("profile")?.as_str()?.to_string();
                let start = u8::try_from(v.get("placement")?.get("start")?.as_u64()?).ok()?;
                Some((profile, start))
            });
            let Some((profile, start)) = created.or_else(|| name.mig_placement()) else {
                continue;
            };
            // Shares of one MIG instance through MPS: one instance, several holders.
            let shared = matches!(name, DeviceName::MigMps { .. });
            let i = match e
                .0
                .iter()
                .position(|h| h.profile == profile && h.start == start)
            {
                Some(i) => {
                    e.0[i].holder.push('+');
                    e.0[i].holder.push_str(&holder);
                    i
                }
                None => {
                    e.0.push(Held {
                        holder: holder.clone(),
                        profile,
                        start,
                        shared,
                        used: None,
                    });
                    e.0.len() - 1
                }
            };
            let h = &mut e.0[i];
            if shared {
                let u = h.used.get_or_insert_with(crate::render::ShareUse::default);
                let (memory_mib, multiprocessors) = consumed(p, d);
                u.memory_mib += memory_mib;
                u.multiprocessors += multiprocessors;
            }
        }
    }
    node.specs
        .iter()
        .enumerate()
        .map(|(i, spec)| {
            let (held, whole) = u32::try_from(i)
                .ok()
                .and_then(|i| by_gpu.remove(&i))
                .unwrap_or_default();
            GpuPicture {
                name: format!("gpu-{i}"),
                spec: spec.clone(),
                held,
                whole,
            }
        })
        .collect()
}

pub(super) fn show_pictures(
    args: &SimulateArgs,
    node: &Node,
    prepared: &[Prepared],
) -> anyhow::Result<()> {
    let pics = pictures(node, prepared);
    say("");
    say(&format!(
        "GPUs with {} claim(s) prepared (letters: holders, .: free, x: stranded):",
        prepared.len()
    ));
    for p in &pics {
        say(p.to_text().trim_end());
    }
    if let Some(path) = &args.svg {
        write_atomic(path, to_svg(&pics).as_bytes())?;
        say(&format!("SVG written to {}", path.display()));
    }
    Ok(())
}
