//! The CUDA driver API through cudarc, loaded at run time, and only after checking that it can be.
//!
//! cudarc's `dynamic-loading` looks for `libcuda.so` (`nvcuda.dll`) on first use and **panics** if it is
//! missing, in every call including `cuInit`. [`Gpu::open`] therefore asks
//! `cudarc::driver::sys::is_culib_present()` first (it only tries to open the library) and answers
//! [`ValidateError::NoDriver`] on machines without an NVIDIA driver; only then does it call `cuInit`, whose
//! errors are ordinary `Result`s. Calls are also run under `catch_unwind` ([`guard`]) so that a symbol
//! missing from an old driver becomes an error, not a crash.
//!
//! Everything here is a thin, checked wrapper of one driver call; the primary context of the device is
//! retained and made current for the whole session and released on drop.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::driver::result;
use cudarc::driver::sys;

use crate::error::ValidateError;

/// The cudarc version this crate was built with (its `Cargo.toml` pins 0.19).
pub const CUDARC_VERSION: &str = "0.19";

/// Whether the CUDA driver library can be loaded here. Never panics, never calls the driver.
pub fn driver_library_present() -> bool {
    // SAFETY: only tries to dlopen the candidate library names; no driver function is called.
    unsafe { sys::is_culib_present() }
}

/// The error for a machine without the driver library.
pub fn no_driver() -> ValidateError {
    ValidateError::NoDriver {
        reason: format!(
            "the CUDA driver library ({}) could not be loaded",
            if cfg!(windows) {
                "nvcuda.dll"
            } else {
                "libcuda.so"
            }
        ),
    }
}

/// Runs `f`, turning a panic inside cudarc into [`ValidateError::Panicked`].
pub fn guard<T>(f: impl FnOnce() -> Result<T, ValidateError>) -> Result<T, ValidateError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => {
            let text = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a driver call panicked".to_string());
            Err(ValidateError::Panicked(text))
        }
    }
}

/// A CUDA stream of a [`Gpu`] session (or the legacy default stream).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Stream(sys::CUstream);

impl Stream {
    /// The legacy default (null) stream: PyTorch's default stream.
    pub fn null() -> Stream {
        Stream(result::stream::null())
    }
}

/// A stream-ordered memory pool created by [`Gpu::new_pool`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pool(sys::CUmemoryPool);

/// A device with its primary context current: the session every GPU command runs in.
pub struct Gpu {
    device: sys::CUdevice,
    /// The device ordinal.
    pub ordinal: i32,
    /// `cuDeviceGetName`.
    pub name: String,
    /// `cuMemGetInfo` total.
    pub total: u64,
    /// `cuMemGetInfo` free right after the context was created.
    pub free_after_context: u64,
    /// `cuDriverGetVersion`.
    pub driver_version: i32,
}

impl Gpu {
    /// Loads the driver, initialises it, retains the primary context of device `ordinal` and makes it
    /// current. [`ValidateError::NoDriver`] when there is no driver library, [`ValidateError::NoDevice`]
    /// when there is no usable device.
    pub fn open(ordinal: i32) -> Result<Gpu, ValidateError> {
        if !driver_library_present() {
            return Err(no_driver());
        }
        guard(|| {
            result::init().map_err(|e| ValidateError::NoDevice {
                reason: format!("cuInit failed: {}", describe(e)),
            })?;
            let count = result::device::get_count().map_err(|e| ValidateError::NoDevice {
                reason: format!("cuDeviceGetCount failed: {}", describe(e)),
            })?;
            if ordinal < 0 || ordinal >= count {
                return Err(ValidateError::NoDevice {
                    reason: format!("device {ordinal} does not exist (the driver sees {count})"),
                });
            }
            let device = result::device::get(ordinal)
                .map_err(|e| ValidateError::driver(format!("cuDeviceGet({ordinal})"), e))?;
            let name = result::device::get_name(device)
                .map_err(|e| ValidateError::driver("cuDeviceGetName", e))?;
            let mut driver_version = 0;
            // SAFETY: writes one int.
            unsafe { sys::cuDriverGetVersion(&mut driver_version) }
                .result()
                .map_err(|e| ValidateError::driver("cuDriverGetVersion", e))?;
            // SAFETY: `device` came from cuDeviceGet.
            let ctx = unsafe { result::primary_ctx::retain(device) }
                .map_err(|e| ValidateError::driver("cuDevicePrimaryCtxRetain", e))?;
            // SAFETY: a context just retained.
            unsafe { result::ctx::set_current(ctx) }
                .map_err(|e| ValidateError::driver("cuCtxSetCurrent", e))?;
            let (free, total) =
                result::mem_get_info().map_err(|e| ValidateError::driver("cuMemGetInfo", e))?;
            Ok(Gpu {
                device,
                ordinal,
                name,
                total: total as u64,
                free_after_context: free as u64,
                driver_version,
            })
        })
    }

