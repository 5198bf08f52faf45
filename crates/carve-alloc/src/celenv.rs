//! The Kubernetes DRA CEL environment on top of the `cel` crate.
//!
//! Variables: `device` with `driver`, `attributes[domain].<id>`,
//! `capacity[domain].<id>` (quantities) and `allowMultipleAllocations`. An unknown
//! domain is an empty map; an unknown field is an evaluation error. Added
//! libraries: Kubernetes quantities (`quantity()`, `isQuantity()`, `compareTo`,
//! `isLessThan`, `isGreaterThan`, `add`, `sub`, `sign`, `isInteger`, `asInteger`,
//! `asApproximateFloat`), semantic versions (`semver()`, `isSemver()`, `major`,
//! `minor`, `patch`, `compareTo`, `isLessThan`, `isGreaterThan`) and the `cel`
//! crate's strings, lists and math extensions.
//!
//! Cost: `cel` 0.15 has no cost accounting, so every expression gets a static
//! worst-case estimate when compiled (see [`estimate_cost`]) and is refused when
//! the estimate exceeds [`CEL_COST_LIMIT`], as the API server refuses expressions
//! whose estimated cost is over the limit.

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use cel::common::ast::{EntryExpr, Expr, IdedExpr};
use cel::common::traits::Indexer;
use cel::common::types::{CelBool, CelDouble, CelInt, CelList, CelMap, CelMapKey, CelString, Type};
use cel::common::value::{CowVal, StaticVal, Val};
use cel::{Context, Env, ExecutionError, Program, Value};
use k8s_openapi::api::resource::v1::{DeviceAttribute, DeviceCapacity};

use crate::quantity::Qty;

/// Longest CEL expression accepted, in bytes (`resource.k8s.io/v1` validation).
pub const CEL_MAX_LENGTH: usize = 10 * 1024;
/// Largest estimated cost accepted for one expression (the Kubernetes per-expression limit).
pub const CEL_COST_LIMIT: u64 = 1_000_000;
/// Upper bound on the elements a comprehension iterates over when the range is not
/// a literal: a device has at most 32 attributes+capacities and 48 attribute values.
const MAX_RANGE: u64 = 48;
/// Upper bound on a string held in a device (attribute strings are at most 64 bytes).
const MAX_STRING: u64 = 64;

static QUANTITY_TYPE: Type = Type::new_unspecified_type("kubernetes.Quantity");
static SEMVER_TYPE: Type = Type::new_unspecified_type("kubernetes.Semver");
static DOMAINS_TYPE: Type = Type::new_unspecified_type("kubernetes.DomainMap");

/// A quantity as a CEL value.
#[derive(Debug, Clone, Copy)]
pub struct CelQuantity(pub Qty);

impl Val for CelQuantity {
    fn get_type(&self) -> &Type {
        <Self as Val>::cel_type()
    }
    fn cel_type() -> &'static Type {
        &QUANTITY_TYPE
    }
    fn equals(&self, other: &dyn Val) -> bool {
        other
            .downcast_ref::<CelQuantity>()
            .is_some_and(|o| o.0 == self.0)
    }
    fn clone_as_boxed<'v>(&self) -> Box<dyn Val + 'v>
    where
        Self: 'v,
    {
        Box::new(*self)
    }
    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}
impl StaticVal for CelQuantity {}

/// A semantic version (semver 2.0.0) as a CEL value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Semver {
    major: u64,
    minor: u64,
    patch: u64,
    pre: Vec<String>,
}

impl Semver {
    /// Parses `MAJOR.MINOR.PATCH[-pre][+build]` strictly (no leading zeros).
    pub fn parse(s: &str) -> Option<Semver> {
        let s = s.split_once('+').map_or(s, |(v, _build)| v);
        let (core, pre) = match s.split_once('-') {
            Some((c, p)) => (c, Some(p)),
            None => (s, None),
        };
        let num = |p: &str| -> Option<u64> {
            if p.is_empty() || (p.len() > 1 && p.starts_with('0')) {
                return None;
            }
            if !p.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            p.parse().ok()
        };
        let mut parts = core.split('.');
        let major = num(parts.next()?)?;
        let minor = num(parts.next()?)?;
        let patch = num(parts.next()?)?;
        if parts.next().is_some() {
            return None;
        }
        let pre = match pre {
            None => Vec::new(),
            Some(p) => {
                let ids: Vec<String> = p.split('.').map(str::to_string).collect();
                let ok = ids.iter().all(|id| {
                    !id.is_empty()
                        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                        && !(id.len() > 1
                            && id.starts_with('0')
                            && id.bytes().all(|b| b.is_ascii_digit()))
                });
                if !ok {
                    return None;
                }
                ids
            }
        };
        Some(Semver {
            major,
            minor,
            patch,
            pre,
        })
    }

