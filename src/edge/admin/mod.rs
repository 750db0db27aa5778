//! What an admin calls (with the admin token or an API key): managing sales, reading their
//! books, managing API keys.

pub mod books;
pub mod keys;
pub mod sales;
