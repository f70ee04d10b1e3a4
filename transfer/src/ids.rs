//! Random ids that must differ between runs but are not secrets: engine instance ids, RDMA
//! packet sequence numbers and endpoint ids. (Secrets, nonces and tokens come from
//! [`crate::auth::random_bytes`], which fails rather than fall back.)

use std::hash::{BuildHasher, Hasher};

/// A random `u64` from the OS (getrandom(2)); where the OS has no randomness to give, a hash
/// of the time, the process id and a per-process random hasher key, which still differs
/// between restarts of one process.
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    if getrandom::fill(&mut b).is_ok() {
        return u64::from_ne_bytes(b);
    }
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_differ() {
        let ids: std::collections::HashSet<u64> = (0..64).map(|_| super::random_u64()).collect();
        assert_eq!(ids.len(), 64);
    }
}