    /// `cuMemGetInfo`: (free, total) bytes.
    pub fn mem_info(&self) -> Result<(u64, u64), ValidateError> {
        let (free, total) =
            result::mem_get_info().map_err(|e| ValidateError::driver("cuMemGetInfo", e))?;
        Ok((free as u64, total as u64))
    }

    /// `cuMemGetInfo` free bytes.
    pub fn free_memory(&self) -> Result<u64, ValidateError> {
        Ok(self.mem_info()?.0)
    }

    /// `cuMemAlloc(size)`.
    pub fn mem_alloc(&self, size: u64) -> Result<u64, ValidateError> {
        // SAFETY: the memory is never read; the context is current.
        unsafe { result::malloc_sync(size as usize) }
            .map_err(|e| ValidateError::driver(format!("cuMemAlloc({size})"), e))
    }

    /// `cuMemFree(ptr)`.
    pub fn mem_free(&self, ptr: u64) -> Result<(), ValidateError> {
        // SAFETY: `ptr` came from `mem_alloc` and is freed once.
        unsafe { result::free_sync(ptr) }
            .map_err(|e| ValidateError::driver(format!("cuMemFree({ptr:#x})"), e))
    }

    /// `cuCtxSynchronize`.
    pub fn synchronize(&self) -> Result<(), ValidateError> {
        result::ctx::synchronize().map_err(|e| ValidateError::driver("cuCtxSynchronize", e))
    }

    /// A new non-blocking stream (as PyTorch's side streams are).
    pub fn new_stream(&self) -> Result<Stream, ValidateError> {
        result::stream::create(result::stream::StreamKind::NonBlocking)
            .map(Stream)
            .map_err(|e| ValidateError::driver("cuStreamCreate", e))
    }

    /// `cuStreamSynchronize`.
    pub fn stream_synchronize(&self, stream: Stream) -> Result<(), ValidateError> {
        // SAFETY: a stream of this session (or the null stream).
        unsafe { result::stream::synchronize(stream.0) }
            .map_err(|e| ValidateError::driver("cuStreamSynchronize", e))
    }

    /// `cuStreamDestroy`.
    pub fn destroy_stream(&self, stream: Stream) -> Result<(), ValidateError> {
        // SAFETY: a stream created by `new_stream`, destroyed once.
        unsafe { result::stream::destroy(stream.0) }
            .map_err(|e| ValidateError::driver("cuStreamDestroy", e))
    }

    /// Makes `dependent` wait for the work queued on `dependency` so far (PyTorch's `sync_raw`).
    pub fn stream_wait(&self, dependency: Stream, dependent: Stream) -> Result<(), ValidateError> {
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| ValidateError::driver("cuEventCreate", e))?;
        // SAFETY: a fresh event and streams of this session.
        unsafe {
            result::event::record(event, dependency.0)
                .map_err(|e| ValidateError::driver("cuEventRecord", e))?;
            result::stream::wait_event(
                dependent.0,
                event,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(|e| ValidateError::driver("cuStreamWaitEvent", e))?;
            result::event::destroy(event).map_err(|e| ValidateError::driver("cuEventDestroy", e))
        }
    }

