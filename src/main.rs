use std::process::ExitCode;

fn main() -> ExitCode {
    purge_freed_memory_at_once();
    seckill::cli::main()
}

// The purchase path allocates small, short-lived buffers in hyper, axum and redis-rs; with
// glibc's malloc about a sixth of the server's time went to malloc/free. mimalloc measured
// about 9% more purchases/s on the Redis accept path (docs/adr/0005).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

extern "C" {
    /// mimalloc's own setter (`mimalloc.h`), linked with the allocator above.
    fn mi_option_set(option: std::ffi::c_int, value: std::ffi::c_long);
}

/// `mi_option_purge_delay` in mimalloc 3's `mi_option_e`.
const MI_OPTION_PURGE_DELAY: std::ffi::c_int = 15;

/// mimalloc hands freed pages back to the system only after a delay, and only when the
/// thread that freed them allocates again: a storm's buffers stayed resident after it
/// (RSS 92-134 MB right after a 1M-buyer storm, 64-71 MB with no delay, the same CPU per
/// order). `MIMALLOC_PURGE_DELAY` in the environment (so spelled) still wins.
fn purge_freed_memory_at_once() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: a plain setter of an option value, called before any other thread runs.
        unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, 0) }
    }
}
