//! A look at a component's shape before it is compiled. wasmtime compiles a component by
//! expanding every instantiation of a nested component into the definitions of that component
//! (and every instantiation of a core module into one definition per import), with no bound: a
//! file of a few kilobytes that instantiates a component a thousand times, which instantiates
//! another a thousand times, and so on, asks for gigabytes of host memory and ends the process
//! before any of a plugin's limits applies. So the file is parsed first (wasmparser; nothing is
//! compiled) and what compiling it would expand to is counted: the bytes of each component's own
//! definitions once per time it is instantiated, and each core instantiation once per import of
//! the largest module. Components that the usual tools build stay far below the limit.
//!
//! The count follows instantiations to the components they name, which it can only do when a
//! component's components are its own nested ones. A component that imports components, or takes
//! them from an enclosing component or from an instance (a component of components, which the
//! usual tools do not build), is therefore refused.

use wasmparser::{
    ComponentAlias, ComponentExternalKind, ComponentInstance, ComponentOuterAliasKind, ComponentTypeRef, Encoding,
    Instance, Parser, Payload,
};

/// The most a plugin may expand to when compiled: bytes of component definitions (types,
/// imports, exports, aliases, instances, canonical functions; core module code not counted), each
/// nested component's counted once per instantiation, plus one per import of the largest core
/// module for each core instantiation. Near the limit, wasmtime took about 150 MB to compile a
/// 4 MB import of 350 000 resources, and 80 MB for a thousand instantiations of a component
/// making a thousand instances; the components ferry ships expand to 25 KiB at most, the
/// JavaScript and Python ones to 16 and 85 KiB.
pub(crate) const MAX_EXPANDED: u64 = 4 << 20;

/// How deep components may nest in one another.
const MAX_DEPTH: usize = 16;

/// One component of the file, as compiling it sees it.
#[derive(Debug, Default)]
struct Node {
    /// Bytes of its own component-level sections.
    own: u64,
    /// Its core module instantiations.
    core_instantiations: u64,
    /// The component index each of its component instantiations names.
    instantiations: Vec<u32>,
    /// Its nested components, in the order they are defined (their component indices).
    nested: Vec<usize>,
}

