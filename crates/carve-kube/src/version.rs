//! The API server's Kubernetes version, used to pick the ResourceSlice layout
//! (1.34: counters in the device slice; 1.35+: counters in their own slice).

use k8s_openapi::apimachinery::pkg::version::Info;
use kube::Client;

use crate::error::PublishError;

/// `(major, minor)` of the API server, from `GET /version`.
///
/// `minor` may carry a suffix (`"35+"` on managed clusters); it is ignored.
/// When `major`/`minor` are empty, `gitVersion` (`"v1.35.2-eks-..."`) is used.
/// The request gets [`crate::DEFAULT_REQUEST_TIMEOUT`] (the kube client has
/// no read timeout of its own).
pub async fn server_version(client: &Client) -> Result<(u32, u32), PublishError> {
    let after = crate::DEFAULT_REQUEST_TIMEOUT;
    let info = tokio::time::timeout(after, client.apiserver_version())
        .await
        .map_err(|_| PublishError::VersionTimeout { after })?
        .map_err(|source| PublishError::Version { source })?;
    parse_version(&info)
}

/// `(major, minor)` from a `/version` document; see [`server_version`].
pub fn parse_version(info: &Info) -> Result<(u32, u32), PublishError> {
    if info.major.is_empty() && info.minor.is_empty() {
        return parse_git_version(&info.git_version);
    }
    let major = leading_number(&info.major).ok_or_else(|| PublishError::BadVersion {
        field: "major",
        value: info.major.clone(),
    })?;
    let minor = leading_number(&info.minor).ok_or_else(|| PublishError::BadVersion {
        field: "minor",
        value: info.minor.clone(),
    })?;
    Ok((major, minor))
}

fn parse_git_version(git: &str) -> Result<(u32, u32), PublishError> {
    let bad = || PublishError::BadVersion {
        field: "gitVersion",
        value: git.to_owned(),
    };
    let mut parts = git.strip_prefix('v').unwrap_or(git).split('.');
    let major = parts.next().and_then(whole_number).ok_or_else(bad)?;
    let minor = parts.next().and_then(leading_number).ok_or_else(bad)?;
    Ok((major, minor))
}

/// The decimal number at the start of `s` (`"35+"` → 35); `None` if there is none.
fn leading_number(s: &str) -> Option<u32> {
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    s[..end].parse().ok()
}

fn whole_number(s: &str) -> Option<u32> {
    if s.bytes().all(|b| b.is_ascii_digit()) {
        s.parse().ok()
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(major: &str, minor: &str, git: &str) -> Info {
        Info {
            major: major.into(),
            minor: minor.into(),
            git_version: git.into(),
            ..Default::default()
        }
    }

    #[test]
    fn plain_and_suffixed_minor() {
        assert_eq!(parse_version(&info("1", "34", "")).unwrap(), (1, 34));
        assert_eq!(parse_version(&info("1", "35+", "")).unwrap(), (1, 35));
        assert_eq!(parse_version(&info("1+", "36", "")).unwrap(), (1, 36));
    }

    #[test]
    fn falls_back_to_git_version() {
        assert_eq!(
            parse_version(&info("", "", "v1.35.2-eks-abc")).unwrap(),
            (1, 35)
        );
        assert_eq!(
            parse_version(&info("", "", "1.37.0-beta.0")).unwrap(),
            (1, 37)
        );
    }

    #[test]
    fn rejects_garbage_naming_the_field() {
        let e = parse_version(&info("1", "x", "")).unwrap_err();
        assert!(
            matches!(e, PublishError::BadVersion { field: "minor", .. }),
            "{e}"
        );
        assert!(e.to_string().contains("minor"));
        let e = parse_version(&info("", "", "devel")).unwrap_err();
        assert!(
            matches!(
                e,
                PublishError::BadVersion {
                    field: "gitVersion",
                    ..
                }
            ),
            "{e}"
        );
        let e = parse_version(&info("one", "35", "")).unwrap_err();
        assert!(
            matches!(e, PublishError::BadVersion { field: "major", .. }),
            "{e}"
        );
    }
}