    /// A fresh stream-ordered pool on this device with the given release threshold and every reuse
    /// policy enabled (PyTorch's settings apart from the threshold). An explicit pool rather than the
    /// device's default one, so that every replay starts from an empty pool.
    pub fn new_pool(&self, release_threshold: u64) -> Result<Pool, ValidateError> {
        let props = sys::CUmemPoolProps {
            allocType: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            handleTypes: sys::CUmemAllocationHandleType(0),
            location: self.location(),
            win32SecurityAttributes: std::ptr::null_mut(),
            maxSize: 0,
            usage: 0,
            reserved: [0; 54],
        };
        // SAFETY: `props` is a valid CUmemPoolProps.
        let pool = unsafe { result::mem_pool::create(&props) }
            .map(Pool)
            .map_err(|e| ValidateError::driver("cuMemPoolCreate", e))?;
        self.set_pool_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            release_threshold,
        )?;
        for attribute in [
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
        ] {
            let mut enable: i32 = 1;
            // SAFETY: these attributes take an int.
            unsafe {
                result::mem_pool::set_attribute(
                    pool.0,
                    attribute,
                    &mut enable as *mut i32 as *mut c_void,
                )
            }
            .map_err(|e| {
                ValidateError::driver(format!("cuMemPoolSetAttribute({attribute:?})"), e)
            })?;
        }
        Ok(pool)
    }

    /// Sets a 64-bit pool attribute (threshold, or a high-water mark reset with 0).
    pub fn set_pool_attribute(
        &self,
        pool: Pool,
        attribute: sys::CUmemPool_attribute,
        value: u64,
    ) -> Result<(), ValidateError> {
        let mut value = value;
        // SAFETY: these attributes take a cuuint64_t.
        unsafe {
            result::mem_pool::set_attribute(
                pool.0,
                attribute,
                &mut value as *mut u64 as *mut c_void,
            )
        }
        .map_err(|e| ValidateError::driver(format!("cuMemPoolSetAttribute({attribute:?})"), e))
    }

    /// Reads a 64-bit pool attribute (`RESERVED_MEM_CURRENT`, `USED_MEM_HIGH`, ...).
    pub fn pool_attribute(
        &self,
        pool: Pool,
        attribute: sys::CUmemPool_attribute,
    ) -> Result<u64, ValidateError> {
        let mut value: u64 = 0;
        // SAFETY: these attributes are cuuint64_t.
        unsafe {
            result::mem_pool::get_attribute(
                pool.0,
                attribute,
                &mut value as *mut u64 as *mut c_void,
            )
        }
        .map_err(|e| ValidateError::driver(format!("cuMemPoolGetAttribute({attribute:?})"), e))?;
        Ok(value)
    }

    /// (`RESERVED_MEM_CURRENT`, `USED_MEM_CURRENT`) of a pool.
    pub fn pool_usage(&self, pool: Pool) -> Result<(u64, u64), ValidateError> {
        use sys::CUmemPool_attribute::*;
        Ok((
            self.pool_attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            self.pool_attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
        ))
    }

    /// `cuMemAllocFromPoolAsync(size, pool, stream)`.
    pub fn pool_alloc(&self, pool: Pool, size: u64, stream: Stream) -> Result<u64, ValidateError> {
        // SAFETY: pool and stream of this session; the memory is never read.
        unsafe { result::mem_pool::alloc_async(pool.0, size as usize, stream.0) }
            .map_err(|e| ValidateError::driver(format!("cuMemAllocFromPoolAsync({size})"), e))
    }

    /// `cuMemFreeAsync(ptr, stream)`.
    pub fn free_async(&self, ptr: u64, stream: Stream) -> Result<(), ValidateError> {
        // SAFETY: `ptr` came from `pool_alloc`, freed once.
        unsafe { result::free_async(ptr, stream.0) }
            .map_err(|e| ValidateError::driver(format!("cuMemFreeAsync({ptr:#x})"), e))
    }

    /// `cuMemPoolTrimTo(pool, keep)`.
    pub fn trim_pool(&self, pool: Pool, keep: u64) -> Result<(), ValidateError> {
        // SAFETY: a pool of this session.
        unsafe { result::mem_pool::trim_to(pool.0, keep as usize) }
            .map_err(|e| ValidateError::driver("cuMemPoolTrimTo", e))
    }

    /// `cuMemPoolDestroy`.
    pub fn destroy_pool(&self, pool: Pool) -> Result<(), ValidateError> {
        // SAFETY: a pool of this session, destroyed once.
        unsafe { result::mem_pool::destroy(pool.0) }
            .map_err(|e| ValidateError::driver("cuMemPoolDestroy", e))
    }

    fn location(&self) -> sys::CUmemLocation {
        sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: self.device,
        }
    }

    fn allocation_prop(&self) -> sys::CUmemAllocationProp {
        sys::CUmemAllocationProp {
            type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: sys::CUmemAllocationHandleType(0),
            location: self.location(),
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
                compressionType: 0,
                gpuDirectRDMACapable: 0,
                usage: 0,
                reserved: [0; 4],
            },
        }
    }

    /// `cuMemGetAllocationGranularity` for device memory: (minimum, recommended).
    pub fn vmm_granularity(&self) -> Result<(u64, u64), ValidateError> {
        let prop = self.allocation_prop();
        let mut out = [0u64; 2];
        for (slot, flag) in out.iter_mut().zip([
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        ]) {
            let mut granularity: usize = 0;
            // SAFETY: valid prop, writes one size_t.
            unsafe { sys::cuMemGetAllocationGranularity(&mut granularity, &prop, flag) }
                .result()
                .map_err(|e| ValidateError::driver("cuMemGetAllocationGranularity", e))?;
            *slot = granularity as u64;
        }
        Ok((out[0], out[1]))
    }

    /// `cuMemAddressReserve(size)` at the default alignment (the allocation granularity).
    pub fn reserve_va(&self, size: u64) -> Result<u64, ValidateError> {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: writes one pointer.
        unsafe { sys::cuMemAddressReserve(&mut ptr, size as usize, 0, 0, 0) }
            .result()
            .map_err(|e| ValidateError::driver(format!("cuMemAddressReserve({size})"), e))?;
        Ok(ptr)
    }

    /// `cuMemAddressFree(ptr, size)`.
    pub fn free_va(&self, ptr: u64, size: u64) -> Result<(), ValidateError> {
        // SAFETY: a range from `reserve_va`, nothing mapped in it any more.
        unsafe { sys::cuMemAddressFree(ptr, size as usize) }
            .result()
            .map_err(|e| ValidateError::driver(format!("cuMemAddressFree({ptr:#x})"), e))
    }

    /// `cuMemCreate(size)` + `cuMemMap(va)` + `cuMemSetAccess(va, read-write)`: one physical page mapped
    /// at `va`, as PyTorch's expandable segments map pages. Returns the allocation handle.
    pub fn map_page(&self, va: u64, size: u64) -> Result<u64, ValidateError> {
        let prop = self.allocation_prop();
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid prop; `va` is a reserved, unmapped range of `size` bytes.
        unsafe {
            sys::cuMemCreate(&mut handle, size as usize, &prop, 0)
                .result()
                .map_err(|e| ValidateError::driver(format!("cuMemCreate({size})"), e))?;
            if let Err(e) = sys::cuMemMap(va, size as usize, 0, handle, 0).result() {
                let _ = sys::cuMemRelease(handle);
                return Err(ValidateError::driver(
                    format!("cuMemMap({va:#x}, {size})"),
                    e,
                ));
            }
            let access = sys::CUmemAccessDesc {
                location: self.location(),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            sys::cuMemSetAccess(va, size as usize, &access, 1)
                .result()
                .map_err(|e| ValidateError::driver(format!("cuMemSetAccess({va:#x})"), e))?;
        }
        Ok(handle)
    }

    /// `cuMemUnmap(va, size)` + `cuMemRelease(handle)`.
    pub fn unmap_page(&self, va: u64, size: u64, handle: u64) -> Result<(), ValidateError> {
        // SAFETY: a page mapped by `map_page`, unmapped once.
        unsafe {
            sys::cuMemUnmap(va, size as usize)
                .result()
                .map_err(|e| ValidateError::driver(format!("cuMemUnmap({va:#x})"), e))?;
            sys::cuMemRelease(handle)
                .result()
                .map_err(|e| ValidateError::driver("cuMemRelease", e))
        }
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // SAFETY: the context retained in `open`.
        let _ = guard(|| {
            unsafe { result::primary_ctx::release(self.device) }
                .map_err(|e| ValidateError::driver("cuDevicePrimaryCtxRelease", e))
        });
    }
}

fn describe(error: cudarc::driver::DriverError) -> String {
    match error.error_name() {
        Ok(name) => name.to_string_lossy().into_owned(),
        Err(_) => format!("{:?}", error.0),
    }
}
