//! The command line and the outside programs run against the binary: `seckill` commands
//! and `seckill bench`, deploy/'s files under nginx and systemd-analyze, the OpenAPI
//! contract under schemathesis, the pages in Chromium, the captcha against tesseract.

#[path = "../common/mod.rs"]
mod common;

mod bench;
mod browser;
mod captcha_ocr;
mod cli;
mod contract;
mod deploy;
