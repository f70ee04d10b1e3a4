//! kvferry-p2p (work in progress): the producer/consumer connector.
pub mod proto;
