//! Unit tests of the RDMA transport's pure parts (device tests are in tests/rdma_*.rs).
use super::endpoint::*;
