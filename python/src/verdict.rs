//! Comparison, verdicts and the failure policy from Python (docs/design.md §2.6, §2.7; the seed's
//! "Verdicts" and "Failure semantics"): `compare(expected, actual)`, `KVChecksumVerdict`,
//! `KVChecksumPolicy` and `decide`. The logic is the checksum crate's; this file only converts.

use std::collections::BTreeMap;

use kvferry_checksum::payload::{Payload, PayloadError};
use kvferry_checksum::policy::{Action, CarrierCheck, LoadFailurePolicy, Policy};
use kvferry_checksum::record::{ConsumerGroup, ConsumerSums};
use kvferry_checksum::verdict::{compare as compare_sums, UnverifiedReason, Verdict};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

use crate::payload::KVChecksumPayload;
use crate::repr::{bool_repr, str_repr};

/// The stable code of an unverified reason (snake case of the reason).
pub fn reason_code(r: UnverifiedReason) -> &'static str {
    match r {
        UnverifiedReason::NotEveryWorkerReported => "not_every_worker_reported",
        UnverifiedReason::NoChecksums => "no_checksums",
        UnverifiedReason::InvalidChecksums => "invalid_checksums",
        UnverifiedReason::OtherBlocks => "other_blocks",
        UnverifiedReason::OneSideOnly => "one_side_only",
        UnverifiedReason::FingerprintDiffers => "fingerprint_differs",
        UnverifiedReason::BlockSizesIncompatible => "block_sizes_incompatible",
        UnverifiedReason::UnalignedStart => "unaligned_start",
        UnverifiedReason::NoCommonPosition => "no_common_position",
        UnverifiedReason::ReplicaNotChecksummed => "replica_not_checksummed",
    }
}

/// `"complete"`, `"fail"` or `"recompute"`.
pub fn action_name(a: Action) -> &'static str {
    match a {
        Action::Complete => "complete",
        Action::Fail => "fail",
        Action::Recompute => "recompute",
    }
}

/// The outcome of comparing one load's checksums (docs/design.md §2.6).
///
/// - status: ``"verified"`` (every compared position of every group matches), ``"mismatch"``
///   (some position differs; a mismatch wins over unverified groups) or ``"unverified"`` (nothing
///   differs, but a group or the whole load could not be compared).
/// - verified: ``status == "verified"``.
/// - mismatches: list of ``(group_id, positions)``, positions the consumer's block positions
///   that differ, ascending.
/// - unverified: list of ``(group_id or None for the whole load, reason)``, reason one of
///   ``not_every_worker_reported``, ``no_checksums``, ``invalid_checksums``, ``other_blocks``,
///   ``one_side_only``, ``fingerprint_differs``, ``block_sizes_incompatible``,
///   ``unaligned_start``, ``no_common_position``, ``replica_not_checksummed``.
///
/// ``str(verdict)`` gives the reasons in words.
#[pyclass(frozen, module = "kvferry")]
#[derive(Clone)]
pub struct KVChecksumVerdict {
    pub(crate) inner: Verdict,
}