    fn cmp(&self, o: &Semver) -> std::cmp::Ordering {
        use std::cmp::Ordering;
        let c = (self.major, self.minor, self.patch).cmp(&(o.major, o.minor, o.patch));
        if c != Ordering::Equal {
            return c;
        }
        match (self.pre.is_empty(), o.pre.is_empty()) {
            (true, true) => return Ordering::Equal,
            (true, false) => return Ordering::Greater,
            (false, true) => return Ordering::Less,
            _ => {}
        }
        for (a, b) in self.pre.iter().zip(&o.pre) {
            let c = match (a.parse::<u64>(), b.parse::<u64>()) {
                (Ok(x), Ok(y)) => x.cmp(&y),
                (Ok(_), Err(_)) => Ordering::Less,
                (Err(_), Ok(_)) => Ordering::Greater,
                (Err(_), Err(_)) => a.cmp(b),
            };
            if c != Ordering::Equal {
                return c;
            }
        }
        self.pre.len().cmp(&o.pre.len())
    }
}

impl Val for Semver {
    fn get_type(&self) -> &Type {
        <Self as Val>::cel_type()
    }
    fn cel_type() -> &'static Type {
        &SEMVER_TYPE
    }
    fn equals(&self, other: &dyn Val) -> bool {
        other
            .downcast_ref::<Semver>()
            .is_some_and(|o| o.cmp(self).is_eq())
    }
    fn clone_as_boxed<'v>(&self) -> Box<dyn Val + 'v>
    where
        Self: 'v,
    {
        Box::new(self.clone())
    }
    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}
impl StaticVal for Semver {}

/// `device.attributes` / `device.capacity`: indexing by a domain that the device
/// does not use yields an empty map.
#[derive(Debug, Clone, Default)]
struct DomainMap {
    domains: BTreeMap<String, CelMap<'static>>,
    empty: CelMap<'static>,
}

impl DomainMap {
    fn key(idx: &dyn Val) -> Result<&str, ExecutionError> {
        idx.downcast_ref::<CelString>()
            .map(|s| s.inner())
            .ok_or_else(|| ExecutionError::UnexpectedType {
                got: idx.get_type().name().to_owned(),
                want: "string".to_owned(),
            })
    }
}

