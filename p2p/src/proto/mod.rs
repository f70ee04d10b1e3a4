//! The sans-I/O protocol (docs/design.md §1, §4): wire messages and the producer and
//! consumer state machines, with no sockets and no clock in them (time is an
//! argument), so every rule is tested without a network.

pub mod consumer;
pub mod msg;
pub mod plan;
pub mod producer;

#[cfg(test)]
mod tests;
