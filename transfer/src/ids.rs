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

/// A map keyed by numbers this process issues or owns (batch ids, local region addresses),
/// never by a peer's choice: hashed by one multiplication instead of SipHash, which costs
/// tens of nanoseconds per lookup on the submit path.
pub(crate) type NumMap<V> =
    std::collections::HashMap<u64, V, std::hash::BuildHasherDefault<NumHasher>>;

/// The hasher of [`NumMap`]: a multiplication by the golden ratio, with the high half folded
/// into the low one (aligned addresses differ in high bits only).
#[derive(Default)]
pub(crate) struct NumHasher(u64);

impl Hasher for NumHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 32)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_differ() {
        let ids: std::collections::HashSet<u64> = (0..64).map(|_| super::random_u64()).collect();
        assert_eq!(ids.len(), 64);
    }

    #[test]
    fn aligned_addresses_spread_over_a_num_maps_buckets() {
        use std::hash::{BuildHasher, BuildHasherDefault};
        let b = BuildHasherDefault::<super::NumHasher>::default();
        // 2 MiB-aligned addresses: their low 12 hash bits (what picks a bucket) still differ.
        let low: std::collections::HashSet<u64> =
            (1..=256u64).map(|i| b.hash_one(i << 21) & 0xfff).collect();
        assert!(low.len() > 200, "{}", low.len());
    }
}
