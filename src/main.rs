use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    seckill::cli::main().await
}
