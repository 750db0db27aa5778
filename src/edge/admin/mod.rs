//! What an admin calls (with the admin token): managing sales, and reading their books.

pub mod books;
pub mod sales;
