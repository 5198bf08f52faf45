//! The claims simulate applies: the built-in examples, or a `--claims`
//! directory of claims, templates and the Pods that name them.

use super::*;

// === claims ===

pub(super) fn embedded_classes() -> anyhow::Result<Vec<DeviceClass>> {
    let objs = carve_alloc::parse_yaml_documents(
        Path::new("examples/deviceclasses.yaml"),
        crate::explain::DEVICE_CLASSES,
    )?;
    Ok(objs
        .into_iter()
        .filter_map(|o| match o {
            Object::Class(c) => Some(c),
            _ => None,
        })
        .collect())
}

/// The claims to apply: the built-in examples, or those under `dir`.
pub(super) fn load_claims(dir: Option<&Path>) -> anyhow::Result<ClaimSet> {
    let mut set = ClaimSet {
        claims: Vec::new(),
        classes: embedded_classes()?,
        off: BTreeMap::new(),
    };
    match dir {
        None => {
            for (source, text) in EXAMPLES {
                let objs = carve_alloc::parse_yaml_documents(Path::new(source), text)?;
                add_objects(&mut set, source, objs)?;
            }
            for c in &mut set.claims {
                c.builtin = true;
            }
        }
        Some(dir) => {
            for file in claim_files(dir)? {
                let objs = carve_alloc::load_yaml_documents(&file)?;
                add_objects(&mut set, &file.display().to_string(), objs)?;
            }
            if set.claims.is_empty() {
                let looked = if dir.is_dir() {
                    " (looked in *.yaml and *.yml files and in */claim.yaml and */pod.yaml)"
                } else {
                    ""
                };
                bail!(
                    "--claims {}: no ResourceClaim found, nor a ResourceClaimTemplate{looked}",
                    dir.display()
                );
            }
        }
    }
    Ok(set)
}

/// `dir/*.yaml`, `dir/*.yml`, `dir/*/claim.yaml` and `dir/*/pod.yaml`, in
/// name order; `dir` itself where it is a file (of one or more documents).
pub(super) fn claim_files(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    if std::fs::metadata(dir).is_ok_and(|m| !m.is_dir()) {
        return Ok(vec![dir.to_path_buf()]);
    }
    let rd = std::fs::read_dir(dir)
        .with_context(|| format!("--claims {}: cannot read the directory", dir.display()))?;
    let mut entries = Vec::new();
    for e in rd {
        let e = e.with_context(|| format!("--claims {}: reading the directory", dir.display()))?;
        entries.push(e.path());
    }
    entries.sort();
    let mut files = Vec::new();
    for p in entries {
        if p.is_dir() {
            for name in ["claim.yaml", "pod.yaml"] {
                let c = p.join(name);
                if c.is_file() {
                    files.push(c);
                }
            }
        } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
            files.push(p);
        }
    }
    Ok(files)
}

pub(super) fn add_objects(
    set: &mut ClaimSet,
    source: &str,
    objs: Vec<Object>,
) -> anyhow::Result<()> {
    let first = set.claims.len();
    let mut pods = Vec::new();
    for (k, o) in objs.into_iter().enumerate() {
        match o {
            Object::Pod(p) => pods.push(*p),
            Object::Claim(mut c) => {
                if c.metadata.name.as_deref().unwrap_or_default().is_empty() {
                    bail!("{source}: ResourceClaim #{k}: field metadata.name is missing");
                }
                if c.metadata
                    .namespace
                    .as_deref()
                    .unwrap_or_default()
                    .is_empty()
                {
                    c.metadata.namespace = Some(DEFAULT_NAMESPACE.into());
                }
                if c.status.is_some() {
                    bail!(
                        "{source}: ResourceClaim {}: field status is set; simulate allocates claims itself",
                        c.metadata.name.as_deref().unwrap_or_default()
                    );
                }
                let new = SourcedClaim {
                    source: source.to_string(),
                    claim: c,
                    pod: None,
                    builtin: false,
                };
                if let Some(old) = set
                    .claims
                    .iter()
                    .find(|o| o.name() == new.name() && o.namespace() == new.namespace())
                {
                    bail!(
                        "{source}: ResourceClaim {}/{} is also defined in {}",
                        new.namespace(),
                        new.name(),
                        old.source
                    );
                }
                set.claims.push(new);
            }
            Object::Class(c) => {
                set.classes.retain(|x| x.metadata.name != c.metadata.name);
                set.classes.push(c);
            }
            Object::Slice(s) => bail!(
                "{source}: ResourceSlice {}: simulate publishes the node's slices itself (through the plugin); remove it",
                s.metadata.name.as_deref().unwrap_or_default()
            ),
        }
    }
    for pod in &pods {
        reserve_for_pod(&mut set.claims[first..], source, pod)?;
    }
    Ok(())
}

