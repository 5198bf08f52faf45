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
    };
    match dir {
        None => {
            for (source, text) in EXAMPLES {
                let objs = carve_alloc::parse_yaml_documents(Path::new(source), text)?;
                add_objects(&mut set, source, objs)?;
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
