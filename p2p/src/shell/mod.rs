//! The thin tokio shell around the [`crate::proto`] state machines: sockets,
//! timers and the transfer engine calls. Every await has a deadline.

pub mod consumer;
mod gate;
mod load_metrics;
mod peer_segments;
pub mod producer;
pub mod producer_config;
mod serve;
