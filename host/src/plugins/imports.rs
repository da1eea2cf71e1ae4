//! What the linker gives plugins beyond wasmtime-wasi's defaults: guards shadowing three
//! `wasi:filesystem` functions (refused paths logged, no symbolic links out of a grant, no hard
//! links), a fix for a resource-table leak in wasi:http's `outgoing-handler.handle`, and for a
//! plugin without an `http` grant, wasi:http functions that trap with a message naming the
//! missing grant instead of the real ones.

use anyhow::Context as _;
use wasmtime::Engine;
use wasmtime::component::types::ComponentItem;
use wasmtime::component::{Component, Linker, ResourceType};

use super::sandbox::HostState;

/// The WASI version of `wasi:filesystem` that wasmtime-wasi links.
const WASI_FILESYSTEM_TYPES: &str = "wasi:filesystem/types@0.2.12";

/// Shadows three `wasi:filesystem` functions in the linker:
///
/// - `descriptor.open-at` calls wasmtime-wasi's own implementation and, when it refuses a path
///   (one that climbs out of a granted directory), leaves a warning naming the plugin and the path.
///   Paths outside every granted directory never reach the host: the guest's libc finds no
///   directory to resolve them against and fails on its own.
/// - `descriptor.symlink-at` refuses a link whose target is absolute or has a `..` component
///   (see [`link_target_stays_inside`]): host tools such as log shippers and backups follow links,
///   and must not be led out of the grant.
/// - `descriptor.link-at` refuses every hard link: transports have no use for them, and a hard
///   link keeps a file alive and reachable under a name the operator did not choose.
///
/// Refusals answer `not-permitted` and leave a warning naming the plugin and the target.
pub(super) fn guard_file_access(linker: &mut Linker<HostState>) -> anyhow::Result<()> {
    use wasmtime::component::Resource;
    use wasmtime_wasi::filesystem::WasiFilesystemView;
    use wasmtime_wasi::p2::bindings::filesystem::types::{
        Descriptor, DescriptorFlags, ErrorCode, Host as _, HostDescriptor as _, OpenFlags, PathFlags,
    };
    type OpenArgs = (Resource<Descriptor>, PathFlags, String, OpenFlags, DescriptorFlags);
    type SymlinkArgs = (Resource<Descriptor>, String, String);
    type LinkArgs = (Resource<Descriptor>, PathFlags, String, Resource<Descriptor>, String);
    linker.allow_shadowing(true);
    let mut types = linker.instance(WASI_FILESYSTEM_TYPES).map_err(anyhow::Error::from)?;
    types
        .func_wrap_async("[method]descriptor.open-at", |mut store, (fd, path_flags, path, oflags, flags): OpenArgs| {
            Box::new(async move {
                let state = store.data_mut();
                let plugin = state.plugin.clone();
                let mut fs = state.filesystem();
                let opened = fs.open_at(fd, path_flags, path.clone(), oflags, flags).await;
                let result: Result<Resource<Descriptor>, ErrorCode> = match opened {
                    Ok(fd) => Ok(fd),
                    Err(e) => Err(fs.convert_error_code(e)?),
                };
                if let Err(ErrorCode::NotPermitted | ErrorCode::Access) = &result {
                    tracing::warn!(plugin = %plugin, path = %shown(&path), "plugin denied access to a path outside its directories");
                }
                Ok((result,))
            })
        })
        .map_err(anyhow::Error::from)?;
    types
        .func_wrap_async("[method]descriptor.symlink-at", |mut store, (fd, target, link): SymlinkArgs| {
            Box::new(async move {
                let state = store.data_mut();
                if !link_target_stays_inside(&target) {
                    tracing::warn!(plugin = %state.plugin, target = %shown(&target), link = %shown(&link), "plugin denied a symbolic link to a target outside its directories");
                    return Ok((Err(ErrorCode::NotPermitted),));
                }
                let mut fs = state.filesystem();
                let result: Result<(), ErrorCode> = match fs.symlink_at(fd, target, link).await {
                    Ok(()) => Ok(()),
                    Err(e) => Err(fs.convert_error_code(e)?),
                };
                Ok((result,))
            })
        })
        .map_err(anyhow::Error::from)?;
    types
        .func_wrap_async("[method]descriptor.link-at", |store, (_, _, target, _, link): LinkArgs| {
            Box::new(async move {
                tracing::warn!(plugin = %store.data().plugin, target = %shown(&target), link = %shown(&link), "plugin denied a hard link; plugins may not make them");
                Ok((Err::<(), _>(ErrorCode::NotPermitted),))
            })
        })
        .map_err(anyhow::Error::from)?;
    linker.allow_shadowing(false);
    Ok(())
}

/// The longest path of a plugin's that a refusal's log line shows.
const MAX_SHOWN_PATH: usize = 512;

/// A path a plugin named, as a log line shows it: a plugin chooses every byte of it (up to its
/// memory's size), so it is cut and its control characters escaped, or a line break in it would
/// forge log lines.
fn shown(path: &str) -> String {
    crate::untrusted::clean(path, MAX_SHOWN_PATH)
}

/// Whether a symbolic link with this target, made anywhere inside a granted directory, resolves
/// inside it: the target is relative and never climbs (`..`). A chain of such links stays inside
/// too, since each step only descends.
pub(super) fn link_target_stays_inside(target: &str) -> bool {
    !target.starts_with('/') && !target.split('/').any(|part| part == "..")
}

/// The wasi:http version wasmtime-wasi-http links.
const WASI_HTTP_OUTGOING_HANDLER: &str = "wasi:http/outgoing-handler@0.2.12";