#[pymethods]
impl KVChecksumVerdict {
    /// ``"verified"``, ``"mismatch"`` or ``"unverified"``.
    #[getter]
    pub(crate) fn status(&self) -> &'static str {
        match self.inner {
            Verdict::Verified => "verified",
            Verdict::Mismatch { .. } => "mismatch",
            Verdict::Unverified(_) => "unverified",
        }
    }

    /// Whether the load verified.
    #[getter]
    fn verified(&self) -> bool {
        self.inner.is_verified()
    }

    /// ``[(group_id, [block positions]), ...]`` of the groups whose values differ.
    #[getter]
    fn mismatches(&self) -> Vec<(u32, Vec<u64>)> {
        match &self.inner {
            Verdict::Mismatch { mismatches, .. } => mismatches
                .iter()
                .map(|m| (m.group_id, m.positions.clone()))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// ``[(group_id or None, reason code), ...]`` of what could not be compared.
    #[getter]
    fn unverified(&self) -> Vec<(Option<u32>, &'static str)> {
        self.inner
            .unverified()
            .iter()
            .map(|(g, r)| (*g, reason_code(*r)))
            .collect()
    }

    fn __str__(&self) -> String {
        let mut parts = vec![self.status().to_string()];
        for (g, pos) in self.mismatches() {
            parts.push(format!("group {g} differs at block positions {pos:?}"));
        }
        for (g, r) in self.inner.unverified() {
            match g {
                Some(g) => parts.push(format!("group {g}: {r}")),
                None => parts.push(format!("load: {r}")),
            }
        }
        parts.join("; ")
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!("KVChecksumVerdict({})", str_repr(py, &self.__str__()))
    }
}

/// The expected side of `compare`: a payload, or why there is none.
fn expected_of(obj: &Bound<'_, PyAny>) -> PyResult<Option<Result<Payload, PayloadError>>> {
    if obj.is_none() {
        return Ok(None);
    }
    if let Ok(p) = obj.cast::<KVChecksumPayload>() {
        return Ok(Some(Ok(p.get().inner.clone())));
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(Some(Payload::from_bytes(b.as_bytes())));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Some(Payload::from_base64(&s.extract::<String>()?)));
    }
    Err(PyTypeError::new_err(format!(
        "expected: a KVChecksumPayload, its bytes, its base64 text, or None; got {}",
        obj.get_type().name()?
    )))
}

/// compare(expected, actual) -> KVChecksumVerdict
///
/// Compares the producer's checksums with the consumer's (docs/design.md §2.6), group by group, at
/// the block positions both sides checksummed; the last block only when both hold the same
/// number of tokens in it. Different block sizes compare when one divides the other (blocks are
/// summed into chunks of the larger size).
///
/// - expected: the producer's KVChecksumPayload, or its bytes (``to_bytes()``) or base64 text
///   (``to_base64()``) as received; bytes or text that do not decode give an unverified verdict
///   (``invalid_checksums``), None gives ``no_checksums``.
/// - actual: the consumer's values as a KVChecksumPayload: per group, one value per block
///   position from ``start`` (the blocks the load wrote, summed over the consumer's ranks), its
///   block size and fingerprint; ``num_tokens`` the tokens the consumer holds after the load. A
///   group missing here but present in ``expected`` is unverified (``one_side_only``).
///
/// Raises TypeError for other argument types; never for bad payload bytes.
#[pyfunction]
fn compare(
    expected: &Bound<'_, PyAny>,
    actual: PyRef<'_, KVChecksumPayload>,
) -> PyResult<KVChecksumVerdict> {
    let expected = expected_of(expected)?;
    let a = &actual.inner;
    let groups: BTreeMap<u32, ConsumerGroup> = a
        .groups
        .iter()
        .map(|g| {
            (
                g.group_id,
                ConsumerGroup::Checked {
                    block_size: g.block_size,
                    start: g.start,
                    fingerprint: g.fingerprint,
                    checks: vec![g.values.clone()],
                },
            )
        })
        .collect();
    if groups.len() != a.groups.len() {
        return Err(PyValueError::new_err(
            "actual: a group id appears twice".to_string(),
        ));
    }
    let sums = ConsumerSums {
        num_tokens: a.num_tokens,
        groups,
    };
    let verdict = match &expected {
        None => compare_sums(Ok(None), &sums),
        Some(Ok(p)) => compare_sums(Ok(Some(p)), &sums),
        Some(Err(e)) => compare_sums(Err(e), &sums),
    };
    Ok(KVChecksumVerdict { inner: verdict })
}

fn load_failure_of(name: &str) -> PyResult<LoadFailurePolicy> {
    name.parse::<LoadFailurePolicy>()
        .map_err(PyValueError::new_err)
}

