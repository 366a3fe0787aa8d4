//! Owning types over the driver table's handles: [`GpuCtx`] (a retained primary context and
//! the table it came from), [`GpuStream`], [`GpuEvent`] and [`GpuModule`], each released by
//! its `Drop` in its own context (cudarc's `safe` layer, over [`Driver`] instead of libcuda).
//!
//! Owns: retain/release, create/destroy, load/unload; binding the context before each call.
//! Must not: panic in `Drop` (errors are logged; the object is still destroyed when binding
//! the context failed, as cudarc's `Drop`s do), or add work to the launch path beyond the one
//! table call each operation is.

use std::sync::Arc;

use crate::driver::{Caps, Ctx, Driver, Event, Function, Module, Stream};
use crate::{KernelError, Result};

/// Turns a driver error into a backend error that says what was being done.
pub(crate) fn driver_err(
    what: impl Into<String>,
) -> impl FnOnce(crate::driver::DriverError) -> KernelError {
    let what = what.into();
    move |e| KernelError::Backend(format!("{what}: {e}"))
}

/// Device `ordinal`'s primary context, retained for as long as this lives, and the driver
/// table everything in it goes through. Shared (`Arc`) by everything made in it, so that the
/// context goes last.
pub struct GpuCtx {
    driver: Arc<dyn Driver>,
    caps: Caps,
    ordinal: usize,
    ctx: Ctx,
}

impl GpuCtx {
    /// Retains device `ordinal`'s primary context and makes it current on this thread.
    pub fn retain(driver: Arc<dyn Driver>, ordinal: usize) -> Result<Arc<GpuCtx>> {
        let caps = driver.caps();
        let ctx = driver
            .primary_ctx_retain(ordinal)
            .map_err(|e| KernelError::Unavailable {
                backend: caps.backend,
                why: format!("cannot open device {ordinal}: {e}"),
            })?;
        let c = Arc::new(GpuCtx {
            driver,
            caps,
            ordinal,
            ctx,
        });
        c.bind()?;
        Ok(c)
    }

    /// Makes the context current on the calling thread (one table call; a no-op for the
    /// runtime when it already is).
    #[inline]
    pub fn bind(&self) -> Result<()> {
        // SAFETY: retained in `retain`, released only in `Drop`.
        unsafe { self.driver.set_current(self.ctx) }.map_err(driver_err("binding the context"))
    }

    #[inline]
    pub fn driver(&self) -> &dyn Driver {
        &*self.driver
    }