/// Refuses a component that compiling would expand beyond [`MAX_EXPANDED`], or that takes
/// components from outside itself. What does not parse passes, as does a core module: wasmtime
/// parses before it expands anything, and says what is wrong.
pub(crate) fn check(bytes: &[u8]) -> Result<(), String> {
    let mut nodes: Vec<Node> = Vec::new();
    // The component (its node) or core module (`None`) each nesting level is in.
    let mut stack: Vec<Option<usize>> = Vec::new();
    let mut most_imports: u64 = 0;
    for payload in Parser::new(0).parse_all(bytes) {
        let Ok(payload) = payload else { return Ok(()) };
        let current = stack.last().copied().flatten();
        match &payload {
            Payload::Version { encoding, .. } if stack.is_empty() => {
                if *encoding != Encoding::Component {
                    return Ok(());
                }
                nodes.push(Node::default());
                stack.push(Some(0));
                continue;
            }
            Payload::ComponentSection { .. } => {
                if stack.len() > MAX_DEPTH {
                    return Err(format!("its components nest more than {MAX_DEPTH} deep"));
                }
                nodes.push(Node::default());
                let id = nodes.len() - 1;
                if let Some(parent) = current {
                    nodes[parent].nested.push(id);
                }
                stack.push(Some(id));
                continue;
            }
            Payload::ModuleSection { .. } => {
                stack.push(None);
                continue;
            }
            Payload::End(_) => {
                stack.pop();
                continue;
            }
            Payload::ImportSection(imports) if current.is_none() => {
                most_imports = most_imports.max(u64::from(imports.count()));
            }
            _ => {}
        }
        // The rest concerns a component's own sections.
        let Some(node) = current else { continue };
        let outside = || {
            "it takes components from its imports, an enclosing component or an instance (a component \
                          of components), which ferry does not load"
                .to_string()
        };
        match payload {
            Payload::CustomSection(_) => continue,
            Payload::InstanceSection(ref instances) => {
                for instance in instances.clone() {
                    let Ok(instance) = instance else { return Ok(()) };
                    nodes[node].core_instantiations += u64::from(matches!(instance, Instance::Instantiate { .. }));
                }
            }
            Payload::ComponentInstanceSection(ref instances) => {
                for instance in instances.clone() {
                    let Ok(instance) = instance else { return Ok(()) };
                    if let ComponentInstance::Instantiate { component_index, .. } = instance {
                        nodes[node].instantiations.push(component_index);
                    }
                }
            }
            Payload::ComponentImportSection(ref imports) => {
                for import in imports.clone() {
                    let Ok(import) = import else { return Ok(()) };
                    if matches!(import.ty, ComponentTypeRef::Component(_)) {
                        return Err(outside());
                    }
                }
            }
            Payload::ComponentAliasSection(ref aliases) => {
                for alias in aliases.clone() {
                    let Ok(alias) = alias else { return Ok(()) };
                    match alias {
                        ComponentAlias::Outer { kind: ComponentOuterAliasKind::Component, .. }
                        | ComponentAlias::InstanceExport { kind: ComponentExternalKind::Component, .. } => {
                            return Err(outside());
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
        if let Some((_, range)) = payload.as_section() {
            nodes[node].own += range.len() as u64;
        }
    }
    if nodes.is_empty() {
        return Ok(());
    }
    let expanded = expanded(&nodes, 0, 1, most_imports);
    if expanded > MAX_EXPANDED {
        return Err(format!(
            "compiling it would expand it to more than {} MiB of definitions (its nested components counted once \
             per instantiation), more than the {} MiB ferry compiles; components built by the usual tools stay far \
             below that",
            expanded >> 20,
            MAX_EXPANDED >> 20
        ));
    }
    Ok(())
}

/// What component `node` expands to when instantiated `times` times; a nested component is
/// expanded once per instantiation naming it (once at least: it is read even if never used).
/// Depth is bounded by [`MAX_DEPTH`] while parsing.
fn expanded(nodes: &[Node], node: usize, times: u64, most_imports: u64) -> u64 {
    let this = &nodes[node];
    let own = this.own.saturating_add(1).saturating_add(this.core_instantiations.saturating_mul(most_imports));
    let mut total = times.saturating_mul(own);
    // Counted once, not per nested component: a hostile file may hold millions of both.
    let mut named_times: std::collections::HashMap<u32, u64> = std::collections::HashMap::new();
    for &index in &this.instantiations {
        *named_times.entry(index).or_default() += 1;
    }
    for (index, &child) in this.nested.iter().enumerate() {
        if total > MAX_EXPANDED {
            break;
        }
        let named = u32::try_from(index).ok().and_then(|i| named_times.get(&i)).copied().unwrap_or(0);
        total = total.saturating_add(expanded(nodes, child, times.saturating_mul(named.max(1)), most_imports));
    }
    total
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
    fn an_exploding_component_is_refused_and_an_ordinary_one_passes() {
        assert!(check(&nested(2, 3)).is_ok());
        // 1000³ instantiations in a few kilobytes: wasmtime alone took gigabytes, then aborted.
        let exploding = nested(3, 1000);
        assert!(exploding.len() < 20_000, "{}", exploding.len());
        let why = check(&exploding).unwrap_err();
        assert!(why.contains("more than the 4 MiB ferry compiles"), "{why}");
        // Only what is instantiated counts more than once: a thousand components side by side,
        // each instantiated once, are a thousand components.
        let side_by_side: String =
            (0..1000).map(|i| format!("(component $c{i}) (instance (instantiate $c{i}))")).collect();
        assert!(check(&wat::parse_str(format!("(component {side_by_side})")).unwrap()).is_ok());
        // A core module of 100 000 imports, instantiated a thousand times: 10⁸ definitions.
        let imports: String = (0..100_000).map(|i| format!("(import \"\" \"f{i}\" (func))")).collect();
        let instances: String = (0..1000).map(|_| "(core instance (instantiate $m))").collect();
        let core = wat::parse_str(format!("(component (core module $m {imports}) {instances})")).unwrap();
        assert!(check(&core).unwrap_err().contains("more than the 4 MiB"));
    }

    #[test]
    fn many_components_and_instantiations_are_counted_without_rescanning() {
        // 150 000 empty components and as many instantiations of the first, within the size cap:
        // counting each component's instantiations by rescanning them all would make 2·10¹⁰
        // comparisons (minutes in a test build, the reload lock held meanwhile); counted once,
        // it takes milliseconds. The 60 s allowed tells a hang, not a speed.
        let n = 150_000;
        let body = format!("{}{}", "(component)".repeat(n), "(instance (instantiate 0))".repeat(n));
        let file = wat::parse_str(format!("(component {body})")).unwrap();
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || done.send(check(&file)).unwrap());
        let checked = finished.recv_timeout(std::time::Duration::from_secs(60)).expect("checked within a minute");
        assert!(checked.is_ok(), "{checked:?}");
    }

    #[test]
    fn components_taken_from_outside_are_refused() {
        let outside = ["(import \"c\" (component))", "(component $a) (component (alias outer 1 $a (component $b)))"];
        for text in outside {
            let why = check(&wat::parse_str(format!("(component {text})")).unwrap()).unwrap_err();
            assert!(why.contains("a component of components"), "{text}: {why}");
        }
    }

    #[test]
    fn what_does_not_parse_is_left_to_wasmtime_and_nesting_is_bounded() {
        let preamble = b"\0asm\x0d\x00\x01\x00";
        for tail in [&[7u8, 0x80, 0x80][..], &[7, 0xff, 0xff, 0xff, 0xff, 0x7f], &[7, 100, 1, 2]] {
            assert!(check(&[&preamble[..], tail].concat()).is_ok());
        }
        assert!(check(b"\0asm\x01\x00\x00\x00").is_ok(), "a core module");
        assert!(check(b"not wasm").is_ok());
        let mut deep = "(component)".to_string();
        for _ in 0..20 {
            deep = format!("(component {deep})");
        }
        assert!(check(&wat::parse_str(&deep).unwrap()).unwrap_err().contains("nest more than 16 deep"));
    }
}