/// Shadows `outgoing-handler.handle`: wasmtime-wasi-http 48 reads the `request-options` a plugin
/// hands over with a request but never removes them from the instance's resource table, so every
/// request with options would leave an entry behind until the (capped) table is full. The wrapper
/// calls the real function, then removes them.
pub(super) fn free_request_options(linker: &mut Linker<HostState>) -> anyhow::Result<()> {
    use wasmtime::component::Resource;
    use wasmtime_wasi_http::p2::bindings::http::outgoing_handler::Host as _;
    use wasmtime_wasi_http::p2::bindings::http::types::ErrorCode;
    use wasmtime_wasi_http::p2::types::{HostFutureIncomingResponse, HostOutgoingRequest};
    use wasmtime_wasi_http::{RequestOptions, WasiHttpView as _};
    type Args = (Resource<HostOutgoingRequest>, Option<Resource<RequestOptions>>);
    linker.allow_shadowing(true);
    let mut handler = linker.instance(WASI_HTTP_OUTGOING_HANDLER).map_err(anyhow::Error::from)?;
    handler
        .func_wrap("handle", |mut store, (request, options): Args| {
            let mut http = store.data_mut().http();
            let handed_over = options.as_ref().map(|o| Resource::<RequestOptions>::new_own(o.rep()));
            let result = http.handle(request, options);
            // Only if the entry is still the options: should a later wasmtime free them itself,
            // the slot may already hold something else.
            if let Some(options) = handed_over
                && http.table.get(&options).is_ok()
            {
                let _ = http.table.delete(options);
            }
            let result: Result<Resource<HostFutureIncomingResponse>, ErrorCode> = match result {
                Ok(response) => Ok(response),
                Err(e) => Err(e.downcast()?),
            };
            Ok((result,))
        })
        .map_err(anyhow::Error::from)?;
    linker.allow_shadowing(false);
    Ok(())
}

/// Whether `component` imports any wasi:http interface.
pub(super) fn imports_http(component: &Component, engine: &Engine) -> bool {
    component.component_type().imports(engine).any(|(name, _)| name.starts_with(WASI_HTTP))
}

/// The interfaces of wasi:http, by the prefix of their import names.
const WASI_HTTP: &str = "wasi:http/";

/// The most resources one wasi:http interface may be imported with.
const MAX_HTTP_RESOURCES: usize = 64;

/// Defines, in `linker` (which has no wasi:http), every wasi:http function `component` imports as
/// one that traps with a message naming the plugin and the missing grant, and every wasi:http
/// resource it imports as a host resource no function ever makes. A plugin without an `http`
/// grant thus loads and runs, but cannot make the host allocate a single wasi:http object.
///
/// Resources that a wasi:http interface only re-exports from another one (`wasi:io`'s streams
/// and pollables, or `types`' resources in `outgoing-handler`) are left alone: they are already
/// defined, and a second definition would not match.
pub(super) fn deny_http(linker: &mut Linker<HostState>, component: &Component, engine: &Engine) -> anyhow::Result<()> {
    let imports: Vec<(String, ComponentItem)> =
        component.component_type().imports(engine).map(|(name, item)| (name.to_string(), item.ty)).collect();
    let mut defined: Vec<ResourceType> = Vec::new();
    for (name, item) in &imports {
        if let ComponentItem::ComponentInstance(instance) = item
            && !name.starts_with(WASI_HTTP)
        {
            defined.extend(instance.exports(engine).filter_map(|(_, item)| match item.ty {
                ComponentItem::Resource(ty) => Some(ty),
                _ => None,
            }));
        }
    }
    for (name, item) in &imports {
        let ComponentItem::ComponentInstance(instance) = item else { continue };
        if !name.starts_with(WASI_HTTP) {
            continue;
        }
        // The interfaces of wasi:http define about a dozen resources: a component that claims
        // thousands is refused before the check below, which compares each with every other.
        let resources = instance.exports(engine).filter(|(_, item)| matches!(item.ty, ComponentItem::Resource(_)));
        if resources.count() > MAX_HTTP_RESOURCES {
            anyhow::bail!(
                "{name} is imported with more than {MAX_HTTP_RESOURCES} resources, which no version of wasi:http has"
            );
        }
        let mut stubs =
            linker.instance(name).map_err(anyhow::Error::from).with_context(|| format!("linking {name}"))?;
        for (export, item) in instance.exports(engine) {
            match item.ty {
                ComponentItem::ComponentFunc(_) => {
                    let function = format!("{name}#{export}");
                    stubs
                        .func_new(export, move |store, _, _, _| {
                            let plugin = &store.data().plugin;
                            wasmtime::bail!(
                                "plugin {plugin} called {function}, but sandbox.{plugin}.http grants no origin: \
                                 wasi:http is linked only for plugins with an http grant"
                            )
                        })
                        .map_err(anyhow::Error::from)
                        .with_context(|| format!("linking {name}#{export}"))?;
                }
                ComponentItem::Resource(ty) if !defined.contains(&ty) => {
                    defined.push(ty);
                    stubs
                        .resource(export, ResourceType::host::<NoHttp>(), |_, _| Ok(()))
                        .map_err(anyhow::Error::from)
                        .with_context(|| format!("linking {name}#{export}"))?;
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// The host side of every wasi:http resource of a plugin without an `http` grant; never made.
struct NoHttp;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_targets_must_stay_inside_the_grant() {
        for inside in ["file.txt", "sub/file.txt", "./file", ".", "a/.../b", "..hidden", "sub/"] {
            assert!(link_target_stays_inside(inside), "{inside}");
        }
        for outside in ["/etc/passwd", "/", "..", "../x", "../../etc/passwd", "sub/../../x", "sub/..", "a//../b"] {
            assert!(!link_target_stays_inside(outside), "{outside}");
        }
    }
}