impl Indexer for DomainMap {
    fn get<'b, 'v>(&'b self, idx: &dyn Val) -> Result<CowVal<'b, 'v>, ExecutionError>
    where
        Self: 'v,
    {
        let key = DomainMap::key(idx)?;
        let map = self.domains.get(key).unwrap_or(&self.empty);
        Ok(CowVal::Borrowed(map))
    }

    fn steal<'v>(self: Box<Self>, idx: &dyn Val) -> Result<Box<dyn Val + 'v>, ExecutionError>
    where
        Self: 'v,
    {
        let key = DomainMap::key(idx)?;
        Ok(Box::new(self.domains.get(key).cloned().unwrap_or_default()))
    }
}

impl Val for DomainMap {
    fn get_type(&self) -> &Type {
        <Self as Val>::cel_type()
    }
    fn cel_type() -> &'static Type {
        &DOMAINS_TYPE
    }
    fn as_indexer<'b, 'v>(&'b self) -> Option<&'b (dyn Indexer + 'v)>
    where
        Self: 'v,
    {
        Some(self)
    }
    fn clone_as_boxed<'v>(&self) -> Box<dyn Val + 'v>
    where
        Self: 'v,
    {
        Box::new(self.clone())
    }
    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}
impl StaticVal for DomainMap {}

// === quantity library ===

fn quantity(s: &CelString<'_>) -> Result<CelQuantity, ExecutionError> {
    Qty::parse(s.inner())
        .map(CelQuantity)
        .map_err(|e| ExecutionError::function_error("quantity", e))
}
fn is_quantity(s: &CelString<'_>) -> CelBool {
    CelBool::from(Qty::parse(s.inner()).is_ok())
}
fn q_compare_to(a: &CelQuantity, b: &CelQuantity) -> CelInt {
    CelInt::from(a.0.cmp(&b.0) as i64)
}
fn q_is_less_than(a: &CelQuantity, b: &CelQuantity) -> CelBool {
    CelBool::from(a.0 < b.0)
}
fn q_is_greater_than(a: &CelQuantity, b: &CelQuantity) -> CelBool {
    CelBool::from(a.0 > b.0)
}
fn overflow(f: &str) -> ExecutionError {
    ExecutionError::function_error(f, "quantity overflow")
}
fn q_add(a: &CelQuantity, b: &CelQuantity) -> Result<CelQuantity, ExecutionError> {
    a.0.checked_add(b.0)
        .map(CelQuantity)
        .ok_or_else(|| overflow("add"))
}
fn q_add_int(a: &CelQuantity, b: &CelInt) -> Result<CelQuantity, ExecutionError> {
    a.0.checked_add(Qty::from_int(*b.inner()))
        .map(CelQuantity)
        .ok_or_else(|| overflow("add"))
}
fn q_sub(a: &CelQuantity, b: &CelQuantity) -> Result<CelQuantity, ExecutionError> {
    a.0.checked_sub(b.0)
        .map(CelQuantity)
        .ok_or_else(|| overflow("sub"))
}
fn q_sub_int(a: &CelQuantity, b: &CelInt) -> Result<CelQuantity, ExecutionError> {
    a.0.checked_sub(Qty::from_int(*b.inner()))
        .map(CelQuantity)
        .ok_or_else(|| overflow("sub"))
}
fn q_sign(a: &CelQuantity) -> CelInt {
    CelInt::from(a.0.signum())
}
fn q_is_integer(a: &CelQuantity) -> CelBool {
    CelBool::from(a.0.is_integer() && a.0.as_i64_ceil().is_some())
}
fn q_as_integer(a: &CelQuantity) -> Result<CelInt, ExecutionError> {
    if !a.0.is_integer() {
        return Err(ExecutionError::function_error(
            "asInteger",
            format!("{} is not an integer", a.0),
        ));
    }
    a.0.as_i64_ceil()
        .map(CelInt::from)
        .ok_or_else(|| ExecutionError::function_error("asInteger", "out of int64 range"))
}
fn q_as_approximate_float(a: &CelQuantity) -> CelDouble {
    CelDouble::from(a.0.as_f64())
}

// === semver library ===

fn semver(s: &CelString<'_>) -> Result<Semver, ExecutionError> {
    Semver::parse(s.inner()).ok_or_else(|| {
        ExecutionError::function_error(
            "semver",
            format!("{:?} is not a semantic version", s.inner()),
        )
    })
}
fn is_semver(s: &CelString<'_>) -> CelBool {
    CelBool::from(Semver::parse(s.inner()).is_some())
}
fn v_major(v: &Semver) -> CelInt {
    CelInt::from(v.major as i64)
}
fn v_minor(v: &Semver) -> CelInt {
    CelInt::from(v.minor as i64)
}
fn v_patch(v: &Semver) -> CelInt {
    CelInt::from(v.patch as i64)
}
fn v_compare_to(a: &Semver, b: &Semver) -> CelInt {
    CelInt::from(a.cmp(b) as i64)
}
fn v_is_less_than(a: &Semver, b: &Semver) -> CelBool {
    CelBool::from(a.cmp(b).is_lt())
}
fn v_is_greater_than(a: &Semver, b: &Semver) -> CelBool {
    CelBool::from(a.cmp(b).is_gt())
}

fn build_env() -> Result<Env, cel::DeclarationError> {
    let mut env = Env::stdlib();
    env.add_extension(cel::extensions::strings)?;
    env.add_extension(cel::extensions::lists)?;
    env.add_extension(cel::extensions::math)?;
    cel::add_overload!(env, fn quantity: (CelString) -> Result<CelQuantity>)?;
    cel::add_overload!(env, fn is_quantity: (CelString) -> CelBool)?;
    cel::add_member_overload!(env, fn q_compare_to: (CelQuantity, CelQuantity) -> CelInt, name = "compareTo")?;
    cel::add_member_overload!(env, fn q_is_less_than: (CelQuantity, CelQuantity) -> CelBool, name = "isLessThan")?;
    cel::add_member_overload!(env, fn q_is_greater_than: (CelQuantity, CelQuantity) -> CelBool, name = "isGreaterThan")?;
    cel::add_member_overload!(env, fn q_add: (CelQuantity, CelQuantity) -> Result<CelQuantity>, name = "add")?;
    cel::add_member_overload!(env, fn q_add_int: (CelQuantity, CelInt) -> Result<CelQuantity>, name = "add")?;
    cel::add_member_overload!(env, fn q_sub: (CelQuantity, CelQuantity) -> Result<CelQuantity>, name = "sub")?;
    cel::add_member_overload!(env, fn q_sub_int: (CelQuantity, CelInt) -> Result<CelQuantity>, name = "sub")?;
    cel::add_member_overload!(env, fn q_sign: (CelQuantity) -> CelInt, name = "sign")?;
    cel::add_member_overload!(env, fn q_is_integer: (CelQuantity) -> CelBool, name = "isInteger")?;
    cel::add_member_overload!(env, fn q_as_integer: (CelQuantity) -> Result<CelInt>, name = "asInteger")?;
    cel::add_member_overload!(env, fn q_as_approximate_float: (CelQuantity) -> CelDouble, name = "asApproximateFloat")?;
    cel::add_overload!(env, fn semver: (CelString) -> Result<Semver>)?;
    cel::add_overload!(env, fn is_semver: (CelString) -> CelBool)?;
    cel::add_member_overload!(env, fn v_major: (Semver) -> CelInt, name = "major")?;
    cel::add_member_overload!(env, fn v_minor: (Semver) -> CelInt, name = "minor")?;
    cel::add_member_overload!(env, fn v_patch: (Semver) -> CelInt, name = "patch")?;
    cel::add_member_overload!(env, fn v_compare_to: (Semver, Semver) -> CelInt, name = "compareTo")?;
    cel::add_member_overload!(env, fn v_is_less_than: (Semver, Semver) -> CelBool, name = "isLessThan")?;
    cel::add_member_overload!(env, fn v_is_greater_than: (Semver, Semver) -> CelBool, name = "isGreaterThan")?;
    Ok(env)
}

/// Why an expression was refused before evaluation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompileFailure {
    /// Longer than [`CEL_MAX_LENGTH`].
    TooLong(usize),
    /// Not valid CEL.
    Syntax(String),
    /// Estimated cost over [`CEL_COST_LIMIT`].
    TooCostly(u64),
}

/// A compiled selector.
#[derive(Debug)]
pub struct Compiled {
    program: Program,
    /// The static cost estimate.
    pub cost: u64,
}

/// The DRA CEL environment.
#[derive(Clone)]
pub struct CelEnv {
    env: Arc<Env>,
}

impl std::fmt::Debug for CelEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CelEnv").finish_non_exhaustive()
    }
}

