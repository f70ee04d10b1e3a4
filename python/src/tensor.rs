//! Reading a KV cache tensor handed over from Python: its address, shape, byte strides,
//! element size and device, without copying it.
//!
//! Accepted, in this order (the first that works wins):
//! 1. `__dlpack__` (DLPack: torch, numpy >= 1.22, cupy, jax): the capsule is read, never
//!    consumed, and kept alive with the view, so the exporter's memory stays valid;
//! 2. torch-like objects: `data_ptr()`, `shape`, `stride()` (elements), `element_size()` or
//!    `dtype.itemsize`, `is_cuda` / `get_device()`;
//! 3. `__array_interface__` (numpy's array interface, version 3).
//!
//! Sources: the DLPack C header (dlpack.h, `DLTensor` / `DLManagedTensor`), the Python array API
//! standard's `__dlpack__` (stream `-1`: no synchronisation), numpy's array interface.

use std::ffi::c_void;

use kvferry_kernels::Location;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict, PyTuple};

/// A strided array in host or device memory, described by its first element's address.
pub struct TensorView {
    /// Address of element `[0, 0, ...]` (a device pointer for CUDA memory).
    pub addr: u64,
    /// Size of each axis.
    pub shape: Vec<u64>,
    /// Byte stride of each axis (never negative: negative strides are refused).
    pub strides: Vec<u64>,
    /// Bytes per element.
    pub itemsize: u64,
    /// Where the memory is.
    pub device: Location,
    /// The objects that keep the memory alive (the tensor, and a DLPack capsule).
    pub keep: Vec<Py<PyAny>>,
}

/// DLPack's device types that kvferry reads (dlpack.h `DLDeviceType`).
const DL_CPU: i64 = 1;
const DL_CUDA: i64 = 2;
const DL_CUDA_HOST: i64 = 3;

/// `DLTensor` of dlpack.h (C layout, identical in every DLPack version's legacy capsule).
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device_type: i32,
    device_id: i32,
    ndim: i32,
    dtype_code: u8,
    dtype_bits: u8,
    dtype_lanes: u16,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// Reads `obj` as a strided array (see the module docs for what is accepted).
///
/// Errors: `TypeError` when `obj` offers none of the three interfaces; `ValueError` for a
/// negative stride, an axis of size 0, a broadcast (stride 0) axis, an element size that is
/// not whole bytes, or a device other than CPU, CUDA host memory or CUDA.
pub fn view_of(obj: &Bound<'_, PyAny>) -> PyResult<TensorView> {
    let mut errors = Vec::new();
    if obj.hasattr("__dlpack__")? {
        match from_dlpack(obj) {
            Ok(v) => return Ok(v),
            Err(e) => errors.push(format!("__dlpack__: {e}")),
        }
    }
    if obj.hasattr("data_ptr")? && obj.hasattr("stride")? {
        match from_torch_like(obj) {
            Ok(v) => return Ok(v),
            Err(e) => errors.push(format!("data_ptr()/stride(): {e}")),
        }
    }
    if obj.hasattr("__array_interface__")? {
        match from_array_interface(obj) {
            Ok(v) => return Ok(v),
            Err(e) => errors.push(format!("__array_interface__: {e}")),
        }
    }
    if errors.is_empty() {
        return Err(PyTypeError::new_err(format!(
            "expected a tensor (an object with __dlpack__, data_ptr()/shape/stride(), or \
             __array_interface__), got {}",
            obj.get_type().name()?
        )));
    }
    Err(PyValueError::new_err(format!(
        "cannot read the tensor: {}",
        errors.join("; ")
    )))
}

fn device_of(device_type: i64, device_id: i64) -> PyResult<Location> {
    match device_type {
        DL_CPU | DL_CUDA_HOST => Ok(Location::Cpu),
        DL_CUDA => u32::try_from(device_id)
            .map(Location::Cuda)
            .map_err(|_| PyValueError::new_err(format!("CUDA device id {device_id}"))),
        other => Err(PyValueError::new_err(format!(
            "DLPack device type {other} is not supported (CPU, CUDA host or CUDA memory only)"
        ))),
    }
}

fn from_dlpack(obj: &Bound<'_, PyAny>) -> PyResult<TensorView> {
    let (dev_type, dev_id) = if obj.hasattr("__dlpack_device__")? {
        obj.call_method0("__dlpack_device__")?
            .extract::<(i64, i64)>()?
    } else {
        (DL_CPU, 0)
    };
    let device = device_of(dev_type, dev_id)?;
    // For CUDA, stream -1 asks the exporter not to synchronise: kvferry orders its own work
    // after the caller's stream.
    let capsule = if dev_type == DL_CUDA {
        let kwargs = PyDict::new(obj.py());
        kwargs.set_item("stream", -1)?;
        obj.call_method("__dlpack__", (), Some(&kwargs))?
    } else {
        obj.call_method0("__dlpack__")?
    };
    let cap = capsule.cast::<PyCapsule>()?;
    let ptr = cap.pointer_checked(Some(c"dltensor"))?;
    // SAFETY: a capsule named "dltensor" holds a `DLManagedTensor*` whose first member is a
    // `DLTensor` (dlpack.h); it stays valid while the capsule lives, and the capsule is kept.
    let t = unsafe { &*(ptr.as_ptr() as *const DlTensor) };
    if t.ndim < 0 || (t.ndim > 0 && t.shape.is_null()) {
        return Err(PyValueError::new_err("DLPack tensor without a shape"));
    }
    let ndim = t.ndim as usize;
    // SAFETY: `shape` (and `strides` when not null) point to `ndim` int64 values (dlpack.h).
    let shape: Vec<i64> = (0..ndim).map(|i| unsafe { *t.shape.add(i) }).collect();
    let bits = t.dtype_bits as u64 * t.dtype_lanes.max(1) as u64;
    if bits == 0 || !bits.is_multiple_of(8) {
        return Err(PyValueError::new_err(format!(
            "elements of {bits} bits are not whole bytes"
        )));
    }
    let itemsize = bits / 8;
    let elem_strides: Option<Vec<i64>> =
        // SAFETY: DLPack gives `ndim` strides at `t.strides` when it is not null, alive while the
        // capsule is.
        (!t.strides.is_null()).then(|| (0..ndim).map(|i| unsafe { *t.strides.add(i) }).collect());
    let addr = (t.data as u64).wrapping_add(t.byte_offset);
    let (shape, strides) = checked_layout(&shape, elem_strides.as_deref(), itemsize)?;
    Ok(TensorView {
        addr,
        shape,
        strides,
        itemsize,
        device,
        keep: vec![obj.clone().unbind(), capsule.unbind()],
    })
}

