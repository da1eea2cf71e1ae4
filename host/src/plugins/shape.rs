//! A look at a component's shape before it is compiled. wasmtime compiles a component by
//! expanding every instantiation of a nested component into the definitions of that component,
//! with no bound: a file of a few kilobytes that instantiates a component a thousand times, which
//! instantiates another a thousand times, and so on, asks for gigabytes of host memory and ends
//! the process before any of a plugin's limits applies. So the file's sections are read first
//! (only their headers; the code of core modules is skipped) and the definitions compiling it
//! would expand to are counted, by their size in bytes: those of each nested component once per
//! time it may be instantiated. Components that the usual tools build stay far below the limit.

/// The most bytes of component definitions (types, imports, exports, aliases, instances,
/// canonical functions; core module code not counted) a plugin may expand to when compiled, its
/// nested components counted once per instantiation. Near the limit, wasmtime took about 150 MB
/// to compile a 4 MB import of 350 000 resources, and 80 MB for a thousand instantiations of a
/// component making a thousand instances; the components ferry ships expand to 25 KiB at most,
/// the JavaScript and Python ones to 16 and 85 KiB.
pub(crate) const MAX_EXPANDED: u64 = 4 << 20;

/// How deep components may nest in one another.
const MAX_DEPTH: usize = 16;

/// The preamble of a component (magic, version 0x0d, layer 1).
const COMPONENT: [u8; 8] = *b"\0asm\x0d\x00\x01\x00";

/// Refuses a component that compiling would expand beyond [`MAX_EXPANDED`], or whose sections do
/// not add up. Anything else that is not a well-formed component (a core module, say) passes:
/// wasmtime says what is wrong with it.
pub(crate) fn check(bytes: &[u8]) -> Result<(), String> {
    if !bytes.starts_with(&COMPONENT) {
        return Ok(());
    }
    let expanded = expanded(bytes, 1, 0)?;
    if expanded > MAX_EXPANDED {
        return Err(format!(
            "compiling it would expand its nested components to more than {} MiB of definitions (each counted \
             once per instantiation), more than the {} MiB ferry compiles; components built by the usual tools \
             stay far below that",
            expanded >> 20,
            MAX_EXPANDED >> 20
        ));
    }
    Ok(())
}

/// The bytes of definitions `component` (with its preamble) expands to when instantiated `times`
/// times, at nesting `depth`; past [`MAX_EXPANDED`] the count stops early.
fn expanded(component: &[u8], times: u64, depth: usize) -> Result<u64, String> {
    if depth > MAX_DEPTH {
        return Err(format!("its components nest more than {MAX_DEPTH} deep"));
    }
    let mut own: u64 = 0;
    let mut instances: u64 = 0;
    let mut nested = Vec::new();
    let mut at = COMPONENT.len();
    while at < component.len() {
        let id = component[at];
        let (size, start) = leb_u32(component, at + 1)?;
        let end = start.checked_add(size as usize).filter(|&end| end <= component.len());
        let body = end.map(|end| &component[start..end]).ok_or("a section runs past the end of its component")?;
        match id {
            // Custom sections are not compiled; core modules are compiled once, however often
            // they are instantiated.
            0 | 1 => {}
            4 if body.starts_with(&COMPONENT) => nested.push(body),
            4 => return Err("a nested component is not a component".into()),
            _ => {
                own += u64::from(size);
                if id == 5 {
                    // The component instance section: how many instances it makes, at most as
                    // many instantiations.
                    instances += u64::from(leb_u32(body, 0)?.0);
                }
            }
        }
        at = start + size as usize;
    }
    let mut total = times.saturating_mul(own.saturating_add(1));
    // Each instantiation in this component may be of any component nested in it.
    let inner = times.saturating_mul(instances.max(1));
    for child in nested {
        if total > MAX_EXPANDED {
            break;
        }
        total = total.saturating_add(expanded(child, inner, depth + 1)?);
    }
    Ok(total)
}

/// The unsigned LEB128 number at `at` in `bytes` (at most 32 bits) and where what follows starts.
fn leb_u32(bytes: &[u8], at: usize) -> Result<(u32, usize), String> {
    let mut value: u32 = 0;
    for i in 0..5 {
        let byte = *bytes.get(at + i).ok_or("a section header runs past the end of its component")?;
        // The fifth byte holds the top 4 bits, and ends the number.
        if i == 4 && byte > 0x0f {
            break;
        }
        value |= u32::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Ok((value, at + i + 1));
        }
    }
    Err("a section size is not a 32-bit number".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A component that instantiates a component nested in it `fanout` times, `levels` deep.
    fn nested(levels: u32, fanout: u32) -> Vec<u8> {
        let instances: String = (0..fanout).map(|_| "(instance (instantiate $c))").collect();
        let mut body = String::new();
        for _ in 0..levels {
            body = format!("(component $c {body}) {instances}");
        }
        wat::parse_str(format!("(component {body})")).unwrap()
    }

    #[test]
    fn the_shipped_shape_passes_and_an_exploding_one_is_refused() {
        let small = nested(2, 3);
        assert!(check(&small).is_ok());
        // 1000³ instantiations in a few kilobytes: wasmtime alone took gigabytes, then aborted.
        let exploding = nested(3, 1000);
        assert!(exploding.len() < 20_000, "{}", exploding.len());
        let why = check(&exploding).unwrap_err();
        assert!(why.contains("more than the 4 MiB ferry compiles"), "{why}");
        // Not a component: left to wasmtime to refuse.
        assert!(check(b"\0asm\x01\x00\x00\x00").is_ok());
        assert!(check(b"not wasm").is_ok());
    }

    #[test]
    fn malformed_sections_are_refused_not_read_past() {
        let mut truncated = COMPONENT.to_vec();
        truncated.extend([7, 0x80, 0x80]);
        assert!(check(&truncated).unwrap_err().contains("runs past the end"));
        let mut too_long = COMPONENT.to_vec();
        too_long.extend([7, 0xff, 0xff, 0xff, 0xff, 0x7f]);
        assert!(check(&too_long).unwrap_err().contains("32-bit"));
        let mut past = COMPONENT.to_vec();
        past.extend([7, 100, 1, 2]);
        assert!(check(&past).unwrap_err().contains("runs past the end"));
        let mut deep = "(component)".to_string();
        for _ in 0..20 {
            deep = format!("(component {deep})");
        }
        assert!(check(&wat::parse_str(&deep).unwrap()).unwrap_err().contains("nest more than 16 deep"));
    }
}
