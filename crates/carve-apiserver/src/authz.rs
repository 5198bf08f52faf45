//! Opt-in authentication by bearer token and RBAC-style authorization.
//!
//! Off until the first identity is registered with
//! [`crate::ApiServer::set_identity`]: then every request must carry
//! `Authorization: Bearer <token>` of a registered identity (401 otherwise),
//! and each resource request must be allowed by one of that identity's
//! [`PolicyRule`]s (403 otherwise). Injected faults ([`crate::Fault`]) are
//! applied before authentication; refused requests are counted and logged
//! like any other. Paraphrased from upstream:
//!
//! * Authentication (k8s.io/apiserver
//!   `pkg/authentication/request/bearertoken/bearertoken.go`,
//!   `pkg/endpoints/filters/authentication.go` `Unauthorized`): the token is
//!   what follows `Bearer ` in the `Authorization` header; an unknown token,
//!   or none, answers 401 with a `Status` whose message is `Unauthorized`.
//!   Anonymous requests are not modelled (as with `--anonymous-auth=false`).
//! * Rule matching (`plugin/pkg/auth/authorizer/rbac/rbac.go` `RuleAllows`,
//!   `pkg/apis/rbac/v1/evaluation_helpers.go`): a rule allows a request when
//!   one of its verbs is `*` or the request's verb, one of its apiGroups is
//!   `*` or the request's group, one of its resources is `*`, the request's
//!   `resource` or `resource/subresource`, or `*/subresource`, and its
//!   resourceNames are empty or name the request's object. Every rule of an
//!   identity applies in every namespace, as if bound by a
//!   ClusterRoleBinding; namespaced RoleBindings are not modelled.
//! * Request attributes (k8s.io/apiserver `pkg/endpoints/request/requestinfo.go`):
//!   verbs `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`,
//!   `deletecollection`; a list or watch whose field selector requires
//!   `metadata.name=<name>` is authorized for that name.
//! * Non-resource URLs: `/version`, `/api`, `/apis` and the discovery paths
//!   below them, `/healthz`, `/livez`, `/readyz` are open to every
//!   authenticated identity for `get`, as the default ClusterRoles
//!   `system:discovery` and `system:public-info-viewer`
//!   (`plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go`) allow.
//!   Paths the stand-in does not serve answer 404 to any authenticated
//!   identity (a real server authorizes them first).
//! * Refusals (k8s.io/apiserver `pkg/endpoints/handlers/responsewriters/errors.go`
//!   `ForbiddenStatusError`, k8s.io/apimachinery `pkg/api/errors/errors.go`
//!   `NewForbidden`): 403 Forbidden,
//!   `<resource>.<group> "<name>" is forbidden: User "<user>" cannot <verb>
//!   resource "<resource>[/<subresource>]" in API group "<group>" in the
//!   namespace "<ns>"` (or `at the cluster scope`; without `"<name>"` when
//!   the request names no object).

use crate::resource::GROUP;
use crate::store::ApiError;

/// One RBAC policy rule (`rbac.authorization.k8s.io/v1` `PolicyRule`,
/// without `nonResourceURLs`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyRule {
    /// API groups, `*` for all; `resource.k8s.io` for everything served here.
    pub api_groups: Vec<String>,
    /// Resources: `resourceclaims`, `resourceclaims/status`, the synthetic
    /// `resourceclaims/binding` and `resourceclaims/driver`, `*`, `*/status`.
    pub resources: Vec<String>,
    /// Verbs: `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`,
    /// `deletecollection`, `associated-node:patch`, `arbitrary-node:update`,
    /// … or `*`.
    pub verbs: Vec<String>,
    /// Object names the rule is limited to; empty for all. For
    /// `resourceclaims/driver` the names are driver names.
    pub resource_names: Vec<String>,
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_string()).collect()
}

impl PolicyRule {
    /// A rule for `verbs` on `resources` of `api_groups`, every name.
    pub fn new(api_groups: &[&str], resources: &[&str], verbs: &[&str]) -> Self {
        PolicyRule {
            api_groups: strings(api_groups),
            resources: strings(resources),
            verbs: strings(verbs),
            resource_names: Vec::new(),
        }
    }

    /// The same rule limited to these object names.
    #[must_use]
    pub fn with_resource_names(mut self, names: &[&str]) -> Self {
        self.resource_names = strings(names);
        self
    }

    /// Whether this rule allows the request `attrs`.
    pub fn allows(&self, attrs: &Attributes) -> bool {
        let any = |list: &[String], want: &str| list.iter().any(|x| x == "*" || x == want);
        let combined = if attrs.subresource.is_empty() {
            attrs.resource.clone()
        } else {
            format!("{}/{}", attrs.resource, attrs.subresource)
        };
        let resource_matches = self.resources.iter().any(|r| {
            r == "*"
                || *r == combined
                || (!attrs.subresource.is_empty()
                    && r.strip_prefix("*/") == Some(attrs.subresource.as_str()))
        });
        any(&self.verbs, &attrs.verb)
            && any(&self.api_groups, &attrs.api_group)
            && resource_matches
            && (self.resource_names.is_empty() || self.resource_names.contains(&attrs.name))
    }
}