fn from_torch_like(obj: &Bound<'_, PyAny>) -> PyResult<TensorView> {
    let addr: u64 = obj.call_method0("data_ptr")?.extract()?;
    let shape: Vec<i64> = obj.getattr("shape")?.extract()?;
    let strides: Vec<i64> = obj.call_method0("stride")?.extract()?;
    let itemsize: u64 = if obj.hasattr("element_size")? {
        obj.call_method0("element_size")?.extract()?
    } else {
        obj.getattr("dtype")?.getattr("itemsize")?.extract()?
    };
    let is_cuda = obj.hasattr("is_cuda")? && obj.getattr("is_cuda")?.extract::<bool>()?;
    let device = if is_cuda {
        let id: i64 = obj.call_method0("get_device")?.extract()?;
        device_of(DL_CUDA, id)?
    } else {
        Location::Cpu
    };
    if strides.len() != shape.len() {
        return Err(PyValueError::new_err(format!(
            "{} strides for {} axes",
            strides.len(),
            shape.len()
        )));
    }
    let (shape, strides) = checked_layout(&shape, Some(&strides), itemsize)?;
    Ok(TensorView {
        addr,
        shape,
        strides,
        itemsize,
        device,
        keep: vec![obj.clone().unbind()],
    })
}

fn from_array_interface(obj: &Bound<'_, PyAny>) -> PyResult<TensorView> {
    let ai = obj.getattr("__array_interface__")?;
    let ai = ai.cast::<PyDict>()?;
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        ai.get_item(k)?
            .ok_or_else(|| PyValueError::new_err(format!("no {k:?} entry")))
    };
    let data = get("data")?;
    let data = data.cast::<PyTuple>()?;
    let addr: u64 = data.get_item(0)?.extract()?;
    let shape: Vec<i64> = get("shape")?.extract()?;
    let typestr: String = get("typestr")?.extract()?;
    let itemsize: u64 = typestr
        .get(2..)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| PyValueError::new_err(format!("typestr {typestr:?}")))?;
    let strides = match ai.get_item("strides")? {
        Some(s) if !s.is_none() => {
            let s: Vec<i64> = s.extract()?;
            // The interface gives byte strides; turn them into element strides for the check.
            if s.iter().any(|&b| b % itemsize as i64 != 0) {
                return Err(PyValueError::new_err(
                    "byte strides that are not whole elements",
                ));
            }
            Some(s.iter().map(|&b| b / itemsize as i64).collect::<Vec<_>>())
        }
        _ => None,
    };
    let (shape, strides) = checked_layout(&shape, strides.as_deref(), itemsize)?;
    Ok(TensorView {
        addr,
        shape,
        strides,
        itemsize,
        device: Location::Cpu,
        keep: vec![obj.clone().unbind()],
    })
}

/// Shape and byte strides from a shape and element strides (`None`: C-contiguous). A size-1 axis
/// may have any stride (exporters give it 0 or anything): it becomes one element.
fn checked_layout(
    shape: &[i64],
    elem_strides: Option<&[i64]>,
    itemsize: u64,
) -> PyResult<(Vec<u64>, Vec<u64>)> {
    let mut out_shape = Vec::with_capacity(shape.len());
    for &s in shape {
        if s <= 0 {
            return Err(PyValueError::new_err(format!(
                "shape {shape:?}: every axis needs at least one element"
            )));
        }
        out_shape.push(s as u64);
    }
    let strides: Vec<i64> = match elem_strides {
        Some(s) => s.to_vec(),
        None => {
            let mut acc = 1i64;
            let mut v = vec![0i64; shape.len()];
            for i in (0..shape.len()).rev() {
                v[i] = acc;
                acc = acc.saturating_mul(shape[i]);
            }
            v
        }
    };
    let mut out = Vec::with_capacity(strides.len());
    for (i, (&s, &n)) in strides.iter().zip(&out_shape).enumerate() {
        if n == 1 {
            out.push(itemsize);
        } else if s < 0 {
            return Err(PyValueError::new_err(format!(
                "axis {i} has a negative stride ({s}); pass a view with positive strides"
            )));
        } else if s == 0 {
            return Err(PyValueError::new_err(format!(
                "axis {i} has stride 0 (a broadcast view): KV must be real memory"
            )));
        } else {
            out.push(
                (s as u64).checked_mul(itemsize).ok_or_else(|| {
                    PyValueError::new_err(format!("axis {i}: stride {s} overflows"))
                })?,
            );
        }
    }
    Ok((out_shape, out))
}