/// Reserve the claims a Pod of `source` names (`spec.resourceClaims`, by
/// template or claim name, in the pod's namespace) for that pod. A name that
/// is not among the file's claims and templates is an error: the pod would
/// never start.
pub(super) fn reserve_for_pod(
    claims: &mut [SourcedClaim],
    source: &str,
    pod: &k8s_openapi::api::core::v1::Pod,
) -> anyhow::Result<()> {
    let Some(name) = pod.metadata.name.as_deref().filter(|n| !n.is_empty()) else {
        bail!("{source}: Pod: field metadata.name is missing");
    };
    let namespace = pod
        .metadata
        .namespace
        .as_deref()
        .filter(|n| !n.is_empty())
        .unwrap_or(DEFAULT_NAMESPACE);
    let refs = pod
        .spec
        .as_ref()
        .and_then(|s| s.resource_claims.as_ref())
        .map(Vec::as_slice)
        .unwrap_or_default();
    if refs.is_empty() {
        bail!("{source}: Pod {namespace}/{name}: spec.resourceClaims is empty; it uses no claim");
    }
    for (i, r) in refs.iter().enumerate() {
        let target = r
            .resource_claim_template_name
            .as_deref()
            .or(r.resource_claim_name.as_deref())
            .ok_or_else(|| {
                anyhow!(
                    "{source}: Pod {namespace}/{name}: spec.resourceClaims[{i}] ({}) names neither resourceClaimTemplateName nor resourceClaimName",
                    r.name
                )
            })?;
        let claim = claims
            .iter_mut()
            .find(|c| c.name() == target && c.namespace() == namespace)
            .ok_or_else(|| {
                anyhow!(
                    "{source}: Pod {namespace}/{name}: spec.resourceClaims[{i}] ({}) names {target}, which is not a ResourceClaim or ResourceClaimTemplate of this file",
                    r.name
                )
            })?;
        if let Some(other) = &claim.pod {
            bail!(
                "{source}: Pod {namespace}/{name}: claim {target} is already used by Pod {other}; simulate gives each pod's claim its own template"
            );
        }
        claim.pod = Some(name.to_string());
    }
    Ok(())
}

/// The DeviceClasses a claim's requests name, in order, without repeats.
pub(super) fn claim_classes(c: &ResourceClaim) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let requests = c.spec.devices.as_ref().and_then(|d| d.requests.as_ref());
    for r in requests.into_iter().flatten() {
        let names = r.exactly.iter().map(|e| e.device_class_name.clone()).chain(
            r.first_available
                .iter()
                .flatten()
                .map(|s| s.device_class_name.clone()),
        );
        for n in names {
            if !out.contains(&n) {
                out.push(n);
            }
        }
    }
    out
}

// === claims that do not fit ===

/// The device classes that `sharing` (the run's `--sharing`) or `shares`
/// (shares apart, on the GPUs listed) leave without devices, each with what
/// the node lacks and the flag that turns it on.
pub(super) fn classes_off_by_sharing(
    sharing: &[SimSharing],
    shares: &crate::shares::ShareDecision,
) -> BTreeMap<String, String> {
    use carve_model::scheduler::{ShareLayout, SharedGpu};
    let list = sharing_list(sharing);
    let hosted = |kind: SimSharing| match &shares.layout {
        ShareLayout::Mixed => true,
        ShareLayout::Separate(listed) => listed.values().any(|g| {
            matches!(
                (g, kind),
                (SharedGpu::Mps, SimSharing::Mps)
                    | (SharedGpu::Timeslice, SimSharing::Timeslice)
                    | (SharedGpu::MigMps { .. }, SimSharing::MigMps)
            )
        }),
    };
    [
        (
            "mps.gpu.carve.dev",
            SimSharing::Mps,
            "MPS shares of whole GPUs",
            "INDEX=mps",
        ),
        (
            "mig-mps.gpu.carve.dev",
            SimSharing::MigMps,
            "MPS shares of MIG partitions",
            "INDEX=mig-mps:PROFILE",
        ),
        (
            "timeslice.gpu.carve.dev",
            SimSharing::Timeslice,
            "time-sliced GPUs",
            "INDEX=timeslice",
        ),
    ]
    .into_iter()
    .filter_map(|(class, kind, what, entry)| {
        let flag = kind.flag().unwrap_or("none");
        let why = if !sharing.contains(&kind) {
            format!(
                "this node publishes no {what}: this run has --sharing {list}; add {flag} to --sharing to publish them (the default is --sharing mps,mig-mps,timeslice)"
            )
        } else if !hosted(kind) {
            format!(
                "this node publishes no {what}: kube-scheduler {} does not count shared devices' counters (before 1.36.2), so shares go only on the GPUs --shared-gpus names, and none is named for these; add {entry} to --shared-gpus, or give --scheduler-version 1.36.2 or later if that is your scheduler",
                shares.scheduler
            )
        } else {
            return None;
        };
        Some((class.to_string(), why))
    })
    .collect()
}

