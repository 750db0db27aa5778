use std::process::ExitCode;

fn main() -> ExitCode {
    seckill::cli::main()
}

// The purchase path allocates small, short-lived buffers in hyper, axum and redis-rs; with
// glibc's malloc about a sixth of the server's time went to malloc/free. mimalloc measured
// about 9% more purchases/s on the Redis accept path (BENCHMARKS.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
