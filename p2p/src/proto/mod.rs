//! The sans-I/O protocol (docs/design.md §1, §4): wire messages, the producer and
//! consumer state machines, the consumer's request ([`request`]) and the producer's plan
//! of the copies that serve it ([`serve`], through the [`heads`] map of which rank holds
//! which KV heads), with no sockets, engines or clock in them (time is an argument, ranks
//! are plain [`layout`] data), so every rule is tested without a network.

pub mod consumer;
pub mod heads;
pub mod layout;
pub mod msg;
mod msg_body;
mod msg_header;
pub mod msg_read;
mod msg_span;
mod peer_segments;
pub mod plan;
pub mod producer;
pub mod producer_effects;
pub mod progress;
pub mod read_plan;
pub mod request;
pub mod serve;
pub mod serve_error;
pub mod serve_parts;
mod serve_ranges;
pub mod session;
pub mod sessions;
pub mod spec_checks;
pub mod wire;

#[cfg(test)]
mod link_tests;
#[cfg(test)]
mod progress_tests;
#[cfg(test)]
mod read_tests;
#[cfg(test)]
mod serve_tests;
#[cfg(test)]
pub(crate) mod tests;