impl Default for CelEnv {
    fn default() -> Self {
        Self::new()
    }
}

impl CelEnv {
    /// Builds the environment.
    pub fn new() -> CelEnv {
        // The declarations are fixed and distinct, so this only fails on a bug here.
        let env = build_env().expect("the DRA CEL declarations are distinct");
        CelEnv { env: Arc::new(env) }
    }

    /// Checks the length, parses and estimates the cost of `expr`.
    pub fn compile(&self, expr: &str) -> Result<Compiled, CompileFailure> {
        if expr.len() > CEL_MAX_LENGTH {
            return Err(CompileFailure::TooLong(expr.len()));
        }
        let program = self
            .env
            .compile(expr)
            .map_err(|e| CompileFailure::Syntax(e.to_string()))?;
        let cost = estimate_cost(program.expression());
        if cost > CEL_COST_LIMIT {
            return Err(CompileFailure::TooCostly(cost));
        }
        Ok(Compiled { program, cost })
    }

    /// Evaluates a compiled selector against one device; an error message on failure.
    pub fn eval(&self, c: &Compiled, device: &DeviceView<'_>) -> Result<bool, String> {
        let value = device.cel_value()?;
        let mut ctx = Context::with_env(self.env.clone());
        ctx.add_variable_as_val("device", Box::new(value));
        match c.program.execute(&ctx) {
            Ok(Value::Bool(b)) => Ok(b),
            Ok(other) => Err(format!("expression must evaluate to bool, got {:?}", other)),
            Err(e) => Err(e.to_string()),
        }
    }
}

