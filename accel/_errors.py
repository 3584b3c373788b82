"""Exception types shared by every layer."""


class InvalidDeviceError(ValueError, RuntimeError):
    """A device the operation cannot use: a device string or index that names no device
    (``"cuda0"``, ``"cuda:x"``, an index past the device count), or a device that does not
    fit the operation (an event recorded on a stream of another device, ``elapsed_time``
    between events of two devices).

    torch raises ``RuntimeError`` for all of these (``torch.device("cuda0")``: "Invalid
    device string: 'cuda0'"; an out-of-range device index; "Event device 0 does not match
    recording stream's device 1"), accel raised ``ValueError``; this class is both, so
    ``except RuntimeError`` written for torch and ``except ValueError`` written for accel
    keep working.
    """


class AllocatorConfigError(ValueError, RuntimeError):
    """A bad ``ACCEL_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF`` setting.

    torch raises RuntimeError or ValueError for these (c10 TORCH_CHECK / TORCH_CHECK_VALUE);
    this class is both, so code written for either catches it.
    """


class AcceleratorError(RuntimeError):
    """A vendor runtime call failed, or no device can serve the request.

    When the failure comes from a vendor call, ``library``, ``call``,
    ``code`` and ``code_name`` say which library, which function, and the
    vendor's numeric error and its name (e.g. ``cudaErrorInsufficientDriver``,
    35).  They are None for errors raised by accel itself.
    """

    def __init__(self, message, *, library=None, call=None, code=None, code_name=None):
        super().__init__(message)
        self.library = library
        self.call = call
        self.code = code
        self.code_name = code_name

    @classmethod
    def from_call(cls, library, call, code, code_name, description=""):
        """Build the error for a failed vendor call with a uniform message."""
        msg = f"{library}: {call} failed with {code_name} ({code})"
        if description:
            msg += f": {description}"
        return cls(msg, library=library, call=call, code=code, code_name=code_name)


class OutOfMemoryError(AcceleratorError):
    """The device (or pinned host) memory request could not be satisfied.

    Raised by backends when the vendor allocator reports out-of-memory; the
    caching allocator catches it, frees its cache, retries, and re-raises it
    with a message that gives the allocator state (as torch's).
    """

    #: set by the device allocators: ``(device, bytes tried, allowed or total bytes, free bytes)``,
    #: the arguments of the out-of-memory observers (accel.memory.attach_out_of_memory_observer)
    observer_args = None


class DeferredCallError(AcceleratorError):
    """A call queued with ``_lazy_call`` before initialization failed at init.

    The message includes the stack of the place where the call was queued,
    as torch's ``DeferredCudaCallError``.
    """


class CaptureError(AcceleratorError):
    """An operation that is illegal while a stream is being captured."""


class KernelImageError(AcceleratorError):
    """The device cannot run a kernel: no image for its architecture, or PTX the
    driver cannot JIT-compile (too new for the driver, invalid, JIT disabled).

    Raised by ``accel.Module(...)``: when the runtime loads lazily (CUDA_MODULE_LOADING=LAZY,
    the default since CUDA 12.2) the load accepts any bytes and the error comes from the first
    kernel lookup (cudaLibraryGetKernel, measured on an H100), which Module makes right after
    loading.  Callers with a host path (accel.random) fall back to it.
    """


class CompileError(AcceleratorError):
    """Source code did not compile into a kernel image: ``accel.compile`` (NVRTC: CUDA C to
    PTX) or a backend that builds source at module creation (Metal's MSL, Level Zero's
    SPIR-V).  ``log`` holds the compiler's log, which the message includes; ``library``,
    ``call``, ``code`` and ``code_name`` say which call failed (e.g. ``nvrtc``,
    ``nvrtcCompileProgram``, 6, ``NVRTC_ERROR_COMPILATION``).

    A subclass of :class:`AcceleratorError` (so of ``RuntimeError``), as CuPy's
    ``CompileException`` and cuda.core's NVRTC errors are runtime errors; a missing NVRTC is
    not a compile error and raises ``RuntimeError`` naming what to install.
    """

    def __init__(self, message, *, log="", library=None, call=None, code=None, code_name=None):
        super().__init__(message, library=library, call=call, code=code, code_name=code_name)
        self.log = log