    pub fn driver_arc(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    pub fn caps(&self) -> Caps {
        self.caps
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Logs a failed bind in a `Drop`, which goes on releasing all the same.
    fn bind_for_drop(&self, what: &str) {
        if let Err(e) = self.bind() {
            tracing::warn!("{what}: cannot bind the context: {e}");
        }
    }
}

impl Drop for GpuCtx {
    fn drop(&mut self) {
        self.bind_for_drop("releasing a context");
        // SAFETY: retained once in `retain`, released once here; everything made in it holds
        // an Arc of this, so it is gone by now.
        if let Err(e) = unsafe { self.driver.primary_ctx_release(self.ordinal) } {
            tracing::warn!("releasing device {}'s context: {e}", self.ordinal);
        }
    }
}

/// A non-blocking stream of a context.
pub struct GpuStream {
    raw: Stream,
    ctx: Arc<GpuCtx>,
}

impl GpuStream {
    pub fn new(ctx: &Arc<GpuCtx>) -> Result<GpuStream> {
        ctx.bind()?;
        // SAFETY: context current.
        let raw =
            unsafe { ctx.driver().stream_create() }.map_err(driver_err("creating a stream"))?;
        Ok(GpuStream {
            raw,
            ctx: ctx.clone(),
        })
    }

    /// The raw handle, for queueing on it (valid while this lives).
    #[inline]
    pub fn raw(&self) -> Stream {
        self.raw
    }

    /// Waits for everything queued so far.
    pub fn sync(&self) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: our live stream.
        unsafe { self.ctx.driver().stream_sync(self.raw) }
            .map_err(driver_err("synchronising the stream"))
    }

    /// A new event, recorded on this stream now.
    pub fn record(&self, timing: bool) -> Result<GpuEvent> {
        let ev = GpuEvent::new(&self.ctx, timing)?;
        // SAFETY: both live, of one context (bound in GpuEvent::new).
        unsafe { self.ctx.driver().event_record(ev.raw, self.raw) }
            .map_err(driver_err("recording an event"))?;
        Ok(ev)
    }
}

impl Drop for GpuStream {
    fn drop(&mut self) {
        self.ctx.bind_for_drop("destroying a stream");
        // SAFETY: created in `new`, destroyed once.
        if let Err(e) = unsafe { self.ctx.driver().stream_destroy(self.raw) } {
            tracing::warn!("destroying a stream: {e}");
        }
    }
}

/// An event of a context.
pub struct GpuEvent {
    raw: Event,
    ctx: Arc<GpuCtx>,
}

impl GpuEvent {
    fn new(ctx: &Arc<GpuCtx>, timing: bool) -> Result<GpuEvent> {
        ctx.bind()?;
        // SAFETY: context current.
        let raw = unsafe { ctx.driver().event_create(timing) }
            .map_err(driver_err("creating an event"))?;
        Ok(GpuEvent {
            raw,
            ctx: ctx.clone(),
        })
    }

    /// Waits until the work recorded before this event completed.
    pub fn sync(&self) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: our live event.
        unsafe { self.ctx.driver().event_sync(self.raw) }
            .map_err(driver_err("synchronising an event"))
    }

    /// Milliseconds from this event to `end` (both timing events), after waiting for both
    /// (as cudarc's `elapsed_ms`).
    pub fn elapsed_ms(&self, end: &GpuEvent) -> Result<f32> {
        self.sync()?;
        end.sync()?;
        // SAFETY: both live timing events, recorded and complete.
        unsafe { self.ctx.driver().event_elapsed_ms(self.raw, end.raw) }
            .map_err(driver_err("reading an event pair's time"))
    }
}

impl Drop for GpuEvent {
    fn drop(&mut self) {
        self.ctx.bind_for_drop("destroying an event");
        // SAFETY: created in `new`, destroyed once.
        if let Err(e) = unsafe { self.ctx.driver().event_destroy(self.raw) } {
            tracing::warn!("destroying an event: {e}");
        }
    }
}

/// A loaded code module of a context.
pub struct GpuModule {
    raw: Module,
    ctx: Arc<GpuCtx>,
}

impl GpuModule {
    /// Loads `image` (a cubin or hsaco for this device).
    pub fn load(ctx: &Arc<GpuCtx>, image: &[u8]) -> Result<GpuModule> {
        ctx.bind()?;
        // SAFETY: context current; the image is a code object built for this device's
        // architecture (a wrong one is refused by the runtime with an error).
        let raw =
            unsafe { ctx.driver().module_load(image) }.map_err(driver_err("loading a module"))?;
        Ok(GpuModule {
            raw,
            ctx: ctx.clone(),
        })
    }

    /// Kernel `name` of this module; valid while the module lives.
    pub fn function(&self, name: &str) -> Result<Function> {
        // SAFETY: our live module.
        unsafe { self.ctx.driver().module_function(self.raw, name) }
            .map_err(driver_err(format!("kernel {name}")))
    }
}

impl Drop for GpuModule {
    fn drop(&mut self) {
        self.ctx.bind_for_drop("unloading a module");
        // SAFETY: loaded in `load`, unloaded once; its device synchronised its stream first.
        if let Err(e) = unsafe { self.ctx.driver().module_unload(self.raw) } {
            tracing::warn!("unloading a module: {e}");
        }
    }
}
