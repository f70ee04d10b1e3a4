//! see lib.rs
