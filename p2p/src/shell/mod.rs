//! The thin tokio shell around the [`crate::proto`] state machines: sockets,
//! timers and the transfer engine calls. Every await has a deadline.

mod connection;
pub mod consumer;
pub mod consumer_config;
mod gate;
mod load_metrics;
pub mod producer;
pub mod producer_config;
mod producer_loop;
mod serve;
mod serve_batch;
mod verify_parts;
#[cfg(test)]
mod verify_parts_tests;

use std::time::Instant;

/// Sleeps until `deadline` (a machine's `poll_timeout`), or forever when there is none: the
/// timer arm of both shells' event loops.
pub(crate) async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(tokio::time::Instant::from_std(d)).await,
        None => std::future::pending().await,
    }
}