/// What a bearer token authenticates as.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Identity {
    /// User name, e.g. `system:serviceaccount:carve-system:carve`.
    pub username: String,
    /// The `authentication.kubernetes.io/node-name` extra that a
    /// ServiceAccount token bound to a pod carries: the pod's node.
    pub node_name: Option<String>,
    /// What the identity may do (as if bound cluster-wide).
    pub rules: Vec<PolicyRule>,
}

impl Identity {
    /// A user with no rules (it may only read `/version` and discovery).
    pub fn new(username: impl Into<String>) -> Self {
        Identity {
            username: username.into(),
            node_name: None,
            rules: Vec::new(),
        }
    }

    /// The ServiceAccount `system:serviceaccount:<namespace>:<name>`.
    pub fn service_account(namespace: &str, name: &str) -> Self {
        Identity::new(format!("system:serviceaccount:{namespace}:{name}"))
    }

    /// An identity allowed everything: user `system:admin` with the rule
    /// `*` verbs on `*` resources of `*` groups (the stand-in's equivalent
    /// of a `system:masters` member, which the real authorizer allows
    /// everything, the synthetic `resourceclaims/binding` and
    /// `resourceclaims/driver` checks included).
    pub fn admin() -> Self {
        Identity::new("system:admin").with_rule(PolicyRule::new(&["*"], &["*"], &["*"]))
    }

    /// With the node-name extra set (a pod-bound ServiceAccount token).
    #[must_use]
    pub fn on_node(mut self, node: impl Into<String>) -> Self {
        self.node_name = Some(node.into());
        self
    }

    /// With one more rule.
    #[must_use]
    pub fn with_rule(mut self, rule: PolicyRule) -> Self {
        self.rules.push(rule);
        self
    }

    /// Whether any rule allows `attrs`.
    pub fn allows(&self, attrs: &Attributes) -> bool {
        self.rules.iter().any(|r| r.allows(attrs))
    }

    /// The ServiceAccount's (namespace, name) if the user name is one, as
    /// k8s.io/apiserver `pkg/authentication/serviceaccount/util.go`
    /// `SplitUsername` accepts it: `system:serviceaccount:<ns>:<name>`, the
    /// namespace a DNS label, the name a DNS subdomain.
    pub fn service_account_name(&self) -> Option<(&str, &str)> {
        let rest = self.username.strip_prefix("system:serviceaccount:")?;
        let mut parts = rest.split(':');
        let (ns, name) = (parts.next()?, parts.next()?);
        (parts.next().is_none() && is_dns_label(ns) && is_dns_subdomain(name)).then_some((ns, name))
    }
}

/// The attributes a request is authorized by (k8s.io/apiserver
/// `authorizer.Attributes` of a resource request).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Attributes {
    /// Verb, e.g. `patch` or `associated-node:patch`.
    pub verb: String,
    /// API group, `resource.k8s.io` here.
    pub api_group: String,
    /// Plural resource name, e.g. `resourceclaims`.
    pub resource: String,
    /// Subresource (`status`, `binding`, `driver`) or empty.
    pub subresource: String,
    /// Namespace, empty at the cluster scope.
    pub namespace: String,
    /// Object name, empty when the request names none.
    pub name: String,
}

impl Attributes {
    /// A request on `resource[/subresource]` of `resource.k8s.io`.
    pub fn new(verb: &str, resource: &str, subresource: &str, namespace: &str, name: &str) -> Self {
        Attributes {
            verb: verb.to_string(),
            api_group: GROUP.to_string(),
            resource: resource.to_string(),
            subresource: subresource.to_string(),
            namespace: namespace.to_string(),
            name: name.to_string(),
        }
    }
}

/// DNS-1123 label: at most 63 of `[a-z0-9-]`, alphanumeric at both ends.
pub(crate) fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|&c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
}

/// DNS-1123 subdomain: at most 253, dot-separated labels.
pub(crate) fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// The 401 every request without a registered token gets.
pub(crate) fn unauthorized() -> ApiError {
    ApiError::new(401, "Unauthorized", "Unauthorized")
}