/// The checksum failure policy of one side (docs/design.md §2.7; the seed's kv_checksum_fail_closed
/// and kv_load_failure_policy).
///
/// KVChecksumPolicy(fail_closed=False, load_failure_policy="fail")
///
/// - fail_closed: False (fail-open, the default): mismatched and unverified loads are only
///   logged and complete. True: they are load failures.
/// - load_failure_policy: ``"fail"`` (the request ends with an error) or ``"recompute"`` (the
///   consumer discards the loaded KV and recomputes the prompt; the caller performs it).
///
/// Raises ValueError for another load_failure_policy.
#[pyclass(frozen, module = "kvferry")]
pub struct KVChecksumPolicy {
    pub(crate) inner: Policy,
}

#[pymethods]
impl KVChecksumPolicy {
    #[new]
    #[pyo3(signature = (fail_closed=false, load_failure_policy="fail"))]
    fn new(fail_closed: bool, load_failure_policy: &str) -> PyResult<KVChecksumPolicy> {
        Ok(KVChecksumPolicy {
            inner: Policy {
                fail_closed,
                load_failure: load_failure_of(load_failure_policy)?,
            },
        })
    }

    /// Whether mismatched and unverified loads fail.
    #[getter]
    fn fail_closed(&self) -> bool {
        self.inner.fail_closed
    }

    /// ``"fail"`` or ``"recompute"``.
    #[getter]
    fn load_failure_policy(&self) -> &'static str {
        match self.inner.load_failure {
            LoadFailurePolicy::Fail => "fail",
            LoadFailurePolicy::Recompute => "recompute",
        }
    }

    /// decide(verdict) -> str: the action for a load with this verdict: ``"complete"`` when
    /// verified or fail-open, else ``"fail"`` or ``"recompute"`` per the load failure policy.
    fn decide(&self, verdict: PyRef<'_, KVChecksumVerdict>) -> &'static str {
        action_name(self.inner.decide(&verdict.inner))
    }

    /// on_load_error() -> str: the action for a load that did not land at all (unreachable
    /// producer, ERROR reply, no reply): ``"fail"`` or ``"recompute"`` per the load failure
    /// policy, fail-open or not (a load that did not land is never completed).
    fn on_load_error(&self) -> &'static str {
        action_name(self.inner.on_load_error())
    }

    /// check_carrier(has_carrier) -> bool: the startup check for enabling checksums. True with
    /// a carrier; without one, False under fail-open (checksums disabled; a warning is logged)
    /// and ValueError under fail-closed (no load could be verified).
    fn check_carrier(&self, has_carrier: bool) -> PyResult<bool> {
        match self.inner.check_carrier(has_carrier) {
            Ok(CarrierCheck::Enabled) => Ok(true),
            Ok(CarrierCheck::DisabledWithWarning(text)) => {
                tracing::warn!("{text}");
                Ok(false)
            }
            Err(e) => Err(PyValueError::new_err(e.to_string())),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "KVChecksumPolicy(fail_closed={}, load_failure_policy='{}')",
            bool_repr(self.inner.fail_closed),
            self.load_failure_policy()
        )
    }
}

/// decide(verdict, fail_closed=False, load_failure_policy="fail") -> str
///
/// ``KVChecksumPolicy(fail_closed, load_failure_policy).decide(verdict)``: ``"complete"``,
/// ``"fail"`` or ``"recompute"`` (docs/design.md §2.7). Raises ValueError for another policy name.
#[pyfunction]
#[pyo3(signature = (verdict, fail_closed=false, load_failure_policy="fail"))]
fn decide(
    verdict: PyRef<'_, KVChecksumVerdict>,
    fail_closed: bool,
    load_failure_policy: &str,
) -> PyResult<&'static str> {
    let policy = Policy {
        fail_closed,
        load_failure: load_failure_of(load_failure_policy)?,
    };
    Ok(action_name(policy.decide(&verdict.inner)))
}

/// Registers the functions and classes of this file.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<KVChecksumVerdict>()?;
    m.add_class::<KVChecksumPolicy>()?;
    m.add_function(wrap_pyfunction!(compare, m)?)?;
    m.add_function(wrap_pyfunction!(decide, m)?)?;
    Ok(())
}