/// What CEL sees of a device.
#[derive(Debug, Clone, Copy)]
pub struct DeviceView<'a> {
    /// The driver publishing the device.
    pub driver: &'a str,
    /// Attributes as published (bare names belong to the driver's domain).
    pub attributes: Option<&'a BTreeMap<String, DeviceAttribute>>,
    /// Capacities as published.
    pub capacity: Option<&'a BTreeMap<String, DeviceCapacity>>,
    /// `allowMultipleAllocations`.
    pub allow_multiple_allocations: bool,
}

fn split_name<'a>(name: &'a str, driver: &'a str) -> (&'a str, &'a str) {
    name.split_once('/').unwrap_or((driver, name))
}

fn attr_value(name: &str, a: &DeviceAttribute) -> Result<Box<dyn Val>, String> {
    let version = |v: &str| -> Result<Box<dyn Val>, String> {
        Semver::parse(v)
            .map(|s| Box::new(s) as Box<dyn Val>)
            .ok_or_else(|| format!("attribute {name}: {v:?} is not a semantic version"))
    };
    let list = |items: Vec<Box<dyn Val>>| -> Box<dyn Val> { Box::new(CelList::from(items)) };
    if let Some(v) = a.bool {
        return Ok(Box::new(CelBool::from(v)));
    }
    if let Some(v) = a.int {
        return Ok(Box::new(CelInt::from(v)));
    }
    if let Some(v) = &a.string {
        return Ok(Box::new(CelString::from(v.clone())));
    }
    if let Some(v) = &a.version {
        return version(v);
    }
    if let Some(v) = &a.bools {
        return Ok(list(
            v.iter()
                .map(|b| Box::new(CelBool::from(*b)) as Box<dyn Val>)
                .collect(),
        ));
    }
    if let Some(v) = &a.ints {
        return Ok(list(
            v.iter()
                .map(|b| Box::new(CelInt::from(*b)) as Box<dyn Val>)
                .collect(),
        ));
    }
    if let Some(v) = &a.strings {
        return Ok(list(
            v.iter()
                .map(|b| Box::new(CelString::from(b.clone())) as Box<dyn Val>)
                .collect(),
        ));
    }
    if let Some(v) = &a.versions {
        return Ok(list(
            v.iter().map(|s| version(s)).collect::<Result<_, _>>()?,
        ));
    }
    Err(format!("attribute {name} has no value"))
}

impl DeviceView<'_> {
    fn cel_value(self) -> Result<CelMap<'static>, String> {
        let mut attrs: BTreeMap<String, HashMap<CelMapKey<'static>, Box<dyn Val>>> =
            BTreeMap::new();
        for (name, a) in self.attributes.into_iter().flatten() {
            let (domain, id) = split_name(name, self.driver);
            attrs
                .entry(domain.to_string())
                .or_default()
                .insert(CelMapKey::from(id.to_string()), attr_value(name, a)?);
        }
        let mut caps: BTreeMap<String, HashMap<CelMapKey<'static>, Box<dyn Val>>> = BTreeMap::new();
        for (name, c) in self.capacity.into_iter().flatten() {
            let (domain, id) = split_name(name, self.driver);
            let q = Qty::from_quantity(&c.value).map_err(|e| format!("capacity {name}: {e}"))?;
            caps.entry(domain.to_string())
                .or_default()
                .insert(CelMapKey::from(id.to_string()), Box::new(CelQuantity(q)));
        }
        let domains = |m: BTreeMap<String, HashMap<CelMapKey<'static>, Box<dyn Val>>>| DomainMap {
            domains: m.into_iter().map(|(k, v)| (k, CelMap::from(v))).collect(),
            empty: CelMap::default(),
        };
        let mut device: HashMap<CelMapKey<'static>, Box<dyn Val>> = HashMap::new();
        device.insert(
            CelMapKey::from("driver".to_string()),
            Box::new(CelString::from(self.driver.to_string())),
        );
        device.insert(
            CelMapKey::from("attributes".to_string()),
            Box::new(domains(attrs)),
        );
        device.insert(
            CelMapKey::from("capacity".to_string()),
            Box::new(domains(caps)),
        );
        device.insert(
            CelMapKey::from("allowMultipleAllocations".to_string()),
            Box::new(CelBool::from(self.allow_multiple_allocations)),
        );
        Ok(CelMap::from(device))
    }
}