/// What a claim that found no device, or did not fit, is told besides the
/// allocator's reasons, and whether a built-in example's pending is what
/// this node shape or the run's flags make of it.
#[derive(Debug, Default)]
pub(super) struct Unfit {
    /// Lines to show under the claim.
    pub(super) lines: Vec<String>,
    /// Why a built-in example cannot fit here (it then does not fail the
    /// run); `None` for claims the user gave and for unexplained misfits.
    pub(super) expected: Option<String>,
}

/// MIG partitions are published only where a GPU is MIG-capable and its MIG
/// mode can be switched without a reset: why a node has none.
fn why_no_mig(node: &Node) -> String {
    let mut why: Vec<String> = Vec::new();
    for (i, spec) in node.specs.iter().enumerate() {
        let reason = if !spec.mig_capable {
            "not MIG-capable"
        } else if spec.architecture.mig_mode_needs_reset()
            && !node.mig_at_start.get(i).copied().unwrap_or(false)
        {
            "MIG mode off, and on this architecture turning it on needs a GPU reset, which carve does not do"
        } else {
            continue;
        };
        let line = format!("{} ({reason})", spec.product_name);
        if !why.contains(&line) {
            why.push(line);
        }
    }
    if why.is_empty() {
        "no GPU of this node publishes MIG partitions".into()
    } else {
        format!(
            "no GPU of this node publishes MIG partitions: {}",
            why.join("; ")
        )
    }
}

/// The MIG profiles this node publishes, per product, smallest first:
/// `H100 80GB HBM3: 1g.10gb, ...`.
pub(super) fn node_profiles(slices: &[ResourceSlice]) -> Vec<String> {
    let mut by_product: BTreeMap<String, BTreeSet<(i64, i64, String)>> = BTreeMap::new();
    for d in slices.iter().flat_map(|s| s.spec.devices.iter().flatten()) {
        let Some(a) = d.attributes.as_ref() else {
            continue;
        };
        let text = |k: &str| a.get(k).and_then(|v| v.string.clone());
        let int = |k: &str| a.get(k).and_then(|v| v.int).unwrap_or_default();
        if text("type").as_deref() != Some("mig") {
            continue;
        }
        let Some(profile) = text("profile") else {
            continue;
        };
        by_product
            .entry(text("productName").unwrap_or_else(|| "GPU".into()))
            .or_default()
            .insert((int("memorySlices"), int("computeSlices"), profile));
    }
    by_product
        .into_iter()
        .map(|(product, ps)| {
            let names: Vec<String> = ps.into_iter().map(|(_, _, p)| p).collect();
            format!("{product}: {}", names.join(", "))
        })
        .collect()
}

const MIG_CLASSES: [&str; 2] = ["mig.gpu.carve.dev", "mig-mps.gpu.carve.dev"];

/// What to tell about claim `c` that did not fit on the node of `slices`,
/// `missing` being the classes it names that have no published device and
/// `off` the classes the run's `--sharing` leaves without devices;
/// `offers_shown`: the report lists what the node offers next (its MIG
/// profiles among them), so the profiles are not listed here again.
pub(super) fn unfit(
    node: &Node,
    slices: &[ResourceSlice],
    c: &SourcedClaim,
    missing: &[String],
    off: &BTreeMap<String, String>,
    offers_shown: bool,
) -> Unfit {
    let profiles = node_profiles(slices);
    let mut reasons: Vec<String> = Vec::new();
    let mut unexplained = false;
    for class in missing {
        if let Some(why) = off.get(class) {
            reasons.push(format!("{class}: {why}"));
        } else if MIG_CLASSES.contains(&class.as_str()) && profiles.is_empty() {
            reasons.push(format!("{class}: {}", why_no_mig(node)));
        } else {
            unexplained = true;
        }
    }
    let explained = !missing.is_empty() && !unexplained;
    // Said once: in the `(as expected ...)` line of a built-in example.
    let mut lines = if explained && c.builtin {
        Vec::new()
    } else {
        reasons.clone()
    };
    let classes = claim_classes(&c.claim);
    // A MIG class with devices, where the claim still found none: most often
    // a profile name of another GPU model.
    let names_mig = classes
        .iter()
        .any(|k| MIG_CLASSES.contains(&k.as_str()) && !missing.contains(k));
    if names_mig && !profiles.is_empty() {
        if offers_shown {
            lines.push("profile names differ between GPU models (this node's are below); select on memory or computeSlices to fit any model".into());
        } else {
            lines.push("MIG profiles on this node (profile names differ between GPU models; select on memory or computeSlices to fit any model):".into());
            lines.extend(profiles.iter().map(|p| format!("  {p}")));
        }
    }
    let expected = if !c.builtin {
        None
    } else if explained {
        Some(reasons.join("; "))
    } else {
        STAYS_PENDING
            .iter()
            .find(|(src, _)| *src == c.source)
            .map(|(_, why)| (*why).to_string())
    };
    Unfit { lines, expected }
}
