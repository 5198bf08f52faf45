//! Every exported NVML function that takes a raw pointer (other than an
//! opaque handle) is declared `unsafe extern "C"` with a `# Safety` section:
//! a caller from Rust must take on the pointer contract, as with the NVML
//! crate's own bindings. Read from the source, so a new export cannot slip in
//! as a safe function.

const FFI: &str = include_str!("../src/ffi.rs");

/// `(name, is unsafe, params, doc above it)` of every `extern "C" fn`.
fn exports() -> Vec<(String, bool, String, String)> {
    let mut out = Vec::new();
    let mut rest = FFI;
    while let Some(i) = rest.find("extern \"C\" fn ") {
        let before = &rest[..i];
        let is_unsafe = before.ends_with("unsafe ");
        let doc: String = before
            .lines()
            .rev()
            .skip(1)
            .take_while(|l| l.starts_with("///") || l.starts_with("#["))
            .collect::<Vec<_>>()
            .join("\n");
        let after = &rest[i + "extern \"C\" fn ".len()..];
        let name = after[..after.find('(').unwrap()].to_string();
        let close = after.find(')').unwrap();
        let params = after[after.find('(').unwrap() + 1..close].to_string();
        out.push((name, is_unsafe, params, doc));
        rest = &after[close..];
    }
    out
}

#[test]
fn exports_taking_raw_pointers_are_unsafe_with_a_safety_section() {
    let all = exports();
    assert!(all.len() >= 40, "found only {} exports", all.len());
    let mut wrong = Vec::new();
    for (name, is_unsafe, params, doc) in &all {
        let takes_ptr = params.contains("*mut") || params.contains("*const");
        if takes_ptr && !(*is_unsafe && doc.contains("# Safety")) {
            wrong.push(format!(
                "{name}: takes a raw pointer but is not unsafe with # Safety"
            ));
        }
        if !takes_ptr && *is_unsafe {
            wrong.push(format!("{name}: takes no raw pointer, yet is unsafe"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