/// A static upper bound on the evaluation steps of an expression.
///
/// Every node costs 1; calls of string functions cost 1 plus a tenth of the
/// longest string a device can hold ([`MAX_STRING`]) or, for `matches`, that
/// times the pattern length; a comprehension costs its range, initialiser and
/// result plus its loop condition and step times the number of elements it may
/// visit: the length of a list or map literal, otherwise [`MAX_RANGE`].
pub fn estimate_cost(e: &IdedExpr) -> u64 {
    match &e.expr {
        Expr::Unspecified | Expr::Ident(_) | Expr::Literal(_) => 1,
        Expr::Select(s) => 1u64.saturating_add(estimate_cost(&s.operand)),
        Expr::Call(c) => {
            let mut cost: u64 = 1;
            if let Some(t) = &c.target {
                cost = cost.saturating_add(estimate_cost(t));
            }
            for a in &c.args {
                cost = cost.saturating_add(estimate_cost(a));
            }
            let string_cost = MAX_STRING.div_ceil(10);
            let extra = match c.func_name.as_str() {
                "matches" => {
                    let pattern = c
                        .args
                        .last()
                        .and_then(|a| match &a.expr {
                            Expr::Literal(l) => Some(format!("{l:?}").len() as u64),
                            _ => None,
                        })
                        .unwrap_or(MAX_STRING);
                    string_cost.saturating_mul(pattern.max(1))
                }
                "startsWith" | "endsWith" | "contains" | "lowerAscii" | "upperAscii" | "split"
                | "replace" | "trim" | "indexOf" | "lastIndexOf" | "substring" | "join" | "_+_"
                | "_==_" | "_!=_" | "size" | "quantity" | "semver" | "isQuantity" | "isSemver" => {
                    string_cost
                }
                _ => 0,
            };
            cost.saturating_add(extra)
        }
        Expr::List(l) => l
            .elements
            .iter()
            .fold(1u64, |acc, x| acc.saturating_add(estimate_cost(x))),
        Expr::Map(m) => m.entries.iter().fold(1u64, |acc, x| match &x.expr {
            EntryExpr::MapEntry(me) => acc
                .saturating_add(estimate_cost(&me.key))
                .saturating_add(estimate_cost(&me.value)),
            EntryExpr::StructField(sf) => acc.saturating_add(estimate_cost(&sf.value)),
        }),
        Expr::Struct(s) => s.entries.iter().fold(1u64, |acc, x| match &x.expr {
            EntryExpr::MapEntry(me) => acc
                .saturating_add(estimate_cost(&me.key))
                .saturating_add(estimate_cost(&me.value)),
            EntryExpr::StructField(sf) => acc.saturating_add(estimate_cost(&sf.value)),
        }),
        Expr::Comprehension(c) => {
            let n = match &c.iter_range.expr {
                Expr::List(l) => l.elements.len() as u64,
                Expr::Map(m) => m.entries.len() as u64,
                _ => MAX_RANGE,
            };
            let body = estimate_cost(&c.loop_cond).saturating_add(estimate_cost(&c.loop_step));
            estimate_cost(&c.iter_range)
                .saturating_add(estimate_cost(&c.accu_init))
                .saturating_add(estimate_cost(&c.result))
                .saturating_add(n.saturating_mul(body))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr_s(s: &str) -> DeviceAttribute {
        DeviceAttribute {
            string: Some(s.to_string()),
            ..Default::default()
        }
    }

    fn eval(expr: &str) -> Result<bool, String> {
        let env = CelEnv::new();
        let mut attributes = BTreeMap::new();
        attributes.insert("profile".to_string(), attr_s("1g.10gb"));
        attributes.insert(
            "driverVersion".to_string(),
            DeviceAttribute {
                version: Some("580.65.6".to_string()),
                ..Default::default()
            },
        );
        attributes.insert(
            "example.com/rack".to_string(),
            DeviceAttribute {
                int: Some(7),
                ..Default::default()
            },
        );
        let mut capacity = BTreeMap::new();
        capacity.insert(
            "memory".to_string(),
            DeviceCapacity {
                value: k8s_openapi::apimachinery::pkg::api::resource::Quantity("10Gi".into()),
                request_policy: None,
            },
        );
        let view = DeviceView {
            driver: "gpu.carve.dev",
            attributes: Some(&attributes),
            capacity: Some(&capacity),
            allow_multiple_allocations: false,
        };
        let c = env.compile(expr).map_err(|e| format!("{e:?}"))?;
        env.eval(&c, &view)
    }

    #[test]
    fn device_environment() {
        assert_eq!(eval(r#"device.driver == "gpu.carve.dev""#), Ok(true));
        assert_eq!(
            eval(r#"device.attributes["gpu.carve.dev"].profile == "1g.10gb""#),
            Ok(true)
        );
        assert_eq!(
            eval(r#"device.attributes["example.com"].rack == 7"#),
            Ok(true)
        );
        assert_eq!(
            eval(r#"device.attributes["nowhere.io"].size() == 0"#),
            Ok(true)
        );
        assert_eq!(
            eval(r#"has(device.attributes["gpu.carve.dev"].nope)"#),
            Ok(false)
        );
        assert_eq!(eval(r#"!device.allowMultipleAllocations"#), Ok(true));
        assert!(eval(r#"device.attributes["gpu.carve.dev"].nope == "x""#).is_err());
        assert!(eval(r#"device.nope"#).is_err());
    }

    #[test]
    fn quantity_library() {
        let t = |e: &str| assert_eq!(eval(e), Ok(true), "{e}");
        t(r#"device.capacity["gpu.carve.dev"].memory.compareTo(quantity("10Gi")) == 0"#);
        t(r#"device.capacity["gpu.carve.dev"].memory.isGreaterThan(quantity("9Gi"))"#);
        t(r#"device.capacity["gpu.carve.dev"].memory.isLessThan(quantity("20Gi"))"#);
        t(r#"quantity("1Gi").add(quantity("1Gi")) == quantity("2Gi")"#);
        t(r#"quantity("2k").sub(1000) == quantity("1k")"#);
        t(r#"quantity("1Ki").asInteger() == 1024"#);
        t(r#"quantity("1500m").asApproximateFloat() == 1.5"#);
        t(r#"isQuantity("20Gi") && !isQuantity("20GB")"#);
        t(r#"quantity("-1").sign() == -1 && quantity("1.5").isInteger() == false"#);
        assert!(eval(r#"quantity("bogus") == quantity("1")"#).is_err());
    }

    #[test]
    fn semver_and_strings() {
        let t = |e: &str| assert_eq!(eval(e), Ok(true), "{e}");
        t(r#"device.attributes["gpu.carve.dev"].driverVersion.isGreaterThan(semver("550.0.0"))"#);
        t(r#"device.attributes["gpu.carve.dev"].driverVersion.major() == 580"#);
        t(r#"semver("1.2.3").compareTo(semver("1.2.3-rc.1")) == 1"#);
        t(r#"semver("1.2.3").minor() == 2 && semver("1.2.3").patch() == 3"#);
        t(r#"isSemver("1.0.0") && !isSemver("01.0.0")"#);
        t(r#"device.attributes["gpu.carve.dev"].profile.startsWith("1g")"#);
        t(r#"device.attributes["gpu.carve.dev"].profile.endsWith("10gb")"#);
        t(r#"device.attributes["gpu.carve.dev"].profile.matches("^[0-9]g\\.[0-9]+gb$")"#);
        t(r#"device.attributes["gpu.carve.dev"].profile.split(".")[0] == "1g""#);
        t(r#""ABC".lowerAscii() == "abc""#);
    }

    #[test]
    fn limits() {
        let env = CelEnv::new();
        let long = format!("true || {}", "true || ".repeat(1300)) + "true";
        assert!(matches!(
            env.compile(&long),
            Err(CompileFailure::TooLong(_))
        ));
        assert!(matches!(
            env.compile("device.driver =="),
            Err(CompileFailure::Syntax(_))
        ));
        let nested = "[1,2].all(a, [1,2].all(b, true))";
        assert!(env.compile(nested).is_ok());
        let costly = "device.attributes[\"x\"].all(a, device.attributes[\"x\"].all(b, device.attributes[\"x\"].all(c, device.attributes[\"x\"].all(d, true))))";
        assert!(matches!(
            env.compile(costly),
            Err(CompileFailure::TooCostly(_))
        ));
    }
}