/// `Bearer <token>` of the `Authorization` header, as the bearer token
/// authenticator reads it (scheme case-insensitive, token trimmed).
pub(crate) fn bearer_token(header: Option<&str>) -> Option<&str> {
    let (scheme, token) = header?.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Go `responsewriters` sanitizer: no text that looks like HTML.
fn sanitize(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The text upstream `forbiddenMessage` + `NewForbidden` produce for a
/// resource request: `<resource>.<group> ["<name>" ]is forbidden: User …`.
pub(crate) fn forbidden_message(user: &str, a: &Attributes) -> String {
    let resource = if a.subresource.is_empty() {
        a.resource.clone()
    } else {
        format!("{}/{}", a.resource, a.subresource)
    };
    let scope = if a.namespace.is_empty() {
        "at the cluster scope".to_string()
    } else {
        format!("in the namespace {:?}", a.namespace)
    };
    let why = sanitize(&format!(
        "User {user:?} cannot {} resource {resource:?} in API group {:?} {scope}",
        a.verb, a.api_group
    ));
    let qualified = format!("{}.{}", a.resource, a.api_group);
    if a.name.is_empty() {
        format!("{qualified} is forbidden: {why}")
    } else {
        format!("{qualified} {:?} is forbidden: {why}", a.name)
    }
}

/// 403 for a resource request no rule allows.
pub(crate) fn forbidden(user: &str, a: &Attributes) -> ApiError {
    ApiError::new(403, "Forbidden", forbidden_message(user, a)).with_forbidden_details(
        &a.api_group,
        &a.resource,
        &a.name,
    )
}

/// 403 for a non-resource request (e.g. `POST /version`).
pub(crate) fn forbidden_path(user: &str, verb: &str, path: &str) -> ApiError {
    ApiError::new(
        403,
        "Forbidden",
        format!(
            "forbidden: {}",
            sanitize(&format!("User {user:?} cannot {verb} path {path:?}"))
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(verb: &str, res: &str, sub: &str, name: &str) -> Attributes {
        Attributes::new(verb, res, sub, "default", name)
    }

    #[test]
    fn rules_match_verb_group_resource_and_name() {
        let r = PolicyRule::new(
            &["resource.k8s.io"],
            &["resourceclaims/driver"],
            &["associated-node:patch"],
        )
        .with_resource_names(&["gpu.carve.dev"]);
        assert!(r.allows(&a(
            "associated-node:patch",
            "resourceclaims",
            "driver",
            "gpu.carve.dev"
        )));
        assert!(!r.allows(&a(
            "arbitrary-node:patch",
            "resourceclaims",
            "driver",
            "gpu.carve.dev"
        )));
        assert!(!r.allows(&a(
            "associated-node:patch",
            "resourceclaims",
            "driver",
            "other.dev"
        )));
        assert!(!r.allows(&a(
            "associated-node:patch",
            "resourceclaims",
            "",
            "gpu.carve.dev"
        )));
        let mut other_group = a(
            "associated-node:patch",
            "resourceclaims",
            "driver",
            "gpu.carve.dev",
        );
        other_group.api_group = String::new();
        assert!(!r.allows(&other_group));

        let status = PolicyRule::new(&["*"], &["*/status"], &["patch"]);
        assert!(status.allows(&a("patch", "resourceclaims", "status", "c")));
        assert!(!status.allows(&a("patch", "resourceclaims", "", "c")));
        assert!(!status.allows(&a("patch", "resourceclaims", "driver", "c")));
        let plain = PolicyRule::new(&["resource.k8s.io"], &["resourceclaims"], &["*"]);
        assert!(plain.allows(&a("delete", "resourceclaims", "", "c")));
        assert!(!plain.allows(&a("patch", "resourceclaims", "status", "c")));
        assert!(Identity::admin().allows(&a(
            "arbitrary-node:update",
            "resourceclaims",
            "driver",
            "x"
        )));
    }

    #[test]
    fn service_account_names_are_split_as_upstream() {
        let sa = Identity::service_account("carve-system", "carve");
        assert_eq!(sa.service_account_name(), Some(("carve-system", "carve")));
        for bad in [
            "system:serviceaccount:ns",
            "system:serviceaccount:ns:a:b",
            "system:serviceaccount:Ns:a",
            "system:serviceaccount::a",
            "alice",
        ] {
            assert_eq!(Identity::new(bad).service_account_name(), None, "{bad}");
        }
    }

    #[test]
    fn bearer_tokens_and_messages() {
        assert_eq!(bearer_token(Some("Bearer abc")), Some("abc"));
        assert_eq!(bearer_token(Some("bearer  abc ")), Some("abc"));
        assert_eq!(bearer_token(Some("Basic abc")), None);
        assert_eq!(bearer_token(Some("Bearer ")), None);
        assert_eq!(bearer_token(None), None);
        assert_eq!(
            forbidden_message("u", &a("patch", "resourceclaims", "status", "c")),
            "resourceclaims.resource.k8s.io \"c\" is forbidden: User \"u\" cannot patch resource \"resourceclaims/status\" in API group \"resource.k8s.io\" in the namespace \"default\""
        );
        assert_eq!(
            forbidden_message("u", &Attributes::new("list", "resourceslices", "", "", "")),
            "resourceslices.resource.k8s.io is forbidden: User \"u\" cannot list resource \"resourceslices\" in API group \"resource.k8s.io\" at the cluster scope"
        );
    }
}
